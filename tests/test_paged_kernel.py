"""The decode kernel reading KV through block tables (a paged pool): bit-identical to the arena's
contiguous blocks, appends through the table, and blocks shared by several requests read once."""
import numpy as np
import pytest
import torch

from hetero.cpu_attention import kernel as K
from hetero.cpu_attention.simd import BK
from hetero.offload.arena import ring_rows
from hetero.offload.session import merge_partials
from tests.test_kernel import TORCH, from_blocks, reference, to_blocks


def bits(t):
    """A torch tensor's storage as numpy (bf16/fp16 bits as uint16)."""
    return t.contiguous().view(torch.uint16).numpy().copy() if t.dtype != torch.float32 else t.numpy().copy()


def junk(shape, dtype, rng, nan=False):
    """Finite noise (or NaN) in storage dtype: what a pool's other blocks hold."""
    if dtype == np.float32:
        return np.full(shape, np.nan, np.float32) if nan else rng.standard_normal(shape, dtype=np.float32)
    return np.full(shape, 0x7FC0, np.uint16) if nan else (rng.integers(0, 2**16, shape, dtype=np.uint16) & 0x3FFF)


def to_pool(kb, vb, tables, NB, rng, nan=False):
    """Arena blocks kb [B, Hkv, n, D, BK] / vb [B, Hkv, n, D/W, BK, W] -> a pool of NB blocks with
    batch 1 ([1, 1, Hkv, NB, ...]: one layer) where request b's block i is tables[b, i], every other
    block junk."""
    Kp = junk((1, 1) + kb.shape[1:2] + (NB,) + kb.shape[3:], kb.dtype, rng, nan)
    Vp = junk((1, 1) + vb.shape[1:2] + (NB,) + vb.shape[3:], vb.dtype, rng, nan)
    for b in range(kb.shape[0]):
        for i in range(kb.shape[2]):
            Kp[0, 0, :, tables[b, i]], Vp[0, 0, :, tables[b, i]] = kb[b, :, i], vb[b, :, i]
    return Kp, Vp


def step(q, knew, vnew, Kc, Vc, lengths, T, window, nsplit, softcap, code, **kw):
    """run_alone on one layer (Kc/Vc: [1, ...], written in place): the units taken and the
    partials (o, m, l; slots never written stay NaN)."""
    B, Hq, _, D = q.shape
    G = Hq // Kc.shape[2]
    ns = nsplit + (kw.get("psplit", 1) if kw.get("pgroup") is not None else 0)
    po = np.full((B, Kc.shape[2], ns, G * T, D), np.nan, np.float32)
    pm = np.full(po.shape[:4], np.nan, np.float32)
    pl = pm.copy()
    lengths = np.asarray(lengths, np.int64)
    taken = K.run_alone(0, T, window, nsplit, D ** -0.5, softcap, code, q, knew, vnew, Kc, Vc, lengths,
                        np.argsort(-lengths, kind="stable"), po, pm, pl, np.zeros((G * T, D), np.float32),
                        np.zeros((G * T, D // 2), np.uint32), K.score_scratch(G * T), **kw)
    return taken, po, pm, pl


def merged(po, pm, pl, Hq, T):
    B, Hkv, _, _, D = po.shape
    out = merge_partials(*map(torch.from_numpy, (po, pm, pl)))            # [B, Hkv, G*T, D]
    return out.view(B, Hkv, Hq // Hkv, T, D).reshape(B, Hq, T, D)


CASES = [  # (Hq, Hkv, D, lengths, T, skip, window, softcap, ring)
    (8, 2, 64, (100, 37, 260), 1, None, 0, 0.0, False),                # GQA 4
    (8, 2, 64, (50, 91, 3), 4, (0, 1, 4), 9, 30.0, False),            # T > 1 with skip, window, softcap
    (16, 4, 128, (700, 33, 1100), 2, (1, 0, 0), 0, 0.0, False),       # passes of SB_MAX blocks, a split inside one
    (8, 2, 64, (300, 95, 64), 1, None, 40, 0.0, True),                # a ring (sliding-window layer)
    (8, 1, 64, (200, 120, 70), 3, (0, 2, 1), 40, 20.0, True),         # a ring, T > 1, skip, softcap, GQA 8
]
DTYPES = [(K.F32, False), (K.BF16, False), (K.BF16, True)]


@pytest.mark.parametrize("code,q_bf16", DTYPES, ids=["fp32", "bf16", "bf16-bf16q"])
@pytest.mark.parametrize("case", CASES, ids=[f"case{i}" for i in range(len(CASES))])
@pytest.mark.parametrize("nsplit", [1, 3])
def test_paged_is_bit_identical_to_contiguous(case, code, q_bf16, nsplit):
    """The same KV in the arena's contiguous blocks and in a pool under shuffled block tables
    (a ring of blocks per request for a ring layer, through run_job's Kr/Vr and rtables) gives
    the same partials bit for bit; each request's new rows land in its own blocks as in the
    arena, and no other block of the pool changes."""
    Hq, Hkv, D, lengths, T, skip, window, softcap, ring = case
    rng = np.random.default_rng(abs(hash((case, code, nsplit))) % 2**32)
    g = torch.Generator().manual_seed(int(rng.integers(2**31)))
    B = len(lengths)
    nblk = -(-(max(lengths) + T) // BK)
    q = torch.randn(B, Hq, T, D, generator=g)
    if q_bf16:
        q = q.bfloat16().float()
    krows = bits((torch.randn(B, Hkv, nblk * BK, D, generator=g) * 2).to(TORCH[code]))
    vrows = bits(torch.randn(B, Hkv, nblk * BK, D, generator=g).to(TORCH[code]))
    for b, L in enumerate(lengths):                   # rows >= L: zero in the arena (the step appends)
        krows[b, :, L:] = 0
        vrows[b, :, L:] = 0
    knew = bits(torch.randn(B, Hkv, T, D, generator=g).to(TORCH[code]))
    vnew = bits(torch.randn(B, Hkv, T, D, generator=g).to(TORCH[code]))
    kb, _ = to_blocks(krows, nblk * BK, code)
    _, vb = to_blocks(vrows, nblk * BK, code)
    if ring:                                          # the arena's ring: logical block i at i % nring
        nring = ring_rows(window, T) // BK
        kr = junk((B, Hkv, nring) + kb.shape[3:], kb.dtype, rng)
        vr = junk((B, Hkv, nring) + vb.shape[3:], vb.dtype, rng)
        for b, L in enumerate(lengths):
            for i in range(max(0, L - window + 1) // BK, L // BK + 1):
                kr[b, :, i % nring], vr[b, :, i % nring] = kb[b, :, i], vb[b, :, i]
        kb, vb = kr, vr
    n = kb.shape[2]
    NB = B * n + 7                                    # blocks no table names: junk that must stay as it is
    tables = rng.permutation(NB)[:B * n].reshape(B, n).astype(np.int64)
    Kp, Vp = to_pool(kb, vb, tables, NB, rng)
    before = Kp.copy(), Vp.copy()
    Kc, Vc = kb[None].copy(), vb[None].copy()
    kw = dict(skip=skip, ring=ring)
    t_c, *parts_c = step(q.numpy(), knew, vnew, Kc, Vc, lengths, T, window, nsplit, softcap, code, **kw)
    t_p, *parts_p = step(q.numpy(), knew, vnew, Kp, Vp, lengths, T, window, nsplit, softcap, code, tables=tables,
                         **kw)
    assert t_c == t_p == B * Hkv * nsplit
    for c, p in zip(parts_c, parts_p):
        np.testing.assert_array_equal(c, p)           # bit for bit (NaN where neither wrote)
    assert not np.isnan(parts_p[0][:, :, :nsplit]).any()
    # the pool after the step: the arena's blocks (appends included) under the table, the rest untouched
    want_K, want_V = before[0].copy(), before[1].copy()
    for b in range(B):
        for i in range(n):
            want_K[0, 0, :, tables[b, i]], want_V[0, 0, :, tables[b, i]] = Kc[0, b, :, i], Vc[0, b, :, i]
    np.testing.assert_array_equal(Kp, want_K)
    np.testing.assert_array_equal(Vp, want_V)
    changed = (Kc[0] != kb).any(axis=(3, 4))         # [B, Hkv, n]: the step appended somewhere
    assert changed.any()
    # and the outputs are right (the arena path's own tests check it more widely)
    out = merged(*parts_p, Hq, T)
    sk = skip or (0,) * B
    for b, L in enumerate(lengths):
        if sk[b] >= T:
            continue
        rows_k = np.concatenate([krows[b, :, :L], knew[b, :, sk[b]:]], 1)
        rows_v = np.concatenate([vrows[b, :, :L], vnew[b, :, sk[b]:]], 1)
        as_f = (lambda x: torch.from_numpy(x.view(np.int16)).view(TORCH[code]).float()) if code else torch.from_numpy
        ref = reference(q[b, :, sk[b]:], as_f(rows_k), as_f(rows_v), L, T - sk[b], window, D ** -0.5, softcap)
        torch.testing.assert_close(out[b, :, sk[b]:], ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("code", [K.F32, K.BF16])
@pytest.mark.parametrize("nring", [0, 3])
def test_put_row_lands_in_its_tables_block_only(code, nring):
    """put_row through a shuffled table writes row j at row j % BK of physical block
    tab[(j // BK) % ntab] (ntab = nring: a ring) and changes nothing else in the pool."""
    rng = np.random.default_rng(7)
    D, NB, n = 64, 23, nring or 9
    dt = K.NP_STORAGE[code]
    Kt = junk((NB, D, BK), dt, rng)
    Vt = junk((NB, D // 16, BK, 16), dt, rng)
    tab = rng.permutation(NB)[:n].astype(np.int64)
    for j in (0, 1, 31, 32, 33, 100, 2 * BK * n - 1 if nring else n * BK - 1):
        k, v = junk((D,), dt, rng), junk((D,), dt, rng)
        rk, rv = (x.copy() for x in from_blocks(Kt[None, None], Vt[None, None], code))   # [1, 1, NB*BK, D]
        K.put_row(Kt, Vt, tab, j, k, v, code)
        ak, av = from_blocks(Kt[None, None], Vt[None, None], code)
        row = tab[(j // BK) % n] * BK + j % BK
        rk[0, 0, row], rv[0, 0, row] = k, v
        np.testing.assert_array_equal(ak, rk)
        np.testing.assert_array_equal(av, rv)


@pytest.mark.parametrize("code", [K.F32, K.BF16])
@pytest.mark.parametrize("T,skip", [(1, None), (3, (0, 2, 1, 0))])
@pytest.mark.parametrize("nsplit,psplit", [(1, 1), (3, 2)])
def test_shared_blocks_are_read_once_for_their_group(code, T, skip, nsplit, psplit):
    """Requests 0-2 hold the same first P blocks (one group; request 3 shares nothing): grouped,
    their prefix units read those blocks once for all three (Hkv*psplit more units, and the
    members' own units start past them), with outputs equal to each request computed alone up to
    rounding, and bit-identical to the same group read in place from a Context's arena
    (run_job's sources path). Members 1 and 2's tables may point anywhere in the shared range:
    only a member's (the first) is read there. The shared blocks stay as they were."""
    Hq, Hkv, D, P = 8, 2, 64, 5
    lengths = np.array([P * BK + 7, P * BK, P * BK + 40, 90])
    B = len(lengths)
    rng = np.random.default_rng(T * 10 + nsplit + code)
    g = torch.Generator().manual_seed(T + code)
    nblk = -(-(int(lengths.max()) + T) // BK)
    q = torch.randn(B, Hq, T, D, generator=g)
    krows = bits((torch.randn(B, Hkv, nblk * BK, D, generator=g) * 2).to(TORCH[code]))
    vrows = bits(torch.randn(B, Hkv, nblk * BK, D, generator=g).to(TORCH[code]))
    krows[1:3, :, :P * BK], vrows[1:3, :, :P * BK] = krows[0, :, :P * BK], vrows[0, :, :P * BK]   # the shared rows
    for b, L in enumerate(lengths):
        krows[b, :, L:] = vrows[b, :, L:] = 0
    knew = bits(torch.randn(B, Hkv, T, D, generator=g).to(TORCH[code]))
    vnew = bits(torch.randn(B, Hkv, T, D, generator=g).to(TORCH[code]))
    kb, _ = to_blocks(krows, nblk * BK, code)
    _, vb = to_blocks(vrows, nblk * BK, code)
    # the pool: request 0's blocks, requests 1 and 2 naming the same first P, then blocks of their own
    NB = B * nblk + 4
    perm = rng.permutation(NB)
    tables = perm[:B * nblk].reshape(B, nblk).astype(np.int64)
    tables[1:3, :P] = tables[0, :P]
    poison = perm[-1]                                  # a NaN block no table names
    Kp, Vp = to_pool(kb, vb, tables, NB, rng)
    Kp[0, 0, :, poison] = junk(Kp.shape[4:], Kp.dtype, rng, nan=True)
    Vp[0, 0, :, poison] = junk(Vp.shape[4:], Vp.dtype, rng, nan=True)
    shared = Kp[0, 0, :, tables[0, :P]].copy(), Vp[0, 0, :, tables[0, :P]].copy()
    group = dict(pgroup=[0, 0, 0, -1], gblocks=[P], psplit=psplit, skip=skip)
    args = (T, 0, nsplit, 0.0, code)

    alone = step(q.numpy(), knew, vnew, Kp.copy(), Vp.copy(), lengths, *args, tables=tables, skip=skip)
    assert alone[0] == B * Hkv * nsplit
    pooled = Kp.copy(), Vp.copy()
    grouped = step(q.numpy(), knew, vnew, *pooled, lengths, *args, tables=tables, **group)
    assert grouped[0] == Hkv * psplit + B * Hkv * nsplit        # the group's units, then every request's own
    # members 1 and 2 name the poisoned block for every shared one: the result does not change
    bad = tables.copy()
    bad[1:3, :P] = poison
    poisoned = step(q.numpy(), knew, vnew, Kp.copy(), Vp.copy(), lengths, *args, tables=bad, **group)
    for a, b in zip(grouped[1:], poisoned[1:]):
        np.testing.assert_array_equal(a, b)
    assert np.isnan(step(q.numpy(), knew, vnew, Kp.copy(), Vp.copy(), lengths, *args, tables=bad, skip=skip)[1]).any()
    # the shared blocks were not written; the members' appends went to their own blocks
    np.testing.assert_array_equal(pooled[0][0, 0, :, tables[0, :P]], shared[0])
    np.testing.assert_array_equal(pooled[1][0, 0, :, tables[0, :P]], shared[1])
    # the same group in an arena: K/V hold each request's blocks (members' first P unused: NaN),
    # the shared blocks come from a Context's segment (sources)
    Ka, Va = kb[None].copy(), vb[None].copy()
    Ka[0, :3, :, :P] = junk(Ka[0, :3, :, :P].shape, Ka.dtype, rng, nan=True)
    Va[0, :3, :, :P] = junk(Va[0, :3, :, :P].shape, Va.dtype, rng, nan=True)
    src = (kb[None, :1, :, :P].copy(), vb[None, :1, :, :P].copy())       # [1, 1, Hkv, P, ...]
    arena = step(q.numpy(), knew, vnew, Ka, Va, lengths, *args, sources=([src[0]], [src[1]]), **group)
    assert arena[0] == grouped[0]
    for a, b in zip(grouped[1:], arena[1:]):
        np.testing.assert_array_equal(a, b)
    # equal to alone up to rounding (other split points), and to the reference
    out_g, out_a = merged(*grouped[1:], Hq, T), merged(*alone[1:], Hq, T)
    sk = skip or (0,) * B
    tol = dict(atol=2e-5, rtol=1e-4)
    as_f = (lambda x: torch.from_numpy(x.view(np.int16)).view(TORCH[code]).float()) if code else torch.from_numpy
    for b, L in enumerate(lengths):
        if sk[b] >= T:
            continue
        torch.testing.assert_close(out_g[b, :, sk[b]:], out_a[b, :, sk[b]:], atol=1e-6, rtol=1e-5)
        rows_k = np.concatenate([krows[b, :, :L], knew[b, :, sk[b]:]], 1)
        rows_v = np.concatenate([vrows[b, :, :L], vnew[b, :, sk[b]:]], 1)
        ref = reference(q[b, :, sk[b]:], as_f(rows_k), as_f(rows_v), L, T - sk[b], 0, D ** -0.5, None)
        torch.testing.assert_close(out_g[b, :, sk[b]:], ref, **tol)
