"""Parent side of the process-per-core worker pool.

The parent owns the control segment (creates it; unlinks it first at close). A job is: write
CMD and params, release-store the job number and command into the GO word of
each worker it uses (the first `active`), then spin until each of those DONE
words holds it. An attention job instead ends when all its units are finished
(FIN = UNITS): its units sit on a ticket tagged with the job number, the parent
takes units too (`share`), and a worker that wakes late, on a busy core, finds
the ticket empty and is not waited for. While spinning the parent polls the
workers' liveness, so a dead worker raises WorkerDiedError within milliseconds
instead of hanging, and a job that makes no progress for `job_timeout` seconds
(a stopped or stuck worker) raises WorkerError. Idle workers are checked too,
every few ms of submits: a pool with a dead worker is broken even when the plan
leaves that worker idle. One job is in flight at a time: a submit while one is
(an exception or Ctrl-C between submit and wait) first finishes it, so a job's
params are never rewritten under running workers.

Reuse (REUSE, off by default; HETERO_REUSE_WORKERS=1): the workers of a pool closed cleanly are
kept, idle, for this process's next pool with the same program and environment, which then
starts in milliseconds instead of a fresh interpreter's ~0.5 s (importing numba, loading the
kernels). An idle worker maps nothing and waits on its stdin; it exits when this process exits
(or dies: the pipe closes) or when more than MAX_IDLE are idle.
"""
import atexit
import importlib
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np

from hetero.errors import WorkerDiedError, WorkerError
from hetero.ipc import atomics, control as C, shm

CMD_NAMES = {C.CMD_PING: "start-up", C.CMD_OPEN: "open", C.CMD_CLOSE: "close",
             C.CMD_ATTN: "attention", C.CMD_EXIT: "exit", C.CMD_LORA_OPEN: "LoRA staging map",
             C.CMD_ADAPTER_MAP: "adapter map", C.CMD_ADAPTER_DROP: "adapter unmap", C.CMD_LORA: "LoRA",
             C.CMD_POPULATE: "page fault-in", C.CMD_LORA_GPU: "GPU-posted LoRA"}


def describe_exit(code):
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


LIVENESS_PERIOD = 0.005    # seconds between checks of every worker's liveness at submit


def _process_state(pid):
    """The state letter of /proc/<pid>/stat (R, S, T = stopped, ...), or '?'."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "?"


REUSE = os.environ.get("HETERO_REUSE_WORKERS", "0") not in ("", "0")
MAX_IDLE = 2 * (os.cpu_count() or 1)
ENV_NOT_KEYED = ("PYTEST_CURRENT_TEST",)    # changes under every test; the workers never read it
_idle = []         # (key, Popen) of workers idle since their pool closed (REUSE); this process's only
_idle_pid = os.getpid()
# pools start and close in several threads (a server's engine, callers), and close() may run from
# a finalizer that the garbage collector calls inside a locked section: reentrant
_idle_lock = threading.RLock()


def _forget_idle_in_child():
    """A forked child: the parent's idle workers are not its own (nor is a lock held at the fork)."""
    global _idle, _idle_lock
    _idle, _idle_lock = [], threading.RLock()


os.register_at_fork(after_in_child=_forget_idle_in_child)


def _take_idle(key, line):
    """An idle worker of `key` given its next pool's arguments (`line`), or None."""
    while _idle_pid == os.getpid():
        with _idle_lock:
            p = next((p for k, p in _idle if k == key), None)
            if p is None:
                return None
            _idle.remove((key, p))
        if _process_state(p.pid) in ("T", "t", "Z", "?"):     # stopped, dead or gone while idle
            p.kill()
            _retire(p)
            continue
        try:
            p.stdin.write(line.encode())
            p.stdin.flush()
            return p
        except OSError:           # it died while idle
            _retire(p)


def _tell_exit(p):
    """A worker started for reuse told to exit when it next waits for a pool ("exit": end of file
    alone means this process died)."""
    try:
        p.stdin.write(b"exit\n")
        p.stdin.close()
    except OSError:
        pass


def reap(p, timeout):
    """Wait up to `timeout` s for process p to exit, then kill it."""
    try:
        p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()


def _retire(*procs):
    """Idle workers sent away, then reaped."""
    for p in procs:
        _tell_exit(p)
    for p in procs:
        reap(p, 2.0)


@atexit.register
def _retire_idle():
    if _idle_pid == os.getpid():
        with _idle_lock:
            idle = [p for _, p in _idle]
            _idle.clear()
        _retire(*idle)


PROGRAM = "hetero.worker"      # the workers' program: a module run with -m, whose prepare_parent(env, timeout)
                              # readies the parent first (hetero/worker.py: compiling the kernels)


class WorkerPool:
    def __init__(self, nworkers, cores, spin_budget=20000, start_timeout=300.0, job_timeout=5.0, idle_spin=None,
                 program=PROGRAM):
        """spin_budget: polls between this process's liveness checks while it waits for a job;
        idle_spin: polls a worker spins after a job before it sleeps (default spin_budget; small
        when the workers share cores with the parent's torch threads). program: the workers'
        module (named, not imported here: it runs the jobs of the layers above this one)."""
        if nworkers < 1:
            raise ValueError(f"a worker pool needs at least one worker, got {nworkers}")
        self.n, self.cores, self.spin, self.job_timeout = nworkers, list(cores), spin_budget, job_timeout
        self.procs, self.seq, self.closed = [], 0, False
        self.pid = os.getpid()    # a forked child's copy (its atexit too) must leave the workers alone
        self.inflight = None      # (seq, active, units, share) of a submitted job not yet waited for
        self._inflight_go = 0     # its GO value (drain posts it again: an interrupt may have come before the post)
        self.stuck = []           # ranks that made no progress (WorkerError): killed at close
        self.broken = None        # why the pool can run no more jobs (a job failed or stalled)
        self._checked = 0.0       # perf_counter of the last liveness check of every worker
        self.session = None   # the KVSession mapped in the workers (one at a time)
        shm.sweep_stale()
        env = child_env()
        importlib.import_module(program).prepare_parent(env, start_timeout)
        self.ctrl = shm.Segment(shm.new_name("ctrl"), C.nbytes(nworkers), create=True)
        atexit.register(self.close)
        self.key = (program, tuple(sorted((k, v) for k, v in env.items() if k not in ENV_NOT_KEYED)))
        try:
            self.words = self.ctrl.array(0, (C.nbytes(nworkers) // 8,), np.int64)
            self.floats = self.words.view(np.float64)
            cpus = ",".join(map(str, sorted(os.sched_getaffinity(0))))   # a reused unpinned one's, as if spawned now
            for rank, core in enumerate(self.worker_cores):
                args = [self.ctrl.name, str(rank), str(nworkers), str(core), str(os.getpid()),
                        str(spin_budget if idle_spin is None else idle_spin)]
                p = _take_idle(self.key, " ".join([*args, cpus]) + "\n") if REUSE else None
                # a session of their own: a signal to the parent's process group (a terminal's hangup,
                # `kill -TERM -PGID`, systemd) leaves them alive to notice the parent gone and clean up
                self.procs.append(p or subprocess.Popen(
                    [sys.executable, "-m", program, *args, *(["reuse"] if REUSE else [])], env=env, cwd=ROOT,
                    stdin=subprocess.PIPE if REUSE else subprocess.DEVNULL, start_new_session=True))
            self.run(C.CMD_PING, timeout=start_timeout)
        except BaseException:
            self.close()
            raise

    @property
    def worker_cores(self):
        """The core each worker is pinned to, in rank order (-1: not pinned)."""
        return [self.cores[r % len(self.cores)] if self.cores else -1 for r in range(self.n)]

    @property
    def alive(self):
        return not self.closed and self.broken is None and all(p.poll() is None for p in self.procs)

    def keep_awake(self, on):
        """on: idle workers spin instead of sleeping (the GPU posts their jobs and cannot wake a
        sleeper). Turning it on runs a ping job: every worker wakes, and after it reads AWAKE
        before it would sleep again (a futex wake alone could miss one about to fall asleep)."""
        atomics.swap(self.words, C.AWAKE, int(bool(on)))
        if on:
            self.run(C.CMD_PING)

    def drain(self):
        """Wait for a job still in flight (abandoned between submit and wait by an exception or
        Ctrl-C). Callers call it before writing a job's params: workers may still read them."""
        if self.inflight is not None:
            self._post(self._inflight_go, self.inflight[1])    # a worker that saw this GO value ignores it
            self.wait(*self.inflight)

    def submit(self, cmd, active, units=None, share=None):
        """Publish a job whose params the caller has already written (after drain()) to workers
        0..active-1. An attention job (units given) puts `units` units on the ticket; share(seq),
        run by wait(), takes units in this process (kernel.run_job), so active may be 0. A job
        still in flight is waited for first; a dead worker (idle ones too) raises."""
        if self.broken is not None:
            raise WorkerError(f"the worker pool is broken ({self.broken})")
        self.drain()
        now = time.perf_counter()
        if now - self._checked > LIVENESS_PERIOD:
            self._checked = now
            self._raise_if_dead("before the job")
        return self._publish(cmd, active, units, share)

    def _publish(self, cmd, active, units=None, share=None):
        self.words[C.CMD] = cmd                # for messages: workers read the command from GO
        self.seq += 1
        if units is not None:
            self.words[C.UNITS] = units
            self.words[C.FIN] = 0
            atomics.store(self.words, C.TICKET, C.ticket(self.seq, units))
        self._inflight_go = C.go(self.seq, cmd)
        self.inflight = (self.seq, active, units, share)   # before GO: an interrupt after it still finds the job
        self._post(self._inflight_go, active)
        return self.seq

    def _post(self, go, active):
        if atomics.HAVE_FUTEX:     # a worker idle for more than its spin sleeps on its GO word
            atomics.post_and_wake(self.words, C.go_word(0), active, C.LINE, go, C.ASLEEP_FROM_GO)
        else:
            atomics.post(self.words, C.go_word(0), active, C.LINE, go)

    def _cmd_name(self):
        return CMD_NAMES.get(int(self.words[C.CMD]), "?")

    def _raise_if_dead(self, when):
        """when: where the message places the death (None: during the current job)."""
        for rank, p in enumerate(self.procs):
            if p.poll() is not None:
                when = when or f"during the {self._cmd_name()} job"
                self.broken = f"worker {rank} died"      # no later job (a session's close) is sent to it
                raise WorkerDiedError(f"CPU worker {rank} (pid {p.pid}, core {self.worker_cores[rank]}) "
                                      f"{describe_exit(p.returncode)} {when}; the pool is broken")

    def _progress(self, active):
        """What changes while a job advances: the attention ticket, its finished units and the
        finished workers."""
        w = self.words
        return int(w[C.TICKET]), int(w[C.FIN]), tuple(int(w[C.done_word(r)]) for r in range(active))

    def _finished(self, seq, active, units):
        if units is None:
            return atomics.spin_until_all(self.words, C.done_word(0), active, C.LINE, seq, self.spin)
        return atomics.spin_until_all(self.words, C.FIN, 1, 1, units, self.spin)

    def wait(self, seq, active, units=None, share=None, timeout=None):
        """Finish job `seq`: run share(seq) (this process's part of an attention job), then spin
        until its `units` are finished, or workers 0..active-1 finished it (other jobs). Raises
        WorkerDiedError when a worker dies, WorkerError when the job makes no progress for
        `timeout` s (default: job_timeout)."""
        timeout = self.job_timeout if timeout is None else timeout
        if share is not None:     # again after an interrupt (drain): it takes only the units left
            share(seq)
        start = progress = None
        while not self._finished(seq, active, units):
            now = time.perf_counter()
            if start is None:
                start, progress = now, self._progress(active)
            self._raise_if_dead(None)
            self._raise_if_failed(seq, active)
            if now - start > timeout:
                seen = self._progress(active)
                if seen != progress:          # still advancing: a long job, not a stuck one
                    start, progress = now, seen
                else:
                    self._raise_stuck(seq, active, units, timeout)
            if now - start < 0.002:
                os.sched_yield()
            else:
                time.sleep(0.0002)
        self.inflight = None
        self._raise_if_failed(seq, active)

    def _raise_if_failed(self, seq, active):
        failed = [r for r in range(active) if self.words[C.err_word(r)] == seq]
        if failed:
            self.inflight = None
            self.broken = f"worker(s) {failed} failed the {self._cmd_name()} job"
            raise WorkerError(f"CPU worker(s) {failed} failed the {self._cmd_name()} job; "
                              "their traceback is on stderr")

    def _raise_stuck(self, seq, active, units, timeout):
        w = self.words
        knob = "start_timeout" if seq == 1 else "worker_timeout"     # job 1: the start-up ping
        late = [r for r in range(active) if w[C.done_word(r)] != seq]
        # an attention job waits only for the workers holding its units (or, when nobody took
        # one, for all that have not started: nothing else would take them)
        holding = [r for r in late if w[C.busy_word(r)] == seq]
        stuck = late if units is None or not holding else holding
        states = ", ".join(f"worker {r} (pid {self.procs[r].pid}, state "
                           f"{_process_state(self.procs[r].pid)})" for r in stuck)
        self.stuck = stuck
        self.inflight = None
        self.broken = f"the {self._cmd_name()} job stalled"
        raise WorkerError(f"CPU workers made no progress on the {self._cmd_name()} job for "
                          f"{timeout:g} s: {states} (HeteroConfig.{knob})")

    def run(self, cmd, timeout=None, active=None):
        """Run one job on workers 0..active-1 (all by default) and wait for it."""
        if self.closed:
            raise WorkerError("the worker pool is closed")
        active = self.n if active is None else active
        if not 1 <= active <= self.n:
            raise ValueError(f"a job needs 1..{self.n} workers, got {active}")
        self.wait(self.submit(cmd, active), active, timeout=timeout)

    def attention(self, active, units, share):
        """Run an attention job (params written) of `units` units on workers 0..active-1 and this
        process (share(seq) takes units until the ticket is empty), and wait for its units."""
        if self.closed:
            raise WorkerError("the worker pool is closed")
        if not 0 <= active <= self.n:
            raise ValueError(f"an attention job uses 0..{self.n} workers, got {active}")
        seq = self.submit(C.CMD_ATTN, active, units, share)
        self.wait(seq, active, units, share)

    def close(self):
        """Stop the workers and unlink the control segment. Idempotent; also runs at exit."""
        if self.closed:
            return
        self.closed = True
        if os.getpid() != self.pid:
            return
        atexit.unregister(self.close)
        try:
            # the name goes before EXIT: a worker that reads EXIT exits, and this process, were it
            # killed after that, would leave it in /dev/shm (one that reads EXIT after this process
            # died unlinks the rest: Worker.clean_up)
            self.ctrl.unlink()
            if any(p.poll() is None for p in self.procs):  # survivors read EXIT; the dead ignore it
                self._publish(C.CMD_EXIT, self.n)          # (a worker still on a job reads it after)
            for r in self.stuck:                           # stopped or stuck: it would not read EXIT
                self.procs[r].kill()
            deadline = time.monotonic() + 2.0
            keep = self.broken is None and not self.stuck and _idle_pid == os.getpid()
            for rank, p in enumerate(self.procs):
                if keep and p.stdin is not None and self._exited_job(rank, deadline):
                    with _idle_lock:                       # it read EXIT: idle, for the next pool
                        _idle.append((self.key, p))
                    continue
                if p.stdin is not None:                    # started to be reused
                    _tell_exit(p)
                reap(p, max(0.0, deadline - time.monotonic()))
            with _idle_lock:
                extra = [p for _, p in _idle[:max(len(_idle) - MAX_IDLE, 0)]]
                del _idle[:len(extra)]
            _retire(*extra)
        finally:
            self.words = self.floats = None
            self.ctrl.close()

    def _exited_job(self, rank, deadline):
        """Whether worker `rank` (started with reuse) finished the EXIT job, alive, by `deadline`."""
        word = C.done_word(rank)
        while atomics.load(self.words, word) != self.seq:
            if self.procs[rank].poll() is not None or time.monotonic() > deadline:
                return False
            time.sleep(0.0002)
        return self.procs[rank].poll() is None


# the directory holding this hetero package: the children run there, so `-m`/`-c` (whose first
# import path is the working directory) import this very package, not another copy where the
# parent happens to run (an old checkout would meet this one's shared memory unchecked)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def child_env():
    """The workers' environment: one thread per library, and the paths that were relative to the
    parent's working directory made absolute (the children run in ROOT)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1",
               NUMBA_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    if env.get("NUMBA_CACHE_DIR"):
        env["NUMBA_CACHE_DIR"] = os.path.abspath(env["NUMBA_CACHE_DIR"])
    if env.get("PYTHONPATH"):
        env["PYTHONPATH"] = os.pathsep.join(os.path.abspath(p) if p else os.getcwd()
                                            for p in env["PYTHONPATH"].split(os.pathsep))
    return env
