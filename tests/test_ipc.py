"""Atomic flags, the worker pool and segment hygiene, with real processes and /dev/shm."""
import fcntl
import multiprocessing as mp
import os
import shutil
import subprocess
import sys
import textwrap
import time
import warnings

import numpy as np
import psutil
import pytest

from hetero.errors import WorkerDiedError
from hetero.ipc import atomics, control as C, shm
from hetero.ipc.pool import WorkerPool


def test_atomics_roundtrip():
    a = np.zeros(16, np.int64)
    atomics.store(a, 8, 42)
    assert atomics.load(a, 8) == 42 and a[8] == 42
    assert atomics.spin_until_changed(a, 8, 42, 10) == 42       # unchanged: returns old after the budget
    assert atomics.spin_until_changed(a, 8, 0, 10) == 42
    assert atomics.spin_until_all(a, 0, 2, 8, 0, 10) is False   # a[8] != 0
    assert atomics.spin_until_all(a, 8, 1, 8, 42, 10) is True


def test_tagged_ticket_claims():
    """A ticket gives each unit once, counting down, and nothing to a taker of another job."""
    a = np.zeros(16, np.int64)
    a[C.TICKET % 16] = C.ticket(7, 3)
    assert atomics.claim(a, C.TICKET % 16, C.ticket_tag(6)) == 0         # a late taker of job 6
    assert [atomics.claim(a, C.TICKET % 16, C.ticket_tag(7)) for _ in range(4)] == [3, 2, 1, 0]
    assert a[C.TICKET % 16] == C.ticket(7, 0)
    assert C.go_seq(C.go(123456, C.CMD_LORA)) == 123456 and C.go_cmd(C.go(123456, C.CMD_LORA)) == C.CMD_LORA


def test_pool_round_trips_and_dead_worker_detection():
    pool = WorkerPool(2, [0, 1] if os.cpu_count() > 1 else [0])
    try:
        name = pool.ctrl.name
        assert os.path.exists("/dev/shm" + name)
        for _ in range(50):
            pool.run(C.CMD_PING)
        assert all(pool.words[C.done_word(r)] == pool.seq for r in range(2))
        victim = pool.procs[1]
        victim.kill()
        victim.wait()
        t0 = time.perf_counter()
        with pytest.raises(WorkerDiedError, match=r"worker 1 \(pid %d.*SIGKILL" % victim.pid):
            pool.run(C.CMD_PING)
        assert time.perf_counter() - t0 < 2.0
        assert not pool.alive
    finally:
        pool.close()
        pool.close()  # idempotent
    assert not os.path.exists("/dev/shm" + name)
    assert all(p.poll() is not None for p in pool.procs)


def test_idle_workers_sleep_and_are_woken():
    """A worker sleeps (futex on its GO word) once its idle spin is spent, so between jobs it
    leaves its core to others (a CPU model's torch threads), and a posted job wakes it at once:
    without the wake each of these jobs would wait for the sleep's 50 ms timeout."""
    import psutil

    pool = WorkerPool(2, [0, 1] if os.cpu_count() > 1 else [0], idle_spin=1)
    try:
        pool.run(C.CMD_PING)
        deadline = time.perf_counter() + 5.0
        while not all(pool.words[C.asleep_word(r)] == 1 for r in range(2)) and time.perf_counter() < deadline:
            time.sleep(0.01)
        asleep = [int(pool.words[C.asleep_word(r)]) for r in range(2)]
        assert asleep == ([1, 1] if atomics.HAVE_FUTEX else [0, 0]), f"ASLEEP words {asleep}"
        procs = [psutil.Process(p.pid) for p in pool.procs]
        before = [sum(p.cpu_times()[:2]) for p in procs]
        t0 = time.perf_counter()
        for _ in range(100):
            time.sleep(0.002)                         # the workers fall asleep between jobs
            pool.run(C.CMD_PING)
        took = time.perf_counter() - t0
        assert took < 2.0, f"100 jobs for sleeping workers took {took:.2f} s"
        time.sleep(1.0)
        used = [sum(p.cpu_times()[:2]) - b for p, b in zip(procs, before)]
        assert max(used) < 0.3, f"sleeping workers used {used} CPU seconds in {took + 1:.1f} s"
        assert pool.alive
    finally:
        pool.close()


def test_keep_awake_workers_answer_a_job_posted_without_a_wake():
    """With keep_awake on, no worker sleeps (the GPU posts GO with plain stores, no futex wake):
    a job posted by plain stores is answered at once; off again, they sleep."""
    pool = WorkerPool(2, [0, 1] if os.cpu_count() > 1 else [0], idle_spin=1)
    try:
        pool.run(C.CMD_PING)
        pool.keep_awake(True)
        time.sleep(0.2)                                  # past any sleep's timeout
        assert [int(pool.words[C.asleep_word(r)]) for r in range(2)] == [0, 0]
        for _ in range(20):
            pool.seq += 1
            atomics.post(pool.words, C.go_word(0), 2, C.LINE, C.go(pool.seq, C.CMD_PING))   # no wake
            assert atomics.spin_until_all(pool.words, C.done_word(0), 2, C.LINE, pool.seq, 50_000_000)
        pool.keep_awake(False)
        pool.run(C.CMD_PING)
        deadline = time.perf_counter() + 5.0
        while atomics.HAVE_FUTEX and time.perf_counter() < deadline and \
                not all(pool.words[C.asleep_word(r)] == 1 for r in range(2)):
            time.sleep(0.01)
        assert not atomics.HAVE_FUTEX or all(pool.words[C.asleep_word(r)] == 1 for r in range(2))
    finally:
        pool.close()


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A segment owner: creates `n` segments, prints their names, waits for its stdin to close, then
# closes the first one and exits normally (the exit handler unlinks the rest and the lock).
OWNER = """
import os, sys
sys.path.insert(0, {root!r})
{pre}
from hetero.ipc import shm
segs = [shm.Segment(shm.new_name("t"), 64, create=True) for _ in range({n})]
print(*[s.name for s in segs], flush=True)
sys.stdin.read()
segs[0].close()
"""


def _start_owner(n=1, pre="", argv=()):
    p = subprocess.Popen([*argv, sys.executable, "-c", OWNER.format(root=ROOT, n=n, pre=pre)],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    return p, p.stdout.readline().split()


def _lock_of(name):
    """The owner lock guarding segment `name`."""
    return shm.LOCK_PREFIX + shm._SEG_RE.match(name.lstrip("/")).group(1)


def _dead_pid():
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _ours():
    """This process's segments (other processes may be creating and sweeping theirs meanwhile)."""
    return [n for n in shm.list_ours() if n.startswith(f"{shm.PREFIX}{os.getpid()}_")]


def _swept(names, removed=()):
    """`names` are gone, and a sweep that returned `removed` removed nothing else of their owner
    (another process's sweep, e.g. a pool starting, may have removed some first)."""
    key = shm._SEG_RE.match(names[0].lstrip("/")).group(1)
    expected = {n.lstrip("/") for n in names} | {_lock_of(names[0])}
    return _gone(expected) and {n for n in removed if key in n} <= expected


def _gone(names):
    here = set(shm.list_ours())
    return not any(n.lstrip("/") in here for n in names)


def test_segment_names_unique_and_sweep_only_dead_owners():
    import posix_ipc

    a, b = shm.Segment(shm.new_name("t"), 64, create=True), shm.Segment(shm.new_name("t"), 64, create=True)
    own_lock = _lock_of(a.name)
    old = f"/{shm.PREFIX}{_dead_pid()}_abc_kv"          # the old name format: no lock, nothing proven
    posix_ipc.SharedMemory(old, posix_ipc.O_CREX, size=64).close_fd()
    owner, names = _start_owner(2)
    try:
        assert a.name != b.name and _lock_of(b.name) == own_lock and own_lock in shm.list_ours()
        assert len(names) == 2 and _lock_of(names[0]) != own_lock
        removed = shm.sweep_stale()
        assert not {a.name[1:], b.name[1:], own_lock, *(n[1:] for n in names)} & set(removed)    # all alive
        assert shm.sweep_owner(names[0]) == [] and shm.sweep_owner(a.name) == []
        owner.kill()                                                            # (b) killed: no exit handler
        owner.wait()
        assert _swept(names, shm.sweep_stale())
        assert old[1:] in shm.list_ours()                                       # never guessed at
        assert {a.name[1:], b.name[1:], own_lock} <= set(shm.list_ours())      # ours are alive: kept
    finally:
        owner.kill()
        owner.wait()
        shm.unlink(old)
        a.close()
        b.close()
    assert a.name[1:] not in shm.list_ours() and own_lock in shm.list_ours()  # the lock lives with us


def test_sweep_keeps_a_live_owner_whose_pid_is_dead_here():
    """(a), simulated: a live owner's names rewritten to carry a pid that is dead in this namespace
    (as another container's look from here) are kept while it holds its lock, swept once it dies."""
    owner, names = _start_owner(1)
    try:
        pid, dead = names[0].split("_")[1], str(_dead_pid())
        moved = []
        for n in [names[0][1:], _lock_of(names[0])]:
            moved.append(n.replace(f"_{pid}_", f"_{dead}_"))
            os.rename(f"/dev/shm/{n}", f"/dev/shm/{moved[-1]}")               # same inode: still locked
        assert shm._SEG_RE.match(moved[0]) and _lock_of(moved[0]) == moved[1]
        assert not set(moved) & set(shm.sweep_stale()) and shm.sweep_owner(moved[0]) == []
        assert set(moved) <= set(shm.list_ours())
        owner.kill()
        owner.wait()
        assert _swept(moved[:1], shm.sweep_owner(moved[0]))      # as a worker does when its parent died
    finally:
        owner.kill()
        owner.wait()


def _unshare_works():
    if shutil.which("unshare") is None:
        return False
    try:
        return subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"], timeout=30,
                              capture_output=True).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


# inside a new pid namespace (as pid 1): fork the owner with pid `want` (dead in the outer namespace)
UNSHARED = """
try:
    with open("/proc/sys/kernel/ns_last_pid", "w") as f:
        f.write(str({want} - 1))
except OSError:
    pass
if os.fork():
    os.wait()
    os._exit(0)
"""


@pytest.mark.skipif(not _unshare_works(), reason="needs unshare --pid --fork --mount-proc (root)")
def test_sweep_keeps_a_live_owner_in_another_pid_namespace():
    """(a) for real: an owner in another pid namespace, whose pid means another process or none
    here, keeps its segments while it lives; once it is killed the next sweep removes them."""
    import random

    want = random.choice([p for p in range(2000, 30000) if not os.path.exists(f"/proc/{p}")])
    owner, names = _start_owner(1, pre=UNSHARED.format(want=want),
                                argv=["unshare", "--pid", "--mount-proc", "--kill-child"])
    try:
        assert len(names) == 1, names
        inner = int(names[0].split("_")[1])
        assert inner == want or inner < 3     # 2 where ns_last_pid cannot be set: init here, or nothing
        for _ in range(3):
            assert not {names[0][1:], _lock_of(names[0])} & set(shm.sweep_stale())
        assert names[0][1:] in shm.list_ours() and _lock_of(names[0]) in shm.list_ours()
        owner.kill()          # unshare dies; --kill-child kills the namespace's init, and all in it
        owner.wait()
        deadline, removed = time.monotonic() + 10, []
        while time.monotonic() < deadline and not _gone(names + [_lock_of(names[0])]):
            removed += shm.sweep_stale()
            time.sleep(0.05)
        assert _swept(names, removed)
    finally:
        owner.kill()
        owner.wait()


def test_owner_lock_is_not_inherited_and_goes_with_a_clean_exit():
    """(c) The lock descriptor is close-on-exec (no worker holds it); a normal exit leaves nothing
    of the owner in /dev/shm, segments it forgot to close included."""
    seg = shm.Segment(shm.new_name("t"), 64, create=True)
    lock = _lock_of(seg.name)
    pool = WorkerPool(1, [])
    try:
        assert fcntl.fcntl(shm._owner[2], fcntl.F_GETFD) & fcntl.FD_CLOEXEC
        ls = subprocess.run(["ls", "-l", "/proc/self/fd/"], close_fds=False, capture_output=True, text=True)
        assert ls.returncode == 0 and "/dev/shm/" not in ls.stdout
        for p in pool.procs:
            fds = [os.readlink(f"/proc/{p.pid}/fd/{fd}") for fd in os.listdir(f"/proc/{p.pid}/fd")]
            assert not any(shm.LOCK_PREFIX in f for f in fds), fds
    finally:
        pool.close()
        seg.close()
    assert lock in shm.list_ours()
    owner, names = _start_owner(3)
    owner.communicate("")              # closes one segment, exits normally with two left open
    assert owner.returncode == 0 and len(names) == 3
    assert _nothing_of(names[0].split("_")[1])


def _nothing_of(pid):
    return not [n for n in shm.list_ours() if n.startswith((f"{shm.PREFIX}{pid}_", f"{shm.LOCK_PREFIX}{pid}_"))]


FORKER = """
import fcntl, os, sys
sys.path.insert(0, {root!r})
from hetero.ipc import shm
seg = shm.Segment(shm.new_name("t"), 64, create=True)
key = shm._owner[1]
r, w = os.pipe()
if os.fork() == 0:
    child = shm.Segment(shm.new_name("t"), 64, create=True)
    os.write(w, (child.name + " " + shm._owner[1]).encode())
    fds = [os.readlink(f"/proc/self/fd/{{f}}") for f in os.listdir("/proc/self/fd") if f.isdigit()]
    assert sum(shm.LOCK_PREFIX in f for f in fds) == 1, fds     # its own lock, not its parent's
    seg.close()                     # a copy in the child: must not unlink its parent's segment
    sys.exit(0)                     # runs the exit handlers: the child's names only
os.wait()
child_name, child_key = os.read(r, 1000).decode().split()
assert child_key != key and not child_key.startswith(str(os.getpid()) + "_")
assert child_name[1:] not in shm.list_ours() and shm.LOCK_PREFIX + child_key not in shm.list_ours()
assert seg.name[1:] in shm.list_ours()
fd = os.open("/dev/shm/" + shm.LOCK_PREFIX + key, os.O_RDONLY)
try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    sys.exit("the parent lost its lock when its child closed it")
except BlockingIOError:
    pass
assert seg.name[1:] not in shm.sweep_stale() and seg.name[1:] in shm.list_ours()
print("OK", os.getpid(), flush=True)
"""


def test_forked_child_takes_its_own_lock_and_names():
    out = subprocess.run([sys.executable, "-c", FORKER.format(root=ROOT)], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.startswith("OK"), out.stderr
    assert _nothing_of(out.stdout.split()[1])


# forks owners in a loop; each takes its lock, creates a segment, checks both are still there a
# moment later (while the test sweeps), and dies without cleaning up (so sweeps have work)
CHURN = """
import os, sys, time
sys.path.insert(0, {root!r})
from hetero.ipc import shm
end, bad, pids = time.monotonic() + {seconds}, 0, []
while time.monotonic() < end:
    pid = os.fork()
    if pid == 0:
        seg = shm.Segment(shm.new_name("t"), 64, create=True)
        lock = shm.LOCK_PREFIX + shm._owner[1]
        time.sleep(0.002)
        os._exit(0 if os.path.exists("/dev/shm" + seg.name) and os.path.exists("/dev/shm/" + lock) else 1)
    bad += os.waitpid(pid, 0)[1] != 0
    pids.append(pid)
print(bad, *pids, flush=True)
"""


DYING_OWNER = """
import os, sys, time
sys.path.insert(0, {root!r})
from hetero.ipc import shm
seg = shm.Segment(shm.new_name("t"), 64, create=True)
print(seg.name, flush=True)
sys.stdin.readline()
time.sleep(0.4)
os._exit(0)                      # no exit handler: its names stay, its lock is released
"""


def test_a_sweep_told_to_wait_takes_a_dying_owner_s_names_once_its_lock_is_free():
    """sweep_owner(wait=...): a worker that saw its parent's pipe close may sweep while the parent
    still holds its lock; it tries again until the lock is free, then removes every name (the
    lock too); without the wait, a live owner's names are kept."""
    p = subprocess.Popen([sys.executable, "-c", DYING_OWNER.format(root=ROOT)], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    try:
        name = p.stdout.readline().strip()
        assert shm.sweep_owner(name) == []                       # alive: nothing removed
        p.stdin.write("go\n")
        p.stdin.flush()
        t = time.monotonic()
        removed = shm.sweep_owner(name, wait=5.0)
        assert time.monotonic() - t >= 0.3 and p.wait(5) == 0
        assert name.lstrip("/") in removed and any(n.startswith(shm.LOCK_PREFIX) for n in removed)
        assert _nothing_of(str(p.pid))
    finally:
        p.kill()
        p.wait()
        shm.sweep_stale()


def test_concurrent_sweeps_never_remove_a_live_owner():
    churn = subprocess.Popen([sys.executable, "-c", CHURN.format(root=ROOT, seconds=3)],
                             stdout=subprocess.PIPE, text=True)
    sweeps, deadline = 0, time.monotonic() + 60
    while churn.poll() is None and time.monotonic() < deadline:
        shm.sweep_stale()
        sweeps += 1
    bad, *pids = churn.communicate(timeout=60)[0].split()
    assert churn.returncode == 0 and len(pids) > 50 and sweeps > 50 and bad == "0", (bad, len(pids), sweeps)
    shm.sweep_stale()                                            # the dead owners' leftovers go
    assert all(_nothing_of(p) for p in pids)


def test_job_wakes_only_the_workers_it_uses():
    """active=1: worker 1 never sees the job (its GO and DONE words stay put); all-worker jobs reach it."""
    pool = WorkerPool(2, [])
    try:
        before = int(pool.words[C.done_word(1)])
        for _ in range(50):
            pool.run(C.CMD_PING, active=1)
        assert pool.words[C.done_word(0)] == pool.seq
        assert pool.words[C.done_word(1)] == before and C.go_seq(pool.words[C.go_word(1)]) == before
        pool.run(C.CMD_PING)
        assert pool.words[C.done_word(1)] == pool.seq
        with pytest.raises(ValueError, match="1..2 workers"):
            pool.run(C.CMD_PING, active=3)
    finally:
        pool.close()


def test_pool_maps_one_session_at_a_time():
    """Two sessions on one pool (a context and a call, or two contexts): opening or continuing one
    maps it in the workers and unmaps the other, whose segment stays; closing unlinks both."""
    import torch

    from hetero.cpu_attention.planner import StaticPlanner
    from hetero.model_spec import ModelSpec
    from hetero.offload.session import KVSession

    spec = ModelSpec(model_type="t", layers=1, q_heads=2, kv_heads=1, head_dim=16, dtype=torch.float32,
                     max_positions=None, sliding=(False,))
    before = set(_ours())
    pool = WorkerPool(1, [])
    try:
        first = KVSession(pool, spec, pads=[0], real_lens=[4], cap=40)
        second = KVSession(pool, spec, pads=[0], real_lens=[4], cap=40)
        assert pool.session is second and second.opened and not first.opened
        first.begin_call(pool, StaticPlanner(1))
        assert pool.session is first and first.opened and not second.opened
        second.close()                                   # not mapped: no worker job, just unlinked
        assert pool.session is first
        first.close()
        assert pool.session is None
    finally:
        pool.close()
    assert set(_ours()) <= before


def _pmd_mapped_kb(name):
    """kB of segment `name` this process maps with 2 MB page-table entries (from smaps)."""
    kb, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            if "-" in line.split(" ", 1)[0]:          # a mapping's header line
                inside = line.rstrip().endswith(name[1:])
            elif inside and line.startswith("ShmemPmdMapped:"):
                kb += int(line.split()[1])
    return kb


def _map_and_report(name, q):
    seg = shm.Segment(name)
    a = seg.array(0, (seg.size,), np.uint8)
    q.put((int(a[::4096].sum()), _pmd_mapped_kb(name)))
    del a
    seg.close()


@pytest.mark.skipif(shm.shmem_huge_pages() not in ("advise", "within_size", "always", "force"),
                    reason="/dev/shm has no transparent huge pages (mount -o remount,huge=advise /dev/shm)")
def test_large_segments_are_mapped_with_huge_pages_in_every_process():
    seg = shm.Segment(shm.new_name("huge"), 16 << 20, create=True)
    try:
        a = seg.array(0, (seg.size,), np.uint8)
        a[:] = 1                                   # the owner faults the pages in, as prefill does
        # (>= half: the kernel falls back to 4 KB pages where it finds no free 2 MB one)
        assert _pmd_mapped_kb(seg.name) >= 8 << 10
        q = mp.get_context("spawn").Queue()
        p = mp.get_context("spawn").Process(target=_map_and_report, args=(seg.name, q))
        p.start()
        total, child_kb = q.get(timeout=60)
        p.join(10)
        assert p.exitcode == 0
        assert total == (16 << 20) // 4096 and child_kb >= 8 << 10     # a worker reads through 2 MB pages too
        del a
    finally:
        seg.close()


def test_big_kv_arena_on_small_pages_warns_once(monkeypatch):
    monkeypatch.setattr(shm, "_warned_small_pages", False)
    monkeypatch.setattr(shm, "shmem_huge_pages", lambda: "never")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        shm.warn_if_small_pages(64 << 20)           # small: no warning
        shm.warn_if_small_pages(4 << 30)
        shm.warn_if_small_pages(4 << 30)            # once per process
    assert len(seen) == 1 and "huge=advise" in str(seen[0].message)
    monkeypatch.setattr(shm, "_warned_small_pages", False)
    monkeypatch.setattr(shm, "shmem_huge_pages", lambda: "advise")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        shm.warn_if_small_pages(4 << 30)
    assert not seen


def test_owner_lock_taken_again_when_its_file_is_removed():
    """A process whose lock file was removed (a careless rm, or its fd closed) must not keep naming
    segments under an owner key nobody holds: such segments would be swept as a dead owner's.
    (In a child process: the test's own segments keep their lock.)"""
    code = textwrap.dedent("""
        import os
        from hetero.ipc import shm
        first = shm.new_name("probe").split("_")[2]
        key = shm._owner[1]
        os.unlink(os.path.join(shm.SHM_DIR, shm.LOCK_PREFIX + key))
        second = shm.new_name("probe").split("_")[2]
        assert shm._owner[1] != key and first != second, (first, second)
        assert os.path.exists(os.path.join(shm.SHM_DIR, shm.LOCK_PREFIX + shm._owner[1]))
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "ok", out.stderr


def test_workers_import_the_parents_hetero_not_one_in_its_working_directory(tmp_path, monkeypatch):
    """`python -m` puts the working directory first on a child's import path: a parent running
    beside another copy of hetero (an old checkout) must still start workers of its own code, and
    a relative NUMBA_CACHE_DIR or PYTHONPATH keeps meaning the parent's directory."""
    (tmp_path / "hetero" / "ipc").mkdir(parents=True)
    (tmp_path / "hetero" / "__init__.py").write_text("raise ImportError('the other copy of hetero')\n")
    (tmp_path / "hetero" / "ipc" / "__init__.py").write_text("")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(["."] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    from hetero.ipc.pool import child_env

    env = child_env()
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(tmp_path)
    pool = WorkerPool(1, [0], start_timeout=60)
    try:
        pool.run(C.CMD_PING, timeout=10)
    finally:
        pool.close()


def _maps_of_ours(pid):
    """The hetero shared-memory segments process `pid` maps."""
    with open(f"/proc/{pid}/maps") as f:
        return [line for line in f if "/dev/shm/" + shm.PREFIX in line]


def _until(check, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_reused_workers_serve_the_next_pool_and_map_nothing_while_idle(monkeypatch):
    """With reuse on, a cleanly closed pool's workers wait, mapping nothing, and the next pool of
    the same environment starts on them (pinned anew); a broken pool's are not kept, nor are
    workers of another environment taken."""
    from hetero.ipc import pool as P

    monkeypatch.setattr(P, "REUSE", True)
    monkeypatch.setattr(P, "_idle", [])
    everything = os.sched_getaffinity(0)
    first = WorkerPool(2, [0])
    try:
        first.run(C.CMD_PING)
        pids = [p.pid for p in first.procs]
        assert all(psutil.Process(pid).cpu_affinity() == [0] for pid in pids)
    finally:
        first.close()
    assert not os.path.exists("/dev/shm" + first.ctrl.name)
    assert all(p.poll() is None for p in first.procs) and len(P._idle) == 2
    assert _until(lambda: not any(_maps_of_ours(pid) for pid in pids))
    t0 = time.perf_counter()
    second = WorkerPool(2, [])
    try:
        assert time.perf_counter() - t0 < 0.3           # no interpreter started
        assert sorted(p.pid for p in second.procs) == sorted(pids) and not P._idle
        assert all(set(psutil.Process(pid).cpu_affinity()) == everything for pid in pids)
        for _ in range(20):
            second.run(C.CMD_PING)
        second.procs[0].kill()
        second.procs[0].wait()
        with pytest.raises(WorkerDiedError):
            second.run(C.CMD_PING)
    finally:
        second.close()
    assert not P._idle and all(p.poll() is not None for p in second.procs)   # a broken pool's: gone
    monkeypatch.setenv("HETERO_TEST_OTHER_ENV", "1")
    third = WorkerPool(1, [])
    third.close()
    monkeypatch.delenv("HETERO_TEST_OTHER_ENV")
    fourth = WorkerPool(1, [])
    try:
        assert fourth.procs[0].pid != third.procs[0].pid      # third's environment is not this one's
    finally:
        fourth.close()
    assert len(P._idle) == 2
    P._retire_idle()
    assert all(p.poll() is not None for p in third.procs + fourth.procs)


def test_an_idle_worker_stopped_or_killed_is_not_handed_to_the_next_pool(monkeypatch):
    """An idle worker SIGKILLed or SIGSTOPped while idle: the next pool starts at once on a fresh
    worker (the stopped one is killed), not after start_timeout."""
    import signal

    from hetero.ipc import pool as P

    monkeypatch.setattr(P, "REUSE", True)
    monkeypatch.setattr(P, "_idle", [])
    for sig in (signal.SIGKILL, signal.SIGSTOP):
        first = WorkerPool(1, [])
        first.close()
        victim = first.procs[0]
        os.kill(victim.pid, sig)
        if sig == signal.SIGKILL:
            victim.wait()
        t0 = time.perf_counter()
        nxt = WorkerPool(1, [], start_timeout=30)
        try:
            assert nxt.procs[0].pid != victim.pid and time.perf_counter() - t0 < 10
            nxt.run(C.CMD_PING)
        finally:
            nxt.close()
        assert victim.poll() is not None
    P._retire_idle()


def test_a_reused_unpinned_worker_takes_the_parents_cores_of_now(monkeypatch):
    """An unpinned worker spawned while the parent ran on one core, reused once the parent runs on
    all: it runs on all (the cores of its new pool's parent, not those it was born with)."""
    from hetero.ipc import pool as P

    everything = os.sched_getaffinity(0)
    if len(everything) < 2:
        pytest.skip("needs two cores")
    monkeypatch.setattr(P, "REUSE", True)
    monkeypatch.setattr(P, "_idle", [])
    os.sched_setaffinity(0, {min(everything)})
    try:
        first = WorkerPool(1, [])
        first.close()
    finally:
        os.sched_setaffinity(0, everything)
    assert psutil.Process(first.procs[0].pid).cpu_affinity() == [min(everything)]
    second = WorkerPool(1, [])
    try:
        assert second.procs[0].pid == first.procs[0].pid
        assert set(psutil.Process(second.procs[0].pid).cpu_affinity()) == everything
    finally:
        second.close()
    P._retire_idle()


def test_a_forked_child_does_not_take_its_parents_idle_workers(monkeypatch):
    from hetero.ipc import pool as P

    monkeypatch.setattr(P, "REUSE", True)
    monkeypatch.setattr(P, "_idle", [])
    first = WorkerPool(1, [])
    first.close()
    assert len(P._idle) == 1
    lock = P._idle_lock
    pid = os.fork()
    if pid == 0:                                   # the child: nothing of its parent's list or lock
        os._exit(0 if not P._idle and P._idle_lock is not lock else 1)
    assert os.waitpid(pid, 0)[1] == 0
    assert len(P._idle) == 1 and first.procs[0].poll() is None
    P._retire_idle()


IDLE_OWNER = """
import os, signal, sys
sys.path.insert(0, {root!r})
from hetero.ipc.pool import WorkerPool
pool = WorkerPool(2, [])
pool.close()
print(os.getpid(), *[p.pid for p in pool.procs], flush=True)
if sys.argv[1] == "killed":
    os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.parametrize("how", ["exits", "killed"])
def test_idle_workers_leave_with_their_parent(how):
    env = dict(os.environ, HETERO_REUSE_WORKERS="1")
    out = subprocess.run([sys.executable, "-c", IDLE_OWNER.format(root=ROOT), how], capture_output=True,
                         text=True, env=env)
    assert out.returncode == (0 if how == "exits" else -9), out.stderr
    pids = [int(x) for x in out.stdout.split()[1:]]
    assert len(pids) == 2
    gone = lambda pid: not psutil.pid_exists(pid) or psutil.Process(pid).status() == "zombie"  # noqa: E731
    assert _until(lambda: all(map(gone, pids)), 5.0)
    owner = out.stdout.split()[0]
    assert _until(lambda: _nothing_of(owner), 10.0), [     # the killed one's lock too (what is left, if not)
        n for n in shm.list_ours() if n.startswith((f"{shm.PREFIX}{owner}_", f"{shm.LOCK_PREFIX}{owner}_"))]
