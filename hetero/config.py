"""HeteroConfig: every engine knob, validated once at the boundary."""
import math
import numbers
import os
from dataclasses import dataclass, field

from hetero.engine.config import EngineConfig


def _check_int(name, value, minimum, allow_none=True):
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"HeteroConfig.{name} must be an int >= {minimum}{' or None' if allow_none else ''}, got {value!r}")


MAX_WORKERS_PER_CORE = 4      # more worker processes than this per CPU of the machine is a mistake, not a plan


@dataclass(frozen=True)
class HeteroConfig:
    cpu_workers: int | None = None        # None: usable cores - 1 (one core is left to the parent), at least 1
    worker_cores: tuple | None = None     # cores to pin workers to; None: the usable cores after the first
    max_cache_tokens: int | None = None   # per-request KV capacity (prompt + new tokens but the last, whose KV
                                          # is never written); None: bounded by RAM
    ram_fraction: float = 0.8             # share of available RAM one generate's KV arena may take
    spin_budget: int = 20000              # atomic polls before a waiter backs off
    start_timeout: float = 300.0          # seconds for workers to start (numba compiles on a cold cache)
    worker_timeout: float = 5.0           # seconds a job may go without progress before WorkerError (a stopped
                                          # or stuck worker); progress = a unit taken or a worker finished
    profile: str = "auto"                 # "auto": plan decode steps from a measured profile (cached on disk,
                                          # measured on first use); "off": every worker, a fixed split rule
    context_memory: int | None = None     # bytes the open contexts' arenas may hold together. None: no budget, and a
                                          # context nobody references is closed at the next prefill. With a budget,
                                          # unreferenced contexts stay as a prefix cache (reuse_contexts finds them)
                                          # and are evicted least recently used when a new context needs the room;
                                          # when only referenced ones are left, a new context raises CapacityError
    prefill_chunk: int | str | None = "auto"  # prompt tokens per forward after the first (None: one pass): each
                                          # later chunk attends to the cached KV (on the CPU workers, or on the GPU
                                          # after a layer-wise prefetch: `continuation`). "auto": one pass on a CPU
                                          # model, and on a GPU where the prompt's activations fit its free memory,
                                          # else the longest chunk that fits (hetero.prefetch.policy.prefill_chunk)
    share_contexts: bool = True           # generate(context=[ctx, ctx, ...]): requests continuing one Context read
                                          # its KV in place, once per step for all of them (False: each request
                                          # gets a private copy; a model with sliding windows always copies)
    reuse_contexts: bool = True           # a generate whose prompts start with a live Context's tokens continues
                                          # that context (read-only) instead of prefilling them again
    continuation: str = "auto"            # who attends a context's new tokens: "workers" (the CPU workers over
                                          # the arena), "prefetch" (the model's device, each layer's KV copied in
                                          # just ahead: hetero.prefetch), "auto": the faster by the measured profile
    engine: EngineConfig = field(default_factory=lambda: EngineConfig(ram_fraction=0.25))
                                          # generate() calls that overlap (threads sharing the generator) join
                                          # this engine's batch (hetero.engine.calls); it runs on the generator's
                                          # workers (its cpu_workers is unused), its KV pool beside the calls' arenas
    transport: str = "auto"               # a CUDA model's decode round trip: "auto": the CUDA extension (hetero/
                                          # cuda, built with nvcc on first use) when it can be used, else host
                                          # copies (one log line says why); "cuda": the extension or an error;
                                          # "host": host copies (hetero.ipc.transport)

    def __post_init__(self):
        _check_int("cpu_workers", self.cpu_workers, 1)
        cores = os.cpu_count() or 1            # the machine's: a GPU model's thread is pinned to fewer
        if self.cpu_workers is not None and self.cpu_workers > MAX_WORKERS_PER_CORE * cores:
            raise ValueError(f"HeteroConfig.cpu_workers={self.cpu_workers} is more than {MAX_WORKERS_PER_CORE} per "
                             f"CPU ({cores} here): each worker is a process pinned to a core")
        _check_int("max_cache_tokens", self.max_cache_tokens, 1)
        if not isinstance(self.prefill_chunk, str):
            _check_int("prefill_chunk", self.prefill_chunk, 1)
        elif self.prefill_chunk != "auto":
            raise ValueError(f"HeteroConfig.prefill_chunk must be an int >= 1, None or 'auto', got {self.prefill_chunk!r}")
        _check_int("context_memory", self.context_memory, 1)
        _check_int("spin_budget", self.spin_budget, 1, allow_none=False)
        if self.spin_budget >= 1 << 62:
            raise ValueError(f"HeteroConfig.spin_budget must be below 2**62 polls, got {self.spin_budget!r}")
        if isinstance(self.ram_fraction, bool) or not (isinstance(self.ram_fraction, (int, float))
                                                        and 0 < self.ram_fraction <= 1):
            raise ValueError(f"HeteroConfig.ram_fraction must be in (0, 1], got {self.ram_fraction!r}")
        for name in ("start_timeout", "worker_timeout"):
            value = getattr(self, name)
            if isinstance(value, bool) or not (isinstance(value, (int, float)) and 0 < value < math.inf):
                raise ValueError(f"HeteroConfig.{name} must be a finite number > 0 of seconds, got {value!r}")
        if not isinstance(self.engine, EngineConfig):
            raise ValueError(f"HeteroConfig.engine must be an EngineConfig, got {self.engine!r}")
        if self.profile not in ("auto", "off"):
            raise ValueError(f"HeteroConfig.profile must be 'auto' or 'off', got {self.profile!r}")
        for name in ("share_contexts", "reuse_contexts"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"HeteroConfig.{name} must be True or False, got {getattr(self, name)!r}")
        if self.continuation not in ("auto", "workers", "prefetch"):
            raise ValueError(f"HeteroConfig.continuation must be 'auto', 'workers' or 'prefetch', "
                             f"got {self.continuation!r}")
        if self.transport not in ("auto", "cuda", "host"):
            raise ValueError(f"HeteroConfig.transport must be 'auto', 'cuda' or 'host', got {self.transport!r}")
        if self.worker_cores is not None:
            usable = os.sched_getaffinity(0)
            if isinstance(self.worker_cores, (str, bytes)) or not hasattr(self.worker_cores, "__iter__"):
                raise ValueError(f"HeteroConfig.worker_cores must be a sequence of core numbers, got "
                                 f"{self.worker_cores!r}")
            cores = tuple(self.worker_cores)
            bad = [c for c in cores if isinstance(c, bool) or not isinstance(c, numbers.Integral) or c not in usable]
            if not cores or bad:
                raise ValueError(f"HeteroConfig.worker_cores {cores!r}: cores {bad} are not usable by this process "
                                 f"(usable: {sorted(usable)})")
            if len(set(cores)) != len(cores):
                raise ValueError(f"HeteroConfig.worker_cores {cores!r} names a core twice (one worker per core)")
            object.__setattr__(self, "worker_cores", tuple(int(c) for c in cores))

    def resolve_workers(self):
        """(number of workers, cores to pin them to, in rank order)."""
        usable = sorted(os.sched_getaffinity(0))
        n = self.cpu_workers or max(1, len(usable) - 1)
        if self.worker_cores:
            cores = list(self.worker_cores)
        else:   # the parent's core (the first) last: taken only by workers beyond the other cores
            cores = usable[1:] + usable[:1]
        return n, cores
