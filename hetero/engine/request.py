"""One generation request, as the engine's step loop sees it.

Who owns what (all of it lives in the engine thread; nothing here is shared with workers):

  field                          written by                     read by
  prompt_token_ids, params,      the caller (at creation)       everyone; params only by the
  adapter, eos, max_new_tokens                                  runner/sampler (opaque here)
  output_token_ids               Scheduler.update               the caller's stream, the hasher
  status                         Scheduler                      everyone
  block_table                    KVCacheManager                 the runner (rows -> blocks)
  block_hashes,                  KVCacheManager                 KVCacheManager
  num_registered_blocks
  num_computed_tokens            Scheduler (update, preempt),   the runner (positions),
                                 KVCacheManager (cache hit)     KVCacheManager
  num_cached_tokens              KVCacheManager (cache hit)     metrics
  pinned_blocks                  Scheduler (pin_prompt)         the Context that owns them
  ring_start                     KVCacheManager (ring)          KVCacheManager, the runner
  window_table, window_start,    HybridKVCacheManager           the runner (windowed layers' rows)
  window_registered

Token i of `all_token_ids` (prompt then outputs) has its KV in row i % block_size of block
block_table[i // block_size]. Rows [0, num_computed_tokens) are written; a running request that
has just sampled has exactly one token (the sampled one) whose KV is not written yet. Under a
sliding window every layer shares (KVCacheManager's ring), the blocks no later token can see are
given back as the request goes: block_table[:ring_start] are -1. In a model that mixes windowed
and full layers, block_table serves the full layers and window_table (from a pool of its own) the
windowed ones, as a ring: window_table[:window_start] are -1.
"""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"                # back in the waiting queue, its KV dropped (recompute)
    FINISHED_STOPPED = "finished_stopped"  # sampled an eos token
    FINISHED_LENGTH = "finished_length"    # reached max_new_tokens
    FINISHED_ABORTED = "finished_aborted"  # Scheduler.abort

    @property
    def is_finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                        RequestStatus.FINISHED_ABORTED)


@dataclass(eq=False)
class Request:
    """A prompt to continue. `pin_prompt=True` makes it a Context's build: once its prompt is
    computed, the scheduler pins the prompt's whole blocks (see KVCacheManager.pin_prefix) and
    lists them in `pinned_blocks`; they outlive the request until the owner unpins them, and every
    later request with the same prefix (and adapter) reads them instead of recomputing.
    `max_new_tokens=0` computes the prompt and finishes without sampling (such a request's
    prefix cache lookup stops short of its last token all the same)."""
    request_id: str
    prompt_token_ids: list[int]
    max_new_tokens: int
    eos_token_ids: set[int] = field(default_factory=set)
    params: Any = None                     # the runner's (a GenerationConfig, a seed): opaque here
    adapter: str | None = None             # LoRA adapter name
    adapter_key: str | None = None         # what block hashes take for it (None: the name): the engine
                                           # marks each load of a name apart (Engine.adapter_key)
    pin_prompt: bool = False
    arrival_time: float = field(default_factory=time.monotonic)

    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0           # KV rows written
    num_cached_tokens: int = 0             # of them, found in the prefix cache at admission
    block_hashes: list[bytes] = field(default_factory=list)  # chained hashes of whole token blocks
    num_registered_blocks: int = 0         # block_table[:n] were offered to the prefix cache
    pinned_blocks: list[int] | None = None
    num_preemptions: int = 0
    ring_start: int = 0                    # block_table[:ring_start] given back (-1): out of the window
    window_table: list[int] = field(default_factory=list)   # the windowed layers' blocks (mixed models)
    window_start: int = 0                  # window_table[:window_start] given back (-1)
    window_registered: int = 0             # window_table[:n] were offered to the window pool's cache

    def __post_init__(self) -> None:
        self.prompt_token_ids = [int(t) for t in self.prompt_token_ids]
        self.eos_token_ids = {int(t) for t in self.eos_token_ids}
        if not self.prompt_token_ids:
            raise ValueError(f"request {self.request_id!r}: empty prompt")
        if self.max_new_tokens < 0:
            raise ValueError(f"request {self.request_id!r}: max_new_tokens={self.max_new_tokens} < 0")

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt then outputs (a new list)."""
        return self.prompt_token_ids + self.output_token_ids

    def tokens(self, start: int, stop: int) -> list[int]:
        """all_token_ids[start:stop] without building the whole list."""
        p = len(self.prompt_token_ids)
        if stop <= p:
            return self.prompt_token_ids[start:stop]
        if start >= p:
            return self.output_token_ids[start - p:stop - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[:stop - p]

    @property
    def num_new_tokens_to_compute(self) -> int:
        """Tokens whose KV is not written yet: the rest of the prompt (and, after a preemption, of
        the outputs), or 1 while decoding (the token sampled last)."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def max_rows(self) -> int:
        """KV rows it can ever need: every token but the last one it may sample."""
        return self.num_prompt_tokens + max(self.max_new_tokens - 1, 0)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.status.name}, tokens={self.num_prompt_tokens}+"
                f"{self.num_output_tokens}, computed={self.num_computed_tokens}, blocks={self.block_table})")
