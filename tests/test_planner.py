"""The decode planner on synthetic profiles, and the on-disk profile cache."""
import json

import numpy as np

from hetero.cpu_attention import planner as P
from hetero.offload.arena import SessionLayout


def synthetic(workers=15, group=4, wake_us=15.0, merge_s=1e-7):
    """A 16 GB/s-per-core machine whose all-core bandwidth saturates at 60 GB/s; entry n of
    dispatch_s / agg_gbps: n workers besides the parent (which takes units too)."""
    fp = {"version": P.PROFILE_VERSION, "cpu": "synthetic", "machine": "x86_64", "cores": list(range(1, workers + 1)),
          "numba": "0", "group": group, "head_dim": 128, "code": 1}
    return P.Profile(fingerprint=fp, block_s=1e-6, unit_s=2e-6,
                     dispatch_s=[0.0] + [2e-6 + wake_us * 1e-6 * n for n in range(1, workers + 1)],
                     agg_gbps=[min(16.0 * (n + 1), 60.0) for n in range(workers + 1)], merge_s=merge_s,
                     merge_fixed_s=5e-6, block_bytes=16384)


def layout(batch=1, kv_heads=8, cap=1 << 20):
    return SessionLayout(batch, kv_heads * 4, kv_heads, 128, cap, 1, 1)


def plan(profile, lengths, n=None, kv_heads=8):
    lay = layout(len(lengths), kv_heads)
    return P.ProfiledPlanner(profile, n or profile.workers).plan(np.asarray(lengths), 1, lay)


def test_tiny_context_stays_in_the_parent():
    """Waking a worker costs more than the few microseconds of work: the parent does it alone."""
    assert plan(synthetic(), [40], kv_heads=2) == (0, 1)
    assert plan(synthetic(), [100], kv_heads=2) == (0, 1)
    assert plan(synthetic(wake_us=0.1), [8192], kv_heads=2)[0] >= 1      # cheap wake-up, more work: help


def test_more_workers_for_longer_contexts():
    prof = synthetic()
    used = [plan(prof, [L], kv_heads=2)[0] for L in (40, 1024, 8192, 65536, 262144)]
    # compute-bound contexts take more takers as they grow; bandwidth-bound ones (from about 64K
    # here) take just the 4 takers that saturate the socket, however long they are
    assert used[:3] == sorted(used[:3]) and used[0] == 0 and used[2] > 2, used
    assert used[3:] == [3, 3], used


def test_no_more_workers_than_the_bandwidth_feeds():
    """16 GB/s per core, 60 GB/s for the socket: past the parent and 3 workers, a worker would
    only add wake-up cost."""
    assert plan(synthetic(), [262144])[0] == 3
    assert plan(synthetic(wake_us=0.5), [262144])[0] <= 4


def test_never_more_workers_than_available():
    prof = synthetic(workers=15)
    for n in (1, 3, 7):
        for L in (100, 10_000, 500_000):
            assert plan(prof, [L], n=n)[0] <= n
    assert plan(prof, [500_000], n=3)[0] == 3


def test_split_k_when_heads_are_few():
    """One request with 2 kv heads on a long context: split the sequence to feed the workers."""
    workers, splits = plan(synthetic(), [262144], kv_heads=2)
    assert workers > 2 and splits * 2 >= workers + 1
    # many requests x heads already feed every worker: splits would only shorten the tail, not
    # worth a dear merge; the 2-head request still splits to use more than 2 workers
    dear = synthetic(merge_s=2e-5)
    assert plan(dear, [65536] * 8, kv_heads=8)[1] == 1
    workers, splits = plan(dear, [262144], kv_heads=2)
    assert workers > 2 and splits > 1


def test_units_go_out_in_rounds_of_the_workers():
    """Compute-bound (bandwidth to spare): 8 equal units on the parent and a worker divide evenly,
    so no split; 3 units leave one taker idle for a whole unit, so split them in two (6 units, 3 each)."""
    fast = synthetic()
    fast.agg_gbps = [1000.0] * (fast.workers + 1)
    assert plan(fast, [65536], n=1, kv_heads=8) == (1, 1)
    assert plan(fast, [65536], n=1, kv_heads=3) == (1, 2)


def test_plan_respects_nsplit_max():
    lay = SessionLayout(1, 4, 1, 128, 1 << 20, 1, 1, nsplit_max=4)
    n, s = P.ProfiledPlanner(synthetic(), 15).plan(np.array([500_000]), 1, lay)
    assert s <= 4


def h100_host():
    """The profile measured on the H100 host (16 SPR cores, 15 workers): 6.4 GB/s per taker,
    73 GB/s for all of them."""
    prof = synthetic(wake_us=0.6, merge_s=0.09e-6)
    prof.block_s, prof.unit_s, prof.merge_fixed_s = 2.549e-6, 0.0, 30e-6
    prof.agg_gbps = [6.4, 13.0, 20.8, 25.8, 31.0, 38.4, 38.8, 44.1, 48.5, 52.7, 53.4, 60.5, 60.2, 65.3, 66.1, 72.7]
    return prof


def test_plan_without_the_parent_spreads_units_over_the_workers():
    """The CUDA transport: the parent takes no units, the plan's n + 1 takers are workers, at most
    15. 8 kv heads x 2 splits (the plan with the parent: 16 takers) would leave one of 15 workers
    two units, the step twice one unit's time; 15 splits give each worker 8 units."""
    lay = layout(1, 8)
    planner = P.ProfiledPlanner(h100_host(), 15)
    assert planner.plan(np.array([65536]), 1, lay) == (15, 2)
    n, s = planner.plan(np.array([65536]), 1, lay, parent=False)
    assert min(n + 1, 15) == 15 and (8 * s) % 15 == 0                 # every worker takes units
    t = P.predict(h100_host(), [65536], 1, 8, 4, 16, max_takers=15)
    assert t[n, s - 1] < 0.6 * t[15, 1]
    assert np.array_equal(t[14], t[15])         # n = 14 and 15 run alike: 15 takers, all workers woken


def test_static_planner_without_profile():
    lay = layout(1, 8)
    assert P.StaticPlanner(15).plan(np.array([32768]), 1, lay) == (15, 2)
    assert P.StaticPlanner(8).plan(np.array([300]), 1, layout(1, 2)) == (8, 1)
    # units spread evenly: 15 takers without the parent, 3 with it over 8 kv heads
    assert P.StaticPlanner(15).plan(np.array([32768]), 1, lay, parent=False) == (15, 15)
    assert P.StaticPlanner(2).plan(np.array([32768]), 1, lay) == (2, 3)


def test_profile_cache_roundtrip_and_invalidation(tmp_path, monkeypatch):
    monkeypatch.setenv("HETERO_CACHE_DIR", str(tmp_path))
    prof = synthetic()
    path = P.save_profile(prof)
    assert P.load_profile(prof.fingerprint) == prof
    # another machine or model shape: another key, nothing cached
    for change in ({"cpu": "other"}, {"cores": [1, 2]}, {"group": 8}, {"head_dim": 64}, {"code": 0},
                   {"version": P.PROFILE_VERSION + 1}, {"shmem_thp": "advise"}):
        assert P.load_profile({**prof.fingerprint, **change}) is None
    # a file whose fingerprint does not match its name (edited, or hash clash) is ignored
    data = json.load(open(path))
    data["fingerprint"]["cpu"] = "tampered"
    json.dump(data, open(path, "w"))
    assert P.load_profile(prof.fingerprint) is None
    open(path, "w").write("{not json")
    assert P.load_profile(prof.fingerprint) is None


def test_fingerprint_tracks_machine_and_shape():
    a = P.fingerprint([1, 2], 4, 128, 1)
    assert a["cpu"] and a["cores"] == [1, 2] and a["group"] == 4
    assert P.profile_path(a) != P.profile_path(P.fingerprint([1, 2], 4, 128, 0))
    assert P.profile_path(a) != P.profile_path(P.fingerprint([1], 4, 128, 1))


def test_measured_profile_is_cached(tmp_path, monkeypatch):
    """A real measurement through a one-worker pool: saved, then loaded instead of re-measured."""
    import torch

    from hetero.ipc.pool import WorkerPool
    from hetero.model_spec import ModelSpec
    from hetero.profile import load_or_measure

    monkeypatch.setenv("HETERO_CACHE_DIR", str(tmp_path))
    spec = ModelSpec(model_type="t", layers=1, q_heads=8, kv_heads=2, head_dim=64, dtype=torch.bfloat16,
                     max_positions=None, sliding=(False,))
    pool = WorkerPool(1, [])
    try:
        prof, measured = load_or_measure(pool, spec)
        assert measured and prof.block_s > 0 and prof.workers == 1 and prof.agg_gbps[0] > 0
        again, measured = load_or_measure(pool, spec)
        assert not measured and again == prof
        other, measured = load_or_measure(pool, ModelSpec(**{**spec.__dict__, "head_dim": 128}))
        assert measured and other.fingerprint["head_dim"] == 128
    finally:
        pool.close()
    assert len(list(tmp_path.iterdir())) == 2
