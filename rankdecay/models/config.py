"""The model configuration: a transformers ``PretrainedConfig`` with named presets."""
from __future__ import annotations

from transformers import PretrainedConfig

from ..ops import _inputs

# the decoding cache's recurrent state (``state_dtype``): the names of the dtypes the kernels update in place
STATE_DTYPES = tuple(str(d).removeprefix("torch.") for d in _inputs.STATE_DTYPES)
MIXERS = ("gdn", "deltanet", "gdp", "kda", "gla", "simple_gla", "linear_attn", "hdla", "hh-gdn", "hh-dn", "swa")

# Shapes of the papers. Head-in-Head Table 9: 340M = 24 layers, d 1024, 4 heads, tied
# embeddings; 1.3B = 24 layers, d 2048, 8 heads, untied; the "standard 4d² mixer" (HH
# App. E) is GLA's convention: key dim d/2, value dim d (q, k: d²/2 each; v, gate,
# output: d² each), i.e. head_k_dim = d / 2H, head_v_dim = d / H. The SwiGLU width is
# fla's: 2/3 * 4d rounded up to a multiple of 256. "tiny" is for CPU tests with the
# byte tokenizer (256 bytes + bos/eos/pad, padded to 264).
PRESETS: dict[str, dict] = {
    "tiny": dict(vocab_size=264, hidden_size=64, num_hidden_layers=2, num_heads=2, intermediate_size=192,
                 tie_word_embeddings=True, bos_token_id=256, eos_token_id=257, pad_token_id=258, chunk_size=16,
                 swa_window=32),
    "340m": dict(vocab_size=32000, hidden_size=1024, num_hidden_layers=24, num_heads=4, head_k_dim=128,
                 head_v_dim=256, tie_word_embeddings=True),
    "1.3b": dict(vocab_size=32000, hidden_size=2048, num_hidden_layers=24, num_heads=8, head_k_dim=128,
                 head_v_dim=256, tie_word_embeddings=False),
}


def swiglu_width(hidden_size: int, hidden_ratio: float = 4) -> int:
    """fla's SwiGLU width rule: 2/3 of hidden_size x hidden_ratio, rounded up to a multiple of 256."""
    return 256 * -(-int(hidden_size * hidden_ratio * 2 / 3) // 256)


class RankDecayConfig(PretrainedConfig):
    """Configuration of a rankdecay language model.

    Args:
        vocab_size, hidden_size, num_hidden_layers: the usual.
        mixer: the token mixer of every layer, one of ``MIXERS``: "gdn" (Gated
            DeltaNet), "deltanet", "gdp" (Gated DeltaProduct), "kda" (Kimi Delta Attention), "gla", "simple_gla",
            "linear_attn", "hdla", "hh-gdn" / "hh-dn" (Head-in-Head over GDN /
            DeltaNet), "swa" (sliding-window attention).
        layer_mixers: optional per-layer list overriding ``mixer`` (hybrid stacks),
            e.g. ``["gdn", "swa"] * 12`` for Gated DeltaNet-H1.
        num_heads: heads of the linear mixers; head_k_dim / head_v_dim default to
            hidden_size / num_heads (``expand_v = head_v_dim / head_k_dim``).
        use_short_conv, conv_size: the short causal convolution on q, k, v.
        qkv_activation: "silu" (the shared block's SiLU on q, k, v after the short convolution, or on the
            projections without one) or None (fla's GLA without a convolution: q, k, v as projected).
        use_output_gate: the linear mixers' output gate (their output RMSNorm times SiLU of ``g_proj x``); False
            leaves the RMSNorm alone (fla's DeltaNet default, ``use_gate=False``).
        output_gate_act: the output gate's activation, "silu" or "sigmoid" (Kimi Linear's); None keeps each
            mechanism's (SiLU; HDLA's gate is linear, its paper's eq. 30).
        output_gate_rank: None: ``g_proj`` is one linear map; an int r: a low-rank one, D -> r -> H V with a bias on
            the second map (fla's KDA, r = head_v_dim).
        allow_neg_eigval: β in [0, 2]; None keeps each mechanism's default (True for
            HDLA, as in its paper; False otherwise).
        num_householder: n_h of Gated DeltaProduct.
        use_forget_gate: Gated DeltaProduct's decay; False is DeltaProduct (fla's default).
        gate_lower_bound: KDA's decay bounded to (b, 0) for a negative b: log α = b sigmoid(exp(A_log) (f +
            dt_bias)) (fla's ``lower_bound``); None is Kimi Linear's -exp(A_log) softplus(f + dt_bias).
        gate_logit_normalizer: τ of the per-channel decays sigmoid(W x)^(1/τ) of GLA and HDLA;
            None keeps each one's default (16 for both, GLA's; 1 is HDLA's eq. 6 as written).
        hh_rank, hh_mask: Head-in-Head groups per head r and "static" / "data" masks.
        chunk_size, mixer_mode: chunked-path chunk size; "chunk" or "recurrent".
        shared_qk_conv: one short-conv filter per head for q and k (state-reduction App. D.6).
        attn_scale: the linear mixers' query scale (default head_k_dim ** -0.5; a model
            pruned by ``rankdecay.prune`` keeps the scale of its original key size).
        swa_window, swa_num_heads, swa_head_dim, rope_theta: the attention layers (``layers.SlidingWindowAttention``):
            the tokens a query sees (itself included; None: full causal attention), query heads (default
            num_heads), head width (default hidden_size / heads) and the rotary embedding's base.
        swa_num_kv_heads, swa_qkv_bias, swa_qk_norm: the attention layers' grouped key/value heads (a divisor of
            their heads; None: as many), biases on q, k and v, and RMSNorms of each head of q and k (fla's
            ``Attention``: ``num_kv_heads``, ``qkv_bias``, ``qk_norm``).
        intermediate_size: SwiGLU width (default: fla's rule from hidden_size).
        use_cache: return a decoding cache by default.
        state_dtype: the dtype the linear mixers keep their recurrent state in, in the decoding
            cache: "float32" (default) or "bfloat16" / "float16", which halves the cache and the
            memory a decode step moves (vLLM's ``mamba_ssm_cache_dtype``). The state is still
            updated in fp32 inside each step and rounded once per step when stored.
        fuse_linear_cross_entropy: in training, ``RankDecayForCausalLM`` forms the loss through the LM head in
            slices of the vocabulary (``rankdecay.layers.linear_cross_entropy``) and returns no logits: none of the
            [B, T, vocab] logits or their gradient are held (fla's option of the same name).
        num_v_heads: grouped value heads (fla's GVA, Gated DeltaNet and DeltaNet mixers only): this many value
            heads, a multiple of num_heads, each reading query and key head h // (num_v_heads / num_heads); None:
            num_heads.
    """

    model_type = "rankdecay"

    def __init__(
        self,
        vocab_size: int = 32000,
        hidden_size: int = 1024,
        num_hidden_layers: int = 24,
        mixer: str = "gdn",
        layer_mixers: list[str] | None = None,
        num_heads: int = 4,
        head_k_dim: int | None = None,
        head_v_dim: int | None = None,
        use_short_conv: bool = True,
        conv_size: int = 4,
        use_output_gate: bool = True,
        output_gate_act: str | None = None,
        output_gate_rank: int | None = None,
        qkv_activation: str | None = "silu",
        allow_neg_eigval: bool | None = None,
        num_householder: int = 2,
        use_forget_gate: bool = True,
        gate_lower_bound: float | None = None,
        gate_logit_normalizer: float | None = None,
        hh_rank: int = 4,
        hh_mask: str = "static",
        chunk_size: int = 64,
        mixer_mode: str = "chunk",
        attn_scale: float | None = None,
        shared_qk_conv: bool = False,
        swa_window: int | None = 2048,
        swa_num_heads: int | None = None,
        swa_head_dim: int | None = None,
        swa_num_kv_heads: int | None = None,
        swa_qkv_bias: bool = False,
        swa_qk_norm: bool = False,
        rope_theta: float = 10000.0,
        intermediate_size: int | None = None,
        rms_norm_eps: float = 1e-6,
        initializer_range: float = 0.02,
        tie_word_embeddings: bool = True,
        use_cache: bool = True,
        state_dtype: str = "float32",
        fuse_linear_cross_entropy: bool = False,
        num_v_heads: int | None = None,
        bos_token_id: int | None = None,
        eos_token_id: int | None = None,
        pad_token_id: int | None = None,
        **kwargs,
    ):
        self.vocab_size, self.hidden_size, self.num_hidden_layers = vocab_size, hidden_size, num_hidden_layers
        self.mixer, self.layer_mixers = mixer, list(layer_mixers) if layer_mixers is not None else None
        self.num_heads, self.head_k_dim, self.head_v_dim = num_heads, head_k_dim, head_v_dim
        self.use_short_conv, self.conv_size, self.allow_neg_eigval = use_short_conv, conv_size, allow_neg_eigval
        self.use_output_gate, self.qkv_activation = use_output_gate, qkv_activation
        self.output_gate_act, self.output_gate_rank = output_gate_act, output_gate_rank
        self.num_householder, self.hh_rank, self.hh_mask = num_householder, hh_rank, hh_mask
        self.use_forget_gate, self.gate_lower_bound = use_forget_gate, gate_lower_bound
        self.gate_logit_normalizer = gate_logit_normalizer
        self.chunk_size, self.mixer_mode, self.attn_scale = chunk_size, mixer_mode, attn_scale
        self.shared_qk_conv = shared_qk_conv
        self.swa_window, self.swa_num_heads, self.swa_head_dim, self.rope_theta = (
            swa_window, swa_num_heads, swa_head_dim, rope_theta)
        self.swa_num_kv_heads, self.swa_qkv_bias, self.swa_qk_norm = swa_num_kv_heads, swa_qkv_bias, swa_qk_norm
        if intermediate_size is None:
            intermediate_size = swiglu_width(hidden_size)
        self.intermediate_size, self.rms_norm_eps, self.initializer_range = (
            intermediate_size, rms_norm_eps, initializer_range)
        self.use_cache, self.state_dtype = use_cache, state_dtype
        self.num_v_heads = num_v_heads
        self.fuse_linear_cross_entropy = fuse_linear_cross_entropy
        super().__init__(tie_word_embeddings=tie_word_embeddings, bos_token_id=bos_token_id,
                         eos_token_id=eos_token_id, pad_token_id=pad_token_id, **kwargs)
        self.validate_mixers()

    @property
    def mixers(self) -> list[str]:
        """The mixer of each layer."""
        return list(self.layer_mixers) if self.layer_mixers is not None else [self.mixer] * self.num_hidden_layers

    def validate_mixers(self) -> None:
        """Clear errors for configurations no model can be built from."""
        if self.layer_mixers is not None and len(self.layer_mixers) != self.num_hidden_layers:
            raise ValueError(f"layer_mixers has {len(self.layer_mixers)} entries for num_hidden_layers = "
                             f"{self.num_hidden_layers}")
        for name in self.mixers:
            if name not in MIXERS:
                raise ValueError(f"unknown mixer {name!r}; choose from {', '.join(MIXERS)}")
        if self.head_k_dim is None and self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}; "
                             "set head_k_dim / head_v_dim explicitly")
        head_k = self.head_k_dim or self.hidden_size // self.num_heads
        if any(name.startswith("hh-") for name in self.mixers) and head_k % self.hh_rank:
            raise ValueError(f"hh_rank {self.hh_rank} must divide head_k_dim {head_k}")
        if self.hh_mask not in ("static", "data"):
            raise ValueError(f"hh_mask must be 'static' or 'data', got {self.hh_mask!r}")
        if getattr(self, "output_gate_act", None) not in (None, "silu", "sigmoid"):
            raise ValueError(f"output_gate_act must be None (each mechanism's), 'silu' or 'sigmoid', got "
                             f"{self.output_gate_act!r}")
        if self.state_dtype not in STATE_DTYPES:
            raise ValueError(f"state_dtype must be one of {', '.join(STATE_DTYPES)}, got {self.state_dtype!r}")

    @classmethod
    def from_dict(cls, config_dict: dict, **kwargs):
        # Saved before gate_logit_normalizer existed (2026-11-24), HDLA's decay was eq. 6 as written
        # (tau = 1); such a model keeps it instead of taking today's default of 16.
        if "gate_logit_normalizer" not in config_dict:
            config_dict = {**config_dict, "gate_logit_normalizer": 1.0 if "hdla" in (
                config_dict.get("layer_mixers") or [config_dict.get("mixer")]) else None}
        return super().from_dict(config_dict, **kwargs)

    @classmethod
    def from_preset(cls, name: str, mixer: str = "gdn", **overrides) -> "RankDecayConfig":
        """A named preset (``tiny``, ``340m``, ``1.3b``) with the given mixer; keywords override fields."""
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; choose from {', '.join(PRESETS)}")
        return cls(**{**PRESETS[name], "mixer": mixer, **overrides})
