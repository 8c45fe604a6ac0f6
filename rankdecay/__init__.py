"""rankdecay: linear attention with structured, rank-enhanced decay matrices."""
from . import ops

__version__ = "0.1.0"

__all__ = ["ops", "__version__"]
