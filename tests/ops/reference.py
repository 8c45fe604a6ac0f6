"""Literal per-token recurrences, written from the papers, independent of rankdecay.

Each forms the full [K, K] transition matrix P_t of its paper's equation and runs
S_t = P_t S_{t-1} + W_t, o_t = scale * S_t^T q_t in fp64. Slow and obvious on purpose.
"""
from __future__ import annotations

import torch

f64 = torch.float64


def run(q, transitions, writes, scale, initial_state):
    """q [B, T, H, K]; transitions(t) -> P_t [B, H, K, K]; writes(t) -> W_t [B, H, K, V]."""
    B, T, H, K = q.shape
    q = q.to(f64)
    S = initial_state.to(f64) if initial_state is not None else None
    out = []
    for t in range(T):
        W = writes(t)
        S = W if S is None else transitions(t) @ S + W
        out.append(scale * torch.einsum("bhk,bhkv->bhv", q[:, t], S))
    return torch.stack(out, 1), S


def eye(q):
    B, T, H, K = q.shape
    return torch.eye(K, dtype=f64).expand(B, H, K, K)


def outer(x, y):
    return torch.einsum("bhk,bhv->bhkv", x.to(f64), y.to(f64))


def linear_attn(q, k, v, scale, h0):
    return run(q, lambda t: eye(q), lambda t: outer(k[:, t], v[:, t]), scale, h0)


def retention(q, k, v, log_gamma, scale, h0):
    gamma = log_gamma.to(f64).exp()[None, :, None, None]
    return run(q, lambda t: gamma * eye(q), lambda t: outer(k[:, t], v[:, t]), scale, h0)


def simple_gla(q, k, v, g, scale, h0):
    return run(q, lambda t: g[:, t].to(f64).exp()[..., None, None] * eye(q), lambda t: outer(k[:, t], v[:, t]), scale, h0)


def gla(q, k, v, g, scale, h0):
    return run(q, lambda t: torch.diag_embed(g[:, t].to(f64).exp()), lambda t: outer(k[:, t], v[:, t]), scale, h0)


def householder(k, beta):
    """I - beta k k^T for k [B, H, K], beta [B, H]."""
    k = k.to(f64)
    K = k.shape[-1]
    return torch.eye(K, dtype=f64) - beta.to(f64)[..., None, None] * torch.einsum("bhk,bhl->bhkl", k, k)


def gated_delta_rule(q, k, v, g, beta, scale, h0):
    """Gated DeltaNet eq. 10 (g None: DeltaNet; g [B,T,H,K]: Diag(alpha)(I - b k k^T))."""
    def P(t):
        H_t = householder(k[:, t], beta[:, t])
        if g is None:
            return H_t
        alpha = g[:, t].to(f64).exp()
        return alpha[..., None, None] * H_t if alpha.dim() == 2 else torch.diag_embed(alpha) @ H_t
    return run(q, P, lambda t: beta[:, t].to(f64)[..., None, None] * outer(k[:, t], v[:, t]), scale, h0)


def kda(q, k, v, g, beta, scale, h0):
    """Kimi Delta Attention: (I - b k k^T) Diag(alpha), the decay before the delta step."""
    return run(q, lambda t: householder(k[:, t], beta[:, t]) @ torch.diag_embed(g[:, t].to(f64).exp()),
               lambda t: beta[:, t].to(f64)[..., None, None] * outer(k[:, t], v[:, t]), scale, h0)


def gated_delta_product(q, k, v, g, beta, nh, scale, h0):
    """n_h delta-rule sub-steps per token on the interleaved sequence, gate at the first."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    S = h0.to(f64) if h0 is not None else torch.zeros(B, H, K, V, dtype=f64)
    out = []
    for t in range(T):
        if g is not None:
            S = g[:, t].to(f64).exp()[..., None, None] * S
        for j in range(nh):
            row = t * nh + j
            S = householder(k[:, row], beta[:, row]) @ S + beta[:, row].to(f64)[..., None, None] * outer(k[:, row], v[:, row])
        out.append(scale * torch.einsum("bhk,bhkv->bhv", q[:, t].to(f64), S))
    return torch.stack(out, 1), S


def hdla(q, k, v, g, beta, scale, h0):
    """HDLA eq. 27: (I - b k k^T) Diag(lambda) (I - b k k^T) S + k v^T."""
    def P(t):
        H_t = householder(k[:, t], beta[:, t])
        return H_t @ torch.diag_embed(g[:, t].to(f64).exp()) @ H_t
    return run(q, P, lambda t: outer(k[:, t], v[:, t]), scale, h0)


def hh_delta_rule(q, k, v, beta, mask, g, scale, h0):
    """Head-in-Head eq. 10: alpha (I - b (k k^T ⊙ expand(M))) S + b k v^T."""
    B, T, H, K = q.shape
    r = mask.shape[-1]
    group = torch.arange(K) // (K // r)

    def P(t):
        M = mask[:, t] if mask.dim() == 5 else mask.expand(B, H, r, r)
        expanded = M.to(f64)[..., group[:, None], group[None, :]]  # [B, H, K, K]
        kk = torch.einsum("bhk,bhl->bhkl", k[:, t].to(f64), k[:, t].to(f64))
        P_t = torch.eye(K, dtype=f64) - beta[:, t].to(f64)[..., None, None] * kk * expanded
        if g is not None:
            P_t = g[:, t].to(f64).exp()[..., None, None] * P_t
        return P_t
    return run(q, P, lambda t: beta[:, t].to(f64)[..., None, None] * outer(k[:, t], v[:, t]), scale, h0)


def dplr(q, k, v, a, b, g, scale, h0):
    """HDLA eq. 8 with explicit P_t = Diag(exp g) - sum_r a_r b_r^T and rank axes."""
    B, T, H, K = q.shape

    def P(t):
        if g is None:
            D = torch.ones(B, H, K, dtype=f64)
        else:
            D = g[:, t].to(f64).exp()
            D = D[..., None].expand(B, H, K) if D.dim() == 2 else D
        P_t = torch.diag_embed(D)
        if a is not None:
            P_t = P_t - torch.einsum("bhrk,bhrl->bhkl", a[:, t].to(f64), b[:, t].to(f64))
        return P_t
    return run(q, P, lambda t: torch.einsum("bhjk,bhjv->bhkv", k[:, t].to(f64), v[:, t].to(f64)), scale, h0)
