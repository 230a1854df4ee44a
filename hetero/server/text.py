"""Token ids to the text a response carries: incremental detokenization, stop strings, logprobs.

A response's text is the tokenizer's decoding of all its tokens so far (special tokens skipped);
each delta is what that adds. The end is held back while it may still change: an incomplete
UTF-8 sequence (decoded as U+FFFD), or the beginning of a stop string. A stop string ends the text
before it (OpenAI's semantics; the engine stops the request on it through HF's StopStringCriteria).
"""
from __future__ import annotations

import math
import weakref

import torch

_TOKEN_CHARS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class Detokenizer:
    def __init__(self, tokenizer, stop: list[str]):
        self.tok, self.stop = tokenizer, stop
        self.ids: list[int] = []
        self.sent = 0                        # characters of the text already returned
        self.stopped = False                 # a stop string was found: the text ends before it

    def _text(self) -> str:
        return self.tok.decode(self.ids, skip_special_tokens=True)

    def add(self, ids: list[int], final: bool = False) -> str:
        """The new text after these tokens (final: the last ones; nothing held back)."""
        if self.stopped:
            return ""
        self.ids += ids
        text = self._text()
        end = len(text)
        for s in self.stop:
            i = text.find(s, max(self.sent - len(s) + 1, 0))
            if i >= 0 and i < end:
                end, self.stopped = i, True
        if not self.stopped and not final:
            if text.endswith("\ufffd"):
                end = len(text) - 1
            for s in self.stop:                  # a tail that may begin a stop string waits
                for k in range(min(len(s) - 1, end - self.sent), 0, -1):
                    if text[end - k:end] == s[:k]:
                        end -= k
                        break
        end = max(end, self.sent)
        delta, self.sent = text[self.sent:end], end
        return delta


def logprob_entries(tokenizer, ids: list[int], scores: list[torch.Tensor], top: int) -> list[tuple]:
    """Per token: (its text, its logprob, [(alternative text, logprob)] * top) from the processed
    scores the engine kept (log-softmax over them: what the token was drawn from)."""
    out = []
    for t, s in zip(ids, scores):
        lp = torch.log_softmax(s.float(), -1)
        chosen = float(lp[t])
        alts = []
        if top:
            v, i = lp.topk(top)
            alts = [(tokenizer.decode([int(j)]), _finite(float(x))) for x, j in zip(v, i)]
        out.append((tokenizer.decode([t]), _finite(chosen), alts))
    return out


def _finite(x: float) -> float:
    return x if math.isfinite(x) else -9999.0       # JSON has no -inf (a token a processor masked)


def chat_logprobs(entries) -> dict:
    return {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode()),
                         "top_logprobs": [{"token": a, "logprob": alp, "bytes": list(a.encode())} for a, alp in alts]}
                        for t, lp, alts in entries]}


def completion_logprobs(entries) -> dict:
    offsets, pos = [], 0
    for t, _, _ in entries:
        offsets.append(pos)
        pos += len(t)
    return {"tokens": [t for t, _, _ in entries], "token_logprobs": [lp for _, lp, _ in entries],
            "top_logprobs": [dict(alts) for _, _, alts in entries], "text_offset": offsets}


def max_token_chars(tokenizer) -> int:
    """The most characters one token's text can hold: its vocabulary's longest entry (byte-level BPE
    writes a byte as a character, SentencePiece a space as one, so a token decodes to no more).
    A text of more than n times this many characters is more than n tokens (its first measure,
    before the tokenizer spends seconds on a megabyte)."""
    n = _TOKEN_CHARS.get(tokenizer)
    if n is None:
        n = _TOKEN_CHARS[tokenizer] = max(map(len, tokenizer.get_vocab()), default=1)
    return n
