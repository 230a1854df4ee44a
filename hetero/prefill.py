"""Chunked prefill and the continuation of contexts: the model run over part of a sequence
whose earlier rows are already in hetero's cache.

Owns: the chunk a prompt is prefilled in (HeteroConfig.prefill_chunk: _chunk_size, _chunk,
_staged, _piece), the forwards that fill the cache chunk by chunk (prefill_chunks, _forward),
feeding tokens over a cached prefix on the CPU workers or over KV prefetched to the device
(_feed, _continuation), and generate() continuing one context (_generate_in_context, _recover)
or a batch of them (_generate_in_contexts).

A mixin of HeteroGenerator rather than functions or an object of its own: these methods use
nearly all of the generator's state (its model and spec, its config (which a caller may replace
between calls), worker pool and planner, the call lock, the context registry, the cache of the
model's forward signature, last_prefetch_log), and tests and benchmarks patch or call several of
them on the class or instance (_chunk_size, _feed, _forward, _generate_in_context(s)).
"""
import contextlib
import inspect
import logging
import time

import torch

from hetero.adapters.sync import active
from hetero.compat import GENERATE_CACHE_KWARG, forward_cache_kwarg
from hetero.cpu_attention import kernel
from hetero.cpu_attention.simd import BK
from hetero.errors import CapacityError, UnsupportedModelError, WorkerError
from hetero.memory import plan_cache
from hetero.offload.arena import whole_blocks
from hetero.offload.registry import STALE, closed_why
from hetero.settings import check_positions, one_pass_only, pad_id, rope_ok, rope_refused

log = logging.getLogger("hetero")
CONTINUE_CHUNK = 256     # a context's continuations go to the workers in pieces of at most this many tokens


class PrefillMixin:
    """HeteroGenerator's chunked prefill and context continuation (see the module's docstring)."""

    def _chunk_size(self, attention_mask):
        """HeteroConfig.prefill_chunk for this prompt: an int, or None (one pass). "auto": one pass
        on a CPU model; on a GPU, one pass where the prompt's forward fits the device's free memory
        (what the caching allocator holds unused counts as free), else the longest chunk that fits
        (hetero.prefetch.policy.prefill_chunk)."""
        C = self.config.prefill_chunk
        if C != "auto":
            return C
        dev = self.model.device
        if dev.type != "cuda":
            return None
        from hetero.prefetch import policy

        free = torch.cuda.mem_get_info(dev)[0] + torch.cuda.memory_reserved(dev) - torch.cuda.memory_allocated(dev)
        B, S = attention_mask.shape
        return policy.prefill_chunk(self.model.config.get_text_config(), self.spec, B, S, free, self._eager,
                                    padded=not bool(attention_mask.all()))

    def _chunk(self, attention_mask):
        """The chunk size of a chunked prefill (_chunk_size), or None for one pass: the first forward
        covers the left pads and one chunk, so later chunks hold real tokens only."""
        C = self._chunk_size(attention_mask)
        if C is None:
            return None
        first = int((attention_mask.shape[1] - attention_mask.sum(1)).max()) + C
        if attention_mask.shape[1] <= first:
            return None
        if self.spec.one_pass_only:
            raise UnsupportedModelError(one_pass_only(self.spec, "a chunked prefill (HeteroConfig.prefill_chunk)"))
        return C

    def _staged(self, chunk):
        """Query tokens per step the workers' staging holds for a prompt prefilled in chunks of
        `chunk` (None: one pass): the chunk a set HeteroConfig.prefill_chunk gives; an "auto" chunk
        (fitted to GPU memory, its pieces attended on the GPU after a prefetch: _feed) only up to
        CONTINUE_CHUNK, since a staging sized to a long chunk grows the host arena by ~256 KiB per
        token at the Llama-3-8B shape (the workers, when they take a chunk, take it in pieces)."""
        if chunk and self.config.prefill_chunk == "auto":
            return min(chunk, CONTINUE_CHUNK)
        return chunk

    @property
    def _piece(self):
        """Tokens per forward when a context is continued (a set prefill_chunk, else CONTINUE_CHUNK)."""
        C = self.config.prefill_chunk
        return C if isinstance(C, int) else CONTINUE_CHUNK

    def prefill_chunks(self, cache, input_ids, attention_mask, chunk, to_end=False):
        """Run a prompt through the model into `cache` in chunks: the first forward (pads + one
        chunk) with the model's own attention, each later chunk of `chunk` tokens attending to the
        cached KV (on the CPU workers, or on the model's device after a layer-wise prefetch: see
        _feed). to_end: all of it; else the rest (at most one chunk) is left to generate's first
        forward, which continues the cache."""
        S = input_ids.shape[1]
        first = min(S, S - int(attention_mask.sum(1).min()) + chunk)      # the longest left pad + one chunk
        if first == S and not to_end:
            return
        self._forward(cache, input_ids, attention_mask, 0, first)
        self._feed(cache, input_ids, attention_mask, first, S, whole=to_end, piece=chunk)

    def _generate_in_context(self, ctx, input_ids, attention_mask, max_new_tokens, call, lora, extend=True):
        """generate() continuing `ctx`: [cached tokens, the last call's unstored token, new tokens].
        extend=False: afterwards the context is as before (its length restored; the rows the call
        appended lie past it and are overwritten later, except in sliding-window rings, which a
        call may wrap: those are saved before and put back)."""
        if ctx.generator is not self or ctx.closed:
            raise ValueError("context= takes an open Context from this generator's prefill()" + closed_why(ctx))
        if input_ids.shape[0] != 1:
            raise ValueError(f"a context continues one request: input_ids must be [1, n], got {tuple(input_ids.shape)}")
        if not bool(attention_mask.all()):
            raise ValueError("the new tokens of a context cannot be padded (attention_mask all ones)")
        with ctx.extend_lock if extend else contextlib.nullcontext(), self._exclusive():
            if ctx.closed:
                raise ValueError("context= takes an open Context from this generator's prefill()" + closed_why(ctx))
            self._arena(ctx)                                     # from the engine's pool, where it lives there
            if self._contexts.stale(ctx):
                raise ValueError(STALE)
            full = torch.cat([ctx.token_ids, ctx.pending, input_ids[0].to("cpu")]).to(self.model.device)[None]
            session, cached = ctx.session, ctx.length                    # full: [1, S]
            if not rope_ok(self.spec, full.shape[1], max_new_tokens, (cached,), keeps=extend):
                raise rope_refused(self.spec)
            need = full.shape[1] + max_new_tokens - 1           # KV rows once the last new token is chosen
            if need > session.layout.cap:
                raise CapacityError(f"the context holds {cached} tokens and this call adds {full.shape[1] - cached} "
                                    f"+ {max_new_tokens} new: {need} rows, but it was prefilled with room for "
                                    f"{session.layout.cap} (prefill(..., reserve=...))")
            check_positions(self.spec, full.shape[1], max_new_tokens)
            pool = self._ensure_pool()
            session.begin_call(pool, self._ensure_planner(pool))
            rings = None if extend or not session.layout.ring_layers else (session.Kr.clone(), session.Vr.clone())
            err = None
            try:
                with self._routed(session, lora) as cache, torch.no_grad(), active(lora):
                    for layer in cache.layers:
                        layer.seen = cached
                    mask = torch.ones_like(full)
                    self._feed(cache, full, mask, cached, full.shape[1])     # generate's first forward: the rest
                    out = self.model.generate(full, attention_mask=mask, **{GENERATE_CACHE_KWARG: cache}, **call)
            except BaseException as e:
                err = e
            try:
                session.end_call(check=err is None)          # a GPU's last step settled, its page locks freed
            except BaseException as e:                       # Ctrl-C too: the context is put back below
                err = err or e
            if not extend:
                session.rewind(cached, rings)
            elif err is not None:
                self._recover(ctx, cached)
            if isinstance(err, WorkerError) and self._pool is not None:
                self._drop_pool()                            # the context stays; the next call maps it again
            if err is not None:
                raise err
            # still under the lock: a close() waiting in another thread must find the call complete
            if extend:
                seq = out if isinstance(out, torch.Tensor) else out.sequences
                stored = int(session.lengths[0])
                ctx.set_tokens(seq[0, :stored].to("cpu"), seq[0, stored:].to("cpu"))
            self._contexts.used(ctx)
        return out

    def _feed(self, cache, ids, mask, a, end, whole=False, piece=None):
        """Forward positions [a, end) of ids into a prefilled session's cache, each piece attending
        to the cached KV: on the CPU workers in pieces of at most the session's tmax tokens
        (generate's first forward then takes the last piece), or, when HeteroConfig.continuation /
        the policy prefers it, on the model's device over KV prefetched layer by layer
        (hetero.prefetch; generate's first forward takes the last token) in pieces of up to
        `piece` tokens (no staging holds them; a sliding window's ring holds only tmax new rows,
        so with ring layers, tmax). whole: feed everything."""
        session = cache.session
        tmax = session.layout.tmax
        n = end - a
        if n <= 0:
            return
        if not whole and n == 1:
            return                                       # generate's first forward takes it
        big = max(piece or 0, tmax) if session.layout.ring_layers == 0 else tmax
        prefetch = session.batch == 1 and self._continuation(session, int(session.lengths[0]), min(n, big)) == "prefetch"
        stop = end if whole else end - (1 if prefetch else (n - 1) % tmax + 1)
        if stop <= a:
            return
        if not prefetch:
            for p in range(a, stop, tmax):
                self._forward(cache, ids, mask, p, min(p + tmax, stop))
            return
        from hetero.prefetch.schedule import LayerPrefetcher

        pre = LayerPrefetcher(session, self.model.device)
        started = time.perf_counter()
        try:
            for p in range(a, stop, big):
                session.prefetcher = pre
                pre.start()
                self._forward(cache, ids, mask, p, min(p + big, stop))
                log.info("hetero: tokens %d-%d of %d attended over the prefetched cache (%.1f s)", p,
                         min(p + big, stop), stop, time.perf_counter() - started)     # long prompts' progress
        except BaseException:
            session.prefetcher = None
            try:
                pre.close()
            except BaseException:
                pass                                     # the forward's own error is the one to raise
            raise
        session.prefetcher = None
        pre.close()
        self.last_prefetch_log, self.last_prefetch_plan = pre.log, pre.planned    # for tests and benchmarks

    def _continuation(self, session, L, T):
        """HeteroConfig.continuation for T new tokens over L cached rows ("auto": hetero.prefetch.policy)."""
        want = self.config.continuation
        if want != "auto":
            return want
        from hetero.prefetch import policy

        profile = getattr(self._planner, "profile", None)
        if profile is None or self.model.device.type != "cuda":
            return "workers"                             # see policy.choose
        if self._rates is None:
            self._rates = policy.measure(self.model.device, self.spec)
        return policy.choose(profile, self._rates, self.spec, L, T, self._pool.n)

    def _recover(self, ctx, cached):
        """A call that extends ctx failed midway: some of its rows may be cached. Without sliding
        -window rings, or before any KV update (a setting transformers refuses as it starts), back
        to the `cached` rows the context had (later rows are overwritten by the next call); a ring
        may have been wrapped over rows the context still needs, so such a context is closed
        (using it again raises), rather than left silently wrong."""
        if ctx.session.layout.ring_layers == 0 or not ctx.session.touched:
            ctx.session.rewind(cached)
        else:
            ctx._close()

    def _generate_in_contexts(self, contexts, input_ids, attention_mask, max_new_tokens, settings, call, lora,
                              width=0):
        """generate() for a batch whose request b continues contexts[b] (read, not changed): the
        requests continuing one context form a shared-prefix group that reads the context's
        whole blocks in place (KVSession prefix_groups; not a context with sliding-window rings,
        nor with share_contexts=False); the call's own session holds
        each request's rows past them (pstart), copied from its context (all of them for a
        request in no group). Request b's sequence is [its context's tokens (pending ones too),
        its new tokens], left-padded to the longest (or to `width`); the steps that feed them count, per
        request, the tokens that are not its own (session.skip)."""
        B = input_ids.shape[0]
        if len(contexts) != B:
            raise ValueError(f"context= has {len(contexts)} contexts for a batch of {B} requests")
        with self._exclusive():
            self._contexts.check_contexts(self, contexts)
            for c in contexts:
                self._arena(c)                                   # from the engine's pool, where it lives there
            new = [input_ids[b, attention_mask[b].bool()].to("cpu") for b in range(B)]      # real new tokens
            seqs = [torch.cat([c.token_ids, c.pending, n]) for c, n in zip(contexts, new)]
            cached = [c.length for c in contexts]
            S = max(width, max(len(q) for q in seqs))
            pad = pad_id(settings)
            full = torch.full((B, S), pad, dtype=torch.long)                     # [B, S], left-padded
            mask = torch.zeros(B, S, dtype=torch.long)
            for b, q in enumerate(seqs):
                full[b, S - len(q):], mask[b, S - len(q):] = q, 1
            check_positions(self.spec, max(len(q) for q in seqs), max_new_tokens)     # each row's own positions
            if not rope_ok(self.spec, S, max_new_tokens, cached):
                raise rope_refused(self.spec)
            uncached = [len(q) - n for q, n in zip(seqs, cached)]
            U = max(uncached)
            rows = S + max_new_tokens           # no window can hide a row from a query below it
            share = self.config.share_contexts and all(w == 0 or w >= rows for w in self.spec.windows or ())
            groups = {}                                          # id(context) -> (its session, members)
            for b, c in enumerate(contexts):
                if share and cached[b] >= BK and c.session.layout.ring_layers == 0:
                    groups.setdefault(id(c.session), (c.session, []))[1].append(b)
            # at most MAX_GROUPS read in place, the largest; the other requests copy their contexts
            groups = sorted(groups.values(), key=lambda g: -len(g[1]))[:kernel.MAX_GROUPS]
            pstart = [0] * B
            for src, members in groups:
                for b in members:
                    pstart[b] = int(src.lengths[0]) // BK * BK
            tmax = min(self._piece, U)                              # the staging holds one step's tokens
            pads, _, cap = plan_cache(self.spec, self.config, mask, max_new_tokens, tmax=tmax,
                                            private=whole_blocks(rows) - min(pstart) if groups else 0,
                                            groups=len(groups))
            full, mask = full.to(self.model.device), mask.to(self.model.device)
            for c in contexts:
                self._contexts.used(c)
            with self._call_session(pads, cached, cap, lora, tmax, groups) as cache, torch.no_grad(), \
                    active(lora):
                session = cache.session
                for b, c in enumerate(contexts):                    # rows past the shared prefix
                    src = c.session
                    for layer in range(self.spec.layers):
                        window = session.ring_window[layer]
                        start = max(0, cached[b] - window + 1) // BK * BK if window else pstart[b]
                        src_window = src.ring_window[layer]       # the source may keep fewer rows (a ring)
                        if src_window:
                            start = max(start, max(0, cached[b] - src_window + 1) // BK * BK)
                        k, v = src.read_rows(layer, 0, cached[b], start)
                        session.write_rows(layer, b, k, v, start)
                session.finish_prefill()                           # lengths = cached
                session.skip[:] = [U - u for u in uncached]        # the first U - u_b tokens fed are b's cached ones or pads
                for layer in cache.layers:
                    layer.seen = S - U
                a = S - U
                while S - a > tmax:                                # continue in pieces of at most tmax tokens
                    self._forward(cache, full, mask, a, a + tmax)
                    a += tmax
                return self.model.generate(full, attention_mask=mask, **{GENERATE_CACHE_KWARG: cache}, **call)

    def _forward(self, cache, input_ids, attention_mask, a, b):
        """The model over positions [a, b) of input_ids into `cache` (no logits kept but the last)."""
        if self._forward_params is None:
            self._forward_params = set(inspect.signature(self.model.forward).parameters)
            self._cache_kwarg = forward_cache_kwarg(self.model.forward)
        kw = {"logits_to_keep": 1} if "logits_to_keep" in self._forward_params else {}
        if "position_ids" in self._forward_params:          # as generate: only where forward takes them
            pos = attention_mask.long().cumsum(-1) - 1
            kw["position_ids"] = pos.masked_fill_(attention_mask == 0, 1)[:, a:b]
        self.model(input_ids=input_ids[:, a:b], attention_mask=attention_mask[:, :b], **{self._cache_kwarg: cache},
                   use_cache=True, cache_position=torch.arange(a, b, device=input_ids.device), **kw)
