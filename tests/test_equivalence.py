"""hetero generate == HF generate (sdpa/eager + DynamicCache) on real model classes."""
import pytest
import torch

from hetero import HeteroGenerator
from tests.conftest import FAMILIES, build_model, padded_batch

NEW = 12


def hf_generate(model, ref_impl, ids, mask, **kw):
    model.set_attn_implementation(ref_impl)
    return model.generate(ids, attention_mask=mask, max_new_tokens=NEW, return_dict_in_generate=True,
                          output_scores=True, pad_token_id=0, **kw)


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_greedy_and_sampling_match_hf(model_type):
    model, ref_impl = build_model(model_type)
    ids, mask = padded_batch()
    ref = hf_generate(model, ref_impl, ids, mask, do_sample=False)
    torch.manual_seed(7)
    ref_s = hf_generate(model, ref_impl, ids, mask, do_sample=True, temperature=0.8, top_k=40, top_p=0.9)
    with HeteroGenerator(model, cpu_workers=2) as gen:
        out = gen.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False,
                           return_dict_in_generate=True, output_scores=True, pad_token_id=0)
        torch.manual_seed(7)
        out_s = gen.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=True, temperature=0.8,
                             top_k=40, top_p=0.9, return_dict_in_generate=True, output_scores=True, pad_token_id=0)
    assert model.config._attn_implementation == ref_impl, "generate must restore the model's attention"
    assert torch.equal(out.sequences, ref.sequences)
    assert len(out.scores) == len(ref.scores) == NEW
    for a, b in zip(out.scores, ref.scores):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    assert torch.equal(out_s.sequences, ref_s.sequences)
    # the run is long enough that sliding windows (6) are exceeded during decode
    assert ids.shape[1] + NEW > 2 * 6


def test_tensor_return_and_default_mask(llama, llama_gen):
    ids, _ = padded_batch(lengths=(9,))
    llama.set_attn_implementation("sdpa")
    ref = llama.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=0)
    out = llama_gen.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert isinstance(out, torch.Tensor) and torch.equal(out, ref)


def test_eos_stops_like_hf(llama, llama_gen):
    ids, mask = padded_batch()
    llama.set_attn_implementation("sdpa")
    first = llama.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0)
    eos = int(first[0, -1])  # request 0 emits this at step 3: make it the EOS
    ref = llama.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0, eos_token_id=eos)
    out = llama_gen.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0,
                             eos_token_id=eos)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_model(dtype):
    model, ref_impl = build_model("llama", dtype=dtype)
    ids, mask = padded_batch()
    model.set_attn_implementation(ref_impl)
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0,
                         return_dict_in_generate=True, output_scores=True)
    with HeteroGenerator(model, cpu_workers=2) as gen:
        assert gen._pool is not None
        out = gen.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0,
                           return_dict_in_generate=True, output_scores=True)
    assert torch.equal(out.sequences, ref.sequences)
    for a, b in zip(out.scores, ref.scores):
        torch.testing.assert_close(a.float(), b.float(), atol=0.1, rtol=0.02)


def test_kv_stored_in_model_dtype(llama):
    """The arena keeps the model's dtype: bf16 storage is 2 bytes per element, never up-cast."""
    from hetero.offload.arena import SessionLayout
    from hetero.offload.session import STORAGE_CODES

    lay32 = SessionLayout(1, 4, 2, 16, 128, 2, STORAGE_CODES[torch.float32])
    lay16 = SessionLayout(1, 4, 2, 16, 128, 2, STORAGE_CODES[torch.bfloat16])
    assert lay32.kv_bytes == 2 * lay16.kv_bytes == 2 * 2 * 2 * 128 * 16 * 4
