"""Cross-entropy through a linear map without the logits: a language model's loss in chunks of tokens.

A language model's last product maps N hidden rows [N, D] to logits [N, V]. With V = 32,000 and N = B·T = 16,384
the logits take 1 GiB in bf16 and 2 GiB once cast to fp32 for the softmax, and the backward holds a gradient of the
same size. :func:`linear_cross_entropy` never holds more than one chunk of them: the forward keeps each token's
log-sum-exp ([N], fp32) and nothing of size N x V, and the backward forms each chunk's logits again, their softmax
from the kept log-sum-exp, and from it the gradients of x, the weight and the bias. That is one product of the head
more than the plain path (4 instead of 3). fla's and Liger-Kernel's fused linear cross-entropy form the gradients in
the forward instead, which ties them to a scalar loss; recomputing keeps ``reduction="none"`` (per-token losses,
masked or weighted afterwards) exact as well. It traces under ``torch.compile`` (``fullgraph=True`` too), so a
compiled model's loss is part of its graph: the chunks' loop unrolled, their elementwise work fused.

Precision: each chunk's product runs in the dtype ``F.linear`` would run it in (autocast's, bf16 under bf16
autocast; else the inputs'), the softmax and the loss in fp32, and the weight's and bias' gradients are summed over
the chunks in fp32.

``RankDecayConfig(fuse_linear_cross_entropy=True)`` makes ``RankDecayForCausalLM`` take it in training (its output's
logits are then None), and so ``rankdecay train --set fuse_linear_cross_entropy=true``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

REDUCTIONS = ("mean", "sum", "none")


def default_chunk_size(n: int, d: int, v: int) -> int:
    """Tokens per chunk: as many as keep a chunk's logits (chunk x V) no larger than the hidden rows (N x D), at
    least 256 (so that each product stays large) and at most N (Liger-Kernel's rule, in elements)."""
    return max(1, min(n, max(256, n * d // max(v, 1))))


def _product_dtype(x: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype ``F.linear(x, weight)`` computes in here: autocast's where it is on, else the inputs'."""
    device = x.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return torch.promote_types(x.dtype, weight.dtype)


def _logits(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """One chunk's logits in fp32 or wider (x and weight already in the products' dtype)."""
    return F.linear(x, weight, None if bias is None else bias.to(x.dtype)).to(_wide(x.dtype))


def _wide(dtype: torch.dtype) -> torch.dtype:
    """The softmax's and the loss' dtype: fp32, or the products' where wider (fp64)."""
    return torch.promote_types(dtype, torch.float32)


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, target, weight, bias, ignore_index: int, chunk: int, dtype: torch.dtype):
        # x [N, D], target [N]: per-token losses [N] fp32 (0 where ignored); keeps the log-sum-exp [N]
        w = weight.to(dtype)
        losses = torch.zeros(x.shape[0], dtype=_wide(dtype), device=x.device)
        lse = torch.zeros_like(losses)
        for s in range(0, x.shape[0], chunk):
            logits = _logits(x[s:s + chunk].to(dtype), w, bias)
            t = target[s:s + chunk]
            valid = t != ignore_index
            lse[s:s + chunk] = torch.logsumexp(logits, -1)
            picked = logits.gather(1, torch.where(valid, t, 0)[:, None])[:, 0]
            losses[s:s + chunk] = torch.where(valid, lse[s:s + chunk] - picked, 0.0)
        ctx.save_for_backward(x, target, weight, bias, lse)
        ctx.ignore_index, ctx.chunk, ctx.dtype = ignore_index, chunk, dtype
        return losses

    @staticmethod
    def backward(ctx, grad):
        x, target, weight, bias, lse = ctx.saved_tensors
        dtype, chunk = ctx.dtype, ctx.chunk
        need_x, _, need_w, need_b = ctx.needs_input_grad[:4]
        w = weight.to(dtype)
        dx = torch.empty_like(x) if need_x else None
        dw = torch.zeros(weight.shape, dtype=_wide(dtype), device=weight.device) if need_w else None
        db = torch.zeros(bias.shape, dtype=_wide(dtype), device=bias.device) if need_b else None
        for s in range(0, x.shape[0], chunk):
            xc = x[s:s + chunk].to(dtype)
            t = target[s:s + chunk]
            valid = t != ctx.ignore_index
            # d loss_i / d logits_i = softmax_i - onehot(t_i), times the token's incoming gradient (0 where ignored)
            p = torch.exp(_logits(xc, w, bias) - lse[s:s + chunk, None])
            p.scatter_add_(1, torch.where(valid, t, 0)[:, None], -valid[:, None].to(p.dtype))
            p.mul_(torch.where(valid, grad[s:s + chunk].to(p.dtype), 0.0)[:, None])
            if need_b:
                db += p.sum(0)
            p = p.to(dtype)
            if need_x:
                dx[s:s + chunk] = (p @ w).to(x.dtype)
            if need_w:
                dw += (p.t() @ xc).to(dw.dtype)
        return (dx, None, None if dw is None else dw.to(weight.dtype), None if db is None else db.to(bias.dtype),
                None, None, None)


def linear_cross_entropy(x: torch.Tensor, target: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                         ignore_index: int = -100, reduction: str = "mean", chunk_size: int | None = None
                         ) -> torch.Tensor:
    """``F.cross_entropy(F.linear(x, weight, bias).float(), target, ignore_index=..., reduction=...)`` over the
    leading dimensions, without forming all the logits at once (the module docstring says how).

    Args:
        x: [..., D] hidden rows (any floating dtype; under autocast the products take autocast's).
        target: [...] integer class indices in [0, V), or ``ignore_index`` for rows with no loss and no gradient.
        weight: [V, D]; bias: [V] or None (an LM head's ``weight`` and ``bias``).
        reduction: ``"mean"`` over the rows not ignored (NaN where every row is, as ``F.cross_entropy``), ``"sum"``,
            or ``"none"``: [...], 0 at ignored rows.
        chunk_size: rows per chunk; None: ``default_chunk_size`` (a chunk's logits no larger than x).
    Returns a scalar (``"mean"``, ``"sum"``) or [...] (``"none"``), fp32 (fp64 for fp64 inputs), with autograd to
    x, weight and bias."""
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dim() < 1:
        raise TypeError(f"x must be a floating-point tensor [..., D]; got {type(x).__name__} "
                        f"{getattr(x, 'dtype', '')}")
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.shape[1] != x.shape[-1]:
        raise ValueError(f"weight must be [V, D] with D = {x.shape[-1]} (x's last dimension); got "
                         f"{list(getattr(weight, 'shape', []))}")
    V = weight.shape[0]
    if bias is not None and tuple(bias.shape) != (V,):
        raise ValueError(f"bias must be [V] = [{V}] or None; got {list(bias.shape)}")
    if not isinstance(target, torch.Tensor) or target.is_floating_point() or target.is_complex() \
            or target.dtype == torch.bool or tuple(target.shape) != tuple(x.shape[:-1]):
        raise ValueError(f"target must be an integer tensor shaped like x without its last dimension, "
                         f"{list(x.shape[:-1])}; got {getattr(target, 'dtype', type(target).__name__)} "
                         f"{list(getattr(target, 'shape', []))}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}; got {reduction!r}")
    if chunk_size is not None and (not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1):
        raise ValueError(f"chunk_size must be a positive int or None; got {chunk_size!r}")
    devices = {x.device, target.device, weight.device} | ({bias.device} if bias is not None else set())
    if len(devices) > 1:
        raise ValueError(f"x, target, weight and bias must be on one device; got {sorted(map(str, devices))}")
    shape = x.shape[:-1]
    xf, tf = x.reshape(-1, x.shape[-1]), target.reshape(-1).long()
    # (not under torch.compile, where reading the check's result would break the graph: there an index out of range
    # fails inside gather as it does in F.cross_entropy)
    valid = tf != ignore_index
    out_of_range = valid & ((tf < 0) | (tf >= V))
    if not torch.compiler.is_compiling() and bool(out_of_range.any()):
        raise ValueError(f"target holds class indices outside [0, {V}) that are not ignore_index = {ignore_index}: "
                         f"{tf[out_of_range][:5].tolist()}")
    chunk = chunk_size or default_chunk_size(xf.shape[0], xf.shape[1], V)
    dtype = _product_dtype(x, weight)
    with torch.autocast(x.device.type, enabled=False):
        losses = _LinearCrossEntropy.apply(xf, tf, weight, bias, ignore_index, chunk, dtype)
    if reduction == "none":
        return losses.view(shape)
    if reduction == "sum":
        return losses.sum()
    return losses.sum() / valid.sum()
