"""Layer-wise KV prefetch (hetero.prefetch): a context's continuation attends on the model's device
over each layer's cached rows, copied in one layer ahead into two rotating buffers. On a CPU model
the schedule runs in order in the calling thread: the same ops, checked here on every machine."""
import pytest
import torch

from hetero import HeteroConfig, HeteroGenerator
from hetero.cpu_attention.planner import Profile
from hetero.model_spec import ModelSpec
from hetero.prefetch import policy
from hetero.prefetch.schedule import LayerPrefetcher, plan
from tests.conftest import build_model
from tests.test_contexts import KW, hf, turns


def test_plan_rotates_two_buffers_two_items_ahead():
    assert plan([1, 1, 1]) == [
        ("fetch", 0, 0, 0), ("fetch", 1, 0, 1),
        ("wait", 0, 0, 0), ("attend", 0, 0, 0), ("release", 0, 0, 0), ("fetch", 2, 0, 0), ("offload", 0, None, None),
        ("wait", 1, 0, 1), ("attend", 1, 0, 1), ("release", 1, 0, 1), ("offload", 1, None, None),
        ("wait", 2, 0, 0), ("attend", 2, 0, 0), ("release", 2, 0, 0), ("offload", 2, None, None),
        ("write", None, None, None)]
    assert plan([1]) == [("fetch", 0, 0, 0), ("wait", 0, 0, 0), ("attend", 0, 0, 0), ("release", 0, 0, 0),
                         ("offload", 0, None, None), ("write", None, None, None)]
    # tiles: layer 0 in three, layer 1 in one; the buffers rotate across the layers' tiles
    assert plan([3, 1]) == [
        ("fetch", 0, 0, 0), ("fetch", 0, 1, 1),
        ("wait", 0, 0, 0), ("attend", 0, 0, 0), ("release", 0, 0, 0), ("fetch", 0, 2, 0),
        ("wait", 0, 1, 1), ("attend", 0, 1, 1), ("release", 0, 1, 1), ("fetch", 1, 0, 1),
        ("wait", 0, 2, 0), ("attend", 0, 2, 0), ("release", 0, 2, 0), ("offload", 0, None, None),
        ("wait", 1, 0, 1), ("attend", 1, 0, 1), ("release", 1, 0, 1), ("offload", 1, None, None),
        ("write", None, None, None)]


@pytest.mark.parametrize("T,n,causal,softcap", [(5, 7, False, None), (6, 6, True, None), (4, 9, False, 3.0),
                                                (5, 5, True, 2.0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiles_merged_by_log_sum_exp_equal_one_attention(T, n, causal, softcap, dtype):
    """attention_lse over disjoint row sets, merged (merge_lse), equals one attention over all the
    rows (eager_attention, the reference the prefill paths share); the kernel and the math path
    give the same (out, lse)."""
    from hetero.attention import eager_attention
    from hetero.prefetch.schedule import attention_lse, attention_lse_math, merge_lse

    g = torch.Generator().manual_seed(n + T)
    q = torch.randn(1, 4, T, 32, generator=g).to(dtype)
    k, v = (torch.randn(1, 4, n, 32, generator=g).to(dtype) for _ in range(2))
    scale = 32 ** -0.5
    parts = [(0, 3), (3, n)] if not causal else [(0, n)]      # (a causal piece merged: the continuations below)
    acc = None
    for a, b in parts:
        piece = attention_lse(q, k[:, :, a:b], v[:, :, a:b], scale, causal, softcap)
        acc = piece if acc is None else merge_lse(acc, piece)
    mask = torch.ones(T, n, dtype=torch.bool).tril() if causal else torch.ones(T, n, dtype=torch.bool)
    ref, _ = eager_attention(None, q.float(), k.float(), v.float(), mask[None, None], scale, softcap)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(acc[0].float().transpose(1, 2), ref, **tol)
    # the kernel (softcap None) and the math path (a kernel refusing) give the same out and lse
    w = torch.matmul(q.float(), k.float().transpose(2, 3)) * scale
    if softcap:
        w = torch.tanh(w / softcap) * softcap
    if causal:
        w = w.masked_fill(~mask, float("-inf"))
    for out, lse in (attention_lse(q, k, v, scale, causal, softcap), attention_lse_math(q, k, v, scale, causal, softcap)):
        torch.testing.assert_close(lse, torch.logsumexp(w, -1), **tol)
        torch.testing.assert_close(out.float().transpose(1, 2), ref, **tol)


@pytest.mark.parametrize("model_type,dtype,chunk", [("llama", torch.float32, None), ("mistral", torch.float32, 4),
                                                    ("gemma2", torch.float32, 8), ("qwen3", torch.bfloat16, None)])
def test_prefetched_continuations_match_hf(model_type, dtype, chunk, monkeypatch):
    """continuation='prefetch': every turn's new tokens (a 23-token message: pieces of 4 and 8 with
    chunk) attend on the device over the prefetched rows (mistral: its window's ring; gemma2:
    softcap and a window), full-attention layers in tiles of 32 rows merged by log-sum-exp, and
    are appended to the arena; the turns equal HF over the whole conversation (bf16: tokens,
    scores close), and the issued ops are plan()'s, once per forward."""
    from hetero.prefetch import schedule

    monkeypatch.setattr(schedule, "TILE_ROWS", 32)
    model, _ = build_model(model_type, dtype=dtype)
    doc, *msgs = turns(21, 45, 23, 9)
    config = HeteroConfig(cpu_workers=2, prefill_chunk=chunk, continuation="prefetch")
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=0.1, rtol=0.05)
    with HeteroGenerator(model, config=config) as gen, gen.prefill(doc[None], reserve=100) as ctx:
        history, tiled = doc, False
        for msg in msgs:
            conv = torch.cat([history, msg])
            cached = ctx.length
            out = gen.generate(msg[None], context=ctx, max_new_tokens=4, **KW)
            ref = hf(model, conv, 4)
            assert torch.equal(out.sequences, ref.sequences)
            for a, b in zip(out.scores, ref.scores):
                torch.testing.assert_close(a, b, **tol)
            fed = len(conv) - cached - 1                                   # all but the last new token
            pieces = -(-fed // ctx.session.layout.tmax)
            assert gen.last_prefetch_log == gen.last_prefetch_plan
            assert len(gen.last_prefetch_plan) == len(plan([1] * model.config.num_hidden_layers)) * pieces + \
                4 * sum(op[0] == "attend" and op[2] > 0 for op in gen.last_prefetch_plan)    # 4 ops per extra tile
            tiled |= any(op[0] == "attend" and op[2] > 0 for op in gen.last_prefetch_log)
            history = out.sequences[0]
        assert tiled == (model_type != "mistral")               # mistral's layers all have windows: one item


def test_prefetch_and_workers_agree_and_a_failed_forward_leaves_the_context():
    """The same turn through the workers and through prefetch gives the same tokens; a forward
    failing in its second layer leaves the context as it was (no row counted), and the next call
    still equals HF."""
    model, _ = build_model("llama")
    doc, msg = turns(22, 60, 30)
    outs = {}
    for mode in ("workers", "prefetch"):
        with HeteroGenerator(model, config=HeteroConfig(cpu_workers=1, continuation=mode)) as gen, \
                gen.prefill(doc[None]) as ctx:
            outs[mode] = gen.generate(msg[None], context=ctx, max_new_tokens=5, **KW)
            assert (gen.last_prefetch_log is not None) == (mode == "prefetch")
    assert torch.equal(outs["workers"].sequences, outs["prefetch"].sequences)

    real = LayerPrefetcher.attend

    def fail(self, layer, *a, **k):
        if layer == 1:
            raise RuntimeError("injected")
        return real(self, layer, *a, **k)
    with HeteroGenerator(model, config=HeteroConfig(cpu_workers=1, continuation="prefetch")) as gen, \
            gen.prefill(doc[None]) as ctx:
        LayerPrefetcher.attend = fail
        try:
            with pytest.raises(RuntimeError, match="injected"):
                gen.generate(msg[None], context=ctx, max_new_tokens=3, **KW)
        finally:
            LayerPrefetcher.attend = real
        assert ctx.length == 60 and ctx.session.prefetcher is None
        out = gen.generate(msg[None], context=ctx, max_new_tokens=5, **KW)
        assert torch.equal(out.sequences, outs["workers"].sequences)


def _profile(block_s):
    fp = {"group": 4}
    return Profile(fingerprint=fp, block_s=block_s, unit_s=1e-6, dispatch_s=[0.0, 2e-5], agg_gbps=[20.0, 35.0],
                   merge_s=1e-7, merge_fixed_s=5e-6, block_bytes=2 * 32 * 128 * 2)


def test_policy_prefers_workers_for_few_tokens_and_the_device_for_many():
    spec = ModelSpec(model_type="t", layers=32, q_heads=32, kv_heads=8, head_dim=128, dtype=torch.bfloat16,
                     max_positions=None, sliding=(False,) * 32)
    prof = _profile(block_s=0.6e-6)
    gpu = policy.DeviceRates("cuda:0", copy_gbps=25.0, device_gflops=300_000.0)
    assert policy.choose(prof, policy.DeviceRates("cpu", 20.0, 150.0), spec, 65536, 4096, 15) == "workers"
    L = 65536
    assert policy.choose(prof, gpu, spec, L, 1, 15) == "workers"
    assert policy.choose(prof, gpu, spec, L, 2048, 15) == "prefetch"
    T = policy.crossover(prof, gpu, spec, L, 15, tmax=4096)
    assert T is not None and policy.choose(prof, gpu, spec, L, T // 2, 15) == "workers"
    slow_bus = policy.DeviceRates("cuda:0", copy_gbps=2.5, device_gflops=300_000.0)
    assert policy.crossover(prof, slow_bus, spec, L, 15, tmax=4096) > T                  # a slower copy: later crossover
    assert policy.choose(None, gpu, spec, L, 4096, 15) == "workers"           # no profile: the workers


def test_measured_device_rates_are_positive():
    spec = ModelSpec(model_type="t", layers=1, q_heads=4, kv_heads=2, head_dim=32, dtype=torch.float32,
                     max_positions=None, sliding=(False,))
    r = policy.measure(torch.device("cpu"), spec, rows=2048, T=16, reps=1)
    assert r.copy_gbps > 0 and r.device_gflops > 0 and "GB/s" in r.describe()


@pytest.mark.parametrize("model_type", ["llama", "gemma2"])
def test_chunked_prefill_prefetches_the_cached_chunks(model_type):
    """A chunked prefill (one-shot generate, and prefill() of a context) with
    continuation='prefetch': chunk c attends on the device to chunks 0..c-1 prefetched layer by
    layer from the arena; tokens and scores equal HF's, and the ops are plan()'s per chunk."""
    model, _ = build_model(model_type)
    doc, msg = turns(23, 50, 6)
    config = HeteroConfig(cpu_workers=1, prefill_chunk=8, continuation="prefetch")
    layers = model.config.num_hidden_layers
    with HeteroGenerator(model, config=config) as gen:
        out = gen.generate(doc[None], max_new_tokens=4, **KW)
        ref = hf(model, doc, 4)
        assert torch.equal(out.sequences, ref.sequences)
        for a, b in zip(out.scores, ref.scores):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
        per = len(plan([1] * layers))
        assert gen.last_prefetch_log == gen.last_prefetch_plan          # 50 = 8 + 6 chunks of <= 8 (the last token
        assert len(gen.last_prefetch_plan) == per * 6                   # left to generate), pieces [8, 49)
        with gen.prefill(doc[None]) as ctx:
            assert gen.last_prefetch_log == gen.last_prefetch_plan      # prefill(): all 42 after the first 8
            assert len(gen.last_prefetch_plan) == per * 6
            out = gen.generate(msg[None], context=ctx, max_new_tokens=4, **KW)
            assert torch.equal(out.sequences, hf(model, torch.cat([doc, msg]), 4).sequences)


def test_auto_prefill_chunk_is_the_longest_that_fits_the_free_memory():
    """prefill_chunk="auto" on a GPU (hetero.prefetch.policy.prefill_chunk), with the Llama-3-8B
    shape: one pass where it fits, else the longest multiple of 256 whose forward fits; eager
    attention (scores T x S) and a batch shrink it; nothing left still gives the smallest chunk."""
    from transformers import LlamaConfig

    cfg = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=128256)
    spec = ModelSpec(model_type="llama", layers=32, q_heads=32, kv_heads=8, head_dim=128, dtype=torch.bfloat16,
                     max_positions=None, sliding=(False,) * 32)
    GiB, S = 2**30, 131072
    assert policy.prefill_chunk(cfg, spec, 1, S, 60 * GiB, eager=False) is None           # ~19 GiB: one pass
    C = policy.prefill_chunk(cfg, spec, 1, S, 8 * GiB, eager=False)
    budget = 0.8 * 8 * GiB
    assert C % 256 == 0 and 256 <= C < S
    assert policy.forward_bytes(cfg, spec, 1, C, S, False, cached=True) <= budget
    assert policy.forward_bytes(cfg, spec, 1, C + 256, S, False, cached=True) > budget    # the longest
    eager = policy.prefill_chunk(cfg, spec, 1, S, 8 * GiB, eager=True)
    batch = policy.prefill_chunk(cfg, spec, 2, S, 8 * GiB, eager=False)
    assert 256 <= eager < C and 256 <= batch < C
    assert policy.prefill_chunk(cfg, spec, 1, S, 2**20, eager=False) == 256
    # a padded batch's one pass also holds transformers' [B, S, S] mask (1 GiB at 32K)
    S = 32768
    free = (policy.forward_bytes(cfg, spec, 1, S, S, False, cached=False) + 2**29) / 0.8
    assert policy.prefill_chunk(cfg, spec, 1, S, free, eager=False) is None
    assert policy.prefill_chunk(cfg, spec, 1, S, free, eager=False, padded=True) is not None


@pytest.mark.parametrize("model_type,pieces", [("llama", 2), ("mistral", 3)])
def test_an_auto_chunk_longer_than_the_staging_is_prefetched_whole(model_type, pieces, monkeypatch):
    """An "auto" chunk (a GPU-memory size) longer than CONTINUE_CHUNK: the workers' staging stays at
    CONTINUE_CHUNK tokens, and prefetched forwards take the whole chunk (400 of the 699 tokens
    after the first chunk: 2 pieces) where no sliding-window ring bounds them (mistral's: pieces of
    256, 3); tokens and scores equal HF's. The GPU's memory is what picks the chunk on a GPU; here
    the chunk is given."""
    from hetero.generator import CONTINUE_CHUNK
    from hetero.offload.session import KVSession

    model, _ = build_model(model_type, max_position_embeddings=2048)
    doc = turns(41, 1000)[0]
    monkeypatch.setattr(HeteroGenerator, "_chunk_size", lambda self, mask: 400)
    made, init = [], KVSession.__init__
    monkeypatch.setattr(KVSession, "__init__", lambda self, *a, **k: (init(self, *a, **k), made.append(self))[0])
    with HeteroGenerator(model, config=HeteroConfig(cpu_workers=1, continuation="prefetch", profile="off")) as gen:
        out = gen.generate(doc[None], max_new_tokens=3, **KW)         # (a profile's measurement makes sessions too)
        assert [s.layout.tmax for s in made] == [CONTINUE_CHUNK]
        assert gen.last_prefetch_log == gen.last_prefetch_plan
        assert len(gen.last_prefetch_plan) == len(plan([1] * model.config.num_hidden_layers)) * pieces
    ref = hf(model, doc, 3)
    assert torch.equal(out.sequences, ref.sequences)
    for a, b in zip(out.scores, ref.scores):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_auto_prefill_chunk_is_one_pass_on_a_cpu_model():
    model, _ = build_model("llama")
    ids = torch.randint(3, 100, (1, 40))
    with HeteroGenerator(model, config=HeteroConfig(cpu_workers=1, profile="off")) as gen:
        assert gen.config.prefill_chunk == "auto"
        assert gen._chunk(torch.ones_like(ids)) is None
    for bad in ("big", 0, 1.5):
        with pytest.raises(ValueError, match="prefill_chunk"):
            HeteroConfig(prefill_chunk=bad)


def test_prefetch_buffers_hold_a_tile_whatever_the_context():
    """The device buffers of a full-attention model hold one tile of blocks, not a layer's context
    (a windowed layer's item is its ring, bounded by the window)."""
    from hetero.cpu_attention.simd import BK
    from hetero.ipc.pool import WorkerPool
    from hetero.offload.session import KVSession

    pool = WorkerPool(1, [])
    try:
        for windows, cap, want in (((0, 0), 4096, 64 // BK), ((0, 0), 40, 2), ((0, 48), 4096, None)):
            spec = ModelSpec(model_type="t", layers=2, q_heads=4, kv_heads=2, head_dim=32, dtype=torch.float32,
                             max_positions=None, sliding=tuple(w > 0 for w in windows), windows=windows)
            s = KVSession(pool, spec, pads=[0], real_lens=[cap - 8], cap=cap, tmax=8)
            try:
                pre = LayerPrefetcher(s, torch.device("cpu"), tile=64)
                ring = s.kv[1][0].shape[2]
                assert pre.bufs[0][0].shape[1] == (want if want else max(ring, 64 // BK))
            finally:
                s.close()
    finally:
        pool.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("L,T,sinks,softcap", [(100, 7, True, None), (96, 5, False, None), (77, 9, True, 2.0),
                                               (33, 3, False, None)])
def test_tiled_layers_equal_one_masked_attention_and_append_the_rows(dtype, L, T, sinks, softcap):
    """The prefetcher's tiled path (tiles of 32 rows, 4 query heads per KV head, sinks, softcap)
    equals device_attention over all the rows at once, and the arena then holds the new rows
    after the cached ones, bit for bit (a row count inside a block, and on a block boundary)."""
    from hetero.ipc.pool import WorkerPool
    from hetero.offload.session import KVSession
    from hetero.prefetch.schedule import device_attention

    layers, Hq, Hkv, D = 2, 8, 2, 64
    g = torch.Generator().manual_seed(L)
    spec = ModelSpec(model_type="t", layers=layers, q_heads=Hq, kv_heads=Hkv, head_dim=D, dtype=dtype,
                     max_positions=None, sliding=(False,) * layers)
    pool = WorkerPool(1, [])
    try:
        s = KVSession(pool, spec, pads=[0], real_lens=[L], cap=256, tmax=16)
        try:
            ks, vs = ([torch.randn(Hkv, L, D, generator=g).to(dtype) for _ in range(layers)] for _ in range(2))
            for layer in range(layers):
                s.write_rows(layer, 0, ks[layer], vs[layer])
            s.lengths[0] = L
            pre = LayerPrefetcher(s, torch.device("cpu"), tile=32)
            pre.start()
            tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
            for layer in range(layers):
                q = torch.randn(1, Hq, T, D, generator=g).to(dtype)
                kn, vn = (torch.randn(1, Hkv, T, D, generator=g).to(dtype) for _ in range(2))
                sk = torch.randn(Hq, generator=g) if sinks else None
                pre.stage(kn, vn)
                out = pre.attend(layer, q, 0, D ** -0.5, softcap, sk)
                kk, vv = torch.cat([ks[layer][None], kn], 2).float(), torch.cat([vs[layer][None], vn], 2).float()
                ref = device_attention(q.float(), kk, vv, 0, L, 0, D ** -0.5, softcap, sk)
                torch.testing.assert_close(out.float(), ref, **tol)
                ks[layer], vs[layer] = kk[0].to(dtype), vv[0].to(dtype)
            pre.finish()
            assert pre.log == pre.planned and max(pre.ntiles) == -(-L // 32)
            for layer in range(layers):
                k2, v2 = s.read_rows(layer, 0, L + T)
                assert torch.equal(k2, ks[layer]) and torch.equal(v2, vs[layer])
        finally:
            s.close()
    finally:
        pool.close()


def test_half_precision_kernel_routing_and_cudnn_fallback(monkeypatch):
    """_half_kernel (CUDA bf16/f16 tiles; driven here with stand-ins for the kernels): cuDNN only
    where cuda_kernel chose it and for a long chunk's steady shapes (whole tiles, the causal piece,
    >= CUDNN_MIN_ROWS query rows), flash for the rest; a cuDNN call that raises turns cuDNN off
    for the device and the call is answered by flash."""
    from hetero.prefetch import schedule

    calls = []
    monkeypatch.setattr(schedule, "_flash", lambda q, k, v, s, c: calls.append("flash") or ("f", None))
    monkeypatch.setattr(schedule, "_cudnn", lambda q, k, v, s, c: calls.append("cudnn") or ("c", None))
    monkeypatch.setattr(schedule, "TILE_ROWS", 64)
    monkeypatch.setattr(schedule, "_chosen", {("cpu", torch.bfloat16, 8): "cudnn"})
    monkeypatch.setattr(schedule, "_spot_checked", lambda *a: True)
    rows = schedule.CUDNN_MIN_ROWS
    q, short = torch.zeros(1, 1, rows, 8, dtype=torch.bfloat16), torch.zeros(1, 1, rows - 1, 8, dtype=torch.bfloat16)
    tile, odd = torch.zeros(1, 1, 64, 8, dtype=torch.bfloat16), torch.zeros(1, 1, 40, 8, dtype=torch.bfloat16)
    for args, want in (((q, tile, tile, 1.0, False), "cudnn"), ((q, odd, odd, 1.0, False), "flash"),
                       ((q, q, q, 1.0, True), "cudnn"), ((short, tile, tile, 1.0, False), "flash"),
                       ((short, short, short, 1.0, True), "flash")):
        calls.clear()
        schedule._half_kernel(*args)
        assert calls == [want], (args[0].shape, args[1].shape, args[4], calls)

    def broken(*args):
        calls.append("cudnn")
        raise RuntimeError("cuDNN Frontend error: no execution plan")

    monkeypatch.setattr(schedule, "_cudnn", broken)
    calls.clear()
    assert schedule._half_kernel(q, tile, tile, 1.0, False) == ("f", None) and calls == ["cudnn", "flash"]
    assert schedule._chosen[("cpu", torch.bfloat16, 8)] == "flash"
    calls.clear()
    schedule._half_kernel(q, tile, tile, 1.0, False)
    assert calls == ["flash"]


def _cpu_flash(q, k, v, scale, causal):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)[:2]


def test_cudnn_results_are_spot_checked_against_flash_once_per_shape(monkeypatch):
    """A cuDNN shape not seen before is checked against flash on SPOT_ROWS query rows (the last
    ones where causal, as two non-causal pieces merged): a wrong row there (out or lse) turns
    cuDNN off for the device and the call is answered by flash; a shape that passed is not
    checked again. Driven with CPU kernels standing in for flash and a (possibly broken) cuDNN."""
    from hetero.prefetch import schedule

    flash_calls = []
    monkeypatch.setattr(schedule, "_flash", lambda *a: flash_calls.append(a[2].shape[2]) or _cpu_flash(*a))
    monkeypatch.setattr(schedule, "SPOT_ROWS", 64)
    monkeypatch.setattr(schedule, "_spot", set())
    g = torch.Generator().manual_seed(0)
    q, kt, vt = (torch.randn(1, 2, n, 16, generator=g) for n in (300, 128, 128))
    for k, v, causal, rows in ((q, q, True, slice(236, 300)), (kt, vt, False, slice(0, 64))):
        out, lse = schedule.attention_lse_math(q, k, v, 0.25, causal)
        assert schedule._spot_checked(q, k, v, 0.25, causal, out, lse)
        flash_calls.clear()
        assert schedule._spot_checked(q, k, v, 0.25, causal, out, lse) and not flash_calls   # once per shape
        schedule._spot.clear()
        for bad_out, bad_lse in ((out.clone(), lse), (out, lse.clone())):
            (bad_out if bad_out is not out else bad_lse)[0, 1, rows.stop - 1] += 0.5
            assert not schedule._spot_checked(q, k, v, 0.25, causal, bad_out, bad_lse)
        other = out.clone()
        other[0, 1, rows.start - 1 if causal else rows.stop] += 0.5                      # a row not checked
        assert schedule._spot_checked(q, k, v, 0.25, causal, other, lse)
        schedule._spot.clear()

    def off_by_one_row(q, k, v, scale, causal):
        out, lse = schedule.attention_lse_math(q, k, v, scale, causal)
        out[:, :, -1] = 0
        return out, lse

    monkeypatch.setattr(schedule, "_cudnn", off_by_one_row)
    monkeypatch.setattr(schedule, "CUDNN_MIN_ROWS", 256)
    monkeypatch.setattr(schedule, "_chosen", {("cpu", torch.float32, 16): "cudnn"})
    out, lse = schedule._half_kernel(q, q, q, 0.25, True)
    ref = _cpu_flash(q, q, q, 0.25, True)
    assert torch.equal(out, ref[0]) and torch.equal(lse, ref[1])
    assert schedule._chosen[("cpu", torch.float32, 16)] == "flash"
