"""POSIX shared-memory segments with hygiene.

Names look like `/hetero_<pid>_<nonce>_<tag>`: <pid> is the process that
created (and alone unlinks) the segment, so a new process can tell which
segments were left behind by a dead parent and remove them (`sweep_stale`).
"""
import itertools
import mmap
import os
import re
import secrets
import warnings

import numpy as np
import posix_ipc

PREFIX = "hetero_"
_NAME_RE = re.compile(r"^hetero_(\d+)_[0-9a-f]+_\w+$")
_counter = itertools.count()
_nonce = secrets.token_hex(3)


def new_name(tag):
    return f"/{PREFIX}{os.getpid()}_{_nonce}{next(_counter):x}_{tag}"


class Segment:
    """A mapped shared-memory segment. `create=True` only in the parent."""

    def __init__(self, name, size=0, create=False):
        self.name = name
        self.owner = create
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
        if self.owner:
            self.owner = False
            unlink(self.name)


HUGE_PAGE = 2 << 20
SHM_DIR = "/dev/shm"
THP_SHMEM = "/sys/kernel/mm/transparent_hugepage/shmem_enabled"


def _advise_huge(mm):
    """Ask for 2 MB pages on segments that can hold one. Every process that maps the segment
    asks: the kernel maps huge pages only into areas that asked. Over 4 KB pages a streaming
    read of the KV cache loses 20-35% (measured on Zen 4): the hardware prefetchers stop at
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


def _pid_alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def list_ours(shm_dir="/dev/shm"):
    try:
        return sorted(n for n in os.listdir(shm_dir) if n.startswith(PREFIX))
    except FileNotFoundError:
        return []


def sweep_stale(shm_dir="/dev/shm"):
    """Unlink segments whose creating process no longer exists. Returns the names removed."""
    removed = []
    for n in list_ours(shm_dir):
        m = _NAME_RE.match(n)
        if m and not _pid_alive(int(m.group(1))):
            unlink("/" + n)
            removed.append(n)
    return removed
