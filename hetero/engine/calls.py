"""generate() calls that overlap join the engine's running batch (continuous batching for a web
application's threads sharing one HeteroGenerator).

A call runs through HF's generation loop, alone, as always when nothing else runs. A call made
while another runs (the generator's call lock is busy) or while the engine has requests in flight
is given to the engine instead when the engine batches its settings (adapters loaded in the
generator included; a PeftModel's calls run HF's loop), also a call that reads contexts
(context=[...], extend_context=False: each context's whole blocks are copied into the engine's
pool once and pinned there until the context closes, and the context then lives there alone:
its arena closed, Context.pooled; a later call that reads it joins the engine even alone, one
that needs HF's loop over it brings it back into an arena; a prefill() made meanwhile is computed
by the engine and pinned there, a context in the pool from the start): each row of its batch becomes a request
(its real tokens, without the left padding) with HF's processors and stopping criteria for that
row alone; the call returns generate's tensor, left padding kept and finished
rows padded with pad_token_id, as HF returns it. Other calls wait their turn for the lock. The
engine shares the generator's worker pool and model: each engine step holds the call lock (an
HF-loop call runs between two steps), and the pool maps the engine's KV pool or a call's arena as
each needs it.

  state           written by                              read by
  _engine         the calling threads (under _make_lock)  the calling threads
  _pins           the calling threads (under _pin_lock)   the calling threads; Context close (forget)
  _built_for      the calling threads (under _make_lock)  _ensure (the weights_key the engine's KV was computed with)
"""
from __future__ import annotations

import dataclasses
import threading
import weakref

import torch

from hetero.engine.config import EngineConfig
from hetero.engine.kv_pool import BLOCK_SIZE
from hetero.errors import (CapacityError, EngineError, GeneratorClosedError, HeteroError, UnsupportedModelError,
                           WorkerError)
from hetero.settings import pad_id

# why a call's settings are not batched by the engine (None: they are)
PER_ROW_OBJECTS = ("logits_processor", "stopping_criteria", "streamer")   # called per request, not per batch


# processors that see a left-padded batch's pad ids or its padded width in HF's loop (a request
# of the engine holds its row's real tokens alone)
PAD_SENSITIVE = {
    "min_length": lambda v: bool(v),                                 # counted over the padded width
    "no_repeat_ngram_size": lambda v: bool(v),                       # n-grams over the pads too
    "encoder_no_repeat_ngram_size": lambda v: bool(v),
    "encoder_repetition_penalty": lambda v: v is not None and v != 1.0,
}


def why_not_batched(settings, call, batch: int, padded: bool = False) -> str | None:
    """Why these resolved settings run through HF's loop instead of the engine (None: they batch).
    padded: the batch has left padding."""
    if settings.return_dict_in_generate:
        return "return_dict_in_generate"
    if settings.do_sample and batch > 1:
        return "sampling a batch (HF draws the rows together from one generator)"
    if batch > 1 and any(call.get(k) for k in PER_ROW_OBJECTS):
        return "logits processors, stopping criteria or a streamer over a batch"
    if padded:
        seen = [k for k, on in PAD_SENSITIVE.items() if on(getattr(settings, k, None))]
        if seen:
            return f"{', '.join(seen)} over a left-padded batch (HF's processors see the pads)"
    return None


class GeneratorEngine:
    """The engine of one HeteroGenerator, created on the first call that joins it (and again after a
    worker died: the generator then has a new pool)."""

    def __init__(self, gen, config: EngineConfig):
        # a weak reference: the generator's finalizer holds this object, which must not keep it alive
        self._gen, self.config = weakref.ref(gen), config
        self.engine = None
        self.refused: str | None = None          # the model is not one the engine serves: why
        self._make_lock = threading.Lock()
        self._pins = weakref.WeakKeyDictionary()  # Context -> (engine, its pin stream, blocks pinned)
        self._pooled = weakref.WeakSet()          # contexts living in a pool alone (this engine's or an old one's)
        self._pin_lock = threading.Lock()         # one pin at a time: two calls over a context pin it once
        self._built_for = None                    # the weights the engine's KV was computed with
        self.closed = False                       # the generator closes: no engine is built again

    @property
    def busy(self) -> bool:
        e = self.engine
        return e is not None and e.failure is None and e.has_unfinished

    def others_running(self, calls) -> bool:
        """Whether other work runs: requests in the engine, or a call holding the generator's lock
        (`calls`, its CallLock) that is not the engine thread's step (which ends on its own)."""
        e = self.engine
        thread = getattr(e, "_thread", None)
        return self.busy or (calls.busy_elsewhere and (thread is None or calls.owner != thread.ident))

    def _ensure(self):
        """The engine, built for the model's weights as they are now; None where the model is not
        one the engine serves, or the weights changed under requests still running (the call then
        runs HF's loop: the engine's prefix cache and pins hold KV of the old weights). Adapters
        need no such check: each load hashes apart (Engine.adapter_key)."""
        from hetero.engine.engine import Engine
        from hetero.offload.registry import weights_key

        gen = self._gen()
        weights = weights_key(gen.model)
        with self._make_lock:
            if self.closed:                       # the call runs HF's loop, which finds the generator closed
                return None
            e = self.engine
            if e is not None and weights != self._built_for and e.has_unfinished:
                return None
            if e is not None and (weights != self._built_for or e.failure is not None or e.pool is not gen._pool
                                  or not e.pool.alive):
                self.engine = None
                try:
                    e.close()
                except WorkerError:               # its pool died: its segment is gone all the same
                    pass
            if self.engine is None:
                self._pins.clear()                # they were the old engine's
                self._built_for = weights
            if self.engine is None and self.refused is None:
                calls, model, pool = gen._calls, gen.model, gen._ensure_pool()
                try:             # the pool is used at the first step only, under the lock (step_guard)
                    ref = self._gen

                    def lora():                   # the generator's adapters, as they are now
                        g = ref()
                        return (g._store, g._hooks) if g is not None and g._store is not None else (None, None)

                    config = self.config      # a CUDA model's decode round trip: the generator's choice
                    if config.transport == "auto":
                        config = dataclasses.replace(config, transport=gen.config.transport)
                    self.engine = Engine(model, config, pool=pool, planner=lambda: ref()._ensure_planner(pool),
                                         step_guard=lambda: calls.turn(model), lora=lora)
                except (UnsupportedModelError, CapacityError) as err:
                    self.refused = str(err)
            return self.engine

    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, max_new_tokens: int, settings,
                 call: dict, lora=None, contexts=None, extend: bool = False) -> torch.Tensor | None:
        """The call through the engine: generate's tensor, or None where the engine does not take it
        (the caller then runs HF's loop). lora: the call's LoraBatch (its adapters by request).
        contexts: one Context per row, read and not changed (generate(context=[...]) or
        extend_context=False): each row's request is its context's tokens then its own, and the
        tensor returned is theirs, left-padded, as HF's loop over the contexts returns it.
        extend: the one context goes on with the call's tokens and the ones generated (as HF's
        loop extends it), pinned again in the pool; its extend_lock held throughout (one extension
        of a context at a time, on either path)."""
        if not extend:
            return self._generate(input_ids, attention_mask, max_new_tokens, settings, call, lora, contexts)
        ctx = contexts[0]
        with ctx.extend_lock:
            return self._generate(input_ids, attention_mask, max_new_tokens, settings, call, lora, contexts, True)

    def _generate(self, input_ids, attention_mask, max_new_tokens, settings, call, lora, contexts, extend=False):
        B = input_ids.shape[0]
        names = [None] * B if lora is None else [None if a is None else a.name for a in lora.adapters]
        if why_not_batched(settings, call, B, padded=not bool(attention_mask.all())) is not None:
            return None
        if contexts is not None and any(c.closed or _arena_rings(c) for c in contexts):
            return None                           # HF's loop names a closed one; rings keep too few rows
        engine = self._ensure()
        if engine is None or (contexts is not None and any(c.pool_pin is not None and c.pool_pin[0] is not engine
                                                           for c in contexts)):
            return None                           # a context of an engine gone: HF's loop computes it again
        rows = [input_ids[b][attention_mask[b].bool()].tolist() for b in range(B)]
        if contexts is not None:
            try:
                for c in {id(c): c for c in contexts}.values():
                    self._pin(engine, c)
            except (CapacityError, HeteroError, ValueError):
                return None
            if extend and not (contexts[0].pooled and contexts[0].pool_pin[0] is engine and
                               len(contexts[0].tokens) + len(rows[0]) + max_new_tokens - 1 <= contexts[0].capacity):
                return None                       # in an arena still, or past its room: HF's loop (it names that)
            rows = [c.tokens.tolist() + r for c, r in zip(contexts, rows)]
            input_ids = left_padded(rows, pad_id(settings), input_ids)
        if any(len(r) + max_new_tokens > engine.max_model_len for r in rows):
            return None
        streamer = call.get("streamer")
        kw = dict(logits_processor=call.get("logits_processor"), stopping_criteria=call.get("stopping_criteria"),
                  tokenizer=call.get("tokenizer"))
        streams = []
        try:
            for r, name in zip(rows, names):
                streams.append(engine.submit(r, settings, max_new_tokens, adapter=name, **kw))
        except (CapacityError, HeteroError, RuntimeError):
            for s in streams:
                s.abort()
            return None
        if streamer is not None:                  # one row (why_not_batched): as HF's loop feeds it
            try:
                streamer.put(input_ids.cpu())
                for t in streams[0]:
                    streamer.put(torch.tensor([t]))
                streamer.end()
            except BaseException:                 # raised to the caller, as HF's loop does; the request stops
                streams[0].abort()
                raise
        try:
            outs = [s.result() for s in streams]
        except EngineError as e:      # the pins took the pool's room since submit: HF's loop serves it instead
            if not isinstance(e.__cause__, CapacityError) or streamer is not None:
                raise
            for s in streams:
                s.abort()
            return None
        if any(s.finish_reason == "abort" for s in streams):      # its engine closed under it: never a short result
            if self.closed:
                raise GeneratorClosedError("the HeteroGenerator was closed while this generate() call ran")
            raise EngineError("this generate() call's requests were aborted before they finished: their engine "
                              "was closed (a CPU worker died, or the model's weights changed); call again")
        pad = streams[0].pad_token_id
        width = max(len(o) for o in outs)
        if any(len(o) < width for o in outs) and pad is None:
            raise ValueError("a finished sequence must be padded but neither pad_token_id nor eos_token_id is set")
        tail = torch.tensor([o + [pad] * (width - len(o)) for o in outs], dtype=torch.long)   # int32 ids: int64 out, as HF
        out = torch.cat([input_ids, tail.to(input_ids.device)], 1)
        if extend:
            self._extended(engine, contexts[0], out[0].to("cpu"))
        return out

    def _extended(self, engine, ctx, seq: torch.Tensor) -> None:
        """ctx extended to `seq` through the engine: seq's whole blocks pinned (found in the prefix
        cache, the request having just computed them; its last rows computed), the old pin released."""
        adapter = None if ctx.adapter is None else ctx.adapter.name
        stream = engine.pin(seq.tolist(), adapter)
        stream.result()
        n = len(stream.pinned_blocks) * BLOCK_SIZE
        with self._pin_lock:
            ctx.set_tokens(seq[:n], seq[n:])
            old = self._keep_pin(ctx, engine, stream, pooled=True)
        if old is not None and old[0] is engine:
            engine.unpin(old[1])
        if ctx.closed:
            self.forget(ctx)

    def _keep_pin(self, ctx, engine, stream, pooled: bool):
        """Under _pin_lock: `stream` is ctx's pin in `engine` (released when ctx is dropped without
        close()); pooled: ctx lives there alone. Returns the entry it replaces (or None)."""
        old = self._pins.get(ctx)
        self._pins[ctx] = (engine, stream, len(stream.pinned_blocks))
        if pooled:
            ctx.pool_pin = (engine, stream)
            self._pooled.add(ctx)
        weakref.finalize(ctx, _unpin, weakref.ref(engine), stream)
        return old

    def _pin(self, engine, ctx) -> None:
        """The context's whole blocks pinned in the engine's pool (copied from its arena, at the
        engine's next step: no call changes the context then), and the context moved there: its
        arena closed (Context.pooled); again once it has grown by a block."""
        with self._pin_lock:
            entry = self._pins.get(ctx)
            blocks = ctx.length // BLOCK_SIZE
            if blocks == 0 or (entry is not None and entry[0] is engine and entry[2] >= blocks):
                return                            # shorter than a block: its requests compute it
            adapter = None if ctx.adapter is None else ctx.adapter.name

            def snapshot():
                n = ctx.length // BLOCK_SIZE * BLOCK_SIZE         # ctx.length raises on a closed context
                return ctx.token_ids[:n].tolist(), ctx.session

            stream = engine.pin_kv(snapshot, adapter, then=lambda s: self._move(engine, ctx, s))
            stream.result()
            if entry is not None and entry[0] is engine:
                engine.unpin(entry[1])
            self._keep_pin(ctx, engine, stream, pooled=False)    # _move pooled it, where it could
            if ctx.closed:                        # closed meanwhile: its forget() may have found nothing
                self.forget(ctx)

    def prefill(self, tokens: torch.Tensor, adapter, capacity: int):
        """HeteroGenerator.prefill while others run: the prompt computed in the engine's batch (its
        steps go on meanwhile) and pinned there, a Context living in the pool alone (capacity: the
        arena's rows it gets when HF's loop needs it). None where the engine does not take it
        (the caller prefills an arena): not served, the pool too small, or no whole block."""
        engine = self._ensure()
        if engine is None or len(tokens) > engine.max_model_len:
            return None
        try:
            stream = engine.pin(tokens.tolist(), None if adapter is None else adapter.name)
            stream.result()
        except (CapacityError, HeteroError):
            return None
        return self._context(engine, stream, tokens, adapter, capacity)

    def load(self, path, capacity_for):
        """HeteroGenerator.load_context while others run: the file's whole blocks loaded into the
        engine's pool (Engine.load_pin: checked against the model and adapters as load_context
        checks it), a Context living there (capacity_for(n): its arena's rows for n tokens). None
        where the engine does not take it (the caller loads an arena: the errors name the file)."""
        engine = self._ensure()
        if engine is None:
            return None
        try:
            stream, _ = engine.load_pin(path)
        except (CapacityError, HeteroError):
            return None
        tokens = torch.tensor(stream.prompt_ids, dtype=torch.long)
        gen = self._gen()
        adapter = None if stream.adapter is None else gen._store.adapters[stream.adapter]
        return self._context(engine, stream, tokens, adapter, capacity_for(len(tokens)))

    def _context(self, engine, stream, tokens: torch.Tensor, adapter, capacity: int):
        """A Context over a pin of `tokens` (computed or loaded): its whole blocks in the pool, the
        rest pending."""
        from hetero.context import Context

        n = len(stream.pinned_blocks or ()) * BLOCK_SIZE
        if n == 0:
            engine.unpin(stream)
            return None
        ctx = Context(self._gen(), None, tokens[:n], adapter)
        ctx.pending, ctx.weights, ctx.pooled_capacity = tokens[n:], self._built_for, capacity
        with self._pin_lock:
            self._keep_pin(ctx, engine, stream, pooled=True)
        return ctx

    def _move(self, engine, ctx, stream) -> None:
        """The engine thread, right after the copy: the context's KV now lives in the pool alone
        (its arena closed, its tokens past the pinned blocks pending). Skipped where the generator's
        lock is another thread's (an engine without its own thread, beside a call)."""
        gen = self._gen()
        if gen is None or not gen._lock.acquire(blocking=False):
            return
        try:
            session = ctx.session
            if ctx.closed or session is None or (gen._calls.busy and gen._calls.owner != threading.get_ident()):
                return
            n = len(stream.pinned_blocks) * BLOCK_SIZE
            tokens = ctx.tokens
            gen._contexts.forget(session)
            ctx.pool_pin, ctx.pooled_capacity = (engine, stream), session.layout.cap
            ctx.pooled_tmax = session.layout.tmax
            self._pooled.add(ctx)
            ctx.session = None
            ctx.set_tokens(tokens[:n], tokens[n:])
            session.close()
        finally:
            gen._lock.release()

    def forget(self, ctx) -> None:
        """A closed Context's pinned copy released (and a context moved back into an arena)."""
        self._pooled.discard(ctx)
        entry = self._pins.pop(ctx, None)
        if entry is not None and entry[0] is self.engine:
            entry[0].unpin(entry[1])

    def pooled(self) -> list:
        """The contexts living in the engine's pool (or an engine's it replaced) alone."""
        return [c for c in list(self._pooled) if c.pool_pin is not None]

    def continues_pooled(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> bool:
        """Whether every row's prompt starts with a context living in the engine's pool and goes on
        past it (HeteroConfig.reuse_contexts: the engine's prefix cache finds its blocks)."""
        held = [c.tokens for c in self.pooled() if not c.closed and c.adapter is None]
        if not held:
            return False
        for b in range(input_ids.shape[0]):
            row = input_ids[b][attention_mask[b].bool()].to("cpu")
            if not any(len(t) < len(row) and torch.equal(row[:len(t)], t) for t in held):
                return False
        return True

    def close(self):
        with self._make_lock:
            self.closed = True                    # a call joining meanwhile builds no engine (close() would
            e, self.engine = self.engine, None    # join its thread, waiting for the lock close() holds)
            for c in self.pooled():               # their KV goes with the pool: using one raises
                c.closed = True
            self._pins.clear()
        if e is not None:
            e.close()


def _arena_rings(ctx) -> int:
    """The ring layers of ctx's arena (0 in none, or where it has no arena: in the engine's pool)."""
    session = ctx.session                     # one read: the engine thread may move it meanwhile
    return 0 if session is None else session.layout.ring_layers


def _unpin(engine_ref, stream) -> None:
    """A dropped Context's pin released (weakref.finalize; nothing where its engine is gone)."""
    engine = engine_ref()
    if engine is not None and not stream.unpinned:
        engine.unpin(stream)


def left_padded(rows: list[list[int]], pad: int, like: torch.Tensor) -> torch.Tensor:
    """[B, S] of the rows, left-padded with `pad`, on like's device and dtype."""
    S = max(len(r) for r in rows)
    return torch.tensor([[pad] * (S - len(r)) + r for r in rows], dtype=like.dtype, device=like.device)
