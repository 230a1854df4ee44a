"""Context: one request's KV kept in shared memory between calls (HeteroGenerator.prefill).

A long document, or a conversation so far, is prefilled once; each later generate(new_ids,
context=ctx) prefills only the new tokens over the cached KV (their attention on the CPU
workers) and decodes. Its KV lives in one of two places:
- its arena, a KVSession segment of its own (after prefill, load_context, and any call that runs
  HF's loop over it); the worker pool maps one session at a time and maps a context's again
  when a call continues it;
- the generator's engine pool alone (`pooled`), once calls joining the engine have read it
  (hetero.engine.calls): its whole blocks were copied there and pinned, and its arena closed.
  Its tokens past them are pending (computed again by the next call). A call that needs HF's
  loop over it (extending it, settings the engine does not batch, save) brings it back into a
  new arena first (HeteroGenerator._arena).

  field                 written by                                  read by
  session, pool_pin     the generator's calls, the engine thread    any caller (under the generator's
                        (under the generator's call lock)           lock, or a snapshot)
  _tokens               the same                                    any thread (one tuple: token_ids, pending)
"""
import threading

import torch


class Context:
    def __init__(self, generator, session, token_ids, adapter=None):
        self.generator, self.session = generator, session
        self.adapter = adapter                                 # the LoRA adapter (store.Adapter) of its KV, or None
        # token_ids [n] int64, CPU: tokens whose KV is cached; pending: generated after them, not yet
        # cached (the last token of a call), fed by the next call. One tuple: set together (set_tokens)
        self._tokens = (token_ids, torch.empty(0, dtype=torch.long))
        self.pool_pin = None          # (engine, stream) while its KV lives in the engine's pool alone
        self.weights = None           # what computed its KV (hetero.offload.registry.weights_key)
        self.pooled_capacity = 0      # the arena's rows it had (given back when it returns to one)
        self.pooled_tmax = None       # and its continuation pieces (None: as a new context's)
        self.extend_lock = threading.RLock()    # one call extending it at a time (HF's loop or the engine), or save()
        self.closed = False

    token_ids = property(lambda self: self._tokens[0], lambda self, t: self.set_tokens(t, self._tokens[1]))
    pending = property(lambda self: self._tokens[1], lambda self, p: self.set_tokens(self._tokens[0], p))

    def set_tokens(self, token_ids, pending):
        self._tokens = (token_ids, pending)

    @property
    def pooled(self) -> bool:
        """Its KV lives in the generator's engine pool alone (no arena)."""
        return self.pool_pin is not None

    def _open(self):
        if self.closed:
            raise ValueError("this Context is closed (ctx.close(), its generator's close(), or a failed call "
                             "that could not keep it consistent)")
        return self.session

    @property
    def length(self):
        """Tokens whose KV the context holds."""
        session = self._open()
        if session is not None:
            try:
                return int(session.lengths[0])
            except (TypeError, AttributeError):       # moved into the engine's pool meanwhile
                pass
        return len(self.token_ids)

    @property
    def capacity(self):
        """KV rows the context can hold (prompt + reserve, in whole blocks)."""
        session = self._open()
        return self.pooled_capacity if session is None else session.layout.cap

    @property
    def tokens(self):
        """Every token of the context so far: the cached ones, then the pending ones."""
        return torch.cat(self._tokens)

    def save(self, path):
        """Write the context (its KV, tokens and the model's fingerprint) to a memory-mappable file;
        HeteroGenerator.load_context(path) brings it back without a prefill."""
        if self.closed:
            raise ValueError("save() on a closed Context")
        from hetero.offload import saved

        # not while a call on this generator runs, nor one extending this context in the engine (it
        # holds extend_lock alone and sets the context's tokens and pin when it ends)
        with self.extend_lock, self.generator._lock:
            self.generator._refuse_nested("Context.save")
            if self.session is None:                # in the engine's pool: back into an arena to write it
                with self.generator._exclusive():
                    self.generator._arena(self)
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
            self.generator._forget(self)                # its pinned copy in the engine's pool too
            if self.session is not None:
                self.session.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        state = "closed" if self.closed else f"{self.length} tokens cached, room for {self.capacity}" + \
            (", in the engine's pool" if self.pooled else "")
        return f"Context({state})"
