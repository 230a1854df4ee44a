"""Byte layout of one generate call's shared segment: the KV cache and the decode staging.

Both sides build the same `SessionLayout` from the same shape numbers, so the
parent and the workers agree on every offset. numpy only (workers import it).

  array    shape                          dtype    written by              read by
  lengths  [B]                            int64    main (after each step)  workers
  order    [B]                            int64    main (after each step)  workers: requests, longest first
  q        [B, Hq, Tmax, D]               f32      main (each layer)       workers
  knew     [B, Hkv, Tmax, D]              storage  main (each layer)       workers (append)
  vnew     [B, Hkv, Tmax, D]              storage  main (each layer)       workers (append)
  part_o   [B, Hkv, NS, G*Tmax, D]        f32      workers                 main (merge)
  part_m   [B, Hkv, NS, G*Tmax]           f32      workers                 main (merge)
  part_l   [B, Hkv, NS, G*Tmax]           f32      workers                 main (merge)
  K        [layers, B, Hkv, nblk, D, BK]  storage  main (prefill), workers (decode append)
  V        [layers, B, Hkv, nblk, D/W, BK, W]  storage  (same)
K and V are blocked (BK = 32 rows per block, nblk = cap / BK; see
hetero.cpu_attention.kernel for why): row j of a request lives in block j // BK;
bf16 K blocks are pair-interleaved inside (kernel.k_index).
"""
from dataclasses import dataclass

import numpy as np

from hetero.cpu_attention.kernel import NP_STORAGE
from hetero.cpu_attention.simd import BK, W
from hetero.ipc import shm

ALIGN = 4096


def _round(n, a=ALIGN):
    return (n + a - 1) // a * a


def whole_blocks(rows):
    """Rows rounded up to whole KV blocks: the `cap` a SessionLayout takes."""
    return _round(rows, BK)


@dataclass(frozen=True)
class SessionLayout:
    batch: int
    q_heads: int
    kv_heads: int
    head_dim: int
    cap: int          # KV rows per request (real prompt + max_new_tokens), a multiple of BK
    layers: int
    code: int         # storage dtype code (kernel.F32 / BF16 / F16)
    tmax: int = 1     # query tokens per decode step
    nsplit_max: int = 16

    def __post_init__(self):
        if self.cap % BK or self.head_dim % W:
            raise ValueError(f"cap must be a multiple of {BK} and head_dim of {W}, got {self.cap}, {self.head_dim}")

    def arrays(self):
        B, Hq, Hkv, D, T, NS = self.batch, self.q_heads, self.kv_heads, self.head_dim, self.tmax, self.nsplit_max
        rows = (Hq // Hkv) * T
        st = NP_STORAGE[self.code]
        return [
            ("lengths", (B,), np.int64),
            ("order", (B,), np.int64),
            ("q", (B, Hq, T, D), np.float32),
            ("knew", (B, Hkv, T, D), st),
            ("vnew", (B, Hkv, T, D), st),
            ("part_o", (B, Hkv, NS, rows, D), np.float32),
            ("part_m", (B, Hkv, NS, rows), np.float32),
            ("part_l", (B, Hkv, NS, rows), np.float32),
            ("K", (self.layers, B, Hkv, self.cap // BK, D, BK), st),
            ("V", (self.layers, B, Hkv, self.cap // BK, D // W, BK, W), st),
        ]

    def offsets(self):
        return shm.pack(self.arrays(), ALIGN)

    @property
    def nbytes(self):
        return self.offsets()[1]

    @property
    def kv_bytes(self):
        return 2 * self.layers * self.batch * self.kv_heads * self.cap * self.head_dim * np.dtype(NP_STORAGE[self.code]).itemsize

    def views(self, segment):
        """name -> numpy view into `segment` (a hetero.ipc.shm.Segment)."""
        return shm.views(segment, self.offsets())
