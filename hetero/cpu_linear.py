"""A CPU fp32 model's linear layers at 1-8 rows as torch.mm(W, X^T), in engine steps and calls.

A decode step of a few requests (an engine step, or a generator's call through HF's loop over
a batch) runs every linear layer at a few rows (M = the tokens of the step), and torch's fp32
F.linear (X @ W^T through MKL) is slow there: on the 2-core dev VM SmolLM2's LM head
(49152 x 576) takes 12 ms at M = 1, 28 ms at 2 and 41 ms at 3, where torch.mm(W, X^T), the
same product with the weight as the left operand, takes 5 ms at 2 and 3.
SmolLM2's 30 layers' projections in turn (weights out of the caches, as in a forward): 0.43x
F.linear's time at 1 and 2 rows, 0.58x at 4, 0.78-0.86x at 5-8, no gain past 8 (12 rows 1.38x,
16 0.84x, 18 1.14x). One row goes as two (the row twice: torch.mm at one column is MKL's slower
GEMV). Decode-alone steps of real SmolLM2: bench/cpu_linear.py (README: "fp32 decode steps").

While an engine or a generator's call uses the model its fp32 CPU nn.Linear layers' class is
`_FastLinear`: an nn.Linear whose forward takes that path inside an engine step or such a call
(`ACTIVE`, set in that thread's context) at 1-8 rows, else nn.Linear's (HF generate itself,
other threads, more rows). The weights stay the layer's own, so a deep copy or a LoRA wrapper
of its forward stays right; the last user to finish puts nn.Linear back. The bits differ from
F.linear's by float rounding, as a batched forward's already do (scores within 1e-4 of HF's in
fp32).

  state      written by                              read by
  _USERS     install / uninstall (under _LOCK)       the same
  ACTIVE     ModelRunner.execute, routing.routed     _FastLinear.forward
             (each in its own thread's context)
"""
from __future__ import annotations

import contextvars
import threading
import weakref

import torch
import torch.nn.functional as F

ROWS = range(1, 9)        # rows (tokens) at which the weight goes on the left
ACTIVE: contextvars.ContextVar[bool] = contextvars.ContextVar("hetero_fast_linear", default=False)

_LOCK = threading.Lock()
_USERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()   # model -> its users (engines, calls) now


class _FastLinear(torch.nn.Linear):
    """nn.Linear whose forward, inside an engine step or a generator's call (ACTIVE) at 1-8 rows of fp32, is
    torch.mm(W, X^T)^T (contiguous, as F.linear's output: the model views it)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = x.numel() // self.in_features
        if m not in ROWS or x.dtype != torch.float32 or not ACTIVE.get():
            return F.linear(x, self.weight, self.bias)
        x2 = x.reshape(m, self.in_features)
        if m == 1:
            x2 = x2.expand(2, -1).contiguous()
        y = torch.mm(self.weight, x2.t())[:, :m].t().contiguous()
        if self.bias is not None:
            y += self.bias
        return y.reshape(*x.shape[:-1], self.out_features)


def install(model) -> bool:
    """An engine or a generator's call over `model` starts using _FastLinear for its fp32 CPU
    nn.Linear layers (exactly nn.Linear: a subclass keeps its own forward). Whether any layer
    qualifies; pair with uninstall."""
    with _LOCK:
        layers = [m for m in model.modules() if type(m) in (torch.nn.Linear, _FastLinear)
                  and m.weight.dtype == torch.float32 and m.weight.device.type == "cpu"]
        if not layers:
            return False
        for m in layers:
            m.__class__ = _FastLinear
        _USERS[model] = _USERS.get(model, 0) + 1
    return True


def uninstall(model) -> None:
    """A user of `model` is done with _FastLinear: the last one puts nn.Linear back."""
    with _LOCK:
        left = _USERS.get(model, 0) - 1
        if left > 0:
            _USERS[model] = left
            return
        _USERS.pop(model, None)
        for m in model.modules():
            if type(m) is _FastLinear:
                m.__class__ = torch.nn.Linear
