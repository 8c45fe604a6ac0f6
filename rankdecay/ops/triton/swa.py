"""One decode step of sliding-window attention over its ring of keys: rotary embeddings, the ring's write and the
attention in two kernels.

``SlidingWindowAttention`` decodes against a ring of ``window`` key/value slots per row (``ring_cache``): the new
token's key takes the slot of the one that left the window, and the query attends over every real slot. In PyTorch
that step is some fifty small kernels per layer (the rotary embedding's angles, cosines, halves and casts; three
index writes; the mask; SDPA, whose one query per row and head leaves most of the GPU idle over a long ring; the
counters), which at B = 1 cost their launches and at B = 64 SDPA's bandwidth. Here:

- ``_swa_partial_kernel``, program (block of slots, row, head): rotates q, and over its block of ring slots (the
  slot being replaced left out) the block's running maximum, sum of exponentials and weighted sum of values, in fp32
  (split-K over the ring, as flash-decoding does), the slots a piece at a time (online softmax, loads pipelined);
- ``_swa_combine_kernel``, program (row, head): rotates the new key, folds its score and value into the blocks'
  partials (the query always sees its own key), writes the output, and writes the rotated key, the value and the
  token's flag into the ring's slot: the partial kernel has read every other slot by then, so nothing races.

Grouped key/value heads (GQA): query head h reads the ring's head h // G (G query heads per key/value head), and
the combine kernel's first program of each group writes that head's slot.

The rotation is the rotate-half form of ``layers.attention.rotary`` (angles ``position x theta^(-2i / D)`` in fp32),
the scores are scaled by ``D^-0.5`` as SDPA's default, and every sum is in fp32. Traced by ``torch.compile`` as
user-defined Triton kernels.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

# ring slots per program of the partial kernel (a ring of 2048: 32 programs per row and head) and its warps; the
# slots SUB at a time, their loads pipelined over STAGES. At B = 64 (H200, 4 heads of 256, a ring of 2048, bf16,
# every slot real) 157-162 us a step, 3.3-3.4 TB/s, against 174-177 us for 32 slots in one piece (session 77's
# launch), 211 us for 64 slots unpipelined, 184 us for SDPA with the mask; at B = 16 60.3 us against 62.5. With 200
# real slots, blocks without one skipped: 86-127 us against 156-165 (session 78)
BLOCK_W, WARPS = 64, 2
SUB, STAGES = 32, 2
# narrower heads take more slots a program, up to 256, so that a program moves what one of 64 slots of a head of 256
# does, while the programs still number PROGRAMS at least: at B = 64 fewer programs and partials (16 heads of 64,
# ring 2048: 2.89 ms a step instead of 3.17 at prompt 128, 3.65-3.89 instead of 3.95-4.11 at 1500, H200, session
# 80); at B = 1 the 64 slots' 512 programs keep the GPU busier (0.94-0.99 ms against 1.01-1.12 with 256 slots)
BLOCK_ELEMS, BLOCK_W_MAX, PROGRAMS = 64 * 256, 256, 4096


def _block_w(B: int, H: int, W: int, D: int) -> int:
    """Ring slots per program of the partial kernel: B rows of H heads of D, rings of W slots."""
    block_w = max(BLOCK_W, min(BLOCK_W_MAX, BLOCK_ELEMS // triton.next_power_of_2(D)))
    while block_w > BLOCK_W and B * H * triton.cdiv(W, block_w) < PROGRAMS:
        block_w //= 2
    return block_w


@triton.jit
def _reduced(angle):
    """An fp32 angle reduced to [-pi, pi] in two steps (Cody and Waite: 2 pi as 6.28125, exact in 8 bits, plus the
    rest), so that cos and sin need no range reduction of their own."""
    turns = tl.floor(angle * 0.15915494309189535 + 0.5)
    return (angle - turns * 6.28125) - turns * 0.0019353071795864769


@triton.jit
def _rotate(x1, x2, angle, sign):
    """The rotate-half RoPE of the halves (x1, x2) by fp32 ``angle`` (any size: reduced here), in fp32; ``sign``
    -1 rotates back (the same cosines, the sines negated)."""
    angle = _reduced(angle)
    c, s = tl.cos(angle), sign * tl.sin(angle)
    return x1 * c - x2 * s, x2 * c + x1 * s


@triton.jit
def _rotated(x_ptr, pos, freq_ptr, HALF: tl.constexpr, HALF_P2: tl.constexpr):
    """The halves of x [2 HALF] rotated by ``pos``, in fp32, each [HALF_P2] (zero past HALF), the angles
    PyTorch's (``pos x inv_freq`` in fp32)."""
    i = tl.arange(0, HALF_P2)
    x1 = tl.load(x_ptr + i, mask=i < HALF, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + HALF + i, mask=i < HALF, other=0.0).to(tl.float32)
    return _rotate(x1, x2, pos * tl.load(freq_ptr + i, mask=i < HALF, other=0.0), 1.0)


@triton.jit
def _swa_partial_kernel(q_ptr, sq_b, sq_h, rk_ptr, rv_ptr, sr_b, sr_w, sr_h, real_ptr, sreal_b, count_ptr, next_ptr,
                        m_ptr, l_ptr, acc_ptr, freq_ptr, H, W, S, SCALE_LOG2E: tl.constexpr,
                        D: tl.constexpr, D_P2: tl.constexpr, BLOCK_W: tl.constexpr, SUB: tl.constexpr,
                        STAGES: tl.constexpr, G: tl.constexpr):
    blk, b, h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    HALF: tl.constexpr = D // 2
    HALF_P2: tl.constexpr = D_P2 // 2
    pos = tl.load(count_ptr + b).to(tl.float32)
    q1, q2 = _rotated(q_ptr + b * sq_b + h * sq_h, pos, freq_ptr, HALF, HALF_P2)
    q1, q2 = q1 * SCALE_LOG2E, q2 * SCALE_LOG2E  # scores in log2 units
    nxt = tl.load(next_ptr + b)
    i = tl.arange(0, HALF_P2)
    d = tl.arange(0, D_P2)
    m = tl.max(tl.full([SUB], -float("inf"), tl.float32), 0)  # the block's running maximum, sum and weighted values
    total = tl.sum(tl.zeros([SUB], tl.float32), 0)
    acc = tl.zeros([D_P2], tl.float32)
    # the block's slots SUB at a time (online softmax), their loads pipelined over STAGES; none if no slot is real
    # (a short prompt's ring is mostly empty: a block's loads, masked off, still cost as much as reading it)
    start = blk * BLOCK_W
    wb = start + tl.arange(0, BLOCK_W)
    flags = tl.load(real_ptr + b * sreal_b + wb, mask=wb < W, other=0)
    end = tl.where(tl.max(flags.to(tl.int32), 0) > 0, start + BLOCK_W, start)
    for w0 in tl.range(start, end, SUB, num_stages=STAGES):
        w = w0 + tl.arange(0, SUB)
        seen = (w < W) & (w != nxt)
        seen &= tl.load(real_ptr + b * sreal_b + w, mask=w < W, other=0) != 0
        rows = b * sr_b + w[:, None] * sr_w + (h // G) * sr_h
        halves = seen[:, None] & (i < HALF)[None, :]
        k1 = tl.load(rk_ptr + rows + i[None, :], mask=halves, other=0.0).to(tl.float32)
        k2 = tl.load(rk_ptr + rows + HALF + i[None, :], mask=halves, other=0.0).to(tl.float32)
        vals = tl.load(rv_ptr + rows + d[None, :], mask=seen[:, None] & (d < D)[None, :], other=0.0).to(tl.float32)
        score = tl.where(seen, tl.sum(k1 * q1[None, :], 1) + tl.sum(k2 * q2[None, :], 1), -float("inf"))
        top = tl.maximum(m, tl.max(score, 0))
        shift = tl.where(top == -float("inf"), 0.0, top)  # nothing seen yet: every weight 0
        p = tl.where(seen, tl.exp2(score - shift), 0.0)
        keep = tl.exp2(m - shift)
        total = total * keep + tl.sum(p, 0)
        acc = acc * keep + tl.sum(p[:, None] * vals, 0)
        m = top
    at = (b * H + h) * S + blk
    tl.store(m_ptr + at, m)
    tl.store(l_ptr + at, total)
    tl.store(acc_ptr + at * D + d, acc, mask=d < D)


@triton.jit
def _swa_combine_kernel(q_ptr, sq_b, sq_h, k_ptr, sk_b, sk_h, v_ptr, sv_b, sv_h, o_ptr, rk_ptr, rv_ptr, sr_b, sr_w,
                        sr_h, real_ptr, sreal_b, tok_real_ptr, count_ptr, next_ptr, m_ptr, l_ptr, acc_ptr,
                        freq_ptr, H, S, SCALE_LOG2E: tl.constexpr, D: tl.constexpr, D_P2: tl.constexpr,
                        BLOCK_S: tl.constexpr, G: tl.constexpr):
    b, h = tl.program_id(0), tl.program_id(1)
    hk = h // G  # the key/value head
    HALF: tl.constexpr = D // 2
    HALF_P2: tl.constexpr = D_P2 // 2
    pos = tl.load(count_ptr + b).to(tl.float32)
    q1, q2 = _rotated(q_ptr + b * sq_b + h * sq_h, pos, freq_ptr, HALF, HALF_P2)
    k1, k2 = _rotated(k_ptr + b * sk_b + hk * sk_h, pos, freq_ptr, HALF, HALF_P2)
    own = (tl.sum(q1 * k1, 0) + tl.sum(q2 * k2, 0)) * SCALE_LOG2E  # the query's own key, always seen
    s = tl.arange(0, BLOCK_S)
    at = (b * H + h) * S + s
    m = tl.load(m_ptr + at, mask=s < S, other=-float("inf"))
    top = tl.maximum(tl.max(m, 0), own)
    f = tl.where(s < S, tl.exp2(m - top), 0.0)  # a block that saw nothing: m = -inf, weight 0
    f_own = tl.exp2(own - top)
    total = tl.sum(tl.load(l_ptr + at, mask=s < S, other=0.0) * f, 0) + f_own
    d = tl.arange(0, D_P2)
    v = tl.load(v_ptr + b * sv_b + hk * sv_h + d, mask=d < D, other=0.0)
    acc = tl.load(acc_ptr + at[:, None] * D + d[None, :], mask=(s < S)[:, None] & (d < D)[None, :], other=0.0)
    out = (tl.sum(acc * f[:, None], 0) + f_own * v.to(tl.float32)) / total
    tl.store(o_ptr + (b * H + h) * D + d, out.to(o_ptr.dtype.element_ty), mask=d < D)
    # the ring's slot, once per key/value head: the partial kernel has read every slot it needed before this
    # kernel started
    if h % G == 0:
        slot = b * sr_b + tl.load(next_ptr + b) * sr_w + hk * sr_h
        i = tl.arange(0, HALF_P2)
        tl.store(rk_ptr + slot + i, k1.to(rk_ptr.dtype.element_ty), mask=i < HALF)
        tl.store(rk_ptr + slot + HALF + i, k2.to(rk_ptr.dtype.element_ty), mask=i < HALF)
        tl.store(rv_ptr + slot + d, v, mask=d < D)
    if h == 0:
        tl.store(real_ptr + b * sreal_b + tl.load(next_ptr + b), tl.load(tok_real_ptr + b))


def takes(q: torch.Tensor, ring_k: torch.Tensor) -> bool:
    """Whether :func:`swa_step` takes these: q [B, H, D] and a ring [B, W, Hkv, D] (Hkv dividing H) of one dtype
    (fp32 / bf16 / fp16), D even from 8 to 256, each last axis contiguous."""
    D = q.shape[-1]
    return (q.dtype in (torch.float32, torch.bfloat16, torch.float16) and ring_k.dtype == q.dtype
            and 8 <= D <= 256 and D % 2 == 0 and q.stride(-1) == 1 and ring_k.stride(-1) == 1
            and q.shape[1] % ring_k.shape[2] == 0)


def swa_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: dict, real: torch.Tensor,
             inv_freq: torch.Tensor) -> torch.Tensor:
    """One token of sliding-window attention against its ring, the ring updated in place.

    Args:
        q: ``[B, H, D]``; k, v: ``[B, Hkv, D]`` (Hkv dividing H: grouped key/value heads); the token's projections
            before the rotary embedding (any strides with the last axis contiguous, as slices of one packed product
            are).
        ring: ``SlidingWindowAttention``'s ring cache: ``"k"``, ``"v"`` ``[B, W, Hkv, D]`` (keys rotated), ``"real"``
            ``[B, W]`` bool, ``"count"`` ``[B]`` (the token's position: the real tokens before it), ``"next"``
            ``[B]`` (the slot this token takes).
        real: ``[B]`` bool, whether the token is real (a padding token still attends to itself).
        inv_freq: ``[D / 2]`` fp32, the rotary embedding's frequencies (``layers.attention.rotary_frequencies``).

    Returns:
        o ``[B, H, D]`` in q's dtype: softmax attention of the rotated q over the ring's real slots other than
        ``next`` and over its own rotated key. ``ring["k"]``, ``ring["v"]`` and ``ring["real"]`` then hold the token
        at slot ``next``; the caller advances ``count`` and ``next``.
    """
    B, H, D = q.shape
    rk, rv, rreal = ring["k"], ring["v"], ring["real"]
    W, Hkv = rk.shape[1], rk.shape[2]
    if (rv.stride() != rk.stride() or rk.shape != (B, W, Hkv, D) or rv.shape != rk.shape or rreal.stride(-1) != 1
            or H % Hkv):
        raise ValueError(f"the ring's k and v must be [B, W, Hkv, D] = {[B, W, 'Hkv', D]} with one layout and Hkv "
                         f"dividing H = {H}, got {list(rk.shape)} / {list(rv.shape)}")
    if k.shape != (B, Hkv, D) or v.shape != k.shape:
        raise ValueError(f"k and v must be [B, Hkv, D] = {[B, Hkv, D]}, got {list(k.shape)} / {list(v.shape)}")
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("k and v must have a contiguous last axis")
    block_w = _block_w(B, H, W, D)
    S = triton.cdiv(W, block_w)
    m = torch.empty(B, H, S, device=q.device, dtype=torch.float32)
    l = torch.empty_like(m)  # noqa: E741
    acc = torch.empty(B, H, S, D, device=q.device, dtype=torch.float32)
    o = torch.empty(B, H, D, device=q.device, dtype=q.dtype)
    tok_real = real.to(rreal.dtype).contiguous()
    scale_log2e = D ** -0.5 * math.log2(math.e)  # a constexpr (one value per D): inductor would pass a float as fp64
    count, nxt = ring["count"], ring["next"]
    _swa_partial_kernel[(S, B, H)](q, q.stride(0), q.stride(1), rk, rv, rk.stride(0), rk.stride(1), rk.stride(2),
                                   rreal, rreal.stride(0), count, nxt, m, l, acc, inv_freq, H, W, S,
                                   scale_log2e, D=D, D_P2=triton.next_power_of_2(D), BLOCK_W=block_w,
                                   SUB=min(SUB, block_w), STAGES=STAGES, G=H // Hkv, num_warps=WARPS)
    _swa_combine_kernel[(B, H)](q, q.stride(0), q.stride(1), k, k.stride(0), k.stride(1), v, v.stride(0), v.stride(1),
                                o, rk, rv, rk.stride(0), rk.stride(1), rk.stride(2), rreal, rreal.stride(0),
                                tok_real, count, nxt, m, l, acc, inv_freq, H, S, scale_log2e, D=D,
                                D_P2=triton.next_power_of_2(D), BLOCK_S=triton.next_power_of_2(S), G=H // Hkv,
                                num_warps=WARPS)
    return o
