"""The same equivalence on a CUDA model (skips without CUDA: CI has no GPU)."""
import pytest
import torch

from hetero import HeteroGenerator
from hetero.compat import forward_cache_kwarg
from tests.conftest import build_model, padded_batch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("model_type,dtype", [("llama", torch.float32), ("gemma2", torch.float32), ("qwen2", torch.bfloat16)])
def test_cuda_model_matches_hf(model_type, dtype):
    model, ref_impl = build_model(model_type, dtype=dtype)
    model = model.cuda()
    ids, mask = (t.cuda() for t in padded_batch())
    kw = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0,
              return_dict_in_generate=True, output_scores=True)
    ref = model.generate(ids, **kw)
    with HeteroGenerator(model, cpu_workers=2) as gen:
        out = gen.generate(ids, **kw)
    assert out.sequences.device == ids.device
    assert torch.equal(out.sequences, ref.sequences)
    tol = 1e-4 if dtype == torch.float32 else 0.1
    for a, b in zip(out.scores, ref.scores):
        torch.testing.assert_close(a.float(), b.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("transport", ["cuda", "host"])
def test_cuda_lora_cold_and_warm_match_peft(tmp_path, transport, monkeypatch):
    """LoRA with the model on the GPU: a cold adapter (device copy held back: prefill deltas on the
    CPU workers, copied to the GPU) and a warm one (its device copy) both equal peft's generate;
    decode deltas posted by the GPU (CUDA transport) or through host copies."""
    from hetero import HeteroConfig
    from hetero.ipc.cuda_transport import CudaTransport
    from tests.test_lora import NAMES, assert_same, generate, make_adapters

    base, pm, _ = make_adapters("llama", tmp_path)
    base, pm = base.cuda(), pm.cuda()
    ids, mask = (t.cuda() for t in padded_batch())
    ref = generate(pm, ids, mask, adapter_names=NAMES)
    posted, begin = [], CudaTransport.lora_begin
    monkeypatch.setattr(CudaTransport, "lora_begin", lambda self, *a: (posted.append(a[0]), begin(self, *a))[1])
    with HeteroGenerator(base, config=HeteroConfig(cpu_workers=2, transport=transport)) as gen:
        gen.load_adapter("legal", tmp_path / "legal")
        gen._store.copy_gate.clear()
        gen.load_adapter("code", tmp_path / "code")
        cold = generate(gen, ids, mask, adapter_names=NAMES)
        assert not gen.adapter_on_device("code")
        gen._store.copy_gate.set()
        assert gen._store.adapters["code"].ready.wait(30)
        assert all(A.is_cuda for A, _ in gen._store.adapters["code"].device.values())
        warm = generate(gen, ids, mask, adapter_names=NAMES)
        one = generate(gen, ids[:, -1:], mask[:, -1:], adapter_names=NAMES)     # a one-token prefill: host jobs
    assert_same(cold, ref)
    assert_same(warm, ref)
    assert_same(one, generate(pm, ids[:, -1:], mask[:, -1:], adapter_names=NAMES))
    # decode deltas posted by the GPU: every adapted site of both layers, 7 steps, 3 calls
    assert len(posted) == (3 * 7 * 7 * base.config.num_hidden_layers if transport == "cuda" else 0)


# ---- the CUDA transport (hetero/cuda/signal.cu): no host synchronization per layer

GPU_FAMILIES = ["llama", "mistral", "qwen3", "gemma2", "phi3"]


def _generate(model, ids, mask, transport, new=8, **cfg):
    from hetero import HeteroConfig

    kw = dict(attention_mask=mask, max_new_tokens=new, do_sample=False, pad_token_id=0,
              return_dict_in_generate=True, output_scores=True)
    with HeteroGenerator(model, config=HeteroConfig(cpu_workers=2, transport=transport, profile="off", **cfg)) as gen:
        out = gen.generate(ids, **kw)
        assert gen.cpu_workers == 2
    return out


@pytest.mark.parametrize("model_type", GPU_FAMILIES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_transport_matches_hf(model_type, dtype):
    """Greedy tokens equal to HF's generate, scores close; the extension and the host-copy
    fallback give the same tokens."""
    model, _ = build_model(model_type, dtype=dtype)
    model = model.cuda()
    ids, mask = (t.cuda() for t in padded_batch())
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0,
                         return_dict_in_generate=True, output_scores=True)
    ext = _generate(model, ids, mask, "cuda")
    host = _generate(model, ids, mask, "host")
    assert torch.equal(ext.sequences, ref.sequences)
    assert torch.equal(host.sequences, ext.sequences)
    tol = 1e-4 if dtype == torch.float32 else 0.1
    for a, b in zip(ext.scores, ref.scores):
        torch.testing.assert_close(a.float(), b.float(), atol=tol, rtol=tol)


def test_cuda_transport_adds_no_synchronization_per_token():
    """Counted with the torch profiler: stream/event/device synchronizations per extra token
    (generate of 12 tokens minus generate of 4) are no more than HF's own generate makes on the
    same batch (its stopping check, and transformers' padding-mask check in create_causal_mask:
    two per token on an H100 with transformers 5.17)."""
    from torch.profiler import ProfilerActivity, profile

    model = build_model("llama")[0].cuda()
    ids, mask = (t.cuda() for t in padded_batch())
    _generate(model, ids, mask, "cuda", new=2)           # builds and loads the extension
    names = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize")

    def syncs(run, new):
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            run(new)
        return sum(e.count for e in prof.key_averages() if e.key in names)

    def hf(new):
        model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False, pad_token_id=0,
                       return_dict_in_generate=True, output_scores=True)

    def hetero(new, transport="cuda"):
        _generate(model, ids, mask, transport, new=new)

    hf(2)
    ref = syncs(hf, 12) - syncs(hf, 4)
    extra = syncs(hetero, 12) - syncs(hetero, 4)
    assert ref >= 8, f"HF made {ref} synchronizations for 8 more tokens: the profiler missed them"
    assert extra <= ref, f"{extra} synchronizations for 8 more tokens, HF's generate {ref}"
    # the fallback (PinnedTransport): one event wait per layer on top
    host = syncs(lambda n: hetero(n, "host"), 12) - syncs(lambda n: hetero(n, "host"), 4)
    assert host <= ref + 8 * model.config.num_hidden_layers, (host, ref)


def test_cuda_transport_dead_worker_raises_within_2s():
    import os
    import signal
    import threading
    import time

    from hetero import HeteroConfig
    from hetero.errors import WorkerDiedError

    model = build_model("llama", max_position_embeddings=8192)[0].cuda()
    ids, mask = (t.cuda() for t in padded_batch())
    with HeteroGenerator(model, config=HeteroConfig(cpu_workers=2, transport="cuda", profile="off")) as gen:
        gen.generate(ids, attention_mask=mask, max_new_tokens=2, pad_token_id=0)
        killed = []
        timer = threading.Timer(0.5, lambda: (os.kill(gen._pool.procs[0].pid, signal.SIGKILL),
                                              killed.append(time.perf_counter())))
        timer.start()
        with pytest.raises(WorkerDiedError):
            gen.generate(ids, attention_mask=mask, max_new_tokens=4000, min_new_tokens=4000, pad_token_id=0)
        assert killed and time.perf_counter() - killed[0] < 2.0


# ---- contexts on a CUDA model: layer-wise prefetch, batches sharing a context

@pytest.mark.parametrize("kernel", ["attention_lse", "flash", "cudnn", "long chunk"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("causal", [False, True])
def test_cuda_attention_lse_kernels_equal_the_math(dtype, causal, kernel, monkeypatch):
    """attention_lse on CUDA equals the plain math for the prefetcher's folded GQA shape at lengths
    no multiple of 128, and no kernel refused (no fallback logged): bf16 through each of flash and
    cuDNN (where torch's sdpa would pick it), and a long chunk's steady shape (whole tiles, >=
    CUDNN_MIN_ROWS query rows), which runs the kernel cuda_kernel chose; f32 the memory-efficient
    kernel."""
    from hetero.prefetch import schedule

    if kernel != "attention_lse" and dtype == torch.float32:
        pytest.skip("f32 runs the memory-efficient kernel")
    if kernel == "cudnn" and not schedule._cudnn_preferred(torch.device("cuda")):
        pytest.skip("torch's sdpa would not pick cuDNN attention on this machine")
    g = torch.Generator(device="cuda").manual_seed(0)
    T, n = (37, 37) if causal else (4 * 37, 300)
    if kernel == "long chunk":                   # a whole tile of n rows, or the chunk's causal piece
        T = schedule.CUDNN_MIN_ROWS + 13
        n = T if causal else 300
        monkeypatch.setattr(schedule, "TILE_ROWS", n)
    q = torch.randn(1, 2, T, 64, generator=g, device="cuda").to(dtype)
    k, v = (torch.randn(1, 2, n, 64, generator=g, device="cuda").to(dtype) for _ in range(2))
    f = {"flash": schedule._flash, "cudnn": schedule._cudnn}.get(kernel, schedule.attention_lse)
    out, lse = f(q, k, v, 0.125, causal)
    ref, ref_lse = schedule.attention_lse_math(q, k, v, 0.125, causal)
    assert out.shape == q.shape and lse.shape == q.shape[:3]
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(out.float(), ref.float(), **tol)
    torch.testing.assert_close(lse.float(), ref_lse, **tol)
    assert not any(d.startswith("cuda") for d in schedule._refused)


@pytest.mark.parametrize("model_type,dtype", [("llama", torch.float32), ("gemma2", torch.float32),
                                              ("qwen3", torch.bfloat16)])
def test_cuda_prefetched_continuation_matches_hf(model_type, dtype, monkeypatch):
    """continuation='prefetch' on a CUDA model: each layer's cached rows are DMA'd from the
    page-locked arena into two rotating GPU buffers on a copy stream, the new rows go back on an
    offload stream; in pieces of 8 tokens (the buffers rotate across forwards, the second turn
    reads the rows the first appended; full-attention layers in tiles of 32 rows) the turns equal
    HF over the whole conversation, the ops are plan()'s, and the workers' path gives the same
    tokens; every layer of the arena is page-locked."""
    from hetero import HeteroConfig
    from hetero.prefetch import schedule
    from tests.test_contexts import KW, turns

    monkeypatch.setattr(schedule, "TILE_ROWS", 32)

    model = build_model(model_type, dtype=dtype)[0].cuda()
    doc, msg, nxt = (t.cuda() for t in turns(31, 60, 40, 9))
    outs = {}
    for mode in ("prefetch", "workers"):
        cfg = HeteroConfig(cpu_workers=2, continuation=mode, profile="off", prefill_chunk=8)
        with HeteroGenerator(model, config=cfg) as gen, gen.prefill(doc[None], reserve=100) as ctx:
            a = gen.generate(msg[None], context=ctx, max_new_tokens=4, **KW)     # 39 tokens fed: 5 pieces
            if mode == "prefetch":
                assert gen.last_prefetch_log == gen.last_prefetch_plan
                assert any(op[0] == "attend" and op[2] > 0 for op in gen.last_prefetch_plan)   # tiles
                pins = ctx.session._pins
                assert not pins.refused and pins.pinned == set(range(model.config.num_hidden_layers))
                assert all(k.is_pinned() and v.is_pinned() for k, v in ctx.session.kv)
            b = gen.generate(nxt[None], context=ctx, max_new_tokens=4, **KW)     # 1 pending + 9, 9 fed: 2
            if mode == "prefetch":
                assert gen.last_prefetch_log == gen.last_prefetch_plan
            outs[mode] = (a, b)
    conv = torch.cat([doc, msg])
    ref = model.generate(conv[None], attention_mask=torch.ones_like(conv)[None], max_new_tokens=4, **KW)
    assert torch.equal(outs["prefetch"][0].sequences, ref.sequences)
    for x, y in zip(outs["prefetch"], outs["workers"]):
        assert torch.equal(x.sequences, y.sequences)


@pytest.mark.parametrize("transport", ["cuda", "host"])
def test_cuda_batch_sharing_a_context_matches_hf(transport):
    """context=[ctx] * 3 on a CUDA model: the shared prefix read once per step; through the CUDA
    transport (the GPU merges prefix and own partials) or host copies."""
    from hetero import HeteroConfig
    from hetero.offload.session import KVSession
    from tests.test_contexts import KW, left_pad, turns

    model = build_model("llama")[0].cuda()
    doc, *qs = turns(32, 80, 5, 11, 2)
    ids, mask = left_pad(qs)
    full_ids, full_mask = left_pad([torch.cat([doc, q]) for q in qs])
    ref = model.generate(full_ids.cuda(), attention_mask=full_mask.cuda(), max_new_tokens=5, **KW)
    seen, use = [], KVSession.use_transport
    with HeteroGenerator(model, config=HeteroConfig(cpu_workers=2, profile="off", transport=transport)) as gen, \
            gen.prefill(doc[None].cuda()) as ctx:
        KVSession.use_transport = lambda self, t: (seen.append((t.name, self.layout.groups)), use(self, t))[1]
        try:
            out = gen.generate(ids.cuda(), attention_mask=mask.cuda(), context=[ctx] * 3, max_new_tokens=5, **KW)
        finally:
            KVSession.use_transport = use
    assert torch.equal(out.sequences, ref.sequences)
    assert seen == [(transport, 1)]                    # the fallback: PinnedTransport ("host")


def test_cuda_prefill_offloads_layer_by_layer():
    """A 32K-token prefill of a 12-layer model: each layer's KV leaves the GPU on the offload stream
    while the next layers compute (the compute stream waits only for layer - 2's offload), so the
    peak GPU memory stays below HF's (which keeps every layer's KV) by at least 8 layers of KV;
    the arena then holds HF's KV rows exactly."""
    from transformers import DynamicCache

    model = build_model("llama", num_hidden_layers=12, max_position_embeddings=40000)[0].cuda()
    cfg = model.config
    S = 32768
    ids = torch.randint(3, cfg.vocab_size, (1, S), generator=torch.Generator().manual_seed(0)).cuda()
    D = cfg.hidden_size // cfg.num_attention_heads
    layer_kv = 2 * cfg.num_key_value_heads * D * S * 4
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    cache = DynamicCache(config=cfg)
    with torch.inference_mode():
        model(input_ids=ids, **{forward_cache_kwarg(model.forward): cache}, use_cache=True, logits_to_keep=1)
    peak_hf = torch.cuda.max_memory_allocated()
    ref = {layer: (cache.layers[layer].keys[0].cpu(), cache.layers[layer].values[0].cpu()) for layer in (0, 11)}
    del cache                                  # the peaks below count what is allocated when they start
    with HeteroGenerator(model, cpu_workers=2) as gen:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        with gen.prefill(ids, reserve=8) as ctx:
            peak = torch.cuda.max_memory_allocated()
            pins = ctx.session._pins                     # page-locked layer by layer, each once
            assert not pins.refused and pins.pinned == set(range(12))
            assert len(pins.locked) == sum(len(b) for b in pins.bounds.values())
            for layer in (0, 11):
                k, v = ctx.session.read_rows(layer, 0, S)
                assert torch.equal(k, ref[layer][0]) and torch.equal(v, ref[layer][1])
    assert peak <= peak_hf - 8 * layer_kv, (peak, peak_hf, layer_kv)


def test_cuda_auto_chunk_on_little_free_memory_matches_hf(monkeypatch):
    """prefill_chunk="auto" with the device's free memory reported as too little for one pass: the
    prompt is prefilled in the chunk policy.prefill_chunk picks, each later chunk attended on the
    GPU over prefetched KV or by the CPU workers, and generate still equals HF's."""
    from hetero import HeteroConfig
    from hetero.prefetch import policy
    from tests.test_contexts import KW

    model = build_model("llama", max_position_embeddings=2048)[0].cuda()
    S = 1500
    ids = torch.randint(3, model.config.vocab_size, (1, S), generator=torch.Generator().manual_seed(0)).cuda()
    ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, **KW)
    for mode in ("prefetch", "workers"):
        cfg = HeteroConfig(cpu_workers=2, profile="off", continuation=mode)
        with HeteroGenerator(model, config=cfg) as gen, monkeypatch.context() as m:
            one_pass = policy.forward_bytes(model.config, gen.spec, 1, S, S, False, cached=False)
            free = int(one_pass / 0.8 * 0.9)             # a one-pass forward does not fit; chunks do
            total = torch.cuda.mem_get_info()[1]
            m.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, total))
            m.setattr(torch.cuda, "memory_reserved", lambda device=None: 0)
            m.setattr(torch.cuda, "memory_allocated", lambda device=None: 0)
            chunk = gen._chunk(torch.ones_like(ids))
            assert chunk == policy.prefill_chunk(model.config, gen.spec, 1, S, free, False) and 256 <= chunk < S
            out = gen.generate(ids, max_new_tokens=4, **KW)
        assert torch.equal(out.sequences, ref.sequences), mode


@pytest.mark.parametrize("model_type,dtype", [("llama", torch.float32), ("qwen2", torch.float32),
                                              ("gemma2", torch.float32), ("gemma3_text", torch.float32)])
@pytest.mark.parametrize("transport", ["cuda", "host"])
def test_cuda_engine_matches_hf(model_type, dtype, transport):
    """(Gemma 2 and 3 mix windowed and full layers: the windowed layers' pool of their own.)
    "cuda": the GPU posts the decode jobs and merges them (CudaDecode); "host": host copies."""
    def used(eng):
        assert (eng.kv.gpu is not None) == (transport == "cuda")

    engine_matches_hf(model_type, dtype, "cuda", transport=transport, hook=used)


def engine_matches_hf(model_type, dtype, device, transport="auto", hook=None):
    """The engine on a CUDA model: requests joining while others decode, a shared document found
    in the pool, and preemption under a small pool each give HF generate's tokens on the GPU for
    that request alone; every block comes back. hook(engine): called on each engine built (the
    host build of the CUDA protocol on a CPU: tests/test_engine_transport.py)."""
    from hetero import Engine, EngineConfig
    from tests.test_engine import prompts

    model = build_model(model_type, dtype=dtype)[0].to(device)
    doc = prompts([70], seed=3)[0]
    mixed = prompts([1, 33, 64, 12], seed=1) + [doc + q for q in prompts([7, 3, 12], seed=4)]
    tol = 1e-4 if dtype == torch.float32 else 0.1
    dma = 0
    for ps, new, cfg in ((mixed, 8, dict(kv_blocks=64, long_prefill_chunk=16, max_num_batched_tokens=48)),
                         (prompts([60, 50, 70, 40], seed=5), 24,             # 9 blocks: preemption
                          dict(kv_blocks=9, long_prefill_chunk=None, max_num_batched_tokens=64))):
        with Engine(model, EngineConfig(background=False, cpu_workers=2, max_model_len=256, transport=transport,
                                        **cfg)) as eng:
            if hook is not None:
                hook(eng)
            streams = [eng.add_request(p, new, output_scores=True) for p in ps[:3]]
            for _ in range(3):
                eng.step()
            streams += [eng.add_request(p, new, output_scores=True) for p in ps[3:]]
            while not all(s.finished for s in streams):
                eng.step()
            assert eng.kv_manager.num_used_blocks == 0
            pins = eng.kv._pins
            if torch.device(device).type == "cuda":      # prompt rows went in as DMAs (PagedKV.lock_pages)
                assert pins is not None and not pins.refused and eng.kv.sync_copies == 0
                assert bool(pins.locked) == (eng.kv.dma_copies > 0)
                dma += eng.kv.dma_copies                  # (16-token chunks fill no whole block: none there)
            if cfg["kv_blocks"] == 9:
                assert eng.scheduler.num_preemptions > 0
            else:
                assert eng.kv_manager.prefix_hits > 0
                rows = eng.runner.prefix_rows             # the document's rows kept on the model's device
                assert rows.misses > 0 and all(K.device == model.device for e in rows.entries.values()
                                               for K, _ in e.layers.values())
        assert pins is None or not pins.locked            # released at close
        for s, p in zip(streams, ps):
            ref = model.generate(torch.tensor([p], device=device), max_new_tokens=new, pad_token_id=0,
                                 do_sample=False, output_scores=True, return_dict_in_generate=True)
            assert s.token_ids == ref.sequences[0, len(p):].tolist(), (model_type, cfg, s.request_id)
            torch.testing.assert_close(torch.stack(s.scores).float().cpu(), torch.cat(ref.scores).float().cpu(),
                                       atol=tol, rtol=tol)
    assert torch.device(device).type != "cuda" or dma > 0     # the preemption run's 60-token prompt: whole blocks


def test_cuda_engine_step_raising_after_its_dmas_leaves_the_pool_exact(monkeypatch):
    """A step that raises on a CUDA model after its prompt rows went into the pool as DMAs (the
    second layer's chunk attention): end_step waits for them, the step's requests fail, and the
    blocks they held, given to later requests, serve HF generate's tokens."""
    from hetero import Engine, EngineConfig
    from hetero.engine import runner as runner_mod
    from tests.test_engine import prompts

    model = build_model("llama")[0].cuda()
    real, calls = runner_mod.chunk_attention, []

    def boom(*a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("boom after the first layer's DMAs")
        return real(*a, **k)

    with Engine(model, EngineConfig(background=False, cpu_workers=2, max_model_len=256, kv_blocks=12)) as eng:
        monkeypatch.setattr(runner_mod, "chunk_attention", boom)
        s = eng.add_request(prompts([200], seed=12)[0], 4)
        with pytest.raises(RuntimeError, match="boom"):
            eng.step()
        monkeypatch.undo()
        assert s.error is not None and eng.kv.dma_copies > 0 and eng.kv._dma_on is None
        ps = prompts([150, 90], seed=13)
        streams = [eng.add_request(p, 6) for p in ps]
        while not all(x.finished for x in streams):
            eng.step()
        assert eng.kv.sync_copies == 0
    for x, p in zip(streams, ps):
        ref = model.generate(torch.tensor([p], device="cuda"), max_new_tokens=6, do_sample=False, pad_token_id=0)
        assert x.token_ids == ref[0, len(p):].tolist()


def test_cuda_engine_dead_worker_fails_its_requests_within_2s():
    """A worker killed while the GPU waits on an engine step's decode job: the watchdog releases
    the stream, the step fails its requests with WorkerDiedError within 2 s, and close() leaves
    no shared-memory name."""
    import os
    import signal
    import time

    from hetero import Engine, EngineConfig, EngineError
    from hetero.errors import WorkerDiedError
    from tests.conftest import our_segments
    from tests.test_engine import prompts

    before = set(our_segments(os.getpid()))
    model = build_model("llama", max_position_embeddings=8192)[0].cuda()
    killed = []

    def kill(*_):                 # inside a step, after layer 0's job was posted: the GPU then waits
        if len(killed) == 0 and eng.steps >= 20:
            os.kill(eng.pool.procs[0].pid, signal.SIGKILL)
            eng.pool.procs[0].wait()        # dead before the watchdog's next look (no later step's ping finds it)
            killed.append(time.perf_counter())

    model.model.layers[1].register_forward_pre_hook(kill)
    with Engine(model, EngineConfig(cpu_workers=2, max_model_len=8192, transport="cuda")) as eng:
        assert eng.kv.gpu is not None
        streams = [eng.add_request(p, 6000, ignore_eos=True) for p in prompts([40, 300], seed=2)]
        for s in streams:
            with pytest.raises(EngineError, match="worker 0"):
                s.result(timeout=60)
            assert isinstance(s.error, WorkerDiedError) and "while the GPU waited" in str(s.error)
        assert killed and time.perf_counter() - killed[0] < 2.0
    assert set(our_segments(os.getpid())) == before


def test_cuda_overlapping_generate_calls_join_the_engine_and_match_hf(caplog, monkeypatch):
    """generate() from several threads on a CUDA model's generator: while a first call holds HF's
    loop (a streamer gate), the others join the engine's batch, and every call returns HF generate's
    sequences, on the GPU."""
    import logging
    import threading

    from hetero.ipc.cuda_transport import CudaTransport
    from tests.test_generate_threads import Gate, wait_for_engine

    model = build_model("llama")[0].cuda()
    g = torch.Generator().manual_seed(0)
    first, *xs = [torch.randint(3, 100, (1, n), generator=g).cuda() for n in (12, 30, 5, 44, 17)]
    out = {}
    with HeteroGenerator(model, cpu_workers=2) as gen:
        gate = Gate()
        with caplog.at_level(logging.WARNING, logger="hetero"), monkeypatch.context() as m:
            m.setattr(CudaTransport, "_said", set())
            t = threading.Thread(target=lambda: out.setdefault("first", gen.generate(
                first, max_new_tokens=6, pad_token_id=0, streamer=gate)))
            t.start()
            assert gate.started.wait(60)                     # the first call holds HF's loop
            ths = [threading.Thread(target=lambda i=i, x=x: out.setdefault(i, gen.generate(
                x, max_new_tokens=6 + i, pad_token_id=0))) for i, x in enumerate(xs)]
            for th in ths:
                th.start()
            engine = wait_for_engine(gen, len(xs))           # queued in the engine meanwhile
            assert engine.kv.gpu is not None                 # the engine's decode jobs: CUDA
            gate.release.set()
            for th in [t, *ths]:
                th.join(120)
            assert engine.steps > 0 and engine.kv_manager.num_used_blocks == 0
            gen.generate(xs[0], max_new_tokens=3, pad_token_id=0)            # HF's loop after: CUDA too
        assert "CUDA transport unavailable" not in caplog.text
    assert torch.equal(out["first"], model.generate(first, attention_mask=torch.ones_like(first), max_new_tokens=6,
                                                    pad_token_id=0))
    for i, x in enumerate(xs):
        assert out[i].device == x.device
        ref = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=6 + i, pad_token_id=0)
        assert torch.equal(out[i], ref), i


def test_cuda_hetero_serve_matches_hf(tmp_path):
    """`hetero serve --device cuda` (a tiny Llama directory: no wheel needed on the GPU machine;
    dense layers and prompt chunks on the GPU, decode attention on the CPU workers) answers a
    completion as HF generate does on the GPU, over HTTP, and leaves no shared-memory name."""
    openai = pytest.importorskip("openai")
    pytest.importorskip("fastapi")
    from tests.test_server import Server, tiny_model_dir

    path, model, tok = tiny_model_dir(tmp_path / "tiny", device="cuda")
    ids = [5, 9, 13, 2, 40, 7]
    out = model.generate(torch.tensor([ids], device="cuda"), max_new_tokens=8, do_sample=False, pad_token_id=0)
    s = Server("--model", path, "--device", "cuda", key=None)
    try:
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0)
        r = c.completions.create(model="tiny", prompt=ids, max_tokens=8, temperature=0)
        assert r.choices[0].text == tok.decode(out[0, len(ids):].cpu())
    finally:
        assert s.stop() == 0
