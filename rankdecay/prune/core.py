"""Structured pruning of the per-head key dimension (state-reduction paper §3).

For each linear-mixer layer and head a set of key/query channels is kept; the rows of
``W_q`` and ``W_k`` (every key of Gated DeltaProduct), the short-convolution filters of
those channels (Proposition 3.2), HDLA's ``lambda`` projection, GLA's gate projection and KDA's (with its
``dt_bias``) are sliced, and a smaller model (``head_k_dim' < head_k_dim``) is written. The query
scale stays the original ``head_k_dim ** -0.5`` (config ``attn_scale``), so pruning is
exactly "zero the dropped q/k channels" of the original model.

Heads of different sizes (adaptive budgets) are padded to the largest: the padding
channels have zero ``W_q``/``W_k`` rows, so their keys and queries are zero, their state
rows stay zero and they are never read — exact, at the compute cost of the largest head.
Head-in-Head keeps the same number of channels in each of its ``r`` groups (the mask
stays ``r x r`` and the groups stay contiguous), so its budgets are multiples of ``r``.
"""
from __future__ import annotations

import copy
import math

import torch

from ..layers import GLA, HDLA, KDA, HeadInHead, LinearMixer

METHODS = ("rand", "l1", "s-wanda", "grad", "drrqr", "pca")
SELECT = ("kq", "k", "q")


def linear_mixers(model) -> dict[int, LinearMixer]:
    """``{layer index: mixer}`` for the model's linear-attention layers (attention layers are left alone)."""
    return {i: layer.mixer for i, layer in enumerate(model.model.layers) if isinstance(layer.mixer, LinearMixer)}


def group_size(mixer: LinearMixer) -> int:
    """Budgets must be multiples of this (Head-in-Head: its rank r; else 1)."""
    return mixer.rank if isinstance(mixer, HeadInHead) else 1


# ----------------------------------------------------------------------------- budgets
def uniform_budgets(model, ratio: float) -> dict[int, list[int]]:
    """Keep ``round((1 - ratio) K)`` channels of every head (rounded to Head-in-Head's group size)."""
    check_ratio(ratio)
    out = {}
    for i, m in linear_mixers(model).items():
        r = group_size(m)
        keep = r * round((1 - ratio) * m.head_k_dim / r)
        if keep < r:
            raise ValueError(f"ratio {ratio} leaves no key channel of {m.head_k_dim} per head in layer {i} "
                             f"(at least {r} must stay)")
        out[i] = [keep] * m.num_heads
    return out


def adaptive_budgets(model, ratio: float, utilization: dict[int, torch.Tensor]) -> dict[int, list[int]]:
    """Per-head budgets proportional to each head's rank utilisation (App. E.1), with each
    layer's total equal to the uniform budget's; at least one group per head, at most K. With grouped value heads
    (``num_v_heads``: a state per value head) a key head's utilisation is the mean of its value heads'."""
    uniform = uniform_budgets(model, ratio)
    out = {}
    for i, m in linear_mixers(model).items():
        r, H, K = group_size(m), m.num_heads, m.head_k_dim
        total_groups = sum(uniform[i]) // r
        u = utilization[i].double().reshape(H, -1).mean(1).clamp_min(1e-6)
        share = u / u.sum() * total_groups
        groups = share.floor().clamp(1, K // r)
        # largest remainders first, within the per-head cap, until the total is met
        order = torch.argsort(share - share.floor(), descending=True).tolist()
        while groups.sum() < total_groups:
            progressed = False
            for h in order:
                if groups.sum() >= total_groups:
                    break
                if groups[h] < K // r:
                    groups[h] += 1
                    progressed = True
            if not progressed:
                break
        while groups.sum() > total_groups:  # the floor of 1 can overshoot
            h = int(torch.where(groups > 1, groups, torch.full_like(groups, -1)).argmax())
            groups[h] -= 1
        out[i] = [int(g) * r for g in groups]
    return out


def check_ratio(ratio: float) -> None:
    if not isinstance(ratio, (int, float)) or math.isnan(ratio) or not 0 <= ratio < 1:
        raise ValueError(f"ratio (the fraction of key channels to prune) must be in [0, 1), got {ratio!r}")


# ----------------------------------------------------------------------------- selection
def top_channels(scores: torch.Tensor, keep: int, groups: int = 1) -> torch.Tensor:
    """The ``keep`` highest-scoring channels of one head (``keep / groups`` in each of
    ``groups`` contiguous groups), sorted."""
    K = scores.numel()
    if keep < 1 or keep > K or keep % groups:
        raise ValueError(f"cannot keep {keep} of {K} channels in {groups} equal groups")
    size, per = K // groups, keep // groups
    picked = [g * size + torch.topk(scores[g * size:(g + 1) * size], per).indices for g in range(groups)]
    return torch.sort(torch.cat(picked)).values


def validate_keep(model, keep: dict[int, list[torch.Tensor]]) -> None:
    """Each head's kept channels are distinct, in range, non-empty and respect Head-in-Head's groups."""
    mixers = linear_mixers(model)
    if set(keep) != set(mixers):
        raise ValueError(f"keep must name the linear-mixer layers {sorted(mixers)}, got {sorted(keep)}")
    for i, heads in keep.items():
        m = mixers[i]
        if len(heads) != m.num_heads:
            raise ValueError(f"layer {i}: {len(heads)} index sets for {m.num_heads} heads")
        for h, idx in enumerate(heads):
            idx = torch.as_tensor(idx)
            if idx.numel() == 0:
                raise ValueError(f"layer {i} head {h}: keeps no channel (a head needs at least one)")
            if idx.unique().numel() != idx.numel() or idx.min() < 0 or idx.max() >= m.head_k_dim:
                raise ValueError(f"layer {i} head {h}: channel indices must be distinct and in [0, {m.head_k_dim})")
            r = group_size(m)
            if r > 1:
                counts = torch.bincount(idx // (m.head_k_dim // r), minlength=r)
                if not bool((counts == counts[0]).all()):
                    raise ValueError(f"layer {i} head {h}: Head-in-Head needs the same number of channels in each "
                                     f"of its {r} groups, got {counts.tolist()}")


# ----------------------------------------------------------------------------- surgery
def keep_to_transforms(model, keep: dict[int, list[torch.Tensor]]) -> dict[int, torch.Tensor]:
    """Selection matrices ``P`` [H, width, K] (one-hot rows; zero rows pad smaller heads,
    group by group for Head-in-Head) for the kept channels, ``width`` = the largest head."""
    validate_keep(model, keep)
    mixers = linear_mixers(model)
    width = max(len(idx) for heads in keep.values() for idx in heads)
    out = {}
    for i, m in mixers.items():
        H, K, r = m.num_heads, m.head_k_dim, group_size(m)
        P = torch.zeros(H, width, K, dtype=torch.float64)
        for h, idx in enumerate(keep[i]):
            idx = torch.sort(torch.as_tensor(idx, dtype=torch.long)).values
            for g in range(r):
                mine = idx[(idx // (K // r)) == g]
                P[h, g * (width // r) + torch.arange(len(mine)), mine] = 1.0
        out[i] = P
    return out


def _is_selection(T: torch.Tensor) -> bool:
    return bool(((T == 0) | (T == 1)).all() and (T.sum(-1) <= 1).all())


def transform_model(model, transforms: dict[int, torch.Tensor], info: dict | None = None):
    """A new model whose heads' key spaces are mapped by ``T`` [H, K', K]: ``W_q <- T W_q``,
    ``W_k <- T W_k``, non-shared convolution filters ``<- (T * T) W`` (Proposition D.1; exact
    for a selection), shared filters unchanged (Lemma D.2), and, for selections only,
    HDLA's lambda and GLA's gate projections sliced. ``attn_scale`` keeps the original scale."""
    from ..models import RankDecayForCausalLM

    mixers = linear_mixers(model)
    if set(transforms) != set(mixers):
        raise ValueError(f"transforms must name the linear-mixer layers {sorted(mixers)}, got {sorted(transforms)}")
    widths = {int(T.shape[1]) for T in transforms.values()}
    ks, vs = {m.head_k_dim for m in mixers.values()}, {m.head_v_dim for m in mixers.values()}
    scales = {m.scale for m in mixers.values()}
    if len(widths) != 1 or len(ks) != 1 or len(vs) != 1 or len(scales) != 1:
        raise ValueError("all linear mixers must share head_k_dim, head_v_dim and scale (and one new width)")
    width, K, V, scale = widths.pop(), ks.pop(), vs.pop(), scales.pop()
    config = copy.deepcopy(model.config)
    config.head_k_dim, config.head_v_dim, config.attn_scale = width, V, scale
    config.pruning = {**(info or {}), "original_head_k_dim": K, "head_k_dim": width}
    sd = model.state_dict()
    for i, m in mixers.items():
        T = transforms[i]
        if tuple(T.shape) != (m.num_heads, width, K):
            raise ValueError(f"layer {i}: transform must be [H, K', K] = [{m.num_heads}, {width}, {K}]")
        selection = _is_selection(T)
        if not selection and (isinstance(m, (HDLA, GLA, KDA, HeadInHead))):
            raise ValueError(f"layer {i}: {type(m).__name__} has per-channel parameters on the key dimension "
                             "(decays, groups) that do not survive a rotation; use a channel selection method")
        prefix = f"model.layers.{i}.mixer."
        for name, blocks in _key_params(m):
            w = sd[prefix + name]
            t = T.to(device=w.device, dtype=torch.float64)  # T from calibration on the CPU, w on the model's
            if name.endswith("conv.weight"):
                t = t * t
            shaped = w.double().reshape(blocks, m.num_heads, K, -1)
            sd[prefix + name] = torch.einsum("hwk,bhkd->bhwd", t, shaped).reshape(
                (blocks * m.num_heads * width,) + tuple(w.shape[1:])).to(w.dtype)
    new = RankDecayForCausalLM(config).to(device=next(model.parameters()).device)
    missing, unexpected = new.load_state_dict(sd, strict=False)
    missing = [k for k in missing if k != "lm_head.weight" or not config.tie_word_embeddings]
    if missing or unexpected:
        raise RuntimeError(f"pruned model does not match: missing {missing}, unexpected {unexpected}")
    if config.tie_word_embeddings:
        new.tie_weights()
    return new.to(next(model.parameters()).dtype).eval()


def apply_pruning(model, keep: dict[int, list[torch.Tensor]], info: dict | None = None):
    """A new, smaller model keeping channels ``keep[layer][head]`` (indices into the head's keys).

    Every head of the new model has ``head_k_dim' = `` the largest kept set; smaller sets are
    padded with inert zero channels. ``attn_scale`` keeps the original scale, so the result
    equals ``zero_channels(model, keep)`` exactly.
    """
    info = {**(info or {}), "kept": {str(i): [torch.as_tensor(x).tolist() for x in heads] for i, heads in keep.items()}}
    transforms = keep_to_transforms(model, keep)
    width = next(iter(transforms.values())).shape[1]
    info["padding_channels"] = sum(width - len(x) for heads in keep.values() for x in heads)
    return transform_model(model, transforms, info)


def _key_params(m: LinearMixer) -> list[tuple[str, int]]:
    """(parameter name, number of stacked key blocks) of the parameters on the key dimension (dim 0)."""
    n = m.kv_per_token
    names = [("q_proj.weight", 1), ("k_proj.weight", n)]
    if m.use_short_conv and not m.shared_qk_conv:
        names += [("q_conv.weight", 1), ("k_conv.weight", n)]
    if isinstance(m, HDLA):
        names += [("lambda_proj.weight", 1), ("lambda_proj.bias", 1)]
    if isinstance(m, GLA):
        names += [("gk_proj.1.weight", 1), ("gk_proj.1.bias", 1)]
    if isinstance(m, KDA):
        names += [("f_proj.1.weight", 1), ("dt_bias", 1)]
    return names


def zero_channels(model, keep: dict[int, list[torch.Tensor]]):
    """A copy of ``model`` whose dropped q/k channels are zeroed (the reference pruning must equal)."""
    out = copy.deepcopy(model)
    for i, m in linear_mixers(out).items():
        H, K, n = m.num_heads, m.head_k_dim, m.kv_per_token
        mask = torch.zeros(H, K, dtype=torch.bool)
        for h, idx in enumerate(keep[i]):
            mask[h, torch.as_tensor(idx, dtype=torch.long)] = True
        with torch.no_grad():
            m.q_proj.weight[~mask.flatten()] = 0
            m.k_proj.weight[~mask.flatten().repeat(n)] = 0
    return out

