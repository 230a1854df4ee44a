"""hetero: heterogeneous CPU-GPU long-context inference for transformers causal LMs.

Names are imported lazily: CPU worker processes import `hetero.worker`,
which must not pull torch or transformers in through this package.
"""
import importlib

_EXPORTS = {
    "HeteroGenerator": "hetero.generator",
    "HeteroConfig": "hetero.config",
    "Context": "hetero.context",
    **{name: "hetero.engine.engine" for name in ("Engine", "EngineConfig", "RequestStream")},
    **{name: "hetero.errors" for name in ("HeteroError", "UnsupportedModelError", "CapacityError", "WorkerError",
                                          "WorkerDiedError", "GeneratorClosedError", "AdapterError",
                                          "ContextFileError", "MissingDependencyError", "EngineError")},
}
__all__ = list(_EXPORTS)
__version__ = "0.1.0"


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'hetero' has no attribute {name!r}")
