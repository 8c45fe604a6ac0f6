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
    KDA,
    LinearAttention,
    LinearMixer,
    SimpleGLA,
)
from .loss import linear_cross_entropy
from .modules import GatedRMSNorm, RMSNorm, ShortConvolution
from .packing import PackedLinears, pack

__all__ = [
    "Cache", "LinearMixer", "DeltaNet", "GatedDeltaNet", "GatedDeltaProduct", "KDA", "GLA", "SimpleGLA",
    "LinearAttention",
    "HDLA", "HeadInHead", "SlidingWindowAttention", "RMSNorm", "GatedRMSNorm", "ShortConvolution",
    "PackedLinears", "pack", "linear_cross_entropy",
]
