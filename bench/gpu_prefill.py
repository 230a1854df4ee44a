"""Prefill with the model on a GPU: hetero (KV offloaded to the CPU arena layer by layer; chunked,
each chunk attending to the earlier ones over KV prefetched layer by layer) beside HF with the
KV on the GPU and HF's offloaded cache; then a 512-token continuation over a cached context.
Needs CUDA (--device cpu --shape tiny: a dry run of the script on any machine).

Random-weight bf16 Llama-3-8B shape (all 32 layers), random prompts. Prefill systems, one fresh
process per (system, prompt length):
  hf              HF forward over the prompt, DynamicCache on the GPU (OOM marked)
  offloaded       HF forward, DynamicCache(offloading=True)
  hetero          gen.prefill(prompt): one pass, each layer's KV offloaded to the arena
  hetero_chunked  gen.prefill(prompt) with prefill_chunk (default 8192) and continuation="prefetch"
Continuation (--continue-context, default 64K cached tokens, --new 512 new tokens):
  prefetch / workers   gen.generate(new, context=ctx, extend_context=False, max_new_tokens=1)
  reprefill            HF forward over context + new tokens on the GPU (OOM marked)
Reported: tokens/s, seconds, peak GPU memory (torch.cuda.max_memory_allocated). Targets (#14):
hetero prefill >= 0.9x HF's GPU prefill where HF fits; the longest prompt hetero runs >= 4x
HF's; hetero_chunked's peak GPU memory flat in prompt length (longest / shortest <= 1.25).

    python bench/gpu_prefill.py [--contexts 8192 32768 65536 131072] [--copy-to DIR]
"""
import argparse
import contextlib
import json
import os
import sys
import time
from dataclasses import replace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.common import machine, positive, run_child, write_json  # noqa: E402
from hetero.compat import forward_cache_kwarg  # noqa: E402

SHAPES = {  # hidden, intermediate, layers, q heads, kv heads, vocab
    "llama3-8b": (4096, 14336, 32, 32, 8, 128256),
    "tiny": (256, 512, 2, 4, 2, 1000),
}
PREFILL = ("hf", "offloaded", "hetero", "hetero_chunked")
CONTINUE = ("prefetch", "workers", "reprefill")
TARGETS = {"vs_hf_prefill": 0.9, "longest_vs_hf": 4.0, "chunked_peak_growth": 1.25}


def build(shape, device):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    h, inter, layers, hq, hkv, vocab = SHAPES[shape]
    cfg = LlamaConfig(hidden_size=h, intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=hq,
                      num_key_value_heads=hkv, vocab_size=vocab, max_position_embeddings=1 << 20)   # 1M: longest-prompt runs
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(cfg).eval()
    finally:
        torch.set_default_dtype(torch.float32)
    model.set_attn_implementation("sdpa")
    return model


def _sync(device):
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def _peak(device, base):
    """(peak bytes allocated net of `base`, peak bytes reserved by the caching allocator)."""
    import torch

    if device != "cuda":
        return None, None
    return torch.cuda.max_memory_allocated() - base, torch.cuda.max_memory_reserved()


def _reset(device):
    """Start a peak measurement; returns the bytes allocated now (the weights), which the peak
    reported (max_memory_allocated: it starts from them) is taken net of."""
    import torch

    if device != "cuda":
        return 0
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    return torch.cuda.memory_allocated()


def _ids(model, n, seed):
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, model.config.vocab_size, (1, n), generator=g).to(model.device)


def hf_forward(model, ids, offloaded):
    """Seconds of one HF forward over ids into a fresh DynamicCache (logits of the last token only)."""
    import torch
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config, offloading=offloaded)
    t = time.perf_counter()
    with torch.inference_mode():
        model(input_ids=ids, **{forward_cache_kwarg(model.forward): cache}, use_cache=True, logits_to_keep=1)
    _sync(str(model.device.type))
    return time.perf_counter() - t


def hetero_gen(model, args, chunked):
    """chunked: prefill_chunk=args.chunk, each chunk after the first attending on the GPU over KV
    prefetched layer by layer (continuation="prefetch"); else one pass."""
    from hetero import HeteroConfig, HeteroGenerator

    cfg = HeteroConfig(prefill_chunk=args.chunk if chunked else None,
                       continuation="prefetch" if chunked else "auto", ram_fraction=args.ram_fraction)
    return HeteroGenerator(model, config=cfg)


@contextlib.contextmanager
def _profiled(on, device):
    """torch.profiler around the timed prefill (--profile; its seconds then include the profiler's
    overhead), else nothing."""
    if not on:
        yield None
        return
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=acts) as prof:
        yield prof


def _top_ops(prof, n=25):
    """The n ops with the most device time of their own (host time on a CPU run): name, calls,
    self device and self host ms."""
    rows = []
    for e in prof.key_averages():
        dev_us = getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0) or 0
        rows.append({"op": e.key[:80], "calls": e.count, "device_ms": round(dev_us / 1e3, 2),
                     "host_ms": round(e.self_cpu_time_total / 1e3, 2)})
    key = "device_ms" if any(r["device_ms"] for r in rows) else "host_ms"
    return sorted(rows, key=lambda r: -r[key])[:n]


def one(args):
    """Child process: one system at one length; prints a JSON line. hetero's INFO lines (the
    tile kernel chosen, a chunked prefill's progress) go to stderr with timestamps: a cell cut by
    the time limit still shows how far it got."""
    import logging

    import torch

    logging.basicConfig(format="%(asctime)s %(message)s")
    logging.getLogger("hetero").setLevel(logging.INFO)

    import psutil

    dev = args.device
    model = build(args.shape, dev)
    vm = psutil.virtual_memory()
    out = {"host_ram_gib": {"total": round(vm.total / 2**30, 1), "available": round(vm.available / 2**30, 1)}}
    logging.getLogger("hetero").info("host RAM: %s GiB", out["host_ram_gib"])
    try:
        if args.one in PREFILL:
            ids = _ids(model, args.context, 1)
            if args.one.startswith("hetero"):
                with hetero_gen(model, args, args.one == "hetero_chunked") as gen:
                    warm = (4096 if args.chunk == "auto" else args.chunk) + 512
                    gen.prefill(_ids(model, warm, 2)).close()   # workers, profile, kernels, prefetch warm
                    if dev == "cuda":       # the tiles' kernel choice (a long chunk's first use), not timed
                        from hetero.prefetch import schedule
                        schedule.cuda_kernel(model.device, model.dtype, gen.spec.head_dim)
                    out["chunk"] = gen._chunk(torch.ones_like(ids))   # None: one pass
                    base = _reset(dev)
                    with _profiled(args.profile, dev) as prof:
                        t = time.perf_counter()
                        ctx = gen.prefill(ids, reserve=1)
                        _sync(dev)
                        out["s"] = time.perf_counter() - t
                    out["peak_gpu_bytes"], out["peak_reserved_bytes"] = _peak(dev, base)
                    out["pin_s"] = ctx.session.pin_s     # host seconds page-locking (per layer, while the GPU computes)
                    from hetero.prefetch import schedule
                    out["tile_kernels"] = {f"{d} {t}": k for (d, t, _), k in schedule._chosen.items()}
                    if prof is not None:
                        out["profile"] = _top_ops(prof)
                    ctx.close()
            else:
                hf_forward(model, _ids(model, 512, 2), args.one == "offloaded")   # warm
                base = _reset(dev)
                out["s"] = hf_forward(model, ids, args.one == "offloaded")
                out["peak_gpu_bytes"], out["peak_reserved_bytes"] = _peak(dev, base)
        else:
            L, new = args.context, _ids(model, args.new, 3)
            if args.one == "reprefill":
                hf_forward(model, _ids(model, 512, 2), False)
                base = _reset(dev)
                out["s"] = hf_forward(model, torch.cat([_ids(model, L, 1), new], 1), False)
                out["peak_gpu_bytes"], out["peak_reserved_bytes"] = _peak(dev, base)
            else:
                # the context is prefilled in one pass on the GPU, then the timed call continues
                # it with `args.one` (in pieces of CONTINUE_CHUNK tokens)
                with hetero_gen(model, args, False) as gen:
                    with gen.prefill(_ids(model, L, 1), reserve=args.new + 8) as ctx:
                        gen.config = replace(gen.config, continuation=args.one)
                        kw = dict(context=ctx, extend_context=False, max_new_tokens=1, do_sample=False, pad_token_id=0)
                        gen.generate(new[:, :16], **kw)                   # warm
                        base = _reset(dev)
                        t = time.perf_counter()
                        gen.generate(new, **kw)
                        _sync(dev)
                        out["s"] = time.perf_counter() - t
                        out["peak_gpu_bytes"], out["peak_reserved_bytes"] = _peak(dev, base)
    except torch.cuda.OutOfMemoryError:
        out["oom"] = True
    print("RESULT " + json.dumps(out))


def spawn(args, system, L):
    return run_child([sys.executable, os.path.abspath(__file__), "--one", system, "--context", str(L),
                      "--shape", args.shape, "--device", args.device, "--chunk", str(args.chunk), "--new",
                      str(args.new), "--ram-fraction", str(args.ram_fraction)] + (["--profile"] if args.profile else []),
                     timeout=args.timeout,
                     log=os.path.join(args.copy_to, f"{args.out}_cells.log") if args.copy_to else None)


def _show(name, r, n):
    if "s" in r:
        peak, res = r.get("peak_gpu_bytes"), r.get("peak_reserved_bytes")
        return (f"{name:15s} {r['s']:8.3f} s  {n / r['s']:9.0f} tokens/s"
                + (f"  peak GPU +{peak / 2**30:6.2f} GiB over the weights (reserved {res / 2**30:6.2f} GiB)"
                   if peak is not None else "") + (f"  host page-locking {r['pin_s']:.2f} s" if r.get("pin_s") else ""))
    return f"{name:15s} " + ("OOM" if r.get("oom") else "failed: " + r.get("error", "")[-300:])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="llama3-8b", choices=list(SHAPES))
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--contexts", type=positive, nargs="*", default=[8192, 32768, 65536, 131072],
                    help="prompt lengths (none: only the continuation)")
    ap.add_argument("--systems", nargs="+", default=list(PREFILL), choices=PREFILL)
    ap.add_argument("--chunk", type=lambda v: v if v == "auto" else int(v), default=4096,
                    help="hetero_chunked's prefill_chunk (auto: the longest that fits the GPU; longest-prompt runs)")
    ap.add_argument("--continue-context", type=int, default=65536, help="cached tokens the continuation extends (0: skip)")
    ap.add_argument("--new", type=positive, default=512, help="the continuation's new tokens")
    ap.add_argument("--timeout", type=positive, default=540, help="seconds per cell (a device call has 600)")
    ap.add_argument("--ram-fraction", type=float, default=0.8,
                    help="HeteroConfig.ram_fraction: share of available RAM the KV arena may take")
    ap.add_argument("--profile", action="store_true",
                    help="hetero cells: the timed prefill under torch.profiler, its top ops in the JSON")
    ap.add_argument("--out", default="gpu_prefill")
    ap.add_argument("--copy-to", default=None, help="also copy the JSON here after every row (a device's $OUT)")
    ap.add_argument("--one", choices=PREFILL + CONTINUE, help=argparse.SUPPRESS)
    ap.add_argument("--context", type=positive, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        return one(args)
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("bench/gpu_prefill.py needs CUDA (or --device cpu --shape tiny for a dry run)")
    res = {"prefill": [], "continuation": None}
    for L in args.contexts:
        row = {"context": L}
        res["prefill"].append(row)
        for s in args.systems:
            row[s] = spawn(args, s, L)
            print(f"L={L:7d} " + _show(s, row[s], L), flush=True)
            save(args, res, {})                                # partial results survive a time limit
    if args.continue_context:
        row = res["continuation"] = {"context": args.continue_context, "new": args.new}
        for s in CONTINUE:
            row[s] = spawn(args, s, args.continue_context)
            print(f"continue {args.new} over {args.continue_context}: " + _show(s, row[s], args.new), flush=True)
            save(args, res, {})
    summary = summarize(res, args.systems)
    for k, (v, met) in summary.items():
        print(f"  {'    ' if met is None else 'MET ' if met else 'MISS'} {k}: {v}")
    print("wrote", save(args, res, summary))


def summarize(res, systems):
    summary = {}
    for r in res["prefill"]:
        if "s" in r.get("hetero", {}) and "s" in r.get("hf", {}):
            x = r["hf"]["s"] / r["hetero"]["s"]
            summary[f"{r['context'] // 1024}K: hetero prefill speed / HF GPU"] = (round(x, 2), x >= TARGETS["vs_hf_prefill"])
    def longest(name):
        return max((r["context"] for r in res["prefill"] if "s" in r.get(name, {})), default=0)
    if "hf" in systems:
        hf, het = longest("hf"), max(longest("hetero"), longest("hetero_chunked"))
        if hf and het:
            fits_all = hf == max(r["context"] for r in res["prefill"])
            summary["longest prompt, hetero / HF (HF ran every length: a lower bound)" if fits_all else
                    "longest prompt, hetero / HF"] = (round(het / hf, 2),
                                                     None if fits_all else het / hf >= TARGETS["longest_vs_hf"])
    peaks = [r["hetero_chunked"]["peak_gpu_bytes"] for r in res["prefill"]
             if (r.get("hetero_chunked") or {}).get("peak_gpu_bytes")]
    if len(peaks) > 1:
        x = max(peaks) / min(peaks)
        summary["hetero_chunked peak GPU memory, longest / shortest prompt"] = (round(x, 3), x <= TARGETS["chunked_peak_growth"])
    c = res["continuation"]
    if c and "s" in c.get("reprefill", {}):
        for s in ("prefetch", "workers"):
            if "s" in c.get(s, {}):
                summary[f"continuation: re-prefill / {s}"] = (round(c["reprefill"]["s"] / c[s]["s"], 2), None)
    return summary


def save(args, res, summary):
    import torch

    return write_json(f"{args.out}.json", {
        "bench": "gpu_prefill", "machine": machine(), "cores": len(os.sched_getaffinity(0)),
        "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None, "shape": args.shape,
        "chunk": args.chunk, "targets": TARGETS, "results": res, "summary": summary,
        "note": "one fresh process per cell, after a warm-up in it; seconds of one prefill (wall, synchronized); "
                "peak_gpu_bytes: max_memory_allocated net of what was allocated at its reset (the weights)"},
        args.copy_to)


if __name__ == "__main__":
    main()
