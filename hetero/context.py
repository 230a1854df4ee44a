"""Context: one request's KV kept in shared memory between calls (HeteroGenerator.prefill).

A long document, or a conversation so far, is prefilled once; each later generate(new_ids,
context=ctx) prefills only the new tokens over the cached KV (their attention on the CPU
workers) and decodes. The arena is the context's own KVSession segment; the worker pool maps
one session at a time and maps a context's again when a call continues it.
"""
import torch


class Context:
    def __init__(self, generator, session, token_ids, adapter=None):
        self.generator, self.session = generator, session
        self.adapter = adapter                                 # the LoRA adapter (store.Adapter) of its KV, or None
        self.token_ids = token_ids                             # [n] int64, CPU: tokens whose KV is cached
        self.pending = torch.empty(0, dtype=torch.long)        # generated after them, not yet cached (the
        self.closed = False                                    # last token of a call): fed by the next call

    def _open(self):
        if self.closed:
            raise ValueError("this Context is closed (ctx.close(), its generator's close(), or a failed call "
                             "that could not keep it consistent)")
        return self.session

    @property
    def length(self):
        """Tokens whose KV the context holds."""
        return int(self._open().lengths[0])

    @property
    def capacity(self):
        """KV rows the context can hold (prompt + reserve, in whole blocks)."""
        return self._open().layout.cap

    @property
    def tokens(self):
        """Every token of the context so far: the cached ones, then the pending ones."""
        return torch.cat([self.token_ids, self.pending])

    def save(self, path):
        """Write the context (its KV, tokens and the model's fingerprint) to a memory-mappable file;
        HeteroGenerator.load_context(path) brings it back without a prefill."""
        if self.closed:
            raise ValueError("save() on a closed Context")
        from hetero.offload import saved

        with self.generator._lock:                  # not while a call on this generator runs
            self.generator._refuse_nested("Context.save")
            saved.save(self, path)

    def close(self):
        """Free the context's shared memory. Idempotent."""
        with self.generator._lock:                  # not while a call on this generator runs
            if self.generator._busy and not self.closed:
                raise RuntimeError("a Context cannot be closed from inside a call of its generator (a streamer?)")
            self._close()

    def _close(self):
        """close(), under the generator's lock (also from inside a call that failed)."""
        if not self.closed:
            self.closed = True
            self.generator._forget(self)
            self.session.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        state = "closed" if self.closed else f"{self.length} tokens cached, room for {self.capacity}"
        return f"Context({state})"
