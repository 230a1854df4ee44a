"""HeteroGenerator: HF-style generate() with the KV cache and decode attention on CPU workers."""
import contextlib
import inspect
import logging
import os
import threading
import time
import weakref
from dataclasses import replace

import psutil
import torch

from hetero import attention
from hetero.adapters import hooks as lora_hooks, source as lora_source, sync
from hetero.adapters.sync import adapter_keys as _peft_adapter_keys  # noqa: F401 (re-exported: tests import it)
from hetero.compat import GENERATE_CACHE_KWARG, forward_cache_kwarg, without_cache
from hetero.config import HeteroConfig
from hetero.context import Context
from hetero.errors import AdapterError, CapacityError, GeneratorClosedError, UnsupportedModelError, WorkerError
from hetero.ipc import shm
from hetero.ipc.pool import WorkerPool
from hetero.model_spec import inspect_model
from hetero.cpu_attention.planner import ProfiledPlanner, StaticPlanner
from hetero.cpu_attention import kernel
from hetero.cpu_attention.simd import BK
from hetero.offload.arena import whole_blocks
from hetero.offload.registry import STALE, ContextRegistry, close_kept, closed_why
from hetero.offload.session import KVSession
from hetero.routing import CallLock, choose_transport, keeping_cache, routed
from hetero.routing import keeping_cache as _keeping_cache  # noqa: F401 (re-exported: tests import it)
from hetero.settings import (MODEL_DEFAULT, check_inputs, check_positions, default_new_tokens, generation_settings,
                             inferred_mask, one_pass_only, pad_id, resolve_lengths, rope_ok, rope_refused)
# re-exported: tests, benchmarks and callers import these from here
from hetero.settings import (DEFAULT_NEW_TOKENS, GC_FIELDS as _GC_FIELDS, PASS_THROUGH,  # noqa: F401
                             UNSUPPORTED_SETTINGS)

log = logging.getLogger("hetero")

DEFAULT_RESERVE = 1024   # KV rows a context keeps free for later calls, unless prefill(reserve=) says
CONTINUE_CHUNK = 256     # a context's continuations go to the workers in pieces of at most this many tokens
SHARED_IDLE_SPIN = 400   # ~10 us of polls before a CPU model's worker sleeps (atomics.sleep_until_changed)


class HeteroGenerator:
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

    @property
    def cpu_workers(self):
        return self._pool.n if self._pool else self.config.resolve_workers()[0]

    def _ensure_pool(self):
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

    def _chunk_size(self, attention_mask):
        """HeteroConfig.prefill_chunk for this prompt: an int, or None (one pass). "auto": one pass
        on a CPU model; on a GPU, one pass where the prompt's forward fits the device's free memory
        (what the caching allocator holds unused counts as free), else the longest chunk that fits
        (hetero.prefetch.policy.prefill_chunk)."""
        C = self.config.prefill_chunk
        if C != "auto":
            return C
        dev = self.model.device
        if dev.type != "cuda":
            return None
        from hetero.prefetch import policy

        free = torch.cuda.mem_get_info(dev)[0] + torch.cuda.memory_reserved(dev) - torch.cuda.memory_allocated(dev)
        B, S = attention_mask.shape
        return policy.prefill_chunk(self.model.config.get_text_config(), self.spec, B, S, free, self._eager,
                                    padded=not bool(attention_mask.all()))

    def _chunk(self, attention_mask):
        """The chunk size of a chunked prefill (_chunk_size), or None for one pass: the first forward
        covers the left pads and one chunk, so later chunks hold real tokens only."""
        C = self._chunk_size(attention_mask)
        if C is None:
            return None
        first = int((attention_mask.shape[1] - attention_mask.sum(1)).max()) + C
        if attention_mask.shape[1] <= first:
            return None
        if self.spec.one_pass_only:
            raise UnsupportedModelError(one_pass_only(self.spec, "a chunked prefill (HeteroConfig.prefill_chunk)"))
        return C

    def _staged(self, chunk):
        """Query tokens per step the workers' staging holds for a prompt prefilled in chunks of
        `chunk` (None: one pass): the chunk a set HeteroConfig.prefill_chunk gives; an "auto" chunk
        (fitted to GPU memory, its pieces attended on the GPU after a prefetch: _feed) only up to
        CONTINUE_CHUNK, since a staging sized to a long chunk grows the host arena by ~256 KiB per
        token at the Llama-3-8B shape (the workers, when they take a chunk, take it in pieces)."""
        if chunk and self.config.prefill_chunk == "auto":
            return min(chunk, CONTINUE_CHUNK)
        return chunk

    @property
    def _piece(self):
        """Tokens per forward when a context is continued (a set prefill_chunk, else CONTINUE_CHUNK)."""
        C = self.config.prefill_chunk
        return C if isinstance(C, int) else CONTINUE_CHUNK

    def prefill_chunks(self, cache, input_ids, attention_mask, chunk, to_end=False):
        """Run a prompt through the model into `cache` in chunks: the first forward (pads + one
        chunk) with the model's own attention, each later chunk of `chunk` tokens attending to the
        cached KV (on the CPU workers, or on the model's device after a layer-wise prefetch: see
        _feed). to_end: all of it; else the rest (at most one chunk) is left to generate's first
        forward, which continues the cache."""
        S = input_ids.shape[1]
        first = min(S, S - int(attention_mask.sum(1).min()) + chunk)      # the longest left pad + one chunk
        if first == S and not to_end:
            return
        self._forward(cache, input_ids, attention_mask, 0, first)
        self._feed(cache, input_ids, attention_mask, first, S, whole=to_end, piece=chunk)

    def _plan_cache(self, attention_mask, max_new_tokens, tmax=1, private=0, groups=0, what="max_new_tokens"):
        """what: the setting that asked for the max_new_tokens rows past the prompt (for messages):
        generate's new tokens (the last one's KV is never written) or a context's reserve."""
        real = attention_mask.sum(1).cpu()
        rows = int(real.max()) + max_new_tokens - (what != "reserve")
        cap = whole_blocks(rows)
        limit = self.config.max_cache_tokens
        if limit is not None and rows > limit:
            new = "reserved" if what == "reserve" else "new, the last one's never written"
            raise CapacityError(f"a request needs {rows} KV rows (prompt {int(real.max())} + {max_new_tokens} {new}) "
                                f"but the cache capacity is max_cache_tokens={limit}")
        s = self.spec
        layout = KVSession.layout_for(s, len(real), cap, tmax, private, groups)   # sliding layers: a ring of their window
        rings = f"; {layout.ring_layers} sliding layers keep {layout.ring} rows" if layout.ring_layers else ""
        what = (f"the KV cache for this batch needs {layout.nbytes / 2**30:.2f} GiB ({len(real)} requests x {cap} rows "
                f"x {s.layers} layers x 2 x {s.kv_heads} heads x {s.head_dim} x {s.dtype}{rings}; the rows are the "
                f"prompt's {int(real.max())} + {what}={max_new_tokens}, allocated up front: a smaller {what} needs less)")
        avail = psutil.virtual_memory().available
        if layout.nbytes > self.config.ram_fraction * avail:
            raise CapacityError(f"{what} but only {avail / 2**30:.2f} GiB of RAM is available "
                                f"(ram_fraction={self.config.ram_fraction})")
        shm_free = shm.free_bytes()     # a segment past the tmpfs's free space dies of SIGBUS on first touch
        if shm_free is not None and layout.nbytes > shm_free:
            raise CapacityError(f"{what} but the shared-memory filesystem {shm.SHM_DIR} has only "
                                f"{shm_free / 2**30:.2f} GiB free; enlarge it (docker run --shm-size=..., or "
                                f"mount -o remount,size=... {shm.SHM_DIR})")
        pads = attention_mask.shape[1] - real
        return pads.tolist(), real.tolist(), cap

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
        pads, real, cap = self._plan_cache(attention_mask, max_new_tokens, tmax=tmax)
        with self.kv_context(pads, real, cap, lora=lora, tmax=tmax) as cache, torch.no_grad(), _active(lora):
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

    # ---- contexts: a request's KV kept between calls
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
            reserve = self._default_reserve(input_ids.shape[1])
        self._contexts.sweep(self.config.context_memory)
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
        with self._context_session(attention_mask, reserve) as session:
            with self._routed(session, lora) as cache, torch.no_grad(), _active(lora):
                if chunk:                                # all chunks; the last one too
                    self.prefill_chunks(cache, input_ids, attention_mask, chunk, to_end=True)
                else:
                    self._forward(cache, input_ids, attention_mask, 0, input_ids.shape[1])
            session.end_call()
            adapter = lora.adapters[0] if lora is not None else None      # kept before the session is let go
            return self._contexts.keep(Context(self, session, input_ids[0].detach().to("cpu", torch.long).clone(), adapter))

    def _default_reserve(self, n):
        """prefill/load_context's default reserve for a context of n tokens: DEFAULT_RESERVE rows,
        within the model's max positions and HeteroConfig.max_cache_tokens."""
        rooms = [limit - n for limit in (self.spec.position_limit, self.config.max_cache_tokens) if limit is not None]
        return max(1, min([DEFAULT_RESERVE] + rooms))

    @contextlib.contextmanager
    def _context_session(self, attention_mask, reserve):
        """Under the generator's lock: a new context's session (one request, `reserve` rows free,
        continuations in pieces of prefill_chunk or CONTINUE_CHUNK tokens) within context_memory;
        closed again if the body raises (and a pool that died with it)."""
        tmax = min(self._piece, attention_mask.shape[1] + reserve)   # no piece outgrows the context's rows
        pads, real, cap = self._plan_cache(attention_mask, reserve, tmax=tmax, what="reserve")
        with self._exclusive():
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

    def _forget(self, ctx):
        """A closed Context's registry entry dropped (Context._close)."""
        self._contexts.forget(ctx.session)

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
        self._contexts.sweep(self.config.context_memory)
        header = saved.read_header(path)
        loaded = self._store.adapters if self._store is not None else {}
        name = saved.check_model(header, self.model, self.spec, path,
                                 lambda n: self._store.digest(loaded[n]) if n in loaded else None)
        n = header["length"]
        if reserve is None:
            reserve = self._default_reserve(n)
        # the token ids are checked against the vocabulary after the payload's CRC (fill), which covers
        # them: a corrupted id is named as the file's corruption, not as a bad prompt
        ids = torch.zeros(1, n, dtype=torch.long, device=self.model.device)
        mask, reserve = check_inputs(self.model, self.spec, ids, None, reserve, "reserve")
        with self._context_session(mask, reserve) as session:
            saved.fill(session, header, path)
            saved.check_vocabulary(header, getattr(self.model.get_input_embeddings(), "num_embeddings", None), path)
            tokens = torch.tensor(header["tokens"], dtype=torch.long)
            pending = torch.tensor(header["pending"], dtype=torch.long)
            session.finish_prefill()
            ctx = Context(self, session, tokens, loaded[name] if name is not None else None)
            ctx.pending = pending
            return self._contexts.keep(ctx)

    def _generate_in_context(self, ctx, input_ids, attention_mask, max_new_tokens, call, lora, extend=True):
        """generate() continuing `ctx`: [cached tokens, the last call's unstored token, new tokens].
        extend=False: afterwards the context is as before (its length restored; the rows the call
        appended lie past it and are overwritten later, except in sliding-window rings, which a
        call may wrap: those are saved before and put back)."""
        if ctx.generator is not self or ctx.closed:
            raise ValueError("context= takes an open Context from this generator's prefill()" + closed_why(ctx))
        if input_ids.shape[0] != 1:
            raise ValueError(f"a context continues one request: input_ids must be [1, n], got {tuple(input_ids.shape)}")
        if not bool(attention_mask.all()):
            raise ValueError("the new tokens of a context cannot be padded (attention_mask all ones)")
        with self._exclusive():
            if ctx.closed:
                raise ValueError("context= takes an open Context from this generator's prefill()" + closed_why(ctx))
            if self._contexts.stale(ctx.session):
                raise ValueError(STALE)
            full = torch.cat([ctx.token_ids, ctx.pending, input_ids[0].to("cpu")]).to(self.model.device)[None]
            session, cached = ctx.session, ctx.length                    # full: [1, S]
            if not rope_ok(self.spec, full.shape[1], max_new_tokens, (cached,), keeps=extend):
                raise rope_refused(self.spec)
            need = full.shape[1] + max_new_tokens - 1           # KV rows once the last new token is chosen
            if need > session.layout.cap:
                raise CapacityError(f"the context holds {cached} tokens and this call adds {full.shape[1] - cached} "
                                    f"+ {max_new_tokens} new: {need} rows, but it was prefilled with room for "
                                    f"{session.layout.cap} (prefill(..., reserve=...))")
            check_positions(self.spec, full.shape[1], max_new_tokens)
            pool = self._ensure_pool()
            session.begin_call(pool, self._ensure_planner(pool))
            rings = None if extend or not session.layout.ring_layers else (session.Kr.clone(), session.Vr.clone())
            err = None
            try:
                with self._routed(session, lora) as cache, torch.no_grad(), _active(lora):
                    for layer in cache.layers:
                        layer.seen = cached
                    mask = torch.ones_like(full)
                    self._feed(cache, full, mask, cached, full.shape[1])     # generate's first forward: the rest
                    out = self.model.generate(full, attention_mask=mask, **{GENERATE_CACHE_KWARG: cache}, **call)
            except BaseException as e:
                err = e
            try:
                session.end_call(check=err is None)          # a GPU's last step settled, its page locks freed
            except BaseException as e:                       # Ctrl-C too: the context is put back below
                err = err or e
            if not extend:
                session.rewind(cached, rings)
            elif err is not None:
                self._recover(ctx, cached)
            if isinstance(err, WorkerError) and self._pool is not None:
                self._drop_pool()                            # the context stays; the next call maps it again
            if err is not None:
                raise err
            # still under the lock: a close() waiting in another thread must find the call complete
            if extend:
                seq = out if isinstance(out, torch.Tensor) else out.sequences
                stored = int(session.lengths[0])
                ctx.token_ids, ctx.pending = seq[0, :stored].to("cpu"), seq[0, stored:].to("cpu")
            self._contexts.used(ctx)
        return out

    def _feed(self, cache, ids, mask, a, end, whole=False, piece=None):
        """Forward positions [a, end) of ids into a prefilled session's cache, each piece attending
        to the cached KV: on the CPU workers in pieces of at most the session's tmax tokens
        (generate's first forward then takes the last piece), or, when HeteroConfig.continuation /
        the policy prefers it, on the model's device over KV prefetched layer by layer
        (hetero.prefetch; generate's first forward takes the last token) in pieces of up to
        `piece` tokens (no staging holds them; a sliding window's ring holds only tmax new rows,
        so with ring layers, tmax). whole: feed everything."""
        session = cache.session
        tmax = session.layout.tmax
        n = end - a
        if n <= 0:
            return
        if not whole and n == 1:
            return                                       # generate's first forward takes it
        big = max(piece or 0, tmax) if session.layout.ring_layers == 0 else tmax
        prefetch = session.batch == 1 and self._continuation(session, int(session.lengths[0]), min(n, big)) == "prefetch"
        stop = end if whole else end - (1 if prefetch else (n - 1) % tmax + 1)
        if stop <= a:
            return
        if not prefetch:
            for p in range(a, stop, tmax):
                self._forward(cache, ids, mask, p, min(p + tmax, stop))
            return
        from hetero.prefetch.schedule import LayerPrefetcher

        pre = LayerPrefetcher(session, self.model.device)
        started = time.perf_counter()
        try:
            for p in range(a, stop, big):
                session.prefetcher = pre
                pre.start()
                self._forward(cache, ids, mask, p, min(p + big, stop))
                log.info("hetero: tokens %d-%d of %d attended over the prefetched cache (%.1f s)", p,
                         min(p + big, stop), stop, time.perf_counter() - started)     # long prompts' progress
        except BaseException:
            session.prefetcher = None
            try:
                pre.close()
            except BaseException:
                pass                                     # the forward's own error is the one to raise
            raise
        session.prefetcher = None
        pre.close()
        self.last_prefetch_log, self.last_prefetch_plan = pre.log, pre.planned    # for tests and benchmarks

    def _continuation(self, session, L, T):
        """HeteroConfig.continuation for T new tokens over L cached rows ("auto": hetero.prefetch.policy)."""
        want = self.config.continuation
        if want != "auto":
            return want
        from hetero.prefetch import policy

        profile = getattr(self._planner, "profile", None)
        if profile is None or self.model.device.type != "cuda":
            return "workers"                             # see policy.choose
        if self._rates is None:
            self._rates = policy.measure(self.model.device, self.spec)
        return policy.choose(profile, self._rates, self.spec, L, T, self._pool.n)

    def _recover(self, ctx, cached):
        """A call that extends ctx failed midway: some of its rows may be cached. Without sliding
        -window rings, or before any KV update (a setting transformers refuses as it starts), back
        to the `cached` rows the context had (later rows are overwritten by the next call); a ring
        may have been wrapped over rows the context still needs, so such a context is closed
        (using it again raises), rather than left silently wrong."""
        if ctx.session.layout.ring_layers == 0 or not ctx.session.touched:
            ctx.session.rewind(cached)
        else:
            ctx._close()

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

    def _generate_in_contexts(self, contexts, input_ids, attention_mask, max_new_tokens, settings, call, lora,
                              width=0):
        """generate() for a batch whose request b continues contexts[b] (read, not changed): the
        requests continuing one context form a shared-prefix group that reads the context's
        whole blocks in place (KVSession prefix_groups; not a context with sliding-window rings,
        nor with share_contexts=False); the call's own session holds
        each request's rows past them (pstart), copied from its context (all of them for a
        request in no group). Request b's sequence is [its context's tokens (pending ones too),
        its new tokens], left-padded to the longest (or to `width`); the steps that feed them count, per
        request, the tokens that are not its own (session.skip)."""
        B = input_ids.shape[0]
        if len(contexts) != B:
            raise ValueError(f"context= has {len(contexts)} contexts for a batch of {B} requests")
        with self._exclusive():
            self._contexts.check_contexts(self, contexts)
            new = [input_ids[b, attention_mask[b].bool()].to("cpu") for b in range(B)]      # real new tokens
            seqs = [torch.cat([c.token_ids, c.pending, n]) for c, n in zip(contexts, new)]
            cached = [c.length for c in contexts]
            S = max(width, max(len(q) for q in seqs))
            pad = pad_id(settings)
            full = torch.full((B, S), pad, dtype=torch.long)                     # [B, S], left-padded
            mask = torch.zeros(B, S, dtype=torch.long)
            for b, q in enumerate(seqs):
                full[b, S - len(q):], mask[b, S - len(q):] = q, 1
            check_positions(self.spec, max(len(q) for q in seqs), max_new_tokens)     # each row's own positions
            if not rope_ok(self.spec, S, max_new_tokens, cached):
                raise rope_refused(self.spec)
            uncached = [len(q) - n for q, n in zip(seqs, cached)]
            U = max(uncached)
            rows = S + max_new_tokens           # no window can hide a row from a query below it
            share = self.config.share_contexts and all(w == 0 or w >= rows for w in self.spec.windows or ())
            groups = {}                                          # id(context) -> (its session, members)
            for b, c in enumerate(contexts):
                if share and cached[b] >= BK and c.session.layout.ring_layers == 0:
                    groups.setdefault(id(c.session), (c.session, []))[1].append(b)
            # at most MAX_GROUPS read in place, the largest; the other requests copy their contexts
            groups = sorted(groups.values(), key=lambda g: -len(g[1]))[:kernel.MAX_GROUPS]
            pstart = [0] * B
            for src, members in groups:
                for b in members:
                    pstart[b] = int(src.lengths[0]) // BK * BK
            tmax = min(self._piece, U)                              # the staging holds one step's tokens
            pads, _, cap = self._plan_cache(mask, max_new_tokens, tmax=tmax,
                                            private=whole_blocks(rows) - min(pstart) if groups else 0,
                                            groups=len(groups))
            full, mask = full.to(self.model.device), mask.to(self.model.device)
            for c in contexts:
                self._contexts.used(c)
            with self._call_session(pads, cached, cap, lora, tmax, groups) as cache, torch.no_grad(), \
                    _active(lora):
                session = cache.session
                for b, c in enumerate(contexts):                    # rows past the shared prefix
                    src = c.session
                    for layer in range(self.spec.layers):
                        window = session.ring_window[layer]
                        start = max(0, cached[b] - window + 1) // BK * BK if window else pstart[b]
                        src_window = src.ring_window[layer]       # the source may keep fewer rows (a ring)
                        if src_window:
                            start = max(start, max(0, cached[b] - src_window + 1) // BK * BK)
                        k, v = src.read_rows(layer, 0, cached[b], start)
                        session.write_rows(layer, b, k, v, start)
                session.finish_prefill()                           # lengths = cached
                session.skip[:] = [U - u for u in uncached]        # the first U - u_b tokens fed are b's cached ones or pads
                for layer in cache.layers:
                    layer.seen = S - U
                a = S - U
                while S - a > tmax:                                # continue in pieces of at most tmax tokens
                    self._forward(cache, full, mask, a, a + tmax)
                    a += tmax
                return self.model.generate(full, attention_mask=mask, **{GENERATE_CACHE_KWARG: cache}, **call)

    def _forward(self, cache, input_ids, attention_mask, a, b):
        """The model over positions [a, b) of input_ids into `cache` (no logits kept but the last)."""
        if self._forward_params is None:
            self._forward_params = set(inspect.signature(self.model.forward).parameters)
            self._cache_kwarg = forward_cache_kwarg(self.model.forward)
        kw = {"logits_to_keep": 1} if "logits_to_keep" in self._forward_params else {}
        if "position_ids" in self._forward_params:          # as generate: only where forward takes them
            pos = attention_mask.long().cumsum(-1) - 1
            kw["position_ids"] = pos.masked_fill_(attention_mask == 0, 1)[:, a:b]
        self.model(input_ids=input_ids[:, a:b], attention_mask=attention_mask[:, :b], **{self._cache_kwarg: cache},
                   use_cache=True, cache_position=torch.arange(a, b, device=input_ids.device), **kw)

    def close(self):
        """Stop the workers and free every shared segment; restore the model's modules. Idempotent.
        Waits for a call running in another thread."""
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


def _release(state):
    """What close() frees, from a HeteroGenerator's attributes (also its finalizer's, when it is
    collected without close()): its contexts, hooks, adapters, workers, and the cores its thread
    was pinned away from. Every step runs; the first error other than a worker's (the contexts
    are closed whatever their workers did) is raised after them."""
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


@contextlib.contextmanager
def _active(lora_batch):
    token = lora_hooks.active_batch.set(lora_batch)
    try:
        yield
    finally:
        lora_hooks.active_batch.reset(token)
