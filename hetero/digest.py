"""Weight digests that see every element: what tells a model's weights from another's (or from
what they were), down to one element of one embedding row. The staleness key of live contexts
(offload.registry.weights_key) and the fingerprint of saved ones (offload.saved) are built on it.

A weight's digest is a weighted sum of its bits: its elements viewed as integers (4-byte and
smaller dtypes widened to int32, 8-byte ones as int64), each times a fixed odd pseudo-random
weight of its position in a block of BLOCK elements (wrapping), summed per block in int64; the
block sums are combined with odd pseudo-random weights of their own, mod 2**64. An odd weight is
invertible mod 2**32, so a change of any one element changes its product and the digest; several
changes (swapped rows) cancel out only by accident. Exact integer ops on the weight's own device
(torch's; numpy's on a CPU, where they run faster): a GPU model is never copied to the host, and
any device gives the digest any other gives.

Each weight is digested once per version: the digest is kept per tensor under its storage
address, in-place version counter, dtype, shape, strides and device, and computed again when
one of them changes. A tensor without a version counter (an inference tensor, made under
torch.inference_mode: its in-place writes are tracked by nothing) is digested at every call.
Writes through `.data` or numpy bypass the version counter too: those the digest misses while
its key holds (the callers add a few sampled values to theirs).
"""
import functools
import weakref

import numpy as np
import torch

BLOCK = 1 << 16           # elements per block (its position weights are cached per device)
_INTS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_cache = {}               # id(tensor) -> (key, digest); an entry goes with its tensor (weakref.finalize)


def weight_digest(t):
    """A 64-bit digest (an int) of every element of tensor `t` (see the module doc)."""
    key = _key(t)
    kept = _cache.get(id(t))
    if key is not None and kept is not None and kept[0] == key:
        return kept[1]
    d = _digest(t)
    if key is not None:
        if id(t) not in _cache:
            weakref.finalize(t, _cache.pop, id(t), None)
        _cache[id(t)] = (key, d)
    return d


def _key(t):
    """What changes when t's contents may have (None: nothing tells, an inference tensor)."""
    try:
        return t.data_ptr(), t._version, t.dtype, tuple(t.shape), t.stride(), t.device
    except RuntimeError:
        return None


def _digest(t, torch_ops=False):
    """torch_ops: a CPU tensor through torch's ops too, as a GPU's (for tests: the two agree)."""
    x = t.detach().reshape(-1)
    x = x.view(_INTS.get(x.element_size(), torch.int64))
    w = _position_weights(x.device, torch.int64 if x.element_size() == 8 else torch.int32)
    cpu = x.device.type == "cpu" and not torch_ops
    group = BLOCK * (16 if cpu else 256)   # blocks per op: a few MB stay in a CPU's caches
    n = x.numel() - x.numel() % BLOCK
    parts = [x[a:min(a + group, n)].view(-1, BLOCK) for a in range(0, n, group)]
    if n < x.numel():                      # the last block, short: as if padded with zeros
        parts.append(x[n:].view(1, -1))
    if not parts:
        return 0
    if cpu:                                # numpy's int64 sums run several times faster than torch's here
        w = w.numpy()
        sums = np.concatenate([(p.numpy().astype(w.dtype, copy=False) * w[:p.shape[1]]).sum(1, dtype=np.int64)
                               for p in parts])
    else:                                  # int32 products wrap, as numpy's: exact, the same on any device
        with torch.no_grad():
            sums = torch.cat([(p.to(w.dtype) * w[:p.shape[1]]).sum(1) for p in parts]).cpu().numpy()
    return int((sums.view(np.uint64) * _odd(len(sums), 1 << 40)).sum(dtype=np.uint64))     # uint64 wraps


@functools.lru_cache(maxsize=None)
def _position_weights(device, dtype):
    z = _odd(BLOCK, 0)
    z = (z >> np.uint64(32)).astype(np.uint32).view(np.int32) | 1 if dtype == torch.int32 else z.view(np.int64)
    return torch.from_numpy(z).to(device)


def _odd(n, salt):
    """n odd pseudo-random uint64 (splitmix64 of salt + 0..n-1)."""
    z = (np.arange(n, dtype=np.uint64) + np.uint64(salt)) * np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return (z ^ (z >> np.uint64(31))) | np.uint64(1)
