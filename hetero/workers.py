"""The worker pool a HeteroGenerator runs on, and what close() frees.

Owns: starting the pool (and again after a worker died), the decode planner over it (from the
machine's measured profile), a GPU model's calling thread kept off the workers' cores, and the
release of everything a generator holds (its contexts, hooks, adapters, workers, pinned cores),
also from its finalizer. A mixin of HeteroGenerator: the pool's lifecycle reads the generator's
config, model, adapter store and contexts, and tests reach `_pool`, `_ensure_pool` and
`_ensure_planner` on the generator.
"""
import logging
import os
import threading

import torch

from hetero.cpu_attention.planner import ProfiledPlanner, StaticPlanner
from hetero.errors import GeneratorClosedError, WorkerError
from hetero.ipc.pool import WorkerPool
from hetero.offload.registry import close_kept

log = logging.getLogger("hetero")

SHARED_IDLE_SPIN = 400   # ~10 us of polls before a CPU model's worker sleeps (atomics.sleep_until_changed)


class WorkersMixin:
    """HeteroGenerator's worker pool and planner (attributes _pool, _planner, _parent_affinity)."""

    @property
    def cpu_workers(self):
        return self._pool.n if self._pool else self.config.resolve_workers()[0]

    def _ensure_pool(self):
        if getattr(self, "_closed", False):     # a call that waited for its turn while close() ran
            raise GeneratorClosedError("the HeteroGenerator was closed (while this call waited for its turn)")
        if self._pool is None or not self._pool.alive:
            if self._pool is not None:
                self._pool.close()
            n, cores = self.config.resolve_workers()
            # a CPU model's workers share cores with its torch threads: they sleep right after a job
            # (the next comes after a layer's dense part); a GPU model's spin through one layer
            idle_spin = SHARED_IDLE_SPIN if self.model.device.type == "cpu" else self.config.spin_budget
            self._pool = WorkerPool(n, cores, spin_budget=self.config.spin_budget, idle_spin=idle_spin,
                                    start_timeout=self.config.start_timeout, job_timeout=self.config.worker_timeout)
            self._planner = None
            try:
                if self._store is not None:
                    self._store.attach(self._pool)
                if self.model.device.type == "cuda":
                    self._pin_parent(self._pool.worker_cores)
            except BaseException:            # half set up: not a pool the next call may take as alive
                self._pool.close()
                raise
        return self._pool

    def _pin_parent(self, worker_cores):
        """A GPU model: the calling thread (the one enqueueing the GPU's work; threads it starts
        later inherit it) keeps to the cores no worker is pinned to, so workers spinning through a
        decode step never take its core; torch's CPU ops (the parent's merge of split partials, the
        profile) run as many threads as it has cores left (more, spinning on one core, made a merge
        of 16 partials take 0.25 s on the H100 host). close() in the same thread restores both.
        Nothing to do when the workers use every core."""
        usable = os.sched_getaffinity(0)
        free = usable - set(worker_cores)
        if not free or free == usable:
            return
        if self._parent_affinity is None:
            threads = torch.get_num_threads()
            self._parent_affinity = (threading.get_native_id(), usable, threads, min(len(free), threads))
        os.sched_setaffinity(0, free)
        torch.set_num_threads(self._parent_affinity[3])

    def _drop_pool(self):
        """Close a pool a call found broken (the next call starts another). While contexts stay
        open a new pool starts at once: its first worker is what unlinks their segments should this
        process be killed (SIGKILL runs no cleanup of ours), and without a pool they would outlive
        it. (A death found outside a call, e.g. by load_adapter, leaves that to the next call.)"""
        self._pool.close()
        if self._contexts and not self._closed:
            try:
                self._ensure_pool()
            except Exception as e:            # the next call starts one, and raises why
                log.warning("hetero: could not restart the CPU worker pool after a worker died (%s); "
                            "the next call tries again", e)

    def _ensure_planner(self, pool):
        """The decode planner: from the machine's measured profile (cached on disk) unless profile='off'."""
        if self._planner is None:
            if self.config.profile == "off":
                self._planner = StaticPlanner(pool.n)
            else:
                from hetero.profile import load_or_measure

                profile, _ = load_or_measure(pool, self.spec)
                self._planner = ProfiledPlanner(profile, pool.n)
        return self._planner


def release(state):
    """What close() frees, from a HeteroGenerator's attributes (also its finalizer's, when it is
    collected without close()): its contexts, hooks, adapters, workers, and the cores its thread
    was pinned away from. Every step runs; the first error other than a worker's (the contexts
    are closed whatever their workers did) is raised after them."""
    if state.get("_engine") is not None:              # its loop steps on the pool: stopped first
        state["_engine"].close()
    contexts = state["_contexts"].take_all()
    steps = [(lambda kept=kept: close_kept(kept)) for kept in contexts] + [state["_hooks"].remove]
    steps += [state[name].close for name in ("_store", "_pool") if state[name] is not None]
    if state["_parent_affinity"] is not None:         # a GPU model pinned its thread: give the cores back
        tid, cores, threads, pinned = state["_parent_affinity"]
        steps += [lambda: _restore_affinity(tid, cores), lambda: _restore_threads(threads, pinned)]
    state["_store"] = state["_pool"] = state["_parent_affinity"] = None
    first = None
    for step in steps:
        try:
            step()
        except Exception as e:
            if first is None and not isinstance(e, WorkerError):
                first = e
    if first is not None:
        raise first


def _restore_affinity(tid, cores):
    """Give a pinned thread its cores back (nothing to do once it has exited)."""
    try:
        os.sched_setaffinity(tid, cores)
    except ProcessLookupError:
        pass


def _restore_threads(threads, pinned):
    """torch's thread count (process-wide) back to `threads`, unless something changed it since
    this generator set `pinned` (another generator pinned after it, say: its close() restores)."""
    if torch.get_num_threads() == pinned:
        torch.set_num_threads(threads)
