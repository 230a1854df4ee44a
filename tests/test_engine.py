"""The engine (hetero.engine.Engine) on real transformers models and real worker processes: every
request, in any mix and arrival order, gives HF `generate`'s tokens for that request alone (fp32,
scores within 1e-4); shared prefixes are read once per step; aborted, finished and preempted
requests give their blocks back; bad input raises; nothing is left in /dev/shm."""
import asyncio
import os
import random
import signal
import threading
import time

import pytest
import torch
from transformers import StoppingCriteria

from hetero.engine import BLOCK_SIZE
from hetero import Engine, EngineConfig, EngineError
from hetero.errors import AdapterError, CapacityError, UnsupportedModelError, WorkerDiedError
from tests.conftest import FAMILIES, VOCAB, build_model, our_segments

NEW = 8


def prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lengths]


def hf(model, prompt, new=NEW, **kw):
    """HF generate on the request alone: (new tokens, processed scores [new, V])."""
    kw = {k: v for k, v in kw.items() if k != "output_scores"}
    out = model.generate(torch.tensor([prompt]), max_new_tokens=new, pad_token_id=0, output_scores=True,
                         return_dict_in_generate=True, **kw)
    return out.sequences[0, len(prompt):].tolist(), torch.cat(out.scores)


def assert_exact(model, stream, prompt, new=NEW, **kw):
    tokens, scores = hf(model, prompt, new, **kw)
    assert stream.token_ids == tokens, (stream.request_id, stream.token_ids, tokens)
    if stream.scores is not None:
        got = torch.stack(stream.scores)
        assert (got - scores).abs().max() < 1e-4


def run(engine, streams):
    while not all(s.finished for s in streams):
        engine.step()


def run_counting_ring_blocks(engine, streams, table):
    """run(), checking the pool after each step: the most blocks a request's `table` held at once
    (the full layers' block_table holds every block where a window pool is kept apart)."""
    peak = 0
    while not all(s.finished for s in streams):
        engine.step()
        engine.kv_manager.check_invariants()
        for r in engine.kv_manager.holders.values():
            peak = max(peak, sum(b >= 0 for b in getattr(r, table)))
            assert table == "block_table" or -1 not in r.block_table
    return peak


def continue_loaded(engine, model, path, prompt, cached):
    """A saved document loaded into the engine's pool, a request continuing it (finding `cached`
    tokens there, exact vs HF), the document unpinned again. Returns the load's stream."""
    loaded, _ = engine.load_pin(path)
    s = engine.add_request(prompt, NEW, output_scores=True)
    run(engine, [s])
    assert s.cached_tokens == cached
    assert_exact(model, s, prompt)
    engine.unpin(loaded)
    engine.step()
    return loaded


def assert_idle(engine):
    """Nothing is held: every block free or cached, the pool consistent."""
    kv = engine.kv_manager
    kv.check_invariants()
    assert not kv.holders and kv.num_used_blocks == 0


def make(model, **cfg):
    base = dict(kv_blocks=48, long_prefill_chunk=16, max_num_batched_tokens=40, background=False, cpu_workers=1,
                max_model_len=256)
    return Engine(model, EngineConfig(**{**base, **cfg}))


@pytest.fixture(scope="module")
def engine(llama):
    eng = make(llama)
    yield eng
    eng.close()


def test_mixed_arrivals_exact(llama, engine):
    ps = prompts([1, 5, 33, 64, 77, 12, 40])
    streams = [engine.add_request(p, NEW, output_scores=True) for p in ps[:2]]
    for _ in range(3):
        engine.step()
    streams += [engine.add_request(p, NEW, output_scores=True) for p in ps[2:4]]   # join while others decode
    engine.step()
    streams += [engine.add_request(p, NEW, output_scores=True) for p in ps[4:]]
    run(engine, streams)
    for s, p in zip(streams, ps):
        assert s.finish_reason == ("stop" if s.token_ids[-1] == llama.config.eos_token_id else "length")
        assert_exact(llama, s, p)
    assert_idle(engine)


def test_a_step_time_target_paces_prompts_beside_decodes_exactly(llama):
    """EngineConfig.step_time_target: prompts that arrive while others decode are computed in
    paced chunks (here the smallest: a target no step meets), and every request's tokens and
    scores are still HF generate's on it alone."""
    from hetero.engine.pacing import MIN_PROMPT_TOKENS
    from hetero.engine.scheduler import is_decoding

    with make(llama, step_time_target=1e-6, long_prefill_chunk=64, max_num_batched_tokens=64) as eng:
        ps = prompts([20, 70, 45], seed=3)
        first = eng.add_request(ps[0], NEW, output_scores=True)
        eng.step()
        eng.step()                                         # decoding: its step times teach the pacer
        late = [eng.add_request(p, NEW, output_scores=True) for p in ps[1:]]
        chunks = []
        schedule = eng.scheduler.schedule

        def watched(limit=None):
            decoding = any(map(is_decoding, eng.scheduler.running))
            out = schedule(limit)
            chunks.append((decoding, sum(x.num_new_tokens for x in out.scheduled if not is_decoding(x.request))))
            return out

        eng.scheduler.schedule = watched
        run(eng, [first, *late])
        paced = [n for decoding, n in chunks if decoding]
        assert paced and max(paced) <= MIN_PROMPT_TOKENS and MIN_PROMPT_TOKENS in paced
        for s, p in zip([first, *late], ps):
            assert_exact(llama, s, p)
        assert eng.pacer.alone and eng.pacer.mixed
        assert_idle(eng)


def test_shared_prefix_is_cached_and_read_once(llama, engine):
    doc = prompts([100], seed=3)[0]
    questions = prompts([7, 3, 12, 20], seed=4)
    first = engine.add_request(doc + questions[0], NEW)
    run(engine, [first])
    hits = engine.kv_manager.prefix_hits
    streams = [engine.add_request(doc + q, NEW, output_scores=True) for q in questions[1:]]
    groups, held = 0, 0
    while not all(s.finished for s in streams):
        engine.step()
        if engine.kv.n == len(streams):              # a step where all three decode
            groups = max(groups, engine.kv.ngroups)
            held = max(held, engine.kv_manager.num_used_blocks)
    assert engine.kv_manager.prefix_hits - hits == 3 * (100 // BLOCK_SIZE) * BLOCK_SIZE   # 96 rows each
    assert groups == 1                               # the document's blocks: one group, read once a step
    private = sum(-(-(100 + len(q) + NEW) // BLOCK_SIZE) for q in questions[1:])
    assert held < private
    for s, q in zip(streams, questions[1:]):
        assert_exact(llama, s, doc + q)
    assert_idle(engine)


def test_chunks_read_cached_rows_of_padded_heads_exactly():
    """A head_dim the pool pads (24 -> 32): prompt chunks read earlier rows back through the block
    table (PagedKV.read_rows) and match HF."""
    model, _ = build_model("llama", hidden_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=24)
    with make(model) as eng:
        ps = prompts([77, 45], seed=16)
        streams = [eng.add_request(p, NEW, output_scores=True) for p in ps]
        run(eng, streams)
        for s, p in zip(streams, ps):
            assert_exact(model, s, p)
        assert_idle(eng)


@pytest.mark.parametrize("stage", [0, 1 << 30])
def test_a_sliding_window_keeps_a_ring_of_blocks(stage):
    """Every layer of Mistral attends through one window (20 keys here): a request holds only the
    blocks its window still sees, so requests of ~7 blocks each run in a pool of 6 (without the
    ring, refused); a later request over a cached prefix takes only the prefix's blocks in its
    window; a pinned document keeps every block. Exact vs HF throughout (also with staged chunks)."""
    model, _ = build_model("mistral", sliding_window=20)
    with make(model, kv_blocks=6, prefill_stage_memory=stage) as eng:
        assert eng.kv_manager.window == 20
        ps = prompts([200, 150, 170], seed=12)
        streams = [eng.add_request(p, NEW, output_scores=True) for p in ps]
        peak = run_counting_ring_blocks(eng, streams, "block_table")
        assert 0 < peak <= 3                              # blocks_for(20 - 1 + 16) + 1
        for s, p in zip(streams, ps):
            assert_exact(model, s, p)
        assert_idle(eng)
    with make(model, kv_blocks=12, prefill_stage_memory=stage) as eng:
        a = eng.add_request(ps[0], NEW)
        run(eng, [a])
        cont = ps[0] + prompts([20], seed=13)[0]          # 6 whole blocks cached; the window sees the last
        s = eng.add_request(cont, NEW, output_scores=True)
        eng.step()
        r = eng.scheduler.requests[s.request_id]
        assert r.num_cached_tokens == 192 and r.ring_start == 5 and r.block_table[:5] == [-1] * 5
        run(eng, [s])
        assert_exact(model, s, cont)
        doc = eng.pin(prompts([100], seed=14)[0])
        run(eng, [doc])
        assert eng.kv_manager.pool.num_pinned_blocks == 3      # the document's whole blocks, all kept
        q = doc.prompt_ids + prompts([40], seed=15)[0]
        s = eng.add_request(q, NEW, output_scores=True)
        run(eng, [s])
        assert_exact(model, s, q)
        eng.unpin(doc)
        eng.step()
        assert_idle(eng)
    with make(model, kv_blocks=2) as eng, pytest.raises(CapacityError, match="at once"):
        eng.add_request(ps[0], NEW)                       # 3 blocks at once: past a pool of 2


@pytest.mark.parametrize("model_type", ["gemma2", "gemma3_text"])
def test_mixed_window_layers_keep_a_ring_in_a_pool_of_their_own(model_type, tmp_path):
    """A model whose windowed layers sit beside full ones (here one of each, a 20-key window): the
    windowed layers' blocks come from a pool of their own, where a request holds only its window's
    (at most 3 here, over ~7 blocks of rows), so that pool is sized for the running requests'
    windows, not their lengths. Exact vs HF under preemption (a full pool of 12 blocks for 3
    requests of ~7), over a cached prefix (the windowed layers' blocks of its window found too),
    over a pinned document (its pin keeps the windowed layers' last window only), and after that
    document is saved and loaded into another engine."""
    from hetero.engine.kv_hybrid import HybridKVCacheManager

    model, _ = build_model(model_type, sliding_window=20)
    with make(model, kv_blocks=None, kv_memory=1 << 30, max_num_seqs=4, max_model_len=2048) as eng:
        assert isinstance(eng.kv_manager, HybridKVCacheManager)
        assert eng.kv_manager.pool.num_blocks == 4 * 64      # every row of 4 requests of 2048 tokens
        assert eng.kv_manager.windowed.pool.num_blocks == max(2 * 4 * 3, 256 // 8)   # their windows twice, or
        # an eighth of the full pool (pinned documents' last windows)
    with make(model, kv_blocks=12) as eng:
        ps = prompts([200, 150, 170], seed=12)
        streams = [eng.add_request(p, NEW, output_scores=True) for p in ps]
        peak = run_counting_ring_blocks(eng, streams, "window_table")
        assert 0 < peak <= 3 and eng.scheduler.num_preemptions > 0
        for s, p in zip(streams, ps):
            assert_exact(model, s, p)
        assert_idle(eng)
        cont = ps[0] + prompts([20], seed=13)[0]          # 6 whole blocks cached; the window sees the last
        s = eng.add_request(cont, NEW, output_scores=True)
        eng.step()
        r = eng.scheduler.requests[s.request_id]
        assert r.num_cached_tokens == 192 and r.window_start == 5 and r.window_table[:5] == [-1] * 5
        assert -1 not in r.block_table
        run(eng, [s])
        assert_exact(model, s, cont)
        doc = eng.pin(prompts([100], seed=14)[0])
        run(eng, [doc])
        assert len(doc.pinned_blocks) == 3 and len(doc.pinned_blocks.window) == 1   # rows 77..95: block 2
        assert eng.kv_manager.windowed.pool.num_pinned_blocks == 1
        q = doc.prompt_ids + prompts([40], seed=15)[0]
        s = eng.add_request(q, NEW, output_scores=True)
        run(eng, [s])
        assert s.cached_tokens == 96
        assert_exact(model, s, q)
        eng.save_pin(doc, tmp_path / "doc.ctx")
        eng.unpin(doc)
        eng.step()
        assert_idle(eng)
    with make(model, kv_blocks=12) as eng:
        continue_loaded(eng, model, tmp_path / "doc.ctx", q, 96)
        assert_idle(eng)


def test_the_window_pool_serves_pins_readers_file_loads_and_keeps_what_prefixes_need(tmp_path):
    """Gemma 3's layer pattern, a 40-key window: a request continuing a pinned document is admitted
    where its window fits beside the pins (it reads the pin's last window, not a chain from block
    0); a generator's context file of 200 rows (not whole blocks) loads into the pool and
    continues exactly (its windowed rows from the pool's window on); and a finished request's
    windowed blocks go head first, so a document's continuation finds it all after unrelated
    requests."""
    from hetero import HeteroGenerator

    model, _ = build_model("gemma3_text", sliding_window=40)
    with make(model, kv_blocks=48, max_num_seqs=1) as eng:
        kvm = eng.kv_manager
        d1, d2 = prompts([100, 100], seed=3)
        pins = [eng.pin(d) for d in (d1, d2)]
        run(eng, pins)
        assert kvm.windowed.pool.num_blocks == 6 and kvm.windowed.pool.num_pinned_blocks == 4
        q = d1 + prompts([10], seed=4)[0]
        s = eng.add_request(q, 4, output_scores=True)
        run(eng, [s])
        assert s.error is None and s.cached_tokens == 96
        assert_exact(model, s, q, 4)
        for p in pins:
            eng.unpin(p)
        eng.step()
        assert_idle(eng)
    doc = prompts([200], seed=4)[0]
    with HeteroGenerator(model, cpu_workers=1) as gen:
        gen.prefill(torch.tensor([doc]), reserve=16).save(tmp_path / "doc.ctx")
    with make(model, kv_blocks=30) as eng:
        for i in range(3):                                # the pool's blocks written before
            run(eng, [eng.add_request(prompts([150], seed=20 + i)[0], 2)])
        eng.reset_prefix_cache()
        continue_loaded(eng, model, tmp_path / "doc.ctx", doc + prompts([20], seed=5)[0], 192)
    with make(model, kv_blocks=48, max_num_seqs=2) as eng:
        run(eng, [eng.add_request(doc + [5] * 10, 4)])
        for i in range(2):
            run(eng, [eng.add_request(prompts([150], seed=10 + i)[0], 4)])
        q = doc + [7] * 10
        s = eng.add_request(q, 4)
        run(eng, [s])
        assert eng.kv_manager.num_cached_blocks(q) == 6 and s.cached_tokens == 192


def test_a_request_the_pins_leave_no_room_is_refused_not_left_waiting(llama):
    """Pins computed after a request was added can leave it too little room for good: it fails
    with a CapacityError naming the pins (before, it waited forever, or preempted itself and came
    back forever), and the engine goes on."""
    with make(llama, kv_blocks=12, max_num_seqs=1) as eng:
        pins = [eng.pin(p) for p in prompts([100] * 3, seed=30)]
        s = eng.add_request(prompts([100], seed=6)[0], 8)
        for _ in range(200):
            if s.finished:
                break
            eng.step()
        assert s.finished and isinstance(s.error, CapacityError) and "pinned by contexts" in str(s.error)
        for p in pins:
            eng.unpin(p)
        ok = eng.add_request(prompts([100], seed=6)[0], 8)
        run(eng, [ok])
        assert ok.error is None and len(ok.token_ids) == 8
        assert_idle(eng)


@pytest.mark.parametrize("stage", [0, 1 << 30])
def test_preempted_requests_resume_exactly(llama, stage):
    """Also with prefill chunks staged on the device (stage: its budget): a preempted request's
    staged rows are dropped and it resumes exactly."""
    with make(llama, kv_blocks=9, max_num_batched_tokens=64, long_prefill_chunk=None if not stage else 16,
              prefill_stage_memory=stage) as eng:
        ps = prompts([60, 50, 70, 40], seed=5)
        streams = [eng.add_request(p, 24, output_scores=True) for p in ps]
        run(eng, streams)
        assert eng.scheduler.num_preemptions > 0
        for s, p in zip(streams, ps):
            assert_exact(llama, s, p, 24)
        assert_idle(eng)
        assert not eng.runner.stage.entries and eng.runner.stage.used == 0


def counting_reads(eng):
    """The rows each read_rows call of the engine's pool reads back (a list that grows)."""
    reads, read = [], eng.kv.read_rows
    eng.kv.read_rows = lambda layer, table, n, first=0, new=None: (reads.append(n - first),
                                                                     read(layer, table, n, first, new))[1]
    return reads


def test_prefill_stage_keeps_chunked_prompts_rows_between_chunks(llama):
    """With a stage budget (a GPU's default), a prompt's later chunks attend over rows kept from
    its earlier chunks instead of reading them back from the pool; a prefix found in the pool is
    read once; exact either way, and with a budget too small to stage (preemption: the test below)."""
    layers = llama.config.num_hidden_layers
    ps = prompts([77, 100, 45], seed=8)
    with make(llama, prefill_stage_memory=1 << 30) as eng:
        reads = counting_reads(eng)
        streams = [eng.add_request(p, NEW, output_scores=True) for p in ps]
        run(eng, streams)
        assert reads == []                               # 15 later chunks, none read back
        for s, p in zip(streams, ps):
            assert_exact(llama, s, p)
        cont = ps[1] + prompts([50], seed=9)[0]          # 96 rows found in the pool, then 54 in 4 chunks
        s = eng.add_request(cont, NEW, output_scores=True)
        run(eng, [s])
        assert reads == [96] * layers                    # read once, at the first chunk
        assert_exact(llama, s, cont)
        assert not eng.runner.stage.entries and eng.runner.stage.used == 0
        assert_idle(eng)
    with make(llama, prefill_stage_memory=1) as eng:     # nothing fits: every later chunk reads back
        reads = counting_reads(eng)
        s = eng.add_request(ps[0], NEW, output_scores=True)
        run(eng, [s])
        assert len(reads) == layers * (-(-77 // 16) - 1)
        assert_exact(llama, s, ps[0])


def test_a_cached_document_s_rows_stay_on_the_device_for_its_questions(llama):
    """PrefixRows: a cached document's rows are read back from the pool by its first question (seen
    once), kept by its second (several in one step), and later questions attend over them, also
    ones longer than the room after them and one in two chunks (its stage seeded from them); once
    the document is computed again (the cache reset), the rows kept no longer match the pool and
    are read again. The same bits as reading back every time, and exact vs HF. A document pinned
    in several chunks (70 tokens, and 96: its prompt all whole blocks) has its rows kept from its
    prompt's stage: its questions read nothing back."""
    layers = llama.config.num_hidden_layers
    doc = prompts([100], seed=21)[0]                       # 96 rows in whole blocks
    qs = prompts([7, 3, 12, 4, 20, 45, 9, 11], seed=22)  # 3 and 4 tokens: in the room; the others copy
    got = {}
    for memory in (0, None):
        with make(llama, prefix_rows_memory=memory, long_prefill_chunk=32, max_num_batched_tokens=64) as eng:
            rows = eng.runner.prefix_rows
            rows.slack = 8                                 # room for 8 rows: 4 document rows + a 3- or 4-token question
            run(eng, [eng.add_request(doc, NEW)])          # the document cached
            reads = counting_reads(eng)
            streams = [eng.add_request(doc + qs[0], NEW, output_scores=True)]
            run(eng, streams)                              # seen once: read back
            together = [eng.add_request(doc + q, NEW, output_scores=True) for q in qs[1:4]]
            run(eng, together)                             # kept by the first, read from there by the others
            streams += together
            if memory is None:
                assert reads == [96] * layers * 2 and (rows.misses, rows.hits) == (1, 2)
                (entry,) = rows.entries.values()
                assert entry.size == 96 + 8 and rows.used == entry.size * rows.row_bytes
            streams.append(eng.add_request(doc + qs[4], NEW, output_scores=True))
            streams.append(eng.add_request(doc + qs[5], NEW, output_scores=True))   # 49 rows: two chunks, staged
            run(eng, streams[-2:])
            if memory is None:
                assert reads == [96] * layers * 2 and rows.hits == 4
            eng.reset_prefix_cache()
            run(eng, [eng.add_request(doc, NEW)])          # computed again: new blocks
            streams.append(eng.add_request(doc + qs[6], NEW, output_scores=True))
            run(eng, streams[-1:])
            if memory is None:
                assert rows.stale == 1 and rows.misses == 2 and len(rows.entries) == 1
                assert reads == [96] * layers * 3          # read again, kept again (it was seen)
            else:
                assert reads == [96] * layers * 7 and not rows.entries
            got[memory] = [torch.stack(s.scores) for s in streams]
            for s, q in zip(streams, qs):
                assert_exact(llama, s, doc + q)
            for n, seed in ((70, 23), (96, 24)):          # pinned in three chunks: kept from its stage
                pdoc = prompts([n], seed=seed)[0]
                pin = eng.pin(pdoc)
                pin.result()
                before = len(reads)
                asked = [eng.add_request(pdoc + q, NEW, output_scores=True) for q in qs[:2]]
                run(eng, asked)
                for s, q in zip(asked, qs):
                    assert_exact(llama, s, pdoc + q)
                if memory is None:
                    assert len(reads) == before           # its questions read nothing back
                eng.unpin(pin)
            if memory is None:
                assert (rows.misses, rows.hits) == (4, 8)
            eng.step()
            assert_idle(eng)
        assert not eng.runner.prefix_rows.entries           # dropped at close
    assert all(torch.equal(a, b) for a, b in zip(got[0], got[None]))


def test_prefix_rows_budget_evicts_the_least_recently_used():
    """PrefixRows' bookkeeping over a real BlockPool: an entry on a second sighting (or at once for
    pinned blocks), least recently used out under the budget but never one this step handed out,
    and an entry whose blocks were taken again since (new content) dropped as stale."""
    from types import SimpleNamespace

    from hetero.engine.kv_pool import BlockPool
    from hetero.engine.prefix_rows import PrefixRows

    pool = BlockPool(16)
    a_blocks, b_blocks, c_blocks = pool.take(3), pool.take(2), pool.take(3)
    rows = PrefixRows(SimpleNamespace(layers=2, kv_heads=2, head_dim=4, dtype=torch.float32), 250 * 128, slack=10)
    assert rows.row_bytes == 2 * 2 * 2 * 4 * 4
    rows.begin_step()
    assert rows.find(b"a", a_blocks, pool) is None and rows.misses == 0    # seen once
    a = rows.find(b"a", a_blocks, pool)
    assert a is not None and a.n == 96 and rows.used == 106 * 128 and rows.misses == 1
    pool.pin(b_blocks)
    b = rows.find(b"b", b_blocks, pool)                                     # pinned: kept at once
    assert b is not None and rows.used == (106 + 74) * 128
    rows.begin_step()
    assert rows.find(b"a", a_blocks, pool) is a and rows.find(b"b", b_blocks, pool) is b and rows.hits == 2
    rows.find(b"c", c_blocks, pool)
    assert rows.find(b"c", c_blocks, pool) is None                        # a and b are this step's: no room
    rows.begin_step()
    rows.find(b"a", a_blocks, pool)
    c = rows.find(b"c", c_blocks, pool)                                     # b (least recent, not this step's) goes
    assert list(rows.entries) == [b"a", b"c"] and rows.used == 212 * 128 and c is not None
    big = pool.take(8)
    rows.find(b"d", big, pool)
    assert rows.find(b"d", big, pool) is None and list(rows.entries) == [b"a", b"c"]   # never fits: none evicted
    rows.begin_step()
    assert rows.find(b"c", c_blocks, pool) is c                             # c is this step's
    pool.pin(big[:5])
    assert rows.find(b"e", big[:5], pool) is None                          # 170 fits only if c went too
    assert list(rows.entries) == [b"a", b"c"] and rows.used == 212 * 128   # so a stays
    rows.begin_step()
    assert rows.find(b"e", big[:5], pool) is not None and list(rows.entries) == [b"e"]   # a and c out, LRU first
    assert b"a" in rows.seen and b"c" in rows.seen                         # kept again at their next sighting
    rows.begin_step()
    assert rows.find(b"a", a_blocks, pool) is not None and list(rows.entries) == [b"a"]
    pool.release(a_blocks)                                                  # a's blocks taken again: new content
    assert sorted(pool.take(3)) == sorted(a_blocks)
    rows.begin_step()
    fresh = rows.find(b"a", a_blocks, pool)
    assert fresh is not None and fresh is not a and rows.stale == 1
    assert rows.find(b"a", c_blocks, pool) is not fresh and rows.stale == 2   # other blocks, same key
    rows.clear()
    assert not rows.entries and not rows.seen and rows.used == 0


def test_prefill_stage_budget_and_drops():
    """PrefillStage's bookkeeping: an entry only while more chunks follow and within the budget,
    reused only for the chunk right after its rows, dropped (its bytes back) when the request stops
    running or is preempted."""
    from types import SimpleNamespace

    from hetero.engine.request import Request, RequestStatus
    from hetero.engine.runner import PrefillStage

    st = PrefillStage(SimpleNamespace(layers=2, kv_heads=2, head_dim=4, dtype=torch.float32), 100 * 128)
    a, b, c = (Request(x, list(range(3, 3 + n)), 4, status=RequestStatus.RUNNING) for x, n in
               (("a", 60), ("b", 50), ("c", 10)))
    assert st.row_bytes == 2 * 2 * 2 * 4 * 4         # K and V, 2 layers, 2 heads of 4 fp32
    e, held = st.chunk(a, 0, 16)
    assert e is not None and not held and st.used == 60 * 128
    assert st.chunk(b, 0, 16) == (None, False)          # 50 more rows are over the budget of 100
    assert st.chunk(c, 0, 10) == (None, False)          # one chunk: nothing to keep
    e.rows = 16
    assert st.chunk(a, 16, 16) == (e, True)
    assert st.chunk(a, 20, 8)[1] is False and st.used == 60 * 128  # not the next rows: a fresh entry
    a.num_preemptions += 1
    st.prune()
    assert not st.entries and st.used == 0
    st.chunk(b, 0, 16)
    b.status = RequestStatus.FINISHED_ABORTED
    st.prune()
    assert not st.entries and st.used == 0


def write_each(kv, layer, table, start, key, value):
    """What PagedKV.write_rows must do, row by row: a scatter through the table (the reference)."""
    from hetero.cpu_attention.kernel import BF16
    from hetero.cpu_attention.simd import BK, W

    Hkv, n, D = key.shape
    Dp, P = kv.layout.dpad, 2 if kv.layout.code == BF16 else 1
    j = torch.arange(start, start + n)
    blk, col = table[j // BK], j % BK
    Kl, Vl = kv.kv[layer]
    key, value = (torch.nn.functional.pad(t.to(Kl.dtype), (0, Dp - D)) for t in (key, value))
    # K [Hkv, NB, Dp/P, BK, P][:, blk, :, col] and V [Hkv, NB, Dp/W, BK, W][:, blk, :, col]: [n, Hkv, ...]
    Kl.view(Hkv, -1, Dp // P, BK, P)[:, blk, :, col] = key.transpose(0, 1).reshape(n, Hkv, Dp // P, P)
    Vl[:, blk, :, col] = value.transpose(0, 1).reshape(n, Hkv, Dp // W, W)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [16, 24])
def test_rows_written_by_whole_blocks_equal_the_row_scatter(dtype, head_dim):
    """PagedKV.write_rows copies whole blocks in the pool's layout (and the partial blocks at either
    end row by row): the same rows as writing each row, for any start and length; read_rows from a
    later block (a ring's first) with new rows after gives the same rows (also with padded heads),
    through consecutive block ids (a view of the pool; written a run at a time) and scattered ones
    (a gather; written by one scatter when the blocks form more than 4 runs)."""
    model = build_model("llama", dtype=dtype, hidden_size=4 * head_dim, head_dim=head_dim)[0]
    with make(model) as eng:
        kv, g = eng.kv, torch.Generator().manual_seed(0)
        Hkv, D = eng.spec.kv_heads, eng.spec.head_dim
        for start, n in [(0, 64), (5, 100), (32, 31), (40, 7), (0, 1), (63, 34), (31, 2), (0, 256), (16, 230)]:
            k, v = (torch.randn(Hkv, n, D, generator=g).to(dtype) for _ in range(2))
            fast, each = torch.arange(0, 8), torch.arange(8, 16)
            scattered = torch.tensor([20, 17, 23, 16, 21, 19, 22, 18])    # read by a gather, not a view
            runs = torch.tensor([24, 25, 26, 30, 31, 27, 28, 29])          # three runs: written run by run
            kv.write_rows(1, fast, start, k, v)
            write_each(kv, 1, each, start, k, v)
            kv.write_rows(1, scattered, start, k, v)
            kv.write_rows(1, runs, start, k, v)
            for table in (fast, each, scattered, runs):
                got_k, got_v = kv.read_rows(1, table, start + n)
                assert torch.equal(got_k[:, start:], k) and torch.equal(got_v[:, start:], v), (start, n)
                first = (start + n - 1) // 32 * 32
                a, b = (torch.randn(Hkv, 3, D, generator=g).to(dtype) for _ in range(2))
                rk, rv = kv.read_rows(1, table, start + n, first, new=(a, b))
                assert torch.equal(rk, torch.cat([got_k[:, first:], a], 1)), (start, n)
                assert torch.equal(rv, torch.cat([got_v[:, first:], b], 1)), (start, n)


def test_a_failed_step_and_close_drop_the_staged_rows(llama, monkeypatch):
    from hetero.engine import runner

    eng = make(llama, prefill_stage_memory=1 << 30)
    s = eng.add_request(prompts([100])[0], 4)
    eng.step()                                        # the first chunk: staged
    assert eng.runner.stage.used > 0
    attend, calls = runner.StepAttention.attend, []

    def failing(self, *a, **k):                       # the next forward fails in its second layer
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("mid-forward failure")
        return attend(self, *a, **k)

    monkeypatch.setattr(runner.StepAttention, "attend", failing)
    with pytest.raises(RuntimeError, match="mid-forward"):
        eng.step()
    assert s.finished and not eng.runner.stage.entries and eng.runner.stage.used == 0
    eng.close()


def test_a_step_out_of_memory_runs_again_with_the_kept_rows_dropped(llama, monkeypatch, caplog):
    """torch.OutOfMemoryError in a step's forward (a GPU shared with others): the runner's rows kept
    on the device are dropped and their budgets halved, the step runs again, and every request,
    decoding or mid-prompt, still gets HF's tokens; a second one in a row fails the step as before."""
    from hetero.engine import runner

    eng = make(llama, prefill_stage_memory=1 << 30, prefix_rows_memory=1 << 30)
    doc = prompts([64], seed=3)[0]
    pin = eng.pin(doc)
    while not pin.finished:
        eng.step()
    ps = [doc + q for q in prompts([7, 9], seed=4)] + prompts([100], seed=5)
    streams = [eng.add_request(p, NEW, output_scores=True) for p in ps[:2]]
    for _ in range(3):
        eng.step()
    streams.append(eng.add_request(ps[2], NEW, output_scores=True))
    eng.step()                                        # the long prompt's first chunk: staged
    assert eng.runner.stage.used > 0 and eng.runner.prefix_rows.used > 0
    attend, calls = runner.StepAttention.attend, []

    def failing(self, *a, **k):                       # the next forward runs out of memory in its second layer
        calls.append(1)
        if len(calls) in fail:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return attend(self, *a, **k)

    fail = {2}
    monkeypatch.setattr(runner.StepAttention, "attend", failing)
    with caplog.at_level("WARNING", logger="hetero"):
        eng.step()
    assert "ran out of memory" in caplog.text and eng.failure is None
    assert (eng.runner.stage.budget, eng.runner.prefix_rows.budget) == (1 << 29, 1 << 29)
    run(eng, streams)
    for s, p in zip(streams, ps):
        assert_exact(llama, s, p)
    s = eng.add_request(ps[2], NEW)
    calls.clear()
    fail = {1, 2}                                     # its first layer, then again in the retry's: it fails
    with pytest.raises(torch.OutOfMemoryError):
        eng.step()
    assert s.finished and s.error is not None and eng.kv_manager.num_used_blocks == len(pin.pinned_blocks)
    eng.close()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_families_exact(family):
    model, _ = build_model(family)
    with make(model) as eng:
        ps = prompts([5, 40, 77, 12], seed=1)
        streams = [eng.add_request(p, NEW, output_scores=True) for p in ps]
        run(eng, streams)
        for s, p in zip(streams, ps):
            assert_exact(model, s, p)


def test_sampling_with_a_seed_matches_hf(llama, engine):
    ps = prompts([9, 30], seed=6)
    settings = dict(do_sample=True, temperature=0.8, top_k=40, top_p=0.9)
    streams = [engine.add_request(p, NEW, seed=100 + i, **settings) for i, p in enumerate(ps)]
    run(engine, streams)
    for i, (s, p) in enumerate(zip(streams, ps)):
        torch.manual_seed(100 + i)
        tokens, _ = hf(llama, p, **settings)
        assert s.token_ids == tokens
    assert streams[0].token_ids != engine_greedy(engine, ps[0])


def engine_greedy(engine, prompt):
    s = engine.add_request(prompt, NEW)
    run(engine, [s])
    return s.token_ids


class StopAfter(StoppingCriteria):
    def __init__(self, token):
        self.token = token

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] == self.token


def test_processors_and_stopping(llama, engine):
    p = prompts([25], seed=7)[0]
    kw = dict(repetition_penalty=1.3, no_repeat_ngram_size=2, output_scores=True)
    s = engine.add_request(p, NEW, **kw)
    run(engine, [s])
    assert_exact(llama, s, p, **kw)
    plain = engine_greedy(engine, p)
    eos = plain[3]
    s = engine.add_request(p, NEW, eos_token_id=[eos, 2])        # stops at the first eos, which it keeps
    run(engine, [s])
    assert s.token_ids == plain[:plain.index(eos) + 1] and s.finish_reason == "stop"
    s = engine.add_request(p, NEW, stopping_criteria=[StopAfter(plain[2])])
    run(engine, [s])
    assert s.token_ids == plain[:plain.index(plain[2]) + 1] and s.finish_reason == "stop"
    assert_idle(engine)


def test_abort_frees_blocks_at_once(llama, engine):
    a, b = (engine.add_request(p, 30) for p in prompts([50, 20], seed=8))
    for _ in range(3):
        engine.step()
    assert engine.kv_manager.num_used_blocks > 0
    a.abort()
    engine.step()
    assert a.finish_reason == "abort" and list(a) == a.token_ids
    assert a.request_id not in engine.kv_manager.holders
    engine.abort(b.request_id)
    engine.abort("no-such-request")
    engine.step()
    assert b.finish_reason == "abort"
    assert_idle(engine)


def test_random_add_abort_finish_preempt_sequences(llama):
    """Random arrivals, aborts and steps over a pool small enough to preempt: every finished
    request is exact, and at the end every refcount is back to zero."""
    rng = random.Random(0)
    pool = [p for p in prompts([3, 17, 32, 45, 64, 70], seed=9)]
    pool += [pool[4][:40] + q for q in prompts([5, 9], seed=10)]        # shared prefixes
    refs = {}
    with make(llama, kv_blocks=7, max_num_seqs=4, max_num_batched_tokens=48) as eng:
        live, done = [], []
        for _ in range(60):
            for _ in range(int(rng.random() < 0.5) + int(rng.random() < 0.25)):
                i = rng.randrange(len(pool))
                live.append((eng.add_request(pool[i], rng.randint(4, 40)), i))
            if rng.random() < 0.1 and live:
                eng.abort(rng.choice(live)[0].request_id)
            eng.step()
            eng.kv_manager.check_invariants()
            done += [x for x in live if x[0].finished]
            live = [x for x in live if not x[0].finished]
        run(eng, [s for s, _ in live])
        done += live
        assert_idle(eng)
        for s, i in done:
            if s.finish_reason == "abort":
                continue
            n = len(s.token_ids)
            if i not in refs:
                refs[i] = hf(llama, pool[i], 40)[0]
            assert s.token_ids == refs[i][:n]
        assert eng.scheduler.num_preemptions > 0


def test_threads_and_async_callers(llama):
    ps = prompts([4, 19, 33, 8, 51, 26], seed=11)
    refs = [hf(llama, p)[0] for p in ps]
    with make(llama, background=True) as eng:
        got = {}

        def call(i):
            got[i] = list(eng.add_request(ps[i], NEW))

        threads = [threading.Thread(target=call, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()

        async def consume():
            async def one(i):
                return [t async for t in eng.add_request(ps[i], NEW)]
            return await asyncio.gather(one(4), one(5))

        got[4], got[5] = asyncio.run(consume())
        for t in threads:
            t.join()
        assert [got[i] for i in range(6)] == refs
        assert eng.generate(ps[:2], NEW) == refs[:2]


def test_bad_input_raises_clear_errors(llama, engine):
    ok = prompts([5])[0]
    cases = [
        (ValueError, "empty prompt", ([],), {}),
        (ValueError, r"outside the vocabulary", ([1, VOCAB],), {}),
        (TypeError, "list of token ids", ("hello",), {}),
        (ValueError, r"\[n\] or \[1, n\]", (torch.ones(2, 3, dtype=torch.long),), {}),
        (CapacityError, "max_model_len=256", (ok, 300), {}),
        (TypeError, r"unsupported arguments \['frobnicate'\]", (ok, 4), {"frobnicate": 1}),
        (ValueError, "num_beams", (ok, 4), {"num_beams": 2}),
        (ValueError, "max_new_tokens", (ok, 0), {}),
        (ValueError, "RequestStream", (ok, 4), {"streamer": object()}),
        (AdapterError, r"no adapter named 'x' is loaded \(loaded: \[\]\)", (ok, 4), {"adapter": "x"}),
    ]
    for exc, msg, args, kw in cases:
        with pytest.raises(exc, match=msg):
            engine.add_request(*args, **kw)
    s = engine.add_request(ok, 2, request_id="same")
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request(ok, 2, request_id="same")
    run(engine, [s])
    with pytest.raises(CapacityError, match="needs 7 blocks of 32 at once; the pool has 4 blocks"):
        with make(llama, kv_blocks=4) as small:
            small.add_request(ok, 200)
    with pytest.raises(ValueError, match="EngineConfig.max_num_seqs"):
        EngineConfig(max_num_seqs=0)
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="EngineConfig.prefill_stage_memory must be an int >= 0"):
            EngineConfig(prefill_stage_memory=bad)
    for bad in (0, -0.1, float("inf"), float("nan"), True, "0.1"):
        with pytest.raises(ValueError, match="EngineConfig.step_time_target must be a number of seconds > 0"):
            EngineConfig(step_time_target=bad)
    dynamic = build_model("llama", rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4})[0]
    with pytest.raises(ValueError, match="past 256 tokens, where the model's positions end"):
        make(dynamic, max_model_len=5000)
    assert_idle(engine)


def test_unsupported_models_refused_by_name():
    bert_like, _ = build_model("llama")
    bert_like.config.is_encoder_decoder = True
    with pytest.raises(UnsupportedModelError, match="encoder-decoder"):
        make(bert_like)


def test_dead_worker_fails_requests_within_seconds_and_close_cleans_up(llama):
    before = set(our_segments(os.getpid()))           # the module's engine's
    eng = make(llama, background=True, cpu_workers=2)
    s = eng.add_request(prompts([40])[0], 200)
    next(iter(s))                                       # decoding
    victim = eng.pool.procs[1]
    os.kill(victim.pid, signal.SIGKILL)
    t = time.perf_counter()
    with pytest.raises(EngineError, match="worker 1"):
        s.result(timeout=30)
    assert time.perf_counter() - t < 5
    assert isinstance(s.error, WorkerDiedError)
    with pytest.raises(EngineError, match="the engine failed"):
        eng.add_request([5, 6], 2)
    eng.close()
    assert set(our_segments(os.getpid())) == before


def test_a_closed_engine_keeps_no_view_of_its_pool(llama):
    """close() unmaps the pool's segment even while the caller still holds the engine (and so its
    PagedKV): no view of it is left alive (one would keep the mapping, and warn)."""
    import warnings

    eng = make(llama)
    s = eng.add_request(prompts([40])[0], 3)
    run(eng, [s])
    kv, name = eng.kv, eng.kv.seg.name
    with warnings.catch_warnings():
        warnings.simplefilter("error", ResourceWarning)
        eng.close()
    with open("/proc/self/maps") as f:
        assert name not in f.read() and kv.seg.mm is None


def test_close_aborts_unfinished_and_leaves_no_segments(llama):
    before = set(our_segments(os.getpid()))
    eng = make(llama, background=True)
    streams = [eng.add_request(p, 100) for p in prompts([30, 60], seed=12)]
    next(iter(streams[0]))
    eng.close()
    assert all(s.finish_reason == "abort" for s in streams)
    assert set(our_segments(os.getpid())) == before
    with pytest.raises(RuntimeError, match="closed"):
        eng.add_request([5], 2)


def test_a_pinned_document_survives_pressure_and_is_read_by_every_request(llama):
    doc = prompts([96], seed=13)[0]                   # 3 whole blocks
    with make(llama, kv_blocks=10, max_num_batched_tokens=64, long_prefill_chunk=None) as eng:
        pin = eng.pin(doc)
        assert pin.result() == [] and len(pin.pinned_blocks) == 3
        for p in prompts([120, 100, 110], seed=14):     # other traffic fills and recycles the pool
            s = eng.add_request(p, 8)
            run(eng, [s])
        hits = eng.kv_manager.prefix_hits
        streams = [eng.add_request(doc + q, NEW, output_scores=True) for q in prompts([5, 9], seed=15)]
        run(eng, streams)
        assert eng.kv_manager.prefix_hits - hits == 2 * 96
        assert all(s_.finish_reason for s_ in streams)
        for s_, q in zip(streams, prompts([5, 9], seed=15)):
            assert_exact(llama, s_, doc + q)
        assert eng.kv_manager.num_used_blocks == 3      # the pin alone
        eng.unpin(pin)
        eng.step()
        assert_idle(eng)
        with pytest.raises(CapacityError, match="max_model_len"):
            eng.pin([5] * 300)


@pytest.mark.parametrize("case", ["paced", "pinned"])
def test_a_step_that_computes_nothing_does_not_stop_a_caller_driving_the_engine(llama, case):
    """background=False: a step may compute nothing and leave work (the request that needed a
    block preempted itself). A caller waiting on a stream steps on: paced (the pacer allows no
    prompt tokens yet, the decoding request preempts itself) it gets HF's tokens; over a pin made
    after it was admitted it gets the CapacityError naming the pins. Before, both waited forever."""
    from hetero.errors import EngineError

    if case == "paced":
        eng = make(llama, kv_blocks=2, long_prefill_chunk=32, max_num_batched_tokens=64, step_time_target=0.5)
        a, b = prompts([60], seed=1)[0], prompts([32], seed=2)[0]
        sa, sb = eng.add_request(a, 4), eng.add_request(b, 2)
        assert eng.step() > 0
        done = {}
        th = threading.Thread(target=lambda: done.setdefault("b", sb.result()), daemon=True)
        th.start()
        th.join(60)
        assert done.get("b") == hf(llama, b, 2)[0]
        assert sa.result() == hf(llama, a, 4)[0]
    else:
        eng = make(llama, kv_blocks=5, long_prefill_chunk=32, max_num_batched_tokens=64)
        sa = eng.add_request(prompts([40], seed=1)[0], 100, ignore_eos=True)     # 5 blocks at its peak
        eng.step()
        pin = eng.pin(prompts([64], seed=3)[0])
        pin.result()
        done = {}

        def wait():
            try:
                sa.result()
            except EngineError as e:
                done["a"] = e
        th = threading.Thread(target=wait, daemon=True)
        th.start()
        th.join(60)
        assert isinstance(done.get("a"), EngineError) and "pinned by contexts" in str(done["a"])
        eng.unpin(pin)
    try:
        assert not th.is_alive()
    finally:
        eng.close()


def test_pins_of_another_engine_and_generated_ids_are_refused_or_fresh(llama):
    """unpin() and save_pin() name a stream that is not this engine's (before, unpin released this
    engine's blocks of the same ids and save_pin wrote the other's tokens with this one's KV); ids
    the engine makes up never collide with ids a caller chose."""
    with make(llama) as a, make(llama) as b:
        pb = b.pin(prompts([70], seed=6)[0])
        pb.result()
        with pytest.raises(ValueError, match="another engine's stream"):
            a.unpin(pb)
        with pytest.raises(ValueError, match="another engine's stream"):
            a.save_pin(pb, "/tmp/never-written.hkv")
        b.unpin(pb)
        b.step()
        assert b.kv_manager.num_used_blocks == 0
        mine = a.add_request(prompts([5])[0], 2, request_id="req-1")
        others = [a.add_request(prompts([5])[0], 2) for _ in range(3)] + [a.pin(prompts([40])[0], request_id="pin-5"),
                                                                          a.pin(prompts([40], seed=2)[0])]
        ids = [s.request_id for s in [mine] + others]
        assert len(set(ids)) == len(ids)
        for s in [mine] + others:
            s.result()


def test_close_waits_for_a_step_another_thread_drives(llama):
    """background=False: close() while another thread steps the engine through its stream: the
    stream ends (all its tokens, or aborted), never with an exception from a step cut in two."""
    for _ in range(3):
        eng = make(llama, max_model_len=512, kv_blocks=64)
        s = eng.add_request(prompts([30])[0], 300, ignore_eos=True)
        out = {}

        def drain():
            try:
                out["n"] = sum(1 for _ in s)
            except BaseException as e:
                out["e"] = e
        th = threading.Thread(target=drain)
        th.start()
        time.sleep(0.2)
        eng.close()
        th.join(30)
        assert "e" not in out and s.finish_reason in ("abort", "length"), out


def test_bad_max_new_tokens_are_named(engine):
    for bad in (2.5, "4", True):
        with pytest.raises(TypeError, match="max_new_tokens must be an integer"):
            engine.add_request(prompts([5])[0], bad)


@pytest.mark.parametrize("background", [False, True])
def test_a_corrupted_saved_pin_raises_context_file_error(llama, tmp_path, background):
    """load_pin of a file whose payload is corrupted raises ContextFileError (as a file of another
    model does), not an EngineError around it, and holds no block."""
    from hetero import ContextFileError

    with make(llama) as e:
        p = e.pin(prompts([70], seed=5)[0])
        p.result()
        path = tmp_path / "doc.hkv"
        e.save_pin(p, path)
    data = bytearray(path.read_bytes())
    data[-100] ^= 0xFF
    path.write_bytes(data)
    with make(llama, background=background) as e2:
        with pytest.raises(ContextFileError, match="corrupted"):
            e2.load_pin(path)
        assert e2.kv_manager.num_used_blocks == 0


def test_a_saved_pin_s_header_is_under_its_crc(llama, tmp_path):
    """A flipped bit in the header outside the fields read as numbers (the extra a server keeps, the
    fingerprint's adapter key) is found by the CRC, not loaded as another document or as the base
    model's; a file past max_model_len, or one the full pool has no room for, is a CapacityError
    (the file is good); save_pin and load_pin take bytes paths and name a closed engine."""
    from hetero import CapacityError, ContextFileError

    doc = prompts([70], seed=5)[0]
    path = tmp_path / "doc.ctx"
    with make(llama) as e:
        p = e.pin(doc)
        p.result()
        e.save_pin(p, os.fsencode(path), {"name": "doc", "messages": [{"role": "system", "content": "Answer only."}]})
        stream, extra = e.load_pin(os.fsencode(path))
        assert extra["messages"][0]["content"] == "Answer only."
        e.unpin(stream)
    data = path.read_bytes()
    for old, new in ((b"Answer only", b"Answer nnly"), (b'"adapter"', b'"aDapter"')):
        path.write_bytes(data.replace(old, new, 1))
        with make(llama) as e2:
            with pytest.raises(ContextFileError, match="corrupted"):
                e2.load_pin(path)
            assert e2.kv_manager.num_used_blocks == 0
    path.write_bytes(data)
    with make(llama, max_model_len=64) as e3:
        with pytest.raises(CapacityError, match="past the engine's max_model_len=64"):
            e3.load_pin(path)
    with make(llama, kv_blocks=4) as e4:
        filler = e4.pin(prompts([100], seed=6)[0])
        filler.result()
        with pytest.raises(CapacityError, match="no room"):
            e4.load_pin(path)
        e4.unpin(filler)
        e4.step()
        assert e4.kv_manager.num_used_blocks == 0
    closed = make(llama)
    closed.close()
    with pytest.raises(RuntimeError, match="the engine is closed"):
        closed.load_pin(path)


def test_saves_to_one_path_from_two_threads_and_an_unpin_during_a_save(llama, tmp_path, monkeypatch):
    """Two threads saving two documents to one path: the file is always one of them, whole. A pin
    unpinned while its save writes (another thread's unpin; a step reusing freed blocks) keeps its
    blocks until the save is done: the file continues as HF generate does."""
    from hetero import CapacityError, EngineError
    from hetero.offload import saved

    docs = prompts([96, 96], seed=7)
    path = tmp_path / "one.ctx"
    with make(llama, kv_blocks=12, background=True) as e:
        pins = [e.pin(d) for d in docs]
        for p in pins:
            p.result()
        errors = []

        def save(p):
            try:
                for _ in range(8):
                    e.save_pin(p, path)
            except Exception as err:
                errors.append(err)
        threads = [threading.Thread(target=save, args=(p,)) for p in pins]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        stream, _ = e.load_pin(path)
        assert stream.prompt_ids in docs
        e.unpin(stream)
        for p in pins:
            e.unpin(p)
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".tmp")]
    doc = docs[0]
    write = saved.write
    with make(llama, kv_blocks=4) as e:
        p = e.pin(doc)
        p.result()

        def racing_write(*args, **kw):           # the pin let go and its blocks wanted, mid-save
            e.unpin(p)
            try:
                e.generate([prompts([120], seed=8)[0]], 2)
            except EngineError as err:           # the save holds them: no room (before, they were reused)
                assert isinstance(err.__cause__, CapacityError), err
            return write(*args, **kw)
        monkeypatch.setattr(saved, "write", racing_write)
        e.save_pin(p, tmp_path / "raced.ctx")
        monkeypatch.setattr(saved, "write", write)
        e.step()
        assert e.kv_manager.pool.num_pinned_blocks == 0          # the unpin and the save's hold both let go
    with make(llama) as e:
        stream, _ = e.load_pin(tmp_path / "raced.ctx")
        out = e.add_request(doc + [7, 8], NEW, output_scores=True)
        out.result()
        tokens, _ = hf(llama, doc + [7, 8])
        assert out.token_ids == tokens
        e.unpin(stream)
