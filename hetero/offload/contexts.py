"""Contexts: a request's KV kept between calls (prefill, load_context), and prompts that continue one.

A mixin of HeteroGenerator: a context's session is opened under the generator's call lock, within
its context_memory budget, and kept in its registry (hetero.offload.registry); load_context fills
one from a saved file (hetero.offload.saved); _reusable finds the live contexts a call's prompts
start with (HeteroConfig.reuse_contexts).
"""
import contextlib

import torch

from hetero.adapters.sync import active
from hetero.context import Context
from hetero.engine.saved import pin_rows
from hetero.errors import CapacityError, GeneratorClosedError, UnsupportedModelError, WorkerError
from hetero.memory import default_reserve, plan_cache
from hetero.offload.arena import whole_blocks
from hetero.offload.registry import STALE, weights_key
from hetero.offload.saved import layer_start
from hetero.offload.session import KVSession
from hetero.routing import keeping_cache
from hetero.settings import check_inputs, one_pass_only, pad_id, rope_ok, rope_refused


class ContextsMixin:
    """HeteroGenerator's contexts (prefill, load_context, _reusable)."""

    def prefill(self, input_ids, attention_mask=None, reserve=None, adapter_name=None):
        """Prefill one request (input_ids [1, S]) and keep its KV in shared memory: returns a
        Context that generate(new_ids, context=ctx) continues (the new tokens are prefilled over
        the cached KV on the CPU workers, then decoded), call after call. `reserve`: rows kept
        free for the tokens later calls add (default: 1024, within the model's max positions; a call
        that needs more raises CapacityError). adapter_name: a loaded LoRA adapter to prefill with
        (None: the base model, or a PeftModel's active adapter; "__base__": the base model); the
        calls continuing the context use it too.
        Close it (ctx.close(), or `with`) to free its memory; gen.close() closes the rest."""
        if self._closed:
            raise GeneratorClosedError("prefill() called on a closed HeteroGenerator")
        if reserve is None and isinstance(input_ids, torch.Tensor) and input_ids.ndim == 2:
            reserve = default_reserve(self.spec, self.config, input_ids.shape[1])
        attention_mask, reserve = check_inputs(self.model, self.spec, input_ids, attention_mask, reserve, "reserve")
        if input_ids.shape[0] != 1:
            raise ValueError(f"a context holds one request: input_ids must be [1, S], got {tuple(input_ids.shape)}")
        if not bool(attention_mask.all()):
            raise ValueError("a context's prompt cannot be padded: pass its tokens only (attention_mask all ones)")
        if self.spec.one_pass_only:
            raise UnsupportedModelError(one_pass_only(self.spec, "a context"))
        chunk = self._chunk(attention_mask)
        if chunk and not rope_ok(self.spec, input_ids.shape[1], 0, (0,)):
            raise rope_refused(self.spec)
        layers = self._check_model_state()
        adapter_name = self._default_adapter(layers) if adapter_name is None else adapter_name
        lora = self._lora_batch(None if adapter_name is None else [adapter_name], 1, layers)
        adapter = lora.adapters[0] if lora is not None else None
        if (lora is None or self._peft_model is None) and not self._calls.busy_here and \
                self._engine.others_running(self._calls):
            ctx = self._engine.prefill(input_ids[0].detach().to("cpu", torch.long), adapter,
                                       whole_blocks(input_ids.shape[1] + reserve))
            if ctx is not None:                  # others run: computed in the engine's batch, pinned there
                ctx.pooled_tmax = min(self._piece, input_ids.shape[1] + reserve)   # as its arena would have
                return ctx
        with self._exclusive(), self._context_session(attention_mask, reserve) as session:
            self._prefill_into(session, input_ids, attention_mask, chunk, lora)
            adapter = lora.adapters[0] if lora is not None else None      # kept before the session is let go
            return self._contexts.keep(Context(self, session, input_ids[0].detach().to("cpu", torch.long).clone(), adapter))

    def _prefill_into(self, session, input_ids, attention_mask, chunk, lora):
        """Under the generator's lock: the prompt's KV computed into a new context's session."""
        with self._routed(session, lora) as cache, torch.no_grad(), active(lora):
            if chunk:                                # all chunks; the last one too
                self.prefill_chunks(cache, input_ids, attention_mask, chunk, to_end=True)
            else:
                self._forward(cache, input_ids, attention_mask, 0, input_ids.shape[1])
        session.end_call()

    @contextlib.contextmanager
    def _context_session(self, attention_mask, reserve, tmax=None):
        """Under the generator's lock (the caller holds it): a new context's session (one request,
        `reserve` rows free, continuations in pieces of prefill_chunk or CONTINUE_CHUNK tokens, or
        `tmax`) within context_memory; closed again if the body raises (and a pool that died with it)."""
        if tmax is None:
            tmax = min(self._piece, attention_mask.shape[1] + reserve)   # no piece outgrows the context's rows
        # contexts nobody references are closed here, under the lock: closing one runs a job on
        # the worker pool, which a call in another thread may be using; and before the memory checks
        self._contexts.sweep(self.config.context_memory)
        pads, real, cap = plan_cache(self.spec, self.config, attention_mask, reserve, tmax=tmax, what="reserve")
        self._contexts.check_budget(KVSession.layout_for(self.spec, 1, cap, tmax).nbytes, self.config.context_memory)
        pool = self._ensure_pool()
        session = KVSession(pool, self.spec, pads, real, cap, planner=self._ensure_planner(pool), tmax=tmax)
        try:
            yield session
        except BaseException:
            self._contexts.forget(session)            # an interrupt may come right after keep
            try:
                session.close()
            except WorkerError:                       # the error raised above says what happened
                pass
            finally:
                if self._pool is not None and not self._pool.alive:
                    self._drop_pool()
            raise

    def _arena(self, ctx):
        """Under the generator's lock: a Context whose KV lives in the engine's pool alone (pooled)
        back in an arena of its own, with the room it had: its pinned rows copied from the pool
        (computed again where that engine is gone: a dead worker replaced it), its pin released.
        Nothing for a context in an arena already."""
        if ctx.session is not None or ctx.closed:
            return
        if self._closed:
            raise GeneratorClosedError("a context of a closed HeteroGenerator")
        if ctx.weights != weights_key(self.model):
            raise ValueError(STALE)
        engine, stream = ctx.pool_pin
        ids = ctx.token_ids[None].to(self.model.device)
        mask = torch.ones_like(ids)
        try:
            self._arena_from(ctx, engine, stream, ids, mask)
        except CapacityError as e:
            raise CapacityError(f"this context lives in the engine's pool, and HF's loop (this call) needs it back "
                                f"in an arena of its own: {e}") from e
        self._engine.forget(ctx)

    def _arena_from(self, ctx, engine, stream, ids, mask):
        """_arena's new session, filled from the pin (or computed again)."""
        with self._context_session(mask, ctx.pooled_capacity - ids.shape[1], ctx.pooled_tmax) as session:
            if engine is self._engine.engine and engine.failure is None and stream.pinned_blocks:
                rows = pin_rows(engine.kv, stream.pinned_blocks)
                n = ids.shape[1]
                for layer in range(self.spec.layers):
                    # a windowed layer's pool keeps its last window (kv_hybrid): the rows before it
                    # stay zero here, which no later query's window reaches
                    start = max(layer_start(n, session.ring_window[layer]), rows.first_row(layer))
                    k, v = rows.read_rows(layer, 0, n, start)
                    session.write_rows(layer, 0, k, v, start)
                session.finish_prefill()
            else:
                layers = self._check_model_state()
                lora = self._lora_batch(None if ctx.adapter is None else [ctx.adapter.name], 1, layers)
                self._prefill_into(session, ids, mask, self._chunk(mask), lora)
            ctx.session, ctx.pool_pin = session, None
            self._contexts.keep_again(ctx)

    def _forget(self, ctx):
        """A closed Context's registry entry and its copy in the engine's pool dropped (Context._close)."""
        self._contexts.forget(ctx.session)
        self._engine.forget(ctx)

    def load_context(self, path, reserve=None):
        """A Context saved by Context.save, copied into a new arena (no prefill). The file must
        come from this model (attention shape, the config fields that shape the KV, weights; its
        LoRA adapter loaded here with the same weights) and be whole: else ContextFileError, and
        nothing is left allocated. `reserve` as in prefill()."""
        from hetero.offload import saved

        if self._closed:
            raise GeneratorClosedError("load_context() called on a closed HeteroGenerator")
        if self.spec.one_pass_only:
            raise UnsupportedModelError(one_pass_only(self.spec, "a context"))
        if self.spec.drops_cache:        # an override set since __init__: no call could continue the context
            keeping_cache(self.model)
        if not self._calls.busy_here and self._engine.others_running(self._calls) and \
                self._peft_model is None:         # others run: loaded into the engine's pool
            ctx = self._engine.load(path, lambda n: whole_blocks(
                n + (default_reserve(self.spec, self.config, n) if reserve is None else reserve)))
            if ctx is not None:
                return ctx
        header = saved.read_header(path)
        loaded = self._store.adapters if self._store is not None else {}
        name = saved.check_model(header, self.model, self.spec, path,
                                 lambda n: self._store.digest(loaded[n]) if n in loaded else None)
        n = header["length"]
        if reserve is None:
            reserve = default_reserve(self.spec, self.config, n)
        # the token ids are checked against the vocabulary after the payload's CRC (fill), which covers
        # them: a corrupted id is named as the file's corruption, not as a bad prompt
        ids = torch.zeros(1, n, dtype=torch.long, device=self.model.device)
        mask, reserve = check_inputs(self.model, self.spec, ids, None, reserve, "reserve")
        with self._exclusive(), self._context_session(mask, reserve) as session:
            saved.fill(session, header, path)
            saved.check_vocabulary(header, getattr(self.model.get_input_embeddings(), "num_embeddings", None), path)
            tokens = torch.tensor(header["tokens"], dtype=torch.long)
            pending = torch.tensor(header["pending"], dtype=torch.long)
            session.finish_prefill()
            ctx = Context(self, session, tokens, loaded[name] if name is not None else None)
            ctx.pending = pending
            return self._contexts.keep(ctx)

    def _reusable(self, input_ids, attention_mask, max_new_tokens, settings):
        """Automatic prefix reuse (HeteroConfig.reuse_contexts): when every request's prompt starts
        with the tokens of a live Context (its cached and pending ones) and goes on past them,
        (the longest such contexts, the new tokens [B, n] left-padded, their mask); else None.
        Continuing a context reads its exact KV, and the sequences the continuation feeds generate
        are input_ids themselves (so not where a pad cell holds another id than the pad: logits
        processors see every column), so the result is the one-shot generate's."""
        if not self.config.reuse_contexts or not self._contexts or self.spec.one_pass_only:
            return None
        if bool((input_ids[attention_mask == 0] != pad_id(settings)).any()):
            return None
        cached = self.config.context_memory is not None     # unreferenced contexts are a cache (see sweep)
        return self._contexts.reusable(self, input_ids, attention_mask, max_new_tokens, cached, lambda picks: rope_ok(
            self.spec, input_ids.shape[1], max_new_tokens, [p.length for p in picks]))
