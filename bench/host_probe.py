"""Probes for a lent GPU machine's host, for the two open questions of the first H100 run (#14):

  register   cudaHostRegister of a fresh shared-memory arena: seconds for the whole segment at
             once, for the same after its pages were populated (MADV_POPULATE_WRITE from 8
             threads), and whether two registrations of adjacent slices that share a page (4 KB,
             and 2 MB with huge pages) are accepted (per-layer registration needs that)
  copy       the host-side strided copy into the blocked arena layout (KVSession.write_rows from
             host memory) that ran at 45 MB/s there: GB/s into plain memory and into a registered
             segment, with torch's default threads and with 1, beside an idle worker pool and one
             whose workers spin (HeteroConfig's CUDA transport keeps them awake)

  pin        KVSession.pin_layer over a Llama-3-8B-shape arena of 32K rows (the workers fault in
             the next layer's pages while a layer is locked): host seconds per layer, with the
             GPU idle and with a ~1 s matmul chain running (does locking slow the GPU's work?)

    python bench/host_probe.py [--gib 4] [--out host_probe.json]
Needs CUDA for `register` (skipped without it). Prints one line per measurement; writes JSON.
"""
import argparse
import ctypes
import itertools
import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.common import machine, positive, write_json  # noqa: E402



def segment(nbytes):
    from hetero.ipc import shm

    return shm.Segment(shm.new_name("probe"), nbytes, create=True)


def close(seg):
    from hetero.ipc import shm

    name = seg.name
    seg.mm.close()
    shm.unlink(name)


def populate(seg, threads=8):
    """Fault in every page of seg from `threads` threads (madvise releases no GIL in Python's mmap,
    so through libc)."""
    from hetero.ipc import shm

    libc = ctypes.CDLL(None, use_errno=True)
    base = ctypes.addressof(ctypes.c_char.from_buffer(seg.mm))
    step = -(-seg.size // threads) // (2 << 20) * (2 << 20) or seg.size
    def run(a):
        libc.madvise(ctypes.c_void_p(base + a), ctypes.c_size_t(min(step, seg.size - a)), shm.MADV_POPULATE_WRITE)
    ts = [threading.Thread(target=run, args=(a,)) for a in range(0, seg.size, step)]
    [t.start() for t in ts]
    [t.join() for t in ts]


def register_probe(gib):
    import torch

    cudart = torch.cuda.cudart()
    out = {}
    for populated in (False, True):
        seg = segment(gib << 30)
        try:
            ptr = ctypes.addressof(ctypes.c_char.from_buffer(seg.mm))
            t = time.perf_counter()
            if populated:
                populate(seg)
            t1 = time.perf_counter()
            err = int(cudart.cudaHostRegister(ptr, seg.size, 1))
            t2 = time.perf_counter()
            cudart.cudaHostUnregister(ptr)
        finally:
            close(seg)
        key = "populated_first" if populated else "fresh"
        out[key] = {"populate_s": t1 - t, "register_s": t2 - t1, "err": err}
        print(f"register {gib} GiB {key}: populate {t1 - t:.3f} s, register {t2 - t1:.3f} s (err {err})", flush=True)
    for page in (4096, 2 << 20):
        seg = segment(64 << 20)
        try:
            ptr = ctypes.addressof(ctypes.c_char.from_buffer(seg.mm))
            cut = 3 * page + page // 2                    # both slices touch the page holding `cut`
            e1 = int(cudart.cudaHostRegister(ptr, cut, 1))
            e2 = int(cudart.cudaHostRegister(ptr + cut, seg.size - cut, 1))
            for p in (ptr, ptr + cut):
                cudart.cudaHostUnregister(p)
        finally:
            close(seg)
        out[f"adjacent_{page}"] = [e1, e2]
        print(f"adjacent slices sharing a {page}-byte page: errors {e1}, {e2} (0: accepted)", flush=True)
    return out


def pin_probe(rows=32768, layers=32):
    """Per-layer page-locking of a real session's arena (hetero.offload.pinning), GPU idle vs busy."""
    import torch

    from hetero.ipc.pool import WorkerPool
    from hetero.model_spec import ModelSpec
    from hetero.offload.session import KVSession

    spec = ModelSpec(model_type="llama", layers=layers, q_heads=32, kv_heads=8, head_dim=128,
                     dtype=torch.bfloat16, max_positions=None, sliding=(False,) * layers)
    cores = sorted(os.sched_getaffinity(0))
    pool = WorkerPool(len(cores) - 1, cores[1:])
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)

    def chain():                                   # ~1 s of matmuls on an H100, timed by events
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(600):
            torch.mm(a, a)
        e1.record()
        return e0, e1

    out = {}
    try:
        chain()
        torch.cuda.synchronize()
        e0, e1 = chain()
        torch.cuda.synchronize()
        alone = e0.elapsed_time(e1) / 1e3
        for busy in (False, True):
            s = KVSession(pool, spec, pads=[0], real_lens=[rows], cap=rows + 256)
            try:
                if busy:
                    e0, e1 = chain()
                per = []
                t0 = time.perf_counter()
                for layer in range(layers):
                    t = time.perf_counter()
                    s.pin_layer(layer)
                    per.append(time.perf_counter() - t)
                total = time.perf_counter() - t0
                torch.cuda.synchronize()
                key = "gpu_busy" if busy else "gpu_idle"
                out[key] = {"arena_gib": s.layout.kv_bytes / 2**30, "total_s": total, "per_layer_s": per,
                            "refused": s._pins.refused}
                line = (f"pin_layer x{layers} ({s.layout.kv_bytes / 2**30:.1f} GiB, {key}): {total:.3f} s, "
                        f"layer 0 {per[0] * 1e3:.1f} ms, median {sorted(per)[layers // 2] * 1e3:.1f} ms")
                if busy:
                    out[key]["chain_s"], out[key]["chain_alone_s"] = e0.elapsed_time(e1) / 1e3, alone
                    line += f"; matmul chain {e0.elapsed_time(e1) / 1e3:.3f} s (alone {alone:.3f} s)"
                print(line, flush=True)
            finally:
                s.close()
    finally:
        pool.close()
    return out


def copy_probe():
    """GB/s of write_rows' host-side strided copy of 4096 bf16 rows (8 kv heads, head_dim 128) into
    the blocked V layout, as a prefetched layer's rows were written before the fix."""
    import torch

    from hetero.ipc.pool import WorkerPool

    Hkv, n, D, BK, W = 8, 4096, 128, 32, 16
    nb = n // BK
    src = torch.randn(1, n, Hkv, D).to(torch.bfloat16).transpose(1, 2)[0]     # [Hkv, n, D], a model's layout
    nbytes = src.numel() * 2
    out = {}
    cores = sorted(os.sched_getaffinity(0))
    pool = WorkerPool(len(cores) - 1, cores[1:]) if len(cores) > 1 else None
    seg, arena = segment(nbytes + (4 << 20)), None
    try:
        arena = torch.frombuffer(seg.mm, dtype=torch.bfloat16, count=nbytes // 2)
        plain = torch.empty_like(arena)
        # V blocks [Hkv, nb, D/W, BK, W] and bf16 K blocks [Hkv, nb, D/2, BK, 2] (pair-interleaved)
        layouts = {"V": lambda: src.reshape(Hkv, nb, BK, D // W, W).transpose(2, 3),
                   "K": lambda: src.reshape(Hkv, nb, BK, D // 2, 2).transpose(2, 3)}
        for awake in (False, True):
            if pool is not None:
                pool.keep_awake(awake)
            for threads in (torch.get_num_threads(), 1):
                prev = torch.get_num_threads()
                torch.set_num_threads(threads)
                try:
                    for (name, dst), (lay, rows) in itertools.product((("plain", plain), ("shm", arena)),
                                                                      layouts.items()):
                        blocks = rows()
                        dst = dst.view(blocks.shape)
                        best = float("inf")
                        for _ in range(5):
                            t = time.perf_counter()
                            dst.copy_(blocks)
                            best = min(best, time.perf_counter() - t)
                        key = f"{lay}_{name}_threads{threads}_{'spinning' if awake else 'idle'}_workers"
                        out[key] = nbytes / best / 1e9
                        print(f"strided copy into {key}: {out[key]:.2f} GB/s", flush=True)
                finally:
                    torch.set_num_threads(prev)
        if pool is not None:
            pool.keep_awake(False)
    finally:
        arena = None                                      # the segment's buffer export, before its close
        close(seg)
        if pool is not None:
            pool.close()
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=positive, default=4, help="arena size for the register probe")
    ap.add_argument("--out", default="host_probe.json")
    ap.add_argument("--copy-to", default=None)
    args = ap.parse_args()
    import torch

    res = {"copy": copy_probe()}
    if torch.cuda.is_available():
        res["register"] = register_probe(args.gib)
        res["pin"] = pin_probe()
    print("wrote", write_json(args.out, {"bench": "host_probe", "machine": machine(),
                                          "cores": len(os.sched_getaffinity(0)), "results": res}, args.copy_to))


if __name__ == "__main__":
    main()
