"""Layer-wise KV prefetch: a forward that continues a context attends on the model's device.

A context's KV lives in the CPU arena. To prefill many new tokens over it (a long follow-up, a
long document appended to a conversation, the next chunk of a chunked prefill), each layer's
cached rows are copied to the model's device just before the layer needs them, in items of at
most TILE_ROWS rows, into one of two rotating buffers; the layer attends there, and its new rows
go back to the arena. A full-attention layer's items are tiles: the new rows attend themselves
(causal) and each tile (every cached row is visible), and the pieces merge by their log-sum-exps
(merge_lse), so device memory holds two tiles whatever the context's length. A sliding-window
layer's one item is the rows its window can still see (its ring: bounded), attended with a mask.
The schedule, for the items 0..K-1 of one forward (every layer's in order; `plan`):

    fetch 0 -> buffer 0, fetch 1 -> buffer 1                    (copy stream)
    item k of layer i:
              wait copied[k % 2]            the compute stream waits for buffer k % 2's fetch
              attend k in buffer k % 2      (the layer's new rows too, at its first item)
              release buffer k % 2          used[k % 2] recorded on the compute stream
              fetch k + 2 -> buffer k % 2   on the copy stream, after used[k % 2]
    after layer i's last item:
              offload i                     the layer's new rows, as whole blocks, into the arena
                                            (DMAs on the offload stream)
    after the last layer: one wait, for the last offload (then the session counts the new rows)

One event per buffer for "copied" and one for "used", one per layer for "offloaded". On a CUDA
model the copies are asynchronous DMAs to and from the page-locked arena (the compute stream
waits through events; the host waits only for layer i - 2's offload, which bounds GPU memory).
On a CPU model every op runs in order in the calling thread: the same schedule, and what the
tests check on every machine.
"""
import contextlib
import logging
import os

import torch
import torch.nn.functional as F

from hetero.attention import eager_attention
from hetero.cpu_attention.simd import BK

log = logging.getLogger("hetero")
TILE_ROWS = 32768    # cached rows per item of a full-attention layer (a multiple of BK): 128 MiB of
#                      Llama-3-8B's bf16 K+V, so device memory stays flat in the context's length; each
#                      tile costs a merge (two passes over the chunk's f32 out): ~3 % of its attention
#                      at this size by arithmetic (3 TB/s, 600 TFLOP/s), ~11 % at 8192 (the size until
#                      the 14th session's change)


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


def attention_lse(q, k, v, scale, causal=False, softcap=None):
    """q [1, H, T, D], k/v [1, H, n, D] -> (out [1, H, T, D] in q's dtype, lse [1, H, T] f32):
    softmax attention over these rows alone and the log-sum-exp of its logits (soft-capped with
    softcap; causal: T == n, query t sees rows 0..t), the pieces that merge_lse joins. sdpa's
    kernels that return their log-sum-exp, the ones torch's own context-parallel ring attention
    merges the same way: flash (CPU), flash or cuDNN (CUDA bf16/f16: _half_kernel) or
    memory-efficient (CUDA f32); plain math (the [H, T, n] f32 logits materialized) with
    softcap, or where the kernel refuses the input (logged once)."""
    if not softcap:
        try:
            if q.device.type == "cpu":
                out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal,
                                                                                      scale=scale)
            elif q.dtype in (torch.float16, torch.bfloat16):
                out, lse = _half_kernel(q, k, v, scale, causal)
            else:
                out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal,
                                                                                  scale=scale)[:2]
            return out, lse[..., :q.shape[2]].float()        # the efficient kernel pads lse to 32 rows
        except (RuntimeError, NotImplementedError) as e:
            if str(q.device) not in _refused:
                _refused.add(str(q.device))
                log.warning("hetero: sdpa's attention kernel with log-sum-exp is unavailable on %s (%s); "
                            "prefetched tiles attend in plain math", q.device, _first_line(e))
    return attention_lse_math(q, k, v, scale, causal, softcap)


def _first_line(e):
    return (str(e).splitlines() or [type(e).__name__])[0]


def _flash(q, k, v, scale, causal):
    return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)[:2]


def _cudnn(q, k, v, scale, causal):
    out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False,
                                                                  scale=scale)[:2]
    return out, lse.reshape(out.shape[:3])                    # lse [1, H, T, 1] -> [1, H, T]


CUDNN_MIN_ROWS = 4096  # cuDNN only for a long chunk's steady shapes (see _half_kernel)
_chosen = {}           # (device, dtype, head_dim) -> "cudnn" | "flash" (cuda_kernel)


def _half_kernel(q, k, v, scale, causal):
    """attention_lse's CUDA bf16/f16 kernel: cuDNN where cuda_kernel chose it and the shape is a
    long chunk's steady one (at least CUDNN_MIN_ROWS query rows; the causal piece, or a whole
    tile of TILE_ROWS rows), flash otherwise: cuDNN builds and keeps an execution plan for every
    new shape, which a tile's odd remainder or a short continuation's pieces would keep asking for.
    A cuDNN call that raises turns it off for the device (flash from then on)."""
    key = (str(q.device), q.dtype, q.shape[-1])
    if q.shape[2] >= CUDNN_MIN_ROWS and (causal or k.shape[2] == TILE_ROWS) and \
            cuda_kernel(q.device, q.dtype, q.shape[-1]) == "cudnn":
        try:
            out, lse = _cudnn(q, k, v, scale, causal)
        except (RuntimeError, NotImplementedError) as e:
            out, why = None, _first_line(e)
        if out is not None:                      # (the check's own flash call may raise: not cuDNN's fault)
            if _spot_checked(q, k, v, scale, causal, out, lse):
                return out, lse
            why = "it disagrees with flash at this size"
        _chosen[key] = "flash"
        log.warning("hetero: cuDNN attention failed on %s at q %s, k %s (%s); prefetched tiles use flash", q.device,
                    tuple(q.shape), tuple(k.shape), why)
    return _flash(q, k, v, scale, causal)


SPOT_ROWS = 1024     # query rows of a new cuDNN shape checked against flash (_spot_checked)
_spot = set()        # (device, dtype, q shape, k shape, causal) whose cuDNN result passed


def _spot_checked(q, k, v, scale, causal, out, lse):
    """Whether cuDNN's (out, lse) for a shape not seen before agrees with flash on SPOT_ROWS query
    rows (the last ones where causal: they see nearly every key), once per shape: cuda_kernel
    compared the two at 4K x 8K rows, a long chunk runs them at 256K rows and GBs per tensor. The
    causal rows are checked as two non-causal pieces merged (keys before them, all visible; their
    own square block, causal), so no causal call has q_len != k_len (flash and cuDNN align those
    differently). One host sync per new shape."""
    key = (str(q.device), q.dtype, tuple(q.shape), tuple(k.shape), causal)
    if key in _spot:
        return True
    T, n = q.shape[2], min(SPOT_ROWS, q.shape[2])
    if causal:
        qs = q[:, :, T - n:]
        ref = _flash(qs, k[:, :, T - n:], v[:, :, T - n:], scale, True)
        if T > n:
            ref = merge_lse(_flash(qs, k[:, :, :T - n], v[:, :, :T - n], scale, False), ref)
        rows = slice(T - n, T)
    else:
        ref, rows = _flash(q[:, :, :n], k, v, scale, False), slice(0, n)
    ok = _agree((out[:, :, rows], lse[:, :, rows]), ref)
    if ok:
        _spot.add(key)
    return ok


def _agree(a, b):
    """Whether two attention_lse results (out, lse) of the same rows agree within half-precision
    rounding (a cuDNN and a flash kernel's)."""
    return torch.allclose(a[0].float(), b[0].float(), atol=2e-2, rtol=2e-2) and \
        torch.allclose(a[1].float(), b[1].float(), atol=1e-2, rtol=1e-3)


def cuda_kernel(device, dtype, head_dim):
    """"cudnn" or "flash": the CUDA kernel a long chunk's tiles attend with in bf16/f16 (see
    _half_kernel), chosen once per device, dtype and head size. cuDNN only where torch's sdpa
    itself would run it (sdp_utils.cpp check_prefer_cudnn_attention: sm90/sm100, cuDNN > 9.15.0,
    older ones erred on lengths not a multiple of 128; not turned off by
    TORCH_CUDNN_SDPA_DEPRIORITIZED or torch.backends.cuda.enable_cudnn_sdp(False)), so that a
    one-pass prefill (HF's too) runs it; where it agrees with flash on odd lengths, causal or not;
    and where it is at least 10 % faster on a tile (8 heads, 4099 query rows over 8179 rows;
    medians of 5), so the choice does not flip between runs. On the H100 the tiles ran flash
    (FlashAttention-2) at ~65 % of HF's one-pass attention rate (by arithmetic from the 512K and
    192K prefills)."""
    key = (str(device), dtype, head_dim)
    if key not in _chosen:
        try:
            ok = _cudnn_preferred(device)
        except (RuntimeError, NotImplementedError) as e:
            log.warning("hetero: cuDNN's version is unknown on %s (%s)", device, _first_line(e))
            ok = False
        _chosen[key] = _time_kernels(device, dtype, head_dim) if ok else "flash"
    return _chosen[key]


def _cudnn_preferred(device):
    """Whether torch's sdpa would pick cuDNN attention on `device` (sdp_utils.cpp)."""
    if os.environ.get("TORCH_CUDNN_SDPA_DEPRIORITIZED", "").upper() in ("1", "ON", "TRUE", "YES", "Y"):
        return False
    if not (torch.backends.cudnn.is_available() and torch.backends.cuda.cudnn_sdp_enabled()):
        return False
    if (torch.backends.cudnn.version() or 0) <= 91500:
        return False
    major, minor = torch.cuda.get_device_capability(device)
    cuda = tuple(int(x) for x in (torch.version.cuda or "0").split(".")[:1])
    return major in (9, 10) and (cuda >= (13,) or minor in (0, 3))


def _time_kernels(device, dtype, head_dim):
    """"cudnn" where it agrees with flash and beats it by 10 % (cuda_kernel), else "flash"."""
    try:
        with torch.cuda.device(device):
            g = torch.Generator(device=device).manual_seed(0)
            q, k, v = (torch.randn(1, 8, n, head_dim, generator=g, device=device, dtype=dtype)
                       for n in (4099, 8179, 8179))
            for causal, n in ((False, None), (True, 1001)):
                a, b, c = (x[:, :, :n].contiguous() for x in (q, k, v))
                if not _agree(*(f(a, b, c, head_dim ** -0.5, causal) for f in (_flash, _cudnn))):
                    log.warning("hetero: cuDNN attention disagrees with flash on %s; prefetched tiles use flash",
                                device)
                    return "flash"
            times = {"flash": [], "cudnn": []}
            for _ in range(5):                                   # alternating, after the calls above warmed both
                for name, f in (("flash", _flash), ("cudnn", _cudnn)):
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    f(q, k, v, 1.0, False)
                    end.record()
                    end.synchronize()
                    times[name].append(start.elapsed_time(end))
    except (RuntimeError, NotImplementedError) as e:
        log.warning("hetero: cuDNN attention is unavailable on %s (%s); prefetched tiles use flash", device,
                    _first_line(e))
        return "flash"
    ms = {name: sorted(t)[2] for name, t in times.items()}
    name = "cudnn" if ms["cudnn"] < 0.9 * ms["flash"] else "flash"
    tflops = {n: 4 * 8 * 4099 * 8179 * head_dim / (t * 1e9) for n, t in ms.items()}
    log.info("hetero: long prefetched chunks attend with %s on %s (TFLOP/s: %s)", name, device,
             ", ".join(f"{n} {t:.0f}" for n, t in tflops.items()))
    return name


def attention_lse_math(q, k, v, scale, causal=False, softcap=None):
    """attention_lse in plain math (the [H, T, n] f32 logits materialized)."""
    w = torch.matmul(q.float(), k.float().transpose(2, 3)) * scale          # [1, H, T, n]
    if softcap:
        w = torch.tanh(w / softcap) * softcap
    if causal:
        w = w.masked_fill(~torch.ones(w.shape[-2:], dtype=torch.bool, device=w.device).tril(), float("-inf"))
    lse = torch.logsumexp(w, -1)
    out = torch.matmul(torch.exp(w - lse[..., None]), v.float())
    return out.to(q.dtype), lse


_refused = set()       # devices whose kernel refused attention_lse's input (logged once)


def merge_lse(acc, part):
    """Two attentions of the same queries over disjoint rows, (out, lse) each -> the attention over
    their union, its out in f32: out = (e^lse_a out_a + e^lse_b out_b) / (e^lse_a + e^lse_b), i.e.
    lerp(out_a, out_b, sigmoid(lse_b - lse_a)), computed in place in acc's out once it is f32 (after
    the first merge): two passes over it and one f32 copy of part's, where a long chunk's out is GBs."""
    (oa, la), (ob, lb) = acc, part
    if oa.dtype != torch.float32:
        oa = oa.float()
    oa.lerp_(ob.float(), torch.sigmoid(lb - la)[..., None])
    return oa, torch.logaddexp(la, lb)


def plan(tiles):
    """The schedule's ops for one forward, in issue order, for layers with tiles[i] tiles each
    (items: every layer's tiles in order; item k uses buffer k % 2):
    ("fetch", layer, tile, buffer) two items ahead, ("wait" | "attend" | "release", layer, tile,
    buffer) per item, ("offload", layer, None, None) after a layer's last tile, then ("write",
    None, None, None)."""
    items = [(layer, t) for layer, n in enumerate(tiles) for t in range(n)]
    ops = [("fetch", *items[k], k % 2) for k in range(min(2, len(items)))]
    k = 0
    for layer, n in enumerate(tiles):
        for t in range(n):
            b = k % 2
            ops += [("wait", layer, t, b), ("attend", layer, t, b), ("release", layer, t, b)]
            if k + 2 < len(items):
                ops.append(("fetch", *items[k + 2], b))
            k += 1
        ops.append(("offload", layer, None, None))
    return ops + [("write", None, None, None)]


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
    them). `log` records the ops as they are issued, `planned` what plan() gave for the same
    forwards (the tests compare them)."""

    def __init__(self, session, device, tile=None):
        if session.batch != 1:
            raise ValueError("layer-wise prefetch continues one context (batch 1)")
        self.s, self.device = session, device
        self.tile = tile or TILE_ROWS
        if self.tile % BK:
            raise ValueError(f"prefetch tiles must be a multiple of {BK} rows, got {self.tile}")
        self.streams = _Streams(device)
        self.log, self.planned = [], []
        windows = session.spec.windows or (0,) * session.spec.layers
        self.whole = [w > 0 for w in windows]          # per layer: one item over the window's rows
        K, V = session.kv[0]                          # [B, Hkv, nblk, Dp, BK], [B, Hkv, nblk, Dp/W, BK, W]
        nblk = max(k.shape[2] if w else min(k.shape[2], self.tile // BK) for (k, _), w in zip(session.kv, self.whole))
        # two rotating device buffers of an item's blocks, in the arena's blocked layout
        self.bufs = [(torch.empty((K.shape[1], nblk) + tuple(K.shape[3:]), dtype=K.dtype, device=device),
                      torch.empty((V.shape[1], nblk) + tuple(V.shape[3:]), dtype=V.dtype, device=device))
                     for _ in range(2)]
        self.copied = [self.streams.event(), self.streams.event()]
        self.used = [self.streams.event(), self.streams.event()]
        self.items = []                                # this forward's (layer, tile, first row, rows)
        self.first_item, self.ntiles = [], []          # per layer: its first item's index, its item count
        self.new = None                                # this layer's new rows (stage)

    def close(self):
        """Wait for this prefetcher's copies (its buffers are freed after). Idempotent."""
        if self.streams.cuda:
            torch.cuda.synchronize(self.device)

    def _plan_items(self):
        """This forward's items: per layer, its cached rows (a window's: those it can still see,
        whole blocks as the arena keeps them) in one item, or in tiles of `tile` rows."""
        s, L = self.s, int(self.s.lengths[0])
        self.items, self.first_item, self.ntiles = [], [], []
        for layer in range(s.spec.layers):
            window = s.ring_window[layer]
            first = max(0, L - window + 1) // BK * BK if window else 0
            step = max(L - first, 1) if self.whole[layer] else self.tile
            starts = list(range(first, L, step)) or [first]          # at least one (maybe empty) item
            self.first_item.append(len(self.items))
            self.items += [(layer, t, a, min(step, L - a)) for t, a in enumerate(starts)]
            self.ntiles.append(len(starts))
        self.planned += plan(self.ntiles)

    # ---- the schedule's ops
    def _fetch(self, k, buf):
        """Copy item k's rows into buffer `buf`."""
        layer, t, first, n = self.items[k]
        self.log.append(("fetch", layer, t, buf))
        if n == 0:
            return
        s = self.s
        if self.streams.cuda:
            with self.streams.on_device():
                s.pin_layer(layer)                                      # the fetch becomes async DMAs
        ids = s._block_ids(layer, first, n)                             # stored block of each logical block
        Kb, Vb = s.kv[layer][0][0], s.kv[layer][1][0]                  # request 0: [Hkv, nblk, ...]
        kd, vd = self.bufs[buf]
        copy = self.streams.copy if self.streams.cuda else None
        self.streams.wait(self.used[buf], copy)                         # item k - 2 has read this buffer
        with self.streams.on(copy):
            i = 0
            for start, m in _runs(ids, Kb.shape[1]):                    # a ring wraps at most once
                for h in range(Kb.shape[0]):                            # per head: contiguous on both sides
                    kd[h, i:i + m].copy_(Kb[h, start:start + m], non_blocking=True)
                    vd[h, i:i + m].copy_(Vb[h, start:start + m], non_blocking=True)
                i += m
            self.streams.record(self.copied[buf], copy)

    def start(self):
        """Before a forward: plan its items and issue the first two fetches (the copy stream first
        waits for the compute stream, which allocated the buffers and may still read them from the
        last forward)."""
        if self.streams.cuda:
            self.streams.copy.wait_stream(self.streams.compute())
        self._plan_items()
        for k in range(min(2, len(self.items))):
            self._fetch(k, k % 2)

    def stage(self, key, value):
        """key/value [1, Hkv, T, D]: the layer's new rows (HeteroLayer.update)."""
        self.new = (key, value)

    def attend(self, layer, query, window, scale, softcap, sinks):
        """query [1, Hq, T, D] -> [1, T, Hq, D]: attention over the layer's prefetched rows and its new
        rows, on the model's device; each buffer goes to item k + 2 once read, and the new rows to the
        host."""
        with self.streams.on_device():
            if self.whole[layer]:
                return self._attend_whole(layer, query, window, scale, softcap, sinks)
            return self._attend_tiles(layer, query, scale, softcap, sinks)

    def _take(self, k):
        """Wait for item k's buffer; its rows [Hkv, n, D] (views of the unblocked buffer)."""
        layer, t, first, n = self.items[k]
        buf = k % 2
        self.log.append(("wait", layer, t, buf))
        self.streams.wait(self.copied[buf])
        self.log.append(("attend", layer, t, buf))
        kd, vd = self.bufs[buf]
        return self.s.unblock(kd[:, :-(-n // BK)], vd[:, :-(-n // BK)], 0, n)

    def _release(self, k):
        """Item k's buffer has been read: it goes to item k + 2."""
        layer, t, _, _ = self.items[k]
        buf = k % 2
        self.log.append(("release", layer, t, buf))
        self.streams.record(self.used[buf])
        if k + 2 < len(self.items):
            self._fetch(k + 2, buf)

    def _attend_whole(self, layer, query, window, scale, softcap, sinks):
        """A windowed layer: its one item (the rows its window can still see) and the new rows, masked."""
        s, k = self.s, self.first_item[layer]
        first = self.items[k][2]
        k_old, v_old = self._take(k)                                       # [Hkv, n, D] each
        key, value = self.new
        kk = torch.cat([k_old[None].to(key.dtype), key], 2)               # [1, Hkv, n + T, D]
        vv = torch.cat([v_old[None].to(value.dtype), value], 2)
        out = device_attention(query, kk, vv, first, int(s.lengths[0]), window, scale, softcap, sinks)
        self._release(k)
        self._offload(layer, kk, vv, first)
        self.new = None
        return out

    def _attend_tiles(self, layer, query, scale, softcap, sinks):
        """A full-attention layer: the new rows (causal) and each tile of cached rows (all visible)
        attended apart and merged by their log-sum-exps (merge_lse): device memory holds one tile,
        whatever the context's length. The T queries of the G = Hq/Hkv heads sharing a KV head
        attend a tile as one [G*T] block (q head h*G + g)."""
        key, value = self.new                                             # [1, Hkv, T, D]
        _, Hq, T, D = query.shape
        Hkv = key.shape[1]
        G = Hq // Hkv
        q = query.contiguous()
        acc = attention_lse(q, key.repeat_interleave(G, 1), value.repeat_interleave(G, 1), scale, True, softcap)
        acc = (acc[0].reshape(1, Hkv, G * T, D), acc[1].reshape(1, Hkv, G * T))      # q head h*G + g
        qf = q.view(1, Hkv, G * T, D)                                      # [1, Hkv, G*T, D]
        start = self._offload_start()
        tail = (key[:, :, :0], value[:, :, :0])                            # cached rows start..L-1
        k0 = self.first_item[layer]
        for k in range(k0, k0 + self.ntiles[layer]):
            first, n = self.items[k][2:]
            k_old, v_old = self._take(k)                                   # [Hkv, n, D] each
            if n:
                kt, vt = k_old[None].to(key.dtype).contiguous(), v_old[None].to(value.dtype).contiguous()
                acc = merge_lse(acc, attention_lse(qf, kt, vt, scale, False, softcap))
                if first + n > start:         # the last tile holds them (copied: kt may view the buffer)
                    tail = (kt[:, :, start - first:].clone(), vt[:, :, start - first:].clone())
            self._release(k)
        o, lse = acc[0].reshape(1, Hq, T, D), acc[1].reshape(1, Hq, T)
        if sinks is not None:        # a logit per head joining the denominator (see merge_partials)
            o = o * torch.sigmoid(lse - sinks.float().view(1, Hq, 1))[..., None]
        self._offload(layer, torch.cat([tail[0], key], 2), torch.cat([tail[1], value], 2), start)
        self.new = None
        return o.to(query.dtype).transpose(1, 2)

    def _offload(self, layer, k, v, first):
        """The layer's new rows to the arena: k/v [1, Hkv, n + T, D] hold the cached rows from
        `first`, then the new ones; rows from the start of the block holding row L are built into
        whole blocks on the device and written into the arena (write_rows; the session counts them
        after the last layer). On a GPU these are DMAs into the page-locked arena on the session's
        offload stream, as a prefill's (KVSession.offloading: the host waits for layer - 2's only;
        a strided host-side write ran at 45 MB/s on an H100 host)."""
        self.log.append(("offload", layer, None, None))
        s, start = self.s, self._offload_start()                 # >= first: first is a block start <= L
        with s.offloading(layer, k, v):
            # rows start..L+T-1: [Hkv, L - start + T, D]
            s.write_rows(layer, 0, k[0, :, start - first:], v[0, :, start - first:], start, whole_blocks=True)

    def _offload_start(self):
        """The first row a layer's offload writes: the start of the block holding row L."""
        return max(int(self.s.lengths[0]) // BK * BK, int(self.s.pstart[0]))

    def finish(self):
        """After the last layer: every layer's new rows are in the arena (on a GPU, one wait for the
        offload stream). The session then counts them (KVSession.advance)."""
        self.log.append(("write", None, None, None))
        self.s.wait_offloads()


def _runs(ids, nphys):
    """Stored block ids of consecutive logical blocks -> [(first stored block, count)]: one run,
    or two when a ring wraps."""
    first = ids[0]
    n = min(len(ids), nphys - first)
    return [(first, n)] + ([(0, len(ids) - n)] if n < len(ids) else [])
