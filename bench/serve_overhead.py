"""What `hetero serve`'s HTTP layer costs, and the time to first token over a long pinned or cached
document, on the real SmolLM2-135M-Instruct (--dtype fp32 or bf16: weights and KV) and this
machine's cores.

overhead  The same batch of requests (--requests chat prompts of ~--prompt tokens, --new tokens
          each, greedy, eos ignored) submitted all at once, in rounds that alternate between
          the in-process engine (Engine.add_request, the server's EngineConfig) and `hetero
          serve` (streamed over loopback HTTP with httpx, every token through the SSE path).
          Each round starts its system fresh and warms it with one batch (not timed); only one
          system is alive at a time. Throughput = completion tokens / (last token - first
          send). The ratio HTTP / in-process per round pair, its median and spread.
pinned    One `hetero serve`: a --doc-token document pinned (POST /v1/contexts, a prompt), then
          --questions requests one after another, each a 20-40-token question over it (the
          context named in the body), max_tokens 1: TTFT p50/p99 (one client, its connection
          kept, as a service keeps it). Then the same over the automatic prefix cache: the
          document sent once as a plain prompt, then questions whose prompt is document + question.

    python bench/serve_overhead.py [--rounds 3] [--requests 16] [--new 64] [--doc 4096] [--dtype bf16]
"""
import argparse
import asyncio
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.common import machine, write_json  # noqa: E402
from bench.engine import pct  # noqa: E402
from bench.serve import Server, one  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUDGET = 256
MODEL = "SmolLM2-135M-Instruct"


def corpus_tokens(tok, n, seed):
    """n token ids of real text (this repository's README and sources), from an offset picked by seed."""
    text = ""
    for d in ("README.md", "hetero/engine/engine.py", "hetero/engine/kv_pool.py", "hetero/server/app.py",
              "hetero/generator.py", "hetero/engine/scheduler.py"):
        with open(os.path.join(ROOT, d)) as f:
            text += f.read()
    ids = tok(text, add_special_tokens=False)["input_ids"]
    start = np.random.default_rng(seed).integers(0, max(len(ids) - n, 1))
    return ids[start:start + n]


class Serve(Server):
    """bench/serve.py's hetero server at this budget (its --cpu-workers when given)."""

    def __init__(self, args):
        super().__init__("hetero", argparse.Namespace(budget=BUDGET, cpu_workers=args.cpu_workers, dtype=args.dtype,
                                                      prefix_rows=getattr(args, "prefix_rows", None)))


def http_batch(url, prompts, new):
    """Completion tokens / seconds of the batch sent at once over HTTP (streamed)."""
    import httpx

    async def go():
        limits = httpx.Limits(max_connections=100, max_keepalive_connections=100)
        async with httpx.AsyncClient(timeout=3600, limits=limits) as c:
            t0 = time.monotonic()
            res = await asyncio.gather(*(one(c, url, {"model": MODEL, "messages": p, "max_tokens": new,
                                                      "temperature": 0, "ignore_eos": True, "stream": True,
                                                      "stream_options": {"include_usage": True}}, t0)
                                         for p in prompts))
            return sum(n for _, _, n in res), max(t[-1] for _, t, _ in res) - t0
    tokens, span = asyncio.run(go())
    return tokens / span, tokens


def engine_batch(engine, ids, new):
    t0 = time.monotonic()
    streams = [engine.add_request(x, max_new_tokens=new, do_sample=False, ignore_eos=True) for x in ids]
    tokens = sum(len(s.result()) for s in streams)
    return tokens / (max(s.token_times[-1] for s in streams) - t0), tokens


def overhead(args, model, tok):
    from hetero import Engine
    from hetero.engine.config import EngineConfig

    rng = np.random.default_rng(args.seed)
    prompts = [[{"role": "user", "content": tok.decode(corpus_tokens(tok, args.prompt, int(rng.integers(1 << 30))))}]
               for _ in range(args.requests)]
    ids = [tok.apply_chat_template(p, add_generation_prompt=True, return_dict=True)["input_ids"] for p in prompts]
    warm = [[{"role": "user", "content": tok.decode(corpus_tokens(tok, args.prompt, 10**6 + i))}]
            for i in range(args.requests)]
    warm_ids = [tok.apply_chat_template(p, add_generation_prompt=True, return_dict=True)["input_ids"] for p in warm]
    rounds = []
    for r in range(args.rounds):
        row = {}
        for system in (("engine", "http") if r % 2 == 0 else ("http", "engine")):
            if system == "engine":
                cfg = EngineConfig(max_num_seqs=32, max_num_batched_tokens=BUDGET, long_prefill_chunk=BUDGET,
                                   kv_memory=2 << 30, cpu_workers=args.cpu_workers)
                with Engine(model, cfg, tokenizer=tok) as engine:
                    engine_batch(engine, warm_ids, args.new)
                    row[system], tokens = engine_batch(engine, ids, args.new)
            else:
                server = Serve(args)
                try:
                    http_batch(server.url, warm, args.new)
                    row[system], tokens = http_batch(server.url, prompts, args.new)
                finally:
                    server.stop()
            print(f"round {r}: {system} {row[system]:.1f} tok/s ({tokens} tokens)", flush=True)
        row["ratio"] = row["http"] / row["engine"]
        rounds.append(row)
    ratios = [x["ratio"] for x in rounds]
    return {"rounds": rounds, "ratio_median": float(np.median(ratios)), "ratio_min": min(ratios),
            "ratio_max": max(ratios), "http_cost_median": 1 - float(np.median(ratios))}


def pinned(args, tok):
    import httpx

    rng = np.random.default_rng(args.seed + 1)
    doc = corpus_tokens(tok, args.doc, args.seed)
    qs = [corpus_tokens(tok, int(rng.integers(20, 41)), int(rng.integers(1 << 30))) for _ in range(args.questions)]
    other = corpus_tokens(tok, args.doc, args.seed + 7)           # another document, cached by its first use
    base = {"model": MODEL, "max_tokens": 1, "temperature": 0, "stream": True}
    server = Serve(args)
    out = {}
    try:
        t = time.monotonic()
        r = httpx.post(server.url + "/v1/contexts", json={"name": "doc", "prompt": doc}, timeout=600)
        r.raise_for_status()
        out["pin_prefill_s"] = time.monotonic() - t

        async def go():
            # one client for every request, as a RAG service keeps its connection (a new client per
            # request put its set-up on these 2 cores, ~30 ms a request, into each TTFT before)
            async with httpx.AsyncClient(timeout=600) as c:
                async def ttft(body):
                    sent, times, _ = await one_completion(c, server.url, body, time.monotonic())
                    return times[0] - sent

                await ttft(base | {"prompt": qs[0], "context": "doc"})             # warm-up, not counted
                pin = [await ttft(base | {"prompt": q, "context": "doc"}) for q in qs]
                cold = await ttft(base | {"prompt": other})
                cached = [await ttft(base | {"prompt": other + q}) for q in qs]
                return pin, cold, cached

        pin, out["cold_ttft_s"], cached = asyncio.run(go())
        out |= {"pinned_ttft_p50": pct(pin, 50), "pinned_ttft_p99": pct(pin, 99), "pinned_ttft": pin,
                "cached_ttft_p50": pct(cached, 50), "cached_ttft_p99": pct(cached, 99), "cached_ttft": cached,
                "question_tokens": [len(q) for q in qs]}
    finally:
        server.stop()
    return out


async def one_completion(client, url, body, t_send):
    """As bench.serve.one, for /v1/completions."""
    import json

    sent, times = time.monotonic(), []
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:300]}")
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                ev = json.loads(line[6:])
                if ev.get("choices") and ev["choices"][0].get("text") is not None:
                    times.append(time.monotonic())
    return sent, times, len(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=200)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--doc", type=int, default=4096)
    ap.add_argument("--questions", type=int, default=20)
    ap.add_argument("--cpu-workers", type=int, default=None)
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="weights and KV, both systems")
    ap.add_argument("--parts", nargs="+", default=["overhead", "pinned"], choices=["overhead", "pinned"])
    ap.add_argument("--prefix-rows", nargs="+", default=[None], metavar="SIZE", help="the pinned part once per "
                    "value of hetero serve --prefix-rows-memory, in turn, --ab-rounds times (e.g. 0 512M: documents' "
                    "rows read back each time, then kept)")
    ap.add_argument("--ab-rounds", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="serve_overhead.json")
    args = ap.parse_args()

    from hetero.models import load_smollm2

    model, tok = load_smollm2(torch.bfloat16 if args.dtype == "bf16" else torch.float32)
    res = {"machine": machine(), "args": vars(args), "budget": BUDGET}
    if "overhead" in args.parts:
        res["overhead"] = overhead(args, model, tok)
        o = res["overhead"]
        print(f"HTTP / in-process throughput: median {o['ratio_median']:.3f} "
              f"[{o['ratio_min']:.3f}, {o['ratio_max']:.3f}] over {args.rounds} rounds")
    if "pinned" in args.parts:
        runs = []
        for _ in range(args.ab_rounds):
            for value in args.prefix_rows:
                p = pinned(argparse.Namespace(**{**vars(args), "prefix_rows": value}), tok)
                runs.append(p | {"prefix_rows_memory": value})
                print(f"{args.doc}-token document (--prefix-rows-memory {value or 'default'}): pinned TTFT p50 "
                      f"{p['pinned_ttft_p50'] * 1e3:.0f} ms, p99 {p['pinned_ttft_p99'] * 1e3:.0f} ms; prefix-cached "
                      f"p50 {p['cached_ttft_p50'] * 1e3:.0f} ms, p99 {p['cached_ttft_p99'] * 1e3:.0f} ms (the pin's "
                      f"prefill {p['pin_prefill_s']:.1f} s, a cold prompt's TTFT {p['cold_ttft_s']:.1f} s)", flush=True)
        res["pinned"] = runs[0] if len(runs) == 1 else runs
    write_json(args.out, res)


if __name__ == "__main__":
    main()
