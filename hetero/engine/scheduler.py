"""The step scheduler: which requests run in the next forward, and how many tokens each.

Continuous batching with chunked prefill over one paged KV pool, as vLLM v1 and nano-vllm:
each step, running requests go first (a decode costs one token of the step's budget, an
unfinished prefill continues by up to `long_prefill_chunk` tokens), then waiting requests are
admitted in policy order while the token budget, `max_num_seqs` and the pool allow, each first
taking its cached prefix; one whose prompt continues into a block a running request is computing
(the same document, arrived together) waits until that block is cached instead of computing it
again. When a running request cannot get a block, the last admitted running
request is preempted (recompute: its blocks freed, its output tokens kept) and waits first in
line; no admission happens in a step that preempted.

  structure                      owned (written) by       read by
  Scheduler.waiting, .running    Scheduler                the engine (has_unfinished)
  SchedulerOutput                Scheduler.schedule       the runner (rows to compute, which
                                                          requests sample), Scheduler.update
  Request.output_token_ids,      Scheduler.update         the caller's stream
  Request.status

Pure logic: no torch, no clocks but the policy's (and requests' arrival_time).
"""
from __future__ import annotations

import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from hetero.engine.kv_pool import KVCacheManager
from hetero.engine.request import Request, RequestStatus
from hetero.errors import CapacityError


class Policy(Protocol):
    """Orders the waiting requests: the one with the smallest key is admitted next. Preempted
    requests always come before the others (the scheduler adds that), ties keep queue order."""

    def sort_key(self, running: Sequence[Request]) -> Callable[[Request], Any]:
        """The key over waiting requests, given the running batch (called before each admission)."""
        ...


class FCFSPolicy:
    """First come, first served: by arrival_time."""

    def sort_key(self, running: Sequence[Request]) -> Callable[[Request], Any]:
        return lambda r: r.arrival_time


class RankAwarePolicy:
    """CaraServe's idea for LoRA batches, kept simple. A batched LoRA kernel pads every request to
    the largest adapter rank in the batch, and a new adapter costs a load, so a waiting request is
    admitted in this order (ties by arrival):
      0. waiting longer than `max_wait_s` (if set): oldest first, so nothing starves;
      1. its adapter is already in the running batch (nothing to load, the batch's rank unchanged);
      2. its rank <= the running batch's largest rank (padding costs no more);
      3. the rest, lowest rank first (a batch's rank grows as slowly as it can).
    With nothing running, the oldest request goes first and the batch forms around it.
    `rank_of(adapter)` gives an adapter's rank (None: the base model, usually 0); left None, an
    Engine sets its own (the loaded adapters' ranks)."""

    def __init__(self, rank_of: Callable[[str | None], int] | None = None, max_wait_s: float | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.rank_of, self.max_wait_s, self.clock = rank_of, max_wait_s, clock

    def sort_key(self, running: Sequence[Request]) -> Callable[[Request], Any]:
        if not running:
            return lambda r: (0, 0, r.arrival_time)
        adapters = {r.adapter for r in running}
        top = max(self.rank_of(a) for a in adapters)
        now = self.clock()

        def key(r: Request) -> tuple[int, int, float]:
            if self.max_wait_s is not None and now - r.arrival_time > self.max_wait_s:
                return (0, 0, r.arrival_time)
            if r.adapter in adapters:
                return (1, 0, r.arrival_time)
            rank = self.rank_of(r.adapter)
            return (2, 0, r.arrival_time) if rank <= top else (3, rank, r.arrival_time)
        return key


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 64               # running requests at most
    max_num_batched_tokens: int = 2048   # tokens computed per step, all requests together
    long_prefill_chunk: int | None = 512  # tokens one request computes per step at most (None: budget)
    policy: Policy = field(default_factory=FCFSPolicy)

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1 or \
                (self.long_prefill_chunk is not None and self.long_prefill_chunk < 1):
            raise ValueError(f"invalid {self}")


@dataclass
class ScheduledRequest:
    request: Request
    start: int              # first token (= KV row) computed this step: the request's num_computed_tokens
    num_new_tokens: int     # tokens [start, start + num_new_tokens) of request.all_token_ids
    samples: bool           # the chunk reaches its last token and a new token is wanted: sample it


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest]
    preempted: list[str]    # request ids preempted this step (their blocks are already freed)
    num_tokens: int         # sum of num_new_tokens
    refused: list[tuple[Request, str]] = field(default_factory=list)   # finished (aborted): can never
                            # run, the pinned blocks having taken its room since it was added; why

    @property
    def empty(self) -> bool:
        return not self.scheduled


def is_decoding(r: Request) -> bool:
    """Whether r computes one token a step: its last sampled one (not a prompt chunk)."""
    return r.num_output_tokens > 0 and r.num_new_tokens_to_compute == 1


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager):
        self.config, self.kv = config, kv
        self.waiting: list[Request] = []     # preempted ones first, then in the order added
        self.running: list[Request] = []     # in admission order: the last is preempted first
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0

    @property
    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def add(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if request.status is not RequestStatus.WAITING or request.block_table or request.num_computed_tokens:
            raise ValueError(f"only a new request can be added: {request}")
        why = self.kv.shortfall(request, self.chunk)
        if why is not None:
            raise CapacityError(f"request {request.request_id!r} needs {request.max_rows} KV rows "
                                f"({request.num_prompt_tokens} prompt + {request.max_new_tokens} new - 1): {why}")
        self.waiting.append(request)
        self.requests[request.request_id] = request

    @property
    def chunk(self) -> int:
        """The most tokens one request computes in a step."""
        return self.config.long_prefill_chunk or self.config.max_num_batched_tokens

    def peak_blocks(self, request: Request) -> int:
        """The most blocks the request holds at once (KVCacheManager.peak_blocks at this chunk size)."""
        return self.kv.peak_blocks(request, self.chunk)

    def abort(self, request_id: str) -> Request | None:
        """Finish the request as aborted and free its blocks now; None if it is not live."""
        r = self.requests.get(request_id)
        if r is not None:
            self._finish(r, RequestStatus.FINISHED_ABORTED)
        return r

    def preempt(self, request_id: str) -> None:
        """Preempt a running request now (its blocks freed, recomputed when admitted again)."""
        r = self.requests.get(request_id)
        if r is None or r.status is not RequestStatus.RUNNING:
            raise ValueError(f"{request_id!r} is not running")
        self.running.remove(r)
        self._preempt(r)

    def schedule(self, prompt_limit: int | None = None) -> SchedulerOutput:
        """The next step's requests and token counts. prompt_limit: prompt tokens (requests not
        decoding) the step may carry, all together, when some request is decoding (pacing.Pacer)."""
        cfg, kv = self.config, self.kv
        budget = cfg.max_num_batched_tokens
        chunk = cfg.long_prefill_chunk or budget
        out: list[ScheduledRequest] = []
        preempted: list[str] = []
        prompt = budget if prompt_limit is None or not any(map(is_decoding, self.running)) else prompt_limit

        i = 0
        while i < len(self.running) and budget > 0:
            r = self.running[i]
            n = min(r.num_new_tokens_to_compute, chunk, budget)
            if n <= 0:
                raise AssertionError(f"running request with nothing to compute: {r}")
            if not is_decoding(r):
                n = min(n, prompt)
                if n == 0:                # paced: its next chunk waits for a step with room
                    i += 1
                    continue
            if not self._make_room(r, n, preempted):
                break
            out.append(ScheduledRequest(r, r.num_computed_tokens, n, self._samples(r, n)))
            budget -= n
            prompt -= 0 if is_decoding(r) else n
            i += 1

        held: set[str] = set()            # waiting for a prefix a running request is computing now
        refused: list[tuple[Request, str]] = []
        while not preempted and len(self.waiting) > len(held) and min(budget, prompt) > 0 and \
                len(self.running) < cfg.max_num_seqs:
            key = cfg.policy.sort_key(self.running)
            r = min((w for w in self.waiting if w.request_id not in held),
                    key=lambda w: (w.status is not RequestStatus.PREEMPTED, key(w)))
            computed, num_cached = kv.get_computed_blocks(r)
            if kv.pending_prefix(r, len(computed)) is not None:
                held.add(r.request_id)    # computed once, by that request: admitted when it is cached
                continue
            n = min(r.num_tokens - num_cached, chunk, budget, prompt)
            # pins made since it was added may leave it too little room for good: waiting (or,
            # preempted, coming back) it would hold the queue (or preempt itself) forever
            why = kv.shortfall(r, self.chunk) if r.num_preemptions else None
            if why is None and not kv.allocate_slots(r, n, computed):
                why = kv.shortfall(r, self.chunk)
                if why is None:
                    break                 # room comes back as running requests finish
            if why is not None:
                self._finish(r, RequestStatus.FINISHED_ABORTED)
                refused.append((r, why))
                continue
            self.waiting.remove(r)
            self.running.append(r)
            r.status = RequestStatus.RUNNING
            out.append(ScheduledRequest(r, r.num_computed_tokens, n, self._samples(r, n)))
            budget -= n
            prompt -= n

        return SchedulerOutput(out, preempted, cfg.max_num_batched_tokens - budget, refused)

    def update(self, output: SchedulerOutput, sampled: dict[str, int], stopped: Collection[str] = ()) -> list[Request]:
        """After the step's forward: advance each scheduled request, append its sampled token (if it
        sampled), stop it on eos, max_new_tokens or when its id is in `stopped` (a stopping
        criterion of the sampler's fired on the new token), offer its new whole blocks to the prefix cache,
        pin a Context's prompt, free finished requests' blocks. Returns the requests finished."""
        finished = []
        for s in output.scheduled:
            r = s.request
            if r.is_finished:                      # aborted since schedule()
                continue
            if r.num_computed_tokens != s.start:
                raise ValueError(f"update() of a step already applied or out of order: {r}")
            r.num_computed_tokens += s.num_new_tokens
            status = None
            if s.samples:
                if r.request_id not in sampled:
                    raise ValueError(f"no token sampled for {r.request_id!r}, which samples this step")
                tok = int(sampled[r.request_id])
                r.output_token_ids.append(tok)
                if tok in r.eos_token_ids or r.request_id in stopped:
                    status = RequestStatus.FINISHED_STOPPED
                elif r.num_output_tokens >= r.max_new_tokens:
                    status = RequestStatus.FINISHED_LENGTH
            elif r.num_computed_tokens == r.num_tokens and r.num_output_tokens >= r.max_new_tokens:
                status = RequestStatus.FINISHED_LENGTH     # max_new_tokens=0: the prompt alone
            self.kv.cache_full_blocks(r)
            self.kv.drop_out_of_window(r)
            if r.pin_prompt and r.pinned_blocks is None and r.num_computed_tokens >= r.num_prompt_tokens:
                r.pinned_blocks = self.kv.pin_prefix(r, r.num_prompt_tokens // self.kv.block_size)
            if status is not None:
                self._finish(r, status)
                finished.append(r)
        return finished

    def _make_room(self, r: Request, n: int, preempted: list[str]) -> bool:
        """Allocate n rows for running request r, preempting running requests from the last admitted
        on (never one scheduled already this step: those precede r) until it fits. False when r
        itself had to go."""
        while not self.kv.allocate_slots(r, n):
            victim = self.running.pop()
            self._preempt(victim)
            preempted.append(victim.request_id)
            if victim is r:
                return False
        return True

    def _samples(self, r: Request, n: int) -> bool:
        return r.num_computed_tokens + n == r.num_tokens and r.num_output_tokens < r.max_new_tokens

    def _preempt(self, r: Request) -> None:
        self.kv.free(r)
        r.num_computed_tokens = r.num_cached_tokens = 0
        r.status = RequestStatus.PREEMPTED
        r.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.insert(0, r)

    def _finish(self, r: Request, status: RequestStatus) -> None:
        self.kv.free(r)
        r.status = status
        if r in self.running:
            self.running.remove(r)
        else:
            self.waiting.remove(r)
        del self.requests[r.request_id]
