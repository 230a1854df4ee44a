"""Ctrl-C (a KeyboardInterrupt at the places CPython delivers it: a function's entry), re-entry
from a streamer, threads sharing a model, and a generator dropped without close(): nothing is
left wrong, stalled or leaked."""
import gc
import os
import threading
import time

import pytest
import torch

from hetero import HeteroGenerator
from hetero.ipc import control as C
from hetero.ipc.pool import WorkerPool
from hetero.offload.session import KVSession
from tests.conftest import our_segments, padded_batch

KW = dict(do_sample=False, pad_token_id=0)


class Once:
    """Replace obj.name by a function raising KeyboardInterrupt on the call when(*args) first holds."""

    def __init__(self, monkeypatch, obj, name, when=lambda *a, **k: True):
        real, self.fired = getattr(obj, name), False

        def wrapper(*args, **kwargs):
            if not self.fired and when(*args, **kwargs):
                self.fired = True
                raise KeyboardInterrupt
            return real(*args, **kwargs)

        monkeypatch.setattr(obj, name, wrapper)


def hf(model, ids, new):
    model.set_attn_implementation("sdpa")
    return model.generate(ids, max_new_tokens=new, **KW)


@pytest.mark.parametrize("extend", [False, True])
def test_ctrl_c_at_the_end_of_a_context_call_puts_the_context_back(llama, monkeypatch, extend):
    """The interrupt comes in the call's closing ping: the context is rewound to what it held (it
    used to keep the call's rows, and every later answer over it was silently wrong)."""
    g = torch.Generator().manual_seed(3)
    doc, q, q2 = (torch.randint(3, 160, (n,), generator=g) for n in (40, 6, 9))
    with HeteroGenerator(llama, cpu_workers=1) as gen, gen.prefill(doc[None]) as ctx:
        Once(monkeypatch, KVSession, "end_call")
        with pytest.raises(KeyboardInterrupt):
            gen.generate(q[None], context=ctx, extend_context=extend, max_new_tokens=4)
        monkeypatch.undo()
        assert ctx.length == len(ctx.tokens) == 40
        out = gen.generate(q2[None], context=ctx, max_new_tokens=5, **KW)
    assert torch.equal(out, hf(llama, torch.cat([doc, q2])[None], 5))


def test_ctrl_c_before_a_job_is_posted_does_not_stall_the_next_call(llama, monkeypatch):
    """Between the job's bookkeeping and its GO words: the next call posts it again (a worker that
    saw it ignores the repeat) instead of waiting worker_timeout for a job nobody runs."""
    ids, mask = padded_batch()
    with HeteroGenerator(llama, cpu_workers=1) as gen:
        gen.generate(ids, attention_mask=mask, max_new_tokens=2, **KW)
        Once(monkeypatch, WorkerPool, "_post", lambda pool, go, active: go & ((1 << C.CMD_BITS) - 1) == C.CMD_CLOSE)
        with pytest.raises(KeyboardInterrupt):
            gen.generate(ids, attention_mask=mask, max_new_tokens=3, **KW)     # its session's close job
        monkeypatch.undo()
        assert gen._pool.inflight is not None                                  # posted nowhere
        t = time.perf_counter()
        out = gen.generate(ids, attention_mask=mask, max_new_tokens=3, **KW)
        assert time.perf_counter() - t < 2.0 < gen.config.worker_timeout
    assert torch.equal(out, (llama.set_attn_implementation("sdpa"), llama.generate(
        ids, attention_mask=mask, max_new_tokens=3, **KW))[1])


@pytest.mark.parametrize("job", [C.CMD_OPEN, C.CMD_CLOSE])
def test_ctrl_c_while_a_session_opens_or_closes_leaks_nothing(llama, monkeypatch, job):
    """In the wait for the open job (the workers may be mapping the arena: it is unmapped there
    before it is unlinked), or before the close job: the arena is unlinked, the next call runs."""
    ids, mask = padded_batch()
    with HeteroGenerator(llama, cpu_workers=1) as gen:
        if job == C.CMD_OPEN:
            Once(monkeypatch, WorkerPool, "wait", lambda pool, *a, **k: pool.words[C.CMD] == C.CMD_OPEN)
        else:
            Once(monkeypatch, WorkerPool, "run", lambda pool, cmd, *a, **k: cmd == job)
        with pytest.raises(KeyboardInterrupt):
            gen.generate(ids, attention_mask=mask, max_new_tokens=2, **KW)
        monkeypatch.undo()
        assert not [n for n in our_segments(os.getpid()) if n.endswith("_kv")]
        assert gen.generate(ids, attention_mask=mask, max_new_tokens=2, **KW).shape == (3, 14)   # usable


def test_close_or_save_from_inside_a_call_is_refused(llama, tmp_path):
    ids, mask = padded_batch()
    with HeteroGenerator(llama, cpu_workers=1) as gen, gen.prefill(ids[:1]) as ctx:
        errors = []

        class Streamer:
            def put(self, value):
                for action in (gen.close, lambda: ctx.save(tmp_path / "c.ctx")):
                    try:
                        action()
                    except RuntimeError as e:
                        errors.append(str(e))

            def end(self):
                pass

        gen.generate(ids[:1, :3], context=ctx, extend_context=False, max_new_tokens=2, streamer=Streamer(), **KW)
        assert len(errors) == 6 and all("from inside a call" in e for e in errors)
        assert not (tmp_path / "c.ctx").exists() and not gen._closed


def test_two_generators_over_one_model_take_turns(llama):
    """The model's attention implementation is set per call: a second generator's call from
    another thread while the first runs waits for it (it used to fail with a misleading error and
    leave the model on hetero's attention), then runs."""
    ids, mask = padded_batch()
    with HeteroGenerator(llama, cpu_workers=1) as a, HeteroGenerator(llama, cpu_workers=1) as b:
        seen, threads = [], []

        class Streamer:
            def put(self, value):
                if not threads:
                    t = threading.Thread(target=lambda: seen.append(b.generate(ids, attention_mask=mask,
                                                                               max_new_tokens=3, **KW)))
                    t.start()
                    threads.append(t)
                    t.join(0.5)
                    assert t.is_alive()        # waiting for the model, not refused

            def end(self):
                pass

        out = a.generate(ids, attention_mask=mask, max_new_tokens=3, streamer=Streamer(), **KW)
        threads[0].join(30)
        assert seen[0].tolist() == out.tolist()
    assert llama.config._attn_implementation == "sdpa"


def test_a_generator_dropped_without_close_frees_its_workers_and_segments(llama, monkeypatch):
    from hetero.ipc import pool as P

    monkeypatch.setattr(P, "REUSE", False)            # the default: the workers exit with their pool
    ids, mask = padded_batch()

    def request():
        gen = HeteroGenerator(llama, cpu_workers=1)
        ctx = gen.prefill(ids[:1])
        gen.generate(ids[:1, :2], context=ctx, max_new_tokens=2, **KW)
        return [p.pid for p in gen._pool.procs]

    before = set(our_segments(os.getpid()))
    pids = request() + request()
    gc.collect()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and any(os.path.exists(f"/proc/{p}") and _running(p) for p in pids):
        time.sleep(0.05)
    assert not any(_running(p) for p in pids)
    assert set(our_segments(os.getpid())) <= before


def _running(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False
