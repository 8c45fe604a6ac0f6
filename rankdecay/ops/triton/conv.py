"""One decode step of up to three short causal convolutions in one kernel, their states updated in place.

A linear mixer runs q, k and v through depthwise causal convolutions of a few taps (``ShortConvolution``). For one
token that is ``y = silu(Σ_i w_i x_{t-i})`` and a shift of the last ``kernel - 1`` inputs, next to no work; in
PyTorch it is a concatenation, a product, a sum, the activation and a copy of the shifted state for each of the
three (and under ``torch.compile`` still three kernels each, since the state is read and written back). Here it is
one launch for all three, which writes the shifted state back where it was read (like causal-conv1d's
``causal_conv1d_update``, which Mamba and fla use): a CUDA-graphed decode step then has nothing to copy back.

The products and the sum are in fp32, rounded once to x's dtype (PyTorch's step rounds each product to x's dtype
first). Traced by ``torch.compile`` as a user-defined Triton kernel: no None arguments (a missing segment repeats
the first), and inductor sees the states it writes.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

BLOCK, WARPS = 256, 2  # a few thousand channels per layer: the launch, not the work, sets the time


@triton.jit
def _conv_segment(x_ptr, stride_x, s_ptr, w_ptr, y_ptr, D, b, block, W: tl.constexpr, SILU: tl.constexpr,
                  BLOCK: tl.constexpr):
    # channels [block * BLOCK, +BLOCK) of row b: state [B, D, W - 1] and weight [D, W] contiguous, y [B, D]
    rd = block * BLOCK + tl.arange(0, BLOCK)
    m = rd < D
    x = tl.load(x_ptr + b * stride_x + rd, mask=m, other=0.0)
    acc = x.to(tl.float32) * tl.load(w_ptr + rd * W + (W - 1), mask=m, other=0.0).to(tl.float32)
    state = s_ptr + (b * D + rd) * (W - 1)
    # tap i moves to slot i - 1 once slot i - 1 has been read; each thread writes only the channels it read (one
    # layout for every load and store), so the shift needs no barrier
    for i in tl.static_range(W - 1):  # state[.., i] is x_{t - (W - 1) + i}, paired with weight i
        s = tl.load(state + i, mask=m, other=0.0)
        acc += s.to(tl.float32) * tl.load(w_ptr + rd * W + i, mask=m, other=0.0).to(tl.float32)
        if i > 0:
            tl.store(state + (i - 1), s, mask=m)
    tl.store(state + (W - 2), x.to(s_ptr.dtype.element_ty), mask=m)
    if SILU:
        acc = acc * tl.sigmoid(acc)
    tl.store(y_ptr + b * D + rd, acc.to(y_ptr.dtype.element_ty), mask=m)


@triton.jit
def _conv_step_kernel(x0, sx0, s0, w0, y0, D0, x1, sx1, s1, w1, y1, D1, x2, sx2, s2, w2, y2, D2, n0, n1,
                      W: tl.constexpr, SILU: tl.constexpr, BLOCK: tl.constexpr):
    # program (block, row): the blocks of segment 0, then 1's, then 2's (n0 and n0 + n1 blocks before them)
    pid, b = tl.program_id(0), tl.program_id(1)
    if pid < n0:
        _conv_segment(x0, sx0, s0, w0, y0, D0, b, pid, W, SILU, BLOCK)
    elif pid < n0 + n1:
        _conv_segment(x1, sx1, s1, w1, y1, D1, b, pid - n0, W, SILU, BLOCK)
    else:
        _conv_segment(x2, sx2, s2, w2, y2, D2, b, pid - n0 - n1, W, SILU, BLOCK)


def short_conv_step(xs: Sequence[torch.Tensor], states: Sequence[torch.Tensor], weights: Sequence[torch.Tensor],
                    activation: str | None = "silu") -> list[torch.Tensor]:
    """One token through up to three depthwise causal convolutions, in one launch; no autograd.

    Args:
        xs: each ``[B, D_i]`` or ``[B, 1, D_i]``, channels contiguous (rows may be strided: the split of a packed
            product).
        states: each ``[B, D_i, W - 1]``, contiguous, in x's dtype: the last ``W - 1`` inputs, oldest first
            (``ShortConvolution``'s). Overwritten with the shifted state, x last.
        weights: each ``[D_i, W]`` (``ShortConvolution.filters()``), contiguous; the newest input pairs with
            the last tap.
        activation: ``"silu"`` or None.

    Returns:
        ``y_i`` of x_i's shape and dtype: ``act(Σ_j w_i[:, j] · [state_i, x_i][:, j])``, in fp32, rounded once.
    """
    if not 1 <= len(xs) <= 3 or len(states) != len(xs) or len(weights) != len(xs):
        raise ValueError(f"short_conv_step takes 1 to 3 convolutions, each with an x, a state and a weight; got "
                         f"{len(xs)} xs, {len(states)} states and {len(weights)} weights")
    if activation not in ("silu", None):
        raise ValueError(f"activation must be 'silu' or None, got {activation!r}")
    W = weights[0].shape[-1]
    if W < 2:
        raise ValueError(f"short_conv_step needs a kernel of at least 2 taps (a state to shift); got {W}")
    B = xs[0].shape[0]
    args, blocks, outs = [], [], []
    for i, (x, s, w) in enumerate(zip(xs, states, weights)):
        D = x.shape[-1]
        if x.dim() not in (2, 3) or x.numel() != B * D or x.stride(-1) != 1 or (x.dim() == 3 and x.shape[1] != 1):
            raise ValueError(f"xs[{i}] must be [B, D] or [B, 1, D] with B = {B} and contiguous channels; got "
                             f"{list(x.shape)} with strides {x.stride()}")
        if w.shape != (D, W) or not w.is_contiguous():
            raise ValueError(f"weights[{i}] must be a contiguous [D, W] = {[D, W]} tensor (W = weights[0]'s taps); "
                             f"got {list(w.shape)}, contiguous={w.is_contiguous()}")
        if s.shape != (B, D, W - 1) or not s.is_contiguous() or s.dtype != x.dtype:
            raise ValueError(f"states[{i}] must be a contiguous [B, D, W - 1] = {[B, D, W - 1]} tensor in x's dtype "
                             f"{x.dtype}; got {list(s.shape)}, {s.dtype}, contiguous={s.is_contiguous()}")
        y = torch.empty(x.shape, device=x.device, dtype=x.dtype)
        args.append((x, x.stride(0), s, w, y, D))
        blocks.append(-(-D // BLOCK))
        outs.append(y)
    while len(args) < 3:  # unused segments: no programs reach them
        args.append(args[0])
        blocks.append(0)
    _conv_step_kernel[(sum(blocks), B)](*args[0], *args[1], *args[2], blocks[0], blocks[1], W=W,
                                       SILU=activation == "silu", BLOCK=BLOCK, num_warps=WARPS)
    return outs
