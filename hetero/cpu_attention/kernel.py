"""Numba decode attention over the CPU-resident KV cache.

Storage dtypes: float32 arrays, or uint16 arrays holding bf16 (code 1) or fp16
(code 2) bits (numba has no CPU float16), widened to fp32 in registers by simd.py.

Cache layout (per layer, request, kv head), in blocks of BK = 32 rows:
  K  [nblk, D, BK]        a block's keys transposed: its BK scores are two vectors
                          (bf16: pair-interleaved, each block is [D/2, BK, 2]; see k_index)
  V  [nblk, D/W, BK, W]   a block's values in W=16-wide column panels
so the inner products run register-tiled (see simd.py) and every block is one
contiguous read. Row j lives in block (j // BK) % nblk: the identity for a layer that keeps
every row, a ring for a sliding-window layer that keeps only the blocks its window can still
see (hetero.offload.arena); the kernel reads only those (unit_span). For bf16 storage and
bf16-exact queries (a bf16 model) on a CPU with AVX512-BF16 the scores use vdpbf16ps: exact
bf16 products, fp32 sums.

A *unit* is (request b, kv head h, sequence split s). For one unit the kernel
reads each K/V block once and uses it for all G = Hq/Hkv query heads and all T
query tokens (rows r = g*T + t), with an online (streaming) softmax taken over up to
SB_MAX blocks at a time (the per-row max, rescale and sum are paid once per pass). It writes
an unnormalised partial (o, m, l); the parent combines splits exactly:
    out = sum_s exp(m_s - M) o_s / sum_s exp(m_s - M) l_s,  M = max_s m_s
(attention sinks, gpt_oss: one more exp(sink - M) term in the denominator and in M;
hetero.offload.session.merge_partials).
This module imports no torch: workers load it.
"""
import math

import numpy as np
from numba import njit

from hetero.cpu_attention import simd
from hetero.cpu_attention.simd import BK, W
from hetero.ipc import atomics, control as C

F32, BF16, F16 = 0, 1, 2           # storage dtype codes
NP_STORAGE = {F32: np.float32, BF16: np.uint16, F16: np.uint16}


# Reassociation lets LLVM vectorize the softmax loops; no nnan/ninf: masking uses -inf.
FASTMATH = {"reassoc", "contract", "nsz", "arcp"}


SB_MAX = 32            # K blocks scored before each softmax pass: per row and pass one max and one
                       # rescale, and K and V are read in runs of up to 32 blocks (5% faster than 8 here)
S_FLOATS = 4096        # the score scratch holds at least this many floats (16 KB: half of L1)


def score_scratch(rows):
    """A worker's score scratch for up to `rows` query rows: room for [rows, BK] at least,
    and for several blocks' scores at once when rows are few."""
    return np.zeros(max(rows * BK, S_FLOATS), np.float32)


@njit(inline="always")
def _scores(qs, qp, dp, R, kt, blk, S, c0, code):
    r = 0
    while r + 4 <= R:
        simd.qk4(qs, qp, r, kt, blk, S, c0, code, dp)
        r += 4
    if r + 2 <= R:
        simd.qk2(qs, qp, r, kt, blk, S, c0, code, dp)
        r += 2
    if r < R:
        simd.qk1(qs, qp, r, kt, blk, S, c0, code, dp)


@njit(inline="always")
def _accumulate(S, c0, R, vt, blk, n, o, code):
    r = 0
    while r + 4 <= R:
        simd.pv4(S, r, c0, vt, blk, n, o, code)
        r += 4
    if r + 2 <= R:
        simd.pv2(S, r, c0, vt, blk, n, o, code)
        r += 2
    if r < R:
        simd.pv1(S, r, c0, vt, blk, n, o, code)


@njit(cache=True, fastmath=FASTMATH)
def attend_unit(qs, qp, dp, R, T, kt, vt, blk0, blk1, lo, hi, L, window, softcap, code, o, m, l, S):
    """Attention of query rows r < R (r = g*T + t, pre-scaled in qs [>=R, D]) over KV rows
    [lo, hi) in (logical) blocks [blk0, blk1). Token t sits at position L+t and sees rows j <= L+t
    (and j > L+t-window when window > 0).
    dp > 0 (bf16 only): scores from the unscaled bf16 pairs qp [>=R, D/2] u32, times dp.
    kt [nblk, D, BK] / vt [nblk, D/W, BK, W] storage, logical block blk at blk % nblk; writes
    o [>=R, D] (unnormalised), m/l [>=R]; S (score_scratch) is scratch.
    """
    D = o.shape[1]
    nphys = kt.shape[0]                                 # blocks stored (a ring when fewer than blk1)
    dps = np.float32(dp)                                # the intrinsics take float32
    nb = max(1, min(SB_MAX, S.size // (R * BK)))      # blocks per softmax pass
    Sv = S[:R * nb * BK].reshape((R, nb * BK))          # [R, nb*BK] scores, then probabilities
    for r in range(R):
        m[r] = -np.inf
        l[r] = 0.0
        for d in range(D):
            o[r, d] = 0.0
    for sb in range(blk0, blk1, nb):
        se = min(sb + nb, blk1)
        for blk in range(sb, se):
            _scores(qs, qp, dps, R, kt, blk % nphys, Sv, (blk - sb) * BK, code)
        j0, w = sb * BK, (se - sb) * BK                 # KV rows [j0, j0+w) scored
        if softcap > 0.0:
            for r in range(R):
                for jj in range(w):
                    Sv[r, jj] = softcap * math.tanh(Sv[r, jj] / softcap)
        # mask only the passes that cross a boundary: range ends, causal edge, window edge
        if j0 < lo or j0 + w > hi or j0 + w - 1 > L or (window > 0 and j0 <= L + T - 1 - window):
            for r in range(R):
                pos = L + r % T
                for jj in range(w):
                    j = j0 + jj
                    if j < lo or j >= hi or j > pos or (window > 0 and j <= pos - window):
                        Sv[r, jj] = -np.inf
        # online softmax: rescale the running sums to the new max, Sv becomes probabilities
        for r in range(R):
            bm = simd.rowmax(Sv, r, w, m[r])
            if bm == -np.inf:            # nothing visible yet in this row
                for jj in range(w):
                    Sv[r, jj] = 0.0
                continue
            alpha = simd.exp_neg(m[r] - bm)
            m[r] = bm
            l[r] = l[r] * alpha + simd.exp_row(Sv, r, w, bm)     # Sv[r, :w] = exp(Sv[r, :w] - bm)
            if alpha != 1.0:
                for d in range(D):
                    o[r, d] *= alpha
        for blk in range(sb, se):
            _accumulate(Sv, (blk - sb) * BK, R, vt, blk % nphys, min(BK, hi - blk * BK), o, code)


@njit(inline="always")
def k_index(d, jj, code):
    """(row, column) in a [D, BK] K block of element (dim d, block row jj)."""
    if code != BF16:
        return d, jj
    off = (d >> 1) * (2 * BK) + 2 * jj + (d & 1)      # pair-interleaved [D/2, BK, 2]
    return off // BK, off % BK


@njit(cache=True)
def put_row(K, V, j, k, v, code):
    """Write one KV row (k/v [D]) at row j of one (request, kv head)'s blocks K [nblk, D, BK],
    V [nblk, D/W, BK, W] (block (j // BK) % nblk)."""
    blk, jj = (j // BK) % K.shape[0], j % BK
    for d in range(k.shape[0]):
        kr, kc = k_index(d, jj, code)
        K[blk, kr, kc] = k[d]
        V[blk, d // W, jj, d % W] = v[d]


@njit(cache=True)
def unit_span(L, T, window, nsplit, s):
    """Blocks [blk0, blk1) and rows [lo, hi) of split s of a request with L cached rows."""
    lo = max(0, L - window + 1) if window > 0 else 0
    first = lo // BK
    nblk = (L + T + BK - 1) // BK - first
    blk0 = first + s * nblk // nsplit
    blk1 = first + (s + 1) * nblk // nsplit
    return blk0, blk1, max(lo, blk0 * BK), min(L + T, blk1 * BK)


@njit(cache=True)
def run_unit(u, layer, T, window, nsplit, scale, softcap, code, q, knew, vnew, K, V, lengths, order,
             part_o, part_m, part_l, qs, qp, S):
    """Unit u = (request order[u // (nsplit*Hkv)], kv head, split u % nsplit) of one layer's step.
    Split s of (b, h) covers whole blocks; before reading, it appends those of the T new rows
    (staged in knew/vnew, at rows L..L+T-1) that fall in its blocks, so no unit reads a row
    another unit is writing. Shapes: see run_job; K/V are the arrays holding this layer's KV
    (the arena's K/V, or Kr/Vr for a ring layer), `layer` indexes them."""
    Hq = q.shape[1]
    Hkv = K.shape[2]
    D = q.shape[3]
    G = Hq // Hkv
    R = G * T
    qbits = q.view(np.uint32)
    s = u % nsplit
    h = (u // nsplit) % Hkv
    b = order[u // (nsplit * Hkv)]
    L = lengths[b]
    Kt, Vt = K[layer, b, h], V[layer, b, h]
    blk0, blk1, lo, hi = unit_span(L, T, window, nsplit, s)
    for t in range(T):
        if lo <= L + t < hi:
            put_row(Kt, Vt, L + t, knew[b, h, t], vnew[b, h, t], code)
    exact = code == BF16 and simd.HAS_DPBF16   # bf16 q (a bf16 model): vdpbf16ps scores
    if exact:
        for g in range(G):
            for t in range(T):
                for d in range(D):
                    exact &= (qbits[b, h * G + g, t, d] & 0xFFFF) == 0
    dp = scale if exact else np.float32(0.0)
    for g in range(G):
        for t in range(T):
            r = g * T + t
            if exact:                      # qp[r, p] = bf16 pair (q[2p], q[2p+1]) of q[b, h*G + g, t]
                for p in range(D // 2):
                    lo_ = qbits[b, h * G + g, t, 2 * p] >> 16
                    qp[r, p] = (qbits[b, h * G + g, t, 2 * p + 1] & 0xFFFF0000) | lo_
            else:                          # qs[r] = scale * q[b, h*G + g, t]
                for d in range(D):
                    qs[r, d] = q[b, h * G + g, t, d] * scale
    attend_unit(qs, qp, dp, R, T, Kt, Vt, blk0, blk1, lo, hi, L, window, softcap,
                code, part_o[b, h, s], part_m[b, h, s], part_l[b, h, s], S)


@njit(cache=True)
def run_job(ctrl, fctrl, seq, busy, code, q, knew, vnew, K, V, Kr, Vr, slots, lengths, order,
            part_o, part_m, part_l, qs, qp, S):
    """One taker's part of attention job `seq` (a worker's, or the parent's: it takes units too).

    Units are taken one at a time from the job's tagged ticket (ctrl[TICKET], atomics.claim),
    requests in `order` (the parent's longest-first permutation, written once per step), so a
    taker that wakes late or shares its core does fewer units; one that wakes after the job
    ended takes none. The job's params (ctrl words LAYER, QLEN, WINDOW, NSPLIT, UNITS; fctrl
    F_SCALE, F_SOFTCAP) are read only after a successful claim: until this unit is finished
    (FIN fetch-added) the parent cannot start the next job. Any permutation gives the same
    result; the order only shortens the tail. Returns the number of units taken.
    q [B,Hq,Tmax,D] f32; knew/vnew [B,Hkv,Tmax,D]; lengths/order [B]; K/V [layers,B,Hkv,nblk,D,BK]
    and [layers,B,Hkv,nblk,D/W,BK,W], Kr/Vr likewise for ring layers; slots [layers]: layer i's
    KV is K[slots[i]] when >= 0, Kr[-slots[i] - 1] when < 0; part_o [B,Hkv,NS,rows,D];
    part_m/l [B,Hkv,NS,rows]; qs [rows, D] f32, qp [rows, D/2] u32 and S (score_scratch(rows))
    are the taker's scratch; ctrl[busy] <- seq on the first claim (who holds units).
    """
    taken = 0
    tag = seq & C.TAG_MASK                  # control.ticket_tag
    while True:
        left = atomics.claim(ctrl, C.TICKET, tag)
        if left == 0:
            return taken
        if taken == 0:
            atomics.atomic_store(ctrl, busy, seq)
        layer = ctrl[C.LAYER]
        slot = slots[layer]
        args = (ctrl[C.QLEN], ctrl[C.WINDOW], ctrl[C.NSPLIT], np.float32(fctrl[C.F_SCALE]),
                np.float32(fctrl[C.F_SOFTCAP]), code, q, knew, vnew)
        u = ctrl[C.UNITS] - left
        if slot >= 0:
            run_unit(u, slot, *args, K, V, lengths, order, part_o, part_m, part_l, qs, qp, S)
        else:
            run_unit(u, -slot - 1, *args, Kr, Vr, lengths, order, part_o, part_m, part_l, qs, qp, S)
        atomics.fetch_add(ctrl, C.FIN, 1)
        taken += 1


def run_alone(layer, T, window, nsplit, scale, softcap, code, q, knew, vnew, K, V, lengths, order,
              part_o, part_m, part_l, qs, qp, S):
    """Every unit of one layer's step in this process, through run_job and control words of its
    own (tests, warm-up). Returns the number of units taken."""
    ctrl = np.zeros(C.nbytes(1) // 8, np.int64)
    fctrl = ctrl.view(np.float64)
    units = lengths.shape[0] * K.shape[2] * nsplit
    ctrl[C.LAYER], ctrl[C.QLEN], ctrl[C.WINDOW], ctrl[C.NSPLIT], ctrl[C.UNITS] = layer, T, window, nsplit, units
    fctrl[C.F_SCALE], fctrl[C.F_SOFTCAP] = scale, softcap
    ctrl[C.TICKET] = C.ticket(1, units)
    slots = np.arange(K.shape[0], dtype=np.int64)
    taken = run_job(ctrl, fctrl, 1, C.PARENT_BUSY, code, q, knew, vnew, K, V, K, V, slots, lengths, order,
                    part_o, part_m, part_l, qs, qp, S)
    if taken != units or ctrl[C.FIN] != units:
        raise RuntimeError(f"run_job took {taken} of {units} units")
    return taken


def warm_up():
    """Compile (or load from cache) both storage signatures on tiny inputs."""
    for dt, code in ((np.float32, F32), (np.uint16, BF16)):
        D = W
        q = np.zeros((1, 2, 1, D), np.float32)
        K = np.zeros((1, 1, 1, 1, D, BK), dt)
        V = np.zeros((1, 1, 1, 1, 1, BK, W), dt)
        new = np.zeros((1, 1, 1, D), dt)
        po = np.zeros((1, 1, 1, 2, D), np.float32)
        pm = np.zeros((1, 1, 1, 2), np.float32)
        run_alone(0, 1, 0, 1, 0.5, 0.0, code, q, new, new, K, V, np.zeros(1, np.int64), np.zeros(1, np.int64),
                  po, pm, pm.copy(), np.zeros((2, D), np.float32), np.zeros((2, D // 2), np.uint32), score_scratch(2))
