"""The serving engine's core: requests, the paged KV pool's bookkeeping, and the scheduler.

Pure logic over numpy and the standard library (no torch, no transformers), so it is fast to
test and importable on the worker side. The runner (the forward over block tables) and the
engine's step loop live elsewhere and drive these objects:

    plan = scheduler.schedule()                  # which requests, how many tokens each
    ...forward over plan's block tables, sample...
    finished = scheduler.update(plan, sampled)   # append, stop, cache and free blocks

README.md's "One request's path through the engine" draws the whole.
"""
from hetero.engine.kv_pool import BLOCK_SIZE, BlockPool, KVCacheManager, block_hash
from hetero.engine.request import Request, RequestStatus
from hetero.engine.scheduler import (
    FCFSPolicy,
    Policy,
    RankAwarePolicy,
    ScheduledRequest,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
)

__all__ = [
    "BLOCK_SIZE",
    "BlockPool",
    "FCFSPolicy",
    "KVCacheManager",
    "Policy",
    "RankAwarePolicy",
    "Request",
    "RequestStatus",
    "ScheduledRequest",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
    "block_hash",
]
