"""Following the model's peft state: which LoRA adapter each request of a call runs.

Owns: the checks of the model's state before a call (dtype, dropout in training mode, adapters
merged into the base weights: check_model_state); what tells a PeftModel's adapters apart over
time (adapter_keys, changed_adapters: HeteroGenerator copies a changed one again); what
adapter_names=None means for a PeftModel (default_adapter, adapters_disabled); a call's
LoraBatch (lora_batch, active); and the adapters a context's continuation must keep (context_adapters,
loaded). Plain functions over the model, its PeftModel (or None) and the generator's AdapterStore
(or None); the generator holds the state (the store, the keys of the adapters it copied).
"""
import collections
import contextlib
import sys

import torch

from hetero.adapters import hooks as lora_hooks, source as lora_source
from hetero.context import Context
from hetero.errors import AdapterError


def is_peft_model(model):
    peft = sys.modules.get("peft")      # a PeftModel exists only if peft was imported
    return peft is not None and isinstance(model, peft.PeftModel)


def loaded_names(store):
    """Names of the adapters loaded in `store` (None: none loaded yet)."""
    return sorted(store.adapters) if store else []


def peft_layers(model):
    """peft's tuner layers in the model now (merge_adapter() writes an adapter into their base
    weights; adapters come and go after the generator was built); none without peft imported."""
    return lora_hooks.peft_layers(model)


def check_model_state(model, spec, owner="HeteroGenerator"):
    """Refused, before a call runs the model: a model whose dtype changed since the generator was
    built over it (spec); a peft adapter merged into the base weights (merge_adapter), which would
    reach every request, the base-model ones too, and add twice to its own (peft refuses
    adapter_names then); a model in training mode with dropout (hetero's attention and LoRA deltas
    apply none, transformers' would). Returns the model's peft layers, for the call's
    default_adapter and lora_batch (one scan: ~2 ms per 2,500 modules)."""
    if model.dtype != spec.dtype:
        raise ValueError(f"the model is in {model.dtype} now, but this {owner} was built over it in "
                         f"{spec.dtype} (its KV cache and kernels hold {spec.dtype}); build a new "
                         f"{owner} after changing the model's dtype")
    if model.training:
        cfg = model.config.get_text_config()
        p = max([getattr(cfg, "attention_dropout", 0.0) or 0.0] +
                [m.p for m in model.modules() if isinstance(m, torch.nn.Dropout)])
        if p > 0:
            raise ValueError(f"the model is in training mode with dropout (p={p}): transformers' generate "
                             "would drop activations at random and hetero would not; call model.eval()")
    layers = peft_layers(model)
    merged = sorted({a for m in layers for a in m.merged_adapters})
    if merged:
        raise AdapterError(f"the model's weights hold merged LoRA adapters {merged} (peft merge_adapter): "
                           "hetero adds adapters per request over the base weights; call unmerge_adapter() "
                           "first (or merge_and_unload() and pass the merged model without adapters)")
    return layers


def changed_adapters(keys, layers):
    """(the names among `keys` (adapter_keys when they were copied) whose LoRA weights or scaling
    changed since, or that were deleted from the PeftModel; adapter_keys(layers) now)."""
    now = adapter_keys(layers)
    return [n for n, key in keys.items() if now.get(n) != key], now


def adapters_disabled(peft_model, model, layers=None):
    """A PeftModel inside its disable_adapter(): peft then runs the base model, whatever
    adapter_names say. layers: the model's peft layers, when the call has them already."""
    return peft_model is not None and any(getattr(m, "disable_adapters", False)
                                          for m in (peft_layers(model) if layers is None else layers))


def default_adapter(peft_model, model, store, layers):
    """What adapter_names=None (prefill's adapter_name=None) runs: the base model; for a
    PeftModel, its active adapter, as its own generate runs it (the base model while its
    adapters are disabled: peft's disable_adapter()). layers: the model's peft layers."""
    if peft_model is None or adapters_disabled(peft_model, model, layers):
        return None
    active = list(peft_model.active_adapters)
    if len(active) != 1:
        raise AdapterError(f"the PeftModel has {len(active)} active adapters {active} (peft adds them up); hetero "
                           "runs one adapter per request: pass adapter_names (or set_adapter one)")
    if store is None or active[0] not in store.adapters:
        raise AdapterError(f"the PeftModel's active adapter {active[0]!r} is not loaded in this generator (added "
                           f"after it was built?); loaded: {loaded_names(store)}")
    return active[0]


def lora_batch(store, hooks, peft_model, model, adapter_names, batch, layers=None):
    """The call's LoraBatch (None: no adapters anywhere), acted on by `hooks` (the generator's
    LoraHooks) only. layers: the model's peft layers (None: found here)."""
    if store is None and adapter_names is None:
        return None
    if adapter_names is None:           # every request on the base model (default_adapter: None)
        adapter_names = [None] * batch
    if isinstance(adapter_names, str) or not isinstance(adapter_names, (list, tuple)):
        raise TypeError(f"adapter_names must be a list with one name (or None) per request, got {adapter_names!r}")
    if len(adapter_names) != batch:
        raise ValueError(f"adapter_names has {len(adapter_names)} entries for a batch of {batch} requests")
    chosen = []
    for n in adapter_names:
        if n is None or n == lora_source.BASE:
            chosen.append(None)
        elif store is not None and n in store.adapters:
            chosen.append(store.adapters[n])
        else:
            raise AdapterError(f"adapter_names names {n!r}, which is not loaded (loaded: {loaded_names(store)}; "
                               f"None or {lora_source.BASE!r} = base model)")
    if adapters_disabled(peft_model, model, layers):       # as peft: its LoRA layers skip adapter_names then
        chosen = [None] * len(chosen)
    return lora_hooks.LoraBatch(store, chosen, owner=hooks)   # only this generator's hooks act on it


def context_adapters(owner, store, peft_model, contexts, adapter_names, batch):
    """adapter_names for a call of `owner` (the generator, whose AdapterStore and PeftModel are
    given) continuing `contexts`: each request goes on with the LoRA adapter its context was
    prefilled with (its KV holds that adapter's keys and values); None takes theirs, naming
    another raises."""
    own = [loaded(store, c.adapter) for c in contexts if isinstance(c, Context) and not c.closed
           and c.generator is owner]
    if len(own) != len(contexts) or len(contexts) != batch:
        return adapter_names                 # not this generator's open Contexts, or not one per request: raised later
    names = [None if a is None else a.name for a in own]
    if any(names) and adapters_disabled(peft_model, owner.model):
        raise AdapterError(f"the contexts were prefilled with adapters {names}, but the PeftModel's adapters are "
                           "disabled (disable_adapter()); continue them outside it")
    if adapter_names is None:
        return names if any(names) else None
    given = [None if n == lora_source.BASE else n for n in adapter_names] \
        if isinstance(adapter_names, (list, tuple)) else adapter_names
    if given != names:
        raise ValueError(f"adapter_names={adapter_names!r}, but the contexts were prefilled with {names} "
                         "(None: the base model); a context goes on with its own adapter")
    return adapter_names


def loaded(store, adapter):
    """A context's adapter (or None), checked to be still the one loaded in `store` under its name."""
    if adapter is not None and (store is None or store.adapters.get(adapter.name) is not adapter):
        raise AdapterError(f"a context was prefilled with adapter {adapter.name!r}, which has been unloaded or "
                           "changed since (a PeftModel's adapter whose weights changed is copied again); its KV "
                           "holds the old adapter's keys and values: prefill it again")
    return adapter


def adapter_keys(layers):
    """{adapter name: what tells its LoRA weights apart over time (each lora_A / lora_B weight's
    identity, storage and in-place version counter, and the layer's scaling)} over peft layers."""
    if not layers:
        return {}
    from peft.tuners.lora import LoraLayer

    keys = collections.defaultdict(list)
    for m in layers:
        if isinstance(m, LoraLayer):
            for name, a in m.lora_A.items():
                b = m.lora_B[name]
                keys[name].append(tuple((id(w), _storage(w), _version(w)) for w in (a.weight, b.weight))
                                  + (m.scaling.get(name),))
    return {name: tuple(k) for name, k in keys.items()}


def _storage(tensor):
    """Its storage's address (a tensor subclass without one: None)."""
    try:
        return tensor.data_ptr()
    except RuntimeError:
        return None


def _version(tensor):
    """Its in-place version counter (an inference tensor has none: -1)."""
    try:
        return tensor._version
    except RuntimeError:
        return -1


@contextlib.contextmanager
def active(lora_batch):
    """The call's LoraBatch (or None) is what the LoRA hooks apply while inside."""
    token = lora_hooks.active_batch.set(lora_batch)
    try:
        yield
    finally:
        lora_hooks.active_batch.reset(token)
