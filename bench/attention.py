"""Decode attention on the CPU: the kernel against the machine's read bandwidth, torch SDPA and
a plain grouped matmul.

In one run, on the same KV data (batch 1, one query token):
  (a) single-core and all-core streaming read bandwidth (numba sums over 256-512 MB),
      measured again next to every configuration (this machine's bandwidth drifts),
  (b) the kernel's KV bytes/s through the real worker pool, for 1..N takers (the parent
      alone, then with 1..N-1 workers) and split counts 1..16 (the exhaustive sweep), and the
      planner's choice against the sweep's best (both timed again, head to head, for the ratio),
  (c) torch scaled_dot_product_attention with the same number of threads, and
  (d) a plain fp32 grouped matmul (q [Hkv, G, D] @ K^T, softmax, @ V) with as many threads,
for fp32 and bf16 storage, contexts 4K-64K, Llama-3-8B (32 q / 8 kv heads, dim 128) and
Llama-2-7B (32 / 32 / 128) head shapes. KV is cold, as in a model: the arena holds one KV
per layer for enough layers to span at least 4x the last-level cache, and successive calls
take successive layers (every system alike); a row whose rotation fits in the cache says so
(cache_resident). The parent is pinned to the first core, a worker to each other. Writes
JSON and a PNG.
"""
import argparse
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import RESULTS, machine, positive, stream_read_all_gbps, stream_read_gbps, write_json  # noqa: E402
from hetero.cpu_attention.planner import ProfiledPlanner  # noqa: E402
from hetero.cpu_attention.simd import BK  # noqa: E402
from hetero.ipc.pool import WorkerPool  # noqa: E402
from hetero.model_spec import ModelSpec  # noqa: E402
from hetero.profile import (Rotation, attention_job, cold_layers, last_level_cache_bytes, load_or_measure,  # noqa: E402
                            median_times, synthetic_session)

SHAPES = {"llama3-8b": (32, 8, 128), "llama2-7b": (32, 32, 128)}
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
SPLITS = (1, 2, 4, 8, 16)
BATCH = (32768, 8192, 2048, 300)   # the mixed batch for the planner
TARGETS = {"one_worker_of_stream": 0.70, "vs_sdpa": 3.0, "scaling": 0.85, "planner_of_best": 0.90}


def local_bounds(cores):
    """Streaming-read GB/s right now: one core (the parent's) and all cores. Measured next to each
    configuration because this machine's bandwidth drifts over a run."""
    parent = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, {cores[0]})                 # the parent's core: the one-taker runs
        one = stream_read_gbps(256 << 20, 3)
        os.sched_setaffinity(0, cores)
        return {"1": one, "all": stream_read_all_gbps(len(cores), 512 << 20, 3)}
    finally:
        os.sched_setaffinity(0, parent)


def sweep_and_plan(pool, profile, session, lengths, reps, rot):
    """Time one decode step (one query token) for every (workers, splits) and for the planner's
    choice; then the sweep's best and the planner's choice again, head to head (the sweep's
    minimum of ~10 noisy medians is biased low: it picks a lucky one)."""
    session.lengths[:] = lengths
    session.order[:] = np.argsort(-np.asarray(lengths), kind="stable")    # as KVSession does per step
    plan = ProfiledPlanner(profile, pool.n).plan(session.lengths, 1, session.layout)
    configs = {(n, s) for n in range(pool.n + 1) for s in SPLITS} | {plan}
    sweep = median_times({c: attention_job(pool, session, lengths, *c, rot.next) for c in sorted(configs)}, reps)
    best = min(sweep, key=sweep.get)
    final = median_times({c: attention_job(pool, session, lengths, *c, rot.next) for c in {best, plan}}, 3 * reps)
    return sweep, best, plan, final


def make_session(pool, shape, dtype, lengths):
    """A session of random KV for `lengths` in enough layers to span COLD_FACTOR last-level caches,
    staged for a one-token decode step: (profile, session, rotation, rotated bytes)."""
    Hq, Hkv, D = shape
    layer_bytes = 2 * Hkv * sum(lengths) * D * torch.finfo(dtype).bits // 8
    layers = cold_layers(layer_bytes)
    spec = ModelSpec(model_type="bench", layers=layers, q_heads=Hq, kv_heads=Hkv, head_dim=D, dtype=dtype,
                     max_positions=None, sliding=(False,) * layers)
    profile, _ = load_or_measure(pool, spec)
    return profile, synthetic_session(pool, spec, lengths, max(lengths) + BK), Rotation(layers), layers * layer_bytes


def bench_batch(pool, shape, dtype, lengths, reps):
    """The planner against the sweep on a batch of unequal contexts (units of unequal size)."""
    profile, session, rot, _ = make_session(pool, shape, dtype, lengths)
    try:
        sweep, best, plan, final = sweep_and_plan(pool, profile, session, lengths, reps, rot)
    finally:
        session.close()
    return {"lengths": list(lengths), "sweep_ms": {f"{n}x{s}": t * 1e3 for (n, s), t in sweep.items()},
            "best": best, "best_ms": final[best] * 1e3, "planner": plan, "planner_ms": final[plan] * 1e3,
            "planner_of_best": final[best] / final[plan]}


def grouped_matmul(q, k, v, scale):
    """Plain attention of one query token: q [Hq, D], k/v [Hkv, L, D] fp32 -> [Hq, D]."""
    Hkv, L, D = k.shape
    s = torch.matmul(q.view(Hkv, -1, D), k.transpose(1, 2)) * scale      # [Hkv, G, L]
    return torch.matmul(torch.softmax(s, -1), v).view(-1, D)              # [Hkv, G, D] -> [Hq, D]


def bench_config(pool, cores, shape, dtype, L, reps, sdpa_threads):
    Hq, Hkv, D = shape
    bounds = local_bounds(cores)
    profile, session, rot, rotated = make_session(pool, shape, dtype, [L])
    try:
        scale = D ** -0.5
        nbytes = 2 * Hkv * (L + 1) * D * torch.finfo(dtype).bits // 8
        sweep, best, plan, final = sweep_and_plan(pool, profile, session, [L], reps, rot)
        # torch SDPA (storage dtype) and a plain fp32 grouped matmul on the same rows, layers rotating alike
        rows = [session.read_rows(i, 0, L + 1) for i in range(rot.layers)]
        rows32 = [(k.float(), v.float()) for k, v in rows]
        q = session.q[:, :, :1].to(dtype)                                     # [1, Hq, 1, D]
        q32 = session.q[0, :, 0].clone()                                     # [Hq, D]
        sdpa, mm = {}, {}
        parent = os.sched_getaffinity(0)
        os.sched_setaffinity(0, cores)             # torch's threads get every core, like the workers
        for threads in sdpa_threads:
            torch.set_num_threads(threads)
            sdpa[threads] = median_times({0: lambda: torch.nn.functional.scaled_dot_product_attention(
                q, *(x[None] for x in rows[rot.next()]), scale=scale, enable_gqa=Hq != Hkv)}, reps)[0]
            mm[threads] = median_times({0: lambda: grouped_matmul(q32, *rows32[rot.next()], scale)}, reps)[0]
        os.sched_setaffinity(0, parent)
        rows = rows32 = None                       # the rows' memory back before the next config
    finally:
        session.close()
    # takers: the parent and n - 1 workers
    best_n = {n + 1: min(t for (m, _), t in sweep.items() if m == n) for n in range(pool.n + 1)}
    llc = last_level_cache_bytes()
    return {
        "context": L, "kv_bytes": nbytes, "stream_gbps": bounds, "layers_rotated": rot.layers,
        "rotated_mb": rotated / 2 ** 20, "llc_mb": llc / 2 ** 20, "cache_resident": rotated <= llc,
        "kernel_gbps": {n: nbytes / t / 1e9 for n, t in best_n.items()},
        "sweep_ms": {f"{n}x{s}": t * 1e3 for (n, s), t in sweep.items()},
        "best": best, "best_ms": final[best] * 1e3, "planner": plan, "planner_ms": final[plan] * 1e3,
        "planner_of_best": final[best] / final[plan], "planner_of_best_in_sweep": sweep[best] / sweep[plan],
        "sdpa_gbps": {t: nbytes / s / 1e9 for t, s in sdpa.items()},
        "vs_sdpa": {t: sdpa[t] / best_n[t] for t in sdpa if t in best_n},
        "matmul_fp32_ms": {t: s * 1e3 for t, s in mm.items()},
        "matmul_fp32_gbps": {t: 2 * Hkv * (L + 1) * D * 4 / s / 1e9 for t, s in mm.items()},   # its own fp32 bytes
        "vs_matmul": {t: mm[t] / best_n[t] for t in mm if t in best_n},
    }


def plot(payload, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = list(payload["results"])
    fig, axes = plt.subplots(1, len(keys), figsize=(4.5 * len(keys), 4), squeeze=False)
    for ax, key in zip(axes[0], keys):
        rows = payload["results"][key]
        ctx = [r["context"] // 1024 for r in rows]
        for n in rows[0]["kernel_gbps"]:
            ax.plot(ctx, [r["kernel_gbps"][n] for r in rows], "o-", label=f"hetero, {n} core(s)")
        for t in rows[0]["sdpa_gbps"]:
            ax.plot(ctx, [r["sdpa_gbps"][t] for r in rows], "s--", label=f"torch SDPA, {t} thread(s)")
            ax.plot(ctx, [r["kv_bytes"] / r["matmul_fp32_ms"][t] / 1e6 for r in rows], "x-.",
                    label=f"fp32 grouped matmul, {t} thread(s)")
        ax.plot(ctx, [r["stream_gbps"]["1"] for r in rows], color="gray", ls=":", label="1-core read bound")
        ax.plot(ctx, [r["stream_gbps"]["all"] for r in rows], color="black", ls=":", label="all-core read bound")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context (K tokens)")
        ax.set_ylabel("KV GB/s")
        ax.set_title(key)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def summarize(payload):
    """Each issue target, met or not, from the measured numbers (bounds: those measured next to each row)."""
    out = {}
    for key, rows in payload["results"].items():
        if key.endswith("bf16"):
            r32 = [r for r in rows if r["context"] == 32768]
            if r32:
                ratio = r32[0]["kernel_gbps"][1] / r32[0]["stream_gbps"]["1"]
                out[f"{key} 32K one worker / 1-core bound"] = (round(ratio, 3), ratio >= TARGETS["one_worker_of_stream"])
        low = min(min(r["vs_sdpa"].values()) for r in rows)
        out[f"{key} min speedup vs SDPA (same threads)"] = (round(low, 2), low >= TARGETS["vs_sdpa"])
        for r in rows:
            one = r["kernel_gbps"][1]
            for n, g in r["kernel_gbps"].items():
                if n > 1:
                    ratio = g / min(n * one, r["stream_gbps"]["all"])
                    out[f"{key} {r['context'] // 1024}K {n} takers / min({n}x one taker, all-core bound)"] = (
                        round(ratio, 3), ratio >= TARGETS["scaling"])
        worst = min(r["planner_of_best"] for r in rows)
        out[f"{key} planner / exhaustive best (worst context)"] = (round(worst, 3), worst >= TARGETS["planner_of_best"])
    for key, r in payload.get("batch", {}).items():
        ratio = r["planner_of_best"]
        out[f"{key} planner / exhaustive best (batch {'/'.join(str(n) for n in r['lengths'])})"] = (
            round(ratio, 3), ratio >= TARGETS["planner_of_best"])
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", type=positive, nargs="+", default=[4096, 8192, 16384, 32768, 65536])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    ap.add_argument("--reps", type=positive, default=3, help="timed calls per job in each of 3 rounds")
    ap.add_argument("--out", default="attention")
    args = ap.parse_args()

    cores = sorted(os.sched_getaffinity(0))
    payload = {"machine": machine(), "cores": cores, "targets": TARGETS, "results": {}, "batch": {}}
    # the parent (it takes units too) on the first core, a worker on each other core
    os.sched_setaffinity(0, {cores[0]})
    pool = WorkerPool(max(1, len(cores) - 1), cores[1:] or cores, spin_budget=500)
    try:
        for shape in args.shapes:
            for dt in args.dtypes:
                key = f"{shape} {dt}"
                rows = payload["results"][key] = []
                for L in args.contexts:
                    r = bench_config(pool, cores, SHAPES[shape], DTYPES[dt], L, args.reps, sorted({1, len(cores)}))
                    rows.append(r)
                    kg = ", ".join(f"{n}c {g:.1f}" for n, g in r["kernel_gbps"].items())
                    sg = ", ".join(f"{t}t {g:.1f}" for t, g in r["sdpa_gbps"].items())
                    b = r["stream_gbps"]
                    print(f"{key:16s} {L // 1024:3d}K  read bound 1c {b['1']:.1f} all {b['all']:.1f} | "
                          f"hetero GB/s: {kg}  | SDPA GB/s: {sg}  | fp32 matmul x{min(r['vs_matmul'].values()):.1f} | "
                          f"planner {r['planner']} {r['planner_ms']:.2f} ms vs best {r['best']} {r['best_ms']:.2f} ms")
            for dt in args.dtypes:     # a mixed batch: the planner with units of unequal size
                key = f"{shape} {dt}"
                r = payload["batch"][key] = bench_batch(pool, SHAPES[shape], DTYPES[dt], BATCH, args.reps)
                print(f"{key:16s} batch {r['lengths']}  planner {r['planner']} {r['planner_ms']:.2f} ms "
                      f"vs best {r['best']} {r['best_ms']:.2f} ms")
    finally:
        pool.close()
        os.sched_setaffinity(0, cores)
    bounds = [r["stream_gbps"] for rows in payload["results"].values() for r in rows]
    payload["stream_1core_gbps"] = max(b["1"] for b in bounds)      # the run's best, for reference
    payload["stream_all_gbps"] = max(b["all"] for b in bounds)
    payload["summary"] = summarize(payload)
    for name, (value, met) in payload["summary"].items():
        print(f"  {'MET ' if met else 'MISS'} {name}: {value}")
    print("wrote", write_json(f"{args.out}.json", payload))
    png = os.path.join(RESULTS, f"{args.out}.png")
    plot(payload, png)
    print("wrote", png)


if __name__ == "__main__":
    main()
