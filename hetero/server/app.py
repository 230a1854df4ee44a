"""The OpenAI-compatible HTTP API over the engine (FastAPI; `hetero serve` runs it under uvicorn).

  POST /v1/completions, /v1/chat/completions   OpenAI's, streamed as server-sent events or not
  GET  /v1/models                              the base model and every loaded adapter
  POST /v1/load_lora_adapter, /v1/unload_lora_adapter   adapters at run time (vLLM's names)
  POST /v1/contexts, GET /v1/contexts, DELETE /v1/contexts/{name}   named documents pinned in the
                                               pool; a request names one with the extra field
                                               "context" (its tokens, or messages, come first)
  GET  /health (200 only while the engine can generate), GET /metrics (Prometheus)

Errors are OpenAI's JSON ({"error": {"message", "type", "param", "code"}}) with the status that
says what went wrong (400 bad input, 401 key, 404 unknown model/adapter/context, 429 queue full,
500 the engine failed, 503 starting or stopping). A client that disconnects aborts its request:
its blocks are free at the next step. Every response carries X-Request-Id (the client's, or new).
"""
from __future__ import annotations

import asyncio
import hmac
import json

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from hetero.errors import CapacityError, EngineError
from hetero.server import metrics as prom
from hetero.server.protocol import (CHAT_FIELDS, COMPLETION_FIELDS, APIError, bad, check_fields, check_text,
                                    messages_of, new_id, now, prompt_of, sampling, usage)
from hetero.server.state import ServerState
from hetero.server.text import Detokenizer, chat_logprobs, completion_logprobs, logprob_entries, max_token_chars


def build_app(state: ServerState) -> FastAPI:
    metrics = prom.Metrics(state)

    async def lifespan(app):
        state.status = "ready"
        yield
        state.status = "stopping"
        await asyncio.to_thread(state.close)

    app = FastAPI(title="hetero", lifespan=lifespan)
    app.state.hetero = state
    app.add_middleware(Guard, api_key=state.api_key)

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError):
        return _error(e, getattr(request.state, "request_id", None))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):     # unknown route, wrong method
        kind = {404: "not_found_error", 405: "invalid_request_error"}.get(e.status_code, "invalid_request_error")
        return _error(APIError(e.status_code, f"{request.method} {request.url.path}: {e.detail}", type=kind),
                      getattr(request.state, "request_id", None), e.headers)        # a 405's Allow

    @app.exception_handler(Exception)
    async def unexpected(request: Request, e: Exception):                  # a bug: still OpenAI's JSON
        return _error(_unexpected(e), getattr(request.state, "request_id", None))

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health():
        if state.status != "ready":
            return JSONResponse({"status": state.status}, status_code=503)
        try:
            await asyncio.to_thread(state.check_health)     # a failed engine is replaced here
        except Exception as e:
            return JSONResponse({"status": "failed", "error": str(e)}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def get_metrics():
        return PlainTextResponse(metrics.render(), media_type=prom.CONTENT_TYPE)

    @app.get("/v1/models")
    async def models():
        base = {"id": state.model_name, "object": "model", "created": 0, "owned_by": "hetero"}
        return {"object": "list", "data": [base] + [
            {"id": a, "object": "model", "created": 0, "owned_by": "hetero", "parent": state.model_name,
             "root": root} for a, root in state.adapter_models()]}

    @app.post("/v1/load_lora_adapter")
    async def load_lora(request: Request):
        body = check_fields(await _json(request), {"lora_name", "lora_path"})
        await asyncio.to_thread(state.load_adapter, body.get("lora_name"), body.get("lora_path"))
        return {"status": "ok", "lora_name": body["lora_name"]}

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora(request: Request):
        body = check_fields(await _json(request), {"lora_name", "lora_int_id"})
        await asyncio.to_thread(state.unload_adapter, body.get("lora_name"))
        return {"status": "ok", "lora_name": body["lora_name"]}

    @app.post("/v1/contexts")
    async def create_context(request: Request):
        body = check_fields(await _json(request), {"name", "prompt", "messages", "model"})
        adapter = state.adapter_for(body.get("model"))
        if ("prompt" in body) == ("messages" in body):
            raise bad("a context takes either prompt or messages")
        messages = messages_of(body) if "messages" in body else None
        ids = await (_chat_ids(state, messages, generation_prompt=False) if messages else
                     _prompt_ids(state, prompt_of(body)))
        ctx = await state.create_context(body.get("name"), ids, adapter, messages)
        return _context_json(ctx)

    @app.get("/v1/contexts")
    async def list_contexts():
        return {"object": "list", "data": [_context_json(c) for c in state.contexts.values()]}

    @app.delete("/v1/contexts/{name}")
    async def delete_context(name: str):
        state.delete_context(name)
        return {"name": name, "object": "context", "deleted": True}

    async def parsed(request, fields, chat):
        """(body, adapter, sampling, named context) of a completion or chat request."""
        body = check_fields(await _json(request), fields)
        adapter = state.adapter_for(body.get("model"))
        s = sampling(body, chat=chat)
        return body, adapter, s, state.context(s.context)

    @app.post("/v1/completions")
    async def completions(request: Request):
        body, adapter, s, ctx = await parsed(request, COMPLETION_FIELDS, chat=False)
        if ctx is not None and ctx.messages is not None:
            raise bad(f"context {ctx.name!r} was made from messages: use it with /v1/chat/completions", "context")
        ids = await _prompt_ids(state, prompt_of(body), prefix=ctx.ids if ctx else None)
        return await _respond(request, state, metrics, ids, s, adapter, chat=False,
                              doc_len=lambda: len(ctx.ids) if ctx else 0)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body, adapter, s, ctx = await parsed(request, CHAT_FIELDS, chat=True)
        messages = messages_of(body)
        if ctx is not None:
            if ctx.messages is None:
                raise bad(f"context {ctx.name!r} was made from a prompt: use it with /v1/completions", "context")
            messages = ctx.messages + messages
        ids = await _chat_ids(state, messages, generation_prompt=True)
        return await _respond(request, state, metrics, ids, s, adapter, chat=True,
                              doc_len=lambda: _document_len(state, ids, messages, ctx))

    return app


class Guard:
    """Every HTTP request: its X-Request-Id (the client's, or new; on every response) and, with an
    API key, its Authorization checked on /v1/. A plain ASGI middleware: Starlette's
    BaseHTTPMiddleware (@app.middleware) hides a client's disconnect from the endpoint, whose
    non-streamed request would then run to its end for nobody."""

    def __init__(self, app, api_key: str | None):
        self.app, self.api_key = app, api_key

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        rid = headers.get("x-request-id") or new_id("req")
        scope.setdefault("state", {})["request_id"] = rid         # request.state.request_id

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                kept = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"x-request-id"]
                message = {**message, "headers": kept + [(b"x-request-id", rid.encode("latin-1", "replace"))]}
            await send(message)

        if self.api_key and scope["path"].startswith("/v1/") and not _authorized(headers, self.api_key):
            response = _error(APIError(401, "invalid or missing API key (Authorization: Bearer ...)",
                                       type="authentication_error", code="invalid_api_key"), None)
            return await response(scope, receive, send_with_id)
        await self.app(scope, receive, send_with_id)


def _authorized(headers: dict, key: str) -> bool:
    """Authorization: Bearer <key> (the scheme's case is free, RFC 7235), compared in constant time."""
    scheme, _, given = headers.get("authorization", "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), key.encode())


def _unexpected(e: BaseException) -> APIError:
    """What no other handler turned into an APIError: a request's own sampling failing (say), or a bug."""
    return APIError(500, f"the request failed: {type(e).__name__}: {e}", type="server_error")


def _stopped() -> APIError:
    return APIError(503, "the server is stopping: the request was aborted before it finished",
                    type="service_unavailable")


def _failed(e: EngineError) -> APIError:
    """A request's stream failed: 400 where the pool cannot hold it beside the pinned contexts (the
    scheduler refused it), else 500 (the engine failed: a dead worker, named)."""
    if isinstance(e.__cause__, CapacityError):
        return bad(f"the request does not fit: {e.__cause__}", "messages")
    return APIError(500, str(e), type="server_error")


def _error(e: APIError, rid: str | None, headers: dict | None = None):
    headers = {**(headers or {}), **({"X-Request-Id": rid} if rid else {})}
    return JSONResponse(e.body(), status_code=e.status, headers=headers or None)


async def _json(request: Request):
    """The parsed body (in a thread, as tokenizing: a large one would hold up every other stream)."""
    raw = await request.body()
    try:
        body = await asyncio.to_thread(json.loads, raw) if len(raw) > 1 << 16 else json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise bad(f"the request body is not JSON: {e}") from None
    check_text(body)
    return body


def _check_text_length(state, chars: int, param: str) -> None:
    """400 before tokenizing a text that cannot fit: more characters than max_model_len tokens hold."""
    most = state.max_model_len * max_token_chars(state.tokenizer)
    if chars > most:
        raise bad(f"this model's maximum context length is {state.max_model_len} tokens; the prompt has {chars} "
                  f"characters, more than that many tokens can hold ({most})", param)


async def _prompt_ids(state, prompt, prefix=None) -> list[int]:
    vocab = state.vocab_size
    if isinstance(prompt, str):
        _check_text_length(state, len(prompt), "prompt")
        # in a thread: the tokenizer lets go of the GIL, the event loop serves the other streams meanwhile
        ids = (await asyncio.to_thread(state.tokenizer, prompt, add_special_tokens=prefix is None))["input_ids"]
    else:
        ids = list(prompt)
        bad_ids = [t for t in ids if not 0 <= t < vocab]
        if bad_ids:
            raise bad(f"prompt token ids {bad_ids[:5]} are outside the vocabulary [0, {vocab})", "prompt")
    return (list(prefix) if prefix else []) + ids


async def _chat_ids(state, messages, generation_prompt) -> list[int]:
    if getattr(state.tokenizer, "chat_template", None) is None:
        raise bad("this model's tokenizer has no chat template: use /v1/completions", "messages")
    _check_text_length(state, sum(len(m["content"]) for m in messages), "messages")
    return await asyncio.to_thread(_chat_template_ids, state.tokenizer, messages, generation_prompt)


def _chat_template_ids(tok, messages, generation_prompt) -> list[int]:
    out = tok.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=True)
    return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)


def _context_json(ctx):
    return {"name": ctx.name, "object": "context", "tokens": len(ctx.ids), "model": ctx.adapter,
            "kind": "messages" if ctx.messages is not None else "prompt", "saved": ctx.path is not None}


def _document_len(state, ids, messages, ctx) -> int:
    """The document a chat request starts with (for routing and the context store): a named
    context's tokens, else every message before the last one, when its tokens lead the prompt."""
    if ctx is not None:
        return len(ctx.ids)
    if len(messages) < 2:
        return 0
    head = _chat_template_ids(state.tokenizer, messages[:-1], generation_prompt=False)
    return len(head) if ids[:len(head)] == head else 0


async def _respond(request, state, metrics, ids, s, adapter, chat, doc_len=None):
    stream = state.submit(ids, s, adapter, s.max_tokens, doc_len=doc_len)
    metrics.started(len(ids))
    rid = new_id("chatcmpl" if chat else "cmpl")
    model = adapter or state.model_name
    if s.stream:
        return StreamingResponse(_sse(request, state, metrics, stream, ids, s, rid, model, chat),
                                 media_type="text/event-stream")
    watcher = asyncio.create_task(_abort_on_disconnect(request, stream))
    try:
        tokens = [t async for t in stream]
    except EngineError as e:                      # any other error: the app's handler (OpenAI's JSON, 500)
        raise _failed(e) from e
    finally:
        watcher.cancel()
    if stream.finish_reason == "abort":
        metrics.aborted()
        if await request.is_disconnected():
            raise APIError(499, "the request was aborted: its client went away", type="server_error")
        raise _stopped()
    det = Detokenizer(state.tokenizer, s.stop)
    text = det.add(tokens, final=True)
    reason = "stop" if det.stopped or stream.finish_reason == "stop" else "length"
    metrics.finished(stream, reason)
    lp = None
    if s.logprobs is not None:
        entries = logprob_entries(state.tokenizer, tokens, stream.scores, s.logprobs)
        lp = chat_logprobs(entries) if chat else completion_logprobs(entries)
    choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": lp, "finish_reason": reason}
              if chat else {"index": 0, "text": text, "logprobs": lp, "finish_reason": reason})
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": now(), "model": model,
            "choices": [choice], "usage": usage(len(ids), len(tokens), stream.cached_tokens)}


async def _abort_on_disconnect(request, stream, period=0.1):
    """A non-streamed response's client went away: abort its request (its blocks free at the next step)."""
    while not stream.finished:
        if await request.is_disconnected():
            stream.abort()
            return
        await asyncio.sleep(period)


def _event(payload) -> str:
    return f"data: {json.dumps(payload)}\n\n"


async def _sse(request, state, metrics, stream, ids, s, rid, model, chat):
    """A streamed response: one event per delta, the finish reason, usage (include_usage), [DONE].
    A client that disconnects closes this generator: its request is aborted."""
    created, det, n, lp_sent = now(), Detokenizer(state.tokenizer, s.stop), 0, 0
    kind = "chat.completion.chunk" if chat else "text_completion"

    def chunk(delta_text, reason=None, first=False, logprobs=None):
        if chat:
            delta = {"role": "assistant", "content": delta_text} if first else \
                ({"content": delta_text} if delta_text or reason is None else {})
            choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
        else:
            choice = {"index": 0, "text": delta_text, "logprobs": logprobs, "finish_reason": reason}
        return _event({"id": rid, "object": kind, "created": created, "model": model, "choices": [choice]})

    finished = False
    try:
        if chat:
            yield chunk("", first=True)
        async for t in stream:
            n += 1
            text = det.add([t])
            lp = None
            if s.logprobs is not None and stream.scores is not None:
                entries = logprob_entries(state.tokenizer, det.ids[lp_sent:], stream.scores[lp_sent:len(det.ids)],
                                          s.logprobs)
                lp_sent = len(det.ids)
                lp = chat_logprobs(entries) if chat else completion_logprobs(entries)
            if text or lp is not None:
                yield chunk(text, logprobs=lp)
            if det.stopped:
                stream.abort()                   # the engine stops on it too (StopStringCriteria), this may be first
                break
        if stream.finish_reason == "abort" and not det.stopped:     # not ours: the server stops
            yield _event(_stopped().body())
            yield "data: [DONE]\n\n"
            return
        tail = det.add([], final=True)
        if tail:
            yield chunk(tail)
        reason = "stop" if det.stopped or stream.finish_reason == "stop" else "length"
        yield chunk("", reason=reason)
        finished = True
        metrics.finished(stream, reason)
        if s.include_usage:
            yield _event({"id": rid, "object": kind, "created": created, "model": model, "choices": [],
                          "usage": usage(len(ids), n, stream.cached_tokens)})
        yield "data: [DONE]\n\n"
    except EngineError as e:
        yield _event(_failed(e).body())
        yield "data: [DONE]\n\n"
    except APIError as e:                        # a replica refused it (hetero serve --replicas): its error
        yield _event(e.body())
        yield "data: [DONE]\n\n"
    except Exception as e:                       # the request's own sampling failed
        yield _event(_unexpected(e).body())
        yield "data: [DONE]\n\n"
    finally:
        if not finished and not stream.finished:
            stream.abort()                       # the client went away (or the server stops)
            metrics.aborted()
