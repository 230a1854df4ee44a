"""Parent side of one generate call: the shared KV arena, prefill offload, decode steps.

The session creates (and alone unlinks) the segment described by
`SessionLayout`, maps it in the workers (CMD_OPEN), and exposes torch views of
it. Prefill writes each layer's real (unpadded) KV rows straight into the
arena; a decode step stages q/k/v, runs one CMD_ATTN job and merges the
workers' partials. Per-request lengths count real tokens only: request b's
row j holds its j-th real token, so left padding never reaches the cache.
Heads are stored padded to the layout's dpad (q/k/v go into the first head_dim
columns; the rest stay zero) and outputs are sliced back. Sliding-window layers
keep a ring of the rows their window can still see (arena.ring_plan).
"""
import contextlib
import logging
from dataclasses import replace
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from hetero.cpu_attention import kernel
from hetero.cpu_attention.kernel import BF16, F16, F32
from hetero.cpu_attention.planner import StaticPlanner
from hetero.cpu_attention.simd import BK, W
from hetero.errors import UnsupportedModelError, WorkerError
from hetero.ipc import control as C, shm
from hetero.ipc.transport import CpuTransport, merge_partials  # noqa: F401 (merge_partials: re-exported)
from hetero.offload.arena import SessionLayout, layer_slots, ring_plan, slots_of, whole_blocks
from hetero.offload.cache import UpdateOrder
from hetero.offload.pinning import ArenaPins

log = logging.getLogger("hetero")
STORAGE_CODES = {torch.float32: F32, torch.bfloat16: BF16, torch.float16: F16}


class Job(NamedTuple):
    """One layer's attention job, as a transport publishes it (hetero.ipc.transport)."""
    layer: int
    window: int       # 0: none
    nsplit: int
    scale: float
    softcap: float    # 0.0: none
    workers: int      # workers posted besides the parent (the planner's choice)
    units: int        # groups * Hkv * psplit + B * Hkv * nsplit
    psplit: int = 0   # splits of each shared-prefix group (their partials come first: slots 0..psplit-1)


class KVSession(UpdateOrder):
    @torch.inference_mode(False)    # its tensors outlive the call (a Context): usable outside inference mode
    def __init__(self, pool, spec, pads, real_lens, cap, planner=None, tmax=1, prefix_groups=()):
        """tmax: query tokens per step after the first forward (chunked prefill: the chunk size).
        prefix_groups: [(source, members)]: a batch-1 session (a Context's, without rings) whose
        first whole blocks the requests `members` share, read in place: their rows before
        pstart[b] are not copied and decode attends each shared block once for all the members
        (kernel.run_prefix_unit). The caller copies each request's rows from pstart[b] on
        (write_rows) before the steps."""
        self.pool, self.spec = pool, spec
        self.prefix_groups = [(src, list(members)) for src, members in prefix_groups]
        pstart = np.zeros(len(pads), np.int64)
        pgroup = np.full(len(pads), -1, np.int64)
        for g, (src, members) in enumerate(self.prefix_groups):
            pstart[members] = int(src.lengths[0]) // BK * BK
            pgroup[members] = g
        private = whole_blocks(cap) - int(pstart.min()) if self.prefix_groups else 0
        self.transport = CpuTransport()               # use_transport() may replace it (a CUDA model)
        self.planner = planner or StaticPlanner(pool.n)
        self.batch = len(pads)
        self.pads = [int(p) for p in pads]            # left pads per request
        self.layout = self.layout_for(spec, self.batch, cap, tmax, private, len(self.prefix_groups))
        self._prefix_layout = replace(self.layout, batch=1, groups=0, private=0)   # planning a group's units
        windows = spec.windows or (0,) * spec.layers
        _, ringed = ring_plan(windows, self.layout.cap, self.layout.tmax)
        # per layer: the window its ring was sized for (0: the layer keeps every row)
        self.ring_window = tuple(w if r else 0 for w, r in zip(windows, ringed))
        self._sinks = {}                              # layer -> (sinks given, their CPU rows; see _sink_rows)
        self.prefilled = False
        self.stepping = False             # this forward began after the prefill (begin_forward): a step
        self.opened = False
        self.prefetcher = None            # a LayerPrefetcher while a forward attends on the model's device
        self._pins = None                 # the arena's page locks for a GPU's DMAs, per layer (pin_layer)
        self._offload = None              # a GPU prefill's (offload stream, {layer: event}) (store_prefill)
        # per layer: the cache was updated and attention has not read it yet (HeteroLayer.update
        # sets it, take_update clears it): one attention call per update, same layer, or refuse
        self.pending = [False] * spec.layers
        self.touched = False              # a KV update ran since the call began (begin_call; generator._recover)
        self.weights = None               # the model's weights its KV came from, for a Context (generator._keep)
        shm.warn_if_small_pages(self.layout.nbytes)
        self.seg = shm.Segment(shm.new_name("kv"), self.layout.nbytes, create=True)
        try:
            v = self.layout.views(self.seg)
            self.lengths = v["lengths"]                 # numpy, real rows per request
            self.skip = v["skip"]                       # numpy, per request: tokens of the next step(s) not its own
            self.skip[:] = 0
            self.pstart = v["pstart"]                   # numpy, per request: the first row stored here
            self.pstart[:], v["pgroup"][:] = pstart, pgroup
            for g, (src, _) in enumerate(self.prefix_groups):       # read by the workers at CMD_OPEN
                if src.layout.nsplit_max != self.layout.nsplit_max:  # they rebuild its layout from this one
                    raise ValueError(f"a shared prefix's session has nsplit_max {src.layout.nsplit_max}")
                v["gblocks"][g] = int(src.lengths[0]) // BK
                v["psrc"][g] = src.layout.cap, src.layout.tmax
                name = src.seg.name.encode()
                v["pnames"][g, :] = 0
                v["pnames"][g, :len(name)] = np.frombuffer(name, np.uint8)
            self.q = torch.from_numpy(v["q"])           # [B, Hq, Tmax, Dp] f32
            self.knew, self.vnew = self._storage(v["knew"]), self._storage(v["vnew"])
            self.K = self._storage(v["K"])              # [Lfull, B, Hkv, nblk, Dp, BK]
            self.V = self._storage(v["V"])              # [Lfull, B, Hkv, nblk, Dp/W, BK, W]
            self.Kr = self._storage(v["Kr"])            # [Lring, B, Hkv, nring, Dp, BK]
            self.Vr = self._storage(v["Vr"])            # [Lring, B, Hkv, nring, Dp/W, BK, W]
            v["ringed"][:] = ringed                     # read by the workers at CMD_OPEN
            # per layer: its (K, V) blocks [B, Hkv, nblk or nring, ...]
            self.kv = [(self.Kr[i], self.Vr[i]) if r else (self.K[i], self.V[i]) for r, i in layer_slots(ringed)]
            self.part_o, self.part_m, self.part_l = (torch.from_numpy(v[n]) for n in ("part_o", "part_m", "part_l"))
            self.lengths[:] = 0
            self.order = v["order"]                     # numpy, the workers' unit order (see _plan_step)
            self.order[:] = np.arange(self.batch)
            self._real_lens = np.asarray(real_lens, np.int64)
            self._prefill_rows = None                   # rows the prefill forward stored per request
            # the parent takes attention units too (kernel.run_job): the arena's arrays, and scratch of its own
            rows = spec.q_heads // spec.kv_heads * self.layout.tmax
            srcs = [src.layout.views(src.seg) for src, _ in self.prefix_groups]     # read in place
            PKs, PVs = kernel.prefix_sources([x["K"] for x in srcs], [x["V"] for x in srcs], v["K"], v["V"])
            pscratch = kernel.prefix_scratch(self.batch * rows if srcs else 1, self.layout.dpad)
            # an arena, not a paged pool: no block tables, every block read through the identity
            self._job = (v["q"], v["knew"], v["vnew"], v["K"], v["V"], v["Kr"], v["Vr"], slots_of(ringed),
                         kernel.NO_TABLES, kernel.NO_TABLES, kernel.identity_table(v["K"], v["Kr"], *PKs),
                         v["lengths"], v["order"], v["skip"], v["pstart"], v["pgroup"], v["gblocks"],
                         len(srcs), v["part_o"], v["part_m"], v["part_l"],
                         np.zeros((rows, self.layout.dpad), np.float32),
                         np.zeros((rows, self.layout.dpad // 2), np.uint32), kernel.score_scratch(rows),
                         PKs, PVs, pscratch)
            self._open()
        except BaseException:
            self.close()
            raise

    @staticmethod
    def layout_for(spec, batch, cap, tmax=1, private=0, groups=0):
        """The SessionLayout a session for `batch` requests of `cap` rows uses (memory checks);
        private: rows stored per request when shared-prefix groups hold the others (0: cap)."""
        cap = whole_blocks(cap)
        ring, ringed = ring_plan(spec.windows or (0,) * spec.layers, cap, tmax)
        return SessionLayout(batch=batch, q_heads=spec.q_heads, kv_heads=spec.kv_heads, head_dim=spec.head_dim,
                             cap=cap, layers=spec.layers, code=STORAGE_CODES[spec.dtype], tmax=tmax,
                             ring=ring, ring_layers=sum(ringed), private=private, groups=groups)

    def _storage(self, arr):
        t = torch.from_numpy(arr)
        return t if arr.dtype == np.float32 else t.view(self.spec.dtype)

    def _open(self):
        """Map this session in the pool's workers (CMD_OPEN; they drop the one they had mapped)."""
        other = self.pool.session
        if other is not None and other is not self:
            other.opened = False                      # its segment stays; the workers unmap it now
        self.pool.drain()
        self.layout.publish(self.pool.words)
        C.write_name(self.pool.words, self.seg.name)
        self.opened = True               # before the job: close() after an interrupt finishes it, then unmaps
        self.pool.session = self
        self.pool.run(C.CMD_OPEN)

    def begin_call(self, pool, planner):
        """Before a call continues this session (a Context): map it in `pool`'s workers if it is
        not (a pool serves one mapped session at a time, and a broken pool is replaced between
        calls), take the call's planner, forget a failed call's half-done layer."""
        self.planner = planner
        self.pending = [False] * self.spec.layers
        self.touched = False
        if self.pool is not pool or pool.session is not self:
            self.pool = pool
            self._open()
        if self.prefilled:
            self._plan_step(self._planned_T)

    def end_call(self, check=True):
        """After a call on a session that stays open: apply a GPU step's deferred length update,
        release the transport (a GPU's page locks) and, with check, ping the workers, so a death
        unnoticed during the call raises from that call."""
        t, self.transport = self.transport, CpuTransport()
        try:
            t.settle(self)
        finally:
            t.close()
        if check and self.opened and not self.pool.closed and self.pool.broken is None:
            self.pool.run(C.CMD_PING)

    def rewind(self, length, rings=None):
        """Back to `length` cached rows (batch 1): later rows are ignored and overwritten by later
        appends; rings: (Kr, Vr) copies saved before, put back (a call may have wrapped them)."""
        if not self.pool.closed and self.pool.broken is None:
            try:
                self.pool.drain()          # an interrupted job may still be appending
            except WorkerError:
                pass
        self.lengths[0] = length
        if rings is not None:
            self.Kr.copy_(rings[0])
            self.Vr.copy_(rings[1])
        self._plan_step(self._planned_T)

    def begin_forward(self):
        """The model's forward begins (a pre-hook, generator._routed). The prefill's forward turns
        prefilled on at its last attention layer; the modules after it are still the prefill's."""
        self.stepping = self.prefilled

    def note_update(self, layer):
        """HeteroLayer.update of `layer` ran: its attention call comes next."""
        self.touched = True
        UpdateOrder.note_update(self, layer)

    # ---- prefill: the model's own attention runs; we offload its KV layer by layer
    def store_prefill(self, layer, key, value):
        """key/value: [B, Hkv, S, D] on the model's device (S includes left pads). A ring layer
        stores only the rows its window can still see at the first decode step. On a GPU the
        layer's KV goes to the arena on an offload stream (asynchronous DMAs into the page-locked
        arena) while the next layers compute; the compute stream waits only for the offload of
        layer - 2 (so GPU memory holds the blocked copies of at most two layers), and
        finish_prefill waits once for the last."""
        window = self.ring_window[layer]
        self._prefill_rows = [key.shape[2] - pad for pad in self.pads]
        with self.offloading(layer, key, value):
            for b, pad in enumerate(self.pads):
                n = key.shape[2] - pad
                start = max(0, n - window + 1) // BK * BK if window else 0     # whole blocks
                self.write_rows(layer, b, key[b, :, pad + start:], value[b, :, pad + start:], start)

    @contextlib.contextmanager
    def offloading(self, layer, key, value):
        """The body's copies of layer's key/value into the arena (store_prefill; a prefetched
        forward's new rows, hetero.prefetch) on the offload stream of a GPU model (nothing on a
        CPU one)."""
        if not key.is_cuda:
            yield
            return
        with torch.cuda.device(key.device):
            self.pin_layer(layer)                                    # before the layer's first DMA
        if self._offload is None:
            self._offload = (torch.cuda.Stream(key.device), {})      # the stream, layer -> its event
        stream, events = self._offload
        if layer - 2 in events:
            # the host waits for layer - 2's offload (long done, normally: it is two layers behind):
            # a wait on the GPU alone would let the host enqueue every layer, each freed key/value
            # held by the allocator until its copy ran, so GPU memory would grow toward HF's
            events.pop(layer - 2).synchronize()
        stream.wait_stream(torch.cuda.current_stream(key.device))   # the layer's key/value exist
        key.record_stream(stream)                                   # not reused before the copies ran
        value.record_stream(stream)
        with torch.cuda.stream(stream):
            yield
            ev = torch.cuda.Event()
            ev.record(stream)
        events[layer] = ev

    def wait_offloads(self):
        """Wait for the offload stream's copies (before the workers or the next fetches read the arena)."""
        if self._offload is not None:
            self._offload[0].synchronize()
            self._offload = None

    def _block_ids(self, layer, start, n):
        """Where rows [start, start + n) live: the stored block of each logical block they touch."""
        nphys = self.kv[layer][0].shape[2]
        first, last = start // BK, (start + n - 1) // BK
        if last - first >= nphys:
            raise ValueError(f"rows [{start}, {start + n}) span {last - first + 1} blocks; layer {layer} "
                             f"keeps {nphys} (a sliding window's ring keeps only the rows it can still see)")
        return [blk % nphys for blk in range(first, last + 1)]

    def write_rows(self, layer, b, key, value, start=0, whole_blocks=None):
        """Rows start..start+n-1 of request b: key/value [Hkv, n, D] (any device) into the blocked
        layout; start is a multiple of BK. Row j goes to block (j // BK) % nblk (a ring wraps).
        From a GPU (whole_blocks: None = key.is_cuda) the blocks are built whole on the GPU (the
        rows after the last one zero: no row past it is read before it is written) and copied per
        head, contiguous on both sides: on the current stream, asynchronous DMAs into a
        page-locked arena (pin_layer). From host memory, one strided copy per run (3-5x faster there)."""
        Hkv, n, D = key.shape
        if start % BK or start < self.pstart[b]:
            raise ValueError(f"start row {start} is not a multiple of {BK} at or past request {b}'s shared prefix "
                             f"({self.pstart[b]} rows)")
        if n == 0:
            return
        ids = self._block_ids(layer, start, n)
        Kl, Vl = self.kv[layer]
        Kb, Vb = Kl[b], Vl[b]                             # [Hkv, nblk, Dp, BK], [Hkv, nblk, Dp/W, BK, W]
        # a ring wraps at most once: stored blocks ids[0].. then 0..; each run is contiguous
        first = min(len(ids), Kb.shape[1] - ids[0])
        runs = [(0, ids[0], first)] + ([(first, 0, len(ids) - first)] if first < len(ids) else [])
        Dp = self.layout.dpad
        P = 2 if self.layout.code == BF16 else 1          # bf16 K blocks are pair-interleaved (kernel.k_index)
        if whole_blocks if whole_blocks is not None else key.is_cuda:
            nb = len(ids)
            # zero columns D..Dp-1 (SessionLayout.dpad) and rows n..nb*BK-1: [Hkv, nb*BK, Dp]
            key, value = F.pad(key, (0, Dp - D, 0, nb * BK - n)), F.pad(value, (0, Dp - D, 0, nb * BK - n))
            # rows -> [Hkv, nb, BK, Dp/P, P] -> K blocks [Hkv, nb, Dp/P, BK, P] = [Hkv, nb, Dp, BK]
            kb = key.reshape(Hkv, nb, BK, Dp // P, P).transpose(2, 3).reshape(Hkv, nb, Dp, BK)
            # rows -> [Hkv, nb, BK, Dp/W, W] -> V blocks [Hkv, nb, Dp/W, BK, W]
            vb = value.reshape(Hkv, nb, BK, Dp // W, W).transpose(2, 3).contiguous()
            for i, p, cnt in runs:
                for h in range(Hkv):
                    Kb[h, p:p + cnt].copy_(kb[h, i:i + cnt], non_blocking=True)
                    Vb[h, p:p + cnt].copy_(vb[h, i:i + cnt], non_blocking=True)
            return
        if D != Dp:                                       # zero columns D..Dp-1
            key, value = F.pad(key, (0, Dp - D)), F.pad(value, (0, Dp - D))
        if P == 2 and key.dtype == Kb.dtype:
            # a bf16 pair as one 32-bit word: each block is a plain [BK, Dp/2] -> [Dp/2, BK]
            # transpose (6x faster on the host than moving 2-element pairs)
            Kp, key, Q = Kb.view(torch.int32).view(Hkv, Kb.shape[1], Dp // 2, BK, 1), key.view(torch.int32), 1
        else:
            Kp, Q = Kb.view(Hkv, Kb.shape[1], Dp // P, BK, P), P
        Dq = key.shape[2] // Q                            # K words per row in a block's column
        for i, p, nb in runs:               # logical blocks i..i+nb-1 of these rows -> stored p..p+nb-1
            k, v = key[:, i * BK:(i + nb) * BK], value[:, i * BK:(i + nb) * BK]
            full, rem = divmod(k.shape[1], BK)
            # [Hkv, full*BK, Dq*Q] -> [Hkv, full, BK, Dq, Q] -> K [Hkv, full, Dq, BK, Q]
            Kp[:, p:p + full].copy_(k[:, :full * BK].reshape(Hkv, full, BK, Dq, Q).transpose(2, 3))
            # [Hkv, full*BK, Dp] -> [Hkv, full, BK, Dp/W, W] -> V [Hkv, full, Dp/W, BK, W]
            Vb[:, p:p + full].copy_(v[:, :full * BK].reshape(Hkv, full, BK, Dp // W, W).transpose(2, 3))
            if rem:
                Kp[:, p + full, :, :rem].copy_(k[:, full * BK:].reshape(Hkv, rem, Dq, Q).transpose(1, 2))
                Vb[:, p + full, :, :rem].copy_(v[:, full * BK:].reshape(Hkv, rem, Dp // W, W).transpose(1, 2))

    def read_rows(self, layer, b, n, start=0):
        """Inverse of write_rows: [Hkv, n - start, D] copies of request b's rows start..n-1 (a ring
        layer holds only the last rows its window sees)."""
        if start < self.pstart[b]:
            raise ValueError(f"rows from {start}: request {b}'s rows before {self.pstart[b]} are its shared prefix's")
        if n <= start:
            return (torch.empty(self.spec.kv_heads, 0, self.spec.head_dim, dtype=self.spec.dtype),) * 2
        ids = torch.tensor(self._block_ids(layer, start, n - start))
        Kl, Vl = self.kv[layer]
        k, v = self.unblock(Kl[b][:, ids], Vl[b][:, ids], start % BK, n - start)
        return k.contiguous(), v.contiguous()

    def unblock(self, K, V, j0, n):
        """Blocks K [Hkv, nb, Dp, BK] and V [Hkv, nb, Dp/W, BK, W] (the arena's layout, on any
        device) -> rows j0..j0+n-1 of them, [Hkv, n, D] each (views where the layout allows)."""
        Hkv, nb, Dp, _ = K.shape
        P = 2 if self.layout.code == BF16 else 1      # bf16 K blocks are pair-interleaved (kernel.k_index)
        # K [Hkv, nb, Dp/P, BK, P] -> [Hkv, nb, BK, Dp/P, P] -> rows [Hkv, nb*BK, Dp]; V likewise
        k = K.reshape(Hkv, nb, Dp // P, BK, P).transpose(2, 3).reshape(Hkv, nb * BK, Dp)
        v = V.transpose(2, 3).reshape(Hkv, nb * BK, Dp)
        D = self.spec.head_dim
        return k[:, j0:j0 + n, :D], v[:, j0:j0 + n, :D]

    def finish_prefill(self):
        """Called after the last layer's prefill attention: later forwards (the rest of a chunked
        prompt, then the decode steps) go to the workers. Without a prefill forward (benchmarks
        writing rows themselves), the lengths are the real_lens given."""
        self.wait_offloads()
        # a chunked prefill's first forward stores only its own rows; the later chunks are steps
        self.lengths[:] = self._real_lens if self._prefill_rows is None else self._prefill_rows
        self._plan_step(1)
        self.prefilled = True

    def _plan_step(self, T):
        """Workers (besides the parent, which takes units too unless the transport is CUDA's),
        split count and request order (longest first: the longest units are taken first) for the
        next decode step: lengths change once per step, not per layer."""
        parent = self.transport.parent_takes_units
        self.nactive, self.nsplit = self.planner.plan(self.lengths - self.pstart, T, self.layout, parent)  # own rows
        self.psplit = 0
        if self.prefix_groups:   # a group's units: one "request" of P rows with its members' m*T query tokens
            P = int(self.pstart.max())
            m = max(len(members) for _, members in self.prefix_groups)
            n, self.psplit = self.planner.plan(np.array([max(P - m * T, 0)]), m * T, self._prefix_layout, parent)
            self.nactive = max(self.nactive, n)
        self.order[:] = np.argsort(-self.lengths, kind="stable")
        self._planned_T = T

    # ---- decode
    def use_transport(self, transport):
        """How decode attention reaches the workers (hetero.ipc.transport); CpuTransport by default.
        The plan depends on it (whether the parent takes units)."""
        self.transport = transport
        if self.prefilled:
            self._plan_step(self._planned_T)

    def stage_kv(self, key, value):
        """key/value: [B, Hkv, T, D], the new rows of this step (workers append them)."""
        self.transport.settle(self)
        if self.prefetcher is not None:
            self.prefetcher.stage(key, value)
        else:
            self.transport.stage(self, key, value)

    def sink_rows(self, layer, sinks, T):
        """sinks [Hq] (any device) -> [Hkv, G*T] f32 CPU: row g*T + t of kv head h holds sinks[h*G + g].
        Cached per layer (a model's sinks are parameters: one device copy per layer and session)."""
        hit = self._sinks.get(layer)
        if hit is None or hit[0] is not sinks or hit[2] != T:
            Hkv = self.spec.kv_heads
            s = sinks.detach().to("cpu", torch.float32).reshape(Hkv, -1, 1)        # [Hkv, G, 1]
            hit = self._sinks[layer] = (sinks, s.expand(-1, -1, T).reshape(Hkv, -1), T)
        return hit[1]

    def attend(self, layer, query, window, scale, softcap, sinks=None):
        """query [B, Hq, T, D] -> attention output [B, T, Hq, D] over the CPU KV cache.
        sinks: None, or a logit per query head [Hq] joining each softmax's denominator (gpt_oss)."""
        B, Hq, T, D = query.shape
        kept = self.ring_window[layer]
        if kept and not 0 < (window or 0) <= kept:
            raise UnsupportedModelError(
                f"layer {layer} keeps only the KV rows a sliding window of {kept} tokens sees (the model's "
                f"configured window), but attention was called with window {window}: refusing to compute it")
        if T > self.layout.tmax and (self.prefetcher is None or self.layout.ring_layers):
            # the staging holds tmax query tokens, a ring tmax new rows; a prefetched forward
            # over full-attention layers uses neither (generator._feed)
            raise NotImplementedError(f"decode steps of {T} query tokens (at most {self.layout.tmax} supported)")
        if self.prefetcher is not None:            # attention on the model's device (hetero.prefetch)
            out = self.prefetcher.attend(layer, query, window, scale, softcap, sinks)
            if layer == self.spec.layers - 1:
                self.prefetcher.finish()             # every layer's new rows are in the arena
                self.advance(T)
            return out
        if T != self._planned_T:
            self._plan_step(T)
        Hkv = self.spec.kv_heads
        job = Job(layer, window or 0, self.nsplit, scale, softcap or 0.0, self.nactive,
                  len(self.prefix_groups) * Hkv * self.psplit + B * Hkv * self.nsplit, self.psplit)
        out = self.transport.attention(self, job, query, sinks)    # [B, T, Hq, D]
        if layer == self.spec.layers - 1:
            self.transport.step_done(self, T)
        return out

    def advance(self, T):
        """A decode step's T tokens went through every layer: count the rows each request
        appended (those past its skip), plan the next step."""
        took = np.minimum(self.skip, T)
        self.lengths += T - took
        self.skip -= took
        self._plan_step(T)

    def run_attention(self, nactive, units):
        """The attention job whose params are in the pool's words: `units` units taken by workers
        0..nactive-1 and by this process."""
        self.pool.attention(nactive, units, self._share)

    def _share(self, seq):
        """This process's part of attention job `seq`: units from the ticket until it is empty."""
        w = self.pool.words
        kernel.run_job(w, self.pool.floats, seq, C.PARENT_BUSY, self.layout.code, *self._job)

    def pin_layer(self, layer):
        """Page-lock the layer's K/V in the arena (cudaHostRegister, portable) before its first DMA
        on the current CUDA device, and have the workers fault in the next layer's pages
        (hetero.offload.pinning). Where the driver refuses, copies stay correct through pageable
        memory (one log line). Released at close."""
        if self._pins is None:
            self._pins = ArenaPins(self, _cuda_register, _cuda_unregister)
        self._pins.pin(layer)

    @property
    def pin_s(self):
        """Host seconds spent page-locking (bench/gpu_prefill.py), None if nothing was."""
        return None if self._pins is None else self._pins.seconds

    def close(self):
        """Unmap in the workers and unlink. Idempotent; safe after a worker died. Raises the
        pool's WorkerError (after cleaning up) when a worker died or stalled unnoticed until now
        (an attention job does not wait for a worker that holds none of its units)."""
        failed = None
        try:
            self.transport.close()        # waits for a GPU's jobs and releases its page locks
        except BaseException as e:        # raised after the cleanup below
            failed = e
        if self.opened:
            self.opened = False
            self.pool.session = None
            if not self.pool.closed and self.pool.broken is None:     # a dead worker raises here
                try:
                    self.pool.run(C.CMD_CLOSE)
                except BaseException as e:    # Ctrl-C too: the segment is still unlinked below
                    failed = failed or e
        try:
            self.wait_offloads()             # no DMA may still write the arena
            pins, self._pins = self._pins, None
            if pins is not None:
                pins.close()                 # before the unmap
        except BaseException as e:
            failed = failed or e
        # drop every view first: a live view pins the mapping (and an output that keeps this
        # session through its cache would pin the whole arena)
        self.q = self.knew = self.vnew = self.K = self.V = self.Kr = self.Vr = self.kv = None
        self._sinks, self._job = {}, None
        self.part_o = self.part_m = self.part_l = self.lengths = self.order = self.skip = self.pstart = None
        self.prefix_groups = []                   # Contexts' sessions: they stay open
        self.seg.close()
        if failed is not None:
            raise failed


def _cuda_register(ptr, nbytes, device=None):
    """cudaHostRegister (portable) of [ptr, ptr + nbytes) (with `device` current, if given); False
    where the driver refuses."""
    with torch.cuda.device(device) if device is not None else contextlib.nullcontext():
        err = torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 1)      # 1: portable
    if int(err) != 0:
        _clear_cuda_error()                    # else torch's next launch check would raise it
        log.info("hetero: cudaHostRegister of %d bytes failed (%s)", nbytes, err)
        return False
    return True


def _cuda_unregister(ptr, device=None):
    with torch.cuda.device(device) if device is not None else contextlib.nullcontext():
        err = torch.cuda.cudart().cudaHostUnregister(ptr)
    if int(err) != 0:
        _clear_cuda_error()                    # else torch's next launch check would raise it
        log.info("hetero: cudaHostUnregister failed (%s)", err)


def _clear_cuda_error():
    """Reset the CUDA runtime's last error (torch's cudart bindings lack cudaGetLastError): through
    the process's already loaded libcudart."""
    import ctypes

    for name in ("libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0", "libcudart.so"):
        try:
            ctypes.CDLL(name).cudaGetLastError()
            return
        except (OSError, AttributeError):
            continue
