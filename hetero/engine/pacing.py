"""Step pacing: prompt chunks sized so a step that carries them stays within a time target while
requests are decoding (EngineConfig.step_time_target), i.e. their inter-token latency stays near it.

On a machine whose cores run the prompt chunks and the decode tokens in one forward (a CPU), a
step that carries a 512-token chunk takes as long as that chunk's prefill, and every decoding
request waits for it. The pacer learns from the last WINDOW steps (nothing configured): the time
of a step of decode tokens alone, as a line in their number (least squares), and the time each
prompt token adds on top of it (the median over the steps that carried some); the scheduler then
gives the next step's prompt chunks at most (target - its decode time) / (time per prompt token)
tokens, and at least MIN_PROMPT_TOKENS (prompts always progress; also while it is still
learning). Steps with no decoding request are not limited. Chunk sizes taken from measured time
make runs differ in how prompts are chunked: the greedy tokens do not change, the scores only by
float rounding (as for any chunking).

  state    written by                     read by
  all      the step loop (record)         the step loop (limit), one thread
"""
from __future__ import annotations

from collections import deque

import numpy as np

MIN_PROMPT_TOKENS = 16       # prompt tokens a paced step still computes: a new document always progresses
WINDOW = 64                  # steps remembered


class Pacer:
    def __init__(self, target: float | None):
        self.target = target          # seconds a step may take while requests decode (None: no pacing)
        self.steps: deque = deque(maxlen=WINDOW)     # (decode tokens, prompt tokens, seconds)

    def decode_time(self, decode_tokens: int) -> float | None:
        """A step of `decode_tokens` decode tokens alone, as measured (None: not yet)."""
        alone = [(d, s) for d, p, s in self.steps if p == 0]
        if len(alone) < 2:
            return None
        d, s = np.array(alone, dtype=np.float64).T
        if np.ptp(d) == 0:
            return float(np.median(s))
        slope, base = np.polyfit(d, s, 1)
        return float(base + max(slope, 0.0) * decode_tokens)

    def per_prompt_token(self) -> float | None:
        """The time a prompt token adds to a step (None: not yet measured)."""
        added = []
        for d, p, s in self.steps:
            if p > 0:
                alone = self.decode_time(d)
                if alone is not None:
                    added.append(max(s - alone, 0.0) / p)
        return float(np.median(added)) if added else None

    def limit(self, decode_tokens: int) -> int | None:
        """Prompt tokens the next step may carry beside `decode_tokens` decode tokens (None: no limit)."""
        if self.target is None or decode_tokens == 0:
            return None
        alone, per = self.decode_time(decode_tokens), self.per_prompt_token()
        if alone is None or per is None:
            return MIN_PROMPT_TOKENS          # still learning
        room = self.target - alone
        return max(MIN_PROMPT_TOKENS, int(room / per) if per > 0 else 1 << 30)

    def record(self, seconds: float, prompt_tokens: int, decode_tokens: int) -> None:
        """A step's wall time, with the prompt tokens and decode tokens it computed."""
        if self.target is not None and decode_tokens > 0:     # no decode time to learn from, none to protect
            self.steps.append((decode_tokens, prompt_tokens, seconds))
