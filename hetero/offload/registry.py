"""The context registry: the KV arenas a generator keeps between calls (HeteroGenerator.prefill,
load_context), one entry per Context.

Owns: the entries (_Kept: a context's arena, a weak reference to its Context, its tokens and
last use), what computed each one's KV (weights_key: a context whose base weights changed since
is stale), closing the contexts nobody references any more (sweep) or, under
HeteroConfig.context_memory, keeping them as a prefix cache evicted least recently used first
(check_budget), and finding live contexts a prompt starts with (reusable). The generator holds
one ContextRegistry and its lock; the registry reads no HeteroConfig itself (a generator's config
may be replaced between calls): the budget is passed in.
"""
import time
import weakref

import torch

from hetero.adapters import hooks as lora_hooks
from hetero.context import Context
from hetero.digest import weight_digest
from hetero.errors import CapacityError

STALE = ("the model's weights changed since this context was prefilled (its KV is what the old ones computed); "
         "prefill it again")


class ContextRegistry:
    """Open contexts: id(session) -> _Kept. A context nobody references any more keeps its arena
    until the next prefill/load_context (sweep) or the generator's close()."""

    def __init__(self, model):
        self.model = model
        self._kept = {}

    def __len__(self):
        return len(self._kept)

    def values(self):
        return self._kept.values()

    def keep(self, ctx):
        """Register a new Context (its KV just computed with the model's weights now)."""
        ctx.session.weights = ctx.weights = weights_key(self.model)      # what computed its KV (stale)
        self._kept[id(ctx.session)] = _Kept(ctx)
        return ctx

    def keep_again(self, ctx):
        """Register a Context back in an arena (its KV moved out of the engine's pool): its weights kept."""
        ctx.session.weights = ctx.weights
        self._kept[id(ctx.session)] = _Kept(ctx)

    def stale(self, holder, now=None):
        """Whether the model's base weights changed (in place: a training step, load_state_dict;
        or replaced) since the KV of `holder` (a Context, or its arena) was computed: its KV is
        not what they would give. now: weights_key computed once for several contexts."""
        return holder.weights != (weights_key(self.model) if now is None else now)

    def forget(self, session):
        """Drop a session's entry (its Context closed, or never handed out)."""
        self._kept.pop(id(session), None)

    def used(self, ctx):
        """A call read or extended ctx: its registry entry's tokens and last use."""
        kept = self._kept.get(id(ctx.session))
        if kept is not None:
            kept.note(ctx)

    def take_all(self):
        """Every entry, the registry emptied (the generator's close: close_kept each)."""
        kept = list(self._kept.values())
        self._kept.clear()
        return kept

    def sweep(self, budget):
        """Without a context_memory `budget`: close the contexts nobody references any more. With
        one, they stay as a prefix cache (reusable finds them) until check_budget needs their room."""
        if budget is not None:
            return
        for key, kept in list(self._kept.items()):
            if kept.ref() is None:
                del self._kept[key]
                kept.session.close()

    def check_budget(self, nbytes, budget):
        """Before a new context of `nbytes`: within HeteroConfig.context_memory (`budget`), closing
        unreferenced contexts least recently used first, or CapacityError naming what the open
        contexts hold."""
        if budget is None:
            return
        if nbytes > budget:
            raise CapacityError(f"a new context needs {nbytes / 2**20:.1f} MiB, more than all of HeteroConfig."
                                f"context_memory={budget} bytes ({budget / 2**20:.1f} MiB; a smaller reserve= needs less)")
        while sum(k.session.layout.nbytes for k in self._kept.values()) + nbytes > budget:
            idle = [(k.used, key) for key, k in self._kept.items() if k.ref() is None]
            if not idle:
                held = [f"{k.session.layout.nbytes / 2**20:.1f} MiB ({int(k.session.lengths[0])} tokens)"
                        for k in self._kept.values()]
                used = sum(k.session.layout.nbytes for k in self._kept.values())
                raise CapacityError(f"a new context needs {nbytes / 2**20:.1f} MiB, but the open contexts {held} "
                                    f"hold {used / 2**20:.1f} MiB of HeteroConfig.context_memory={budget} bytes "
                                    f"({budget / 2**20:.1f} MiB) and are all still referenced; close some")
            self._kept.pop(min(idle)[1]).session.close()

    def check_contexts(self, owner, contexts):
        """context=[...] of a call of `owner` (the generator): its own open, fresh Contexts."""
        if not contexts:
            raise ValueError("context= got an empty list")
        now = weights_key(self.model)                          # once per call: it looks up every weight
        for c in contexts:
            if not isinstance(c, Context) or c.generator is not owner or c.closed:
                raise ValueError(f"context= takes open Contexts from this generator's prefill(), got {c!r}"
                                 + closed_why(c))
            if self.stale(c, now):                   # a Context's weights: in an arena or in the engine's pool
                raise ValueError(STALE)

    def valid(self, owner, contexts) -> bool:
        """Whether check_contexts passes (a call that would fail it runs where it raises)."""
        try:
            self.check_contexts(owner, contexts)
        except ValueError:
            return False
        return True

    def reusable(self, owner, input_ids, attention_mask, max_new_tokens, cached, fits):
        """Automatic prefix reuse: when every request's prompt starts with the tokens of a live
        Context of `owner` (its cached and pending ones; `cached`: unreferenced ones too, kept as
        a prefix cache under context_memory) and goes on past them, (the longest such contexts,
        the new tokens [B, n] left-padded, their mask); else None. fits(contexts): whether a call
        may continue them (settings.rope_ok)."""
        now = weights_key(self.model)
        tokens = [(k, k.tokens) for k in list(self._kept.values())          # a snapshot: no lock held yet
                  if (cached or k.ref() is not None) and k.adapter is None and k.session.weights == now]
        picks, rests = [], []
        for b in range(input_ids.shape[0]):
            row = input_ids[b, attention_mask[b].bool()].to("cpu")
            best = max((kt for kt in tokens if len(kt[1]) < len(row) and torch.equal(row[:len(kt[1])], kt[1])),
                       key=lambda kt: len(kt[1]), default=None)
            if best is None:
                return None
            picks.append(best[0].context(owner))
            rests.append(row[len(best[1]):])
        if len(picks) == 1 and len(input_ids[0]) + max_new_tokens > picks[0].capacity:
            return None                          # no room in the context's arena: an ordinary generate
        if not fits(picks):
            return None
        width = max(len(r) for r in rests)
        ids = torch.zeros(len(rests), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for b, r in enumerate(rests):
            ids[b, width - len(r):], mask[b, width - len(r):] = r, 1
        return picks, ids.to(input_ids.device), mask.to(input_ids.device)


class _Kept:
    """A context's registry entry: its arena, a weak reference to its Context, and its tokens and
    last use kept here too, so a context nobody references any more can be found and continued
    again (a prefix cache under HeteroConfig.context_memory) until it is evicted."""

    def __init__(self, ctx):
        self.session, self.adapter = ctx.session, ctx.adapter
        self.ref = weakref.ref(ctx)
        self.note(ctx)

    def note(self, ctx):
        self.token_ids, self.pending, self.used = ctx.token_ids, ctx.pending, time.monotonic()

    @property
    def tokens(self):
        return torch.cat([self.token_ids, self.pending])

    def context(self, generator):
        """The Context (a new one over the same arena when nobody references the old any more)."""
        ctx = self.ref()
        if ctx is None:
            ctx = Context(generator, self.session, self.token_ids, self.adapter)
            ctx.pending, ctx.weights = self.pending, self.session.weights
            self.ref = weakref.ref(ctx)
        return ctx


def close_kept(kept):
    """A registry entry's arena, closed; its Context, if one is still held, says so when used."""
    ctx = kept.ref()
    if ctx is not None:
        ctx.closed = True
    kept.session.close()


def closed_why(ctx):
    return ("; this one is closed (ctx.close(), its generator's close(), or a failed call that could not keep "
            "it consistent: a sliding-window ring it had begun to overwrite)") if getattr(ctx, "closed", False) else ""


def weights_key(model):
    """What tells the base weights apart over time: each one's dtype, shape and digest of every
    element (hetero.digest: computed once per in-place version, storage and dtype, so a call
    with unchanged weights only looks them up), and 8 of its values read now (writes through
    .data or numpy bypass the version counter; peft's merge writes so). peft's adapter weights
    aside (LoRA, modules_to_save copies): adapters come and go, and each adapter's KV is tied
    to it by name and digest. One copy of the samples to the host per device, per call."""
    adapters = {id(p) for m in lora_hooks.peft_layers(model)          # any peft tuner's own weights
                for name in getattr(m, "adapter_layer_names", ()) if isinstance(getattr(m, name, None), torch.nn.Module)
                for p in getattr(m, name).parameters()}
    params = [p for n, p in model.named_parameters()
              if id(p) not in adapters and "lora_" not in n and ".modules_to_save." not in n and p.device.type != "meta"]
    samples = {}                    # (device, dtype) -> 8-value views, joined on the device: one copy each
    with torch.no_grad():
        for p in params:
            samples.setdefault((p.device, p.dtype), []).append(p.detach().reshape(-1)[::max(1, p.numel() // 8)][:8])
    values = b"".join(torch.cat(v).cpu().view(torch.uint8).numpy().tobytes() for v in samples.values())
    return tuple((p.dtype, tuple(p.shape), weight_digest(p)) for p in params), values
