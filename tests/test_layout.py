"""Arena layouts: head dims padded to the tile width, sliding-window layers kept as rings, and
attention sinks through a session; kernel level, session level and end to end against HF."""
import numpy as np
import pytest
import torch

from hetero import HeteroGenerator
from hetero.cpu_attention import kernel as K
from hetero.cpu_attention.simd import BK
from hetero.errors import UnsupportedModelError
from hetero.model_spec import ModelSpec
from hetero.offload.arena import SessionLayout, ring_rows
from hetero.offload.session import KVSession, merge_partials
from tests.conftest import build_model, padded_batch
from tests.test_kernel import FixedPlan, TORCH, from_blocks, reference, run_kernel, to_blocks


def spec_of(D, dtype=torch.float32, windows=(0,), Hq=4, Hkv=2):
    return ModelSpec(model_type="t", layers=len(windows), q_heads=Hq, kv_heads=Hkv, head_dim=D, dtype=dtype,
                     max_positions=None, sliding=tuple(w > 0 for w in windows), windows=tuple(windows))


def storage(t):
    """A torch tensor's storage bits as numpy (uint16 for half types)."""
    return t.view(torch.uint16).numpy() if t.dtype != torch.float32 else t.numpy()


@pytest.fixture(scope="module")
def pool():
    from hetero.ipc.pool import WorkerPool

    p = WorkerPool(2, [])
    yield p
    p.close()


# ---- A. head dims that are not a multiple of 16

@pytest.mark.parametrize("D", [8, 24])
@pytest.mark.parametrize("code", [K.F32, K.BF16])
def test_kernel_on_zero_padded_heads_is_exact(D, code):
    """Heads stored as Dp = 16 or 32 columns with zeros after D: the first D output columns are
    the attention over D columns, the rest are zero."""
    Dp, Hq, Hkv, lengths, T = -(-D // 16) * 16, 4, 2, (70, 9), 1
    g = torch.Generator().manual_seed(D)
    q = torch.randn(2, Hq, T, D, generator=g)
    kst = torch.randn(2, Hkv, 80, D, generator=g).to(TORCH[code])
    vst = torch.randn(2, Hkv, 80, D, generator=g).to(TORCH[code])
    pad = lambda t: torch.nn.functional.pad(t, (0, Dp - D))
    out, _, _ = run_kernel(pad(q), pad(kst), pad(vst), lengths, T, 0, D ** -0.5, None, code, 2)
    assert out.shape[-1] == Dp and torch.all(out[..., D:] == 0)
    for b, L in enumerate(lengths):
        ref = reference(q[b], kst[b, :, :L + T].float(), vst[b, :, :L + T].float(), L, T, 0, D ** -0.5, None)
        torch.testing.assert_close(out[b, ..., :D], ref, atol=2e-5, rtol=1e-4)


def test_layout_pads_head_dim():
    lay = SessionLayout(1, 4, 2, 24, 64, 1, K.F32)
    assert lay.head_dim == 24 and lay.dpad == 32
    shapes = {name: shape for name, shape, _ in lay.arrays()}
    assert shapes["q"][-1] == shapes["knew"][-1] == shapes["part_o"][-1] == shapes["K"][-2] == 32
    assert shapes["V"][-3] == 2 and lay.kv_bytes == 2 * 2 * 64 * 32 * 4


@pytest.mark.parametrize("D", [8, 24])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_session_pads_heads(pool, D, dtype):
    """Prefill rows (write_rows / read_rows), staged rows and q of a D-wide head go into the first
    D stored columns; attend gives D-wide outputs equal to the reference."""
    Hq, Hkv, lengths, T = 4, 2, [45, 100], 1
    g = torch.Generator().manual_seed(5)
    kst = torch.randn(2, Hkv, 101, D, generator=g).to(dtype)
    vst = torch.randn(2, Hkv, 101, D, generator=g).to(dtype)
    q = torch.randn(2, Hq, T, D, generator=g).to(dtype)
    s = KVSession(pool, spec_of(D, dtype), pads=[0, 0], real_lens=lengths, cap=101, planner=FixedPlan(2, 3))
    try:
        for b, L in enumerate(lengths):
            s.write_rows(0, b, kst[b, :, :L], vst[b, :, :L])
            k2, v2 = s.read_rows(0, b, L)
            assert torch.equal(k2, kst[b, :, :L]) and torch.equal(v2, vst[b, :, :L])
        # the pad columns D..Dp-1 stay zero (K: rows D.. of a [Dp, BK] block, also pair-interleaved)
        assert torch.all(s.K[..., D:, :] == 0) and torch.all(s.V[..., D // 16, :, D % 16:] == 0)
        s.finish_prefill()
        s.stage_kv(torch.stack([kst[b, :, L:L + T] for b, L in enumerate(lengths)]),
                   torch.stack([vst[b, :, L:L + T] for b, L in enumerate(lengths)]))
        out = s.attend(0, q, None, D ** -0.5, None)                    # [B, T, Hq, D]
        assert out.shape == (2, T, Hq, D) and out.dtype == dtype
        for b, L in enumerate(lengths):
            ref = reference(q[b].float(), kst[b, :, :L + T].float(), vst[b, :, :L + T].float(), L, T, 0,
                            D ** -0.5, None)
            tol = dict(atol=2e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
            torch.testing.assert_close(out[b].transpose(0, 1).float(), ref.to(dtype).float(), **tol)
            k2, v2 = s.read_rows(0, b, L + T)                           # the workers' appended row
            assert torch.equal(k2[:, L:], kst[b, :, L:L + T]) and torch.equal(v2[:, L:], vst[b, :, L:L + T])
    finally:
        s.close()


def hf_and_ours(monkeypatch, model, ref_impl, ids, mask, new, planner=None):
    """(HF generate, hetero generate, the KVSessions hetero opened), with scores; planner: a
    fixed (workers, splits) plan instead of the profiled one."""
    import hetero.generator

    kw = dict(attention_mask=mask, max_new_tokens=new, do_sample=False, pad_token_id=0,
              return_dict_in_generate=True, output_scores=True)
    model.set_attn_implementation(ref_impl)
    ref = model.generate(ids, **kw)
    sessions = []

    class Recorded(KVSession):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            sessions.append(self)

    monkeypatch.setattr(hetero.generator, "KVSession", Recorded)
    with HeteroGenerator(model, cpu_workers=2) as gen:
        if planner is not None:
            gen._planner = planner
        out = gen.generate(ids, **kw)
    return ref, out, sessions


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("dims", [dict(head_dim=8), dict(hidden_size=48, num_attention_heads=2,
                                                          num_key_value_heads=1, head_dim=24)],
                         ids=["head_dim8", "head_dim24"])
def test_head_dim_not_multiple_of_16_matches_hf(monkeypatch, dims, dtype):
    model, ref_impl = build_model("llama", dtype=dtype, **dims)
    ids, mask = padded_batch()
    new = 10 if dtype == torch.float32 else 4
    ref, out, sessions = hf_and_ours(monkeypatch, model, ref_impl, ids, mask, new)
    lay = sessions[0].layout
    assert lay.head_dim == dims["head_dim"] and lay.dpad == {8: 16, 24: 32}[lay.head_dim]
    assert torch.equal(out.sequences, ref.sequences)
    if dtype == torch.float32:
        for a, b in zip(out.scores, ref.scores):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


# ---- B. sliding-window layers kept as rings

def test_ring_layout_is_window_sized():
    """A Mistral-7B-shaped model (32 layers, 8 KV heads of 128, bf16, window 4096) at 32K context
    keeps window-sized KV: under 13 % of the full history (4096 + 64 of 32768 rows)."""
    full = spec_of(128, torch.bfloat16, windows=(0,) * 32, Hq=32, Hkv=8)
    mistral = spec_of(128, torch.bfloat16, windows=(4096,) * 32, Hq=32, Hkv=8)
    lf, lm = KVSession.layout_for(full, 1, 32768 + 64), KVSession.layout_for(mistral, 1, 32768 + 64)
    assert lf.kv_bytes == 2 * 32 * 8 * (32768 + 64) * 128 * 2
    assert lm.ring == ring_rows(4096) == 4096 + BK and lm.ring_layers == 32
    assert lm.kv_bytes == 2 * 32 * 8 * (4096 + BK) * 128 * 2
    assert lm.nbytes < 0.13 * lf.nbytes
    # a window as long as the cache, or a mix of layers
    assert KVSession.layout_for(spec_of(16, windows=(6, 0)), 1, 32).ring_layers == 0
    mixed = KVSession.layout_for(spec_of(16, windows=(40, 0, 40)), 1, 1000)
    assert (mixed.ring_layers, mixed.ring) == (2, 96) and mixed.kv_bytes == 2 * 2 * (1024 + 2 * 96) * 16 * 4


@pytest.mark.parametrize("code", [K.F32, K.BF16])
@pytest.mark.parametrize("nsplit", [1, 2, 3])
@pytest.mark.parametrize("L,T,window", [(300, 1, 40), (95, 1, 33), (64, 1, 1), (200, 3, 40)])
def test_kernel_reads_and_appends_through_the_ring(code, nsplit, L, T, window):
    """run_job on a ring of blocks: logical block blk at blk % nring, only window rows present;
    the new rows are appended into the ring and the output equals the full-history reference."""
    Hq, Hkv, D = 4, 2, 32
    nring = ring_rows(window, T) // BK
    g = torch.Generator().manual_seed(L + window)
    q = torch.randn(1, Hq, T, D, generator=g)
    kst = (torch.randn(1, Hkv, L + T, D, generator=g) * 2).to(TORCH[code])
    vst = torch.randn(1, Hkv, L + T, D, generator=g).to(TORCH[code])
    kb, _ = to_blocks(storage(kst)[:, :, :L], -(-(L + T) // BK) * BK, code)    # rows >= L: zero,
    _, vb = to_blocks(storage(vst)[:, :, :L], -(-(L + T) // BK) * BK, code)    # the kernel appends them
    first = max(0, L - window + 1) // BK                 # the oldest block the window sees
    kr = np.full((1, 1, Hkv, nring) + kb.shape[3:], 7, kb.dtype)   # stale rows: finite junk
    vr = np.full((1, 1, Hkv, nring) + vb.shape[3:], 7, vb.dtype)
    for blk in range(first, L // BK + 1):                # rows < L: the prefill's, through the ring
        kr[0, 0, :, blk % nring], vr[0, 0, :, blk % nring] = kb[0, :, blk], vb[0, :, blk]
    knew, vnew = storage(kst)[:, :, L:].copy(), storage(vst)[:, :, L:].copy()
    po = np.full((1, Hkv, nsplit, 2 * T, D), np.nan, np.float32)
    pm = np.full((1, Hkv, nsplit, 2 * T), np.nan, np.float32)
    pl = pm.copy()
    K.run_alone(0, T, window, nsplit, D ** -0.5, 0.0, code, q.numpy(), knew, vnew, kr, vr, np.array([L]),
                np.array([0]), po, pm, pl, np.zeros((2 * T, D), np.float32), np.zeros((2 * T, D // 2), np.uint32),
                K.score_scratch(2 * T))
    out = merge_partials(*map(torch.from_numpy, (po, pm, pl))).view(1, Hq, T, D)
    ref = reference(q[0], kst[0].float(), vst[0].float(), L, T, window, D ** -0.5, None)
    torch.testing.assert_close(out[0], ref, atol=2e-5, rtol=1e-4)
    kr_rows, vr_rows = from_blocks(kr[0], vr[0], code)   # [1, Hkv, nring*BK, D]
    for t in range(T):                                   # appended at ring row of L+t
        j = (L + t) // BK % nring * BK + (L + t) % BK
        np.testing.assert_array_equal(kr_rows[0, :, j], storage(kst)[0, :, L + t])
        np.testing.assert_array_equal(vr_rows[0, :, j], storage(vst)[0, :, L + t])


def test_session_ring_rows_and_window_checks(pool):
    """A ring layer stores only the prompt rows its window sees (wrapping), read_rows gives them
    back, and attend refuses a call with no window or a larger one; a full layer accepts any."""
    window, L, Hq, Hkv, D = 40, 300, 4, 2, 16
    spec = spec_of(D, windows=(window, 0), Hq=Hq, Hkv=Hkv)
    g = torch.Generator().manual_seed(2)
    kst, vst = torch.randn(2, 1, Hkv, L + 1, D, generator=g), torch.randn(2, 1, Hkv, L + 1, D, generator=g)
    s = KVSession(pool, spec, pads=[0], real_lens=[L], cap=L + 1, planner=FixedPlan(2, 2))
    try:
        assert s.ring_window == (window, 0) and s.Kr.shape[3] == 3 and s.K.shape[3] == 10
        for layer in (0, 1):
            s.store_prefill(layer, kst[layer, :, :, :L], vst[layer, :, :, :L])
        first = L - window + 1
        k, v = s.read_rows(0, 0, L, start=first)
        assert torch.equal(k, kst[0, 0, :, first:L]) and torch.equal(v, vst[0, 0, :, first:L])
        with pytest.raises(ValueError, match="span"):
            s.read_rows(0, 0, L, start=0)                       # no longer held
        k, v = s.read_rows(1, 0, L)
        assert torch.equal(k, kst[1, 0, :, :L])
        s.finish_prefill()
        q = torch.randn(1, Hq, 1, D, generator=g)
        for bad in (None, 0, window + 1):
            with pytest.raises(UnsupportedModelError, match="layer 0 .* window of 40"):
                s.attend(0, q, bad, D ** -0.5, None)
        for layer, w in ((0, window), (0, 7), (1, 13)):       # (the last layer ends the step)
            s.stage_kv(kst[layer, :, :, L:], vst[layer, :, :, L:])
            out = s.attend(layer, q, w, D ** -0.5, None)
            ref = reference(q[0], kst[layer, 0], vst[layer, 0], L, 1, w or 0, D ** -0.5, None)
            torch.testing.assert_close(out[0].transpose(0, 1), ref, atol=2e-5, rtol=1e-4)
    finally:
        s.close()


LONG = (300, 230, 200)          # prompts of 6-10 blocks against a window of 40


@pytest.mark.parametrize("model_type,nsplit", [("mistral", 3), ("gemma3_text", 2), ("gemma2", 1)])
def test_long_prompts_past_the_window_match_hf(monkeypatch, model_type, nsplit):
    """Prompts 5-8x the window, decode crossing block and ring boundaries; 2 workers, forced
    splits; the sliding layers' arena is window-sized."""
    model, ref_impl = build_model(model_type, sliding_window=40, max_position_embeddings=512)
    ids, mask = padded_batch(lengths=LONG)
    ref, out, sessions = hf_and_ours(monkeypatch, model, ref_impl, ids, mask, 24, planner=FixedPlan(2, nsplit))
    lay = sessions[0].layout
    assert lay.ring == 96 and lay.ring_layers == sum(w > 0 for w in sessions[0].spec.windows) > 0
    assert lay.kv_bytes < SessionLayout(lay.batch, lay.q_heads, lay.kv_heads, lay.head_dim, lay.cap, lay.layers,
                                        lay.code).kv_bytes
    assert torch.equal(out.sequences, ref.sequences)
    for a, b in zip(out.scores, ref.scores):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


# ---- C. attention sinks through a session

def test_session_attend_with_sinks(pool):
    Hq, Hkv, D, lengths = 8, 2, 24, [130, 70]
    g = torch.Generator().manual_seed(9)
    kst, vst = torch.randn(2, Hkv, 131, D, generator=g), torch.randn(2, Hkv, 131, D, generator=g)
    q, sinks = torch.randn(2, Hq, 1, D, generator=g), torch.randn(Hq, generator=g) * 3
    s = KVSession(pool, spec_of(D, Hq=Hq, Hkv=Hkv), pads=[0, 0], real_lens=lengths, cap=131, planner=FixedPlan(2, 3))
    try:
        for b, L in enumerate(lengths):
            s.write_rows(0, b, kst[b, :, :L], vst[b, :, :L])
        s.finish_prefill()
        s.stage_kv(torch.stack([kst[b, :, L:L + 1] for b, L in enumerate(lengths)]),
                   torch.stack([vst[b, :, L:L + 1] for b, L in enumerate(lengths)]))
        out = s.attend(0, q, None, D ** -0.5, None, sinks=sinks)
        for b, L in enumerate(lengths):
            ref = reference(q[b], kst[b, :, :L + 1], vst[b, :, :L + 1], L, 1, 0, D ** -0.5, None, sinks)
            torch.testing.assert_close(out[b].transpose(0, 1), ref, atol=2e-5, rtol=1e-4)
    finally:
        s.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("D", [24, 64])
def test_whole_block_writes_equal_strided_writes(pool, dtype, D):
    """write_rows' two paths (whole blocks built on the source's device and copied per head, as
    from a GPU; strided copies, as from host memory) store the same rows, bit for bit: a full
    layer's arena is identical (blocks from any start, a partial tail), and a ring wrapping
    around reads back the same rows (the whole-block path also zeroes the expired rows after
    the tail, which the strided one leaves as they were)."""
    Hkv = 2
    spec = ModelSpec(model_type="t", layers=2, q_heads=4, kv_heads=Hkv, head_dim=D, dtype=dtype,
                     max_positions=None, sliding=(False, True), windows=(0, 20))
    g = torch.Generator().manual_seed(9)
    rows = [(0, 0, 45), (0, 64, 7), (1, 96, 40), (1, 160, 33)]          # (layer, start, n)
    data = [(torch.randn(Hkv, n, D, generator=g).to(dtype), torch.randn(Hkv, n, D, generator=g).to(dtype))
            for _, _, n in rows]
    arenas = []
    for whole in (False, True):
        s = KVSession(pool, spec, pads=[0], real_lens=[200], cap=256, tmax=4)
        try:
            assert s.layout.ring_layers == 1
            for (layer, start, n), (k, v) in zip(rows, data):
                s.write_rows(layer, 0, k, v, start, whole_blocks=whole)
                kk, vv = s.read_rows(layer, 0, start + n, start)
                assert torch.equal(kk, k) and torch.equal(vv, v)
            arenas.append([t.clone() for t in (s.K, s.V)])
        finally:
            s.close()
    for a, b in zip(*arenas):
        assert torch.equal(a.view(torch.uint8) if a.dtype != torch.float32 else a,
                           b.view(torch.uint8) if b.dtype != torch.float32 else b)
