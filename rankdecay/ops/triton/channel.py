"""Per-channel decayed products inside a chunk, forward and backward, in sub-blocks.

With a per-channel gate, every intra-chunk product of the chunked algorithm has the form

    P[p, q] = Σ_k x_pk y_qk exp(G^x_pk - G^y_qk)      for tok q < tok p (STRICT) or tok q <= tok p

(M_QK, M_QA: x = q, G^x = G_t; L_BA, L_BK: x = b, STRICT, G^x = G_{t-1}; G^y = G_t), with G the
chunk-local log-cumsums (``chunk_fwd.chunk_log_cumsum``). The decay is not a rank-one factor, so
it cannot be moved out of the product whole; it is split the way fla's GLA kernels split it.
The chunk's tokens fall into NB sub-blocks of TB tokens (TB*R >= 16 rows for either side):

* off the diagonal (y's block before x's), through the token r just before x's block: the
  exponent is (G^x_p - G_r) + (G_r - G^y_q), both parts <= 0, so P's off-diagonal part is a
  tensor-core product of x ⊙ e^{G^x - G_r} with y ⊙ e^{G_r - G^y}: in the forward, one per earlier
  block of y; in the backward, one against all of y's rows, the later ones masked to 0;
* on the diagonal, the pairs within TB tokens are taken level by level (``_level_product``):
  at each level the second half of every block of S tokens against its first half, through
  the token at S/2 - 1, both factors <= 1 again, plus (not STRICT) a token against itself.

No factor exceeds 1, so a log-gate of -30 per step underflows to an exact 0 and never overflows.
One program per (x row block, chunk, sequence x head) in the forward; one per (key block, row
block, chunk, ...) in the backward, which forms dx for x's rows of its block (through the token
before it, as above) and dy for y's rows of its block (through the block's last token f:
(G^x_p - G_f) + (G_f - G^y_q), again both <= 0).

The exponents are differences of log-cumsums, fp64 at fp32 accuracy and fp32 where the products are
rounded to TF32 or bf16 anyway (``chunk_fwd.log_cumsum_dtype``).

HDLA's rows have structure the general products do not use: b1 = λ ⊙ k through G_{t-1} is k through G_t,
b2 = k, and a1 = β k. ``hdla_products`` forms its four products from six products of token rows (q, b1 and b2
against k and a2) in one kernel, the same sub-blocks and levels, instead of nine [C, C] products in four;
``hdla_products_bwd`` their gradients from twelve, instead of sixteen in four launches. HDLA's forward without
autograd, whose 16-token chunk is one sub-block, takes them from the rows the log-cumsum kernel has already decayed
(``hdla_row_products``: one product through the chunk's start, no exp), where the chunk's log-cumsums stay near 0.

Where a is k with per-row factors (``kda``: a = β ⊙ k), Q A is Q K with β on its columns and B A is B K:
``channel_product(..., out_scaled=)`` writes each pair from one product and ``channel_product_bwd(...,
dp_scaled=)`` takes its gradients in one pass (the kernels' DUAL), two products where there were four. Without
autograd, KDA's L_BK is k's product with itself through G_t (b = e^g ⊙ k), the same columns and exponents as M_QK:
``channel_product(..., x2=)`` takes both in one kernel (the forward kernel's PAIR; H200 KDA forward 1.17 -> 1.07 ms,
BENCHMARKS.md session 45).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .chunk_state import _chunk_rows, _dot, _load_rows, _maxnreg
from .fused_recurrent import _cdiv, _pow2

# Knobs: rows of a sub-block (at least 16, tl.dot's smallest tile); key block and warps of the forward and
# backward kernels (None: by chunk size, ``_LAUNCH``); log_cumsum: the log-cumsums' dtype (None:
# ``chunk_fwd.log_cumsum_dtype``'s choice).
# bk is the forward's diagonal blocks' key block; its off-diagonal part takes all of K at once.
# hdla_bwd_bk, hdla_bwd_warps: ``hdla_products_bwd``'s (H100 HDLA: 2.45 ms on 2 warps and 32 channels, 1.95 on
# 4 and 64, 2.14 on 8 and 128; BENCHMARKS.md session 29).
# hdla_pairs / hdla_bwd_pairs: ``hdla_products``' / ``hdla_products_bwd``'s last level (adjacent tokens) as row sums.
# H100, HDLA at bf16 (BENCHMARKS.md session 32): the forward kernel 0.963 -> 0.904 ms, so on; the backward's
# 1.852 -> 2.075 ms (it trades 24 of 144 HMMA for row sums and their shuffles, 4272 -> 4520 instructions on sm_90),
# so off. Both pass the GPU's HDLA tests (bf16 at K = 128 and the one-node cases).
# dual_bwd_bk, dual_bwd_warps: ``channel_product_bwd``'s with a pair of products (``dp_scaled``; None: bwd_bk's, and 2
# warps). H100 KDA, B8 T2048 H16 K=V=128 bf16: 1.618 ms on 4 warps, 1.293 on 2 (BENCHMARKS.md session 33).
# pair_bwd_warps: the same with two pairs (``x2``, KDA's four products): 2 warps. On the H100 4 warps were a little
# faster (forward+backward 4.638-4.658 ms on 2, 4.622-4.629 on 4: BENCHMARKS.md session 47, before the one-product
# blocks of session 48); on the H200 the kernel takes 0.566 ms on 2 warps against 0.697 on 4 (session 57).
# one_level: ``one_level_span``'s bound (None: by the log-cumsums' dtype; 0: levels always); hdla_bwd_one_warps:
# ``hdla_products_bwd``'s two launches in one product and then by levels where flagged (sm_90: 139 registers on 4
# warps, 244 on 2, no spills; H100 HDLA: 0.809 ms on 4 warps, 0.678 on 2, against 1.138 by levels alone, and 0.717
# with the flagged levels' launch on 4, which nearly all its programs leave at once; BENCHMARKS.md session 48).
# Levels alone keep hdla_bwd_warps. hdla_stacked: ``hdla_products``' blocks in one product as two stacked products
# (``_hdla_one_stacked``; H100 HDLA forward 1.29-1.32 -> 1.16-1.19 ms, BENCHMARKS.md session 49); 0: six
# (``_hdla_diag_one``). Stacking the backward's twelve into four was slower (0.68 -> 0.72-0.75 ms) and is not kept.
_CHANNEL = dict(rows=16, bk=None, warps=None, bwd_bk=None, bwd_warps=None, log_cumsum=None, hdla_bwd_bk=64,
                hdla_bwd_warps=4, hdla_pairs=1, hdla_bwd_pairs=0, dual_bwd_bk=None, dual_bwd_warps=2,
                pair_bwd_warps=2, one_level=None, hdla_bwd_one_warps=2, hdla_stacked=1, hdla_maxnreg=0,
                hdla_bwd_maxnreg=None, maxnreg=None)
# maxnreg, hdla_maxnreg, hdla_bwd_maxnreg: a register cap (Triton's maxnreg) for the per-channel products' kernel,
# HDLA's or HDLA's backward's, 0 none; None: the caller's (``channel_product``'s maxnreg) or ``hdla_products_bwd``'s
# the launch knobs left None, by tokens per chunk (H100, bf16, K = 128; BENCHMARKS.md session 21): 64-token
# chunks (ranks <= 1: GLA) ran their products' forward 0.36 -> 0.31 ms on 2 warps instead of 4; 32-token chunks
# (HDLA's rank 2) their backward 3.88 -> 3.35 ms on 2 warps, and kept 4 in the forward
# (HDLA's at 16 tokens, session 43: its products' forward 0.66 -> 0.54 ms on 2 warps, 1.12 on 8)
_LAUNCH = {64: dict(bk=64, warps=2, bwd_bk=32, bwd_warps=4), 16: dict(bk=64, warps=2, bwd_bk=32, bwd_warps=2)}
_LAUNCH_ELSE = dict(bk=64, warps=4, bwd_bk=32, bwd_warps=2)


def one_level_span(gc_dtype: torch.dtype) -> float:
    """The bound on |G_t - G_ref| (log-cumsums against the token before a diagonal block) under which
    ``_hdla_products_kernel``, ``_channel_product_kernel`` (KDA's and GLA's products) and their backward kernels
    (``channel_product_bwd``'s for a pair of products only, unless forced) take the block in one product through
    that token rather than by levels (``_one_level_span``).

    60 where the log-cumsums are fp32 (the products rounded to bf16 or TF32 anyway): every factor then lies in
    [e^-60, e^60], far inside fp32's and bf16's normal range, and each product keeps its operands' relative
    rounding. 0 (levels always) for fp64 log-cumsums (fp32 accuracy), where the levels' smaller exponents keep the
    decays' error lower. A chunk with stronger decays (log-gates of -4 per step over 16 tokens) takes the levels.
    ``_CHANNEL["one_level"]`` overrides it (0: levels always)."""
    forced = _CHANNEL["one_level"]
    if forced is not None:
        return float(forced)
    return 60.0 if gc_dtype == torch.float32 else 0.0


def _launch_one_level(kernel, grid, args, kw: dict, one: float, flags_shape, device, one_kw: dict | None = None,
                      flags=None):
    """Launches one of the per-channel products' kernels: where ``one`` (``one_level_span``'s bound) > 0, in one
    product where the decays allow (MODE 1, flagging the rest in an int32 tensor of ``flags_shape``) and then by
    levels for what it flagged (MODE 2), with ``one_kw`` over ``kw``; else by levels alone (MODE 0). ``flags``
    (of ``flags_shape``, set by another kernel): MODE 2 alone, for what it flags."""
    if flags is not None:
        kernel[grid](*args, ONE=one, MODE=2, flags=flags, **{**kw, **(one_kw or {})})
    elif one > 0:
        flags = torch.empty(flags_shape, device=device, dtype=torch.int32)
        for mode in (1, 2):
            kernel[grid](*args, ONE=one, MODE=mode, flags=flags, **{**kw, **(one_kw or {})})
    else:
        kernel[grid](*args, **kw)


def _knob(name: str, TC: int) -> int:
    """A launch knob: ``_CHANNEL``'s where set, else ``_LAUNCH``'s for this chunk size."""
    return _CHANNEL[name] if _CHANNEL[name] is not None else _LAUNCH.get(TC, _LAUNCH_ELSE)[name]


@triton.jit
def _gc_at(gc, tok, ok, o_k, m_k, KG: tl.constexpr):
    """[rows, BK] chunk-local log-cumsums G (in gc's dtype) at the chunk's tokens tok where ok, else 0.
    gc: this chunk's [C, KG] slice of ``chunk_log_cumsum``'s output."""
    return tl.load(gc + tok[:, None] * KG + o_k[None, :], mask=ok[:, None] & m_k[None, :], other=0.0)


@triton.jit
def _gc_row(gc, tok, o_k, m_k, KG: tl.constexpr):
    """[1, BK] the chunk-local log-cumsums at one token tok (gc: the chunk's [C, KG] slice), 0 where tok < 0 (before
    the chunk's first token)."""
    return tl.load(gc + tok * KG + o_k, mask=m_k & (o_k * 0 + tok >= 0), other=0.0)[None, :]


@triton.jit
def _span_block(gc, tok, ref, o_k, m_k, KG: tl.constexpr):
    """max |G_t - G_ref| over tokens tok and key channels o_k, as fp32 (``_one_level_span``'s, one key block)."""
    return tl.max(tl.abs((_gc_at(gc, tok, tok >= 0, o_k, m_k, KG) - _gc_row(gc, ref, o_k, m_k, KG)).to(tl.float32)))


@triton.jit
def _one_level_span(gc, tok, ref, K: tl.constexpr, BK: tl.constexpr, KG: tl.constexpr):
    """max |G_t - G_ref| over a diagonal block's tokens tok and every key channel, as fp32: where it is at most
    ``one_level_span``'s bound, the block's products can go through the token ref before it in one step,
    x ⊙ e^{G^x - G_ref} against y ⊙ e^{G_ref - G^y}, every factor within e^{±bound} (fp32's and bf16's range is
    e^{±87}); else by levels, whose factors never exceed 1."""
    for k0 in tl.static_range(0, K, BK):
        o_k = k0 + tl.arange(0, BK)
        d = _span_block(gc, tok, ref, o_k, o_k < K, KG)
        if k0 == 0:
            span = d
        else:
            span = tl.maximum(span, d)
    return span


@triton.jit
def _level_x(gc, tok, o_k, m_k, KG: tl.constexpr, S: tl.constexpr, STRICT: tl.constexpr):
    """Decays of the row side at one level of the per-channel products (blocks of S tokens):
    exp of the gates from the block's midpoint (token S/2 - 1) to each row of the block's second
    half, up to the row's token (STRICT: strictly before it), and 0 on the first half's rows."""
    HS: tl.constexpr = S // 2
    sel = (tok % S) >= HS
    mid = tok - tok % S + HS - 1
    if STRICT:  # the gates over (mid, tok)
        ex = _gc_at(gc, tok - 1, sel, o_k, m_k, KG) - _gc_at(gc, mid, sel, o_k, m_k, KG)
    else:       # over (mid, tok]
        ex = _gc_at(gc, tok, sel, o_k, m_k, KG) - _gc_at(gc, mid, sel, o_k, m_k, KG)
    return tl.where(sel[:, None], tl.exp(ex.to(tl.float32)), 0.0)


@triton.jit
def _level_y(gc, tok, o_k, m_k, KG: tl.constexpr, S: tl.constexpr):
    """Decays of the column side at one level: exp of the gates after each row's token up to the
    midpoint, on the block's first half (0 on its second half)."""
    HS: tl.constexpr = S // 2
    sel = (tok % S) < HS
    mid = tok - tok % S + HS - 1
    ey = _gc_at(gc, mid, sel, o_k, m_k, KG) - _gc_at(gc, tok, sel, o_k, m_k, KG)  # the gates over (tok, mid]
    return tl.where(sel[:, None], tl.exp(ey.to(tl.float32)), 0.0)


@triton.jit
def _same_block(tokx, toky, S: tl.constexpr):
    return (tokx // S)[:, None] == (toky // S)[None, :]


@triton.jit
def _level_product(X, Y, gc, tokx, toky, o_k, m_k, KG: tl.constexpr, S: tl.constexpr, STRICT: tl.constexpr,
                   PRECISION: tl.constexpr):
    """One level of the per-channel products: in blocks of S tokens, the rows of each block's
    second half against the columns of its first half, through the token at S/2 - 1."""
    Xs = X * _level_x(gc, tokx, o_k, m_k, KG, S, STRICT)
    Ys = Y * _level_y(gc, toky, o_k, m_k, KG, S)
    return tl.where(_same_block(tokx, toky, S), _dot(Xs, tl.trans(Ys), PRECISION), 0.0)


@triton.jit
def _shared_cumsums(gc, tok, o_k, m_k, KG: tl.constexpr, STRICT: tl.constexpr):
    """(Gx, Gy) for ``_level_decays``, rows that are x's and y's alike: G_{tok-1} (STRICT) or G_tok, and G_tok."""
    Gy = _gc_at(gc, tok, tok >= 0, o_k, m_k, KG)
    if STRICT:
        Gx = _x_exponent(gc, tok, o_k, m_k, KG, STRICT)
    else:
        Gx = Gy
    return Gx, Gy


@triton.jit
def _level_decays(Gx, Gy, gc, tok, o_k, m_k, KG: tl.constexpr, S: tl.constexpr):
    """``_level_x`` and ``_level_y`` where x's and y's rows are the same tokens tok, with their
    log-cumsums Gx (G_tok, or G_{tok-1} when strict) and Gy (G_tok) at hand: a row is on x's side
    (second half of its block) or on y's (first half), never both, so one exp serves the two and
    only the midpoint's log-cumsums are gathered (H100, GLA's products: 0.445 -> 0.364 ms)."""
    HS: tl.constexpr = S // 2
    sel = ((tok % S) >= HS)[:, None]
    Gm = _gc_at(gc, tok - tok % S + HS - 1, tok >= 0, o_k, m_k, KG)
    E = tl.exp(tl.where(sel, Gx - Gm, Gm - Gy).to(tl.float32))  # both <= 0
    return tl.where(sel, E, 0.0), tl.where(sel, 0.0, E)


@triton.jit
def _level_product_shared(X, Y, Gx, Gy, gc, tok, o_k, m_k, KG: tl.constexpr, S: tl.constexpr,
                          PRECISION: tl.constexpr):
    """``_level_product`` with x's and y's rows the same tokens (``_level_decays``)."""
    lx, ly = _level_decays(Gx, Gy, gc, tok, o_k, m_k, KG, S)
    return tl.where(_same_block(tok, tok, S), _dot(X * lx, tl.trans(Y * ly), PRECISION), 0.0)


@triton.jit
def _level_pair_shared(X, X2, Y, Gx, Gy, gc, tok, o_k, m_k, KG: tl.constexpr, S: tl.constexpr,
                       PRECISION: tl.constexpr):
    """``_level_product_shared`` for two row sets X and X2 of the same tokens and exponent against one Y: the
    decays and Y's scaled rows taken once for both products."""
    lx, ly = _level_decays(Gx, Gy, gc, tok, o_k, m_k, KG, S)
    Yl = tl.trans(Y * ly)
    same = _same_block(tok, tok, S)
    return (tl.where(same, _dot(X * lx, Yl, PRECISION), 0.0), tl.where(same, _dot(X2 * lx, Yl, PRECISION), 0.0))


@triton.jit
def _store_product_dia(p, p2, dia, sc_y, scale, c, o_x, o_y, i_r, NX: tl.constexpr, NY: tl.constexpr,
                       XR: tl.constexpr, YR: tl.constexpr, NB: tl.constexpr, YSC: tl.constexpr, DUAL: tl.constexpr):
    """The diagonal block ``dia`` [XR, YR] of a row block in its own columns and zeros after it (the earlier columns
    are ``_store_product_off``'s): P times scale into p, ⊙ sc_y (y's factors [NY], YSC) as ``_channel_product_kernel``
    describes; DUAL: P times scale into p and P ⊙ sc_y times scale into p2."""
    blk = (tl.arange(0, NB) == i_r).to(tl.float32)
    out = tl.reshape(dia[:, None, :] * blk[None, :, None], [XR, NY]) * scale
    rows = (c * NX + o_x[:, None]) * NY + o_y[None, :]
    later = (o_y >= i_r * YR)[None, :]
    if YSC:
        if DUAL:
            tl.store(p + rows, out, mask=later)
            p = p2
        out = out * sc_y[None, :]
    tl.store(p + rows, out, mask=later)


@triton.jit
def _store_product_off(p, p2, blk, sc_j, scale, c, o_x, o_j, NX: tl.constexpr, NY: tl.constexpr, YSC: tl.constexpr,
                       DUAL: tl.constexpr):
    """One earlier block of y's columns o_j (``_store_product_dia``'s layout and factors; sc_j: y's factors there)."""
    rows = (c * NX + o_x[:, None]) * NY + o_j[None, :]
    blk = blk * scale
    if YSC:
        if DUAL:
            tl.store(p + rows, blk)
            p = p2
        blk = blk * sc_j[None, :]
    tl.store(p + rows, blk)


@triton.jit
def _input_dot(X, Y, x, y, LP: tl.constexpr, PRECISION: tl.constexpr):
    """X Yᵀ of rows loaded (as fp32) from the inputs x and y: with LP (both 16-bit) in their own
    dtype, which is exact (16-bit products fit the fp32 accumulator), else at PRECISION."""
    if LP:
        return tl.dot(X.to(x.dtype.element_ty), tl.trans(Y.to(y.dtype.element_ty)))
    else:
        return _dot(X, tl.trans(Y), PRECISION)


@triton.jit
def _tok_rows(o_r, i_b, i_h, n, T, H: tl.constexpr, TC: tl.constexpr, R: tl.constexpr, RP: tl.constexpr):
    """Rows o_r of chunk n of a [B, T, H, R, D] tensor: token in chunk, valid, flat row (``_chunk_rows``)."""
    tok, _, _, valid, flat = _chunk_rows(o_r, i_b, i_h, n, T, H, TC, R, RP)
    return tok, valid, flat


@triton.jit
def _x_exponent(gc, tok, o_k, m_k, KG: tl.constexpr, STRICT: tl.constexpr):
    """G^x [rows, BK]: G_{tok-1} (STRICT; 0 at the chunk's first token) or G_tok."""
    if STRICT:
        return _gc_at(gc, tok - 1, tok > 0, o_k, m_k, KG)
    else:
        return _gc_at(gc, tok, tok >= 0, o_k, m_k, KG)


@triton.jit
def _channel_diag_one(x, y, x2, gc, fx, vx, fd, vd, tokx, tokd, ref, K: tl.constexpr, KG: tl.constexpr,
                      BK: tl.constexpr, XR: tl.constexpr, YR: tl.constexpr, STRICT: tl.constexpr,
                      XSTRICT: tl.constexpr, PAIR: tl.constexpr, PRECISION: tl.constexpr):
    """``_channel_product_kernel``'s diagonal block in one product through the token ref before it (where
    ``_one_level_span`` allows it): x ⊙ e^{G^x - G_ref} against y ⊙ e^{G_ref - G_tok}, causally masked, a token
    against itself included unless STRICT; PAIR: x2's too, through G_t, strictly. Returns (P, P2)."""
    dia = tl.zeros([XR, YR], dtype=tl.float32)
    dia2 = tl.zeros([XR, YR], dtype=tl.float32)
    for k0 in tl.static_range(0, K, BK):
        o_k = k0 + tl.arange(0, BK)
        m_k = o_k < K
        Gr = _gc_row(gc, ref, o_k, m_k, KG)
        Ex = tl.exp((_x_exponent(gc, tokx, o_k, m_k, KG, XSTRICT) - Gr).to(tl.float32))
        Ys = tl.trans(_load_rows(y, fd, vd, o_k, m_k, K)
                      * tl.exp((Gr - _gc_at(gc, tokd, tokd >= 0, o_k, m_k, KG)).to(tl.float32)))
        dia += _dot(_load_rows(x, fx, vx, o_k, m_k, K) * Ex, Ys, PRECISION)
        if PAIR:  # (x's exponent is G_t here too: PAIR is not STRICT)
            dia2 += _dot(_load_rows(x2, fx, vx, o_k, m_k, K) * Ex, Ys, PRECISION)
    if STRICT:
        dia = tl.where(tokx[:, None] > tokd[None, :], dia, 0.0)
    else:
        dia = tl.where(tokx[:, None] >= tokd[None, :], dia, 0.0)
    return dia, tl.where(tokx[:, None] > tokd[None, :], dia2, 0.0)


@triton.jit
def _channel_product_kernel(
    x, y, gc, sy, p, p2, x2, p3, p4, scale, T, NC,
    H: tl.constexpr, K: tl.constexpr, KG: tl.constexpr, TC: tl.constexpr, TB: tl.constexpr,
    RX: tl.constexpr, RXP: tl.constexpr, RY: tl.constexpr, RYP: tl.constexpr, STRICT: tl.constexpr,
    BK: tl.constexpr, PRECISION: tl.constexpr, LP: tl.constexpr, YSC: tl.constexpr, KP: tl.constexpr,
    DUAL: tl.constexpr, XSTRICT: tl.constexpr, PAIR: tl.constexpr, ONE: tl.constexpr = 0.0, MODE: tl.constexpr = 0,
    flags=None,
):
    # x [B, T, H, RX, K], y [B, T, H, RY, K] as given; gc [B, H, NC, TC, K] (fp64 or fp32); sy [B, T, H, RY]
    # factors of y's rows (YSC); p [B, H, NC, TC*RXP, TC*RYP]: P ⊙ sy (columns) times scale. DUAL (with YSC):
    # p takes P times scale and p2 (p's shape) P ⊙ sy times scale, from one product. XSTRICT: x's exponent is
    # G_{t-1} (STRICT, as a rule), else G_t (STRICT alone masks a token against itself: ``channel_product``'s x_at_t).
    # PAIR (not STRICT, RXP == RYP): also x2's rows (x's shape) against y, strict, through G_t, without scale, into
    # p3 (and p4 as p2, DUAL): the decays, y's rows and their exps shared by both products.
    # Off the diagonal, x's side is scaled once over all of K (KP = pow2 >= K), then meets y's earlier
    # sub-blocks one at a time: half the exps and loads of one product against every y row with the
    # later ones masked (H100: GLA 0.75 -> 0.44 ms; BENCHMARKS.md session 20).
    # MODE 1 / 2 (ONE > 0): the diagonal block in one product where ``_one_level_span`` allows it, else flagged and
    # taken by levels in a second launch (MODE 2), as ``_hdla_products_kernel``'s; MODE 0: levels.
    i_r, i_c, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_h = i_bh // H, i_bh % H
    c = i_bh * NC + i_c
    NX: tl.constexpr = TC * RXP
    NY: tl.constexpr = TC * RYP
    XR: tl.constexpr = TB * RXP
    YR: tl.constexpr = TB * RYP
    NB: tl.constexpr = TC // TB
    LEVELS: tl.constexpr = TB.bit_length() - 1
    g = gc + c * TC * KG
    o_x = i_r * XR + tl.arange(0, XR)  # x's rows in this block
    tokx, vx, fx = _tok_rows(o_x, i_b, i_h, i_c, T, H, TC, RX, RXP)
    o_y = tl.arange(0, NY)  # every y row: the row block's columns
    toky, vy, fy = _tok_rows(o_y, i_b, i_h, i_c, T, H, TC, RY, RYP)
    o_d = i_r * YR + tl.arange(0, YR)  # y's rows in this block (the diagonal block's columns)
    tokd, vd, fd = _tok_rows(o_d, i_b, i_h, i_c, T, H, TC, RY, RYP)
    ref = i_r * TB - 1  # the token before the block (-1: the chunk's start, where G = 0)
    run = True
    if MODE == 1:  # in one product where the decays allow, else flagged for MODE 2
        run = _one_level_span(g, i_r * TB + tl.arange(0, TB), ref, K, BK, KG) <= ONE
        tl.store(flags + c * NB + i_r, tl.where(run, 0, 1))
    elif MODE == 2:  # the flagged blocks by levels; nothing else
        run = tl.load(flags + c * NB + i_r) != 0
    if run:
        if MODE == 1:
            dia, dia2 = _channel_diag_one(x, y, x2, g, fx, vx, fd, vd, tokx, tokd, ref, K, KG, BK, XR, YR, STRICT,
                                          XSTRICT, PAIR, PRECISION)
        else:
            if not STRICT:
                same_tok = tokx[:, None] == tokd[None, :]
            dia = tl.zeros([XR, YR], dtype=tl.float32)
            dia2 = tl.zeros([XR, YR], dtype=tl.float32)  # PAIR's
            for k0 in tl.static_range(0, K, BK):
                o_k = k0 + tl.arange(0, BK)
                m_k = o_k < K
                X = _load_rows(x, fx, vx, o_k, m_k, K)
                Yd = _load_rows(y, fd, vd, o_k, m_k, K)
                if not STRICT:  # a token against itself: no decay
                    dia += tl.where(same_tok, _input_dot(X, Yd, x, y, LP, PRECISION), 0.0)
                if RXP == RYP:  # x's and y's rows are the same tokens: their halves at each level share one exp
                    Gx, Gy = _shared_cumsums(g, tokx, o_k, m_k, KG, XSTRICT)
                    if PAIR:
                        X2 = _load_rows(x2, fx, vx, o_k, m_k, K)
                        for lvl in tl.static_range(LEVELS):
                            d1, d2 = _level_pair_shared(X, X2, Yd, Gx, Gy, g, tokx, o_k, m_k, KG, TB >> lvl,
                                                        PRECISION)
                            dia += d1
                            dia2 += d2
                    else:
                        for lvl in tl.static_range(LEVELS):
                            dia += _level_product_shared(X, Yd, Gx, Gy, g, tokx, o_k, m_k, KG, TB >> lvl,
                                                         PRECISION)
                else:
                    for lvl in tl.static_range(LEVELS):
                        dia += _level_product(X, Yd, g, tokx, tokd, o_k, m_k, KG, TB >> lvl, XSTRICT, PRECISION)
        if YSC:
            sc_y = tl.load(sy + fy, mask=vy, other=0.0).to(tl.float32)
        else:
            sc_y = tl.zeros([NY], dtype=tl.float32)  # unused
        _store_product_dia(p, p2, dia, sc_y, scale, c, o_x, o_y, i_r, NX, NY, XR, YR, NB, YSC, DUAL)
        if PAIR:
            _store_product_dia(p3, p4, dia2, sc_y, 1.0, c, o_x, o_y, i_r, NX, NY, XR, YR, NB, YSC, DUAL)
    if (i_r > 0) & (MODE < 2):  # each earlier block of y, through the token just before this row block (ref)
        o_kf = tl.arange(0, KP)
        m_kf = o_kf < K
        Gr = tl.load(g + ref * KG + o_kf, mask=m_kf, other=0.0)
        Ex = tl.exp((_x_exponent(g, tokx, o_kf, m_kf, KG, XSTRICT) - Gr[None, :]).to(tl.float32))
        Xs = _load_rows(x, fx, vx, o_kf, m_kf, K) * Ex
        if PAIR:
            X2s = _load_rows(x2, fx, vx, o_kf, m_kf, K) * Ex
        for j in range(0, i_r):
            o_j = j * YR + tl.arange(0, YR)
            tokj, vj, fj = _tok_rows(o_j, i_b, i_h, i_c, T, H, TC, RY, RYP)
            Ys = _load_rows(y, fj, vj, o_kf, m_kf, K) * tl.exp(
                (Gr[None, :] - _gc_at(g, tokj, tokj >= 0, o_kf, m_kf, KG)).to(tl.float32))
            if YSC:
                sc_j = tl.load(sy + fj, mask=vj, other=0.0).to(tl.float32)
            else:
                sc_j = tl.zeros([YR], dtype=tl.float32)  # unused
            _store_product_off(p, p2, _dot(Xs, tl.trans(Ys), PRECISION), sc_j, scale, c, o_x, o_j, NX, NY, YSC,
                               DUAL)
            if PAIR:
                _store_product_off(p3, p4, _dot(X2s, tl.trans(Ys), PRECISION), sc_j, 1.0, c, o_x, o_j, NX, NY,
                                   YSC, DUAL)


def _sub_block(TC: int, rx: int, ry: int) -> int:
    """Tokens per sub-block: ``_CHANNEL["rows"]`` rows on the side of the smaller padded rank."""
    return min(TC, max(1, _CHANNEL["rows"] // min(_pow2(rx), _pow2(ry))))


def channel_product(x, y, gc, out, T: int, TC: int, strict: bool, precision: str, lowp: bool,
                    scale: float = 1.0, y_scale=None, out_scaled=None, x_at_t: bool = False, x2=None, out2=None,
                    out2_scaled=None, maxnreg: int = 0) -> torch.Tensor:
    """Writes P ⊙ y_scale (columns) times ``scale`` into ``out`` [B, H, NC, TC*Rxp, TC*Ryp] (any float dtype).
    ``maxnreg``: a register cap for the kernel's launches (0 none; ``_CHANNEL["maxnreg"]`` where set overrides it).

    x [B, T, H, Rx, K], y [B, T, H, Ry, K] (contiguous, as given; [B, T, H, K]: rank 1); gc [B, H, NC, TC, K]
    (``chunk_log_cumsum``); y_scale [B, T, H, Ry] fp32 or None; lowp: x and y are 16-bit of one
    dtype (a token against itself is then taken in that dtype, exactly). ``out_scaled`` (out's shape, with
    y_scale): ``out`` then takes P times ``scale`` and ``out_scaled`` P ⊙ y_scale times ``scale``, both from one
    product (the products of a row set with y and with y's scaled rows, as a = k with a_scale: ``kda``).
    ``x_at_t`` (with ``strict``): x's rows decay through G_t rather than G_{t-1}, a token still not against itself:
    KDA's L_BK with b = e^g ⊙ k is this product of k with itself, since b_t e^{G_{t-1}} = k_t e^{G_t}.
    ``x2`` (x's shape; with ``strict`` False and x and y of one rank): in the same kernel, x2's product with y as
    ``x_at_t`` takes it (strict, through G_t), without ``scale``, into ``out2`` (out's shape; with ``out_scaled``,
    ``out2_scaled`` as well): the decays and y's rows are shared (KDA's M_QK and L_BK, x = q and x2 = k)."""
    x, y = (z.unsqueeze(-2) if z.dim() == 4 else z for z in (x, y))  # q: rank 1
    B, _, H, RX, K = x.shape
    RY = y.shape[-2]
    NC = gc.shape[2]
    TB = _sub_block(TC, RX, RY)
    BK = min(_knob("bk", TC), max(16, _pow2(K)))
    if out_scaled is not None and (y_scale is None or out_scaled.shape != out.shape):
        raise ValueError("out_scaled takes y_scale and out's shape")
    if x2 is not None:
        x2 = x2.unsqueeze(-2) if x2.dim() == 4 else x2
        if (strict or _pow2(RX) != _pow2(RY) or x2.shape != x.shape or out2 is None or out2.shape != out.shape
                or (out2_scaled is None) != (out_scaled is None)):
            raise ValueError("x2 takes x's shape, strict=False, x and y of one rank, out2 of out's shape, and "
                             "out2_scaled with out_scaled")
    grid = (TC // TB, NC, B * H)
    args = (x, y, gc, out if y_scale is None else y_scale, out, out if out_scaled is None else out_scaled,
            x if x2 is None else x2, out if out2 is None else out2, out if out2_scaled is None else out2_scaled, scale,
            T, NC)
    kw = dict(H=H, K=K, KG=gc.shape[-1], TC=TC, TB=TB, RX=RX, RXP=_pow2(RX), RY=RY, RYP=_pow2(RY), STRICT=strict,
              BK=BK, PRECISION=precision, LP=lowp, YSC=y_scale is not None, KP=_pow2(K),
              DUAL=out_scaled is not None, XSTRICT=strict and not x_at_t, PAIR=x2 is not None,
              num_warps=_knob("warps", TC), num_stages=1,
              **_maxnreg(maxnreg if _CHANNEL["maxnreg"] is None else _CHANNEL["maxnreg"]))
    _launch_one_level(_channel_product_kernel, grid, args, kw, one_level_span(gc.dtype), (B, H, NC, TC // TB),
                      x.device)
    return out


@triton.jit
def _hdla_store(P1, P2, P3, P4, P5, P6, be, mqk, mqa, lba, lbk, c, tokx, toky, scale, TC: tl.constexpr,
                SCALED: tl.constexpr = False):
    """One (row block, column block) of HDLA's four products from its six token products (``_hdla_products_kernel``;
    be: the column tokens' β): M_QK = P1, M_QA = [β P1, P2], L_BK = [P3; P5], L_BA = [[β P3, P4], [β P5, P6]],
    rows and columns (token, rank) token major; M_QK and M_QA times ``scale``. SCALED (the forward's scaled form,
    whose update rows are [k, a2]): M_QA = [P1, P2] and L_BA = [[P3, P4], [P5, P6]] alone, without β."""
    i = tokx[:, None]
    j = toky[None, :]
    bj = be[None, :]
    if SCALED:
        bj = tl.full([1, 1], 1.0, tl.float32)
    else:
        tl.store(mqk + (c * TC + i) * TC + j, P1 * scale)
        row = lbk + (c * 2 * TC + 2 * i) * TC + j
        tl.store(row, P3)
        tl.store(row + TC, P5)
    row = mqa + (c * TC + i) * (2 * TC) + 2 * j
    tl.store(row, bj * P1 * scale)
    tl.store(row + 1, P2 * scale)
    row = lba + (c * 2 * TC + 2 * i) * (2 * TC) + 2 * j
    tl.store(row, bj * P3)
    tl.store(row + 1, P4)
    tl.store(row + 2 * TC, bj * P5)
    tl.store(row + 2 * TC + 1, P6)


@triton.jit
def _hdla_level_decays(G0, G1, gc, tok, o_k, m_k, KG: tl.constexpr, S: tl.constexpr):
    """The decays of one level of HDLA's diagonal block (blocks of S tokens, through the token at S/2 - 1; G0, G1:
    the rows' G_t and G_{t-1}): (x0, x1) on the second half's rows, through G_t and G_{t-1}, and y0 on the first
    half's, each 0 on the other half. One exp serves x0 and y0, a row being on one side only."""
    HS: tl.constexpr = S // 2
    sel = ((tok % S) >= HS)[:, None]
    Gm = _gc_at(gc, tok - tok % S + HS - 1, tok >= 0, o_k, m_k, KG)
    E0 = tl.exp(tl.where(sel, G0 - Gm, Gm - G0).to(tl.float32))  # both <= 0
    x0 = tl.where(sel, E0, 0.0)
    x1 = tl.where(sel, tl.exp(tl.where(sel, G1 - Gm, 0.0).to(tl.float32)), 0.0)
    return x0, x1, tl.where(sel, 0.0, E0)


@triton.jit
def _hdla_six(Q, Kr, A2, x0, x1, y0, PRECISION: tl.constexpr):
    """HDLA's six token products with their decays on the rows' side (x0: q and b1 = λ ⊙ k through G_t; x1: b2 = k
    through G_{t-1}) and the columns' (y0: k and a2): (q, k), (q, a2), (b1, k), (b1, a2), (b2, k), (b2, a2)."""
    Qx = Q * x0
    B1 = Kr * x0  # b1 ⊙ e^{G_{t-1}} = k ⊙ e^{G_t}
    B2 = Kr * x1
    Ky = tl.trans(Kr * y0)
    Ay = tl.trans(A2 * y0)
    return (_dot(Qx, Ky, PRECISION), _dot(Qx, Ay, PRECISION), _dot(B1, Ky, PRECISION), _dot(B1, Ay, PRECISION),
            _dot(B2, Ky, PRECISION), _dot(B2, Ay, PRECISION))


@triton.jit
def _hdla_level(Q, Kr, A2, G0, G1, gc, tok, o_k, m_k, KG: tl.constexpr, S: tl.constexpr, PRECISION: tl.constexpr):
    """One level of ``_hdla_products_kernel``'s diagonal block: in blocks of S tokens, the second half's rows (x:
    q and b1 through G_t, b2 through G_{t-1}) against the first half's (y: k and a2), through the token at S/2 - 1
    (G0, G1: the rows' G_t and G_{t-1}). Returns the six products' shares."""
    x0, x1, y0 = _hdla_level_decays(G0, G1, gc, tok, o_k, m_k, KG, S)
    P1, P2, P3, P4, P5, P6 = _hdla_six(Q, Kr, A2, x0, x1, y0, PRECISION)
    same = _same_block(tok, tok, S)
    return (tl.where(same, P1, 0.0), tl.where(same, P2, 0.0), tl.where(same, P3, 0.0), tl.where(same, P4, 0.0),
            tl.where(same, P5, 0.0), tl.where(same, P6, 0.0))


@triton.jit
def hdla_c(cp, c, tok, ok, NKB: tl.constexpr, TC: tl.constexpr):
    """HDLA's c = kᵀ(λ ⊙ k) [rows] at chunk c's tokens tok where ok (else 0): the sum of the log-cumsum kernel's
    key-block shares (``chunk_fwd.chunk_log_cumsum``'s c_parts, cp [B, H, NC, NKB, TC])."""
    s = tl.load(cp + c * NKB * TC + tok, mask=ok, other=0.0)
    for j in tl.static_range(1, NKB):
        s += tl.load(cp + (c * NKB + j) * TC + tok, mask=ok, other=0.0)
    return s


@triton.jit
def hdla_a2(Kr, lam, be, cc):
    """HDLA's a2 = β (λ ⊙ k - β c k) = β k ⊙ (λ - β c) [rows, BK] from k's rows and λ (fp32; λ = e^{G_t - G_{t-1}}
    from the log-cumsums: the gate of the row's token), β and c per row."""
    return Kr * (be[:, None] * (lam - (be * cc)[:, None]))


@triton.jit
def _hdla_diag_one(q, k, a, g, be, cc, ref, tok, vx, fx, K: tl.constexpr, BK: tl.constexpr, TB: tl.constexpr,
                   PRECISION: tl.constexpr, FORM_A2: tl.constexpr):
    """``_hdla_products_kernel``'s six products on its diagonal block in one product each, through the token ref
    before the block: x ⊙ e^{G^x - G_ref} against y ⊙ e^{G_ref - G^y}, a token against itself included in M_QK and
    M_QA (where ``_one_level_span`` allows it)."""
    P1 = tl.zeros([TB, TB], dtype=tl.float32)
    P2 = tl.zeros([TB, TB], dtype=tl.float32)
    P3 = tl.zeros([TB, TB], dtype=tl.float32)
    P4 = tl.zeros([TB, TB], dtype=tl.float32)
    P5 = tl.zeros([TB, TB], dtype=tl.float32)
    P6 = tl.zeros([TB, TB], dtype=tl.float32)
    for k0 in tl.static_range(0, K, BK):
        o_k = k0 + tl.arange(0, BK)
        m_k = o_k < K
        Q = _load_rows(q, fx, vx, o_k, m_k, K)
        Kr = _load_rows(k, fx, vx, o_k, m_k, K)
        Gr = _gc_row(g, ref, o_k, m_k, K)
        G0 = _gc_at(g, tok, tok >= 0, o_k, m_k, K)
        G1 = _gc_at(g, tok - 1, tok > 0, o_k, m_k, K)
        if FORM_A2:
            A2 = hdla_a2(Kr, tl.exp((G0 - G1).to(tl.float32)), be, cc)
        else:
            A2 = _load_rows(a, 2 * fx + 1, vx, o_k, m_k, K)
        L1, L2, L3, L4, L5, L6 = _hdla_six(Q, Kr, A2, tl.exp((G0 - Gr).to(tl.float32)),
                                           tl.exp((G1 - Gr).to(tl.float32)), tl.exp((Gr - G0).to(tl.float32)),
                                           PRECISION)
        P1 += L1
        P2 += L2
        P3 += L3
        P4 += L4
        P5 += L5
        P6 += L6
    upto = tok[:, None] >= tok[None, :]
    before = tok[:, None] > tok[None, :]
    P1 = tl.where(upto, P1, 0.0)
    P2 = tl.where(upto, P2, 0.0)
    P3 = tl.where(before, P3, 0.0)
    P4 = tl.where(before, P4, 0.0)
    P5 = tl.where(before, P5, 0.0)
    P6 = tl.where(before, P6, 0.0)
    return P1, P2, P3, P4, P5, P6


@triton.jit
def _hdla_one_stacked(q, k, a, g, beta, cp, mqk, mqa, lba, lbk, c, ref, tq, vq, fq, i_b, i_h, i_c, i_r, scale, T,
                      H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, TB: tl.constexpr, TC: tl.constexpr,
                      NKB: tl.constexpr, PRECISION: tl.constexpr, FORM_A2: tl.constexpr, SCALED: tl.constexpr):
    """``_hdla_products_kernel``'s diagonal block in one product through the token ref before it, stored: what
    ``_hdla_diag_one`` and ``_hdla_store`` give, from two products instead of six. The rows b1 = λ ⊙ k (through
    G_{t-1}: k through G_t) and b2 = k (through G_{t-1}) are stacked token-major as L_BA's rows are, and so are the
    columns k and a2 (through G_s): one [2 TB, 2 TB] product is the block of L_BA (β on k's columns) and, on its even
    columns, L_BK's; q's [TB, 2 TB] product against the same columns is M_QA's (and on the even ones M_QK's).
    tq, vq, fq: the block's token rows (``_tok_rows``)."""
    r2 = i_r * 2 * TB + tl.arange(0, 2 * TB)  # (token, rank) rows of the chunk's 2 TC
    tp, rp, _, vp, fp = _chunk_rows(r2, i_b, i_h, i_c, T, H, TC, 2, 2)  # fp: a's flat row; fp // 2: k's, β's
    second = (rp == 1)[:, None]
    bep = tl.load(beta + fp // 2, mask=vp, other=0.0).to(tl.float32)
    if FORM_A2:
        ccp = hdla_c(cp, c, tp, vp, NKB, TC)
    Lb = tl.zeros([2 * TB, 2 * TB], dtype=tl.float32)
    Mq = tl.zeros([TB, 2 * TB], dtype=tl.float32)
    for k0 in tl.static_range(0, K, BK):
        o_k = k0 + tl.arange(0, BK)
        m_k = o_k < K
        Gr = _gc_row(g, ref, o_k, m_k, K)
        Kp = _load_rows(k, fp // 2, vp, o_k, m_k, K)  # each token's k on both its rows
        G0 = _gc_at(g, tp, tp >= 0, o_k, m_k, K)
        G1 = _gc_at(g, tp - 1, tp > 0, o_k, m_k, K)
        Xb = Kp * tl.exp((tl.where(second, G1, G0) - Gr).to(tl.float32))
        if FORM_A2:
            A2 = hdla_a2(Kp, tl.exp((G0 - G1).to(tl.float32)), bep, ccp)
        else:
            A2 = _load_rows(a, fp, vp & (rp == 1), o_k, m_k, K)
        Y = tl.trans(tl.where(second, A2, Kp) * tl.exp((Gr - G0).to(tl.float32)))
        Xq = _load_rows(q, fq, vq, o_k, m_k, K) * tl.exp((_gc_at(g, tq, tq >= 0, o_k, m_k, K) - Gr).to(tl.float32))
        Lb += _dot(Xb, Y, PRECISION)
        Mq += _dot(Xq, Y, PRECISION)
    Lb = tl.where(tp[:, None] > tp[None, :], Lb, 0.0)
    Mq = tl.where(tq[:, None] >= tp[None, :], Mq, 0.0)
    if SCALED:
        colf = tl.full([2 * TB], 1.0, tl.float32)
    else:
        colf = tl.where(rp == 0, bep, 1.0)  # a1 = β k: β on k's columns
    tl.store(lba + (c * 2 * TC + r2[:, None]) * (2 * TC) + r2[None, :], Lb * colf[None, :])
    tl.store(mqa + (c * TC + tq[:, None]) * (2 * TC) + r2[None, :], Mq * (colf * scale)[None, :])
    if not SCALED:
        even = (rp == 0)[None, :]
        tl.store(lbk + (c * 2 * TC + r2[:, None]) * TC + tp[None, :], Lb, mask=even)
        tl.store(mqk + (c * TC + tq[:, None]) * TC + tp[None, :], Mq * scale, mask=even)


@triton.jit
def _hdla_diag_levels(q, k, a, g, be, cc, bep, ccp, tok, vx, fx, odd, H: tl.constexpr, K: tl.constexpr,
                      BK: tl.constexpr, TB: tl.constexpr, PRECISION: tl.constexpr, PAIRS: tl.constexpr,
                      FORM_A2: tl.constexpr):
    """``_hdla_products_kernel``'s six products on its diagonal block by levels (``_hdla_level``), a token against
    itself and (PAIRS) adjacent tokens as row sums."""
    LEVELS: tl.constexpr = TB.bit_length() - 1
    P1 = tl.zeros([TB, TB], dtype=tl.float32)
    P2 = tl.zeros([TB, TB], dtype=tl.float32)
    P3 = tl.zeros([TB, TB], dtype=tl.float32)
    P4 = tl.zeros([TB, TB], dtype=tl.float32)
    P5 = tl.zeros([TB, TB], dtype=tl.float32)
    P6 = tl.zeros([TB, TB], dtype=tl.float32)
    d1 = tl.zeros([TB], dtype=tl.float32)  # a token against itself (M_QK, M_QA: j <= i)
    d2 = tl.zeros([TB], dtype=tl.float32)
    # PAIRS: the last level (S = 2: an odd token against the one before it) as row sums, through e^{G_t - G_{t-1}}
    e1 = tl.zeros([TB], dtype=tl.float32)
    e2 = tl.zeros([TB], dtype=tl.float32)
    e3 = tl.zeros([TB], dtype=tl.float32)
    e4 = tl.zeros([TB], dtype=tl.float32)
    e5 = tl.zeros([TB], dtype=tl.float32)
    e6 = tl.zeros([TB], dtype=tl.float32)
    for k0 in tl.static_range(0, K, BK):
        o_k = k0 + tl.arange(0, BK)
        m_k = o_k < K
        Q = _load_rows(q, fx, vx, o_k, m_k, K)
        Kr = _load_rows(k, fx, vx, o_k, m_k, K)
        G0 = _gc_at(g, tok, tok >= 0, o_k, m_k, K)
        G1 = _gc_at(g, tok - 1, tok > 0, o_k, m_k, K)
        if FORM_A2:
            lam = tl.exp((G0 - G1).to(tl.float32))  # λ_t, and the pairs' e^{G_t - G_{t-1}}
            A2 = hdla_a2(Kr, lam, be, cc)
        else:
            A2 = _load_rows(a, 2 * fx + 1, vx, o_k, m_k, K)
        d1 += tl.sum(Q * Kr, axis=1)
        d2 += tl.sum(Q * A2, axis=1)
        for lvl in tl.static_range(LEVELS - 1 if PAIRS else LEVELS):
            L1, L2, L3, L4, L5, L6 = _hdla_level(Q, Kr, A2, G0, G1, g, tok, o_k, m_k, K, TB >> lvl, PRECISION)
            P1 += L1
            P2 += L2
            P3 += L3
            P4 += L4
            P5 += L5
            P6 += L6
        if PAIRS:  # x_t against y_{t-1}: q and b1 through e^{G_t - G_{t-1}}, b2 as it is
            Kp = _load_rows(k, fx - H, odd, o_k, m_k, K)
            if FORM_A2:  # (λ on the even rows too: their Kp and Ap are 0)
                G2 = _gc_at(g, tok - 2, odd & (tok > 1), o_k, m_k, K)
                Ap = hdla_a2(Kp, tl.exp((G1 - G2).to(tl.float32)), bep, ccp)
                E = lam
            else:
                Ap = _load_rows(a, 2 * (fx - H) + 1, odd, o_k, m_k, K)
                E = tl.exp(tl.where(odd[:, None], G0 - G1, 0.0).to(tl.float32))
            Qx = Q * E
            B1 = Kr * E
            e1 += tl.sum(Qx * Kp, axis=1)
            e2 += tl.sum(Qx * Ap, axis=1)
            e3 += tl.sum(B1 * Kp, axis=1)
            e4 += tl.sum(B1 * Ap, axis=1)
            e5 += tl.sum(Kr * Kp, axis=1)
            e6 += tl.sum(Kr * Ap, axis=1)
    diag = tok[:, None] == tok[None, :]
    P1 += tl.where(diag, d1[:, None], 0.0)
    P2 += tl.where(diag, d2[:, None], 0.0)
    if PAIRS:
        sub = tok[:, None] - 1 == tok[None, :]  # the odd rows' only nonzero e
        P1 += tl.where(sub, e1[:, None], 0.0)
        P2 += tl.where(sub, e2[:, None], 0.0)
        P3 += tl.where(sub, e3[:, None], 0.0)
        P4 += tl.where(sub, e4[:, None], 0.0)
        P5 += tl.where(sub, e5[:, None], 0.0)
        P6 += tl.where(sub, e6[:, None], 0.0)
    return P1, P2, P3, P4, P5, P6


@triton.jit
def _hdla_products_kernel(q, k, a, gc, beta, mqk, mqa, lba, lbk, scale, T, NC,
                          H: tl.constexpr, K: tl.constexpr, TC: tl.constexpr, TB: tl.constexpr, BK: tl.constexpr,
                          KP: tl.constexpr, PRECISION: tl.constexpr, PAIRS: tl.constexpr = False,
                          SCALED: tl.constexpr = False, cp=None, NKB: tl.constexpr = 1, FORM_A2: tl.constexpr = False,
                          ONE: tl.constexpr = 0.0, MODE: tl.constexpr = 0, flags=None,
                          STACKED: tl.constexpr = True):
    # q, k [B, T, H, K]; a [B, T, H, 2, K] (HDLA's, row 1 read: a2); gc [B, H, NC, TC, K]; beta [B, T, H].
    # Six token products, x ∈ {q ⊙ e^{G_t}, b1 = k ⊙ e^{G_t}, b2 = k ⊙ e^{G_{t-1}}} against
    # y ∈ {k, a2} ⊙ e^{-G_s}, in sub-blocks of TB tokens as ``_channel_product_kernel`` takes them:
    # one exp serves q and b1, one b2, one both y's. a1 = β k, so the columns of a1 are β times those of k.
    # FORM_A2: a is not read; a2 is formed from k, the log-cumsums, β and c (``hdla_a2``; c from the log-cumsum
    # kernel's shares in cp: ``hdla_c``)
    # MODE 1 (ONE > 0: ``one_level_span``): where no log-cumsum of the diagonal block strays more than ONE from the one
    # at the token before it (``_one_level_span``), the block is one product through that token (``_hdla_one_stacked``,
    # or with STACKED False ``_hdla_diag_one``);
    # else flags [B, H, NC, NB] (int32) marks it, and a second launch with MODE 2 takes the flagged blocks by levels
    # and nothing else. MODE 0: levels for every block. (Two launches: one kernel with both forms spills ten times
    # as much on sm_90.)
    i_r, i_c, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_h = i_bh // H, i_bh % H
    c = i_bh * NC + i_c
    NB: tl.constexpr = TC // TB
    g = gc + c * TC * K
    tok, vx, fx = _tok_rows(i_r * TB + tl.arange(0, TB), i_b, i_h, i_c, T, H, TC, 1, 1)
    be = tl.load(beta + fx, mask=vx, other=0.0).to(tl.float32)
    odd = vx & (tok % 2 == 1)
    cc = be
    bep = be
    ccp = be
    if FORM_A2:
        cc = hdla_c(cp, c, tok, vx, NKB, TC)
        if PAIRS:  # the token before each odd row's: its β and c
            bep = tl.load(beta + fx - H, mask=odd, other=0.0).to(tl.float32)
            ccp = hdla_c(cp, c, tok - 1, odd, NKB, TC)
    ref = i_r * TB - 1  # the token before the block (-1: the chunk's start, where G = 0)
    if MODE == 1:  # in one product where the decays allow, else flagged for MODE 2
        fast = _one_level_span(g, tok, ref, K, BK, K) <= ONE
        tl.store(flags + c * NB + i_r, tl.where(fast, 0, 1))
        if fast and STACKED:
            _hdla_one_stacked(q, k, a, g, beta, cp, mqk, mqa, lba, lbk, c, ref, tok, vx, fx, i_b, i_h, i_c, i_r,
                              scale, T, H, K, BK, TB, TC, NKB, PRECISION, FORM_A2, SCALED)
        elif fast:
            P1, P2, P3, P4, P5, P6 = _hdla_diag_one(q, k, a, g, be, cc, ref, tok, vx, fx, K, BK, TB, PRECISION,
                                                    FORM_A2)
            _hdla_store(P1, P2, P3, P4, P5, P6, be, mqk, mqa, lba, lbk, c, tok, tok, scale, TC, SCALED)
    elif MODE == 2:  # the flagged blocks by levels; nothing else
        if tl.load(flags + c * NB + i_r) != 0:
            P1, P2, P3, P4, P5, P6 = _hdla_diag_levels(q, k, a, g, be, cc, bep, ccp, tok, vx, fx, odd, H, K, BK, TB,
                                                       PRECISION, PAIRS, FORM_A2)
            _hdla_store(P1, P2, P3, P4, P5, P6, be, mqk, mqa, lba, lbk, c, tok, tok, scale, TC, SCALED)
    else:
        P1, P2, P3, P4, P5, P6 = _hdla_diag_levels(q, k, a, g, be, cc, bep, ccp, tok, vx, fx, odd, H, K, BK, TB,
                                                   PRECISION, PAIRS, FORM_A2)
        _hdla_store(P1, P2, P3, P4, P5, P6, be, mqk, mqa, lba, lbk, c, tok, tok, scale, TC, SCALED)
    if MODE < 2 and NB > 1:  # the blocks after the diagonal (zeros) and before it (the same either way), if any
        zero = tl.zeros([TB, TB], dtype=tl.float32)
        for jb in range(i_r + 1, NB):  # the blocks after the diagonal: zeros
            tokj = jb * TB + tl.arange(0, TB)
            _hdla_store(zero, zero, zero, zero, zero, zero, be, mqk, mqa, lba, lbk, c, tok, tokj, scale, TC, SCALED)
        if i_r > 0:  # each earlier block of columns, through the token just before this row block (ref)
            o_f = tl.arange(0, KP)  # all of K at once
            m_f = o_f < K
            Gr = tl.load(g + ref * K + o_f, mask=m_f, other=0.0)[None, :]
            Ex = tl.exp((_gc_at(g, tok, tok >= 0, o_f, m_f, K) - Gr).to(tl.float32))
            Qf = _load_rows(q, fx, vx, o_f, m_f, K) * Ex
            Kf = _load_rows(k, fx, vx, o_f, m_f, K)
            B1f = Kf * Ex
            B2f = Kf * tl.exp((_gc_at(g, tok - 1, tok > 0, o_f, m_f, K) - Gr).to(tl.float32))
            for jb in range(0, i_r):
                tokj, vj, fj = _tok_rows(jb * TB + tl.arange(0, TB), i_b, i_h, i_c, T, H, TC, 1, 1)
                Gj = _gc_at(g, tokj, tokj >= 0, o_f, m_f, K)
                Ey = tl.exp((Gr - Gj).to(tl.float32))
                Kj = _load_rows(k, fj, vj, o_f, m_f, K)
                bej = tl.load(beta + fj, mask=vj, other=0.0).to(tl.float32)
                if FORM_A2:
                    Aj = hdla_a2(Kj, tl.exp((Gj - _gc_at(g, tokj - 1, tokj > 0, o_f, m_f, K)).to(tl.float32)), bej,
                                 hdla_c(cp, c, tokj, vj, NKB, TC))
                else:
                    Aj = _load_rows(a, 2 * fj + 1, vj, o_f, m_f, K)
                Ky = tl.trans(Kj * Ey)
                Ay = tl.trans(Aj * Ey)
                _hdla_store(_dot(Qf, Ky, PRECISION), _dot(Qf, Ay, PRECISION), _dot(B1f, Ky, PRECISION),
                            _dot(B1f, Ay, PRECISION), _dot(B2f, Ky, PRECISION), _dot(B2f, Ay, PRECISION),
                            bej, mqk, mqa, lba, lbk, c, tok, tokj, scale, TC, SCALED)


@triton.jit
def _hdla_row_products_kernel(qd, kg, ad, dch, flags, mqa, lba, NC, K: tl.constexpr, TC: tl.constexpr,
                              BK: tl.constexpr, PRECISION: tl.constexpr):
    # HDLA's scaled forward, a chunk one sub-block, not flagged: its products from the log-cumsum kernel's rows
    # through the chunk's start (``hdla_row_products``), with no exp of its own: X = B ⊙ e^{G_{i-1}} (kg) and
    # Q̃ (qd, scale included) against Y = Ã ⊙ e^{-G_C} = [k, a2] ⊙ e^{-G} (ad over e^{G_C}, dch)
    i_c, i_bh = tl.program_id(0), tl.program_id(1)
    c = i_bh * NC + i_c
    if tl.load(flags + c) == 0:
        NA: tl.constexpr = 2 * TC
        r2 = tl.arange(0, NA)
        rq = tl.arange(0, TC)
        Lb = tl.zeros([NA, NA], dtype=tl.float32)
        Mq = tl.zeros([TC, NA], dtype=tl.float32)
        for k0 in tl.static_range(0, K, BK):
            o_k = k0 + tl.arange(0, BK)
            m_k = (o_k < K)[None, :]
            X = tl.load(kg + (c * NA + r2[:, None]) * K + o_k[None, :], mask=m_k, other=0.0)
            Xq = tl.load(qd + (c * TC + rq[:, None]) * K + o_k[None, :], mask=m_k, other=0.0)
            Y = (tl.load(ad + (c * NA + r2[:, None]) * K + o_k[None, :], mask=m_k, other=0.0).to(tl.float32)
                 / tl.load(dch + c * K + o_k[None, :], mask=m_k, other=1.0))
            Y = tl.trans(Y)
            Lb += _dot(X, Y, PRECISION)
            Mq += _dot(Xq, Y, PRECISION)
        tl.store(lba + (c * NA + r2[:, None]) * NA + r2[None, :],
                 tl.where(r2[:, None] // 2 > r2[None, :] // 2, Lb, 0.0))
        tl.store(mqa + (c * TC + rq[:, None]) * NA + r2[None, :], tl.where(rq[:, None] >= r2[None, :] // 2, Mq, 0.0))


def hdla_row_products(qd, kg, ad, dch, flags, mqa, lba, TC: int, precision: str) -> None:
    """HDLA's scaled forward's M_QA and L_BA (``hdla_products``' with ``scaled``) for the chunks that ``flags``
    leaves at 0, from the rows the log-cumsum kernel stored (``chunk_fwd.chunk_log_cumsum``'s hdla_rows, with its
    flags): the chunk one sub-block (``hdla_one_block``), each product is one, through the chunk's start, of
    B ⊙ e^{G_{t-1}} (kg [B, H, NC, 2 TC, K]) and Q̃ = scale q ⊙ e^G (qd [.., TC, K]) against
    Ã ⊙ e^{-G_C} = [k, a2] ⊙ e^{-G} (ad [.., 2 TC, K] over dch = e^{G_C} [B, H, NC, K]). The flagged chunks'
    log-cumsums stray beyond ``row_span`` from 0 and are left to ``hdla_products``' levels (its flags); every factor
    here lies within e^{±2 row_span}. Needs no q, k, β, c or log-cumsums, and takes no exp."""
    B, H, NC, NA, K = kg.shape
    if not hdla_one_block(TC) or NA != 2 * TC:
        raise ValueError(f"hdla_row_products: a chunk of TC = {TC} tokens as one sub-block, kg of 2 TC rows (got {NA})")
    _hdla_row_products_kernel[(NC, B * H)](qd, kg, ad, dch, flags, mqa, lba, NC, K=K, TC=TC,
                                           BK=min(_knob("bk", TC), max(16, _pow2(K))),
                                           PRECISION=precision, num_warps=_knob("warps", TC), num_stages=1)


def row_span(gc_dtype: torch.dtype) -> float:
    """The bound on |G_t| (log-cumsums from the chunk's start) under which ``hdla_row_products`` takes a chunk: half
    ``one_level_span``'s, so that every difference of two of them, and e^{±G}, stays within e^{±one_level_span}
    whatever the gates' signs; 0 (off) where that is 0."""
    return one_level_span(gc_dtype) / 2


def hdla_one_block(TC: int) -> bool:
    """Whether a chunk of TC tokens is one of ``hdla_products``' sub-blocks (one program holds its whole L_BA)."""
    return _sub_block(TC, 1, 1) == TC


def hdla_products(q, k, a, gc, beta, mqk, mqa, lba, lbk, T: int, TC: int, precision: str, scale: float,
                  scaled: bool = False, c_parts=None, flags=None) -> None:
    """HDLA's four per-channel products in one kernel: what ``channel_product`` gives for M_QK = P(q, k),
    M_QA = P(q, a), L_BA = P(b, a) and L_BK = P(b, k) (strict) with a = [β k, a2] and b = [λ ⊙ k, k]
    (``triton.factors.hdla_factors``), written into mqk [B, H, NC, TC, TC], mqa [.., TC, 2 TC], lba
    [.., 2 TC, 2 TC] and lbk [.., 2 TC, TC]. Since λ_t ⊙ k_t e^{G_{t-1}} = k_t e^{G_t} and a1 = β k, they
    are six products of token rows rather than nine (H100 HDLA: BENCHMARKS.md session 28). With
    ``_CHANNEL["hdla_pairs"]``, the diagonal blocks' last level (an odd token against the one before it) is taken as
    row sums through e^{G_t - G_{t-1}} rather than as masked [TB, TB] products. A diagonal block whose log-cumsums
    stay within ``one_level_span`` of the one before it is taken in one product, not by levels: two products, b1 and
    b2 stacked as L_BA's rows and k and a2 as its columns (``_CHANNEL["hdla_stacked"]``; 0: six).

    q, k [B, T, H, K] as given; a [B, T, H, 2, K] (its a2 rows are read); gc [B, H, NC, TC, K]
    (``chunk_log_cumsum``); beta [B, T, H]. ``scaled``: the forward's scaled form (``chunk_fwd.chunk_dplr_fwd``'s
    ``hdla_scaled``), whose update rows are [k, a2]: M_QA and L_BA without β (L_BA then takes it on its rows in
    the intra kernel), M_QK and L_BK not written. ``c_parts`` ([B, H, NC, key blocks, TC] fp32:
    ``chunk_fwd.chunk_log_cumsum``'s): a2 is formed from k, gc, β and c = kᵀ(λ ⊙ k) (those shares' sum) in the
    kernel, and a is not read (a placeholder of its shape will do). ``flags`` ([B, H, NC] int32,
    ``hdla_row_products``'): only the chunks it marks are taken (by levels), and only theirs of gc are read."""
    B, _, H, K = q.shape
    NC = gc.shape[2]
    TB = _sub_block(TC, 1, 1)
    grid = (TC // TB, NC, B * H)
    args = (q, k, a, gc, beta, mqk, mqa, lba, lbk, scale, T, NC)
    kw = dict(
        H=H, K=K, TC=TC, TB=TB,
        BK=min(_knob("bk", TC), max(16, _pow2(K))), KP=_pow2(K),
        PRECISION=precision, PAIRS=bool(_CHANNEL["hdla_pairs"]), SCALED=scaled, num_warps=_knob("warps", TC),
        num_stages=1, cp=gc if c_parts is None else c_parts, NKB=1 if c_parts is None else c_parts.shape[3],
        FORM_A2=c_parts is not None, STACKED=bool(_CHANNEL["hdla_stacked"]), **_maxnreg(_CHANNEL["hdla_maxnreg"]),
    )
    if flags is not None and TB != TC:
        raise ValueError(f"flags: one per chunk, for chunks of one sub-block (TC = {TC}, sub-blocks of {TB})")
    _launch_one_level(_hdla_products_kernel, grid, args, kw, one_level_span(gc.dtype), (B, H, NC, TC // TB),
                      q.device, flags=flags)


@triton.jit
def _diag_bwd_add(dX, dY, dY2, dX2, X, Yd, X2, dPx, dP, dP2, dPx2, dP3, dP4, lx, ly, keep, DUAL: tl.constexpr,
                  PAIR: tl.constexpr, PRECISION: tl.constexpr):
    """``_channel_product_bwd_kernel``'s diagonal block's share through the pairs ``keep`` (a level's, or the causal
    ones in one product) with the rows' decays lx and the columns' ly, added to (dX, dY, dY2, dX2) and returned:
    dY2 with DUAL (dP2's, and PAIR's dP4), dX2 with PAIR (x2's, through x's decays; dP3's share into dY)."""
    Xl = X * lx
    Yl = Yd * ly
    dX += _dot(tl.where(keep, dPx, 0.0), Yl, PRECISION) * lx
    dY += _dot(tl.trans(tl.where(keep, dP, 0.0)), Xl, PRECISION) * ly
    if DUAL:
        dY2 += _dot(tl.trans(tl.where(keep, dP2, 0.0)), Xl, PRECISION) * ly
    if PAIR:
        X2l = X2 * lx
        dX2 += _dot(tl.where(keep, dPx2, 0.0), Yl, PRECISION) * lx
        dY += _dot(tl.trans(tl.where(keep, dP3, 0.0)), X2l, PRECISION) * ly
        dY2 += _dot(tl.trans(tl.where(keep, dP4, 0.0)), X2l, PRECISION) * ly
    return dX, dY, dY2, dX2


@triton.jit
def _channel_product_bwd_kernel(
    x, y, gc, sy, dp, dx, dy, dp2, dy2, T, NC,
    H: tl.constexpr, K: tl.constexpr, KG: tl.constexpr, TC: tl.constexpr, TB: tl.constexpr,
    RX: tl.constexpr, RXP: tl.constexpr, RY: tl.constexpr, RYP: tl.constexpr, STRICT: tl.constexpr,
    BK: tl.constexpr, PRECISION: tl.constexpr, YSC: tl.constexpr, ACC_X: tl.constexpr, ACC_Y: tl.constexpr,
    DUAL: tl.constexpr, ACC_Y2: tl.constexpr, x2=None, dp3=None, dp4=None, dx2=None, PAIR: tl.constexpr = False,
    ONE: tl.constexpr = 0.0, MODE: tl.constexpr = 0, flags=None,
):
    # dp [B, H, NC, NX, NY]: dL/dP for P = P(x, sy ⊙ y) (``_channel_product_kernel``'s without its scale);
    # entries outside the causal pattern are ignored. dx [B, H, NC, NX, K] and dy [B, H, NC, NY, K]
    # fp32: dL/dx and dL/d(sy ⊙ y) through P, added to what they hold with ACC_X / ACC_Y.
    # DUAL (with YSC): two products of the same rows, P = P(x, y) with dp and P2 = P(x, sy ⊙ y) with dp2
    # (``channel_product``'s out_scaled): dx takes both shares (dp + dp2 ⊙ sy against y), dy dL/dy through P
    # and dy2 [dy's shape] dL/d(sy ⊙ y) through P2 (ACC_Y2: added), from one pass over the decays.
    # PAIR (with DUAL, not STRICT, x and y of rank 1): x2's rows (x's shape) through G_t as x's, strictly before
    # each token (``_channel_product_kernel``'s PAIR: KDA's L_BK = P(k at G_t, k) and L_BA with sy), with dp3 and
    # dp4 their dP and dP2: dx2 takes x2's share as dx takes x's, and dy and dy2 both pairs' shares.
    # MODE 1 (ONE > 0): where this program's key block allows it (``_one_level_span``), the diagonal block in one
    # product through the token before it; else the program only flags itself in flags [B, H, NC, programs on
    # axis 0], and a second launch (MODE 2) runs the flagged programs by levels, the others not at all.
    i_kr, i_c, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    NB: tl.constexpr = TC // TB
    i_k, i_r = i_kr // NB, i_kr % NB
    i_b, i_h = i_bh // H, i_bh % H
    c = i_bh * NC + i_c
    NX: tl.constexpr = TC * RXP
    NY: tl.constexpr = TC * RYP
    XR: tl.constexpr = TB * RXP
    YR: tl.constexpr = TB * RYP
    LEVELS: tl.constexpr = TB.bit_length() - 1
    g = gc + c * TC * KG
    o_k = i_k * BK + tl.arange(0, BK)
    m_k = o_k < K
    o_x = i_r * XR + tl.arange(0, XR)  # x's rows in this block
    tokx, vx, fx = _tok_rows(o_x, i_b, i_h, i_c, T, H, TC, RX, RXP)
    o_d = i_r * YR + tl.arange(0, YR)  # y's rows in this block
    tokd, vd, fd = _tok_rows(o_d, i_b, i_h, i_c, T, H, TC, RY, RYP)
    ref = i_r * TB - 1  # the token before the block (-1: the chunk's start, where G = 0)
    run = True
    if MODE == 1:
        run = _span_block(g, i_r * TB + tl.arange(0, TB), ref, o_k, m_k, KG) <= ONE  # this key block alone
        tl.store(flags + c * tl.num_programs(0) + i_kr, tl.where(run, 0, 1))
    elif MODE == 2:
        run = tl.load(flags + c * tl.num_programs(0) + i_kr) != 0
    if run:
        X = _load_rows(x, fx, vx, o_k, m_k, K)
        Yd = _load_rows(y, fd, vd, o_k, m_k, K)
        dP = tl.load(dp + (c * NX + o_x[:, None]) * NY + o_d[None, :]).to(tl.float32)  # the diagonal block
        if DUAL:  # x's share of both products; dP stays P's for dy, dP2 is P2's for dy2
            dP2 = tl.load(dp2 + (c * NX + o_x[:, None]) * NY + o_d[None, :]).to(tl.float32)
            sd = tl.load(sy + fd, mask=vd, other=0.0).to(tl.float32)[None, :]
            dPx = dP + dP2 * sd
            if PAIR:  # x2's, strictly before each token (its diagonal entries are not read)
                before_d = tokx[:, None] > tokd[None, :]
                X2 = _load_rows(x2, fx, vx, o_k, m_k, K)
                dP3 = tl.where(before_d, tl.load(dp3 + (c * NX + o_x[:, None]) * NY + o_d[None, :]).to(tl.float32), 0.0)
                dP4 = tl.where(before_d, tl.load(dp4 + (c * NX + o_x[:, None]) * NY + o_d[None, :]).to(tl.float32), 0.0)
                dPx2 = dP3 + dP4 * sd
        else:
            if YSC:
                Yd = Yd * tl.load(sy + fd, mask=vd, other=0.0).to(tl.float32)[:, None]
            dPx = dP
        if not DUAL:  # (placeholders of tiles ``_diag_bwd_add`` reads only with DUAL or PAIR)
            dP2 = dP
        if not PAIR:
            X2, dPx2, dP3, dP4 = X, dP, dP, dP
        dY2 = tl.zeros([YR, BK], dtype=tl.float32)
        dX2 = tl.zeros([XR, BK], dtype=tl.float32)  # (PAIR's; a placeholder without it)
        if RXP == RYP:  # the same tokens on both sides (``_level_decays``)
            Gx, Gy = _shared_cumsums(g, tokx, o_k, m_k, KG, STRICT)
        if MODE == 1:  # the diagonal block in one product through the token before it (``_channel_diag_one``'s)
            Gref = _gc_row(g, ref, o_k, m_k, KG)  # (not Gr: a [BK] Gr follows under a runtime branch)
            Ex = tl.exp((_x_exponent(g, tokx, o_k, m_k, KG, STRICT) - Gref).to(tl.float32))
            Ey = tl.exp((Gref - _gc_at(g, tokd, tokd >= 0, o_k, m_k, KG)).to(tl.float32))
            if STRICT:
                causal = tokx[:, None] > tokd[None, :]
            else:  # a token against itself included
                causal = tokx[:, None] >= tokd[None, :]
            dX, dY, dY2, dX2 = _diag_bwd_add(tl.zeros([XR, BK], dtype=tl.float32), tl.zeros([YR, BK], dtype=tl.float32),
                                             dY2, dX2, X, Yd, X2, dPx, dP, dP2, dPx2, dP3, dP4, Ex, Ey, causal, DUAL,
                                             PAIR, PRECISION)
        else:  # level by level (and a token against itself)
            if STRICT:
                dX = tl.zeros([XR, BK], dtype=tl.float32)
                dY = tl.zeros([YR, BK], dtype=tl.float32)
            else:
                same = tokx[:, None] == tokd[None, :]
                dX = _dot(tl.where(same, dPx, 0.0), Yd, PRECISION)
                dY = _dot(tl.trans(tl.where(same, dP, 0.0)), X, PRECISION)
                if DUAL:
                    dY2 = _dot(tl.trans(tl.where(same, dP2, 0.0)), X, PRECISION)
            for lvl in tl.static_range(LEVELS):  # blocks of TB >> lvl tokens
                if RXP == RYP:
                    lx, ly = _level_decays(Gx, Gy, g, tokx, o_k, m_k, KG, TB >> lvl)
                else:
                    lx = _level_x(g, tokx, o_k, m_k, KG, TB >> lvl, STRICT)
                    ly = _level_y(g, tokd, o_k, m_k, KG, TB >> lvl)
                dX, dY, dY2, dX2 = _diag_bwd_add(dX, dY, dY2, dX2, X, Yd, X2, dPx, dP, dP2, dPx2, dP3, dP4, lx, ly,
                                                 _same_block(tokx, tokd, TB >> lvl), DUAL, PAIR, PRECISION)
        # x's rows of this block against y's rows before it, through the token just before the block
        if i_r > 0:  # (ref: the token just before the block)
            o_y = tl.arange(0, NY)
            toky, vy, fy = _tok_rows(o_y, i_b, i_h, i_c, T, H, TC, RY, RYP)
            before = toky <= ref
            Gr = tl.load(g + ref * KG + o_k, mask=m_k, other=0.0)
            Y = _load_rows(y, fy, vy & before, o_k, m_k, K)
            eb = tl.where(before[:, None], Gr[None, :] - _gc_at(g, toky, before, o_k, m_k, KG), -1.0e30)
            Pb = tl.load(dp + (c * NX + o_x[:, None]) * NY + o_y[None, :]).to(tl.float32)
            if DUAL:
                sb = tl.load(sy + fy, mask=vy, other=0.0).to(tl.float32)[None, :]
                Pb += tl.load(dp2 + (c * NX + o_x[:, None]) * NY + o_y[None, :]).to(tl.float32) * sb
            elif YSC:
                Y = Y * tl.load(sy + fy, mask=vy, other=0.0).to(tl.float32)[:, None]
            if RXP == RYP:
                xb = Gx - Gr[None, :]
            else:
                xb = _x_exponent(g, tokx, o_k, m_k, KG, STRICT) - Gr[None, :]
            Yb = Y * tl.exp(eb.to(tl.float32))
            dX += _dot(Pb, Yb, PRECISION) * tl.exp(xb.to(tl.float32))
            if PAIR:  # (the rows' exps taken again: kept live across the dot, they cost the unpaired kernel registers)
                Pb2 = (tl.load(dp3 + (c * NX + o_x[:, None]) * NY + o_y[None, :]).to(tl.float32)
                       + tl.load(dp4 + (c * NX + o_x[:, None]) * NY + o_y[None, :]).to(tl.float32) * sb)
                dX2 += _dot(Pb2, Yb, PRECISION) * tl.exp(xb.to(tl.float32))
        # y's rows of this block against x's rows after it, through the block's last token
        if i_r < NB - 1:
            last = (i_r + 1) * TB - 1
            o_a = tl.arange(0, NX)
            toka, va, fa = _tok_rows(o_a, i_b, i_h, i_c, T, H, TC, RX, RXP)
            after = toka > last
            Gf = tl.load(g + last * KG + o_k, mask=m_k, other=0.0)
            Xa = _load_rows(x, fa, va & after, o_k, m_k, K)
            xa = tl.where(after[:, None], _x_exponent(g, toka, o_k, m_k, KG, STRICT) - Gf[None, :], -1.0e30)
            Pa = tl.load(dp + (c * NX + o_a[:, None]) * NY + o_d[None, :]).to(tl.float32)
            if RXP == RYP:
                ya = Gf[None, :] - Gy
            else:
                ya = Gf[None, :] - _gc_at(g, tokd, tokd >= 0, o_k, m_k, KG)
            Xa = Xa * tl.exp(xa.to(tl.float32))
            ey = tl.exp(ya.to(tl.float32))
            dY += _dot(tl.trans(Pa), Xa, PRECISION) * ey
            if DUAL:
                Pa2 = tl.load(dp2 + (c * NX + o_a[:, None]) * NY + o_d[None, :]).to(tl.float32)
                dY2 += _dot(tl.trans(Pa2), Xa, PRECISION) * ey
            if PAIR:  # x2's rows after the block, through G_t as x's
                X2a = _load_rows(x2, fa, va & after, o_k, m_k, K) * tl.exp(xa.to(tl.float32))
                Pa3 = tl.load(dp3 + (c * NX + o_a[:, None]) * NY + o_d[None, :]).to(tl.float32)
                Pa4 = tl.load(dp4 + (c * NX + o_a[:, None]) * NY + o_d[None, :]).to(tl.float32)
                dY += _dot(tl.trans(Pa3), X2a, PRECISION) * ey
                dY2 += _dot(tl.trans(Pa4), X2a, PRECISION) * ey
        px = dx + (c * NX + o_x[:, None]) * K + o_k[None, :]
        py = dy + (c * NY + o_d[:, None]) * K + o_k[None, :]
        if ACC_X:
            dX += tl.load(px, mask=m_k[None, :], other=0.0)
        if ACC_Y:
            dY += tl.load(py, mask=m_k[None, :], other=0.0)
        tl.store(px, dX, mask=m_k[None, :])
        tl.store(py, dY, mask=m_k[None, :])
        if PAIR:
            tl.store(dx2 + (c * NX + o_x[:, None]) * K + o_k[None, :], dX2, mask=m_k[None, :])
        if DUAL:
            py2 = dy2 + (c * NY + o_d[:, None]) * K + o_k[None, :]
            if ACC_Y2:
                dY2 += tl.load(py2, mask=m_k[None, :], other=0.0)
            tl.store(py2, dY2, mask=m_k[None, :])


def channel_product_bwd(x, y, gc, dp, dx, dy, T: int, TC: int, strict: bool, precision: str, acc_x: bool,
                        acc_y: bool, y_scale=None, dp_scaled=None, dy_scaled=None, acc_y_scaled: bool = False,
                        x2=None, dp2=None, dp2_scaled=None, dx2=None):
    """dL/dx into dx [B, H, NC, TC*Rxp, K] and dL/d(y_scale ⊙ y) into dy [B, H, NC, TC*Ryp, K] (fp32,
    chunk layout), given dp = dL/dP [B, H, NC, TC*Rxp, TC*Ryp] for P = ``channel_product``'s without its
    scale, that is P(x, y_scale ⊙ y); with acc_x / acc_y added to what dx / dy hold.

    With ``dp_scaled`` (and y_scale, ``dy_scaled``): the gradients of the two products ``channel_product``
    writes with ``out_scaled``, P = P(x, y) (dp) and P2 = P(x, y_scale ⊙ y) (dp_scaled), in one pass: dx takes
    both shares, dy dL/dy through P, dy_scaled dL/d(y_scale ⊙ y) through P2 (added with acc_y_scaled).

    With ``x2`` (x's shape; with dp_scaled, not strict, x and y of rank 1): the gradients of the second pair that
    ``channel_product``'s x2 writes, P(x2, y) strict with x2's rows through G_t as x's (dp2) and its scaled twin
    (dp2_scaled), in the same pass: dL/dx2 into dx2 (x2's rows through G_t: KDA's b = e^g ⊙ k taken as k), and
    both pairs' shares into dy and dy_scaled."""
    x, y = (z.unsqueeze(-2) if z.dim() == 4 else z for z in (x, y))  # q: rank 1
    B, _, H, RX, K = x.shape
    RY = y.shape[-2]
    NC = gc.shape[2]
    TB = _sub_block(TC, RX, RY)
    dual = dp_scaled is not None
    bk, warps = _knob("bwd_bk", TC), _knob("bwd_warps", TC)
    pair = x2 is not None
    if dual:  # the pair's own launch where set
        bk, warps = _CHANNEL["dual_bwd_bk"] or bk, _CHANNEL["dual_bwd_warps"] or warps
    if pair:  # and two pairs' (KDA's four)
        warps = _CHANNEL["pair_bwd_warps"] or warps
    BK = min(bk, max(16, _pow2(K)))
    if dual and (y_scale is None or dy_scaled is None or dp_scaled.shape != dp.shape or dy_scaled.shape != dy.shape):
        raise ValueError("dp_scaled takes y_scale and dy_scaled, of dp's and dy's shapes")
    if pair:
        x2 = x2.unsqueeze(-2) if x2.dim() == 4 else x2
        if (not dual or strict or RX != 1 or RY != 1 or x2.shape != x.shape or dp2 is None or dp2.shape != dp.shape
                or dp2_scaled is None or dp2_scaled.shape != dp.shape or dx2 is None or dx2.shape != dx.shape):
            raise ValueError("x2 takes dp_scaled, strict=False, x and y of rank 1, x's shape, and dp2, dp2_scaled "
                             "(dp's shape) and dx2 (dx's)")
    grid = (_cdiv(K, BK) * (TC // TB), NC, B * H)
    args = (x, y, gc, dx if y_scale is None else y_scale, dp, dx, dy, dp if not dual else dp_scaled,
            dy if not dual else dy_scaled, T, NC)
    kw = dict(H=H, K=K, KG=gc.shape[-1], TC=TC, TB=TB, RX=RX, RXP=_pow2(RX), RY=RY, RYP=_pow2(RY), STRICT=strict,
              BK=BK, PRECISION=precision, YSC=y_scale is not None, ACC_X=acc_x, ACC_Y=acc_y, DUAL=dual,
              ACC_Y2=acc_y_scaled, x2=x2 if pair else x, dp3=dp2 if pair else dp, dp4=dp2_scaled if pair else dp,
              dx2=dx2 if pair else dx, PAIR=pair, num_warps=warps, num_stages=1)
    # one product where the decays allow, then levels for the programs flagged (``hdla_products_bwd``'), by default
    # for a pair of products (KDA's; H100: 0.874 -> 0.750 ms) but not one alone (GLA's 64-token chunks, four times
    # the programs, where the second launch costs more than the one product saves: 0.493 -> 0.529 ms; BENCHMARKS.md
    # session 48); ``_CHANNEL["one_level"]`` set forces either way
    one = one_level_span(gc.dtype) if dual or _CHANNEL["one_level"] is not None else 0.0
    _launch_one_level(_channel_product_bwd_kernel, grid, args, kw, one, (B, H, NC, grid[0]), x.device)


@triton.jit
def _hdla_dp(dmqk, dmqa, dlba, dlbk, be, c, ti, tj, TC: tl.constexpr):
    """The six token products' gradients for rows ti and columns tj of a chunk, from those of HDLA's four products
    (``_hdla_store``'s layout; be: the column tokens' β): dP1 = dM_QK + β dM_QA[:, a1], dP2 = dM_QA[:, a2],
    dP3 = dL_BK[b1] + β dL_BA[b1, a1], dP4 = dL_BA[b1, a2], dP5 and dP6 the same on b2's rows; 0 outside the
    causal pattern (j <= i for q's rows, j < i for b's). β's share through a1 = β k is taken here, into k's."""
    i = ti[:, None]
    j = tj[None, :]
    bj = be[None, :]
    cq = j <= i
    cb = j < i
    row = dmqa + (c * TC + i) * (2 * TC) + 2 * j
    Dqk = (tl.load(dmqk + (c * TC + i) * TC + j, mask=cq, other=0.0).to(tl.float32)
           + bj * tl.load(row, mask=cq, other=0.0).to(tl.float32))
    Dqa = tl.load(row + 1, mask=cq, other=0.0).to(tl.float32)
    row = dlba + (c * 2 * TC + 2 * i) * (2 * TC) + 2 * j
    col = dlbk + (c * 2 * TC + 2 * i) * TC + j
    D1k = tl.load(col, mask=cb, other=0.0).to(tl.float32) + bj * tl.load(row, mask=cb, other=0.0).to(tl.float32)
    D1a = tl.load(row + 1, mask=cb, other=0.0).to(tl.float32)
    D2k = (tl.load(col + TC, mask=cb, other=0.0).to(tl.float32)
           + bj * tl.load(row + 2 * TC, mask=cb, other=0.0).to(tl.float32))
    D2a = tl.load(row + 2 * TC + 1, mask=cb, other=0.0).to(tl.float32)
    return Dqk, Dqa, D1k, D1a, D2k, D2a


@triton.jit
def _hdla_dp_where(keep, Dqk, Dqa, D1k, D1a, D2k, D2a):
    """The six products' gradient tiles (``_hdla_dp``) where keep, 0 elsewhere."""
    return (tl.where(keep, Dqk, 0.0), tl.where(keep, Dqa, 0.0), tl.where(keep, D1k, 0.0), tl.where(keep, D1a, 0.0),
            tl.where(keep, D2k, 0.0), tl.where(keep, D2a, 0.0))


@triton.jit
def _hdla_twelve(Q, Kr, A2, x0, x1, y0, Dqk, Dqa, D1k, D1a, D2k, D2a, PRECISION: tl.constexpr):
    """The gradients through ``_hdla_six``'s products given theirs (``_hdla_dp``'s tiles, masked as the caller's
    pairs are): the shares of dq, db1, db2 (rows; b1's own exponent is G_{t-1}, so it takes x1) and dk, da2
    (columns), twelve products of [TB, TB] by [TB, BK]."""
    Ky = Kr * y0
    Ay = A2 * y0
    dQ = (_dot(Dqk, Ky, PRECISION) + _dot(Dqa, Ay, PRECISION)) * x0
    dB1 = (_dot(D1k, Ky, PRECISION) + _dot(D1a, Ay, PRECISION)) * x1
    dB2 = (_dot(D2k, Ky, PRECISION) + _dot(D2a, Ay, PRECISION)) * x1
    Qx = Q * x0
    B1 = Kr * x0  # b1 ⊙ e^{G_{t-1}} = k ⊙ e^{G_t}
    B2 = Kr * x1
    dK = (_dot(tl.trans(Dqk), Qx, PRECISION) + _dot(tl.trans(D1k), B1, PRECISION)
          + _dot(tl.trans(D2k), B2, PRECISION)) * y0
    dA = (_dot(tl.trans(Dqa), Qx, PRECISION) + _dot(tl.trans(D1a), B1, PRECISION)
          + _dot(tl.trans(D2a), B2, PRECISION)) * y0
    return dQ, dB1, dB2, dK, dA


@triton.jit
def _hdla_level_bwd(Q, Kr, A2, G0, G1, Dqk, Dqa, D1k, D1a, D2k, D2a, gc, tok, o_k, m_k, K: tl.constexpr,
                    S: tl.constexpr, PRECISION: tl.constexpr):
    """One level of ``_hdla_products_bwd_kernel``'s diagonal block (``_hdla_level``'s pairs): the shares of dq,
    db1, db2 (the second half's rows) and dk, da2 (the first half's), twelve products of [TB, TB] by [TB, BK]."""
    x0, x1, y0 = _hdla_level_decays(G0, G1, gc, tok, o_k, m_k, K, S)
    Eqk, Eqa, E1k, E1a, E2k, E2a = _hdla_dp_where(_same_block(tok, tok, S), Dqk, Dqa, D1k, D1a, D2k, D2a)
    return _hdla_twelve(Q, Kr, A2, x0, x1, y0, Eqk, Eqa, E1k, E1a, E2k, E2a, PRECISION)


@triton.jit
def _hdla_diag_one_bwd(Q, Kr, A2, G0, G1, dmqk, dmqa, dlba, dlbk, be, c, ref, tok, gc, o_k, m_k, K: tl.constexpr,
                       TC: tl.constexpr, PRECISION: tl.constexpr):
    """``_hdla_products_bwd_kernel``'s diagonal block in one product each through the token ref before it
    (``_hdla_diag_one``'s backward): the shares of dq, db1, db2 (rows, through G_t and G_{t-1}: e^{G^x - G_ref}) and
    dk, da2 (columns, e^{G_ref - G_s}), the causal masks of ``_hdla_dp`` taking a token against itself in."""
    Dqk, Dqa, D1k, D1a, D2k, D2a = _hdla_dp(dmqk, dmqa, dlba, dlbk, be, c, tok, tok, TC)
    Gr = _gc_row(gc, ref, o_k, m_k, K)
    return _hdla_twelve(Q, Kr, A2, tl.exp((G0 - Gr).to(tl.float32)), tl.exp((G1 - Gr).to(tl.float32)),
                        tl.exp((Gr - G0).to(tl.float32)), Dqk, Dqa, D1k, D1a, D2k, D2a, PRECISION)


@triton.jit
def _hdla_products_bwd_kernel(q, k, a, gc, beta, dmqk, dmqa, dlba, dlbk, mqk, lbk, pq, pk, pa, pb, dbeta,
                              inv_scale, T, NC, H: tl.constexpr, K: tl.constexpr, TC: tl.constexpr,
                              TB: tl.constexpr, BK: tl.constexpr, PRECISION: tl.constexpr, PAIRS: tl.constexpr = False,
                              ONE: tl.constexpr = 0.0, MODE: tl.constexpr = 0, flags=None):
    # One program per (key block and row block, chunk, sequence x head), as ``_channel_product_bwd_kernel``:
    # x's rows of its block (q; b1 and b2, both through G_{t-1}) against the columns up to them, y's rows (k, a2)
    # against the rows from them on. pq [B, H, NC, TC, K], pk and pb as ``channel_product_bwd`` leaves them (chunk
    # layout, any float dtype), pa a2's rows alone [B, H, NC, TC, K]: a1's share is folded into k's and β's; dbeta
    # [B, T, H] fp32: β's share through a1 (from the programs of the first key block).
    # MODE 1 (ONE > 0: ``one_level_span``): where the block's log-cumsums in this key block stay within ONE of the one
    # at the token before it (``_one_level_span``), the diagonal block in one product each through that token
    # (``_hdla_diag_one_bwd``); else the program only flags itself in flags [B, H, NC, programs on axis 0] (int32),
    # and a second launch with MODE 2 runs the flagged programs by levels, the others not at all. MODE 0: levels.
    i_kr, i_c, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    NB: tl.constexpr = TC // TB
    i_k, i_r = i_kr // NB, i_kr % NB
    i_b, i_h = i_bh // H, i_bh % H
    c = i_bh * NC + i_c
    LEVELS: tl.constexpr = TB.bit_length() - 1
    g = gc + c * TC * K
    o_k = i_k * BK + tl.arange(0, BK)
    m_k = o_k < K
    tok, vx, fx = _tok_rows(i_r * TB + tl.arange(0, TB), i_b, i_h, i_c, T, H, TC, 1, 1)
    be = tl.load(beta + fx, mask=vx, other=0.0).to(tl.float32)
    ref = i_r * TB - 1  # the token before the block (-1: the chunk's start, where G = 0)
    run = True
    if MODE == 1:
        run = _span_block(g, tok, ref, o_k, m_k, K) <= ONE  # this program's key block alone
        tl.store(flags + c * tl.num_programs(0) + i_kr, tl.where(run, 0, 1))
    elif MODE == 2:
        run = tl.load(flags + c * tl.num_programs(0) + i_kr) != 0
    if run:
        Q = _load_rows(q, fx, vx, o_k, m_k, K)
        Kr = _load_rows(k, fx, vx, o_k, m_k, K)
        A2 = _load_rows(a, 2 * fx + 1, vx, o_k, m_k, K)
        G0 = _gc_at(g, tok, tok >= 0, o_k, m_k, K)
        G1 = _gc_at(g, tok - 1, tok > 0, o_k, m_k, K)
        if MODE == 1:  # the diagonal block in one product each (a token against itself included)
            dQ, dB1, dB2, dK, dA = _hdla_diag_one_bwd(Q, Kr, A2, G0, G1, dmqk, dmqa, dlba, dlbk, be, c, ref, tok,
                                                      g, o_k, m_k, K, TC, PRECISION)
        else:
            # the diagonal block: a token against itself (q's rows), then level by level
            Dqk, Dqa, D1k, D1a, D2k, D2a = _hdla_dp(dmqk, dmqa, dlba, dlbk, be, c, tok, tok, TC)
            eye = tok[:, None] == tok[None, :]
            dqk = tl.sum(tl.where(eye, Dqk, 0.0), axis=1)[:, None]
            dqa = tl.sum(tl.where(eye, Dqa, 0.0), axis=1)[:, None]
            dQ = dqk * Kr + dqa * A2
            dK = dqk * Q
            dA = dqa * Q
            dB1 = tl.zeros([TB, BK], dtype=tl.float32)
            dB2 = tl.zeros([TB, BK], dtype=tl.float32)
            for lvl in tl.static_range(LEVELS - 1 if PAIRS else LEVELS):
                lq, l1, l2, lk, la = _hdla_level_bwd(Q, Kr, A2, G0, G1, Dqk, Dqa, D1k, D1a, D2k, D2a, g, tok, o_k,
                                                     m_k, K, TB >> lvl, PRECISION)
                dQ += lq
                dB1 += l1
                dB2 += l2
                dK += lk
                dA += la
            if PAIRS:  # the last level (S = 2) as row sums (``_hdla_products_kernel``'s PAIRS): odd t against t - 1
                odd = tok % 2 == 1
                sub = (tok[:, None] - 1 == tok[None, :]) & odd[:, None]  # entry [t, t - 1], t odd
                vo = vx & odd
                tokn, vn, fn = _tok_rows(i_r * TB + tl.arange(0, TB) + 1, i_b, i_h, i_c, T, H, TC, 1, 1)
                ve = vn & (tok % 2 == 0)  # an even token whose next one is there
                # one exp for both sides: e^{G_t - G_{t-1}} on the odd rows, e^{G_{s+1} - G_s} on the even ones
                Gn = _gc_at(g, tokn, ve, o_k, m_k, K)
                E = tl.exp(tl.where(odd[:, None], G0 - G1, tl.where(ve[:, None], Gn - G0, 0.0)).to(tl.float32))
                # the six gradients' entries [t, t - 1], each read by rows (x's side) and by columns (y's side)
                Sqk, Sqa, S1k, S1a, S2k, S2a = _hdla_dp_where(sub, Dqk, Dqa, D1k, D1a, D2k, D2a)
                # x's side, the odd rows: D[t, t - 1] times y's rows at t - 1 (b1 and b2 through G_{t-1}: no decay)
                Kp = _load_rows(k, fx - H, vo, o_k, m_k, K)
                Ap = _load_rows(a, 2 * (fx - H) + 1, vo, o_k, m_k, K)
                dQ += (tl.sum(Sqk, axis=1)[:, None] * Kp + tl.sum(Sqa, axis=1)[:, None] * Ap) * E
                dB1 += tl.sum(S1k, axis=1)[:, None] * Kp + tl.sum(S1a, axis=1)[:, None] * Ap
                dB2 += tl.sum(S2k, axis=1)[:, None] * Kp + tl.sum(S2a, axis=1)[:, None] * Ap
                # y's side, the even rows s: D[s + 1, s] (a column of sub) times x's rows at s + 1
                Qn = _load_rows(q, fn, ve, o_k, m_k, K) * E
                Kn = _load_rows(k, fn, ve, o_k, m_k, K)
                KnE = Kn * E
                dK += (tl.sum(Sqk, axis=0)[:, None] * Qn + tl.sum(S1k, axis=0)[:, None] * KnE
                       + tl.sum(S2k, axis=0)[:, None] * Kn)
                dA += (tl.sum(Sqa, axis=0)[:, None] * Qn + tl.sum(S1a, axis=0)[:, None] * KnE
                       + tl.sum(S2a, axis=0)[:, None] * Kn)
        o_c = tl.arange(0, TC)  # every token of the chunk
        tokc, vc, fc = _tok_rows(o_c, i_b, i_h, i_c, T, H, TC, 1, 1)
        if i_r > 0:  # x's rows against the columns before the block, through the token just before it
            ref = i_r * TB - 1
            before = tokc <= ref
            Gr = tl.load(g + ref * K + o_k, mask=m_k, other=0.0)[None, :]
            Ey = tl.exp(tl.where(before[:, None], Gr - _gc_at(g, tokc, before, o_k, m_k, K), -1.0e30).to(tl.float32))
            Kb = _load_rows(k, fc, vc & before, o_k, m_k, K) * Ey
            Ab = _load_rows(a, 2 * fc + 1, vc & before, o_k, m_k, K) * Ey
            bec = tl.load(beta + fc, mask=vc, other=0.0).to(tl.float32)
            Fqk, Fqa, F1k, F1a, F2k, F2a = _hdla_dp(dmqk, dmqa, dlba, dlbk, bec, c, tok, tokc, TC)
            dQ += (_dot(Fqk, Kb, PRECISION) + _dot(Fqa, Ab, PRECISION)) * tl.exp((G0 - Gr).to(tl.float32))
            e1 = tl.exp((G1 - Gr).to(tl.float32))
            dB1 += (_dot(F1k, Kb, PRECISION) + _dot(F1a, Ab, PRECISION)) * e1
            dB2 += (_dot(F2k, Kb, PRECISION) + _dot(F2a, Ab, PRECISION)) * e1
        if i_r < NB - 1:  # y's rows against the rows after the block, through the block's last token
            last = (i_r + 1) * TB - 1
            after = (tokc > last)[:, None]
            Gf = tl.load(g + last * K + o_k, mask=m_k, other=0.0)[None, :]
            Ga0 = tl.exp(tl.where(after, _gc_at(g, tokc, tokc >= 0, o_k, m_k, K) - Gf, -1.0e30).to(tl.float32))
            Ga1 = tl.exp(tl.where(after, _gc_at(g, tokc - 1, tokc > 0, o_k, m_k, K) - Gf, -1.0e30).to(tl.float32))
            Ka = _load_rows(k, fc, vc, o_k, m_k, K)
            Xq = _load_rows(q, fc, vc, o_k, m_k, K) * Ga0
            X1 = Ka * Ga0
            X2 = Ka * Ga1
            Hqk, Hqa, H1k, H1a, H2k, H2a = _hdla_dp(dmqk, dmqa, dlba, dlbk, be, c, tokc, tok, TC)
            ey = tl.exp((Gf - G0).to(tl.float32))
            dK += (_dot(tl.trans(Hqk), Xq, PRECISION) + _dot(tl.trans(H1k), X1, PRECISION)
                   + _dot(tl.trans(H2k), X2, PRECISION)) * ey
            dA += (_dot(tl.trans(Hqa), Xq, PRECISION) + _dot(tl.trans(H1a), X1, PRECISION)
                   + _dot(tl.trans(H2a), X2, PRECISION)) * ey
        rows = (c * TC + tok)[:, None] * K + o_k[None, :]
        tl.store(pq + rows, dQ, mask=m_k[None, :])
        tl.store(pk + rows, dK, mask=m_k[None, :])
        tl.store(pa + rows, dA, mask=m_k[None, :])  # a2's rows alone
        rows = (c * 2 * TC + 2 * tok)[:, None] * K + o_k[None, :]
        tl.store(pb + rows, dB1, mask=m_k[None, :])
        tl.store(pb + rows + K, dB2, mask=m_k[None, :])
        if i_k == 0:  # β's share through a1 = β k: Σ_i dM_QA[i, a1_j] P1[i, j] + Σ_i,r dL_BA[b_ri, a1_j] L_BK[b_ri, j]
            i = tokc[:, None]
            j = tok[None, :]
            cq = (j <= i) & vc[:, None]
            cb = (j < i) & vc[:, None]
            sq = (tl.load(dmqa + (c * TC + i) * (2 * TC) + 2 * j, mask=cq, other=0.0).to(tl.float32)
                  * tl.load(mqk + (c * TC + i) * TC + j, mask=cq, other=0.0).to(tl.float32)) * inv_scale
            row = dlba + (c * 2 * TC + 2 * i) * (2 * TC) + 2 * j
            col = lbk + (c * 2 * TC + 2 * i) * TC + j
            sb = (tl.load(row, mask=cb, other=0.0).to(tl.float32) * tl.load(col, mask=cb, other=0.0).to(tl.float32)
                  + tl.load(row + 2 * TC, mask=cb, other=0.0).to(tl.float32)
                  * tl.load(col + TC, mask=cb, other=0.0).to(tl.float32))
            tl.store(dbeta + fx, tl.sum(sq + sb, axis=0), mask=vx)


def hdla_products_bwd(q, k, a, gc, beta, dmqk, dmqa, dlba, dlbk, mqk, lbk, pq, pk, pa, pb, T: int, TC: int,
                      precision: str, scale: float) -> torch.Tensor:
    """The gradients through ``hdla_products``' four products in one kernel, given theirs (dmqk, dmqa, dlba, dlbk:
    dL/dP of the products without their scale, ``channel_product_bwd``'s dp) and the products themselves (mqk
    with its scale, lbk). Writes into pq [B, H, NC, TC, K], pk [.., TC, K], pa [.., TC, K] and pb [.., 2 TC, K]
    (any float dtype: each entry is written once, not accumulated) what ``channel_product_bwd`` would for q, k, a
    and b, except that a1 = β k's share is taken into k's and β's, which it returns ([B, T, H] fp32), so pa holds
    a2's rows alone. Twelve products of token rows instead of sixteen [C, C] ones in four launches (BENCHMARKS.md
    session 29). ``_CHANNEL["hdla_bwd_pairs"]``: the diagonal blocks' last level as row sums, as ``hdla_products``'.
    A program whose key block's log-cumsums stay within ``one_level_span`` takes its diagonal block in one product
    each, as ``hdla_products`` does."""
    B, _, H, K = q.shape
    NC = gc.shape[2]
    TB = _sub_block(TC, 1, 1)
    BK = min(_CHANNEL["hdla_bwd_bk"], max(16, _pow2(K)))
    dbeta = torch.empty(beta.shape, device=q.device, dtype=torch.float32)
    grid = (_cdiv(K, BK) * (TC // TB), NC, B * H)
    args = (q, k, a, gc, beta, dmqk, dmqa, dlba, dlbk, mqk, lbk, pq, pk, pa, pb, dbeta, 1.0 / scale, T, NC)
    kw = dict(H=H, K=K, TC=TC, TB=TB, BK=BK, PRECISION=precision, PAIRS=bool(_CHANNEL["hdla_bwd_pairs"]),
              num_stages=1)
    one = one_level_span(gc.dtype)
    # both one-product launches (2 warps, 244 registers) under a cap of 168, six programs an SM where four fit:
    # H100, bf16, K = 128, 0.675 -> 0.557 ms (0.59 at 152, 0.64 at 144, 0.74 at 128, 0.69 at 184 and 200: BENCHMARKS.md
    # session 51); not by levels alone (fp64 log-cumsums) nor for K > 128 (not measured)
    cap = _CHANNEL["hdla_bwd_maxnreg"]
    cap = (168 if one > 0 and precision.startswith("bf16") and K <= 128 else 0) if cap is None else cap
    _launch_one_level(_hdla_products_bwd_kernel, grid, args, dict(kw, num_warps=_CHANNEL["hdla_bwd_warps"]),
                      one, (B, H, NC, grid[0]), q.device,
                      one_kw=dict(num_warps=_CHANNEL["hdla_bwd_one_warps"], **_maxnreg(cap)))
    return dbeta
