"""What one `hetero serve` process holds: the engine, its model's name and adapters, the named
documents (contexts) pinned in its pool, the request limits and the metrics.

The HTTP handlers (hetero.server.app) run on the event loop's thread and call in here; the engine
runs its steps in its own thread (Engine's background loop), so nothing here blocks the loop for
longer than a request's tokenization and queueing. A dead worker fails the requests it touched;
the next request finds the engine failed and gets a new one (adapters loaded again, contexts
pinned again: from their saved files, else recomputed).

  state            written by                         read by
  engine           the loop's thread (restart)        handlers, metrics
  contexts         the loop's thread (create/delete)  handlers
  status           lifespan, SIGTERM                  handlers (503 unless "ready"), /health
"""
from __future__ import annotations

import asyncio
import logging
import os
import threading
import weakref
from dataclasses import dataclass

from hetero.engine.config import EngineConfig
from hetero.errors import AdapterError, CapacityError, EngineError
from hetero.server.protocol import APIError, bad, queue_full

log = logging.getLogger("hetero")


@dataclass
class NamedContext:
    name: str
    ids: list[int]
    adapter: str | None
    messages: list[dict] | None      # a chat context: its messages come first in a chat request's
    pin: object                      # the engine's pin() stream
    path: str | None = None          # its saved file (--saved-contexts)


def check_length(ids: list[int], max_tokens: int | None, max_model_len: int) -> int:
    """The room left after the prompt (400 when the prompt and max_tokens do not fit the model)."""
    room = max_model_len - len(ids)
    if room < 1 or (max_tokens is not None and max_tokens > room):
        raise bad(f"this model's maximum context length is {max_model_len} tokens; the prompt has "
                  f"{len(ids)} and {max_tokens or 1} more were asked", "max_tokens" if room >= 1 else "messages")
    return room


class Front:
    """What the app asks of any state (one engine here, replicas in hetero.server.replicas):
    status, the model's name and its adapters' names (adapter_names())."""
    status: str
    model_name: str

    def adapter_names(self) -> list[str]:
        raise NotImplementedError

    def check_ready(self):
        if self.status != "ready":
            raise APIError(503, f"the server is {self.status}", type="service_unavailable")

    def check_new_adapter(self, name, path) -> None:
        """A load_lora_adapter body's name and directory: strings, the name not served yet."""
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
            raise bad("lora_name and lora_path must be non-empty strings")
        if name in self.model_ids():
            raise bad(f"an adapter or model named {name!r} is already served", "lora_name")

    def model_ids(self) -> list[str]:
        return [self.model_name] + list(self.adapter_names())

    def adapter_for(self, model: str | None) -> str | None:
        """A request's `model`: the base model (None / its name) or a loaded adapter's name."""
        if model is None or model == self.model_name:
            return None
        if not isinstance(model, str):
            raise bad(f"model must be a string, got {model!r}", "model")
        if model in self.adapter_names():
            return model
        raise APIError(404, f"the model {model!r} does not exist (served: {self.model_ids()})",
                       type="not_found_error", param="model", code="model_not_found")


def check_context_name(name):
    """A name that is also a file's (--saved-contexts): 1-128 printable characters, at most 200
    bytes in UTF-8, no '/', not starting with '.'."""
    if not isinstance(name, str) or not name or len(name) > 128 or len(name.encode()) > 200 or "/" in name or \
            name.startswith(".") or not name.isprintable():
        raise bad(f"a context's name must be 1-128 printable characters (at most 200 bytes in UTF-8) without '/' "
                  f"and not starting with '.', got {name!r}", "name")


def _server_error(message: str) -> APIError:
    return APIError(500, message, type="server_error")


class ServerState(Front):
    def __init__(self, model, tokenizer, *, model_name: str, engine_config: EngineConfig,
                 adapters: dict | None = None, api_key: str | None = None, max_queue: int = 256,
                 saved_contexts: str | None = None):
        from hetero import Engine

        self.model, self.tokenizer, self.model_name = model, tokenizer, model_name
        self.engine_config, self.api_key, self.max_queue = engine_config, api_key, max_queue
        self.adapter_dirs = dict(adapters or {})
        self.saved_contexts = saved_contexts
        self.contexts: dict[str, NamedContext] = {}
        self._creating: set[str] = set()      # names whose context is being computed (a second create: 409)
        self._live: weakref.WeakSet = weakref.WeakSet()   # streams of requests and context pins submitted here
        self._restart_lock = threading.Lock()
        self.status = "starting"
        self._Engine = Engine
        self.engine = self._new_engine()
        self.restarts = 0

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def abort_in_flight(self):
        """The shutdown's time is up (hetero serve's SIGTERM): every request and context still computing
        ends now, each answered 503 (streams: an error event and [DONE]) before the server stops."""
        for stream in list(self._live):
            if not stream.finished:
                stream.abort()

    def _new_engine(self):
        return self._Engine(self.model, self.engine_config, tokenizer=self.tokenizer, adapters=self.adapter_dirs)

    # ---- the engine, restarted after a failure
    def live_engine(self):
        """The engine; a new one when the last failed or a worker of its pool died (found here, not
        by the next request failing): its requests failed with it. Any thread (one restart)."""
        e = self.engine
        if (e.failure is None and e.pool.alive) or self.status == "stopped":
            return e                              # (closed with the server: never started again)
        with self._restart_lock:
            if self.engine is not e:              # another thread replaced it meanwhile
                return self.engine
            return self._restart(e)

    def _restart(self, e):
        why = e.failure if e.failure is not None else e.pool.broken or "a CPU worker died"
        log.warning("hetero serve: the engine failed (%s); starting a new one", why)
        try:
            e.close()
        except Exception as err:             # the failed engine's pool is broken: closing it still frees its memory
            log.warning("hetero serve: closing the failed engine: %s", err)
        self.engine = self._new_engine()
        self.restarts += 1
        for ctx in self.contexts.values():   # pinned again in the new pool: loaded from its file, else recomputed
            try:
                ctx.pin = self.engine.load_pin(ctx.path)[0] if ctx.path else None
            except Exception as e:
                log.warning("hetero serve: context %r: its saved file does not load (%s); computing it again",
                            ctx.name, e)
                ctx.pin = None
            if ctx.pin is None:
                ctx.pin = self.engine.pin(ctx.ids, adapter=ctx.adapter)
        return self.engine

    def check_health(self):
        self.live_engine()

    @property
    def vocab_size(self) -> int:
        return self.model.config.get_text_config().vocab_size

    def adapter_models(self) -> list[tuple[str, str | None]]:
        """(name, directory) of every adapter a request's model may name."""
        return [(a, self.adapter_dirs.get(a)) for a in self.engine.adapters]

    def gauges(self) -> dict[str, tuple[str, float]]:
        """/metrics' gauges, read when scraped: {name: (help, value)}."""
        e = self.engine
        kv = e.kv_manager
        return {
            "hetero_requests_waiting": ("requests queued for the engine, not yet running", self.queue_depth()),
            "hetero_requests_running": ("requests the engine is computing", len(e.scheduler.running)),
            "hetero_kv_blocks_used": ("KV pool blocks held by requests and pins", kv.num_used_blocks),
            "hetero_kv_blocks_free": ("KV pool blocks free or cached (evictable)", kv.num_free_blocks + kv.num_evictable_blocks),
            "hetero_kv_blocks_total": ("KV pool blocks", kv.num_blocks),
            "hetero_prefix_cache_hit_rate": ("prompt tokens found in the prefix cache / prompt tokens looked up",
                                             kv.prefix_hits / max(kv.prefix_queries, 1)),
            "hetero_prefix_rows_bytes": ("bytes of the model's device keeping pinned or cached documents' rows for "
                                         "their questions", e.runner.prefix_rows.used),
            "hetero_prefix_rows_hits": ("prompt chunks that attended over a document's kept rows, since start",
                                        e.runner.prefix_rows.hits),
            "hetero_contexts": ("named contexts pinned in the pool", len(self.contexts)),
            "hetero_engine_restarts": ("engines replaced after a failure (a dead worker)", self.restarts),
        }

    def queue_depth(self) -> int:
        s = self.engine.scheduler
        return len(self.engine._inbox) + len(s.waiting)

    # ---- models and adapters
    def adapter_names(self) -> list[str]:
        return self.engine.adapters

    def load_adapter(self, name: str, path: str):
        self.check_ready()
        self.check_new_adapter(name, path)
        try:
            self.live_engine().load_adapter(name, path)
        except (AdapterError, OSError, ValueError) as e:
            raise bad(f"cannot load adapter {name!r} from {path!r}: {e}", "lora_path") from e
        self.adapter_dirs[name] = path

    def unload_adapter(self, name: str):
        self.check_ready()
        if name not in self.engine.adapters:
            raise APIError(404, f"no adapter named {name!r} is loaded", type="not_found_error", param="lora_name")
        users = [c.name for c in self.contexts.values() if c.adapter == name]
        if users:
            raise bad(f"adapter {name!r} is used by contexts {users}; delete them first", "lora_name")
        self.live_engine().unload_adapter(name)
        self.adapter_dirs.pop(name, None)

    # ---- requests
    def submit(self, ids: list[int], sampling, adapter: str | None, max_tokens: int | None, doc_len=None):
        """Queue a request in the engine: its stream. doc_len (the replicas' routing) is not needed:
        the engine's prefix cache finds any document it holds."""
        self.check_ready()
        engine = self.live_engine()
        if self.queue_depth() >= self.max_queue:
            raise queue_full(f"the server's queue ({self.max_queue} requests waiting)")
        room = check_length(ids, max_tokens, engine.max_model_len)
        kw = dict(sampling.kwargs)
        if sampling.stop:
            kw.update(stop_strings=sampling.stop, tokenizer=self.tokenizer)
        try:
            stream = engine.add_request(ids, max_tokens or room, seed=sampling.seed, adapter=adapter,
                                        ignore_eos=sampling.ignore_eos, output_scores=sampling.logprobs is not None,
                                        **kw)
        except CapacityError as e:
            raise bad(f"the request does not fit: {e}") from e
        except (ValueError, TypeError) as e:
            raise bad(str(e)) from e
        except EngineError as e:
            raise APIError(500, str(e), type="server_error") from e
        self._live.add(stream)
        return stream

    # ---- named contexts (documents pinned in the pool)
    async def create_context(self, name: str, ids: list[int], adapter: str | None, messages: list[dict] | None):
        """Compute and pin a named context (and save it, with --saved-contexts). It is listed once
        all of that succeeded; a failure leaves nothing pinned or saved."""
        self.check_ready()
        check_context_name(name)
        if name in self.contexts or name in self._creating:
            raise APIError(409, f"a context named {name!r} exists; delete it first", param="name")
        self._creating.add(name)                 # the event loop's thread: no await since the check
        try:
            engine = self.live_engine()
            if len(ids) > engine.max_model_len:
                raise bad(f"the context has {len(ids)} tokens; this model's maximum context length is "
                          f"{engine.max_model_len}", "prompt")
            try:
                pin = engine.pin(ids, adapter=adapter)
            except CapacityError as e:
                raise bad(f"the context does not fit: {e}") from e
            self._live.add(pin)
            try:
                await asyncio.to_thread(pin.result)
                if pin.finish_reason == "abort":      # abort_in_flight
                    raise APIError(503, "the server is stopping: the context was not created",
                                   type="service_unavailable")
            except EngineError as e:              # the pins left no room for it, or the engine failed
                if isinstance(e.__cause__, CapacityError):
                    raise bad(f"the context does not fit: {e.__cause__}", "prompt") from e
                raise APIError(500, str(e), type="server_error") from e
            except BaseException:                 # cancelled (shutdown): nothing kept of it
                engine.unpin(pin)
                raise
            ctx = NamedContext(name, ids, adapter, messages, pin)
            if self.saved_contexts:
                path = os.path.join(self.saved_contexts, f"{name}.ctx")
                try:
                    await asyncio.to_thread(engine.save_pin, pin, path, {"name": name, "messages": messages})
                except Exception as e:            # save_pin writes atomically: no partial file
                    engine.unpin(pin)
                    raise (bad if isinstance(e, (ValueError, OSError)) else _server_error)(
                        f"the context could not be saved to --saved-contexts: {e}") from e
                ctx.path = path
            self.contexts[name] = ctx
            return ctx
        finally:
            self._creating.discard(name)

    def delete_context(self, name: str):
        ctx = self.contexts.pop(name, None)
        if ctx is None:
            raise APIError(404, f"no context named {name!r}", type="not_found_error", param="name")
        self.engine.unpin(ctx.pin)
        if ctx.path and os.path.exists(ctx.path):
            os.unlink(ctx.path)

    def context(self, name: str | None) -> NamedContext | None:
        if name is None:
            return None
        ctx = self.contexts.get(name)
        if ctx is None:
            raise APIError(404, f"no context named {name!r} (created: {sorted(self.contexts)})",
                           type="not_found_error", param="context")
        return ctx

    def load_saved_contexts(self):
        """At start: every context saved in --saved-contexts, loaded into the pool without a prefill."""
        if not self.saved_contexts:
            return
        os.makedirs(self.saved_contexts, exist_ok=True)
        for fn in sorted(os.listdir(self.saved_contexts)):
            if not fn.endswith(".ctx"):
                continue
            path = os.path.join(self.saved_contexts, fn)
            try:
                pin, extra = self.engine.load_pin(path)
                pin.result()
            except Exception as e:               # a file of another model, or corrupted: skipped, named
                log.warning("hetero serve: skipping saved context %s: %s", path, e)
                continue
            name, messages = extra.get("name"), extra.get("messages")
            name = name if isinstance(name, str) and name else fn[:-4]
            messages = messages if isinstance(messages, list) else None
            self.contexts[name] = NamedContext(name, pin.prompt_ids, pin.adapter, messages, pin, path)

    def close(self):
        self.status = "stopped"
        self.engine.close()
