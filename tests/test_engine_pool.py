"""The paged KV pool's bookkeeping (hetero.engine.kv_pool): sharing, caching, eviction, pins, and a
randomized property test of the pool under the scheduler. Pure Python: no model, no torch."""
import random
import subprocess
import sys

import numpy as np
import pytest

from hetero.engine import (
    BLOCK_SIZE,
    BlockPool,
    KVCacheManager,
    Request,
    RequestStatus,
    Scheduler,
    SchedulerConfig,
    block_hash,
)
from hetero.engine.kv_hybrid import HybridKVCacheManager
from hetero.errors import CapacityError

BS = BLOCK_SIZE


def make(n_blocks, bs=BS):
    return KVCacheManager(BlockPool(n_blocks, bs))


def admit(kv, rid, tokens, adapter=None, compute=True):
    """Take the request's cached prefix, allocate the rest and (compute=True) mark it all computed and
    cached but the last token, as a prefill step would."""
    r = Request(rid, tokens, 4, adapter=adapter)
    blocks, n = kv.get_computed_blocks(r)
    assert kv.allocate_slots(r, r.num_tokens - n, blocks)
    if compute:
        r.num_computed_tokens = r.num_tokens
        kv.cache_full_blocks(r)
    kv.check_invariants()
    return r


def test_engine_modules_import_neither_torch_nor_transformers():
    code = ("import sys, hetero.engine; bad = [m for m in sys.modules if m.split('.')[0] in "
            "('torch', 'transformers', 'numba')]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_block_size_is_the_kernels():
    from hetero.cpu_attention.simd import BK

    assert BLOCK_SIZE == BK


def test_block_hash_chains_tokens_and_adapter():
    t = list(range(BS))
    h = block_hash(None, t)
    assert h == block_hash(None, list(t)) and len(h) == 16
    assert len({h, block_hash(h, t), block_hash(None, t, ""), block_hash(None, t, "a"),
                block_hash(None, t[::-1])}) == 5


def test_two_requests_over_one_document_share_its_whole_blocks():
    kv = make(16)
    doc = list(range(100, 200))                         # 3 whole blocks + 4 tokens
    a = admit(kv, "a", doc + [7, 8])
    b = admit(kv, "b", doc + [9])
    assert b.num_cached_tokens == 3 * BS
    assert b.block_table[:3] == a.block_table[:3] and b.block_table[3] != a.block_table[3]
    assert kv.pool.refcount[a.block_table[:3]].tolist() == [2, 2, 2]
    assert kv.pool.refcount[[a.block_table[3], b.block_table[3]]].tolist() == [1, 1]
    assert kv.blocks_shared([a, b]) == {blk: ["a", "b"] for blk in a.block_table[:3]}
    assert kv.blocks_shared([a]) == {} and kv.num_used_blocks == 5
    assert (kv.prefix_queries, kv.prefix_hits) == (a.num_tokens + b.num_tokens, 3 * BS)


def test_the_partial_last_block_is_never_shared():
    kv = make(8)
    a = admit(kv, "a", list(range(40)))                 # 1 whole block + 8 rows
    b = admit(kv, "b", list(range(40)))
    assert b.num_cached_tokens == BS and b.block_table[1] != a.block_table[1]
    assert kv.pool.hashes[a.block_table[1]] is None
    # a prompt of exactly two blocks shares only the first: its last token must be computed
    c = admit(kv, "c", list(range(64)))
    d = admit(kv, "d", list(range(64)))
    assert d.num_cached_tokens == BS and d.num_new_tokens_to_compute == 0
    assert kv.get_computed_blocks(Request("e", list(range(65)), 1))[1] == 2 * BS
    assert c.block_table[1] not in b.block_table


def test_different_adapters_never_share():
    kv = make(16)
    doc = list(range(70))
    admit(kv, "base", doc)
    x = admit(kv, "x", doc, adapter="x")
    y = admit(kv, "y", doc, adapter="y")
    assert x.num_cached_tokens == y.num_cached_tokens == 0
    assert admit(kv, "x2", doc, adapter="x").block_table[:2] == x.block_table[:2]
    assert admit(kv, "base2", doc).num_cached_tokens == 2 * BS
    # what a request starting with these tokens would find, without admitting one
    assert kv.num_cached_blocks(doc) == kv.num_cached_blocks(doc, "x") == 2
    assert kv.num_cached_blocks(doc, "z") == 0 and kv.num_cached_blocks(doc[:BS - 1]) == 0
    assert kv.num_cached_blocks([7] + doc[1:]) == 0 and kv.num_cached_blocks(doc + list(range(200))) == 2


def test_freed_blocks_stay_cached_and_are_evicted_lru_tail_first():
    kv = make(4)
    a = admit(kv, "a", list(range(64)) + [1])          # 3 blocks, the first 2 whole and cached
    a0, a1, _ = a.block_table
    kv.free(a)
    assert a.block_table == [] and kv.num_free_blocks == 2 and kv.num_evictable_blocks == 2
    assert list(kv.pool.evictable) == [a1, a0]          # the tail block is released first
    h1 = kv.pool.hashes[a1]
    b = admit(kv, "b", [5] * 65)                        # 3 blocks: the 2 free ones, then evicts a1
    assert a1 in b.block_table and h1 not in kv.pool.cached        # a1 holds one of b's (ids ascending)
    assert b.block_table == sorted(b.block_table)
    assert list(kv.pool.evictable) == [a0]
    c = Request("c", list(range(64)) + [2], 1)
    assert kv.get_computed_blocks(c) == ([a0], BS)     # a's first block is still found, not its second
    b0, b1, b2 = b.block_table
    kv.free(b)
    assert list(kv.pool.evictable) == [a0, b1, b0]
    # a hit takes the block out of the LRU; released again, it goes to the young end
    d = admit(kv, "d", list(range(40)))
    assert d.block_table[0] == a0 and list(kv.pool.evictable) == [b1, b0]
    kv.free(d)
    assert list(kv.pool.evictable) == [b1, b0, a0]
    e = admit(kv, "e", [6] * 97, compute=False)         # 4 blocks: the free b2, then b1, b0, a0 evicted
    assert e.block_table == sorted([b2, b1, b0, a0]) and not kv.pool.cached
    kv.check_invariants()


def test_cache_hit_after_a_request_finishes():
    kv = make(8)
    a = admit(kv, "a", list(range(96)) + [3])
    kv.free(a)
    assert kv.num_used_blocks == 0 and kv.num_evictable_blocks == 3
    b = admit(kv, "b", list(range(96)) + [4, 5])
    assert b.num_cached_tokens == 3 * BS and kv.num_evictable_blocks == 0
    assert kv.prefix_hits == 3 * BS and kv.usage == 4 / 8


def test_allocation_is_all_or_nothing():
    kv = make(3)
    a = admit(kv, "a", list(range(64)) + [1])          # 3 blocks
    kv.free(a)                                          # 2 evictable, 1 free
    b = Request("b", list(range(64)) + list(range(40)), 1)
    blocks, n = kv.get_computed_blocks(b)
    assert n == 2 * BS
    before = (kv.pool.refcount.copy(), list(kv.pool.free), list(kv.pool.evictable), dict(kv.pool.cached))
    # 4 blocks in all: 2 cached + 2 new, but taking the cached ones leaves only 1 to allocate
    assert not kv.allocate_slots(b, b.num_tokens - n, blocks)
    after = (kv.pool.refcount, list(kv.pool.free), list(kv.pool.evictable), kv.pool.cached)
    assert b.block_table == [] and b.num_computed_tokens == 0 and kv.prefix_queries == a.num_tokens
    assert np.array_equal(before[0], after[0]) and before[1:] == after[1:]
    c = Request("c", list(range(64)) + list(range(30)), 1)
    blocks, n = kv.get_computed_blocks(c)
    assert kv.allocate_slots(c, c.num_tokens - n, blocks) and len(c.block_table) == 3
    assert not kv.allocate_slots(c, 3 * BS - 64 + 1)    # row 96 wants a 4th block: none left
    assert len(c.block_table) == 3
    kv.check_invariants()


def test_pinned_blocks_are_never_evicted_and_are_shared():
    kv = make(4)
    ctx = admit(kv, "ctx", list(range(64)) + [9])
    pinned = kv.pin_prefix(ctx, 2)
    assert pinned == ctx.block_table[:2] and kv.pool.num_pinned_blocks == 2
    kv.free(ctx)
    assert kv.num_evictable_blocks == 0 and kv.num_used_blocks == 2
    other = admit(kv, "other", [3] * 64, compute=False)  # the 2 unpinned blocks
    assert not set(other.block_table) & set(pinned)
    assert not kv.allocate_slots(other, 65)              # a 3rd block: pinned blocks are not evictable
    kv.free(other)
    user = admit(kv, "user", list(range(64)) + [5, 6])
    assert user.block_table[:2] == pinned and kv.pool.refcount[pinned].tolist() == [2, 2]
    assert kv.num_free_blocks == 1
    with pytest.raises(ValueError, match="free"):
        kv.pin([kv.pool.free[0]])
    kv.unpin(pinned)
    assert kv.pool.refcount[pinned].tolist() == [1, 1]
    with pytest.raises(ValueError, match="not pinned"):
        kv.unpin(pinned)
    kv.free(user)
    assert kv.num_evictable_blocks == 2 and kv.num_used_blocks == 0
    kv.check_invariants()


def test_invariant_check_catches_a_lost_reference():
    kv = make(4)
    a = admit(kv, "a", list(range(40)))
    kv.pool.refcount[a.block_table[0]] += 1
    with pytest.raises(AssertionError, match="refcount"):
        kv.check_invariants()


# ---- property test: random operations on a small pool, invariants after each -----------------

EOS = 2


def _check_all(s, kv, content):
    kv.check_invariants()
    live = s.waiting + s.running
    assert len(live) == len(s.requests) and {r.request_id for r in live} == set(s.requests)
    assert len(s.running) <= s.config.max_num_seqs
    for r in s.waiting:
        assert r.block_table == [] and r.num_computed_tokens == 0 and not r.is_finished
    for r in s.running:
        assert r.status is RequestStatus.RUNNING and r.request_id in kv.holders
        _check_rows(kv, r, r.num_computed_tokens, content)


def _tables(kv, r):
    """(pool name, block table, its first kept block, the window it keeps) of each pool r holds
    blocks in: one, or a hybrid manager's two (full layers', windowed layers')."""
    if isinstance(kv, HybridKVCacheManager):
        return [("full", r.block_table, r.ring_start, 0), ("window", r.window_table, r.window_start, kv.window)]
    return [("full", r.block_table, r.ring_start, kv.window)]


def _check_rows(kv, r, upto, content):
    """The KV rows [0, upto) the request's table points at hold its own prefix (under its adapter);
    under a ring, the rows from its first kept block, which the window of row `upto` needs."""
    toks, bs = r.all_token_ids, kv.block_size
    for name, table, start, window in _tables(kv, r):
        first = start * bs
        assert first <= max(upto - window + 1, 0) or not window, (name, r, upto)
        for j in range(first, upto):
            assert content.get((name, table[j // bs], j % bs)) == (r.adapter, tuple(toks[:j + 1])), (name, r, j)


def _step(s, kv, content, rng, force_eos=None):
    out = s.schedule()
    cfg = s.config
    assert out.num_tokens == sum(x.num_new_tokens for x in out.scheduled) <= cfg.max_num_batched_tokens
    for x in out.scheduled:
        r = x.request
        assert 0 < x.num_new_tokens <= (cfg.long_prefill_chunk or cfg.max_num_batched_tokens)
        _check_rows(kv, r, x.start, content)                # what it reads was written for its prefix
        toks = r.all_token_ids
        for name, table, _, _ in _tables(kv, r):
            pool = kv.windowed.pool if name == "window" else kv.pool
            for j in range(x.start, x.start + x.num_new_tokens):  # the "forward" writes its rows
                blk = table[j // kv.block_size]
                assert pool.refcount[blk] == 1, f"a write into a shared or pinned block ({name})"
                content[(name, blk, j % kv.block_size)] = (r.adapter, tuple(toks[:j + 1]))
    kv.check_invariants()
    sampled = {x.request.request_id: (EOS if x.request.request_id == force_eos or rng.random() < 0.04
                                      else rng.randrange(3, 9))
               for x in out.scheduled if x.samples}
    for r in s.update(out, sampled):
        assert r.is_finished and r.block_table == []
    return out


@pytest.mark.parametrize("window", [0, 6, "hybrid"])
@pytest.mark.parametrize("seed", range(6))
def test_pool_invariants_under_random_operations(seed, window):
    """Also under a ring (window: every layer's sliding window, rows), and with a hybrid manager (a
    full layers' pool beside a windowed layers' pool of its own, window 6: both checked)."""
    rng = random.Random(seed)
    bs = 4
    if window == "hybrid":
        kv = HybridKVCacheManager(BlockPool(rng.randint(14, 30), bs), BlockPool(rng.randint(10, 16), bs), 6)
        window = 0                              # the full pool's rules below: pins and sharing as without a ring
    else:
        kv = KVCacheManager(BlockPool(rng.randint(6, 10) if window else rng.randint(14, 30), bs), window=window)
    s = Scheduler(SchedulerConfig(max_num_seqs=rng.randint(2, 6), max_num_batched_tokens=rng.randint(6, 40),
                                  long_prefill_chunk=rng.choice([3, 5] if window else [None, 3, 5, 16])), kv)
    docs = [[rng.randrange(3, 9) for _ in range(rng.randint(4, 20))] for _ in range(3)]
    content, contexts, all_reqs, collected = {}, [], [], set()
    stats = {"preempted": 0, "hits": 0, "pinned": 0, "shared": 0, "ring": 0 if window else 1}
    for op in range(400):
        roll = rng.random()
        if roll < 0.2:
            prompt = rng.choice(docs) + [rng.randrange(3, 9) for _ in range(rng.randint(0, 12))]
            r = Request(f"r{op}", prompt, rng.randint(0, 12), eos_token_ids={EOS},
                        adapter=rng.choice([None, None, "a"]), pin_prompt=rng.random() < 0.1)
            try:
                s.add(r)
                all_reqs.append(r)
            except CapacityError:
                assert kv.shortfall(r, s.chunk) is not None
        elif roll < 0.75:
            out = _step(s, kv, content, rng)
            stats["preempted"] += len(out.preempted)
            stats["shared"] += len(kv.blocks_shared(s.running))
            stats["ring"] += sum(r.ring_start > 0 for r in s.running) if window else 0
        elif roll < 0.8 and s.requests:
            victim = rng.choice(list(s.requests))
            r = s.abort(victim)
            assert r.status is RequestStatus.FINISHED_ABORTED and r.block_table == []
        elif roll < 0.85 and s.running:
            _step(s, kv, content, rng, force_eos=rng.choice(s.running).request_id)
        elif roll < 0.9 and s.running:
            r = rng.choice(s.running)
            s.preempt(r.request_id)
            assert r.status is RequestStatus.PREEMPTED and s.waiting[0] is r and r.block_table == []
        elif roll < 0.95 and [r for r in s.running if not r.ring_start]:
            r = rng.choice([r for r in s.running if not r.ring_start])     # a ring's given-back blocks: no pin
            n = rng.randint(0, r.num_computed_tokens // bs)
            try:
                contexts.append(kv.pin_prefix(r, n))
                stats["pinned"] += n
            except ValueError:                  # a hybrid's window blocks at n given back and evicted
                first = max(n * bs - kv.window + 1, 0) // bs        # the window blocks the pin keeps
                assert isinstance(kv, HybridKVCacheManager) and first < r.window_start, (n, r)
                kv.check_invariants()
        elif contexts:
            kv.unpin(contexts.pop(rng.randrange(len(contexts))))
        for r in all_reqs:                                  # a Context's blocks, pinned by the scheduler
            if r.pinned_blocks is not None and r.request_id not in collected:
                collected.add(r.request_id)
                contexts.append(r.pinned_blocks)
                stats["pinned"] += len(r.pinned_blocks)
        _check_all(s, kv, content)
    stats["hits"] = kv.prefix_hits
    for rid in list(s.requests):
        s.abort(rid)
        kv.check_invariants()
    for blocks in contexts:
        kv.unpin(blocks)
        kv.check_invariants()
    for pool in [kv.pool] + ([kv.windowed.pool] if isinstance(kv, HybridKVCacheManager) else []):
        assert not pool.refcount.any() and not pool.pins.any()
    assert not kv.holders
    assert kv.num_free_blocks + kv.num_evictable_blocks == kv.num_blocks
    assert kv.num_used_blocks == 0
    if window:                                  # a ring gives shared document blocks back soon: may not share
        stats.pop("shared")
    assert min(stats.values()) > 0, stats       # every seed preempts, hits, pins and shares (and drops)


def test_pool_pressure_preempts_and_every_request_finishes():
    """The property test's pools under a heavier load with no aborts: preemptions happen, every
    request ends by eos or with max_new_tokens outputs, and the pool ends empty."""
    preempted = 0
    for seed in range(6):
        rng = random.Random(seed)
        kv = KVCacheManager(BlockPool(rng.randint(14, 30), 4))
        s = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=24, long_prefill_chunk=8), kv)
        reqs = [Request(f"r{i}", [rng.randrange(3, 9) for _ in range(rng.randint(4, 30))], 10, {EOS})
                for i in range(12)]
        for r in reqs:
            s.add(r)
        content = {}
        for _ in range(1000):
            if not s.has_unfinished:
                break
            preempted += len(_step(s, kv, content, rng).preempted)
            _check_all(s, kv, content)
        assert not s.has_unfinished
        for r in reqs:
            assert (r.status is RequestStatus.FINISHED_STOPPED and r.output_token_ids[-1] == EOS
                    and EOS not in r.output_token_ids[:-1]) or \
                   (r.status is RequestStatus.FINISHED_LENGTH and len(r.output_token_ids) == 10)
        assert kv.num_used_blocks == 0
    assert preempted > 0


def _serve(s, r):
    """Run request r alone through scheduler s to its end (every sampled token 7)."""
    s.add(r)
    while not r.is_finished:
        out = s.schedule()
        s.update(out, {x.request.request_id: 7 for x in out.scheduled if x.samples})


def test_a_ring_evicts_a_finished_document_from_its_tail():
    """The blocks a ring gave back early are the LRU's oldest; when the request ends they move
    behind its tail, so eviction takes the document's tail first and a later request finds its
    head (the chain starts there), as without a ring."""
    for window in (0, 6):
        kv = KVCacheManager(BlockPool(7, 4), window=window)
        s = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=4, long_prefill_chunk=4), kv)
        doc = [3, 4, 5, 6] * 6                                  # 6 whole blocks
        _serve(s, Request("a", doc + [8], 1))
        _serve(s, Request("c", [9] * 11, 1))                    # 3 blocks: evicts 2 of the document's
        b = Request("b", doc + [8, 8], 1)
        _serve(s, b)
        assert b.num_cached_tokens == 16, window               # its first 4 blocks
        kv.check_invariants()


def test_a_ring_request_over_pinned_blocks_needs_room_of_its_own():
    """Under a ring a request reads the pinned blocks of its prefix only while they are in its
    window: one whose new blocks cannot fit beside the pinned ones is refused (admitted, it would
    preempt itself forever); a short question over them is served."""
    kv = KVCacheManager(BlockPool(7, 4), window=6)
    s = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=4, long_prefill_chunk=4), kv)
    doc = [3, 4, 5, 6] * 6
    ctx = Request("ctx", doc, 0, pin_prompt=True)
    _serve(s, ctx)
    assert kv.pool.num_pinned_blocks == 6
    with pytest.raises(CapacityError, match="6 of them pinned"):
        s.add(Request("q", doc + [8, 8, 8], 4))                # 2 new blocks at once > the 1 unpinned
    short = Request("short", doc + [8], 2)                     # 1 new block: served over the pinned ones
    _serve(s, short)
    assert short.num_cached_tokens == 24 and s.num_preemptions == 0
    kv.unpin(ctx.pinned_blocks)
    q = Request("q", doc + [8, 8, 8], 4)
    _serve(s, q)
    assert q.num_cached_tokens == 24                           # the pinned prefix, found again
    kv.check_invariants()


def test_allocations_hand_out_ascending_ids_and_tables_stay_mostly_consecutive():
    """The kernel reads runs of consecutive block ids faster (bench/kernel_paged.py): one
    allocation's blocks come in ascending order, and in a seeded RAG-like mix through the
    scheduler (12 documents of 2-8K tokens over a pool of 2,000 blocks, eviction under way) at
    least 90 % of neighbouring entries of the decoding requests' tables are consecutive ids
    (82 % when blocks were handed out in the order they came free)."""
    rng = random.Random(0)
    kv = make(2000)
    s = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=512, long_prefill_chunk=512), kv)
    docs = [[rng.randrange(3, 30000) for _ in range(rng.randint(2000, 8000))] for _ in range(12)]
    runs = total = 0
    for step in range(3000):
        if rng.random() < 0.05:
            s.add(Request(f"r{step}", rng.choice(docs) + [rng.randrange(3, 30000) for _ in range(30)], 64))
        out = s.schedule()
        for x in out.scheduled:
            t = x.request.block_table
            if x.num_new_tokens == 1:
                total += len(t) - 1
                runs += sum(b == a + 1 for a, b in zip(t, t[1:]))
        s.update(out, {x.request.request_id: 5 for x in out.scheduled if x.samples})
    assert kv.num_free_blocks < 8                        # the pool went round: allocations evict
    assert total > 10000 and runs / total >= 0.9, runs / total
    taken = kv.pool.take(7)
    assert taken == sorted(taken)
