"""The decode kernel with and without its next-block prefetch (simd.PREFETCH), on one core.

One process per (variant, shape, dtype, round), alternating the variants, each with its own numba
cache directory (the flag is read when the kernel compiles). Each times attend_unit over 8 KV
heads of cold KV (--mb MB in all, beyond the last-level cache), batch 1, one query token, the
group's query rows per head (4: Llama-3-8B, 1: Llama-2-7B), median of 9 calls after a warm one;
bf16 as a bf16 model runs it (dp > 0: vdpbf16ps where the CPU has it). Reports GB/s of KV read
per variant and shape, and the ratio. Each child is pinned to the last usable core.

    python bench/kernel_prefetch.py [--rounds 2] [--mb 256] [--out kernel_prefetch]
"""
import argparse
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.common import machine, positive, write_json  # noqa: E402

CASES = [("llama3-8b", 4, "bf16"), ("llama3-8b", 4, "fp32"), ("llama2-7b", 1, "bf16"), ("llama2-7b", 1, "fp32")]


def one(prefetch, G, dtype, mb):
    """Child: GB/s (median of 9) of attend_unit over `mb` MB of KV."""
    import time

    import numpy as np

    from hetero.cpu_attention import simd
    simd.PREFETCH = prefetch
    from hetero.cpu_attention import kernel
    from hetero.cpu_attention.simd import BK, W

    D, H = 128, 8
    item = 4 if dtype == "fp32" else 2
    nblk = max(1, mb * 2**20 // (2 * H * D * BK * item))
    rng = np.random.default_rng(0)
    if dtype == "fp32":
        K = rng.standard_normal((H, nblk, D, BK), dtype=np.float32)
        V = rng.standard_normal((H, nblk, D // W, BK, W), dtype=np.float32)
        code = 0
    else:                                         # bf16 bits of modest values
        K = rng.integers(0, 2**16, size=(H, nblk, D, BK), dtype=np.uint16) & 0x3fff
        V = rng.integers(0, 2**16, size=(H, nblk, D // W, BK, W), dtype=np.uint16) & 0x3fff
        code = 1
    dp = 0.0 if dtype == "fp32" else D ** -0.5                  # bf16: q's exact bf16 pairs (qp) times dp
    qs = rng.standard_normal((G, D)).astype(np.float32) * 0.01
    qp = np.zeros((G, D // 2), np.uint32)
    o, m, l = np.zeros((G, D), np.float32), np.zeros(G, np.float32), np.zeros(G, np.float32)
    S = kernel.score_scratch(G)
    L = nblk * BK
    tab = np.arange(nblk, dtype=np.int64)             # contiguous blocks: the identity table

    def run():
        for h in range(H):
            kernel.attend_unit(qs, qp, dp, G, 1, K[h], V[h], tab, 0, nblk, 0, L, L, 0, 0.0, code, o, m, l, S, 0)

    run()
    times = []
    for _ in range(9):
        t = time.perf_counter()
        run()
        times.append(time.perf_counter() - t)
    return (K.nbytes + V.nbytes) / float(np.median(times)) / 1e9


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=positive, default=2)
    ap.add_argument("--mb", type=positive, default=256, help="MB of KV per call (keep it past the last-level cache)")
    ap.add_argument("--out", default="kernel_prefetch")
    ap.add_argument("--copy-to", default=None)
    ap.add_argument("--one", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print("RESULT", one(args.one[0] == "1", int(args.one[1]), args.one[2], args.mb))
        return
    core = sorted(os.sched_getaffinity(0))[-1]
    caches = {v: tempfile.mkdtemp(prefix=f"hetero_nb{v}_") for v in (0, 1)}
    res = {f"{s} {dt}": {"off": [], "on": []} for s, _, dt in CASES}
    for _ in range(args.rounds):
        for shape, G, dtype in CASES:
            for v in (0, 1):
                out = subprocess.run(["taskset", "-c", str(core), sys.executable, os.path.abspath(__file__),
                                      "--mb", str(args.mb), "--one", str(v), str(G), dtype],
                                     env=dict(os.environ, NUMBA_CACHE_DIR=caches[v], NUMBA_NUM_THREADS="1"),
                                     capture_output=True, text=True)
                if out.returncode or "RESULT" not in out.stdout:
                    print(f"{shape} {dtype} prefetch {v}: failed: {out.stderr[-500:]}", flush=True)
                    continue
                gbps = float(out.stdout.split("RESULT")[-1])
                res[f"{shape} {dtype}"]["on" if v else "off"].append(round(gbps, 2))
                print(f"{shape} {dtype} prefetch {'on ' if v else 'off'}: {gbps:5.1f} GB/s", flush=True)
    summary = {k: round(max(r["on"]) / max(r["off"]), 3) for k, r in res.items() if r["on"] and r["off"]}
    for k, x in summary.items():
        print(f"  {k}: prefetch on / off (best of rounds) {x:.2f}x")
    print("wrote", write_json(f"{args.out}.json", {
        "bench": "kernel_prefetch", "machine": machine(), "core": core, "mb": args.mb, "results": res,
        "summary": summary, "note": "GB/s of KV read by attend_unit on one core (median of 9 calls per process)"},
        args.copy_to))


if __name__ == "__main__":
    main()
