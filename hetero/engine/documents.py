"""Documents kept in an Engine's pool: pin() computes one, load_pin() reads one a save_pin()
wrote, pin_kv() copies one a HeteroGenerator Context holds; unpin() lets it go. A mixin of Engine:
callers (any thread) queue each in the engine's inbox; the engine thread takes it between two
steps (_take_document, _unpin), so the pool changes in that thread alone.

  state                     written by                         read by
  stream.pinned_blocks      the engine thread (on taking it)   callers (save_pin, unpin), _unpin
  stream.unpinned           the engine thread (_unpin)         Engine._end (an unpin before the pin ended)
"""
from __future__ import annotations

import os

from hetero.engine import saved as engine_saved
from hetero.engine.request import Request
from hetero.engine.stream import RequestStream
from hetero.errors import AdapterError, CapacityError


class Documents:
    """Engine's pin(), save_pin(), load_pin(), pin_kv() and unpin()."""

    def pin(self, prompt, adapter: str | None = None, request_id: str | None = None) -> RequestStream:
        """Compute a prompt (a document) and keep its whole 32-token blocks in the pool until
        unpin(): every later request starting with it reads them (never evicted, never
        recomputed). Returns its stream: result() waits for it; then `stream.pinned_blocks`."""
        ids = self._checked_prompt(prompt)
        if adapter is not None and adapter not in self.adapters:
            raise AdapterError(f"no adapter named {adapter!r} is loaded (loaded: {self.adapters})")
        if len(ids) > self.max_model_len:
            raise CapacityError(f"a prompt of {len(ids)} tokens is past the engine's max_model_len={self.max_model_len}")
        rid = request_id if request_id is not None else self._new_id("pin")
        req = Request(rid, ids, 0, adapter=adapter, adapter_key=self.adapter_key(adapter), pin_prompt=True)
        stream = RequestStream(self, rid, len(ids))
        stream.prompt_ids, stream.adapter, stream.adapter_key = ids, adapter, req.adapter_key
        return self._queue(req, None, stream)

    def save_pin(self, stream: RequestStream, path, extra: dict | None = None) -> None:
        """Write a computed pin()'s blocks to `path` (hetero's saved-context format, atomically);
        extra: a JSON object kept with it (load_pin returns it)."""
        self._check_open()
        self._own_stream(stream, "save_pin")
        stream.result()
        with self._in_turn():                   # held while the file is written: an unpin meanwhile frees nothing
            blocks = stream.pinned_blocks
            if blocks:
                self.kv_manager.pin(blocks)
        try:
            engine_saved.save_pin(self, stream, os.fsdecode(path), extra, blocks)
        finally:
            if blocks:
                with self._in_turn():
                    self.kv_manager.unpin(blocks)

    def load_pin(self, path) -> tuple[RequestStream, dict]:
        """A document saved by save_pin, loaded into the pool and pinned without computing it: (its
        stream, finished once loaded; unpin() releases it, and the extra the file keeps). A file
        from another model or adapter, or corrupted, raises ContextFileError naming the difference."""
        self._check_open()
        path = os.fsdecode(path)
        header, adapter = engine_saved.read(self, path)         # the file's adapter is the one loaded now
        rid = self._new_id("load")
        stream = RequestStream(self, rid, header["length"])
        stream.prompt_ids, stream.adapter = header["tokens"] + header["pending"], adapter
        stream.adapter_key = self.adapter_key(adapter)             # still that one when the engine loads it
        self._post(("load", header, adapter, str(path), stream))
        stream.result()
        return stream, header.get("extra") or {}

    def adapter_digest(self, name: str | None):
        """What identifies a loaded adapter's weights in a saved file (None: the base model / not loaded)."""
        store, _ = self._lora()
        if name is None or store is None or name not in store.adapters:
            return None
        return store.digest(store.adapters[name])

    def pin_kv(self, snapshot, adapter: str | None = None, then=None) -> RequestStream:
        """Pin a document whose KV another holder has, copied into the pool without computing it.
        snapshot() runs in the engine thread between two steps and gives (the token ids of whole
        blocks, a source whose read_rows(layer, 0, n) gives their key and value rows [Hkv, n, D]):
        a HeteroGenerator Context's tokens and session; then(stream), if given, runs there right
        after the copy (the source may let its rows go). Returns its stream, finished once pinned
        (its pinned_blocks); unpin() releases them."""
        if adapter is not None and adapter not in self.adapters:
            raise AdapterError(f"no adapter named {adapter!r} is loaded (loaded: {self.adapters})")
        stream = RequestStream(self, self._new_id("copy"), 0)
        stream.adapter, stream.adapter_key = adapter, self.adapter_key(adapter)
        self._post(("copy", snapshot, adapter, then, stream))
        return stream

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the engine is closed")

    def _own_stream(self, stream, what: str) -> None:
        if not isinstance(stream, RequestStream) or stream.engine is not self:
            got = "another engine's stream" if isinstance(stream, RequestStream) else repr(stream)
            raise ValueError(f"{what}() takes a stream of this engine's pin(), load_pin() or pin_kv(); got {got}")

    def unpin(self, stream: RequestStream) -> None:
        """Release a pin()'s blocks (at the next step): cached, evicted when the room is needed."""
        self._own_stream(stream, "unpin")
        with self._lock:
            self._inbox.append(("unpin", stream))
            self._lock.notify_all()

    def _take_document(self, item) -> None:
        """The engine thread: a load_pin() or pin_kv() item from the inbox, into the pool."""
        stream = item[-1]
        try:
            if item[0] == "load":
                _, header, adapter, path, _ = item
                stream.pinned_blocks = engine_saved.load_into(self, header, adapter, stream.adapter_key,
                                                              path, stream.request_id)
            else:
                _, snapshot, adapter, then, _ = item
                tokens, source = snapshot()
                stream.prompt_ids = tokens
                stream.pinned_blocks = engine_saved.copy_into(self, tokens, source, adapter,
                                                              stream.adapter_key, stream.request_id)
                if then is not None:
                    then(stream)
        except Exception as e:                  # the file's or the source's (ContextFileError, ...): as it is
            stream._push([], error=e, own=True)
        else:
            stream._push([], "length")

    def _unpin(self, stream: RequestStream):
        stream.unpinned = True
        blocks, stream.pinned_blocks = stream.pinned_blocks, None
        if blocks:
            self.kv_manager.unpin(blocks)
