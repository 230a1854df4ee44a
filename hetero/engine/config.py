"""EngineConfig: the engine's knobs, validated once at the boundary (hetero.engine.engine.Engine;
a HeteroGenerator's concurrent generate() calls use HeteroConfig.engine)."""
from __future__ import annotations

from dataclasses import dataclass, field

from hetero.engine.scheduler import FCFSPolicy, Policy


def _positive(name, value, allow_none=True):
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"EngineConfig.{name} must be an int >= 1{' or None' if allow_none else ''}, got {value!r}")


@dataclass(frozen=True)
class EngineConfig:
    max_num_seqs: int = 32                    # requests running at once
    max_num_batched_tokens: int = 2048        # tokens one step computes, all requests together
    long_prefill_chunk: int | None = 512      # prompt tokens one request computes per step (None: the budget)
    max_model_len: int | None = None          # tokens one request may hold (prompt + new); None: the model's
                                              # max_position_embeddings, else DEFAULT_MAX_MODEL_LEN, at most
                                              # the pool's rows (unless every layer keeps a window's ring)
    kv_blocks: int | None = None              # the pool's 32-row blocks; None: from kv_memory
    kv_memory: int | None = None              # the pool's bytes; None: ram_fraction of the available RAM, at most
                                              # what max_num_seqs requests of max_model_len tokens hold
    ram_fraction: float = 0.5
    policy: Policy = field(default_factory=FCFSPolicy)
    background: bool = True                   # add_request starts the step loop's thread (False: call step())
    cpu_workers: int | None = None            # worker processes (None: usable cores - 1, at least 1)
    worker_timeout: float = 5.0               # seconds a job may go without progress before WorkerError
    step_time_target: float | None = None     # seconds a step may take while requests decode: prompt chunks
                                              # shrink to fit it, as measured (hetero.engine.pacing); None: off
    prefill_stage_memory: int | None = None   # bytes of the model's device that keep a chunked prompt's rows
                                              # between its chunks (runner.PrefillStage); None: on a GPU a
                                              # quarter of its free memory at start, on the CPU 256 MiB
    prefix_rows_memory: int | None = None     # bytes of the model's device that keep cached prefixes' rows (a pinned
                                              # or cached document's) for the chunks that continue them
                                              # (hetero.engine.prefix_rows); None: an eighth of a GPU's free
                                              # memory at start, on the CPU 512 MiB; 0: read back every time
    transport: str = "auto"                   # a CUDA model's decode jobs: "auto": the CUDA extension (the GPU
                                              # posts them and merges their results, hetero.ipc.cuda_transport)
                                              # where it can be used, else host copies; "cuda": the extension or
                                              # an error; "host": host copies

    def __post_init__(self):
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            _positive(name, getattr(self, name), allow_none=False)
        for name in ("long_prefill_chunk", "max_model_len", "kv_blocks", "kv_memory", "cpu_workers"):
            _positive(name, getattr(self, name))
        for name in ("prefill_stage_memory", "prefix_rows_memory"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise ValueError(f"EngineConfig.{name} must be an int >= 0 or None, got {value!r}")
        if self.step_time_target is not None and (isinstance(self.step_time_target, bool) or
                                                  not isinstance(self.step_time_target, (int, float)) or
                                                  not 0 < self.step_time_target < float("inf")):
            raise ValueError(f"EngineConfig.step_time_target must be a number of seconds > 0 or None, "
                             f"got {self.step_time_target!r}")
        if isinstance(self.ram_fraction, bool) or not isinstance(self.ram_fraction, (int, float)) or \
                not 0 < self.ram_fraction <= 1:
            raise ValueError(f"EngineConfig.ram_fraction must be in (0, 1], got {self.ram_fraction!r}")
        if self.transport not in ("auto", "cuda", "host"):
            raise ValueError(f"EngineConfig.transport must be 'auto', 'cuda' or 'host', got {self.transport!r}")
        if not hasattr(self.policy, "sort_key"):
            raise ValueError(f"EngineConfig.policy must have a sort_key method (a Policy), got {self.policy!r}")
