"""The engine: requests in, tokens streamed out, one step loop over one paged KV pool.

    engine = Engine(model)                       # or Engine(model, EngineConfig(...), tokenizer=tok)
    stream = engine.add_request(prompt_ids, max_new_tokens=64, temperature=0.7, do_sample=True, seed=1)
    for token in stream: ...                     # from any thread; `async for` in an event loop
    engine.close()

Callers in any thread add and abort requests; their calls go into an inbox that the step drains,
so one thread alone, the engine's, touches the model, the pool and the
scheduler. `step()` runs one step in the calling thread (tests, benchmarks); `start()` runs
steps in a background thread whenever there is work (add_request starts it on first use
unless `EngineConfig.background=False`).

One step:
    inbox -> scheduler (add, abort)
    plan = scheduler.schedule(limit)     which requests, how many tokens each (chunked prefill beside decode, paced)
    logits = runner.execute(plan)        one forward (hetero.engine.runner)
    tokens = sampler.sample(...)         each request's processors and generator (hetero.engine.sampler)
    scheduler.update(plan, tokens)       append, stop, cache and free blocks; streams get their tokens

  state                         written by                  read by
  _inbox                        callers (under _lock)       the engine thread (step)
  scheduler, kv, pool, model    the engine thread           the engine thread
  RequestStream (tokens, end)   the engine thread (_push)   callers (under the stream's condition)
"""
from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
from collections import deque

import torch

from hetero import attention
from hetero.config import HeteroConfig
from hetero.cpu_attention.planner import StaticPlanner
from hetero.engine import sampler as sampling
from hetero.engine.kv_hybrid import HybridKVCacheManager
from hetero.engine.kv_pool import BLOCK_SIZE, BlockPool, KVCacheManager
from hetero.engine.config import EngineConfig
from hetero.engine.documents import Documents
from hetero.engine.pacing import Pacer
from hetero.engine.paged import PagedKV, pool_sizes
from hetero.engine.request import Request, RequestStatus
from hetero.engine.runner import ModelRunner
from hetero.engine.scheduler import RankAwarePolicy, Scheduler, SchedulerConfig, is_decoding
from hetero.engine.stream import RequestStream
from hetero.adapters import sync
from hetero.engine.adapters import EngineAdapters
from hetero.errors import AdapterError, CapacityError, EngineError, UnsupportedModelError
from hetero.ipc.pool import WorkerPool
from hetero.model_spec import inspect_model
from hetero.settings import MODEL_DEFAULT, as_int, generation_settings, resolve_lengths

log = logging.getLogger("hetero")

DEFAULT_MAX_MODEL_LEN = 32768     # tokens per request when the model states no limit
STALLED_STEPS = 10_000            # steps in a row that compute nothing with requests unfinished: they fail


class Engine(Documents):
    """Continuous batching of requests over `model` (a transformers causal LM, see the module doc)."""

    def __init__(self, model, config: EngineConfig | None = None, *, tokenizer=None, adapters: dict | None = None,
                 pool: WorkerPool | None = None, planner=None, step_guard=None, lora=None):
        """model: a transformers causal LM, or a peft PeftModel (its adapters are served by name).
        adapters: {name: a peft LoRA adapter's save_pretrained directory}, served by name
        (add_request(adapter=name)). pool/planner: a worker pool (and its planner) to run on
        instead of starting one; the engine then shares it (a HeteroGenerator's: step_guard, a
        context manager factory, is entered around every step, e.g. the generator's call lock; the
        model's attention implementation is set to hetero's for each step only; lora, a callable
        giving the generator's (AdapterStore, LoraHooks), serves its adapters)."""
        self.config = config = config or EngineConfig()
        if not isinstance(config, EngineConfig):
            raise TypeError(f"config must be an EngineConfig, got {type(config).__name__}")
        if adapters is not None and not isinstance(adapters, dict):
            raise TypeError(f"adapters= takes {{name: save_pretrained directory}}, got {type(adapters).__name__}")
        peft_model = model if sync.is_peft_model(model) else None
        if peft_model is not None:
            model = peft_model.get_base_model()
        self.model, self.tokenizer = model, tokenizer
        self.spec = spec = inspect_model(model)
        if spec.one_pass_only:
            raise UnsupportedModelError(f"the engine computes prompts in chunks over cached KV: {spec.one_pass_only}")
        # the positions a request may reach: a learned or length-dependent position scheme's limit; for
        # LongRoPE the switch to its long factors, which transformers makes for a whole forward by its
        # longest position (in a packed step, another request's)
        limits = [x for x in (spec.position_limit, spec.rope_switch) if x is not None]
        default = getattr(model.config.get_text_config(), "max_position_embeddings", None) or DEFAULT_MAX_MODEL_LEN
        self.max_model_len = config.max_model_len or min(limits + [default])
        if limits and self.max_model_len > min(limits):
            why = "LongRoPE switches factors" if min(limits) == spec.rope_switch else "the model's positions end"
            raise ValueError(f"EngineConfig.max_model_len={self.max_model_len} is past {min(limits)} tokens, where "
                             f"{why}; the engine serves requests up to there")
        w = spec.windows
        self.window = max(w, default=0)                 # the windowed layers' (mixed models: the largest)
        uniform = bool(w) and all(x == w[0] for x in w)   # every layer one window: one pool, a ring
        num_blocks, ring_blocks = pool_sizes(config, spec, self.max_model_len, self.window,
                                             hybrid=self.window > 0 and not uniform)
        if config.max_model_len is None and not (uniform and self.window):   # the model's, at most the pool's rows
            self.max_model_len = min(self.max_model_len, num_blocks * BLOCK_SIZE)   # (vLLM's rule; a ring: any)
        self._own_pool = pool is None
        if pool is None:
            n, cores = HeteroConfig(cpu_workers=config.cpu_workers).resolve_workers()
            pool = WorkerPool(n, cores, job_timeout=config.worker_timeout,
                              idle_spin=400 if model.device.type == "cpu" else None)
        self.pool = pool
        self.kv = self._adapters = None
        self._step_guard = step_guard or contextlib.nullcontext
        self._step_lock = threading.RLock()   # held through a step; adapter loads and close() wait for it
        try:
            ring = self.window if uniform else 0
            table = -(-self.max_model_len // BLOCK_SIZE)     # a table's entries (under a ring, the -1s too)
            self.kv = PagedKV(pool, spec, num_blocks, table if self.window else min(table, num_blocks),
                              config.max_num_seqs, planner=planner or StaticPlanner(pool.n), ring_blocks=ring_blocks)
            if model.device.type == "cuda":
                self.kv.use_gpu(model.device, config.transport)
                self.kv.lock_pages(model.device)     # prompt rows go into the pool as DMAs
            if ring_blocks:                   # windowed and full layers: a pool each (Gemma 2/3, gpt-oss, ...)
                self.kv_manager = HybridKVCacheManager(BlockPool(num_blocks), BlockPool(ring_blocks), self.window)
            else:
                self.kv_manager = KVCacheManager(BlockPool(num_blocks), window=ring)
            if lora is None:
                self._adapters = EngineAdapters(model, pool)
                if peft_model is not None:
                    self._adapters.from_peft(peft_model)
                for name, path in (adapters or {}).items():
                    self._adapters.load(name, path)
                lora = self._adapters.lora
            self._lora = lora
            policy = config.policy
            if isinstance(policy, RankAwarePolicy) and policy.rank_of is None:
                policy.rank_of = self.adapter_rank
            self.scheduler = Scheduler(SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens,
                                                       config.long_prefill_chunk, policy), self.kv_manager)
            self.runner = ModelRunner(model, spec, self.kv, getattr(self.kv_manager, "full", self.kv_manager).pool,
                                     lora=lora, stage_memory=config.prefill_stage_memory,
                                     prefix_memory=config.prefix_rows_memory)
        except BaseException:
            self._release(guard=False)        # the caller holds the pool (a generator's lock) while it builds one
            raise
        attention.register()
        self._previous_attn = None
        if self._own_pool:                    # the model is the engine's: routed to hetero once
            self._previous_attn = model.config._attn_implementation
            model.set_attn_implementation(attention.NAME)
        self._samplers: dict[str, sampling.RequestSampler] = {}
        self._streams: dict[str, RequestStream] = {}
        self._inbox: deque = deque()
        self._lock = threading.Condition()
        self._ids = itertools.count()
        self._stalled = 0                     # steps in a row that computed nothing with requests unfinished
        self._thread: threading.Thread | None = None
        self._closed = False
        self.failure: BaseException | None = None
        self.steps = 0
        self.pacer = Pacer(config.step_time_target)    # prompt chunks sized to the step time target

    # ---- callers (any thread)
    def add_request(self, prompt, max_new_tokens=MODEL_DEFAULT, *, request_id: str | None = None,
                    seed: int | None = None, adapter: str | None = None, ignore_eos: bool = False,
                    **generate_kwargs) -> RequestStream:
        """Queue a request: prompt token ids (a list, or a [1, n] / [n] tensor) and generate's
        settings (max_new_tokens, do_sample, temperature, top_k, top_p, repetition_penalty,
        eos_token_id, stop_strings with tokenizer, logits_processor, stopping_criteria, ...).
        seed: the request's own torch.Generator when it samples (None: torch's global one).
        ignore_eos: generate max_new_tokens whatever the tokens (benchmarks, as vLLM's)."""
        ids = self._checked_prompt(prompt)
        if generate_kwargs.get("streamer") is not None:
            raise ValueError("streamer= is generate's: iterate over the RequestStream add_request returns")
        generate_kwargs.pop("streamer", None)
        tokenizer = generate_kwargs.pop("tokenizer", self.tokenizer)
        lp, sc = generate_kwargs.pop("logits_processor", None), generate_kwargs.pop("stopping_criteria", None)
        keep_scores = bool(generate_kwargs.pop("output_scores", False))    # the stream's, not a generate output
        if max_new_tokens is not MODEL_DEFAULT and max_new_tokens is not None:
            max_new_tokens = as_int(max_new_tokens)
            if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int):
                raise TypeError(f"max_new_tokens must be an integer, got {max_new_tokens!r}")
        new, kwargs, model_new, max_length, _ = resolve_lengths(self.model, max_new_tokens, generate_kwargs)
        settings, _ = generation_settings(self.model, new, kwargs, started=time.time())
        if new is None:
            total = settings.max_length if settings.max_length is not None else len(ids) + 20
            new = max(total - len(ids), 0)
        if new < 1:
            raise ValueError(f"max_new_tokens must be >= 1 (the prompt has {len(ids)} tokens), got {new}")
        return self.submit(ids, settings, new, logits_processor=lp, stopping_criteria=sc, tokenizer=tokenizer,
                           seed=seed, request_id=request_id, ignore_eos=ignore_eos, keep_scores=keep_scores,
                           adapter=adapter)

    def submit(self, ids: list[int], settings, max_new_tokens: int, *, logits_processor=None, stopping_criteria=None,
               tokenizer=None, seed: int | None = None, request_id: str | None = None, ignore_eos: bool = False,
               keep_scores: bool = False, adapter: str | None = None) -> RequestStream:
        """add_request's second half: a request whose settings are resolved already (a GenerationConfig as
        hetero.settings.generation_settings gives it; prompt ids checked)."""
        self._check_open()
        if self.failure is not None:
            raise EngineError(f"the engine failed: {self.failure}") from self.failure
        if len(ids) + max_new_tokens > self.max_model_len:
            raise CapacityError(f"prompt of {len(ids)} tokens + max_new_tokens={max_new_tokens} is past the engine's "
                                f"max_model_len={self.max_model_len}")
        if adapter is not None and adapter not in self.adapters:
            raise AdapterError(f"no adapter named {adapter!r} is loaded (loaded: {self.adapters})")
        s = sampling.build(self.model, ids, settings, max_new_tokens, logits_processor=logits_processor,
                           stopping_criteria=stopping_criteria, tokenizer=tokenizer, seed=seed)
        s.keep_scores = keep_scores
        rid = request_id if request_id is not None else self._new_id("req")
        req = Request(rid, ids, max_new_tokens, eos_token_ids=set() if ignore_eos else s.eos, params=settings,
                      adapter=adapter, adapter_key=self.adapter_key(adapter))
        why = self.kv_manager.shortfall(req, self.scheduler.chunk, pins=False)
        if why is not None:
            raise CapacityError(f"request {rid!r} needs {why} (EngineConfig.kv_blocks / kv_memory)")
        stream = RequestStream(self, rid, len(ids))
        stream.pad_token_id = s.pad
        if s.keep_scores:
            stream.scores = s.scores
        return self._queue(req, s, stream)

    def _checked_prompt(self, prompt) -> list[int]:
        ids = _token_list(prompt)
        vocab = self.model.config.get_text_config().vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        return ids

    def _new_id(self, prefix: str) -> str:
        """A request id no live request has (a caller may have chosen "req-3" itself)."""
        with self._lock:
            while True:
                rid = f"{prefix}-{next(self._ids)}"
                if not self._in_use(rid):
                    return rid

    def _in_use(self, rid: str) -> bool:
        """Under _lock: a live request's id (queued, or known to the engine thread)."""
        return rid in self._streams or any(x[0] == "add" and x[1].request_id == rid for x in self._inbox)

    def _queue(self, req: Request, s, stream: RequestStream) -> RequestStream:
        self._check_open()
        if self.failure is not None:
            raise EngineError(f"the engine failed: {self.failure}") from self.failure
        rid = req.request_id
        with self._lock:
            if self._in_use(rid):
                raise ValueError(f"request id {rid!r} is already in use")
            self._inbox.append(("add", req, s, stream))
            self._lock.notify_all()
        if self.config.background:
            self.start()
        return stream

    def _post(self, item) -> None:
        """An item for the engine thread's inbox (drained at the next step)."""
        with self._lock:
            self._inbox.append(item)
            self._lock.notify_all()
        if self.config.background:
            self.start()
        else:
            self._drain_inbox()

    # ---- adapters
    @property
    def adapters(self) -> list[str]:
        """Names of the LoRA adapters requests may name."""
        store, _ = self._lora()
        return sorted(store.adapters) if store is not None else []

    def adapter_rank(self, name: str | None) -> int:
        """An adapter's rank (its largest over the layers it adapts; 0: the base model)."""
        store, _ = self._lora()
        if name is None or store is None or name not in store.adapters:
            return 0
        return max(e[3] for e in store.adapters[name].entries.values())

    def load_adapter(self, name: str, path) -> None:
        """Serve a peft LoRA adapter saved with save_pretrained under `name` (between two steps)."""
        self._own_adapters("load_adapter").load_in_turn(name, path, self._in_turn)

    def unload_adapter(self, name: str) -> None:
        """Stop serving `name`: requests still naming it fail (AdapterError) at the next step. The
        KV computed under it is never found by requests naming an adapter loaded later as `name`."""
        self._own_adapters("unload_adapter").remove_in_turn(name, self._in_turn)

    def adapter_key(self, name: str | None) -> str | None:
        """What the prefix cache's block hashes take for adapter `name`: the name and the slot of
        the adapter loaded under it now (each load takes a new slot, never reused: an adapter
        reloaded under a name, with other weights, hashes apart)."""
        store, _ = self._lora()
        a = store.adapters.get(name) if name is not None and store is not None else None
        return name if a is None else f"{name}\x00{a.slot}"

    def _own_adapters(self, what):
        if self._adapters is None:
            raise RuntimeError(f"{what}: this engine serves its HeteroGenerator's adapters; use the generator's")
        self._check_open()
        return self._adapters

    @contextlib.contextmanager
    def _in_turn(self):
        """Between two steps, holding what a step holds (the pool is free)."""
        with self._step_lock, self._step_guard():
            yield

    def abort(self, request_id: str) -> None:
        """Finish a request now (its stream ends with finish_reason "abort"); its blocks are freed
        at the next step. Unknown or finished ids are ignored."""
        with self._lock:
            self._inbox.append(("abort", request_id))
            self._lock.notify_all()

    def generate(self, prompts, max_new_tokens=MODEL_DEFAULT, **kwargs) -> list[list[int]]:
        """Every prompt as its own request (they batch continuously); their output token ids."""
        streams = [self.add_request(p, max_new_tokens, **kwargs) for p in prompts]
        return [s.result() for s in streams]

    def reset_prefix_cache(self) -> int:
        """Forget the cached blocks no request holds (the next requests start cold); the engine
        thread's, or between steps. Returns how many blocks were freed."""
        with self._lock:
            return self.kv_manager.clear_cache()

    @property
    def has_unfinished(self) -> bool:
        with self._lock:
            return bool(self._inbox) or self.scheduler.has_unfinished

    # ---- the engine thread
    def step(self) -> int:
        """One step: admit and abort what callers queued, schedule, one forward, sample, update.
        Returns the number of tokens computed (0: nothing to do)."""
        with self._step_lock, self._step_guard(), self._routed():
            return 0 if self._closed else self._step()

    @contextlib.contextmanager
    def _routed(self):
        """The model's attention is hetero's for the step (once and for all when the engine owns it)."""
        previous = self.model.config._attn_implementation
        if previous == attention.NAME:
            yield
            return
        self.model.set_attn_implementation(attention.NAME)
        try:
            yield
        finally:
            self.model.set_attn_implementation(previous)

    def _step(self) -> int:
        self._drain_inbox()
        if not self._model_as_built():
            return 0
        store, _ = self._lora()
        for r in [r for r in self.scheduler.requests.values() if r.adapter is not None]:
            if store is None or r.adapter not in store.adapters or self.adapter_key(r.adapter) != r.adapter_key:
                self.scheduler.abort(r.request_id)              # unloaded (or reloaded) since it was added
                self._fail(r.request_id, AdapterError(
                    f"adapter {r.adapter!r} was unloaded (or reloaded with other weights) while the request ran"))
        start = time.perf_counter()
        plan = self.scheduler.schedule(self.pacer.limit(sum(map(is_decoding, self.scheduler.running))))
        for r, why in plan.refused:               # the pins took its room since it was added
            self._fail(r.request_id, CapacityError(f"request {r.request_id!r} needs {r.max_rows} KV rows: {why}"))
        if plan.empty:
            self._stalled = self._stalled + 1 if self.scheduler.has_unfinished else 0
            if self._stalled >= STALLED_STEPS:    # never seen: a scheduler bug must not hang its callers
                self._stalled = 0
                self._fail_all(EngineError(f"the scheduler computed nothing for {STALLED_STEPS} steps with "
                                           f"{len(self.scheduler.requests)} requests unfinished"))
            return 0
        self._stalled = 0
        decode = sum(is_decoding(s.request) for s in plan.scheduled)
        try:
            logits = self._execute(plan)
            rows = [s.request for s in plan.scheduled if s.samples]
            tokens, stopped, errors = sampling.sample([self._samplers[r.request_id] for r in rows], logits)
        except BaseException as e:
            self._fail_all(e)
            raise
        for r, err in zip(rows, errors):          # a request's own processor or criterion raised: it alone fails
            if err is not None:
                self.scheduler.abort(r.request_id)
                self._fail(r.request_id, err, own=True)
        sampled = {r.request_id: t for r, t, err in zip(rows, tokens, errors) if err is None}
        stops = {r.request_id for r, st in zip(rows, stopped) if st}
        rows = [r for r in rows if r.request_id in sampled]
        finished = self.scheduler.update(plan, sampled, stops)
        done = {r.request_id for r in finished}
        for r in rows:
            if r.request_id not in done:
                stream = self._streams[r.request_id]
                stream.cached_tokens = r.num_cached_tokens
                stream._push([sampled[r.request_id]])
        for r in finished:
            last = [sampled[r.request_id]] if r.request_id in sampled else []
            self._end(r, last)
        self.steps += 1
        self.pacer.record(time.perf_counter() - start, plan.num_tokens - decode, decode)
        return plan.num_tokens

    def _model_as_built(self) -> bool:
        """Whether the model may run this step (sync.check_model_state: its dtype the engine's, not
        training with dropout, no peft adapter merged into its weights); if not, every request fails
        with why (the engine goes on: undo it and add them again). peft LoRA layers added to the
        model since (a PeftModel's add_adapter) run their base layer alone in steps with adapters,
        as in a generator's calls: each request gets the adapter it names and no other."""
        try:
            layers = sync.check_model_state(self.model, self.spec, owner="Engine")
        except (AdapterError, ValueError) as e:
            self._fail_all(e)
            return False
        _, hooks = self._lora()
        if layers and hooks is not None:
            hooks.route_peft_layers()
        return True

    def _execute(self, plan):
        """runner.execute; out of memory once (the model's device, a GPU shared with others): the rows
        the runner keeps on the device are dropped, its budgets for them halved, and the step runs
        again (no request sampled yet: its rows are rewritten with the same values)."""
        try:
            return self.runner.execute(plan)
        except torch.OutOfMemoryError as e:
            stage, rows = self.runner.shrink()
            if self.runner.device.type == "cuda":
                torch.cuda.empty_cache()
            log.warning("hetero: a step ran out of memory (%s); running it again with the device's kept rows "
                        "dropped and their budgets halved (stage %d MiB, prefix rows %d MiB)", str(e).split("\n")[0],
                        stage >> 20, rows >> 20)
        return self.runner.execute(plan)

    def _drain_inbox(self):
        with self._lock:
            items, self._inbox = list(self._inbox), deque()
            for item in items:                  # known from here on (_in_use): no window for a twin id
                if item[0] == "add":
                    self._streams[item[1].request_id] = item[3]
        for item in items:
            if item[0] == "add":
                _, req, s, stream = item
                try:
                    self.scheduler.add(req)
                except Exception as e:          # the pool's pinned blocks leave no room for it
                    self._streams.pop(req.request_id, None)
                    stream._push([], error=e)
                    continue
                except BaseException:
                    self._streams.pop(req.request_id, None)
                    raise
                self._samplers[req.request_id] = s
            elif item[0] == "unpin":
                self._unpin(item[1])
            elif item[0] in ("load", "copy"):
                self._take_document(item)
            else:
                r = self.scheduler.abort(item[1])
                if r is not None:
                    self._end(r, [])

    def _end(self, r: Request, last: list[int]):
        reason = {RequestStatus.FINISHED_STOPPED: "stop", RequestStatus.FINISHED_LENGTH: "length",
                  RequestStatus.FINISHED_ABORTED: "abort"}[r.status]
        self._samplers.pop(r.request_id, None)
        stream = self._streams.pop(r.request_id)
        stream.pinned_blocks = r.pinned_blocks          # a pin()'s, until unpin()
        stream.cached_tokens = r.num_cached_tokens
        if stream.unpinned:                              # unpin() came before the pin was computed
            self._unpin(stream)
        stream._push(last, reason)

    def _fail(self, rid: str, e: BaseException, own: bool = False):
        """A request out of the scheduler (aborted, refused) ends with error e (own: its caller's)."""
        self._samplers.pop(rid, None)
        self._streams.pop(rid)._push([], error=e, own=own)

    def _fail_all(self, e: BaseException):
        """A step raised: every live request fails with it (their blocks freed)."""
        self.runner.clear()
        for rid in list(self.scheduler.requests):
            self.scheduler.abort(rid)
            self._fail(rid, e)

    def start(self):
        """Run steps in a background thread while there is work (idempotent)."""
        with self._lock:
            if self._thread is None and not self._closed:
                self._thread = threading.Thread(target=self._loop, name="hetero-engine", daemon=True)
                self._thread.start()

    def _loop(self):
        while True:
            with self._lock:
                while not self._closed and not self._inbox and not self.scheduler.has_unfinished:
                    self._lock.wait()
                if self._closed:
                    return
            try:
                self.step()
            except BaseException as e:        # the requests failed with it (step); later ones are refused
                self.failure = e
                log.error("hetero: the engine's step failed: %s", e)
                with self._lock:
                    items, self._inbox = list(self._inbox), deque()
                _refuse(items, e)
                return

    def close(self):
        """Stop the loop, fail what is unfinished (aborted), free the pool. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._lock.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        with self._step_lock:                 # a step a caller's thread drives (background=False) ends first
            self._drain_inbox_on_close()
            try:
                if self._previous_attn is not None:
                    self.model.set_attn_implementation(self._previous_attn)
            finally:
                self._release()

    def _drain_inbox_on_close(self):
        with self._lock:
            items, self._inbox = list(self._inbox), deque()
        _refuse(items, None)
        for rid in list(self.scheduler.requests):
            r = self.scheduler.abort(rid)
            self._end(r, [])

    def _release(self, guard=True):
        try:
            with self._step_guard() if guard else contextlib.nullcontext():      # a shared pool: between calls
                if self._adapters is not None:
                    self._adapters.close()
                if self.kv is not None:
                    self.kv.close()
        finally:
            self.kv = None
            if getattr(self, "runner", None) is not None:
                self.runner.clear()
                self.runner.release()
            if self._own_pool:
                self.pool.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _refuse(items, error: BaseException | None) -> None:
    """Inbox items the engine will not take (it failed: error; it closes: None): each one's
    stream ends (an added request aborted or failed; a pin, load or copy failed), none waits on."""
    for item in items:
        if item[0] in ("add", "load", "copy"):
            stream = item[3] if item[0] == "add" else item[-1]
            if error is None and item[0] == "add":
                stream._push([], "abort")
            else:
                stream._push([], error=error or EngineError("the engine closed before it took this"))


def _token_list(prompt) -> list[int]:
    if isinstance(prompt, torch.Tensor):
        if prompt.dim() == 2 and prompt.shape[0] == 1:
            prompt = prompt[0]
        if prompt.dim() != 1:
            raise ValueError(f"a prompt is one sequence of token ids ([n] or [1, n]), got shape {tuple(prompt.shape)}")
        prompt = prompt.tolist()
    if isinstance(prompt, (str, bytes)) or not hasattr(prompt, "__iter__"):
        raise TypeError(f"a prompt is a list of token ids, got {type(prompt).__name__}")
    ids = []
    for t in prompt:
        if isinstance(t, bool) or not isinstance(t, int) and not (hasattr(t, "__index__")):
            raise TypeError(f"prompt token ids must be ints, got {t!r}")
        ids.append(int(t))
    if not ids:
        raise ValueError("empty prompt")
    return ids
