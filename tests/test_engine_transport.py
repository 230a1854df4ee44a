"""The engine's decode jobs through the CUDA transport's protocol (hetero.ipc.cuda_transport.CudaDecode)
on every machine: its device parts replaced by the host build of hetero/cuda/protocol.h (HostDecode
below, as tests/test_transport.py's HostTransport for a generator's sessions). The same C code the
GPU kernels run copies each layer's decode tokens into the pool's staging, publishes the job to the
real workers (NGROUPS included: a paged pool's shared-prefix groups), waits on FIN or ABORT and
merges the partials, while the step's prompt chunks are attended in between. So the two halves,
the workers-only plan, the per-step spinning and watchdog and their failures are checked without a
GPU; the CUDA source must compile and export the halves wherever nvcc exists."""
import os
import signal
import time

import pytest
import torch

from hetero import Engine, EngineConfig
from hetero.cuda import build
from hetero.engine import runner as runner_mod
from hetero.errors import WorkerDiedError, WorkerError
from hetero.ipc import control as C
from hetero.ipc.cuda_transport import CudaDecode, _ptr as _p
from hetero.model_spec import inspect_model
from tests.conftest import build_model, our_segments
from tests.test_engine import assert_exact, prompts, run
from tests.test_gpu import engine_matches_hf
from tests.test_kernel import FixedPlan
from tests.test_transport import host_lib, host_wait_and_merge


class HostDecode(CudaDecode):
    """CudaDecode with signal.cu's kernels done on the host by protocol.h's code: the copy-out
    into the pool's staging (hetero_host_copy_out), the publication (hetero_host_publish), the
    stream's wait (a spin on hetero_host_released) and the merge (hetero_host_merge). `during`,
    if set, is called with the job's index before each publication (what a step looks like then)."""

    def __init__(self, pool, kv, during=None):
        super().__init__(host_lib(), pool, kv)
        self.jobs, self.during = [], during

    def _map(self, session):
        pass

    def _lock_ctrl(self):                    # the control segment's page lock: a step's, here a flag
        self.ctrl_dev = self.pool.words.ctypes.data

    def _unlock_ctrl(self):
        self.ctrl_dev = None

    def _drain(self):
        pass

    def _unmap(self):
        pass

    def _launch_post(self, kv, q, k, v):
        self.lib.hetero_host_copy_out(q.data_ptr(), k.data_ptr(), v.data_ptr(), kv.q.data_ptr(), kv.knew.data_ptr(),
                                      kv.vnew.data_ptr(), _p(self.dims), q.element_size())
        if self.during is not None:
            self.during(len(self.jobs))
        self.lib.hetero_host_publish(self.pool.words.ctypes.data, _p(self.iparams), _p(self.fparams))
        self.jobs.append(self.iparams.copy())

    def _launch_finish(self, kv, out, sink):
        host_wait_and_merge(self, kv, out, sink)


def host_decode(engine, during=None) -> HostDecode:
    """The engine's decode jobs through HostDecode from its next step; the plans asked for recorded
    in kv.parents (whether the parent takes units: never, the GPU's jobs are the workers')."""
    kv = engine.kv
    kv.gpu = HostDecode(engine.pool, kv, during)
    kv.parents = []
    planner, plan = kv.planner, kv.planner.plan

    def recorded(lengths, T, layout, parent=True):
        kv.parents.append(parent)
        return plan(lengths, T, layout, parent)

    planner.plan = recorded
    return kv.gpu


def make(model, **cfg):
    base = dict(kv_blocks=48, long_prefill_chunk=16, max_num_batched_tokens=40, background=False, cpu_workers=2,
                max_model_len=256)
    return Engine(model, EngineConfig(**{**base, **cfg}))


@pytest.mark.parametrize("model_type,dtype", [("llama", torch.float32), ("gemma2", torch.float32),
                                              ("gemma3_text", torch.float32)])
def test_engine_decode_through_the_cuda_protocol_matches_hf(model_type, dtype):
    """Requests joining while others decode, a shared document (its blocks read once per step: a
    job's NGROUPS), prompt chunks attended between a layer's post and finish, preemption under a
    small pool: HF generate's tokens for each request alone, scores close. Gemma 2 / 3: windowed
    layers in a pool of their own (their jobs without groups), soft-capping (Gemma 2)."""
    made = []

    def hook(eng):
        made.append((eng.kv, host_decode(eng)))

    engine_matches_hf(model_type, dtype, "cpu", hook=hook)
    for kv, gpu in made:
        assert gpu.jobs and kv.parents and not any(kv.parents)   # planned for the workers alone
    jobs = made[0][1].jobs                                     # the mixed load: a shared document
    assert any(j[8] > 0 for j in jobs)                         # groups published in NGROUPS
    windows = {int(j[1]) for j in jobs if j[3] > 0}            # windowed layers: no groups
    assert all(j[8] == 0 for j in jobs if j[3] > 0)
    assert bool(windows) == (model_type in ("gemma2", "gemma3_text"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_decode_job_posted_by_the_protocol_equals_the_hosts(dtype):
    """One layer's decode job over the pool, for two requests sharing their first blocks (a group)
    and one of its own, posted and merged by the protocol (HostDecode) and by the host (post_decode /
    finish_decode's CPU path) with the same plan: equal outputs (bf16: q widened, k/v copied as
    bits into the staging), in the model's dtype."""
    model = build_model("llama", dtype=dtype)[0]
    s = inspect_model(model)
    g = torch.Generator().manual_seed(0)
    with make(model) as eng:
        kv = eng.kv
        kv.planner = FixedPlan(1, 2)
        kv.ensure_open()
        lengths = [70, 81, 40]
        tables = [[0, 1, 2], [0, 1, 3], [4, 5]]             # the first two share blocks 0 and 1
        for table, n in zip(tables, lengths):
            for layer in range(s.layers):
                kv.write_rows(layer, torch.tensor(table), 0, torch.randn(s.kv_heads, n, s.head_dim, generator=g).to(dtype),
                              torch.randn(s.kv_heads, n, s.head_dim, generator=g).to(dtype))
        q = torch.randn(3, s.q_heads, s.head_dim, generator=g).to(dtype)
        k, v = (torch.randn(3, s.kv_heads, s.head_dim, generator=g).to(dtype) for _ in range(2))
        outs = []
        for gpu in (None, HostDecode(eng.pool, kv)):
            kv.gpu = gpu
            kv.begin_decode(lengths, tables)
            assert kv.ngroups == 1
            kv.post_decode(1, q, k, v, 0, s.head_dim ** -0.5, 0.0)
            outs.append(kv.finish_decode().to(dtype))
            kv.end_step()
        assert gpu.jobs[0][8] == 1 and gpu.jobs[0][6] == 2      # NGROUPS; workers 0..1 posted (no parent)
        kv.gpu = None
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(outs[1], outs[0], atol=tol, rtol=tol)


def test_each_step_spins_watches_and_locks_only_while_it_runs(llama):
    """Workers spin (AWAKE), the watchdog runs and the control segment is page-locked from a step's
    first decode job to its end; between steps they may sleep, nothing watches and nothing is
    locked (a generator's call may use the pool then, locking the same segment)."""
    seen = []
    with make(llama) as eng:
        gpu = host_decode(eng, during=lambda i: seen.append((int(eng.pool.words[C.AWAKE]), gpu.watchdog is not None,
                                                             gpu.ctrl_dev is not None)))
        streams = [eng.add_request(p, 6, output_scores=True) for p in prompts([20, 45], seed=7)]
        while not all(s.finished for s in streams):
            eng.step()
            assert eng.pool.words[C.AWAKE] == 0 and gpu.watchdog is None and gpu.open_job is None
            assert gpu.ctrl_dev is None
        for s, p in zip(streams, prompts([20, 45], seed=7)):
            assert_exact(llama, s, p, 6)
    assert seen and all(x == (1, True, True) for x in seen)


def test_a_failed_open_leaves_another_transports_spinning_alone(llama):
    """A CudaDecode whose setup fails (here its page locks) does not stop the workers' spinning that
    another transport (a generator call's, running meanwhile) started and still needs."""
    with make(llama) as eng:
        eng.kv.ensure_open()
        eng.pool.keep_awake(True)                        # a generator call's CudaTransport, say

        class Failing(HostDecode):
            def _map(self, session):
                raise RuntimeError("cudaHostRegister failed")

        with pytest.raises(RuntimeError, match="cudaHostRegister"):
            Failing(eng.pool, eng.kv)
        assert eng.pool.words[C.AWAKE] == 1
        eng.pool.keep_awake(False)


@pytest.mark.parametrize("how", ["stopped", "killed"])
def test_a_worker_failing_a_gpu_posted_job_fails_the_step_within_seconds(llama, how):
    """A worker stopped (no progress for worker_timeout) or killed while a step's decode job waits
    on it: the watchdog releases the wait, the step raises (WorkerError / WorkerDiedError) within
    seconds and fails its requests; close() leaves no segment."""
    before = set(our_segments(os.getpid()))
    eng = make(llama, cpu_workers=1, worker_timeout=0.5)
    victim = eng.pool.procs[0]
    try:
        s = eng.add_request(prompts([40], seed=8)[0], 20)
        while not s.token_ids:
            eng.step()                           # decoding: the next steps post jobs

        def fault(i):
            if i == 3:
                os.kill(victim.pid, signal.SIGSTOP if how == "stopped" else signal.SIGKILL)

        host_decode(eng, during=fault)
        t0 = time.perf_counter()
        with pytest.raises(WorkerError if how == "stopped" else WorkerDiedError):
            run(eng, [s])
        assert time.perf_counter() - t0 < 3.0
        assert s.finished and isinstance(s.error, WorkerError)
        assert eng.pool.words[C.ABORT] == 1 and eng.kv.gpu.watchdog is None
    finally:
        if how == "stopped" and victim.poll() is None:
            os.kill(victim.pid, signal.SIGCONT)
        eng.close()
    assert set(our_segments(os.getpid())) == before


@pytest.mark.parametrize("where", ["chunk attention", "merge launch"])
def test_a_step_raising_between_the_halves_waits_for_the_posted_job(llama, monkeypatch, where):
    """A step that raises after a layer's decode job was posted but before anything waits for it
    (a prompt chunk's attention, or the merge's launch itself): end_step waits for the workers to
    finish it (they must not read a staging the next step rewrites), the pool stays usable, and
    later requests are exact."""
    def boom(*a, **k):
        raise RuntimeError(f"boom in the {where}")

    with make(llama) as eng:
        gpu = host_decode(eng)
        s = eng.add_request(prompts([40], seed=9)[0], 10)
        while not s.token_ids:
            eng.step()
        real = runner_mod.chunk_attention
        if where == "chunk attention":
            monkeypatch.setattr(runner_mod, "chunk_attention", boom)
        else:
            monkeypatch.setattr(gpu, "_launch_finish", boom)
        s2 = eng.add_request(prompts([30], seed=10)[0], 4)     # a chunk beside s's decode token
        with pytest.raises(RuntimeError, match="boom"):
            eng.step()
        assert gpu.open_job is None and gpu.watchdog is None and gpu.ctrl_dev is None
        assert eng.pool.words[C.FIN] == gpu.jobs[-1][5]       # the posted job's units all finished
        assert s.error is not None and s2.error is not None and eng.pool.alive
        monkeypatch.setattr(runner_mod, "chunk_attention", real)
        monkeypatch.undo()
        p = prompts([25, 50], seed=11)
        streams = [eng.add_request(x, 6, output_scores=True) for x in p]
        run(eng, streams)
        for st, x in zip(streams, p):
            assert_exact(llama, st, x, 6)


def test_use_gpu_opens_the_extension_or_says_why(llama, monkeypatch, caplog):
    """PagedKV.use_gpu: CudaDecode.open builds the transport where the extension loads (its
    device parts replaced: the host library, no page locks); where it cannot load, "cuda" raises
    naming why and "auto" keeps host copies with one log line; "host" never tries."""
    from hetero.errors import UnsupportedModelError
    from hetero.ipc import cuda_transport as ct

    monkeypatch.setattr(ct.CudaTransport, "_said", set())      # the reasons logged so far in this process
    with make(llama) as eng:
        kv = eng.kv
        kv.use_gpu(torch.device("cpu"), "host")
        assert kv.gpu is None
        with pytest.raises(UnsupportedModelError, match="EngineConfig.transport='cuda'"):
            kv.use_gpu(torch.device("cpu"), "cuda")        # no CUDA device here: the reason is named
        with caplog.at_level("WARNING", logger="hetero"):
            kv.use_gpu(torch.device("cpu"), "auto")
        assert kv.gpu is None and "CUDA transport unavailable" in caplog.text
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
        monkeypatch.setattr(ct._Lib, "load", classmethod(lambda cls, arch: host_lib()))
        monkeypatch.setattr(CudaDecode, "_map", lambda self, session: None)
        kv.use_gpu(torch.device("cpu"), "cuda")
        assert isinstance(kv.gpu, CudaDecode) and kv.gpu.watchdog is None     # no spinning before a step
        assert list(kv.gpu.dims[1:]) == [kv.layout.q_heads, kv.layout.kv_heads, 0, kv.spec.head_dim, 1,
                                         kv.layout.dpad, kv.layout.nparts]
        monkeypatch.setattr(CudaDecode, "_drain", lambda self: None)
        monkeypatch.setattr(CudaDecode, "_unmap", lambda self: None)


@pytest.mark.parametrize("refuse", [False, True])
def test_a_pool_is_page_locked_chunk_by_chunk_as_a_gpu_s_copies_touch_it(llama, refuse):
    """PagedKV.lock_pages (a CUDA model's engine): the pool's K/V get locked in page-aligned chunks as
    write_rows's copies first touch them, each chunk once, never past its array; a copy is cut
    at the chunks' bounds into pieces, each within one lock (RangePins.copy_in: the pieces' DMAs
    put the same bytes as one copy); close() releases every lock before the unmap. A driver that
    refuses stops the locking, and copies go whole and synchronous."""
    from hetero.offload.pinning import PAGE
    from tests.test_engine import make

    locked, unlocked = [], []

    def register(ptr, nbytes):
        assert ptr % PAGE == 0 and nbytes % PAGE == 0 and nbytes > 0
        assert all(ptr + nbytes <= p or p + n <= ptr for p, n in locked), "a page locked twice"
        if refuse:
            return False
        locked.append((ptr, nbytes))
        return True

    eng = make(llama, kv_blocks=24)
    try:
        kv = eng.kv
        kv.lock_pages("cpu", register, unlocked.append)
        pins = kv._pins
        pins.chunk = 2 * PAGE                                   # small chunks: bounds inside a layer
        arrays = [(t.data_ptr(), t.numel() * t.element_size()) for t in (kv.K, kv.V) if t.numel()]
        K0 = kv.kv[0][0]                                        # layer 0's K [Hkv, NB, Dp, BK]
        blk = K0[0, 0].numel() * K0.element_size()
        one = pins.lock(K0[0, 1].data_ptr(), blk)               # a block inside one chunk
        span = K0[0].data_ptr() + 5 * pins.chunk - blk // 2     # straddling a bound: two new chunks
        if refuse:
            assert one is None and pins.refused and not locked
            assert pins.lock(span, blk) is None                 # nothing more tried
        else:
            assert one == [(0, blk)] and len(locked) == 1
            assert pins.lock(K0[0, 1].data_ptr(), blk) == [(0, blk)] and len(locked) == 1   # once
            assert pins.lock(span, blk) == [(0, blk // 2), (blk // 2, blk // 2)] and len(locked) == 3
            last, n = arrays[-1]                                # an array's last bytes: its chunk
            assert pins.lock(last + n - 8, 8) == [(0, 8)]       # ends at the array's last page
            a, m = locked[-1]
            assert a + m == last + -(-n // PAGE) * PAGE
            assert pins.lock(last + n + 10 * PAGE, 8) is None   # past the arrays: no lock
        # a run of blocks across chunk bounds, copied in pieces: the bytes of one copy
        dst = K0[1, 2:9]
        src = torch.randn(dst.shape).to(dst.dtype)
        assert pins.copy_in(dst, src) is (not refuse)
        assert torch.equal(dst, src)
        ps = prompts([40, 70, 9], seed=6)
        streams = [eng.add_request(p, 6, output_scores=True) for p in ps]
        run(eng, streams)
        for s, p in zip(streams, ps):
            assert_exact(llama, s, p, 6)
    finally:
        eng.close()
    assert sorted(unlocked) == sorted(p for p, _ in locked) and not pins.locked


def test_a_one_block_request_locks_a_chunk_per_region_not_the_pool(llama):
    """A pool's K/V are [layer][kv head][block]: a request's first block touches every (layer, head)
    region, so the lock's chunks must be small beside a region, or the first request of a big pool
    locks all of it (the H200 lease: ~34 GB, 11 s, for a 64-token warm-up)."""
    from hetero.offload.pinning import PAGE
    from tests.test_engine import make

    locked = []
    eng = make(llama, kv_blocks=8192, max_model_len=256)
    try:
        kv = eng.kv
        kv.lock_pages("cpu", lambda ptr, n: locked.append(n) or True, lambda ptr: None)
        pins = kv._pins
        regions = 0
        for K, V in kv.kv:
            for t in (K, V):
                for h in range(t.shape[0]):              # block 0 of each head: a first request's rows
                    blk = t[h, 0].numel() * t.element_size()
                    assert pins.lock(t[h, 0].data_ptr(), blk) == [(0, blk)]
                    regions += 1
        pool = sum(t.numel() * t.element_size() for t in (kv.K, kv.V))
        assert pool // regions >= 16 << 20, "the test's pool is too small to tell"
        assert sum(locked) <= regions * (pins.chunk + PAGE) and sum(locked) <= pool // 4
    finally:
        eng.close()


def test_engine_transport_config_is_checked():
    with pytest.raises(ValueError, match="EngineConfig.transport must be"):
        EngineConfig(transport="gpu")


def test_cuda_library_loads_and_its_declarations_match_the_source():
    """signal.cu builds as the shared library the transports load (no GPU needed to load it), and
    _Lib.load declares every C entry point with as many arguments as the source gives it (ctypes
    would pass a wrong count silently)."""
    import re

    from hetero.ipc.cuda_transport import _Lib

    if build.nvcc() is None:
        pytest.skip("nvcc not found")
    lib = _Lib.load(90)
    src = open(os.path.join(os.path.dirname(build.__file__), "signal.cu")).read()
    extern = src[src.index('extern "C" {'):]
    found = re.findall(r"^\S.*?\b(hetero_\w+)\(([^)]*)\)\s*{", extern, re.M | re.S)
    assert {n for n, _ in found} >= {"hetero_attention_post", "hetero_attention_finish", "hetero_attention_step",
                                      "hetero_lora_post", "hetero_lora_finish", "hetero_register"}
    for name, params in found:
        n = len([p for p in params.split(",") if p.strip() and p.strip() != "void"])
        assert len(getattr(lib, name).argtypes) == n, name
