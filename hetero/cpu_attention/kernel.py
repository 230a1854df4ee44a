"""Numba decode attention over the CPU-resident KV cache.

Storage dtypes: float32 arrays, or uint16 arrays holding bf16 (code 1) or fp16
(code 2) bits (numba has no CPU float16), widened to fp32 in registers by simd.py.

Cache layout (per layer, request, kv head), in blocks of BK = 32 rows:
  K  [nblk, D, BK]        a block's keys transposed: its BK scores are two vectors
                          (bf16: pair-interleaved, each block is [D/2, BK, 2]; see k_index)
  V  [nblk, D/W, BK, W]   a block's values in W=16-wide column panels
so the inner products run register-tiled (see simd.py) and every block is one
contiguous read. Blocks are read through a block table `tab` (int64 [ntab]): row j lives in
physical block tab[(j // BK) % ntab]. In an arena (hetero.offload.arena) the table is the
identity over the array's blocks (identity_table: one arange per session, sliced), so row j is
in block (j // BK) % nblk: every row for a full layer, a ring for a sliding-window layer that
keeps only the blocks its window can still see; the kernel reads only those (unit_span). In a
paged pool (K [layers, 1, Hkv, NB, D, BK]: block ids shared by every request) request b's
table is its row of `tables` (hetero.engine.kv_pool's block_table). For bf16 storage and
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

from hetero.ipc.control import BF16, F16, F32  # noqa: E402  storage dtype codes (re-exported)
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
def _scores(qs, qp, dp, R, kt, blk, nxt, S, c0, code):
    r = 0
    while r + 4 <= R:
        simd.qk4(qs, qp, r, kt, blk, nxt, S, c0, code, dp)
        r += 4
    if r + 2 <= R:
        simd.qk2(qs, qp, r, kt, blk, nxt, S, c0, code, dp)
        r += 2
    if r < R:
        simd.qk1(qs, qp, r, kt, blk, nxt, S, c0, code, dp)


@njit(inline="always")
def _accumulate(S, c0, R, vt, blk, nxt, n, o, code):
    r = 0
    while r + 4 <= R:
        simd.pv4(S, r, c0, vt, blk, nxt, n, o, code)
        r += 4
    if r + 2 <= R:
        simd.pv2(S, r, c0, vt, blk, nxt, n, o, code)
        r += 2
    if r < R:
        simd.pv1(S, r, c0, vt, blk, nxt, n, o, code)


@njit(cache=True, fastmath=FASTMATH)
def attend_unit(qs, qp, dp, R, T, kt, vt, tab, blk0, blk1, lo, hi, L, window, softcap, code, o, m, l, S, sk):
    """Attention of query rows r < R (r = g*T + t, pre-scaled in qs [>=R, D]) over KV rows
    [lo, hi) in (logical) blocks [blk0, blk1). Token t sits at position L+t-sk and sees rows
    j <= L+t-sk (and j > L+t-sk-window when window > 0); the first sk tokens are skipped (a
    request with fewer new tokens than the step's T, see run_unit): they sit at L-1 (row 0 when
    L = 0), so their rows stay finite, and the caller ignores them.
    dp > 0 (bf16 only): scores from the unscaled bf16 pairs qp [>=R, D/2] u32, times dp.
    kt [nblk, D, BK] / vt [nblk, D/W, BK, W] storage, logical block blk at physical block
    tab[blk % ntab] (tab: int64 [ntab], the identity over nblk in an arena: a ring when fewer
    than blk1); the block read after blk is prefetched as it is read (simd._prefetch_ahead),
    and after the last, the block physically after it (the next unit's first in an arena).
    Writes o [>=R, D] (unnormalised), m/l [>=R]; S (score_scratch) is scratch.
    """
    D = o.shape[1]
    ntab = tab.shape[0]                                 # logical blocks the table maps (a ring when fewer than blk1)
    dps = np.float32(dp)                                # the intrinsics take float32
    nb = max(1, min(SB_MAX, S.size // (R * BK)))      # blocks per softmax pass
    Sv = S[:R * nb * BK].reshape((R, nb * BK))          # [R, nb*BK] scores, then probabilities
    pos_lo = L if sk == 0 else max(L - 1, 0)            # the rows' lowest and highest positions
    pos_hi = max(L + T - 1 - sk, pos_lo)
    for r in range(R):
        m[r] = -np.inf
        l[r] = 0.0
        for d in range(D):
            o[r, d] = 0.0
    for sb in range(blk0, blk1, nb):
        se = min(sb + nb, blk1)
        i0 = sb % ntab                                  # table index of block sb (then stepped: no division per block)
        i = i0
        for blk in range(sb, se):
            nxt = i + 1 if i + 1 < ntab else 0
            p = tab[i]
            _scores(qs, qp, dps, R, kt, p, tab[nxt] if blk + 1 < blk1 else p + 1, Sv, (blk - sb) * BK, code)
            i = nxt
        j0, w = sb * BK, (se - sb) * BK                 # KV rows [j0, j0+w) scored
        if softcap > 0.0:
            for r in range(R):
                for jj in range(w):
                    Sv[r, jj] = softcap * math.tanh(Sv[r, jj] / softcap)
        # mask only the passes that cross a boundary: range ends, causal edge, window edge
        if j0 < lo or j0 + w > hi or j0 + w - 1 > pos_lo or (window > 0 and j0 <= pos_hi - window):
            for r in range(R):
                t = r % T
                pos = L + t - sk if t >= sk else pos_lo
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
        i = i0
        for blk in range(sb, se):
            nxt = i + 1 if i + 1 < ntab else 0
            p = tab[i]
            _accumulate(Sv, (blk - sb) * BK, R, vt, p, tab[nxt] if blk + 1 < blk1 else p + 1, min(BK, hi - blk * BK),
                        o, code)
            i = nxt


@njit(inline="always")
def k_index(d, jj, code):
    """(row, column) in a [D, BK] K block of element (dim d, block row jj)."""
    if code != BF16:
        return d, jj
    off = (d >> 1) * (2 * BK) + 2 * jj + (d & 1)      # pair-interleaved [D/2, BK, 2]
    return off // BK, off % BK


@njit(cache=True)
def put_row(K, V, tab, j, k, v, code):
    """Write one KV row (k/v [D]) at row j of one (request, kv head)'s blocks K [nblk, D, BK],
    V [nblk, D/W, BK, W] through its block table tab (physical block tab[(j // BK) % ntab])."""
    blk, jj = tab[(j // BK) % tab.shape[0]], j % BK
    for d in range(k.shape[0]):
        kr, kc = k_index(d, jj, code)
        K[blk, kr, kc] = k[d]
        V[blk, d // W, jj, d % W] = v[d]


@njit(cache=True)
def unit_span(L, T, window, nsplit, s, start):
    """Blocks [blk0, blk1) and rows [lo, hi) of split s of a request with L cached rows and T
    new ones, from row `start` on (a multiple of BK: the rows before it are a shared prefix's)."""
    lo = max(start, L - window + 1) if window > 0 else start
    first = lo // BK
    nblk = (L + T + BK - 1) // BK - first
    blk0 = first + s * nblk // nsplit
    blk1 = first + (s + 1) * nblk // nsplit
    return blk0, blk1, max(lo, blk0 * BK), min(L + T, blk1 * BK)


@njit(inline="always")
def _stage_query(q, b, hq, t, r, scale, exact, qs, qp, qbits):
    """Query row r of a unit: qp[r] = q[b, hq, t]'s bf16 pairs (exact), else qs[r] = scale * q[b, hq, t]."""
    if exact:                              # qp[r, p] = bf16 pair (q[2p], q[2p+1])
        for p in range(q.shape[3] // 2):
            qp[r, p] = (qbits[b, hq, t, 2 * p + 1] & 0xFFFF0000) | (qbits[b, hq, t, 2 * p] >> 16)
    else:
        for d in range(q.shape[3]):
            qs[r, d] = q[b, hq, t, d] * scale


@njit(inline="always")
def _bf16_exact(qbits, b, h0, G, T):
    """Every query row of heads h0..h0+G-1 of request b is bf16-exact (a bf16 model's q)."""
    exact = True
    for g in range(G):
        for t in range(T):
            for d in range(qbits.shape[3]):
                exact &= (qbits[b, h0 + g, t, d] & 0xFFFF) == 0
    return exact


@njit(cache=True)
def run_unit(u, layer, T, window, nsplit, split0, scale, softcap, code, q, knew, vnew, K, V, tables, ident,
             lengths, order, skip, pstart, pgroup, part_o, part_m, part_l, qs, qp, S):
    """Unit u = (request order[u // (nsplit*Hkv)], kv head, split u % nsplit) of one layer's step,
    over the request's rows from pstart[b] on (0, or its shared prefix's end: see
    run_prefix_unit; 0 when the job has no prefix splits, split0 == 0); its partial goes to split
    slot split0 + s. Split s of (b, h) covers whole blocks; before
    reading, it appends those of the step's new rows (staged in knew/vnew) that fall in its
    blocks, so no unit reads a row another unit is writing. Request b's first skip[b] tokens
    of the step are not its own (a shorter continuation in a batch): not appended, and their
    rows of the output are ignored; its other tokens t go to rows L+t-skip[b]. A request in no
    shared-prefix group (pgroup[b] < 0) has no prefix partials: split 0 writes its slots
    0..split0-1 empty (m = -inf, l = 0), so the merge never reads a stale one.
    Shapes: see run_job; K/V are the arrays holding this layer's KV (the arena's K/V, or Kr/Vr
    for a ring layer), `layer` indexes them; tables their block tables: [B, MAXBLK] in a paged
    pool (K/V hold one "request": b reads K[layer, 0] through tables[b]), zero-width in an
    arena (b reads K[layer, b] through ident[:nblk], the identity)."""
    Hq = q.shape[1]
    Hkv = K.shape[2]
    G = Hq // Hkv
    R = G * T
    qbits = q.view(np.uint32)
    s = u % nsplit
    h = (u // nsplit) % Hkv
    b = order[u // (nsplit * Hkv)]
    L = lengths[b]
    sk = min(skip[b], T)
    if tables.shape[1] > 0:
        Kt, Vt, tab = K[layer, 0, h], V[layer, 0, h], tables[b]
    else:
        Kt, Vt, tab = K[layer, b, h], V[layer, b, h], ident[:K.shape[3]]
    if s == 0 and pgroup[b] < 0:
        for slot in range(split0):
            for r in range(R):
                part_m[b, h, slot, r] = -np.inf
                part_l[b, h, slot, r] = 0.0
                for d in range(part_o.shape[4]):
                    part_o[b, h, slot, r, d] = 0.0
    if sk == T:                        # none of the step's tokens is b's: a finite partial, ignored
        for r in range(R):
            part_m[b, h, split0 + s, r] = 0.0
            part_l[b, h, split0 + s, r] = 1.0
            for d in range(part_o.shape[4]):
                part_o[b, h, split0 + s, r, d] = 0.0
        return
    blk0, blk1, lo, hi = unit_span(L, T - sk, window, nsplit, s, pstart[b] if split0 > 0 else 0)
    for t in range(sk, T):
        if lo <= L + t - sk < hi:
            put_row(Kt, Vt, tab, L + t - sk, knew[b, h, t], vnew[b, h, t], code)
    exact = code == BF16 and simd.HAS_DPBF16 and _bf16_exact(qbits, b, h * G, G, T)   # vdpbf16ps scores
    for g in range(G):
        for t in range(T):
            _stage_query(q, b, h * G + g, t, g * T + t, scale, exact, qs, qp, qbits)
    dp = scale if exact else np.float32(0.0)
    attend_unit(qs, qp, dp, R, T, Kt, Vt, tab, blk0, blk1, lo, hi, L, window, softcap,
                code, part_o[b, h, split0 + s], part_m[b, h, split0 + s], part_l[b, h, split0 + s], S, sk)


@njit(cache=True)
def run_prefix_unit(u, group, layer, T, nsplit, pblocks, pgroup, scale, softcap, code, q, PK, PV, ptab, part_o,
                    part_m, part_l, pqs, pqp, pS, po, pm, pl):
    """Unit u = (kv head u // nsplit, split u % nsplit) of shared-prefix group `group`: the first
    pblocks blocks of its source (PK/PV: [layers, 1, Hkv, nblk, ...] read through ptab: a
    Context's arena and the identity, or the paged pool and a member's table, whose first
    pblocks entries every member's table holds; read only) attended by all its members' queries
    at once (the requests b with pgroup[b] == group,
    in order, m-th member's rows (m*G + g)*T + t), so each block is read once per step for
    them all. Every query of the step sits past the prefix: no mask. Member b's partial goes
    to split slot s of part_*[b, h] (its rows g*T + t, as run_unit's).
    pqs/pqp/pS/po/pm/pl: scratch for B*G*T rows."""
    B, Hq = q.shape[0], q.shape[1]
    Hkv = PK.shape[2]
    G = Hq // Hkv
    qbits = q.view(np.uint32)
    s, h = u % nsplit, u // nsplit
    blk0, blk1 = s * pblocks // nsplit, (s + 1) * pblocks // nsplit
    exact = code == BF16 and simd.HAS_DPBF16
    nm = 0
    for b in range(B):
        if pgroup[b] == group:
            exact = exact and _bf16_exact(qbits, b, h * G, G, T)
            nm += 1
    m = 0
    for b in range(B):
        if pgroup[b] == group:
            for g in range(G):
                for t in range(T):
                    _stage_query(q, b, h * G + g, t, (m * G + g) * T + t, scale, exact, pqs, pqp, qbits)
            m += 1
    dp = scale if exact else np.float32(0.0)
    # L = the prefix's end and T = 1: every row sits there and sees all of [blk0 * BK, blk1 * BK)
    attend_unit(pqs, pqp, dp, nm * G * T, 1, PK[layer, 0, h], PV[layer, 0, h], ptab, blk0, blk1, blk0 * BK,
                blk1 * BK, pblocks * BK, 0, softcap, code, po, pm, pl, pS, 0)
    rows = G * T
    m = 0
    for b in range(B):
        if pgroup[b] == group:
            for r in range(rows):
                part_m[b, h, s, r] = pm[m * rows + r]
                part_l[b, h, s, r] = pl[m * rows + r]
                for d in range(po.shape[1]):
                    part_o[b, h, s, r, d] = po[m * rows + r, d]
            m += 1


@njit(cache=True)
def run_job(ctrl, fctrl, seq, busy, code, q, knew, vnew, K, V, Kr, Vr, slots, tables, rtables, ident, lengths,
            order, skip, pstart, pgroup, gblocks, ngroups, part_o, part_m, part_l, qs, qp, S, PKs, PVs, pscratch):
    """One taker's part of attention job `seq` (a worker's, or the parent's: it takes units too).

    Units are taken one at a time from the job's tagged ticket (ctrl[TICKET], atomics.claim),
    requests in `order` (the parent's longest-first permutation, written once per step), so a
    taker that wakes late or shares its core does fewer units; one that wakes after the job
    ended takes none. The job's params (ctrl words LAYER, QLEN, WINDOW, NSPLIT, PSPLIT, UNITS;
    fctrl F_SCALE, F_SOFTCAP) are read only after a successful claim: until this unit is
    finished (FIN fetch-added) the parent cannot start the next job. Any permutation gives the
    same result; the order only shortens the tail. Returns the number of units taken.
    With ngroups shared-prefix groups (group g: its first gblocks[g] blocks, members pgroup[b] == g),
    units 0..ngroups*Hkv*PSPLIT-1 are theirs (run_prefix_unit, longest
    first), the rest are the requests' own rows from pstart[b] on (run_unit, split slots PSPLIT..).
    q [B,Hq,Tmax,D] f32; knew/vnew [B,Hkv,Tmax,D]; lengths/order/skip/pstart/pgroup [B]; slots [layers]: layer
    i's KV is K[slots[i]] when >= 0, Kr[-slots[i] - 1] when < 0; part_o [B,Hkv,NS,rows,D];
    part_m/l [B,Hkv,NS,rows]; qs [rows, D] f32, qp [rows, D/2] u32 and S (score_scratch(rows))
    are the taker's scratch, pscratch (pqs, pqp, pS, po, pm, pl) its scratch for prefix units
    (B*rows rows); ctrl[busy] <- seq on the first claim (who holds units).
    KV, two ways:
    - an arena (tables and rtables zero-width): K/V [layers,B,Hkv,nblk,D,BK] and
      [layers,B,Hkv,nblk,D/W,BK,W], Kr/Vr likewise (rings) for sliding-window layers, read through
      ident[:nblk] (identity_table: int64, at least as long as any of their block counts);
      group g's blocks are in PKs[g]/PVs[g] (tuples of MAX_GROUPS arrays, prefix_sources;
      [layers,1,Hkv,...]: a Context's arena).
    - a paged pool (tables [B, MAXBLK] int64): K/V [layers,1,Hkv,NB,...], request b's logical
      block i in physical block tables[b, i]; the job's groups are ctrl[NGROUPS] (not ngroups,
      which a paged taker ignores: they change per step); a group reads its first gblocks[g] blocks from K/V
      through its first member's table (every member's holds them at the same indices); PKs/PVs
      are unused. Layers in Kr/Vr [layers,1,Hkv,NR,...] read through rtables [B, NRT] (modulo its
      width: a ring of NRT blocks per request, or every block); their jobs must post PSPLIT 0
      (a ring's blocks are not shared), and then every request's rows are read from row 0.
    """
    taken = 0
    tag = seq & C.TAG_MASK                  # control.ticket_tag
    Hkv = K.shape[2]
    paged = tables.shape[1] > 0
    while True:
        left = atomics.claim(ctrl, C.TICKET, tag)
        if left == 0:
            return taken
        if taken == 0:
            atomics.atomic_store(ctrl, busy, seq)
        layer = ctrl[C.LAYER]
        slot = slots[layer]
        T, nsplit = ctrl[C.QLEN], ctrl[C.NSPLIT]
        ng = ctrl[C.NGROUPS] if paged else ngroups      # a paged pool's groups change per step
        psplit = ctrl[C.PSPLIT] if ng > 0 else 0
        scale, softcap = np.float32(fctrl[C.F_SCALE]), np.float32(fctrl[C.F_SOFTCAP])
        u = ctrl[C.UNITS] - left
        per_group = Hkv * psplit
        if u < ng * per_group:
            g = u // per_group
            pqs, pqp, pS, po, pm, pl = pscratch
            if paged:
                PK, PV, ptab = K, V, tables[_first_member(pgroup, g)]
            else:
                PK, PV = PKs[g], PVs[g]
                ptab = ident[:PK.shape[3]]
            run_prefix_unit(u % per_group, g, slot, T, psplit, gblocks[g], pgroup, scale, softcap, code, q,
                            PK, PV, ptab, part_o, part_m, part_l, pqs, pqp, pS, po, pm, pl)
        else:
            args = (T, ctrl[C.WINDOW], nsplit, psplit, scale, softcap, code, q, knew, vnew)
            u -= ng * per_group
            if slot >= 0:
                run_unit(u, slot, *args, K, V, tables, ident, lengths, order, skip, pstart, pgroup, part_o, part_m,
                         part_l, qs, qp, S)
            else:
                run_unit(u, -slot - 1, *args, Kr, Vr, rtables, ident, lengths, order, skip, pstart, pgroup, part_o,
                         part_m, part_l, qs, qp, S)
        atomics.fetch_add(ctrl, C.FIN, 1)
        taken += 1


@njit(inline="always")
def _first_member(pgroup, g):
    """The first request of group g (0 if none: a group has members)."""
    for b in range(pgroup.shape[0]):
        if pgroup[b] == g:
            return b
    return 0


def identity_table(*arrays):
    """run_job's `ident` for an arena: arange over the most blocks any of the KV arrays holds
    ([layers, B, Hkv, nblk, ...]; at least 1), made once per session: a unit reads ident[:nblk]."""
    return np.arange(max([a.shape[3] for a in arrays if a.ndim > 3] + [1]), dtype=np.int64)


NO_TABLES = np.zeros((0, 0), np.int64)     # run_job's tables/rtables in an arena: not paged


def prefix_scratch(rows, dpad):
    """A taker's scratch for shared-prefix units of `rows` query rows (B*G*Tmax; run_prefix_unit)."""
    rows = max(rows, 1)
    return (np.zeros((rows, dpad), np.float32), np.zeros((rows, dpad // 2), np.uint32), score_scratch(rows),
            np.zeros((rows, dpad), np.float32), np.zeros(rows, np.float32), np.zeros(rows, np.float32))


MAX_GROUPS = 4          # shared-prefix groups a session can read in place (more contexts are copied)


def prefix_sources(Ks, Vs, K, V):
    """run_job's PKs/PVs: tuples of MAX_GROUPS source K/V arrays (the groups', then placeholders of
    K/V's dtype and rank): one fixed signature, indexed by group at run time."""
    if len(Ks) > MAX_GROUPS:
        raise ValueError(f"{len(Ks)} shared-prefix groups; at most {MAX_GROUPS}")
    pad = MAX_GROUPS - len(Ks)
    return (tuple(Ks) + (np.zeros((1,) * K.ndim, K.dtype),) * pad,
            tuple(Vs) + (np.zeros((1,) * V.ndim, V.dtype),) * pad)


def run_alone(layer, T, window, nsplit, scale, softcap, code, q, knew, vnew, K, V, lengths, order,
              part_o, part_m, part_l, qs, qp, S, *, tables=None, ring=False, skip=None, pgroup=None, gblocks=None,
              psplit=1, sources=None):
    """Every unit of one layer's step in this process, through run_job and control words of its
    own (tests, warm-up, benchmarks). Returns the number of units taken.
    tables: [B, MAXBLK] block tables (K/V a paged pool, batch 1); None: an arena. ring: K/V are
    run_job's Kr/Vr (the layer's slot < 0; tables, if any, its rtables). pgroup/gblocks: shared-
    prefix groups (pstart[b] = gblocks[pgroup[b]] * BK), each in psplit splits, read from the pool
    (paged) or from sources = (Ks, Vs) (an arena: K/V then hold each request's rows from pstart
    on). skip [B]: run_job's (zeros by default)."""
    ctrl = np.zeros(C.nbytes(1) // 8, np.int64)
    fctrl = ctrl.view(np.float64)
    B, Hkv = lengths.shape[0], K.shape[2]
    zeros = np.zeros(B, np.int64)
    pgroup = zeros - 1 if pgroup is None else np.asarray(pgroup, np.int64)
    gblocks = zeros[:1] if gblocks is None else np.asarray(gblocks, np.int64)
    ngroups = int(pgroup.max()) + 1 if pgroup.size else 0
    pstart = np.where(pgroup >= 0, gblocks[np.maximum(pgroup, 0)] * BK, 0).astype(np.int64)
    units = ngroups * Hkv * psplit + B * Hkv * nsplit
    ctrl[C.LAYER], ctrl[C.QLEN], ctrl[C.WINDOW], ctrl[C.NSPLIT], ctrl[C.UNITS] = layer, T, window, nsplit, units
    ctrl[C.PSPLIT], ctrl[C.NGROUPS] = psplit, ngroups
    fctrl[C.F_SCALE], fctrl[C.F_SOFTCAP] = scale, softcap
    ctrl[C.TICKET] = C.ticket(1, units)
    tables = NO_TABLES if tables is None else np.ascontiguousarray(tables, np.int64)
    Ks, Vs = sources or ([], [])
    PKs, PVs = prefix_sources(Ks, Vs, K, V)
    ident = identity_table(K, *Ks)
    skip = zeros if skip is None else np.asarray(skip, np.int64)
    slots = np.arange(K.shape[0], dtype=np.int64)
    if ring:                    # no shared prefix in a ring layer: tables (for K/V) do not matter
        slots, kv, rtables, tables = -1 - slots, (K[:0], V[:0], K, V), tables, NO_TABLES
    else:
        kv, rtables = (K, V, K[:0], V[:0]), NO_TABLES
    taken = run_job(ctrl, fctrl, 1, C.PARENT_BUSY, code, q, knew, vnew, *kv, slots, tables, rtables, ident, lengths,
                    order, skip, pstart, pgroup, gblocks, ngroups, part_o, part_m, part_l, qs, qp, S, PKs, PVs,
                    prefix_scratch(B * qs.shape[0] if ngroups else 1, q.shape[3]))
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


def _drop_cache_if_simd_changed():
    """numba keys the cache of this module's functions on this file alone, but they inline the
    intrinsics of simd.py: after a change there (an edit, a checkout) numba would serve the old
    machine code. So the index of every cached function here is emptied (they compile again) when
    simd.py's digest differs from the one recorded beside the cache (kernel.simd-<digest>)."""
    import glob
    import hashlib
    import os

    cached = [f for f in globals().values() if hasattr(getattr(f, "_cache", None), "_cache_path")]
    if not cached:
        return
    with open(simd.__file__, "rb") as fh:
        digest = hashlib.sha1(fh.read()).hexdigest()[:16]
    path = cached[0]._cache._cache_path
    marker = os.path.join(path, f"kernel.simd-{digest}")
    if os.path.exists(marker):
        return
    try:
        os.makedirs(path, exist_ok=True)
        for f in cached:
            f._cache.flush()
        for old in glob.glob(os.path.join(path, "kernel.simd-*")):
            os.remove(old)
        open(marker, "w").close()
    except OSError:              # a read-only cache directory: numba does not write there either
        pass


_drop_cache_if_simd_changed()
