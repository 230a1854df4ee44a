"""Who attends a continuation's new tokens over a cached context: the CPU workers, or the model's
device after a layer-wise prefetch (hetero.prefetch.schedule).

Per layer, for T new tokens over L cached rows:
  workers   the planner's predicted step time (its measured profile: per-block cost scaled by the
            G*T query rows, wake-ups, bandwidth), as for any decode step of T tokens
  prefetch  max(KV bytes of the L rows / copy_gbps, attention FLOPs / device_gflops): the copy of
            layer i+1 overlaps layer i's attention, so the slower of the two sets the pace
            (a CPU model always uses the workers: see choose)
copy_gbps (host arena -> device buffer, per head as the fetches copy; PCIe on a GPU machine)
and device_gflops (a full-attention layer's tile: attention_lse over one tile of cached rows; the
math path of soft-capped models, the masked path of windowed layers and the unblocking and merges
are not counted) are measured once per device and shape (`measure`), in the same process that
uses them. The crossover (the T above which the device wins) grows with nothing but these two
figures and the profile; `hetero profile --device` prints it.
"""
import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from hetero.cpu_attention import planner as P
from hetero.prefetch.schedule import attention_lse

log = logging.getLogger("hetero")


@dataclass(frozen=True)
class DeviceRates:
    device: str
    copy_gbps: float       # host (arena) -> device buffer
    device_gflops: float   # the model's attention on the device (sdpa, bf16/fp32 as the model)

    def describe(self):
        return (f"{self.device}: host->device copy {self.copy_gbps:.1f} GB/s, "
                f"attention {self.device_gflops:.0f} GFLOP/s")


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(device, spec, rows=8192, T=128, reps=3):
    """DeviceRates of `device` for the model's head shape (a few hundred ms)."""
    Hq, Hkv, D, dt = spec.q_heads, spec.kv_heads, spec.head_dim, spec.dtype
    g = torch.Generator().manual_seed(0)         # not the global RNGs: a user's seeded sampling follows
    host = torch.randn(Hkv, rows, D, generator=g).to(dt)
    if device.type == "cuda":
        host = host.pin_memory()
    dev = torch.empty_like(host, device=device)
    q = torch.randn(1, Hq, T, D, generator=g).to(device, dt)
    k = torch.randn(1, Hkv, rows, D, generator=g).to(device, dt)
    best_copy = best_attn = float("inf")
    for _ in range(reps):
        _sync(device)
        t = time.perf_counter()
        for h in range(Hkv):                                 # per head, as LayerPrefetcher's fetches
            dev[h].copy_(host[h], non_blocking=True)
        _sync(device)
        best_copy = min(best_copy, time.perf_counter() - t)
        t = time.perf_counter()
        attention_lse(q.view(1, Hkv, Hq // Hkv * T, D), k, k, D ** -0.5)     # a tile, as the prefetcher runs it
        _sync(device)
        best_attn = min(best_attn, time.perf_counter() - t)
    flops = 4.0 * Hq * T * rows * D
    return DeviceRates(str(device), host.numel() * host.element_size() / best_copy / 1e9,
                       flops / best_attn / 1e9)


def prefetch_s(rates, spec, L, T):
    """Predicted seconds per layer of the prefetch path."""
    kv_bytes = 2 * spec.kv_heads * L * spec.head_dim * torch.finfo(spec.dtype).bits / 8
    copy = kv_bytes / (rates.copy_gbps * 1e9)
    attn = 4.0 * spec.q_heads * T * (L + T) * spec.head_dim / (rates.device_gflops * 1e9)
    return max(copy, attn)


def workers_s(profile, spec, L, T, nworkers, nsplit_max=16, parent=True):
    """Predicted seconds per layer of the workers' step of T tokens (the planner's best plan);
    parent: whether the parent takes units too (not under the CUDA transport)."""
    rows = spec.q_heads // spec.kv_heads * T
    t = P.predict(profile, np.array([L]), T, spec.kv_heads, rows, nsplit_max,
                  None if parent else nworkers)[:nworkers + 1]
    return float(t.min())


def choose(profile, rates, spec, L, T, nworkers):
    """"prefetch" or "workers" for T new tokens over L cached rows. Without a profile, and on a CPU
    model (its "device" memory is the host's: a prefetch only adds copies of what the workers read
    in place; 1.4-2.7x slower on the 2-core VM, 16 to 1024 tokens over 8K), the workers."""
    if profile is None or rates is None or not rates.device.startswith("cuda"):
        return "workers"
    workers = workers_s(profile, spec, L, T, nworkers, parent=False)     # a GPU model: the CUDA transport's plan
    return "prefetch" if prefetch_s(rates, spec, L, T) < workers else "workers"


def crossover(profile, rates, spec, L, nworkers, tmax=256):
    """The fewest new tokens (powers of two up to tmax: a continuation's pieces, CONTINUE_CHUNK or
    HeteroConfig.prefill_chunk) for which prefetch wins over L cached rows, or None."""
    T = 1
    while T <= tmax:
        if choose(profile, rates, spec, L, T, nworkers) == "prefetch":
            return T
        T *= 2
    return None


# ---- how many tokens one prefill forward may take on the model's device (prefill_chunk="auto")

def forward_bytes(cfg, spec, B, T, S, eager, cached, padded=False):
    """Estimated device bytes beyond the weights of a forward of T tokens per request (B requests)
    at positions up to S. Activations per token: the MLP's three intermediate-size tensors (times
    the experts a token visits), six hidden-size ones, q/k/v.
    One pass: two layers' KV awaiting their offload (KVSession.store_prefill); over a padded
    batch, transformers' [B, S, S] boolean mask (an unpadded one needs none); an eager attention
    (soft-capped or sink models) adds f32 scores and probabilities, Hq x T x S.
    Over a cached context (hetero.prefetch): the device holds items of at most `held` cached rows
    (TILE_ROWS; a sliding window's rows, if longer), six copies of one (two buffers, the unblocked
    and the converted copies, the windowed path's concatenation), the new rows' KV expanded to
    the query heads and a tile's out, and two f32 [Hq, T, D] (the merged out, a tile's converted:
    merge_lse); a windowed layer's [T, held]
    boolean mask with sdpa's additive copy; eager scores Hq x T x held.
    On the H100 run (Llama-3-8B shape, before the tiles) this over-estimated the measured peak by
    30 % (one pass, 32K) and 13 % (chunks of 4096 over 32K, whole layers prefetched)."""
    e = torch.finfo(spec.dtype).bits // 8
    h = cfg.hidden_size
    inter = (getattr(cfg, "intermediate_size", None) or 4 * h) * max(1, getattr(cfg, "num_experts_per_tok", None) or 1)
    per_token = e * (3 * inter + 6 * h + (spec.q_heads + 2 * spec.kv_heads) * spec.head_dim)
    kv_per_position = 2 * spec.kv_heads * spec.head_dim * e
    if not cached:
        scores = 8 * spec.q_heads * T * S if eager else 0
        return B * (T * per_token + 2 * S * kv_per_position + scores + (S * S if padded else 0))
    from hetero.prefetch.schedule import TILE_ROWS

    window = max(spec.windows or (0,))
    held = min(S, max(TILE_ROWS, window + T if window else 0))
    scores = 8 * spec.q_heads * T * held if eager else 0
    mask = T * held * (2 + e) if window else 0
    merge = spec.q_heads * T * spec.head_dim * (3 * e + 2 * 4)
    return B * (T * per_token + 6 * held * kv_per_position + scores + mask + merge)


def prefill_chunk(cfg, spec, B, S, free_bytes, eager, padded=False, step=256, headroom=0.8):
    """HeteroConfig.prefill_chunk="auto" on a GPU: None when a one-pass prefill of B prompts of S
    positions fits `headroom` of the device's free bytes (forward_bytes), else the longest chunk,
    a multiple of `step`, whose forwards over the cached earlier chunks fit (at least `step`)."""
    budget = headroom * free_bytes
    if forward_bytes(cfg, spec, B, S, S, eager, cached=False, padded=padded) <= budget:
        return None
    def fits(n):                                   # n steps per chunk
        return forward_bytes(cfg, spec, B, n * step, S, eager, cached=True) <= budget
    lo, hi = 1, max(1, S // step)                  # fits(lo) is hoped for; the answer is in [lo, hi]
    if not fits(lo):
        log.warning("hetero: even %d-token prefill chunks over %d positions may not fit the GPU's %.1f GiB "
                    "free; trying them anyway", step, S, free_bytes / 2**30)
        return step
    while lo < hi:                                 # the largest n with fits(n)
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo * step
