"""Layer-wise KV prefetch: a forward that continues a context attends on the model's device.

A context's KV lives in the CPU arena. To prefill many new tokens over it (a long follow-up, a
long document appended to a conversation), each layer's cached rows are copied to the model's
device just before the layer needs them, into one of two rotating buffers, and attention runs
there as in a plain prefill; the layer's new rows go back to the arena. The schedule, for the
layers 0..n-1 of one forward (`plan`):

    fetch 0 -> buffer 0, fetch 1 -> buffer 1                    (copy stream)
    layer i:  wait copied[i % 2]            the compute stream waits for buffer i % 2's fetch
              attend i in buffer i % 2      cached rows + the layer's new rows, causal
              release buffer i % 2          used[i % 2] recorded on the compute stream
              fetch i + 2 -> buffer i % 2   on the copy stream, after used[i % 2]
              offload i                     the layer's new rows, as whole blocks, into the arena
                                            (DMAs on the offload stream)
    after layer n-1: one wait, for the last offload (then the session counts the new rows)

One event per buffer for "copied" and one for "used", one per layer for "offloaded". On a CUDA
model the copies are asynchronous DMAs to and from the page-locked arena (the compute stream
waits through events; the host waits only for layer i - 2's offload, which bounds GPU memory).
On a CPU model every op runs in order in the calling thread: the same schedule, and what the
tests check on every machine.
"""
import contextlib

import torch
import torch.nn.functional as F

from hetero.attention import eager_attention
from hetero.cpu_attention.simd import BK


def device_attention(query, k, v, first, L, window, scale, softcap=None, sinks=None):
    """query [B, Hq, T, D] at positions L..L+T-1 over k/v [B, Hkv, n, D] holding positions first..
    first+n-1 (cached rows, then the T new ones) -> [B, T, Hq, D], causal, with an optional
    sliding window, logit soft-cap and attention sinks (as transformers' sdpa and eager paths)."""
    T, n = query.shape[2], k.shape[2]
    pos = L + torch.arange(T, device=query.device)[:, None]          # [T, 1] positions of the queries
    j = first + torch.arange(n, device=query.device)[None, :]        # [1, n] positions of the rows
    keep = j <= pos
    if window:
        keep &= j > pos - window
    if softcap or sinks is not None:
        out, _ = eager_attention(None, query, k, v, keep[None, None], scale, softcap, sinks)
        return out
    out = F.scaled_dot_product_attention(query, k, v, attn_mask=keep[None, None], scale=scale,
                                         enable_gqa=k.shape[1] != query.shape[1])
    return out.transpose(1, 2)


def plan(layers):
    """The schedule's ops for one forward over `layers` layers, in issue order:
    ("fetch", layer, buffer), ("wait", layer, buffer), ("attend", layer, buffer),
    ("release", layer, buffer), ("offload", layer, None), then ("write", None, None)."""
    ops = [("fetch", i, i % 2) for i in range(min(2, layers))]
    for i in range(layers):
        b = i % 2
        ops += [("wait", i, b), ("attend", i, b), ("release", i, b)]
        if i + 2 < layers:
            ops.append(("fetch", i + 2, b))
        ops.append(("offload", i, None))
    return ops + [("write", None, None)]


class _Streams:
    """CUDA streams and events on the model's device for the schedule; on a CPU device, nothing
    (every op runs in order)."""

    def __init__(self, device):
        self.cuda, self.device = device.type == "cuda", device
        if self.cuda:
            self.copy = torch.cuda.Stream(device)

    def event(self):
        return torch.cuda.Event() if self.cuda else None

    def on(self, stream):
        return torch.cuda.stream(stream) if self.cuda else contextlib.nullcontext()

    def on_device(self):
        """The model's device current (events and streams default to it, whatever the caller's)."""
        return torch.cuda.device(self.device) if self.cuda else contextlib.nullcontext()

    def compute(self):
        return torch.cuda.current_stream(self.device)

    def record(self, event, stream=None):
        if self.cuda:
            event.record(stream if stream is not None else self.compute())

    def wait(self, event, stream=None):
        if self.cuda:
            (stream if stream is not None else self.compute()).wait_event(event)


class LayerPrefetcher:
    """Runs `plan` for the forwards of one continuation of a batch-1 session (KVSession). The
    session hands it each layer's new rows (stage) and its attention call (attend); the last
    layer's call writes every layer's new rows into the arena (finish, then the session counts
    them). `log` records the ops as they are issued (the tests compare it with plan())."""

    def __init__(self, session, device):
        if session.batch != 1:
            raise ValueError("layer-wise prefetch continues one context (batch 1)")
        self.s, self.device = session, device
        self.streams = _Streams(device)
        self.log = []
        K, V = session.kv[0]                          # [B, Hkv, nblk, Dp, BK], [B, Hkv, nblk, Dp/W, BK, W]
        nblk = max(k.shape[2] for k, _ in session.kv)
        # two rotating device buffers of a layer's blocks, in the arena's blocked layout
        self.bufs = [(torch.empty((K.shape[1], nblk) + tuple(K.shape[3:]), dtype=K.dtype, device=device),
                      torch.empty((V.shape[1], nblk) + tuple(V.shape[3:]), dtype=V.dtype, device=device))
                     for _ in range(2)]
        self.copied = [self.streams.event(), self.streams.event()]
        self.used = [self.streams.event(), self.streams.event()]
        self.spans = [None, None]                      # per buffer: (first row, rows) it holds
        self.new = None                                # this layer's new rows (stage)

    def close(self):
        """Wait for this prefetcher's copies (its buffers are freed after). Idempotent."""
        if self.streams.cuda:
            torch.cuda.synchronize(self.device)

    # ---- the schedule's ops
    def _fetch(self, layer, buf):
        """Copy layer's cached rows (those its window can still see) into buffer `buf`."""
        self.log.append(("fetch", layer, buf))
        s = self.s
        L, window = int(s.lengths[0]), s.ring_window[layer]
        first = max(0, L - window + 1) // BK * BK if window else 0    # whole blocks, as the arena keeps them
        self.spans[buf] = (first, L - first)
        if L == first:
            return
        if self.streams.cuda:
            with self.streams.on_device():
                s.pin_layer(layer)                                      # the fetch becomes async DMAs
        ids = s._block_ids(layer, first, L - first)                     # stored block of each logical block
        Kb, Vb = s.kv[layer][0][0], s.kv[layer][1][0]                  # request 0: [Hkv, nblk, ...]
        kd, vd = self.bufs[buf]
        copy = self.streams.copy if self.streams.cuda else None
        self.streams.wait(self.used[buf], copy)                         # layer - 2 has read this buffer
        with self.streams.on(copy):
            i = 0
            for start, n in _runs(ids, Kb.shape[1]):                    # a ring wraps at most once
                for h in range(Kb.shape[0]):                            # per head: contiguous on both sides
                    kd[h, i:i + n].copy_(Kb[h, start:start + n], non_blocking=True)
                    vd[h, i:i + n].copy_(Vb[h, start:start + n], non_blocking=True)
                i += n
            self.streams.record(self.copied[buf], copy)

    def start(self):
        """Before a forward: the first two fetches (the copy stream first waits for the compute
        stream, which allocated the buffers and may still read them from the last forward)."""
        if self.streams.cuda:
            self.streams.copy.wait_stream(self.streams.compute())
        for op, layer, buf in plan(self.s.spec.layers):
            if op != "fetch":
                break
            self._fetch(layer, buf)

    def stage(self, key, value):
        """key/value [1, Hkv, T, D]: the layer's new rows (HeteroLayer.update)."""
        self.new = (key, value)

    def attend(self, layer, query, window, scale, softcap, sinks):
        """query [1, Hq, T, D] -> [1, T, Hq, D]: attention over the layer's prefetched rows and its new
        rows, on the model's device; then the buffer goes to layer + 2 and the new rows to the host."""
        with self.streams.on_device():
            return self._attend(layer, query, window, scale, softcap, sinks)

    def _attend(self, layer, query, window, scale, softcap, sinks):
        s, buf = self.s, layer % 2
        self.log.append(("wait", layer, buf))
        self.streams.wait(self.copied[buf])
        self.log.append(("attend", layer, buf))
        first, n = self.spans[buf]
        kd, vd = self.bufs[buf]
        nb = -(-n // BK)
        k_old, v_old = s.unblock(kd[:, :nb], vd[:, :nb], 0, n)             # [Hkv, n, D] each
        key, value = self.new
        k = torch.cat([k_old[None].to(key.dtype), key], 2)                # [1, Hkv, n + T, D]
        v = torch.cat([v_old[None].to(value.dtype), value], 2)
        out = device_attention(query, k, v, first, int(s.lengths[0]), window, scale, softcap, sinks)
        self.log.append(("release", layer, buf))
        self.streams.record(self.used[buf])
        if layer + 2 < s.spec.layers:
            self._fetch(layer + 2, buf)
        self._offload(layer, k, v, first)
        self.new = None
        return out

    def _offload(self, layer, k, v, first):
        """The layer's new rows to the arena: k/v [1, Hkv, n + T, D] hold the cached rows from
        `first`, then the new ones; rows from the start of the block holding row L are built into
        whole blocks on the device and written into the arena (write_rows; the session counts them
        after the last layer). On a GPU these are DMAs into the page-locked arena on the session's
        offload stream, as a prefill's (KVSession.offloading: the host waits for layer - 2's only;
        a strided host-side write ran at 45 MB/s on an H100 host)."""
        self.log.append(("offload", layer, None))
        s = self.s
        L = int(s.lengths[0])
        start = max(L // BK * BK, int(s.pstart[0]))              # >= first: first is a block start <= L
        with s.offloading(layer, k, v):
            # rows start..L+T-1: [Hkv, L - start + T, D]
            s.write_rows(layer, 0, k[0, :, start - first:], v[0, :, start - first:], start, whole_blocks=True)

    def finish(self):
        """After the last layer: every layer's new rows are in the arena (on a GPU, one wait for the
        offload stream). The session then counts them (KVSession.advance)."""
        self.log.append(("write", None, None))
        self.s.wait_offloads()


def _runs(ids, nphys):
    """Stored block ids of consecutive logical blocks -> [(first stored block, count)]: one run,
    or two when a ring wraps."""
    first = ids[0]
    n = min(len(ids), nphys - first)
    return [(first, n)] + ([(0, len(ids) - n)] if n < len(ids) else [])
