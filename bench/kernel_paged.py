"""The decode kernel on one core through block tables, against a base tree's kernel, in one process.

Throughput: kernel.run_job (-> run_unit -> attend_unit), its args built once as a worker's are, for
batch 1, one query token, Llama-3-8B heads (32 q / 8 kv, dim 128), one split, fp32 and bf16
storage, contexts 4K-16K, over cold KV (successive calls take successive layers of arrays
spanning at least --mb MB, past the last-level cache). The variants are timed in turn, call by
call (in a random order each round), in this one process pinned to one core, so a noisy
neighbour slows them alike:
  base          --base's kernel (a source tree, e.g. `git archive` of the parent commit; loaded
                beside this one as the package hetero_base), the arena layout
  contiguous    this tree's kernel, the arena layout [layers, 1, Hkv, nblk, D, BK] (identity table)
  paged-ident   the same KV as a paged pool, read through an identity block table
  paged-runs8   ... through a table of runs of 8 consecutive blocks, the runs shuffled
  paged-shuf    ... through a table of single blocks, shuffled (the worst placement)
(the pool variants read the same arrays as `contiguous`: only the order of the blocks differs).
Per (variant, dtype, context): GB/s of KV read, median and spread (min, max) over --reps calls,
and the median of the paired ratios to `base` (each call against its neighbour's).
--compile N: the seconds (wall and CPU) a fresh process takes to import the kernel and run
kernel.warm_up() (what every worker does at start) on an empty numba cache (cold: compiling
every signature) and then on the cache it left (warm), N rounds, base and this tree alternating.

    git archive HEAD~1 hetero | tar -x -C /tmp/base
    python bench/kernel_paged.py --base /tmp/base [--reps 41] [--compile 3] [--out kernel_paged.json]
"""
import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from bench.common import machine, positive, write_json  # noqa: E402

CONTEXTS = (4096, 8192, 16384)
DTYPES = ("fp32", "bf16")
HQ, HKV, D = 32, 8, 128
KERNEL_FILES = ("cpu_attention/kernel.py", "cpu_attention/simd.py", "ipc/atomics.py", "ipc/control.py")


def load_base(tree):
    """The kernel of source tree `tree` (its hetero/ directory's parent) as hetero_base.cpu_attention.kernel."""
    import importlib

    tmp = tempfile.mkdtemp(prefix="hetero_base_")
    for f in KERNEL_FILES:
        dst = os.path.join(tmp, "hetero_base", f)
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        with open(os.path.join(tree, "hetero", f)) as fh:
            src = fh.read().replace("from hetero.", "from hetero_base.")
        with open(dst, "w") as fh:
            fh.write(src)
    for d in ("", "cpu_attention", "ipc"):
        open(os.path.join(tmp, "hetero_base", d, "__init__.py"), "w").close()
    sys.path.insert(0, tmp)
    return importlib.import_module("hetero_base.cpu_attention.kernel")


def job(mod, code, q, knew, K, V, lengths, order, po, pm, pl, qs, qp, S, tables=None):
    """(call, ctrl): a run_job call of kernel module `mod` on one layer's step whose control words
    are set but for the layer and the ticket (call(layer) sets them), its args built once, as a
    worker's are (run_alone would add its own Python per call)."""
    import inspect

    C = mod.C
    ctrl = np.zeros(C.nbytes(1) // 8, np.int64)
    fctrl = ctrl.view(np.float64)
    units = lengths.shape[0] * K.shape[2]
    ctrl[C.QLEN], ctrl[C.WINDOW], ctrl[C.NSPLIT], ctrl[C.UNITS], ctrl[C.PSPLIT] = 1, 0, 1, units, 0
    fctrl[C.F_SCALE], fctrl[C.F_SOFTCAP] = q.shape[3] ** -0.5, 0.0
    zeros = np.zeros_like(lengths)
    PKs, PVs = mod.prefix_sources([], [], K, V)
    slots = np.arange(K.shape[0], dtype=np.int64)
    if "tables" in inspect.signature(mod.run_job.py_func).parameters:
        tabs = (mod.NO_TABLES if tables is None else tables, mod.NO_TABLES, mod.identity_table(K))
    else:
        tabs = ()
    args = (code, q, knew, knew, K, V, K[:0], V[:0], slots, *tabs, lengths, order, zeros, zeros, zeros - 1,
            zeros[:1], 0, po, pm, pl, qs, qp, S, PKs, PVs, mod.prefix_scratch(1, q.shape[3]))

    def call(layer):
        ctrl[C.LAYER], ctrl[C.FIN], ctrl[C.TICKET] = layer, 0, C.ticket(1, units)
        if mod.run_job(ctrl, fctrl, 1, C.PARENT_BUSY, *args) != units:
            raise RuntimeError("units left")
    return call


def throughput(base, dtype, ctx, mb, reps, seed=0):
    """{variant: [seconds per call]} and the bytes of KV one call reads."""
    from hetero.cpu_attention import kernel
    from hetero.cpu_attention.simd import BK, W

    code, item = (kernel.F32, 4) if dtype == "fp32" else (kernel.BF16, 2)
    nblk = ctx // BK
    per_layer = 2 * HKV * nblk * D * BK * item
    layers = max(2, -(-mb * 2**20 // per_layer))
    rng = np.random.default_rng(seed)
    if dtype == "fp32":
        K = rng.standard_normal((layers, 1, HKV, nblk, D, BK), dtype=np.float32)
        V = rng.standard_normal((layers, 1, HKV, nblk, D // W, BK, W), dtype=np.float32)
    else:                                                  # bf16 bits of modest values
        K = (rng.integers(0, 2**16, (layers, 1, HKV, nblk, D, BK), dtype=np.uint16) & 0x3FFF) | 0x3000
        V = (rng.integers(0, 2**16, (layers, 1, HKV, nblk, D // W, BK, W), dtype=np.uint16) & 0x3FFF) | 0x3000
    G = HQ // HKV
    q = rng.standard_normal((1, HQ, 1, D)).astype(np.float32)
    if dtype == "bf16":                  # a bf16 model's q: bf16-exact (vdpbf16ps where the CPU has it)
        q = (q.view(np.uint32) & 0xFFFF0000).view(np.float32)
    knew = np.zeros((1, HKV, 1, D), K.dtype)
    lengths, order = np.array([ctx - 1], np.int64), np.zeros(1, np.int64)
    po = np.zeros((1, HKV, 1, G, D), np.float32)
    pm = np.zeros((1, HKV, 1, G), np.float32)
    scratch = (np.zeros((G, D), np.float32), np.zeros((G, D // 2), np.uint32), kernel.score_scratch(G))
    runs = rng.permutation(nblk // 8)
    tables = {"paged-ident": np.arange(nblk), "paged-runs8": (runs[:, None] * 8 + np.arange(8)).reshape(-1),
              "paged-shuf": rng.permutation(nblk)}
    common = (q, knew, K, V, lengths, order, po, pm, pm.copy(), *scratch)
    variants = {"contiguous": job(kernel, code, *common)}
    if base is not None:
        variants = {"base": job(base, code, *common), **variants}
    variants.update({name: job(kernel, code, *common, tables=t.astype(np.int64)[None]) for name, t in tables.items()})
    times = {name: [] for name in variants}
    layer = 0
    for rep in range(reps + 1):
        for name in rng.permutation(list(variants)):       # a fresh order each round: no position bias
            t = time.perf_counter()
            variants[name](layer)
            if rep:                                        # the first round warms up
                times[name].append(time.perf_counter() - t)
            layer = (layer + 1) % layers
    return times, per_layer


def compile_times(base, rounds, core):
    """Seconds (wall, and CPU: user + system) to import the kernel and warm it up in a fresh
    process, on an empty numba cache then on the cache it left, base and this tree alternating."""
    import resource

    trees = {"this": ROOT, **({"base": base} if base else {})}
    res = {}
    for rnd in range(rounds):
        for name in (list(trees) if rnd % 2 == 0 else list(trees)[::-1]):
            cache = tempfile.mkdtemp(prefix=f"hetero_kp_{name}_")
            env = dict(os.environ, PYTHONPATH=trees[name], NUMBA_CACHE_DIR=cache, NUMBA_NUM_THREADS="1")
            cmd = ["taskset", "-c", str(core), sys.executable, "-c",
                   "from hetero.cpu_attention import kernel; kernel.warm_up()"]
            for kind in ("cold", "warm"):
                t, r = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
                subprocess.run(cmd, env=env, check=True, cwd=trees[name])
                r2 = resource.getrusage(resource.RUSAGE_CHILDREN)
                res.setdefault(f"{name} {kind} wall", []).append(time.perf_counter() - t)
                res.setdefault(f"{name} {kind} cpu", []).append(r2.ru_utime + r2.ru_stime - r.ru_utime - r.ru_stime)
            shutil.rmtree(cache, ignore_errors=True)
    for key, xs in sorted(res.items()):
        print(f"{key:16s} median {statistics.median(xs):6.2f} s  [{min(xs):6.2f}, {max(xs):6.2f}]  "
              + " ".join(f"{x:.2f}" for x in xs), flush=True)
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", default=None, help="a source tree (holding hetero/) whose kernel to compare against")
    ap.add_argument("--reps", type=positive, default=41, help="timed calls per variant and shape")
    ap.add_argument("--mb", type=positive, default=256, help="MB of KV the calls rotate over")
    ap.add_argument("--core", type=int, default=None, help="the core to pin to (default: the last usable)")
    ap.add_argument("--compile", type=int, default=0, help="also time cold and warm kernel loads, N rounds")
    ap.add_argument("--out", default=None, help="a JSON name under bench/results/")
    args = ap.parse_args()
    core = args.core if args.core is not None else sorted(os.sched_getaffinity(0))[-1]
    result = {"bench": "kernel_paged", "core": core, "mb": args.mb, "reps": args.reps, "base": args.base,
              "machine": machine()}
    if args.compile:
        result["compile_s"] = compile_times(args.base, args.compile, core)
    os.sched_setaffinity(0, {core})
    base = load_base(args.base) if args.base else None
    if base is not None:
        base.warm_up()
    from hetero.cpu_attention import kernel
    kernel.warm_up()
    result["gbps"], result["paired_ratio_to_base"] = {}, {}
    for dtype in DTYPES:
        for ctx in CONTEXTS:
            times, nbytes = throughput(base, dtype, ctx, args.mb, args.reps)
            shape = f"{dtype} {ctx // 1024}K"
            line = [f"{shape:9s}"]
            for name, ts in times.items():
                gbps = [nbytes / t / 1e9 for t in ts]
                result["gbps"].setdefault(name, {})[shape] = gbps
                line.append(f"{name} {statistics.median(gbps):5.2f} [{min(gbps):5.2f},{max(gbps):5.2f}]")
                if base is not None and name != "base":
                    ratios = [b / t for b, t in zip(times["base"], ts)]       # > 1: faster than base
                    result["paired_ratio_to_base"].setdefault(name, {})[shape] = ratios
                    q1, med, q3 = statistics.quantiles(ratios, n=4)
                    line.append(f"x{med:.3f} (IQR {q1:.3f}-{q3:.3f})")
            print("  ".join(line), flush=True)
    if args.out:
        print("wrote", write_json(args.out, result))


if __name__ == "__main__":
    main()
