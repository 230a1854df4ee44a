"""IPC round-trip latency: main -> N pinned workers -> main with empty work, three mechanisms.

One round trip is what a decode step pays per layer to hand work to the CPU
workers and learn they are done. Measured, per N and per call (perf_counter_ns,
after 200 warm-up calls), with the parent pinned to the first usable core and
the workers pinned to the cores hetero would give them:

  flags      hetero's WorkerPool.run(CMD_PING, active=N): release-store a GO word
             per worker, each worker spins on its own word, replies via DONE words
  posix_sem  a posix_ipc semaphore pair per worker: post each "go", wait each "done"
  pipe       a multiprocessing Pipe per worker (fork): send a few bytes, receive the reply

Reports p50/p99 in microseconds; target (flags): p50 <= 5 us, p99 <= 50 us.

    python bench/ipc.py [--iters 20000] [--workers 1 2 3] [--out ipc.json]
"""
import argparse
import multiprocessing as mp
import os
import subprocess
import sys
import time

import numpy as np
import posix_ipc

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.common import machine, positive, write_json  # noqa: E402
from hetero.config import HeteroConfig  # noqa: E402
from hetero.ipc import control as C  # noqa: E402
from hetero.ipc.pool import WorkerPool, reap  # noqa: E402

WARMUP = 200
TARGET = {"p50_us": 5, "p99_us": 50}
SEM_WORKER = """
import os, sys, posix_ipc
go_name, done_name, core, n = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
os.sched_setaffinity(0, {core})
go, done = posix_ipc.Semaphore(go_name), posix_ipc.Semaphore(done_name)
for _ in range(n):
    go.acquire()
    done.release()
go.close(); done.close()
"""


def timed(step, iters):
    """Per-call latencies (ns) of `step` after WARMUP untimed calls."""
    for _ in range(WARMUP):
        step()
    out = np.empty(iters, np.int64)
    for i in range(iters):
        t = time.perf_counter_ns()
        step()
        out[i] = time.perf_counter_ns() - t
    return out


def bench_flags(n, cores, iters):
    pool = WorkerPool(n, cores)
    try:
        return timed(lambda: pool.run(C.CMD_PING, active=n), iters)
    finally:
        pool.close()


def bench_sem(n, cores, iters):
    tag = f"/ipcbench_{os.getpid()}_{n}"
    sems, procs = [], []
    try:
        for r in range(n):
            pair = [posix_ipc.Semaphore(f"{tag}_{r}_{k}", posix_ipc.O_CREX) for k in ("go", "done")]
            sems.append(pair)
            procs.append(subprocess.Popen([sys.executable, "-c", SEM_WORKER, pair[0].name, pair[1].name,
                                           str(cores[r % len(cores)]), str(WARMUP + iters)]))

        def step():
            for go, _ in sems:
                go.release()
            for _, done in sems:
                done.acquire()
        return timed(step, iters)
    finally:
        for p in procs:
            reap(p, 2.0)
        for sem in (s for pair in sems for s in pair):
            sem.unlink()
            sem.close()


def _pipe_worker(conn, core):
    os.sched_setaffinity(0, {core})
    while (msg := conn.recv_bytes()) != b"exit":
        conn.send_bytes(msg)


def bench_pipe(n, cores, iters):
    ctx = mp.get_context("fork")
    conns, procs = [], []
    try:
        for r in range(n):
            a, b = ctx.Pipe()
            procs.append(ctx.Process(target=_pipe_worker, args=(b, cores[r % len(cores)]), daemon=True))
            procs[-1].start()
            b.close()
            conns.append(a)

        def step():
            for c in conns:
                c.send_bytes(b"go")
            for c in conns:
                c.recv_bytes()
        return timed(step, iters)
    finally:
        for c in conns:
            try:
                c.send_bytes(b"exit")
            except OSError:  # that worker is already gone
                pass
            c.close()
        for p in procs:
            p.join(timeout=2.0)
            if p.exitcode is None:
                p.kill()
                p.join()


def main():
    usable = sorted(os.sched_getaffinity(0))
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=positive, default=20000)
    ap.add_argument("--workers", type=positive, nargs="+", default=list(range(1, max(1, len(usable) - 1) + 1)))
    ap.add_argument("--out", default="ipc.json", help="file name under bench/results, or an absolute path")
    args = ap.parse_args()
    _, cores = HeteroConfig().resolve_workers()
    rows = []
    os.sched_setaffinity(0, {usable[0]})  # the parent's core: the one the workers do not get
    try:
        print(f"{'mechanism':10s} {'N':>3s} {'p50 us':>9s} {'p99 us':>9s}")
        for n in args.workers:
            for name, fn in (("flags", bench_flags), ("posix_sem", bench_sem), ("pipe", bench_pipe)):
                p50, p99 = np.percentile(fn(n, cores, args.iters), [50, 99]) / 1e3
                row = {"mechanism": name, "workers": n, "p50_us": float(p50), "p99_us": float(p99)}
                if name == "flags":
                    row["met"] = bool(p50 <= TARGET["p50_us"] and p99 <= TARGET["p99_us"])
                rows.append(row)
                print(f"{name:10s} {n:3d} {p50:9.2f} {p99:9.2f}" + (f"   target met: {row['met']}" if "met" in row else ""))
    finally:
        os.sched_setaffinity(0, usable)
    path = write_json(args.out, {  # os.path.join keeps an absolute --out as is
        "bench": "ipc", "machine": machine(), "iters": args.iters, "warmup": WARMUP, "parent_core": usable[0],
        "worker_cores": cores, "target": TARGET, "results": rows,
        "note": "one round trip main -> N workers -> main with empty work; latencies per call in microseconds",
    })
    print("wrote", path)


if __name__ == "__main__":
    main()
