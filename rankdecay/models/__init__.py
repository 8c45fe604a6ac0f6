"""Language models: one class for every mixer, registered with transformers' Auto classes."""
from .config import MIXERS, PRESETS, RankDecayConfig
from .convert import from_fla
from .generation import GraphDecoder
from .modeling import RankDecayForCausalLM, RankDecayModel, build_mixer, output_cache

__all__ = ["MIXERS", "PRESETS", "RankDecayConfig", "RankDecayModel", "RankDecayForCausalLM", "build_mixer",
           "GraphDecoder", "output_cache", "from_fla"]
