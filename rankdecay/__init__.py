"""rankdecay: linear attention with structured, rank-enhanced decay matrices."""
from . import ops
from . import models  # registers the config and models with transformers' Auto classes

__version__ = "0.1.0"

__all__ = ["ops", "models", "__version__"]
