"""The OpenAI API's request bodies checked and turned into engine requests, and its responses.

Every field a request may carry is named here: the ones hetero runs, the ones it accepts only at
their neutral value (`n=1`, `echo=false`, penalties of 0, ...), and hetero's own extras (sent with
the `openai` client's `extra_body`: `context`, `top_k`, `repetition_penalty`, `min_tokens`,
`ignore_eos`). Anything else, or a value out of range, is an APIError naming it (400).
"""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any


class APIError(Exception):
    """An error as the OpenAI API returns it: an HTTP status and {"error": {...}}."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def __reduce__(self):                # pickled whole (a replica's error reaching the ingress through Ray)
        return APIError, (self.status, self.message, self.type, self.param, self.code)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


COMMON = {"model", "max_tokens", "temperature", "top_p", "n", "stream", "stream_options", "stop", "seed", "user",
          "presence_penalty", "frequency_penalty", "logit_bias", "logprobs",
          # hetero's own (extra_body)
          "context", "top_k", "repetition_penalty", "min_tokens", "ignore_eos"}
COMPLETION_FIELDS = COMMON | {"prompt", "echo", "best_of", "suffix"}
CHAT_FIELDS = COMMON | {"messages", "max_completion_tokens", "top_logprobs", "response_format", "tools",
                        "tool_choice", "parallel_tool_calls", "store", "metadata"}
# fields accepted only at these values (what they would change, hetero does not run)
NEUTRAL = {"n": (None, 1), "presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0),
           "logit_bias": (None, {}), "echo": (None, False), "best_of": (None, 1), "suffix": (None,),
           "tools": (None, []), "tool_choice": (None, "none"), "parallel_tool_calls": (None, False, True),
           "store": (None, False), "metadata": (None,)}
MAX_STOP = 4
MAX_TOP_LOGPROBS = 20
SAMPLING_EPS = 1e-5       # a temperature below it samples greedily (vLLM's rule: 1 / T would overflow the logits)


@dataclass
class Sampling:
    """What a request asks of the engine (Engine.add_request's keywords) and of the response."""
    max_tokens: int | None
    kwargs: dict                      # do_sample, temperature, top_p, top_k, repetition_penalty, min_new_tokens
    seed: int | None
    stop: list[str]
    stream: bool
    include_usage: bool
    ignore_eos: bool
    logprobs: int | None              # None: none; else how many top alternatives (0: the chosen token's only)
    context: str | None
    extra: dict = field(default_factory=dict)


def _number(body, name, lo, hi, default, integer=False):
    v = body.get(name)
    if v is None:
        return default
    ok = isinstance(v, int) if integer else isinstance(v, (int, float))
    if isinstance(v, bool) or not ok or not lo <= v <= hi:
        kind = "an integer" if integer else "a number"
        raise bad(f"{name} must be {kind} in [{lo}, {hi}], got {v!r}", name)
    return v if integer else float(v)        # JSON's 2 for 2.0: transformers' processors take floats


def _flag(body, name) -> bool:
    v = body.get(name)
    if v is not None and not isinstance(v, bool):
        raise bad(f"{name} must be true or false, got {v!r}", name)
    return bool(v)


def check_text(body) -> None:
    """Every string in a parsed body is text UTF-8 can carry: JSON lets a lone surrogate through
    ("\\ud800"), which no tokenizer takes. Iterative: the parser allows deeper nesting than a recursion."""
    stack = [(body, "")]
    while stack:
        x, where = stack.pop()
        if isinstance(x, str):
            try:
                x.encode("utf-8")
            except UnicodeEncodeError as e:
                raise bad(f"{where or 'the request body'} is not valid Unicode text (a lone surrogate "
                          f"{x[e.start:e.end]!r} at character {e.start})", _field(where)) from None
        elif isinstance(x, dict):
            stack += [(k, f"a field name in {where or 'the request body'}") for k in x]
            stack += [(v, f"{where}.{k}" if where else str(k)) for k, v in x.items()]
        elif isinstance(x, list):
            stack += [(v, f"{where}[{i}]") for i, v in enumerate(x)]


def check_fields(body: Any, allowed: set[str]) -> dict:
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise bad(f"unsupported field(s) {unknown}; supported: {sorted(allowed)}", unknown[0])
    for name, values in NEUTRAL.items():
        if name in body and not any(body[name] == v and type(body[name]) is type(v) or body[name] is v
                                    for v in values):
            raise bad(f"{name}={body[name]!r} is not supported (only {[v for v in values if v is not None]})", name)
    return body


def _field(where: str) -> str | None:
    """The top-level field a check_text path is in ("messages[0].content" -> "messages")."""
    if not where or where.startswith("a field"):
        return None
    return where.split("[")[0].split(".")[0] or None


def sampling(body: dict, chat: bool) -> Sampling:
    """The sampling fields of a completion or chat request (OpenAI's defaults: temperature 1)."""
    for name in ("max_tokens", "max_completion_tokens"):
        v = body.get(name)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise bad(f"{name} must be a positive integer, got {v!r}", name)
    max_tokens = body.get("max_completion_tokens") if chat and body.get("max_completion_tokens") is not None \
        else body.get("max_tokens")
    if not chat and max_tokens is None:
        max_tokens = 16                                  # the completions API's default
    temperature = _number(body, "temperature", 0, 2, 1.0)
    top_p = _number(body, "top_p", 0, 1, 1.0)
    if top_p == 0:
        raise bad("top_p must be > 0", "top_p")
    top_k = _number(body, "top_k", 0, 1 << 20, 0, integer=True)
    rep = _number(body, "repetition_penalty", 0.01, 10, 1.0)
    min_tokens = _number(body, "min_tokens", 0, 1 << 20, 0, integer=True)
    if max_tokens is not None and min_tokens > max_tokens:
        raise bad(f"min_tokens ({min_tokens}) must not be more than max_tokens ({max_tokens})", "min_tokens")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise bad(f"user must be a string, got {user!r}", "user")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not -(1 << 63) <= seed < 1 << 64):
        raise bad(f"seed must be an integer in [-2**63, 2**64), got {seed!r}", "seed")
    greedy = temperature < SAMPLING_EPS
    kwargs = {"do_sample": not greedy, "repetition_penalty": rep}
    if not greedy:               # top_k 0: the whole vocabulary (OpenAI's sampling), not transformers' 50
        kwargs.update(temperature=temperature, top_p=top_p, top_k=top_k)
    else:                        # no sampling flags: transformers warns about ones set beside greedy
        kwargs.update(temperature=1.0, top_p=1.0)
    if min_tokens:
        kwargs["min_new_tokens"] = min_tokens
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > MAX_STOP:
        raise bad(f"stop must be a non-empty string or a list of at most {MAX_STOP} of them, got {body.get('stop')!r}",
                  "stop")
    stream = body.get("stream")
    stream = False if stream is None else stream
    if not isinstance(stream, bool):
        raise bad(f"stream must be true or false, got {stream!r}", "stream")
    opts = body.get("stream_options")
    if opts is not None:
        if not stream:
            raise bad("stream_options is only allowed with stream=true", "stream_options")
        if not isinstance(opts, dict) or set(opts) - {"include_usage", "continuous_usage_stats"}:
            raise bad(f"stream_options takes include_usage, got {opts!r}", "stream_options")
    include_usage = _flag(opts or {}, "include_usage")
    ignore_eos = body.get("ignore_eos")
    ignore_eos = False if ignore_eos is None else ignore_eos
    if not isinstance(ignore_eos, bool):
        raise bad(f"ignore_eos must be true or false, got {ignore_eos!r}", "ignore_eos")
    logprobs = None
    if chat:
        if _flag(body, "logprobs"):
            logprobs = _number(body, "top_logprobs", 0, MAX_TOP_LOGPROBS, 0, integer=True)
        elif body.get("top_logprobs") is not None:
            raise bad("top_logprobs needs logprobs=true", "top_logprobs")
        fmt = body.get("response_format")
        if fmt is not None and fmt != {"type": "text"}:
            raise bad(f"response_format {fmt!r} is not supported (only {{'type': 'text'}})", "response_format")
    elif body.get("logprobs") is not None:
        logprobs = _number(body, "logprobs", 0, 5, 0, integer=True)
    context = body.get("context")
    if context is not None and not isinstance(context, str):
        raise bad(f"context must be a context's name (a string), got {context!r}", "context")
    return Sampling(max_tokens, kwargs, seed, stop, stream, include_usage, ignore_eos, logprobs, context)


def messages_of(body: dict) -> list[dict]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad("messages must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "developer"):
            raise bad(f"messages[{i}] must be an object with a role of system, user, assistant or developer",
                      f"messages[{i}]")
        content = m.get("content")
        if isinstance(content, list):              # [{"type": "text", "text": ...}]
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise bad(f"messages[{i}].content parts must be text parts", f"messages[{i}].content")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise bad(f"messages[{i}].content must be a string", f"messages[{i}].content")
        out.append({"role": "system" if m["role"] == "developer" else m["role"], "content": content})
    return out


def prompt_of(body: dict) -> str | list[int]:
    """A completion's prompt: a string, or token ids (one prompt: n and batches of prompts are not run)."""
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]
    if isinstance(p, str) and p:
        return p
    if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        return p
    raise bad("prompt must be a non-empty string or list of token ids (one prompt per request)", "prompt")


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage, with prompt_tokens_details.cached_tokens: the prompt tokens whose KV was found
    in the prefix cache (or a pinned or loaded document) rather than computed."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def queue_full(what: str) -> APIError:
    """429, OpenAI's rate_limit_error: `what` is full."""
    return APIError(429, f"{what} is full; retry later", type="rate_limit_error")
