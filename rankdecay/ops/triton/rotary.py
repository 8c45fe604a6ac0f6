"""The rotary position embedding (rotate-half form) as one Triton kernel forward and one backward.

``layers.attention.rotary`` in PyTorch is about fifteen kernels a tensor forward (the frequencies, the angles, cos,
sin, a cast to fp32, the halves' four products, their sum and difference, the concatenation, the cast back) and as
many backward, each a pass over [B, T, H, D]: in a sliding-window attention layer's training step on an H200 they
took more GPU time than the attention itself. Here one pass reads x and writes the rotated x (the backward rotates
the gradient back: the same kernel with the angle negated), with the angles formed as PyTorch forms them
(``position x inv_freq`` in fp32), reduced to [-pi, pi] and rotated as the decode step's (``swa._rotate``), cos and sin and the products in fp32,
rounded once.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable

from .swa import _rotate

BLOCK_T, WARPS = 16, 4


@triton.jit
def _rotary_kernel(x_ptr, sx_b, sx_t, sx_h, y_ptr, sy_b, sy_t, sy_h, pos_ptr, sp_b, sp_t, freq_ptr, T, H, n_t,
                   SIGN: tl.constexpr, HALF: tl.constexpr, HALF_P2: tl.constexpr, BLOCK_T: tl.constexpr):
    # one axis of programs (a grid's second and third take at most 65,535): block tb of row b's head h
    pid = tl.program_id(0)
    tb, bh = pid % n_t, pid // n_t
    b, h = bh // H, bh % H
    t = tb * BLOCK_T + tl.arange(0, BLOCK_T)
    i = tl.arange(0, HALF_P2)
    m = (t < T)[:, None] & (i < HALF)[None, :]
    pos = tl.load(pos_ptr + b * sp_b + t * sp_t, mask=t < T, other=0).to(tl.float32)
    x = x_ptr + b * sx_b + t[:, None] * sx_t + h * sx_h + i[None, :]
    x1 = tl.load(x, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(x + HALF, mask=m, other=0.0).to(tl.float32)
    y1, y2 = _rotate(x1, x2, pos[:, None] * tl.load(freq_ptr + i, mask=i < HALF, other=0.0)[None, :], SIGN)
    y = y_ptr + b * sy_b + t[:, None] * sy_t + h * sy_h + i[None, :]
    tl.store(y, y1.to(y_ptr.dtype.element_ty), mask=m)
    tl.store(y + HALF, y2.to(y_ptr.dtype.element_ty), mask=m)


def _launch(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, sign: float) -> torch.Tensor:
    B, T, H, D = x.shape
    y = torch.empty(B, T, H, D, device=x.device, dtype=x.dtype)
    sp_b, sp_t = (0, positions.stride(0)) if positions.dim() == 1 else (
        positions.stride(0) if positions.shape[0] > 1 else 0, positions.stride(1))
    n_t = triton.cdiv(T, BLOCK_T)
    _rotary_kernel[(n_t * B * H,)](
        x, x.stride(0), x.stride(1), x.stride(2), y, y.stride(0), y.stride(1), y.stride(2), positions, sp_b, sp_t,
        inv_freq, T, H, n_t, SIGN=sign, HALF=D // 2, HALF_P2=triton.next_power_of_2(D // 2), BLOCK_T=BLOCK_T,
        num_warps=WARPS)
    return y


class _Rotary(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, positions, inv_freq):
        ctx.save_for_backward(positions, inv_freq)
        return _launch(x, positions, inv_freq, 1.0)

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        positions, inv_freq = ctx.saved_tensors
        if dy.stride(-1) != 1:
            dy = dy.contiguous()
        return _launch(dy, positions, inv_freq, -1.0), None, None


def takes(x: torch.Tensor, positions: torch.Tensor) -> bool:
    """Whether :func:`rotary` takes x ``[B, T, H, D]`` (fp32 / bf16 / fp16, D even, the last axis contiguous) and
    integer positions ``[B, T]``, ``[1, T]`` or ``[T]``."""
    B, T = x.shape[:2]
    return (x.dim() == 4 and x.dtype in (torch.float32, torch.bfloat16, torch.float16) and x.shape[-1] % 2 == 0
            and x.stride(-1) == 1 and not positions.is_floating_point() and positions.shape in ((B, T), (1, T), (T,)))


def rotary(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of x ``[B, T, H, D]`` at integer ``positions`` (``[B, T]``, ``[1, T]`` or ``[T]``) with the
    frequencies ``inv_freq`` ``[D / 2]`` fp32 (``layers.attention.rotary_frequencies``): a new tensor in x's
    dtype, differentiable in x."""
    return _Rotary.apply(x, positions, inv_freq)
