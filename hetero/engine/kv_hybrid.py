"""Block tables for a model that mixes sliding-window and full-attention layers (Gemma 2/3,
gpt-oss, Cohere 2, ...), as vLLM's hybrid KV cache manager: two pools of 32-row blocks, each
with its own ids, refcounts and prefix cache.

- The full layers' pool is an ordinary KVCacheManager: a request holds every block of its rows.
- The windowed layers' pool (a KVCacheManager with the window) keeps a ring per request: the
  blocks no later token can see are given back as it goes (to that pool's prefix cache), so a
  request holds at most its window's blocks and a chunk's there, however long it runs. A
  Context's prompt rings too: its pin keeps the full layers' every block and the windowed
  layers' last window only (what a request continuing it reads).
- A prefix is found in both: the longest whole-block prefix the full pool caches whose window
  (the blocks the next token sees) the window pool still caches too.

Both are keyed by the same chained block hashes. The window pool's manager sees a request
through _WindowView: its window_table in place of its block_table (hetero.engine.request).

  structure                          owned (written) by               read by
  Request.block_table                self.full (KVCacheManager)       the runner: full layers
  Request.window_table, window_start self.windowed (via _WindowView)  the runner: windowed layers
  PinnedBlocks (a list, .window)     pin_prefix                       unpin, hetero.engine.saved
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence

from hetero.engine.kv_pool import BlockPool, KVCacheManager, block_hash
from hetero.engine.request import Request


class PinnedBlocks(list):
    """The full layers' blocks of a pin (the list: one per whole token block), and in `window`
    the windowed layers' blocks of its last window; `window_first`: the first block index
    `window` covers."""

    def __init__(self, blocks: Iterable[int], window: Sequence[int] = (), window_first: int = 0):
        super().__init__(blocks)
        self.window, self.window_first = list(window), window_first


class _WindowView:
    """A request as the window pool's KVCacheManager sees it: its window table, ring start and
    registered blocks in place of its block table's; everything else is the request's."""

    _OWN = {"block_table": "window_table", "ring_start": "window_start", "num_registered_blocks": "window_registered"}
    __slots__ = ("_r",)

    def __init__(self, request: Request):
        object.__setattr__(self, "_r", request)

    def __getattr__(self, name):
        return getattr(self._r, self._OWN.get(name, name))

    def __setattr__(self, name, value):
        setattr(self._r, self._OWN.get(name, name), value)


def _both(name: str, doc: str) -> property:
    """A figure of HybridKVCacheManager: its two managers' summed."""
    return property(lambda self: getattr(self.full, name) + getattr(self.windowed, name), doc=doc)


class HybridKVCacheManager:
    """KVCacheManager's interface over a full layers' pool and a windowed layers' pool."""

    def __init__(self, full_pool: BlockPool, window_pool: BlockPool, window: int):
        if window <= 0 or full_pool.block_size != window_pool.block_size:
            raise ValueError(f"a window of {window} over pools of {full_pool.block_size} and "
                             f"{window_pool.block_size}-row blocks")
        self.full = KVCacheManager(full_pool)
        self.windowed = KVCacheManager(window_pool, window=window, ring_pins=True)
        self.window, self.block_size = window, full_pool.block_size

    # ---- the full pool's (a request's blocks there are all of its rows; the figures below count both)
    pool = property(lambda self: self.full.pool)
    holders = property(lambda self: self.full.holders)
    prefix_queries = property(lambda self: self.full.prefix_queries,
                              lambda self, n: setattr(self.full, "prefix_queries", n))
    prefix_hits = property(lambda self: self.full.prefix_hits, lambda self, n: setattr(self.full, "prefix_hits", n))

    num_blocks = _both("num_blocks", "Blocks of both pools (the full layers' alone: pool.num_blocks).")
    num_used_blocks = _both("num_used_blocks", "Blocks referenced in both pools.")
    num_free_blocks = _both("num_free_blocks", "Free blocks of both pools.")
    num_evictable_blocks = _both("num_evictable_blocks", "Cached, unreferenced blocks of both pools.")

    @property
    def usage(self) -> float:
        return max(self.full.usage, self.windowed.usage)

    def blocks_for(self, rows: int) -> int:
        return self.full.blocks_for(rows)

    def rings(self, request: Request) -> bool:
        return True

    def peak_blocks(self, request: Request, chunk: int) -> int:
        return self.full.peak_blocks(request, chunk)

    def room_for(self, request: Request, peak: int) -> int:
        return self.full.room_for(request, peak)

    def shortfall(self, request: Request, chunk: int, pins: bool = True) -> str | None:
        why = self.full.shortfall(request, chunk, pins)
        if why is not None:
            return why
        view = _WindowView(request)
        need = self.windowed.peak_blocks(view, chunk)
        pinned = self.windowed.pool.num_pinned_blocks if pins else 0
        room = self.windowed.num_blocks - pinned
        if pins and pinned and not request.block_table:
            # the pinned blocks of the window its cached prefix ends with: it reads them while
            # they are in its window (the window pool keeps a pin's last window only, so the
            # chain from block 0 that KVCacheManager.room_for follows is not there)
            blocks, _ = self.get_computed_blocks(request)
            reads = sum(1 for b in blocks.window if b >= 0 and self.windowed.pool.pins[b])
            room += max(0, reads - (self.blocks_for(request.max_rows) - need))
        if need <= room:
            return None
        return (f"{need} blocks of {self.block_size} at once (a ring of the {self.window}-token window's blocks); "
                f"the windowed layers' pool has {self.windowed.num_blocks} blocks"
                + (f", {pinned} of them pinned by contexts" if pins else ""))

    # ---- prefixes
    def hashes(self, request: Request, n: int) -> list[bytes]:
        return self.full.hashes(request, n)

    def _usable(self, hashes: Sequence[bytes]) -> int:
        """The most leading blocks of `hashes` (all cached in the full pool) whose window the
        window pool caches: the blocks the token after them sees."""
        cached, bs, run, best = self.windowed.pool.cached, self.block_size, 0, 0
        for i, h in enumerate(hashes):                 # run: cached blocks in a row ending at block i
            run = run + 1 if h in cached else 0
            k = i + 1
            if run >= k - self.windowed.first_in_window(k * bs):
                best = k
        return best

    def num_cached_blocks(self, tokens: Sequence[int], adapter_key: str | None = None) -> int:
        h, hs = None, []
        for i in range(len(tokens) // self.block_size):
            h = block_hash(h, tokens[i * self.block_size:(i + 1) * self.block_size], adapter_key)
            if h not in self.full.pool.cached:
                break
            hs.append(h)
        return self._usable(hs)

    def get_computed_blocks(self, request: Request) -> tuple[PinnedBlocks, int]:
        """(blocks, tokens) of the longest prefix cached in both pools: the full layers' blocks, and
        in `.window` the windowed layers' (-1 for the blocks its window no longer sees)."""
        full, _ = self.full.get_computed_blocks(request)
        hs = self.full.hashes(request, len(full))
        k = self._usable(hs)
        skip = self.windowed.first_in_window(k * self.block_size)
        cached = self.windowed.pool.cached
        return PinnedBlocks(full[:k], [-1] * skip + [cached[h] for h in hs[skip:k]]), k * self.block_size

    def pending_prefix(self, request: Request, num_cached_blocks: int) -> str | None:
        return self.full.pending_prefix(request, num_cached_blocks)

    # ---- slots
    def can_allocate(self, request: Request, num_new_tokens: int, computed_blocks: Sequence[int] = ()) -> bool:
        window = getattr(computed_blocks, "window", ())
        return (self.full.can_allocate(request, num_new_tokens, computed_blocks)
                and self.windowed.can_allocate(_WindowView(request), num_new_tokens, window))

    def allocate_slots(self, request: Request, num_new_tokens: int, computed_blocks: Sequence[int] = ()) -> bool:
        """Slots in both pools, or neither (False)."""
        if not self.can_allocate(request, num_new_tokens, computed_blocks):
            return False
        window = getattr(computed_blocks, "window", ())
        computed = request.num_computed_tokens
        ok = self.full.allocate_slots(request, num_new_tokens, list(computed_blocks))
        request.num_computed_tokens = computed    # an admission set it to the cached rows: both count from here
        ok &= self.windowed.allocate_slots(_WindowView(request), num_new_tokens, window)
        if not ok:
            raise AssertionError(f"{request.request_id!r}: allocation failed after can_allocate")
        return True

    def allocate_filled(self, request: Request, n: int) -> bool:
        """Blocks for n rows written at once from elsewhere: every block in the full pool, and in
        the window pool the last window's only (the earlier rows of the windowed layers are not
        kept: hetero.engine.saved writes from window_start on)."""
        skip = self.windowed.first_in_window(n)
        need = self.blocks_for(n) - skip
        if request.block_table or request.window_table:
            raise ValueError(f"{request.request_id!r} already holds blocks")
        if need > self.windowed.pool.num_available_blocks or not self.full.allocate_slots(request, n):
            return False
        request.window_table = [-1] * skip + self.windowed.pool.take(need)
        request.window_start = request.window_registered = skip
        self.windowed.holders[request.request_id] = _WindowView(request)
        return True

    def cache_full_blocks(self, request: Request) -> None:
        self.full.cache_full_blocks(request)
        self.windowed.cache_full_blocks(_WindowView(request))

    def drop_out_of_window(self, request: Request) -> None:
        keep = None
        if request.pin_prompt and request.pinned_blocks is None:   # what its pin will keep stays
            keep = self.windowed.first_in_window(request.num_prompt_tokens // self.block_size * self.block_size)
        self.windowed.drop_out_of_window(_WindowView(request), keep)


    def free(self, request: Request) -> None:
        self.full.free(request)
        self.windowed.free(_WindowView(request))

    # ---- pins
    def pin_prefix(self, request: Request, num_blocks: int) -> PinnedBlocks:
        """The full layers' num_blocks blocks pinned, and the windowed layers' blocks of the window
        the token after them sees (the request's own, or the cached copies its hashes find)."""
        full = self.full.pin_prefix(request, num_blocks)
        first = self.windowed.first_in_window(num_blocks * self.block_size)
        hs, table, cached = self.full.hashes(request, num_blocks), request.window_table, self.windowed.pool.cached
        window = [cached.get(hs[i], table[i] if i < len(table) else -1) for i in range(first, num_blocks)]
        if -1 in window:
            self.full.unpin(full)
            raise ValueError(f"{request.request_id!r}: the windowed layers' blocks of its window are gone")
        self.windowed.pin(window)
        return PinnedBlocks(full, window, first)

    def pin(self, blocks: PinnedBlocks) -> None:
        self.full.pin(list(blocks))
        self.windowed.pin(blocks.window)

    def unpin(self, blocks: PinnedBlocks) -> None:
        self.full.unpin(list(blocks))
        self.windowed.unpin(blocks.window)

    def clear_cache(self) -> int:
        return self.full.clear_cache() + self.windowed.clear_cache()

    def blocks_shared(self, requests: Iterable[Request]) -> dict[int, list[str]]:
        return self.full.blocks_shared(requests)          # a ring's blocks are read per request

    def check_invariants(self) -> None:
        self.full.check_invariants()
        self.windowed.check_invariants()
        for rid, r in self.full.holders.items():
            v = self.windowed.holders.get(rid)
            if v is None or v._r is not r:
                raise AssertionError(f"{rid} holds blocks in one pool only")
        if len(self.windowed.holders) != len(self.full.holders):
            raise AssertionError("the window pool's holders are not the full pool's")
