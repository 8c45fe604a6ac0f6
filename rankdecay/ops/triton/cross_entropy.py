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
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .fused_recurrent import _pow2

MAX_BLOCK = 4096  # columns a program holds at once; wider slices loop


@triton.jit
def _slice_lse_kernel(l_ptr, stride_l, lse_ptr, picked_ptr, t_ptr, Vc, v0, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = l_ptr + row * stride_l
    cols = tl.arange(0, BLOCK)
    m = tl.max(tl.load(base + cols, mask=cols < Vc, other=float("-inf")).to(tl.float32), 0)
    for start in range(BLOCK, Vc, BLOCK):
        x = tl.load(base + start + cols, mask=start + cols < Vc, other=float("-inf")).to(tl.float32)
        m = tl.maximum(m, tl.max(x, 0))
    s = tl.sum(tl.exp(tl.load(base + cols, mask=cols < Vc, other=float("-inf")).to(tl.float32) - m), 0)
    for start in range(BLOCK, Vc, BLOCK):
        x = tl.load(base + start + cols, mask=start + cols < Vc, other=float("-inf")).to(tl.float32)
        s += tl.sum(tl.exp(x - m), 0)
    old = tl.load(lse_ptr + row)  # -inf before the first slice
    top = tl.maximum(old, m)
    tl.store(lse_ptr + row, top + tl.log(tl.exp(old - top) + s * tl.exp(m - top)))
    t = tl.load(t_ptr + row)
    if (t >= v0) & (t < v0 + Vc):  # (an ignored row's is never read)
        tl.store(picked_ptr + row, tl.load(base + (t - v0)).to(tl.float32))


@triton.jit
def _slice_grad_kernel(l_ptr, stride_l, lse_ptr, t_ptr, g_ptr, Vc, v0, ignore_index, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = l_ptr + row * stride_l
    t = tl.load(t_ptr + row)
    g = tl.where(t != ignore_index, tl.load(g_ptr + row).to(tl.float32), 0.0)
    lse = tl.load(lse_ptr + row)
    cols = tl.arange(0, BLOCK)
    for start in range(0, Vc, BLOCK):
        c = start + cols
        x = tl.load(base + c, mask=c < Vc, other=0.0).to(tl.float32)
        p = tl.exp(x - lse)
        p = tl.where(c + v0 == t, p - 1.0, p) * g
        tl.store(base + c, p.to(l_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=c < Vc)


def _check(logits: torch.Tensor, *rows: torch.Tensor) -> None:
    assert logits.dim() == 2 and logits.stride(1) == 1, "logits must be [N, Vc] with unit column stride"
    assert all(r.shape == logits.shape[:1] and r.is_contiguous() for r in rows)


def slice_logsumexp_(logits: torch.Tensor, lse: torch.Tensor, picked: torch.Tensor, target: torch.Tensor,
                     v0: int) -> None:
    """logits [N, Vc] (vocabulary entries v0 .. v0 + Vc - 1), lse [N] fp32 (-inf before the first slice), picked
    [N] fp32, target [N] int64: lse <- log(exp(lse) + sum exp(logits)); picked <- the target's logit where the
    target is in the slice."""
    _check(logits, lse, picked, target)
    N, Vc = logits.shape
    if N:
        _slice_lse_kernel[(N,)](logits, logits.stride(0), lse, picked, target, Vc, v0,
                                BLOCK=min(_pow2(Vc), MAX_BLOCK), num_warps=4)


def slice_softmax_grad_(logits: torch.Tensor, lse: torch.Tensor, target: torch.Tensor, grad: torch.Tensor,
                        v0: int, ignore_index: int) -> torch.Tensor:
    """Overwrites logits [N, Vc] with (exp(logits - lse) - onehot(target - v0)) * grad, rows with target ==
    ignore_index 0; lse, grad [N] fp32, target [N] int64. Returns logits."""
    _check(logits, lse, target, grad)
    N, Vc = logits.shape
    if N:
        _slice_grad_kernel[(N,)](logits, logits.stride(0), lse, target, grad, Vc, v0, ignore_index,
                                 BLOCK=min(_pow2(Vc), MAX_BLOCK), num_warps=4)
    return logits
