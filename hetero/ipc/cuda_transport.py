"""The CUDA transport (hetero/cuda/signal.cu through ctypes): a decode layer's round trip to the
CPU workers enqueued on the model's stream, with no host synchronization per layer; see
hetero.ipc.transport for the seam it implements.

  CudaTransport  one call enqueues on the model's current stream: copy-out + signal (the GPU
                 writes q/k/v into the page-locked, mapped staging area and publishes the job in
                 the control segment), a wait for the job's FIN, and the merge into the output.
                 A step's length update waits for the step's end event, at the next step (the one
                 synchronization per token, which HF's generate loop makes anyway). LoRA decode
                 deltas take the same road (lora_begin / lora_end).
  CudaDecode     the engine's decode tokens (hetero.engine.paged.PagedKV on a CUDA model): the
                 same round trip in two halves per layer, post (copy-out + signal) and finish
                 (wait + merge), with the step's prompt chunks attended on the device between.
  Watchdog       a host thread that releases the stream (ABORT) when a worker dies or stalls
                 (a worker that fails a job writes ABORT itself; the watchdog reports it);
                 the error is raised at the next call.
"""
import ctypes
import logging
import mmap
import threading
import time

import numpy as np
import torch

from hetero.errors import HeteroError, WorkerDiedError, WorkerError
from hetero.ipc import control as C
from hetero.ipc.control import BF16, F16, F32
from hetero.ipc.pool import describe_exit

log = logging.getLogger("hetero")
PAGE = mmap.PAGESIZE


class Watchdog:
    """While the GPU may wait on the workers: every `period` s, check that the workers live and
    that an unfinished job (FIN != UNITS) advances; on a dead worker, a failed job (its worker
    wrote ERR and ABORT), or no progress for the pool's job_timeout, write ABORT (the GPU's waits
    return at once, the stream drains), mark the pool broken and keep the error for the host to
    raise (`check`); once more when stopped."""

    def __init__(self, pool, period=0.01):
        self.pool, self.period, self.error = pool, period, None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hetero-watchdog", daemon=True)
        pool.words[C.ABORT] = 0
        self._errs = [int(pool.words[C.err_word(r)]) for r in range(pool.n)]   # a new value: a job failed
        self._thread.start()

    def _run(self):
        pool, w, errs = self.pool, self.pool.words, self._errs
        seen, since = None, time.monotonic()
        while True:
            last = self._stop.wait(self.period)     # stop(): one more look (the host drained the GPU first)
            err = None
            for rank, p in enumerate(pool.procs):
                if p.poll() is not None:
                    err = WorkerDiedError(f"CPU worker {rank} (pid {p.pid}) {describe_exit(p.returncode)} while "
                                          "the GPU waited on the workers; the pool is broken")
                    break
                if w[C.err_word(rank)] != errs[rank]:
                    err = WorkerError(f"CPU worker {rank} failed a GPU-posted job; its traceback "
                                      "is on stderr")
                    break
            # an attention job is unfinished while FIN != UNITS; a LoRA job while a worker's GO is
            # ahead of its DONE
            behind = tuple(r for r in range(pool.n) if C.go_seq(int(w[C.go_word(r)])) > int(w[C.done_word(r)]))
            now, progress = time.monotonic(), (int(w[C.TICKET]), int(w[C.FIN]), int(w[C.UNITS]), behind)
            if err is None and not last and (progress[1] != progress[2] or behind):
                if progress != seen:
                    seen, since = progress, now
                elif now - since > pool.job_timeout:
                    holders = list(behind) if progress[1] == progress[2] else \
                        [r for r in range(pool.n) if C.ticket_tag(int(w[C.busy_word(r)])) == int(w[C.TICKET]) >> 32]
                    pool.stuck = holders or list(range(pool.n))     # killed at pool.close
                    err = WorkerError(f"CPU workers made no progress on a GPU-posted job for "
                                      f"{pool.job_timeout:g} s (workers holding it: {holders}); "
                                      "HeteroConfig.worker_timeout")
            else:
                seen, since = progress, now
            if err is not None:
                self.error = err
                pool.broken = str(err)
                w[C.ABORT] = 1                                       # release the GPU's waits
                return
            if last:
                return

    def check(self):
        if self.error is not None:
            raise self.error

    def stop(self):
        self._stop.set()
        self._thread.join()


_CODES = {torch.float32: F32, torch.bfloat16: BF16, torch.float16: F16}     # signal.cu's dtype codes


class _Lib:
    """The compiled signal.cu (ctypes), loaded once per process and device architecture."""
    _cache = {}

    @classmethod
    def load(cls, arch):
        if arch not in cls._cache:
            from hetero.cuda.build import cuda_library

            lib = ctypes.CDLL(cuda_library(arch))
            vp, i64p, f64p = ctypes.c_void_p, ctypes.POINTER(ctypes.c_int64), ctypes.POINTER(ctypes.c_double)
            lib.hetero_attention_step.argtypes = [vp, ctypes.c_int, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp,
                                                  i64p, vp, i64p, f64p, vp]
            lib.hetero_attention_post.argtypes = [vp, ctypes.c_int, vp, vp, vp, vp, vp, vp, i64p, vp, i64p, f64p,
                                                  vp]
            lib.hetero_attention_finish.argtypes = [vp, ctypes.c_int, vp, vp, vp, vp, vp, i64p, vp, i64p, f64p]
            lib.hetero_lora_post.argtypes = [vp, ctypes.c_int, vp, vp, ctypes.c_int64, vp, vp, i64p, vp]
            lib.hetero_lora_finish.argtypes = [vp, ctypes.c_int, vp, vp, ctypes.c_int64, vp, i64p]
            lib.hetero_register.argtypes = [vp, ctypes.c_size_t, ctypes.POINTER(vp)]
            lib.hetero_unregister.argtypes = [vp]
            lib.hetero_counter_alloc.argtypes = [ctypes.POINTER(vp)]
            lib.hetero_counter_free.argtypes = [vp]
            lib.hetero_error_string.argtypes = [ctypes.c_int]
            lib.hetero_error_string.restype = ctypes.c_char_p
            cls._cache[arch] = lib
        return cls._cache[arch]


class _Unlock:
    """Releases a page lock of hetero_register on `device` (AdapterStore.device_map)."""

    def __init__(self, lib, device, ptr):
        self.lib, self.device, self.ptr = lib, device, ptr

    def __call__(self):
        with torch.cuda.device(self.device):
            self.lib.hetero_unregister(ctypes.c_void_p(self.ptr))


def _ptr(a):
    return a.ctypes.data_as(ctypes.POINTER(ctypes.c_int64 if a.dtype == np.int64 else ctypes.c_double))


class CudaTransport:
    """See the module docstring. Build with `CudaTransport.open(pool, session, device)`, which
    returns None (and logs why, once) when the extension cannot be built or loaded."""
    name = "cuda"
    parent_takes_units = False   # the host thread enqueues the GPU's work: one more worker takes its share
    ctrl_for_life = True         # the control segment page-locked from open to close (CudaDecode: per step)
    why = None           # why the last open() failed
    _said = set()

    @classmethod
    def open(cls, pool, session, device, quiet=False, lora=None):
        try:
            major, minor = torch.cuda.get_device_capability(device)
            return cls(_Lib.load(major * 10 + minor), pool, session, device, lora)
        except HeteroError:         # a worker died (the ping): not the extension's fault
            raise
        except Exception as e:      # no nvcc, a compile error, an old driver: the exact fallback
            cls.why = f"{type(e).__name__}: {str(e).strip()}"
            if not quiet and cls.why not in cls._said:
                cls._said.add(cls.why)
                log.warning("hetero: CUDA transport unavailable (%s); decode uses host copies",
                            cls.why.splitlines()[0])
            return None

    def __init__(self, lib, pool, session, device=None, lora=None, start=True):
        """session: a KVSession, or a PagedKV (the layout's arrays from `lengths` to `part_l` are
        page-locked and mapped). start: the workers spin and the watchdog runs from now (begin)."""
        self.lib, self.pool, self.device = lib, pool, device    # the model's GPU: every call runs on it
        self.lora = lora                        # the generator's AdapterStore: its staging is mapped too
        self.lparams = np.zeros(6, np.int64)    # a LoRA job's seq, rows, din, site, dout, parts (LoraParams)
        self._regs, self.watchdog, self.counter = [], None, None
        self._awake = False                     # begin() set the workers spinning (end() stops them)
        self.pending, self.step_end = 0, None    # rows of a step whose end the host has not seen
        self._kv, self._sinks = None, {}
        lay = session.layout
        self.dims = np.array([0, lay.q_heads, lay.kv_heads, 0, session.spec.head_dim, lay.tmax, lay.dpad,
                              lay.nparts], np.int64)          # B, Hq, Hkv, T, D, Tmax, Dp, NS (signal.cu)
        self.iparams = np.zeros(9, np.int64)    # seq, layer, T, window, nsplit, units, active, psplit, ngroups
                                                # (JobParams)
        self.fparams = np.zeros(2, np.float64)  # scale, softcap
        self._args = tuple(map(_ptr, (self.dims, self.iparams, self.fparams, self.lparams)))   # ctypes pointers, once
        try:
            self._map(session)
            if start:
                self.begin()
        except BaseException:
            self.close()
            raise

    def begin(self):
        """The GPU may post jobs from now: the workers spin (it cannot wake a sleeper), the
        watchdog watches."""
        self._awake = True
        try:
            self.pool.keep_awake(True)
            self.watchdog = Watchdog(self.pool)
        except BaseException:
            self._sleep()
            raise

    def end(self):
        """The GPU posts no more (its stream drained): stop the watchdog and the spinning this
        transport started (another's, e.g. a generator call's beside a failed open, stays); raise
        the watchdog's error, if any."""
        err = None
        if self.watchdog is not None:
            self.watchdog.stop()
            err = self.watchdog.error
            self.watchdog = None
        self._sleep()
        if err is not None:
            raise err

    def _sleep(self):
        if self._awake and self.pool.words is not None:
            self.pool.keep_awake(False)
        self._awake = False

    # ---- the device-specific parts (tests replace them with the host build of protocol.h)
    def _map(self, session):
        """Page-lock the control segment and the session's staging region; their device addresses."""
        with torch.cuda.device(self.device):
            self._map_on_device(session)

    def _map_on_device(self, session):
        if self.ctrl_for_life:
            self.ctrl_dev = self._register(self.pool.words.ctypes.data, self.pool.words.nbytes)
        offs, _ = session.layout.offsets()
        if offs["lengths"][0] != 0:
            raise RuntimeError("the session layout must start with its lengths array")
        end = offs["part_l"][0] + session.part_l.numel() * 4
        dev = self._register(session.lengths.ctypes.data, -(-end // PAGE) * PAGE)   # lengths .. part_l
        self.dev = {n: dev + offs[n][0] for n in ("q", "knew", "vnew", "part_o", "part_m", "part_l")}
        if self.lora is not None:               # the LoRA staging (hdr .. delta): x in, deltas out
            base = self.lora.views["hdr"].ctypes.data            # offset 0 of the staging segment
            if self.lora.device_map is None or self.lora.device_map[0] != base:
                self.lora.device_map = (base, self._lock_staging(base), _Unlock(self.lib, self.device, base))
            ldev = self.lora.device_map[1]
            self.dev.update({n: ldev + self.lora.views[n].ctypes.data - base for n in ("hdr", "x", "delta")})
        c = ctypes.c_void_p()
        self._call(self.lib.hetero_counter_alloc(ctypes.byref(c)), "cudaMalloc")
        self.counter = c.value

    def _lock_staging(self, base):
        """Page-lock and map the adapter store's staging once (kept across calls: released by the
        store when it replaces or closes it); its device address."""
        return self._page_lock(base, -(-self.lora.staging.size // PAGE) * PAGE)

    def _register(self, ptr, nbytes):
        """_page_lock, released at close (_unmap)."""
        d = self._page_lock(ptr, nbytes)
        self._regs.append(ptr)
        return d

    def _page_lock(self, ptr, nbytes):
        """Page-lock and map [ptr, ptr + nbytes) (the current device); its device address."""
        d = ctypes.c_void_p()
        self._call(self.lib.hetero_register(ctypes.c_void_p(ptr), nbytes, ctypes.byref(d)), "cudaHostRegister")
        return d.value

    def _launch(self, s, q, k, v, out, sink):
        """Enqueue copy-out + signal, wait, merge (signal.cu) on the current stream."""
        stream = torch.cuda.current_stream(q.device).cuda_stream
        with torch.cuda.device(q.device):
            rc = self.lib.hetero_attention_step(
                stream, s.layout.code, q.data_ptr(), k.data_ptr(), v.data_ptr(), self.dev["q"], self.dev["knew"],
                self.dev["vnew"], self.dev["part_o"], self.dev["part_m"], self.dev["part_l"],
                None if sink is None else sink.data_ptr(), out.data_ptr(), self._args[0], self.ctrl_dev,
                self._args[1], self._args[2], self.counter)
        self._call(rc, "the attention step launch")

    def _launch_lora_post(self, code, x):
        """Enqueue x -> the LoRA staging, then the job (signal.cu's hetero_lora_post)."""
        stream = torch.cuda.current_stream(x.device).cuda_stream
        with torch.cuda.device(x.device):
            rc = self.lib.hetero_lora_post(stream, code, x.data_ptr(), self.dev["x"], self.lora.views["x"].shape[1],
                                           self.dev["hdr"], self.ctrl_dev, self._args[3], self.counter)
        self._call(rc, "the LoRA job launch")

    def _launch_lora_finish(self, code, out):
        """Enqueue the wait for the LoRA job and the deltas' add into out (hetero_lora_finish)."""
        stream = torch.cuda.current_stream(out.device).cuda_stream
        with torch.cuda.device(out.device):
            rc = self.lib.hetero_lora_finish(stream, code, out.data_ptr(), self.dev["delta"],
                                             self.lora.views["delta"].shape[1], self.ctrl_dev, self._args[3])
        self._call(rc, "the LoRA add launch")

    def _event(self):
        e = torch.cuda.Event()
        e.record(torch.cuda.current_stream(self.device))
        return e

    def _drain(self):
        if self._regs:
            torch.cuda.synchronize(self.device)

    def _unmap(self):
        with torch.cuda.device(self.device):
            if self.counter is not None:
                self.lib.hetero_counter_free(ctypes.c_void_p(self.counter))
                self.counter = None
            for ptr in reversed(self._regs):
                self.lib.hetero_unregister(ctypes.c_void_p(ptr))
            self._regs = []

    def _call(self, rc, what):
        if rc != 0:
            raise RuntimeError(f"{what} failed: {self.lib.hetero_error_string(rc).decode()}")

    # ---- the protocol
    def settle(self, s):
        """Before a step's first write: apply the previous step's length update once its last
        layer ran (wait for its end event: the per-token synchronization)."""
        if self.pending:
            self.watchdog.check()
            if not self.step_end.query():          # HF's loop usually synchronized already
                self.step_end.synchronize()
            self.watchdog.check()
            T, self.pending = self.pending, 0
            s.advance(T)

    def stage(self, s, key, value):
        self.watchdog.check()
        self._kv = (key.to(s.spec.dtype).contiguous(), value.to(s.spec.dtype).contiguous())

    def attention(self, s, job, query, sinks):
        self.watchdog.check()
        B, Hq, T, D = query.shape
        q = query.to(s.spec.dtype).contiguous()
        k, v = self._kv
        out = torch.empty(B, T, Hq, D, dtype=s.spec.dtype, device=query.device)
        sink = None if sinks is None else self._sink(job.layer, sinks)
        self.pool.seq += 1
        active = min(self.pool.n, job.workers + 1)   # no parent taker here: its share goes to a worker
        self.iparams[:] = (self.pool.seq, job.layer, T, job.window, job.nsplit, job.units, active, job.psplit, 0)
        self.fparams[:] = (job.scale, job.softcap)
        self.dims[0], self.dims[3] = B, T
        self._launch(s, q, k, v, out, sink)
        return out.to(query.dtype)

    def _sink(self, layer, sinks):
        hit = self._sinks.get(layer)
        if hit is None or hit[0] is not sinks:
            hit = self._sinks[layer] = (sinks, sinks.detach().float().contiguous())
        return hit[1]

    def lora_rows(self, slots):
        """Before the call's first LoRA job: request b's adapter slot (-1: the base model), read by
        the workers (hetero.adapters.layout.run_rows)."""
        self.lora.views["rowslot"][:len(slots)] = slots

    def lora_begin(self, site, x, dout, parts):
        """x [rows, din] (device, contiguous; one decode token per request): enqueue its copy into
        the LoRA staging and the workers' job for `site` on `parts` workers; the base projection
        runs on the stream meanwhile. Returns the job for lora_end."""
        self.watchdog.check()
        self.pool.seq += 1
        self.lparams[:] = (self.pool.seq, x.shape[0], x.shape[1], site, dout, parts)
        self._launch_lora_post(_CODES[x.dtype], x)
        return self.lparams.copy()

    def lora_end(self, job, out):
        """out [rows, dout] (device, contiguous: the base projection's output) += the job's deltas,
        enqueued after the wait for the workers."""
        self.lparams[:] = job
        self._launch_lora_finish(_CODES[out.dtype], out)

    def step_done(self, s, T):
        self.pending += T
        self.step_end = self._event()

    def close(self):
        """Wait for the GPU's jobs, stop the watchdog, release the page locks. Idempotent. Raises
        the watchdog's error, if any (a worker died, stalled or failed a job during the call)."""
        try:
            self._drain()
        finally:
            try:
                self.end()
            finally:
                self._unmap()


class CudaDecode(CudaTransport):
    """See the module docstring. Build with `CudaDecode.open(pool, kv, device)` (None where the
    extension cannot be used). The page locks last as long as the pool's segment; the workers spin
    and the watchdog runs only from a step's first post to its end_step (between two steps a
    generator's call may run its own sessions on the same workers)."""

    ctrl_for_life = False   # a generator's calls lock the same control segment between two steps (CUDA
                            # refuses a second lock of a range): locked from a step's first post to its end

    def __init__(self, lib, pool, kv, device=None, lora=None):
        if lora is not None:            # the engine's adapters run on the model's device
            raise ValueError("CudaDecode carries no LoRA jobs")
        self.ctrl_dev = None
        super().__init__(lib, pool, kv, device, start=False)
        self.open_job = None            # (layer, rows) of a posted job whose finish is not enqueued

    def begin(self):
        self._lock_ctrl()
        try:
            super().begin()
        except BaseException:
            self._unlock_ctrl()
            raise

    def end(self):
        try:
            super().end()
        finally:
            self._unlock_ctrl()

    def _lock_ctrl(self):
        """Page-lock the pool's control segment for the step (its device address: ctrl_dev)."""
        with torch.cuda.device(self.device):
            self.ctrl_dev = self._page_lock(self.pool.words.ctypes.data, self.pool.words.nbytes)

    def _unlock_ctrl(self):
        if self.ctrl_dev is not None:
            self.ctrl_dev = None
            with torch.cuda.device(self.device):
                self.lib.hetero_unregister(ctypes.c_void_p(self.pool.words.ctypes.data))

    def post(self, kv, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, window: int,
             scale: float, softcap: float, nsplit: int, psplit: int, ngroups: int, workers: int, units: int):
        """Enqueue the copy of q [n, Hq, D] and new k/v [n, Hkv, D] (the device) into kv's staging
        and the job's publication (kv: the PagedKV whose staging is mapped; its tables written)."""
        if self.watchdog is None:
            self.begin()
        self.watchdog.check()
        dt = kv.spec.dtype
        q, k, v = (t.to(dt).contiguous() for t in (query, key, value))
        n = q.shape[0]
        self.pool.seq += 1
        active = min(self.pool.n, workers + 1)       # no parent taker: its share goes to a worker
        self.iparams[:] = (self.pool.seq, layer, 1, window, nsplit, units, active, psplit, ngroups)
        self.fparams[:] = (scale, softcap)
        self.dims[0], self.dims[3] = n, 1
        self._launch_post(kv, q, k, v)
        self.open_job = (layer, n)

    def finish(self, kv, sinks: torch.Tensor | None) -> torch.Tensor:
        """Enqueue the wait for the posted job and the merge: [n, Hq, D] (the device, the model's dtype)."""
        layer, n = self.open_job
        out = torch.empty(n, 1, kv.spec.q_heads, kv.spec.head_dim, dtype=kv.spec.dtype, device=self.device)
        self._launch_finish(kv, out, None if sinks is None else self._sink(layer, sinks))
        self.open_job = None
        return out.view(n, kv.spec.q_heads, kv.spec.head_dim)

    def end_step(self):
        """The step's forward is over (or raised): wait for the stream, then for the workers to
        finish the last job the GPU published (a forward that raised between the halves left
        nothing on the stream waiting for it; the next step rewrites what they read), then stop
        the watchdog and the spinning. Raises the watchdog's error (a worker died, stalled or
        failed a job); a CUDA error here leaves the pool broken (what the stream ran is unknown)."""
        if self.watchdog is None:
            return
        try:
            try:
                self._drain()
            except BaseException as e:
                self.pool.broken = f"a CUDA error while the GPU posted the workers' jobs ({e})"
                raise
            # the step's last job (its params stay in iparams); one never published has no ticket
            seq, units, w = int(self.iparams[0]), int(self.iparams[5]), self.pool.words
            while int(w[C.TICKET]) >> 32 == C.ticket_tag(seq) and w[C.FIN] != units and not w[C.ABORT] \
                    and self.watchdog.error is None:
                time.sleep(0.0002)
        finally:
            self.open_job = None
            self.end()

    def _launch_post(self, kv, q, k, v):
        stream = torch.cuda.current_stream(q.device).cuda_stream
        with torch.cuda.device(q.device):
            rc = self.lib.hetero_attention_post(
                stream, kv.layout.code, q.data_ptr(), k.data_ptr(), v.data_ptr(), self.dev["q"], self.dev["knew"],
                self.dev["vnew"], self._args[0], self.ctrl_dev, self._args[1], self._args[2], self.counter)
        self._call(rc, "the decode job's launch")

    def _launch_finish(self, kv, out, sink):
        stream = torch.cuda.current_stream(out.device).cuda_stream
        with torch.cuda.device(out.device):
            rc = self.lib.hetero_attention_finish(
                stream, kv.layout.code, self.dev["part_o"], self.dev["part_m"], self.dev["part_l"],
                None if sink is None else sink.data_ptr(), out.data_ptr(), self._args[0], self.ctrl_dev,
                self._args[1], self._args[2])
        self._call(rc, "the decode job's merge launch")
