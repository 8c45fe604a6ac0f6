"""The chunked forward with its parallel (intra-chunk) parts fused in Triton.

Three kernels, in ``rankdecay.ops.chunk``'s notation (HDLA §3.2, eqs. 13-18):

1. ``_intra_kernel``, one program per (chunk, sequence x head): the decayed products
   M_QK, M_QA (j <= i) and L_BK, L_BA (j < i), the UT transform T = (I + L_BA)^{-1}
   (blockwise, in registers: ``_unit_lower_inverse``), W = T (B ⊙ e^{G_{i-1}}), Ũ = T L_BK V, and
   everything decayed to the chunk's end (K̃, Ã, e^{G_C}) or from its start (Q ⊙ e^G).
2. ``chunk_state._state_fwd_kernel``: the state from chunk to chunk (S_n, U_n).
3. ``_output_kernel``: O = (Q ⊙ e^G) S_n + M_QK V - M_QA U_n.

Ranks are compile-time constants: the rows of a chunk are (token, rank) pairs, token
major, with the rank padded to a power of two (padded rows are zero and change
nothing), so one kernel family serves every (Rab, Rkv). A chunk holds
``64 / max(padded ranks)`` tokens (at least 16), so that every row set fits a
64-row tile whatever the ranks; the result does not depend on the chunk size.

Decays are never formed as a quotient: with a scalar gate the log-cumsums are fp64
vectors and their differences are taken in fp64; with a per-channel gate every
exponent is a sum of log-gates over a token range, accumulated directly (no
difference of two large cumsums), and the [C, C] products are built level by level
as in ``rankdecay.ops.chunk._blocked_products``: at each level the rows of a block's
second half meet the columns of its first half through the block's midpoint, both
factors <= 1, as one tensor-core product.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .chunk_state import _blocks, _dot_ex, _is16, _out_dtype, _precision, _state_fwd_kernel
from .fused_recurrent import gate_kind

MAX_ROWS = 64  # rows of one row set (tokens x padded rank) in a chunk tile


@triton.jit
def _rows(i_b, i_h, i_c, T, H: tl.constexpr, TC: tl.constexpr, R: tl.constexpr, RP: tl.constexpr):
    """The chunk's rows of a [B, T, H, R, D] tensor: token in chunk, rank, time, valid, flat row."""
    r = tl.arange(0, TC * RP)
    tok = r // RP
    rk = r % RP
    t = i_c * TC + tok
    valid = (rk < R) & (t < T)
    flat = ((i_b * T + t) * H + i_h) * R + rk
    return tok, rk, t, valid, flat


@triton.jit
def _load_rows(x, flat, valid, o_d, m_d, D: tl.constexpr):
    return tl.load(x + flat[:, None] * D + o_d[None, :], mask=valid[:, None] & m_d[None, :], other=0.0).to(tl.float32)


@triton.jit
def _row_factor(s, flat, valid):
    """[rows] per-row factors (``a_scale`` / ``v_scale`` of ``dplr``) of a [B, T, H, R, D] tensor's rows."""
    return tl.load(s + flat, mask=valid, other=0.0).to(tl.float32)


@triton.jit
def _g_at(g, i_b, i_h, t, ok, T, H: tl.constexpr, o_k, m_k, KG: tl.constexpr, CHANNEL: tl.constexpr):
    """Log-gate at time t for each row where ok (else 0): [rows] or, per channel, [rows, BK]."""
    ok = ok & (t >= 0) & (t < T)
    off = (i_b * T + t) * H + i_h
    if CHANNEL:
        return tl.load(g + off[:, None] * KG + o_k[None, :], mask=ok[:, None] & m_k[None, :], other=0.0).to(tl.float32)
    else:
        return tl.load(g + off * KG, mask=ok, other=0.0).to(tl.float32)


@triton.jit
def _seg_cumsum(x, NSEG: tl.constexpr, SEG: tl.constexpr, BK: tl.constexpr, REVERSE: tl.constexpr):
    """Cumulative sums of [NSEG * SEG, BK] restarting every SEG rows."""
    if NSEG == 1:
        return tl.cumsum(x, axis=0, reverse=REVERSE)
    else:
        y = tl.cumsum(tl.reshape(x, (NSEG, SEG, BK)), axis=1, reverse=REVERSE)
        return tl.reshape(y, (NSEG * SEG, BK))


@triton.jit
def _level_x(g, tok, rk, t, i_b, i_h, T, H: tl.constexpr, o_k, m_k, KG: tl.constexpr, TC: tl.constexpr,
             RP: tl.constexpr, S: tl.constexpr, STRICT: tl.constexpr, BK: tl.constexpr):
    """Decays of the row side at one level of the per-channel products (blocks of S tokens):
    exp of the gates from the block's midpoint (token S/2 - 1) to each row of the block's second
    half, up to the row's token (STRICT: strictly before it), and 0 on the first half's rows."""
    HS: tl.constexpr = S // 2
    if STRICT:  # sum of g over (mid, tok): the gates strictly between
        gx = _g_at(g, i_b, i_h, t - 1, (rk == 0) & (tok % HS != 0), T, H, o_k, m_k, KG, True)
    else:       # sum of g over (mid, tok]
        gx = _g_at(g, i_b, i_h, t, rk == 0, T, H, o_k, m_k, KG, True)
    ex = _seg_cumsum(gx, TC // HS, HS * RP, BK, False)
    sel = (tok % S) >= HS
    return tl.where(sel[:, None], tl.exp(tl.where(sel[:, None], ex, 0.0)), 0.0)


@triton.jit
def _level_y(g, tok, rk, t, i_b, i_h, T, H: tl.constexpr, o_k, m_k, KG: tl.constexpr, TC: tl.constexpr,
             RP: tl.constexpr, S: tl.constexpr, BK: tl.constexpr):
    """Decays of the column side at one level: exp of the gates after each row's token up to the
    midpoint, on the block's first half (0 on its second half)."""
    HS: tl.constexpr = S // 2
    # sum of g over (tok, mid]; reverse sums count a token's gate on its last row, forward sums on its first
    gy = _g_at(g, i_b, i_h, t + 1, (rk == RP - 1) & (tok % HS != HS - 1), T, H, o_k, m_k, KG, True)
    ey = _seg_cumsum(gy, TC // HS, HS * RP, BK, True)
    sel = (tok % S) < HS
    return tl.where(sel[:, None], tl.exp(tl.where(sel[:, None], ey, 0.0)), 0.0)


@triton.jit
def _same_block(tokx, toky, S: tl.constexpr):
    return (tokx // S)[:, None] == (toky // S)[None, :]


@triton.jit
def _level_product(X, Y, g, tokx, rkx, tx, toky, rky, ty, i_b, i_h, T, H: tl.constexpr, o_k, m_k,
                   KG: tl.constexpr, TC: tl.constexpr, RXP: tl.constexpr, RYP: tl.constexpr, S: tl.constexpr,
                   STRICT: tl.constexpr, BK: tl.constexpr, PRECISION: tl.constexpr):
    """One level of the per-channel products: in blocks of S tokens, the rows of each block's
    second half against the columns of its first half, through the token at S/2 - 1."""
    Xs = X * _level_x(g, tokx, rkx, tx, i_b, i_h, T, H, o_k, m_k, KG, TC, RXP, S, STRICT, BK)
    Ys = Y * _level_y(g, toky, rky, ty, i_b, i_h, T, H, o_k, m_k, KG, TC, RYP, S, BK)
    return tl.where(_same_block(tokx, toky, S), tl.dot(Xs, tl.trans(Ys), input_precision=PRECISION), 0.0)


@triton.jit
def _channel_decays(g, tok, rk, t, i_b, i_h, T, H: tl.constexpr, o_k, m_k, KG: tl.constexpr, TC: tl.constexpr,
                    RP: tl.constexpr, TO_END: tl.constexpr, EXCLUSIVE: tl.constexpr):
    """Per-channel decays of a row set [rows, BK] inside the chunk: TO_END, exp(G_C - G_tok) (the
    gates after the row's token); else exp(G_tok) from the chunk's start, or with EXCLUSIVE
    exp(G_{tok-1}) (the gates before it)."""
    if TO_END:
        x = _g_at(g, i_b, i_h, t + 1, (rk == RP - 1) & (tok < TC - 1), T, H, o_k, m_k, KG, True)
        return tl.exp(tl.cumsum(x, axis=0, reverse=True))
    elif EXCLUSIVE:
        x = _g_at(g, i_b, i_h, t - 1, (rk == 0) & (tok > 0), T, H, o_k, m_k, KG, True)
        return tl.exp(tl.cumsum(x, axis=0))
    else:
        x = _g_at(g, i_b, i_h, t, rk == 0, T, H, o_k, m_k, KG, True)
        return tl.exp(tl.cumsum(x, axis=0))


@triton.jit
def _input_dot(X, Y, x, y, LP: tl.constexpr, PRECISION: tl.constexpr):
    """X Yᵀ of rows loaded (as fp32) from the inputs x and y: with LP (both 16-bit) in their own
    dtype, which is exact (16-bit products fit the fp32 accumulator), else at PRECISION."""
    if LP:
        return tl.dot(X.to(x.dtype.element_ty), tl.trans(Y.to(y.dtype.element_ty)))
    else:
        return tl.dot(X, tl.trans(Y), input_precision=PRECISION)


@triton.jit
def _decays(Gx, Gy, tokx, toky, STRICT: tl.constexpr, GATE: tl.constexpr):
    """[NX, NY] causal mask (tok y < tok x, or <=) times exp(Gx - Gy) for a scalar gate (GATE 1).

    Gx, Gy: fp64 row vectors, split into fp32 hi + lo: the hi difference is exact wherever it
    is small enough to matter (Sterbenz), so no [NX, NY] fp64 tile is needed.
    """
    if STRICT:
        causal = tokx[:, None] > toky[None, :]
    else:
        causal = tokx[:, None] >= toky[None, :]
    if GATE == 1:
        xh = Gx.to(tl.float32)
        yh = Gy.to(tl.float32)
        xl = (Gx - xh.to(tl.float64)).to(tl.float32)
        yl = (Gy - yh.to(tl.float64)).to(tl.float32)
        diff = (xh[:, None] - yh[None, :]) + (xl[:, None] - yl[None, :])
        return tl.exp(tl.where(causal, diff, float("-inf")))
    else:
        return causal.to(tl.float32)


@triton.jit
def _products(x, y, g, Gx, Gy, i_b, i_h, i_c, T,
              H: tl.constexpr, K: tl.constexpr, KG: tl.constexpr, TC: tl.constexpr,
              RX: tl.constexpr, RXP: tl.constexpr, RY: tl.constexpr, RYP: tl.constexpr,
              STRICT: tl.constexpr, GATE: tl.constexpr, LEVELS: tl.constexpr, BK: tl.constexpr,
              PRECISION: tl.constexpr, LP: tl.constexpr):
    """P[p, q] = sum_k x_pk y_qk exp(G^x_{tok p, k} - G^y_{tok q, k}) for tok q < tok p (STRICT) or <=.

    G^y is the inclusive log-cumsum; G^x the exclusive one (STRICT: b rows, whose decay
    starts before their own token) or the inclusive one (queries). Gx, Gy: fp64 row
    vectors for a scalar gate (GATE 1), unused otherwise.
    """
    tokx, rkx, tx, vx, fx = _rows(i_b, i_h, i_c, T, H, TC, RX, RXP)
    toky, rky, ty, vy, fy = _rows(i_b, i_h, i_c, T, H, TC, RY, RYP)
    acc = tl.zeros([TC * RXP, TC * RYP], dtype=tl.float32)
    if GATE == 2:
        if not STRICT:  # a token against itself: no decay
            same_tok = tokx[:, None] == toky[None, :]
        for k0 in tl.static_range(0, K, BK):
            o_k = k0 + tl.arange(0, BK)
            m_k = o_k < K
            X = _load_rows(x, fx, vx, o_k, m_k, K)
            Y = _load_rows(y, fy, vy, o_k, m_k, K)
            if not STRICT:
                acc += tl.where(same_tok, _input_dot(X, Y, x, y, LP, PRECISION), 0.0)
            for lvl in tl.static_range(LEVELS):
                acc += _level_product(X, Y, g, tokx, rkx, tx, toky, rky, ty, i_b, i_h, T, H, o_k, m_k, KG, TC,
                                      RXP, RYP, TC >> lvl, STRICT, BK, PRECISION)
    else:
        for k0 in tl.static_range(0, K, BK):
            o_k = k0 + tl.arange(0, BK)
            m_k = o_k < K
            X = _load_rows(x, fx, vx, o_k, m_k, K)
            Y = _load_rows(y, fy, vy, o_k, m_k, K)
            acc += _input_dot(X, Y, x, y, LP, PRECISION)
        acc = acc * _decays(Gx, Gy, tokx, toky, STRICT, GATE)
    return acc


@triton.jit
def _unit_lower_inverse(L, lptr, sptr, N: tl.constexpr, PRECISION: tl.constexpr):
    """(I + L)^{-1} for a strictly lower-triangular [N, N] L (N a power of two >= 16).

    ``lptr``: L as stored row-major [N, N] by the calling program (the caller has stored
    it); ``sptr``: [N, N] scratch. The 16 x 16 diagonal blocks D = I + L_diag are inverted
    together by forward substitution on [N / 16, 16, 16] tiles read back from ``lptr``,
    row i of every block at once (row i of D^{-1} is e_i - L_i D^{-1}, which reads only
    rows already final), in fp32 on the FMA units: 15 short steps instead of a tensor-core
    product of the whole tile per row. Then, with Z = D^{-1} L_off strictly block-lower
    (so Z^{N/16} = 0), (I + L)^{-1} = (I + Z)^{-1} D^{-1} = (I - Z)(I + Z^2)... D^{-1}.
    """
    BS: tl.constexpr = 16
    NB: tl.constexpr = N // BS
    bb = tl.arange(0, NB)[:, None, None]
    ii = tl.arange(0, BS)[None, :, None]
    jj = tl.arange(0, BS)[None, None, :]
    diag = (BS * bb + ii) * N + BS * bb + jj  # [NB, BS, BS] offsets of the diagonal blocks
    tl.debug_barrier()  # L, stored by every thread of this program, is read back by others
    Ld = tl.load(lptr + diag)
    inv = (ii == jj).to(tl.float32) + tl.zeros([NB, BS, BS], dtype=tl.float32)
    for i in tl.static_range(1, BS):
        row = tl.sum(tl.where(ii == i, Ld, 0.0), axis=1)  # [NB, BS]: L_i of every block
        new = (jj == i).to(tl.float32) - tl.sum(row[:, :, None] * inv, axis=1)[:, None, :]
        inv = tl.where(ii == i, new, inv)
    if N == BS:
        out = tl.reshape(inv, [N, N])
    else:
        r = tl.arange(0, N)
        same = (r[:, None] // BS) == (r[None, :] // BS)
        tl.store(sptr + diag, inv)
        tl.debug_barrier()
        Dinv = tl.load(sptr + r[:, None] * N + r[None, :], mask=same, other=0.0)
        eye = (r[:, None] == r[None, :]).to(tl.float32)
        Z = tl.dot(Dinv, tl.where(same, 0.0, L), input_precision=PRECISION)
        P = eye - Z  # (I + Z)^{-1} = (I - Z)(I + Z^2)(I + Z^4)...
        Zp = Z
        for _ in tl.static_range(1, N // 32):  # log2(N / 16) factors in all (N <= 64)
            Zp = tl.dot(Zp, Zp, input_precision=PRECISION)
            P = tl.dot(P, eye + Zp, input_precision=PRECISION)
        out = tl.dot(P, Dinv, input_precision=PRECISION)
        tl.debug_barrier()  # every read of the scratch is done before the caller may reuse it
    return out


@triton.jit
def _scalar_cumsums(g, i_b, i_h, t, tok, rk, T, H: tl.constexpr, KG: tl.constexpr,
                    GATE: tl.constexpr):
    """Scalar gate (GATE 1), per row: (inclusive, exclusive) fp64 log-cumsums from the chunk's start.
    Any other gate: fp64 zeros [1] (unused, but they keep one code path in the kernels)."""
    if GATE == 1:
        zero = tl.zeros([1], dtype=tl.int32)
        g_tok = _g_at(g, i_b, i_h, t, rk >= 0, T, H, zero, zero == 0, KG, False).to(tl.float64)
        incl = tl.cumsum(tl.where(rk == 0, g_tok, 0.0), axis=0)  # each token's gate counted once, on its first row
        return incl, incl - g_tok
    else:
        none = tl.zeros([1], dtype=tl.float64)
        return none, none


@triton.jit
def _intra_kernel(
    q, k, v, a, b, g, sa, sv, qd, mqk, mqa, kd, vf, w, uv, ad, dch, tinv, lba, lbk, scale, T, NC,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, KG: tl.constexpr, TC: tl.constexpr,
    RKV: tl.constexpr, RKVP: tl.constexpr, RAB: tl.constexpr, RABP: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, GATE: tl.constexpr, LEVELS: tl.constexpr, PRECISION: tl.constexpr,
    LP_QK: tl.constexpr, LP_QA: tl.constexpr, LP_BA: tl.constexpr, LP_BK: tl.constexpr, SAVE: tl.constexpr,
    ASC: tl.constexpr, VSC: tl.constexpr, E_B: tl.constexpr, E_V: tl.constexpr,
):
    # LP_XY: x and y are both 16-bit (their undecayed products are exact in their own dtype).
    # ASC / VSC: a's / v's rows carry the fp32 factors sa / sv, applied to the products' columns
    # and to the loaded rows (so 16-bit a and v stay 16-bit). E_B / E_V: b / v are 16-bit, and
    # T B̃ and L_BK V take two TF32 passes (``chunk_state._dot_ex``), decays and factors moved onto T and L.
    i_c, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    c = i_bh * NC + i_c  # chunk row of [B, H, NC, ...]
    NK: tl.constexpr = TC * RKVP
    NA: tl.constexpr = TC * RABP
    tokq, rkq, tq, vq, fq = _rows(i_b, i_h, i_c, T, H, TC, 1, 1)
    tokk, rkk, tk, vk, fk = _rows(i_b, i_h, i_c, T, H, TC, RKV, RKVP)
    Gq, Gq_ex = _scalar_cumsums(g, i_b, i_h, tq, tokq, rkq, T, H, KG, GATE)
    Gk, _ = _scalar_cumsums(g, i_b, i_h, tk, tokk, rkk, T, H, KG, GATE)
    G_end = tl.sum(Gq - Gq_ex, axis=0)  # the chunk's total log-decay (scalar gate)
    r_q = tl.arange(0, TC)
    r_k = tl.arange(0, NK)

    # O's intra-chunk products (the scale folded in)
    M = _products(q, k, g, Gq, Gk, i_b, i_h, i_c, T, H, K, KG, TC, 1, 1, RKV, RKVP, False, GATE, LEVELS, BK,
                  PRECISION, LP_QK)
    tl.store(mqk + (c * TC + r_q[:, None]) * NK + r_k[None, :], M * scale)
    if RAB > 0:
        toka, rka, ta, va, fa = _rows(i_b, i_h, i_c, T, H, TC, RAB, RABP)
        r_a = tl.arange(0, NA)
        Ga, Gb = _scalar_cumsums(g, i_b, i_h, ta, toka, rka, T, H, KG, GATE)
        if ASC:
            fac_a = _row_factor(sa, fa, va)
        M = _products(q, a, g, Gq, Ga, i_b, i_h, i_c, T, H, K, KG, TC, 1, 1, RAB, RABP, False, GATE, LEVELS, BK,
                      PRECISION, LP_QA)
        if ASC:
            M = M * fac_a[None, :]
        tl.store(mqa + (c * TC + r_q[:, None]) * NA + r_a[None, :], M * scale)
        # The UT transform: (I + L_BA) U = (B ⊙ e^{G_{i-1}}) S_0 + L_BK V
        L = _products(b, a, g, Gb, Ga, i_b, i_h, i_c, T, H, K, KG, TC, RAB, RABP, RAB, RABP, True, GATE, LEVELS,
                      BK, PRECISION, LP_BA)
        if ASC:
            L = L * fac_a[None, :]
        tl.store(lba + (c * NA + r_a[:, None]) * NA + r_a[None, :], L)  # saved, and read back by the inverse
        Tinv = _unit_lower_inverse(L, lba + c * NA * NA, tinv + c * NA * NA, NA, PRECISION)
        L = _products(b, k, g, Gb, Gk, i_b, i_h, i_c, T, H, K, KG, TC, RAB, RABP, RKV, RKVP, True, GATE, LEVELS,
                      BK, PRECISION, LP_BK)
        if SAVE:  # for the backward: T, L_BA and L_BK
            tl.store(tinv + (c * NA + r_a[:, None]) * NA + r_a[None, :], Tinv)
            tl.store(lbk + (c * NA + r_a[:, None]) * NK + r_k[None, :], L)
    # V in the chunk layout the state kernel reads and, with a low-rank decay, Ũ = T L_BK V
    if VSC:
        fac_v = _row_factor(sv, fk, vk)
        if RAB > 0:
            L = L * fac_v[None, :]  # Ũ = T (L_BK ⊙ sv) v, with v as given (L_BK is saved above)
    for v0 in tl.static_range(0, V, BV):
        o_v = v0 + tl.arange(0, BV)
        m_v = o_v < V
        V16 = _load_rows(v, fk, vk, o_v, m_v, V)
        if VSC:
            Vr = V16 * fac_v[:, None]
        else:
            Vr = V16
        tl.store(vf + (c * NK + r_k[:, None]) * V + o_v[None, :], Vr, mask=m_v[None, :])
        if RAB > 0:
            LV = _dot_ex(L, V16, PRECISION, E_V)
            tl.store(uv + (c * NA + r_a[:, None]) * V + o_v[None, :], tl.dot(Tinv, LV, input_precision=PRECISION),
                     mask=m_v[None, :])

    # Per key channel: Q ⊙ e^G, K ⊙ e^{G_C - G}, A ⊙ e^{G_C - G}, W = T (B ⊙ e^{G_{i-1}}), e^{G_C}
    if RAB > 0 and GATE == 1:
        Tinv_b = Tinv * tl.exp(Gb.to(tl.float32))[None, :]  # W = (T e^{G_{i-1}}) B: B as given
    for k0 in tl.static_range(0, K, BK):
        o_k = k0 + tl.arange(0, BK)
        m_k = o_k < K
        Q = _load_rows(q, fq, vq, o_k, m_k, K)
        Kr = _load_rows(k, fk, vk, o_k, m_k, K)
        if GATE == 1:
            Q = Q * tl.exp(Gq.to(tl.float32))[:, None]
            Kr = Kr * tl.exp((G_end - Gk).to(tl.float32))[:, None]
        elif GATE == 2:
            eq = _channel_decays(g, tokq, rkq, tq, i_b, i_h, T, H, o_k, m_k, KG, TC, 1, False, False)
            Q = Q * eq
            Kr = Kr * _channel_decays(g, tokk, rkk, tk, i_b, i_h, T, H, o_k, m_k, KG, TC, RKVP, True, False)
            tl.store(dch + c * KG + o_k, tl.sum(tl.where(r_q[:, None] == TC - 1, eq, 0.0), axis=0),
                     mask=m_k)  # e^{G_C}
        tl.store(qd + (c * TC + r_q[:, None]) * K + o_k[None, :], Q * scale, mask=m_k[None, :])
        tl.store(kd + (c * NK + r_k[:, None]) * K + o_k[None, :], Kr, mask=m_k[None, :])
        if RAB > 0:
            A = _load_rows(a, fa, va, o_k, m_k, K)
            if ASC:
                A = A * fac_a[:, None]
            Bm = _load_rows(b, fa, va, o_k, m_k, K)
            if GATE == 1:
                A = A * tl.exp((G_end - Ga).to(tl.float32))[:, None]
                W = _dot_ex(Tinv_b, Bm, PRECISION, E_B)
            elif GATE == 2:
                A = A * _channel_decays(g, toka, rka, ta, i_b, i_h, T, H, o_k, m_k, KG, TC, RABP, True, False)
                Bm = Bm * _channel_decays(g, toka, rka, ta, i_b, i_h, T, H, o_k, m_k, KG, TC, RABP, False, True)
                W = tl.dot(Tinv, Bm, input_precision=PRECISION)
            else:
                W = _dot_ex(Tinv, Bm, PRECISION, E_B)
            tl.store(ad + (c * NA + r_a[:, None]) * K + o_k[None, :], A, mask=m_k[None, :])
            tl.store(w + (c * NA + r_a[:, None]) * K + o_k[None, :], W, mask=m_k[None, :])
    if GATE == 1:
        tl.store(dch + c + tl.arange(0, 1), tl.exp(G_end.to(tl.float32)) + tl.zeros([1], dtype=tl.float32))


@triton.jit
def _output_kernel(
    qd, s0, mqk, vf, mqa, u, o, T, NC,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, TC: tl.constexpr, NK: tl.constexpr, NA: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, PRECISION: tl.constexpr,
):
    i_v, i_c, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_h = i_bh // H, i_bh % H
    c = i_bh * NC + i_c
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    r_q = tl.arange(0, TC)
    r_k = tl.arange(0, NK)
    acc = tl.zeros([TC, BV], dtype=tl.float32)
    for k0 in tl.static_range(0, K, BK):
        o_k = k0 + tl.arange(0, BK)
        m_k = o_k < K
        Q = tl.load(qd + (c * TC + r_q[:, None]) * K + o_k[None, :], mask=m_k[None, :], other=0.0)
        S = tl.load(s0 + (c * K + o_k[:, None]) * V + o_v[None, :], mask=m_k[:, None] & m_v[None, :], other=0.0)
        acc += tl.dot(Q, S, input_precision=PRECISION)
    Mk = tl.load(mqk + (c * TC + r_q[:, None]) * NK + r_k[None, :])
    Vf = tl.load(vf + (c * NK + r_k[:, None]) * V + o_v[None, :], mask=m_v[None, :], other=0.0)
    acc += tl.dot(Mk, Vf, input_precision=PRECISION)
    if NA > 0:
        r_a = tl.arange(0, NA)
        Ma = tl.load(mqa + (c * TC + r_q[:, None]) * NA + r_a[None, :])
        U = tl.load(u + (c * NA + r_a[:, None]) * V + o_v[None, :], mask=m_v[None, :], other=0.0)
        acc -= tl.dot(Ma, U, input_precision=PRECISION)
    t = i_c * TC + r_q
    tl.store(o + ((i_b * T + t[:, None]) * H + i_h) * V + o_v[None, :], acc, mask=(t < T)[:, None] & m_v[None, :])


def _pow2(n: int) -> int:
    return 0 if n == 0 else triton.next_power_of_2(n)


def fused_chunk_size(Rab: int, Rkv: int) -> int | None:
    """Tokens per chunk of the fused forward (None: these ranks need the unfused path)."""
    tc = MAX_ROWS // max(_pow2(Rab), _pow2(Rkv), 1)
    return tc if tc >= 16 else None


def _lowp(*xs) -> bool:
    """Every tensor 16-bit of one dtype: products of them are exact on tensor cores in that dtype.

    (Not bf16 under the CPU interpreter, whose bf16 tl.dot is wrong on Triton 3.x: there it
    stays fp32; the CPU tests cover this path with fp16.)
    """
    dt = {x.dtype for x in xs}
    return len(dt) == 1 and (dt == {torch.float16} or (dt == {torch.bfloat16} and xs[0].is_cuda))


def chunk_dplr_fwd(q, k, v, a, b, g, scale: float, initial_state, save: bool = False,
                   _config: dict | None = None, a_scale=None, v_scale=None):
    """Forward of the chunked algorithm in three Triton kernels (no autograd).

    Canonical inputs (``rankdecay.ops._inputs``): q [B, T, H, K], k [B, T, H, Rkv, K],
    v [B, T, H, Rkv, V], a, b [B, T, H, Rab, K] or None, g [B, T, H, 1 | K] or None,
    any float dtype; initial_state [B, H, K, V] or None; a_scale [B, T, H, Rab], v_scale
    [B, T, H, Rkv] or None: per-row factors of a and v (``dplr``'s). Returns (o [B, T, H, V] in q's dtype,
    final state [B, H, K, V] fp32), and with ``save`` a dict of the per-chunk tensors the
    backward needs (``rankdecay.ops.triton.chunk_bwd``). Needs ``fused_chunk_size(Rab, Rkv)``.
    """
    B, T, H, K = q.shape
    Rkv, V = v.shape[-2], v.shape[-1]
    Rab = a.shape[-2] if a is not None else 0
    TC = fused_chunk_size(Rab, Rkv)
    if TC is None:
        raise ValueError(f"the fused forward takes ranks up to 4, got Rab={Rab}, Rkv={Rkv}")
    NC = triton.cdiv(T, TC)
    NK, NA = TC * _pow2(Rkv), TC * _pow2(Rab)
    gate = gate_kind(g)
    KG = 1 if g is None else g.shape[-1]
    f32 = dict(device=q.device, dtype=torch.float32)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    a = a.contiguous() if a is not None else None
    b = b.contiguous() if b is not None else None
    g = g.contiguous() if g is not None else None
    sa = a_scale.float().contiguous() if a_scale is not None and Rab else None
    sv = v_scale.float().contiguous() if v_scale is not None else None
    qd = torch.empty(B, H, NC, TC, K, **f32)
    mqk = torch.empty(B, H, NC, TC, NK, **f32)
    kd = torch.empty(B, H, NC, NK, K, **f32)
    vf = torch.empty(B, H, NC, NK, V, **f32)
    mqa = torch.empty(B, H, NC, TC, NA, **f32) if Rab else None
    w = torch.empty(B, H, NC, NA, K, **f32) if Rab else None
    ad = torch.empty_like(w) if Rab else None
    uv = torch.empty(B, H, NC, NA, V, **f32) if Rab else None
    dch = torch.empty(B, H, NC, KG, **f32) if gate else None
    tinv = torch.empty(B, H, NC, NA, NA, **f32) if Rab else None  # scratch of the inverse without save
    lbk = torch.empty(B, H, NC, NA, NK, **f32) if Rab and save else None
    lba = torch.empty(B, H, NC, NA, NA, **f32) if Rab else None
    cfg = dict(intra_warps=4, precision=_precision(q), state_precision=_precision(q))
    cfg.update(_config or {})  # benchmarking knobs
    prec = cfg["precision"]
    BK = min(32 if gate == 2 else 64, max(16, triton.next_power_of_2(K)))
    BV = min(64, max(16, triton.next_power_of_2(V)))
    dummy = qd
    _intra_kernel[(NC, B * H)](
        q, k, v, a if Rab else dummy, b if Rab else dummy, g if gate else dummy, dummy if sa is None else sa,
        dummy if sv is None else sv, qd, mqk,
        mqa if Rab else dummy, kd, vf, w if Rab else dummy, uv if Rab else dummy, ad if Rab else dummy,
        dch if gate else dummy, tinv if Rab else dummy, lba if Rab else dummy,
        lbk if save and Rab else dummy, scale, T, NC,
        H=H, K=K, V=V, KG=KG, TC=TC, RKV=Rkv, RKVP=_pow2(Rkv), RAB=Rab, RABP=_pow2(Rab), BK=BK, BV=BV, GATE=gate,
        LEVELS=TC.bit_length() - 1, PRECISION=prec, LP_QK=_lowp(q, k), LP_QA=Rab > 0 and _lowp(q, a),
        LP_BA=Rab > 0 and _lowp(b, a), LP_BK=Rab > 0 and _lowp(b, k), SAVE=save, ASC=sa is not None, VSC=sv is not None,
        E_B=Rab > 0 and _is16(b), E_V=_is16(v),
        num_warps=cfg["intra_warps"], num_stages=1,
    )
    blocks = _blocks(K, V, NK, NA)
    s0 = torch.empty(B, H, NC, K, V, **f32)
    u = torch.empty(B, H, NC, NA, V, **f32)
    ht = torch.empty(B, H, K, V, **f32)
    h0 = initial_state.float().contiguous() if initial_state is not None else None
    _state_fwd_kernel[(triton.cdiv(V, blocks["BV"]), B * H)](
        h0 if h0 is not None else dummy, dch if gate else dummy, kd, vf, w if Rab else dummy,
        uv if Rab else dummy, ad if Rab else dummy, s0, u, ht, NC, K=K, V=V, CR=NK, CA=NA, GATE=gate,
        HAS_H0=h0 is not None, PRECISION=cfg["state_precision"], **blocks,
    )
    o = torch.empty(B, T, H, V, device=q.device, dtype=_out_dtype(q))
    BKo = min(64, max(16, triton.next_power_of_2(K)))
    _output_kernel[(triton.cdiv(V, BV), NC, B * H)](
        qd, s0, mqk, vf, mqa if Rab else dummy, u, o, T, NC, H=H, K=K, V=V, TC=TC, NK=NK, NA=NA, BK=BKo, BV=BV,
        PRECISION=prec, num_warps=4, num_stages=1,
    )
    if not save:
        return o, ht
    saved = dict(qd=qd, mqk=mqk, mqa=mqa, kd=kd, vf=vf, w=w, ad=ad, dch=dch, tinv=tinv, lba=lba, lbk=lbk, s0=s0,
                 u=u, TC=TC)  # Ũ is not needed: dL_BA = -dX Uᵀ
    return o, ht, saved
