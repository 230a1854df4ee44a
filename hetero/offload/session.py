"""Parent side of one generate call: the shared KV arena, prefill offload, decode steps.

The session creates (and alone unlinks) the segment described by
`SessionLayout`, maps it in the workers (CMD_OPEN), and exposes torch views of
it. Prefill writes each layer's real (unpadded) KV rows straight into the
arena; a decode step stages q/k/v, runs one CMD_ATTN job and merges the
workers' partials. Per-request lengths count real tokens only: request b's
row j holds its j-th real token, so left padding never reaches the cache.
"""
import numpy as np
import torch

from hetero.cpu_attention.kernel import BF16, F16, F32
from hetero.cpu_attention.planner import StaticPlanner
from hetero.cpu_attention.simd import BK, W
from hetero.ipc import control as C, shm
from hetero.offload.arena import SessionLayout, whole_blocks

STORAGE_CODES = {torch.float32: F32, torch.bfloat16: BF16, torch.float16: F16}


def merge_partials(o, m, l):
    """Exact combination of split partials: o [B, Hkv, ns, rows, D], m/l [B, Hkv, ns, rows]
    -> [B, Hkv, rows, D] (see hetero.cpu_attention.kernel)."""
    if o.shape[2] == 1:
        return o[:, :, 0] / l[:, :, 0, :, None]
    wgt = torch.exp(m - m.amax(2, keepdim=True))
    return (wgt[..., None] * o).sum(2) / (wgt * l).sum(2)[..., None]


class KVSession:
    def __init__(self, pool, spec, pads, real_lens, cap, planner=None):
        self.pool, self.spec = pool, spec
        self.planner = planner or StaticPlanner(pool.n)
        cap = whole_blocks(cap)
        self.batch = len(pads)
        self.pads = [int(p) for p in pads]            # left pads per request
        self.layout = SessionLayout(batch=self.batch, q_heads=spec.q_heads, kv_heads=spec.kv_heads,
                                    head_dim=spec.head_dim, cap=cap, layers=spec.layers,
                                    code=STORAGE_CODES[spec.dtype])
        self.prefilled = False
        self.opened = False
        shm.warn_if_small_pages(self.layout.nbytes)
        self.seg = shm.Segment(shm.new_name("kv"), self.layout.nbytes, create=True)
        try:
            v = self.layout.views(self.seg)
            self.lengths = v["lengths"]                 # numpy, real rows per request
            self.q = torch.from_numpy(v["q"])           # [B, Hq, Tmax, D] f32
            self.knew, self.vnew = self._storage(v["knew"]), self._storage(v["vnew"])
            self.K = self._storage(v["K"])              # [layers, B, Hkv, nblk, D, BK]
            self.V = self._storage(v["V"])              # [layers, B, Hkv, nblk, D/W, BK, W]
            self.part_o, self.part_m, self.part_l = (torch.from_numpy(v[n]) for n in ("part_o", "part_m", "part_l"))
            self.lengths[:] = 0
            self.order = v["order"]                     # numpy, the workers' unit order (see _plan_step)
            self.order[:] = np.arange(self.batch)
            self._real_lens = np.asarray(real_lens, np.int64)
            self._open()
        except BaseException:
            self.close()
            raise

    def _storage(self, arr):
        t = torch.from_numpy(arr)
        return t if arr.dtype == np.float32 else t.view(self.spec.dtype)

    def _open(self):
        if self.pool.session is not None:
            raise RuntimeError("this worker pool already serves an open KV session; close it first")
        w, lay = self.pool.words, self.layout
        w[C.S_BATCH], w[C.S_HQ], w[C.S_HKV], w[C.S_HDIM] = lay.batch, lay.q_heads, lay.kv_heads, lay.head_dim
        w[C.S_CAP], w[C.S_LAYERS], w[C.S_CODE], w[C.S_TMAX], w[C.S_NSPLIT_MAX] = (
            lay.cap, lay.layers, lay.code, lay.tmax, lay.nsplit_max)
        C.write_name(w, self.seg.name)
        self.pool.run(C.CMD_OPEN)
        self.opened = True
        self.pool.session = self

    # ---- prefill: the model's own attention runs; we offload its KV layer by layer
    def store_prefill(self, layer, key, value):
        """key/value: [B, Hkv, S, D] on the model's device (S includes left pads)."""
        for b, pad in enumerate(self.pads):
            self.write_rows(layer, b, key[b, :, pad:], value[b, :, pad:])

    def _kblocks(self, layer, b):
        """Request b's K blocks as [Hkv, nblk, D/P, BK, P]: P = 2 for bf16 (pair-interleaved,
        see kernel.k_index), else P = 1 (plain [D, BK] blocks)."""
        Kb = self.K[layer, b]                       # [Hkv, nblk, D, BK]
        P = 2 if self.layout.code == BF16 else 1
        Hkv, nblk, D, _ = Kb.shape
        return Kb.view(Hkv, nblk, D // P, BK, P)

    def write_rows(self, layer, b, key, value):
        """Rows 0..n-1 of request b: key/value [Hkv, n, D] (any device) into the blocked layout."""
        Hkv, n, D = key.shape
        full, rem = divmod(n, BK)
        Kb, Vb = self._kblocks(layer, b), self.V[layer, b]
        P = Kb.shape[-1]
        # [Hkv, full*BK, D] -> [Hkv, full, BK, D/P, P] -> K [Hkv, full, D/P, BK, P]
        Kb[:, :full].copy_(key[:, :full * BK].reshape(Hkv, full, BK, D // P, P).transpose(2, 3))
        # [Hkv, full*BK, D] -> [Hkv, full, BK, D/W, W] -> V [Hkv, full, D/W, BK, W]
        Vb[:, :full].copy_(value[:, :full * BK].reshape(Hkv, full, BK, D // W, W).transpose(2, 3))
        if rem:
            Kb[:, full, :, :rem].copy_(key[:, full * BK:].reshape(Hkv, rem, D // P, P).transpose(1, 2))
            Vb[:, full, :, :rem].copy_(value[:, full * BK:].reshape(Hkv, rem, D // W, W).transpose(1, 2))

    def read_rows(self, layer, b, n):
        """Inverse of write_rows: [Hkv, n, D] copies of request b's first n rows."""
        Kb, Vb = self._kblocks(layer, b), self.V[layer, b]
        Hkv, nblk, _, _, _ = Kb.shape
        D = self.layout.head_dim
        k = Kb.transpose(2, 3).reshape(Hkv, nblk * BK, D)[:, :n]
        v = Vb.transpose(2, 3).reshape(Hkv, nblk * BK, D)[:, :n]
        return k.clone(), v.clone()

    def finish_prefill(self):
        """Called after the last layer's prefill attention: later forwards are decode steps."""
        self.lengths[:] = self._real_lens
        self._plan_step(1)
        self.prefilled = True

    def _plan_step(self, T):
        """Workers, split count and request order (longest first: the longest units are taken
        first) for the next decode step: lengths change once per step, not per layer."""
        self.nactive, self.nsplit = self.planner.plan(self.lengths, T, self.layout)
        self.order[:] = np.argsort(-self.lengths, kind="stable")
        self._planned_T = T

    # ---- decode
    def stage_kv(self, key, value):
        """key/value: [B, Hkv, T, D], the new rows of this step (workers append them)."""
        T = key.shape[2]
        self.knew[:, :, :T].copy_(key)
        self.vnew[:, :, :T].copy_(value)

    def attend(self, layer, query, window, scale, softcap):
        """query [B, Hq, T, D] -> attention output [B, T, Hq, D] over the CPU KV cache."""
        B, Hq, T, D = query.shape
        if T > self.layout.tmax:
            raise NotImplementedError(f"decode steps of {T} query tokens (at most {self.layout.tmax} supported)")
        G, Hkv = Hq // self.spec.kv_heads, self.spec.kv_heads
        self.q[:, :, :T].copy_(query)
        if T != self._planned_T:
            self._plan_step(T)
        nsplit = self.nsplit
        w, f = self.pool.words, self.pool.floats
        w[C.LAYER], w[C.QLEN], w[C.WINDOW], w[C.NSPLIT] = layer, T, window or 0, nsplit
        f[C.F_SCALE], f[C.F_SOFTCAP] = scale, softcap or 0.0
        self.pool.run(C.CMD_ATTN, active=self.nactive)
        rows = G * T
        out = merge_partials(self.part_o[:, :, :nsplit, :rows], self.part_m[:, :, :nsplit, :rows],
                             self.part_l[:, :, :nsplit, :rows])    # [B, Hkv, G*T, D]
        out = out.view(B, Hkv, G, T, D).reshape(B, Hq, T, D)   # q head = h*G + g
        if layer == self.spec.layers - 1:
            self.lengths += T
            self._plan_step(T)
        return out.transpose(1, 2).to(query.device, query.dtype)

    def close(self):
        """Unmap in the workers and unlink. Idempotent; safe after a worker died."""
        if self.opened:
            self.opened = False
            self.pool.session = None
            if self.pool.alive:
                try:
                    self.pool.run(C.CMD_CLOSE, timeout=5.0)
                except Exception:
                    pass
        # drop every view first: a live view pins the mapping (and an output that keeps this
        # session through its cache would pin the whole arena)
        self.q = self.knew = self.vnew = self.K = self.V = None
        self.part_o = self.part_m = self.part_l = self.lengths = self.order = None
        self.seg.close()
