"""The elementwise part of ``rankdecay.layers.linear_cross_entropy`` on a GPU: one read of a slice of logits.

The loss goes through the vocabulary in slices (``rankdecay.layers.loss``). Each slice's logits [N, Vc] come out of
a matrix product in its dtype (bf16 under autocast); in PyTorch, the softmax's statistics and gradient then take
about ten passes over them in fp32 (cast, max, exp, sum, subtract, scale, cast back). Here one program per row reads
its slice once (twice from cache):

- ``slice_logsumexp_``: the running log-sum-exp of each row, merged with the slice's, and the target's logit where
  the target falls in the slice; both [N] fp32, updated in place.
- ``slice_softmax_grad_``: ``(softmax - onehot(target)) * grad`` over the slice from the kept log-sum-exp, written
  over the logits (the product's output is not needed again), 0 in ignored rows.

Both compute in fp32 from logits rounded as the product rounds them, as ``F.cross_entropy(logits.float())`` does.
With ``softcap`` c > 0 the logits are soft-capped first, z -> c tanh(z / c) (fla's ``logit_softcapping``); then the
first also sums each row's capped logits (label smoothing's term needs them) and the second takes label smoothing's
share of the gradient itself and the cap's derivative, 1 - tanh².
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .fused_recurrent import _pow2

MAX_BLOCK = 4096  # columns a program holds at once; wider slices loop


@triton.jit
def _tanh(y):
    """tanh in fp32, accurate near 0 too: y - y³/3 + 2y⁵/15 below |y| = 0.1 (relative error under 1e-7), else
    (1 - e^-2|y|) / (1 + e^-2|y|) with y's sign."""
    a = tl.abs(y)
    e = tl.exp(-2.0 * a)
    r = tl.where(a < 0.1, a * (1.0 - a * a / 3.0 * (1.0 - 0.4 * a * a)), (1.0 - e) / (1.0 + e))
    return tl.where(y < 0, -r, r)


@triton.jit
def _load(ptr, cols, Vc, cap, other, SOFTCAP: tl.constexpr):
    """A row's logits at cols (< Vc) in fp32, soft-capped (c tanh(z / c)) with SOFTCAP; ``other`` past Vc."""
    x = tl.load(ptr + cols, mask=cols < Vc, other=0.0).to(tl.float32)
    if SOFTCAP:
        x = cap * _tanh(x / cap)
    return tl.where(cols < Vc, x, other)


@triton.jit
def _slice_lse_kernel(l_ptr, stride_l, lse_ptr, picked_ptr, t_ptr, sum_ptr, Vc, v0, cap, BLOCK: tl.constexpr,
                      SOFTCAP: tl.constexpr, SUM: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = l_ptr + row * stride_l
    cols = tl.arange(0, BLOCK)
    cap = tl.cast(cap, tl.float32)
    m = tl.max(_load(base, cols, Vc, cap, float("-inf"), SOFTCAP), 0)
    for start in range(BLOCK, Vc, BLOCK):
        m = tl.maximum(m, tl.max(_load(base + start, cols, Vc - start, cap, float("-inf"), SOFTCAP), 0))
    s = tl.sum(tl.zeros((BLOCK,), tl.float32), 0)
    z = tl.sum(tl.zeros((BLOCK,), tl.float32), 0)
    for start in range(0, Vc, BLOCK):
        x = _load(base + start, cols, Vc - start, cap, float("-inf"), SOFTCAP)
        s += tl.sum(tl.exp(x - m), 0)
        if SUM:
            z += tl.sum(tl.where(start + cols < Vc, x, 0.0), 0)
    old = tl.load(lse_ptr + row)  # -inf before the first slice
    top = tl.maximum(old, m)
    tl.store(lse_ptr + row, top + tl.log(tl.exp(old - top) + s * tl.exp(m - top)))
    if SUM:
        tl.store(sum_ptr + row, tl.load(sum_ptr + row) + z)
    t = tl.load(t_ptr + row)
    if (t >= v0) & (t < v0 + Vc):  # (an ignored row's is never read)
        x = tl.load(base + (t - v0)).to(tl.float32)
        if SOFTCAP:
            x = cap * _tanh(x / cap)
        tl.store(picked_ptr + row, x)


@triton.jit
def _slice_grad_kernel(l_ptr, stride_l, lse_ptr, t_ptr, g_ptr, Vc, v0, ignore_index, cap, eps, inv_v,
                       BLOCK: tl.constexpr, SOFTCAP: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = l_ptr + row * stride_l
    t = tl.load(t_ptr + row)
    g = tl.where(t != ignore_index, tl.load(g_ptr + row).to(tl.float32), 0.0)
    lse = tl.load(lse_ptr + row)
    cols = tl.arange(0, BLOCK)
    cap, eps, inv_v = tl.cast(cap, tl.float32), tl.cast(eps, tl.float32), tl.cast(inv_v, tl.float32)
    for start in range(0, Vc, BLOCK):
        c = start + cols
        x = tl.load(base + c, mask=c < Vc, other=0.0).to(tl.float32)
        if SOFTCAP:  # d/dz of the capped logit's loss: (softmax - (1 - ε) onehot - ε / V) (1 - tanh²)
            th = _tanh(x / cap)
            p = tl.exp(cap * th - lse)
            p = (tl.where(c + v0 == t, p - (1.0 - eps), p) - eps * inv_v) * g * (1.0 - th * th)
        else:
            p = tl.exp(x - lse)
            p = tl.where(c + v0 == t, p - 1.0, p) * g
        tl.store(base + c, p.to(l_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=c < Vc)


def _check(logits: torch.Tensor, *rows: torch.Tensor) -> None:
    assert logits.dim() == 2 and logits.stride(1) == 1, "logits must be [N, Vc] with unit column stride"
    assert all(r.shape == logits.shape[:1] and r.is_contiguous() for r in rows)


def slice_logsumexp_(logits: torch.Tensor, lse: torch.Tensor, picked: torch.Tensor, target: torch.Tensor,
                     v0: int, softcap: float = 0.0, sums: torch.Tensor | None = None) -> None:
    """logits [N, Vc] (vocabulary entries v0 .. v0 + Vc - 1), lse [N] fp32 (-inf before the first slice), picked
    [N] fp32, target [N] int64: lse <- log(exp(lse) + sum exp(logits)); picked <- the target's logit where the
    target is in the slice. softcap c > 0: the logits are c tanh(logits / c) throughout. sums [N] fp32 or None:
    sums += each row's sum of the (capped) logits."""
    _check(logits, lse, picked, target, *(() if sums is None else (sums,)))
    N, Vc = logits.shape
    if N:
        _slice_lse_kernel[(N,)](logits, logits.stride(0), lse, picked, target, sums if sums is not None else lse,
                                Vc, v0, float(softcap or 1.0), BLOCK=min(_pow2(Vc), MAX_BLOCK),
                                SOFTCAP=bool(softcap), SUM=sums is not None, num_warps=4)


def slice_softmax_grad_(logits: torch.Tensor, lse: torch.Tensor, target: torch.Tensor, grad: torch.Tensor,
                        v0: int, ignore_index: int, softcap: float = 0.0, smoothing: float = 0.0,
                        vocab: int = 1) -> torch.Tensor:
    """Overwrites logits [N, Vc] with (exp(logits - lse) - onehot(target - v0)) * grad, rows with target ==
    ignore_index 0; lse, grad [N] fp32, target [N] int64. Returns logits. softcap c > 0: with z' = c tanh(logits /
    c), (exp(z' - lse) - (1 - smoothing) onehot - smoothing / vocab) * grad * (1 - tanh²) instead (label smoothing's
    share included)."""
    _check(logits, lse, target, grad)
    N, Vc = logits.shape
    if N:
        _slice_grad_kernel[(N,)](logits, logits.stride(0), lse, target, grad, Vc, v0, ignore_index,
                                 float(softcap or 1.0), float(smoothing), 1.0 / vocab,
                                 BLOCK=min(_pow2(Vc), MAX_BLOCK), SOFTCAP=bool(softcap), num_warps=4)
    return logits
