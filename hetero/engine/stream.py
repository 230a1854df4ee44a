"""A request's output as the engine produces it: RequestStream.

  field                          written by                       read by
  token_ids, token_times,        the engine thread (_push, under  callers (iteration, result(),
  finish_reason, error           the condition)                   async iteration)
  scores, pinned_blocks, ...     the engine thread                callers, after finished
"""
from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from hetero.errors import EngineError

if TYPE_CHECKING:
    from hetero.engine.engine import Engine


class RequestStream:
    """One request's output as the engine produces it: iterate (blocking) or `async for` over its
    new token ids, or wait for all of them with result(). `finish_reason` is "stop" (an eos id or
    a stopping criterion), "length" (max_new_tokens) or "abort" once finished."""

    def __init__(self, engine: Engine, request_id: str, prompt_len: int):
        self.engine, self.request_id, self.prompt_len = engine, request_id, prompt_len
        self.token_ids: list[int] = []
        self.finish_reason: str | None = None
        self.error: BaseException | None = None
        self._own_error = False                     # error is the request's own processor's (raised as it is)
        self.scores: list[torch.Tensor] | None = None     # processed scores per token (output_scores=True)
        self.pad_token_id: int | None = None              # what generate pads a finished sequence with
        self.pinned_blocks: list[int] | None = None       # a pin()'s blocks, once computed (unpin releases)
        self.prompt_ids: list[int] | None = None          # a pin()'s document and adapter
        self.adapter_key: str | None = None               # a pin()'s adapter as its blocks were hashed
        self.adapter: str | None = None
        self.unpinned = False
        self.cached_tokens = 0                      # prompt tokens found in the prefix cache (at its admission)
        self.arrival = time.monotonic()
        self.token_times: list[float] = []          # time.monotonic() of each token's arrival here
        self.finish_time: float | None = None
        self._cond = threading.Condition()
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None or self.error is not None

    def _push(self, tokens: list[int], finish_reason: str | None = None, error: BaseException | None = None,
              own: bool = False):
        """The engine thread: new tokens, and the end. own: the error is the request's own logits
        processor's or stopping criterion's, raised to its caller as it is (as generate does)."""
        with self._cond:
            now = time.monotonic()
            self.token_times += [now] * len(tokens)
            self.token_ids += tokens
            if error is not None:
                self.error, self._own_error = error, own
            elif finish_reason is not None:
                self.finish_reason = finish_reason
            if self.finished:
                self.finish_time = now
            self._cond.notify_all()
            waiters = list(self._waiters)
        for loop, event in waiters:
            try:
                loop.call_soon_threadsafe(event.set)
            except RuntimeError:          # that loop is closed
                pass

    def _raise(self):
        if self.error is not None:
            if self._own_error:
                raise self.error
            raise EngineError(f"request {self.request_id!r} failed: {self.error}") from self.error

    def _since(self, i: int, wait: bool = False) -> tuple[list[int], bool]:
        """(the tokens after the first i, finished), waiting for one of them with wait (an engine
        without its background thread is stepped here meanwhile)."""
        if wait:
            self._drive(lambda: len(self.token_ids) > i)
        with self._cond:
            while wait and len(self.token_ids) <= i and not self.finished:
                self._cond.wait()
            return self.token_ids[i:], self.finished     # finished: no token comes after these

    def __iter__(self) -> Iterator[int]:
        i, done = 0, False
        while not done:
            new, done = self._since(i, wait=True)
            yield from new
            i += len(new)
        self._raise()

    async def __aiter__(self):
        loop, event = asyncio.get_running_loop(), asyncio.Event()
        with self._cond:
            self._waiters.append((loop, event))
        try:
            i, done = 0, False
            while not done:
                event.clear()
                new, done = self._since(i)
                for t in new:
                    yield t
                i += len(new)
                if not new and not done:
                    await event.wait()
            self._raise()
        finally:
            with self._cond:
                self._waiters.remove((loop, event))

    def _drive(self, ready):
        """EngineConfig(background=False): step the engine in this thread until ready() or finished."""
        e = self.engine
        if not e.config.background:
            # a step may compute nothing and leave work (a request preempted itself, to be admitted
            # again or refused at the next): go on while the engine has any
            while not ready() and not self.finished and (e.step() or e.has_unfinished):
                pass

    def result(self, timeout: float | None = None) -> list[int]:
        """All output token ids once finished (raises EngineError if it failed, TimeoutError). An
        engine without its background thread (EngineConfig.background=False) is stepped here."""
        self._drive(lambda: False)
        with self._cond:
            if not self._cond.wait_for(lambda: self.finished, timeout):
                raise TimeoutError(f"request {self.request_id!r} unfinished after {timeout} s")
        self._raise()
        return list(self.token_ids)

    def abort(self):
        self.engine.abort(self.request_id)
