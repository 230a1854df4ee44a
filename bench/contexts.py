"""Contexts on the CPU: time to first token over a cached long context against re-prefilling,
and loading a saved context against prefilling it again.

The bench model of bench/decode_cpu.py (4 layers of a Llama shape, 1024 wide, 16q/4kv heads of
64, random weights, fp32), a document of --context tokens (default 16K) and a question of 64:
  ttft_cached      generate(question, context=ctx, extend_context=False), first token
  ttft_hetero      hetero's one-shot generate over document + question, first token
  ttft_hf          HF generate over document + question, first token
  prefill_s        gen.prefill(document)
  load_s           gen.load_context(file) of that context saved with ctx.save
Targets (#15): ttft_hf / ttft_cached >= 20, prefill_s / load_s >= 10. Rounds alternate; medians
and spread. The shared-prefix batch (8 questions over one context read once per step) is not
built yet and not measured here.

    python bench/contexts.py [--context 16384] [--rounds 3]
"""
import argparse
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.common import machine, write_json  # noqa: E402
from bench.decode_cpu import build  # noqa: E402
from hetero import HeteroGenerator  # noqa: E402

TARGETS = {"ttft_hf_over_cached": 20.0, "prefill_over_load": 10.0}


def first_token_s(fn):
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=16384)
    ap.add_argument("--question", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="contexts.json")
    args = ap.parse_args()
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    model = build("bench", torch.float32)
    g = torch.Generator().manual_seed(0)
    doc = torch.randint(3, model.config.vocab_size, (1, args.context), generator=g)
    q = torch.randint(3, model.config.vocab_size, (1, args.question), generator=g)
    full = torch.cat([doc, q], 1)
    one = dict(max_new_tokens=1, do_sample=False, pad_token_id=0)
    runs = {k: [] for k in ("ttft_cached", "ttft_hetero", "ttft_hf", "prefill_s", "load_s")}
    with HeteroGenerator(model) as gen, tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "doc.ctx")
        gen.generate(q, **one)                                   # workers and planner profile warm
        for rnd in range(args.rounds):
            t = time.perf_counter()
            ctx = gen.prefill(doc, reserve=args.question + 8)
            runs["prefill_s"].append(time.perf_counter() - t)
            runs["ttft_cached"].append(first_token_s(lambda: gen.generate(q, context=ctx, extend_context=False, **one)))
            ctx.save(path)
            ctx.close()
            t = time.perf_counter()
            gen.load_context(path, reserve=args.question + 8).close()
            runs["load_s"].append(time.perf_counter() - t)
            runs["ttft_hetero"].append(first_token_s(lambda: gen.generate(full, **one)))
            runs["ttft_hf"].append(first_token_s(lambda: model.generate(full, attention_mask=torch.ones_like(full),
                                                                        **one)))
            print(f"round {rnd}: " + "  ".join(f"{k} {v[-1]:.3f} s" for k, v in runs.items()), flush=True)
        file_bytes = os.path.getsize(path)
    med = {k: statistics.median(v) for k, v in runs.items()}
    summary = {
        "TTFT, HF re-prefilling / cached context": (round(med["ttft_hf"] / med["ttft_cached"], 1),
                                                    med["ttft_hf"] / med["ttft_cached"] >= TARGETS["ttft_hf_over_cached"]),
        "TTFT, hetero re-prefilling / cached context": (round(med["ttft_hetero"] / med["ttft_cached"], 1), None),
        "prefill / load of the saved context": (round(med["prefill_s"] / med["load_s"], 1),
                                                med["prefill_s"] / med["load_s"] >= TARGETS["prefill_over_load"]),
    }
    for k, (v, met) in summary.items():
        print(f"  {'    ' if met is None else 'MET ' if met else 'MISS'} {k}: {v}x")
    print("wrote", write_json(args.out, {
        "bench": "contexts", "machine": machine(), "context": args.context, "question": args.question,
        "rounds": args.rounds, "model": "bench (4 layers, 1024 wide, 16q/4kv heads of 64), fp32",
        "saved_file_bytes": file_bytes, "runs_s": runs, "median_s": med, "targets": TARGETS, "summary": summary,
        "note": "not measured: 8 questions sharing one context read once per step (shared-prefix batches "
                "are not built yet)"}))


if __name__ == "__main__":
    main()
