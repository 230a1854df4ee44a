"""Chunked prefill on the CPU (HeteroConfig.prefill_chunk): the first forward covers the left pads
and one chunk with the model's own attention; every later chunk attends to the cached KV on the
CPU workers (q_len = chunk). Against one-pass prefill and HF: the same greedy tokens and scores,
the same KV in the arena (fp32, to round-off), sliding windows with chunk boundaries inside them."""
import pytest
import torch

from hetero import HeteroConfig, HeteroGenerator
from hetero.offload.session import KVSession
from tests.conftest import build_model, padded_batch

KW = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, return_dict_in_generate=True, output_scores=True)


def run(model, ids, mask, chunk, monkeypatch):
    """(generate output, the arena's KV at close: {(layer, request): (k, v)}, query lengths seen)."""
    kvs, qlens = [], []
    close, attend = KVSession.close, KVSession.attend

    def spy_attend(self, layer, query, *a, **k):
        qlens.append(query.shape[2])
        return attend(self, layer, query, *a, **k)

    def keep_kv(self):                  # the generate's session (a planner profile opens others first)
        if self.opened and self.prefilled:
            kv = {}
            kvs.append(kv)
            for layer in range(self.spec.layers):
                for b in range(self.batch):
                    n = int(self.lengths[b])
                    kept = self.ring_window[layer]
                    kv[layer, b] = self.read_rows(layer, b, n, max(0, n - kept) if kept else 0)
        return close(self)

    monkeypatch.setattr(KVSession, "attend", spy_attend)
    monkeypatch.setattr(KVSession, "close", keep_kv)
    with HeteroGenerator(model, config=HeteroConfig(cpu_workers=2, prefill_chunk=chunk)) as gen:
        out = gen.generate(ids, attention_mask=mask, **KW)
    monkeypatch.undo()
    return out, kvs[-1], qlens


@pytest.mark.parametrize("model_type,chunk", [("llama", 8), ("mistral", 4), ("gemma2", 5)])
def test_chunked_prefill_matches_one_pass_and_hf(monkeypatch, model_type, chunk):
    """mistral/gemma2: sliding windows of 6 with chunks of 4/5, so chunk boundaries fall inside
    the window and later chunks read ring blocks the earlier ones wrote."""
    model, _ = build_model(model_type)
    ids, mask = padded_batch(lengths=(41, 30, 17))
    ref = model.generate(ids, attention_mask=mask, **KW)
    one, kv_one, q_one = run(model, ids, mask, None, monkeypatch)
    chunked, kv_chunked, q_chunked = run(model, ids, mask, chunk, monkeypatch)
    assert set(q_one) == {1}                                    # one pass: only decode steps
    assert chunk in q_chunked                                   # later chunks went to the workers
    layers = model.config.num_hidden_layers
    assert sum(1 for t in q_chunked if t > 1) % layers == 0
    for out in (one, chunked):
        assert torch.equal(out.sequences, ref.sequences)
        for a, b in zip(out.scores, ref.scores):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    assert kv_one.keys() == kv_chunked.keys()
    for key, (k, v) in kv_one.items():
        k2, v2 = kv_chunked[key]
        assert k.shape == k2.shape
        torch.testing.assert_close(k2, k, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(v2, v, atol=1e-5, rtol=1e-5)


def test_short_prompt_or_no_chunk_is_one_pass(monkeypatch):
    model, _ = build_model("llama")
    ids, mask = padded_batch(lengths=(9, 5))
    out, _, qlens = run(model, ids, mask, 64, monkeypatch)        # the prompt fits one chunk
    assert set(qlens) == {1}
    with pytest.raises(ValueError, match="prefill_chunk"):
        HeteroConfig(prefill_chunk=0)
