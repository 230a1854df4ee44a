"""hetero on Ray Serve: replicas of the engine behind one OpenAI ingress, routed by document, with a
context store they share.

  Ingress         a Ray Serve deployment running hetero serve's FastAPI app (hetero.server.app)
                  over ReplicatedState: it parses and tokenizes each request, then streams it from
                  a replica through a DeploymentHandle (token ids in, token ids out; the text,
                  SSE and errors are made here, as in `hetero serve`)
  HeteroReplica   one engine (hetero.server.state.ServerState) on its share of the host's cores:
                  the replica's process is pinned to them, so its engine's workers are too
  DocumentRouter  Ray Serve's request router for the replicas: a request whose prompt starts with a
                  document goes to the replica rendezvous hashing picks for the hash of the
                  document's first whole blocks (the same choice in every ingress, with no shared
                  state, and a lost replica moves only its own documents); when that replica is
                  full (max_ongoing_requests), the least loaded of the others
  ContextStore    (hetero.server.store) documents' KV by content: a replica missing a request's
                  document loads it from the store instead of prefilling it, and saves the ones it
                  prefills

Adapters: the store's adapters.json lists those served by name (--adapters at start); the
ingress changes it (/v1/load_lora_adapter, after one replica loaded the adapter as its check;
/v1/unload_lora_adapter), and each replica loads and unloads to match before its next request.

A request's path: ingress (tokens, document length, route key) -> DocumentRouter -> replica:
the document cached in its pool ("hit"), else loaded from the store ("load"), else prefilled,
pinned while it is saved, then released to the prefix cache ("prefill") -> the request itself
over those blocks -> tokens streamed back -> ingress -> client.

Build it with `hetero serve --replicas N`, or add `build(...)` to your own Ray application.
"""
from __future__ import annotations

import asyncio
import collections
import hashlib
import logging
import math
import os
import threading
import time
import weakref
from dataclasses import dataclass

from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from hetero.engine.kv_pool import BLOCK_SIZE
from hetero.errors import CapacityError, ContextFileError, EngineError
from hetero.ipc import shm
from hetero.server.protocol import APIError, bad, queue_full
from hetero.server.state import Front, check_context_name, check_length
from hetero.server.store import ContextStore

log = logging.getLogger("hetero")
RETRY_S = 10.0            # seconds before a replica tries again an adapter it could not load
ROUTE_BLOCKS = 4          # whole blocks of a prompt's start that name its document for routing


@dataclass
class Job:
    """What the ingress sends a replica: token ids and settings (pickled once per request)."""
    ids: list[int]
    sampling: object                # hetero.server.protocol.Sampling
    adapter: str | None
    max_tokens: int | None
    doc_len: int                    # the prompt's leading document (0: none)
    route_key: str | None           # DocumentRouter's key (None: the least loaded replica)


def route_key(ids: list[int], doc_len: int) -> str | None:
    """The hash of the first whole blocks (up to ROUTE_BLOCKS) of the document, else of the prompt
    before its last token; None under one block."""
    n = min((doc_len or len(ids) - 1) // BLOCK_SIZE, ROUTE_BLOCKS)
    if n < 1:
        return None
    return hashlib.blake2b(str(ids[:n * BLOCK_SIZE]).encode(), digest_size=16).hexdigest()


class DocumentRouter(RequestRouter):
    """Rendezvous hashing on a Job's route_key: [[its replica], [the others]]; Ray Serve takes the
    least loaded replica of the first rank with room (max_ongoing_requests), then of the next.
    When its replica has `imbalance` more requests in flight than the least loaded one, the others
    come first: a popular document spreads (the others load it from the context store)."""

    def initialize_state(self, imbalance: int = 4):
        self.imbalance = imbalance

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        job = next((a for a in (pending_request.args if pending_request else ()) if hasattr(a, "route_key")), None)
        if job is None or job.route_key is None or len(candidate_replicas) < 2:
            return [candidate_replicas]
        ranked = sorted(candidate_replicas, key=lambda r: hashlib.blake2b(
            f"{job.route_key}/{r.replica_id.unique_id}".encode(), digest_size=8).digest(), reverse=True)
        if await self._imbalanced(ranked):
            return [ranked[1:], ranked[:1]]
        return [ranked[:1], ranked[1:]]

    async def _imbalanced(self, ranked) -> bool:
        """Whether the document's replica (ranked[0]) leads the least loaded other by `imbalance`
        requests in flight. Ray Serve's queue-length cache (no RPC) only raises the question: it
        counts requests sent and goes stale as they finish, so a fresh probe answers it. These
        are the request router's own helpers (an alpha API): without them, no imbalance rule."""
        limit = getattr(self, "imbalance", 4)
        try:
            if self._use_replica_queue_len_cache:
                cached = [self._replica_queue_len_cache.get(r.replica_id) for r in ranked]
                if cached[0] is not None and all(n is not None and cached[0] - n < limit for n in cached[1:]):
                    return False
            lens = dict((r.replica_id, n) for r, n in await self._probe_queue_lens(ranked, 0))
        except AttributeError:
            return False
        first = lens.get(ranked[0].replica_id)
        return first is not None and any(lens.get(r.replica_id) is not None and first - lens[r.replica_id] >= limit
                                         for r in ranked[1:])


def shared_gpu_budgets(engine: dict, total: int, share: float, allocated: int) -> dict:
    """EngineConfig's options for a replica on `share` of a GPU of `total` bytes, its weights
    `allocated` there: the device memory it keeps rows in (PrefillStage, PrefixRows), unless set,
    from its share of the GPU, not from the free memory it sees at start (what the replicas after
    it see too)."""
    from hetero.engine.runner import gpu_budgets

    if share >= 1:
        return engine
    stage, prefix = gpu_budgets(max(int(total * share) - allocated, 0))
    defaults = {"prefill_stage_memory": stage, "prefix_rows_memory": prefix}
    return {**engine, **{k: v for k, v in defaults.items() if engine.get(k) is None}}


class HeteroReplica:
    """One engine on its share of the cores (Ray Serve deployment class)."""

    def __init__(self, model: str | None, dtype: str, engine: dict, store: str, cores_per_replica: int | None = None,
                 served_model_name: str | None = None, device: str = "cpu", gpu_share: float = 1.0):
        import torch

        from hetero.engine.config import EngineConfig
        from hetero.server.main import load
        from hetero.server.state import ServerState

        ctx = serve.get_replica_context()
        self.name = ctx.replica_id.unique_id if ctx else f"local-{os.getpid()}"
        if cores_per_replica:                # this replica's share: its engine's workers pin inside it
            usable = sorted(os.sched_getaffinity(0))
            rank = ctx.rank.local_rank if ctx and ctx.rank is not None else 0
            share = [usable[(rank * cores_per_replica + i) % len(usable)] for i in range(cores_per_replica)]
            os.sched_setaffinity(0, share)
            torch.set_num_threads(len(share))
        m, tok, served = load(model, dtype, device)         # "cuda": the GPU Ray gave this replica
        if m.device.type == "cuda":
            engine = shared_gpu_budgets(engine, torch.cuda.get_device_properties(m.device).total_memory, gpu_share,
                                        torch.cuda.memory_allocated(m.device))
        # the adapters: the store's list (build() writes --adapters there; a replica Ray starts later
        # takes what the API has made of it since)
        self.state = ServerState(m, tok, model_name=served_model_name or served, engine_config=EngineConfig(**engine),
                                 max_queue=1 << 30)
        self.state.status = "ready"
        self.store = ContextStore(store)
        self._locks: dict[str, asyncio.Lock] = collections.defaultdict(asyncio.Lock)
        self._fingerprints: dict[str | None, dict] = {}     # by Engine.adapter_key (a reload hashes apart),
        self._fingerprints_of = None                        # for this engine (a new one numbers slots anew)
        self._adapters_seen: dict | None = None             # the store's adapters.json as last matched
        self._adapter_failures: dict[str, str] = {}         # adapters this replica could not load: why
        self._retry_at = math.inf                           # when to try them again
        self._adapter_lock = asyncio.Lock()
        self._match_adapters()

    def check_health(self):
        """Ray Serve's health check: a failed engine is replaced; one that cannot be fails the replica."""
        self.state.live_engine()

    def front(self) -> dict:
        """What the ingress needs of the model: its tokenizer, name, vocabulary and length."""
        s = self.state
        return {"tokenizer": s.tokenizer, "model_name": s.model_name, "vocab_size": s.vocab_size,
                "max_model_len": s.engine.max_model_len}

    async def load_adapter(self, name: str, path: str) -> None:
        """The ingress's check of an adapter before it enters the store's list: loaded here (a
        bad name or directory raises hetero serve's 400) after matching the list (an adapter of
        that name unloaded there may still be loaded here); the other replicas follow the list."""
        async with self._adapter_lock:
            await asyncio.to_thread(self._match_adapters)
            await asyncio.to_thread(self.state.load_adapter, name, path)

    def _match_adapters(self) -> None:
        """Load and unload adapters to match the store's list (blocking: at start, or under
        _adapter_lock). A load that fails is remembered for the requests naming it, and tried
        again RETRY_S later."""
        want = self.store.adapters()
        have = dict(self.state.adapter_models())
        for name, path in have.items():
            if want.get(name) != path:
                self.state.unload_adapter(name)
        failures = {}
        for name, path in want.items():
            if have.get(name) != path:
                try:
                    self.state.load_adapter(name, path)
                except APIError as e:
                    log.warning("replica %s: adapter %r does not load: %s", self.name, name, e.message)
                    failures[name] = e.message
        self._adapter_failures = failures
        self._adapters_seen = want
        self._retry_at = time.monotonic() + RETRY_S if failures else math.inf

    def _adapters_stale(self) -> bool:
        return self.store.adapters() != self._adapters_seen or time.monotonic() >= self._retry_at

    async def _follow_adapters(self, adapter: str | None) -> None:
        """Before a request: match the store's adapter list when it changed since last matched (a
        file read per request); then a request naming an adapter this replica could not load
        fails, naming why."""
        if self._adapters_stale():
            async with self._adapter_lock:
                if self._adapters_stale():
                    await asyncio.to_thread(self._match_adapters)
        if adapter in self._adapter_failures:
            raise APIError(500, f"replica {self.name} cannot serve adapter {adapter!r}: "
                           f"{self._adapter_failures[adapter]}", type="server_error")

    async def document(self, job: Job) -> str | None:
        """Make sure the job's document is in this replica's pool: "hit", "load", "prefill" or None."""
        await self._follow_adapters(job.adapter)
        n = job.doc_len // BLOCK_SIZE
        if n < 1:
            return None
        engine = self.state.live_engine()
        doc = job.ids[:job.doc_len]
        if engine.kv_manager.num_cached_blocks(doc, engine.adapter_key(job.adapter)) == n:
            return "hit"
        if self._fingerprints_of is not engine:
            self._fingerprints, self._fingerprints_of = {}, engine
        fp = self._fingerprints.get(engine.adapter_key(job.adapter))
        if fp is None:
            from hetero.offload.saved import fingerprint

            fp = self._fingerprints[engine.adapter_key(job.adapter)] = await asyncio.to_thread(
                fingerprint, engine.model, engine.spec, engine.adapter_digest(job.adapter))
        key = self.store.key(fp, doc)
        async with self._locks[key]:
            if engine.kv_manager.num_cached_blocks(doc, engine.adapter_key(job.adapter)) == n:
                return "hit"
            if self.store.has(key):
                try:
                    pin, _ = await asyncio.to_thread(engine.load_pin, self.store.path(key))
                    engine.unpin(pin)                       # cached: the request below finds its blocks
                    return "load"
                except ContextFileError as e:               # corrupted or not this model's: prefilled again
                    log.warning("context store: %s does not load (%s); prefilling it", self.store.path(key), e)
                    self.store.discard(key)
                except CapacityError as e:                  # the pool is full now: the file stays good
                    log.info("context store: %s does not fit now (%s)", self.store.path(key), e)
                    return None
            pin = engine.pin(doc, adapter=job.adapter)
            try:
                await asyncio.to_thread(pin.result)
                await asyncio.to_thread(engine.save_pin, pin, self.store.prepare(key), {"tokens": len(doc)})
            finally:
                engine.unpin(pin)
            return "prefill"

    async def generate(self, job: Job):
        """Stream the job's tokens ([ids] per step), then {"finish_reason", "replica", "source", "scores"}.
        Cancelled (the client went away): its request is aborted, its blocks free at the next step."""
        await self._follow_adapters(job.adapter)
        try:
            source = await self.document(job)
        except CapacityError:                   # the document alone does not fit the pool: the request says so
            source = None
        stream = self.state.submit(job.ids, job.sampling, job.adapter, job.max_tokens)
        try:
            async for t in stream:
                yield [t]
        finally:
            if not stream.finished:
                stream.abort()
        keep = job.sampling.logprobs is not None
        yield {"finish_reason": stream.finish_reason, "replica": self.name, "pid": os.getpid(), "source": source,
               # tokens found computed: not the document this request had prefilled just before it
               "cached_tokens": stream.cached_tokens - (job.doc_len // BLOCK_SIZE * BLOCK_SIZE
                                                        if source == "prefill" else 0),
               "scores": [s.float().cpu() for s in stream.scores] if keep and stream.scores else None}

    def __del__(self):
        """Ray Serve's graceful shutdown: the engine closes (its workers exit, its segments go), then
        this process's owner lock, as its exit handlers would (Ray ends the actor without them)."""
        state = getattr(self, "state", None)
        if state is not None:
            state.close()
            self.state = None
        shm.release_owner_lock()


class RemoteStream:
    """A replica's streamed answer, read as the app reads an engine's RequestStream."""

    def __init__(self, front, gen):
        self.front, self.gen = front, gen
        self.arrival = time.monotonic()
        self.token_ids: list[int] = []
        self.token_times: list[float] = []
        self.finish_reason = None
        self.scores = None
        self.finished = False
        self.cached_tokens = 0
        front.in_flight += 1                     # until finished (iteration's end, or abort), or dropped
        self._live = [True]                      # (a streamed response whose body never started: its client
        weakref.finalize(self, _dropped, front, gen, self._live)   # left first) unread, its request cancelled

    async def __aiter__(self):
        try:
            async for msg in self.gen:
                if isinstance(msg, list):
                    now = time.monotonic()
                    for t in msg:
                        self.token_ids.append(t)
                        self.token_times.append(now)
                        yield t
                else:
                    self.finish_reason, self.scores = msg["finish_reason"], msg["scores"]
                    self.cached_tokens = msg["cached_tokens"]
                    self.front.record(msg["replica"], msg["pid"], msg["source"])
            if self.finish_reason is None:       # the stream ended without the replica's last word: it died
                raise EngineError("the replica serving this request ended its stream unfinished (it died or was "
                                  "stopped)")
        except APIError:
            raise
        except Exception as e:
            if type(e).__name__ == "BackPressureError":     # Ray's queue in front of the replicas is full
                raise queue_full("Ray Serve's queue in front of the replicas") from None
            cause = getattr(e, "cause", None)
            if isinstance(cause, APIError):
                raise cause from None
            if isinstance(cause, EngineError):
                raise EngineError(str(cause)) from None
            raise EngineError(f"the replica serving this request failed: {type(e).__name__}: {e}") from None
        finally:
            self._finish()

    def abort(self):
        if not self.finished:
            self.gen.cancel()
            self.finish_reason = "abort"
            self._finish()

    def _finish(self):
        if not self.finished:
            self.finished = True
            self._live[0] = False
            self.front.in_flight -= 1


def _dropped(front, gen, live):
    """A RemoteStream dropped unfinished: no longer in flight, its replica's request cancelled."""
    if live[0]:
        live[0] = False
        front.in_flight -= 1
        gen.cancel()


@dataclass
class StoredContext:
    name: str
    ids: list[int]
    adapter: str | None
    messages: list[dict] | None
    path: str | None


class ReplicatedState(Front):
    """ServerState's face for the app (hetero.server.app) in the ingress: requests go to replicas."""

    def __init__(self, replicas, tokenizer, *, model_name: str, vocab_size: int, max_model_len: int,
                 store: str, api_key: str | None, capacity: int = 1 << 30):
        self.replicas, self.tokenizer, self.model_name = replicas, tokenizer, model_name
        self.capacity = capacity               # requests in flight beyond which a new one gets 429
        self.vocab_size, self.max_model_len = vocab_size, max_model_len
        self.api_key, self.store = api_key, ContextStore(store)
        self._adapter_lock = threading.Lock()  # one change of the store's adapter list at a time
        self.status = "starting"
        self.in_flight = 0
        self._replica_requests = self._sources = None

    def register_metrics(self, registry):
        from prometheus_client import Counter

        self._replica_requests = Counter("hetero_replica_requests", "requests served, by replica (and its process)",
                                         ["pid", "replica"], registry=registry)
        self._sources = Counter("hetero_documents", "requests' documents: cached on their replica (hit), loaded "
                                "from the context store (load) or prefilled (prefill)", ["source"], registry=registry)

    def record(self, replica: str, pid: int, source: str | None):
        if self._replica_requests is not None:
            self._replica_requests.labels(str(pid), replica).inc()
            if source:
                self._sources.labels(source).inc()

    def gauges(self):
        return {"hetero_requests_in_flight": ("requests sent to replicas, not finished", self.in_flight),
                "hetero_contexts": ("named contexts in the context store", len(self.store.names()))}

    def check_health(self):
        pass                                   # Ray Serve checks the replicas (HeteroReplica.check_health)

    def close(self):
        self.status = "stopped"

    # ---- models: the store's adapter list, which every replica follows before its next request
    def adapter_names(self) -> list[str]:
        return list(self.store.adapters())

    def adapter_models(self):
        return list(self.store.adapters().items())

    def load_adapter(self, name, path):
        """Checked by loading it on one replica (its errors are hetero serve's), then listed."""
        self.check_ready()
        with self._adapter_lock:
            self.check_new_adapter(name, path)
            try:
                self.replicas.load_adapter.remote(name, path).result()
            except Exception as e:
                cause = getattr(e, "cause", e)
                if isinstance(cause, APIError):
                    raise cause from None
                raise APIError(500, f"the replica loading adapter {name!r} failed: {cause}", type="server_error") \
                    from e
            self.store.set_adapters(self.store.adapters() | {name: path})

    def unload_adapter(self, name):
        self.check_ready()
        with self._adapter_lock:
            adapters = self.store.adapters()
            if name not in adapters:
                raise APIError(404, f"no adapter named {name!r} is loaded", type="not_found_error", param="lora_name")
            users = [n for n, c in self.contexts.items() if c.adapter == name]
            if users:
                raise bad(f"adapter {name!r} is used by contexts {users}; delete them first", "lora_name")
            del adapters[name]
            self.store.set_adapters(adapters)

    # ---- requests
    def submit(self, ids, sampling, adapter, max_tokens, doc_len=None):
        self.check_ready()
        check_length(ids, max_tokens, self.max_model_len)
        if self.in_flight >= self.capacity:
            raise queue_full(f"the replicas' room ({self.capacity} requests in flight: --max-num-seqs on each "
                             "and --max-queue waiting)")
        n = doc_len() if callable(doc_len) else (doc_len or 0)
        job = Job(list(ids), sampling, adapter, max_tokens, n, route_key(ids, n))
        gen = self.replicas.options(stream=True).generate.remote(job)
        return RemoteStream(self, gen)

    # ---- named contexts: in the store, loaded by whichever replica a request reaches
    @property
    def contexts(self) -> dict[str, StoredContext]:
        return {n: c for n in self.store.names() if (c := self._stored(n)) is not None}

    def _stored(self, name):
        rec = self.store.get_name(name)
        return None if rec is None else StoredContext(name, rec["ids"], rec["adapter"], rec["messages"], self.store.root)

    async def create_context(self, name, ids, adapter, messages):
        self.check_ready()
        check_context_name(name)
        if self.store.get_name(name) is not None:
            raise APIError(409, f"a context named {name!r} exists; delete it first", param="name")
        if len(ids) > self.max_model_len:
            raise bad(f"the context has {len(ids)} tokens; this model's maximum context length is "
                      f"{self.max_model_len}", "prompt")
        job = Job(list(ids), None, adapter, None, len(ids), route_key(ids, len(ids)))
        try:
            source = await self.replicas.document.remote(job)
        except Exception as e:
            cause = getattr(e, "cause", e)
            raise APIError(500, f"the replica computing context {name!r} failed: {cause}", type="server_error") from e
        await asyncio.to_thread(self._put_context, name, ids, adapter, messages, source)
        return self._stored(name)

    def _put_context(self, name, ids, adapter, messages, source):
        with self._adapter_lock:                # not an adapter unloaded while the replica computed it
            if adapter is not None and adapter not in self.store.adapters():
                raise APIError(404, f"adapter {adapter!r} was unloaded while context {name!r} was computed",
                               type="not_found_error", param="model")
            self.store.put_name(name, {"ids": list(ids), "adapter": adapter, "messages": messages, "source": source})

    def delete_context(self, name):
        if not self.store.delete_name(name):
            raise APIError(404, f"no context named {name!r}", type="not_found_error", param="name")

    def context(self, name):
        if name is None:
            return None
        ctx = self._stored(name)
        if ctx is None:
            raise APIError(404, f"no context named {name!r} (created: {self.store.names()})",
                           type="not_found_error", param="context")
        return ctx


class Ingress:
    """The OpenAI API (hetero.server.app) as a Ray Serve ingress over the replicas' handle.
    capacity: the requests it sends on at once (each replica's max_ongoing_requests, times the
    replicas or the autoscaler's maximum, plus max_queued_requests); one more gets 429."""

    def __init__(self, replicas, store: str, api_key: str | None, capacity: int = 1 << 30):
        self.replicas, self.store, self.api_key, self.capacity = replicas, store, api_key, capacity

    async def __serve_build_asgi_app__(self):
        from hetero.server.app import build_app

        info = await self.replicas.front.remote()            # the model's tokenizer, name and limits
        self.state = ReplicatedState(self.replicas, info["tokenizer"], model_name=info["model_name"],
                                     vocab_size=info["vocab_size"], max_model_len=info["max_model_len"],
                                     store=self.store, api_key=self.api_key, capacity=self.capacity)
        return build_app(self.state)


def build(*, replicas: int = 2, model: str | None = None, dtype: str = "fp32", engine: dict | None = None,
          store: str, adapters: dict | None = None, api_key: str | None = None, cores_per_replica: int | None = None,
          gpus_per_replica: float = 0, device: str = "cpu",
          max_ongoing_requests: int = 32, max_queued_requests: int = 256, autoscaling_config: dict | None = None,
          routing: str = "document", imbalance: int = 4, served_model_name: str | None = None):
    """A Ray Serve application: the ingress over `replicas` HeteroReplica deployments (or Ray
    Serve's autoscaling_config instead of a fixed count), document-aware routing, the store at
    `store`. Run it with serve.run(build(...)). cores_per_replica: each replica's num_cpus and the
    host cores its process (and its engine's workers) is pinned to, by its local rank. routing:
    "document" (DocumentRouter; imbalance: the requests in flight by which a document's replica may
    lead the least loaded one before the others come first) or "pow2" (Ray Serve's default: the
    less loaded of two replicas). device "cuda": each replica's model on the GPU Ray gives it
    (num_gpus=gpus_per_replica: 1, or a share of one GPU the replicas load their copies on)."""
    if routing not in ("document", "pow2"):
        raise ValueError(f"routing must be 'document' or 'pow2', got {routing!r}")
    engine = dict(engine or {})
    ContextStore(store).set_adapters(adapters or {})    # the adapters served: these, then what the API changes
    router = {"request_router_config": RequestRouterConfig(request_router_class=f"{__name__}:DocumentRouter",
                                                           request_router_kwargs={"imbalance": imbalance})} \
        if routing == "document" else {}
    scaling = {"autoscaling_config": autoscaling_config} if autoscaling_config else {"num_replicas": replicas}
    replica = serve.deployment(
        HeteroReplica, name="HeteroReplica", max_ongoing_requests=max_ongoing_requests,
        max_queued_requests=max_queued_requests, health_check_period_s=5, health_check_timeout_s=60,
        graceful_shutdown_timeout_s=30,
        ray_actor_options={"num_cpus": cores_per_replica or 1, "num_gpus": gpus_per_replica},
        **router, **scaling,
    ).bind(model, dtype, engine, store, cores_per_replica, served_model_name, device, gpus_per_replica or 1.0)
    ingress = serve.deployment(serve.ingress()(Ingress), name="HeteroIngress", num_replicas=1,
                               max_ongoing_requests=4096, ray_actor_options={"num_cpus": 0})
    most = autoscaling_config.get("max_replicas", 1) if autoscaling_config else replicas     # Ray's default: 1
    capacity = 1 << 30 if max_queued_requests < 0 else most * max_ongoing_requests + max_queued_requests
    return ingress.bind(replica, store, api_key, capacity)
