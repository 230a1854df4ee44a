"""hetero: heterogeneous CPU-GPU long-context inference for transformers causal LMs."""
from hetero.config import HeteroConfig
from hetero.errors import (CapacityError, GeneratorClosedError, HeteroError, UnsupportedModelError,
                           WorkerDiedError, WorkerError)
from hetero.generator import HeteroGenerator

__all__ = ["HeteroGenerator", "HeteroConfig", "HeteroError", "UnsupportedModelError", "CapacityError",
           "WorkerError", "WorkerDiedError", "GeneratorClosedError"]
__version__ = "0.1.0"
