"""The same equivalence on a CUDA model (skips without CUDA: CI has no GPU)."""
import pytest
import torch

from hetero import HeteroGenerator
from tests.conftest import build_model, padded_batch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("model_type,dtype", [("llama", torch.float32), ("gemma2", torch.float32), ("qwen2", torch.bfloat16)])
def test_cuda_model_matches_hf(model_type, dtype):
    model, ref_impl = build_model(model_type, dtype=dtype)
    model = model.cuda()
    ids, mask = (t.cuda() for t in padded_batch())
    kw = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0,
              return_dict_in_generate=True, output_scores=True)
    ref = model.generate(ids, **kw)
    with HeteroGenerator(model, cpu_workers=2) as gen:
        out = gen.generate(ids, **kw)
    assert out.sequences.device == ids.device
    assert torch.equal(out.sequences, ref.sequences)
    tol = 1e-4 if dtype == torch.float32 else 0.1
    for a, b in zip(out.scores, ref.scores):
        torch.testing.assert_close(a.float(), b.float(), atol=tol, rtol=tol)


def test_cuda_lora_cold_and_warm_match_peft(tmp_path):
    """LoRA with the model on the GPU: a cold adapter (device copy held back: prefill deltas on the
    CPU workers, copied to the GPU) and a warm one (its device copy) both equal peft's generate."""
    from tests.test_lora import NAMES, assert_same, generate, make_adapters

    base, pm, _ = make_adapters("llama", tmp_path)
    base, pm = base.cuda(), pm.cuda()
    ids, mask = (t.cuda() for t in padded_batch())
    ref = generate(pm, ids, mask, adapter_names=NAMES)
    with HeteroGenerator(base, cpu_workers=2) as gen:
        gen.load_adapter("legal", tmp_path / "legal")
        gen._store.copy_gate.clear()
        gen.load_adapter("code", tmp_path / "code")
        cold = generate(gen, ids, mask, adapter_names=NAMES)
        assert not gen.adapter_on_device("code")
        gen._store.copy_gate.set()
        assert gen._store.adapters["code"].ready.wait(30)
        assert all(A.is_cuda for A, _ in gen._store.adapters["code"].device.values())
        warm = generate(gen, ids, mask, adapter_names=NAMES)
    assert_same(cold, ref)
    assert_same(warm, ref)
