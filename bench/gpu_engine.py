"""The engine on a GPU machine beside transformers' continuous batching with the KV on the GPU.

Random-weight bf16 Llama-3-8B shape (all 32 layers; bench/gpu_decode.py's build), N requests of
L random prompt tokens each (no shared prefix: cold KV, as in a real service's first pass), all
added at once (the saturating load), each asking --new tokens (greedy, eos ignored so both do the
same work). Systems, each (N, L, system) in a fresh process:
  engine   hetero.Engine: prefill on the GPU in --chunk-token steps, KV in the host's shared-memory
           pool, decode attention on the CPU workers (every core but one), the dense layers on the GPU;
           each layer's decode job posted and merged by the GPU (the CUDA transport, CudaDecode)
  engine_host  the same with the decode jobs' q/k/v and outputs copied by the host (transport="host")
  hf_cb    transformers' ContinuousBatchingManager (init_continuous_batching, its default cache
           sizing: a share of the GPU's free memory), sdpa/paged attention on the GPU
Per cell: throughput (output tokens / (last token - first add)), TTFT and inter-token p50/p99,
peak GPU memory; a cell that fails, runs out of memory or overruns --timeout is marked so.
Target (issue #32): engine >= 1.5x hf_cb's throughput at equal load, and every load that fits
the host's RAM served.

    python bench/gpu_engine.py [--loads 8x32768 16x32768] [--new 32]
A dry run on any machine: --shape tiny --loads 3x256 --new 4 --device cpu.
"""
import argparse
import json
import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import bench.gpu_decode as gd  # noqa: E402
from bench.common import machine, positive, run_child, write_json  # noqa: E402

SYSTEMS = ("engine", "engine_host", "hf_cb")
TARGET = 1.5


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))] if xs else None


def prompts(n, L, vocab):
    import torch

    g = torch.Generator().manual_seed(0)
    return [torch.randint(10, vocab, (L,), generator=g).tolist() for _ in range(n)]


def metrics(start, token_times, new):
    """Throughput and latency from each request's token times (monotonic seconds)."""
    end = max(t[-1] for t in token_times)
    ttft = [t[0] - start for t in token_times]
    itl = [b - a for t in token_times for a, b in zip(t, t[1:])]
    return {"throughput_tok_s": sum(len(t) for t in token_times) / (end - start), "wall_s": end - start,
            "ttft_p50_s": pct(ttft, 50), "ttft_p99_s": pct(ttft, 99),
            "itl_p50_s": pct(itl, 50), "itl_p99_s": pct(itl, 99), "complete": all(len(t) == new for t in token_times)}


def run_engine(model, ps, args, transport="auto"):
    from hetero import Engine, EngineConfig
    from hetero.engine.kv_pool import BLOCK_SIZE

    cfg = model.config
    row = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads) * 2
    blocks = sum(-(-(len(p) + args.new) // BLOCK_SIZE) for p in ps) + 2 * len(ps)
    ecfg = EngineConfig(max_num_seqs=len(ps), max_num_batched_tokens=args.chunk, long_prefill_chunk=args.chunk,
                        kv_memory=blocks * BLOCK_SIZE * row, max_model_len=len(ps[0]) + args.new + 64,
                        transport=transport)
    t0 = time.monotonic()
    with Engine(model, ecfg) as eng:
        log(f"engine up in {time.monotonic() - t0:.1f} s (pool {eng.kv.num_blocks} blocks)")
        t = time.monotonic()
        eng.add_request(list(range(10, 10 + 64)), 4, ignore_eos=True).result()     # warm-up: workers, kernels
        warm = time.monotonic() - t
        eng.reset_prefix_cache()
        phases = timed_phases(eng) if args.phases else None       # the timed load's steps only
        gd.sync()
        start = time.monotonic()
        streams = [eng.add_request(p, args.new, ignore_eos=True) for p in ps]
        done = threading.Event()
        threading.Thread(target=progress, args=(eng, streams, start, done), daemon=True).start()
        try:
            for s in streams:
                s.result()
        finally:
            done.set()
        return metrics(start, [s.token_times for s in streams], args.new) | {
            "warmup_s": warm, "steps": eng.steps, "preemptions": eng.scheduler.num_preemptions,
            "pool_bytes": eng.kv.num_blocks * BLOCK_SIZE * row, "transport": "cuda" if eng.kv.gpu else "host",
            # the prompt rows' copies into the pool: as DMAs (PagedKV.lock_pages) or waited for; page-locking's host time
            "dma_copies": eng.kv.dma_copies, "sync_copies": eng.kv.sync_copies,
            "pin_s": eng.kv._pins.seconds if eng.kv._pins is not None else None} | (
                {"phases": phases} if phases else {})


PHASES = (("runner", "execute"), ("kv", "post_decode"), ("kv", "finish_decode"), ("kv", "write_rows"),
          ("kv", "read_rows"))


def timed_phases(eng):
    """--phases: each step's forward (runner.execute) and, inside it, the pool's calls timed on the
    host, with the device synchronized before and after each (GPU work is then charged to the
    call that ran it, and nothing overlaps: slower, for attribution only). Returns a dict the
    wrappers fill: name -> [calls, seconds]; the forward's time outside those calls (dense layers,
    prefill attention) is "execute" minus their sum."""
    out = {}
    for owner, name in PHASES:
        obj = getattr(eng, owner)
        fn, acc = getattr(obj, name), out.setdefault(name, [0, 0.0])

        def timed(*a, _fn=fn, _acc=acc, **k):
            gd.sync()
            t = time.perf_counter()
            try:
                return _fn(*a, **k)
            finally:
                gd.sync()
                _acc[0] += 1
                _acc[1] += time.perf_counter() - t
        setattr(obj, name, timed)
    return out


def log(msg):
    """A cell's progress on stderr (the parent appends it to <out>_cells.log as it runs: a cell cut
    by its timeout still tells where its time went)."""
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def progress(eng, streams, start, done, every=5.0):
    """Every few seconds: the engine's steps, tokens out, requests begun / finished, blocks used."""
    while not done.wait(every):
        toks = [len(s.token_times) for s in streams]
        log(f"{time.monotonic() - start:6.1f} s: step {eng.steps}, {sum(toks)} tokens, {sum(t > 0 for t in toks)} "
            f"begun, {sum(s.finished for s in streams)} finished, {eng.kv_manager.num_used_blocks} blocks used")


def run_hf_cb(model, ps, args):
    from transformers import GenerationConfig

    gc = GenerationConfig(max_new_tokens=args.new, do_sample=False, eos_token_id=-1, pad_token_id=0)
    manager = model.init_continuous_batching(generation_config=gc)
    manager.start()
    try:
        t = time.monotonic()
        manager.get_result(manager.add_request(list(range(10, 74)), max_new_tokens=4, eos_token_id=-1), timeout=600)
        warm = time.monotonic() - t
        offset = time.monotonic() - time.perf_counter()       # its timestamps are perf_counter's
        start = time.monotonic()
        for i, p in enumerate(ps):
            manager.add_request(p, request_id=f"r{i}", max_new_tokens=args.new, record_timestamps=True,
                                eos_token_id=-1)
        results = {}
        while len(results) < len(ps):
            out = manager.get_result(timeout=args.timeout)
            if out is None:
                raise RuntimeError(f"transformers' manager stopped with {len(results)} of {len(ps)} results")
            if out.error:
                raise RuntimeError(f"transformers' manager failed request {out.request_id}: {out.error}")
            results[out.request_id] = out
            log(f"{time.monotonic() - start:6.1f} s: {len(results)} of {len(ps)} finished")
        times = [[x + offset for x in results[f"r{i}"].timestamps] for i in range(len(ps))]
        return metrics(start, times, args.new) | {"warmup_s": warm}
    finally:
        manager.stop(block=True, timeout=60)


def one(args):
    import torch

    gd.DEVICE = args.device
    t = time.monotonic()
    model = gd.build(args.shape)
    log(f"{args.one}: {args.n} x {args.context}, model built in {time.monotonic() - t:.1f} s")
    if args.device == "cpu":
        model = model.float()
    ps = prompts(args.n, args.context, model.config.vocab_size)
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    try:
        if args.one == "hf_cb":
            res = run_hf_cb(model, ps, args)
        else:
            res = run_engine(model, ps, args, "host" if args.one == "engine_host" else "auto")
    except torch.OutOfMemoryError as e:
        res = {"oom": True, "error": str(e)[:300]}
    if args.device == "cuda":
        res["peak_gpu_bytes"] = torch.cuda.max_memory_allocated()
    print("RESULT " + json.dumps(res), flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="llama3-8b", choices=list(gd.SHAPES))
    ap.add_argument("--loads", nargs="+", default=["8x32768", "16x32768"], help="NxL: N requests of L tokens")
    ap.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    ap.add_argument("--new", type=positive, default=32)
    ap.add_argument("--chunk", type=positive, default=8192, help="the engine's tokens per step (and per prefill chunk)")
    ap.add_argument("--timeout", type=positive, default=240, help="seconds a cell may take")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a dry run")
    ap.add_argument("--phases", action="store_true",
                    help="engine cells: where a step's time goes (device synchronized around each part: slower)")
    ap.add_argument("--out", default="gpu_engine")
    ap.add_argument("--copy-to", default=None, help="also copy the JSON here after every cell (a device's $OUT)")
    ap.add_argument("--one", choices=SYSTEMS, help=argparse.SUPPRESS)
    ap.add_argument("--n", type=positive, help=argparse.SUPPRESS)
    ap.add_argument("--context", type=positive, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        return one(args)
    loads = []
    for load in args.loads:
        n, _, L = load.partition("x")
        if not (n.isdigit() and L.isdigit() and int(n) > 0 and int(L) > 0):
            ap.error(f"--loads takes NxL (e.g. 8x32768), got {load!r}")
        loads.append((int(n), int(L)))
    rows, summary = [], {}
    cells_log = os.path.join(args.copy_to, f"{args.out}_cells.log") if args.copy_to else None
    for n, L in loads:
        row = {"requests": n, "context": L}
        for s in args.systems:
            cmd = [sys.executable, os.path.abspath(__file__), "--one", s, "--n", str(n), "--context", str(L),
                   "--shape", args.shape, "--new", str(args.new), "--chunk", str(args.chunk),
                   "--device", args.device, "--timeout", str(args.timeout)] + (["--phases"] if args.phases else [])
            r = run_child(cmd, args.timeout, log=cells_log)
            if r.get("phases"):
                print("  phases (calls, s): " + ", ".join(f"{k} {c} {t:.2f}" for k, (c, t) in r["phases"].items()))
            row[s] = r
            print(f"{n:3d} x {L:6d} {s:11s} " + (
                f"{r['throughput_tok_s']:8.1f} tok/s  TTFT p50 {r['ttft_p50_s']:.2f} p99 {r['ttft_p99_s']:.2f} s  "
                f"ITL p50 {r['itl_p50_s'] * 1e3:.0f} p99 {r['itl_p99_s'] * 1e3:.0f} ms  peak GPU "
                f"{(r.get('peak_gpu_bytes') or 0) / 2**30:.1f} GiB" if "throughput_tok_s" in r else
                ("OOM" if r.get("oom") else "failed: " + str(r.get("error", ""))[-400:])), flush=True)
        e, h = row.get("engine", {}), row.get("hf_cb", {})
        if "throughput_tok_s" in e and "throughput_tok_s" in h:
            x = e["throughput_tok_s"] / h["throughput_tok_s"]
            summary[f"{n}x{L // 1024}K engine / hf_cb throughput"] = (round(x, 2), x >= TARGET)
        elif "throughput_tok_s" in e and "hf_cb" in row:
            summary[f"{n}x{L // 1024}K served by the engine, not by hf_cb"] = (True, True)
        eh = row.get("engine_host", {})
        if "throughput_tok_s" in e and "throughput_tok_s" in eh:   # what the CUDA transport gives (no target)
            summary[f"{n}x{L // 1024}K engine / engine_host throughput"] = (
                round(e["throughput_tok_s"] / eh["throughput_tok_s"], 2), None)
        rows.append(row)
        write_json(f"{args.out}.json", {"machine": machine(), "shape": args.shape, "new": args.new,
                                        "chunk": args.chunk, "rows": rows, "summary": summary}, args.copy_to)
    for k, (v, met) in summary.items():
        print(f"  {'MET ' if met else '    ' if met is None else 'MISS'} {k}: {v}")


if __name__ == "__main__":
    main()
