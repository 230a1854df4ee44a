"""generate() from several threads on one HeteroGenerator is never refused: overlapping calls join
the engine's batch (hetero.engine.calls) and return what HF generate returns for them; calls whose
settings the engine does not batch wait their turn; a call from inside a call still raises."""
import os
import signal
import threading
import time

import pytest
import torch

from hetero import HeteroConfig, HeteroGenerator
from hetero.errors import WorkerError
from tests.conftest import VOCAB, RaisingStreamer, our_segments, padded_batch


class Gate:
    """A streamer that holds the call on its n-th token until released (the call stays busy)."""

    def __init__(self, n=2):
        self.n, self.calls, self.tokens = n, 0, []
        self.started, self.release = threading.Event(), threading.Event()

    def put(self, value):
        self.calls += 1
        if self.calls > 1:
            self.tokens += value.flatten().tolist()
        if self.calls == self.n + 1:
            self.started.set()
            self.release.wait(30)

    def end(self):
        pass


def wait_for_engine(gen, n, timeout=30):
    """The generator's engine once n requests are queued in it (callers blocked on their streams)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        e = gen._engine.engine
        if e is not None and len(e._inbox) + len(e.scheduler.requests) >= n:
            return e
        time.sleep(0.01)
    raise AssertionError(f"{n} requests never reached the engine")


def rows(seed, *lengths):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (1, n), generator=g) for n in lengths]


def hf(model, ids, mask=None, **kw):
    return model.generate(ids, attention_mask=torch.ones_like(ids) if mask is None else mask, pad_token_id=0, **kw)


def test_overlapping_calls_join_the_engine_and_match_hf(llama):
    first, *others = rows(0, 30, 5, 44, 17, 9)
    ids, mask = padded_batch((12, 8, 5), seed=3)
    with HeteroGenerator(llama, cpu_workers=1) as gen:
        gate = Gate()
        out = {}
        t = threading.Thread(target=lambda: out.setdefault("first", gen.generate(
            first, max_new_tokens=10, pad_token_id=0, streamer=gate)))
        t.start()
        assert gate.started.wait(30)                 # the first call is inside HF's loop, holding the lock
        done = []

        def call(i, x):
            out[i] = gen.generate(x, max_new_tokens=8 + i, pad_token_id=0)
            done.append(i)

        threads = [threading.Thread(target=call, args=(i, x)) for i, x in enumerate(others)]
        threads.append(threading.Thread(target=lambda: out.setdefault("batch", gen.generate(
            ids, attention_mask=mask, max_new_tokens=7, pad_token_id=0, eos_token_id=None))))
        for th in threads:
            th.start()
        engine = wait_for_engine(gen, len(others) + 3)   # queued in the engine while the first call runs
        assert not done and engine.steps == 0            # its steps take the lock the first call holds
        gate.release.set()
        t.join(60)
        for th in threads:
            th.join(60)
        assert len(done) == len(others) and "batch" in out
        assert engine.steps < sum(8 + i for i in range(len(others)))    # one batch, not one call after another
        assert torch.equal(out["first"], hf(llama, first, max_new_tokens=10))
        for i, x in enumerate(others):
            assert torch.equal(out[i], hf(llama, x, max_new_tokens=8 + i)), i
        assert torch.equal(out["batch"], hf(llama, ids, mask, max_new_tokens=7, eos_token_id=None))
        assert engine.kv_manager.num_used_blocks == 0


def test_a_streamer_sees_each_token_and_eos_pads_like_hf(llama):
    x, y = rows(1, 20, 11)
    eos = hf(llama, y, max_new_tokens=6)[0, 11 + 2].item()        # the third token y generates
    with HeteroGenerator(llama, cpu_workers=1) as gen:
        gate = Gate()
        t = threading.Thread(target=lambda: gen.generate(x, max_new_tokens=6, pad_token_id=0, streamer=gate))
        t.start()
        assert gate.started.wait(30)
        seen = Gate(n=10 ** 6)
        ys = torch.cat([y, rows(2, 11)[0]])                            # a batch: one row stops early
        out = {}
        ths = [threading.Thread(target=lambda: out.update(
                   one=gen.generate(y, max_new_tokens=6, pad_token_id=0, streamer=seen))),
               threading.Thread(target=lambda: out.update(
                   batch=gen.generate(ys, max_new_tokens=6, pad_token_id=5, eos_token_id=eos)))]
        for th in ths:
            th.start()
        wait_for_engine(gen, 3)
        gate.release.set()
        t.join(60)
        for th in ths:
            th.join(60)
        assert gen._engine.engine.steps > 0
    assert torch.equal(out["one"], hf(llama, y, max_new_tokens=6))
    assert seen.tokens == out["one"][0, 11:].tolist()
    ref = llama.generate(ys, attention_mask=torch.ones_like(ys), max_new_tokens=6, pad_token_id=5, eos_token_id=eos)
    assert torch.equal(out["batch"], ref)
    assert (out["batch"][0, 11 + 3:] == 5).all()


def test_settings_the_engine_does_not_batch_wait_their_turn(llama):
    x, y = rows(4, 15, 9)
    with HeteroGenerator(llama, cpu_workers=1) as gen:
        gate = Gate()
        t = threading.Thread(target=lambda: gen.generate(x, max_new_tokens=5, pad_token_id=0, streamer=gate))
        t.start()
        assert gate.started.wait(30)
        out = {}
        th = threading.Thread(target=lambda: out.setdefault("dict", gen.generate(
            y, max_new_tokens=4, pad_token_id=0, return_dict_in_generate=True, output_scores=True)))
        th.start()
        th.join(1.0)
        assert th.is_alive()                          # waiting for the lock, not refused
        gate.release.set()
        t.join(60)
        th.join(60)
        ref = hf(llama, y, max_new_tokens=4, return_dict_in_generate=True, output_scores=True)
        assert torch.equal(out["dict"].sequences, ref.sequences)
        assert gen._engine.engine is None            # nothing joined an engine


def test_calls_reading_contexts_join_the_engine_over_their_pinned_copies(llama):
    """Overlapping calls that read contexts (context=[...], extend_context=False) join the engine:
    each context's whole blocks are copied into its pool once and pinned (not computed again),
    the calls return what HF generate returns over [context, new tokens], and a closed context's
    copy is released."""
    from tests.test_contexts import left_pad

    doc_a, doc_b, doc_c = (r[0] for r in rows(7, 70, 45, 20))
    qs = [r[0] for r in rows(8, 6, 11, 4, 9, 5)]
    with HeteroGenerator(llama, cpu_workers=1) as gen:
        ctx_a, ctx_b, ctx_c = (gen.prefill(d[None]) for d in (doc_a, doc_b, doc_c))   # c: no whole block
        gate = Gate()
        first, = rows(9, 12)
        t = threading.Thread(target=lambda: gen.generate(first, max_new_tokens=6, pad_token_id=0, streamer=gate))
        t.start()
        assert gate.started.wait(30)
        ids, mask = left_pad(qs[:3] + qs[4:])
        out = {}
        ths = [threading.Thread(target=lambda: out.update(batch=gen.generate(
                   ids, attention_mask=mask, context=[ctx_a, ctx_b, ctx_a, ctx_c], max_new_tokens=7, pad_token_id=0))),
               threading.Thread(target=lambda: out.update(one=gen.generate(
                   qs[3][None], context=ctx_b, extend_context=False, max_new_tokens=5, pad_token_id=0)))]
        for th in ths:
            th.start()
        engine = wait_for_engine(gen, 1)                  # a context copy queued: taken between calls
        gate.release.set()
        t.join(60)
        for th in ths:
            th.join(60)
        assert engine.steps > 0
        pins = engine.kv_manager.pool.num_pinned_blocks
        assert pins == 70 // 32 + 45 // 32                # each context's whole blocks, pinned once
        assert engine.kv_manager.prefix_hits >= 2 * 64 + 32 + 32
        full_ids, full_mask = left_pad([torch.cat([doc_a, qs[0]]), torch.cat([doc_b, qs[1]]),
                                        torch.cat([doc_a, qs[2]]), torch.cat([doc_c, qs[4]])])
        assert torch.equal(out["batch"], llama.generate(full_ids, attention_mask=full_mask, max_new_tokens=7,
                                                        pad_token_id=0))
        assert torch.equal(out["one"], hf(llama, torch.cat([doc_b, qs[3]])[None], max_new_tokens=5))
        # read, not changed; their KV lives in the pool alone now: whole blocks there, the rest pending
        assert ctx_a.pooled and ctx_b.pooled and not ctx_c.pooled and ctx_c.length == 20
        assert torch.equal(ctx_a.tokens, doc_a) and ctx_a.length == 64 and ctx_b.length == 32
        ctx_a.close()
        engine.step()                                     # the unpin is taken at the next step
        assert engine.kv_manager.pool.num_pinned_blocks == 45 // 32


@pytest.fixture
def engine_always(monkeypatch):
    """Every generate() call joins the engine, as if another call ran."""
    from hetero.routing import CallLock

    monkeypatch.setattr(CallLock, "busy_elsewhere", property(lambda self: True))


def test_new_weights_never_read_kv_the_engine_cached_under_the_old(engine_always):
    """Weights changed in place (a training step) between two contexts over one document: the
    second call gets HF's tokens under the new weights, not the first context's pinned blocks."""
    from tests.conftest import build_model

    model = build_model("llama")[0]
    doc, q = rows(10, 70, 6)
    full = torch.cat([doc, q], 1)
    with HeteroGenerator(model, cpu_workers=1) as gen:
        ctx1 = gen.prefill(doc)
        out = gen.generate(q, context=ctx1, extend_context=False, max_new_tokens=6, pad_token_id=0)
        first = gen._engine.engine
        assert first.steps > 0 and torch.equal(out, hf(model, full, max_new_tokens=6))
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.k_proj.weight.mul_(3.0)
        ctx2 = gen.prefill(doc)
        out = gen.generate(q, context=ctx2, extend_context=False, max_new_tokens=6, pad_token_id=0)
        assert torch.equal(out, hf(model, full, max_new_tokens=6))
        assert gen._engine.engine is not first            # a new engine: the old one's cache was stale


def test_a_context_the_engine_reads_lives_in_its_pool_alone_and_comes_back_for_hf_s_loop(tmp_path, monkeypatch):
    """A context read by a call that joins the engine moves there: its whole blocks pinned in the
    pool and its arena closed (its segment gone), so its KV is held once. Later reads use the pin
    (also alone: no other call runs); a call that needs HF's loop over it (extending it) brings it
    back into an arena with the room it had, and save() does too; a context whose engine was
    replaced (a dead worker) is computed again. Every answer is HF generate's over [context, new
    tokens]; close() and the generator's close() leave nothing pinned or mapped."""
    from tests.conftest import build_model

    model = build_model("llama")[0]
    doc, q1, q2, q3 = rows(14, 70, 6, 5, 4)
    before = set(our_segments(os.getpid()))
    with HeteroGenerator(model, cpu_workers=1) as gen:
        ctx = gen.prefill(doc, reserve=64)
        cap, arena = ctx.capacity, {n for n in our_segments(os.getpid()) if n.endswith("_kv")}   # its arena
        nbytes = ctx.session.layout.nbytes
        from hetero.routing import CallLock

        def read(q, new=5):
            """A read that joins the engine, as when another call runs."""
            with monkeypatch.context() as m:
                m.setattr(CallLock, "busy_elsewhere", property(lambda self: True))
                return gen.generate(q, context=ctx, extend_context=False, max_new_tokens=new, pad_token_id=0)

        assert torch.equal(read(q1), hf(model, torch.cat([doc, q1], 1), max_new_tokens=5))
        engine = gen._engine.engine
        assert ctx.pooled and ctx.session is None and ctx.length == 64 and ctx.capacity == cap
        assert torch.equal(ctx.tokens, doc[0]) and "in the engine's pool" in repr(ctx)
        assert engine.kv_manager.pool.num_pinned_blocks == 2
        assert arena and not arena & set(our_segments(os.getpid()))     # the context's arena is gone
        # alone, a read stays in the pool: no copy, the pin read again
        steps = engine.steps
        out = gen.generate(q2, context=ctx, extend_context=False, max_new_tokens=5, pad_token_id=0)
        assert torch.equal(out, hf(model, torch.cat([doc, q2], 1), max_new_tokens=5))
        assert engine.steps > steps and ctx.pooled and engine.kv_manager.pool.num_pinned_blocks == 2
        # a prompt starting with it (reuse_contexts) goes where it lives: the engine finds its blocks
        hits, full = engine.kv_manager.prefix_hits, torch.cat([doc, q2], 1)
        assert torch.equal(gen.generate(full, max_new_tokens=5, pad_token_id=0), hf(model, full, max_new_tokens=5))
        assert engine.kv_manager.prefix_hits == hits + 64
        # extending it goes on where it lives: the engine computes the turn and pins the longer prefix
        out = gen.generate(q3, context=ctx, max_new_tokens=4, pad_token_id=0)
        full = torch.cat([doc, q3], 1)
        assert torch.equal(out, hf(model, full, max_new_tokens=4))
        assert ctx.pooled and torch.equal(ctx.tokens, out[0]) and ctx.length == 64      # 77 tokens: 2 blocks
        # a call the engine does not batch runs HF's loop over an arena: back out of the pool, with its room
        res = gen.generate(q1, context=ctx, extend_context=False, max_new_tokens=3, pad_token_id=0,
                           return_dict_in_generate=True, output_scores=True)
        assert torch.equal(res.sequences, hf(model, torch.cat([out, q1], 1), max_new_tokens=3))
        assert not ctx.pooled and ctx.capacity == cap and torch.equal(ctx.tokens, out[0])
        assert ctx.session.layout.nbytes == nbytes        # the arena it had (context_memory counts it so)
        engine.step()                                     # the unpin is taken at the next step
        assert engine.kv_manager.pool.num_pinned_blocks == 0
        # extended alone in its arena: HF's loop, as before
        before_turn = torch.cat([ctx.tokens[None], q3], 1)
        out = gen.generate(q3, context=ctx, max_new_tokens=3, pad_token_id=0)
        assert not ctx.pooled and torch.equal(out, hf(model, before_turn, max_new_tokens=3))
        # read again (into the pool), then saved from there and loaded: the same answer
        out = read(q2)
        want = hf(model, torch.cat([out[0, :len(ctx.tokens)][None], q2], 1), max_new_tokens=5)
        assert ctx.pooled and torch.equal(out, want)
        ctx.save(tmp_path / "ctx.bin")
        assert not ctx.pooled
        loaded = gen.load_context(tmp_path / "ctx.bin")
        assert torch.equal(gen.generate(q2, context=loaded, extend_context=False, max_new_tokens=5,
                                        pad_token_id=0), want)
        loaded.close()
        # a dead worker: the engine is replaced and the context, pooled in the old one, computed again
        read(q1, 2)
        assert ctx.pooled
        os.kill(gen._pool.procs[0].pid, signal.SIGKILL)
        gen._pool.procs[0].wait()
        out = gen.generate(q1, context=ctx, extend_context=False, max_new_tokens=5, pad_token_id=0)
        assert torch.equal(out, hf(model, torch.cat([ctx.tokens[None], q1], 1), max_new_tokens=5))
        assert gen._engine.engine is not engine and not ctx.pooled   # computed again into an arena
        read(q1, 2)
        assert ctx.pooled                                 # in the new engine's pool
        # the engine replaced again (a dead worker) with the context pooled in the old one: the
        # generator's close still closes it (and a save after that raises, nothing mapped again)
        engine = gen._engine.engine
        os.kill(gen._pool.procs[0].pid, signal.SIGKILL)
        gen._pool.procs[0].wait()
        try:
            gen.generate(q1, max_new_tokens=3, pad_token_id=0)       # a new pool, and a new engine
        except WorkerError:
            pass
        with monkeypatch.context() as m:                  # a call that joins the engine: a new one
            m.setattr(CallLock, "busy_elsewhere", property(lambda self: True))
            gen.generate(q1, max_new_tokens=3, pad_token_id=0)
        assert gen._engine.engine is not engine and ctx.pooled
    assert ctx.closed                                     # the generator's close closed it
    with pytest.raises(ValueError, match="closed"):
        ctx.save(tmp_path / "after.bin")
    assert set(our_segments(os.getpid())) == before


def test_a_prefill_while_others_run_is_computed_in_the_engine_and_lives_in_its_pool(engine_always, tmp_path):
    """prefill() while other calls run joins the engine (its steps go on; no arena): the Context
    lives in the pool from the start, answers as HF over [document, new tokens], extends there,
    saves (through an arena with the room prefill gave it), and closes leaving no pin."""
    from tests.conftest import build_model

    model = build_model("llama")[0]
    doc, q1, q2 = rows(16, 75, 6, 5)
    with HeteroGenerator(model, cpu_workers=1) as gen:
        ctx = gen.prefill(doc, reserve=40)
        engine = gen._engine.engine
        assert ctx.pooled and ctx.session is None and ctx.length == 64 and torch.equal(ctx.tokens, doc[0])
        assert ctx.capacity == 128 and engine.kv_manager.pool.num_pinned_blocks == 2
        out = gen.generate(q1, context=ctx, extend_context=False, max_new_tokens=5, pad_token_id=0)
        assert torch.equal(out, hf(model, torch.cat([doc, q1], 1), max_new_tokens=5))
        out = gen.generate(q2, context=ctx, max_new_tokens=4, pad_token_id=0)      # extends, in the engine
        assert torch.equal(out, hf(model, torch.cat([doc, q2], 1), max_new_tokens=4))
        assert ctx.pooled and ctx.capacity == 128 and torch.equal(ctx.tokens, out[0])
        ctx.save(tmp_path / "c.bin")                      # into an arena (the room prefill gave it)
        assert not ctx.pooled and ctx.capacity == 128 and torch.equal(ctx.tokens, out[0])
        ctx.close()
        engine.step()
        assert engine.kv_manager.pool.num_pinned_blocks == 0
        short = gen.prefill(doc[:, :20])                  # no whole block: an arena, as alone
        assert not short.pooled and short.length == 20


def test_conversations_extended_from_threads_go_on_in_the_engine_exactly(engine_always):
    """Chat-style turns (generate(new, context=ctx), extending it) from threads while others run
    join the engine: each turn's sequences are HF generate's over the whole conversation so far,
    and two threads extending one context take turns (each turn sees the other's: one serial
    order), the context ending as the last turn's sequence."""
    from tests.conftest import build_model

    model = build_model("llama")[0]
    docs = [r for r in rows(18, 70, 40)]
    turns = rows(19, 5, 7, 4, 6, 3, 5)
    with HeteroGenerator(model, cpu_workers=1) as gen:
        ctxs = [gen.prefill(d) for d in docs]
        assert all(c.pooled for c in ctxs)
        outs, errors = {}, []

        def chat(i):
            try:
                for k, t in enumerate(turns[3 * i:3 * i + 3]):
                    before = ctxs[i].tokens.clone()
                    out = gen.generate(t, context=ctxs[i], max_new_tokens=4, pad_token_id=0)
                    outs[(i, k)] = (before, t, out)
            except BaseException as e:
                errors.append(e)

        ths = [threading.Thread(target=chat, args=(i,)) for i in range(2)]
        for th in ths:
            th.start()
        for th in ths:
            th.join(120)
        assert not errors, errors
        for (i, k), (before, t, out) in outs.items():
            assert torch.equal(out, hf(model, torch.cat([before[None], t], 1), max_new_tokens=4)), (i, k)
        for i in range(2):
            assert ctxs[i].pooled and torch.equal(ctxs[i].tokens, outs[(i, 2)][2][0])
        # one context, two threads at once: one turn after the other
        ctx, res = ctxs[0], []
        start = ctx.tokens.clone()
        ths = [threading.Thread(target=lambda t=t: res.append(gen.generate(t, context=ctx, max_new_tokens=3,
                                                                           pad_token_id=0))) for t in turns[:2]]
        for th in ths:
            th.start()
        for th in ths:
            th.join(120)
        first, second = sorted(res, key=lambda o: o.shape[1])
        assert torch.equal(first[0, :len(start)], start) and torch.equal(second[0, :first.shape[1]], first[0])
        assert torch.equal(ctx.tokens, second[0])
        for o in (first, second):
            assert torch.equal(o, hf(model, o[:, :-3], max_new_tokens=3))


@pytest.mark.parametrize("model_type", ["gemma2", "gemma3_text"])
def test_a_mixed_window_context_in_the_pool_comes_back_into_an_arena_exactly(model_type, engine_always):
    """Gemma 2/3 (windowed layers beside full ones, a 6-token window): a context prefilled in the
    engine keeps only its windowed layers' last window in the pool; a call that needs HF's loop
    over it brings it back into an arena (those layers' rows from that window on) and answers as
    HF, scores included; then it extends there."""
    from tests.conftest import build_model

    model = build_model(model_type)[0]
    doc, q = rows(13, 75, 6)
    with HeteroGenerator(model, cpu_workers=1) as gen:
        ctx = gen.prefill(doc, reserve=60)
        assert ctx.pooled
        out = gen.generate(q, context=ctx, extend_context=False, max_new_tokens=4, pad_token_id=0,
                           return_dict_in_generate=True, output_scores=True)
        ref = model.generate(torch.cat([doc, q], 1), max_new_tokens=4, pad_token_id=0, return_dict_in_generate=True,
                             output_scores=True)
        assert not ctx.pooled and torch.equal(out.sequences, ref.sequences)
        assert max(float((a - b).abs().max()) for a, b in zip(out.scores, ref.scores)) < 1e-4
        with pytest.MonkeyPatch.context() as m:          # alone: extended in its arena, by HF's loop
            from hetero.routing import CallLock
            m.setattr(CallLock, "busy_elsewhere", property(lambda self: False))
            out = gen.generate(q, context=ctx, max_new_tokens=4, pad_token_id=0)
        assert not ctx.pooled and torch.equal(out, ref.sequences)


def test_load_context_while_others_run_loads_into_the_engine_s_pool(monkeypatch, tmp_path):
    """A context file a generator saved (75 tokens: two whole blocks and 11 rows more) loads into
    the engine's pool while other calls run (Engine.load_pin takes a generator's file: its whole
    blocks, the rest pending), a Context living there that answers as HF; a file with no whole
    block gets a clear ContextFileError from the engine and loads into an arena through
    load_context; another model's file is refused by name either way."""
    from hetero import Engine, EngineConfig
    from hetero.errors import ContextFileError
    from hetero.routing import CallLock
    from tests.conftest import build_model

    model = build_model("llama")[0]
    doc, q = rows(17, 75, 6)
    with HeteroGenerator(model, cpu_workers=1) as gen:
        gen.prefill(doc).save(tmp_path / "doc.bin")
        gen.prefill(doc[:, :20]).save(tmp_path / "short.bin")
        monkeypatch.setattr(CallLock, "busy_elsewhere", property(lambda self: True))
        ctx = gen.load_context(tmp_path / "doc.bin", reserve=20)
        assert ctx.pooled and ctx.length == 64 and torch.equal(ctx.tokens, doc[0]) and ctx.capacity == 96
        out = gen.generate(q, context=ctx, extend_context=False, max_new_tokens=5, pad_token_id=0)
        assert torch.equal(out, hf(model, torch.cat([doc, q], 1), max_new_tokens=5))
        with pytest.raises(ContextFileError, match="no whole block"):
            gen._engine.engine.load_pin(tmp_path / "short.bin")
        short = gen.load_context(tmp_path / "short.bin")
        assert not short.pooled and short.length == 20
        other = build_model("llama", seed=1)[0]
        with HeteroGenerator(other, cpu_workers=1) as gen2, pytest.raises(ContextFileError, match="weights"):
            gen2.load_context(tmp_path / "doc.bin")
    with Engine(model, EngineConfig(background=False, cpu_workers=1, kv_blocks=16, max_model_len=256)) as eng:
        pin, _ = eng.load_pin(tmp_path / "doc.bin")          # the engine alone, a generator's file
        assert len(pin.pinned_blocks) == 2
        s = eng.add_request(doc[0].tolist() + q[0].tolist(), 5)
        while not s.finished:
            eng.step()
        assert s.cached_tokens == 64 and s.token_ids == hf(model, torch.cat([doc, q], 1), max_new_tokens=5)[0, 81:].tolist()


def test_a_mixed_window_models_context_is_copied_into_both_of_the_engines_pools(monkeypatch):
    """Gemma 2 (a windowed layer beside a full one): a context read through the engine is copied
    into the full layers' pool and the windowed layers' (hetero.engine.kv_hybrid) and the call
    returns HF's tokens over [context, new tokens]."""
    from tests.conftest import build_model

    model = build_model("gemma2", sliding_window=40)[0]
    doc, q = rows(12, 70, 6)
    with HeteroGenerator(model, cpu_workers=1) as gen:
        ctx = gen.prefill(doc, reserve=16)               # 96 rows: the arena keeps every row (no ring)
        assert not ctx.session.layout.ring_layers
        from hetero.routing import CallLock

        monkeypatch.setattr(CallLock, "busy_elsewhere", property(lambda self: True))    # the read joins the engine
        out = gen.generate(q, context=ctx, extend_context=False, max_new_tokens=6, pad_token_id=0)
        kv = gen._engine.engine.kv_manager
        assert kv.pool.num_pinned_blocks == 2 and kv.windowed.pool.num_pinned_blocks == 2
        assert torch.equal(out, hf(model, torch.cat([doc, q], 1), max_new_tokens=6))


def test_a_context_copy_queued_when_a_step_fails_or_closed_meanwhile_leaves_nothing_waiting(llama, engine_always,
                                                                                           monkeypatch):
    """A context's copy queued in the engine when its step fails is refused (the call then runs
    HF's loop), and a context closed while its copy is made leaves no block pinned."""
    from hetero import EngineError
    from hetero.engine import engine as E, runner

    from hetero.routing import CallLock

    doc, q = rows(11, 70, 6)
    full = torch.cat([doc, q], 1)
    with HeteroGenerator(llama, cpu_workers=1) as gen:
        with monkeypatch.context() as m:                  # prefilled alone: an arena, copied by the read
            m.setattr(CallLock, "busy_elsewhere", property(lambda self: False))
            ctx = gen.prefill(doc)
        inside = threading.Event()

        def failing(self, plan):
            inside.set()
            time.sleep(1)
            raise RuntimeError("simulated failure mid-forward")

        monkeypatch.setattr(runner.ModelRunner, "execute", failing)
        res = {}

        def plain_call():                                 # joins the engine, whose step fails under it
            try:
                gen.generate(q, max_new_tokens=4, pad_token_id=0)
            except EngineError as e:
                res["plain"] = e

        plain = threading.Thread(target=plain_call)
        plain.start()
        assert inside.wait(30)
        reader = threading.Thread(target=lambda: res.setdefault("ctx", gen.generate(
            q, context=ctx, extend_context=False, max_new_tokens=4, pad_token_id=0)))
        reader.start()
        plain.join(30)
        reader.join(30)
        assert not reader.is_alive() and "simulated failure" in str(res["plain"])   # the copy refused, not lost
        assert torch.equal(res["ctx"], hf(llama, full, max_new_tokens=4))    # HF's loop ran it
        monkeypatch.undo()
        monkeypatch.setattr(type(gen._calls), "busy_elsewhere", property(lambda self: True))
        pin_kv = E.Engine.pin_kv

        def closing(self, snapshot, adapter=None, then=None):   # the context closes while its copy is made
            stream = pin_kv(self, snapshot, adapter)            # (not moved into the pool: closed anyway)
            result = stream.result

            def then_close(*a):
                out = result(*a)
                t = threading.Thread(target=ctx.close)
                t.start()
                t.join()
                return out
            stream.result = then_close
            return stream

        monkeypatch.setattr(E.Engine, "pin_kv", closing)
        gen.generate(q, context=ctx, extend_context=False, max_new_tokens=4, pad_token_id=0)
        engine = gen._engine.engine
        engine.step()
        assert ctx.closed and engine.kv_manager.pool.num_pinned_blocks == 0 and not len(gen._engine._pins)


def test_a_call_from_inside_a_call_still_raises(llama):
    x, = rows(5, 10)
    with HeteroGenerator(llama, cpu_workers=1) as gen:
        class Nested:
            error = None

            def put(self, value):
                if Nested.error is None:
                    try:
                        gen.generate(x, max_new_tokens=2, pad_token_id=0)
                    except RuntimeError as e:
                        Nested.error = e

            def end(self):
                pass

        gen.generate(x, max_new_tokens=3, pad_token_id=0, streamer=Nested())
        assert "from inside a call" in str(Nested.error)


def test_many_threads_and_close_leave_nothing(llama):
    before = set(our_segments(os.getpid()))
    prompts = rows(6, *[3 + 5 * i for i in range(8)])
    refs = [hf(llama, p, max_new_tokens=6) for p in prompts]
    with HeteroGenerator(llama, config=HeteroConfig(cpu_workers=1)) as gen:
        outs = [None] * len(prompts)

        def call(i):
            outs[i] = gen.generate(prompts[i], max_new_tokens=6, pad_token_id=0)

        threads = [threading.Thread(target=call, args=(i,)) for i in range(len(prompts))]
        for th in threads:
            th.start()
        for th in threads:
            th.join(120)
        for o, r in zip(outs, refs):
            assert torch.equal(o, r)
    assert set(our_segments(os.getpid())) == before
    with pytest.raises(Exception, match="closed"):
        gen.generate(prompts[0], max_new_tokens=2)


def test_engine_sampling_fills_in_hf_s_default_top_k(llama, engine_always):
    """Sampling with no top_k through the engine: transformers fills in its default (top_k=50 where
    the generation_config leaves it None) before building its warpers, and so does the engine."""
    x = rows(3, 9)[0]
    with HeteroGenerator(llama, cpu_workers=1) as gen:
        for seed in range(4):
            torch.manual_seed(seed)
            ref = hf(llama, x, max_new_tokens=8, do_sample=True)
            torch.manual_seed(seed)
            assert torch.equal(gen.generate(x, max_new_tokens=8, pad_token_id=0, do_sample=True), ref), seed


@pytest.mark.parametrize("setting", [dict(min_length=13), dict(no_repeat_ngram_size=1),
                                     dict(encoder_no_repeat_ngram_size=1), dict(encoder_repetition_penalty=0.2)])
def test_settings_that_see_a_batch_s_pads_match_hf_over_a_padded_batch(llama, engine_always, setting):
    """A left-padded batch whose settings see its pads or its padded width in HF's loop (min_length
    counts the padded width; n-gram bans and the encoder penalty read the pad ids) runs HF's loop,
    not the engine (whose requests hold their real tokens): HF's sequences. The pad id is a token
    the short row generates, the eos its 2nd token."""
    ids, mask = padded_batch((12, 8, 5), seed=1)
    base = llama.generate(ids, attention_mask=mask, max_new_tokens=6, pad_token_id=0)
    pad, eos = int(base[2, 12]), int(base[2, 13])
    ids = ids.masked_fill(mask == 0, pad)
    kw = dict(max_new_tokens=6, pad_token_id=pad, eos_token_id=eos, **setting)
    ref = llama.generate(ids, attention_mask=mask, **kw)
    with HeteroGenerator(llama, cpu_workers=1) as gen:
        assert torch.equal(gen.generate(ids, attention_mask=mask, **kw), ref)


def test_int32_ids_through_the_engine_come_back_int64_as_from_hf(llama, engine_always):
    x = rows(4, 7)[0].int()
    ref = llama.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=5, pad_token_id=0)
    with HeteroGenerator(llama, cpu_workers=1) as gen:
        out = gen.generate(x, max_new_tokens=5, pad_token_id=0)
    assert out.dtype == ref.dtype == torch.int64 and torch.equal(out, ref)


def test_a_raising_processor_fails_its_own_call_alone(llama, engine_always):
    """Two calls in the engine's batch: B's logits processor raises at its 3rd token. B gets its own
    ValueError (as from HF's loop); A, running beside it, gets HF's tokens; the engine serves on."""
    from transformers import LogitsProcessor, LogitsProcessorList

    class Boom(LogitsProcessor):
        def __init__(self):
            self.n = 0

        def __call__(self, ids, scores):
            self.n += 1
            if self.n == 3:
                raise ValueError("B's processor")
            return scores

    a, b = rows(5, 9, 7)
    ref = hf(llama, a, max_new_tokens=120)
    out = {}
    with HeteroGenerator(llama, cpu_workers=1) as gen:
        first = threading.Event()

        class Signal:
            def put(self, value):
                first.set()

            def end(self):
                pass

        th = threading.Thread(target=lambda: out.setdefault("A", gen.generate(
            a, max_new_tokens=120, pad_token_id=0, streamer=Signal())))
        th.start()
        assert first.wait(30)
        with pytest.raises(ValueError, match="B's processor"):
            gen.generate(b, max_new_tokens=20, pad_token_id=0, logits_processor=LogitsProcessorList([Boom()]))
        assert gen._engine.engine.has_unfinished        # A was running beside it
        th.join(60)
        assert torch.equal(out["A"], ref)
        assert torch.equal(gen.generate(b, max_new_tokens=4, pad_token_id=0), hf(llama, b, max_new_tokens=4))
        assert gen._engine.engine.kv_manager.num_used_blocks == 0


def test_a_raising_streamer_stops_its_request_in_the_engine(llama, engine_always):
    """A streamer that raises ends its call with that error, as in HF's loop, and its request stops
    at once instead of running to max_new_tokens for nobody."""
    with HeteroGenerator(llama, cpu_workers=1) as gen:
        with pytest.raises(KeyError, match="streamer"):
            gen.generate(rows(6, 8)[0], max_new_tokens=200, pad_token_id=0, streamer=RaisingStreamer(3, KeyError("streamer")))
        eng = gen._engine.engine
        deadline = time.monotonic() + 5
        while eng.has_unfinished and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not eng.has_unfinished and eng.kv_manager.num_used_blocks == 0
        assert eng.steps <= 10           # stopped at once (it would end by an eos after ~44 tokens)


def test_a_call_waiting_while_the_generator_closes_starts_no_pool(llama):
    """A call waiting for the lock (settings the engine does not batch) while another thread
    closes the generator: either it ran before the close, or it raises GeneratorClosedError; no
    worker pool or segment outlives the close."""
    from hetero.errors import GeneratorClosedError

    x, y = rows(5, 9, 7)
    before = set(our_segments(os.getpid()))
    gen = HeteroGenerator(llama, cpu_workers=1)
    gate, out = Gate(), {}

    def run(key, f):
        try:
            out[key] = f()
        except BaseException as e:
            out[key] = e

    holder = threading.Thread(target=run, args=("h", lambda: gen.generate(x, max_new_tokens=6, pad_token_id=0,
                                                                          streamer=gate)))
    holder.start()
    assert gate.started.wait(60)
    closer = threading.Thread(target=gen.close)
    closer.start()
    time.sleep(0.3)
    waiter = threading.Thread(target=run, args=("w", lambda: gen.generate(y, max_new_tokens=5, pad_token_id=0,
                                                                          return_dict_in_generate=True)))
    waiter.start()
    time.sleep(0.3)
    gate.release.set()
    for th in (closer, holder, waiter):
        th.join(60)
    assert isinstance(out["w"], GeneratorClosedError) or torch.equal(out["w"].sequences,
                                                                     hf(llama, y, max_new_tokens=5))
    gen.close()
    assert gen._pool is None and set(our_segments(os.getpid())) <= before


def test_calls_in_the_engine_when_the_generator_closes_raise_and_a_late_joiner_does_not_hang(llama):
    """close() while calls decode in the engine: each raises GeneratorClosedError (before: a
    shorter tensor, as if finished). close() while an HF-loop call holds the lock, and a call made
    after close() began: it builds no engine (whose step would wait for the lock close() holds,
    and close() for its thread: a deadlock); it runs HF's loop, or raises GeneratorClosedError."""
    from hetero.errors import GeneratorClosedError

    p = rows(9, 8)[0]
    gen = HeteroGenerator(llama, config=HeteroConfig(cpu_workers=1))
    gate = Gate(n=2)
    out = {}

    def run(name, **kw):
        try:
            out[name] = gen.generate(p, max_new_tokens=kw.pop("new", 150), pad_token_id=0, **kw)
        except Exception as e:
            out[name] = e
    held = threading.Thread(target=run, args=("held",), kwargs=dict(new=4, streamer=gate))
    held.start()                              # holds a call (HF's loop: a streamer alone) on its 2nd token
    assert gate.started.wait(30)
    joined = [threading.Thread(target=run, args=(f"e{i}",)) for i in range(2)]
    for th in joined:
        th.start()
    wait_for_engine(gen, 2)
    closer = threading.Thread(target=gen.close)
    closer.start()
    time.sleep(0.3)
    late = threading.Thread(target=run, args=("late",), kwargs=dict(new=8))
    late.start()
    time.sleep(0.3)
    gate.release.set()
    for th in joined + [held, closer, late]:
        th.join(60)
        assert not th.is_alive(), "a thread hangs"
    for name in ("e0", "e1"):
        assert isinstance(out[name], GeneratorClosedError), (name, out[name])
    # the late call ran HF's loop: it took the lock before close() (then it is whole) or after
    late = out["late"]
    assert isinstance(late, GeneratorClosedError) or torch.equal(late, hf(llama, p, max_new_tokens=8)), late


def test_a_call_the_pins_leave_no_room_for_runs_hf_s_loop(llama, engine_always):
    """Contexts read through the engine stay pinned in its pool; once they leave a call no room
    (the scheduler refuses it after submit let it by), the call runs HF's loop and gives HF's
    tokens, never an EngineError (generate() is never refused)."""
    from hetero import EngineConfig

    cfg = HeteroConfig(cpu_workers=1, engine=EngineConfig(max_num_seqs=2, max_model_len=128))   # 8 blocks
    docs = rows(11, 64, 64, 64)
    q = rows(12, 3)[0]
    p = rows(13, 60)[0]
    with HeteroGenerator(llama, config=cfg) as gen:
        ctxs = [gen.prefill(d) for d in docs]
        for c in ctxs:                        # each read pins its context's 2 blocks in the engine's pool
            gen.generate(q, context=c, extend_context=False, max_new_tokens=2, pad_token_id=0)
        assert gen._engine.engine.kv_manager.pool.num_pinned_blocks == 6
        out = gen.generate(p, max_new_tokens=30, pad_token_id=0)
        assert torch.equal(out, hf(llama, p, max_new_tokens=30))
        for c in ctxs:
            c.close()


def test_saving_a_context_while_another_thread_extends_it_in_the_engine(llama, engine_always, tmp_path):
    """ctx.save() while a call extends the context in the engine waits for it (extend_lock): the
    context stays one thing (before: an arena of the old length beside the new pin and tokens, and
    every later save wrote a file load_context refused as corrupted)."""
    ctx_prompt, q = rows(14, 70, 3)
    with HeteroGenerator(llama, config=HeteroConfig(cpu_workers=1)) as gen:
        ctx = gen.prefill(ctx_prompt)
        gen.generate(rows(15, 2)[0], context=ctx, extend_context=False, max_new_tokens=3, pad_token_id=0)
        assert ctx.pooled                      # read through the engine: it lives in its pool

        class Slow:                            # keeps the extending call in the engine a while
            def put(self, value):
                time.sleep(0.01)

            def end(self):
                pass
        out = {}
        ext = threading.Thread(target=lambda: out.setdefault("ext", gen.generate(
            q, context=ctx, max_new_tokens=40, pad_token_id=0, streamer=Slow())))
        ext.start()
        time.sleep(0.2)
        ctx.save(tmp_path / "a.ctx")
        ext.join(60)
        assert ctx.length == len(ctx.token_ids)         # its KV rows are its tokens: one thing
        ctx.save(tmp_path / "b.ctx")
        with gen.load_context(tmp_path / "b.ctx") as again:
            assert torch.equal(again.token_ids, ctx.token_ids)
        ctx.close()
