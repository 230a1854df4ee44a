"""Bad input, dead workers, exceptions and killed parents: clear errors, nothing leaked or hung."""
import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from hetero import compat
from hetero import (CapacityError, GeneratorClosedError, HeteroConfig, HeteroGenerator, UnsupportedModelError,
                    WorkerDiedError)
from hetero.ipc import shm
from tests.conftest import build_model, our_segments, padded_batch


def only_ctrl_segment(gen):
    """While a generator is idle only its pool's control segment exists."""
    return our_segments(os.getpid()) == [gen._pool.ctrl.name[1:]]


def test_bad_inputs_raise_and_generator_stays_usable(llama, llama_gen):
    ids, mask = padded_batch()
    good = llama_gen.generate(ids, attention_mask=mask, max_new_tokens=4, pad_token_id=0)
    bad_calls = [
        (ValueError, "empty prompt", dict(input_ids=torch.zeros(1, 0, dtype=torch.long))),
        (ValueError, "empty prompt", dict(input_ids=ids, attention_mask=torch.zeros_like(mask))),
        (ValueError, r"\[batch, seq_len\]", dict(input_ids=ids[0])),
        (TypeError, "integer token ids", dict(input_ids=ids.float())),
        (ValueError, "model is on cpu", dict(input_ids=ids.to("meta"))),
        (ValueError, "does not match", dict(input_ids=ids, attention_mask=mask[:, 1:])),
        (TypeError, "0/1", dict(input_ids=ids, attention_mask=mask.to(torch.complex64))),
        (ValueError, "only hold 0 and 1", dict(input_ids=ids, attention_mask=mask.float() * 0.5)),
        (ValueError, "only hold 0 and 1", dict(input_ids=ids, attention_mask=mask * 2)),
        (ValueError, "left-padded", dict(input_ids=ids, attention_mask=mask.flip(1))),
        (ValueError, "max_new_tokens", dict(input_ids=ids, max_new_tokens=0)),
        (ValueError, r"does not support {'num_beams': 4}", dict(input_ids=ids, num_beams=4)),
    ]
    for exc, msg, kw in bad_calls:
        kw = {"max_new_tokens": 4, **kw}
        with pytest.raises(exc, match=msg):
            llama_gen.generate(**kw)
        assert only_ctrl_segment(llama_gen)
    again = llama_gen.generate(ids, attention_mask=mask, max_new_tokens=4, pad_token_id=0)
    assert torch.equal(good, again)


def test_cache_capacity_and_ram_limits(llama):
    ids, mask = padded_batch()
    with HeteroGenerator(llama, config=HeteroConfig(cpu_workers=1, max_cache_tokens=16)) as gen:
        with pytest.raises(CapacityError, match=r"needs 21 KV rows .* max_cache_tokens=16"):
            gen.generate(ids, attention_mask=mask, max_new_tokens=10)
        gen.generate(ids, attention_mask=mask, max_new_tokens=5, pad_token_id=0)  # 16 rows fit: the last token's
        #                                                                           KV is never written
        with gen.prefill(ids[:1, 4:]) as ctx:                 # 8 tokens: the default reserve fits the cap
            assert ctx.capacity >= 16 and ctx.length == 8
    with HeteroGenerator(llama, config=HeteroConfig(cpu_workers=1, ram_fraction=1e-9)) as gen:
        with pytest.raises(CapacityError, match=r"needs .* GiB .*prompt's 12 \+ max_new_tokens=4, allocated up "
                                                r"front: a smaller max_new_tokens needs less\) but only .* GiB of RAM"):
            gen.generate(ids, attention_mask=mask, max_new_tokens=4)
        with pytest.raises(CapacityError, match=r"prompt's 8 \+ reserve=500, allocated up front: a smaller reserve"):
            gen.prefill(ids[:1, 4:], reserve=500)


def test_bad_config_values():
    for kw, msg in [({"cpu_workers": 0}, "cpu_workers"), ({"ram_fraction": 2}, "ram_fraction"),
                    ({"worker_cores": (10**6,)}, "not usable"), ({"max_cache_tokens": -1}, "max_cache_tokens"),
                    ({"cpu_workers": 4 * os.cpu_count() + 1}, "more than 4 per CPU"),
                    ({"ram_fraction": True}, "ram_fraction"), ({"worker_timeout": float("inf")}, "finite"),
                    ({"worker_cores": (0, 0)}, "names a core twice")]:
        with pytest.raises(ValueError, match=msg):
            HeteroConfig(**kw)
    for bad in ("x", {"cpu_workers": 1}, 0):
        with pytest.raises(TypeError, match="config= takes a HeteroConfig"):
            HeteroGenerator(None, config=bad)


def test_default_worker_cores_spare_the_parents_core():
    """Workers fill the cores after the parent's (the first usable) before doubling up on it."""
    usable = sorted(os.sched_getaffinity(0))
    for n in (1, len(usable), len(usable) + 1):
        n_, cores = HeteroConfig(cpu_workers=n).resolve_workers()
        pinned = [cores[r % len(cores)] for r in range(n)]          # as WorkerPool.worker_cores
        assert n_ == n and sorted(set(pinned)) == sorted((usable[1:] + usable[:1])[:min(n, len(usable))])
        assert usable[0] not in pinned[:len(usable) - 1]


def test_unsupported_models():
    from transformers import MambaConfig, MambaForCausalLM, T5Config, T5ForConditionalGeneration

    with pytest.raises(UnsupportedModelError, match="PreTrainedModel"):
        HeteroGenerator(torch.nn.Linear(2, 2))
    mamba = MambaForCausalLM(MambaConfig(vocab_size=32, hidden_size=16, num_hidden_layers=1))
    with pytest.raises(UnsupportedModelError, match="AttentionInterface|layer types|attention"):
        HeteroGenerator(mamba)
    t5 = T5ForConditionalGeneration(T5Config(vocab_size=32, d_model=16, d_ff=32, num_layers=1, num_heads=2, d_kv=8))
    with pytest.raises(UnsupportedModelError, match="encoder-decoder"):
        HeteroGenerator(t5)
    llama64 = build_model("llama")[0].to(torch.float64)
    with pytest.raises(UnsupportedModelError, match="float64"):
        HeteroGenerator(llama64)


def test_generate_after_close(llama, monkeypatch):
    """close() stops the workers (by default: no reuse, see hetero.ipc.pool.REUSE)."""
    from hetero.ipc import pool as P

    monkeypatch.setattr(P, "REUSE", False)
    gen = HeteroGenerator(llama, cpu_workers=1)
    name, procs = gen._pool.ctrl.name[1:], gen._pool.procs
    gen.close()
    gen.close()
    with pytest.raises(GeneratorClosedError):
        gen.generate(padded_batch()[0], max_new_tokens=2)
    assert name not in our_segments()
    assert all(p.poll() is not None for p in procs)


class _Streamer:
    """A transformers streamer whose put() runs `action` on the n-th decode token."""

    def __init__(self, n, action):
        self.n, self.action, self.calls = n, action, 0

    def put(self, value):
        self.calls += 1
        if self.calls == self.n + 1:  # the first put() is the prompt
            self.action()

    def end(self):
        pass


def test_exception_inside_generate_leaks_nothing(llama, llama_gen):
    def boom():
        raise RuntimeError("user callback failed")

    ids, mask = padded_batch()
    with pytest.raises(RuntimeError, match="user callback failed"):
        llama_gen.generate(ids, attention_mask=mask, max_new_tokens=8, streamer=_Streamer(3, boom), pad_token_id=0)
    assert only_ctrl_segment(llama_gen)
    assert llama_gen.generate(ids, attention_mask=mask, max_new_tokens=3, pad_token_id=0).shape[1] == ids.shape[1] + 3


def test_worker_killed_during_decode_raises_fast(llama):
    ids, mask = padded_batch()
    before = our_segments(os.getpid())
    gen = HeteroGenerator(llama, config=HeteroConfig(cpu_workers=2, profile="off"))   # worker 1 has work
    victim = gen._pool.procs[1]
    killed = {}

    def kill():
        os.kill(victim.pid, signal.SIGKILL)
        killed["t"] = time.perf_counter()

    try:
        with pytest.raises(WorkerDiedError, match=rf"worker 1 \(pid {victim.pid}.*SIGKILL"):
            gen.generate(ids, attention_mask=mask, max_new_tokens=8, streamer=_Streamer(2, kill), pad_token_id=0)
        assert time.perf_counter() - killed["t"] < 2.0
        assert our_segments(os.getpid()) == before      # the broken pool and the session are gone
        # the next generate starts a fresh pool and is correct
        out = gen.generate(ids, attention_mask=mask, max_new_tokens=4, pad_token_id=0)
        llama.set_attn_implementation("sdpa")
        assert torch.equal(out, llama.generate(ids, attention_mask=mask, max_new_tokens=4, pad_token_id=0))
    finally:
        gen.close()
    assert our_segments(os.getpid()) == before


def test_two_generators_in_one_process(llama):
    ids, mask = padded_batch()
    other = build_model("qwen3")[0]
    before = our_segments(os.getpid())
    with HeteroGenerator(llama, cpu_workers=1) as a, HeteroGenerator(other, cpu_workers=1) as b:
        assert a._pool.ctrl.name != b._pool.ctrl.name
        ra = a.generate(ids, attention_mask=mask, max_new_tokens=5, pad_token_id=0)
        rb = b.generate(ids, attention_mask=mask, max_new_tokens=5, pad_token_id=0)
    llama.set_attn_implementation("sdpa")
    other.set_attn_implementation("sdpa")
    assert torch.equal(ra, llama.generate(ids, attention_mask=mask, max_new_tokens=5, pad_token_id=0))
    assert torch.equal(rb, other.generate(ids, attention_mask=mask, max_new_tokens=5, pad_token_id=0))
    assert our_segments(os.getpid()) == before


PARENT = textwrap.dedent("""
    import sys, time, torch
    sys.path.insert(0, {root!r})
    from tests.conftest import build_model, padded_batch
    from hetero import HeteroGenerator
    gen = HeteroGenerator(build_model("llama")[0], cpu_workers=2)
    ids, mask = padded_batch()

    class Hang:
        n = 0
        def put(self, v):
            self.n += 1
            if self.n == 3:  # mid-decode, with the KV segment open
                print("PIDS", *[p.pid for p in gen._pool.procs], flush=True)
                time.sleep(600)
        def end(self): pass

    gen.generate(ids, attention_mask=mask, max_new_tokens=8, streamer=Hang(), pad_token_id=0)
""")


def test_parent_killed_leaves_no_segments_and_no_workers():
    """SIGKILL of one parent, SIGTERM to another's whole process group (a terminal's hangup,
    `timeout`, systemd), both mid-decode: the workers, in a session of their own, see their parent
    gone and clean up. The two run side by side (the start-up dominates)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    parents = [subprocess.Popen([sys.executable, "-c", PARENT.format(root=root)], stdout=subprocess.PIPE, text=True,
                                start_new_session=True) for _ in range(2)]
    workers = []
    try:
        for parent in parents:
            line = parent.stdout.readline()
            assert line.startswith("PIDS"), line
            workers += [int(p) for p in line.split()[1:]]
            assert len(our_segments(parent.pid)) == 2           # control + KV session
    finally:
        parents[0].kill()
        os.killpg(parents[1].pid, signal.SIGTERM)
        for parent in parents:
            parent.wait()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and (any(our_segments(p.pid) for p in parents) or any(map(_alive, workers))):
        time.sleep(0.05)
    assert all(our_segments(p.pid) == [] for p in parents)
    assert not any(_alive(p) for p in workers)


CONTEXT_PARENT = textwrap.dedent("""
    import os, signal, sys, time, torch
    sys.path.insert(0, {root!r})
    from hetero import HeteroGenerator
    from tests.conftest import build_model
    model, _ = build_model("llama")
    gen = HeteroGenerator(model, cpu_workers=1)
    ctx = gen.prefill(torch.arange(3, 40)[None])
    calls = [0]
    def kill(*_):
        calls[0] += 1
        if calls[0] == 2:                          # the first decode step: attention on the worker
            os.kill(gen._pool.procs[0].pid, signal.SIGKILL)
            gen._pool.procs[0].wait()
    model.model.layers[0].register_forward_pre_hook(kill)
    try:
        gen.generate(torch.tensor([[5, 6]]), context=ctx, max_new_tokens=3)
    except Exception as e:
        print("RAISED", type(e).__name__, flush=True)
    print("PIDS", *[p.pid for p in gen._pool.procs], flush=True)
    time.sleep(600)
""")


def test_parent_killed_after_a_worker_died_leaves_no_context_segments():
    """A worker dies in a call over a live context (the call raises, the context stays): a new
    pool starts at once, so when the parent is then SIGKILLed a worker is there to unlink the
    context's segments (they outlived the parent when the pool started only at the next call)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    parent = subprocess.Popen([sys.executable, "-c", CONTEXT_PARENT.format(root=root)], stdout=subprocess.PIPE,
                              text=True, start_new_session=True)
    try:
        assert parent.stdout.readline().split() == ["RAISED", "WorkerDiedError"]
        workers = [int(p) for p in parent.stdout.readline().split()[1:]]
        assert workers and any("_kv" in n for n in our_segments(parent.pid))      # the context's arena
    finally:
        parent.kill()
        parent.wait()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and (our_segments(parent.pid) or any(map(_alive, workers))):
        time.sleep(0.05)
    assert our_segments(parent.pid) == [] and not any(map(_alive, workers))


CLOSE_PARENT = textwrap.dedent("""
    import subprocess, sys, time
    sys.path.insert(0, {root!r})
    from hetero import HeteroGenerator
    from tests.conftest import build_model
    gen = HeteroGenerator(build_model("llama")[0], cpu_workers=2)
    procs = gen._pool.procs
    print("PIDS", *[p.pid for p in procs], flush=True)
    sys.stdin.readline()
    wait = subprocess.Popen.wait

    def killed_here(self, timeout=None):   # close() waits for its workers once EXIT is posted: stop there
        if {exited}:
            for p in procs:
                wait(p)
        print("IN CLOSE", flush=True)
        time.sleep(600)

    subprocess.Popen.wait = killed_here
    gen.close()
""")


def test_a_parent_killed_inside_close_leaves_nothing():
    """A parent SIGKILLed inside close(), once EXIT is posted: the control segment's name went
    before it (it stayed in /dev/shm, with the lock, when the kill came after the workers had read
    EXIT). Workers that read EXIT only after the parent died (stopped meanwhile here) unlink the
    rest, the parent's lock included; a kill after they exited leaves only the lock, which lives
    as long as the process (the next pool's sweep removes it)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, HETERO_REUSE_WORKERS="0")     # close() waits for its workers to exit
    parents = {exited: subprocess.Popen([sys.executable, "-c", CLOSE_PARENT.format(root=root, exited=exited)],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
                                        start_new_session=True) for exited in (False, True)}
    workers = {}
    try:
        for exited, parent in parents.items():
            line = parent.stdout.readline()
            assert line.startswith("PIDS"), line
            workers[exited] = [int(p) for p in line.split()[1:]]
            if not exited:                   # they read EXIT only after the parent is gone
                for pid in workers[exited]:
                    os.kill(pid, signal.SIGSTOP)
            parent.stdin.write("close\n")
            parent.stdin.flush()
        for parent in parents.values():
            assert parent.stdout.readline() == "IN CLOSE\n"
            assert our_segments(parent.pid) == []
    finally:
        for exited, parent in parents.items():
            parent.kill()
            parent.wait()
            for pid in workers.get(exited, []):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
    everything = lambda pid: [n for n in shm.list_ours() if n.startswith((f"{shm.PREFIX}{pid}_",  # noqa: E731
                                                                          f"{shm.LOCK_PREFIX}{pid}_"))]
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and (everything(parents[False].pid) or our_segments(parents[True].pid)
                                           or any(_alive(p) for w in workers.values() for p in w)):
        time.sleep(0.05)
    assert everything(parents[False].pid) == [] and our_segments(parents[True].pid) == []
    assert not any(_alive(p) for w in workers.values() for p in w)
    shm.sweep_stale()                                       # the lock left by the late kill, as the next pool does
    assert everything(parents[True].pid) == []


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:   # a zombie has exited
        return f.read().split(")")[-1].split()[0] != "Z"


def test_concurrent_generate_on_one_generator_waits_its_turn(llama):
    """A second call while one runs is not refused: it joins the engine (hetero.engine.calls), whose
    steps run once the first call has finished; both give HF's sequences."""
    import threading

    ids, mask = padded_batch()
    started, release = threading.Event(), threading.Event()

    def slow():
        started.set()
        release.wait(10)

    with HeteroGenerator(llama, cpu_workers=1) as gen:
        out = {}

        def first():
            out["first"] = gen.generate(ids, attention_mask=mask, max_new_tokens=4, pad_token_id=0,
                                        streamer=_Streamer(1, slow))

        t = threading.Thread(target=first)
        t.start()
        assert started.wait(10)
        second = threading.Thread(target=lambda: out.setdefault("second", gen.generate(
            ids, attention_mask=mask, max_new_tokens=2, pad_token_id=0)))
        second.start()
        second.join(0.5)
        assert second.is_alive()             # waiting (in the engine), not refused
        release.set()
        t.join(10)
        second.join(30)
        assert torch.equal(out["first"], llama.generate(ids, attention_mask=mask, max_new_tokens=4, pad_token_id=0))
        assert torch.equal(out["second"], llama.generate(ids, attention_mask=mask, max_new_tokens=2, pad_token_id=0))


def _mapped_kv_segments():
    """KV arenas still mapped into this process (unlinked ones show as '(deleted)')."""
    with open("/proc/self/maps") as f:
        return [line.split()[-2] if line.rstrip().endswith("(deleted)") else line.split()[-1]
                for line in f if "/dev/shm/hetero_" in line and "_kv" in line]


def test_kept_outputs_do_not_pin_the_kv_arena(llama, llama_gen):
    """return_dict_in_generate outputs: closing the session releases every view so the arena is
    unmapped, not pinned by each kept output (HF's would hold the cache; hetero's drop it, closed)."""
    import warnings

    ids, mask = padded_batch()
    with warnings.catch_warnings():
        warnings.simplefilter("error", ResourceWarning)     # a view left alive warns in Segment.close
        outs = [llama_gen.generate(ids, attention_mask=mask, max_new_tokens=3, pad_token_id=0,
                                   return_dict_in_generate=True) for _ in range(20)]
    assert all(compat.output_cache(o) is None for o in outs)
    assert _mapped_kv_segments() == []
    assert only_ctrl_segment(llama_gen)


class _OneWorker:
    """A planner that leaves every worker but the first idle."""

    def plan(self, lengths, T, layout, parent=True):
        return 1, 1


def test_dead_idle_worker_is_noticed_at_the_next_step(llama):
    ids, mask = padded_batch()
    before = our_segments(os.getpid())
    with HeteroGenerator(llama, cpu_workers=2) as gen:
        gen._planner = _OneWorker()
        victim = gen._pool.procs[1]

        def kill():
            os.kill(victim.pid, signal.SIGKILL)
            victim.wait()
            time.sleep(0.01)

        with pytest.raises(WorkerDiedError, match=r"worker 1 .*SIGKILL before the job; the pool is broken"):
            gen.generate(ids, attention_mask=mask, max_new_tokens=8, streamer=_Streamer(2, kill), pad_token_id=0)
        assert our_segments(os.getpid()) == before
        assert gen.generate(ids, attention_mask=mask, max_new_tokens=3, pad_token_id=0).shape[1] == ids.shape[1] + 3


def test_stopped_worker_raises_within_the_timeout_and_the_generator_recovers(llama):
    from hetero import WorkerError

    ids, mask = padded_batch()
    before = our_segments(os.getpid())
    with HeteroGenerator(llama, config=HeteroConfig(cpu_workers=2, profile="off", worker_timeout=0.5)) as gen:
        victim = gen._pool.procs[1]
        stopped = {}

        def stop():
            os.kill(victim.pid, signal.SIGSTOP)
            stopped["t"] = time.perf_counter()

        try:
            with pytest.raises(WorkerError, match=r"no progress on the (attention|close) job for 0.5 s: worker 1 .*state T"):
                gen.generate(ids, attention_mask=mask, max_new_tokens=8, streamer=_Streamer(2, stop), pad_token_id=0)
            assert time.perf_counter() - stopped["t"] < 2 * 0.5 + 5.0  # the timeout (judged between two
            #                                                            progress snapshots), plus teardown
        finally:
            os.kill(victim.pid, signal.SIGCONT) if victim.poll() is None else None
        assert victim.poll() is not None                           # the stuck worker was stopped for good
        assert our_segments(os.getpid()) == before
        out = gen.generate(ids, attention_mask=mask, max_new_tokens=4, pad_token_id=0)
    llama.set_attn_implementation("sdpa")
    assert torch.equal(out, llama.generate(ids, attention_mask=mask, max_new_tokens=4, pad_token_id=0))


def test_submit_waits_for_a_job_still_in_flight():
    """A job abandoned between submit and wait (an exception, Ctrl-C) is finished before the next
    job rewrites the command words under the workers."""
    import threading

    from hetero.ipc import control as C
    from hetero.ipc.pool import WorkerPool

    pool = WorkerPool(2, sorted(os.sched_getaffinity(0)))
    try:
        os.kill(pool.procs[0].pid, signal.SIGSTOP)
        first = pool.submit(C.CMD_PING, 2)                  # never waited for
        threading.Timer(0.3, os.kill, (pool.procs[0].pid, signal.SIGCONT)).start()
        pool.submit(C.CMD_PING, 2)
        assert all(pool.words[C.done_word(r)] >= first for r in range(2))
        pool.wait(*pool.inflight)
    finally:
        os.kill(pool.procs[0].pid, signal.SIGCONT)
        pool.close()


def test_ctrl_c_during_a_decode_wait_leaks_nothing(llama, llama_gen, monkeypatch):
    from hetero.ipc import pool as pool_mod

    ids, mask = padded_batch()
    from hetero.ipc import control as C

    real, calls = pool_mod.atomics.spin_until_all, {"n": 0}

    def interrupted(words, *args):
        calls["n"] += words[C.CMD] == C.CMD_ATTN
        if calls["n"] == 5:         # a decode layer's wait, mid-generate
            raise KeyboardInterrupt
        return real(words, *args)

    monkeypatch.setattr(pool_mod.atomics, "spin_until_all", interrupted)
    with pytest.raises(KeyboardInterrupt):
        llama_gen.generate(ids, attention_mask=mask, max_new_tokens=8, pad_token_id=0)
    monkeypatch.undo()
    assert only_ctrl_segment(llama_gen) and llama_gen._pool.inflight is None
    llama.set_attn_implementation("sdpa")
    ref = llama.generate(ids, attention_mask=mask, max_new_tokens=5, pad_token_id=0)
    assert torch.equal(llama_gen.generate(ids, attention_mask=mask, max_new_tokens=5, pad_token_id=0), ref)


def test_small_shared_memory_filesystem_is_a_capacity_error(llama, llama_gen, monkeypatch):
    """Docker's default /dev/shm is 64 MB: an arena past its free space must be refused, not SIGBUS."""
    from hetero import generator

    real = os.statvfs

    def tiny(path):
        st = real(path)
        if path != generator.shm.SHM_DIR:
            return st
        return os.statvfs_result((st.f_bsize, st.f_frsize, 16, 16, 16, *st[5:]))   # 16 blocks free

    monkeypatch.setattr(generator.shm.os, "statvfs", tiny)
    ids, mask = padded_batch()
    with pytest.raises(CapacityError, match=r"/dev/shm has only 0.00 GiB free.*--shm-size"):
        llama_gen.generate(ids, attention_mask=mask, max_new_tokens=4)
    assert only_ctrl_segment(llama_gen)


def test_attention_goes_on_without_a_stopped_worker_and_a_late_worker_takes_nothing():
    """A worker that does not run (stopped, or on a core a busy process holds) and took no unit
    does not stall attention jobs: the parent and the other worker take its units, bit-identical.
    When it runs again, its stale jobs' tickets are empty or carry a later tag: it takes nothing,
    counts nothing, and the next job uses it again."""
    from hetero.ipc import control as C
    from hetero.ipc.pool import WorkerPool
    from hetero.model_spec import ModelSpec
    from hetero.offload.session import KVSession
    from tests.test_kernel import FixedPlan

    Hq, Hkv, D, L = 4, 2, 32, 700
    spec = ModelSpec(model_type="t", layers=1, q_heads=Hq, kv_heads=Hkv, head_dim=D, dtype=torch.float32,
                     max_positions=None, sliding=(False,))
    g = torch.Generator().manual_seed(5)
    k, v, q = torch.randn(Hkv, L, D, generator=g), torch.randn(Hkv, L, D, generator=g), torch.randn(1, Hq, 1, D, generator=g)
    pool = WorkerPool(2, [], job_timeout=5.0)
    s = KVSession(pool, spec, pads=[0], real_lens=[L - 1], cap=L, planner=FixedPlan(2, 4))
    try:
        s.write_rows(0, 0, k[:, :L - 1], v[:, :L - 1])
        s.finish_prefill()

        def step():                     # the same step again (attend advances the lengths: undo it)
            s.pool.drain()
            s.lengths[:] = L - 1
            s.stage_kv(k[None, :, L - 1:], v[None, :, L - 1:])
            return s.attend(0, q, None, D ** -0.5, None)

        ref = step()
        os.kill(pool.procs[1].pid, signal.SIGSTOP)
        time.sleep(0.05)
        busy = int(pool.words[C.busy_word(1)])
        t0 = time.perf_counter()
        for _ in range(30):
            assert torch.equal(step(), ref)
        assert time.perf_counter() - t0 < 2.0                       # no job waited for the stopped worker
        assert int(pool.words[C.busy_word(1)]) == busy               # it took nothing
        os.kill(pool.procs[1].pid, signal.SIGCONT)
        deadline = time.monotonic() + 5
        while pool.words[C.done_word(1)] != pool.seq and time.monotonic() < deadline:
            time.sleep(0.001)
        assert pool.words[C.done_word(1)] == pool.seq                # it woke to the last job, found it over,
        assert pool.words[C.FIN] == pool.words[C.UNITS] == 8          # and counted no unit
        assert pool.words[C.TICKET] == C.ticket(pool.seq, 0)
        assert int(pool.words[C.busy_word(1)]) == busy
        s._share = lambda seq: None                                  # the workers alone: both run again
        assert torch.equal(step(), ref)
    finally:
        os.kill(pool.procs[1].pid, signal.SIGCONT)
        s.close()
        pool.close()


def test_attention_job_with_a_stopped_unit_holder_raises():
    """When nobody else can take the units (the parent takes none here), a stopped worker stalls
    the job: WorkerError names it after worker_timeout; the pool is broken."""
    from hetero import WorkerError
    from hetero.ipc import control as C
    from hetero.ipc.pool import WorkerPool

    pool = WorkerPool(1, [], job_timeout=0.3)
    try:
        os.kill(pool.procs[0].pid, signal.SIGSTOP)
        pool.words[C.LAYER] = 0
        with pytest.raises(WorkerError, match=r"no progress on the attention job for 0.3 s: worker 0 .*state T"):
            pool.attention(1, 4, share=None)
        assert not pool.alive
        with pytest.raises(WorkerError, match="broken"):
            pool.run(C.CMD_PING)
    finally:
        os.kill(pool.procs[0].pid, signal.SIGCONT)
        pool.close()
