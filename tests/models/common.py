"""Tiny models for the CPU tests."""
import torch

from rankdecay.models import MIXERS, RankDecayConfig, RankDecayForCausalLM

LINEAR_MIXERS = tuple(m for m in MIXERS if m != "swa")
# full causal attention with 4 query heads over 2 key/value heads, q/k/v biases and q/k norms (fla's ``Attention``
# as hybrids have it): ``tiny_model("attn")``, or ``"gdn+attn"`` (Gated DeltaNet, then that layer)
ATTN = dict(swa_window=None, swa_num_heads=4, swa_num_kv_heads=2, swa_qkv_bias=True, swa_qk_norm=True)


def tiny_model(mixer: str = "gdn", seed: int = 0, **overrides) -> RankDecayForCausalLM:
    """A tiny fp32 model in eval mode. hh_rank 2 (head_k_dim is 32). A larger
    initializer_range than training's 0.02 makes random logits far from uniform, so
    comparisons of tokens and logits say something. ``"attn"`` / ``"gdn+attn"``: ``ATTN``'s attention layers, their
    biases and norm weights moved off their initial values."""
    if mixer in ("attn", "gdn+attn"):
        layers = dict(layer_mixers=["gdn", "swa"]) if mixer == "gdn+attn" else {}
        model = tiny_model(mixer.removeprefix("gdn+").replace("attn", "swa"), seed, **{**ATTN, **layers, **overrides})
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(("_proj.bias", "q_norm.weight", "k_norm.weight")):
                    p.add_(0.5 * torch.randn_like(p))
        return model
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
