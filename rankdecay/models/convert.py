"""Gated DeltaNet checkpoints of flash-linear-attention (fla) as rankdecay models.

fla's ``GatedDeltaNetForCausalLM`` (``model_type = "gated_deltanet"``) is the same network as
``RankDecayForCausalLM`` with ``mixer="gdn"``: embeddings, N x [RMSNorm -> Gated DeltaNet -> + -> RMSNorm ->
SwiGLU -> +], a final norm and the LM head; the mixer's q, k, v projections with SiLU short convolutions,
L2-normalised q and k, the gate ``-exp(A_log) softplus(a_proj x + dt_bias)``, β = σ(b_proj x) (x 2 with
``allow_neg_eigval``), the output RMSNorm times SiLU of ``g_proj x``, and ``o_proj``. So a checkpoint converts by
renaming (``attn.`` -> ``mixer.``, ``q_conv1d.weight [D, 1, W]`` -> ``q_conv.weight [D, W]``) and its config by
mapping fields; then rankdecay decodes it with its kernels and CUDA graphs, and prunes it (the state-reduction paper
prunes such checkpoints). Settings rankdecay has no counterpart for (grouped value heads, attention layers, a
sigmoid output gate, convolution biases, ...) are refused by name rather than dropped.

    from rankdecay.models import from_fla
    model = from_fla("path/to/fla-checkpoint")       # a folder fla saved, or an fla model in memory
    model.save_pretrained("gdn-rankdecay")

or ``rankdecay convert-fla SRC OUT``.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from .config import RankDecayConfig

# fla GatedDeltaNetConfig fields that change the network, and the values rankdecay's GDN model has
# (the first value is the default where the config does not name the field)
_FIXED = {"use_gate": (True,), "output_gate_activation": ("swish", "silu"), "attn": (None,), "conv_bias": (False,),
          "attnres_block_size": (None,), "use_l2warp": (False,), "hidden_act": ("swish", "silu")}


def fla_config(fla: dict) -> RankDecayConfig:
    """The ``RankDecayConfig`` of an fla Gated DeltaNet config (as a dict: ``config.json`` or ``to_dict()``)."""
    if fla.get("model_type") != "gated_deltanet":
        raise ValueError(f"only fla's Gated DeltaNet (model_type 'gated_deltanet') converts; got "
                         f"{fla.get('model_type')!r}")
    for key, allowed in _FIXED.items():
        value = fla.get(key, allowed[0])
        if value not in allowed:
            raise ValueError(f"fla config {key} = {value!r} has no rankdecay counterpart (rankdecay's Gated DeltaNet "
                             f"takes {' or '.join(map(repr, allowed))}); not converted")
    num_v = fla.get("num_v_heads")
    if num_v not in (None, fla["num_heads"]):
        raise ValueError(f"fla config num_v_heads = {num_v} (grouped value heads) has no rankdecay counterpart")
    head_k = fla["head_dim"]
    head_v = int(head_k * fla.get("expand_v", 2))
    return RankDecayConfig(
        vocab_size=fla["vocab_size"], hidden_size=fla["hidden_size"], num_hidden_layers=fla["num_hidden_layers"],
        mixer="gdn", num_heads=fla["num_heads"], head_k_dim=head_k, head_v_dim=head_v,
        use_short_conv=fla.get("use_short_conv", True), conv_size=fla.get("conv_size", 4),
        allow_neg_eigval=bool(fla.get("allow_neg_eigval", False)), intermediate_size=fla.get("intermediate_size"),
        rms_norm_eps=fla.get("norm_eps", 1e-6), initializer_range=fla.get("initializer_range", 0.02),
        tie_word_embeddings=fla.get("tie_word_embeddings", False), use_cache=fla.get("use_cache", True),
        bos_token_id=fla.get("bos_token_id"), eos_token_id=fla.get("eos_token_id"),
        pad_token_id=fla.get("pad_token_id"))


def fla_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """fla's Gated DeltaNet weights under rankdecay's names (the tensors themselves, reshaped where needed)."""
    out = {}
    for name, tensor in state.items():
        new = name.replace(".attn.", ".mixer.")
        for conv in ("q", "k", "v"):
            if new.endswith(f".mixer.{conv}_conv1d.weight"):
                new = new.replace(f"{conv}_conv1d.weight", f"{conv}_conv.weight")
                tensor = tensor.reshape(tensor.shape[0], tensor.shape[-1])  # [D, 1, W] -> [D, W]
        out[new] = tensor
    return out


def from_fla(source, dtype: torch.dtype | None = None):
    """A ``RankDecayForCausalLM`` with the weights of an fla ``GatedDeltaNetForCausalLM``.

    source: a folder fla saved (``config.json`` and safetensors or ``pytorch_model.bin`` files; fla itself need not
        be installed), a Hugging Face Hub repository of one (``"org/name"``, downloaded with ``huggingface_hub``
        where no such folder exists), or the fla model itself. dtype: the weights' dtype (default: as stored).
    Returns the model in eval mode, on the fla model's device (from a folder, on the CPU); every weight is checked to
    land (none missing, none left over)."""
    from .modeling import RankDecayForCausalLM

    device = None  # a folder loads on the CPU; a model converts onto its own device
    if isinstance(source, torch.nn.Module):
        fla, state = source.config.to_dict(), source.state_dict()
        device = next(iter(state.values())).device
    else:
        folder = local_folder(source)
        if not (folder / "config.json").exists():
            raise ValueError(f"{folder} has no config.json: give a folder an fla model was saved to, or the model")
        fla, state = json.loads((folder / "config.json").read_text()), _load_weights(folder)
    config = fla_config(fla)
    model = RankDecayForCausalLM(config)
    state = fla_state_dict(state)
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise ValueError(f"the fla checkpoint does not match a rankdecay Gated DeltaNet of its config: missing "
                         f"{missing[:8]}, unexpected {unexpected[:8]}")
    return model.to(device=device, dtype=dtype).eval()


def local_folder(source) -> Path:
    """``source`` itself where it is a folder here, else the Hub repository of that name downloaded (its config,
    weights and tokenizer files) into Hugging Face's cache."""
    folder = Path(source)
    if folder.exists() or str(source).count("/") != 1 or str(source).startswith((".", "/", "~")):
        return folder
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(str(source), allow_patterns=["*.json", "*.safetensors", "*.bin", "tokenizer*",
                                                                "*.model"]))


def _load_weights(folder: Path) -> dict[str, torch.Tensor]:
    files = sorted(folder.glob("*.safetensors"))
    if files:
        from safetensors.torch import load_file

        return {k: v for f in files for k, v in load_file(str(f)).items()}
    files = sorted(folder.glob("pytorch_model*.bin"))
    if not files:
        raise ValueError(f"{folder} holds no *.safetensors or pytorch_model*.bin weights")
    return {k: v for f in files for k, v in torch.load(f, map_location="cpu", weights_only=True).items()}
