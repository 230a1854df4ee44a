"""`hetero serve` under an open-loop HTTP load, beside the servers people use, on the same model and cores.

The RAG mix of bench/engine.py as chat requests over HTTP (a system message holding one of D
documents, Zipf popularity; a user question of 20-60 tokens; N new tokens, greedy, eos ignored
where the server allows it), sent at Poisson arrival times (open loop: a slow server does not slow
the arrivals) with `stream=true`; each token's arrival is timed at the client. Every (rate,
system) cell starts a fresh server (caches cold) and warms it with two requests over other text
(not timed).

Systems (each skipped, and said so, where it is not installed):
  hetero      hetero serve (this repository), --dtype weights (fp32 or bf16), one CPU worker per core but one
  hetero-paced  the same with --step-time-target (--step-target s): prompt chunks paced beside
              decodes (named in --systems only)
  llama       llama.cpp's C++ llama-server (continuous batching, 8 slots, prompt cache) on the same
              model's GGUF (Q4_1: 4-bit weights), --llama-server PATH (built from the
              llama-cpp-python source distribution's vendored llama.cpp, cmake target llama-server)
  hf          transformers serve --continuous-batching on the same weights (--dtype: fp32 or bf16)
With --replicas, hetero serve --replicas on a local Ray instance instead (a fresh context store
per cell):
  r1          one replica on half the cores (taskset)
  r2          two replicas on all the cores, routed by document (DocumentRouter)
  r2-pow2     two replicas, Ray Serve's default router (the less loaded of two: documents ignored)
and per cell the documents' sources (hit in the replica's pool / loaded from the store /
prefilled), the document hit rate and the share of prompt tokens reported cached (usage).

Per cell: throughput (completion tokens / (last token - first request)), TTFT, inter-token and
end-to-end latency p50/p99, and goodput: the share of requests meeting the SLO (TTFT <= --slo-ttft
and their own p99 inter-token gap <= --slo-itl), and the misses by cause (TTFT, inter-token) for the
first request sent over its document (cold) and for the later ones. Summary: per system the highest
rate with >= 90 % of requests within the SLO.

    python bench/serve.py [--llama-server PATH] [--rates 0.1 0.25 0.5] [--systems hetero llama hf]
    python bench/serve.py --replicas [--rates ...] --out serve_replicas.json
"""
import argparse
import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.common import machine, write_json  # noqa: E402
from bench.engine import pct, workload  # noqa: E402
from hetero.server.launch import free_port, wait_healthy  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SYSTEMS = ("hetero", "hetero-paced", "llama", "hf")      # hetero-paced: --step-time-target (--step-target)
# hetero serve --replicas (--replicas-bench): one replica on half the cores, two on all of them routed by
# document, two routed by Ray Serve's default (power of two choices: load only)
REPLICA_SYSTEMS = ("r1", "r2", "r2-pow2")


def command(system, port, args):
    from hetero.models import model_cache_dir, smollm2_gguf

    threads = str(len(os.sched_getaffinity(0)))
    if system in ("hetero", "hetero-paced"):
        return [sys.executable, "-m", "hetero.cli", "serve", "--port", str(port), "--max-num-seqs", "32",
                "--max-num-batched-tokens", str(args.budget), "--context-memory", "2G", "--log-level", "warning",
                "--dtype", getattr(args, "dtype", "fp32")] + \
            (["--cpu-workers", str(args.cpu_workers)] if getattr(args, "cpu_workers", None) else []) + \
            (["--step-time-target", str(args.step_target)] if system == "hetero-paced" else []) + \
            (["--prefix-rows-memory", args.prefix_rows] if getattr(args, "prefix_rows", None) else [])
    if system in REPLICA_SYSTEMS:
        n = 1 if system == "r1" else 2
        cores = sorted(os.sched_getaffinity(0))
        pin = ["taskset", "-c", ",".join(map(str, cores[:max(1, len(cores) // 2)]))] if n == 1 else []
        return pin + [sys.executable, "-m", "hetero.cli", "serve", "--replicas", str(n), "--port", str(port),
                      "--max-num-seqs", "32", "--max-num-batched-tokens", str(args.budget), "--context-memory", "1G",
                      "--log-level", "warning", "--saved-contexts", args.store,
                      "--routing", "pow2" if system == "r2-pow2" else "document"]
    if system == "llama":
        return [args.llama_server, "-m", smollm2_gguf(), "--port", str(port), "-c", str(8 * 4096), "-np", "8",
                "-t", threads, "-tb", threads, "--cont-batching", "--log-disable"]
    here = os.path.join(os.path.dirname(sys.executable), "transformers")      # this venv's, else the PATH's
    return [here if os.path.exists(here) else shutil.which("transformers") or "transformers", "serve",
            os.path.join(model_cache_dir(), "smollm2-135m-instruct-fp32"), "--continuous-batching",
            "--port", str(port), "--device", "cpu", "--dtype", "bfloat16" if getattr(args, "dtype", "fp32") == "bf16" else
            "float32"]


class Server:
    def __init__(self, system, args):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(command(system, self.port, args), cwd=ROOT, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            wait_healthy(self.url, self.proc, 300, f"the {system} server")
        except RuntimeError:
            self.stop()
            raise

    def stop(self):
        """SIGTERM to the server (its own shutdown: Ray Serve's replicas close their engines), then to
        whatever of its session is left."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(90)
            except subprocess.TimeoutExpired:
                pass
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            time.sleep(2)
        self.proc.wait()


async def one(client, url, body, t_send):
    """Send at t_send (monotonic); returns (sent, token times, completion tokens)."""
    delay = t_send - time.monotonic()
    if delay > 0:
        await asyncio.sleep(delay)
    sent, times, usage = time.monotonic(), [], {}
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:300]}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if ev.get("usage"):
                usage = ev["usage"]
            if ev.get("choices") and ev["choices"][0].get("delta", {}).get("content"):
                times.append(time.monotonic())
    one.cached[0] += (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    one.cached[1] += usage.get("prompt_tokens") or 0
    return sent, times, usage.get("completion_tokens") or len(times)


one.cached = [0, 0]         # prompt tokens reported cached (usage.prompt_tokens_details), prompt tokens


def bodies(system, docs_text, reqs, questions_text, model):
    out = []
    for q, qt in zip(reqs, questions_text):
        b = {"model": model, "messages": [{"role": "system", "content": docs_text[q["doc"]]},
                                          {"role": "user", "content": qt}],
             "max_tokens": q["new"], "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
        if system != "hf":
            b["ignore_eos"] = True
        out.append(b)
    return out


def run_cell(system, rate, args, tok, tokens):
    import httpx

    docs, reqs = workload(tokens, args, rate, args.seed)
    docs_text = [tok.decode(d) for d in docs]
    qtext = [tok.decode(q["question"]) for q in reqs]
    warm = [tok.decode(list(reversed(tokens[400 * i:400 * (i + 1)]))) for i in range(4)]
    replicas = system in REPLICA_SYSTEMS
    if replicas:
        args.store = tempfile.mkdtemp(prefix="hetero-bench-store-")       # cold: no document saved yet
    server = Server(system, args)
    try:
        model = httpx.get(server.url + "/v1/models", timeout=30).json()["data"][0]["id"]
        limits = httpx.Limits(max_connections=1000, max_keepalive_connections=1000)

        async def go():
            async with httpx.AsyncClient(timeout=3600, limits=limits) as c:
                t = time.monotonic()
                for text in warm[:4 if replicas else 2]:        # warm-up, not timed (replicas: each, likely)
                    await one(c, server.url, {"model": model, "messages": [{"role": "user", "content": text}],
                                              "max_tokens": 8, "temperature": 0, "stream": True}, 0)
                warm_s = time.monotonic() - t
                one.cached[:] = [0, 0]
                before = _replica_metrics(server.url) if replicas else {}
                t0 = time.monotonic() + 0.1
                res = await asyncio.gather(*(one(c, server.url, b, t0 + q["arrival"])
                                             for b, q in zip(bodies(system, docs_text, reqs, qtext, model), reqs)))
                after = _replica_metrics(server.url) if replicas else {}
                return res, warm_s, {k: v - before.get(k, 0) for k, v in after.items()}
        res, warm_s, counts = asyncio.run(go())
    finally:
        server.stop()
        if replicas:
            shutil.rmtree(args.store, ignore_errors=True)
    out = summarize(res, reqs, args) | {"warmup_s": warm_s}
    if one.cached[1]:
        out["cached_prompt_share"] = one.cached[0] / one.cached[1]
    if replicas:
        docs = {k.split('"')[1]: v for k, v in counts.items() if k.startswith("hetero_documents_total")}
        out |= {"documents": docs, "document_hit_rate": docs.get("hit", 0) / max(sum(docs.values()), 1),
                "replica_requests": sorted(v for k, v in counts.items() if k.startswith("hetero_replica_requests"))}
    return out


def _replica_metrics(url) -> dict[str, float]:
    """The ingress's counters: requests per replica, documents by source (hit / load / prefill)."""
    import re

    import httpx

    text = httpx.get(url + "/metrics", timeout=30).text
    return {m.group(1): float(m.group(2)) for m in re.finditer(
        r"^((?:hetero_replica_requests_total|hetero_documents_total)\{[^}]*\}) (\S+)$", text, re.M)}


def summarize(res, reqs, args):
    ttft = [times[0] - sent for sent, times, _ in res if times]
    itl = [b - a for _, times, _ in res for a, b in zip(times, times[1:])]
    e2e = [times[-1] - sent for sent, times, _ in res if times]
    ok = 0
    seen, misses = set(), {"first_ttft": 0, "first_itl": 0, "later_ttft": 0, "later_itl": 0}
    for (sent, times, _), q in zip(res, reqs):
        gaps = [b - a for a, b in zip(times, times[1:])]
        slow_first = not times or times[0] - sent > args.slo_ttft
        slow_gaps = bool(gaps) and pct(gaps, 99) > args.slo_itl
        ok += not (slow_first or slow_gaps)
        kind = "later" if q["doc"] in seen else "first"      # first: the first request sent over its document
        seen.add(q["doc"])
        misses[kind + "_ttft"] += slow_first
        misses[kind + "_itl"] += slow_gaps
    span = max(t[-1] for _, t, _ in res if t) - min(s for s, _, _ in res)
    out_tokens = sum(n for _, _, n in res)
    return {"throughput_tok_s": out_tokens / span, "completion_tokens": out_tokens, "makespan_s": span,
            "ttft_p50": pct(ttft, 50), "ttft_p99": pct(ttft, 99), "itl_p50": pct(itl, 50), "itl_p99": pct(itl, 99),
            "e2e_p50": pct(e2e, 50), "e2e_p99": pct(e2e, 99), "within_slo": ok / len(res), "requests": len(res),
            "slo_misses": misses}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--docs", type=int, default=4)
    ap.add_argument("--doc-min", type=int, default=512)
    ap.add_argument("--doc-max", type=int, default=1024)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--new-min", type=int, default=16)
    ap.add_argument("--new-max", type=int, default=32)
    ap.add_argument("--rates", nargs="+", type=float, default=[0.1, 0.25, 0.5])
    ap.add_argument("--systems", nargs="+", default=None, choices=SYSTEMS + REPLICA_SYSTEMS)
    ap.add_argument("--replicas", action="store_true", help="the replica rows (r1, r2, r2-pow2) instead of the peers")
    ap.add_argument("--llama-server", default=shutil.which("llama-server"))
    ap.add_argument("--budget", type=int, default=256, help="hetero's tokens per engine step")
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="hetero's weights and KV")
    ap.add_argument("--step-target", type=float, default=0.12, help="hetero-paced's --step-time-target (s)")
    ap.add_argument("--slo-ttft", type=float, default=2.0)
    ap.add_argument("--slo-itl", type=float, default=0.2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="serve.json")
    args = ap.parse_args()
    from hetero.models import english_text, load_smollm2

    _, tok = load_smollm2(__import__("torch").float32)
    tokens = tok(english_text())["input_ids"]
    args.systems = args.systems or list(REPLICA_SYSTEMS if args.replicas else [s for s in SYSTEMS if s != "hetero-paced"])
    systems = [s for s in args.systems if s != "llama" or args.llama_server]
    if "llama" in args.systems and not args.llama_server:
        print("no llama-server (--llama-server PATH): no llama.cpp row")
    cells = []
    for rate in args.rates:
        for system in systems:
            t = time.time()
            try:
                cell = run_cell(system, rate, args, tok, tokens)
            except Exception as e:                   # a server that fails a cell: said, the others go on
                cell = {"error": f"{type(e).__name__}: {e}"[:500]}
            cell.update(system=system, rate=rate, wall_s=time.time() - t)
            cells.append(cell)
            show = {k: round(v, 3) if isinstance(v, float) else v for k, v in cell.items()
                    if k in ("throughput_tok_s", "ttft_p50", "ttft_p99", "itl_p50", "itl_p99", "within_slo", "error",
                             "document_hit_rate", "cached_prompt_share", "documents", "slo_misses")}
            print(f"rate {rate} {system}: {show}", flush=True)
            write_json(args.out, {"bench": "serve", "machine": machine(), "args": vars(args), "cells": cells,
                                  "summary": summary(cells, systems)})
    for k, v in summary(cells, systems).items():
        print(f"  {k}: {v}")


def summary(cells, systems):
    out = {}
    for s in systems:
        ok = [c["rate"] for c in cells if c["system"] == s and c.get("within_slo", 0) >= 0.9]
        out[f"{s}: highest rate with >= 90 % of requests within the SLO"] = max(ok) if ok else None
    best = {s: v for s, v in ((s, out[f"{s}: highest rate with >= 90 % of requests within the SLO"]) for s in systems)}
    if best.get("hetero") and any(v for k, v in best.items() if k != "hetero"):
        peer = max(v for k, v in best.items() if k != "hetero" and v)
        out["hetero / the better peer (target >= 1.5)"] = round(best["hetero"] / peer, 2)
    by = {(c["system"], c["rate"]): c for c in cells if "error" not in c}
    for rate in sorted({c["rate"] for c in cells}):
        r1, r2, rr = by.get(("r1", rate)), by.get(("r2", rate)), by.get(("r2-pow2", rate))
        if r1 and r2:
            out[f"rate {rate}: goodput r2 / r1 (target >= 1.7)"] = round(r2["within_slo"] / r1["within_slo"], 2) \
                if r1["within_slo"] else f"r1 {r1['within_slo']}, r2 {r2['within_slo']:.2f}"
        for name, c in (("r2", r2), ("r2-pow2", rr)):
            if r1 and c and r1.get("document_hit_rate"):
                out[f"rate {rate}: document hit rate {name} / r1 (target >= 0.9 for r2)"] = round(
                    c["document_hit_rate"] / r1["document_hit_rate"], 2)
    return out


if __name__ == "__main__":
    np.seterr(all="ignore")
    main()
