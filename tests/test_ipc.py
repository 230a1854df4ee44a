"""Atomic flags, the worker pool and segment hygiene, with real processes and /dev/shm."""
import multiprocessing as mp
import os
import subprocess
import sys
import time
import warnings

import numpy as np
import pytest

from hetero.errors import WorkerDiedError
from hetero.ipc import atomics, control as C, shm
from hetero.ipc.pool import WorkerPool


def test_atomics_roundtrip():
    a = np.zeros(16, np.int64)
    atomics.store(a, 8, 42)
    assert atomics.load(a, 8) == 42 and a[8] == 42
    assert atomics.spin_until_changed(a, 8, 42, 10) == 42       # unchanged: returns old after the budget
    assert atomics.spin_until_changed(a, 8, 0, 10) == 42
    assert atomics.spin_until_all(a, 0, 2, 8, 0, 10) is False   # a[8] != 0
    assert atomics.spin_until_all(a, 8, 1, 8, 42, 10) is True


def test_pool_round_trips_and_dead_worker_detection():
    pool = WorkerPool(2, [0, 1] if os.cpu_count() > 1 else [0])
    try:
        name = pool.ctrl.name
        assert os.path.exists("/dev/shm" + name)
        for _ in range(50):
            pool.run(C.CMD_PING)
        assert all(pool.words[C.done_word(r)] == pool.seq for r in range(2))
        victim = pool.procs[1]
        victim.kill()
        victim.wait()
        t0 = time.perf_counter()
        with pytest.raises(WorkerDiedError, match=r"worker 1 \(pid %d.*SIGKILL" % victim.pid):
            pool.run(C.CMD_PING)
        assert time.perf_counter() - t0 < 2.0
        assert not pool.alive
    finally:
        pool.close()
        pool.close()  # idempotent
    assert not os.path.exists("/dev/shm" + name)
    assert all(p.poll() is not None for p in pool.procs)


def test_idle_workers_leave_their_cores_free():
    """Between requests (and during a long prefill) a worker polls rarely: it must not keep
    spinning (it took a third of its core before the cold back-off), yet it still answers."""
    import psutil

    pool = WorkerPool(2, [0, 1] if os.cpu_count() > 1 else [0])
    try:
        pool.run(C.CMD_PING)
        time.sleep(0.3)                               # past the hot and warm back-off
        procs = [psutil.Process(p.pid) for p in pool.procs]
        before = [sum(p.cpu_times()[:2]) for p in procs]
        time.sleep(2.0)
        used = [sum(p.cpu_times()[:2]) - b for p, b in zip(procs, before)]
        assert max(used) < 0.2, f"idle workers used {used} CPU seconds in 2 s"
        t0 = time.perf_counter()
        pool.run(C.CMD_PING)                          # a cold worker wakes within its sleep
        assert time.perf_counter() - t0 < 0.5
    finally:
        pool.close()


def test_segment_names_unique_and_sweep_only_dead_owners():
    a, b = shm.Segment(shm.new_name("t"), 64, create=True), shm.Segment(shm.new_name("t"), 64, create=True)
    try:
        assert a.name != b.name
        # a segment "left" by a process that no longer exists
        p = subprocess.Popen([sys.executable, "-c", "pass"])
        p.wait()
        dead = f"/{shm.PREFIX}{p.pid}_abc_kv"
        import posix_ipc
        posix_ipc.SharedMemory(dead, posix_ipc.O_CREX, size=64).close_fd()
        removed = shm.sweep_stale()
        assert dead[1:] in removed
        assert a.name[1:] in shm.list_ours() and b.name[1:] in shm.list_ours()   # ours are alive: kept
    finally:
        a.close()
        b.close()
    assert a.name[1:] not in shm.list_ours()


def test_job_wakes_only_the_workers_it_uses():
    """active=1: worker 1 never sees the job (its GO and DONE words stay put); all-worker jobs reach it."""
    pool = WorkerPool(2, [])
    try:
        before = int(pool.words[C.done_word(1)])
        for _ in range(50):
            pool.run(C.CMD_PING, active=1)
        assert pool.words[C.done_word(0)] == pool.seq
        assert pool.words[C.done_word(1)] == before and pool.words[C.go_word(1)] == before
        pool.run(C.CMD_PING)
        assert pool.words[C.done_word(1)] == pool.seq
        with pytest.raises(ValueError, match="1..2 workers"):
            pool.run(C.CMD_PING, active=3)
    finally:
        pool.close()


def test_one_session_per_pool():
    import torch

    from hetero.model_spec import ModelSpec
    from hetero.offload.session import KVSession

    spec = ModelSpec(model_type="t", layers=1, q_heads=2, kv_heads=1, head_dim=16, dtype=torch.float32,
                     max_positions=None, sliding=(False,))
    before = set(os.listdir("/dev/shm"))
    pool = WorkerPool(1, [])
    try:
        first = KVSession(pool, spec, pads=[0], real_lens=[4], cap=40)
        with pytest.raises(RuntimeError, match="already serves an open KV session"):
            KVSession(pool, spec, pads=[0], real_lens=[4], cap=40)
        first.close()
        KVSession(pool, spec, pads=[0], real_lens=[4], cap=40).close()
    finally:
        pool.close()
    assert set(os.listdir("/dev/shm")) <= before


def _pmd_mapped_kb(name):
    """kB of segment `name` this process maps with 2 MB page-table entries (from smaps)."""
    kb, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            if "-" in line.split(" ", 1)[0]:          # a mapping's header line
                inside = line.rstrip().endswith(name[1:])
            elif inside and line.startswith("ShmemPmdMapped:"):
                kb += int(line.split()[1])
    return kb


def _map_and_report(name, q):
    seg = shm.Segment(name)
    a = seg.array(0, (seg.size,), np.uint8)
    q.put((int(a[::4096].sum()), _pmd_mapped_kb(name)))
    del a
    seg.close()


@pytest.mark.skipif(shm.shmem_huge_pages() not in ("advise", "within_size", "always", "force"),
                    reason="/dev/shm has no transparent huge pages (mount -o remount,huge=advise /dev/shm)")
def test_large_segments_are_mapped_with_huge_pages_in_every_process():
    seg = shm.Segment(shm.new_name("huge"), 16 << 20, create=True)
    try:
        a = seg.array(0, (seg.size,), np.uint8)
        a[:] = 1                                   # the owner faults the pages in, as prefill does
        # (>= half: the kernel falls back to 4 KB pages where it finds no free 2 MB one)
        assert _pmd_mapped_kb(seg.name) >= 8 << 10
        q = mp.get_context("spawn").Queue()
        p = mp.get_context("spawn").Process(target=_map_and_report, args=(seg.name, q))
        p.start()
        total, child_kb = q.get(timeout=60)
        p.join(10)
        assert p.exitcode == 0
        assert total == (16 << 20) // 4096 and child_kb >= 8 << 10     # a worker reads through 2 MB pages too
        del a
    finally:
        seg.close()


def test_big_kv_arena_on_small_pages_warns_once(monkeypatch):
    monkeypatch.setattr(shm, "_warned_small_pages", False)
    monkeypatch.setattr(shm, "shmem_huge_pages", lambda: "never")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        shm.warn_if_small_pages(64 << 20)           # small: no warning
        shm.warn_if_small_pages(4 << 30)
        shm.warn_if_small_pages(4 << 30)            # once per process
    assert len(seen) == 1 and "huge=advise" in str(seen[0].message)
    monkeypatch.setattr(shm, "_warned_small_pages", False)
    monkeypatch.setattr(shm, "shmem_huge_pages", lambda: "advise")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        shm.warn_if_small_pages(4 << 30)
    assert not seen
