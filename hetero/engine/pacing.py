"""Step pacing: prompt chunks sized so a step that carries them stays within a time target while
requests are decoding (EngineConfig.step_time_target), i.e. their inter-token latency stays near it.

On a machine whose cores run the prompt chunks and the decode tokens in one forward (a CPU), a
step that carries a 512-token chunk takes as long as that chunk's prefill, and every decoding
request waits for it. The pacer learns from the steps themselves (nothing configured): the time
of a step of decode tokens alone, as a line in their number (least squares over the last WINDOW
such steps), and the time each prompt token adds on top of it (the median over the last WINDOW
steps that carried some); the scheduler then gives the next step's prompt chunks at most
(target - its decode time) / (time per prompt token) tokens, and at least MIN_PROMPT_TOKENS
(prompts always progress). Until it has timed two steps of decode tokens alone it asks for them
(a limit of 0: under a steady backlog every step would otherwise carry a prompt), then for
MIN_PROMPT_TOKENS until it has timed a step that carried some. Where prompt tokens seem to cost
nothing (steps that carried some were no slower than the decode line: noise), it allows twice
the most a step carried within the target, and no more. Steps with no decoding request
are not limited. Chunk sizes taken from measured time make runs differ in how prompts are
chunked: the greedy tokens do not change, the scores only by float rounding (as for any
chunking).

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
        self.alone: deque = deque(maxlen=WINDOW)     # (decode tokens, seconds) of steps without a prompt
        self.mixed: deque = deque(maxlen=WINDOW)     # (decode tokens, prompt tokens, seconds) of the others

    def decode_line(self) -> tuple[float, float] | None:
        """(base, per decode token): a step of decode tokens alone, as measured (None: not yet)."""
        if len(self.alone) < 2:
            return None
        d, s = np.array(self.alone, dtype=np.float64).T
        if np.ptp(d) == 0:
            return float(np.median(s)), 0.0
        slope, base = np.polyfit(d, s, 1)
        return float(base), max(float(slope), 0.0)

    def per_prompt_token(self, line: tuple[float, float]) -> float | None:
        """The time a prompt token adds to a step, over the decode `line` (None: not yet measured)."""
        base, slope = line
        added = [max(s - base - slope * d, 0.0) / p for d, p, s in self.mixed]
        return float(np.median(added)) if added else None

    def limit(self, decode_tokens: int) -> int | None:
        """Prompt tokens the next step may carry beside `decode_tokens` decode tokens (None: no limit)."""
        if self.target is None or decode_tokens == 0:
            return None
        line = self.decode_line()
        if line is None:
            return 0                          # a step of decode tokens alone, to time
        per = self.per_prompt_token(line)
        if per is None:
            return MIN_PROMPT_TOKENS          # a paced step, to time
        if per <= 0:                          # no cost seen over a noisy decode line: grow what stayed in time
            fast = [p for _, p, s in self.mixed if s <= self.target]
            return max(MIN_PROMPT_TOKENS, 2 * max(fast, default=0))
        room = self.target - (line[0] + line[1] * decode_tokens)
        return max(MIN_PROMPT_TOKENS, int(room / per))

    def record(self, seconds: float, prompt_tokens: int, decode_tokens: int) -> None:
        """A step's wall time, with the prompt tokens and decode tokens it computed."""
        if self.target is None or decode_tokens == 0:
            return                            # no decode time to learn from, none to protect
        if prompt_tokens == 0:
            self.alone.append((decode_tokens, seconds))
        else:
            self.mixed.append((decode_tokens, prompt_tokens, seconds))
