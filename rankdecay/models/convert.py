"""Gated DeltaNet, DeltaNet, GLA, Gated DeltaProduct and KDA checkpoints of flash-linear-attention (fla) as
rankdecay models.

fla's ``GatedDeltaNetForCausalLM`` (``model_type = "gated_deltanet"``) is the same network as
``RankDecayForCausalLM`` with ``mixer="gdn"``: embeddings, N x [RMSNorm -> Gated DeltaNet -> + -> RMSNorm -> SwiGLU
-> +], a final norm and the LM head; the mixer's q, k, v projections with SiLU short convolutions, L2-normalised q
and k, the gate ``-exp(A_log) softplus(a_proj x + dt_bias)``, β = σ(b_proj x) (x 2 with ``allow_neg_eigval``), the
output RMSNorm times SiLU (or sigmoid: ``output_gate_activation``) of ``g_proj x`` (``use_gate``; without it the
RMSNorm alone), and ``o_proj``. fla's
``DeltaNetForCausalLM`` (``"delta_net"``) is ``mixer="deltanet"`` the same way: no gate and no decay, head widths
from ``expand_k`` and ``expand_v``, and by default no output gate (``use_gate=False``, rankdecay's
``use_output_gate=False``). fla's ``GLAForCausalLM`` (``"gla"``) is ``mixer="gla"``: the gate ``logsigmoid(W2 W1 x)
/ 16`` through the same low-rank ``gk_proj``, and, as fla makes it by default, no short convolution and no
activation on q, k, v (``qkv_activation=None``; with fla's ``use_short_conv`` the SiLU convolutions). fla's
``GatedDeltaProductForCausalLM`` (``"gated_deltaproduct"``) is ``mixer="gdp"``: ``num_householder`` keys, values and
βs per token in fla's layout, and by default no forget gate (DeltaProduct, ``use_forget_gate=False``). fla's
``KDAForCausalLM`` (``"kda"``, Kimi Linear's mixer) is ``mixer="kda"``: the per-channel gate ``-exp(A_log)
softplus(f_proj x + dt_bias)`` through fla's low-rank ``f_proj`` (or, with fla's ``lower_bound`` b,
``b sigmoid(exp(A_log) (f_proj x + dt_bias))``: rankdecay's ``gate_lower_bound``), and its output gate, a sigmoid of
a low-rank ``g_proj`` with a bias (``output_gate_act="sigmoid"``, ``output_gate_rank=head_v_dim``). So a
checkpoint converts by renaming (``attn.`` -> ``mixer.``, ``q_conv1d.weight [D, 1, W]`` -> ``q_conv.weight [D, W]``)
and its config by mapping fields; then rankdecay decodes it with its kernels and CUDA graphs, and prunes it (the
state-reduction paper prunes such checkpoints). Gated DeltaNet's grouped value heads (``num_v_heads``, fla's GVA)
convert too, and so do hybrids: fla's ``attn`` config (a dict, or a list of them with one setting) puts its
``Attention`` layer at ``attn["layers"]``, which is rankdecay's ``"swa"`` mixer there (``layer_mixers``): its heads
(``swa_num_heads``; the head width ``hidden_size / num_heads``, as fla forms it), ``num_kv_heads`` (grouped
key/value heads), ``qkv_bias``, ``window_size`` (None: full causal attention) and ``rope_theta``; fla's
``attn.q_proj`` ... become ``mixer.q_proj`` ... as for any layer. Settings rankdecay has no counterpart for (other
mechanisms' grouped value heads, convolution biases, DeltaNet without β or with another feature map or q/k norm, GLA
with grouped key/value heads, a feature map, a clamped gate or an output norm without weights, ...) are refused by
name rather than dropped.

    from rankdecay.models import from_fla
    model = from_fla("path/to/fla-checkpoint")       # a folder fla saved, or an fla model in memory
    model.save_pretrained("gdn-rankdecay")

or ``rankdecay convert-fla SRC OUT``.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from .config import RankDecayConfig, swiglu_width

# fla config fields that change the network, and the values rankdecay's models have (the first value is the default
# where the config does not name the field): those every converted model shares, then each model type's own
_SHARED = {"conv_bias": (False,), "attnres_block_size": (None,), "use_l2warp": (False,),
           "hidden_act": ("swish", "silu")}
_TYPES = {  # fla model_type: its name, rankdecay's mixer, its fixed fields, the output gate's field and default
    # (None: always one), and the defaults of use_short_conv, expand_k (None: widths from head_dim) and expand_v
    "gated_deltanet": dict(name="Gated DeltaNet", mixer="gdn",
                           fixed={"output_gate_activation": ("swish", "silu", "sigmoid")},
                           gate=("use_gate", True), conv=True, expand_k=None, expand_v=2),
    "delta_net": dict(name="DeltaNet", mixer="deltanet",
                      fixed={"use_beta": (True,), "qk_norm": ("l2",), "qk_activation": ("silu",)},
                      gate=("use_gate", False), conv=True, expand_k=1.0, expand_v=1.0),
    "gla": dict(name="GLA", mixer="gla",
                fixed={"feature_map": (None,), "clamp_min": (None,), "elementwise_affine": (True,)},
                gate=("use_output_gate", True), conv=False, expand_k=0.5, expand_v=1.0),
    "gated_deltaproduct": dict(name="Gated DeltaProduct", mixer="gdp", fixed={}, gate=("use_output_gate", True),
                               conv=True, expand_k=None, expand_v=2),
    "kda": dict(name="KDA", mixer="kda", fixed={}, gate=None, conv=True, expand_k=None, expand_v=1.0),
}
FLA_NAMES = {kind["mixer"]: kind["name"] for kind in _TYPES.values()}  # rankdecay's mixer: the fla model's name


def _head_dims(fla: dict) -> tuple[int, int]:
    """(head_k_dim, head_v_dim) as fla's layer forms them."""
    heads, kind = fla["num_heads"], _TYPES[fla["model_type"]]
    if kind["expand_k"] is None:  # Gated DeltaNet and DeltaProduct: head_dim, and expand_v of it
        head_k = fla["head_dim"]
        return head_k, int(head_k * fla.get("expand_v", kind["expand_v"]))
    dims = []
    for key, default in (("expand_k", kind["expand_k"]), ("expand_v", kind["expand_v"])):  # hidden_size * expand
        width = fla["hidden_size"] * fla.get(key, default)
        if width != int(width) or int(width) % heads:
            raise ValueError(f"fla config hidden_size * {key} = {width} is not a whole number of {heads} heads")
        dims.append(int(width) // heads)
    return dims[0], dims[1]


# fla's attention settings (an ``attn`` spec's keys besides ``layers``), their defaults, and rankdecay's fields
_ATTN = {"num_heads": (None, "swa_num_heads"), "num_kv_heads": (None, "swa_num_kv_heads"),
         "qkv_bias": (False, "swa_qkv_bias"), "window_size": (None, "swa_window"),
         "rope_theta": (10000.0, "rope_theta")}


def _attention(fla: dict, mixer: str) -> dict:
    """The config fields of fla's hybrid attention layers (``attn``): ``layer_mixers`` with ``"swa"`` at its
    layers, and the attention layers' settings; ``{}`` without ``attn``."""
    specs = fla.get("attn")
    if specs is None:
        return {}
    specs = [specs] if isinstance(specs, dict) else list(specs)
    if not specs or not all(isinstance(spec, dict) and "layers" in spec and "num_heads" in spec for spec in specs):
        raise ValueError(f"fla config attn = {fla['attn']!r}: expected a dict, or a list of dicts, each with "
                         "'layers' and 'num_heads'")
    settings = [{key: spec.get(key) if spec.get(key) is not None else default for key, (default, _) in _ATTN.items()}
                for spec in specs]
    for setting in settings:
        setting["num_kv_heads"] = setting["num_kv_heads"] or setting["num_heads"]
    for other in settings[1:]:
        if other != settings[0]:
            raise ValueError(f"fla config attn has attention layers of different settings ({settings[0]} and "
                             f"{other}): rankdecay's attention layers share one; not converted")
    unknown = sorted({key for spec in specs for key in spec} - set(_ATTN) - {"layers", "qk_norm"})
    if unknown or any(spec.get("qk_norm") for spec in specs):  # (fla's hybrid blocks build no q/k norm)
        raise ValueError(f"fla config attn has {unknown or ['qk_norm']}, which rankdecay's conversion does not "
                         "know; not converted")
    layers = {i for spec in specs for i in spec["layers"]}
    if not layers <= set(range(fla["num_hidden_layers"])):
        raise ValueError(f"fla config attn layers {sorted(layers)} are not all below num_hidden_layers = "
                         f"{fla['num_hidden_layers']}")
    heads = settings[0]["num_heads"]
    if fla["hidden_size"] % heads:
        raise ValueError(f"fla config attn num_heads = {heads} does not divide hidden_size = {fla['hidden_size']}")
    fields = {field: settings[0][key] for key, (_, field) in _ATTN.items()}
    return dict(fields, swa_head_dim=fla["hidden_size"] // heads,
                layer_mixers=["swa" if i in layers else mixer for i in range(fla["num_hidden_layers"])])


def fla_config(fla: dict) -> RankDecayConfig:
    """The ``RankDecayConfig`` of an fla Gated DeltaNet, DeltaNet, GLA, Gated DeltaProduct or KDA config (as a dict:
    ``config.json`` or ``to_dict()``), with the attention layers of a hybrid (fla's ``attn``)."""
    name = fla.get("model_type")
    if name not in _TYPES:
        *most, last = FLA_NAMES.values()
        raise ValueError(f"only fla's {', '.join(most)} and {last} (model_type {', '.join(map(repr, _TYPES))}) "
                         f"convert; got {name!r}")
    kind = _TYPES[name]
    for key, allowed in {**_SHARED, **kind["fixed"]}.items():
        value = fla.get(key, allowed[0])
        if value not in allowed:
            raise ValueError(f"fla config {key} = {value!r} has no rankdecay counterpart (rankdecay's "
                             f"{kind['mixer']} takes {' or '.join(map(repr, allowed))}); not converted")
    for key in ("num_v_heads", "num_kv_heads"):
        if fla.get(key) not in (None, fla["num_heads"]) and not (key == "num_v_heads" and name == "gated_deltanet"):
            raise ValueError(f"fla config {key} = {fla[key]} (grouped heads) has no rankdecay counterpart")
    head_k, head_v = _head_dims(fla)
    conv = fla.get("use_short_conv", kind["conv"])
    product = dict(num_householder=fla.get("num_householder", 1),
                   use_forget_gate=bool(fla.get("use_forget_gate", False))) if name == "gated_deltaproduct" else {}
    mlp = fla.get("intermediate_size") or swiglu_width(fla["hidden_size"], fla.get("hidden_ratio") or 4)
    gate = dict(output_gate_act="sigmoid" if fla.get("output_gate_activation") == "sigmoid" else None)
    if name == "kda":  # Kimi Linear's output gate, and its bounded decay where fla's config sets one
        gate = dict(output_gate_act="sigmoid", output_gate_rank=head_v, gate_lower_bound=fla.get("lower_bound"))
    return RankDecayConfig(
        vocab_size=fla["vocab_size"], hidden_size=fla["hidden_size"], num_hidden_layers=fla["num_hidden_layers"],
        mixer=kind["mixer"], num_heads=fla["num_heads"], head_k_dim=head_k, head_v_dim=head_v,
        use_short_conv=conv, conv_size=fla.get("conv_size", 4),
        # GLA without a convolution takes q, k, v as projected; every other case has the SiLU
        qkv_activation="silu" if conv or name != "gla" else None,
        use_output_gate=kind["gate"] is None or bool(fla.get(*kind["gate"])), **gate,
        allow_neg_eigval=bool(fla.get("allow_neg_eigval", False)) if name != "gla" else None,
        intermediate_size=mlp, rms_norm_eps=fla.get("norm_eps", 1e-6),
        initializer_range=fla.get("initializer_range", 0.02), tie_word_embeddings=fla.get("tie_word_embeddings", False),
        use_cache=fla.get("use_cache", True), bos_token_id=fla.get("bos_token_id"),
        eos_token_id=fla.get("eos_token_id"), pad_token_id=fla.get("pad_token_id"),
        num_v_heads=fla.get("num_v_heads") if name == "gated_deltanet" else None, **product,
        **_attention(fla, kind["mixer"]))


def fla_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """fla's weights under rankdecay's names (the tensors themselves, reshaped where needed)."""
    out = {}
    for name, tensor in state.items():
        new = name.replace(".attn.", ".mixer.")
        for norm in ("g_norm_swish_gate.weight", "g_norm.weight"):  # GLA's output norm
            if new.endswith(f".mixer.{norm}"):
                new = new.replace(norm, "o_norm.weight")
        for conv in ("q", "k", "v"):
            if new.endswith(f".mixer.{conv}_conv1d.weight"):
                new = new.replace(f"{conv}_conv1d.weight", f"{conv}_conv.weight")
                tensor = tensor.reshape(tensor.shape[0], tensor.shape[-1])  # [D, 1, W] -> [D, W]
        out[new] = tensor
    return out


def from_fla(source, dtype: torch.dtype | None = None):
    """A ``RankDecayForCausalLM`` with the weights of an fla ``GatedDeltaNetForCausalLM``, ``DeltaNetForCausalLM``,
    ``GLAForCausalLM``, ``GatedDeltaProductForCausalLM`` or ``KDAForCausalLM``, hybrids with attention layers
    (fla's ``attn``: Gated DeltaNet-H1 / H2 and the like) included.

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
        raise ValueError(f"the fla checkpoint does not match a rankdecay {config.mixer} model of its config: missing "
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
