"""Token mixers (nn.Module): the shared block of GDN Fig. 1 and a subclass per mechanism."""
from .attention import SlidingWindowAttention
from .cache import Cache
from .mixers import (
    GLA,
    HDLA,
    DeltaNet,
    GatedDeltaNet,
    GatedDeltaProduct,
    HeadInHead,
    LinearAttention,
    LinearMixer,
    SimpleGLA,
)
from .modules import GatedRMSNorm, RMSNorm, ShortConvolution

__all__ = [
    "Cache", "LinearMixer", "DeltaNet", "GatedDeltaNet", "GatedDeltaProduct", "GLA", "SimpleGLA", "LinearAttention",
    "HDLA", "HeadInHead", "SlidingWindowAttention", "RMSNorm", "GatedRMSNorm", "ShortConvolution",
]
