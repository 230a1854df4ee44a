"""Shared benchmark helpers: machine description, streaming-read bandwidth bound, JSON results."""
import json
import os
import platform
import shutil
import subprocess
import time

import numpy as np
from numba import njit, prange

from hetero.cli import positive  # noqa: F401 (argparse type of the scripts' counts and sizes)
from hetero.ipc.shm import shmem_huge_pages
from hetero.models import load_smollm2, smollm2_gguf  # noqa: F401 (the benchmarks' real model)

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def _run(cmd):
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def steady(times, warm=1.10, falling=(0.97, 0.95)):
    """A per-step time series' steady-state level, one rule for every system compared.
    R = the median of the last 4 steps; the leading steps above warm * R are warm-up, dropped;
    the level is the median of the steps kept. A series still falling at its end (its last step
    < falling[0] * the mean of the last 4, and R < falling[1] * the median of its steps 3..n-4)
    has no steady state yet: R, flagged, an upper bound. Returns {"ms", "warmup_dropped",
    "still_falling", "kept_min_ms", "kept_max_ms"} (ms)."""
    import statistics

    t = [x * 1e3 for x in times]
    R = statistics.median(t[-4:])
    d = 0
    while d < len(t) - 1 and t[d] > warm * R:
        d += 1
    kept = t[d:]
    early = t[2:len(t) - 4]
    still = bool(early) and t[-1] < falling[0] * statistics.mean(t[-4:]) and R < falling[1] * statistics.median(early)
    return {"ms": R if still else statistics.median(kept), "warmup_dropped": d, "still_falling": still,
            "kept_min_ms": min(kept), "kept_max_ms": max(kept)}


def machine():
    import torch
    import transformers

    return {
        "platform": platform.platform(), "python": platform.python_version(), "cpus_usable": len(os.sched_getaffinity(0)),
        "lscpu": _run(["lscpu"]),
        "nvidia_smi": _run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv"]),
        "shmem_thp": shmem_huge_pages(),   # KV in 2 MB pages unless "never"
        "torch": torch.__version__, "transformers": transformers.__version__,
        "commit": _run(["git", "-C", os.path.dirname(RESULTS), "rev-parse", "--short", "HEAD"]),
        "source_sha1": source_digest(),    # the code itself: a copied tree's git HEAD may be stale (the device)
    }


def source_digest():
    """sha1 (12 hex) of hetero/'s sources (.py, .cu, .h, .cpp), path by path: which code a run measured."""
    import hashlib

    root = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "hetero")
    h = hashlib.sha1()
    for d, _, files in sorted(os.walk(root)):
        for f in sorted(files):
            if f.endswith((".py", ".cu", ".h", ".cpp")):
                path = os.path.join(d, f)
                h.update(os.path.relpath(path, root).encode())
                with open(path, "rb") as fh:
                    h.update(fh.read())
    return h.hexdigest()[:12]


@njit(cache=True, fastmath=True)  # reassociation: vector adds, so memory (not add latency) is the limit
def _stream_sum(a):
    s = np.float32(0.0)
    for i in range(a.size):
        s += a[i]
    return s


def stream_read_gbps(nbytes=512 << 20, repeats=5):
    """Single-core streaming read bandwidth (GB/s) of a numba sum over a buffer larger than the caches."""
    a = np.ones(nbytes // 4, np.float32)
    _stream_sum(a[:1024])
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        _stream_sum(a)
        best = min(best, time.perf_counter() - t)
    return a.nbytes / best / 1e9


@njit(parallel=True, fastmath=True)
def _stream_sum_parallel(a, nchunks):
    part = np.zeros(nchunks, np.float32)
    step = (a.size + nchunks - 1) // nchunks
    for c in prange(nchunks):   # each thread runs the vectorized single-core sum on its slice
        part[c] = _stream_sum(a[c * step:min(a.size, (c + 1) * step)])
    return part.sum()


def stream_read_all_gbps(threads, nbytes=1 << 30, repeats=5):
    """All-core streaming read bandwidth (GB/s): the same sum split over `threads` numba threads."""
    import numba

    previous = numba.get_num_threads()
    numba.set_num_threads(threads)
    try:
        a = np.ones(nbytes // 4, np.float32)
        _stream_sum_parallel(a[:4096], threads)
        best = float("inf")
        for _ in range(repeats):
            t = time.perf_counter()
            _stream_sum_parallel(a, threads)
            best = min(best, time.perf_counter() - t)
        return a.nbytes / best / 1e9
    finally:
        numba.set_num_threads(previous)


def write_json(name, payload, copy_to=None):
    """payload as bench/results/<name> (an absolute name: there); also copied into copy_to (a
    device's $OUT) when given."""
    os.makedirs(RESULTS, exist_ok=True)
    path = os.path.join(RESULTS, name)
    with open(path, "w") as f:
        json.dump(payload, f, indent=1)
    if copy_to:
        shutil.copy(path, copy_to)
    return path


def run_child(cmd, timeout, log=None):
    """Run a benchmark cell in a fresh process; the dict its last `RESULT <json>` line holds, or
    {"error": ...} (a crash, no result, or over `timeout` seconds). log: a file its stderr is
    appended to as it runs, after a header naming the cell (a long cell's progress survives this
    process being killed; one file for all cells: a device returns only a few)."""
    err, start = None, 0
    if log:
        err = open(log, "a")
        err.write(f"\n== {' '.join(cmd[2:])}\n")
        err.flush()
        start = err.tell()
    try:
        res = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=err or subprocess.PIPE, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:      # what it logged so far (e.g. a long prefill's progress)
        tail = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        return {"error": f"over {timeout} s", "log_tail": (_logged(log, start) if log else tail)[-2000:]}
    finally:
        if err is not None:
            err.close()
    line = [x for x in res.stdout.splitlines() if x.startswith("RESULT ")]
    if res.returncode or not line:
        return {"error": (_logged(log, start) if log else res.stderr)[-2000:]}
    return json.loads(line[-1][7:])


def _logged(path, start):
    """What a cell appended to `path` from byte `start` on."""
    with open(path, errors="replace") as f:
        f.seek(start)
        return f.read()


def padded_batch(lengths, vocab, seed=1):
    """Left-padded random prompts of the given lengths (token ids 3..vocab-1; 0 pads):
    (input_ids, attention_mask), both [len(lengths), max(lengths)]."""
    import torch

    g = torch.Generator().manual_seed(seed)
    S = max(lengths)
    ids = torch.zeros(len(lengths), S, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, n in enumerate(lengths):
        ids[b, S - n:] = torch.randint(3, vocab, (n,), generator=g)
        mask[b, S - n:] = 1
    return ids, mask

