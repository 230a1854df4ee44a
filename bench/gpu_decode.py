"""Per-token decode with the model on a GPU: hetero (KV and attention on the CPU workers) beside
HF with the KV on the GPU, HF's offloaded cache and HF's static cache. Needs CUDA.

Random-weight bf16 models of the Llama-3-8B and Llama-2-7B shapes (all 32 layers), KV of the
context length filled synthetically (decode cost does not depend on what it holds). Systems:
  hetero       hetero, CUDA transport (hetero/cuda: copy-out + signal, wait, merge on the GPU)
  hetero_host  hetero, host-copy transport (the fallback)
  hf           HF, DynamicCache on the GPU (OOM marked)
  offloaded    HF, DynamicCache(offloading=True): KV in host memory, prefetched layer by layer
  static       HF, StaticCache on the GPU
and, asked for with --systems (not in the default set):
  hetero_all        hetero with HeteroConfig(profile="off"): every worker, the static split rule
                    (an A/B of the profiled planner's choice in the same run)
  hetero_lora       hetero with a rank-16 peft adapter on all seven projections of every layer, its
                    decode deltas on the CPU workers through the CUDA transport (GPU-posted jobs)
  hetero_lora_host  the same through host copies (a synchronization per projection)
  peft              HF + peft with the same adapter, all on the GPU (DynamicCache)
Each (shape, context, system) runs in a fresh process; the parent measures in the same run the
all-core host read bandwidth, PCIe copy bandwidth (pinned, both ways) and the base layers' time
(HF's static cache at a 256-token context), and the bound = KV bytes / host read bandwidth + base time.
Targets: hetero >= 3x HF offloaded at 64K, within 1.5x of the bound, GPU memory flat in context.

    python bench/gpu_decode.py [--shapes llama3-8b] [--contexts 8192 32768 65536 131072]
A dry run of one cell on any machine: --one hetero_lora --shape tiny --context 64 --device cpu.
"""
import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.common import machine, positive, run_child, steady, stream_read_all_gbps, write_json  # noqa: E402
from hetero.compat import forward_cache_kwarg  # noqa: E402

SHAPES = {  # hidden, intermediate, layers, q heads, kv heads, vocab
    "llama3-8b": (4096, 14336, 32, 32, 8, 128256),
    "llama2-7b": (4096, 11008, 32, 32, 32, 32000),
    "tiny": (256, 512, 2, 4, 2, 1000),          # dry runs
}
DEVICE = "cuda"                                  # --device (cpu: a dry run of one cell)


def sync():
    import torch

    if DEVICE == "cuda":
        torch.cuda.synchronize()
SYSTEMS = ("hetero", "hetero_host", "hf", "offloaded", "static")
LORA_SYSTEMS = ("hetero_all", "hetero_lora", "hetero_lora_host", "peft")
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
TARGETS = {"vs_offloaded_64k": 3.0, "of_bound": 1.5, "gpu_memory_growth": 1.05}


def build(shape):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    h, inter, layers, hq, hkv, vocab = SHAPES[shape]
    cfg = LlamaConfig(hidden_size=h, intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=hq,
                      num_key_value_heads=hkv, vocab_size=vocab, max_position_embeddings=262144)
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(DEVICE):
            model = LlamaForCausalLM(cfg).eval()
    finally:
        torch.set_default_dtype(torch.float32)
    return model


def kv_layer(cfg, L, i):
    """Layer i's random keys and values [1, Hkv, L, D] on the GPU (bf16)."""
    import torch

    g = torch.Generator(device=DEVICE).manual_seed(i)
    D = cfg.hidden_size // cfg.num_attention_heads
    shape = (1, cfg.num_key_value_heads, L, D)
    return (torch.randn(shape, generator=g, device=DEVICE, dtype=torch.bfloat16),
            torch.randn(shape, generator=g, device=DEVICE, dtype=torch.bfloat16))


def decode_loop(model, cache, L, steps):
    """Greedy single-token forwards from position L; per-step seconds (synchronized per step, as
    generate's stopping check is)."""
    import torch

    tok, times = torch.full((1, 1), 5, device=DEVICE), []
    with torch.inference_mode():
        for i in range(steps):
            t = time.perf_counter()
            out = model(input_ids=tok, **{forward_cache_kwarg(model.forward): cache},
                        position_ids=torch.full((1, 1), L + i, device=DEVICE),
                        cache_position=torch.tensor([L + i], device=DEVICE), use_cache=True)
            tok = out.logits[:, -1:].argmax(-1)
            sync()
            times.append(time.perf_counter() - t)
    return times


def with_lora(model):
    """The model wrapped by peft with one rank-16 adapter ("a") on every projection (random B)."""
    import torch
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1)
    return get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=LORA_TARGETS,
                                            init_lora_weights=False), adapter_name="a").eval()


def run_hf(model, L, steps, kind):
    import torch
    from transformers import DynamicCache, StaticCache

    if kind == "peft":
        model, kind = with_lora(model), "hf"
    model.set_attn_implementation("sdpa")
    if kind == "static":
        cache = StaticCache(config=model.config, max_cache_len=L + steps)
        pos = {"cache_position": torch.arange(L, device=DEVICE)}
    else:
        cache, pos = DynamicCache(config=model.config, offloading=kind == "offloaded"), None
    for i in range(model.config.num_hidden_layers):
        k, v = kv_layer(model.config, L, i)
        cache.update(k, v, i, pos)
        del k, v
    sync()
    if DEVICE == "cuda":
        torch.cuda.reset_peak_memory_stats()
    return decode_loop(model, cache, L, steps), None


def run_hetero(model, L, steps, transport, lora=False, profile="auto"):
    import torch

    from hetero import HeteroConfig, HeteroGenerator
    from hetero.generator import _active

    config = HeteroConfig(transport=transport, profile=profile)
    with HeteroGenerator(with_lora(model) if lora else model, config=config) as gen:
        model = gen.model                                    # the base model (peft's layers hooked)
        batch = gen._lora_batch(["a"], 1) if lora else None
        with gen.kv_context(pads=[0], real_lens=[L], cap=L + steps, lora=batch) as cache, _active(batch):
            s = cache.session
            for i in range(model.config.num_hidden_layers):
                k, v = kv_layer(model.config, L, i)
                s.write_rows(i, 0, k[0], v[0])
                del k, v
            s.finish_prefill()
            for layer in cache.layers:
                layer.seen = L
            sync()
            if DEVICE == "cuda":
                torch.cuda.reset_peak_memory_stats()
            times = decode_loop(model, cache, L, steps)
            prof = getattr(gen._planner, "profile", None)
            info = {"plan": [s.nactive, s.nsplit], "transport": s.transport.name, "workers": gen.cpu_workers,
                    "profile": prof.describe() if prof is not None else None}   # why this plan
    return times, info


def one(args):
    """Child process: one system at one context; prints a JSON line."""
    import torch

    model = build(args.shape)
    out = {}
    try:
        if args.one.startswith("hetero"):
            out["times"], out["info"] = run_hetero(model, args.context, args.steps,
                                                   "host" if args.one.endswith("_host") else "cuda",
                                                   lora="lora" in args.one,
                                                   profile="off" if args.one == "hetero_all" else "auto")
        else:
            out["times"], out["info"] = run_hf(model, args.context, args.steps, args.one)
        out["peak_gpu_bytes"] = torch.cuda.max_memory_allocated() if DEVICE == "cuda" else 0
    except torch.cuda.OutOfMemoryError:
        out["oom"] = True
    print("RESULT " + json.dumps(out))


def spawn(args, system, L):
    return run_child([sys.executable, os.path.abspath(__file__), "--one", system, "--context", str(L),
                      "--shape", args.shape, "--steps", str(args.steps)], timeout=1800)


def pcie_gbps(nbytes=1 << 30):
    """Pinned host<->device copy GB/s (best of 3 each way)."""
    import torch

    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    out = {}
    for name, dst, src in (("h2d", dev, host), ("d2h", host, dev)):
        best = float("inf")
        for _ in range(3):
            torch.cuda.synchronize()
            t = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t)
        out[name] = nbytes / best / 1e9
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=["llama3-8b"], choices=list(SHAPES))
    ap.add_argument("--contexts", type=positive, nargs="+", default=[8192, 32768, 65536, 131072])
    ap.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS + LORA_SYSTEMS)
    ap.add_argument("--steps", type=positive, default=12)
    ap.add_argument("--out", default="gpu_decode")
    ap.add_argument("--copy-to", default=None, help="also copy the JSON here after every row (a device's $OUT)")
    ap.add_argument("--one", choices=SYSTEMS + LORA_SYSTEMS, help=argparse.SUPPRESS)
    ap.add_argument("--shape", help=argparse.SUPPRESS)
    ap.add_argument("--context", type=positive, help=argparse.SUPPRESS)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a dry run of one --one cell")
    args = ap.parse_args()
    if args.steps < 3:
        ap.error("--steps must be at least 3 (the first two are warm-up)")
    global DEVICE
    DEVICE = args.device
    if args.one:
        return one(args)
    import torch

    if not torch.cuda.is_available():
        sys.exit("bench/gpu_decode.py needs CUDA")
    cores = len(os.sched_getaffinity(0))
    host_gbps, pcie = stream_read_all_gbps(cores), pcie_gbps()
    print(f"host read {host_gbps:.1f} GB/s ({cores} cores), PCIe h2d {pcie['h2d']:.1f} d2h {pcie['d2h']:.1f} GB/s",
          flush=True)
    results = {}
    for shape in args.shapes:
        args.shape = shape
        # the base layers' time: HF's static cache at a tiny context (its dynamic cache is bound by
        # kernel launches on the host: 83 ms against static's 26 ms at 8K on an H100)
        base = spawn(args, "static", 256)
        base_ms = statistics.median(base["times"][2:]) * 1e3 if "times" in base else None
        spawn(args, "hetero", args.contexts[0])        # measures the planner profile outside the timed runs
        rows = []
        h, _, layers, hq, hkv, _ = SHAPES[shape]
        for L in args.contexts:
            kv_bytes = 2 * layers * hkv * (h // hq) * L * 2
            row = {"context": L, "kv_bytes": kv_bytes,
                   "bound_ms": kv_bytes / (host_gbps * 1e9) * 1e3 + (base_ms or 0)}
            for s in args.systems:
                r = spawn(args, s, L)
                if "times" in r:
                    r.update(steady(r["times"]))            # warm-up dropped and counted, as for every system
                row[s] = r
                info = dict(r.get("info") or {})
                if info.pop("profile", None) and L == args.contexts[0]:
                    print(r["info"]["profile"])                  # the planner's profile, once
                print(f"{shape} L={L:7d} {s:12s} " + (f"{r['ms']:9.2f} ms/token  peak GPU "
                      f"{r['peak_gpu_bytes'] / 2**30:6.2f} GiB {info or ''}" if "ms" in r else
                      ("OOM" if r.get("oom") else "failed: " + r.get("error", "")[-300:])), flush=True)
            rows.append(row)
            results[shape] = {"base_ms": base_ms, "rows": rows}
            save(args, cores, host_gbps, pcie, results, {})     # partial results survive a time limit
    summary = {}
    for shape, res in results.items():
        by = {r["context"]: r for r in res["rows"]}
        r64 = by.get(65536)
        if r64 and "ms" in r64.get("hetero", {}) and "ms" in r64.get("offloaded", {}):
            x = r64["offloaded"]["ms"] / r64["hetero"]["ms"]
            summary[f"{shape} 64K: HF offloaded / hetero"] = (round(x, 2), x >= TARGETS["vs_offloaded_64k"])
        for r in res["rows"]:
            if "ms" in r.get("hetero", {}):
                x = r["hetero"]["ms"] / r["bound_ms"]
                summary[f"{shape} {r['context'] // 1024}K: hetero / bound"] = (round(x, 2), x <= TARGETS["of_bound"])
        peaks = [r["hetero"]["peak_gpu_bytes"] for r in res["rows"] if "peak_gpu_bytes" in r.get("hetero", {})]
        if len(peaks) > 1:
            x = max(peaks) / min(peaks)
            summary[f"{shape}: hetero peak GPU memory, longest / shortest context"] = (
                round(x, 3), x <= TARGETS["gpu_memory_growth"])
    for k, (v, met) in summary.items():
        print(f"  {'MET ' if met else 'MISS'} {k}: {v}")
    print("wrote", save(args, cores, host_gbps, pcie, results, summary))


def save(args, cores, host_gbps, pcie, results, summary):
    import torch

    return write_json(f"{args.out}.json", {
        "bench": "gpu_decode", "machine": machine(), "gpu": torch.cuda.get_device_name(), "cores": cores,
        "host_read_gbps": host_gbps, "pcie_gbps": pcie, "steps": args.steps, "targets": TARGETS,
        "results": results, "summary": summary,
        "note": "ms = steady-state per-token time (bench.common.steady: warm-up dropped and counted, "
                "still_falling: an upper bound), one fresh process per cell; bound = KV bytes / "
                "all-core host read bandwidth + the base layers' time (HF static cache at 256 tokens)"}, args.copy_to)


if __name__ == "__main__":
    main()
