"""A pinned document's KV in a file and back (Engine.save_pin, Engine.load_pin): hetero's saved
context format (hetero.offload.saved: fingerprint of the model and adapter, tokens, CRC-checked
rows), written from the pool's pinned blocks and read into new blocks of a pool, where they are
registered in the prefix cache and pinned as if the document had been computed there; and
(Engine.pin_kv) a HeteroGenerator Context's whole blocks copied in the same way.

The file holds the document's whole blocks as its cached "tokens" and the rest of its prompt as
"pending" (computed again by the first request that reads it); its header's "extra" keeps what
the caller adds (hetero serve: the context's name and messages). A file a HeteroGenerator Context
saved loads too: its whole blocks, the rows past them computed again as pending tokens.
"""
from __future__ import annotations

import torch

from hetero.engine.kv_pool import BLOCK_SIZE
from hetero.engine.request import Request, RequestStatus
from hetero.errors import AdapterError, CapacityError, ContextFileError
from hetero.offload import saved


class PoolRows:
    """A request's rows in the pool through its block table, as hetero.offload.saved reads and
    writes a session's (batch 1). Where the windowed layers have a pool of their own (kv.ringed),
    their rows go through `window_table`, which holds the blocks from `window_first` on (the last
    window's: the file keeps those layers' rows from there, saved.layer_start)."""

    def __init__(self, kv, table: list[int], window_table: list[int] = (), window_first: int = 0):
        self.kv, self.spec = kv, kv.spec
        self.rows = len(table) * BLOCK_SIZE        # rows written past them are dropped (a file's partial block)
        self.table = torch.tensor(table, dtype=torch.int64)
        self.wtable = torch.tensor(list(window_table), dtype=torch.int64)
        self.wfirst = window_first * BLOCK_SIZE
        self.ring_window = tuple(w if r else 0 for w, r in zip(kv.windows, kv.ringed))

    def first_row(self, layer: int) -> int:
        """The first row of `layer` these blocks hold (a windowed layer's pool: its last window's)."""
        return self.wfirst if self.kv.ringed[layer] else 0

    def read_rows(self, layer, b, n, start=0):
        if self.kv.ringed[layer]:
            if start < self.wfirst:
                raise ValueError(f"rows from {start} of a windowed layer whose pool keeps them from {self.wfirst}")
            return self.kv.read_rows(layer, self.wtable, n, start)
        k, v = self.kv.read_rows(layer, self.table, n)
        return k[:, start:], v[:, start:]

    def write_rows(self, layer, b, key, value, start=0):
        key, value = key[:, :max(self.rows - start, 0)], value[:, :max(self.rows - start, 0)]
        if self.kv.ringed[layer]:                 # the rows before the last window are not kept
            cut = max(self.wfirst - start, 0)
            key, value, start = key[:, cut:], value[:, cut:], start + cut
            if key.shape[1]:
                self.kv.write_rows(layer, self.wtable, start, key, value)
            return
        self.kv.write_rows(layer, self.table, start, key, value)


def pin_rows(kv, blocks) -> PoolRows:
    """A pin's rows (its blocks: a list, or hetero.engine.kv_hybrid.PinnedBlocks)."""
    window = getattr(blocks, "window", ())
    first = getattr(blocks, "window_first", 0)
    return PoolRows(kv, list(blocks), [-1] * first + list(window), first)


def save_pin(engine, stream, path, extra, blocks):
    """Write a pin()'s blocks (computed, pinned; `blocks`, held by the caller while it writes) to
    `path` atomically."""
    if stream.adapter_key != engine.adapter_key(stream.adapter):
        raise AdapterError(f"adapter {stream.adapter!r} was reloaded since this document was pinned: its KV is the "
                           "earlier weights'; pin it again")
    if not blocks:
        raise ValueError("that pin holds no whole block (shorter than 32 tokens, unpinned, or not computed yet)")
    n = len(blocks) * BLOCK_SIZE
    ids = stream.prompt_ids
    fp = saved.fingerprint(engine.model, engine.spec, engine.adapter_digest(stream.adapter))
    saved.write(path, pin_rows(engine.kv, blocks), n, ids[:n], ids[n:], fp, extra)


def read(engine, path):
    """(header, adapter name) of a saved document this engine can load, or ContextFileError."""
    header = saved.read_header(path)
    name = saved.check_model(header, engine.model, engine.spec, path, engine.adapter_digest)
    kv, n = engine.kv, header["length"] // BLOCK_SIZE * BLOCK_SIZE        # its whole blocks are loaded
    if n == 0:
        raise ContextFileError(f"{path} holds {header['length']} rows: no whole block of {BLOCK_SIZE} to load "
                               "(load it with HeteroGenerator.load_context)")
    total = len(header["tokens"]) + len(header["pending"])
    if total > engine.max_model_len:                    # as pin() refuses it
        raise CapacityError(f"{path} holds a document of {total} tokens, past the engine's "
                            f"max_model_len={engine.max_model_len}: no request could read it")
    keep = [saved.layer_start(n, w) if r else 0 for w, r in zip(kv.windows, kv.ringed)]
    if len(keep) != len(header["layers"]) or any(lay["start"] > k for lay, k in zip(header["layers"], keep)):
        raise ContextFileError(f"{path} keeps only a sliding window's rows of some layers (a generator's context "
                               "past its window); the engine's pool needs more of them")
    saved.check_vocabulary(header, engine.model.config.get_text_config().vocab_size, path)
    return header, name


def load_into(engine, header, adapter, key, path, rid) -> list[int]:
    """The engine thread: new blocks filled from the file's whole blocks (the rows of a last
    partial block are computed again by the first request that reads them, as its pending
    tokens), cached under the tokens' hashes and pinned. Returns the pinned blocks."""
    n = header["length"] // BLOCK_SIZE * BLOCK_SIZE
    blocks = pin_filled(engine, header["tokens"][:n], adapter, key, rid, lambda rows: saved.fill(rows, header, path))
    if blocks is None:                    # the file is good: CapacityError, as a prompt that does not fit
        raise CapacityError(f"the pool has no room for the {n // BLOCK_SIZE} blocks of {path}")
    return blocks


def copy_into(engine, tokens, source, adapter, key, rid) -> list[int]:
    """The engine thread: new blocks filled with rows 0..len(tokens)-1 of `source` (a KVSession: a
    HeteroGenerator Context's), cached under the tokens' hashes and pinned. Returns the blocks."""
    n = len(tokens)

    def fill(rows):
        for layer in range(engine.spec.layers):
            k, v = source.read_rows(layer, 0, n)
            rows.write_rows(layer, 0, k, v)

    blocks = pin_filled(engine, tokens, adapter, key, rid, fill)
    if blocks is None:
        raise CapacityError(f"the pool has no room for the context's {n // BLOCK_SIZE} blocks")
    return blocks


def pin_filled(engine, tokens, adapter, key, rid, fill) -> list[int] | None:
    """New blocks for `tokens` (whole blocks) filled by fill(PoolRows), cached under adapter key
    `key` (taken when the caller checked the source: the adapter must still be that one) and pinned
    (None: no room in the pool)."""
    if key != engine.adapter_key(adapter):
        raise AdapterError(f"adapter {adapter!r} was unloaded or reloaded before its document could be pinned")
    n, kvm = len(tokens), engine.kv_manager
    req = Request(rid, tokens, 0, adapter=adapter, adapter_key=key)
    queries, hits = kvm.prefix_queries, kvm.prefix_hits
    if not kvm.allocate_filled(req, n):
        return None
    kvm.prefix_queries, kvm.prefix_hits = queries, hits         # a load is no prompt looked up
    try:
        fill(PoolRows(engine.kv, req.block_table, req.window_table, req.window_start))
        req.num_computed_tokens = n
        kvm.cache_full_blocks(req)
        return kvm.pin_prefix(req, n // BLOCK_SIZE)
    finally:
        kvm.free(req)
        req.status = RequestStatus.FINISHED_LENGTH
