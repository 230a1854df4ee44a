"""Page-locking a session's KV arena for a GPU's DMAs, layer by layer (KVSession.pin_layer).

A GPU model's prefill offload and a prefetched forward copy each layer's KV between the GPU and
the arena with asynchronous DMAs, which need page-locked host memory (cudaHostRegister). Locking
a fresh arena is mostly its page faults (allocating and zeroing every page): 0.81 s for the
4 GiB of a 32K Llama-3-8B arena on the first H100 host, 0.6x of HF's whole prefill there, when
the whole arena was locked at once before the first layer's offload. Two things take it off
the critical path:
  - layer by layer: a layer's pages are locked just before its first DMA, while the GPU still
    runs what the host has enqueued (the host runs one to two layers ahead of the GPU);
  - the workers fault in the next layer's pages (CMD_POPULATE: MADV_POPULATE_WRITE over their
    share, in parallel, contents untouched) while the GPU computes, so the lock finds the pages
    allocated (on this 2-core VM mapping allocated pages runs at 4-5 GB/s vs 1.7 GB/s for
    fresh ones; with 2 MB shared-memory pages the lock has little left to do).
Ranges: each of K, V, Kr, Vr (per layer slot: [B, Hkv, nblk, ...]) is locked in one chunk per
slot where slots are whole pages (every real shape: a bf16 block of 32 rows of a 64-wide head is
4 KB), else in one chunk for the whole array, locked with the first layer (a copy spanning two
separate registrations might not count as page-locked). Arrays start on page boundaries
(hetero.offload.arena), so no page is locked twice.

The workers' fault-in job is posted only where no GPU-posted job can be in flight: a call's
prefill and prefetched forwards come before its first decode step (hetero.ipc.transport).
"""
import logging
import mmap
import time

from hetero.ipc import control as C
from hetero.offload.arena import layer_slots

log = logging.getLogger("hetero")
PAGE = mmap.PAGESIZE


def chunks(base, slot_bytes, slots, page=PAGE):
    """The page-aligned chunks [(lo, hi)] of an array of `slots` slots of `slot_bytes` bytes from
    byte `base` (page-aligned): one per slot where slots are whole pages, else one for the array."""
    if slot_bytes % page:
        return [(base, base + -(-slots * slot_bytes // page) * page)]
    return [(base + j * slot_bytes, base + (j + 1) * slot_bytes) for j in range(slots)]


def touching(bounds, lo, hi):
    """Indices of the non-empty chunks of `bounds` that overlap bytes [lo, hi)."""
    return [k for k, (a, b) in enumerate(bounds) if a < b and a < hi and lo < b]


class ArenaPins:
    """The page locks of one session's K/V, taken per layer (see the module doc).
    register(ptr, nbytes) -> bool (False: the driver refused; copies stay correct through
    pageable memory) and unregister(ptr) are cudaHostRegister/Unregister on a GPU; the tests pass
    recording ones. Not thread-safe: the session's host thread alone calls it."""

    def __init__(self, session, register, unregister):
        self.s, self._register, self._unregister = session, register, unregister
        offs, _ = session.layout.offsets()
        self.base = session.lengths.ctypes.data - offs["lengths"][0]   # the segment's first byte here
        self.bounds = {}                                        # array -> its chunks (byte offsets)
        # per layer: [(array, chunk indices)] for its K and V slabs
        self.layers = [[] for _ in range(session.spec.layers)]
        ringed = [w > 0 for w in session.ring_window]
        for layer, (r, i) in enumerate(layer_slots(ringed)):
            for name, t in (("Kr", session.Kr), ("Vr", session.Vr)) if r else (("K", session.K), ("V", session.V)):
                slot = t[0].numel() * t.element_size()
                if name not in self.bounds:
                    self.bounds[name] = chunks(offs[name][0], slot, t.shape[0])
                lo = offs[name][0] + i * slot
                self.layers[layer].append((name, touching(self.bounds[name], lo, lo + slot)))
        self.locked = []              # host addresses locked, in order (unlocked in reverse at close)
        self._done = set()            # (array, chunk index) locked
        self.pinned = set()           # layers whose pages are all locked
        self.refused = False          # the driver refused once: no more tries (pageable copies)
        self.populating = None        # (job, layer) of a CMD_POPULATE in flight
        self.seconds = 0.0            # host time spent here (bench/gpu_prefill.py reports it)

    def _ranges(self, layer):
        """The layer's byte ranges (K side, V side) of the segment: its chunks' span in each."""
        out = []
        for name, ks in self.layers[layer]:
            if ks:
                b = self.bounds[name]
                out.append((b[ks[0]][0], b[ks[-1]][1] - b[ks[0]][0]))
        return (out + [(0, 0), (0, 0)])[:2]

    def _post_populate(self, layer):
        """Start the workers faulting in the layer's pages; returns the job (None: none posted,
        where the workers do not have this session mapped: the lock faults the pages in itself)."""
        pool = self.s.pool
        if pool.session is not self.s or pool.closed or pool.broken is not None:
            return None
        (k0, kn), (v0, vn) = self._ranges(layer)
        pool.drain()                         # the words below are a job's params
        w = pool.words
        for word, value in zip(C.POP_RANGES, (k0, kn, v0, vn)):
            w[word] = value
        return pool.submit(C.CMD_POPULATE, pool.n)

    def _wait_populate(self):
        """Wait for the fault-in job, unless another job has already waited for it (pool.submit
        drains a job in flight: its number is then gone from pool.inflight)."""
        job, self.populating = self.populating, None
        pool = self.s.pool
        if job is None or job[0] is None or pool.closed or pool.broken is not None:
            return                           # a closed or broken pool: nothing to wait for
        if pool.inflight is not None and pool.inflight[0] == job[0]:
            pool.drain()

    def pin(self, layer):
        """Lock the layer's pages (before its first DMA), then start the workers on the next
        layer's. Idempotent per layer."""
        if layer in self.pinned or self.refused:
            return
        t0 = time.perf_counter()
        ahead = self.populating is not None and self.populating[1] == layer
        if not ahead:
            self._wait_populate()            # another layer's: let it finish (the words are reused)
            self.populating = (self._post_populate(layer), layer)
        self._wait_populate()
        for name, ks in self.layers[layer]:
            for k in ks:
                if (name, k) in self._done:
                    continue
                lo, hi = self.bounds[name][k]
                if not self._register(self.base + lo, hi - lo):
                    self.refused = True
                    log.info("hetero: cudaHostRegister of the KV arena failed; its copies go through "
                             "pageable memory")
                    return
                self._done.add((name, k))
                self.locked.append(self.base + lo)
        self.pinned.add(layer)
        nxt = layer + 1
        if nxt < len(self.layers) and nxt not in self.pinned:
            self.populating = (self._post_populate(nxt), nxt)
        self.seconds += time.perf_counter() - t0

    def close(self):
        """Wait for a fault-in job in flight and release every lock (before the unmap). Idempotent."""
        try:
            self._wait_populate()
        finally:
            locked, self.locked = self.locked, []
            for ptr in reversed(locked):
                self._unregister(ptr)


class RangePins:
    """Page locks of a few big arrays (a paged pool's K/V), taken chunk by chunk as copies first
    touch them: a pool's blocks come into use over time, and locking it whole up front would make
    all of it resident at once (~0.3 s a GiB of fresh pages on the H200 host) before the first prompt.
    Chunks are small (4 MiB) because a pool's K and V are [layer][kv head][block]: even a one-block
    request touches every (layer, head) region, and one 64 MiB chunk per region (a region of an
    8B model's 8 x 32K pool is 64 MiB) locked about the whole 34 GB pool for the warm-up's 64
    tokens (bench/results/gpu_engine_h200_phases.json: warm-up 12.4 s, locking 11.0 s in all). Now a
    request locks about the pages its rows fill, which its copies would fault in anyway.
    arrays: (address, bytes) of page-aligned arrays, each followed by a page boundary before the
    next. register/unregister as for ArenaPins. Not thread-safe: the engine's step alone calls it."""

    def __init__(self, arrays, register, unregister, chunk: int = 4 << 20):
        assert chunk % PAGE == 0
        self.arrays = sorted((a, a + -(-n // PAGE) * PAGE) for a, n in arrays if n)
        self._register, self._unregister, self.chunk = register, unregister, chunk
        self.locked: dict[int, None] = {}     # chunk start addresses, in the order locked
        self.refused = False          # the driver refused once: no more tries (pageable copies)
        self.seconds = 0.0

    def lock(self, ptr: int, nbytes: int) -> list[tuple[int, int]] | None:
        """Lock the chunks that bytes [ptr, ptr + nbytes) touch; the range cut at their bounds, as
        (offset, bytes) pieces from ptr, each in one locked chunk (a copy spanning two
        registrations might not count as page-locked); None where they cannot all be locked."""
        if self.refused or nbytes <= 0:
            return None
        base, end = next(((a, b) for a, b in self.arrays if a <= ptr < b), (None, None))
        if base is None or ptr + nbytes > end:
            return None
        c, pieces = self.chunk, []
        for k in range((ptr - base) // c, (ptr + nbytes - 1 - base) // c + 1):
            lo = base + k * c
            if lo not in self.locked:
                t0 = time.perf_counter()
                ok = self._register(lo, min(lo + c, end) - lo)
                self.seconds += time.perf_counter() - t0
                if not ok:
                    self.refused = True
                    log.info("hetero: cudaHostRegister of the KV pool failed; its copies go through pageable memory")
                    return None
                self.locked[lo] = None
            a, b = max(lo, ptr), min(lo + c, ptr + nbytes)
            pieces.append((a - ptr, b - a))
        return pieces

    def copy_in(self, dst, src) -> bool:
        """dst.copy_(src) (contiguous, alike), from a GPU into a locked array: one DMA per piece
        (asynchronous: the caller waits for the stream before the host reads dst); a synchronous
        copy where the range cannot be locked. Whether it went as DMAs."""
        n = dst.element_size()
        pieces = self.lock(dst.data_ptr(), dst.numel() * n)
        if pieces is None:
            dst.copy_(src)
            return False
        if len(pieces) == 1:
            dst.copy_(src, non_blocking=True)
            return True
        d, s = dst.view(-1), src.reshape(-1)
        for off, size in pieces:               # chunk bounds are pages: whole elements
            d[off // n:(off + size) // n].copy_(s[off // n:(off + size) // n], non_blocking=True)
        return True

    def close(self):
        """Release every lock (before the unmap). Idempotent."""
        locked, self.locked = self.locked, {}
        for ptr in reversed(list(locked)):
            self._unregister(ptr)
