"""``prune(model, method, ratio, calib)``: choose channels, then cut the model."""
from __future__ import annotations

import torch

from .core import (
    METHODS, SELECT, adaptive_budgets, apply_pruning, check_ratio, linear_mixers, transform_model, uniform_budgets,
)
from .metrics import state_diagnostics
from .scorers import calibrate, channel_scores, pca_transforms, select_by_scores, select_drrqr

NEEDS_CALIBRATION = ("s-wanda", "grad", "drrqr", "pca")


def prune(model, method: str = "drrqr", ratio: float = 0.5, calib: list[torch.Tensor] | None = None,
          select: str = "kq", budget: str = "uniform", tolerance: float = 1.1, seed: int = 0,
          max_rows: int = 5000, pca_adversarial: bool = False):
    """Prune ``ratio`` of every linear mixer's key/query channels; returns ``(smaller_model, info)``.

    Args:
        model: a ``RankDecayForCausalLM`` (not modified).
        method: "rand", "l1", "s-wanda", "grad", "drrqr" or "pca" (state-reduction §3.3.1, App. D).
        ratio: fraction of key channels to drop, in [0, 1); 0 returns an exact copy.
        calib: calibration token ids, a list of [B, T] tensors (needed by s-wanda, grad, drrqr,
            pca and adaptive budgets).
        select: score keys and queries together ("kq", the paper's default), or "k" / "q" only.
        budget: "uniform" (every head keeps the same number) or "adaptive" (per head,
            proportional to its rank utilisation on ``calib``, same total per layer; heads are
            then padded to the largest, which costs the compute of the largest head).
        tolerance: DRRQR's f >= 1 (every |U_ij| and gamma_j / omega_i end <= f).
        pca_adversarial: PCA keeps the lowest-variance components (App. E.4.2's control).
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {', '.join(METHODS)}; got {method!r}")
    if select not in SELECT:
        raise ValueError(f"select must be one of {', '.join(SELECT)}; got {select!r}")
    if budget not in ("uniform", "adaptive"):
        raise ValueError(f"budget must be 'uniform' or 'adaptive', got {budget!r}")
    check_ratio(ratio)
    if not linear_mixers(model):
        raise ValueError("the model has no linear-attention layers to prune")
    if (method in NEEDS_CALIBRATION or budget == "adaptive") and not calib:
        raise ValueError(f"method {method!r} with budget {budget!r} needs calibration data (calib)")
    info = {"method": method, "ratio": ratio, "select": select, "budget": budget}
    if budget == "adaptive":
        diag = state_diagnostics(model, calib[0][: min(4, len(calib[0]))], skip=min(16, calib[0].shape[1] // 2))
        budgets = adaptive_budgets(model, ratio, {i: d["utilization"] for i, d in diag["layers"].items()})
    else:
        budgets = uniform_budgets(model, ratio)
    info["budgets"] = {str(i): b for i, b in budgets.items()}
    cal = None
    if method in NEEDS_CALIBRATION:
        cal = calibrate(model, calib, max_rows=max_rows, with_grad=method == "grad", seed=seed)
    if method == "pca":
        if budget != "uniform":
            raise ValueError("pca takes the uniform budget")
        transforms = pca_transforms(model, cal, budgets, select, adversarial=pca_adversarial)
        shared = all(m.shared_qk_conv or not m.use_short_conv for m in linear_mixers(model).values())
        info["conv_adaptation"] = "none needed (shared filters)" if shared else "W' = (T*T) W (approximate)"
        info["pca_adversarial"] = pca_adversarial
        return transform_model(model, transforms, info), info
    if method == "drrqr":
        keep, stats = select_drrqr(model, cal, budgets, select, tolerance)
        info["drrqr"] = {"tolerance": tolerance, "swaps": sum(s["swaps"] for s in stats),
                         "rho_max": max(s["rho_max"] for s in stats)}
    else:
        keep = select_by_scores(model, channel_scores(model, method, cal, select, seed), budgets)
    return apply_pruning(model, keep, info), info
