"""What keeping a document's rows on the model's device (EngineConfig.prefix_rows_memory,
hetero.engine.prefix_rows) saves a question over it, in-process, side by side.

One engine, its --doc-token document pinned, then --questions questions of 20-40 tokens, each
asked twice in turn (the order alternating, the prefix cache reset before each: only the pinned
document is found): once with the document's rows read back from the
pool at every layer (the runner's PrefixRows swapped for one of budget 0), once with them kept
(the engine's own PrefixRows, the default budget); max_new_tokens 1: the time from add_request
to the first token, stepping the engine in this thread (no HTTP). One warm-up question each way,
not counted. Reported: p50 / p99 of each, and the per-question ratio kept / read back (median
and spread), since this VM's speed drifts between questions more than the difference.

The model: the real SmolLM2-135M-Instruct (--dtype fp32 or bf16) on this machine's cores; or, on a
GPU machine, bench/gpu_decode.py's random-weight bf16 model (--shape llama3-8b --device cuda),
random document and question tokens, where reading a document back is a gather on the host and a
copy over PCIe at every layer.

    python bench/prefix_rows.py [--doc 4096] [--questions 40] [--dtype bf16]
    python bench/prefix_rows.py --shape llama3-8b --device cuda --doc 32768 --questions 12 --chunk 8192
"""
import argparse
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.common import machine, write_json  # noqa: E402
from bench.engine import pct  # noqa: E402
from bench.serve_overhead import corpus_tokens  # noqa: E402


def ask(eng, prompt):
    t = time.perf_counter()
    s = eng.add_request(prompt, 1)
    while not s.finished:
        eng.step()
    if s.error is not None:
        raise s.error
    return time.perf_counter() - t


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--doc", type=int, default=4096)
    ap.add_argument("--questions", type=int, default=40)
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="bf16", help="SmolLM2's weights and KV")
    ap.add_argument("--shape", default=None, help="bench/gpu_decode.py's random bf16 model of this shape "
                                                  "(default: the real SmolLM2-135M-Instruct)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--chunk", type=int, default=256, help="the engine's tokens per step (the pin's prefill chunks)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="prefix_rows.json")
    ap.add_argument("--copy-to", default=None, help="also copy the JSON here (a device's $OUT)")
    args = ap.parse_args()

    from hetero import Engine, EngineConfig
    from hetero.engine.prefix_rows import PrefixRows

    rng = np.random.default_rng(args.seed + 1)
    lengths = [int(rng.integers(20, 41)) for _ in range(args.questions + 1)]
    if args.shape is None:
        from hetero.models import load_smollm2

        model, tok = load_smollm2(torch.bfloat16 if args.dtype == "bf16" else torch.float32)
        model.to(args.device)
        doc = corpus_tokens(tok, args.doc, args.seed)
        qs = [corpus_tokens(tok, n, int(rng.integers(1 << 30))) for n in lengths]
    else:
        import bench.gpu_decode as gd

        gd.DEVICE = args.device
        model = gd.build(args.shape)
        vocab = model.config.vocab_size
        doc = rng.integers(3, vocab, args.doc).tolist()
        qs = [rng.integers(3, vocab, n).tolist() for n in lengths]
    rows = 2 * args.doc * model.config.num_hidden_layers * model.config.num_key_value_heads * \
        (getattr(model.config, "head_dim", None) or model.config.hidden_size // model.config.num_attention_heads) * \
        model.dtype.itemsize
    cfg = EngineConfig(background=False, kv_memory=max(1 << 30, 2 * rows), max_num_batched_tokens=args.chunk,
                       long_prefill_chunk=args.chunk, max_model_len=args.doc + 64)
    names = ("read_back", "kept")
    times = {n: [] for n in names}
    with Engine(model, cfg) as eng:
        kept = eng.runner.prefix_rows
        ways = {"read_back": PrefixRows(eng.runner.spec, 0), "kept": kept}

        def ask_as(name, prompt):
            eng.runner.prefix_rows = ways[name]
            eng.reset_prefix_cache()           # the other way's question blocks: not found (the pin stays)
            return ask(eng, prompt)

        t = time.perf_counter()
        eng.pin(doc).result()
        pin_s = time.perf_counter() - t
        for n in names:
            ask_as(n, doc + qs[0])                                  # warm-up, not counted
        for i, q in enumerate(qs[1:]):
            for n in (names if i % 2 == 0 else names[::-1]):
                times[n].append(ask_as(n, doc + q))
        hits = (kept.hits, kept.misses)
        budget = kept.budget
    ratio = [k / r for k, r in zip(times["kept"], times["read_back"])]
    res = {"machine": machine(), "args": vars(args), "question_tokens": lengths[1:], "pin_prefill_s": pin_s,
           "prefix_rows_budget": budget, "prefix_rows_hits_misses": hits, "ratio_median": float(np.median(ratio)),
           "ratio_p10": pct(ratio, 10), "ratio_p90": pct(ratio, 90), "ratios": ratio}
    for n in names:
        res[n] = {"ttft_p50": pct(times[n], 50), "ttft_p99": pct(times[n], 99), "ttft": times[n]}
        print(f"{n:9s}: TTFT p50 {res[n]['ttft_p50'] * 1e3:.1f} ms, p99 {res[n]['ttft_p99'] * 1e3:.1f} ms")
    print(f"kept / read back, per question: median {res['ratio_median']:.3f} "
          f"[p10 {res['ratio_p10']:.3f}, p90 {res['ratio_p90']:.3f}]; hits/misses {hits}; "
          f"the pin's prefill {pin_s:.1f} s")
    write_json(args.out, res, copy_to=args.copy_to)


if __name__ == "__main__":
    main()
