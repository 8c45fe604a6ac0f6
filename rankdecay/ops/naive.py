"""The per-token recurrence: the ground truth, and the decode step on the CPU.

    S_t = (Diag(exp g_t) - sum_r a_{t,r} b_{t,r}^T) S_{t-1} + sum_j k_{t,j} v_{t,j}^T
    o_t = scale * S_t^T q_t                                           (HDLA eq. 8)

The transition is applied without forming the [K, K] matrix: the low-rank part
costs two [R, K] x [K, V] products per step.
"""
from __future__ import annotations

import torch


def naive_dplr_core(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor | None,
    b: torch.Tensor | None,
    g: torch.Tensor | None,
    scale: float,
    initial_state: torch.Tensor | None,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Canonical inputs (see ``_inputs``) -> (o [B, T, H, V], S_T [B, H, K, V]), both in ``dtype``."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    q = q.to(dtype) * scale
    k, v = k.to(dtype), v.to(dtype)
    a = a.to(dtype) if a is not None else None
    b = b.to(dtype) if b is not None else None
    decay = g.to(dtype).exp() if g is not None else None  # [B, T, H, Kg]
    if initial_state is None:
        S = q.new_zeros(B, H, K, V)
    else:
        S = initial_state.to(dtype)
    # each step's slices by unbind: indexing step t inside the loop makes autograd's backward allocate and zero-fill
    # the whole input once per step, quadratic in T
    steps = [x.unbind(1) if x is not None else [None] * T for x in (q, k, v, a, b, decay)]
    outputs = []
    for q_t, k_t, v_t, a_t, b_t, d_t in zip(*steps):
        S_new = S if d_t is None else d_t[..., None] * S
        if a_t is not None:
            bS = torch.einsum("bhrk,bhkv->bhrv", b_t, S)  # B_t^T S_{t-1}
            S_new = S_new - torch.einsum("bhrk,bhrv->bhkv", a_t, bS)
        S = S_new + torch.einsum("bhjk,bhjv->bhkv", k_t, v_t)
        outputs.append(torch.einsum("bhk,bhkv->bhv", q_t, S))
    o = torch.stack(outputs, dim=1) if outputs else q.new_zeros(B, 0, H, V)
    return o, S
