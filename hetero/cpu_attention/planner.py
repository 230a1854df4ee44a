"""How many workers a decode step uses, and how finely it splits the sequence.

A *profile* is measured once per machine and model shape (through the real
worker pool, on synthetic KV) and cached on disk:
  block_s     seconds one taker spends per KV block (BK rows) of one kv head
  unit_s      fixed seconds per unit (request x kv head x split)
  dispatch_s  wake-up of n workers: round trip main -> n workers -> main with empty work,
              n = 0..N (0 for n = 0: the parent alone wakes nobody)
  agg_gbps    KV bytes/s the parent and n workers together reach on a long context, n = 0..N
  merge_s     parent-side merge of one request's partials, per (request, kv head) and extra split
  merge_fixed_s  the merge's fixed cost once there is more than one split
The parent takes units too, so a step has a = n + 1 takers. The planner predicts a
step's time for every (workers n, splits s) and takes the fastest:
  t(n, s) = max((work + n dispatch(n)) / a + tail, longest unit, bytes / agg(n)) + merge(s)
  tail = (ceil(U / a) - U / a) shortest unit,   U = requests x kv heads x s units
The parent starts at once and each worker after its wake-up, so a worker pays off only
when there is more work per taker than its wake-up costs: short contexts stay in the
parent, long ones spread over every core. Takers take units from a shared ticket,
longest first (kernel.run_job), so units go out in rounds of a and the last round, of
the shortest units, leaves the takers without a unit idle (with equal units the
makespan is exactly ceil(U/a) units). The tail counts only where compute is the limit:
when bandwidth is, the takers still running read faster as the others stop. Split-K
serves when requests x kv heads are fewer than the takers, and finer units where they
shorten a compute-bound tail by more than the per-unit and merge costs.
"""
import hashlib
import json
import os
import platform
from dataclasses import asdict, dataclass

import numpy as np

from hetero.cpu_attention.simd import BK

PROFILE_VERSION = 12  # bump when the kernel or the measurement changes


def cache_dir():
    return os.environ.get("HETERO_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "hetero")


def _cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def fingerprint(cores, group, head_dim, code):
    """What a profile depends on: the machine (CPU model, worker cores, versions, shared-memory
    page size mode) and the shape."""
    import numba

    from hetero.ipc.shm import shmem_huge_pages

    return {"version": PROFILE_VERSION, "cpu": _cpu_model(), "machine": platform.machine(),
            "cores": list(cores), "numba": numba.__version__, "shmem_thp": shmem_huge_pages(),
            "group": int(group), "head_dim": int(head_dim), "code": int(code)}


@dataclass
class Profile:
    fingerprint: dict
    block_s: float
    unit_s: float
    dispatch_s: list     # index n = workers besides the parent, 0..N
    agg_gbps: list       # index n
    merge_s: float       # per request x kv head x extra split
    merge_fixed_s: float  # once per step with more than one split
    block_bytes: int     # KV bytes of one block of one kv head (K and V)

    @property
    def workers(self):
        return len(self.dispatch_s) - 1

    def describe(self):
        fp = self.fingerprint
        lines = [f"profile for {fp['cpu']} ({len(fp['cores'])} worker cores {fp['cores']}), "
                 f"group {fp['group']}, head_dim {fp['head_dim']}, storage code {fp['code']}",
                 f"  shared-memory huge pages: {fp.get('shmem_thp')}"
                 + ("  (KV reads run 15-30% slower on 4 KB pages: mount -o remount,huge=advise /dev/shm)"
                    if fp.get("shmem_thp") in ("never", "deny") else ""),
                 f"  one worker: {self.block_s * 1e6:.3f} us per {BK}-row block "
                 f"({self.block_bytes / self.block_s / 1e9:.1f} GB/s) + {self.unit_s * 1e6:.2f} us per unit",
                 f"  merge: {self.merge_fixed_s * 1e6:.1f} us once split + {self.merge_s * 1e6:.3f} us per extra "
                 "split per (request, kv head)",
                 "  workers  wake-up_us  parent+workers GB/s"]
        for n in range(self.workers + 1):
            lines.append(f"  {n:7d}  {self.dispatch_s[n] * 1e6:10.1f}  {self.agg_gbps[n]:19.1f}")
        return "\n".join(lines)


def profile_path(fp):
    digest = hashlib.sha1(json.dumps(fp, sort_keys=True).encode()).hexdigest()[:16]
    return os.path.join(cache_dir(), f"profile-{digest}.json")


def load_profile(fp):
    """The cached profile for this fingerprint, or None (missing, unreadable or stale)."""
    try:
        with open(profile_path(fp)) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    if data.get("fingerprint") != fp:
        return None
    try:
        return Profile(**data)
    except TypeError:
        return None


def save_profile(profile):
    path = profile_path(profile.fingerprint)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(asdict(profile), f, indent=1)
    os.replace(tmp, path)
    return path


def predict(profile, lengths, T, kv_heads, rows, nsplit_max, max_takers=None):
    """Predicted step time [n, s] (seconds) for n = 0..workers besides the parent, s = 1..nsplit_max.
    Plan n has n + 1 takers of units (the parent too), at most max_takers (the CUDA transport:
    the parent enqueues the GPU's work instead, and one more worker takes its share)."""
    nblk = (np.asarray(lengths, np.int64) + T + BK - 1) // BK               # [B] blocks per (b, h)
    s = np.arange(1, nsplit_max + 1)[:, None]                             # [S, 1]
    row_factor = max(1.0, rows / profile.fingerprint["group"])            # more query rows: more FMAs
    nbytes = kv_heads * nblk.sum() * profile.block_bytes
    n = np.arange(profile.workers + 1)[:, None]                           # [N+1, 1] workers
    if max_takers is None:                                                # the parent and n workers take units
        a, woken = n + 1, n
    else:                                                                 # workers alone: n + 1, at most max_takers
        a = np.minimum(n + 1, max_takers)
        woken = np.minimum(a, profile.workers)
    wake = np.asarray(profile.dispatch_s)[woken]                          # [N+1, 1]
    agg = np.asarray(profile.agg_gbps)[a - 1] * 1e9                       # measured with a takers (row a - 1)
    # a block's time with `a` takers reading at once: each gets at most 1/a of their bandwidth
    blk_s = np.maximum(profile.block_s * row_factor, profile.block_bytes * a / agg)[:, :, None]  # [N+1, 1, 1]
    unit = np.ceil(nblk / s)[None] * blk_s + profile.unit_s               # [N+1, S, B]: one unit's time
    work = kv_heads * (unit * s[None]).sum(2)                             # [N+1, S]: all units
    longest, shortest = unit.max(2), unit.min(2)                          # [N+1, S]
    U = len(nblk) * kv_heads * s[:, 0]                                    # [S] units
    tail = (np.ceil(U / a) - U / a) * shortest                            # [N+1, S]: the last round
    compute = np.maximum((work + woken * wake) / a + tail, longest)       # [N+1, S]
    extra = (s[:, 0] - 1)[None, :]                                        # [1, S]
    merge = profile.merge_s * len(nblk) * kv_heads * extra + profile.merge_fixed_s * (extra > 0)
    return np.maximum(compute, nbytes / agg) + merge


class ProfiledPlanner:
    def __init__(self, profile, nworkers):
        self.profile, self.nworkers = profile, min(nworkers, profile.workers)
        self._memo = {}

    def plan(self, lengths, T, layout, parent=True):
        """(workers besides the parent, splits); parent: whether the parent takes units too."""
        nblk = tuple(((np.asarray(lengths) + T + BK - 1) // BK).tolist())
        key = (nblk, T, layout.kv_heads, layout.nsplit_max, parent)
        if key not in self._memo:
            if len(self._memo) >= 4096:       # an engine's lengths change every step: keep the memo bounded
                self._memo.clear()
            rows = layout.q_heads // layout.kv_heads * T
            t = predict(self.profile, lengths, T, layout.kv_heads, rows, layout.nsplit_max,
                        None if parent else self.nworkers)[:self.nworkers + 1]
            n, s = np.unravel_index(int(np.argmin(t)), t.shape)
            self._memo[key] = (int(n), int(s) + 1)
        return self._memo[key]


class StaticPlanner:
    """Without a profile: every worker, and the split count (of >= min_rows rows each) whose units
    spread most evenly over the takers (the parent too, where it takes units): the fewest
    rounds of units per head of work, ceil(units / takers) / splits; the fewest splits on a tie."""

    def __init__(self, nworkers, min_rows=256):
        self.nworkers, self.min_rows = nworkers, min_rows

    def plan(self, lengths, T, layout, parent=True):
        takers = self.nworkers + 1 if parent else max(1, self.nworkers)
        most = max(1, min(int(np.max(lengths)) // self.min_rows, layout.nsplit_max))
        heads = len(lengths) * layout.kv_heads
        nsplit = min(range(1, most + 1), key=lambda s: (-(-heads * s // takers) / s, s))
        return self.nworkers, int(nsplit)
