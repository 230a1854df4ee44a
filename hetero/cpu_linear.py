"""A CPU fp32 model's linear layers in engine steps and calls: torch.mm(W, X^T) at 1-5 rows, oneDNN past.

torch's fp32 F.linear (X @ W^T) goes through MKL, slow on this AMD EPYC at every row count a
serving step has. SmolLM2's 30 layers' projections in turn (weights out of the caches, as in a
forward) and its LM head (49152 x 576), on the 2-core dev VM (bench/cpu_linear.py --ops,
cpu_linear_ops.json: medians of 5 rounds, ms):

  rows                      1     2     4     5     6     8    16    32    64   512
  projections  F.linear    41    61    59    70    78    63    52    74   116   703
               W @ X^T     24    16    28    37    41    48    47    64    99   642
               oneDNN      30    30    39    45    38    46    43    59    99   656
  LM head      F.linear    11    25    18    19    24    17    22    26    37   226
               W @ X^T      3     3     4     5     7     7    15    19    28   200
               oneDNN       4     6     7     7     7     7    10    15    23   172

So a step's rows go to torch.mm(W, X^T) at 1-5 (the weight as the left operand; one row goes as
two: torch.mm at one column is MKL's slower GEMV) and to oneDNN's fp32 matmul
(torch.ops.mkldnn._linear_pointwise, the op torch.compile's CPU backend emits for nn.Linear) at 6
and more: a decode step of many requests, a mixed step of decodes and a prompt chunk, a prompt
chunk. Where torch has no oneDNN, F.linear past 5 rows.

oneDNN keeps a primitive for each shape it has run (up to its cache's 1024), ~0.7-1.6 MB each
for SmolLM2's 1536 x 576 weight: every row count from 6 to 1200 through two such weight shapes
grew a process by 1.5-2.5 GB, and an engine's steps run many row counts. So the rows go padded
with zero rows to a bucket (8, 16, then four per octave: 20, 24, 28, 32, 40, ...; past 16 rows
at most 25 % more; 30 buckets up to 2048): four weight shapes over every row count from 6 to
2048 then held 120 MB. Decode-alone steps of real SmolLM2: bench/cpu_linear.py (README: "fp32
linear layers").

While an engine or a generator's call uses the model its fp32 CPU nn.Linear layers' class is
`_FastLinear`: an nn.Linear whose forward takes these paths inside an engine step or such a call
(`ACTIVE`, set in that thread's context), else nn.Linear's (HF generate itself, other threads).
The weights stay the layer's own, so a deep copy or a LoRA wrapper of its forward stays right;
the last user to finish puts nn.Linear back. The bits differ from F.linear's by float rounding,
as a batched forward's already do (scores within 1e-4 of HF's in fp32).

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

MM_ROWS = range(1, 6)     # rows (tokens) at which the weight goes on the left; more: oneDNN
ACTIVE: contextvars.ContextVar[bool] = contextvars.ContextVar("hetero_fast_linear", default=False)

_LOCK = threading.Lock()
_USERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()   # model -> its users (engines, calls) now


def _onednn() -> bool:
    """Whether this torch has oneDNN's fp32 linear (built with it, the op there and right)."""
    try:
        if not torch.backends.mkldnn.is_available():
            return False
        x, w, b = torch.ones(5, 3), torch.ones(2, 3), torch.ones(2)
        return bool(torch.equal(torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], ""), torch.full((5, 2), 4.0)))
    except (AttributeError, RuntimeError):
        return False


ONEDNN = _onednn()
_onednn_linear = torch.ops.mkldnn._linear_pointwise if ONEDNN else None   # (x, W, b, "none", [], "")


def bucket(m: int) -> int:
    """The rows oneDNN computes for m rows (m padded with zero rows): 8, 16, then four per octave."""
    if m <= 16:
        return 8 if m <= 8 else 16
    step = 1 << (m.bit_length() - 3)
    return -(-m // step) * step


class _FastLinear(torch.nn.Linear):
    """nn.Linear whose forward, inside an engine step or a generator's call (ACTIVE) in fp32, is
    torch.mm(W, X^T)^T at 1-5 rows (contiguous, as F.linear's output: the model views it) and
    oneDNN's linear at more (its rows padded to a bucket)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = x.numel() // self.in_features
        if x.dtype != torch.float32 or not ACTIVE.get() or not m or (m not in MM_ROWS and _onednn_linear is None) \
                or torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, self.weight, self.bias)):
            return F.linear(x, self.weight, self.bias)      # (oneDNN's op has no backward)
        x2 = x.reshape(m, self.in_features)
        if m in MM_ROWS:
            if m == 1:
                x2 = x2.expand(2, -1).contiguous()
            y = torch.mm(self.weight, x2.t())[:, :m].t().contiguous()
            if self.bias is not None:
                y += self.bias
        else:
            pad = bucket(m) - m
            if pad:
                x2 = torch.cat([x2, x2.new_zeros(pad, self.in_features)])
            b = self.bias if self.bias is None or self.bias.is_contiguous() else self.bias.contiguous()
            y = _onednn_linear(x2, self.weight, b, "none", [], "")[:m]   # leading rows: contiguous (it reads
            # a bias as contiguous: a strided view's values would be wrong)
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
