"""Calibration statistics and the channel scorers of the state-reduction paper (§3.3.1, App. D).

``calibrate(model, batches)`` runs the model over calibration windows once and keeps,
per linear-mixer layer: the second moment of the mixer input ``X^T X`` (S-Wanda uses
its diagonal, PCA all of it), a subsample of the keys and queries the op sees (DRRQR),
and, when asked, the gradients of the calibration loss w.r.t. ``W_q``/``W_k`` (Grad).

Scores are ``[H, K]`` per layer, higher = keep. ``select`` is "kq" (both, the paper's
default), "k" or "q" (App. E.5).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .core import group_size, linear_mixers, top_channels
from .rrqr import strong_rrqr


@dataclass
class Calibration:
    xx: dict = field(default_factory=dict)      # layer -> [D, D] sum of x x^T over tokens
    tokens: int = 0
    keys: dict = field(default_factory=dict)    # layer -> [H, N, K] subsampled keys
    queries: dict = field(default_factory=dict)  # layer -> [H, N, K]
    grad_q: dict = field(default_factory=dict)  # layer -> [H K, D]
    grad_k: dict = field(default_factory=dict)  # layer -> [n H K, D]


def calibrate(model, batches: list[torch.Tensor], max_rows: int = 5000, with_grad: bool = False,
              seed: int = 0) -> Calibration:
    """Statistics over ``batches`` (each ``[B, T]`` token ids); ``max_rows`` keys and queries kept per head."""
    mixers = linear_mixers(model)
    cal = Calibration()
    gen = torch.Generator().manual_seed(seed)
    total_rows = sum(b.numel() for b in batches)
    take = min(1.0, max_rows / max(total_rows, 1))
    collected = {i: ([], []) for i in mixers}
    handles = []

    def pre_hook(i):
        def hook(mod, args):
            x = args[0].detach().double().flatten(0, 1)
            cal.xx[i] = cal.xx.get(i, 0) + x.T @ x
        return hook

    def qk_hook(i):
        def hook(mod, q, k):
            H, K = mod.num_heads, mod.head_k_dim
            qf, kf = q.detach().float().reshape(-1, H, K), k.detach().float().reshape(-1, H, K)
            for store, t in zip(collected[i], (kf, qf)):
                n = max(1, round(take * t.shape[0]))
                rows = torch.randperm(t.shape[0], generator=gen)[:n].to(t.device)
                store.append(t[rows].transpose(0, 1).cpu())
        return hook

    for i, m in mixers.items():
        handles.append(m.register_forward_pre_hook(pre_hook(i)))
        m.qk_hook = qk_hook(i)
    was_training = model.training
    model.eval()
    try:
        for ids in batches:
            ids = ids.to(next(model.parameters()).device)
            cal.tokens += ids.numel()
            if with_grad:
                out = model(input_ids=ids, labels=ids, use_cache=False)
                out.loss.backward()
            else:
                with torch.no_grad():
                    model(input_ids=ids, use_cache=False)
    finally:
        for h in handles:
            h.remove()
        for m in mixers.values():
            m.qk_hook = None
        model.train(was_training)
    for i, m in mixers.items():
        cal.keys[i] = torch.cat(collected[i][0], dim=1)
        cal.queries[i] = torch.cat(collected[i][1], dim=1)
        if with_grad:
            cal.grad_q[i] = m.q_proj.weight.grad.detach().clone()
            cal.grad_k[i] = m.k_proj.weight.grad.detach().clone()
    if with_grad:
        model.zero_grad(set_to_none=True)
    return cal


def _per_channel(m, w_q: torch.Tensor, w_k: torch.Tensor, select: str) -> torch.Tensor:
    """Row scores of q ([H K]) and k ([n H K]) summed into per-channel [H, K] as ``select`` says."""
    H, K = m.num_heads, m.head_k_dim
    sq = w_q.reshape(H, K)
    sk = w_k.reshape(-1, H, K).sum(0)
    return {"kq": sq + sk, "q": sq, "k": sk}[select]


def channel_scores(model, method: str, cal: Calibration | None, select: str = "kq", seed: int = 0) -> dict:
    """``{layer: [H, K]}`` scores for the score-based methods (rand, l1, s-wanda, grad)."""
    out = {}
    gen = torch.Generator().manual_seed(seed)
    for i, m in linear_mixers(model).items():
        Wq, Wk = m.q_proj.weight.detach().double().cpu(), m.k_proj.weight.detach().double().cpu()
        if method == "rand":
            out[i] = torch.rand(m.num_heads, m.head_k_dim, generator=gen, dtype=torch.float64)
        elif method == "l1":
            out[i] = _per_channel(m, Wq.abs().sum(1), Wk.abs().sum(1), select)
        elif method == "s-wanda":
            xnorm = cal.xx[i].diagonal().clamp_min(0).sqrt().cpu()
            out[i] = _per_channel(m, (Wq.abs() * xnorm).sum(1), (Wk.abs() * xnorm).sum(1), select)
        elif method == "grad":
            gq, gk = cal.grad_q[i].double().cpu(), cal.grad_k[i].double().cpu()
            out[i] = _per_channel(m, (Wq * gq).abs().sum(1), (Wk * gk).abs().sum(1), select)
        else:
            raise ValueError(f"{method!r} is not a score-based method")
    return out


def select_by_scores(model, scores: dict, budgets: dict) -> dict:
    return {i: [top_channels(scores[i][h], budgets[i][h], group_size(m)) for h in range(m.num_heads)]
            for i, m in linear_mixers(model).items()}


def select_drrqr(model, cal: Calibration, budgets: dict, select: str = "kq", tolerance: float = 1.1) -> tuple:
    """Strong-RRQR column selection on the activation matrix [K; Q] of each head (Algorithm 2);
    for Head-in-Head, within each group. Returns ``(keep, stats)``."""
    keep, stats = {}, []
    for i, m in linear_mixers(model).items():
        heads = []
        for h in range(m.num_heads):
            parts = {"kq": [cal.keys[i][h], cal.queries[i][h]], "k": [cal.keys[i][h]], "q": [cal.queries[i][h]]}[select]
            A = torch.cat(parts).double()
            r, K = group_size(m), m.head_k_dim
            size, per = K // r, budgets[i][h] // r
            chosen = []
            for g in range(r):
                res = strong_rrqr(A[:, g * size:(g + 1) * size], per, tolerance)
                chosen.append(g * size + res.indices)
                stats.append({"layer": i, "head": h, "group": g, "swaps": res.swaps, "rho_max": res.rho_max})
            heads.append(torch.sort(torch.cat(chosen)).values)
        keep[i] = heads
    return keep, stats


def pca_transforms(model, cal: Calibration, budgets: dict, select: str = "kq", adversarial: bool = False) -> dict:
    """Per-head rotations onto the top principal components of the pre-activation keys and
    queries ``W x`` (from the input's second moment): ``T`` [H, K', K] with orthonormal rows.
    ``adversarial`` keeps the lowest-variance components instead (App. E.4.2's control)."""
    out = {}
    for i, m in linear_mixers(model).items():
        H, K = m.num_heads, m.head_k_dim
        if len(set(budgets[i])) != 1:
            raise ValueError("pca takes uniform budgets")
        kp = budgets[i][0]
        xx = cal.xx[i].double().cpu()
        Wq = m.q_proj.weight.detach().double().cpu().reshape(H, K, -1)
        Wk = m.k_proj.weight.detach().double().cpu().reshape(-1, H, K, Wq.shape[-1])
        T = torch.zeros(H, kp, K, dtype=torch.float64)
        for h in range(H):
            cov = torch.zeros(K, K, dtype=torch.float64)
            if select in ("kq", "q"):
                cov += Wq[h] @ xx @ Wq[h].T
            if select in ("kq", "k"):
                for b in range(Wk.shape[0]):
                    cov += Wk[b, h] @ xx @ Wk[b, h].T
            evals, evecs = torch.linalg.eigh(cov)  # ascending
            cols = evecs[:, :kp] if adversarial else evecs[:, -kp:].flip(-1)
            T[h] = cols.T
        out[i] = T
    return out
