"""Byte layout of one generate call's shared segment: the KV cache and the decode staging.

Both sides build the same `SessionLayout` from the same shape numbers, so the
parent and the workers agree on every offset. numpy only (workers import it).
Dp = head_dim rounded up to W (`SessionLayout.dpad`): heads are stored padded with zero
columns (zero q and K columns add nothing to a score, zero V columns give output columns
the parent drops).

  array    shape                               dtype    written by              read by
  lengths  [B]                                 int64    main (after each step)  workers
  skip     [B]                                 int64    main (after each step)  workers: step tokens not a request's own
  pstart   [B]                                 int64    main (before OPEN)      workers: first row stored here (shared before)
  pgroup   [B]                                 int64    main (before OPEN)      workers: shared-prefix group, -1: none
  gblocks  [NG]                                int64    main (before OPEN)      workers: a group's shared blocks
  psrc     [NG, 2]                             int64    main (before OPEN)      workers: its source's (cap, tmax)
  pnames   [NG, 64]                            uint8    main (before OPEN)      workers: its source's segment name
  order    [B]                                 int64    main (after each step)  workers: requests, longest first
  ringed   [layers]                            int64    main (before OPEN)      workers: 1 = layer kept in Kr/Vr
  q        [B, Hq, Tmax, Dp]                   f32      main (each layer)       workers
  knew     [B, Hkv, Tmax, Dp]                  storage  main (each layer)       workers (append)
  vnew     [B, Hkv, Tmax, Dp]                  storage  main (each layer)       workers (append)
  part_o   [B, Hkv, NS, G*Tmax, Dp]            f32      workers                 main (merge); NS = nparts
  part_m   [B, Hkv, NS, G*Tmax]                f32      workers                 main (merge)
  part_l   [B, Hkv, NS, G*Tmax]                f32      workers                 main (merge)
  K        [Lfull, B, Hkv, nblk, Dp, BK]       storage  main (prefill), workers (decode append); read by workers
  V        [Lfull, B, Hkv, nblk, Dp/W, BK, W]  storage  (same)
  Kr       [Lring, B, Hkv, nring, Dp, BK]      storage  (same): sliding-window layers, rings of nring blocks
  Vr       [Lring, B, Hkv, nring, Dp/W, BK, W] storage  (same)
K and V are blocked (BK = 32 rows per block, nblk = cap / BK; see
hetero.cpu_attention.kernel for why): row j of a request lives in block j // BK;
bf16 K blocks are pair-interleaved inside (kernel.k_index). A layer with a sliding
window keeps only the rows it can still see, in a ring: row j lives in block
(j // BK) % nring of its Kr/Vr (the kernel reads blocks through a block table, here the
identity over the array's blocks taken modulo its length: kernel.identity_table; the identity
for K/V). Layers keep their order inside K/V and
inside Kr/Vr (`layer_slots`).

A paged pool (`blocks` > 0, hetero.engine.paged) holds one "request" of `blocks` blocks whose
ids every request shares: K [Lfull, 1, Hkv, blocks, Dp, BK]; request slot b of a decode job reads
its rows through `tables` [B, maxblk] (row j in block tables[b, j // BK]; kernel.run_job), and
`groups` is then the most shared-prefix groups a job may post (their members and blocks are
chosen per step: pgroup, gblocks, and the job's NGROUPS word). A model that mixes windowed and
full layers keeps its windowed layers in a second pool of `ring // BK` blocks (Kr/Vr [Lring, 1,
Hkv, ring // BK, ...]; block ids of their own, hetero.engine.kv_pool.HybridKVCacheManager): request
slot b reads them through `rtables` [B, maxblk], which holds only the blocks its window still sees
(the others -1, never read).

  tables   [B, maxblk]                         int64    main (each step)        workers (paged only)
  rtables  [B, maxblk]                         int64    main (each step)        workers (paged ring layers only)

A batch continuing Contexts shares their KV (`groups` > 0): the requests continuing one
Context form a group, whose rows [0, pstart[b]) are that Context's first whole blocks, read
from its own segment (the workers map each group's source beside this one). K/V here hold
each request's rows from pstart[b] on, in `private` rows (row j in block (j // BK) % nblk, a
ring that never wraps: private >= cap - pstart[b] for every request).
"""
import mmap
from dataclasses import dataclass

import numpy as np

from hetero.cpu_attention.kernel import NP_STORAGE
from hetero.cpu_attention.simd import BK, W
from hetero.ipc import control as C, shm

ALIGN = max(4096, mmap.PAGESIZE)   # arrays start on page boundaries (a GPU page-locks them apart)


def _round(n, a=ALIGN):
    return (n + a - 1) // a * a


def whole_blocks(rows):
    """Rows rounded up to whole KV blocks: the `cap` a SessionLayout takes."""
    return _round(rows, BK)


def ring_rows(window, tmax=1):
    """Rows of a ring holding all that a decode step of up to tmax tokens reads or appends with a
    sliding window: rows [L - window + 1, L + tmax) (window + tmax - 1 rows, see
    kernel.unit_span), which start anywhere in a block and so span at most this many whole
    blocks. Distinct rows of that range then never share a ring block, so a step's appends
    overwrite only rows no query sees any more."""
    return (window + tmax - 1 + 2 * BK - 2) // BK * BK


def ring_plan(windows, cap, tmax=1):
    """(ring rows, per-layer flags) for per-layer sliding windows (0 = full attention): layers
    with a window are kept as rings when that is smaller than cap rows. One ring size serves
    them all (the largest window's)."""
    ring = max((ring_rows(w, tmax) for w in windows if w > 0), default=0)
    if ring == 0 or ring >= cap:
        return 0, (False,) * len(windows)
    return ring, tuple(w > 0 for w in windows)


def layer_slots(ringed):
    """Per layer, (kept as a ring?, its index in K/V or in Kr/Vr)."""
    count, out = [0, 0], []
    for r in ringed:
        r = int(bool(r))
        out.append((bool(r), count[r]))
        count[r] += 1
    return out


def slots_of(ringed):
    """layer_slots as the int64 array kernel.run_job takes: i >= 0 for K[i]/V[i], -i - 1 for Kr[i]/Vr[i]."""
    return np.array([-i - 1 if r else i for r, i in layer_slots(ringed)], np.int64)


@dataclass(frozen=True)
class SessionLayout:
    batch: int
    q_heads: int
    kv_heads: int
    head_dim: int     # the model's; stored padded to dpad
    cap: int          # KV rows per request (real prompt + max_new_tokens), a multiple of BK
    layers: int
    code: int         # storage dtype code (kernel.F32 / BF16 / F16)
    tmax: int = 1     # query tokens per decode step
    nsplit_max: int = 16
    ring: int = 0           # KV rows per request of a ring layer (see ring_plan), a multiple of BK; a paged
                            # pool's ring layers: rows of their own pool (its blocks * BK)
    ring_layers: int = 0    # layers kept as rings (Kr/Vr); the other layers keep cap rows (K/V)
    private: int = 0        # rows K/V hold per request (0: cap); less with shared prefixes (a multiple of BK)
    groups: int = 0         # shared-prefix groups (Contexts read in place), NG
    blocks: int = 0         # a paged pool's blocks (0: an arena of cap rows per request)
    maxblk: int = 0         # a paged pool's block-table width: blocks one request's rows span (more than
                            # the pool's blocks under a sliding window's ring: the entries it gave back are -1)

    def __post_init__(self):
        if self.cap % BK or self.ring % BK:
            raise ValueError(f"cap and ring must be multiples of {BK}, got {self.cap}, {self.ring}")
        if not 0 <= self.ring_layers <= self.layers or (self.ring_layers > 0) != (self.ring > 0):
            raise ValueError(f"{self.ring_layers} ring layers of {self.ring} rows in {self.layers} layers")
        if self.private % BK or not 0 <= self.private <= self.cap or \
                (self.groups and self.ring_layers and not self.blocks) or \
                not 0 <= self.groups <= self.batch:
            raise ValueError(f"{self.groups} shared-prefix groups, {self.private} private rows (cap {self.cap}, "
                             f"{self.ring_layers} ring layers, batch {self.batch})")
        if self.blocks and (self.private or self.maxblk <= 0):
            raise ValueError(f"a paged pool of {self.blocks} blocks: tables {self.maxblk} wide, "
                             f"{self.ring_layers} ring layers, {self.private} private rows")

    @property
    def paged(self):
        return self.blocks > 0

    @property
    def dpad(self):
        """The stored head dimension: head_dim rounded up to the tile width W."""
        return -(-self.head_dim // W) * W

    @property
    def nparts(self):
        """Partial slots per (request, kv head): the splits of its own rows, and of a shared prefix."""
        return self.nsplit_max * (2 if self.groups else 1)

    @property
    def nblk(self):
        """Blocks K/V hold per request (and layer, kv head); a paged pool's, all of them."""
        return self.blocks or (self.private or self.cap) // BK

    def arrays(self):
        B, Hq, Hkv, D, T, NS = self.batch, self.q_heads, self.kv_heads, self.dpad, self.tmax, self.nparts
        rows = (Hq // Hkv) * T
        st = NP_STORAGE[self.code]
        full, nring, nblk, NG = self.layers - self.ring_layers, self.ring // BK, self.nblk, max(self.groups, 1)
        KB = 1 if self.paged else B        # a paged pool is one "request" whose blocks the tables share
        return [
            ("lengths", (B,), np.int64),
            ("skip", (B,), np.int64),
            ("pstart", (B,), np.int64),
            ("pgroup", (B,), np.int64),
            ("gblocks", (NG,), np.int64),
            ("psrc", (NG, 2), np.int64),
            ("pnames", (NG, 64), np.uint8),
            ("order", (B,), np.int64),
            ("ringed", (self.layers,), np.int64),
            ("q", (B, Hq, T, D), np.float32),
            ("knew", (B, Hkv, T, D), st),
            ("vnew", (B, Hkv, T, D), st),
            ("part_o", (B, Hkv, NS, rows, D), np.float32),
            ("part_m", (B, Hkv, NS, rows), np.float32),
            ("part_l", (B, Hkv, NS, rows), np.float32),
            ("tables", (B, self.maxblk), np.int64),
            ("rtables", (B, self.maxblk if self.ring_layers else 0), np.int64),
            ("K", (full, KB, Hkv, nblk, D, BK), st),
            ("V", (full, KB, Hkv, nblk, D // W, BK, W), st),
            ("Kr", (self.ring_layers, KB, Hkv, nring, D, BK), st),
            ("Vr", (self.ring_layers, KB, Hkv, nring, D // W, BK, W), st),
        ]

    def offsets(self):
        return shm.pack(self.arrays(), ALIGN)

    @property
    def nbytes(self):
        return self.offsets()[1]

    @property
    def kv_bytes(self):
        rows = (self.layers - self.ring_layers) * self.nblk * BK + self.ring_layers * self.ring
        return 2 * (1 if self.paged else self.batch) * self.kv_heads * rows * self.dpad * np.dtype(NP_STORAGE[self.code]).itemsize

    def publish(self, words):
        """Write this layout's shape into the pool's control words (before CMD_OPEN)."""
        w = words
        w[C.S_BATCH], w[C.S_HQ], w[C.S_HKV], w[C.S_HDIM] = self.batch, self.q_heads, self.kv_heads, self.head_dim
        w[C.S_CAP], w[C.S_LAYERS], w[C.S_CODE], w[C.S_TMAX], w[C.S_NSPLIT_MAX] = (
            self.cap, self.layers, self.code, self.tmax, self.nsplit_max)
        w[C.S_RING], w[C.S_RING_LAYERS] = self.ring, self.ring_layers
        w[C.S_GROUPS], w[C.S_PRIVATE] = self.groups, self.private
        w[C.S_BLOCKS], w[C.S_MAXBLK] = self.blocks, self.maxblk

    @classmethod
    def from_words(cls, words):
        """The layout publish() wrote (a worker at CMD_OPEN)."""
        w = [int(x) for x in words]
        return cls(batch=w[C.S_BATCH], q_heads=w[C.S_HQ], kv_heads=w[C.S_HKV], head_dim=w[C.S_HDIM], cap=w[C.S_CAP],
                   layers=w[C.S_LAYERS], code=w[C.S_CODE], tmax=w[C.S_TMAX], nsplit_max=w[C.S_NSPLIT_MAX],
                   ring=w[C.S_RING], ring_layers=w[C.S_RING_LAYERS], private=w[C.S_PRIVATE], groups=w[C.S_GROUPS],
                   blocks=w[C.S_BLOCKS], maxblk=w[C.S_MAXBLK])

    def views(self, segment):
        """name -> numpy view into `segment` (a hetero.ipc.shm.Segment)."""
        return shm.views(segment, self.offsets())
