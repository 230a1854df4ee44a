"""POSIX shared-memory segments with hygiene.

Names look like `/hetero_<pid>_<key>_<n>_<tag>`, <key> = `o` + 8 random hex digits. The
process that creates a segment alone unlinks it (`Segment.close`, and at exit any it left).
Before its first segment a process creates its *owner lock* `/hetero_lock_<pid>_<key>` and
holds an exclusive flock on it for as long as it lives: the kernel drops the lock when the
process dies, however it dies. `sweep_stale` removes an owner's segments only when it can take
that lock itself (or the lock is gone): the owner is then provably dead. The <pid> is only a
hint for humans and tests: across PID namespaces (containers sharing /dev/shm) it means
nothing, so it never decides anything. Names of any other shape are never touched.
"""
import atexit
import fcntl
import itertools
import mmap
import os
import re
import secrets
import threading
import time
import warnings

import numpy as np
import posix_ipc

SHM_DIR = "/dev/shm"   # where Linux keeps POSIX shared memory (shm_open names)
PREFIX = "hetero_"
LOCK_PREFIX = PREFIX + "lock_"       # not `hetero_<pid>_`: counting an owner's segments skips its lock
_KEY = r"\d+_o[0-9a-f]{8}"            # <pid>_o<nonce>
_SEG_RE = re.compile(rf"^{PREFIX}({_KEY})_[0-9a-f]+_\w+$")
_LOCK_RE = re.compile(rf"^{LOCK_PREFIX}({_KEY})$")
_counter = itertools.count()
_owner = None   # (pid, key, fd) of this process's owner lock, once it has taken one
_owner_mutex = threading.Lock()


def new_name(tag):
    """A fresh segment name for this process (creating its owner lock first, see the module doc)."""
    return f"/{PREFIX}{_owner_key()}_{next(_counter):x}_{tag}"


def _owner_key():
    """This process's <pid>_<key>, taking its owner lock the first time (again after a fork)."""
    global _owner
    pid, own = os.getpid(), _owner
    if own and own[0] == pid and _same_file(own[2], os.path.join(SHM_DIR, LOCK_PREFIX + own[1])):
        return own[1]
    with _owner_mutex:
        if _owner and _owner[0] == pid and not _same_file(_owner[2], os.path.join(SHM_DIR, LOCK_PREFIX + _owner[1])):
            _owner = None   # our lock file was removed, or our fd closed under us: take a new lock (the
            #                 old fd is left alone: its number may belong to another file by now)
        while not (_owner and _owner[0] == pid):
            key = f"{pid}_o{secrets.token_hex(4)}"
            path = os.path.join(SHM_DIR, LOCK_PREFIX + key)
            try:   # O_CLOEXEC: processes we exec (the workers) never hold it
                fd = os.open(path, os.O_RDONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
            except FileExistsError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                ours = _same_file(fd, path)
            except BlockingIOError:   # a sweeper opened it before we locked it: it will unlink it
                ours = False
            except BaseException:
                os.close(fd)
                raise
            if ours:   # locked and still under its name: no sweeper can take it from now on
                _owner = (pid, key, fd)
            else:      # a sweeper took it for a dead owner's lock and unlinked it: pick another name
                os.close(fd)
        return _owner[1]


def _same_file(fd, path):
    try:
        a, b = os.fstat(fd), os.stat(path, follow_symlinks=False)
    except OSError:          # gone, or fd no longer open
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _release_owner_lock():
    """At exit: unlink the segments this process still owns, then its lock (the last of its names)."""
    global _owner
    with _owner_mutex:
        if not (_owner and _owner[0] == os.getpid()):
            return
        _, key, fd = _owner
        _owner = None
        for n in list_ours():
            if n.startswith(f"{PREFIX}{key}_"):
                _remove(SHM_DIR, n)
        _remove(SHM_DIR, LOCK_PREFIX + key)
        os.close(fd)


def release_owner_lock():
    """What exit does, now: for a process whose end skips the exit handlers (a Ray actor is ended
    with os._exit after its __del__). Its later segments take a new lock."""
    _release_owner_lock()


def _forget_parent_lock():
    """In a forked child: drop the inherited descriptor of the parent's lock (closing it does not
    release the parent's flock; unlocking would), so the child takes its own lock and names."""
    global _owner, _owner_mutex
    _owner_mutex = threading.Lock()
    if _owner:
        os.close(_owner[2])
    _owner = None


# registered at import, so it runs after the exit handlers of pools and sessions (LIFO)
atexit.register(_release_owner_lock)
os.register_at_fork(after_in_child=_forget_parent_lock)


class Segment:
    """A mapped shared-memory segment. `create=True` only in the parent."""

    def __init__(self, name, size=0, create=False):
        self.name = name
        self.owner = create
        self.pid = os.getpid()   # a forked child's copy must not unlink its parent's segment
        if create:
            shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600, size=max(int(size), 1))
        else:
            shm = posix_ipc.SharedMemory(name)
        try:
            self.size = shm.size
            self.mm = mmap.mmap(shm.fd, shm.size)
            _advise_huge(self.mm)
        except BaseException:
            if create:
                shm.unlink()
            raise
        finally:
            shm.close_fd()

    def array(self, offset, shape, dtype):
        """A numpy view of `shape`/`dtype` starting at byte `offset`."""
        dtype = np.dtype(dtype)
        count = int(np.prod(shape, dtype=np.int64))
        if offset + count * dtype.itemsize > self.size:
            raise ValueError(f"view [{offset}, +{count * dtype.itemsize}) exceeds segment {self.name} of {self.size} bytes")
        return np.frombuffer(self.mm, dtype=dtype, count=count, offset=offset).reshape(shape)

    def close(self):
        """Unmap; the owner also unlinks. Idempotent. Views still alive keep the mapping until freed."""
        mm, self.mm = self.mm, None
        if mm is not None:
            try:
                mm.close()
            except BufferError:   # a numpy/torch view still references it: the memory stays mapped
                warnings.warn(f"shared segment {self.name} is still referenced by a view and stays mapped "
                              f"({self.size} bytes) until that view is freed", ResourceWarning, stacklevel=2)
        self.unlink()

    def unlink(self):
        """The owner: remove the name now (the mappings stay until closed). Idempotent."""
        if self.owner:
            self.owner = False
            if os.getpid() == self.pid:
                unlink(self.name)


HUGE_PAGE = 2 << 20
THP_SHMEM = "/sys/kernel/mm/transparent_hugepage/shmem_enabled"


def _advise_huge(mm):
    """Ask for 2 MB pages on segments that can hold one. Every process that maps the segment
    asks: the kernel maps huge pages only into areas that asked. Over 4 KB pages a streaming
    read of the KV cache loses 15-35% (measured on Zen 4 and the H100 host): the hardware prefetchers stop at
    each page boundary. Honoured when shmem_huge_pages() is advise, within_size or always."""
    if len(mm) >= HUGE_PAGE and hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            mm.madvise(mmap.MADV_HUGEPAGE)
        except OSError:
            pass


def shmem_huge_pages():
    """The transparent-huge-page policy of POSIX shared memory: the huge= option of the
    /dev/shm tmpfs mount ("never" when absent; enable with
    `mount -o remount,huge=advise /dev/shm`), unless the system-wide shmem_enabled
    overrides every mount ("deny" or "force"). None when it cannot be read."""
    try:
        with open(THP_SHMEM) as f:
            system = next((w[1:-1] for w in f.read().split() if w.startswith("[")), None)
        if system in ("deny", "force"):
            return system
        policy = None
        with open("/proc/mounts") as f:
            for line in f:           # the last mount on /dev/shm is the one in effect
                fields = line.split()
                if len(fields) >= 4 and fields[1] == SHM_DIR:
                    policy = dict(o.partition("=")[::2] for o in fields[3].split(",")).get("huge", "never")
        return policy
    except OSError:
        return None


def free_bytes():
    """Free bytes of the tmpfs behind POSIX shared memory (SHM_DIR), or None when unknown. A
    segment larger than this is created but dies of SIGBUS on first touch (Docker's 64 MB)."""
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


_warned_small_pages = False


def warn_if_small_pages(nbytes, threshold=1 << 30):
    """Once per process: warn that a KV arena of `nbytes` (>= threshold) will sit on 4 KB pages."""
    global _warned_small_pages
    if _warned_small_pages or nbytes < threshold:
        return
    policy = shmem_huge_pages()
    if policy not in ("never", "deny"):
        return
    _warned_small_pages = True
    warnings.warn(f"the {nbytes / 2**30:.1f} GiB KV cache sits on 4 KB pages (/dev/shm huge pages: "
                  f"{policy}); decode attention reads it 15-30% slower than from 2 MB pages. "
                  "Enable them with: mount -o remount,huge=advise /dev/shm", RuntimeWarning, stacklevel=3)


MADV_POPULATE_WRITE = 23        # Linux 5.14+ (mmap lacks the constant before Python 3.13)


def populate(mm, start, nbytes):
    """Fault in the pages of mm[start:start + nbytes] (start page-aligned) without changing their
    contents: MADV_POPULATE_WRITE, or on an older kernel a read of one byte per page (a shared
    memory page is allocated on its first read too)."""
    if nbytes <= 0:
        return
    try:
        mm.madvise(MADV_POPULATE_WRITE, start, nbytes)
    except OSError:
        page = mmap.PAGESIZE
        np.frombuffer(mm, np.uint8, count=nbytes, offset=start)[::page].max()


def pack(arrays, align=4096):
    """[(name, shape, dtype)] -> ({name: (byte offset, shape, dtype)}, total bytes); each array
    starts on an `align` boundary. Parent and workers derive the same offsets from the same list."""
    off, out = 0, {}
    for name, shape, dt in arrays:
        out[name] = (off, shape, dt)
        off = (off + int(np.prod(shape, dtype=np.int64)) * np.dtype(dt).itemsize + align - 1) // align * align
    return out, off


def views(segment, packed):
    """name -> numpy view into `segment` for a `pack` result."""
    offs, total = packed
    if total > segment.size:
        raise ValueError(f"segment {segment.name} has {segment.size} bytes, layout needs {total}")
    return {n: segment.array(o, s, d) for n, (o, s, d) in offs.items()}


def unlink(name):
    try:
        posix_ipc.unlink_shared_memory(name)
    except posix_ipc.ExistentialError:
        pass


def _remove(shm_dir, n):
    try:
        os.unlink(os.path.join(shm_dir, n))
        return True
    except (FileNotFoundError, PermissionError):   # gone already, or another user's
        return False


def list_ours(shm_dir=SHM_DIR):
    """Every hetero name in `shm_dir`: segments and owner locks."""
    try:
        return sorted(n for n in os.listdir(shm_dir) if n.startswith(PREFIX))
    except FileNotFoundError:
        return []


def _sweep_owner(key, names, shm_dir):
    """Unlink owner `key`'s segments among `names`, then its lock, if the owner is provably dead."""
    lock = LOCK_PREFIX + key
    try:
        fd = os.open(os.path.join(shm_dir, lock), os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except FileNotFoundError:
        fd = None   # an owner creates its lock before its first segment and unlinks it last
        #             (or a sweeper did, having proved it dead): dead
    except OSError:
        return []   # cannot look (another user's): cannot prove anything
    try:
        if fd is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                return []   # held: the owner lives, whatever its pid means in this namespace
            # ours now: the owner is dead (it never created any name after dying), and any other
            # sweeper waits on it; an owner that had created the lock but not locked it yet finds
            # it unlinked once we release it and picks another name
        prefix = f"{PREFIX}{key}_"
        removed = [n for n in names if n.startswith(prefix) and _remove(shm_dir, n)]
        if fd is not None and _same_file(fd, os.path.join(shm_dir, lock)) and _remove(shm_dir, lock):
            removed.append(lock)   # unlinked while we hold it; closing releases it
        return removed
    finally:
        if fd is not None:
            os.close(fd)


def sweep_stale(shm_dir=SHM_DIR):
    """Unlink the segments (and locks) of owners that are provably dead. Returns the names removed.
    Names that appear after the listing are left for the next sweep."""
    names = list_ours(shm_dir)
    owners = {m.group(1) for n in names for m in [_SEG_RE.match(n) or _LOCK_RE.match(n)] if m}
    own = _owner
    if own and own[0] == os.getpid():
        owners.discard(own[1])   # we are alive
    removed = []
    for key in sorted(owners):
        removed += _sweep_owner(key, names, shm_dir)
    return removed


def sweep_owner(name, shm_dir=SHM_DIR, wait: float = 0.0):
    """Remove all names of the owner of segment `name` (with or without its leading "/") if that
    owner is provably dead; for a worker whose parent died. Returns the names removed. wait: try
    again for up to that many seconds while the owner's lock is still there (held by an owner
    that is still dying, or by another sweeper)."""
    m = _SEG_RE.match(name.lstrip("/"))
    if not m:
        return []
    removed, deadline = [], time.monotonic() + wait
    while True:
        removed += _sweep_owner(m.group(1), list_ours(shm_dir), shm_dir)
        if not os.path.exists(os.path.join(shm_dir, LOCK_PREFIX + m.group(1))) or time.monotonic() >= deadline:
            return removed
        time.sleep(0.05)
