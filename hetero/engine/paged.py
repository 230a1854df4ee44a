"""The paged KV pool's memory: one shared segment the workers map, and the decode job over it.

The pool is one "request" of `num_blocks` 32-row blocks per layer and kv head (a SessionLayout
with `blocks` set: K [layers, 1, Hkv, NB, Dp, BK], V [layers, 1, Hkv, NB, Dp/W, BK, W]); which
block holds which request's rows is hetero.engine.kv_pool's business, read here through block
tables only. A step's decode tokens (one new token per request, after its cached rows) go to
the CPU workers as one job per layer; the new rows of a prefill chunk are written by the parent
(write_rows) and its cached rows read back (read_rows) for attention on the model's device.

A model that mixes windowed and full layers (Gemma 2/3, gpt-oss, ...) keeps its windowed layers
in a pool of their own (`ring_blocks` blocks, Kr/Vr; `ringed[layer]`), read through each
request's window table (rtables: hetero.engine.kv_pool.HybridKVCacheManager), which holds only
the blocks its window still sees.

  segment array  written by                              read by
  tables, rtables, lengths, order, skip, pstart, pgroup, gblocks
                 the parent (begin_decode, once a step)  the workers
  q, knew, vnew  the parent (each layer, after drain)    the workers
  K, V           the parent (write_rows: prefill rows;   the workers; the parent (read_rows)
                 from a GPU, DMAs into the page-locked
                 pool, waited for at end_step), the
                 workers (a decode token's row, appended
                 by the unit that reads its block)
  part_o/m/l     the workers and the parent (units)      the parent (merge)

On a CUDA model whose extension can be used (`gpu`: hetero.ipc.cuda_transport.CudaDecode), the
GPU writes q/knew/vnew and publishes each layer's job itself, the workers alone take its units,
and the GPU merges their partials: the host enqueues a step's layers without waiting for any
(one synchronization a step, end_step); staging and partials are page-locked and mapped for that.

A block read by several decoding requests (refcount > 1: a shared document) is read once per
step for all of them: requests whose tables start with the same blocks form a group whose
common blocks are attended in shared-prefix units (kernel.run_prefix_unit), at most
`max_groups` groups a step; the others read their own rows from 0.
"""
from __future__ import annotations

import contextlib
import functools

import numpy as np
import psutil
import torch
import torch.nn.functional as F

from hetero.cpu_attention import kernel
from hetero.cpu_attention.kernel import BF16
from hetero.cpu_attention.planner import StaticPlanner
from hetero.cpu_attention.simd import BK, W
from hetero.errors import CapacityError, UnsupportedModelError
from hetero.ipc import control as C, shm
from hetero.ipc.cuda_transport import CudaDecode
from hetero.ipc.transport import merge_partials
from hetero.offload.arena import SessionLayout, layer_slots, slots_of
from hetero.offload.pinning import RangePins
from hetero.offload.session import STORAGE_CODES, _cuda_register, _cuda_unregister


class PagedKV:
    """The pool's segment, mapped in `pool`'s workers at its first step (ensure_open; a WorkerPool
    serves one mapped segment at a time: opening this one unmaps a KVSession's, which reopens
    itself at its next call, and the reverse). planner: the decode planner, or a callable giving
    it, called at the first step (a generator measures its profile on the pool it shares)."""

    def __init__(self, pool, spec, num_blocks: int, max_blocks_per_seq: int, max_seqs: int,
                 max_groups: int | None = None, planner=None, ring_blocks: int = 0):
        """ring_blocks > 0: the windowed layers of a model that mixes them with full ones keep a
        pool of that many blocks of their own (num_blocks: the full layers')."""
        self.pool, self.spec = pool, spec
        groups = max(max_seqs // 2, 1) if max_groups is None else max_groups
        self.windows = spec.windows or (0,) * spec.layers
        self.ringed = tuple(bool(ring_blocks and w) for w in self.windows)   # a layer in the window pool
        self.layout = SessionLayout(batch=max_seqs, q_heads=spec.q_heads, kv_heads=spec.kv_heads,
                                    head_dim=spec.head_dim, cap=BK, layers=spec.layers,
                                    code=STORAGE_CODES[spec.dtype], tmax=1, groups=groups, blocks=num_blocks,
                                    maxblk=max_blocks_per_seq, ring=ring_blocks * BK, ring_layers=sum(self.ringed))
        self.planner = planner or StaticPlanner(pool.n)     # or a callable: resolved by ensure_open
        self.opened = False
        self.gpu = None               # a CudaDecode (use_gpu): the GPU posts and merges the decode jobs
        self._pins = None             # the K/V page locks (lock_pages): a GPU's prompt rows then go as DMAs
        self._dma_on = None           # the device whose stream holds this step's DMAs into K/V (end_step)
        self.dma_copies = self.sync_copies = 0    # write_rows's copies from a GPU, as DMAs or waited for
        shm.warn_if_small_pages(self.layout.nbytes)
        self.seg = shm.Segment(shm.new_name("kvpool"), self.layout.nbytes, create=True)
        try:
            v = self.v = self.layout.views(self.seg)
            for name in ("skip", "pstart", "lengths"):
                v[name][:] = 0
            v["pgroup"][:] = -1
            v["ringed"][:] = self.ringed
            self.q = torch.from_numpy(v["q"])                 # [B, Hq, 1, Dp] f32
            self.knew, self.vnew = self._storage(v["knew"]), self._storage(v["vnew"])
            K, V, Kr, Vr = self.K, self.V, self.Kr, self.Vr = [self._storage(v[n]) for n in ("K", "V", "Kr", "Vr")]
            self.kv = [(Kr[i, 0], Vr[i, 0]) if r else (K[i, 0], V[i, 0])    # [Hkv, NB, Dp, BK], [Hkv, NB, Dp/W, BK, W]
                       for r, i in layer_slots(self.ringed)]
            self.part_o, self.part_m, self.part_l = (torch.from_numpy(v[n]) for n in ("part_o", "part_m", "part_l"))
            self.lengths = v["lengths"]             # the layout's first array (a CudaDecode maps from it)
            rows = spec.q_heads // spec.kv_heads
            self._job = (v["q"], v["knew"], v["vnew"], v["K"], v["V"], v["Kr"], v["Vr"],
                         slots_of(self.ringed), v["tables"], v["rtables"],
                         kernel.identity_table(v["K"][:, :, :, :1]), v["lengths"], v["order"], v["skip"],
                         v["pstart"], v["pgroup"], v["gblocks"], groups, v["part_o"], v["part_m"], v["part_l"],
                         np.zeros((rows, self.layout.dpad), np.float32),
                         np.zeros((rows, self.layout.dpad // 2), np.uint32), kernel.score_scratch(rows),
                         *kernel.prefix_sources([], [], v["K"][:1, :, :, :1], v["V"][:1, :, :, :1]),
                         kernel.prefix_scratch(max_seqs * rows, self.layout.dpad))
        except BaseException:
            self.close()
            raise
        self.n = 0                    # decode requests this step (begin_decode)
        self.ngroups = self.nactive = self.nsplit = self.psplit = 0
        self._inflight = None         # (seq, nactive, units) of the layer's job between post and finish

    @property
    def num_blocks(self) -> int:
        return self.layout.blocks

    @property
    def nbytes(self) -> int:
        return self.layout.nbytes

    def _storage(self, arr):
        t = torch.from_numpy(arr)
        return t if arr.dtype == np.float32 else t.view(self.spec.dtype)

    def use_gpu(self, device, want: str = "auto") -> None:
        """A CUDA model's decode jobs through the extension (want: EngineConfig.transport; "auto"
        falls back to host copies where it cannot be used, with one log line saying why)."""
        if want == "host":
            return
        self.gpu = CudaDecode.open(self.pool, self, device, quiet=want == "cuda")
        if self.gpu is None and want == "cuda":
            raise UnsupportedModelError(f"EngineConfig.transport='cuda': the CUDA extension is unavailable "
                                        f"({CudaDecode.why})")

    def end_step(self) -> None:
        """After a step's forward (or its failure): with a GPU posting, wait for it (raises a worker's
        failure it saw); with prompt rows copied in as DMAs, wait for them (the workers and the next
        step read those blocks; a failed step's blocks may be given to another request)."""
        try:
            if self.gpu is not None:
                self.gpu.end_step()
        except BaseException:
            with contextlib.suppress(Exception):  # the worker's failure is the one to raise
                self._wait_dmas()
            raise
        self._wait_dmas()

    def _wait_dmas(self):
        dev, self._dma_on = self._dma_on, None
        if dev is not None:
            torch.cuda.current_stream(dev).synchronize()

    def lock_pages(self, device, register=None, unregister=None) -> None:
        """Have write_rows's whole-block copies from a GPU go as DMAs: the pool's K/V page-locked
        (cudaHostRegister, portable) in 4 MiB chunks as the copies first touch them
        (hetero.offload.pinning.RangePins), the copies enqueued without waiting and waited for at
        end_step. Synchronous copies into pageable memory moved ~2.6 GB/s: 12.8 s of a 44 s run at
        8 x 32K on the H100 host. Where the driver refuses, copies stay synchronous (one log line).
        Released at close. register/unregister: the tests' recording ones (else cudaHostRegister /
        Unregister with `device` current)."""
        if self._pins is None:
            arrays = [(t.data_ptr(), t.numel() * t.element_size()) for t in (self.K, self.V, self.Kr, self.Vr)]
            self._pins = RangePins(arrays, register or functools.partial(_cuda_register, device=device),
                                   unregister or functools.partial(_cuda_unregister, device=device))

    def open(self):
        """Map the pool in the workers (CMD_OPEN); the session they had mapped is unmapped."""
        other = self.pool.session
        if other is not None and other is not self:
            other.opened = False
        self.pool.drain()
        self.layout.publish(self.pool.words)
        C.write_name(self.pool.words, self.seg.name)
        self.opened = True
        self.pool.session = self
        self.pool.run(C.CMD_OPEN)

    def ensure_open(self):
        """Before a step: the planner resolved and the pool mapped in the workers."""
        if callable(self.planner) and not hasattr(self.planner, "plan"):
            self.planner = self.planner()
        if self.pool.session is not self:
            self.open()

    # ---- rows written and read by the parent (prefill chunks)
    def write_rows(self, layer: int, table: torch.Tensor, start: int, key: torch.Tensor, value: torch.Tensor):
        """Rows start..start+n-1 of a request (key/value [Hkv, n, D], any device) through its block
        table (int64 tensor: row j in block table[j // BK], column j % BK)."""
        Hkv, n, D = key.shape
        if n == 0:
            return
        Dp, P = self.layout.dpad, 2 if self.layout.code == BF16 else 1   # bf16 K blocks: pairs (kernel.k_index)
        Kl, Vl = self.kv[layer]
        a, b = min(-(-start // BK) * BK, start + n), (start + n) // BK * BK     # the whole blocks: rows a..b-1
        if b > a:
            # put the rows in the blocks' layout where they are (on a GPU: there), then whole-block
            # copies into the pool: one per kv head and run of consecutive block ids (what
            # BlockPool.take mostly hands out), straight from the GPU; a per-row scatter moves
            # 4-byte pieces at ~1 GB/s
            m, rows = (b - a) // BK, slice(a - start, b - start)
            k, v = key[:, rows].to(Kl.dtype), value[:, rows].to(Vl.dtype)
            if D != Dp:
                k, v = F.pad(k, (0, Dp - D)), F.pad(v, (0, Dp - D))
            kw, Kw, Q = pair_words(k, Kl, P)
            # rows [Hkv, m*BK, Dq*Q] -> K blocks [Hkv, m, Dq, BK, Q]; V blocks [Hkv, m, Dp/W, BK, W]
            kb = kw.reshape(Hkv, m, BK, -1, Q).transpose(2, 3)
            vb = v.reshape(Hkv, m, BK, Dp // W, W).transpose(2, 3)
            blocks = table[a // BK:b // BK]
            runs = consecutive_runs(blocks)
            if len(runs) > 4:                   # scattered: one scatter of whole blocks
                Kw.index_copy_(1, blocks, kb.contiguous().cpu())
                Vl.index_copy_(1, blocks, vb.contiguous().cpu())
            else:
                pins = self._pins if key.is_cuda else None   # page-locked (lock_pages): DMAs, waited for at end_step
                if key.is_cuda:                 # the transposes on the GPU, then a copy per run and head
                    kb, vb = kb.contiguous(), vb.contiguous()
                for i, lo, cnt in runs:
                    for h in range(Hkv) if key.is_cuda else (slice(None),):
                        for dst, src in ((Kw[h, lo:lo + cnt], kb[h, i:i + cnt]), (Vl[h, lo:lo + cnt], vb[h, i:i + cnt])):
                            if pins is not None and pins.copy_in(dst, src):
                                self._dma_on = key.device
                                self.dma_copies += 1
                            else:
                                dst.copy_(src)
                                self.sync_copies += bool(key.is_cuda)
        for lo, hi in ((start, a), (max(a, b), start + n)):             # the partial blocks at either end
            if hi > lo:                                                # (rows lo..hi-1 lie in one block)
                self._write_within(layer, int(table[lo // BK]), lo % BK, key[:, lo - start:hi - start],
                                   value[:, lo - start:hi - start])

    def _write_within(self, layer: int, block: int, col: int, key: torch.Tensor, value: torch.Tensor):
        """Rows of one block from column `col` on (key/value [Hkv, m, D], any device): a strided copy
        each (a question's rows after a document's whole blocks; the cheap way, not an index scatter)."""
        Hkv, m, D = key.shape
        Dp, P = self.layout.dpad, 2 if self.layout.code == BF16 else 1
        Kl, Vl = self.kv[layer]
        key, value = key.to("cpu", Kl.dtype), value.to("cpu", Vl.dtype)
        if D != Dp:                                   # zero columns D..Dp-1
            key, value = F.pad(key, (0, Dp - D)), F.pad(value, (0, Dp - D))
        # K [Hkv, NB, Dp/P, BK, P][:, block, :, col:col+m] and V [Hkv, NB, Dp/W, BK, W][:, block, :, col:col+m]
        Kl.view(Hkv, -1, Dp // P, BK, P)[:, block, :, col:col + m] = key.view(Hkv, m, Dp // P, P).transpose(1, 2)
        Vl[:, block, :, col:col + m] = value.view(Hkv, m, Dp // W, W).transpose(1, 2)

    def read_rows(self, layer: int, table: torch.Tensor, n: int, first: int = 0,
                  new: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """A request's rows first..n-1 (first: a multiple of BK) through its block table, then the
        rows of `new` (K, V [Hkv, m, D]) when given, on new's device: ([Hkv, n - first (+ m), D]) x 2,
        copies. One gather of whole blocks (none where the table's blocks are consecutive ids, as
        BlockPool.take mostly gives them: a view), then one copy that turns them into rows."""
        b0, nb = first // BK, -(-n // BK) - first // BK
        Kl, Vl = self.kv[layer]
        idx = table[b0:b0 + nb]
        runs = consecutive_runs(idx)
        if len(runs) == 1 and runs[0][1] >= 0:
            lo = runs[0][1]
            K, V = Kl[:, lo:lo + nb], Vl[:, lo:lo + nb]           # a run of consecutive blocks: a view
        else:
            K, V = Kl.index_select(1, idx), Vl.index_select(1, idx)   # [Hkv, nb, Dp, BK], [Hkv, nb, Dp/W, BK, W]
        Hkv, Dp = K.shape[0], K.shape[2]
        P = 2 if self.layout.code == BF16 else 1
        m, extra = n - first, 0 if new is None else new[0].shape[1]
        rows = max(nb * BK, m + extra)           # the last block's rows past n are overwritten by new's
        k, v = K.new_empty(Hkv, rows, Dp), V.new_empty(Hkv, rows, Dp)
        kw, Kw, Q = pair_words(k, K, P)
        # K blocks [Hkv, nb, Dq, BK, Q] -> rows [Hkv, nb, BK, Dq, Q]
        kw[:, :nb * BK].view(Hkv, nb, BK, -1, Q).copy_(Kw.transpose(2, 3))
        v[:, :nb * BK].view(Hkv, nb, BK, Dp // W, W).copy_(V.transpose(2, 3))
        D = self.spec.head_dim
        if new is None:
            return k[:, :m, :D], v[:, :m, :D]
        kn, vn = new
        k, v = k[:, :m + extra, :D].to(kn.device, kn.dtype), v[:, :m + extra, :D].to(vn.device, vn.dtype)
        k[:, m:], v[:, m:] = kn, vn
        return k, v

    # ---- decode: one token per request, attended by the workers
    def begin_decode(self, lengths: list[int], tables: list[list[int]], rtables: list[list[int]] | None = None):
        """The step's decode requests (slot i: `lengths[i]` cached rows, block table `tables[i]`,
        which already has a block for row lengths[i]; rtables[i] its window table, when the window
        pool is kept apart): their tables, lengths, groups and plan."""
        v, n = self.v, len(lengths)
        if n > self.layout.batch:
            raise ValueError(f"{n} decode requests in a step; the pool's staging holds {self.layout.batch}")
        self.pool.drain()                          # no job may still read what is written next
        self.n = n
        if n == 0:
            return
        L = np.asarray(lengths, np.int64)
        v["lengths"][:n] = L
        tab = v["tables"]
        for i, t in enumerate(tables):
            if len(t) > tab.shape[1]:
                raise ValueError(f"a block table of {len(t)} blocks; the pool's tables hold {tab.shape[1]}")
            tab[i, :len(t)] = t
        for i, t in enumerate(rtables or ()):
            v["rtables"][i, :len(t)] = t
        v["skip"][:n] = 0
        v["order"][:n] = np.argsort(-L, kind="stable")
        self.ngroups = self._group(L, tables)
        parent = self.gpu is None                  # the GPU's jobs: the workers alone take units
        own = L - v["pstart"][:n]
        self.nactive, self.nsplit = self.planner.plan(own, 1, self.layout, parent)
        self.psplit = 0
        if self.ngroups:
            members = v["pgroup"][:n]
            m = int(np.bincount(members[members >= 0]).max())
            P = int(v["gblocks"][:self.ngroups].max()) * BK
            nact, self.psplit = self.planner.plan(np.array([max(P - m, 0)]), m, self.layout, parent)
            self.nactive = max(self.nactive, nact)

    def _group(self, L, tables) -> int:
        """Decode requests whose tables start with the same block form a group reading their
        common leading blocks once (pgroup, gblocks, pstart). Returns the number of groups."""
        v, n = self.v, len(tables)
        v["pgroup"][:] = -1
        v["pstart"][:n] = 0
        by_first: dict[int, list[int]] = {}
        for i, t in enumerate(tables):
            if L[i] >= BK and t[0] >= 0:           # a whole block read before this step's token (not a ring's)
                by_first.setdefault(t[0], []).append(i)
        g = 0
        for members in by_first.values():
            if len(members) < 2 or g == self.layout.groups:
                continue
            first = tables[members[0]]
            common = min(int(L[i]) // BK for i in members)
            for i in members[1:]:
                t, k = tables[i], 0
                while k < common and t[k] == first[k]:
                    k += 1
                common = k
            v["gblocks"][g] = common
            for i in members:
                v["pgroup"][i] = g
                v["pstart"][i] = common * BK
            g += 1
        return g

    def post_decode(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    window: int, scale: float, softcap: float):
        """Stage the decode tokens' q [n, Hq, D] and new k/v [n, Hkv, D] of `layer` and publish its
        job; the workers run it while the caller computes the prefill chunks (finish_decode)."""
        n, D = self.n, query.shape[-1]
        ng, psplit = (0, 0) if window else (self.ngroups, self.psplit)    # a window reads its own rows only
        units = ng * self.spec.kv_heads * psplit + n * self.spec.kv_heads * self.nsplit
        if self.gpu is not None:                   # enqueued on the stream; the GPU publishes the job
            self.gpu.post(self, layer, query, key, value, window=window, scale=scale, softcap=softcap,
                          nsplit=self.nsplit, psplit=psplit, ngroups=ng, workers=self.nactive, units=units)
            return
        self.pool.drain()                          # no job may still read the staging area
        self.q[:n, :, 0, :D].copy_(query)          # columns D..Dp-1 stay zero
        self.knew[:n, :, 0, :D].copy_(key)
        self.vnew[:n, :, 0, :D].copy_(value)
        w, f = self.pool.words, self.pool.floats
        w[C.LAYER], w[C.QLEN], w[C.WINDOW], w[C.NSPLIT] = layer, 1, window, self.nsplit
        w[C.PSPLIT], w[C.NGROUPS] = psplit, ng
        f[C.F_SCALE], f[C.F_SOFTCAP] = scale, softcap
        seq = self.pool.submit(C.CMD_ATTN, self.nactive, units, self._share)
        self._inflight = (seq, self.nactive, units, psplit)

    def finish_decode(self, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Take units, wait for the posted job and merge: [n, Hq, D] f32 (CPU); with a GPU posting,
        the wait and the merge enqueued: [n, Hq, D] on the GPU, the model's dtype."""
        if self.gpu is not None:
            return self.gpu.finish(self, sinks)
        seq, nactive, units, psplit = self._inflight
        self._inflight = None
        self.pool.wait(seq, nactive, units, self._share)
        n, Hq, Hkv, D = self.n, self.spec.q_heads, self.spec.kv_heads, self.spec.head_dim
        G, ns = Hq // Hkv, psplit + self.nsplit
        sink = None if sinks is None else sinks.detach().to("cpu", torch.float32).reshape(Hkv, G)
        out = merge_partials(self.part_o[:n, :, :ns, :G, :D], self.part_m[:n, :, :ns, :G],
                             self.part_l[:n, :, :ns, :G], sink)          # [n, Hkv, G, D]
        return out.reshape(n, Hq, D)

    def _share(self, seq):
        """This process's part of attention job `seq` (kernel.run_job)."""
        kernel.run_job(self.pool.words, self.pool.floats, seq, C.PARENT_BUSY, self.layout.code, *self._job)

    def close(self):
        """Unmap in the workers and unlink. Idempotent; safe after a worker died."""
        failed = None
        if self.gpu is not None:                  # its page locks, before the segment goes
            gpu, self.gpu = self.gpu, None
            try:
                gpu.close()
            except BaseException as e:
                failed = e
        pins, self._pins = self._pins, None
        if pins is not None:                      # before the unmap, no DMA left in flight
            try:
                self._wait_dmas()
            except BaseException as e:
                failed = failed or e
            try:
                pins.close()
            except BaseException as e:
                failed = failed or e
        if self.opened:
            self.opened = False
            if self.pool.session is self:
                self.pool.session = None
                if not self.pool.closed and self.pool.broken is None:
                    try:
                        self.pool.run(C.CMD_CLOSE)
                    except BaseException as e:    # the segment is still unlinked below
                        failed = failed or e
        self.q = self.knew = self.vnew = self.kv = self.part_o = self.part_m = self.part_l = self.lengths = None
        self.K = self.V = self.Kr = self.Vr = None
        self.v = self._job = None
        if getattr(self, "seg", None) is not None:
            self.seg.close()
        if failed is not None:
            raise failed


def pair_words(rows: torch.Tensor, blocks: torch.Tensor, P: int):
    """K rows [Hkv, R, Dp] and K blocks [Hkv, nb, Dp, BK] as (rows, blocks [Hkv, nb, Dp/(P/Q), BK, Q], Q).
    bf16 K blocks hold pairs of columns side by side ([Dp/2, BK, 2]: kernel.k_index); seen as
    32-bit words (Q = 1) a pair moves as one element, which makes the rows <-> blocks transpose a
    plain 2-D one (~7x faster on the host than moving 2-element pieces)."""
    Hkv, nb = blocks.shape[:2]
    if P == 2 and rows.dtype == blocks.dtype and _words(rows) and _words(blocks):
        return rows.view(torch.int32), blocks.view(torch.int32).view(Hkv, nb, -1, BK, 1), 1
    return rows, blocks.view(Hkv, nb, -1, BK, P), P


def _words(t: torch.Tensor) -> bool:
    """A 16-bit tensor that can be seen as 32-bit words along its last dim."""
    return t.stride(-1) == 1 and t.shape[-1] % 2 == 0 and t.storage_offset() % 2 == 0 and \
        all(x % 2 == 0 for x in t.stride()[:-1])


def consecutive_runs(ids: torch.Tensor) -> list[tuple[int, int, int]]:
    """A block table's runs of consecutive ids: [(index in ids, first id, count)]."""
    if len(ids) == 0:
        return []
    x = ids.cpu()
    cut = (torch.nonzero(x[1:] - x[:-1] != 1).flatten() + 1).tolist()
    starts = [0] + cut
    ends = cut + [len(x)]
    return [(i, int(x[i]), j - i) for i, j in zip(starts, ends)]


def pool_sizes(cfg, s, max_model_len: int, window: int, hybrid: bool) -> tuple[int, int]:
    """(blocks of the full layers' pool, of the windowed layers' when kept apart (hybrid), else 0)
    under EngineConfig `cfg` for a model of spec `s`. The window pool holds every running
    request's ring twice over (room for its prefix cache) and at least an eighth of the full pool's
    (pinned documents keep their last window there), at most as many blocks as the full pool;
    kv_blocks sets the full pool's, else kv_memory (or a share of the RAM) both."""
    layer_block = SessionLayout(1, s.q_heads, s.kv_heads, s.head_dim, BK, 1,
                                STORAGE_CODES[s.dtype], blocks=1, maxblk=1).kv_bytes      # one layer's block
    ringed = sum(1 for x in s.windows if x) if hybrid else 0
    full = s.layers - ringed
    table = -(-max_model_len // BK)
    chunk = cfg.long_prefill_chunk or cfg.max_num_batched_tokens
    need = cfg.max_num_seqs * table
    # the running requests' rings twice over, and at least an eighth of the full pool (room for
    # the last windows of pinned documents)
    ring_want = max(2 * cfg.max_num_seqs * min(table, -(-(window - 1 + chunk) // BK) + 1), need // 8) if hybrid else 0
    free = shm.free_bytes()
    if cfg.kv_blocks is not None:
        n = cfg.kv_blocks
        r = min(n, max(ring_want, n // 8))
    else:
        if cfg.kv_memory is not None:
            room = cfg.kv_memory
        else:                 # a default within the RAM and the shared-memory filesystem's room
            room = int(cfg.ram_fraction * min(psutil.virtual_memory().available, free or 1 << 62))
        units = room // layer_block                      # layer-blocks the room holds
        r = min(ring_want, need, units // s.layers)      # never more than an equal split's
        n = max(1, min(need, (units - r * ringed) // full))
        r = min(r, n) if hybrid else 0
    nbytes = (n * full + r * ringed) * layer_block
    if free is not None and nbytes > free:
        raise CapacityError(f"a KV pool of {n} blocks ({nbytes / 2**30:.2f} GiB) does not fit the "
                            f"shared-memory filesystem's {free / 2**30:.2f} GiB free; set EngineConfig.kv_memory")
    return n, max(r, 1) if hybrid else 0
