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
