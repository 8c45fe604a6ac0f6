"""Random inputs for every mechanism, shared by the op tests."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from rankdecay import ops

from . import reference as ref

MECHANISMS = [
    "linear_attn", "retention", "simple_gla", "gla", "delta_rule", "gated_delta_rule",
    "kda", "gated_delta_product", "hdla", "hh_delta_rule", "hh_gated_delta_rule",
]


def make_case(name, B, T, H, K, V, dtype=torch.float64, *, beta_max=1.0, gate=None, nh=2, r=4, data_mask=False,
              leaves=None):
    """Return (call, literal): call(**kw) runs rankdecay, literal(h0) the paper's recurrence.

    ``gate`` overrides the log-decays: a callable shape -> tensor. If ``leaves`` is a
    list, every random input is made to require grad and appended to it.
    """
    def track(t):
        if leaves is not None:
            leaves.append(t.requires_grad_())
        return t

    def rnd(*shape):
        return track(torch.randn(*shape, dtype=dtype))

    def log_decay(*shape):
        return track(gate(shape).to(dtype)) if gate is not None else -F.softplus(rnd(*shape))

    q = rnd(B, T, H, K)
    if name != "gated_delta_product":  # it has n_h keys and values per token
        k, v = F.normalize(rnd(B, T, H, K), dim=-1), rnd(B, T, H, V)
    uses_beta = name in ("delta_rule", "gated_delta_rule", "kda", "hdla", "hh_delta_rule", "hh_gated_delta_rule")
    beta = beta_max * (track(torch.rand(B, T, H, dtype=dtype)) if uses_beta else torch.rand(B, T, H, dtype=dtype))
    scale = K ** -0.5
    if name == "linear_attn":
        return (lambda **kw: ops.linear_attn(q, k, v, **kw)), (lambda h0: ref.linear_attn(q, k, v, scale, h0))
    if name == "retention":
        log_gamma = track(torch.tensor([math.log(1 - 2 ** (-5 - h)) for h in range(H)], dtype=dtype))
        return (lambda **kw: ops.retention(q, k, v, log_gamma, **kw)), (lambda h0: ref.retention(q, k, v, log_gamma, scale, h0))
    if name == "simple_gla":
        g = log_decay(B, T, H)
        return (lambda **kw: ops.simple_gla(q, k, v, g, **kw)), (lambda h0: ref.simple_gla(q, k, v, g, scale, h0))
    if name == "gla":
        g = log_decay(B, T, H, K)
        return (lambda **kw: ops.gla(q, k, v, g, **kw)), (lambda h0: ref.gla(q, k, v, g, scale, h0))
    if name == "delta_rule":
        return (lambda **kw: ops.delta_rule(q, k, v, beta, **kw)), (lambda h0: ref.gated_delta_rule(q, k, v, None, beta, scale, h0))
    if name == "gated_delta_rule":
        g = log_decay(B, T, H)
        return (lambda **kw: ops.gated_delta_rule(q, k, v, g, beta, **kw)), (lambda h0: ref.gated_delta_rule(q, k, v, g, beta, scale, h0))
    if name == "kda":
        g = log_decay(B, T, H, K)
        return (lambda **kw: ops.kda(q, k, v, g, beta, **kw)), (lambda h0: ref.kda(q, k, v, g, beta, scale, h0))
    if name == "gated_delta_product":
        kp, vp = F.normalize(rnd(B, T * nh, H, K), dim=-1), rnd(B, T * nh, H, V)
        bp = beta_max * track(torch.rand(B, T * nh, H, dtype=dtype))
        g = log_decay(B, T, H)
        return (lambda **kw: ops.gated_delta_product(q, kp, vp, g, bp, nh, **kw)), (
            lambda h0: ref.gated_delta_product(q, kp, vp, g, bp, nh, scale, h0))
    if name == "hdla":
        g = log_decay(B, T, H, K)
        return (lambda **kw: ops.hdla(q, k, v, g, beta, **kw)), (lambda h0: ref.hdla(q, k, v, g, beta, scale, h0))
    if name in ("hh_delta_rule", "hh_gated_delta_rule"):
        m_org = track(torch.rand(*((B, T, H, r, r) if data_mask else (H, r, r)), dtype=dtype))
        mask = ops.head_in_head_mask(m_org)
        g = log_decay(B, T, H) if name == "hh_gated_delta_rule" else None
        return (lambda **kw: ops.hh_delta_rule(q, k, v, beta, mask, g, **kw)), (
            lambda h0: ref.hh_delta_rule(q, k, v, beta, mask, g, scale, h0))
    raise KeyError(name)
