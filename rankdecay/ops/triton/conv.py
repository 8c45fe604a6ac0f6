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
from torch.autograd.function import once_differentiable

from .._inputs import sequence_ids

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


# -- whole sequences (training, prefill) ------------------------------------------------------------------------------
#
# y_t = act(Σ_i w[KW - 1 - i] x_{t - i}) over [B, T, D], each tap read only inside the token's sequence (packed
# sequences: ``seq`` [T], each token's sequence, and ``cu`` [N + 1]), before it from that sequence's (or row's)
# initial state [B or N, D, KW - 1]. In PyTorch that is a product, an add and, for packed sequences, a mask per tap,
# each a pass over [T, D] (the 340m preset's packed prefill spent a third of its GPU time there, session 76); here
# one pass, products and sums in fp32, rounded once. The backward recomputes the sums: one kernel forms
# g = dy * act'(pre) and the filters' gradient per block of tokens, a second dx_t = Σ_i w[KW - 1 - i] g_{t + i}.

# tiles of 16 tokens x 64 channels on one warp: the backward's filter gradient sums each tile over its tokens, which
# on one warp takes no exchange between warps (H200, bf16, B8 T2048, D = 512 / 1024: backward 0.119 -> 0.074 /
# 0.206 -> 0.132 ms against 32 x 128 on 4, the forward unchanged; benchmarks/conv_backward.py, session 85)
CONV_BT, CONV_BD, CONV_WARPS = 16, 64, 1


@triton.jit
def _conv_rows(cu, seq, b, t, T, PACKED: tl.constexpr, BT: tl.constexpr):
    # each token's state row and its sequence's first token (rows: b and 0)
    if PACKED:
        row = tl.load(seq + t, mask=t < T, other=0)
        lo = tl.load(cu + row, mask=t < T, other=0)
    else:
        row = tl.zeros([BT], dtype=tl.int32) + b
        lo = tl.zeros([BT], dtype=tl.int32)
    return row, lo


@triton.jit
def _conv_input(x, h0, b, row, lo, t, d, i: tl.constexpr, T, D, sxb, sxt, KW: tl.constexpr,
                HAS_STATE: tl.constexpr):
    # tap i's inputs x_{t - i} [BT, BD] in fp32: inside the sequence from x, before its start from the state
    src = t - i
    md = d < D
    inside = (t < T) & (src >= lo)
    xv = tl.load(x + b * sxb + src[:, None] * sxt + d[None, :], mask=inside[:, None] & md[None, :],
                 other=0.0).to(tl.float32)
    if HAS_STATE and i > 0:
        slot = (KW - 1) + src - lo  # the state's slot of an input before the sequence's start
        before = (t < T) & (src < lo) & (slot >= 0)
        xv += tl.load(h0 + (row[:, None] * D + d[None, :]) * (KW - 1) + slot[:, None],
                      mask=before[:, None] & md[None, :], other=0.0).to(tl.float32)
    return xv


@triton.jit
def _conv_taps(x, h0, w, cu, seq, b, t, d, T, D, sxb, sxt, KW: tl.constexpr, PACKED: tl.constexpr,
               HAS_STATE: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr):
    # the pre-activation sums [BT, BD] of tokens t
    row, lo = _conv_rows(cu, seq, b, t, T, PACKED, BT)
    acc = tl.zeros([BT, BD], dtype=tl.float32)
    for i in tl.static_range(KW):
        wv = tl.load(w + d * KW + (KW - 1 - i), mask=d < D, other=0.0).to(tl.float32)
        acc += _conv_input(x, h0, b, row, lo, t, d, i, T, D, sxb, sxt, KW, HAS_STATE) * wv[None, :]
    return acc


@triton.jit
def _conv_fwd_kernel(x, h0, w, cu, seq, y, T, D, sxb, sxt, KW: tl.constexpr, SILU: tl.constexpr,
                     PACKED: tl.constexpr, HAS_STATE: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr):
    it, i_d, b = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    t = it * BT + tl.arange(0, BT).to(tl.int64)  # int64 offsets: B * T * D may pass 2^31
    d = i_d * BD + tl.arange(0, BD)
    acc = _conv_taps(x, h0, w, cu, seq, b, t, d, T, D, sxb, sxt, KW, PACKED, HAS_STATE, BT, BD)
    if SILU:
        acc = acc * tl.sigmoid(acc)
    tl.store(y + (b * T + t[:, None]) * D + d[None, :], acc.to(y.dtype.element_ty),
             mask=(t < T)[:, None] & (d < D)[None, :])


@triton.jit
def _conv_bwd_g_kernel(x, h0, w, cu, seq, dy, g, dw, T, D, sxb, sxt, KW: tl.constexpr, SILU: tl.constexpr,
                       PACKED: tl.constexpr, HAS_STATE: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr):
    # g = dy * act'(pre) [B, T, D] fp32, and this block's share of dw: [B * nT, D, KW] fp32 (summed by the caller)
    it, i_d, b = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    t = it * BT + tl.arange(0, BT).to(tl.int64)  # int64 offsets: B * T * D may pass 2^31
    d = i_d * BD + tl.arange(0, BD)
    mt, md = t < T, d < D
    m = mt[:, None] & md[None, :]
    gv = tl.load(dy + (b * T + t[:, None]) * D + d[None, :], mask=m, other=0.0).to(tl.float32)
    if SILU:
        pre = _conv_taps(x, h0, w, cu, seq, b, t, d, T, D, sxb, sxt, KW, PACKED, HAS_STATE, BT, BD)
        sig = tl.sigmoid(pre)
        gv = gv * sig * (1.0 + pre * (1.0 - sig))
    tl.store(g + (b * T + t[:, None]) * D + d[None, :], gv, mask=m)
    row, lo = _conv_rows(cu, seq, b, t, T, PACKED, BT)
    part = dw + ((b * tl.num_programs(0) + it) * D + d) * KW
    for i in tl.static_range(KW):
        xv = _conv_input(x, h0, b, row, lo, t, d, i, T, D, sxb, sxt, KW, HAS_STATE)
        tl.store(part + (KW - 1 - i), tl.sum(gv * xv, axis=0), mask=md)


@triton.jit
def _conv_bwd_dx_kernel(g, w, cu, seq, dx, T, D, KW: tl.constexpr, PACKED: tl.constexpr, BT: tl.constexpr,
                        BD: tl.constexpr):
    # dx_t = Σ_i w[KW - 1 - i] g_{t + i}, for t + i inside t's sequence
    it, i_d, b = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    t = it * BT + tl.arange(0, BT).to(tl.int64)  # int64 offsets: B * T * D may pass 2^31
    d = i_d * BD + tl.arange(0, BD)
    mt, md = t < T, d < D
    if PACKED:
        hi = tl.load(cu + tl.load(seq + t, mask=mt, other=0) + 1, mask=mt, other=0)
    else:
        hi = tl.zeros([BT], dtype=tl.int32) + T
    acc = tl.zeros([BT, BD], dtype=tl.float32)
    for i in tl.static_range(KW):
        dst = t + i
        wv = tl.load(w + d * KW + (KW - 1 - i), mask=md, other=0.0).to(tl.float32)
        gv = tl.load(g + (b * T + dst[:, None]) * D + d[None, :], mask=(mt & (dst < hi))[:, None] & md[None, :],
                     other=0.0)
        acc += gv * wv[None, :]
    tl.store(dx + (b * T + t[:, None]) * D + d[None, :], acc.to(dx.dtype.element_ty),
             mask=mt[:, None] & md[None, :])


def _conv_grid(B: int, T: int, D: int) -> tuple[int, int, int]:
    return triton.cdiv(T, CONV_BT), triton.cdiv(D, CONV_BD), B


class _ShortConv(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, state, cu, seq, silu):
        B, T, D = x.shape
        KW = weight.shape[1]
        y = torch.empty(B, T, D, device=x.device, dtype=x.dtype)
        packed, has_state = seq is not None, state is not None
        h0 = state if has_state else weight  # an unread pointer stands in for a missing tensor
        cu_, seq_ = (cu, seq) if packed else (weight, weight)
        _conv_fwd_kernel[_conv_grid(B, T, D)](x, h0, weight, cu_, seq_, y, T, D, x.stride(0), x.stride(1), KW=KW,
                                              SILU=silu, PACKED=packed, HAS_STATE=has_state, BT=CONV_BT, BD=CONV_BD,
                                              num_warps=CONV_WARPS)
        ctx.save_for_backward(x, weight, state, cu, seq)
        ctx.silu = silu
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        x, weight, state, cu, seq = ctx.saved_tensors
        B, T, D = x.shape
        KW = weight.shape[1]
        packed, has_state = seq is not None, state is not None
        h0 = state if has_state else weight
        cu_, seq_ = (cu, seq) if packed else (weight, weight)
        dy = dy.contiguous()
        grid = _conv_grid(B, T, D)
        g = torch.empty(B, T, D, device=x.device, dtype=torch.float32)
        dw = torch.empty(B * grid[0], D, KW, device=x.device, dtype=torch.float32)
        _conv_bwd_g_kernel[grid](x, h0, weight, cu_, seq_, dy, g, dw, T, D, x.stride(0), x.stride(1), KW=KW,
                                 SILU=ctx.silu, PACKED=packed, HAS_STATE=has_state, BT=CONV_BT, BD=CONV_BD,
                                 num_warps=CONV_WARPS)
        dx = torch.empty(B, T, D, device=x.device, dtype=x.dtype)
        _conv_bwd_dx_kernel[grid](g, weight, cu_, seq_, dx, T, D, KW=KW, PACKED=packed, BT=CONV_BT, BD=CONV_BD,
                                  num_warps=CONV_WARPS)
        dstate = _state_grad(g, weight, cu).to(state.dtype) if has_state and ctx.needs_input_grad[2] else None
        return dx, dw.sum(0).to(weight.dtype), dstate, None, None, None


def _state_grad(g: torch.Tensor, weight: torch.Tensor, cu: torch.Tensor | None) -> torch.Tensor:
    """The initial state's gradient ``[B or N, D, W - 1]`` (fp32) from g ``[B, T, D]``, the loss's gradient at the
    sums before the activation: the state's input j (oldest first) came W - 1 - j steps before its row's (its
    sequence's) first token and meets token t <= j through the tap ``w[:, j - t]``, so only the first W - 1 tokens of
    each row (of each sequence, where it has them) reach it: a few small products, not a pass over T."""
    past = weight.shape[1] - 1
    B, T, D = g.shape
    if not past:  # a one-tap filter keeps no state
        return g.new_zeros(B if cu is None else cu.shape[0] - 1, D, 0)
    if cu is None:
        first = g[:, :past]  # [B, min(T, past), D]
    else:  # each sequence's first `past` tokens, zeros past its end
        at = cu[:-1].long()[:, None] + torch.arange(past, device=g.device)  # [N, past]
        first = torch.where((at < cu[1:].long()[:, None])[..., None], g[0, at.clamp(max=T - 1)], 0.0)
    w = weight.float()
    return torch.stack([sum(first[:, t] * w[:, j - t] for t in range(min(j + 1, first.shape[1])))
                        for j in range(past)], -1)  # (T >= 1: every sum has a term)


def short_conv(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor | None = None,
               cu_seqlens: torch.Tensor | None = None, seq: torch.Tensor | None = None,
               activation: str | None = "silu") -> torch.Tensor:
    """A depthwise causal convolution over whole sequences in one kernel, with autograd (x, the filters and the
    state).

    Args:
        x: ``[B, T, D]``, channels contiguous.
        weight: ``[D, W]`` (``ShortConvolution.filters()``); the newest input pairs with the last tap.
        state: None (zeros), or the inputs before each row (each sequence with ``cu_seqlens``):
            ``[B or N, D, W - 1]``, oldest first; differentiated where it requires grad (a state carried over from
            an earlier segment without ``detach``, or a learned one).
        cu_seqlens: ``[N + 1]`` offsets of sequences packed along T (B = 1): no tap crosses a start.
        seq: each token's sequence ``[T]`` (``ops._inputs.sequence_ids``), where the caller has it.
        activation: ``"silu"`` or None.

    Returns:
        ``y [B, T, D]`` in x's dtype: ``act(Σ_i w[:, W - 1 - i] x_{t - i})``, in fp32, rounded once.
    """
    if activation not in ("silu", None):
        raise ValueError(f"activation must be 'silu' or None, got {activation!r}")
    B, T, D = x.shape
    W = weight.shape[-1]
    if weight.shape != (D, W):
        raise ValueError(f"weight must be [D, W] with D = {D}, got {list(weight.shape)}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    weight = weight.contiguous()
    if cu_seqlens is not None:
        cu = cu_seqlens.to(device=x.device, dtype=torch.int32)
        seq = (sequence_ids(cu, T) if seq is None else seq).to(torch.int32)
        rows = cu.shape[0] - 1
    else:
        cu = seq = None
        rows = B
    if state is not None:
        if state.shape != (rows, D, W - 1):
            raise ValueError(f"state must be [{rows}, {D}, {W - 1}], got {list(state.shape)}")
        state = state.to(x.dtype).contiguous()
    return _ShortConv.apply(x, weight, state, cu, seq, activation == "silu")
