"""What hetero.cpu_linear saves an engine's decode steps on the CPU, side by side.

--ops: the three ways of an fp32 linear layer alone, side by side: F.linear (MKL), torch.mm(W,
X^T) (one row as two) and oneDNN's (torch.ops.mkldnn._linear_pointwise), over SmolLM2-135M's 30
layers' projections in turn (random weights of its shapes, out of the caches as in a forward)
and over its LM head (49152 x 576), at --rows rows; the ways take turns for --rounds rounds;
reported per row count: each way's median over the rounds (ms) and its spread.

Otherwise: real SmolLM2-135M-Instruct (--dtype fp32: the path is fp32's), D requests decoding at once
(D = 1, 2, 4, 8), each a 30-token question over its own --doc-token window of an English text;
the time of each step of decode tokens alone (the first two of each set dropped), with the
model's linear layers as cpu_linear makes them ("mm") and as nn.Linear ("linear"), the two ways
taking turns for --rounds rounds in one process (the same engine, its pool and workers; the
prefix cache reset between sets). Reported per D: the median step time of each way over all
rounds, each round's median, and their ratio; the greedy tokens of the two ways compared.

    python bench/cpu_linear.py [--rounds 3] [--doc 1024] [--new 24]
    python bench/cpu_linear.py --ops [--rounds 5] [--out cpu_linear_ops.json]
"""
import argparse
import os
import statistics
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.common import machine, write_json  # noqa: E402
from bench.serve_overhead import corpus_tokens  # noqa: E402


def decode_steps(eng, prompts, new):
    """Step times (s) of the decode-alone steps of `prompts` run together, and their tokens."""
    eng.reset_prefix_cache()
    streams = [eng.add_request(p, new, ignore_eos=True) for p in prompts]
    while any(not s.token_times for s in streams):
        eng.step()
    times = []
    while not all(s.finished for s in streams):
        t = time.perf_counter()
        eng.step()
        times.append(time.perf_counter() - t)
    return times[2:], [s.token_ids for s in streams]


def ops(args):
    """The --ops table: {rows: {way: [each round's ms]}} for the projections and the LM head."""
    import torch.nn.functional as F

    from hetero import cpu_linear

    torch.manual_seed(0)
    shapes = [(576, 576), (576, 192), (576, 192), (576, 576), (576, 1536), (576, 1536), (1536, 576)]
    parts = {"projections": [torch.randn(o, i) for _ in range(30) for i, o in shapes],
             "lm_head": [torch.randn(49152, 576)]}

    def mm(x, w):
        return torch.mm(w, (x.expand(2, -1).contiguous() if x.shape[0] == 1 else x).t())

    ways = {"F.linear": lambda x, w: F.linear(x, w), "mm": mm}
    if cpu_linear.ONEDNN:
        ways["oneDNN"] = lambda x, w: cpu_linear._onednn_linear(x, w, None, "none", [], "")

    def once(way, ws, m):
        xs = {i: torch.randn(m, i) for i in (576, 1536)}
        way(xs[576], ws[0])
        t = time.perf_counter()
        for w in ws:
            way(xs[w.shape[1]], w)
        return (time.perf_counter() - t) * 1e3

    res = {"machine": machine(), "args": vars(args), "parts": {}}
    for part, ws in parts.items():
        table = res["parts"][part] = {}
        for m in args.rows:
            got = {w: [] for w in ways}
            for r in range(args.rounds):
                order = list(ways) if r % 2 == 0 else list(reversed(ways))
                for w in order:
                    once(ways[w], ws, m)                          # warm
                    got[w].append(min(once(ways[w], ws, m) for _ in range(3)))
            table[m] = {w: {"median_ms": statistics.median(v), "rounds_ms": v} for w, v in got.items()}
            print(f"{part} rows {m:4d}: " + "  ".join(
                f"{w} {statistics.median(v):7.2f} [{min(v):.1f}-{max(v):.1f}]" for w, v in got.items()), flush=True)
    write_json(args.out, res)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--doc", type=int, default=1024)
    ap.add_argument("--new", type=int, default=24)
    ap.add_argument("--decoding", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--out", default=None, help="cpu_linear.json (--ops: cpu_linear_ops.json)")
    ap.add_argument("--ops", action="store_true", help="the linear ways alone (see above)")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32, 64, 512])
    args = ap.parse_args()
    if args.ops:
        args.out = args.out or "cpu_linear_ops.json"
        return ops(args)
    args.out = args.out or "cpu_linear.json"

    from hetero import Engine, EngineConfig
    from hetero.models import load_smollm2

    model, tok = load_smollm2(torch.float32 if args.dtype == "fp32" else torch.bfloat16)
    rng = np.random.default_rng(0)
    top = max(args.decoding)
    prompts = [corpus_tokens(tok, args.doc, 100 + i) + corpus_tokens(tok, 30, int(rng.integers(1 << 30)))
               for i in range(top)]
    cfg = EngineConfig(background=False, kv_memory=1 << 30, max_model_len=args.doc + 30 + args.new + 32,
                       max_num_seqs=top)
    times = {(w, d): [] for w in ("mm", "linear") for d in args.decoding}
    rounds = {(w, d): [] for w in ("mm", "linear") for d in args.decoding}
    same = {d: True for d in args.decoding}
    with Engine(model, cfg) as eng:
        uses = eng.runner.fast_linear
        decode_steps(eng, prompts[:1], 4)                       # warm-up
        for r in range(args.rounds):
            for d in args.decoding:
                tokens = {}
                for w in (("mm", "linear") if r % 2 == 0 else ("linear", "mm")):
                    eng.runner.fast_linear = uses and w == "mm"   # the runner sets cpu_linear.ACTIVE from it
                    ts, tokens[w] = decode_steps(eng, prompts[:d], args.new)
                    times[(w, d)] += ts
                    rounds[(w, d)].append(statistics.median(ts))
                same[d] &= tokens["mm"] == tokens["linear"]
    res = {"machine": machine(), "args": vars(args), "installed": bool(uses), "rows": []}
    for d in args.decoding:
        mm, lin = statistics.median(times[("mm", d)]), statistics.median(times[("linear", d)])
        row = {"decoding": d, "mm_ms": mm * 1e3, "linear_ms": lin * 1e3, "ratio": mm / lin,
               "mm_rounds_ms": [t * 1e3 for t in rounds[("mm", d)]],
               "linear_rounds_ms": [t * 1e3 for t in rounds[("linear", d)]], "same_tokens": same[d]}
        res["rows"].append(row)
        print(f"{d} decoding: mm {mm * 1e3:6.1f} ms, linear {lin * 1e3:6.1f} ms, ratio {mm / lin:.2f} "
              f"(rounds mm {[round(t) for t in row['mm_rounds_ms']]}, linear "
              f"{[round(t) for t in row['linear_rounds_ms']]}); same tokens: {same[d]}")
    write_json(args.out, res)


if __name__ == "__main__":
    main()
