"""One language model for every mixer: [RMSNorm -> mixer -> + -> RMSNorm -> SwiGLU -> +] x N."""
from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.utils import logging

from .. import ops
from ..layers import (
    GLA, HDLA, KDA, Cache, DeltaNet, GatedDeltaNet, GatedDeltaProduct, HeadInHead, LinearAttention, LinearMixer,
    RMSNorm, SimpleGLA, SlidingWindowAttention,
)
from ..layers.loss import REDUCTIONS as _LOSS_REDUCTIONS
from ..layers.loss import linear_cross_entropy
from ..layers.modules import swiglu as _swiglu
from ..layers.packing import fused_input_projections as _fused_input_projections
from ..layers.packing import fused_output_linear as _fused_output_linear
from ..layers.packing import output_linear as _output_linear
from ..layers.packing import projections as _packed_projections
from .config import RankDecayConfig

logger = logging.get_logger(__name__)

# transformers 5.24 renamed the outputs' and generate's ``past_key_values`` to ``cache`` (the old name
# still works there, with a deprecation warning). The model takes both and answers in the installed name.
CACHE_FIELD = "cache" if "cache" in {f.name for f in dataclasses.fields(BaseModelOutputWithPast)} else "past_key_values"


def output_cache(out) -> Cache | None:
    """The cache of a model output (``out.cache`` with transformers >= 5.24, ``out.past_key_values`` before)."""
    return getattr(out, CACHE_FIELD)


def _one_cache(past_key_values: Cache | None, cache: Cache | None) -> Cache | None:
    if cache is not None and past_key_values is not None and cache is not past_key_values:
        raise ValueError("give the cache once: past_key_values or cache (its name from transformers 5.24), not both")
    return past_key_values if cache is None else cache


def build_mixer(name: str, config: RankDecayConfig, layer_idx: int) -> nn.Module:
    """The token mixer ``name`` for layer ``layer_idx`` of a model with this config."""
    if name == "swa":
        heads = config.swa_num_heads or config.num_heads
        return SlidingWindowAttention(config.hidden_size, heads, config.swa_head_dim, window_size=config.swa_window,
                                      rope_theta=config.rope_theta, layer_idx=layer_idx,
                                      num_kv_heads=getattr(config, "swa_num_kv_heads", None),
                                      qkv_bias=getattr(config, "swa_qkv_bias", False),
                                      qk_norm=getattr(config, "swa_qk_norm", False))
    common = dict(use_short_conv=config.use_short_conv, conv_size=config.conv_size, chunk_size=config.chunk_size,
                  mode=config.mixer_mode, norm_eps=config.rms_norm_eps, layer_idx=layer_idx,
                  scale=config.attn_scale, shared_qk_conv=config.shared_qk_conv,
                  state_dtype=getattr(config, "state_dtype", "float32"),
                  use_output_gate=getattr(config, "use_output_gate", True),
                  output_gate_rank=getattr(config, "output_gate_rank", None),
                  qkv_activation=getattr(config, "qkv_activation", "silu"))
    if config.allow_neg_eigval is not None and name in ("gdn", "deltanet", "gdp", "kda", "hdla", "hh-gdn", "hh-dn"):
        common["allow_neg_eigval"] = config.allow_neg_eigval
    if getattr(config, "gate_logit_normalizer", None) is not None and name in ("gla", "hdla"):
        common["gate_logit_normalizer"] = config.gate_logit_normalizer
    if getattr(config, "output_gate_act", None) is not None:
        common["gate_act"] = config.output_gate_act
    if getattr(config, "num_v_heads", None) not in (None, config.num_heads):
        common["num_v_heads"] = config.num_v_heads
    if getattr(config, "gate_lower_bound", None) is not None and name == "kda":
        common["gate_lower_bound"] = config.gate_lower_bound
    cls, extra = {
        "gdn": (GatedDeltaNet, {}),
        "deltanet": (DeltaNet, {}),
        "gdp": (GatedDeltaProduct, {"num_householder": config.num_householder,
                                    "use_forget_gate": getattr(config, "use_forget_gate", True)}),
        "kda": (KDA, {}),
        "gla": (GLA, {}),
        "simple_gla": (SimpleGLA, {}),
        "linear_attn": (LinearAttention, {}),
        "hdla": (HDLA, {}),
        "hh-gdn": (HeadInHead, {"rank": config.hh_rank, "mask": config.hh_mask, "gated": True}),
        "hh-dn": (HeadInHead, {"rank": config.hh_rank, "mask": config.hh_mask, "gated": False}),
    }[name]
    return cls(config.hidden_size, config.num_heads, config.head_k_dim, config.head_v_dim, **common, **extra)


class SwiGLU(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def input_projections(self) -> tuple[str, ...]:
        """The linear maps of the input x (one packed product when decoding: ``rankdecay.layers.packing``)."""
        return ("gate_proj", "up_proj")

    def forward(self, x, packed=None, projected=None):
        """x [..., D]; ``packed``: a ``PackedLinears`` of gate_proj and up_proj (used without autograd);
        ``projected``: their outputs where the caller formed them already (``Block.decode_step``)."""
        p = projected if projected is not None else _packed_projections(self, self.input_projections(), x, packed)
        gate, up = (self.gate_proj(x), self.up_proj(x)) if p is None else (p["gate_proj"], p["up_proj"])
        fused = _fused_output_linear(self.down_proj, gate, packed, u=up, x_act="silu")  # B = 1 on a GPU
        return fused if fused is not None else _output_linear(self.down_proj, _swiglu(gate, up), packed)


class Block(nn.Module):
    def __init__(self, config: RankDecayConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.mixer_name = config.mixers[layer_idx]
        self.attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, autocast_output=True)
        self.mixer = build_mixer(self.mixer_name, config, layer_idx)
        self.mlp_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, autocast_output=True)
        self.mlp = SwiGLU(config.hidden_size, config.intermediate_size)

    def forward(self, x, attention_mask=None, cache=None, use_cache=False, cu_seqlens=None):
        h, _ = self.mixer(self.attn_norm(x), attention_mask, cache, use_cache, cu_seqlens)
        x = x + h
        packed = cache.packed(self.layer_idx, "mlp") if cache is not None else None
        return x + self.mlp(self.mlp_norm(x), packed)

    def decode_step(self, x: torch.Tensor, pending: torch.Tensor | None, cache: Cache
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A one-row decode step with packs (``RankDecayModel`` calls it): ``x + pending`` through the block, as
        ``(x', pending')`` whose sum is the block's output. Where the one-row kernel applies, each residual add and
        the norm after it go into the next product (``layers.packing.fused_input_projections``), so they take no
        kernels of their own and the last add is left to the next block; else the plain forward."""
        fused = _fused_input_projections(cache.packed(self.layer_idx, "mixer"), x, self.attn_norm, pending)
        mlp_packed = cache.packed(self.layer_idx, "mlp")
        if fused is None or mlp_packed is None:
            return self(x if pending is None else x + pending, None, cache, True), None
        p, x = fused
        h, _ = self.mixer(x, None, cache, True, None, projected=p)
        fused = _fused_input_projections(mlp_packed, x, self.mlp_norm, h)
        if fused is None:  # the MLP's pack refused what the mixer's took (its weights' dtype or layout)
            x = x + h
            return x + self.mlp(self.mlp_norm(x), mlp_packed), None
        p, x = fused
        return x, self.mlp(x, mlp_packed, projected=p)


class RankDecayPreTrainedModel(PreTrainedModel):
    config_class = RankDecayConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["Block"]
    _is_stateful = True  # a recurrent cache: no assisted decoding or cache cropping

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # we bring our own fixed-size cache (rankdecay.layers.Cache)

    def _init_weights(self, module):
        std = self.config.initializer_range
        if isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=std)
        elif isinstance(module, nn.Linear):
            if getattr(module, "_zero_init", False):
                nn.init.zeros_(module.weight)
            else:
                nn.init.normal_(module.weight, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)


class RankDecayModel(RankDecayPreTrainedModel):
    """Embeddings, N blocks and the final norm; returns hidden states and the cache."""

    def __init__(self, config: RankDecayConfig):
        super().__init__(config)
        self.embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Block(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.gradient_checkpointing = False
        self.post_init()

    def get_input_embeddings(self):
        return self.embeddings

    def set_input_embeddings(self, value):
        self.embeddings = value

    def forward(self, input_ids=None, attention_mask=None, past_key_values: Cache | None = None, inputs_embeds=None,
                use_cache: bool | None = None, cu_seqlens: torch.Tensor | None = None, cache: Cache | None = None,
                output_hidden_states: bool | None = None, output_attentions: bool | None = None,
                return_dict: bool | None = None, **kwargs):
        """input_ids [B, T] (or inputs_embeds [B, T, D]); attention_mask [B, T] or [B, past + T] with 0 at
        (left) padding; cu_seqlens [N + 1] for sequences packed along T (B = 1). The cache of earlier
        tokens comes as ``past_key_values`` or ``cache`` (transformers >= 5.24 names it so) and goes
        back in the output under the installed transformers' name (``output_cache`` reads either).
        With ``cu_seqlens`` the cache has one row per sequence: packed prompts fill it (N rows), then steps
        ``input_ids [N, 1]`` continue them as a batch, and packed tokens with it continue each row.
        ``output_hidden_states`` (or the config's): ``hidden_states``, a tuple of N + 1 [B, T, D] tensors, the
        input of each layer and the final norm's output, as transformers' models give them. There are no
        attention weights (``output_attentions`` gives None, with a warning). ``return_dict=False``: a tuple.

        Other keyword arguments that transformers' generation passes (position_ids, ...) are
        not used: positions live in the cache.
        """
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("give exactly one of input_ids and inputs_embeds")
        x = self.embeddings(input_ids) if inputs_embeds is None else inputs_embeds
        B, T = x.shape[:2]
        past_key_values = _one_cache(past_key_values, cache)
        use_cache = self.config.use_cache if use_cache is None else use_cache
        output_hidden_states = _flag(output_hidden_states, self.config.output_hidden_states)
        if _flag(output_attentions, self.config.output_attentions):
            logger.warning_once("rankdecay's mixers form no attention weights: output_attentions gives None")
        if use_cache and self.gradient_checkpointing and self.training and torch.is_grad_enabled():
            # the backward runs each layer again, which would read the cache the forward had already written
            logger.warning_once("use_cache=True is incompatible with gradient checkpointing: setting use_cache=False "
                                "(a cache given is read, not written)")
            use_cache = False
        if use_cache and past_key_values is None:
            past_key_values = Cache(self.config.num_hidden_layers)
        if attention_mask is not None:
            if attention_mask.dim() != 2 or attention_mask.shape[0] != B or attention_mask.shape[1] < T:
                raise ValueError(f"attention_mask must be [B, T] or [B, past + T] with B = {B}, T = {T}; "
                                 f"got {list(attention_mask.shape)}")
            attention_mask = attention_mask[:, -T:]
            if bool(attention_mask.all()):
                attention_mask = None
        if (use_cache and past_key_values.projections is not None and B * T == 1 and attention_mask is None
                and cu_seqlens is None and not torch.is_grad_enabled() and not output_hidden_states):
            # a one-row step with packs (GraphDecoder): each residual add and norm inside the next product
            pending = None
            for layer in self.layers:
                x, pending = layer.decode_step(x, pending, past_key_values)
            past_key_values.seen_tokens += T
            x = x if pending is None else x + pending
            out = BaseModelOutputWithPast(last_hidden_state=self.norm(x), **{CACHE_FIELD: past_key_values})
            return out if _flag(return_dict, self.config.return_dict) else out.to_tuple()
        hidden = []
        for layer in self.layers:
            if output_hidden_states:
                hidden.append(x)
            if self.gradient_checkpointing and self.training:
                x = self._gradient_checkpointing_func(layer.__call__, x, attention_mask, past_key_values, use_cache,
                                                      cu_seqlens)
            else:
                x = layer(x, attention_mask, past_key_values, use_cache, cu_seqlens)
        if use_cache:  # packed sequences: as many as the longest one's (as a left-padded batch of them would)
            past_key_values.seen_tokens += T if cu_seqlens is None else int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
        x = self.norm(x)
        out = BaseModelOutputWithPast(last_hidden_state=x, hidden_states=(*hidden, x) if output_hidden_states else None,
                                      **{CACHE_FIELD: past_key_values if use_cache else None})
        return out if _flag(return_dict, self.config.return_dict) else out.to_tuple()


def _flag(value: bool | None, default: bool) -> bool:
    return default if value is None else value


def _per_item(loss: torch.Tensor, num_items_in_batch: int | torch.Tensor | None) -> torch.Tensor:
    """A summed loss divided by transformers' ``num_items_in_batch`` (the targets of every accumulated batch)."""
    if num_items_in_batch is None:
        return loss
    if isinstance(num_items_in_batch, torch.Tensor):
        num_items_in_batch = num_items_in_batch.to(loss.device)
    return loss / num_items_in_batch


class RankDecayForCausalLM(RankDecayPreTrainedModel, GenerationMixin):
    """The language model: ``RankDecayModel`` and an LM head (tied to the embeddings or not)."""

    _tied_weights_keys = {"lm_head.weight": "model.embeddings.weight"}

    def __init__(self, config: RankDecayConfig):
        super().__init__(config)
        self.model = RankDecayModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embeddings

    def set_input_embeddings(self, value):
        self.model.embeddings = value

    def generate(self, inputs=None, generation_config=None, *, graph_decoder: bool = False, compile: bool = False,
                 **kwargs):
        """transformers' ``generate``. With ``graph_decoder=True`` (or ``compile=True``) the tokens come from a
        ``rankdecay.models.GraphDecoder`` kept on the model, as Mamba's ``generate(..., cg=True)``: the step as a
        CUDA graph on a GPU (the same steps eagerly on a CPU), ``compile`` through ``torch.compile`` as well. It
        takes what ``GraphDecoder.generate`` does (``input_ids``, ``attention_mask``, ``max_new_tokens`` or
        ``max_length``, ``do_sample``, ``temperature``, ``top_k``, ``top_p``, ``eos_token_id``, ``pad_token_id``,
        from the arguments or the generation config; a ``streamer``) and returns the ids ``[B, T + new]``; any other
        setting is refused by name. The decoder is built at the first such call and kept for the next ones (a copy
        or pickle of the model leaves it behind); uncompiled, its sliding-window rings hold the prompt and the new
        tokens rounded up to a power of two (64 at least), or the window if that is less, and a call that needs more
        builds it again; compiled, the window's (a new size would compile again)."""
        if not graph_decoder and not compile:
            return super().generate(inputs, generation_config, **kwargs)
        from .generation import graph_generate

        return graph_generate(self, inputs, generation_config, compile, kwargs)

    def __getstate__(self):
        # the decoder ``generate(graph_decoder=True)`` keeps (CUDA graphs, static buffers) is not copied or pickled
        state = super().__getstate__()
        state.pop("_graph_decoder", None)
        return state

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, value):
        self.lm_head = value

    def forward(self, input_ids=None, attention_mask=None, past_key_values: Cache | None = None, inputs_embeds=None,
                labels=None, use_cache: bool | None = None, cu_seqlens: torch.Tensor | None = None,
                logits_to_keep: int = 0, cache: Cache | None = None, loss_reduction: str = "mean",
                output_hidden_states: bool | None = None, output_attentions: bool | None = None,
                return_dict: bool | None = None, num_items_in_batch: int | torch.Tensor | None = None, **kwargs):
        """Logits [B, T, vocab] and, with ``labels`` [B, T], the next-token cross-entropy (labels are shifted
        inside; -100 is ignored): its mean over the targets, or with ``loss_reduction`` "sum" their sum, "none"
        [B, T - 1] per target (0 where ignored), fp32. ``num_items_in_batch`` (transformers' Trainer passes it under
        gradient accumulation): the mean is the sum over this batch's targets divided by it, the number of targets
        in all the accumulated batches. With ``config.fuse_linear_cross_entropy`` in training
        (``model.train()``, labels given, a plain ``nn.Linear`` head) the loss goes through
        ``rankdecay.layers.linear_cross_entropy`` and ``logits`` is None. See ``RankDecayModel.forward``."""
        if loss_reduction not in _LOSS_REDUCTIONS:
            raise ValueError(f"loss_reduction must be one of {_LOSS_REDUCTIONS}; got {loss_reduction!r}")
        if num_items_in_batch is not None and loss_reduction != "mean":
            raise ValueError(f"num_items_in_batch divides the loss's sum in place of the mean: it needs "
                             f"loss_reduction='mean', got {loss_reduction!r}")
        reduction = "sum" if num_items_in_batch is not None else loss_reduction
        if labels is not None and (input_ids is not None or inputs_embeds is not None):
            shape = (input_ids if input_ids is not None else inputs_embeds).shape[:2]
            if labels.shape != shape:
                raise ValueError(f"labels must be [B, T] = {list(shape)}, as the inputs; got {list(labels.shape)}")
        out = self.model(input_ids, attention_mask, _one_cache(past_key_values, cache), inputs_embeds, use_cache,
                         cu_seqlens, output_hidden_states=output_hidden_states, output_attentions=output_attentions,
                         return_dict=True)
        h = out.last_hidden_state
        as_tuple = not _flag(return_dict, self.config.return_dict)
        if (labels is not None and self.training and self.config.fuse_linear_cross_entropy
                and type(self.lm_head) is nn.Linear):
            # every position, the last one's target ignored: x stays h itself (no copy), and no logits are formed
            target = F.pad(labels[:, 1:], (0, 1), value=-100)
            loss = linear_cross_entropy(h, target, self.lm_head.weight, self.lm_head.bias, reduction=reduction)
            loss = loss[:, :-1] if loss_reduction == "none" else _per_item(loss, num_items_in_batch)
            result = CausalLMOutputWithPast(loss=loss, logits=None, hidden_states=out.hidden_states,
                                            **{CACHE_FIELD: output_cache(out)})
            return result.to_tuple() if as_tuple else result
        logits = self.lm_head(h if not logits_to_keep else h[:, -logits_to_keep:])
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100,
                                   reduction=reduction)
            loss = loss.view(labels[:, 1:].shape) if loss_reduction == "none" else _per_item(loss, num_items_in_batch)
        result = CausalLMOutputWithPast(loss=loss, logits=logits, hidden_states=out.hidden_states,
                                        **{CACHE_FIELD: output_cache(out)})
        return result.to_tuple() if as_tuple else result

    def num_params(self, exclude_embeddings: bool = False) -> int:
        """Parameters (tied weights counted once); optionally without the embeddings."""
        n = sum(p.numel() for p in self.parameters())
        if exclude_embeddings:
            n -= self.model.embeddings.weight.numel()
        return n

    def flops_per_token(self, seq_len: int = 2048, training: bool = True) -> float:
        """Estimated FLOPs per token: 2 per weight in a matmul (x3 with backward), plus the mixers'
        sequence work (the chunked algorithm for linear mixers, the window for attention)."""
        matmul_params = self.num_params(exclude_embeddings=True)
        if self.config.tie_word_embeddings:
            matmul_params += self.lm_head.weight.numel()  # the tied head is still a matmul
        mixer = sum(mixer_flops_per_token(layer.mixer, seq_len) for layer in self.model.layers)
        return (3 if training else 1) * (2 * matmul_params + mixer)


def mixer_flops_per_token(mixer: nn.Module, seq_len: int) -> float:
    """Forward FLOPs per token of a mixer's sequence mixing (projections excluded)."""
    if isinstance(mixer, SlidingWindowAttention):
        context = min(mixer.window_size or seq_len, seq_len / 2)  # average causal context
        return 4 * mixer.num_heads * mixer.head_dim * context
    assert isinstance(mixer, LinearMixer)
    H, K, V, C = mixer.num_v_heads, mixer.head_k_dim, mixer.head_v_dim, mixer.chunk_size  # a state per value head
    r_kv = mixer.kv_per_token
    r_ab = {DeltaNet: r_kv, GatedDeltaNet: r_kv, GatedDeltaProduct: r_kv, KDA: r_kv, HDLA: 2}.get(type(mixer), 0)
    if isinstance(mixer, HeadInHead):
        r_ab = mixer.rank
    return H * ops.chunk_flops_per_token(K, V, C, r_ab, r_kv)


AutoConfig.register(RankDecayConfig.model_type, RankDecayConfig)
AutoModel.register(RankDecayConfig, RankDecayModel)
AutoModelForCausalLM.register(RankDecayConfig, RankDecayForCausalLM)
