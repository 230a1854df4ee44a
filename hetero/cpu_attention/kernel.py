"""Numba decode attention over the CPU-resident KV cache.

Storage dtypes: float32 arrays, or uint16 arrays holding bf16 (code 1) or fp16
(code 2) bits, widened to fp32 in registers (numba has no CPU float16).

A *unit* is (request b, kv head h, sequence split s). For one unit the kernel
reads each K/V row once and uses it for all G = Hq/Hkv query heads and all T
query tokens (rows r = g*T + t), with an online (streaming) softmax. It writes
an unnormalised partial (o, m, l); `merge_partials` combines splits exactly:
    out = sum_s exp(m_s - M) o_s / sum_s exp(m_s - M) l_s,  M = max_s m_s.
This module imports no torch: workers load it.
"""
import math

import numpy as np
from numba import njit, types
from numba.extending import overload

from hetero.ipc.atomics import u32_as_f32

F32, BF16, F16 = 0, 1, 2           # storage dtype codes
NP_STORAGE = {F32: np.float32, BF16: np.uint16, F16: np.uint16}
BLOCK = 32                         # KV rows per softmax block


@njit(cache=True)
def f16_bits_to_f32(h):
    h = np.uint32(h)
    sign = (h & np.uint32(0x8000)) << np.uint32(16)
    e = (h >> np.uint32(10)) & np.uint32(0x1F)
    m = h & np.uint32(0x3FF)
    if e == 0:
        v = np.float32(m) * np.float32(5.9604644775390625e-08)  # subnormal: m * 2**-24
        return -v if sign else v
    if e == 31:
        return u32_as_f32(sign | np.uint32(0x7F800000) | (m << np.uint32(13)))
    return u32_as_f32(sign | ((e + np.uint32(112)) << np.uint32(23)) | (m << np.uint32(13)))


def to_f32(x, code):
    pass


@overload(to_f32)
def _to_f32(x, code):
    if isinstance(x, types.Float):
        return lambda x, code: np.float32(x)
    if isinstance(x, types.Integer):
        def impl(x, code):
            if code == BF16:
                return u32_as_f32(np.uint32(x) << np.uint32(16))
            return f16_bits_to_f32(x)
        return impl


# Reassociation lets LLVM vectorize the dot products and P.V sums; no nnan/ninf: masking uses -inf.
FASTMATH = {"reassoc", "contract", "nsz", "arcp"}


@njit(cache=True, fastmath=FASTMATH)
def attend_unit(q, kc, vc, b, h, G, T, c0, c1, L, window, scale, softcap, code,
                o, m, l, S, kf):
    """Attention of query rows (b, heads h*G..h*G+G-1, tokens 0..T-1) over KV rows [c0, c1).

    q: [B, Hq, Tmax, D] f32; kc/vc: [cap, D] storage; token t sits at position L+t and
    sees rows j <= L+t (and j > L+t-window when window > 0).
    Writes o [G*T, D] (unnormalised), m [G*T], l [G*T]. S [G*T, BLOCK] and kf [D] are scratch.
    """
    D = kc.shape[1]
    rows = G * T
    for r in range(rows):
        m[r] = -np.inf
        l[r] = 0.0
        for d in range(D):
            o[r, d] = 0.0
    for j0 in range(c0, c1, BLOCK):
        n = min(BLOCK, c1 - j0)
        # scores S[r, jj] = scale * q_r . k_{j0+jj}, masked
        for jj in range(n):
            j = j0 + jj
            for d in range(D):
                kf[d] = to_f32(kc[j, d], code)
            for g in range(G):
                for t in range(T):
                    r = g * T + t
                    pos = L + t
                    if j > pos or (window > 0 and j <= pos - window):
                        S[r, jj] = -np.inf
                        continue
                    acc = np.float32(0.0)
                    for d in range(D):
                        acc += q[b, h * G + g, t, d] * kf[d]
                    sc = acc * scale
                    if softcap > 0.0:
                        sc = softcap * math.tanh(sc / softcap)
                    S[r, jj] = sc
        # online softmax: rescale running sums to the new max, turn S into probabilities
        for r in range(rows):
            bm = -np.inf
            for jj in range(n):
                bm = max(bm, S[r, jj])
            if bm == -np.inf:
                for jj in range(n):
                    S[r, jj] = 0.0
                continue
            mn = max(m[r], bm)
            if m[r] != mn:
                alpha = np.float32(math.exp(m[r] - mn)) if m[r] != -np.inf else np.float32(0.0)
                l[r] *= alpha
                for d in range(D):
                    o[r, d] *= alpha
                m[r] = mn
            for jj in range(n):
                p = np.float32(math.exp(S[r, jj] - mn))
                S[r, jj] = p
                l[r] += p
        # o += P V, each V row read once for all rows
        for jj in range(n):
            j = j0 + jj
            for d in range(D):
                kf[d] = to_f32(vc[j, d], code)
            for r in range(rows):
                p = S[r, jj]
                if p != 0.0:
                    for d in range(D):
                        o[r, d] += p * kf[d]


@njit(cache=True)
def run_share(rank, nworkers, layer, T, window, nsplit, scale, softcap, code,
              q, knew, vnew, K, V, lengths, part_o, part_m, part_l, S, kf):
    """One worker's share of a decode step for one layer.

    Units u = (b*Hkv + h)*nsplit + s are dealt in contiguous ranges over workers.
    Split s of (b, h) covers an even slice of the old rows [lo, L); the last split
    also appends the T new k/v rows at [L, L+T) first and covers them, so no
    worker reads a row another worker is writing.
    q [B,Hq,Tmax,D] f32; knew/vnew [B,Hkv,Tmax,D]; K/V [layers,B,Hkv,cap,D];
    part_o [B,Hkv,NS,rows,D]; part_m/part_l [B,Hkv,NS,rows].
    """
    B = q.shape[0]
    Hq = q.shape[1]
    Hkv = K.shape[2]
    D = K.shape[4]
    G = Hq // Hkv
    units = B * Hkv * nsplit
    u0 = rank * units // nworkers
    u1 = (rank + 1) * units // nworkers
    for u in range(u0, u1):
        s = u % nsplit
        bh = u // nsplit
        h = bh % Hkv
        b = bh // Hkv
        L = lengths[b]
        lo = 0
        if window > 0:
            lo = max(0, L - window + 1)
        c0 = lo + s * (L - lo) // nsplit
        c1 = lo + (s + 1) * (L - lo) // nsplit
        if s == nsplit - 1:
            for t in range(T):
                for d in range(D):
                    K[layer, b, h, L + t, d] = knew[b, h, t, d]
                    V[layer, b, h, L + t, d] = vnew[b, h, t, d]
            c1 = L + T
        attend_unit(q, K[layer, b, h], V[layer, b, h], b, h, G, T, c0, c1, L, window, scale,
                    softcap, code, part_o[b, h, s], part_m[b, h, s], part_l[b, h, s], S, kf)


def choose_nsplit(batch, kv_heads, max_len, nworkers, nsplit_max, min_rows=256):
    """Sequence splits per (request, kv head): enough units to feed every worker, but
    no split shorter than `min_rows` rows. (The profiled planner replaces this.)"""
    want = -(-nworkers // (batch * kv_heads))
    return int(max(1, min(want, max_len // min_rows, nsplit_max)))


def warm_up():
    """Compile (or load from cache) both storage signatures on tiny inputs."""
    for dt, code in ((np.float32, F32), (np.uint16, BF16)):
        q = np.zeros((1, 2, 1, 4), np.float32)
        kv = np.zeros((1, 1, 1, 8, 4), dt)
        new = np.zeros((1, 1, 1, 4), dt)
        po = np.zeros((1, 1, 1, 2, 4), np.float32)
        pm = np.zeros((1, 1, 1, 2), np.float32)
        run_share(0, 1, 0, 1, 0, 1, np.float32(0.5), np.float32(0.0), code, q, new, new, kv, kv,
                  np.zeros(1, np.int64), po, pm, pm.copy(), np.zeros((2, BLOCK), np.float32),
                  np.zeros(4, np.float32))
