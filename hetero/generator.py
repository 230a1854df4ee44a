"""HeteroGenerator: HF-style generate() with the KV cache and decode attention on CPU workers.

The facade: the public API (generate, prefill, load_context, the LoRA adapters, close) and what
ties a call together: the KV session it opens, the lock. The parts live in modules named for
them: workers (the pool and planner a call runs on), settings (a call's arguments), memory (its KV rows),
adapters.sync (a PeftModel's adapters), offload.registry (the contexts kept between calls),
routing (the call lock, the attention routed to a session, the transport) and prefill (chunked
prefill and the continuation of contexts, a mixin of HeteroGenerator).
"""
import contextlib
import logging
import time
import weakref
from dataclasses import replace

import torch

from hetero import attention
from hetero.adapters import hooks as lora_hooks, source as lora_source, sync
from hetero.adapters.sync import active
from hetero.compat import GENERATE_CACHE_KWARG, without_cache
from hetero.config import HeteroConfig
from hetero.context import Context
from hetero.engine.calls import GeneratorEngine
from hetero.errors import AdapterError, GeneratorClosedError, UnsupportedModelError, WorkerError
from hetero.memory import plan_cache
from hetero.model_spec import inspect_model
from hetero.offload.contexts import ContextsMixin
from hetero.offload.registry import ContextRegistry
from hetero.offload.session import KVSession
from hetero.prefill import PrefillMixin
from hetero.routing import CallLock, choose_transport, keeping_cache, routed
from hetero.workers import WorkersMixin, release as _release
from hetero.settings import (MODEL_DEFAULT, check_inputs, default_new_tokens, generation_settings,
                             inferred_mask, one_pass_only, resolve_lengths, rope_ok, rope_refused)

# re-exported from their new homes: tests and benchmarks import or patch these here
from hetero.adapters.sync import active as _active, adapter_keys as _peft_adapter_keys  # noqa: F401, E402
from hetero.ipc import shm  # noqa: F401, E402
from hetero.prefill import CONTINUE_CHUNK  # noqa: F401, E402
from hetero.routing import keeping_cache as _keeping_cache  # noqa: F401, E402
from hetero.settings import (DEFAULT_NEW_TOKENS, GC_FIELDS as _GC_FIELDS, PASS_THROUGH,  # noqa: F401, E402
                             UNSUPPORTED_SETTINGS)

log = logging.getLogger("hetero")



class HeteroGenerator(PrefillMixin, ContextsMixin, WorkersMixin):
    """Generate with a transformers causal LM whose KV cache and decode attention live on CPU workers.

        with HeteroGenerator(model, adapters={"legal": "path/to/lora"}) as gen:
            out = gen.generate(input_ids, attention_mask=mask, max_new_tokens=64,
                               adapter_names=["legal", None])

    `model` may be a peft.PeftModel: its LoRA adapters are served by name.
    """

    def __init__(self, model, cpu_workers=None, config=None, adapters=None):
        if config is not None and not isinstance(config, HeteroConfig):
            raise TypeError(f"config= takes a HeteroConfig, got {type(config).__name__}")
        config = config or HeteroConfig()
        if cpu_workers is not None:
            config = replace(config, cpu_workers=cpu_workers)
        self.config = config
        if adapters is not None and not isinstance(adapters, dict):
            raise TypeError(f"adapters= takes {{name: save_pretrained directory}}, got {type(adapters).__name__}")
        peft_model = model if sync.is_peft_model(model) else None
        if peft_model is not None:
            model = peft_model.get_base_model()
        self.spec = inspect_model(model)
        self.model = model
        if self.spec.drops_cache:        # refused up front: a user's override hetero would skip (keeping_cache)
            keeping_cache(model)
        # a prefill attends eagerly (scores materialized: prefill_chunk="auto" counts them) with a
        # logit soft-cap or attention sinks (hetero.attention)
        self._eager = bool(getattr(model.config.get_text_config(), "attn_logit_softcapping", None)) or any(
            isinstance(getattr(m, "sinks", None), torch.Tensor) for m in model.modules())
        self._pool = None
        self._planner = None
        self._store = None                 # LoRA adapters in shared memory (created on first load)
        self._contexts = ContextRegistry(model)   # open contexts (hetero.offload.registry)
        self._parent_affinity = None       # _pin_parent (a GPU model): (thread, its affinity, torch threads
                                           # before, torch threads set)
        self._forward_params = None        # the names the model's forward takes (logits_to_keep, position_ids)
        self._cache_kwarg = None           # and the one it takes the cache by (hetero.compat)
        self._rates = None                 # the model's device's copy and attention rates (hetero.prefetch.policy)
        self.last_prefetch_log = None      # the ops of the last prefetched continuation (hetero.prefetch.schedule)
        self.last_prefetch_plan = None     # and what plan() gave for its forwards
        self._hooks = lora_hooks.LoraHooks(model)
        self._peft_model = peft_model      # its active adapter is what adapter_names=None runs (_default_adapter)
        self._peft_keys = {}               # its adapters served here -> _peft_adapter_keys when copied
        self._closed = False
        self._calls = CallLock()           # one call at a time (hetero.routing)
        self._engine = GeneratorEngine(self, config.engine)   # overlapping calls join its batch
        self._lock = self._calls.lock      # taken by Context.save/close too
        # dropped without close(): its workers, segments and hooks go when it is collected (the
        # finalizer holds its attributes, which hold nothing that holds the generator)
        self._finalizer = weakref.finalize(self, _release, self.__dict__)
        attention.register()
        try:
            self._ensure_pool()
            if peft_model is not None:
                for name in peft_model.peft_config:
                    with self._lock:
                        self._add_adapter(name, lora_source.from_peft_model(peft_model, name, model))
                # what the served adapters' weights were when copied (_sync_peft_adapters)
                self._peft_keys = sync.adapter_keys(sync.peft_layers(self.model))
            for name, src in (adapters or {}).items():
                self.load_adapter(name, src)
        except BaseException:
            self.close()
            raise

    @classmethod
    def from_pretrained(cls, path, device=None, torch_dtype=None, cpu_workers=None, config=None, adapters=None,
                        **model_kwargs):
        from transformers import AutoModelForCausalLM

        if torch_dtype is not None:
            model_kwargs["dtype"] = torch_dtype
        model = AutoModelForCausalLM.from_pretrained(path, **model_kwargs)
        if device is not None:
            model = model.to(device)
        return cls(model.eval(), cpu_workers=cpu_workers, config=config, adapters=adapters)

    # ---- LoRA adapters
    @property
    def adapters(self):
        """Names of the loaded adapters."""
        return sync.loaded_names(self._store)

    def load_adapter(self, name, path):
        """Load a peft LoRA adapter saved with save_pretrained (adapter_config.json +
        adapter_model.safetensors) under `name`. Usable at once: its device copy is made in the
        background and the CPU workers serve it until then."""
        if self._closed:
            raise GeneratorClosedError("load_adapter() called on a closed HeteroGenerator")
        lora_source.check_name(name, self._store.adapters if self._store else {})
        weights = lora_source.from_directory(name, path, self.model)
        with self._lock:
            self._refuse_nested("load_adapter")
            self._add_adapter(name, weights)

    def unload_adapter(self, name):
        """Remove adapter `name` from the workers and from shared memory."""
        self._adapter(name)
        with self._lock:
            self._refuse_nested("unload_adapter")
            self._store.remove(name)

    def _refuse_nested(self, what):
        self._calls.refuse_nested(what)

    @property
    def _busy(self):
        """A call of this generator is running (in this thread: a streamer calling back)."""
        return self._calls.busy

    def adapter_on_device(self, name):
        """True once `name`'s device copy is ready (before that its prefill runs on the CPU workers)."""
        return self._adapter(name).device is not None

    def _adapter(self, name):
        if self._store is None or name not in self._store.adapters:
            raise AdapterError(f"no adapter named {name!r} is loaded (loaded: {self.adapters})")
        return self._store.adapters[name]

    def _add_adapter(self, name, weights):
        if self._peft_model is None and lora_hooks.peft_layers(self.model, lora_only=True):
            raise AdapterError("the model holds peft LoRA layers but was not passed as its PeftModel (its "
                               "get_base_model()?): pass the PeftModel itself to serve adapters with it")
        if self._store is None:
            from hetero.adapters.store import AdapterStore

            store = AdapterStore(self.model.device, *lora_hooks.max_linear_dims(self.model))
            try:
                store.attach(self._ensure_pool())
            except BaseException:
                store.close()
                raise
            self._store = store
        self._store.add(name, weights)
        for path in weights:
            self._hooks.ensure(path, self._store.sites[path])

    def _check_model_state(self):
        """sync.check_model_state, then a PeftModel's adapters brought up to date
        (_sync_peft_adapters). Returns the model's peft layers, for the call's _default_adapter
        and _lora_batch."""
        layers = sync.check_model_state(self.model, self.spec)
        if self._peft_model is not None:
            self._sync_peft_adapters(layers)
        return layers

    def _sync_peft_adapters(self, layers):
        """A PeftModel's adapters as they are now: one whose LoRA weights or scaling changed since
        they were copied to shared memory (a training step, set_peft_model_state_dict) is copied
        again, one deleted from the PeftModel (delete_adapter) is unloaded here, as peft's own
        generate would see them. Contexts prefilled with the old copy then refuse to go on."""
        changed, now = sync.changed_adapters(self._peft_keys, layers)
        if not changed:
            return
        with self._lock:
            self._refuse_nested("a call after the PeftModel's adapters changed")
            for name in changed:
                if self._store is not None and name in self._store.adapters:
                    self._store.remove(name)
                del self._peft_keys[name]
                if name in now:
                    self._add_adapter(name, lora_source.from_peft_model(self._peft_model, name, self.model))
                    self._peft_keys[name] = now[name]

    def _default_adapter(self, layers):
        """What adapter_names=None runs (sync.default_adapter)."""
        return sync.default_adapter(self._peft_model, self.model, self._store, layers)

    def _lora_batch(self, adapter_names, batch, layers=None):
        """The call's LoraBatch (None: no adapters anywhere; sync.lora_batch)."""
        return sync.lora_batch(self._store, self._hooks, self._peft_model, self.model, adapter_names, batch, layers)

    def generate(self, input_ids=None, attention_mask=None, max_new_tokens=MODEL_DEFAULT, adapter_names=None, context=None,
                 extend_context=None, **kwargs):
        """transformers-style generate; returns a tensor of sequences, or a GenerateOutput when
        return_dict_in_generate=True. Left padding only. max_new_tokens omitted: as in transformers,
        the model's generation_config.max_new_tokens, else max_length (the call's, else the model's;
        the whole sequence), else 20; None, as there, sets the model's max_new_tokens aside.
        adapter_names: one loaded adapter name per request, or None / "__base__" for the base model
        (as peft's adapter_names); adapter_names=None: the base model, or a PeftModel's active
        adapter for every request (as its own generate).
        context: a Context from prefill(); input_ids [1, n] are then the new tokens after it, and
        the sequences returned start with the context's tokens (as if it had been the prompt).
        extend_context=False: the call reads the context and leaves it as it was (many questions
        over one document; a call longer than the context's reserve runs in an arena of its own,
        as context=[ctx]); by default the context grows by the call's tokens (a conversation).
        context=[ctx, ...]: one Context per request of input_ids [B, n] (left-padded new tokens);
        the call reads them and leaves them as they were. Requests continuing the same Context
        share its KV in place (HeteroConfig.share_contexts): decode reads it once per step for
        all of them. The sequences returned are left-padded [context tokens, new tokens, output].
        inputs= (transformers' name of its first argument) is taken for input_ids."""
        inputs = kwargs.pop("inputs", None)
        if inputs is not None:
            if input_ids is not None:
                raise TypeError("generate() got both input_ids and inputs; pass the prompt's token ids once")
            input_ids = inputs
        if input_ids is None:
            raise TypeError("generate() needs the prompt's token ids: input_ids (or inputs), a [batch, seq_len] tensor")
        # hetero's cache is closed with the call: the output does not hold it
        return without_cache(self._generate(input_ids, attention_mask, max_new_tokens, adapter_names, context,
                                             extend_context, kwargs))

    def _generate(self, input_ids, attention_mask, max_new_tokens, adapter_names, context, extend_context, kwargs):
        started = time.time()                  # max_time counts from here (see settings.generation_settings)
        if self._closed:
            raise GeneratorClosedError("generate() called on a closed HeteroGenerator")
        max_new_tokens, kwargs, model_new, max_length, from_max_length = resolve_lengths(
            self.model, max_new_tokens, kwargs)
        if attention_mask is None:
            attention_mask = inferred_mask(self.model, input_ids, kwargs, context, self)
        if extend_context is not None and not isinstance(extend_context, bool):
            raise TypeError(f"extend_context must be True, False or None, got {extend_context!r}")
        if extend_context is not None and context is None:
            raise ValueError("extend_context= needs context=")
        many = isinstance(context, (list, tuple))
        if context is not None and not many and not isinstance(context, Context):
            raise TypeError(f"context= takes a Context (from prefill or load_context) or a list of them, "
                            f"got {type(context).__name__}")
        if context is not None:
            if self.spec.one_pass_only:
                raise UnsupportedModelError(one_pass_only(self.spec, "continuing a context"))
            batch = input_ids.shape[0] if isinstance(input_ids, torch.Tensor) else None
            adapter_names = sync.context_adapters(self, self._store, self._peft_model,
                                                  list(context) if many else [context], adapter_names, batch)
        if many:
            self._contexts.check_contexts(self, context)
            if extend_context:
                raise ValueError("extend_context=True needs a single Context; a list of contexts is only read")
        if context is not None and max_new_tokens is None and (many or (isinstance(context, Context)
                                                                        and not context.closed)):
            ctxs = context if many else [context]       # HF's max_length counts the whole sequence
            real = [input_ids.shape[-1]] * len(ctxs) if attention_mask is None or attention_mask.ndim != 2 \
                else attention_mask.sum(-1).tolist()
            longest = max(len(c.tokens) + int(n) for c, n in zip(ctxs, real))
            max_new_tokens = default_new_tokens(self.model, self.spec, longest, model_new, max_length)
        attention_mask, max_new_tokens = check_inputs(self.model, self.spec, input_ids, attention_mask, max_new_tokens,
                                                      model_new=model_new, max_length=max_length)
        settings, call = generation_settings(self.model, None if from_max_length else max_new_tokens, kwargs, started)
        layers = self._check_model_state()
        if adapter_names is None and context is None:
            default = self._default_adapter(layers)
            adapter_names = None if default is None else [default] * input_ids.shape[0]
        lora = self._lora_batch(adapter_names, input_ids.shape[0], layers)
        single = context is not None and not many and input_ids.shape[0] == 1 and bool(attention_mask.all())
        read = list(context) if many else [context] if extend_context is False and single else None
        busy = self._calls.busy_elsewhere or self._engine.busy
        extend = single and extend_context is not False and (context.pooled or busy)   # extended in the engine
        # read where it lives: a context in the engine's pool, or prompts starting with one (reuse_contexts)
        pooled = any(c.pooled for c in read) if read is not None else \
            context is None and self.config.reuse_contexts and self._engine.continues_pooled(input_ids, attention_mask)
        if (context is None or read is not None or extend) and (lora is None or self._peft_model is None) and \
                not self._calls.busy_here and (busy or pooled or extend) \
                and (read is None or self._contexts.valid(self, read)) and \
                (not extend or self._contexts.valid(self, [context])):
            out = self._engine.generate(input_ids, attention_mask, max_new_tokens, settings, call, lora,
                                        [context] if extend else read, extend)
            if out is not None:                 # another call runs: this one joined the engine's batch
                return out
        if context is not None:
            if not many and extend_context is False and not context.closed and input_ids.shape[0] == 1 and \
                    bool(attention_mask.all()) and \
                    len(context.tokens) + input_ids.shape[1] + max_new_tokens - 1 > context.capacity:
                many, context = True, [context]          # a read-only call past its room: in an arena of its own
            if many:
                return self._generate_in_contexts(list(context), input_ids, attention_mask, max_new_tokens,
                                                  settings, call, lora)
            return self._generate_in_context(context, input_ids, attention_mask, max_new_tokens, call, lora,
                                             extend_context is not False)
        reuse = self._reusable(input_ids, attention_mask, max_new_tokens, settings) if lora is None else None
        if reuse is not None:                   # the prompts start with live contexts: continue them, read-only
            ctxs, rest, rest_mask = reuse
            if len(ctxs) == 1 and bool(attention_mask.all()):
                out = self._generate_in_context(ctxs[0], rest, rest_mask, max_new_tokens, call, None, extend=False)
            else:                               # as wide as input_ids: generate sees input_ids themselves
                out = self._generate_in_contexts(ctxs, rest, rest_mask, max_new_tokens, settings, call, None,
                                                 width=input_ids.shape[1])
            return out
        chunk = self._chunk(attention_mask)
        if not rope_ok(self.spec, input_ids.shape[1], max_new_tokens, (0,) if chunk else ()):
            raise rope_refused(self.spec)
        tmax = self._staged(chunk) or 1
        pads, real, cap = plan_cache(self.spec, self.config, attention_mask, max_new_tokens, tmax=tmax)
        with self.kv_context(pads, real, cap, lora=lora, tmax=tmax) as cache, torch.no_grad(), active(lora):
            if chunk:
                self.prefill_chunks(cache, input_ids, attention_mask, chunk)
            return self.model.generate(input_ids, attention_mask=attention_mask, **{GENERATE_CACHE_KWARG: cache}, **call)

    def _adapter_id(self, ctx):
        """A saved context's adapter record (AdapterStore.digest), or None (offload.saved)."""
        return None if sync.loaded(self._store, ctx.adapter) is None else self._store.digest(ctx.adapter)

    @contextlib.contextmanager
    def kv_context(self, pads, real_lens, cap, lora=None, tmax=1, prefix_groups=()):
        """Open a KV session (shared arena mapped in the workers) for len(pads) requests of `cap` rows,
        route the model's attention to it and yield its HeteroCache (`cache.session`). On exit the
        session is closed and the model's attention implementation restored, whatever happened.
        lora: the call's LoraBatch (its decode deltas then go through the session's transport).
        tmax: query tokens per step after the first forward (a chunked prefill's chunk).
        prefix_groups: [(a Context's session, the requests sharing its first blocks)] (KVSession)."""
        with self._exclusive(), self._call_session(pads, real_lens, cap, lora, tmax, prefix_groups) as cache:
            yield cache

    @contextlib.contextmanager
    def _call_session(self, pads, real_lens, cap, lora, tmax, prefix_groups=()):
        """kv_context's body, under the generator's lock."""
        pool = self._ensure_pool()
        session = KVSession(pool, self.spec, pads, real_lens, cap, planner=self._ensure_planner(pool), tmax=tmax,
                            prefix_groups=prefix_groups)
        try:
            with self._routed(session, lora) as cache:
                yield cache
        except WorkerError:
            try:
                session.close()  # first: a GPU may still post jobs until its stream is drained
            except WorkerError:
                pass
            self._drop_pool()
            raise
        finally:
            try:
                session.close()      # raises when a worker died or stalled unnoticed (holding no units)
            except WorkerError:
                self._drop_pool()
                raise

    def _exclusive(self):
        """The call lock (routing.CallLock.exclusive), for one call."""
        return self._calls.exclusive(self.model)

    def _routed(self, session, lora=None):
        """For one call: the model's attention routed to `session` (routing.routed)."""
        return routed(self.model, self.spec, self._hooks, session, lora, self._choose_transport)

    def _choose_transport(self, session, pool, lora=None):
        """A CUDA model's decode transport for `session` (routing.choose_transport)."""
        choose_transport(self.model, self.config.transport, session, pool, lora)

    def close(self):
        """Stop the workers and free every shared segment; restore the model's modules. Idempotent.
        Waits for a call running in another thread; calls in the engine's batch are aborted."""
        self._engine.close()                  # its loop takes the lock between steps: before taking it
        with self._lock:
            self._refuse_nested("close")
            self._close()

    def _close(self):
        self._closed = True
        self._finalizer.detach()
        _release(self.__dict__)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
