"""How a decode layer's attention reaches the CPU workers and comes back: the transport seam.

  CpuTransport   the host copies q and the new k/v into the session's staging area, publishes
                 the job (WorkerPool), takes units itself, waits, and merges the partials (torch).
                 Every CPU model.
  PinnedTransport  a CUDA model's fallback where the extension cannot be used (no nvcc, an old
                 driver, transport="host"): the same, with q/k/v copied in through page-locked
                 buffers with asynchronous DMAs and one event wait per layer (the workers need
                 them before the job is posted; the host copies had three), and the output copied
                 back asynchronously (no wait; the host copies had one).
  CudaTransport  (hetero.ipc.cuda_transport) one call enqueues on the model's stream the GPU's
                 copy-out + signal, the wait for the workers and the merge: the host never
                 synchronizes per layer.
All three publish the same words in the same order (hetero/cuda/protocol.h is the GPU's side;
a host build of it runs against real workers in the tests on every machine).
"""
import numpy as np
import torch

from hetero.ipc import control as C


class CpuTransport:
    name = "cpu"
    parent_takes_units = True      # the parent takes units beside the workers (the planner counts it)

    def stage(self, s, key, value):
        """key/value [B, Hkv, T, D] (any device): the step's new rows, into the staging area."""
        T, D = key.shape[2], key.shape[3]
        s.pool.drain()                               # no job may still read the staging area
        s.knew[:, :, :T, :D].copy_(key)              # columns D..Dp-1 stay zero
        s.vnew[:, :, :T, :D].copy_(value)

    def attention(self, s, job, query, sinks):
        """One layer's job (params in `job`) for query [B, Hq, T, D] -> [B, T, Hq, D] on query's device."""
        T, D = query.shape[2], query.shape[3]
        s.pool.drain()                               # no job may still read what is written next
        s.q[:, :, :T, :D].copy_(query)               # columns D..Dp-1 stay zero
        return self._run(s, job, query.shape, sinks).to(query.device, query.dtype)

    @staticmethod
    def _run(s, job, shape, sinks):
        """Post the job whose q/k/v are staged, take units, wait, merge: [B, T, Hq, D] f32 (CPU)."""
        B, Hq, T, D = shape
        Hkv = s.spec.kv_heads
        w, f = s.pool.words, s.pool.floats
        w[C.LAYER], w[C.QLEN], w[C.WINDOW], w[C.NSPLIT] = job.layer, T, job.window, job.nsplit
        w[C.PSPLIT] = job.psplit
        f[C.F_SCALE], f[C.F_SOFTCAP] = job.scale, job.softcap
        s.run_attention(job.workers, job.units)
        rows = (Hq // Hkv) * T
        ns = job.psplit + job.nsplit                 # a shared prefix's partials, then the requests' own
        sink = None if sinks is None else s.sink_rows(job.layer, sinks, T)
        out = merge_partials(s.part_o[:, :, :ns, :rows, :D], s.part_m[:, :, :ns, :rows],
                             s.part_l[:, :, :ns, :rows], sink)     # [B, Hkv, G*T, D]
        out = out.view(B, Hkv, Hq // Hkv, T, D).reshape(B, Hq, T, D)      # q head = h*G + g
        return out.transpose(1, 2)

    def step_done(self, s, T):
        """The step's last layer was called: its T new rows are in the cache."""
        s.advance(T)

    def settle(self, s):
        """Before a step's first write: nothing is pending on the CPU."""

    def close(self):
        pass


class Bounce:
    """Page-locked host buffers for copies to and from a GPU, kept by name and grown on demand
    (plain memory for a CPU device: the same code path in the tests). The caller orders reuse: a
    buffer is written again only after the stream ran the copies that read it."""

    def __init__(self, device):
        self.pinned, self._bufs = torch.device(device).type == "cuda", {}

    def get(self, name, shape, dtype=torch.float32):
        n = int(np.prod(shape))
        buf = self._bufs.get(name)
        if buf is None or buf.numel() < n or buf.dtype != dtype:
            buf = self._bufs[name] = torch.empty(n, dtype=dtype, pin_memory=self.pinned)
        return buf[:n].view(shape)


class PinnedTransport(CpuTransport):
    """See the module doc. Page-locked bounce buffers (torch's pinned host memory, no nvcc): q/k/v
    in [B, H, T, D] come over in asynchronous DMAs and one event wait, the host copies them into
    the staging area, and the merged output goes back through another, asynchronously (the next
    layer refills a buffer only after its own wait, which the stream orders after the copies
    that read it). On a CPU device (the tests) the same flow, with plain copies."""
    name = "host"

    def __init__(self, device):
        self.device, self._kv, self.bounce = device, None, Bounce(device)

    def stage(self, s, key, value):
        self._kv = (key, value)                      # copied with q, at the layer's attention call

    def attention(self, s, job, query, sinks):
        """query [B, Hq, T, D] -> [B, T, Hq, D] on query's device."""
        T, D = query.shape[2], query.shape[3]
        key, value = self._kv
        self._kv = None
        ins = [self.bounce.get(n, t.shape, dt) for n, t, dt in (("q", query, torch.float32),
                                                                 ("k", key, s.spec.dtype), ("v", value, s.spec.dtype))]
        for buf, t in zip(ins, (query, key, value)):
            buf.copy_(t.to(buf.dtype), non_blocking=True)
        if query.is_cuda:                            # the one wait per layer: the workers read them next
            torch.cuda.current_stream(query.device).synchronize()
        s.pool.drain()                               # no job may still read the staging area
        for dst, buf in zip((s.q, s.knew, s.vnew), ins):
            dst[:, :, :T, :D].copy_(buf)             # columns D..Dp-1 stay zero
        out = self._run(s, job, query.shape, sinks)  # [B, T, Hq, D] f32, merged on the CPU
        back = self.bounce.get("out", out.shape)
        back.copy_(out)
        return back.to(query.device, non_blocking=True).to(query.dtype)


def merge_partials(o, m, l, sink=None):
    """Exact combination of split partials: o [B, Hkv, ns, rows, D], m/l [B, Hkv, ns, rows]
    -> [B, Hkv, rows, D] (see hetero.cpu_attention.kernel).
    sink: None, or a logit per row (broadcasting to [B, Hkv, rows]) that joins the softmax's
    denominator but adds no value (gpt_oss's s_aux, unscaled and not soft-capped):
        out = sum_s e^(m_s - M) o_s / (sum_s e^(m_s - M) l_s + e^(sink - M)),  M = max(max_s m_s, sink).
    hetero/cuda/protocol.h computes the same on the GPU."""
    if sink is None:
        if o.shape[2] == 1:
            return o[:, :, 0] / l[:, :, 0, :, None]
        M = m.amax(2, keepdim=True)                          # [B, Hkv, 1, rows]
    else:
        M = torch.maximum(m.amax(2), sink).unsqueeze(2)      # [B, Hkv, 1, rows]
    wgt = torch.exp(m - M)                                   # [B, Hkv, ns, rows]
    den = (wgt * l).sum(2)                                   # [B, Hkv, rows]
    if sink is not None:
        den = den + torch.exp(sink - M[:, :, 0])
    return (wgt[..., None] * o).sum(2) / den[..., None]
