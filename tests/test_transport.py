"""The transport seam (hetero.ipc.transport) on every machine.

The CUDA transport's protocol runs here with its device parts replaced by the host build of
hetero/cuda/protocol.h (HostTransport below): the same C code that the GPU kernels run
publishes each job to the real workers (params, FIN, tagged ticket, GO words), the "stream"
waits on FIN or ABORT with it, and it merges the partials. So word offsets, encodings, the
merge, the deferred length update (one synchronization per token) and the watchdog are checked
without a GPU; the CUDA source itself must compile wherever nvcc exists.
"""
import contextlib
import ctypes
import os
import signal
import threading
import time

import numpy as np
import pytest
import torch

from hetero import HeteroConfig, HeteroGenerator
from hetero.cuda import build
from hetero.errors import WorkerDiedError, WorkerError
from hetero.generator import HeteroGenerator as _Gen
from hetero.ipc import control as C
from hetero.ipc.pool import WorkerPool
from hetero.ipc.cuda_transport import CudaTransport, _ptr as _p
from hetero.ipc.transport import CpuTransport
from hetero.offload.session import KVSession
from tests.conftest import build_model, padded_batch
from tests.test_kernel import FixedPlan
from tests.test_layout import spec_of

_HOST = []


def host_lib():
    if not _HOST:
        lib = ctypes.CDLL(build.host_library())
        vp, i64p, f64p = ctypes.c_void_p, ctypes.POINTER(ctypes.c_int64), ctypes.POINTER(ctypes.c_double)
        lib.hetero_host_publish.argtypes = [vp, i64p, f64p]
        lib.hetero_host_released.argtypes = [vp, ctypes.c_int64]
        lib.hetero_host_merge.argtypes = [vp, vp, vp, i64p, i64p, f64p, vp, vp]
        lib.hetero_host_copy_out.argtypes = [vp, vp, vp, vp, vp, vp, i64p, ctypes.c_int64]
        lib.hetero_host_publish_lora.argtypes = [vp, vp, i64p]
        lib.hetero_host_lora_released.argtypes = [vp, ctypes.c_int64, ctypes.c_int64]
        lib.hetero_host_lora_copy_out.argtypes = [vp, vp, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64]
        lib.hetero_host_lora_add.argtypes = [vp, vp, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64]
        _HOST.append(lib)
    return _HOST[0]


def host_wait_and_merge(t, s, out, sink):
    """The stream's wait for transport t's posted job (a spin on hetero_host_released: FIN == UNITS
    or ABORT), then the merge kernel's loop over s's partials into out (hetero_host_merge)."""
    words = t.pool.words
    while not t.lib.hetero_host_released(words.ctypes.data, int(t.iparams[5])):
        time.sleep(0)
    merged = torch.empty(out.shape, dtype=torch.float32)
    t.lib.hetero_host_merge(s.part_o.data_ptr(), s.part_m.data_ptr(), s.part_l.data_ptr(), _p(t.dims), _p(t.iparams),
                            _p(t.fparams), None if sink is None else sink.data_ptr(), merged.data_ptr())
    out.copy_(merged)


class _Done:
    def query(self):
        return True

    def synchronize(self):
        pass


class HostTransport(CudaTransport):
    """CudaTransport with signal.cu's three kernels done on the host by protocol.h's code: the
    copy-out (hetero_host_copy_out: the kernel's index math into the staging area), publish
    (hetero_host_publish), the stream's wait (a spin on hetero_host_released: FIN == UNITS or
    ABORT) and the merge (hetero_host_merge)."""
    launches = 0
    lora_jobs = 0

    def __init__(self, pool, session, lora=None):
        super().__init__(host_lib(), pool, session, lora=lora)

    def _map(self, session):
        pass

    def _launch(self, s, q, k, v, out, sink):
        # the copy-out kernel's index math, on the host (q, k, v: contiguous, the storage dtype)
        self.lib.hetero_host_copy_out(q.data_ptr(), k.data_ptr(), v.data_ptr(), s.q.data_ptr(), s.knew.data_ptr(),
                                      s.vnew.data_ptr(), _p(self.dims), q.element_size())
        self.lib.hetero_host_publish(self.pool.words.ctypes.data, _p(self.iparams), _p(self.fparams))
        host_wait_and_merge(self, s, out, sink)
        HostTransport.launches += 1

    def _launch_lora_post(self, code, x):
        # the LoRA copy-out kernel's loop (x widened to f32 into the staging), then publish_lora
        rows, din = x.shape
        xf = x.float().contiguous()
        self.lib.hetero_host_lora_copy_out(xf.data_ptr(), self.lora.x.data_ptr(), rows, din, self.lora.x.shape[1])
        v = self.lora.views
        self.lib.hetero_host_publish_lora(self.pool.words.ctypes.data, v["hdr"].ctypes.data, _p(self.lparams))
        HostTransport.lora_jobs += 1

    def _launch_lora_finish(self, code, out):
        # the stream's wait (a spin on lora_released), then the add kernel's f32 add and cast
        seq, rows, _, _, dout, parts = (int(v) for v in self.lparams)
        while not self.lib.hetero_host_lora_released(self.pool.words.ctypes.data, seq, parts):
            time.sleep(0)
        if self.pool.words[C.ABORT] == 0:               # the add kernel's loop, in f32, cast back
            acc = out.float().contiguous()
            self.lib.hetero_host_lora_add(acc.data_ptr(), self.lora.delta.data_ptr(), rows, dout,
                                          self.lora.delta.shape[1])
            out.copy_(acc)

    def _event(self):
        return _Done()

    def _drain(self):
        pass

    def _unmap(self):
        pass


def test_cuda_source_compiles_for_sm80_and_sm90():
    """The extension's source compiles with this machine's nvcc (no GPU needed), so a broken
    kernel fails here and not on a rare GPU machine."""
    if build.nvcc() is None:
        pytest.skip("nvcc not found")
    path = build.compile_check((80, 90))
    assert os.path.getsize(path) > 0


@pytest.fixture
def host_transport(monkeypatch):
    """Every generate uses HostTransport (the CUDA transport's protocol, on the host)."""
    made = []

    def choose(self, session, pool, lora=None):
        made.append(HostTransport(pool, session, None if lora is None else lora.store))
        session.use_transport(made[-1])
        if lora is not None:
            lora.use_transport(made[-1])

    monkeypatch.setattr(_Gen, "_choose_transport", choose)
    return made


@pytest.mark.parametrize("model_type,dtype,chunk", [("llama", torch.float32, None), ("gemma2", torch.float32, None),
                                                     ("qwen3", torch.bfloat16, None), ("mistral", torch.float32, 4)])
def test_cuda_protocol_generate_matches_hf(host_transport, model_type, dtype, chunk):
    """A whole generate through the CUDA transport's protocol (host build): HF's greedy tokens,
    scores close; the length update waits for each step's end (settle). With chunk, the later
    prompt chunks go through it too (q_len 4 in a staging of 4 tokens, then q_len 1)."""
    model, _ = build_model(model_type, dtype=dtype)
    ids, mask = padded_batch(lengths=(20, 14, 9) if chunk else (12, 8, 5))
    kw = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0,
              return_dict_in_generate=True, output_scores=True)
    ref = model.generate(ids, **kw)
    before = HostTransport.launches
    with HeteroGenerator(model, config=HeteroConfig(cpu_workers=2, prefill_chunk=chunk)) as gen:
        out = gen.generate(ids, **kw)
    assert len(host_transport) == 1 and host_transport[0].watchdog is None     # closed
    # forwards through the workers: one pass, 5 decode steps; chunked (pads 11 + 4 = 15 tokens first),
    # the chunk [15, 19), then generate's 6 forwards ([19, 20) and 5 decode steps)
    steps = 5 if chunk is None else 7
    assert HostTransport.launches - before == steps * model.config.num_hidden_layers
    assert torch.equal(out.sequences, ref.sequences)
    tol = 1e-4 if dtype == torch.float32 else 0.1
    for a, b in zip(out.scores, ref.scores):
        torch.testing.assert_close(a.float(), b.float(), atol=tol, rtol=tol)


@pytest.fixture(scope="module")
def pool():
    p = WorkerPool(2, [])
    yield p
    p.close()


def _session(pool, planner, dtype=torch.float32, D=32, lengths=(40, 75)):
    g = torch.Generator().manual_seed(3)
    s = KVSession(pool, spec_of(D, dtype, windows=(0, 0)), pads=[0] * len(lengths), real_lens=list(lengths),
                  cap=96, planner=planner)
    for layer in range(2):
        for b, L in enumerate(lengths):
            s.write_rows(layer, b, torch.randn(2, L, D, generator=g).to(dtype), torch.randn(2, L, D, generator=g).to(dtype))
    s.finish_prefill()
    return s, g


def test_the_plan_follows_the_transports_takers(pool):
    """The CUDA transport's parent takes no units: the session plans for its workers alone
    (2 takers over 2 kv heads x 2 requests: 1 split) and again for the parent too when the
    CPU transport is back (3 takers: 3 splits spread 12 units evenly)."""
    from hetero.cpu_attention.planner import StaticPlanner

    s, _ = _session(pool, StaticPlanner(2, min_rows=8))
    try:
        assert (s.nactive, s.nsplit) == (2, 3)
        ht = HostTransport(pool, s)
        s.use_transport(ht)
        assert (s.nactive, s.nsplit) == (2, 1)
        s.use_transport(CpuTransport())
        assert (s.nactive, s.nsplit) == (2, 3)
        ht.close()
    finally:
        s.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("workers,nsplit", [(0, 1), (1, 3), (2, 4)])
def test_cuda_protocol_step_equals_cpu_transport(pool, dtype, workers, nsplit):
    """One layer through the CPU transport and through the CUDA protocol (host build), same
    staged rows (a non-final layer: the lengths stay, the append rewrites the same row): equal
    outputs (bit-equal with one split, where both merges are o / l), sinks included."""
    s, g = _session(pool, FixedPlan(workers, nsplit), dtype)
    try:
        ht = HostTransport(pool, s)
        k, v = torch.randn(2, 2, 1, 32, generator=g).to(dtype), torch.randn(2, 2, 1, 32, generator=g).to(dtype)
        q = torch.randn(2, 4, 1, 32, generator=g).to(dtype)
        for sinks in (None, torch.randn(4, generator=g) * 2):
            s.stage_kv(k, v)
            cpu = s.attend(0, q, None, 32 ** -0.5, None, sinks=sinks)
            s.use_transport(ht)
            s.stage_kv(k, v)
            seq = pool.seq
            host = s.attend(0, q, None, 32 ** -0.5, None, sinks=sinks)
            assert pool.seq == seq + 1 and pool.words[C.FIN] == pool.words[C.UNITS] == 2 * 2 * nsplit
            assert C.go_seq(pool.words[C.go_word(0)]) == pool.seq          # the GO word the C code posted
            s.use_transport(CpuTransport())
            if nsplit == 1 and sinks is None:
                assert torch.equal(host, cpu)
            else:
                torch.testing.assert_close(host.float(), cpu.float(), atol=1e-6, rtol=1e-5)
        ht.close()
    finally:
        s.close()


def test_cuda_protocol_defers_the_length_update_to_the_next_step(pool):
    """The last layer's call does not touch lengths (the GPU may still run the step); the next
    step's first write applies it after the step's end event."""
    s, g = _session(pool, FixedPlan(1, 2))
    try:
        ht = HostTransport(pool, s)
        s.use_transport(ht)
        before = s.lengths.copy()
        for layer in range(2):
            s.stage_kv(torch.randn(2, 2, 1, 32, generator=g), torch.randn(2, 2, 1, 32, generator=g))
            s.attend(layer, torch.randn(2, 4, 1, 32, generator=g), None, 32 ** -0.5, None)
        assert np.array_equal(s.lengths, before) and ht.pending == 1
        s.stage_kv(torch.randn(2, 2, 1, 32, generator=g), torch.randn(2, 2, 1, 32, generator=g))
        assert np.array_equal(s.lengths, before + 1) and ht.pending == 0
        ht.close()
    finally:
        s.close()


@pytest.mark.parametrize("how", ["stopped", "killed"])
def test_watchdog_releases_the_wait_and_raises(how):
    """While the "stream" waits on a job, a stopped worker (no progress for job_timeout) or a
    killed one makes the watchdog write ABORT: the wait returns within the limit, and the next
    call and close() raise; the pool is broken (the next generate replaces it)."""
    with _watched(0.5) as (pool, s, g, ht):
        victim = pool.procs[0]
        os.kill(victim.pid, signal.SIGSTOP)        # the job waits; "killed": dies while it waits
        if how == "killed":
            threading.Timer(0.1, os.kill, (victim.pid, signal.SIGKILL)).start()
        s.stage_kv(torch.randn(2, 2, 1, 32, generator=g), torch.randn(2, 2, 1, 32, generator=g))
        t0 = time.perf_counter()
        s.attend(0, torch.randn(2, 4, 1, 32, generator=g), None, 32 ** -0.5, None)   # released by ABORT
        assert time.perf_counter() - t0 < 2.0
        assert pool.words[C.ABORT] == 1 and pool.broken and not pool.alive
        err = WorkerError if how == "stopped" else WorkerDiedError
        with pytest.raises(err, match="made no progress" if how == "stopped" else "SIGKILL"):
            s.stage_kv(torch.randn(2, 2, 1, 32, generator=g), torch.randn(2, 2, 1, 32, generator=g))
        with pytest.raises(err):
            ht.close()
    assert all(p.poll() is not None for p in pool.procs)


@contextlib.contextmanager
def _watched(job_timeout):
    """A one-worker pool, a session and a HostTransport (its watchdog running): (pool, session,
    its generator, transport); all closed after."""
    pool = WorkerPool(1, [], job_timeout=job_timeout)
    try:
        s, g = _session(pool, FixedPlan(0, 2))
        try:
            ht = HostTransport(pool, s)
            s.use_transport(ht)
            yield pool, s, g, ht
        finally:
            s.close()
    finally:
        pool.close()


def test_transport_config_is_checked():
    from hetero import HeteroConfig

    with pytest.raises(ValueError, match="transport must be"):
        HeteroConfig(transport="gpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the extension may work here")
def test_unavailable_extension_falls_back_with_one_log_line(pool, caplog):
    """Where the CUDA transport cannot be used (here: no CUDA at all), open() returns None and
    logs why once; the session keeps the exact host-copy transport and nothing stays allocated."""
    import logging

    s, _ = _session(pool, FixedPlan(1, 1))
    try:
        CudaTransport._said.clear()
        with caplog.at_level(logging.WARNING, logger="hetero"):
            for _ in range(3):
                assert CudaTransport.open(pool, s, torch.device("cuda")) is None
        lines = [r.getMessage() for r in caplog.records if "CUDA transport unavailable" in r.getMessage()]
        assert len(lines) == 1 and CudaTransport.why
        assert isinstance(s.transport, CpuTransport) and pool.words[C.AWAKE] == 0
    finally:
        s.close()


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores")
def test_parent_pinned_off_the_workers_cores_and_restored(llama):
    """What a GPU model does at pool start (_pin_parent): the calling thread keeps to the cores no
    worker uses, and torch runs no more threads than those cores; close() gives both back."""
    before, threads = os.sched_getaffinity(0), torch.get_num_threads()
    workers = sorted(before)[1:]
    gen = HeteroGenerator(llama, cpu_workers=1)
    try:
        torch.set_num_threads(len(before) + 2)        # as a 16-thread torch pinned to one core
        gen._pin_parent(workers)
        assert os.sched_getaffinity(0) == before - set(workers)
        assert torch.get_num_threads() == len(before) - len(workers)
    finally:
        gen.close()
        after = torch.get_num_threads()
        torch.set_num_threads(threads)
    assert os.sched_getaffinity(0) == before and after == len(before) + 2


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores")
def test_pinned_generators_closed_in_any_order_or_after_their_thread_restore_torch(llama):
    """torch's thread count is the process's: two generators pinned one after the other and closed
    in the same order leave it as it was; a generator whose pinning thread has exited closes
    without an error."""
    import threading

    before, threads = os.sched_getaffinity(0), torch.get_num_threads()
    workers = sorted(before)[1:]
    g1, g2 = HeteroGenerator(llama, cpu_workers=1), HeteroGenerator(llama, cpu_workers=1)
    try:
        torch.set_num_threads(len(before))
        go = threading.Event()
        t = threading.Thread(target=lambda: (go.wait(), g2._pin_parent(workers)))
        t.start()                                     # before g1 pins: it keeps every core
        g1._pin_parent(workers)
        go.set()
        t.join()                                      # g2's thread is gone when it closes
        assert g2._parent_affinity is not None
        g1.close()
        g2.close()
        assert torch.get_num_threads() == len(before) and os.sched_getaffinity(0) == before
    finally:
        g1.close()
        g2.close()
        torch.set_num_threads(threads)


@pytest.mark.parametrize("model_type,split", [("llama", False), ("phi3", False), ("llama", True)])
def test_cuda_protocol_lora_decode_matches_peft(host_transport, model_type, split, tmp_path, monkeypatch):
    """LoRA deltas of decode steps posted through the CUDA transport's protocol (host build of
    publish_lora / lora_released; the workers' run_rows, zeros for requests whose adapter skips a
    site; split: jobs cut in column ranges over both workers): a mixed batch (two adapters, the
    base model) equals peft's tokens and scores, and so does a one-token prompt (its prefill is
    not a decode step: host jobs). phi3: fused qkv / gate_up projections."""
    from hetero.adapters import hooks
    from tests.test_lora import NAMES, assert_same, generate, make_adapters

    base, pm, _ = make_adapters(model_type, tmp_path)
    if split:
        monkeypatch.setattr(hooks, "MIN_WORK_POSTED", 1)
    parts = []
    monkeypatch.setattr(HostTransport, "lora_begin",
                        lambda self, site, x, dout, n: (parts.append(n), CudaTransport.lora_begin(self, site, x, dout, n))[1])
    ids, mask = padded_batch()
    ref = generate(pm, ids, mask, adapter_names=NAMES)
    ref1 = generate(pm, ids[:, -1:], mask[:, -1:], adapter_names=NAMES)
    dirs = {n: str(tmp_path / n) for n in ("legal", "code")}
    with HeteroGenerator(base, config=HeteroConfig(cpu_workers=2), adapters=dirs) as gen:
        out = generate(gen, ids, mask, adapter_names=NAMES)
        # every adapted site of every layer, in each of the 7 decode steps (the prefill's: host jobs)
        sites = len({s for a in (pm.peft_config["legal"], pm.peft_config["code"]) for s in a.target_modules})
        assert len(parts) == 7 * sites * base.config.num_hidden_layers
        assert (max(parts) == 2) == split
        out1 = generate(gen, ids[:, -1:], mask[:, -1:], adapter_names=NAMES)
        # the one-token prefill posts nothing, not even its last layer's sites after its attention
        assert len(parts) == 2 * 7 * sites * base.config.num_hidden_layers
    assert_same(out, ref)
    assert_same(out1, ref1)


@contextlib.contextmanager
def _lora_job_transport(tmp_path, **cfg):
    """(pool, adapter store, HostTransport, din, dout of site 0) of a generator over two real peft
    adapters, request 0 on adapter "code"; the session closed afterwards."""
    from tests.test_lora import make_adapters

    _, pm, _ = make_adapters("llama", tmp_path)
    with HeteroGenerator(pm, config=HeteroConfig(cpu_workers=1, **cfg)) as gen:
        pool, store = gen._ensure_pool(), gen._store
        s = KVSession(pool, gen.spec, pads=[0], real_lens=[4], cap=40)
        try:
            ht = HostTransport(pool, s, store)
            ht.lora_rows([store.adapters["code"].slot])
            yield (pool, store, ht, *store.site_dims[0])
        finally:
            s.close()                                               # a broken pool: no CMD_CLOSE


def test_watchdog_releases_a_stalled_lora_job(tmp_path):
    """A GPU-posted LoRA job whose worker stops (no DONE for worker_timeout): the watchdog writes
    ABORT, the "stream"'s wait returns within 2 s, the next call raises, and closing cleans up."""
    with _lora_job_transport(tmp_path, worker_timeout=0.5) as (pool, store, ht, din, dout):
        os.kill(pool.procs[0].pid, signal.SIGSTOP)
        job = ht.lora_begin(0, torch.randn(1, din), dout, 1)
        t0 = time.perf_counter()
        ht.lora_end(job, torch.zeros(1, dout))                  # released by ABORT
        assert time.perf_counter() - t0 < 2.0 and pool.words[C.ABORT] == 1 and pool.broken
        with pytest.raises(WorkerError, match="made no progress"):
            ht.lora_begin(0, torch.randn(1, din), dout, 1)
        with pytest.raises(WorkerError):
            ht.close()


def test_a_failed_gpu_posted_job_adds_nothing_and_is_reported(tmp_path):
    """A worker failing a GPU-posted LoRA job (here: activations one column too wide) still
    writes DONE; it also writes ABORT, so the "stream" adds no stale deltas, and closing the
    transport raises however soon after the job it comes (the watchdog takes one more look)."""
    with _lora_job_transport(tmp_path) as (pool, store, ht, din, dout):
        store.delta[:1, :dout] = 1.0                            # what a stale add would add
        out = torch.zeros(1, dout)
        ht.lora_end(ht.lora_begin(0, torch.randn(1, din + 1), dout, 1), out)
        assert pool.words[C.ABORT] == 1 and not out.any()
        with pytest.raises(WorkerError, match="failed a GPU-posted job"):
            ht.close()


def test_watchdog_ignores_finished_fault_in_jobs():
    """Page-locking's fault-in jobs (CMD_POPULATE, host-posted during a prefill) leave no word the
    watchdog reads as an unfinished job: a prefill longer than worker_timeout is not aborted."""
    from hetero.offload.pinning import ArenaPins

    with _watched(0.3) as (pool, s, _, ht):
        s._pins = ArenaPins(s, lambda p, n: True, lambda p: None)
        s._pins.pin(0)                                  # posts layer 1's fault-in job
        s._pins.pin(1)
        time.sleep(1.0)
        assert pool.words[C.ABORT] == 0 and pool.broken is None
        ht.close()


class _Splits:
    """A planner giving every step `splits` splits (of its own rows and of a shared prefix) and one worker."""

    def __init__(self, splits):
        self.splits = splits

    def plan(self, lengths, T, layout, parent=True):
        return 1, min(self.splits, layout.nsplit_max)


@pytest.mark.parametrize("transport", ["host_build", "pinned"])
@pytest.mark.parametrize("splits,chunk", [(1, None), (3, 4), (16, None)])
def test_contexts_batch_through_the_gpu_transports_matches_hf(monkeypatch, transport, splits, chunk):
    """Batches of contexts through the CUDA transport's protocol (host build: the shared prefix's
    split partials, slots 0..PSPLIT-1, merged with each request's own by protocol.h's merge) and
    through the fallback's data flow (PinnedTransport): two shared contexts, a request in no group
    (a context shorter than a block), a context continued twice; 1, 3 and 16 splits (16 + 16: all
    of the layout's nparts), steps of 1 and of 4 tokens. Tokens and scores equal HF."""
    from hetero.ipc.transport import PinnedTransport
    from tests.test_contexts import KW, hf_batch, left_pad, turns

    made = []

    def choose(self, session, pool, lora=None):
        t = HostTransport(pool, session) if transport == "host_build" else PinnedTransport(torch.device("cpu"))
        made.append((t, session.layout))
        session.use_transport(t)

    monkeypatch.setattr(_Gen, "_choose_transport", choose)
    monkeypatch.setattr(_Gen, "_ensure_planner", lambda self, pool: _Splits(splits))
    model, _ = build_model("llama")
    doc, doc2, small, *qs = turns(7, 70, 100, 10, 5, 19, 1, 7)
    with HeteroGenerator(model, config=HeteroConfig(cpu_workers=2, prefill_chunk=chunk)) as gen, \
            gen.prefill(doc[None], reserve=60) as ctx, gen.prefill(doc2[None], reserve=60) as ctx2, \
            gen.prefill(small[None], reserve=60) as ctx3:
        ids, mask = left_pad(qs)
        out = gen.generate(ids, attention_mask=mask, context=[ctx, ctx2, ctx3, ctx], max_new_tokens=5, **KW)
    t, layout = made[-1]
    assert layout.groups == 2
    if transport == "host_build":
        assert t.dims[7] == layout.nparts and int(t.iparams[7]) == splits      # NS and PSPLIT posted
    ref = hf_batch(model, [torch.cat([d, q]) for d, q in zip([doc, doc2, small, doc], qs)], 5)
    assert torch.equal(out.sequences, ref.sequences)
    for a, b in zip(out.scores, ref.scores):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)

@pytest.mark.parametrize("model_type,dtype,chunk", [("llama", torch.float32, 4), ("qwen3", torch.bfloat16, None),
                                                    ("gemma2", torch.float32, None)])
def test_pinned_fallback_matches_hf(monkeypatch, model_type, dtype, chunk):
    """The CUDA fallback's data flow (PinnedTransport: q/k/v through bounce buffers, the staging
    written from them, the output back through another) on a CPU model: HF's tokens and scores,
    with chunked steps (T = 4). (Pinned memory, the asynchronous copies and the event wait run on
    a GPU only: tests/test_gpu.py.)"""
    from hetero.ipc.transport import PinnedTransport

    used = []

    def choose(self, session, pool, lora=None):
        used.append(PinnedTransport(torch.device("cpu")))
        session.use_transport(used[-1])

    monkeypatch.setattr(_Gen, "_choose_transport", choose)
    model, _ = build_model(model_type, dtype=dtype, **({"sliding_window": 512} if model_type == "gemma2" else {}))
    tol = 1e-4 if dtype == torch.float32 else 0.1
    with HeteroGenerator(model, config=HeteroConfig(cpu_workers=2, prefill_chunk=chunk)) as gen:
        ids, mask = padded_batch(lengths=(20, 14, 9) if chunk else (12, 8, 5))
        kw = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0,
                  return_dict_in_generate=True, output_scores=True)
        out, ref = gen.generate(ids, **kw), model.generate(ids, **kw)
    assert len(used) == 1 and set(used[0].bounce._bufs) == {"q", "k", "v", "out"}
    assert torch.equal(out.sequences, ref.sequences)
    for a, b in zip(out.scores, ref.scores):
        torch.testing.assert_close(a.float(), b.float(), atol=tol, rtol=tol)


def test_a_cuda_model_without_the_extension_gets_the_pinned_fallback(monkeypatch, caplog):
    """_choose_transport on a (pretend) CUDA model: transport="host" and "auto" without the
    extension take PinnedTransport, "cuda" without it raises, a CPU model keeps CpuTransport."""
    from hetero.errors import UnsupportedModelError
    from hetero.ipc.transport import PinnedTransport

    model, _ = build_model("llama")
    monkeypatch.setattr(CudaTransport, "open", classmethod(lambda cls, *a, **k: None))
    with HeteroGenerator(model, config=HeteroConfig(cpu_workers=1)) as gen:
        s = KVSession(gen._ensure_pool(), gen.spec, pads=[0], real_lens=[4], cap=40)
        try:
            gen._choose_transport(s, s.pool)
            assert type(s.transport) is CpuTransport                  # a CPU model
            monkeypatch.setattr(type(model), "device", property(lambda self: torch.device("cuda", 0)))
            for want in ("host", "auto"):
                gen.config = HeteroConfig(cpu_workers=1, transport=want)
                s.use_transport(CpuTransport())
                gen._choose_transport(s, s.pool)
                assert type(s.transport) is PinnedTransport and s.transport.device == torch.device("cuda", 0)
            gen.config = HeteroConfig(cpu_workers=1, transport="cuda")
            with pytest.raises(UnsupportedModelError, match="unavailable"):
                gen._choose_transport(s, s.pool)
            # with the extension, a call naming no loaded adapter (a LoraBatch without a store)
            opened = []
            monkeypatch.setattr(CudaTransport, "open", classmethod(
                lambda cls, *a, **k: opened.append(k["lora"]) or CpuTransport()))
            gen._choose_transport(s, s.pool, gen._lora_batch([None], 1))
            assert opened == [None]
        finally:
            s.use_transport(CpuTransport())
            s.close()
