"""Per-layer page-locking of the KV arena (hetero.offload.pinning) on every machine: the chunk
partition, and ArenaPins on a real session with real workers faulting in pages, its
cudaHostRegister replaced by a recorder (what a GPU would be asked to lock, and when)."""
import ctypes
import os
import signal
import time

import pytest
import torch

from hetero.ipc import control as C, shm
from hetero.ipc.pool import WorkerPool
from hetero.model_spec import ModelSpec
from hetero.offload.pinning import PAGE, ArenaPins, chunks, touching
from hetero.offload.session import KVSession


@pytest.mark.parametrize("slot", [100, 4096, 5 * 1024, 8192, 3 * 1024 * 1024 + 8, 3 * 1024 * 1024])
@pytest.mark.parametrize("slots", [1, 2, 7])
def test_chunks_partition_the_pages(slot, slots):
    """One chunk per slot of whole pages, else one for the array; page-aligned, consecutive, and
    a slab's chunks cover its bytes."""
    base = 3 * PAGE
    b = chunks(base, slot, slots)
    assert len(b) == (slots if slot % PAGE == 0 else 1) and b[0][0] == base
    assert b[-1][1] == base + -(-slots * slot // PAGE) * PAGE
    for (lo, hi), (lo2, _) in zip(b, b[1:]):
        assert hi == lo2 and lo < hi                    # consecutive, no overlap
    for lo, hi in b:
        assert lo % PAGE == 0 and hi % PAGE == 0
    for j in range(slots):
        lo, hi = base + j * slot, base + (j + 1) * slot
        ks = touching(b, lo, hi)
        assert ks == list(range(ks[0], ks[-1] + 1))
        assert b[ks[0]][0] <= lo and b[ks[-1]][1] >= hi


def _resident(addr, nbytes):
    """Fraction of the pages of [addr, addr + nbytes) (page-aligned) in memory (mincore)."""
    libc = ctypes.CDLL(None, use_errno=True)
    n = -(-nbytes // PAGE)
    vec = (ctypes.c_ubyte * n)()
    assert libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(nbytes), vec) == 0, ctypes.get_errno()
    return sum(v & 1 for v in vec) / n


@pytest.mark.parametrize("windows,head_dim,kv_heads,cap", [((0, 0, 0, 0), 64, 2, 300), ((0, 40, 0, 40), 64, 2, 300),
                                                            ((40,) * 4, 64, 2, 300), ((0, 0, 0, 0), 80, 1, 288)],
                         ids=["full", "rings", "all-rings", "slots-not-pages"])
def test_arena_pins_lock_each_page_once_after_the_workers_fault_it_in(windows, head_dim, kv_heads, cap):
    """Layer by layer: each lock is page-aligned and inside the segment, no page is locked twice,
    every layer's K/V bytes are locked after its pin, the workers have faulted in the next layer's
    pages meanwhile (mincore), the arena's contents are untouched, and close unlocks all."""
    spec = ModelSpec(model_type="t", layers=4, q_heads=4, kv_heads=kv_heads, head_dim=head_dim, dtype=torch.bfloat16,
                     max_positions=None, sliding=tuple(w > 0 for w in windows), windows=windows)
    locked, unlocked = [], []

    def register(ptr, nbytes):
        assert ptr % PAGE == 0 and nbytes % PAGE == 0 and nbytes > 0
        assert all(ptr + nbytes <= p or p + n <= ptr for p, n in locked), "a page locked twice"
        locked.append((ptr, nbytes))
        return True

    pool = WorkerPool(2, [])
    try:
        s = KVSession(pool, spec, pads=[0, 3], real_lens=[200, 197], cap=cap)
        try:
            k, v = (torch.randn(kv_heads, 32, head_dim).to(torch.bfloat16) for _ in range(2))
            s.write_rows(0, 0, k, v)                                  # data before any pin (K, or a ring)
            pins = s._pins = ArenaPins(s, register, unlocked.append)
            assert pins.base == ctypes.addressof(ctypes.c_char.from_buffer(s.seg.mm)) and pins.base % PAGE == 0
            slabs = [(t.data_ptr(), t.numel() * t.element_size()) for t in (x for kv in s.kv for x in kv)]
            if shm.shmem_huge_pages() == "never":                     # 4 KB pages: the last layer's are fresh
                ptr, n = slabs[-1]
                lo = -(-ptr // PAGE) * PAGE
                assert _resident(lo, (ptr + n) // PAGE * PAGE - lo) == 0.0
            for layer in range(spec.layers):
                pins.pin(layer)
                assert pins.pinned == set(range(layer + 1))
                for ptr, n in slabs[:2 * (layer + 1)]:                # this layer's K and V, and all before
                    for a in range(ptr, ptr + n, PAGE // 2):
                        assert any(p <= a < p + m for p, m in locked), (layer, hex(a))
                if layer + 1 < spec.layers:                           # the workers fault in the next layer's
                    pins._wait_populate()
                    for ptr, n in slabs[2 * layer + 2:2 * layer + 4]:
                        lo = ptr // PAGE * PAGE
                        assert _resident(lo, ptr + n - lo) == 1.0
            assert pins.populating is None and pins.seconds > 0
            pins.pin(1)                                               # idempotent
            k2, v2 = s.read_rows(0, 0, 32)
            assert torch.equal(k2, k) and torch.equal(v2, v)          # population changed nothing
            assert int(s.kv[0][0].view(torch.int16).count_nonzero()) == int(k.view(torch.int16).count_nonzero())
        finally:
            s.close()
        assert sorted(unlocked) == sorted(p for p, _ in locked) and s._pins is None
    finally:
        pool.close()


def test_arena_pins_stop_at_a_refusal():
    """A driver that refuses the lock: pinning stops (copies go pageable), nothing more is tried,
    and what was locked is released at close."""
    spec = ModelSpec(model_type="t", layers=3, q_heads=2, kv_heads=1, head_dim=64, dtype=torch.float32,
                     max_positions=None, sliding=(False,) * 3)
    calls, unlocked = [], []
    pool = WorkerPool(1, [])
    try:
        s = KVSession(pool, spec, pads=[0], real_lens=[64], cap=128)
        try:
            s._pins = pins = ArenaPins(s, lambda p, n: calls.append(p) or len(calls) < 2, unlocked.append)
            pins.pin(0)
            assert pins.refused and pins.pinned == set() and len(calls) == 2
            pins.pin(1)
            assert len(calls) == 2
        finally:
            s.close()
        assert unlocked == calls[:1]
    finally:
        pool.close()


def test_a_fault_in_job_waited_for_by_another_job_is_not_waited_for_again():
    """Another pool job between two pins (a LoRA prefill job, the session's close after an
    exception) drains the fault-in job in flight: the next pin and the close go on at once, the
    pool stays healthy."""
    spec = ModelSpec(model_type="t", layers=3, q_heads=2, kv_heads=1, head_dim=64, dtype=torch.float32,
                     max_positions=None, sliding=(False,) * 3)
    pool = WorkerPool(1, [], job_timeout=5.0)
    try:
        s = KVSession(pool, spec, pads=[0], real_lens=[64], cap=128)
        try:
            s._pins = pins = ArenaPins(s, lambda p, n: True, lambda p: None)
            pins.pin(0)
            assert pins.populating is not None and pool.inflight is not None    # layer 1's, in flight
            pool.run(C.CMD_PING)
            t = time.perf_counter()
            pins.pin(1)
            pins.pin(0)
            assert time.perf_counter() - t < 1.0 and pool.broken is None
        finally:
            t = time.perf_counter()
            s.close()                                   # layer 2's job in flight: CMD_CLOSE drains it
            assert time.perf_counter() - t < 1.0 and pool.broken is None and pool.alive
    finally:
        pool.close()


def test_closing_after_the_pool_closed_with_a_fault_in_job_in_flight():
    """A session closed after its pool (a Context outliving a replaced pool) with a fault-in job
    still in flight on a dead worker: nothing waits on the closed pool, every lock is released."""
    spec = ModelSpec(model_type="t", layers=3, q_heads=2, kv_heads=1, head_dim=64, dtype=torch.float32,
                     max_positions=None, sliding=(False,) * 3)
    unlocked = []
    pool = WorkerPool(1, [])
    s = KVSession(pool, spec, pads=[0], real_lens=[64], cap=128)
    s._pins = pins = ArenaPins(s, lambda p, n: True, unlocked.append)
    pins.pin(0)
    assert pins.populating is not None
    n = len(pins.locked)
    os.kill(pool.procs[0].pid, signal.SIGKILL)
    pool.procs[0].wait()
    pool.close()
    s.close()
    assert len(unlocked) == n > 0 and s._pins is None
