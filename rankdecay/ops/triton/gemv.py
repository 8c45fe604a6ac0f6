"""A matrix-vector product for a B = 1 decode step: ``y = x Wᵀ + b`` for one row x.

A one-token step's products read each weight once and do next to no arithmetic, so their time is the bandwidth
they reach and their launch. cuBLAS takes them with tiles of 64 outputs, which leaves most of an H200 idle at the
340m preset's widths; a few outputs per one-warp program, a slice of the row per step of a 3-stage loop, reach
more of it. On an H200 in a CUDA graph (``benchmarks/gemv_probe.py``, bf16, µs per product, at each shape's best
launch of a sweep), cuBLAS -> this kernel: 3080 x 1024 5.02 -> 3.74, 1024 x 1024 7.63 -> 2.48, 5632 x 1024 5.58 ->
4.99, 1024 x 2816 7.23 -> 4.51; at 1.3b's widths 9.79 -> 8.09, 6.03 -> 4.52, 13.32 -> 13.55 (a tie), 11.10 ->
8.81. The launch here, two outputs a program and 1024-wide slices, won at three of those shapes. With four rows
cuBLAS is as fast or faster, so ``rankdecay.layers.packing.decode_linear`` takes this kernel for one row only.

Traced by ``torch.compile`` as a user-defined Triton kernel (no None arguments: a missing bias passes the weight
under ``HAS_BIAS=False``).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .fused_recurrent import _pow2

BLOCK_N, BLOCK_K, WARPS, STAGES = 2, 1024, 1, 3  # the launch that won at the 340m preset's widths (H200)


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, b_ptr, y_ptr, N, K, stride_wn,
                 HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_N,), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(w_ptr + rn[:, None] * stride_wn + rk[None, :], mask=(rn[:, None] < N) & (rk[None, :] < K),
                    other=0.0)
        x = tl.load(x_ptr + rk, mask=rk < K, other=0.0)
        acc += tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)
    tl.store(y_ptr + rn, acc.to(y_ptr.dtype.element_ty), mask=rn < N)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for x [K] (one row, contiguous), weight [N, K] (rows contiguous), bias [N];
    returns [N] in x's dtype, accumulated in fp32. No autograd."""
    K = x.shape[-1]
    N = weight.shape[0]
    if x.numel() != K or weight.shape[1] != K or weight.stride(1) != 1 or not x.is_contiguous():
        raise ValueError(f"gemv takes one contiguous row x [K] and weight [N, K] with contiguous rows; got x "
                         f"{list(x.shape)}, weight {list(weight.shape)} with strides {weight.stride()}")
    y = x.new_empty(N)
    _gemv_kernel[(-(-N // BLOCK_N),)](x, weight, bias if bias is not None else weight, y, N, K, weight.stride(0),
                                      HAS_BIAS=bias is not None, BLOCK_N=BLOCK_N, BLOCK_K=min(BLOCK_K, _pow2(K)),
                                      num_warps=WARPS, num_stages=STAGES)
    return y
