"""Measure a planner profile (see hetero.cpu_attention.planner) through the real worker pool.

Runs the decode-attention job on synthetic KV: the parent alone at growing
context lengths (per-core time per block), the parent alone on a long context in
16 splits instead of 1 (per-unit cost), the parent with every worker count on a
long context (the aggregate bandwidth), empty jobs (the workers' wake-up), and the
parent's merge (fixed, and per split). The KV is cold, as a model's is: the arena
holds enough layers to span COLD_FACTOR last-level caches and successive calls take
successive layers (a one-layer arena of 64 MB sat in the 300 MB L3 of the H100
host's CPU, and the profile then under-priced every block read from memory). A few
seconds; cached on disk per machine and shape.
"""
import functools
import logging
import math
import time

import numpy as np
import torch

from hetero.cpu_attention import planner as P
from hetero.cpu_attention.simd import BK
from hetero.ipc import control as C
from hetero.model_spec import ModelSpec
from hetero.offload.session import STORAGE_CODES, KVSession, merge_partials

PROFILE_KV_HEADS = 8
PROFILE_ROWS = 16384        # per kv head: one layer holds 64 MB of bf16 KV at head_dim 128
COLD_FACTOR = 4             # the layers a measurement rotates over span this many last-level caches
MAX_COLD_BYTES = 2 << 30    # at most (a 512 MB cache: 2 GB)


def last_level_cache_bytes():
    """The largest CPU cache (sysfs), or 32 MB when unknown."""
    best = 0
    for idx in range(8):
        try:
            with open(f"/sys/devices/system/cpu/cpu0/cache/index{idx}/size") as f:
                text = f.read().strip()
        except OSError:
            break
        mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1], 1)
        best = max(best, int(text.rstrip("KMG")) * mult)
    return best or 32 << 20


def cold_layers(layer_bytes):
    """Layers of `layer_bytes` that span COLD_FACTOR last-level caches (at most MAX_COLD_BYTES)."""
    return max(1, -(-min(COLD_FACTOR * last_level_cache_bytes(), MAX_COLD_BYTES) // layer_bytes))


class Rotation:
    """Successive calls take successive layers: every call reads cold KV, as in a model."""

    def __init__(self, layers):
        self.layers, self.i = layers, 0

    def next(self):
        self.i = (self.i + 1) % self.layers
        return self.i


def median_times(jobs, reps, rounds=3, steady=False):
    """{key: median seconds} for jobs {key: fn}, in `rounds` round-robin passes so slow drifts of a
    shared machine hit every job alike. Each pass runs a job once untimed (it wakes workers that
    backed off while other jobs ran: decode keeps its workers hot) and then times it `reps` times.
    steady: the fastest pass's median instead (a profile should not keep a passing disturbance)."""
    ts = {k: [[] for _ in range(rounds)] for k in jobs}
    for i in range(rounds):
        for k, fn in jobs.items():
            fn()
            for _ in range(reps):
                t = time.perf_counter()
                fn()
                ts[k][i].append(time.perf_counter() - t)
    if steady:
        return {k: float(min(np.median(r) for r in v)) for k, v in ts.items()}
    return {k: float(np.median(sum(v, []))) for k, v in ts.items()}


def synthetic_session(pool, spec, lengths, cap):
    """A KVSession of random KV (and a random q staged as a model of spec.dtype would: bf16-exact
    for bf16) for `lengths`, with the pool's words set for a one-token decode step of layer 0."""
    session = KVSession(pool, spec, pads=[0] * len(lengths), real_lens=list(lengths), cap=cap)
    try:
        g = torch.Generator().manual_seed(0)
        for X in (session.K, session.V):          # [layers, ...]: layer 0 random, the others its copies
            X[0].copy_(torch.randn(X.shape[1:], generator=g).to(X.dtype))
            X[1:].copy_(X[:1].expand_as(X[1:]))
        session.q.copy_(torch.randn(session.q.shape, generator=g).to(spec.dtype).float())
        w, f = pool.words, pool.floats
        f[C.F_SCALE], f[C.F_SOFTCAP] = spec.head_dim ** -0.5, 0.0
        w[C.LAYER], w[C.QLEN], w[C.WINDOW] = 0, 1, 0
    except BaseException:
        session.close()
        raise
    return session


def attention_job(pool, session, lengths, n, s, next_layer=None):
    """A callable running one decode-attention step over `lengths` on the parent and n workers in
    s splits; next_layer: None (layer 0, as set), or a callable giving each call's layer."""
    units = session.batch * session.layout.kv_heads * s        # lengths: one per request, or one for all

    def job():
        session.lengths[:] = lengths
        pool.words[C.NSPLIT] = s
        if next_layer is not None:
            pool.words[C.LAYER] = next_layer()
        session.run_attention(n, units)
    return job


def measure(pool, group, head_dim, dtype, reps=5):
    """Profile for `pool` and queries of `group` heads per kv head, `head_dim`, KV in `dtype`."""
    Hkv = PROFILE_KV_HEADS
    block_bytes = 2 * BK * head_dim * torch.finfo(dtype).bits // 8
    layers = cold_layers(Hkv * (PROFILE_ROWS // BK + 1) * block_bytes)
    spec = ModelSpec(model_type="profile", layers=layers, q_heads=Hkv * group, kv_heads=Hkv, head_dim=head_dim,
                     dtype=dtype, max_positions=None, sliding=(False,) * layers)
    session = synthetic_session(pool, spec, [1], PROFILE_ROWS + BK)
    try:
        rot = Rotation(layers)
        attn = functools.partial(attention_job, pool, session, next_layer=rot.next)   # attn(lengths, n, s)
        ping = median_times({n: (lambda n=n: pool.run(C.CMD_PING, active=n)) for n in range(1, pool.n + 1)}, 100,
                            steady=True)
        dispatch = [0.0] + [ping[n] for n in range(1, pool.n + 1)]
        # the parent alone, one split: time(L) = call + Hkv * (unit_s + blocks * block_s);
        # and the parent with every worker count on the longest context (each taker >= 2 units)
        sizes = [BK - 1, 4 * BK - 1, 32 * BK - 1, PROFILE_ROWS // 4 - 1, PROFILE_ROWS - 1]
        L = PROFILE_ROWS - 1
        jobs = {("size", x): attn(x, 0, 1) for x in sizes}
        jobs["split"] = attn(PROFILE_ROWS - 1, 0, 16)        # what 15 more units per kv head cost
        jobs.update({("all", n): attn(L, n, max(1, math.ceil(2 * (n + 1) / Hkv))) for n in range(1, pool.n + 1)})
        t = median_times(jobs, reps, steady=True)
        blocks = np.array([(x + 1 + BK - 1) // BK for x in sizes], float)
        per_unit = np.array([t["size", x] / Hkv for x in sizes])
        block_s = max(float(np.polyfit(blocks, per_unit, 1)[0]), 1e-9)
        unit_s = max(0.0, (t["split"] - t["size", PROFILE_ROWS - 1]) / (15 * Hkv))
        nbytes = Hkv * ((L + 1 + BK - 1) // BK) * block_bytes
        t["all", 0] = t["size", L]
        agg = [nbytes / max(t["all", n], 1e-9) / 1e9 for n in range(pool.n + 1)]
        # parent merge of the partials, per (request, kv head) and extra split
        g = torch.Generator().manual_seed(0)     # not the global RNG: a user's seeded sampling follows
        o = torch.randn(1, Hkv, 16, group, head_dim, generator=g)
        m, l = torch.randn(1, Hkv, 16, group, generator=g), torch.rand(1, Hkv, 16, group, generator=g) + 1

        tm = median_times({s: (lambda s=s: merge_partials(o[:, :, :s], m[:, :, :s], l[:, :, :s]))
                           for s in (1, 2, 16)}, 20, steady=True)
        merge_s = max(0.0, (tm[16] - tm[2]) / 14 / Hkv)
        merge_fixed_s = max(0.0, tm[2] - tm[1] - merge_s * Hkv)
    finally:
        session.close()
    fp = P.fingerprint(pool.worker_cores, group, head_dim, STORAGE_CODES[dtype])
    return P.Profile(fingerprint=fp, block_s=block_s, unit_s=unit_s, dispatch_s=dispatch, agg_gbps=agg,
                     merge_s=merge_s, merge_fixed_s=merge_fixed_s, block_bytes=block_bytes)


def load_or_measure(pool, spec, force=False):
    """(profile, whether it was measured now). Cached per machine + shape in planner.cache_dir()."""
    group = spec.q_heads // spec.kv_heads
    fp = P.fingerprint(pool.worker_cores, group, spec.head_dim, STORAGE_CODES[spec.dtype])
    if not force:
        cached = P.load_profile(fp)
        if cached is not None and cached.workers == pool.n:
            return cached, False
    profile = measure(pool, group, spec.head_dim, spec.dtype)
    try:
        P.save_profile(profile)
    except OSError as e:                 # a read-only cache directory: this process keeps what it measured
        logging.getLogger("hetero").warning("hetero: the decode profile could not be saved (%s); it is measured "
                                            "again by the next process (set HETERO_CACHE_DIR)", e)
    return profile, True
