"""Contexts (HeteroGenerator.prefill): a request's KV kept in shared memory between calls. Each
call continuing a context must give what HF generate gives on the whole conversation so far."""
import contextlib
import os
import threading

import pytest
import torch

from hetero import CapacityError, HeteroConfig, HeteroGenerator
from tests.conftest import VOCAB, RaisingStreamer, build_model, our_segments

KW = dict(do_sample=False, pad_token_id=0, return_dict_in_generate=True, output_scores=True)


def hf(model, ids, new):
    return model.generate(ids[None], attention_mask=torch.ones_like(ids)[None], max_new_tokens=new, **KW)


def turns(seed, *lengths):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=g) for n in lengths]


@pytest.mark.parametrize("model_type,chunk", [("llama", None), ("mistral", 4), ("gemma2", None)])
def test_multi_turn_context_matches_hf_on_the_whole_conversation(model_type, chunk):
    """prefill a document, then three turns: each turn's new message (longer than a continuation
    piece in one turn) is prefilled over the cached KV on the workers and decoded; tokens and
    scores equal HF generate over [document, turn 1, answer 1, ..., turn k]."""
    model, _ = build_model(model_type)
    doc, *msgs = turns(1, 40, 7, 19, 1)
    with HeteroGenerator(model, config=HeteroConfig(cpu_workers=2, prefill_chunk=chunk)) as gen:
        ctx = gen.prefill(doc[None], reserve=120)
        assert ctx.length == 40 and torch.equal(ctx.tokens, doc)
        history = doc
        for msg, new in zip(msgs, (5, 6, 4)):
            conv = torch.cat([history, msg])
            ref = hf(model, conv, new)
            out = gen.generate(msg[None], context=ctx, max_new_tokens=new, **KW)
            assert torch.equal(out.sequences, ref.sequences)                 # starts with the conversation
            for a, b in zip(out.scores, ref.scores):
                torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
            history = out.sequences[0]
            assert torch.equal(ctx.tokens, history) and ctx.length == len(history) - 1    # last token pending
        ctx.close()
        ctx.close()                                                           # idempotent


def test_contexts_interleave_with_each_other_and_with_plain_generate(llama):
    """Two contexts and one-shot generates alternate on one pool (it maps one session at a time)."""
    a_doc, b_doc, a_msg, b_msg, plain = turns(2, 30, 25, 6, 5, 12)
    with HeteroGenerator(llama, cpu_workers=2) as gen:
        a, b = gen.prefill(a_doc[None]), gen.prefill(b_doc[None])
        out_plain = gen.generate(plain[None], max_new_tokens=4, **KW)
        out_b = gen.generate(b_msg[None], context=b, max_new_tokens=4, **KW)
        out_a = gen.generate(a_msg[None], context=a, max_new_tokens=4, **KW)
        assert torch.equal(out_plain.sequences, hf(llama, plain, 4).sequences)
        assert torch.equal(out_a.sequences, hf(llama, torch.cat([a_doc, a_msg]), 4).sequences)
        assert torch.equal(out_b.sequences, hf(llama, torch.cat([b_doc, b_msg]), 4).sequences)
        assert len(our_segments(os.getpid())) >= 2                           # both arenas alive
        a.close()
        with pytest.raises(ValueError, match="open Context"):
            gen.generate(a_msg[None], context=a, max_new_tokens=2)
    assert b.closed                                                           # closed with the generator


def test_context_capacity_and_bad_input(llama):
    doc, msg = turns(3, 20, 5)
    with HeteroGenerator(llama, cpu_workers=1) as gen:
        with gen.prefill(doc[None], reserve=8) as ctx:                        # 28 rows -> one block of 32
            assert ctx.capacity == 32
            with pytest.raises(CapacityError, match="reserve"):
                gen.generate(msg[None], context=ctx, max_new_tokens=10)
            # read-only, the call needs no room in the context: it runs in an arena of its own, as HF
            out = gen.generate(msg[None], context=ctx, extend_context=False, max_new_tokens=10, **KW)
            assert torch.equal(out.sequences, hf(llama, torch.cat([doc, msg]), 10).sequences)
            assert ctx.length == 20 and ctx.capacity == 32
            with pytest.raises(ValueError, match="padded"):          # the single-context checks still apply
                gen.generate(torch.cat([torch.zeros(1, dtype=torch.long), msg])[None], context=ctx,
                             attention_mask=torch.cat([torch.zeros(1, dtype=torch.long), torch.ones_like(msg)])[None],
                             extend_context=False, max_new_tokens=10)
            out = gen.generate(msg[None], context=ctx, max_new_tokens=3, pad_token_id=0)
            assert out.shape[1] == 28
            with pytest.raises(ValueError, match="one request"):
                gen.generate(torch.stack([msg, msg]), context=ctx, max_new_tokens=2)
        with pytest.raises(ValueError, match="one request"):
            gen.prefill(torch.stack([doc, doc]))
        with pytest.raises(ValueError, match="padded"):
            gen.prefill(doc[None], attention_mask=torch.cat([torch.zeros(1, 1, dtype=torch.long),
                                                              torch.ones(1, 19, dtype=torch.long)], 1))
    with pytest.raises(ValueError, match="open Context"):
        with HeteroGenerator(llama, cpu_workers=1) as other:
            other.generate(msg[None], context=ctx, max_new_tokens=2)


def test_context_survives_a_dead_worker(llama):
    """A worker killed between calls: the next call replaces the pool, which maps the context's
    arena again (the KV lives in the parent's segment, not in the workers), and gives HF's tokens."""
    import signal

    doc, msg = turns(4, 33, 6)
    with HeteroGenerator(llama, cpu_workers=2) as gen:
        ctx = gen.prefill(doc[None])
        old = gen._pool
        os.kill(old.procs[0].pid, signal.SIGKILL)
        old.procs[0].wait()
        out = gen.generate(msg[None], context=ctx, max_new_tokens=4, **KW)
        assert gen._pool is not old and ctx.session.pool is gen._pool
        assert torch.equal(out.sequences, hf(llama, torch.cat([doc, msg]), 4).sequences)


def test_a_worker_killed_during_a_contexts_prefill_is_named_as_such(llama):
    """A worker dies in the middle of a chunked prefill: the error places the death in the
    prefill's job (not in the session's close job sent afterwards to the broken pool), nothing of
    the context is left, and the next prefill runs on a new pool and continues as HF."""
    import signal

    from hetero import WorkerDiedError

    doc, msg = turns(8, 40, 5)
    with HeteroGenerator(llama, config=HeteroConfig(cpu_workers=1, prefill_chunk=8)) as gen:
        before = set(our_segments(os.getpid()))
        calls = [0]

        def kill(*_):
            calls[0] += 1
            if calls[0] == 3:                      # the third chunk attends over cached KV on the worker
                os.kill(gen._pool.procs[0].pid, signal.SIGKILL)
                gen._pool.procs[0].wait()
        hook = llama.model.layers[0].register_forward_pre_hook(kill)
        try:
            with pytest.raises(WorkerDiedError) as raised:
                gen.prefill(doc[None])
        finally:
            hook.remove()
        assert "close job" not in str(raised.value) and raised.value.__context__ is None
        assert set(our_segments(os.getpid())) <= before and not gen._contexts
        with gen.prefill(doc[None]) as ctx:
            out = gen.generate(msg[None], context=ctx, max_new_tokens=3, **KW)
        assert torch.equal(out.sequences, hf(llama, torch.cat([doc, msg]), 3).sequences)


@pytest.mark.parametrize("model_type", ["llama", "mistral"])
def test_questions_over_one_document_leave_it_unchanged(model_type):
    """extend_context=False: every question reads the document's KV and leaves it as it was, so
    each answer equals HF over [document, that question]. mistral: window 6, pieces of 4 tokens,
    so its ring keeps 64 rows, and the 62-token question wraps it over rows the document's
    window still needs: they must be put back."""
    model, _ = build_model(model_type)
    doc, *questions = turns(5, 45, 9, 62, 5)
    config = HeteroConfig(cpu_workers=2, prefill_chunk=4)
    with HeteroGenerator(model, config=config) as gen, gen.prefill(doc[None]) as ctx:
        assert model_type != "mistral" or ctx.session.layout.ring == 64
        for q in questions:
            out = gen.generate(q[None], context=ctx, extend_context=False, max_new_tokens=5, **KW)
            ref = hf(model, torch.cat([doc, q]), 5)
            assert torch.equal(out.sequences, ref.sequences)
            for a, b in zip(out.scores, ref.scores):
                torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
            assert ctx.length == 45 and torch.equal(ctx.tokens, doc)


@pytest.mark.parametrize("model_type,dtype", [("llama", torch.float32), ("mistral", torch.bfloat16)])
def test_saved_context_loads_without_prefill_and_continues_exactly(tmp_path, model_type, dtype):
    """save after a turn, load into a new generator: same tokens, the same KV rows, and the next
    turn's output equals the original context's (and HF's in fp32); mistral keeps only its
    window's rows (the file holds those: with 4-token pieces its ring, 64 rows, is shorter than
    the context)."""
    from hetero.offload import saved
    model, _ = build_model(model_type, dtype=dtype)
    doc, msg, nxt = turns(6, 50, 7, 5)
    path = tmp_path / "doc.ctx"
    config = HeteroConfig(cpu_workers=2, prefill_chunk=4 if model_type == "mistral" else None)
    with HeteroGenerator(model, config=config) as gen:
        ctx = gen.prefill(doc[None])
        gen.generate(msg[None], context=ctx, max_new_tokens=4, **KW)
        ctx.save(path)
        tokens, pending = ctx.token_ids.clone(), ctx.pending.clone()
        expect = gen.generate(nxt[None], context=ctx, max_new_tokens=5, **KW)
    starts = {lay["start"] for lay in saved.read_header(path)["layers"]}
    assert starts == ({32} if model_type == "mistral" else {0})            # 60 rows; window 6 -> from 32
    with HeteroGenerator(model, config=config) as gen:
        loaded = gen.load_context(path)
        assert torch.equal(loaded.token_ids, tokens) and torch.equal(loaded.pending, pending)
        assert loaded.length == len(tokens) and len(pending) == 1
        got = gen.generate(nxt[None], context=loaded, max_new_tokens=5, **KW)
    assert torch.equal(got.sequences, expect.sequences)
    for a, b in zip(got.scores, expect.scores):
        torch.testing.assert_close(a, b, atol=0, rtol=0)                    # the same KV: bit-identical
    if dtype == torch.float32:
        assert torch.equal(got.sequences, hf(model, got.sequences[0, :-5], 5).sequences)


def test_bad_context_files_raise_and_leave_nothing(tmp_path, llama):
    from hetero import ContextFileError

    doc = turns(7, 40)[0]
    good = tmp_path / "good.ctx"
    with HeteroGenerator(llama, cpu_workers=1) as gen:
        with gen.prefill(doc[None]) as ctx:
            ctx.save(good)
        data = good.read_bytes()
        before = set(our_segments(os.getpid()))
        token = data.index(b'"tokens": [') + len(b'"tokens": [')         # a digit of the first token id
        cases = {"truncated": data[:-100], "not a context": b"hello" * 100,
                 "corrupted": data[:-10] + bytes(b ^ 0xFF for b in data[-10:]),
                 "corrupted token": data[:token] + (b"9" if data[token:token + 1] != b"9" else b"8") + data[token + 1:],
                 "corrupted header": data.replace(b'"length"', b'"lenxth"', 1),
                 "corrupted fingerprint": _with_header(data, fingerprint="x")}
        for what, blob in cases.items():
            bad = tmp_path / f"{what}.ctx"
            bad.write_bytes(blob)
            with pytest.raises(ContextFileError, match="truncated|bad magic|corrupted") as raised:
                gen.load_context(bad)
            if what == "not a context":               # said once, not wrapped in "corrupted header (...)"
                assert str(raised.value) == f"{bad} is not a saved hetero context (bad magic)"
            assert set(our_segments(os.getpid())) == before                 # nothing half-loaded
        other, _ = build_model("llama", seed=1)                             # same shape, other weights
        with HeteroGenerator(other, cpu_workers=1) as gen2:
            with pytest.raises(ContextFileError, match="another model: weights_sha256"):
                gen2.load_context(good)
        with pytest.raises(ContextFileError, match="cannot read"):
            gen.load_context(tmp_path / "missing.ctx")
    # the same weights under another RoPE base: other keys, so the KV would be wrong
    moved, _ = build_model("llama", rope_parameters={"rope_type": "default", "rope_theta": 500.0})
    with HeteroGenerator(moved, cpu_workers=1) as gen3:
        with pytest.raises(ContextFileError, match="another config: rope_parameters"):
            gen3.load_context(good)


def test_an_out_of_vocabulary_token_in_a_context_file_is_the_files_error(tmp_path, llama):
    """A token id past the vocabulary in a saved context's header raised a ValueError about
    input_ids (the ids were checked as a prompt before the CRC). The CRC comes first: a corrupted
    id is named as corruption; an id the CRC covers (a file written so) as the file's, by name."""
    import json
    import zlib

    from hetero import ContextFileError
    from hetero.offload import saved

    doc = turns(30, 40)[0]
    good = tmp_path / "good.ctx"
    with HeteroGenerator(llama, cpu_workers=1) as gen:
        with gen.prefill(doc[None]) as ctx:
            gen.generate(doc[None, :3], context=ctx, max_new_tokens=2)       # a pending token too
            ctx.save(good)
        data = good.read_bytes()
        header = json.loads(data[24:24 + int.from_bytes(data[16:24], "little")])
        before = set(our_segments(os.getpid()))
        cases = [("tokens", VOCAB + 7, False, "is corrupted: CRC-32 .* over its header and payload"),
                 ("tokens", VOCAB + 7, True, f"holds token id {VOCAB + 7}, outside the model's vocabulary of {VOCAB}"),
                 ("pending", VOCAB, True, f"holds token id {VOCAB}, outside the model's vocabulary"),
                 ("tokens", 10 ** 30, True, f"holds token id {10 ** 30}, outside")]
        for i, (field, token, crc_holds, match) in enumerate(cases):
            ids = [token] + header[field][1:]
            fields = {field: ids}
            if crc_holds:                    # the CRC a file written with these ids would carry
                h = {**header, **fields}
                crc = saved._meta_crc(h)
                fields["crc32"] = zlib.crc32(data[-header["payload_bytes"]:], crc)
            bad = tmp_path / f"bad{i}.ctx"
            bad.write_bytes(_with_header(data, **fields))
            with pytest.raises(ContextFileError, match=match) as raised:
                gen.load_context(bad)
            assert str(raised.value).startswith(str(bad))
            assert set(our_segments(os.getpid())) == before                 # nothing half-loaded


def test_a_context_path_that_is_no_regular_file_is_refused_at_once(tmp_path, llama):
    """load_context on a FIFO (whose open waits for a writer: it hung), a directory or a device
    raises ContextFileError naming the path and what it is, without opening it."""
    from hetero import ContextFileError

    fifo = tmp_path / "ctx.fifo"
    os.mkfifo(fifo)
    with HeteroGenerator(llama, cpu_workers=1) as gen:
        before = set(our_segments(os.getpid()))
        for path, kind in ((fifo, "a FIFO"), (tmp_path, "a directory"), ("/dev/null", "a character device")):
            raised = []

            def load():
                try:
                    gen.load_context(path)
                except Exception as e:
                    raised.append(e)

            t = threading.Thread(target=load, daemon=True)
            t.start()
            t.join(20)
            if t.is_alive():                  # blocked in open(): a writer lets it go, so the test cannot hang
                with open(fifo, "wb"):
                    pass
                t.join(20)
                pytest.fail(f"load_context({path}) blocked")
            assert len(raised) == 1 and isinstance(raised[0], ContextFileError), raised
            assert str(raised[0]).startswith(f"{path} is not a regular file ({kind})")
        assert set(our_segments(os.getpid())) == before


def _with_header(data, **fields):
    """A saved context's bytes with header fields replaced: well-formed JSON, the length prefix
    and the payload's alignment kept (only the checks of the fields can refuse it)."""
    import json

    from hetero.offload import saved

    n = int.from_bytes(data[16:24], "little")
    header = json.loads(data[24:24 + n])
    offset = -(-(24 + n) // saved.ALIGN) * saved.ALIGN
    new = json.dumps({**header, **fields}).encode()
    head = saved.MAGIC + len(new).to_bytes(8, "little") + new
    return head + b"\0" * (-len(head) % saved.ALIGN) + data[offset:]


def test_context_memory_budget_evicts_unreferenced_contexts_first(llama):
    """HeteroConfig.context_memory: a new context closes contexts nobody references any more;
    when the referenced ones leave no room, CapacityError."""
    import gc

    doc = turns(8, 30)[0]
    with HeteroGenerator(llama, config=HeteroConfig(cpu_workers=1)) as probe:
        with probe.prefill(doc[None], reserve=30) as c:
            size = c.session.layout.nbytes
    with HeteroGenerator(llama, config=HeteroConfig(cpu_workers=1, context_memory=2 * size)) as gen:
        a = gen.prefill(doc[None], reserve=30)
        b = gen.prefill(doc[None], reserve=30)
        with pytest.raises(CapacityError, match="still referenced"):
            gen.prefill(doc[None], reserve=30)
        a_session = a.session
        del a
        gc.collect()
        c = gen.prefill(doc[None], reserve=30)                # a's arena is closed for it
        assert a_session.lengths is None and not b.closed and not c.closed
        out = gen.generate(turns(9, 4)[0][None], context=b, max_new_tokens=2, pad_token_id=0)
        assert out.shape[1] == 36
    with HeteroGenerator(llama, config=HeteroConfig(cpu_workers=1)) as probe:
        with probe.prefill(doc[None], reserve=200) as c:
            big = c.session.layout.nbytes
    assert big > size
    with HeteroGenerator(llama, config=HeteroConfig(cpu_workers=1, context_memory=(size + big) // 2)) as gen:
        kept = gen.prefill(doc[None], reserve=30).session                 # unreferenced: a prefix cache
        gc.collect()
        with pytest.raises(CapacityError, match="more than all of HeteroConfig.context_memory"):
            gen.prefill(doc[None], reserve=200)       # larger than the whole budget: refused, nothing evicted
        assert kept.lengths is not None
    with pytest.raises(ValueError, match="context_memory"):
        HeteroConfig(context_memory=0)


def test_a_call_that_fails_midway_leaves_the_context_consistent(llama):
    """A streamer raising after a few tokens: the call raises, the context is as before the call
    (no half-cached turn), and the next call equals HF over [document, message]."""
    doc, msg = turns(10, 40, 6)

    with HeteroGenerator(llama, cpu_workers=2) as gen, gen.prefill(doc[None]) as ctx:
        with pytest.raises(KeyboardInterrupt):
            gen.generate(msg[None], context=ctx, max_new_tokens=8, streamer=RaisingStreamer(4, KeyboardInterrupt()),
                         pad_token_id=0)
        assert ctx.length == 40 and torch.equal(ctx.tokens, doc)
        out = gen.generate(msg[None], context=ctx, max_new_tokens=5, **KW)
        assert torch.equal(out.sequences, hf(llama, torch.cat([doc, msg]), 5).sequences)


def test_saved_context_loads_into_a_smaller_ring(tmp_path):
    """Saved where mistral's layers keep every row (no ring: the capacity is below the ring size),
    loaded where they are rings of 64 rows (4-token pieces): only the window's rows go in, and the
    continuation equals HF."""
    model, _ = build_model("mistral")
    doc, msg = turns(11, 100, 5)
    path = tmp_path / "doc.ctx"
    with HeteroGenerator(model, cpu_workers=1) as gen, gen.prefill(doc[None], reserve=20) as ctx:
        assert ctx.session.layout.ring_layers == 0
        ctx.save(path)
    with HeteroGenerator(model, config=HeteroConfig(cpu_workers=1, prefill_chunk=4)) as gen:
        with gen.load_context(path) as ctx:
            assert ctx.session.layout.ring == 64
            out = gen.generate(msg[None], context=ctx, max_new_tokens=4, **KW)
    assert torch.equal(out.sequences, hf(model, torch.cat([doc, msg]), 4).sequences)


def test_batch_copies_from_a_context_kept_as_a_smaller_ring():
    """A context prefilled in 1-token pieces keeps mistral's layers as rings of 64 rows; a batch
    continuing it under a config with no ring (one-pass) copies the rows the context keeps."""
    model, _ = build_model("mistral", sliding_window=8)
    doc, msg = turns(15, 65, 27)
    with HeteroGenerator(model, config=HeteroConfig(cpu_workers=1, prefill_chunk=1)) as gen:
        ctx = gen.prefill(doc[None])
        assert ctx.session.layout.ring_layers
        gen.config = HeteroConfig(cpu_workers=1)
        out = gen.generate(torch.stack([msg, msg]), context=[ctx, ctx], max_new_tokens=3, **KW)
    ref = hf(model, torch.cat([doc, msg]), 3).sequences
    assert torch.equal(out.sequences, torch.cat([ref, ref]))


def test_extend_context_takes_a_bool_with_a_context(llama):
    ids = turns(16, 10)[0][None]
    with HeteroGenerator(llama, cpu_workers=1) as gen, gen.prefill(ids) as ctx:
        with pytest.raises(TypeError, match="extend_context"):
            gen.generate(ids, context=ctx, extend_context=0, max_new_tokens=2)
        with pytest.raises(ValueError, match="needs context="):
            gen.generate(ids, extend_context=True, max_new_tokens=2)


def test_unreferenced_contexts_are_freed_by_the_next_prefill(llama):
    import gc

    doc = turns(12, 20)[0]
    with HeteroGenerator(llama, cpu_workers=1) as gen:
        base = len(our_segments(os.getpid()))
        for _ in range(4):
            ctx = gen.prefill(doc[None], reserve=10)
        del ctx
        gc.collect()
        gen.prefill(doc[None], reserve=10).close()
        assert len(our_segments(os.getpid())) == base


def test_closed_context_says_so(llama):
    doc = turns(13, 10)[0]
    with HeteroGenerator(llama, cpu_workers=1) as gen:
        ctx = gen.prefill(doc[None], reserve=4)
    assert ctx.closed and "closed" in repr(ctx)
    with pytest.raises(ValueError, match="Context is closed"):
        _ = ctx.length
    with HeteroGenerator(llama, cpu_workers=1) as gen:
        ctx = gen.prefill(doc[None], reserve=4)
        ctx.close()
        for context in (ctx, [ctx]):
            with pytest.raises(ValueError, match="this one is closed .* a failed call"):
                gen.generate(doc[None], context=context, max_new_tokens=2)


def test_context_close_from_another_thread_waits_for_the_running_call(llama):
    """ctx.close() in another thread while a call on the context runs: it waits for the call
    (which completes correctly) instead of unmapping the arena under it; a nested call from a
    streamer is refused."""
    import threading
    import time

    doc, msg = turns(14, 30, 5)
    closed_at, ended = [], []

    class Slow:
        def put(self, value):
            time.sleep(0.05)

        def end(self):                      # the last thing the call does on the context's KV
            ended.append(time.perf_counter())

    with HeteroGenerator(llama, cpu_workers=1) as gen:
        ctx = gen.prefill(doc[None])
        closer = threading.Timer(0.1, lambda: (ctx.close(), closed_at.append(time.perf_counter())))
        closer.start()
        out = gen.generate(msg[None], context=ctx, max_new_tokens=6, streamer=Slow(), **KW)
        closer.join()
        assert closed_at and ended and closed_at[0] >= ended[0] and ctx.closed
        assert torch.equal(out.sequences, hf(llama, torch.cat([doc, msg]), 6).sequences)

        class Nested:
            def put(self, value):
                gen.generate(msg[None], max_new_tokens=1, pad_token_id=0)

            def end(self):
                pass

        with pytest.raises(RuntimeError, match="from inside a call"):
            gen.generate(msg[None], max_new_tokens=2, streamer=Nested(), pad_token_id=0)


def left_pad(rows):
    """[B, S] left-padded ids and mask of 1-D token tensors."""
    S = max(len(r) for r in rows)
    ids, mask = torch.zeros(len(rows), S, dtype=torch.long), torch.zeros(len(rows), S, dtype=torch.long)
    for b, r in enumerate(rows):
        ids[b, S - len(r):], mask[b, S - len(r):] = r, 1
    return ids, mask


def hf_batch(model, rows, new):
    ids, mask = left_pad(rows)
    return model.generate(ids, attention_mask=mask, max_new_tokens=new, **KW)


@pytest.mark.parametrize("model_type,chunk,share,overrides", [
    ("llama", None, True, {}), ("llama", 4, True, {}), ("llama", 4, False, {}),
    ("gemma2", 8, True, {"sliding_window": 512}), ("mistral", 4, True, {})])
def test_batch_of_questions_over_one_context(model_type, chunk, share, overrides):
    """context=[ctx] * B with questions of different lengths (left-padded): each request's tokens
    and scores equal HF over the left-padded batch [document, question b]. With chunk 4 the
    19-token question takes several pieces, and the 1-token one sits out the first pieces
    whole (session.skip). llama and gemma2 (soft-capped; its window longer than any sequence
    here) share the document's blocks in place (a 70-token document: 64 rows shared, 6 copied
    per request); share_contexts=False and mistral (a window of 6) copy it per request. The
    context is left as it was, and decoding after it equals HF again."""
    from hetero.offload.session import KVSession

    model, _ = build_model(model_type, **overrides)
    plans = []
    real_plan = KVSession._plan_step

    def spy(self, T):
        real_plan(self, T)
        plans.append((int(self.pstart.min()), self.psplit))
    doc, *qs = turns(7, 70, 5, 19, 1)
    config = HeteroConfig(cpu_workers=2, prefill_chunk=chunk, share_contexts=share)
    with HeteroGenerator(model, config=config) as gen, gen.prefill(doc[None], reserve=60) as ctx:
        ids, mask = left_pad(qs)
        KVSession._plan_step = spy
        try:
            out = gen.generate(ids, attention_mask=mask, context=[ctx] * 3, max_new_tokens=5, **KW)
        finally:
            KVSession._plan_step = real_plan
        shared = share and model_type != "mistral"
        assert all((p == 64 and ps >= 1) if shared else (p, ps) == (0, 0) for p, ps in plans)
        ref = hf_batch(model, [torch.cat([doc, q]) for q in qs], 5)
        assert torch.equal(out.sequences, ref.sequences)
        for a, b in zip(out.scores, ref.scores):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
        assert ctx.length == 70 and torch.equal(ctx.tokens, doc)
        one = gen.generate(qs[0][None], context=ctx, max_new_tokens=3, **KW)
        assert torch.equal(one.sequences, hf(model, torch.cat([doc, qs[0]]), 3).sequences)


def test_shared_prefix_is_read_in_place():
    """The batch's arena holds only the rows past the shared blocks: its K/V are (cap - prefix)
    rows per request, and the workers map the context's segment beside it (prefix units)."""
    model, _ = build_model("llama")
    doc, q1, q2 = turns(8, 100, 4, 6)
    made = []
    with HeteroGenerator(model, cpu_workers=2) as gen, gen.prefill(doc[None]) as ctx:
        ids, mask = left_pad([q1, q2])
        real = KVSessionSpy.install(made)
        try:
            out = gen.generate(ids, attention_mask=mask, context=[ctx, ctx], max_new_tokens=4, **KW)
        finally:
            KVSessionSpy.remove(real)
        lay = made[-1].layout
        assert lay.groups == 1 and lay.private == 32 and lay.cap == 128 and lay.nparts == 2 * lay.nsplit_max
        assert lay.kv_bytes * 3 < ctx.session.layout.kv_bytes      # 2 requests x 32 rows vs the document's 1152
        ref = hf_batch(model, [torch.cat([doc, q1]), torch.cat([doc, q2])], 4)
        assert torch.equal(out.sequences, ref.sequences)


def test_batch_of_different_contexts():
    """context=[a, b, a, c]: two shared-prefix groups in one batch (a: requests 0 and 2, with a
    pending token from a turn before; b: request 1), each reading its context in place, and c
    (shorter than a block) copied; equal to HF over [each request's conversation, its
    question]. share_contexts=False copies each."""
    model, _ = build_model("qwen3")
    a_doc, b_doc, c_doc, a_msg, q0, q1, q2, q3 = turns(9, 40, 70, 20, 5, 3, 8, 2, 6)
    with HeteroGenerator(model, cpu_workers=2) as gen, gen.prefill(a_doc[None]) as a, \
            gen.prefill(b_doc[None]) as b, gen.prefill(c_doc[None]) as c:
        gen.generate(a_msg[None], context=a, max_new_tokens=3, **KW)
        assert len(a.pending) == 1
        ids, mask = left_pad([q0, q1, q2, q3])
        ref = hf_batch(model, [torch.cat([a.tokens, q0]), torch.cat([b_doc, q1]), torch.cat([a.tokens, q2]),
                               torch.cat([c_doc, q3])], 4)
        made = []
        for share in (True, False):
            gen.config = HeteroConfig(cpu_workers=2, share_contexts=share)
            real = KVSessionSpy.install(made)
            try:
                out = gen.generate(ids, attention_mask=mask, context=[a, b, a, c], max_new_tokens=4, **KW)
            finally:
                KVSessionSpy.remove(real)
            assert made[-1].layout.groups == (2 if share else 0)
            assert made[-1].layout.private == (made[-1].layout.cap if share else 0)    # c's request: no prefix
            assert torch.equal(out.sequences, ref.sequences)
            for x, y in zip(out.scores, ref.scores):
                torch.testing.assert_close(x, y, atol=1e-4, rtol=1e-4)


def test_batch_of_contexts_bad_input(llama):
    doc, q = turns(10, 40, 4)
    before = set(our_segments(os.getpid()))            # a shared generator's, when another test made it
    with HeteroGenerator(llama, cpu_workers=1) as gen:
        ctx, other = gen.prefill(doc[None]), gen.prefill(doc[None])
        ids = torch.stack([q, q])
        with pytest.raises(ValueError, match="2 requests"):
            gen.generate(ids, context=[ctx], max_new_tokens=2)
        with pytest.raises(ValueError, match="extend_context=True"):
            gen.generate(ids, context=[ctx, ctx], extend_context=True, max_new_tokens=2)
        with pytest.raises(ValueError, match="empty list"):
            gen.generate(ids, context=[], max_new_tokens=2)
        other.close()
        with pytest.raises(ValueError, match="open Contexts"):
            gen.generate(ids, context=[ctx, other], max_new_tokens=2)
        with pytest.raises(ValueError, match="open Contexts"):
            gen.generate(ids, context=[ctx, "doc"], max_new_tokens=2)
        closer = lambda *a, **k: ctx.close()                                    # noqa: E731
        with pytest.raises(RuntimeError, match="inside a call"):
            gen.generate(ids, context=[ctx, ctx], max_new_tokens=2, logits_processor=[closer])
        assert not ctx.closed
    assert set(our_segments(os.getpid())) <= before


def test_bf16_batch_sharing_a_context_matches_hf():
    """bf16 (the vdpbf16ps score path where the CPU has it): prefix units take every request's
    bf16 queries at once; tokens equal HF's over the left-padded batch, scores close."""
    model, _ = build_model("llama", dtype=torch.bfloat16)
    doc, *qs = turns(11, 90, 3, 7)
    with HeteroGenerator(model, cpu_workers=2) as gen, gen.prefill(doc[None]) as ctx:
        ids, mask = left_pad(qs)
        out = gen.generate(ids, attention_mask=mask, context=[ctx, ctx], max_new_tokens=4, **KW)
        ref = hf_batch(model, [torch.cat([doc, q]) for q in qs], 4)
        assert torch.equal(out.sequences, ref.sequences)
        for a, b in zip(out.scores, ref.scores):
            torch.testing.assert_close(a, b, atol=0.15, rtol=0.05)


def test_prompts_starting_with_a_live_context_reuse_it():
    """Automatic prefix reuse: a plain generate whose prompt starts with a live context's tokens
    continues that context read-only (no second prefill of the document) and returns HF's
    output; a batch whose rows all start with it shares it; a prompt that does not, or
    reuse_contexts=False, takes the ordinary path."""
    model, _ = build_model("llama")
    doc, q1, q2, other = turns(12, 70, 6, 3, 20)
    calls = []
    with HeteroGenerator(model, cpu_workers=2) as gen, gen.prefill(doc[None]) as ctx:
        real_one, real_many = gen._generate_in_context, gen._generate_in_contexts
        gen._generate_in_context = lambda *a, **k: calls.append("one") or real_one(*a, **k)
        gen._generate_in_contexts = lambda *a, **k: calls.append("many") or real_many(*a, **k)
        full = torch.cat([doc, q1])
        out = gen.generate(full[None], max_new_tokens=5, **KW)
        assert calls == ["one"] and torch.equal(out.sequences, hf(model, full, 5).sequences)
        assert ctx.length == 70 and torch.equal(ctx.tokens, doc)
        rows = [torch.cat([doc, q1]), torch.cat([doc, q2])]
        ids, mask = left_pad(rows)
        ids, mask = torch.cat([torch.zeros(2, 2, dtype=torch.long), ids], 1), \
            torch.cat([torch.zeros(2, 2, dtype=torch.long), mask], 1)          # a column of pads more than needed
        out = gen.generate(ids, attention_mask=mask, max_new_tokens=4, **KW)
        ref = model.generate(ids, attention_mask=mask, max_new_tokens=4, **KW)
        assert calls[-1] == "many" and torch.equal(out.sequences, ref.sequences)
        n = len(calls)
        gen.generate(other[None], max_new_tokens=3, **KW)
        assert len(calls) == n                                                   # no context to reuse
        gen.config = HeteroConfig(cpu_workers=2, reuse_contexts=False)
        out = gen.generate(full[None], max_new_tokens=5, **KW)
        assert len(calls) == n and torch.equal(out.sequences, hf(model, full, 5).sequences)


def test_unreferenced_contexts_are_a_prefix_cache_under_a_budget(llama):
    """With HeteroConfig.context_memory, a context nobody references stays as a prefix cache: a
    later prompt starting with its tokens continues it (HF's output, no new prefill), and when
    a new context needs room the least recently used unreferenced one is evicted first."""
    import gc

    docs = turns(13, 40, 40, 40, 40)
    q = turns(14, 5)[0]
    with HeteroGenerator(llama, config=HeteroConfig(cpu_workers=1)) as probe:
        with probe.prefill(docs[0][None], reserve=30) as c:
            size = c.session.layout.nbytes
    with HeteroGenerator(llama, config=HeteroConfig(cpu_workers=1, context_memory=3 * size)) as gen:
        sessions = [gen.prefill(d[None], reserve=30).session for d in docs[:3]]   # A, B, C: none kept
        gc.collect()
        assert all(s.lengths is not None for s in sessions)                      # still open: cached
        full = torch.cat([docs[0], q])
        made = []
        real = KVSessionSpy.install(made)
        try:
            out = gen.generate(full[None], max_new_tokens=4, **KW)                # reuses A, read-only
        finally:
            KVSessionSpy.remove(real)
        assert not made and torch.equal(out.sequences, hf(llama, full, 4).sequences)
        gc.collect()
        d = gen.prefill(docs[3][None], reserve=30)                                # room for D: B goes
        assert sessions[1].lengths is None
        assert sessions[0].lengths is not None and sessions[2].lengths is not None
        assert not d.closed


class KVSessionSpy:
    """Records every KVSession created while installed (a reused context creates none)."""

    @staticmethod
    def install(made):
        from hetero.offload.session import KVSession

        real = KVSession.__init__

        def spy(self, *a, **k):
            made.append(self)
            real(self, *a, **k)
        KVSession.__init__ = spy
        return real

    @staticmethod
    def remove(real):
        from hetero.offload.session import KVSession

        KVSession.__init__ = real


def test_more_contexts_than_groups_copy_the_rest():
    """Five different contexts in one batch: the largest MAX_GROUPS groups are read in place,
    the fifth context is copied; equal to HF."""
    from hetero.cpu_attention.kernel import MAX_GROUPS

    model, _ = build_model("llama")
    docs = turns(15, 40, 36, 50, 33, 45)
    qs = turns(16, 3, 5, 2, 4, 6)
    made = []
    with HeteroGenerator(model, cpu_workers=2) as gen:
        ctxs = [gen.prefill(d[None]) for d in docs]
        ids, mask = left_pad(qs)
        real = KVSessionSpy.install(made)
        try:
            out = gen.generate(ids, attention_mask=mask, context=ctxs, max_new_tokens=3, **KW)
        finally:
            KVSessionSpy.remove(real)
        assert made[-1].layout.groups == MAX_GROUPS == 4
        ref = hf_batch(model, [torch.cat([d, q]) for d, q in zip(docs, qs)], 3)
        assert torch.equal(out.sequences, ref.sequences)


def test_a_request_outside_every_group_never_merges_stale_prefix_slots(monkeypatch):
    """context=[a, c]: a (560 tokens) is a group, c (20 tokens, shorter than a block) is copied.
    The continuation's 40-token steps plan fewer prefix splits than the decode steps after them,
    so c's request must not merge slots it wrote itself a step before: equal to HF."""
    from hetero.offload.session import KVSession

    model, _ = build_model("qwen3", max_position_embeddings=1024)
    a_doc, c_doc, q0, q1 = turns(3, 560, 20, 40, 40)
    plans = []
    real = KVSession._plan_step
    monkeypatch.setattr(KVSession, "_plan_step", lambda self, T: real(self, T) or plans.append((T, self.psplit)))
    cfg = HeteroConfig(cpu_workers=2, profile="off", prefill_chunk=40)

    class ByStep:                        # 1 split for the continuation's steps, 2 for the decode's
        def plan(self, lengths, T, layout, parent=True):
            return 2, min(1 if T > 1 else 2, layout.nsplit_max)

    with HeteroGenerator(model, config=cfg) as gen, gen.prefill(a_doc[None]) as a, gen.prefill(c_doc[None]) as c:
        gen._planner = ByStep()
        ids, mask = left_pad([q0, q1])
        out = gen.generate(ids, attention_mask=mask, context=[a, c], max_new_tokens=6, **KW)
    assert len({p for T, p in plans if p}) > 1                    # psplit changes between steps
    ref = hf_batch(model, [torch.cat([a_doc, q0]), torch.cat([c_doc, q1])], 6)
    assert torch.equal(out.sequences, ref.sequences)
    for x, y in zip(out.scores, ref.scores):
        torch.testing.assert_close(x, y, atol=1e-4, rtol=1e-4)


def test_a_call_refused_before_any_kv_update_keeps_a_sliding_window_context():
    """A call extending a context that fails midway closes it when the model has sliding-window
    rings (a ring may have wrapped over rows it still needs); one that transformers refuses as it
    starts (temperature=0 with sampling), before any KV update, leaves it open and exact (a
    message longer than a piece is fed before transformers starts: such a call still closes it)."""
    model, _ = build_model("mistral")                            # window 6; 4-token pieces: rings of 64 rows
    doc, msg = turns(21, 45, 3)
    with HeteroGenerator(model, config=HeteroConfig(cpu_workers=1, prefill_chunk=4)) as gen:
        ctx = gen.prefill(doc[None])
        assert ctx.session.layout.ring_layers
        with pytest.raises(ValueError, match="temperature"):
            gen.generate(msg[None], context=ctx, max_new_tokens=4, do_sample=True, temperature=0.0)
        assert not ctx.closed
        out = gen.generate(msg[None], context=ctx, extend_context=False, max_new_tokens=4, **KW)
        assert torch.equal(out.sequences, hf(model, torch.cat([doc, msg]), 4).sequences)

        def stop_at_third_step(ids, scores):
            if ids.shape[1] >= 45 + 3 + 2:
                raise RuntimeError("stop")
            return scores

        with pytest.raises(RuntimeError, match="stop"):
            gen.generate(msg[None], context=ctx, max_new_tokens=4, logits_processor=[stop_at_third_step], **KW)
        assert ctx.closed


def test_a_context_made_in_inference_mode_is_used_outside_it(llama):
    """A context prefilled (or a generator built) inside torch.inference_mode() continues outside
    it, as a normal tensor would: its shared-memory views are not inference tensors."""
    doc, msg = turns(22, 30, 5)
    with torch.inference_mode():
        gen = HeteroGenerator(llama, cpu_workers=1)
        ctx = gen.prefill(doc[None])
    with gen:
        out = gen.generate(msg[None], context=ctx, max_new_tokens=4, **KW)
        assert torch.equal(out.sequences, hf(llama, torch.cat([doc, msg]), 4).sequences)
    with torch.inference_mode():                         # a model built there: inference-tensor weights
        model = build_model("llama")[0]
    with HeteroGenerator(model, cpu_workers=1) as gen, gen.prefill(doc[None]) as ctx:
        out = gen.generate(msg[None], context=ctx, max_new_tokens=4, **KW)
        assert torch.equal(out.sequences, hf(model, torch.cat([doc, msg]), 4).sequences)


def test_a_huge_prefill_chunk_does_not_size_a_small_contexts_staging(llama):
    """prefill_chunk=N sizes a context's staging for pieces of N tokens, but never past the
    context's own rows (a 30-token context with prefill_chunk=10**9 once asked for 47 GiB)."""
    doc, msg = turns(23, 30, 5)
    with HeteroGenerator(llama, config=HeteroConfig(cpu_workers=1, prefill_chunk=10 ** 9)) as gen, \
            gen.prefill(doc[None], reserve=12) as ctx:
        assert ctx.session.layout.tmax <= 30 + 12
        out = gen.generate(msg[None], context=ctx, max_new_tokens=4, **KW)
        assert torch.equal(out.sequences, hf(llama, torch.cat([doc, msg]), 4).sequences)


@pytest.mark.parametrize("change", ["in place", "data"])
def test_a_context_is_not_reused_after_the_weights_change(change):
    """Weights changed after a prefill (in place: a training step, load_state_dict; or through
    .data, as peft's merge writes): a prompt that starts with the live context's tokens is
    prefilled anew (HF's answer with the new weights), and continuing the context by name says
    its KV is stale."""
    model, _ = build_model("llama")
    doc, msg = turns(24, 30, 5)
    with HeteroGenerator(model, config=HeteroConfig(cpu_workers=1, context_memory=1 << 30)) as gen:
        ctx = gen.prefill(doc[None])
        w = model.model.layers[0].self_attn.k_proj.weight
        with torch.no_grad():
            if change == "in place":
                w.mul_(1.5)
            else:
                w.data = w.data * 1.5
        full = torch.cat([doc, msg])[None]
        out = gen.generate(full, max_new_tokens=4, **KW)
        assert torch.equal(out.sequences, hf(model, full[0], 4).sequences)
        for context in (ctx, [ctx]):
            with pytest.raises(ValueError, match="weights changed since this context was prefilled"):
                gen.generate(msg[None], context=context, max_new_tokens=2)
        del ctx                                                   # kept unreferenced as a prefix cache
        assert torch.equal(gen.generate(full, max_new_tokens=4, **KW).sequences, out.sequences)


def _one_row_retrained(model):
    """A copy of `model` whose embedding differs in one element of one row (37, 5), an element
    neither the old fingerprint's samples (the even ones here) nor the old staleness key's held."""
    import copy

    other = copy.deepcopy(model)
    with torch.inference_mode():
        other.get_input_embeddings().weight[37, 5] += 0.25
    return other


@pytest.mark.parametrize("mode", ["normal", "inference"])
def test_weights_one_element_apart_refuse_each_others_contexts(tmp_path, mode):
    """Two models whose weights differ in ONE element of one embedding row: (a) a live context made
    with the other weights (copied in place with load_state_dict) is stale, also for weights made
    inside torch.inference_mode() (no version counter tells their writes: their digest is taken
    at every call); (b) a context one saved does not load into the other (every element counts in
    the fingerprint: 8 or 4,096 samples per weight missed it, and the context continued wrongly)."""
    from hetero import ContextFileError

    with torch.inference_mode() if mode == "inference" else contextlib.nullcontext():
        model, _ = build_model("llama")
    other = _one_row_retrained(model)
    doc, msg = turns(31, 45, 5)
    path = tmp_path / "doc.ctx"
    with HeteroGenerator(model, config=HeteroConfig(cpu_workers=1)) as gen:
        with gen.prefill(doc[None]) as ctx:
            ctx.save(path)
            with gen.load_context(path) as loaded:                   # the same weights: it loads
                assert torch.equal(loaded.token_ids, doc)
            with HeteroGenerator(other, cpu_workers=1) as gen2:
                before = set(our_segments(os.getpid()))
                with pytest.raises(ContextFileError, match=f"{path} was saved from another model: weights_sha256"):
                    gen2.load_context(path)
                assert set(our_segments(os.getpid())) == before
            with torch.inference_mode() if mode == "inference" else torch.no_grad():
                model.load_state_dict(other.state_dict())
            for context in (ctx, [ctx]):
                with pytest.raises(ValueError, match="weights changed since this context was prefilled"):
                    gen.generate(msg[None], context=context, max_new_tokens=2)
            full = torch.cat([doc, msg])[None]                  # a prompt over its tokens: prefilled anew
            assert torch.equal(gen.generate(full, max_new_tokens=4, **KW).sequences,
                               hf(model, full[0], 4).sequences)
            with pytest.raises(ContextFileError, match="another model: weights_sha256"):
                gen.load_context(path)                                # the fingerprint sees the new weights too


def test_an_older_context_file_format_is_named(tmp_path, llama):
    """A file of format version 2 (its fingerprint sampled the weights) is refused by name."""
    from hetero import ContextFileError

    path = tmp_path / "old.ctx"
    with HeteroGenerator(llama, cpu_workers=1) as gen:
        with gen.prefill(turns(32, 20)[0][None]) as ctx:
            ctx.save(path)
        path.write_bytes(_with_header(path.read_bytes(), version=2))
        with pytest.raises(ContextFileError, match=rf"{path}: saved context format version 2, this hetero reads "
                                                   r"version 4 only \(an older hetero saved it: prefill"):
            gen.load_context(path)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.uint8])
def test_weight_digest_sees_every_element_and_is_the_same_on_any_device(dtype):
    """hetero.digest: any one element changed (here each of a few, in a tensor spanning several
    blocks and a short last one) changes the digest, rows swapped too; torch's ops (a GPU's) give
    numpy's (a CPU's) digest; a changed version or storage is seen, an unchanged one is looked up."""
    from hetero import digest

    t = (torch.randn(3 * digest.BLOCK + 77, generator=torch.Generator().manual_seed(0)) * 50).to(dtype)
    d = digest._digest(t)
    assert digest._digest(t, torch_ops=True) == d
    for i in (0, digest.BLOCK - 1, 2 * digest.BLOCK + 5, t.numel() - 1):
        u = t.clone()
        u[i] = (u[i].double() + 1).to(dtype)
        assert digest._digest(u) != d and digest._digest(u, torch_ops=True) == digest._digest(u)
    rows = t[:64 * 64].reshape(64, 64).clone()
    swapped = rows[[1, 0, *range(2, 64)]]
    assert digest._digest(swapped) != digest._digest(rows)
    p = torch.nn.Parameter(t.clone(), requires_grad=False)
    assert digest.weight_digest(p) == d and digest._cache[id(p)][1] == d
    with torch.no_grad():
        p[7] = (p[7].double() + 1).to(dtype)                  # in place: the version counter moves
    assert digest.weight_digest(p) != d
    p.data = t.clone()                                        # replaced: another storage
    assert digest.weight_digest(p) == d


def test_a_waiting_prefill_from_another_thread_closes_no_context_early(llama):
    """prefill() from a second thread while a call runs waits its turn (one call per generator) and
    leaves everything as it was until then: the contexts nobody references are closed under the
    call lock, when its turn comes, not while the running call uses the worker pool (closing one
    runs a job on it)."""
    doc, = turns(11, 20)
    started, release = threading.Event(), threading.Event()

    class Pause:                                 # holds the running call between two decode steps
        n = 0

        def put(self, value):
            self.n += 1
            if self.n == 3:
                started.set()
                release.wait(30)

        def end(self):
            pass

    before = set(our_segments(os.getpid()))
    with HeteroGenerator(llama, cpu_workers=1) as gen:
        gen.prefill(doc[None], reserve=8)        # dropped at once: unreferenced, kept until a sweep
        kept = len(gen._contexts)
        out = {}
        t = threading.Thread(target=lambda: out.setdefault("seq", gen.generate(
            doc[None], max_new_tokens=6, streamer=Pause(), **KW).sequences))
        t.start()
        try:
            assert started.wait(30)
            waiting = threading.Thread(target=lambda: out.setdefault("ctx", gen.prefill(doc[None], reserve=8)))
            waiting.start()
            waiting.join(0.5)
            assert waiting.is_alive()                   # a prefill waits for the call's turn to end
            assert len(gen._contexts) == kept == 1      # the unreferenced context is still open
        finally:
            release.set()
            t.join(30)
        waiting.join(30)
        out.pop("ctx").close()
        assert torch.equal(out["seq"], hf(llama, doc, 6).sequences)
        ctx = gen.prefill(doc[None], reserve=8)          # runs, and closes the dropped one first
        assert len(gen._contexts) == 1
        ctx.close()
    assert set(our_segments(os.getpid())) <= before


def test_a_context_file_whose_layers_do_not_fit_the_model_is_refused(tmp_path, llama):
    """A header listing fewer layers, or a full-attention layer kept from a later row, under a CRC
    that holds (written so): refused by name, not loaded as wrong KV."""
    import zlib

    from hetero import ContextFileError
    from hetero.offload import saved

    path = tmp_path / "doc.ctx"
    with HeteroGenerator(llama, cpu_workers=1) as gen:
        with gen.prefill(turns(40, 20)[0][None]) as ctx:
            ctx.save(path)
        data = path.read_bytes()
        header = saved.read_header(path)
        for layers in (header["layers"][:1], [{**header["layers"][0], "start": 32}] + header["layers"][1:]):
            h = {**header, "layers": layers}
            h["payload_bytes"] = sum(header["payload_bytes"] // len(header["layers"]) * (lay["rows"] - lay["start"])
                                     // lay["rows"] for lay in layers)
            payload = data[header["offset"]:header["offset"] + h["payload_bytes"]]
            fields = {"layers": layers, "payload_bytes": h["payload_bytes"],
                      "crc32": zlib.crc32(payload, saved._meta_crc(h))}
            bad = _with_header(data, **fields)
            n = int.from_bytes(bad[16:24], "little")
            offset = -(-(24 + n) // saved.ALIGN) * saved.ALIGN
            path.write_bytes(bad[:offset] + payload)
            with pytest.raises(ContextFileError, match="do not fit this model's"):
                gen.load_context(path)
