"""PrefixRows (a cached or pinned document's rows kept on the model's device) under random
sequences of questions, aborts, pins, unpins and prefix-cache resets, on real tiny models and
real worker processes, with budgets from nothing to a few entries and rooms smaller than the
questions: after every step the bytes accounted equal the entries' and stay within the budget,
and every entry still matching the pool holds the pool's rows bit for bit; every request's
tokens and scores equal those of the same sequence without the cache (prefix_rows_memory=0) bit
for bit, and HF generate's for that request alone (fp32, scores within 1e-4)."""
import random

import numpy as np
import pytest
import torch

from tests.conftest import build_model
from tests.test_engine import hf, make, prompts

NEW = 6


def check_rows(eng):
    rows, pool = eng.runner.prefix_rows, eng.runner.blocks
    assert rows.used == sum(e.size for e in rows.entries.values()) * rows.row_bytes <= rows.budget
    full = sum(not r for r in eng.kv.ringed)
    for e in rows.entries.values():
        if not np.array_equal(pool.born[e.blocks], e.born):
            continue                                # stale: dropped at its next use
        assert len(e.layers) in (0, full)           # a step fills every layer or none
        table = torch.tensor(e.blocks, dtype=torch.int64)
        for layer, (K, V) in e.layers.items():
            k, v = eng.kv.read_rows(layer, table, e.n)
            assert torch.equal(K[:, :e.n], k) and torch.equal(V[:, :e.n], v)


def scenario(model, seed, memory, slack, cfg, ops=40, check=True):
    """{request id: (tokens, scores)} of the requests that finished, and their prompts."""
    rng = random.Random(seed)
    docs = prompts([64, 96, 70, 33], seed=seed + 100)
    out, asked = {}, {}
    with make(model, prefix_rows_memory=memory, **cfg) as eng:
        eng.runner.prefix_rows.slack = slack
        streams, pins = {}, {}
        for op in range(ops):
            x = rng.random()
            live = [rid for rid, s in streams.items() if not s.finished]
            if x < 0.5:
                d = rng.randrange(len(docs))
                n = rng.choice([1, 2, rng.randrange(1, 40), 32 - len(docs[d]) % 32 or 32])
                p = docs[d] + prompts([n], seed=seed * 1000 + op)[0]
                streams[f"r{op}"] = eng.add_request(p, NEW, output_scores=True, request_id=f"r{op}")
                asked[f"r{op}"] = p
            elif x < 0.58 and live:
                eng.abort(rng.choice(live))
            elif x < 0.68:
                d = rng.randrange(len(docs))
                if d not in pins:
                    pins[d] = eng.pin(docs[d], request_id=f"pin{op}")
            elif x < 0.75 and pins:
                eng.unpin(pins.pop(rng.choice(sorted(pins))))
            elif x < 0.8:
                eng.reset_prefix_cache()
            for _ in range(rng.choice([0, 1, 1, 2])):
                eng.step()
                if check:
                    check_rows(eng)
        while any(not s.finished for s in [*streams.values(), *pins.values()]):
            eng.step()
            if check:
                check_rows(eng)
        for p in pins.values():
            eng.unpin(p)
        eng.step()
        eng.kv_manager.check_invariants()
        assert not eng.kv_manager.holders
        stats = eng.runner.prefix_rows
        for rid, s in streams.items():
            if s.finish_reason != "abort":
                out[rid] = (s.token_ids, torch.stack(s.scores))
    return out, asked, (stats.hits, stats.misses, stats.stale)


@pytest.mark.parametrize("model_type, config, seed, memory, slack", [
    ("llama", {}, 1, 40_000, 8),                    # ~1 entry: evicted and made again
    ("llama", {}, 3, 200_000, 40),
    ("llama", {}, 4, None, 256),                    # the default budget and room
    ("gemma2", {"sliding_window": 40}, 2, 80_000, 4),   # windowed layers read back from a pool of their own
])
def test_random_sequences_keep_the_pool_s_rows_and_exact_tokens(model_type, config, seed, memory, slack):
    model = build_model(model_type, **config)[0]
    cfg = dict(kv_blocks=24, long_prefill_chunk=32, max_num_batched_tokens=64)
    kept, asked, (hits, misses, _) = scenario(model, seed, memory, slack, cfg)
    plain, _, _ = scenario(model, seed, 0, slack, cfg, check=False)
    assert hits > 0 and misses > 0                      # the sequence used the cache
    assert kept.keys() == plain.keys() and len(kept) > 5
    for rid, (tokens, scores) in kept.items():
        assert tokens == plain[rid][0] and torch.equal(scores, plain[rid][1]), rid
        want, want_scores = hf(model, asked[rid], NEW)
        assert tokens == want, rid
        assert (scores - want_scores).abs().max() < 1e-4
