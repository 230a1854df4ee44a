"""CPU worker process: `python -m hetero.worker CTRL RANK NWORKERS CORE PARENT_PID SPIN [reuse]`.

Started by `WorkerPool` as a fresh interpreter with single-threaded numeric
libraries, pinned to one core. Imports numpy/numba only (never torch). Loop:
spin (atomic loads) on its own GO word, then sleep on it (futex), run the job
named in it (GO = job number and command), publish DONE. An attention job is
shared with the other workers and the parent through a tagged ticket
(kernel.run_job): a worker that wakes after its job ended finds it empty.
Exits on CMD_EXIT, or when the parent dies (rank 0 then unlinks the parent's
segments, so nothing is left in /dev/shm; so does any worker that reads EXIT after the parent died).
With `reuse` (the pool's REUSE), a worker that read EXIT unmaps everything and waits on its stdin
for the same arguments of another pool of the same parent (one line), and exits on end of file
(the parent closed the pipe, or died) or when its parent is gone.
It runs the jobs of every layer (attention kernels, LoRA, the arena's layout), so it sits above
them all; hetero.ipc.pool starts it by name (PROGRAM) and calls prepare_parent first.
"""
import os
import select
import signal
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import replace

import numpy as np

from hetero.adapters import layout as lora
from hetero.cpu_attention import kernel
from hetero.errors import WorkerError
from hetero.ipc import atomics, control as C, shm
from hetero.offload.arena import SessionLayout, slots_of

# Idle: spin `spin` polls on the GO word (a job due within microseconds starts at once), then
# block in a futex wait on it (the parent wakes a sleeping worker when it posts GO), so an idle
# worker leaves its core to others (torch's threads in a CPU model's dense layers). The wait
# times out every SLEEP_NS to notice a dead parent. Without futexes: poll every FALLBACK_SLEEP.
SLEEP_NS = 50_000_000
FALLBACK_SLEEP = 0.0001


class Worker:
    def __init__(self, ctrl_name, rank, nworkers, parent_pid, spin):
        self.rank, self.nworkers, self.parent_pid, self.spin = rank, nworkers, parent_pid, spin
        self.ctrl = shm.Segment(ctrl_name)
        self.words = self.ctrl.array(0, (C.nbytes(nworkers) // 8,), np.int64)
        self.floats = self.words.view(np.float64)
        self.session_name = None
        self.v = None  # session views (name -> numpy array)
        self.psegs = []   # shared-prefix groups' segments (Contexts'), mapped beside the session's
        self.lora_seg, self.lora_v = None, None   # LoRA staging segment and its views
        self.adapters = {}                        # slot -> {site: (A, BT, scaling)} views
        self.adapter_segs = {}                    # slot -> its segment

    def open_session(self):
        w = self.words
        self.close_session()
        lay = SessionLayout.from_words(w)
        self.session_name = C.read_name(w)
        self.seg = shm.Segment(self.session_name)
        v = self.v = lay.views(self.seg)
        self.code = lay.code
        self.slots = slots_of(v["ringed"])                      # per layer: where its KV lives
        rows = (lay.q_heads // lay.kv_heads) * lay.tmax
        self.qs = np.zeros((rows, lay.dpad), np.float32)        # private scratch: scaled queries
        self.qp = np.zeros((rows, lay.dpad // 2), np.uint32)    # private scratch: bf16 query pairs
        self.S = kernel.score_scratch(rows)                     # private scratch: scores
        srcs = []            # shared-prefix groups: map each source's segment (a Context's; read only)
        try:
            for g in range(0 if lay.paged else lay.groups):    # a paged pool's groups read the pool
                src = replace(lay, batch=1, cap=int(v["psrc"][g, 0]), tmax=int(v["psrc"][g, 1]), private=0, groups=0)
                self.psegs.append(shm.Segment(bytes(v["pnames"][g]).rstrip(b"\0").decode()))
                srcs.append(src.views(self.psegs[-1]))
        except BaseException:
            srcs = None
            self.close_session()             # nothing half-mapped; the job reports the error
            raise
        self.PKs, self.PVs = kernel.prefix_sources([x["K"] for x in srcs], [x["V"] for x in srcs], v["K"], v["V"])
        self.ident = kernel.identity_table(v["K"], v["Kr"], *self.PKs)     # an arena: blocks read in place
        self.pscratch = kernel.prefix_scratch(lay.batch * rows if srcs or lay.groups else 1, lay.dpad)
        self.ngroups = lay.groups         # a paged pool's: the job's NGROUPS word (kernel.run_job)

    def release(self):
        """Unmap everything (a reused worker serves the next pool with nothing of this one's)."""
        self.close_session()
        self.lora_v = None
        if self.lora_seg is not None:
            self.lora_seg.close()
            self.lora_seg = None
        for slot in list(self.adapter_segs):
            self.drop_adapter(slot)
        self.words = self.floats = None
        self.ctrl.close()

    def close_session(self):
        if self.v is not None:
            self.v = self.PKs = self.PVs = self.ident = None
            self.seg.close()
            for seg in self.psegs:
                seg.close()
            self.psegs = []
        self.session_name = None

    def open_lora(self):
        if self.lora_seg is not None:
            self.lora_v = None
            self.lora_seg.close()
        w = self.words
        self.lora_seg = shm.Segment(C.read_name(w))
        self.lora_v = shm.views(self.lora_seg, lora.staging(self.nworkers, int(w[C.ARG0]), int(w[C.ARG1])))

    def map_adapter(self):
        slot = int(self.words[C.ARG0])
        self.drop_adapter(slot)
        seg = self.adapter_segs[slot] = shm.Segment(C.read_name(self.words))
        self.adapters[slot] = lora.read_adapter(seg)

    def drop_adapter(self, slot):
        self.adapters.pop(slot, None)        # drop the views first: they pin the mapping
        seg = self.adapter_segs.pop(slot, None)
        if seg is not None:
            seg.close()

    def populate(self):
        """CMD_POPULATE (posted to every worker): this worker's share of two byte ranges of the
        session segment (2 MB pieces: whole huge pages where /dev/shm has them), faulted in."""
        w, parts = self.words, self.nworkers
        for i in (0, 2):
            start, n = int(w[C.POP_RANGES[i]]), int(w[C.POP_RANGES[i + 1]])
            per = -(-n // parts)
            step = -(-per // shm.HUGE_PAGE) * shm.HUGE_PAGE              # a multiple of 2 MB
            lo = start + self.rank * step
            shm.populate(self.seg.mm, lo, min(step, start + n - lo))

    def attend(self, seq):
        v = self.v
        kernel.run_job(self.words, self.floats, seq, C.busy_word(self.rank), self.code, v["q"], v["knew"],
                       v["vnew"], v["K"], v["V"], v["Kr"], v["Vr"], self.slots, v["tables"], v["rtables"],
                       self.ident, v["lengths"], v["order"],
                       v["skip"], v["pstart"], v["pgroup"], v["gblocks"], self.ngroups, v["part_o"],
                       v["part_m"], v["part_l"], self.qs, self.qp, self.S, self.PKs, self.PVs, self.pscratch)

    def orphaned(self):
        if os.getppid() == self.parent_pid:
            return False
        if self.rank == 0:  # the parent cannot clean up any more: do it for it
            self.clean_up()
        return True

    def clean_up(self):
        """Unlink a dead parent's names (they may be gone already: unlinking twice is harmless)."""
        for name in [self.session_name, *(seg.name for seg in self.psegs), self.lora_seg and self.lora_seg.name,
                     *(seg.name for seg in self.adapter_segs.values())]:
            if name:
                shm.unlink(name)
        shm.unlink(self.ctrl.name)
        shm.sweep_owner(self.ctrl.name, wait=5.0)   # the rest of the dead parent's names, its lock included

    def run(self) -> bool:
        """Serve jobs until EXIT (True) or the parent's death (False)."""
        w, last = self.words, 0
        go_i, asleep_i = C.go_word(self.rank), C.asleep_word(self.rank)
        while True:
            go = atomics.spin_until_changed(w, go_i, last, self.spin)
            if go == last:  # idle: sleep, and notice a dead parent
                if self.orphaned():
                    return False
                if atomics.load(w, C.AWAKE):     # the GPU posts GO and cannot wake a sleeper
                    continue
                if atomics.HAVE_FUTEX:
                    go = atomics.sleep_until_changed(w, go_i, last, asleep_i, SLEEP_NS)
                else:
                    time.sleep(FALLBACK_SLEEP)
                if go == last:
                    continue
            last = go
            seq, cmd = C.go_seq(go), C.go_cmd(go)
            try:
                if cmd == C.CMD_ATTN:
                    self.attend(seq)
                elif cmd == C.CMD_LORA:
                    lora.run_units(self.rank, self.lora_v, self.adapters)
                elif cmd == C.CMD_LORA_GPU:
                    lora.run_rows(self.rank, self.lora_v, self.adapters)
                elif cmd == C.CMD_OPEN:
                    self.open_session()
                elif cmd == C.CMD_POPULATE:
                    self.populate()
                elif cmd == C.CMD_LORA_OPEN:
                    self.open_lora()
                elif cmd == C.CMD_ADAPTER_MAP:
                    self.map_adapter()
                elif cmd == C.CMD_ADAPTER_DROP:
                    self.drop_adapter(int(self.words[C.ARG0]))
                elif cmd == C.CMD_CLOSE:
                    self.close_session()
                elif cmd == C.CMD_EXIT:
                    self.close_session()
                    atomics.store(w, C.done_word(self.rank), seq)
                    if os.getppid() != self.parent_pid:   # the parent was killed inside close(): whoever reads
                        self.clean_up()                   # EXIT after that is left to clean up for it
                        return False
                    return True
            except Exception:
                traceback.print_exc()
                atomics.store(w, C.err_word(self.rank), seq)
                atomics.store(w, C.ABORT, 1)      # a GPU waiting on this job gives up and adds nothing
            atomics.store(w, C.done_word(self.rank), seq)


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # the directory holding the package
WARM_UP = "from hetero.ipc import atomics; from hetero.cpu_attention import kernel; atomics.warm_up(); kernel.warm_up()"


def prepare_parent(env, timeout):
    """Before the parent first uses the attention kernel (WorkerPool calls it): compile it (on a
    cold numba cache) in a child process, then load it here from the cache, as every worker does.
    The parent takes units too, and numba's in-process JIT code rounds differently (1 ulp) from
    the object code it caches, so a parent that compiled the kernel itself would not be
    bit-identical with its workers."""
    global _prepared
    with _PREPARE_LOCK:                          # pools started by several threads at once
        if _prepared or kernel.run_job.overloads:    # loaded (or compiled) already in this process
            return
        if not _load_cached():                   # a warm cache needs no child (~1.2 s saved)
            _compile_in_child(env, timeout)
        _prepared = True


def _compile_in_child(env, timeout):
    try:
        subprocess.run([sys.executable, "-c", WARM_UP], env=env, cwd=ROOT, stdin=subprocess.DEVNULL, check=True,
                       timeout=timeout)
    except subprocess.TimeoutExpired:
        raise WorkerError(f"compiling the attention kernel took over start_timeout={timeout} s (a cold numba "
                          "cache takes ~10-60 s); raise HeteroConfig.start_timeout") from None
    except subprocess.CalledProcessError as e:
        raise WorkerError(f"compiling the attention kernel failed in a child process (exit {e.returncode}; "
                          "its error is above)") from None
    atomics.warm_up()
    kernel.warm_up()


_PREPARE_LOCK = threading.Lock()
_prepared = False              # prepare_parent done in this process


class _NotCached(Exception):
    pass


def _load_cached() -> bool:
    """Load the warm-up's kernels from numba's on-disk cache in this process, compiling nothing:
    for the time of the call, each of their dispatchers' compile() refuses, in this thread, a
    signature the cache lacks (other threads compile as ever). False when one is not cached
    (prepare_parent then compiles in a child). Under _PREPARE_LOCK: one thread patches at a time."""
    from numba.core import sigutils
    from numba.core.compiler_lock import global_compiler_lock
    from numba.core.dispatcher import Dispatcher

    me = threading.get_ident()

    def cache_only(d):
        real = d.compile

        def compile(sig):
            if threading.get_ident() != me:
                return real(sig)
            with global_compiler_lock:       # numba's cache is read under it (reentrant: real takes it too)
                args, _ = sigutils.normalize_signature(sig)
                if d.overloads.get(tuple(args)) is None and d._cache.load_overload(sig, d.targetctx) is None:
                    raise _NotCached(d.py_func.__name__)
                return real(sig)
        return compile

    patched = [d for m in (atomics, kernel) for d in vars(m).values() if isinstance(d, Dispatcher)]
    for d in patched:
        d.compile = cache_only(d)
    try:
        atomics.warm_up()
        kernel.warm_up()
        return True
    except _NotCached:
        return False
    finally:
        for d in patched:
            d.__dict__.pop("compile", None)


def main(argv):
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    home = os.sched_getaffinity(0)                # an unpinned worker's cores (a reused one's too)
    reuse = argv[6:7] == ["reuse"]
    atomics.warm_up()
    kernel.warm_up()
    while argv:
        ctrl_name, rank, nworkers, core, parent_pid, spin = argv[0], *map(int, argv[1:6])
        if len(argv) > 6 and argv[6] != "reuse":        # a reused worker's line: the parent's cores now
            home = {int(c) for c in argv[6].split(",")}
        os.sched_setaffinity(0, {core} if core >= 0 else home)
        worker = Worker(ctrl_name, rank, nworkers, parent_pid, spin)
        served = worker.run()
        worker.release()
        argv = next_pool(parent_pid, ctrl_name) if served and reuse else None
    # EXIT read (or the parent gone and cleaned up for): what an exit handler would do, then out
    # without the interpreter's teardown of numba and numpy (~0.15 s the parent's close() waits for)
    shm.release_owner_lock()
    os._exit(0)


def next_pool(parent_pid, last_ctrl):
    """A reused worker's next arguments: one line on stdin from the parent. None when the parent
    retires it ("exit") or is gone (end of file without it; checked every second too, as a fork
    of the parent may hold the pipe open): then, as an orphaned worker does, this one unlinks
    what the dead parent left in /dev/shm, its lock included (shm.sweep_owner: only once the
    parent is provably dead)."""
    line = b""
    while os.getppid() == parent_pid:
        ready, _, _ = select.select([0], [], [], 1.0)
        if not ready:
            continue
        chunk = os.read(0, 4096)
        line += chunk
        if line == b"exit\n":
            return None
        if line.endswith(b"\n"):
            return line.decode().split()
        if not chunk:                        # the parent died: its pipe closed before it was reaped
            deadline = time.monotonic() + 2.0
            while os.getppid() == parent_pid and time.monotonic() < deadline:
                time.sleep(0.01)
            break
    if os.getppid() != parent_pid:
        shm.sweep_owner(last_ctrl, wait=5.0)      # its lock may outlive the pipe for a moment
    return None


if __name__ == "__main__":
    main(sys.argv[1:])
