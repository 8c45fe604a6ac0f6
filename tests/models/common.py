"""Tiny models for the CPU tests."""
import torch

from rankdecay.models import MIXERS, RankDecayConfig, RankDecayForCausalLM

LINEAR_MIXERS = tuple(m for m in MIXERS if m != "swa")


def tiny_model(mixer: str = "gdn", seed: int = 0, **overrides) -> RankDecayForCausalLM:
    """A tiny fp32 model in eval mode. hh_rank 2 (head_k_dim is 32). A larger
    initializer_range than training's 0.02 makes random logits far from uniform, so
    comparisons of tokens and logits say something."""
    torch.manual_seed(seed)
    config = RankDecayConfig.from_preset("tiny", mixer=mixer, **{"hh_rank": 2, "initializer_range": 0.2, **overrides})
    model = RankDecayForCausalLM(config).eval()
    if mixer.startswith("hh-"):  # leave the r = 1 start point: a mask that actually masks
        with torch.no_grad():
            for layer in model.model.layers:
                mixer_module = layer.mixer
                if mixer_module.mask_kind == "static":
                    mixer_module.mask_org.normal_(0, 2)
                else:
                    mixer_module.mask_proj.weight.normal_(0, 0.5)
    return model


def random_ids(B: int, T: int, vocab: int = 256, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (B, T), generator=torch.Generator().manual_seed(seed))
