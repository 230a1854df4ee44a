"""Bookkeeping of the paged KV pool: which request holds which 32-row block, and the prefix cache.

The pool's memory is one arena per model (K [layers, 1, Hkv, NBLOCKS, Dp, BK], V tiled likewise, so
each head's blocks are one C-contiguous array as the kernel's SIMD loops want; see
hetero.offload.arena for the per-block layout and kernel.run_job for reads through block tables):
block id b names rows [0, 32) of block b in every full-attention layer and kv head at once. The
kernel reads a scattered table at about half the speed of consecutive ids, runs of 8 at 0.86x
(bench/kernel_paged.py): BlockPool.take hands out the blocks of one allocation in ascending
order (in the seeded RAG-like mix of tests/test_engine_pool.py, 94 % of neighbouring table
entries are consecutive ids, 82 % in the order blocks came free). This module never touches that memory; it decides which ids each
request's rows go to.

  structure                      owned (written) by       read by
  BlockPool.refcount [N] int32   BlockPool                KVCacheManager, tests
  BlockPool.pins [N] int32       BlockPool (pin/unpin)    check_invariants; a Context's owner
  BlockPool.hashes, .cached      BlockPool                KVCacheManager (prefix lookups)
  BlockPool.free, .evictable     BlockPool                KVCacheManager (accounting)
  BlockPool.born [N] int64       BlockPool.take           PrefixRows (rows kept still the pool's)
  Request.block_table            KVCacheManager           the runner -> the workers (row j of a
                                                          request is in block table[j // 32])

Every block is exactly one of: free (in `free`, refcount 0, no hash), referenced (refcount > 0:
the block tables holding it plus its pins), or cached-evictable (refcount 0 with a hash, in the
LRU `evictable`). A new block comes from `free` first, then by evicting the least recently
released cached block (its hash forgotten). A block's hash is chained over all whole token
blocks up to it and the adapter name, so equal hashes mean equal KV; only whole blocks whose
rows are all computed are hashed, so the partial last block of a request is never shared.

A model whose every layer attends through the same sliding window of W keys keeps a ring per
request (KVCacheManager(window=W)): once no later token can see a block (its last row before the
window of the next row to compute), drop_out_of_window gives it back (to the prefix cache, as any
released block) and its table entry becomes -1, so a request holds at most the window's blocks
and a chunk's (peak_blocks), however long it runs. A Context's prompt (pin_prompt) keeps every
block: later requests start from it. A model that mixes windowed and full layers has two
managers, one per pool (hetero.engine.kv_hybrid).
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict, defaultdict, deque
from collections.abc import Iterable, Sequence

import numpy as np

from hetero.engine.request import Request

BLOCK_SIZE = 32   # rows per block: hetero.cpu_attention.simd.BK (not imported: it pulls numba in)


def block_hash(parent: bytes | None, tokens: Sequence[int], extra: str | None = None) -> bytes:
    """A stable 16-byte digest of a whole block of tokens after the block hashed `parent` (None:
    the first block), under adapter `extra` (None: the base model). Not Python's salted hash():
    the same on every process and run."""
    h = hashlib.blake2b(digest_size=16)
    h.update(b"\x00" if parent is None else b"\x01" + parent)
    h.update(len(tokens).to_bytes(4, "little"))
    h.update(np.asarray(tokens, dtype="<i8").tobytes())
    if extra is None:
        h.update(b"\x00")
    else:
        e = extra.encode()
        h.update(b"\x01" + len(e).to_bytes(4, "little") + e)
    return h.digest()


def request_hashes(request: Request, n: int, block_size: int = BLOCK_SIZE) -> list[bytes]:
    """The chained hashes of a request's first n whole token blocks (memoized on it), under its
    adapter (Request.adapter_key, else its name)."""
    hs, bs = request.block_hashes, block_size
    while len(hs) < n:
        i = len(hs)
        key = request.adapter if request.adapter_key is None else request.adapter_key
        hs.append(block_hash(hs[-1] if hs else None, request.tokens(i * bs, (i + 1) * bs), key))
    return hs[:n]


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise AssertionError(msg)


class BlockPool:
    """Block ids 0..num_blocks-1: refcounts, pins, hashes, the free list and the LRU of cached blocks."""

    def __init__(self, num_blocks: int, block_size: int = BLOCK_SIZE):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"a pool of {num_blocks} blocks of {block_size} rows")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.refcount = np.zeros(num_blocks, np.int32)      # block tables + pins holding it
        self.pins = np.zeros(num_blocks, np.int32)
        self.hashes: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}                  # hash -> the block holding that content
        self.free: deque[int] = deque(range(num_blocks))    # refcount 0, no hash
        self.evictable: OrderedDict[int, None] = OrderedDict()  # refcount 0, hashed; oldest first
        self.born = np.zeros(num_blocks, np.int64)         # when each block was last taken (a count of
        self._taken = 0                                     # takes): its content is the same while this is

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def num_evictable_blocks(self) -> int:
        return len(self.evictable)

    @property
    def num_available_blocks(self) -> int:
        """Blocks a new allocation can take: free, or cached and evictable."""
        return len(self.free) + len(self.evictable)

    @property
    def num_pinned_blocks(self) -> int:
        return int(np.count_nonzero(self.pins))

    def take(self, n: int) -> list[int]:
        """n new blocks (refcount 1, no hash): from the free list, then evicting the LRU's oldest;
        in ascending order (the kernel reads runs of consecutive ids faster: see the module doc)."""
        if n > self.num_available_blocks:
            raise ValueError(f"{n} blocks wanted, {self.num_available_blocks} available")
        out = []
        for _ in range(n):
            if self.free:
                b = self.free.popleft()
            else:
                b, _ = self.evictable.popitem(last=False)
                del self.cached[self.hashes[b]]
                self.hashes[b] = None
            self.refcount[b] = 1
            self._taken += 1
            self.born[b] = self._taken
            out.append(b)
        return sorted(out)

    def touch(self, blocks: Iterable[int]) -> None:
        """One more reference to each block (a cached one leaves the LRU)."""
        for b in blocks:
            if self.refcount[b] == 0:
                if b not in self.evictable:
                    raise ValueError(f"block {b} is free: its content is gone")
                del self.evictable[b]
            self.refcount[b] += 1

    def release(self, blocks: Iterable[int]) -> None:
        """One reference less to each block, in order: one that drops to 0 joins the LRU's young end
        if hashed (so the first released is evicted first), the free list otherwise."""
        for b in blocks:
            if self.refcount[b] <= 0:
                raise ValueError(f"block {b} released with refcount {self.refcount[b]}")
            self.refcount[b] -= 1
            if self.refcount[b] == 0:
                if self.hashes[b] is None:
                    self.free.append(b)
                else:
                    self.evictable[b] = None

    def clear_cache(self) -> int:
        """Forget every cached block nobody holds (the LRU's): they become free. Returns how many."""
        n = len(self.evictable)
        while self.evictable:
            b, _ = self.evictable.popitem(last=False)
            del self.cached[self.hashes[b]]
            self.hashes[b] = None
            self.free.append(b)
        return n

    def register(self, b: int, h: bytes) -> bool:
        """Make block b findable by hash h. False (nothing changes) when b already has a hash or
        another block holds h: a table is append-only, so the duplicate keeps its id, unhashed."""
        if self.hashes[b] is not None or h in self.cached:
            return False
        self.hashes[b] = h
        self.cached[h] = b
        return True

    def pin(self, blocks: Sequence[int]) -> None:
        """Hold each block like a block table would (never evicted) until unpin()."""
        for b in blocks:
            if self.refcount[b] == 0 and b not in self.evictable:
                raise ValueError(f"cannot pin block {b}: it is free")
        self.touch(blocks)
        for b in blocks:
            self.pins[b] += 1

    def unpin(self, blocks: Sequence[int]) -> None:
        for b in blocks:
            if self.pins[b] <= 0:
                raise ValueError(f"block {b} is not pinned")
        for b in blocks:
            self.pins[b] -= 1
        self.release(blocks)

    def check_invariants(self, expected_refcount: np.ndarray) -> None:
        """Raise AssertionError unless the pool is consistent and refcount == expected_refcount."""
        free, lru = set(self.free), set(self.evictable)
        _check(len(free) == len(self.free), f"duplicates in the free list {list(self.free)}")
        _check(not free & lru, f"blocks both free and evictable: {free & lru}")
        bad = np.flatnonzero(self.refcount != expected_refcount)
        _check(bad.size == 0, f"refcounts {self.refcount[bad]} of blocks {bad} != tables + pins "
                              f"{expected_refcount[bad]}")
        _check(bool((self.pins >= 0).all() and (self.pins <= self.refcount).all()), "pins out of range")
        for b in range(self.num_blocks):
            h = self.hashes[b]
            if self.refcount[b] > 0:
                _check(b not in free and b not in lru, f"referenced block {b} is free or evictable")
            elif h is not None:
                _check(b in lru, f"cached block {b} with refcount 0 is not in the LRU")
            else:
                _check(b in free, f"block {b} is nowhere: refcount 0, no hash, not free")
            if h is not None:
                _check(self.cached.get(h) == b, f"block {b}'s hash maps to {self.cached.get(h)}")
        _check(len(self.cached) == sum(h is not None for h in self.hashes), "hash map has stale entries")


class KVCacheManager:
    """Request-level view of a BlockPool (vLLM v1's split): prefix lookups, slot allocation,
    caching of completed blocks, freeing. The scheduler calls it; only it writes block tables."""

    def __init__(self, pool: BlockPool, window: int = 0, ring_pins: bool = False):
        """window: the sliding window every layer it serves shares (0: none, no ring). ring_pins:
        a Context's prompt rings too (the pin keeps its last window's blocks: HybridKVCacheManager's
        window pool)."""
        self.pool, self.block_size = pool, pool.block_size
        self.window = window
        self.ring_pins = ring_pins
        self.holders: dict[str, Request] = {}   # requests whose block_table holds blocks
        # whole prompt blocks a holder is computing and has not cached yet: hash -> its id (a request
        # whose prefix continues into one waits for it rather than computing it again: pending_prefix)
        self.promised: dict[bytes, str] = {}
        self.prefix_queries = 0                 # tokens looked up at admissions
        self.prefix_hits = 0                    # of them, found cached

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_evictable_blocks(self) -> int:
        return self.pool.num_evictable_blocks

    @property
    def num_used_blocks(self) -> int:
        """Blocks referenced by a table or a pin."""
        return self.pool.num_blocks - self.pool.num_available_blocks

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.pool.num_blocks

    def blocks_for(self, rows: int) -> int:
        return -(-rows // self.block_size)

    def rings(self, request: Request) -> bool:
        """Whether the request keeps a ring (a window every layer shares; not a Context's prompt,
        unless ring_pins)."""
        return bool(self.window) and (self.ring_pins or not request.pin_prompt)

    def peak_blocks(self, request: Request, chunk: int) -> int:
        """The most blocks the request holds at once when it computes at most `chunk` tokens a step:
        all of its rows' blocks, or under a ring the window's and a chunk's (and one more where
        they straddle block edges)."""
        n = self.blocks_for(request.max_rows)
        if not self.rings(request):
            return n
        pinning = int(request.pin_prompt)     # (ring_pins) it keeps what its pin will, a block more at most
        return min(n, self.blocks_for(self.window - 1 + chunk) + 1 + pinning)

    def first_in_window(self, rows: int) -> int:
        """The first block the window of row `rows` (the next token's, after `rows` computed ones)
        sees: every block before it is out of the window for good."""
        return max(rows - self.window + 1, 0) // self.block_size

    def drop_out_of_window(self, request: Request, keep: int | None = None) -> None:
        """Under a ring: give back the request's blocks that no token from num_computed_tokens on can
        see (every row before the window of that token's row), leaving -1 in their table entries;
        from block `keep` on none (a pin to come keeps them)."""
        if not self.rings(request):
            return
        first = self.first_in_window(request.num_computed_tokens)
        first = min(first, request.num_registered_blocks)      # only blocks offered to the cache go
        if keep is not None:
            first = min(first, keep)
        t = request.block_table
        if first > request.ring_start:
            self.pool.release(t[request.ring_start:first])
            t[request.ring_start:first] = [-1] * (first - request.ring_start)
            request.ring_start = first

    def hashes(self, request: Request, n: int) -> list[bytes]:
        """The chained hashes of the request's first n whole token blocks (memoized on it)."""
        return request_hashes(request, n, self.block_size)

    def num_cached_blocks(self, tokens: Sequence[int], adapter_key: str | None = None) -> int:
        """How many of the leading whole blocks of `tokens` (under the adapter of Engine.adapter_key)
        the cache holds: what a request starting with them would find (hetero serve --replicas asks
        before routing a document)."""
        h, n = None, 0
        for i in range(len(tokens) // self.block_size):
            h = block_hash(h, tokens[i * self.block_size:(i + 1) * self.block_size], adapter_key)
            if h not in self.pool.cached:
                break
            n += 1
        return n

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """(blocks, tokens): the longest cached prefix of whole blocks of a request not holding any,
        stopping short of its last token (which must be computed to give the step logits).
        Takes no reference: pass the blocks to allocate_slots before anything else allocates."""
        if request.block_table:
            raise ValueError(f"{request.request_id!r} already holds blocks {request.block_table}")
        out = []
        for h in self.hashes(request, (request.num_tokens - 1) // self.block_size):
            b = self.pool.cached.get(h)
            if b is None:
                break
            out.append(b)
        return out, len(out) * self.block_size

    def pending_prefix(self, request: Request, num_cached_blocks: int) -> str | None:
        """The id of the holder computing the whole prompt block that follows the request's
        `num_cached_blocks` cached ones (it is promised: see allocate_slots), or None."""
        n = (request.num_tokens - 1) // self.block_size
        if num_cached_blocks >= n:
            return None
        return self.promised.get(self.hashes(request, num_cached_blocks + 1)[num_cached_blocks])

    def allocate_slots(self, request: Request, num_new_tokens: int, computed_blocks: Sequence[int] = ()) -> bool:
        """Give the request blocks for `num_new_tokens` more rows (after its computed ones and the
        cached `computed_blocks`, which a request holding nothing takes first). All or nothing:
        False, changing nothing, when free + evictable blocks do not suffice."""
        computed, bs = list(computed_blocks), self.block_size
        admitting = request.request_id not in self.holders
        need, skip = self._need(request, num_new_tokens, computed)
        if need is None:
            return False
        self.pool.touch(computed[skip:])
        request.block_table.extend([-1] * skip + computed[skip:] + self.pool.take(need))
        request.ring_start = max(request.ring_start, skip)
        if admitting:
            self.prefix_queries += request.num_tokens
            self.prefix_hits += len(computed) * bs
            request.num_computed_tokens = request.num_cached_tokens = len(computed) * bs
            request.num_registered_blocks = len(computed)
            for h in self.hashes(request, request.num_prompt_tokens // bs)[len(computed):]:
                if h not in self.pool.cached:
                    self.promised.setdefault(h, request.request_id)
        self.holders[request.request_id] = request
        return True

    def can_allocate(self, request: Request, num_new_tokens: int, computed_blocks: Sequence[int] = ()) -> bool:
        """Whether allocate_slots would succeed (changing nothing)."""
        return self._need(request, num_new_tokens, list(computed_blocks))[0] is not None

    def _need(self, request: Request, num_new_tokens: int, computed: list[int]) -> tuple[int | None, int]:
        """(new blocks allocate_slots takes, or None when they are not available; leading cached
        blocks it skips under a ring)."""
        admitting, bs = request.request_id not in self.holders, self.block_size
        if admitting and request.block_table:
            raise ValueError(f"{request.request_id!r} holds blocks {request.block_table} it was not given here")
        if computed and not admitting:
            raise ValueError(f"{request.request_id!r}: cached blocks for a request already holding blocks")
        rows = request.num_computed_tokens + len(computed) * bs + num_new_tokens
        need = max(self.blocks_for(rows) - len(request.block_table) - len(computed), 0)
        skip = 0                                # under a ring: cached blocks the window no longer sees
        if computed and self.rings(request):
            skip = self.first_in_window(len(computed) * bs)
        reviving = sum(1 for b in set(computed[skip:]) if self.pool.refcount[b] == 0)
        return (None if need > self.pool.num_available_blocks - reviving else need), skip

    def allocate_filled(self, request: Request, n: int) -> bool:
        """Blocks for the n rows of a request holding none whose rows are written from elsewhere
        at once (a saved file, a Context's arena: hetero.engine.saved)."""
        return self.allocate_slots(request, n)

    def shortfall(self, request: Request, chunk: int, pins: bool = True) -> str | None:
        """Why the request could never run (None: it can): the most blocks it holds at once (at
        most `chunk` tokens computed a step) past the pool, or (pins) past what the pinned blocks
        leave it."""
        need = self.peak_blocks(request, chunk)
        if need <= (self.room_for(request, need) if pins else self.num_blocks):
            return None
        ring = f" (a ring of the {self.window}-token window's blocks)" if self.rings(request) else ""
        pinned = f", {self.pool.num_pinned_blocks} of them pinned by contexts" if pins else ""
        return f"{need} blocks of {self.block_size} at once{ring}; the pool has {self.num_blocks} blocks{pinned}"

    def cache_full_blocks(self, request: Request) -> None:
        """Make the request's whole blocks computed since the last call findable by hash (prompt and
        output tokens alike). Call after each step that advanced num_computed_tokens."""
        n = request.num_computed_tokens // self.block_size
        start = request.num_registered_blocks
        if n <= start:
            return
        hs = self.hashes(request, n)
        for i in range(start, n):
            self.pool.register(request.block_table[i], hs[i])
            if self.promised.get(hs[i]) == request.request_id:
                del self.promised[hs[i]]
        request.num_registered_blocks = n

    def free(self, request: Request) -> None:
        """Drop the request's references, its last block first (so the tail is evicted first; a
        ring's blocks given back earlier, oldest in the LRU, move after them, the first block last:
        a prefix is found from its first block, so its head must be evicted last). A windowed
        layers' pool of its own (ring_pins) keeps the other order: a prefix is found there by the
        blocks of its last window, so the head goes first and the tail stays longest."""
        if self.ring_pins:
            self.pool.release(request.block_table[request.ring_start:])
        else:
            self.pool.release(reversed(request.block_table[request.ring_start:]))
            for h in reversed(request.block_hashes[:request.ring_start]):
                b = self.pool.cached.get(h)
                if b is not None and b in self.pool.evictable:
                    self.pool.evictable.move_to_end(b)
        bs, rid = self.block_size, request.request_id
        for h in request.block_hashes[:request.num_prompt_tokens // bs]:
            if self.promised.get(h) == rid:
                del self.promised[h]
        request.block_table.clear()
        request.num_registered_blocks = request.ring_start = 0
        self.holders.pop(request.request_id, None)

    def clear_cache(self) -> int:
        """Forget every cached block nobody holds (BlockPool.clear_cache)."""
        return self.pool.clear_cache()

    def pin(self, blocks: Sequence[int]) -> None:
        self.pool.pin(blocks)

    def unpin(self, blocks: Sequence[int]) -> None:
        self.pool.unpin(blocks)

    def pin_prefix(self, request: Request, num_blocks: int) -> list[int]:
        """Pin the blocks holding the request's first num_blocks whole blocks of tokens and return
        them: for each, the block its hash finds (another request's when this one's is a duplicate),
        so every later request with that prefix reads the pinned copy."""
        if num_blocks * self.block_size > request.num_computed_tokens:
            raise ValueError(f"{request.request_id!r}: {num_blocks} blocks are not all computed")
        hs = self.hashes(request, num_blocks)
        blocks = [self.pool.cached.get(h, request.block_table[i]) for i, h in enumerate(hs)]
        if -1 in blocks:
            raise ValueError(f"{request.request_id!r}: blocks its ring gave back cannot be pinned")
        self.pool.pin(blocks)
        return blocks

    def room_for(self, request: Request, peak: int) -> int:
        """Blocks the request could hold alone in the pool: every block but the pinned ones, and the
        pinned blocks its cached prefix reads (its table holds them). Under a ring (given its
        peak_blocks) it holds at most `peak` at once and reads the pinned ones only while they are in
        its window: they count only where its new blocks alone (all but them) are fewer than peak."""
        pinned = self.pool.num_pinned_blocks
        if pinned == 0:
            return self.num_blocks
        blocks, _ = self.get_computed_blocks(request) if not request.block_table else ([], 0)
        reads = sum(1 for b in blocks if self.pool.pins[b])
        if self.rings(request):
            return self.num_blocks - pinned + max(0, reads - (self.blocks_for(request.max_rows) - peak))
        return self.num_blocks - pinned + reads

    def blocks_shared(self, requests: Iterable[Request]) -> dict[int, list[str]]:
        """block id -> ids of the given requests holding it, for blocks held by two or more of them:
        the runner has each read once per step for all its holders."""
        holders: dict[int, list[str]] = defaultdict(list)
        rc = self.pool.refcount
        for r in requests:
            for b in r.block_table[r.ring_start:]:
                if rc[b] > 1:
                    holders[b].append(r.request_id)
        return {b: ids for b, ids in holders.items() if len(ids) > 1}

    def check_invariants(self) -> None:
        """Raise AssertionError unless refcounts equal the tables and pins holding each block and the
        pool and the holders' tables are consistent (the tests call it after every operation)."""
        expected = self.pool.pins.astype(np.int32)
        for rid, r in self.holders.items():
            _check(all(b == -1 for b in r.block_table[:r.ring_start]), f"{rid}: ring entries {r}")
            t = r.block_table[r.ring_start:]
            _check(rid == r.request_id and not r.is_finished, f"holder {rid}: {r}")
            _check(r.ring_start == 0 or (self.window and r.num_computed_tokens - self.window + 1 >=
                                         r.ring_start * self.block_size), f"{rid}: a block dropped in its window")
            _check(len(set(t)) == len(t), f"{rid} holds a block twice: {t}")
            _check(r.num_computed_tokens <= len(r.block_table) * self.block_size,
                   f"{rid}: computed rows outside its table")
            _check(r.num_registered_blocks <= len(r.block_table), f"{rid}: registered blocks outside its table")
            np.add.at(expected, np.asarray(t, np.int64), 1)
        for rid in set(self.promised.values()):
            _check(rid in self.holders, f"prompt blocks promised by {rid}, which holds no blocks")
        self.pool.check_invariants(expected)
