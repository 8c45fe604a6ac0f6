"""Every mechanism as an instance of :func:`rankdecay.ops.dplr` (DESIGN.md §1).

Each function builds the decay (``g``, ``a``, ``b``) and the writes (``k``, ``v``) of
its recurrence and calls the one engine; none has its own copy of the algorithm.
All take the same keyword arguments as ``dplr`` (``scale``, ``initial_state``,
``output_final_state``, ``cu_seqlens``, ``chunk_size``, ``mode``, ``inplace_final_state``) and return
``(o [B, T, H, V], final_state [N, H, K, V] or None)``. Argument names and order
follow flash-linear-attention where it has the same operation.

``beta`` is ``[B, T, H]``; values in [0, 2] are allowed (negative eigenvalues,
Grazzi et al. 2025). The per-token construction of ``a`` and ``b`` is done in at
least fp32, like the recurrence itself.
"""
from __future__ import annotations

import importlib

import torch
import torch.nn.functional as F

from ._inputs import (check_chunk_size, check_cu_seqlens, check_devices, check_float, check_inplace_state, check_shape,
                      compute_dtype, resolve_scale)
from .backends import check_triton_mode, needs_grad, recurrent_mode, resolve_mode, triton_runs_on
from .dplr import _dplr, dplr


def _up(x: torch.Tensor) -> torch.Tensor:
    """At least fp32, so that a = αβk and friends are built exactly."""
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_rows: int = 1, value_groups: int = 1) -> None:
    check_float(q, "q")
    check_float(k, "k")
    check_float(v, "v")
    if q.dim() != 4:
        raise ValueError(f"q must have shape [B, T, H, K], got {list(q.shape)}")
    B, T, H, K = q.shape
    rows = "T" if kv_rows == 1 else f"T * {kv_rows}"
    check_shape(k, "k", (B, T * kv_rows, H, K), f"[B, {rows}, H, K]")
    HV = H * value_groups
    if v.dim() != 4 or tuple(v.shape[:3]) != (B, T * kv_rows, HV):
        heads = "H" if value_groups == 1 else f"H * {value_groups}"
        raise ValueError(f"v must have shape [B, {rows}, {heads}, V] = [{B}, {T * kv_rows}, {HV}, V], got "
                         f"{list(v.shape)}")


def _value_groups(q: torch.Tensor, v: torch.Tensor) -> int:
    """Grouped value heads (fla's GVA, ``num_v_heads``): v with HV heads, a multiple of q's and k's H, value head h
    reading key head h // (HV / H). Returns HV / H, 1 when the heads match (or the shapes are for the checks)."""
    if q.dim() != 4 or v.dim() != 4 or v.shape[2] == q.shape[2]:
        return 1
    H, HV = q.shape[2], v.shape[2]
    if HV < H or HV % H:
        raise ValueError(f"v must have q's H = {H} heads or a multiple of them (grouped value heads), got {HV}")
    return HV // H


def _heads_like(q: torch.Tensor, heads: int) -> torch.Tensor:
    """A shape-only stand-in for q with ``heads`` heads (the checks of tensors per value head read q's shape)."""
    B, T, _, K = q.shape
    return q if heads == q.shape[2] else torch.empty(B, T, heads, K, device="meta")


def _check_beta(beta: torch.Tensor, q: torch.Tensor, rows: int = 1) -> None:
    check_float(beta, "beta")
    B, T, H, _ = q.shape
    check_shape(beta, "beta", (B, T * rows, H), "[B, T, H]" if rows == 1 else f"[B, T * {rows}, H]")


def _check_gate(g: torch.Tensor | None, q: torch.Tensor, name: str = "g", per_channel: bool = True) -> None:
    if g is None:
        return
    check_float(g, name)
    B, T, H, K = q.shape
    if g.dim() == 3:
        check_shape(g, name, (B, T, H), "[B, T, H]")
    elif g.dim() == 4 and per_channel:
        check_shape(g, name, (B, T, H, K), "[B, T, H, K]")
    else:
        expected = "[B, T, H] or [B, T, H, K]" if per_channel else "[B, T, H]"
        raise ValueError(f"{name} must have shape {expected}, got {list(g.shape)}")


def _runs_triton(mode: str, q: torch.Tensor, tensors) -> bool:
    """Whether ``dplr`` runs these inputs on its Triton kernels (``resolve_mode``: "triton", computed in fp32, with
    triton able to run on q's device)."""
    dtype = compute_dtype(tensors)
    return resolve_mode(mode, q, dtype) == "triton" and dtype == torch.float32 and triton_runs_on(q)


def _triton_factors(mode: str, q: torch.Tensor, tensors, max_k: int = 1024) -> bool:
    """Whether a mechanism builds its DPLR factors with a Triton kernel (``triton.factors``): where
    ``dplr`` itself runs Triton, for K up to ``max_k``."""
    return q.shape[-1] <= max_k and _runs_triton(mode, q, tensors)


def _gate_factor(g: torch.Tensor | None) -> torch.Tensor | None:
    """exp(g) shaped to multiply [B, T, H, R, K] tensors."""
    if g is None:
        return None
    alpha = _up(g).exp()
    return alpha[..., None, None] if alpha.dim() == 3 else alpha[..., None, :]


def linear_attn(q, k, v, *, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None,
                chunk_size=64, mode="auto", inplace_final_state=False):
    r"""Linear attention (Katharopoulos et al. 2020): :math:`S_t = S_{t-1} + k_t v_t^\top`.

    q, k: ``[B, T, H, K]``; v: ``[B, T, H, V]``. Returns ``(o [B, T, H, V], final_state)``.
    """
    return dplr(q, k, v, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
                cu_seqlens=cu_seqlens, chunk_size=chunk_size, mode=mode, inplace_final_state=inplace_final_state)


def retention(q, k, v, log_gamma, *, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None,
              chunk_size=64, mode="auto", inplace_final_state=False):
    r"""Retention / Lightning attention: :math:`S_t = \gamma_h S_{t-1} + k_t v_t^\top`, a fixed decay per head.

    q, k: ``[B, T, H, K]``; v: ``[B, T, H, V]``; log_gamma: ``[H]`` (``log γ_h <= 0``;
    RetNet uses ``γ_h = 1 - 2^{-5-h}``).
    """
    _check_qkv(q, k, v)
    check_float(log_gamma, "log_gamma")
    B, T, H, _ = q.shape
    check_shape(log_gamma, "log_gamma", (H,), "[H]")
    g = log_gamma.expand(B, T, H)
    return dplr(q, k, v, g=g, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
                cu_seqlens=cu_seqlens, chunk_size=chunk_size, mode=mode, inplace_final_state=inplace_final_state)


def simple_gla(q, k, v, g=None, g_gamma=None, *, scale=None, initial_state=None, output_final_state=False,
               cu_seqlens=None, chunk_size=64, mode="auto", inplace_final_state=False, state_v_first=False,
               cu_seqlens_cpu=None):
    r"""Scalar-gated linear attention (Mamba2-style): :math:`S_t = e^{g_t} S_{t-1} + k_t v_t^\top`.

    q, k: ``[B, T, H, K]``; v: ``[B, T, H, V]``; g: ``[B, T, H]`` log-decay, or (fla's) ``g_gamma`` ``[H]``, one
    log-decay per head for every token (:func:`retention`); one of the two, as fla's.
    ``state_v_first`` (fla's): the states are ``[N, H, V, K]``; ``cu_seqlens_cpu`` is accepted and not needed.
    """
    _check_qkv(q, k, v)
    if (g is None) == (g_gamma is None):
        raise ValueError("give one of g [B, T, H] (a log-decay per token) and g_gamma [H] (one per head)")
    _check_gate(g, q, per_channel=False)
    if g_gamma is not None:
        check_float(g_gamma, "g_gamma")
        check_shape(g_gamma, "g_gamma", (q.shape[2],), "[H]")
        g = g_gamma.expand(q.shape[:3])
    initial_state = _state_in(initial_state, state_v_first, inplace_final_state)
    o, state = dplr(q, k, v, g=g, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
                    cu_seqlens=cu_seqlens, chunk_size=chunk_size, mode=mode, inplace_final_state=inplace_final_state)
    return o, _state_out(state, state_v_first)


def gla(q, k, v, g, *, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None,
        chunk_size=64, mode="auto", inplace_final_state=False, state_v_first=False, cu_seqlens_cpu=None):
    r"""Gated linear attention (Yang et al. 2024): :math:`S_t = \mathrm{Diag}(e^{g_t}) S_{t-1} + k_t v_t^\top`.

    q, k: ``[B, T, H, K]``; v: ``[B, T, H, V]``; g: ``[B, T, H, K]`` log-decay per key channel.
    ``state_v_first`` (fla's): the states are ``[N, H, V, K]``; ``cu_seqlens_cpu`` is accepted and not needed.
    """
    _check_qkv(q, k, v)
    check_float(g, "g")
    check_shape(g, "g", tuple(q.shape), "[B, T, H, K]")
    initial_state = _state_in(initial_state, state_v_first, inplace_final_state)
    o, state = dplr(q, k, v, g=g, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
                    cu_seqlens=cu_seqlens, chunk_size=chunk_size, mode=mode, inplace_final_state=inplace_final_state)
    return o, _state_out(state, state_v_first)


def delta_rule(q, k, v, beta, *, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None,
               chunk_size=64, mode="auto", inplace_final_state=False, use_qk_l2norm_in_kernel=False,
               cu_seqlens_cpu=None):
    r"""DeltaNet: :math:`S_t = (I - \beta_t k_t k_t^\top) S_{t-1} + \beta_t k_t v_t^\top`.

    q, k: ``[B, T, H, K]`` (k is expected L2-normalised, or give ``use_qk_l2norm_in_kernel``);
    v: ``[B, T, H, V]``; beta: ``[B, T, H]``. ``cu_seqlens_cpu`` (fla's) is accepted and not needed.
    """
    return _gated_delta_rule(q, k, v, None, beta, scale, initial_state, output_final_state, cu_seqlens, chunk_size,
                             mode, inplace_final_state, use_qk_l2norm_in_kernel)


def gated_delta_rule(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None,
                     chunk_size=64, mode="auto", inplace_final_state=False, use_qk_l2norm_in_kernel=False,
                     use_gate_in_kernel=False, A_log=None, dt_bias=None, use_beta_sigmoid_in_kernel=False,
                     allow_neg_eigval=False, state_v_first=False, cu_seqlens_cpu=None):
    r"""Gated DeltaNet (eq. 10): :math:`S_t = \alpha_t (I - \beta_t k_t k_t^\top) S_{t-1} + \beta_t k_t v_t^\top`.

    q, k: ``[B, T, H, K]`` (k is expected L2-normalised); v: ``[B, T, H, V]``;
    g: ``[B, T, H]`` with ``α_t = e^{g_t}``, or ``[B, T, H, K]`` for a per-channel
    gate ``Diag(e^{g_t})(I - β k kᵀ)``, or None (DeltaNet). A per-channel gate here decays after the
    delta step; Kimi Delta Attention (fla's ``chunk_kda``) decays before it: that is :func:`kda`;
    beta: ``[B, T, H]``.

    ``use_qk_l2norm_in_kernel`` (fla's argument): q and k are L2-normalised first, in fp32
    (``x / max(||x||, 1e-6)``). The decode kernel (``mode="fused_recurrent"``) does it inside the
    kernel; the other paths normalise in PyTorch and round back to the inputs' dtype, through autograd.

    Grouped value heads (fla's GVA, its layers' ``num_v_heads``): v ``[B, T, HV, V]`` with HV a multiple of q's and
    k's H, and g, beta and the states with HV heads; value head h reads key head h // (HV / H). The decode kernel
    reads them so; the other paths repeat q and k to HV heads first (``repeat_interleave``, through autograd).

    fla 0.6.0's other options, formed in PyTorch (through autograd) before the recurrence: ``use_gate_in_kernel``: g is
    the decay's projection, ``g = -exp(A_log) softplus(g + dt_bias)`` (A_log ``[H]``, dt_bias ``[H]`` or None);
    ``use_beta_sigmoid_in_kernel``: beta is β's logits, ``β = σ(beta)`` (``2 σ(beta)`` with ``allow_neg_eigval``);
    ``state_v_first``: the states are ``[N, H, V, K]``; ``cu_seqlens_cpu`` is accepted and not needed.

    As DPLR: ``a = α β k``, ``b = k``, writes ``k (β v)ᵀ`` (DESIGN.md §1).
    """
    if use_gate_in_kernel:  # g is checked as the gate's projection, one per (value) head
        _check_qkv(q, k, v, value_groups=_value_groups(q, v))
        _check_gate(g, _heads_like(q, v.shape[2]), per_channel=False)
    g, beta, initial_state = _fla_options(
        g, beta, initial_state, inplace_final_state, use_gate_in_kernel=use_gate_in_kernel, A_log=A_log,
        dt_bias=dt_bias, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
        state_v_first=state_v_first)
    o, state = _gated_delta_rule(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, chunk_size,
                                 mode, inplace_final_state, use_qk_l2norm_in_kernel)
    return o, _state_out(state, state_v_first)


def _fla_options(g, beta, initial_state, inplace_final_state, *, use_gate_in_kernel=False, A_log=None, dt_bias=None,
                 lower_bound=None, use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, state_v_first=False,
                 per_channel=False):
    """fla 0.6.0's in-kernel options of ``chunk_gated_delta_rule`` and ``chunk_kda``, formed here in PyTorch: returns
    (g, beta, initial_state [N, H, K, V] by ``_state_in``). ``per_channel``: KDA's gate (``kda_log_decay``), else
    Mamba2's."""
    if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
        raise ValueError("allow_neg_eigval=True scales σ(beta) to (0, 2) and needs use_beta_sigmoid_in_kernel=True "
                         "(fla's rule); a beta in [0, 2] already is taken as it is without either")
    if use_beta_sigmoid_in_kernel:
        check_float(beta, "beta")
        beta = (2.0 if allow_neg_eigval else 1.0) * _up(beta).sigmoid()
    if use_gate_in_kernel:
        if g is None:
            raise ValueError("use_gate_in_kernel=True forms the decay from g, the decay's projection; got g None")
        H = g.shape[2]
        if A_log is not None:
            check_float(A_log, "A_log")
            check_shape(A_log, "A_log", (H,), "[H]")
        elif not (per_channel and lower_bound is not None):
            raise ValueError("use_gate_in_kernel=True needs A_log [H]" + (" (or a lower_bound)" if per_channel else ""))
        if dt_bias is not None:
            check_float(dt_bias, "dt_bias")
            n = H * g.shape[3] if per_channel else H
            check_shape(dt_bias, "dt_bias", (n,), "[H * K]" if per_channel else "[H]")
        g = kda_log_decay(g, A_log, dt_bias, lower_bound) if per_channel else mamba2_log_decay(g, A_log, dt_bias)
    elif A_log is not None or dt_bias is not None:
        raise ValueError("A_log and dt_bias form the decay only with use_gate_in_kernel=True; g is the log-decay "
                         "itself without it")
    return g, beta, _state_in(initial_state, state_v_first, inplace_final_state)


def _state_in(initial_state: torch.Tensor | None, state_v_first: bool,
              inplace_final_state: bool) -> torch.Tensor | None:
    """The initial state as [N, H, K, V]: with fla's ``state_v_first`` it comes as [N, H, V, K] (a transposed view)."""
    if state_v_first and initial_state is not None:
        if inplace_final_state:
            raise ValueError("inplace_final_state writes the state in its [N, H, K, V] layout; not with "
                             "state_v_first")
        check_float(initial_state, "initial_state")
        if initial_state.dim() != 4:
            raise ValueError(f"initial_state must be [N, H, V, K] with state_v_first, got {list(initial_state.shape)}")
        initial_state = initial_state.transpose(-1, -2)
    return initial_state


def _state_out(state: torch.Tensor | None, state_v_first: bool) -> torch.Tensor | None:
    """The final state [N, H, K, V], or [N, H, V, K] (contiguous) with fla's ``state_v_first``."""
    return state.transpose(-1, -2).contiguous() if state_v_first and state is not None else state


def _gated_delta_rule(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, chunk_size, mode,
                      inplace_final_state, use_qk_l2norm_in_kernel):
    groups = _value_groups(q, v)
    _check_qkv(q, k, v, value_groups=groups)
    _check_beta(beta, _heads_like(q, v.shape[2]))
    _check_gate(g, _heads_like(q, v.shape[2]))
    if mode == "fused_recurrent":
        return _fused_recurrent_gdn(q, k, v, g, beta, scale, initial_state, output_final_state,
                                    use_qk_l2norm=use_qk_l2norm_in_kernel, inplace_final_state=inplace_final_state,
                                    cu_seqlens=cu_seqlens)
    if groups > 1:
        q, k = q.repeat_interleave(groups, dim=2), k.repeat_interleave(groups, dim=2)
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    if (cu_seqlens is None and not inplace_final_state and (g is None or g.dim() == 3)
            and _runs_triton(mode, q, (q, k, v, g, beta, initial_state))):
        # the fused kernels with a = b = k straight from these inputs: one autograd node, β e^g formed inside and
        # the factors' gradients carried on to g and β in the backward's gate kernel (``chunk_gated_delta_rule``)
        from .triton.chunk_bwd import chunk_gated_delta_rule

        check_chunk_size(chunk_size)  # not the kernels' own: checked as dplr checks it
        _check_state_and_devices(q, k, v, g, beta, initial_state)
        o, state = chunk_gated_delta_rule(q, k, v, g, beta, resolve_scale(scale, q.shape[-1]), initial_state)
        return o.to(q.dtype), (state if output_final_state else None)
    k1 = k[..., None, :]
    a, a_scale = _beta_alpha(k1, beta, g)
    # k stays in its dtype: the fused kernels multiply 16-bit pairs exactly on tensor cores and
    # apply β and α to the results (dplr's a_scale / v_scale); a and b are k1 itself when a has
    # no per-channel gate in it, and the backward then forms k's gradient in one pass
    return dplr(q, k1, v[..., None, :], a, k1, g, scale=scale, initial_state=initial_state,
                output_final_state=output_final_state, cu_seqlens=cu_seqlens, chunk_size=chunk_size, mode=mode,
                inplace_final_state=inplace_final_state, a_scale=a_scale, v_scale=beta)


def l2norm(x: torch.Tensor) -> torch.Tensor:
    """L2 normalisation over the last dim in at least fp32 (``x / max(||x||, 1e-6)``), back in x's dtype. On a
    GPU (outside ``torch.compile``, which fuses these operations itself) one Triton kernel forward and one backward
    (``ops.triton.norm``)."""
    norm = _kernels("norm", x)
    if norm is not None:
        return norm.l2norm(x, 1e-6)
    return F.normalize(x.to(torch.promote_types(x.dtype, torch.float32)), dim=-1, eps=1e-6).to(x.dtype)


def kda(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None,
        chunk_size=64, mode="auto", inplace_final_state=False, use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False,
        A_log=None, dt_bias=None, lower_bound=None, use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False,
        state_v_first=False, cu_seqlens_cpu=None):
    r"""Kimi Delta Attention: Gated DeltaNet with a per-channel gate applied before the delta step (fla's
    ``chunk_kda``, same arguments and order).

    .. math:: S_t = (I - \beta_t k_t k_t^\top)\,\mathrm{Diag}(e^{g_t})\,S_{t-1} + \beta_t k_t v_t^\top

    q, k: ``[B, T, H, K]`` (k is expected L2-normalised); v: ``[B, T, H, V]``; g: ``[B, T, H, K]`` log-decays
    (``[B, T, H]`` also accepted: then the order does not matter and this is :func:`gated_delta_rule`, which it
    calls); beta: ``[B, T, H]``.
    ``use_qk_l2norm_in_kernel``: q and k L2-normalised first, as in :func:`gated_delta_rule`.
    fla 0.6.0's other options, formed in PyTorch first: ``use_gate_in_kernel``: g is the decay's projection
    ``[B, T, H, K]``, the gate :func:`kda_log_decay` of it with ``A_log`` ``[H]``, ``dt_bias`` ``[H * K]`` (or None)
    and ``lower_bound`` (which only this reads); ``use_beta_sigmoid_in_kernel`` and ``allow_neg_eigval``,
    ``state_v_first`` and ``cu_seqlens_cpu`` as in :func:`gated_delta_rule`.

    As DPLR: ``a = β k`` (``a = k``, ``a_scale = β``), ``b = e^{g} ⊙ k``, writes ``k (β v)ᵀ``. With ``a`` the keys
    themselves, the fused forward takes each of the decay's intra-chunk products with its write's product
    (``q a`` with ``q k``, ``b a`` with ``b k``): two per-channel products instead of four. Without autograd it
    builds no ``b`` at all: ``b_t e^{G_{t-1}} = k_t e^{G_t}`` for the chunk's log-cumsums G.
    """
    if use_gate_in_kernel:
        _check_qkv(q, k, v)
        check_float(g, "g")
        check_shape(g, "g", tuple(q.shape), "[B, T, H, K]")
    g, beta, initial_state = _fla_options(
        g, beta, initial_state, inplace_final_state, use_gate_in_kernel=use_gate_in_kernel, A_log=A_log,
        dt_bias=dt_bias, lower_bound=lower_bound, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
        allow_neg_eigval=allow_neg_eigval, state_v_first=state_v_first, per_channel=True)
    o, state = _kda(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, chunk_size, mode,
                    inplace_final_state, use_qk_l2norm_in_kernel)
    return o, _state_out(state, state_v_first)


def _kda(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, chunk_size, mode,
         inplace_final_state, use_qk_l2norm_in_kernel):
    _check_qkv(q, k, v)
    _check_beta(beta, q)
    _check_gate(g, q)
    if g is None:
        raise ValueError("g must be a log-decay of shape [B, T, H, K] (kda), got None: use delta_rule")
    if g.dim() == 3:  # one decay per head commutes with the delta step
        return _gated_delta_rule(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, chunk_size,
                                 mode, inplace_final_state, use_qk_l2norm_in_kernel)
    if mode == "fused_recurrent":  # the delta rule's decode kernel, decaying first
        return _fused_recurrent_gdn(q, k, v, g, beta, scale, initial_state, output_final_state,
                                    use_qk_l2norm=use_qk_l2norm_in_kernel, inplace_final_state=inplace_final_state,
                                    decay_first=True, cu_seqlens=cu_seqlens)
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    k1 = k[..., None, :]
    # b = e^g ⊙ k, i.e. bᵀ = kᵀ Diag(e^g): the decay acts on the state before the delta step reads it
    kernels = _triton_factors(mode, q, (q, k, v, g, beta, initial_state))
    if kernels:
        from .triton.factors import decay_rows_dtype, placeholder

        # the fused kernels form what they need of b from k and the gate themselves (b_t e^{G_{t-1}} = k_t e^{G_t}),
        # and build it (``kda_factor``) where a form still reads it: b is a placeholder, and by default no factor
        # kernel runs, with autograd or without
        b_dtype = decay_rows_dtype(k, q)
        b = placeholder(k1.shape, b_dtype, k.device)
    else:
        b = _up(k1) * _gate_factor(g)
    return _dplr(q, k1, v[..., None, :], k1, b, g, scale, initial_state, output_final_state, cu_seqlens, chunk_size,
                 mode, beta, beta, inplace_final_state, kda_b=kernels)


def _beta_alpha(a: torch.Tensor, beta: torch.Tensor | None,
                g: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``a`` [B, T, H, R, K] times α β as (rows, per-row factors) for ``dplr(a=..., a_scale=...)``:
    a scalar gate joins β in the factors [B, T, H] (``a`` keeps its dtype); a per-channel one
    multiplies ``a`` (in at least fp32). ``beta`` None: β is in ``a`` already (or there is none)."""
    if g is not None and g.dim() == 4:
        return _up(a) * _gate_factor(g), beta
    if g is None:
        return a, beta
    alpha = _up(g).exp()
    return a, (alpha if beta is None else _up(beta) * alpha)


def gated_delta_product(q, k, v, g, beta, num_householder, *, scale=None, initial_state=None, output_final_state=False,
                        cu_seqlens=None, chunk_size=64, mode="auto", inplace_final_state=False,
                        use_qk_l2norm_in_kernel=False, cu_seqlens_cpu=None):
    r"""Gated DeltaProduct (Siems et al. 2025): ``n_h`` delta-rule sub-steps per token.

    Per token t, with sub-steps j = 1..n_h and :math:`H_j = I - \beta_j k_j k_j^\top`:
    the state is gated once, :math:`S \leftarrow \alpha_t S`, then
    :math:`S \leftarrow H_j S + \beta_j k_j v_j^\top` for j = 1..n_h, and the query reads
    after the last sub-step.

    q: ``[B, T, H, K]``; k: ``[B, T * n_h, H, K]``; v: ``[B, T * n_h, H, V]``; beta:
    ``[B, T * n_h, H]`` (fla's interleaved layout: row ``t * n_h + j`` is sub-step j of
    token t); g: ``[B, T, H]`` or None (DeltaProduct); ``cu_seqlens`` counts tokens of q.
    ``use_qk_l2norm_in_kernel``: q and k L2-normalised first, as in :func:`gated_delta_rule`; ``cu_seqlens_cpu``
    (fla's) is accepted and not needed.

    Two exact forms, chosen by where it runs:

    - On the Triton kernels, with a scalar gate or none: the interleaved sequence (fla's form), Gated DeltaNet
      over ``T * n_h`` sub-steps, the gate on each token's first sub-step and the query on its last (zero
      queries elsewhere, their outputs dropped). Gated DeltaNet's one-node kernels at 64-token chunks beat the
      rank machinery's 32-token chunks of [64, 64] row tiles: on the H100 (B8 T2048 H16 K=V=128, bf16, n_h = 2)
      3.51 -> 0.88 ms forward (fla's ``chunk_gated_delta_product`` 1.14) and 12.95 -> 4.72 ms forward+backward
      (BENCHMARKS.md, session 34). ``mode="fused_recurrent"`` (decoding) runs the sub-steps in the delta rule's
      decode kernel, reading the rows as they are (no interleaved copies).
    - Elsewhere (the PyTorch paths, a per-channel gate): the rank machinery (``Rab = Rkv = n_h``):
      :math:`H_{n_h} \cdots H_1 = I - \sum_j (H_{n_h} \cdots H_{j+1}) \beta_j k_j k_j^\top`,
      so ``a_j = α β_j H_{n_h}⋯H_{j+1} k_j``, ``b_j = k_j``, writes ``(β_j H_{n_h}⋯H_{j+1} k_j) v_jᵀ``, and the
      queries cost nothing at the inner sub-steps. (A per-channel gate applied once per token does not commute
      with the sub-steps, so it has no interleaved Gated DeltaNet form.)
    """
    if isinstance(num_householder, bool) or not isinstance(num_householder, int) or num_householder < 1:
        raise ValueError(f"num_householder must be a positive int, got {num_householder!r}")
    nh = num_householder
    _check_qkv(q, k, v, kv_rows=nh)
    _check_beta(beta, q, rows=nh)
    _check_gate(g, q)
    B, T, H, K = q.shape
    if (g is None or g.dim() == 3) and mode == "fused_recurrent":
        return _fused_recurrent_gdn(q, k, v, g, beta, scale, initial_state, output_final_state,
                                    use_qk_l2norm=use_qk_l2norm_in_kernel, inplace_final_state=inplace_final_state,
                                    num_householder=nh, cu_seqlens=cu_seqlens)
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    if (g is None or g.dim() == 3) and (mode == "fused_recurrent" or _runs_triton(mode, q, (q, k, v, g, beta,
                                                                                            initial_state))):
        o, state = gated_delta_rule(
            _interleave(q, nh, at_last=True), k, v, None if g is None else _interleave(g, nh, at_last=False), beta,
            scale=scale, initial_state=initial_state, output_final_state=output_final_state,
            cu_seqlens=None if cu_seqlens is None else cu_seqlens * nh, chunk_size=chunk_size, mode=mode,
            inplace_final_state=inplace_final_state)
        return o.unflatten(1, (T, nh))[:, :, -1], state
    ks = _up(k).unflatten(1, (T, nh)).transpose(2, 3)  # [B, T, nh, H, K] -> [B, T, H, nh, K]
    vs = _up(v).unflatten(1, (T, nh)).transpose(2, 3)
    betas = _up(beta).unflatten(1, (T, nh)).transpose(2, 3)  # [B, T, H, nh]
    transformed = []
    for j in range(nh):
        x = ks[..., j, :]
        for m in range(j + 1, nh):  # apply H_{j+1}, ..., H_{n_h} in turn
            km = ks[..., m, :]
            x = x - betas[..., m, None] * (km * x).sum(-1, keepdim=True) * km
        transformed.append(betas[..., j, None] * x)
    k_w = torch.stack(transformed, dim=3)  # β_j H_{n_h}⋯H_{j+1} k_j, [B, T, H, nh, K]
    a, a_scale = _beta_alpha(k_w, None, g)  # β_j is in k_w already
    return dplr(q, k_w, vs, a, ks, g, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
                cu_seqlens=cu_seqlens, chunk_size=chunk_size, mode=mode, inplace_final_state=inplace_final_state,
                a_scale=a_scale)


def _interleave(x: torch.Tensor, nh: int, at_last: bool) -> torch.Tensor:
    """[B, T, ...] -> [B, T * nh, ...]: token t's x at sub-step nh - 1 (``at_last``) or 0 of its nh, zeros at the
    others (differentiable)."""
    zeros = [torch.zeros_like(x)] * (nh - 1)
    return torch.stack(zeros + [x] if at_last else [x] + zeros, dim=2).flatten(1, 2)


def hdla(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None,
         chunk_size=64, mode="auto", inplace_final_state=False):
    r"""Householder-diagonalised linear attention (HDLA eq. 27).

    .. math:: S_t = (I - \beta_t k_t k_t^\top)\,\mathrm{Diag}(\lambda_t)\,(I - \beta_t k_t k_t^\top) S_{t-1} + k_t v_t^\top

    q, k: ``[B, T, H, K]`` (k is expected L2-normalised); v: ``[B, T, H, V]``;
    g: ``[B, T, H, K]`` with ``λ_t = e^{g_t}`` (``[B, T, H]`` also accepted); beta:
    ``[B, T, H]``, in (0, 2) in the paper.

    As diagonal-plus-rank-2 (App. C.2): ``D = λ``; ``a1 = βk, b1 = λ⊙k``;
    ``a2 = β(λ⊙k - β (kᵀ(λ⊙k)) k), b2 = k``. ``mode="fused_recurrent"`` (decoding) takes the step as written, two
    reflections around the decay, in the delta rule's decode kernel: no factors built.
    """
    _check_qkv(q, k, v)
    _check_beta(beta, q)
    _check_gate(g, q)
    if mode == "fused_recurrent":
        return _fused_recurrent_gdn(q, k, v, g, beta, scale, initial_state, output_final_state,
                                    inplace_final_state=inplace_final_state, householder=True, cu_seqlens=cu_seqlens)
    if cu_seqlens is None and not inplace_final_state and _triton_factors(mode, q, (q, k, v, g, beta, initial_state)):
        # the fused kernels as one autograd node: a and b built inside, six products of token rows in place of the
        # nine of a and b, the rows' gradients carried on to k, g and β inside (``chunk_hdla``)
        from .triton.chunk_bwd import chunk_hdla

        check_chunk_size(chunk_size)  # not the kernels' own: checked as dplr checks it
        _check_state_and_devices(q, k, v, g, beta, initial_state)
        gk = (g if g.dim() == 4 else g[..., None].expand(k.shape)).contiguous()
        o, state = chunk_hdla(q.contiguous(), k.contiguous(), v.contiguous(), gk, beta.contiguous(),
                              resolve_scale(scale, q.shape[-1]), initial_state)
        return o.to(q.dtype), (state if output_final_state else None)
    if _triton_factors(mode, q, (q, k, v, g, beta, initial_state)):
        from .triton.factors import hdla_factors  # one kernel each way instead of ~30 elementwise passes

        a, b = hdla_factors(k, g if g.dim() == 4 else g[..., None].expand(k.shape), beta)
    else:
        k_, beta_ = _up(k), _up(beta)[..., None]
        lam = _up(g).exp()
        lam = lam[..., None] if lam.dim() == 3 else lam
        lk = lam * k_  # λ ⊙ k
        a1 = beta_ * k_
        a2 = beta_ * (lk - beta_ * (k_ * lk).sum(-1, keepdim=True) * k_)
        a = torch.stack([a1, a2], dim=3)  # [B, T, H, 2, K]
        b = torch.stack([lk, k_], dim=3)
    return dplr(q, k, v, a, b, g, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
                cu_seqlens=cu_seqlens, chunk_size=chunk_size, mode=mode, inplace_final_state=inplace_final_state)


def hh_delta_rule(q, k, v, beta, mask, g=None, *, scale=None, initial_state=None, output_final_state=False,
                  cu_seqlens=None, chunk_size=64, mode="auto", inplace_final_state=False):
    r"""Head-in-Head DeltaNet / Gated DeltaNet (Head-in-Head eq. 10, App. B).

    .. math:: S_t = \alpha_t (I - \beta_t (k_t k_t^\top \odot \mathrm{expand}(M_t))) S_{t-1} + \beta_t k_t v_t^\top

    Key channel i belongs to group ``i // (K / r)``; ``expand(M)[i, l] = M[group(i), group(l)]``.

    q, k: ``[B, T, H, K]``; v: ``[B, T, H, V]``; beta: ``[B, T, H]``; mask: ``[H, r, r]``
    (static) or ``[B, T, H, r, r]`` (per token), r dividing K — build it with
    :func:`head_in_head_mask` to keep the eigenvalues in [0, 1] (or [-1, 1] with
    β in [0, 2]); g: None (HH-DeltaNet), ``[B, T, H]`` (HH-GDN) or ``[B, T, H, K]``.

    As DPLR with ``Rab = r``: ``a_j = α β k ⊙ 1[group j]``, ``b_j = k ⊙ M[j, group(·)]``. The rows
    ``k ⊙ 1[group j]`` sum to k, so the writes lie on them too: on the Triton kernels without autograd (a scalar
    gate or none) the forward takes the scaled form over them (``triton.chunk_fwd.grouped_update``).
    """
    _check_qkv(q, k, v)
    _check_beta(beta, q)
    _check_gate(g, q)
    check_float(mask, "mask")
    B, T, H, K = q.shape
    if mask.dim() == 3:
        r = mask.shape[-1]
        check_shape(mask, "mask", (H, r, r), "[H, r, r]")
    elif mask.dim() == 5:
        r = mask.shape[-1]
        check_shape(mask, "mask", (B, T, H, r, r), "[B, T, H, r, r]")
    else:
        raise ValueError(f"mask must have shape [H, r, r] or [B, T, H, r, r], got {list(mask.shape)}")
    if r < 1 or K % r:
        raise ValueError(f"the mask rank r = {r} must divide the key dimension K = {K}")
    if mode == "fused_recurrent" and K & (K - 1) == 0 and r & (r - 1) == 0:
        # decoding: the delta rule's decode kernel with the mask between the key's groups, no factors built
        return _fused_recurrent_gdn(q, k, v, g, beta, scale, initial_state, output_final_state,
                                    inplace_final_state=inplace_final_state, mask=mask, cu_seqlens=cu_seqlens)
    hh_mask = None
    if _triton_factors(mode, q, (q, k, v, beta, mask, g, initial_state)):
        from .triton.factors import decay_rows_dtype, hh_factors, hh_placeholders, hh_update_rows  # no gather

        b_dtype = decay_rows_dtype(k, q)
        if (g is None or g.dim() == 3) and r <= 4:
            # the fused kernels form the rows from k and the mask, and their backward carries the rows' gradients on
            # to k and the mask: a and b are placeholders (H100 HH-GDN r=4 fwd+bwd 7.25 -> 7.01 ms, peak 4447 ->
            # 3935 MB); without autograd the grouped forward's state kernel reads b (BENCHMARKS.md session 39)
            hh_mask = mask
            if needs_grad((q, k, v, beta, mask, g, initial_state)):
                a, b = hh_placeholders(k.shape, r, k.dtype, b_dtype, k.device)
            else:
                a, b = hh_update_rows(k, mask, b_dtype)
        else:
            a, b = hh_factors(k, mask, b_dtype=b_dtype)
    else:
        group = torch.arange(K, device=q.device) // (K // r)
        onehot = (group[None, :] == torch.arange(r, device=q.device)[:, None]).to(k.dtype)  # [r, K]
        a = k[..., None, :] * onehot  # k ⊙ 1[group j]: exact in k's dtype
        b = _up(k)[..., None, :] * _up(mask)[..., group]  # M[j, group(l)] k_l
    a, a_scale = _beta_alpha(a, beta, g)
    # a's rows sum to k: without autograd the fused forward takes its scaled form over them (``grouped``); with
    # ``hh_mask`` the fused kernels form the rows from k and the mask, and their backward carries the rows' gradients
    # on to k and the mask itself
    return _dplr(q, k, v, a, b, g, scale, initial_state, output_final_state, cu_seqlens, chunk_size, mode, a_scale,
                 beta, inplace_final_state, grouped=True, hh_mask=hh_mask)


def head_in_head_mask(m_org: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    r"""The Head-in-Head mask ``M = N Nᵀ`` with ``N`` = row-L2-normalised ``m_org`` (paper §3.3, App. A).

    m_org: ``[..., r, r]``, expected non-negative; then M is positive semi-definite,
    every entry lies in [0, 1] and the diagonal is 1. The normalisation is scale-free
    (each row is first divided by its largest entry), so rows of tiny entries, such as
    the softplus of very negative logits, still normalise exactly; only an all-zero row
    stays zero (its diagonal entry is then 0, not 1). ``eps`` guards that case. With
    L2-normalised keys, ``β (k kᵀ ⊙ expand(M))`` is then PSD (Schur product theorem)
    with eigenvalues in [0, β], so every transition has its eigenvalues in
    [1 - β, 1]: [0, 1] for β in [0, 1], [-1, 1] for β in [0, 2]. Returns ``[..., r, r]``.
    """
    check_float(m_org, "m_org")
    if m_org.dim() < 2 or m_org.shape[-1] != m_org.shape[-2]:
        raise ValueError(f"m_org must have shape [..., r, r], got {list(m_org.shape)}")
    n = m_org / m_org.abs().amax(dim=-1, keepdim=True).clamp_min(torch.finfo(m_org.dtype).tiny)
    n = n / n.norm(dim=-1, keepdim=True).clamp_min(eps)
    return n @ n.transpose(-1, -2)


def _check_state_and_devices(q, k, v, g, beta, initial_state, cu_seqlens=None) -> None:
    """What ``dplr`` checks beyond q, k, v, g and beta's shapes, for the routes that bypass it ((Gated) DeltaNet's
    and HDLA's): ``cu_seqlens`` (``_inputs.check_cu_seqlens``), the initial state's dtype and shape ``[N, H, K, V]``
    (N = B, or the number of packed sequences), and every tensor on q's device."""
    B, T, _, K = q.shape
    N, _ = check_cu_seqlens(cu_seqlens, B, T)
    if initial_state is not None:  # H: v's heads (q's but with grouped value heads)
        check_float(initial_state, "initial_state")
        check_shape(initial_state, "initial_state", (N, v.shape[2], K, v.shape[-1]), "[N, H, K, V]")
    check_devices(q.device, (("k", k), ("v", v), ("g", g), ("beta", beta), ("initial_state", initial_state)))


def _fused_recurrent_gdn(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm=False,
                         raw_gates=None, inplace_final_state=False, decay_first=False, lower_bound=None,
                         householder=False, mask=None, norm_q=True, logsigmoid_scale=None, mask_raw=False,
                         num_householder=1, cu_seqlens=None):
    """(Gated) DeltaNet's, KDA's and HDLA's decode fast path: one kernel, no DPLR factors built. q, k, v, g and
    beta were checked by the caller; the rest is checked as ``dplr`` checks it, without a
    second pass over what was (a decode step's host time is its cost). ``raw_gates``, ``lower_bound``: see
    ``gated_delta_rule_decode`` and ``kda_decode``; ``decay_first``: KDA's order; ``householder``: HDLA's step;
    ``mask``: Head-in-Head's (``mask_raw``: its M_org); ``norm_q=False``: the norm on k alone; ``logsigmoid_scale``:
    see ``hdla_decode``; ``num_householder``: Gated DeltaProduct's sub-steps (k, v and beta ``T * n_h`` rows);
    ``cu_seqlens``: sequences packed along T, each walked where it lies by its own programs (no padding)."""
    scale = resolve_scale(scale, q.shape[-1])
    _check_state_and_devices(q, k, v, g, beta, initial_state, cu_seqlens)
    if inplace_final_state:
        check_inplace_state(initial_state)
    tensors = (q, k, v, g, beta, initial_state)
    check_triton_mode("fused_recurrent", q, tensors, compute_dtype(tensors))
    from .triton import fused_recurrent_gated_delta_rule

    c = lambda t: t.contiguous() if t is not None else None  # noqa: E731
    o, state = fused_recurrent_gated_delta_rule(
        c(q), c(k)[..., None, :], c(v)[..., None, :], c(g[..., None] if g is not None and g.dim() == 3 else g),
        c(beta), scale, initial_state if inplace_final_state else c(initial_state),
        inplace_final_state=inplace_final_state, use_qk_l2norm=use_qk_l2norm, raw_gates=raw_gates,
        decay_first=decay_first, lower_bound=lower_bound, householder=householder,
        mask=None if mask is None else mask.contiguous(), norm_q=norm_q, logsigmoid_scale=logsigmoid_scale,
        mask_raw=mask_raw, num_householder=num_householder,
        cu_seqlens=None if cu_seqlens is None else cu_seqlens.to(q.device))
    return o, (state if output_final_state else None)


def gated_delta_rule_decode(q, k, v, a, b, A_log=None, dt_bias=None, *, beta_max=1.0, scale=None, initial_state=None,
                            output_final_state=False, cu_seqlens=None, use_qk_l2norm_in_kernel=True,
                            inplace_final_state=False, mode="auto"):
    r"""Gated DeltaNet's decode step with its gates formed in the kernel from the layer's projections
    (the fused sigmoid-gating update of serving engines): one kernel for the L2 norms, the gates and
    the recurrence, on a GPU, without autograd; elsewhere the same computation in PyTorch.

    q, k: ``[B, T, H, K]`` (before the L2 norm with ``use_qk_l2norm_in_kernel``); v: ``[B, T, H, V]``;
    a: ``[B, T, H]``, the decay's projection (``A_log`` and ``dt_bias``, ``[H]``, make
    :math:`g = -e^{A_{log}} \operatorname{softplus}(a + dt_{bias})`, Mamba2's); ``a=None``: no decay
    (DeltaNet); b: ``[B, T, H]``, β's logits: :math:`\beta = \beta_{max} \sigma(b)`. Returns
    ``(o [B, T, H, V], final state [B, H, K, V] fp32 or None)``, as ``gated_delta_rule``. Grouped value heads as in
    ``gated_delta_rule``: v, a, b, ``A_log``, ``dt_bias`` and the state with HV heads, a multiple of q's and k's.

    inplace_final_state: write the final state into ``initial_state`` (contiguous, fp32 or a 16-bit
    cache's bf16 / fp16, updated in fp32) and return that tensor as the final state, as serving
    engines' decode kernels do: a step then allocates no state and moves it once each way (the
    kernel reads it and writes it back; on the other path the result is copied in).

    cu_seqlens: ``[N + 1]`` int offsets of N sequences packed along T (B = 1; the state ``[N, H, K, V]``), as in
    :func:`gated_delta_rule`: a prefill of several prompts, or serving's mixed batches. The kernel walks each
    sequence where it lies (no padding); the values are checked on the host (one sync) unless compiling.

    mode: ``"fused_recurrent"`` (the kernel), ``"naive"`` (the gates and norms in PyTorch, then the
    per-token loop, with autograd) or ``"auto"``: the kernel for CUDA tensors without autograd
    when triton runs there, else ``"naive"``.
    """
    mode, raw = _check_scalar_decode(q, k, v, a, b, A_log, dt_bias, beta_max, mode,
                                     value_groups=_value_groups(q, v))
    if mode == "fused_recurrent":
        return _fused_recurrent_gdn(q, k, v, a, b, scale, initial_state, output_final_state,
                                    use_qk_l2norm=use_qk_l2norm_in_kernel, raw_gates=raw,
                                    inplace_final_state=inplace_final_state, cu_seqlens=cu_seqlens)
    beta = beta_max * _up(b).sigmoid()
    g = None if a is None else mamba2_log_decay(a, A_log, dt_bias)
    return gated_delta_rule(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                            output_final_state=output_final_state, cu_seqlens=cu_seqlens, mode="naive",
                            inplace_final_state=inplace_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)


def mamba2_log_decay(a: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor | None) -> torch.Tensor:
    """Mamba2's log-decay per head, g = -exp(A_log) softplus(a + dt_bias), in at least fp32: a [..., H], A_log and
    dt_bias [H] (Gated DeltaNet's and Head-in-Head's gate, as the layers and the decode kernel form it; dt_bias None:
    no bias). On a GPU (outside ``torch.compile``) ``ops.triton.gate``'s kernels, as KDA's gate of one channel a
    head."""
    heads = (a.shape[-1],) if a.dim() else None
    gate = _kernels("gate", a, A_log, dt_bias)
    if gate is not None and A_log.shape == heads and (dt_bias is None or dt_bias.shape == heads):
        return gate.kda_gate(a.unsqueeze(-1), A_log, dt_bias).squeeze(-1)
    return -_up(A_log).exp() * F.softplus(_up(a) if dt_bias is None else _up(a) + _up(dt_bias))


def kda_log_decay(a: torch.Tensor, A_log: torch.Tensor | None, dt_bias: torch.Tensor | None,
                  lower_bound: float | None = None) -> torch.Tensor:
    """Kimi Delta Attention's log-decay per key channel, in at least fp32: a [..., H, K], A_log [H], dt_bias [H * K]
    (fla's shapes); g = -exp(A_log) softplus(a + dt_bias), or with ``lower_bound`` b < 0 (fla's)
    g = b sigmoid(exp(A_log) (a + dt_bias)), in (b, 0). dt_bias None: no bias; A_log None (with a lower bound
    only): g = b sigmoid(a + dt_bias), as fla's. On a GPU (outside ``torch.compile``, which fuses these operations
    itself) one Triton kernel forward and one backward (``ops.triton.gate``)."""
    gate = _kernels("gate", a, A_log, dt_bias)
    if gate is not None:
        return gate.kda_gate(a, A_log, dt_bias, lower_bound)
    return _kda_log_decay(a, A_log, dt_bias, lower_bound)


def logsigmoid_log_decay(z: torch.Tensor, tau: float) -> torch.Tensor:
    """GLA's and HDLA's per-channel log-decay ``logsigmoid(z) / tau`` in at least fp32. On a GPU (outside
    ``torch.compile``, which fuses these operations itself) one Triton kernel forward and one backward
    (``ops.triton.gate``)."""
    gate = _kernels("gate", z)
    if gate is not None:
        return gate.logsigmoid_gate(z, tau)
    return F.logsigmoid(_up(z)) / tau


def _kernels(module: str, x: torch.Tensor, *others: torch.Tensor | None):
    """``ops.triton.<module>`` (``gate`` or ``norm``) where its kernels take x and the others: CUDA tensors, outside
    ``torch.compile`` (which fuses the PyTorch forms itself), what the module's ``takes`` accepts; else None (the
    PyTorch forms)."""
    if not (x.is_cuda and triton_runs_on(x) and not torch.compiler.is_compiling()):
        return None
    kernels = importlib.import_module(f".triton.{module}", __package__)
    return kernels if kernels.takes(x, *others) else None


def _kda_log_decay(a: torch.Tensor, A_log: torch.Tensor | None, dt_bias: torch.Tensor | None,
                   lower_bound: float | None = None) -> torch.Tensor:
    """:func:`kda_log_decay` in PyTorch."""
    H, K = a.shape[-2:]
    f = _up(a) if dt_bias is None else _up(a) + _up(dt_bias).view(H, K)
    if lower_bound is None:
        return -_up(A_log).exp()[:, None] * F.softplus(f)
    return lower_bound * torch.sigmoid(f if A_log is None else _up(A_log).exp()[:, None] * f)


def _check_channel_decode(q, k, v, a, b, mode: str) -> str:
    """The checks a decode op with a per-channel gate's projection makes: q, k, v; a [B, T, H, K]; b [B, T, H]; the
    mode, "auto" resolved (the kernel for CUDA tensors without autograd where triton runs there, else "naive")."""
    _check_decode_inputs(q, k, v, b)
    check_float(a, "a")
    check_shape(a, "a", tuple(q.shape), "[B, T, H, K]")
    return _decode_mode(q, mode)


def _check_decode_inputs(q, k, v, b, rows: int = 1, value_groups: int = 1) -> None:
    _check_qkv(q, k, v, kv_rows=rows, value_groups=value_groups)
    check_float(b, "b")
    B, T, H = q.shape[:3]
    H *= value_groups
    check_shape(b, "b", (B, T * rows, H), "[B, T, H]" if rows == 1 else f"[B, T * {rows}, H]")


def _decode_mode(q, mode: str) -> str:
    """A decode op's mode, "auto" resolved: the kernel for CUDA tensors without autograd where triton runs there,
    else "naive"."""
    if mode not in ("auto", "fused_recurrent", "naive"):
        raise ValueError(f"mode must be 'auto', 'fused_recurrent' or 'naive', got {mode!r}")
    return recurrent_mode(q) if mode == "auto" else mode


def _check_scalar_decode(q, k, v, a, b, A_log, dt_bias, beta_max, mode: str, rows: int = 1,
                         value_groups: int = 1) -> tuple[str, tuple]:
    """The checks a decode op with Gated DeltaNet's gate makes (a [B, T, H] or None, with A_log and dt_bias [H];
    b [B, T * rows, H], k and v ``rows`` a token; H: v's heads, ``value_groups`` times q's); returns the resolved
    mode and the kernel's ``raw_gates``."""
    _check_decode_inputs(q, k, v, b, rows, value_groups)
    H = q.shape[2] * value_groups
    if a is not None:
        _check_gate(a, _heads_like(q, H), name="a", per_channel=False)
        for name, x in (("A_log", A_log), ("dt_bias", dt_bias)):
            if x is None or x.shape != (H,):
                raise ValueError(f"{name} must be [H] = [{H}] with a decay projection a, "
                                 f"got {None if x is None else list(x.shape)}")
    raw = (A_log.contiguous() if a is not None else None, dt_bias.contiguous() if a is not None else None, beta_max)
    return _decode_mode(q, mode), raw


def kda_decode(q, k, v, a, b, A_log, dt_bias, *, lower_bound=None, beta_max=1.0, scale=None, initial_state=None,
               output_final_state=False, cu_seqlens=None, use_qk_l2norm_in_kernel=True, inplace_final_state=False,
               mode="auto"):
    r"""Kimi Delta Attention's decode step with its gates formed in the kernel from the layer's projections (fla's
    ``fused_recurrent_kda`` with ``use_gate_in_kernel`` and ``use_beta_sigmoid_in_kernel``): one kernel for the L2
    norms, the gates and the recurrence of :func:`kda`, on a GPU, without autograd; elsewhere the same computation in
    PyTorch.

    q, k: ``[B, T, H, K]`` (before the L2 norm with ``use_qk_l2norm_in_kernel``); v: ``[B, T, H, V]``;
    a: ``[B, T, H, K]``, the decay's projection, with ``A_log`` ``[H]`` and ``dt_bias`` ``[H * K]`` (fla's shapes):
    :math:`g = -e^{A_{log}} \operatorname{softplus}(a + dt_{bias})`, or with ``lower_bound`` b < 0 (fla's)
    :math:`g = b\,\sigma(e^{A_{log}} (a + dt_{bias}))`; b: ``[B, T, H]``, β's logits: :math:`\beta = \beta_{max}
    \sigma(b)`. Returns ``(o [B, T, H, V], final state [B, H, K, V] fp32 or None)``, as :func:`kda`.
    ``cu_seqlens``, ``inplace_final_state`` and ``mode``: as in :func:`gated_delta_rule_decode`.
    """
    mode = _check_channel_decode(q, k, v, a, b, mode)
    H, K = q.shape[2:]
    for name, x, dims, n in (("A_log", A_log, "H", H), ("dt_bias", dt_bias, "H * K", H * K)):
        if not isinstance(x, torch.Tensor) or x.shape != (n,):
            raise ValueError(f"{name} must be [{dims}] = [{n}], got "
                             f"{list(x.shape) if isinstance(x, torch.Tensor) else x!r}")
    if lower_bound is not None and not (isinstance(lower_bound, (int, float)) and lower_bound < 0):
        raise ValueError(f"lower_bound must be None or a negative number, got {lower_bound!r}")
    if mode == "fused_recurrent":
        return _fused_recurrent_gdn(q, k, v, a, b, scale, initial_state, output_final_state,
                                    use_qk_l2norm=use_qk_l2norm_in_kernel,
                                    raw_gates=(A_log.contiguous(), dt_bias.contiguous(), beta_max),
                                    inplace_final_state=inplace_final_state, decay_first=True,
                                    lower_bound=None if lower_bound is None else float(lower_bound),
                                    cu_seqlens=cu_seqlens)
    g = kda_log_decay(a, A_log, dt_bias, lower_bound)
    return kda(q, k, v, g, beta_max * _up(b).sigmoid(), scale=scale, initial_state=initial_state,
               output_final_state=output_final_state, cu_seqlens=cu_seqlens, mode="naive",
               inplace_final_state=inplace_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)


def hdla_decode(q, k, v, a, b, *, gate_logit_normalizer=16.0, beta_max=2.0, scale=None, initial_state=None,
                output_final_state=False, cu_seqlens=None, use_k_l2norm_in_kernel=True, inplace_final_state=False,
                mode="auto"):
    r"""HDLA's decode step with its gates formed in the kernel from the layer's projections: one kernel for k's L2
    norm, λ, β and the recurrence of :func:`hdla`, on a GPU, without autograd; elsewhere the same computation in
    PyTorch.

    q, k: ``[B, T, H, K]`` (k before its L2 norm with ``use_k_l2norm_in_kernel``; q is not normalised, as in the
    HDLA layer); v: ``[B, T, H, V]``; a: ``[B, T, H, K]``, λ's logits (the layer's ``lambda_proj x``, its bias
    included): :math:`\log\lambda = \log\sigma(a) / \tau`, τ = ``gate_logit_normalizer``; b: ``[B, T, H]``, β's
    logits: :math:`\beta = \beta_{max} \sigma(b)` (the paper's β in (0, 2) by default). Returns ``(o [B, T, H, V],
    final state [B, H, K, V] fp32 or None)``, as :func:`hdla`. ``cu_seqlens``, ``inplace_final_state`` and ``mode``:
    as in :func:`gated_delta_rule_decode`.
    """
    mode = _check_channel_decode(q, k, v, a, b, mode)
    if isinstance(gate_logit_normalizer, bool) or not isinstance(gate_logit_normalizer, (int, float)) \
            or not gate_logit_normalizer > 0:
        raise ValueError(f"gate_logit_normalizer must be a number > 0, got {gate_logit_normalizer!r}")
    if mode == "fused_recurrent":
        return _fused_recurrent_gdn(q, k, v, a, b, scale, initial_state, output_final_state,
                                    use_qk_l2norm=use_k_l2norm_in_kernel, norm_q=False,
                                    raw_gates=(None, None, beta_max), inplace_final_state=inplace_final_state,
                                    householder=True, logsigmoid_scale=1.0 / gate_logit_normalizer,
                                    cu_seqlens=cu_seqlens)
    g = F.logsigmoid(_up(a)) / gate_logit_normalizer
    k = l2norm(k) if use_k_l2norm_in_kernel else k
    return hdla(q, k, v, g, beta_max * _up(b).sigmoid(), scale=scale, initial_state=initial_state,
                output_final_state=output_final_state, cu_seqlens=cu_seqlens, mode="naive",
                inplace_final_state=inplace_final_state)


def hh_delta_rule_decode(q, k, v, a, b, m_org, A_log=None, dt_bias=None, *, beta_max=1.0, scale=None,
                         initial_state=None, output_final_state=False, cu_seqlens=None, use_qk_l2norm_in_kernel=True,
                         inplace_final_state=False, mode="auto"):
    r"""Head-in-Head's decode step with its gates and its mask formed in the kernel from the layer's projections and
    parameters: one kernel for the L2 norms, α, β, the mask :math:`M = N N^\top` (:func:`head_in_head_mask` of
    softplus(``m_org``)) and the recurrence of :func:`hh_delta_rule`, on a GPU, without autograd; elsewhere (or where
    K or r is not a power of two) the same computation in PyTorch.

    q, k: ``[B, T, H, K]`` (before their L2 norms with ``use_qk_l2norm_in_kernel``); v: ``[B, T, H, V]``; a:
    ``[B, T, H]``, the decay's projection with ``A_log`` and ``dt_bias`` ``[H]`` (:math:`g = -e^{A_{log}}
    \operatorname{softplus}(a + dt_{bias})`, Gated DeltaNet's), or None (Head-in-Head DeltaNet); b: ``[B, T, H]``,
    β's logits (:math:`\beta = \beta_{max} \sigma(b)`); m_org: ``[H, r, r]`` (a static mask's parameter) or
    ``[B, T, H, r, r]`` (projected per token). Returns ``(o [B, T, H, V], final state [B, H, K, V] fp32 or None)``;
    ``cu_seqlens``, ``inplace_final_state`` and ``mode`` as in :func:`gated_delta_rule_decode`.
    """
    mode, raw = _check_scalar_decode(q, k, v, a, b, A_log, dt_bias, beta_max, mode)
    B, T, H, K = q.shape
    check_float(m_org, "m_org")
    r = m_org.shape[-1] if m_org.dim() in (3, 5) else 0
    if m_org.shape not in ((H, r, r), (B, T, H, r, r)) or r < 1 or K % r:
        raise ValueError(f"m_org must be [H, r, r] or [B, T, H, r, r] with r dividing K = {K}, got "
                         f"{list(m_org.shape)}")
    if mode == "fused_recurrent" and K & (K - 1) == 0 and r & (r - 1) == 0:
        return _fused_recurrent_gdn(q, k, v, a, b, scale, initial_state, output_final_state,
                                    use_qk_l2norm=use_qk_l2norm_in_kernel, raw_gates=raw,
                                    inplace_final_state=inplace_final_state, mask=m_org, mask_raw=True,
                                    cu_seqlens=cu_seqlens)
    g = None if a is None else mamba2_log_decay(a, A_log, dt_bias)
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    return hh_delta_rule(q, k, v, beta_max * _up(b).sigmoid(), head_in_head_mask(F.softplus(_up(m_org))), g,
                         scale=scale, initial_state=initial_state, output_final_state=output_final_state,
                         cu_seqlens=cu_seqlens, mode=mode, inplace_final_state=inplace_final_state)


def gated_delta_product_decode(q, k, v, a, b, num_householder, A_log=None, dt_bias=None, *, beta_max=1.0, scale=None,
                               initial_state=None, output_final_state=False, cu_seqlens=None,
                               use_qk_l2norm_in_kernel=True, inplace_final_state=False, mode="auto"):
    r"""Gated DeltaProduct's decode step with its gates formed in the kernel from the layer's projections: one kernel
    for the L2 norms, the gate, the β's and the ``n_h`` sub-steps of :func:`gated_delta_product`, on a GPU, without
    autograd; elsewhere the same computation in PyTorch.

    q: ``[B, T, H, K]``; k: ``[B, T * n_h, H, K]``, v: ``[B, T * n_h, H, V]`` (fla's interleaved layout: row
    ``t * n_h + j`` is sub-step j of token t; q and k before their L2 norms with ``use_qk_l2norm_in_kernel``); a:
    ``[B, T, H]``, the decay's projection with ``A_log`` and ``dt_bias`` ``[H]`` (:math:`g = -e^{A_{log}}
    \operatorname{softplus}(a + dt_{bias})`, Gated DeltaNet's), or None (DeltaProduct); b: ``[B, T * n_h, H]``, the
    β's logits (:math:`\beta = \beta_{max} \sigma(b)`). Returns ``(o [B, T, H, V], final state [B, H, K, V] fp32 or
    None)``; ``cu_seqlens`` (counting tokens of q), ``inplace_final_state`` and ``mode`` as in
    :func:`gated_delta_rule_decode`.
    """
    if isinstance(num_householder, bool) or not isinstance(num_householder, int) or num_householder < 1:
        raise ValueError(f"num_householder must be a positive int, got {num_householder!r}")
    mode, raw = _check_scalar_decode(q, k, v, a, b, A_log, dt_bias, beta_max, mode, rows=num_householder)
    if mode == "fused_recurrent":
        return _fused_recurrent_gdn(q, k, v, a, b, scale, initial_state, output_final_state,
                                    use_qk_l2norm=use_qk_l2norm_in_kernel, raw_gates=raw,
                                    inplace_final_state=inplace_final_state, num_householder=num_householder,
                                    cu_seqlens=cu_seqlens)
    g = None if a is None else mamba2_log_decay(a, A_log, dt_bias)
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    return gated_delta_product(q, k, v, g, beta_max * _up(b).sigmoid(), num_householder, scale=scale,
                               initial_state=initial_state, output_final_state=output_final_state,
                               cu_seqlens=cu_seqlens, mode="naive",
                               inplace_final_state=inplace_final_state)
