"""The numba decode-attention kernel against a torch reference."""
import math
import os

import numpy as np
import pytest
import torch

from hetero.cpu_attention import kernel as K, simd
from hetero.cpu_attention.simd import BK, W
from hetero.offload.session import merge_partials

TORCH = {K.F32: torch.float32, K.BF16: torch.bfloat16, K.F16: torch.float16}


def reference(q, k, v, L, T, window, scale, softcap, sinks=None):
    """q [Hq, T, D] f32; k/v [Hkv, L+T, D] f32 -> [Hq, T, D]; token t is at position L+t.
    sinks [Hq]: a logit per head joining the softmax with no value, as transformers' gpt_oss
    eager_attention_forward (concatenated after scaling and masking, then dropped)."""
    G = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(G, 0), v.repeat_interleave(G, 0)
    s = (q @ k.transpose(1, 2)) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    pos = L + torch.arange(T)[:, None]
    j = torch.arange(L + T)[None, :]
    allowed = j <= pos
    if window:
        allowed &= j > pos - window
    s = s.masked_fill(~allowed, -math.inf)
    if sinks is not None:
        s = torch.cat([s, sinks[:, None, None].expand(-1, T, 1)], -1)
        return torch.softmax(s, -1)[..., :-1] @ v
    return torch.softmax(s, -1) @ v


def to_blocks(rows, cap, code):
    """[B, Hkv, n, D] numpy rows -> blocked K [B, Hkv, nblk, D, BK] and V [B, Hkv, nblk, D/W, BK, W]
    (zero-padded); bf16 K blocks hold [D/2, BK, 2] (pair-interleaved)."""
    B, Hkv, n, D = rows.shape
    nblk, P = cap // BK, 2 if code == K.BF16 else 1
    padded = np.zeros((B, Hkv, nblk * BK, D), rows.dtype)
    padded[:, :, :n] = rows
    kb = padded.reshape(B, Hkv, nblk, BK, D // P, P).transpose(0, 1, 2, 4, 3, 5).reshape(B, Hkv, nblk, D, BK)
    vb = padded.reshape(B, Hkv, nblk, BK, D // W, W).transpose(0, 1, 2, 4, 3, 5)
    return np.ascontiguousarray(kb), np.ascontiguousarray(vb)


def from_blocks(kb, vb, code):
    """Inverse of to_blocks: rows [B, Hkv, nblk*BK, D] of K and of V."""
    B, Hkv, nblk, D, _ = kb.shape
    P = 2 if code == K.BF16 else 1
    return (kb.reshape(B, Hkv, nblk, D // P, BK, P).transpose(0, 1, 2, 4, 3, 5).reshape(B, Hkv, nblk * BK, D),
            vb.transpose(0, 1, 2, 4, 3, 5).reshape(B, Hkv, nblk * BK, D))


def run_kernel(q, kst, vst, lengths, T, window, scale, softcap, code, nsplit, sinks=None):
    """Drive run_job exactly as the workers do, with the new rows staged in knew/vnew; merge
    as KVSession.attend does (sinks [Hq]: row g*T + t of kv head h takes sinks[h*G + g])."""
    B, Hq, _, D = q.shape
    Hkv, cap = kst.shape[1], -(-kst.shape[2] // BK) * BK
    G = Hq // Hkv
    as_np = (lambda t: t.contiguous().view(torch.uint16).numpy().copy()) if code else (lambda t: t.contiguous().numpy().copy())
    krows, vrows = as_np(kst), as_np(vst)               # [B, Hkv, n, D]
    knew = np.stack([krows[b, :, lengths[b]:lengths[b] + T] for b in range(B)])
    vnew = np.stack([vrows[b, :, lengths[b]:lengths[b] + T] for b in range(B)])
    for b in range(B):                                   # the workers must append these themselves
        krows[b, :, lengths[b]:] = 0
        vrows[b, :, lengths[b]:] = 0
    kb, _ = to_blocks(krows, cap, code)
    _, vb = to_blocks(vrows, cap, code)
    Kc, Vc = kb[None], vb[None]                          # one layer
    po = np.full((B, Hkv, nsplit, G * T, D), np.nan, np.float32)
    pm = np.full((B, Hkv, nsplit, G * T), np.nan, np.float32)
    pl = pm.copy()
    taken = K.run_alone(0, T, window, nsplit, scale, softcap or 0, code, q.numpy(), knew, vnew, Kc, Vc,
                        np.asarray(lengths, np.int64), np.argsort(-np.asarray(lengths)), po, pm, pl,
                        np.zeros((G * T, D), np.float32), np.zeros((G * T, D // 2), np.uint32), K.score_scratch(G * T))
    assert taken == B * Hkv * nsplit                        # every unit taken once
    po, pm, pl = map(torch.from_numpy, (po, pm, pl))
    sink = None if sinks is None else sinks.view(Hkv, G, 1).expand(Hkv, G, T).reshape(Hkv, G * T)
    out = merge_partials(po, pm, pl, sink)                             # [B, Hkv, G*T, D]
    Kr, Vr = from_blocks(Kc[0], Vc[0], code)
    return out.view(B, Hkv, G, T, D).reshape(B, Hq, T, D), Kr, Vr


CASES = [  # (Hq, Hkv, D, lengths, T, window, softcap)
    (8, 8, 64, (37, 100), 1, 0, None),        # MHA (group 1)
    (16, 4, 128, (257, 64), 1, 0, None),      # group 4, head dim 128
    (32, 4, 64, (95, 3), 1, 0, None),         # group 8
    (8, 2, 64, (130, 61), 1, 17, None),       # sliding window
    (8, 2, 128, (77, 200), 1, 0, 20.0),       # softcap
    (8, 2, 64, (50, 91), 4, 9, 30.0),         # q_len 4 + window + softcap
    (4, 1, 64, (1, 33), 3, 0, None),          # tiny context, q_len 3
    (16, 4, 128, (2100, 700), 2, 0, None),    # several softmax passes of SB_MAX blocks
    (8, 2, 64, (1500, 999), 1, 300, None),    # window edge inside a pass
    (64, 1, 64, (1000, 37), 1, 0, None),      # 64 query rows: 2 blocks per pass
    (40, 1, 64, (400, 31), 8, 0, None),       # 320 query rows: one block per pass, scratch sized by rows
    (4, 4, 64, (3000, 1100), 1, 0, None),     # MHA: 32-block passes
]


# (storage code, q rounded to bf16): a bf16 model's q is bf16-exact, which takes the
# vdpbf16ps score path where the CPU has AVX512-BF16; fp32 q takes the widening path.
DTYPES = [(K.F32, False), (K.BF16, False), (K.BF16, True), (K.F16, False)]


@pytest.mark.parametrize("code,q_bf16", DTYPES, ids=["fp32", "bf16", "bf16-bf16q", "fp16"])
@pytest.mark.parametrize("case", CASES, ids=[f"case{i}" for i in range(len(CASES))])
@pytest.mark.parametrize("nsplit", [1, 4])
def test_kernel_matches_reference(case, code, q_bf16, nsplit):
    Hq, Hkv, D, lengths, T, window, softcap = case
    g = torch.Generator().manual_seed(hash((case, code)) % 2**31)
    B, cap = len(lengths), max(lengths) + T + 5
    q = torch.randn(B, Hq, T, D, generator=g)
    if q_bf16:
        q = q.bfloat16().float()
    kst = (torch.randn(B, Hkv, cap, D, generator=g) * 2).to(TORCH[code])
    vst = torch.randn(B, Hkv, cap, D, generator=g).to(TORCH[code])
    scale = D ** -0.5
    out, Kc, Vc = run_kernel(q, kst, vst, lengths, T, window, scale, softcap, code, nsplit)
    for b, L in enumerate(lengths):
        ref = reference(q[b], kst[b, :, :L + T].float(), vst[b, :, :L + T].float(), L, T, window, scale, softcap)
        torch.testing.assert_close(out[b], ref, atol=2e-5, rtol=1e-4)
        # the appended rows are bit-identical to the staged ones
        for stored, src in ((Kc, kst), (Vc, vst)):
            expect = src[b, :, L:L + T]
            expect = expect.view(torch.uint16).numpy() if code else expect.numpy()
            np.testing.assert_array_equal(stored[b, :, L:L + T], expect)


SINK_CASES = [CASES[1], CASES[5], CASES[8]]    # group 4; q_len 4 + window + softcap; window edge


@pytest.mark.parametrize("sink_scale", [0.0, 3.0, 50.0], ids=["small", "comparable", "dominant"])
@pytest.mark.parametrize("case", SINK_CASES, ids=[f"case{i}" for i in range(len(SINK_CASES))])
@pytest.mark.parametrize("nsplit", [1, 4])
def test_merge_with_sinks_matches_softmax_with_sink_column(case, sink_scale, nsplit):
    """merge_partials' sink term == a softmax over the scores with the sink logit appended
    (gpt_oss), for one split and several; a dominant sink (above every score) sets the max."""
    Hq, Hkv, D, lengths, T, window, softcap = case
    g = torch.Generator().manual_seed(11)
    B, cap = len(lengths), max(lengths) + T + 5
    q = torch.randn(B, Hq, T, D, generator=g)
    kst, vst = torch.randn(B, Hkv, cap, D, generator=g) * 2, torch.randn(B, Hkv, cap, D, generator=g)
    sinks = torch.randn(Hq, generator=g) + sink_scale
    out, _, _ = run_kernel(q, kst, vst, lengths, T, window, D ** -0.5, softcap, K.F32, nsplit, sinks)
    for b, L in enumerate(lengths):
        ref = reference(q[b], kst[b, :, :L + T], vst[b, :, :L + T], L, T, window, D ** -0.5, softcap, sinks)
        torch.testing.assert_close(out[b], ref, atol=2e-5, rtol=1e-4)
    if sink_scale == 0.0:     # a sink of -inf is no sink
        none, _, _ = run_kernel(q, kst, vst, lengths, T, window, D ** -0.5, softcap, K.F32, nsplit,
                                torch.full((Hq,), -math.inf))
        ref, _, _ = run_kernel(q, kst, vst, lengths, T, window, D ** -0.5, softcap, K.F32, nsplit)
        torch.testing.assert_close(none, ref, atol=0, rtol=0)


@pytest.mark.parametrize("code,np_dtype", [(K.F16, np.float16), (K.BF16, None)], ids=["fp16", "bf16"])
def test_widening_is_exact_for_every_bit_pattern(code, np_dtype):
    """The register widening the kernel uses (simd.py), on all 65536 half patterns: o = 0 + 1 * v."""
    from numba import njit

    from hetero.cpu_attention import simd

    bits = np.arange(2**16, dtype=np.uint16)
    nblk = bits.size // W
    vt = np.zeros((nblk, 1, BK, W), np.uint16)          # D = W: one panel; row 0 of each block holds 16 patterns
    vt[:, 0, 0, :] = bits.reshape(nblk, W)
    P = np.zeros((1, BK), np.float32)
    P[0, 0] = 1.0

    @njit
    def widen(P, vt, code, out):
        o = np.zeros((1, W), np.float32)
        for blk in range(vt.shape[0]):
            o[0, :] = 0.0
            simd.pv1(P, 0, 0, vt, blk, blk + 1, 1, o, code)
            out[blk * W:(blk + 1) * W] = o[0]

    got = np.empty(bits.size, np.float32)
    widen(P, vt, code, got)
    want = bits.view(np_dtype).astype(np.float32) if np_dtype else (bits.astype(np.uint32) << 16).view(np.float32)
    assert np.array_equal(got, want, equal_nan=True)      # (+0 and -0 compare equal: 0 + -0 is +0)


def _exp_scalar(x, out):
    for i in range(x.size):
        out[i] = simd.exp_neg(x[i])


def _exp_rows(x, out):
    """simd.exp_row over x viewed as rows of 16 lanes, with bm = 0; out[-1] is the worst error
    of a row's returned sum."""
    S = x[:x.size - 1].reshape(-1, 16).copy()
    worst = 0.0
    for r in range(S.shape[0]):
        total = simd.exp_row(S, r, 16, np.float32(0.0))
        worst = max(worst, abs(total - S[r].astype(np.float64).sum()) / max(1.0, total))
    out[:x.size - 1] = S.reshape(-1)
    out[-1] = worst


@pytest.mark.parametrize("impl", ["exp_neg", "exp_row"])
def test_exp_is_within_two_ulp_and_zero_for_masked(impl):
    """The scalar exp (rescale factors) and the vector one (probabilities), for x <= 0."""
    from numba import njit

    run = njit(_exp_scalar) if impl == "exp_neg" else njit(_exp_rows)
    x = np.concatenate([-np.geomspace(1e-8, 87, 200000 - 2).astype(np.float32), np.float32([0.0, -0.0, -1.0])])
    out = np.empty_like(x)                 # (the last element: exp_row's sum check)
    run(x, out)
    if impl == "exp_row":
        assert out[-1] <= 1e-6             # each row's returned sum is the sum of its values
    x, out = x[:-1], out[:-1]
    ref = np.exp(x.astype(np.float64))
    normal = x >= -80                      # results well above the subnormal range
    ulp = np.spacing(ref[normal].astype(np.float32)).astype(np.float64)
    assert np.max(np.abs(out[normal] - ref[normal]) / ulp) <= 2.0
    assert np.max(np.abs(out - ref) / ref) < 1e-5
    masked = np.float32([-np.inf, -88.0, -1e30] + [-1.0] * 14)
    out = np.empty_like(masked)
    run(masked, out)
    assert np.all(out[:3] == 0) and np.allclose(out[3:16], np.exp(-1.0))


@pytest.mark.parametrize("n", [1, 31, 32, 33, 100])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_blocked_layout_roundtrip(n, dtype):
    """KVSession.write_rows puts rows where the kernel reads them; read_rows gives them back."""
    from hetero.ipc.pool import WorkerPool
    from hetero.model_spec import ModelSpec
    from hetero.offload.session import KVSession

    spec = ModelSpec(model_type="t", layers=2, q_heads=4, kv_heads=2, head_dim=32, dtype=dtype,
                     max_positions=None, sliding=(False, False))
    pool = WorkerPool(1, [])
    try:
        s = KVSession(pool, spec, pads=[0, 0], real_lens=[n, n], cap=n + 3)
        try:
            k, v = torch.randn(2, n, 32).to(dtype), torch.randn(2, n, 32).to(dtype)
            s.write_rows(1, 1, k, v)
            k2, v2 = s.read_rows(1, 1, n)
            assert torch.equal(k2, k) and torch.equal(v2, v)
            assert s.K[0].abs().sum() == 0 and s.K[1, 0].abs().sum() == 0     # nothing else touched
            blk, jj = (n - 1) // BK, (n - 1) % BK
            for d in (0, 1, 6, 31):                                          # where the kernel reads it
                kr, kc = K.k_index(d, jj, K.BF16 if dtype == torch.bfloat16 else K.F32)
                assert torch.equal(s.K[1, 1, :, blk, kr, kc], k[:, n - 1, d])
            assert torch.equal(s.V[1, 1, :, blk, 5 // W, jj, 5 % W], v[:, n - 1, 5])
        finally:
            s.close()
    finally:
        pool.close()


class FixedPlan:
    def __init__(self, n, s):
        self.n, self.s = n, s

    def plan(self, lengths, T, layout, parent=True):
        return self.n, self.s


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_workers_share_units_deterministically(dtype):
    """Through the real pool: the parent alone, the parent with any worker count, and the workers
    alone take the units from the shared ticket and give bit-identical results (each unit's partials
    do not depend on who computed them), equal to the reference, for a batch of unequal lengths."""
    from hetero.ipc.pool import WorkerPool
    from hetero.model_spec import ModelSpec
    from hetero.offload.session import KVSession

    Hq, Hkv, D, lengths, T = 8, 2, 64, [300, 41, 170], 1
    spec = ModelSpec(model_type="t", layers=1, q_heads=Hq, kv_heads=Hkv, head_dim=D, dtype=dtype,
                     max_positions=None, sliding=(False,))
    g = torch.Generator().manual_seed(3)
    kst = torch.randn(3, Hkv, max(lengths) + T, D, generator=g).to(dtype)
    vst = torch.randn(3, Hkv, max(lengths) + T, D, generator=g).to(dtype)
    q = torch.randn(3, Hq, T, D, generator=g).to(dtype)
    pool = WorkerPool(3, [])
    try:
        for nsplit in (1, 3):
            outs = []
            for n in (0, 1, 2, 3, "workers only"):
                s = KVSession(pool, spec, pads=[0, 0, 0], real_lens=lengths, cap=max(lengths) + T,
                              planner=FixedPlan(3 if n == "workers only" else n, nsplit))
                if n == "workers only":                 # the parent takes no unit: the workers take all
                    s._share = lambda seq: None
                    n = 3
                try:
                    for b, L in enumerate(lengths):
                        s.write_rows(0, b, kst[b, :, :L], vst[b, :, :L])
                    s.finish_prefill()
                    s.stage_kv(torch.stack([kst[b, :, L:L + T] for b, L in enumerate(lengths)]),
                               torch.stack([vst[b, :, L:L + T] for b, L in enumerate(lengths)]))
                    assert (s.nactive, s.nsplit) == (n, nsplit)
                    outs.append(s.attend(0, q, None, D ** -0.5, None).float())   # [B, T, Hq, D]
                finally:
                    s.close()
            assert all(torch.equal(outs[0], o) for o in outs[1:])
            for b, L in enumerate(lengths):
                ref = reference(q[b].float(), kst[b, :, :L + T].float(), vst[b, :, :L + T].float(), L, T, 0,
                                D ** -0.5, None)                                  # [Hq, T, D]
                tol = dict(atol=2e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
                torch.testing.assert_close(outs[0][b].transpose(0, 1), ref.to(dtype).float(), **tol)
    finally:
        pool.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_shared_prefix_units_through_the_workers(dtype):
    """A batch sharing a context's first blocks (KVSession(prefix_groups=...)): the workers alone,
    the parent alone and both give bit-identical outputs (the workers map the context's segment
    themselves), equal to private copies of the context per request up to rounding, and to the
    reference; one request sits out the step entirely (skip = T) and the others' rows land after
    their own skipped tokens."""
    from hetero.ipc.pool import WorkerPool
    from hetero.model_spec import ModelSpec
    from hetero.offload.session import KVSession

    Hq, Hkv, D, P, T = 8, 2, 64, 200, 3
    spec = ModelSpec(model_type="t", layers=1, q_heads=Hq, kv_heads=Hkv, head_dim=D, dtype=dtype,
                     max_positions=None, sliding=(False,))
    g = torch.Generator().manual_seed(5)
    own = [7, 0, 30]                                      # rows of each request past the context
    skip = [1, 3, 0]
    kst = torch.randn(Hkv, P + max(own) + T, D, generator=g).to(dtype)      # context rows, then per request
    extra = [torch.randn(Hkv, n + T, D, generator=g).to(dtype) for n in own]
    q = torch.randn(3, Hq, T, D, generator=g).to(dtype)
    pool = WorkerPool(2, [])
    try:
        ctx = KVSession(pool, spec, pads=[0], real_lens=[P], cap=P + 64)
        ctx.write_rows(0, 0, kst[:, :P], kst[:, :P])
        ctx.finish_prefill()
        outs = []
        for mode in ("parent", "both", "workers", "private"):
            plan = FixedPlan(0 if mode == "parent" else 2, 2)
            s = KVSession(pool, spec, pads=[0] * 3, real_lens=[P + n for n in own], cap=P + 64, planner=plan, tmax=T,
                          prefix_groups=() if mode == "private" else [(ctx, [0, 1, 2])])
            if mode == "workers":
                s._share = lambda seq: None
            try:
                start = int(s.pstart.max())
                assert start == (0 if mode == "private" else 192)
                for b, n in enumerate(own):
                    rows = torch.cat([kst[:, :P], extra[b][:, :n]], 1)
                    s.write_rows(0, b, rows[:, start:], rows[:, start:], start)
                s.finish_prefill()
                s.skip[:] = skip
                s._plan_step(T)
                assert s.psplit == (0 if mode == "private" else 2)
                new = torch.stack([e[:, n:n + T] for e, n in zip(extra, own)])        # [B, Hkv, T, D]
                s.stage_kv(new, new)
                outs.append(s.attend(0, q, None, D ** -0.5, None).float())            # [B, T, Hq, D]
                assert s.lengths.tolist() == [P + n + T - k for n, k in zip(own, skip)] and not s.skip.any()
                got = s.read_rows(0, 0, P + own[0] + T - skip[0], start)[0]
                want = torch.cat([kst[:, :P], extra[0][:, :own[0]], new[0, :, skip[0]:]], 1)[:, start:]
                assert torch.equal(got, want)                                         # appended after the skip
            finally:
                s.close()
        assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
        tol = dict(atol=2e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
        for b, (n, k) in enumerate(zip(own, skip)):
            if k == T:
                continue                                                          # no token of b's: ignored
            torch.testing.assert_close(outs[0][b, k:], outs[3][b, k:], **tol)
            rows = torch.cat([kst[:, :P], extra[b][:, :n], new[b, :, k:]], 1).float()
            L = P + n
            ref = reference(q[b, :, k:].float(), rows, rows, L, T - k, 0, D ** -0.5, None)   # [Hq, T-k, D]
            torch.testing.assert_close(outs[0][b, k:].transpose(0, 1), ref.to(dtype).float(), **tol)
        ctx.close()
    finally:
        pool.close()


def test_a_change_to_simd_drops_the_kernels_numba_cache(tmp_path):
    """numba keys kernel.py's cache on kernel.py alone; its functions inline simd.py's intrinsics,
    so a changed simd.py empties their cached index (they compile again) instead of serving the
    old machine code; an unchanged one leaves the cache alone."""
    import shutil
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    shutil.copytree(os.path.join(root, "hetero"), tmp_path / "hetero",
                    ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    cache = tmp_path / "hetero" / "cpu_attention" / "__pycache__"
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_CACHE_DIR"}

    def load():
        subprocess.run([sys.executable, "-c", "import hetero.cpu_attention.kernel"], cwd=tmp_path, env=env,
                       check=True)
        index = sorted(cache.glob("kernel.attend_unit-*.nbi"))
        return sorted(p.name for p in cache.glob("kernel.simd-*")), index[0].stat().st_mtime_ns

    marker, first = load()
    assert len(marker) == 1
    assert load() == (marker, first)                               # unchanged: the cache is kept
    with open(tmp_path / "hetero" / "cpu_attention" / "simd.py", "a") as f:
        f.write("\n# changed\n")
    changed, flushed = load()
    assert len(changed) == 1 and changed != marker and flushed > first


CACHED_ONLY = """
import sys
sys.path.insert(0, {root!r})
from hetero import worker
from hetero.cpu_attention import kernel
from hetero.ipc import atomics
from numba.core.dispatcher import Dispatcher
ok = worker._load_cached()
ds = [d for m in (atomics, kernel) for d in vars(m).values() if isinstance(d, Dispatcher)]
print(ok, sum(sum(d._cache_hits.values()) for d in ds), sum(sum(d._cache_misses.values()) for d in ds),
      all("compile" not in vars(d) for d in ds))
"""


def test_the_parent_loads_cached_kernels_itself_and_compiles_none(tmp_path):
    """prepare_parent with a warm numba cache loads the kernels in this process (no child: ~1.2 s
    less at every start), compiling nothing (the parent takes attention units: its code must be
    the workers' cached code, bit for bit); with a cold cache it says so and a child compiles."""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = CACHED_ONLY.format(root=root)
    warm = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    ok, hits, misses, restored = warm.stdout.split()
    assert ok == "True" and int(hits) > 0 and misses == "0" and restored == "True", warm.stdout
    cold = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True,
                          env=dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path)))
    ok, hits, misses, restored = cold.stdout.split()
    assert ok == "False" and misses == "0" and restored == "True", cold.stdout


RACE = """
import sys, threading
sys.path.insert(0, {root!r})
from hetero import worker
from hetero.cpu_attention import kernel
from hetero.ipc import atomics
bar, errs = threading.Barrier(4), []
def go():
    bar.wait()
    try:
        worker.prepare_parent(dict(), 60)
    except BaseException as e:
        errs.append(repr(e))
ts = [threading.Thread(target=go) for _ in range(4)]
[t.start() for t in ts]
[t.join() for t in ts]
left = [n for m in (atomics, kernel) for n, d in vars(m).items() if "compile" in getattr(d, "__dict__", {{}})]
print(errs, left)
"""


def test_threads_starting_pools_at_once_prepare_the_kernels_once():
    """prepare_parent from four threads at once (their first pools): no error, and no dispatcher
    left patched (one thread loads; the others wait for it)."""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", RACE.format(root=root)], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[] []", out.stdout + out.stderr
