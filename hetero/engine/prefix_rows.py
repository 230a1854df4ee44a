"""Cached prefixes' rows kept on the model's device, in row layout, for the prompt chunks that
continue them.

A question over a pinned or prefix-cached document is a prompt chunk after thousands of cached
rows. Its attention on the model's device needs those rows as [Hkv, rows, D]; the pool holds them
in the kernel's block layout (hetero.offload.arena), so without this cache every such chunk reads
them back at every layer: a transposing copy on the CPU (a 4K document ~26 ms a question in bf16
on the 2-core VM), a gather on the host and a copy over PCIe on a GPU. PrefixRows keeps the rows
of prefixes found in the prefix cache, keyed by the chained hash of their last whole block
(kv_pool.block_hash: the tokens and the adapter), and checked at every use against the blocks
they were read from: the same block ids, each still holding what it held then (BlockPool.born:
a block taken again is new content, which may be the same tokens computed again with other
bits). A prefix gets an entry when its blocks are pinned or when it is seen a second time (a
conversation's turns, each a new prefix, would only push documents out); a document pinned in
several chunks gets one from its prompt's stage (runner.PrefillStage) as its last chunk ends; least recently used
entries go first under a bytes budget (EngineConfig.prefix_rows_memory), never one a chunk of
the current step holds, and none for an entry that would not fit even then.

Each entry has room for `slack` rows after the prefix: a chunk writes its own rows there and
attends over one view of prefix + chunk (no copy of the prefix). The chunks of one step run one
after the other on one device stream, so two chunks continuing the same prefix in a step reuse
the room in turn. A chunk longer than the room gets a copy of the prefix and its rows.

  object            written by                          read by
  PrefixRows        ModelRunner.execute (find)          ModelRunner.execute
  _Rows.layers[l]   StepAttention.attend (layer l, the  StepAttention.attend (later chunks over
                    first chunk over it: read back), or the same prefix, any step)
                    ModelRunner.execute (a pin's stage)
  its rows >= n     StepAttention.attend (each chunk's  that chunk's attention, right after
                    own rows: scratch)
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import numpy as np
import torch

SLACK = 256                 # rows of room after an entry's prefix (a question; longer chunks copy)
SEEN = 4096                 # prefixes remembered as seen once


class _Rows:
    """One prefix's rows on the device: per layer (K, V) [Hkv, n + slack, D], filled at first use."""

    def __init__(self, n: int, size: int, blocks: np.ndarray, born: np.ndarray):
        self.n, self.size = n, size       # prefix rows; rows allocated (prefix + room)
        self.blocks, self.born = blocks, born   # the pool blocks read, and BlockPool.born of each then
        self.step = -1                    # the last step a chunk was handed it
        self.layers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def fill(self, layer: int, k: torch.Tensor, v: torch.Tensor, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `layer`'s buffers, on like's device in its dtype, given the first n rows of k/v
        [Hkv, >= n, D] (copied there); kept only once filled (a step may raise before)."""
        Hkv, _, D = k.shape
        K, V = like.new_empty(Hkv, self.size, D), like.new_empty(Hkv, self.size, D)
        K[:, :self.n], V[:, :self.n] = k[:, :self.n], v[:, :self.n]
        self.layers[layer] = (K, V)
        return K, V


class PrefixRows:
    """Rows of prefix-cached prompts on the model's device (a bytes budget, least recently used out)."""

    def __init__(self, spec, budget: int, slack: int = SLACK, layers: int | None = None):
        """layers: how many layers an entry fills (None: spec.layers; a windowed layer with a pool
        of its own reads its rows back instead)."""
        self.budget, self.used, self.slack = budget, 0, slack
        layers = spec.layers if layers is None else layers
        self.row_bytes = 2 * layers * spec.kv_heads * spec.head_dim * torch.finfo(spec.dtype).bits // 8
        self.entries: OrderedDict[bytes, _Rows] = OrderedDict()
        self.seen: OrderedDict[bytes, None] = OrderedDict()
        self.step = 0
        self.hits = self.misses = self.stale = 0   # chunks served from an entry / entries made / dropped as stale

    def begin_step(self) -> None:
        self.step += 1

    def find(self, key: bytes, blocks: Sequence[int], pool) -> _Rows | None:
        """The entry of the prefix in `blocks` (pool: their BlockPool), its last block hashed `key`:
        the one kept when it still matches the pool, else a new one when the prefix is pinned or
        was seen before and it fits the budget, else None (read back)."""
        ids = np.asarray(blocks, dtype=np.int64)
        born = pool.born[ids]
        e = self.entries.get(key)
        if e is not None:
            if np.array_equal(e.blocks, ids) and np.array_equal(e.born, born):
                self.entries.move_to_end(key)
                e.step = self.step
                self.hits += 1
                return e
            self._drop(key)                   # made again below: its prefix was used before
            self.stale += 1
        elif not pool.pins[ids[-1]] and key not in self.seen:
            self._saw(key)
            return None
        return self._make(key, ids, born, pool)

    def adopt(self, key: bytes, blocks: Sequence[int], pool) -> _Rows | None:
        """A new entry for a document being pinned, whose rows the caller has on the device already
        (its prompt's stage): None when one is kept for it or it does not fit."""
        if key in self.entries:
            return None
        ids = np.asarray(blocks, dtype=np.int64)
        return self._make(key, ids, pool.born[ids], pool)

    def _make(self, key: bytes, ids: np.ndarray, born: np.ndarray, pool) -> _Rows | None:
        n = len(ids) * pool.block_size
        size = n + self.slack
        held = sum(x.size for x in self.entries.values() if x.step == self.step) * self.row_bytes
        if held + size * self.row_bytes > self.budget:
            return None                   # no room without what this step's chunks hold: nothing evicted
        while self.used + size * self.row_bytes > self.budget:
            old = next(iter(self.entries))            # the least recently used (this step's are the newest)
            self._drop(old)
            self._saw(old)                            # kept again at its next sighting
        self.seen.pop(key, None)
        e = self.entries[key] = _Rows(n, size, ids, born)
        e.step = self.step
        self.used += size * self.row_bytes
        self.misses += 1
        return e

    def _saw(self, key: bytes) -> None:
        self.seen[key] = None
        if len(self.seen) > SEEN:
            self.seen.popitem(last=False)

    def _drop(self, key: bytes) -> None:
        self.used -= self.entries.pop(key).size * self.row_bytes

    def clear(self) -> None:
        self.entries.clear()
        self.seen.clear()
        self.used = 0
