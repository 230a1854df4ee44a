"""Per-request LoRA inside generate: instance hooks on the adapted linear layers.

Each adapted module (a peft LoRA layer, or a plain nn.Linear when the adapter came from a
directory) gets its `forward` wrapped on the instance; model and peft code are untouched and
`remove()` puts back exactly what was there (the class's forward, or another wrapper such as
accelerate's device hooks). Outside generate the original forward runs. Inside, with a
`LoraBatch` active (one adapter name or None per request, like peft's adapter_names):

  decode (one token per request): stage x in shared memory, start the CPU workers on the LoRA
      deltas, run the base projection meanwhile, wait, add. On a GPU under the CUDA transport
      (use_transport) the GPU does all of that on its stream with no host synchronization: a
      kernel copies x into the mapped staging and posts the job (CMD_LORA_GPU: each worker takes a
      column range of every request's delta, hetero.adapters.layout.run_rows), the base projection
      runs, a kernel waits for the workers and adds the deltas (hetero/cuda/signal.cu).
  prefill: requests whose adapter has its device copy use it (torch, on the model's device);
      requests whose copy is not ready yet use the CPU workers: the whole prompt in one job where
      it fits the staging rows (layout.staging_rows), so the base projection runs alongside it.
  a CPU model: decode tokens too use the device copy (there, the shared copy itself), in torch in
      the calling process: the workers would share its cores and cost a round trip per site.
Either way out = base(x) + scaling * (x A^T) B^T per adapted request, computed in fp32 and
cast back to the output dtype (as peft does with its fp32 adapter weights).
"""
import heapq
import sys
import weakref
from contextvars import ContextVar

import numpy as np
import torch

from hetero.attention import active_session
from hetero.ipc import control as C
from hetero.ipc.transport import Bounce

active_batch = ContextVar("hetero_lora_batch", default=None)
MIN_WORK = 1 << 18     # multiply-adds worth waking one more worker for (~20-50 us of work)
# A GPU-posted decode job finds the workers awake (they spin through a GPU decode step), so only
# its time counts: a job streams its adapters' f32 weights (4 bytes per multiply-add of the
# shrink and expand), ~6 GB/s per core on the H100 host (its profile), where a rank-16 q_proj
# job on one worker took ~80 us. 2**15 multiply-adds (128 KB, ~20 us there) per worker.
MIN_WORK_POSTED = 1 << 15


def plan_units(pieces, din, dout, nworkers):
    """Rank-aware split of a LoRA job. pieces: [(slot, site, row0, row1, scaling, r)].
    Returns (active workers, [[unit, ...] per worker]) with unit = (slot, site, row0, row1, c0, c1, scaling).
    Cost of a unit: r * rows * (din + cols); a piece bigger than its fair share is cut along the
    output columns (each cut repeats the small shrink), then units go largest-first to the
    least-loaded worker (LPT)."""
    costs = [r * (r1 - r0) * (din + dout) for (_, _, r0, r1, _, r) in pieces]
    total = sum(costs)
    nactive = max(1, min(nworkers, total // MIN_WORK))
    share = total / nactive
    units = []
    for (slot, site, r0, r1, s, r), c in zip(pieces, costs):
        k = max(1, min(round(c / share), dout // 64, nactive))
        bounds = [j * dout // k // 16 * 16 for j in range(k)] + [dout]
        for c0, c1 in zip(bounds, bounds[1:]):
            units.append((r * (r1 - r0) * (din + c1 - c0), (slot, site, r0, r1, c0, c1, s)))
    units.sort(key=lambda u: -u[0])
    loads = [(0, w) for w in range(nactive)]
    per = [[] for _ in range(nactive)]
    for cost, u in units:
        load, w = heapq.heappop(loads)
        per[w].append(u)
        heapq.heappush(loads, (load + cost, w))
    return nactive, per


class LoraBatch:
    """The adapters of one generate call: adapters[b] is request b's (None: base model), over x
    [B, T, in] request-major. An engine step's packed forward (x [1, N, in], requests one after
    another, each its own number of tokens) is LoraBatch.packed(store, [(row0, row1, adapter)])."""

    def __init__(self, store, adapters, owner=None, segments=None, kept=None):
        self.store = store
        self.owner = owner                       # the LoraHooks (generator) whose call this is
        self.adapters = adapters                 # per request: store.Adapter or None
        self.segments = segments                 # packed: [(row0, row1, adapter)] over x's rows; None: per request
        self.kept = kept                         # packed: the same over the rows the LM head sees (logits_to_keep)
        self._plans = {}                         # (site, pieces) -> staged unit tables
        self.transport = None                    # a CUDA transport posting the decode jobs (use_transport)
        self._parts = {}                         # site -> workers of its GPU-posted decode job
        self._bounce = None                      # page-locked buffers for the host jobs of a GPU model

    @classmethod
    def packed(cls, store, segments, owner=None, kept=None):
        """An engine step's adapters: rows [row0, row1) of the packed forward use `adapter`; kept:
        [(row0, row1, adapter)] over the rows the LM head computes (the forward's logits_to_keep:
        one per sampling request), None where it sees every row."""
        return cls(store, [a for _, _, a in segments], owner, segments=list(segments),
                   kept=None if kept is None else list(kept))

    def use_transport(self, transport):
        """Decode deltas through `transport` (a CudaTransport mapping the store's staging)."""
        if self.segments is None and len(self.adapters) <= self.store.x.shape[0]:   # one staging row per request
            transport.lora_rows([-1 if a is None else a.slot for a in self.adapters])
            self.transport = transport

    def _users(self, site, rows):
        """[(row0, row1, adapter)] of x's `rows` rows whose adapter adapts `site`."""
        if self.segments is not None:
            segs = self.segments
            if rows != (segs[-1][1] if segs else 0):  # the LM head over the kept rows alone
                if self.kept is None or rows != self.kept[-1][1]:
                    raise RuntimeError(f"{site}: {rows} rows, none of the step's row layouts")
                segs = self.kept
            return [(r0, r1, a) for r0, r1, a in segs if a is not None and site in a.entries]
        T = rows // len(self.adapters)
        return [(b * T, (b + 1) * T, a) for b, a in enumerate(self.adapters) if a is not None and site in a.entries]

    def apply(self, site, x, base):
        """x [..., in] (rows as the batch orders them) -> base() + LoRA deltas. A piece of one row
        (a decode token) of a GPU model goes to the CPU workers; a longer one (a prompt), and on a
        CPU model any, runs on the model's device where its adapter has a device copy, else on the
        workers too."""
        din = x.shape[-1]
        x2 = x.reshape(-1, din)                  # [rows, in]
        users = self._users(site, x2.shape[0])
        if not users:
            return base()
        if self.segments is None and x2.shape[0] == len(self.adapters) and self.transport is not None \
                and _decoding():
            return self._apply_posted(site, x2.view(len(self.adapters), 1, din), base,
                                      [(b, a) for b, a in enumerate(self.adapters) if a is not None and site in a.entries])
        # a CPU model's rows all run here (its copy is the workers' own memory): a decode token's job on the
        # workers shares their cores anyway and costs a round trip per site (rank 16 on q, k, v, o, one
        # request decoding: 60-88 -> 49 ms an engine step on 2 cores)
        here, on_device, on_cpu = x2.device.type == "cpu", [], []
        for u in users:
            (on_device if u[2].device is not None and (here or u[1] - u[0] > 1) else on_cpu).append(u)
        chunks = self._chunks(on_cpu, self.store.x.shape[0])
        pending = self._submit(site, x2, chunks[0]) if chunks else None
        out = base()                              # the base projection runs while the workers work
        out2 = out.view(-1, out.shape[-1])        # a fresh tensor: deltas are added in place
        if pending is not None:
            self._collect(pending, out2)
            for chunk in chunks[1:]:
                self._collect(self._submit(site, x2, chunk), out2)
        spans = {}                                # adapter -> its pieces: one product for all of them
        for r0, r1, a in on_device:
            spans.setdefault(id(a), (a, []))[1].append((r0, r1))
        for a, pieces in spans.values():          # on the model's device
            A, BT = a.device[site]
            s = a.entries[site][2]
            # several pieces: e.g. a CPU model's decode tokens under one adapter (8: 110 -> 104 ms a SmolLM2 step)
            rows = slice(*pieces[0]) if len(pieces) == 1 else \
                torch.cat([torch.arange(r0, r1) for r0, r1 in pieces]).to(x2.device)
            _add(out2, rows, ((x2[rows].float() @ A.T) * s) @ BT)
        return out

    def _apply_posted(self, site, x2, base, users):
        """A decode step's deltas, posted by the GPU (see the module doc): x2 [B, 1, in]."""
        B, _, din = x2.shape
        dout = self.store.site_dims[site][1]
        parts = self._parts.get(site)
        if parts is None:                         # as plan_units sizes a job, without cutting pieces
            work = sum(a.entries[site][3] * (din + dout) for _, a in users)
            parts = self._parts[site] = max(1, min(self.store.pool.n, work // MIN_WORK_POSTED, dout // 64))
        job = self.transport.lora_begin(site, x2.reshape(B, din).contiguous(), dout, parts)
        out = base().contiguous()                 # on the stream while the workers work
        self.transport.lora_end(job, out.view(B, dout))
        return out

    # ---- CPU workers
    @staticmethod
    def _chunks(users, rows):
        """[(row0, row1, adapter)] pieces cut and packed into chunks of at most `rows` staging rows."""
        chunks, cur, n = [], [], 0
        for r0, r1, a in users:
            for t0 in range(r0, r1, rows):
                t1 = min(r1, t0 + rows)
                if n + t1 - t0 > rows:
                    chunks.append(cur)
                    cur, n = [], 0
                cur.append((t0, t1, a))
                n += t1 - t0
        if cur:
            chunks.append(cur)
        return chunks

    def _submit(self, site, x2, chunk):
        st, pool = self.store, self.store.pool
        pool.drain()                             # a job still in flight may read the staging area
        din, dout = st.site_dims[site]
        self._stage_rows(x2, chunk, din)
        pieces, row = [], 0
        for t0, t1, a in chunk:
            _, _, s, r = a.entries[site]
            pieces.append((a.slot, site, row, row + t1 - t0, s, r))
            row += t1 - t0
        key = (site, tuple(pieces))
        plan = self._plans.get(key)
        if plan is None:
            nactive, per = plan_units(pieces, din, dout, pool.n)
            counts = np.array([len(u) for u in per] + [0] * (pool.n - nactive), np.int64)
            if counts.max() > st.views["units"].shape[1]:
                raise RuntimeError(f"LoRA plan gives a worker {counts.max()} units "
                                   f"(at most {st.views['units'].shape[1]})")
            units = np.zeros((nactive, max(counts), 6), np.int64)
            scale = np.zeros((nactive, max(counts)), np.float64)
            for w, us in enumerate(per):
                for k, (slot, site_, r0, r1, c0, c1, s) in enumerate(us):
                    units[w, k] = (slot, site_, r0, r1, c0, c1)
                    scale[w, k] = s
            plan = self._plans[key] = (nactive, counts, units, scale)
        nactive, counts, units, scale = plan
        v = st.views
        v["hdr"][0], v["hdr"][1] = row, din
        v["counts"][:] = counts
        v["units"][:nactive, :units.shape[1]] = units
        v["scale"][:nactive, :scale.shape[1]] = scale
        seq = pool.submit(C.CMD_LORA, nactive)
        return seq, nactive, chunk, dout

    def _collect(self, pending, out2):
        seq, nactive, chunk, dout = pending
        self.store.pool.wait(seq, nactive)
        n = sum(t1 - t0 for t0, t1, _ in chunk)
        delta = self.store.delta[:n, :dout]
        if out2.is_cuda:              # one asynchronous copy through a page-locked buffer: the next
            buf = self._bounce.get("delta", delta.shape)   # job's _stage_rows waits for it before
            buf.copy_(delta)                               # this buffer is written again
            delta = buf.to(out2.device, non_blocking=True)
        row = 0
        for t0, t1, _ in chunk:
            _add(out2, slice(t0, t1), delta[row:row + t1 - t0])
            row += t1 - t0

    def _stage_rows(self, x2, chunk, din):
        """The chunk's rows of x2 [rows, in] into the staging's x (f32), in chunk order. From a GPU:
        one gather and one copy through a page-locked buffer, one wait (the workers read them
        next), not a synchronous copy per piece."""
        x = self.store.x
        if not x2.is_cuda:
            row = 0
            for t0, t1, _ in chunk:
                x[row:row + t1 - t0, :din].copy_(x2[t0:t1])
                row += t1 - t0
            return
        rows = torch.cat([x2[t0:t1] for t0, t1, _ in chunk]).float()    # [n, in] on the device
        self._bounce = self._bounce or Bounce(x2.device)
        buf = self._bounce.get("x", rows.shape)
        buf.copy_(rows, non_blocking=True)
        torch.cuda.current_stream(x2.device).synchronize()
        x[:rows.shape[0], :din].copy_(buf)


def _decoding():
    """A decode step of the active session (hetero.attention): a forward begun after the prefill
    (not the prefill's own last layer), not a prefetched one. Only there may the GPU post LoRA jobs:
    a prefill's or prefetched forward's host may post jobs of its own (hetero.offload.pinning),
    whose numbers would overtake the GPU's."""
    s = active_session.get()
    return s is not None and s.stepping and s.prefetcher is None


def _add(out, rows, delta):
    """out[rows] += delta (f32; rows a slice or an index tensor), in out's dtype and on its device,
    as peft adds its fp32 adapters."""
    delta = delta.to(out.device)
    if out.dtype != torch.float32:
        out[rows] = (out[rows].float() + delta).to(out.dtype)
    elif isinstance(rows, slice):
        out[rows].add_(delta)
    else:
        out.index_add_(0, rows, delta)


class LoraHooks:
    """Instance-level forward hooks on the adapted modules of `model`."""

    def __init__(self, model):
        self.model = model
        self.hooked = {}        # path -> (module, the forward attribute it had, ours)
        self.routed = {}        # id(peft LoRA layer) -> the same, for the layers route_peft_layers took

    def _batch(self):
        """The active LoraBatch if it is this generator's, else None."""
        batch = active_batch.get()
        return batch if batch is not None and batch.owner is self else None

    def ensure(self, path, site):
        if path in self.hooked:
            return
        mod = self.model.get_submodule(path)
        if id(mod) in self.routed:               # a peft layer routed to its base layer: now served here
            _restore(*self.routed.pop(id(mod)))
        own = mod.__dict__.get("forward")         # an instance's own forward (another wrapper's), else the
        # class's, looked up at each call: hetero.cpu_linear swaps an nn.Linear's class while it runs
        original = own if own is not None else (lambda *a, **k: type(mod).forward(mod, *a, **k))
        base = mod.base_layer if hasattr(mod, "base_layer") else original   # peft layer: skip its own LoRA

        def forward(x, *args, **kwargs):
            batch = self._batch()
            if batch is None:
                return original(x, *args, **kwargs)
            return batch.apply(site, x, lambda: base(x, *args, **kwargs))

        # an instance attribute already there (accelerate's device hooks put one) is kept to restore
        self.hooked[path] = (mod, mod.__dict__.get("forward"), forward)
        mod.forward = forward

    def route_peft_layers(self):
        """Inside a call with a LoraBatch, every peft LoRA layer of the model that serves no site
        here (an adapter added to the PeftModel after the generator was built, or a peft layer
        wrapping a module hooked here) runs its base layer alone: each request gets the adapter
        its adapter_names entry names and no other (peft's own forward would add its active
        adapters). Outside a call peft's forward runs. Checked at every call (layers come and go)."""
        layers = {id(m): m for m in peft_layers(self.model, lora_only=True)}
        for key in [k for k in self.routed if k not in layers]:      # gone from the model: let them go
            _restore(*self.routed.pop(key))
        ours = {id(entry[0]) for entry in self.hooked.values()}
        for key, mod in layers.items():
            if key in ours or key in self.routed:
                continue
            forward = _base_only(mod.forward, mod.base_layer, self)
            self.routed[key] = (mod, mod.__dict__.get("forward"), forward)
            mod.forward = forward

    def remove(self):
        """Restore each module's forward as it was before ensure() / route_peft_layers(): the
        class's, or the instance attribute another library had set (e.g. accelerate's dispatch hooks)."""
        for entry in list(self.hooked.values()) + list(self.routed.values()):
            _restore(*entry)
        self.hooked.clear()
        self.routed.clear()


def peft_layers(model, lora_only=False):
    """peft's tuner layers in `model` (its LoRA layers alone: lora_only); none while peft was
    never imported. isinstance, not hasattr: a missing attribute of an nn.Module is slow to find
    (~4 ms per 1000 modules), and this runs at every call."""
    if "peft" not in sys.modules:
        return []
    from peft.tuners.lora import LoraLayer
    from peft.tuners.tuners_utils import BaseTunerLayer

    kind = LoraLayer if lora_only else BaseTunerLayer
    found, stack, seen = [], [model], set()       # model.modules() without its generators: half the time
    while stack:
        m = stack.pop()
        if id(m) not in seen:
            seen.add(id(m))
            if isinstance(m, kind):
                found.append(m)
            stack.extend(c for c in m._modules.values() if c is not None)
    return found


def _base_only(original, base, hooks):
    """A peft layer's forward inside a call of `hooks`' generator: its base layer alone (route_peft_layers)."""
    def forward(x, *args, **kwargs):
        if hooks._batch() is None:
            return original(x, *args, **kwargs)
        return base(x, *args, **kwargs)
    return forward


_RELEASED = weakref.WeakKeyDictionary()   # a wrapper removed while another sat on top of it -> what it wrapped


def _restore(mod, previous, ours):
    """Put back the forward attribute `mod` had before `ours` (none: the class's). Where another
    wrapper was put on top since (a second generator over the model), ours stays in its chain,
    released (_RELEASED: not an attribute, which functools.wraps would copy onto a wrapper of
    it), and is skipped when that one is removed."""
    if mod.__dict__.get("forward") is not ours:
        _RELEASED[ours] = previous
        return
    while previous is not None and previous in _RELEASED:
        previous = _RELEASED[previous]
    if previous is None:
        del mod.forward
    else:
        mod.forward = previous


def max_linear_dims(model):
    """Largest in/out features over the model's linear layers but the LM head (sizes the staging buffers)."""
    din = dout = 1
    head = model.get_output_embeddings()
    for m in model.modules():
        if isinstance(m, torch.nn.Linear) and m is not head and getattr(head, "base_layer", None) is not m:
            din, dout = max(din, m.in_features), max(dout, m.out_features)
    return din, dout

