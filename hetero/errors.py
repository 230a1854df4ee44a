"""Exceptions raised by hetero. All derive from HeteroError."""


class HeteroError(RuntimeError):
    """Base class of hetero's errors."""


class UnsupportedModelError(HeteroError, ValueError):
    """The model lacks something the engine needs (named in the message)."""


class CapacityError(HeteroError, ValueError):
    """A request does not fit: model positions, configured cache capacity, or free RAM."""


class WorkerError(HeteroError):
    """A CPU worker failed a job or died."""


class WorkerDiedError(WorkerError):
    """A CPU worker process exited while the engine needed it."""


class GeneratorClosedError(HeteroError):
    """The generator was used after close()."""


class AdapterError(HeteroError, ValueError):
    """A LoRA adapter cannot be loaded or used (unsupported variant, wrong base model, unknown name)."""


class ContextFileError(HeteroError, ValueError):
    """A saved context that cannot be loaded into this model: truncated, corrupted or mismatched."""


class MissingDependencyError(HeteroError):
    """A package this feature needs is not installed (the message names the install command)."""


class EngineError(HeteroError):
    """The engine failed a request (a worker died, the model raised); the cause is chained."""
