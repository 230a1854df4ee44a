"""Contexts on the CPU: time to first token over a cached long context against re-prefilling,
and loading a saved context against prefilling it again.

The bench model of bench/decode_cpu.py (4 layers of a Llama shape, 1024 wide, 16q/4kv heads of
64, random weights, fp32), a document of --context tokens (default 16K) and a question of 64:
  ttft_cached      generate(question, context=ctx, extend_context=False), first token
  ttft_hetero      hetero's one-shot generate over document + question, first token
  ttft_hf          HF generate over document + question, first token
  prefill_s        gen.prefill(document)
  load_s           gen.load_context(file) of that context saved with ctx.save
  decode_shared    8 questions in one batch, context=[ctx] * 8 (its KV read in place, once per
                   step for all 8): seconds per decoded token, (t(1 + N new) - t(1 new)) / N
  decode_private   the same with HeteroConfig.share_contexts=False: each request a private copy
  decode_dense     the same 8 questions without the context: the step's cost outside attention
                   over the document (the dense layers and lm_head of a batch of 8, HF's loop),
                   which sharing cannot remove; (private - dense) / (shared - dense) is the
                   attention part's ratio
Targets (#15): ttft_hf / ttft_cached >= 20, prefill_s / load_s >= 10, decode_private /
decode_shared >= 3 with KV memory (private copies / context + shared batch) >= 6. Rounds
alternate; medians and spread.

    python bench/contexts.py [--context 16384] [--rounds 3]
"""
import argparse
import os
import statistics
import sys
import tempfile
import time

from dataclasses import replace

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.common import machine, positive, write_json  # noqa: E402
from bench.decode_cpu import build  # noqa: E402
from hetero import HeteroGenerator  # noqa: E402
from hetero.generator import CONTINUE_CHUNK  # noqa: E402
from hetero.offload.arena import whole_blocks  # noqa: E402
from hetero.offload.session import KVSession  # noqa: E402

TARGETS = {"ttft_hf_over_cached": 20.0, "prefill_over_load": 10.0, "decode_private_over_shared": 3.0,
           "kv_private_over_shared": 6.0}


def first_token_s(fn):
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=positive, default=16384)
    ap.add_argument("--question", type=positive, default=64)
    ap.add_argument("--rounds", type=positive, default=3)
    ap.add_argument("--batch", type=positive, default=8, help="questions sharing the context")
    ap.add_argument("--decode", type=positive, default=16, help="tokens decoded per question (N)")
    ap.add_argument("--out", default="contexts.json")
    args = ap.parse_args()
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    model = build("bench", torch.float32)
    g = torch.Generator().manual_seed(0)
    doc = torch.randint(3, model.config.vocab_size, (1, args.context), generator=g)
    q = torch.randint(3, model.config.vocab_size, (1, args.question), generator=g)
    full = torch.cat([doc, q], 1)
    one = dict(max_new_tokens=1, do_sample=False, pad_token_id=0)
    runs = {k: [] for k in ("ttft_cached", "ttft_hetero", "ttft_hf", "prefill_s", "load_s", "decode_shared",
                            "decode_private", "decode_dense")}
    B, N = args.batch, args.decode
    qs = torch.randint(3, model.config.vocab_size, (B, args.question), generator=g)
    reserve = args.question + N + 8
    with HeteroGenerator(model) as gen, tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "doc.ctx")
        gen.generate(q, **one)                                   # workers and planner profile warm
        for rnd in range(args.rounds):
            t = time.perf_counter()
            ctx = gen.prefill(doc, reserve=reserve)
            runs["prefill_s"].append(time.perf_counter() - t)
            runs["ttft_cached"].append(first_token_s(lambda: gen.generate(q, context=ctx, extend_context=False, **one)))
            for share in (True, False) if rnd % 2 == 0 else (False, True):
                gen.config = replace(gen.config, share_contexts=share)
                step = decode_s(gen, qs, ctx, N)
                runs["decode_shared" if share else "decode_private"].append(step)
            runs["decode_dense"].append(decode_s(gen, qs, None, N))
            ctx.save(path)
            ctx.close()
            t = time.perf_counter()
            gen.load_context(path, reserve=reserve).close()
            runs["load_s"].append(time.perf_counter() - t)
            runs["ttft_hetero"].append(first_token_s(lambda: gen.generate(full, **one)))
            runs["ttft_hf"].append(first_token_s(lambda: model.generate(full, attention_mask=torch.ones_like(full),
                                                                        **one)))
            print(f"round {rnd}: " + "  ".join(f"{k} {v[-1]:.3f} s" for k, v in runs.items()), flush=True)
        file_bytes = os.path.getsize(path)
        kv = kv_bytes(gen, args.context, args.question, N, B)
    med = {k: statistics.median(v) for k, v in runs.items()}
    spread = {k: [round(min(v), 4), round(max(v), 4)] for k, v in runs.items()}
    summary = {
        "TTFT, HF re-prefilling / cached context": (round(med["ttft_hf"] / med["ttft_cached"], 1),
                                                    med["ttft_hf"] / med["ttft_cached"] >= TARGETS["ttft_hf_over_cached"]),
        "TTFT, hetero re-prefilling / cached context": (round(med["ttft_hetero"] / med["ttft_cached"], 1), None),
        "prefill / load of the saved context": (round(med["prefill_s"] / med["load_s"], 1),
                                                med["prefill_s"] / med["load_s"] >= TARGETS["prefill_over_load"]),
        f"decode per token, {B} private copies / {B} sharing the context": (
            round(med["decode_private"] / med["decode_shared"], 2),
            med["decode_private"] / med["decode_shared"] >= TARGETS["decode_private_over_shared"]),
        "  the attention part of it, (private - dense) / (shared - dense)": (
            round((med["decode_private"] - med["decode_dense"]) / (med["decode_shared"] - med["decode_dense"]), 2), None),
        f"KV bytes, {B} private copies / context + shared batch": (
            round(kv["private"] / kv["shared"], 2), kv["private"] / kv["shared"] >= TARGETS["kv_private_over_shared"]),
        "  whole arenas (KV + staging + partials), private / shared": (
            round(kv["arena_private"] / kv["arena_shared"], 2), None),
    }
    for k, (v, met) in summary.items():
        print(f"  {'    ' if met is None else 'MET ' if met else 'MISS'} {k}: {v}x")
    print("wrote", write_json(args.out, {
        "bench": "contexts", "machine": machine(), "context": args.context, "question": args.question,
        "rounds": args.rounds, "model": "bench (4 layers, 1024 wide, 16q/4kv heads of 64), fp32",
        "batch": B, "decoded": N, "saved_file_bytes": file_bytes, "kv_bytes": kv, "runs_s": runs, "median_s": med,
        "spread_s": spread, "targets": TARGETS, "summary": summary}))


def decode_s(gen, qs, ctx, n):
    """Seconds per decoded token of a batch continuing ctx: (t(1 + n new) - t(1 new)) / n."""
    kw = dict(do_sample=False, pad_token_id=0, context=None if ctx is None else [ctx] * qs.shape[0])
    t1 = first_token_s(lambda: gen.generate(qs, max_new_tokens=1, **kw))
    tn = first_token_s(lambda: gen.generate(qs, max_new_tokens=1 + n, **kw))
    what = "no context" if ctx is None else f"share_contexts={gen.config.share_contexts}"
    print(f"  {what}: {qs.shape[0]} x (1 + {n}) tokens in {tn:.2f} s, "
          f"first {t1:.2f} s: {(tn - t1) / n * 1e3:.1f} ms per decoded token", flush=True)
    return (tn - t1) / n


def kv_bytes(gen, context, question, n, batch):
    """KV bytes held during a batch call: the context's arena plus the call's (rows past the shared
    blocks), against the call's arena of private copies (as generate sizes them)."""
    spec, tmax = gen.spec, min(CONTINUE_CHUNK, question)
    ctx = KVSession.layout_for(spec, 1, whole_blocks(context + question + n + 8), CONTINUE_CHUNK)
    cap = whole_blocks(context + question + 1 + n)
    shared = KVSession.layout_for(spec, batch, cap, tmax, private=cap - context // 32 * 32, groups=1)
    private = KVSession.layout_for(spec, batch, cap, tmax)
    return {"context": ctx.kv_bytes, "shared_batch": shared.kv_bytes, "shared": ctx.kv_bytes + shared.kv_bytes,
            "private": private.kv_bytes,
            # whole arenas: KV plus the staging and the split partials (sized for a step of tmax tokens)
            "arena_shared": ctx.nbytes + shared.nbytes, "arena_private": private.nbytes}


if __name__ == "__main__":
    main()
