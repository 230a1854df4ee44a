"""LoRA adapters of an engine: which one each request runs, served by the CPU workers.

A standalone Engine owns an AdapterStore (the adapters' weights in shared memory, mapped in the
workers, with background device copies) and LoraHooks (instance hooks on the adapted layers),
as a HeteroGenerator does (hetero.adapters); a generator's engine uses the generator's. Each
step's forward gets a packed LoraBatch: rows [row0, row1) of the step run their request's
adapter (hetero.adapters.hooks.LoraBatch.packed), decode tokens' deltas on the workers, prompt
chunks on the model's device once the adapter's device copy is there.

  state            written by                                 read by
  store, hooks     load/unload (under the engine's step lock)  the engine thread (each step)
"""
from __future__ import annotations

from hetero.adapters import hooks as lora_hooks, source as lora_source, sync
from hetero.errors import AdapterError


class EngineAdapters:
    """An engine's own adapters (Engine(model, adapters={name: dir}), load_adapter, a PeftModel's)."""

    def __init__(self, model, pool):
        self.model, self.pool = model, pool
        self.store = None
        self.hooks = lora_hooks.LoraHooks(model)
        self.peft = False                 # a PeftModel's layers run their base alone in every step

    def _ensure_store(self):
        if self.store is None:
            from hetero.adapters.store import AdapterStore

            store = AdapterStore(self.model.device, *lora_hooks.max_linear_dims(self.model))
            try:
                store.attach(self.pool)
            except BaseException:
                store.close()
                raise
            self.store = store
        return self.store

    def add(self, name, weights):
        """weights: {module path: (A, B, scaling)} (hetero.adapters.source)."""
        if not self.peft and lora_hooks.peft_layers(self.model, lora_only=True):
            raise AdapterError("the model holds peft LoRA layers but was not passed as its PeftModel (its "
                               "get_base_model()?): pass the PeftModel itself to serve adapters with it")
        store = self._ensure_store()
        store.add(name, weights)
        for path in weights:
            self.hooks.ensure(path, store.sites[path])

    def load(self, name, path):
        lora_source.check_name(name, self.store.adapters if self.store else {})
        self.add(name, lora_source.from_directory(name, path, self.model))

    def from_peft(self, peft_model):
        """Serve every adapter of a PeftModel by name (its LoRA layers then run their base layer
        alone in the engine's steps: each request gets only the adapter it names)."""
        self.peft = True
        for name in peft_model.peft_config:
            self.add(name, lora_source.from_peft_model(peft_model, name, self.model))
        self.hooks.route_peft_layers()

    def load_in_turn(self, name, path, turn):
        """load() with the weights read first and the pool's jobs (mapping them) in `turn`."""
        lora_source.check_name(name, self.store.adapters if self.store else {})
        weights = lora_source.from_directory(name, path, self.model)
        with turn():
            self.add(name, weights)

    def remove_in_turn(self, name, turn):
        with turn():
            self.remove(name)

    def remove(self, name):
        if self.store is None or name not in self.store.adapters:
            raise AdapterError(f"no adapter named {name!r} is loaded (loaded: {sync.loaded_names(self.store)})")
        self.store.remove(name)

    def lora(self):
        """(store, hooks) for a step, or (None, None) when no adapter was ever loaded."""
        return (self.store, self.hooks) if self.store is not None or self.peft else (None, None)

    def close(self):
        try:
            self.hooks.remove()
        finally:
            if self.store is not None:
                self.store.close()
                self.store = None
