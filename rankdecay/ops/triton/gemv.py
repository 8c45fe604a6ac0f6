"""A matrix-vector product for a B = 1 decode step: ``y = x Wᵀ + b`` for one row x.

A one-token step's products read each weight once and do next to no arithmetic, so their time is the bandwidth
they reach and their launch. cuBLAS takes them with tiles of 64 outputs, which leaves most of an H200 idle at the
340m preset's widths; a few outputs per one-warp program, a slice of the row per step of a 3-stage loop, reach
more of it. On an H200 in a CUDA graph (``benchmarks/gemv_probe.py``, bf16, µs per product, at each shape's best
launch of a sweep), cuBLAS -> this kernel: 3080 x 1024 5.02 -> 3.74, 1024 x 1024 7.63 -> 2.48, 5632 x 1024 5.58 ->
4.99, 1024 x 2816 7.23 -> 4.51; at 1.3b's widths 9.79 -> 8.09, 6.03 -> 4.52, 13.32 -> 13.55 (a tie), 11.10 ->
8.81. The launch here, two outputs a program and 1024-wide slices, won at three of those shapes. With four rows
cuBLAS is as fast or faster, so ``rankdecay.layers.packing.decode_linear`` takes this kernel for one row only.

A prologue takes what a layer does to a row just before its output map: ``y = W (pre(x) * post(u)) + b`` with
pre an RMSNorm per group of channels (a head) or SiLU, and post a gate row, SiLU'd or not. So a mixer's output norm
and gate (``GatedRMSNorm``) and a SwiGLU's ``silu(gate) * up`` need no kernels of their own in a B = 1 step
(``rankdecay.layers.packing.fused_output_linear``). A block's residual add and input RMSNorm, over the whole
row, go into its first product the same way (``rankdecay.layers.packing.fused_input_projections``): the first
program also writes the sum, the residual stream. Each program forms the prologue over the whole row again (a few
thousand channels, from L2), so no program waits on another.

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
def _gemv_kernel(x_ptr, w_ptr, b_ptr, y_ptr, u_ptr, nw_ptr, r_ptr, s_ptr, N, K, stride_wn, eps,
                 HAS_BIAS: tl.constexpr, X_ACT: tl.constexpr, U_ACT: tl.constexpr, G: tl.constexpr,
                 ADD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # y = W (pre(x) * post(u)) + b. pre: x (X_ACT 0), silu(x) (1), RMSNorm over groups of G channels times nw
    # (2), or over the whole row times nw (3); post: 1 (U_ACT 0), u (1), silu(u) (2), sigmoid(u) (3). A group's
    # statistic scales its share of the sum, so each slice of BLOCK_K channels (whole groups) is summed per group
    # first; the row's scales the whole sum at the end. ADD: x is x + r, rounded to x's dtype as PyTorch's sum would
    # be, and the first program writes it to s (a block's residual stream).
    pid = tl.program_id(0)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_N,), tl.float32)
    sq_row = tl.sum(tl.zeros((BLOCK_K,), tl.float32), axis=0)  # X_ACT 3: the row's sum of squares
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(w_ptr + rn[:, None] * stride_wn + rk[None, :], mask=(rn[:, None] < N) & (rk[None, :] < K),
                    other=0.0)
        x = tl.load(x_ptr + rk, mask=rk < K, other=0.0).to(tl.float32)
        if ADD:
            x = (x + tl.load(r_ptr + rk, mask=rk < K, other=0.0).to(tl.float32)).to(x_ptr.dtype.element_ty)
            if pid == 0:
                tl.store(s_ptr + rk, x, mask=rk < K)
            x = x.to(tl.float32)
        xs = x
        if X_ACT == 1:
            xs = x * tl.sigmoid(x)
        if X_ACT == 2:
            xs = x * tl.load(nw_ptr + rk % G, mask=rk < K, other=0.0).to(tl.float32)
        if X_ACT == 3:
            xs = x * tl.load(nw_ptr + rk, mask=rk < K, other=0.0).to(tl.float32)
            sq_row += tl.sum(x * x, axis=0)
        if U_ACT > 0:
            u = tl.load(u_ptr + rk, mask=rk < K, other=0.0).to(tl.float32)
            if U_ACT == 2:
                u = u * tl.sigmoid(u)
            if U_ACT == 3:
                u = tl.sigmoid(u)
            xs = xs * u
        prod = w.to(tl.float32) * xs[None, :]
        if X_ACT == 2:
            ss = tl.sum(tl.reshape(x * x, (BLOCK_K // G, G)), axis=1)  # [groups]
            r = tl.rsqrt(ss / G + tl.cast(eps, tl.float32))  # (inductor passes floats as fp64)
            acc += tl.sum(tl.sum(tl.reshape(prod, (BLOCK_N, BLOCK_K // G, G)), axis=2) * r[None, :], axis=1)
        else:
            acc += tl.sum(prod, axis=1)
    if X_ACT == 3:
        acc = acc * tl.rsqrt(sq_row / K + tl.cast(eps, tl.float32))
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)
    tl.store(y_ptr + rn, acc.to(y_ptr.dtype.element_ty), mask=rn < N)


def block_k(K: int) -> int:
    """The kernel's slice of the row: whole row up to 1024 channels, else 1024 a step."""
    return min(BLOCK_K, _pow2(K))


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, u: torch.Tensor | None = None,
         x_act: str | None = None, u_act: str | None = None, norm_weight: torch.Tensor | None = None,
         eps: float = 1e-6, residual: torch.Tensor | None = None, out_sum: torch.Tensor | None = None
         ) -> torch.Tensor:
    """``F.linear(pre(x) * post(u), weight, bias)`` for one row; no autograd.

    Args:
        x: [K], contiguous, one row.
        weight: [N, K], rows contiguous. bias: [N] or None.
        u: [K] or None: a second row, multiplied in after ``u_act`` (None: identity, ``"silu"`` or ``"sigmoid"``).
        x_act: None (x itself), ``"silu"``, or ``"rms_norm"``: x scaled by ``rsqrt(mean(x²) + eps)`` over each
            group of ``norm_weight.numel()`` channels (a head), times ``norm_weight`` ([G], G a power of two
            dividing K and the kernel's slice, ``block_k(K)``); or ``"rms_norm_row"``: the same over the whole
            row, ``norm_weight`` [K] (a block's input norm).
        residual: [K] or None: x is first ``x + residual`` (rounded to x's dtype), written into ``out_sum``
            ([K], x's dtype, contiguous, sharing no memory with x or residual; required with it): a block's
            residual add before its norm.
    Returns [N] in x's dtype, accumulated in fp32 (the prologue too, rounded once at the end)."""
    K = x.shape[-1]
    N = weight.shape[0]
    if x.numel() != K or weight.shape[1] != K or weight.stride(1) != 1 or not x.is_contiguous():
        raise ValueError(f"gemv takes one contiguous row x [K] and weight [N, K] with contiguous rows; got x "
                         f"{list(x.shape)}, weight {list(weight.shape)} with strides {weight.stride()}")
    if u is not None and (u.numel() != K or not u.is_contiguous()):
        raise ValueError(f"u must be one contiguous row of K = {K}, like x; got {list(u.shape)}")
    if x_act not in (None, "silu", "rms_norm", "rms_norm_row") or u_act not in (None, "silu", "sigmoid"):
        raise ValueError(f"x_act must be None, 'silu', 'rms_norm' or 'rms_norm_row' and u_act None, 'silu' or "
                         f"'sigmoid'; got {x_act!r}, {u_act!r}")
    if residual is not None and (residual.numel() != K or not residual.is_contiguous() or residual.dtype != x.dtype
                                 or out_sum is None or out_sum.numel() != K or not out_sum.is_contiguous()
                                 or out_sum.dtype != x.dtype):
        raise ValueError(f"residual and out_sum must be contiguous rows of K = {K} in x's dtype {x.dtype}; got "
                         f"{None if residual is None else (list(residual.shape), residual.dtype)}, "
                         f"{None if out_sum is None else (list(out_sum.shape), out_sum.dtype)}")
    if residual is not None and (out_sum is x or out_sum is residual):  # (no data_ptr: traced by Dynamo)
        raise ValueError("out_sum must be a tensor of its own, not x or residual: the other programs read those "
                         "while the first writes it")
    G = 1
    if x_act == "rms_norm_row" and (norm_weight is None or norm_weight.numel() != K
                                    or not norm_weight.is_contiguous()):
        raise ValueError(f"x_act='rms_norm_row' needs norm_weight [K = {K}], contiguous; got "
                         f"{None if norm_weight is None else list(norm_weight.shape)}")
    if x_act == "rms_norm":
        G = norm_weight.numel() if norm_weight is not None else 0
        if G < 1 or G & (G - 1) or K % G or block_k(K) % G or not norm_weight.is_contiguous():
            raise ValueError(f"x_act='rms_norm' needs norm_weight [G], contiguous, G a power of two dividing K = {K} "
                             f"and {block_k(K)}; got {None if norm_weight is None else list(norm_weight.shape)}")
    y = x.new_empty(N)
    _gemv_kernel[(-(-N // BLOCK_N),)](
        x, weight, bias if bias is not None else weight, y, u if u is not None else x,
        norm_weight if norm_weight is not None else weight, residual if residual is not None else x,
        out_sum if residual is not None else x, N, K, weight.stride(0), float(eps),
        HAS_BIAS=bias is not None, X_ACT={None: 0, "silu": 1, "rms_norm": 2, "rms_norm_row": 3}[x_act],
        U_ACT=0 if u is None else {None: 1, "silu": 2, "sigmoid": 3}[u_act], G=G, ADD=residual is not None,
        BLOCK_N=BLOCK_N, BLOCK_K=block_k(K), num_warps=WARPS, num_stages=STAGES)
    return y
