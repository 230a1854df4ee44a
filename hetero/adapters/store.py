"""LoRA adapters in host shared memory, mapped by every CPU worker, with device copies made in
the background.

Each adapter is one shared segment (layout.py) created and unlinked by the parent alone: load
maps it in the workers (CMD_ADAPTER_MAP), unload unmaps it there (CMD_ADAPTER_DROP) and
unlinks it, so the memory held is exactly the adapters loaded. A site is one adapted linear
module (by path); the site table only grows (a hook on a module no adapter uses costs nothing).

Device copies (for prefill on the model's device) are made by one background thread (on a
CPU model the "copy" is a torch view of the shared segment: nothing is duplicated). Until an
adapter's copy is ready its prefill deltas run on the CPU workers from shared memory (no cold
start); `Adapter.device` is None until then and is published once, complete.
"""
import contextlib
import queue
import threading
from dataclasses import dataclass, field

import numpy as np
import torch

from hetero.adapters import layout
from hetero.adapters.source import check_name
from hetero.errors import AdapterError
from hetero.ipc import control as C, shm


@dataclass
class Adapter:
    name: str
    slot: int
    seg: object                      # its shared segment (parent: owner)
    entries: dict                    # site -> (A [r, in] f32 numpy view, BT [r, out] view, scaling, r)
    device: dict | None = None       # site -> (A, BT) torch tensors on the model's device, once copied
    ready: threading.Event = field(default_factory=threading.Event)


class AdapterStore:
    def __init__(self, model_device, max_in, max_out):
        self.device = torch.device(model_device)
        self.max_in, self.max_out = max_in, max_out
        self.decoder_dims = (max_in, max_out)   # the staging's width without an LM-head adapter (_fit_staging)
        self.adapters = {}           # name -> Adapter
        self.sites = {}              # module path -> site id
        self.site_dims = []          # site id -> (in, out)
        self._slots = iter(range(1, 1 << 62))
        self.pool, self.staging, self.views = None, None, None
        # while a CUDA transport has page-locked and mapped the staging (once, kept across calls):
        # (its host address, its device address, the function that releases the lock)
        self.device_map = None
        self.copy_gate = threading.Event()   # cleared: device copies wait (tests, cold-start benchmarks)
        self.copy_gate.set()
        self._copies = queue.Queue()
        self._copier = threading.Thread(target=self._copy_loop, name="hetero-adapter-copy", daemon=True)
        self._copier.start()

    # ---- workers
    def attach(self, pool):
        """Map the staging segment and every adapter in `pool`'s workers (a new or restarted pool)."""
        if self.staging is None or self.views["counts"].shape[0] != pool.n:   # staging is per worker count
            self._new_staging(pool.n)
        self.pool = pool
        self._open_staging()
        for a in self.adapters.values():
            self._map(a)

    def _open_staging(self):
        """Map the staging segment in the pool's workers (their previous one is unmapped)."""
        w = self.pool.words
        w[C.ARG0], w[C.ARG1] = self.max_in, self.max_out
        C.write_name(w, self.staging.name)
        self.pool.run(C.CMD_LORA_OPEN)

    def _unmap_device(self):
        mapped, self.device_map = self.device_map, None
        if mapped is not None:
            mapped[2]()

    @torch.inference_mode(False)    # kept across calls, also ones outside inference mode
    def _new_staging(self, nworkers):
        if self.staging is not None:
            self._unmap_device()                 # before the unmap
            self.views = None
            self.staging.close()
        packed = layout.staging(nworkers, self.max_in, self.max_out)
        self.staging = shm.Segment(shm.new_name("lora"), packed[1], create=True)
        self.views = shm.views(self.staging, packed)
        self.x = torch.from_numpy(self.views["x"])          # [rows, max_in] f32 (layout.staging_rows)
        self.delta = torch.from_numpy(self.views["delta"])  # [rows, max_out] f32

    def _map(self, a):
        w = self.pool.words
        w[C.ARG0] = a.slot
        C.write_name(w, a.seg.name)
        self.pool.run(C.CMD_ADAPTER_MAP)

    # ---- load / unload
    def add(self, name, weights):
        """weights: {module path: (A [r, in], B [out, r], scaling)} (validated by source.py)."""
        check_name(name, self.adapters)
        new_sites = [p for p in weights if p not in self.sites]
        self._fit_staging([(A.shape[1], B.shape[0]) for A, B, _ in weights.values()], grow_only=True)
        site_of = dict(self.sites)
        for k, p in enumerate(new_sites):
            site_of[p] = len(self.site_dims) + k
        entries = [(site_of[p], A.shape[1], B.shape[0], A.shape[0]) for p, (A, B, _) in weights.items()]
        offs, total = layout.adapter_offsets(entries)
        seg = shm.Segment(shm.new_name("ad"), total, create=True)
        a = None
        try:
            seg.array(0, (1,), np.int64)[0] = len(entries)
            hdr = seg.array(64, (len(entries), layout.HEADER_WORDS), np.int64)
            views = {}
            for k, ((site, i, o, r), (oa, ob), (A, B, s)) in enumerate(zip(entries, offs, weights.values())):
                hdr[k] = (site, i, o, r, oa, ob, np.float64(s).view(np.int64), 0)
                va, vb = seg.array(oa, (r, i), np.float32), seg.array(ob, (r, o), np.float32)
                va[:] = A.numpy()
                vb[:] = B.numpy().T
                views[site] = (va, vb, float(s), r)
            a = Adapter(name, next(self._slots), seg, views)
            if self.pool is not None:
                self._map(a)
        except BaseException:
            if a is not None and self.pool is not None and self.pool.alive:
                self._drop(a)
            seg.close()
            raise
        for p in new_sites:
            self.sites[p] = site_of[p]
            self.site_dims.append((weights[p][0].shape[1], weights[p][1].shape[0]))
        self.adapters[name] = a
        self._copies.put(a)
        return a

    def remove(self, name):
        a = self.adapters.pop(name, None)
        if a is None:
            raise AdapterError(f"no adapter named {name!r} is loaded (loaded: {sorted(self.adapters)})")
        if self.pool is not None and self.pool.alive:
            self._drop(a)
        a.entries, a.device = {}, None
        a.seg.close()
        self._fit_staging([(A.shape[1], BT.shape[1]) for b in self.adapters.values() for A, BT, _, _ in b.entries.values()])

    def _fit_staging(self, dims, grow_only=False):
        """Size the staging's rows for the decoder's layers and the widest of `dims` [(in, out)]: an
        adapter on the LM head (vocabulary-wide deltas) widens it, and fewer rows then fit in
        layout.STAGING_BYTES; unloading the last such adapter narrows it back. Between calls only."""
        wide = tuple(max([d] + [x[k] for x in dims]) for k, d in enumerate(self.decoder_dims))
        if grow_only:
            wide = (max(wide[0], self.max_in), max(wide[1], self.max_out))
        if wide == (self.max_in, self.max_out):
            return
        self.max_in, self.max_out = wide
        if self.staging is not None:
            self._new_staging(self.views["counts"].shape[0])
            if self.pool is not None and self.pool.alive:
                self._open_staging()

    def digest(self, a):
        """A saved context's record of adapter `a` ({"name", "sha256"}): its name and a hash of its
        weights by module path (a reload under the same name with other weights differs)."""
        import hashlib

        path_of = {site: p for p, site in self.sites.items()}
        h = hashlib.sha256()
        for site in sorted(a.entries, key=path_of.get):
            A, BT, scaling, r = a.entries[site]
            h.update(f"{path_of[site]}:{A.shape}:{BT.shape}:{scaling!r}".encode())
            h.update(np.ascontiguousarray(A).tobytes())
            h.update(np.ascontiguousarray(BT).tobytes())
        return {"name": a.name, "sha256": h.hexdigest()}

    def _drop(self, a):
        self.pool.words[C.ARG0] = a.slot
        self.pool.run(C.CMD_ADAPTER_DROP)

    @property
    def nbytes(self):
        return sum(a.seg.size for a in self.adapters.values())

    # ---- device copies
    def _copy_loop(self):
        while True:
            a = self._copies.get()
            if a is None:
                return
            self.copy_gate.wait()
            try:
                dev = {}
                side = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
                with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
                    for site, (A, BT, _, _) in list(a.entries.items()):
                        if self.device.type == "cpu":    # the shared copy is already in host memory
                            dev[site] = (torch.from_numpy(A), torch.from_numpy(BT))
                        else:
                            dev[site] = (torch.from_numpy(A).to(self.device, copy=True),
                                         torch.from_numpy(BT).to(self.device, copy=True))
                if side is not None:
                    side.synchronize()
                if self.adapters.get(a.name) is a:     # not unloaded meanwhile
                    a.device = dev
                    a.ready.set()
            except Exception:                           # the CPU path keeps serving it
                pass

    def close(self):
        for name in list(self.adapters):
            self.remove(name)
        self._copies.put(None)
        self.copy_gate.set()
        if self.staging is not None:
            self._unmap_device()
            self.views = self.x = self.delta = None
            self.staging.close()
            self.staging = None

