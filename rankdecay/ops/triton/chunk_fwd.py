"""The chunked forward with its parallel (intra-chunk) parts fused in Triton.

Three kernels, in ``rankdecay.ops.chunk``'s notation (HDLA §3.2, eqs. 13-18):

1. ``_intra_kernel``, one program per (chunk, sequence x head): the decayed products
   M_QK, M_QA (j <= i) and L_BK, L_BA (j < i), the UT transform T = (I + L_BA)^{-1}
   (blockwise, in registers: ``_unit_lower_inverse``), W = T (B ⊙ e^{G_{i-1}}), Ũ = T L_BK V, and
   everything decayed to the chunk's end (K̃, Ã, e^{G_C}) or from its start (Q ⊙ e^G).
2. ``chunk_state._state_fwd_kernel``: the state from chunk to chunk (S_n, U_n).
3. ``_output_kernel``: O = (Q ⊙ e^G) S_n + M_QK V - M_QA U_n; or, where the state kernel's grid
   alone fills the GPU (``fuse_output``), the state kernel forms O itself from S_n and U_n in
   registers, and S_n and U_n are stored only for the backward.

The delta rule's forward without the backward, outputs from the state kernel, takes a scaled form
(``scaled_update``): the intra kernel stores only T' = (I + D L_BK)^{-1}, and the state kernel forms
the chunk's value update T' (sv ⊙ v - D e^{G_{i-1}} ⊙ K S_n) itself (fla's v_new, without W and U).

Ranks are compile-time constants: the rows of a chunk are (token, rank) pairs, token
major, with the rank padded to a power of two (padded rows are zero and change
nothing), so one kernel family serves every (Rab, Rkv). A chunk holds
``64 / max(padded ranks)`` tokens (at least 16), so that every row set fits a
64-row tile whatever the ranks; the result does not depend on the chunk size.

Decays are never formed as a quotient: with a scalar gate the log-cumsums are fp64
vectors and their differences are taken in fp64; with a per-channel gate the chunk-local
log-cumsums are formed once (``chunk_log_cumsum``, [B, H, NC, C, K], summed in fp64 and
stored in fp64 or, where the products are rounded anyway, fp32: ``log_cumsum_dtype``) and
every exponent is a difference of two of them. A per-channel gate's four [C, C] products
are ``channel.channel_product``'s, in sub-blocks of the chunk, before the intra kernel runs (HDLA's:
``channel.hdla_products``, one kernel).
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .chunk_state import (_LAUNCH, _blocks, _chunk_cols, _chunk_rows, _dot, _dot_ex, _hh_rows, _is16, _load_rows,
                          _maxnreg, _out_dtype, _precision, _query_state, _raw_rows, _row_factor, _segment_starts_kernel,
                          _state_fwd_kernel, _values_out)
from .channel import (_CHANNEL, _gc_at, _input_dot, channel_product, hdla_a2, hdla_c, hdla_one_block, hdla_products,
                      hdla_row_products, row_span)
from .factors import placeholder
from .fused_recurrent import _cdiv, _pow2, gate_kind
from ..backends import LOG_GATE_FLOOR
from .opaque import opaque, same_memory

MAX_ROWS = 64  # rows of one row set (tokens x padded rank) in a chunk tile
_FLOOR = tl.constexpr(LOG_GATE_FLOOR)  # log-gates below count as it (``backends.LOG_GATE_FLOOR``)


@triton.jit
def _rows(i_b, i_h, i_c, T, H: tl.constexpr, TC: tl.constexpr, R: tl.constexpr, RP: tl.constexpr):
    """The chunk's rows of a [B, T, H, R, D] tensor: token in chunk, rank, time, valid, flat row."""
    return _chunk_rows(tl.arange(0, TC * RP), i_b, i_h, i_c, T, H, TC, R, RP)


@triton.jit
def _g_at(g, i_b, i_h, t, ok, T, H: tl.constexpr, KG: tl.constexpr):
    """Scalar log-gate at time t for each row where ok (else 0), [rows], at least ``_FLOOR``. (A per-channel gate
    is read as chunk-local log-cumsums instead: ``_gc_at``.)"""
    ok = ok & (t >= 0) & (t < T)
    return tl.maximum(tl.load(g + ((i_b * T + t) * H + i_h) * KG, mask=ok, other=0.0).to(tl.float32), _FLOOR)


@triton.jit
def _channel_decays(gc, tok, o_k, m_k, KG: tl.constexpr, TC: tl.constexpr, TO_END: tl.constexpr,
                    EXCLUSIVE: tl.constexpr):
    """Per-channel decays of a row set [rows, BK] inside the chunk: TO_END, exp(G_C - G_tok) (the
    gates after the row's token); else exp(G_tok) from the chunk's start, or with EXCLUSIVE
    exp(G_{tok-1}) (the gates before it). gc: the chunk's log-cumsums (``_gc_at``)."""
    every = tok >= 0
    if TO_END:
        x = _gc_at(gc, tok * 0 + TC - 1, every, o_k, m_k, KG) - _gc_at(gc, tok, every, o_k, m_k, KG)
    elif EXCLUSIVE:
        x = _gc_at(gc, tok - 1, tok > 0, o_k, m_k, KG)
    else:
        x = _gc_at(gc, tok, every, o_k, m_k, KG)
    return tl.exp(x.to(tl.float32))


@triton.jit
def _hdla_rows(k, a, be, fa, va, rka, o_k, m_k, K: tl.constexpr):
    """HDLA's rows (token, rank) of a chunk, columns o_k, from k [B, T, H, 1, K] (row fa's token: fa // 2) and a's
    second rows a2 alone (``hdla_factors_fwd``'s ``a2_only``): (k's rows, a = [β k; a2]); be [rows, 1]: the rows'
    tokens' β. As fp32."""
    Kt = _load_rows(k, fa // 2, va, o_k, m_k, K)
    return Kt, tl.where((rka == 0)[:, None], be * Kt, _load_rows(a, fa, va & (rka == 1), o_k, m_k, K))


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
def _products(x, y, Gx, Gy, i_b, i_h, i_c, T,
              H: tl.constexpr, K: tl.constexpr, TC: tl.constexpr,
              RX: tl.constexpr, RXP: tl.constexpr, RY: tl.constexpr, RYP: tl.constexpr,
              STRICT: tl.constexpr, GATE: tl.constexpr, BK: tl.constexpr,
              PRECISION: tl.constexpr, LP: tl.constexpr, k=None, hmask=None, HX: tl.constexpr = 0,
              HY: tl.constexpr = 0, HH: tl.constexpr = 0):
    """P[p, q] = sum_k x_pk y_qk exp(G^x_{tok p} - G^y_{tok q}) for tok q < tok p (STRICT) or <=, with a
    decay per row (no gate, GATE 0, or a scalar one, 1; a per-channel gate's products are
    ``channel.channel_product``'s). HX / HY 1 or 2: x's / y's rows are Head-in-Head's a or b, formed from k and
    the mask hmask (``_hh_rows``; HH: the mask's kind) instead of read.

    G^y is the inclusive log-cumsum; G^x the exclusive one (STRICT: b rows, whose decay
    starts before their own token) or the inclusive one (queries). Gx, Gy: fp64 row
    vectors for a scalar gate, unused otherwise.
    """
    tokx, rkx, tx, vx, fx = _rows(i_b, i_h, i_c, T, H, TC, RX, RXP)
    toky, rky, ty, vy, fy = _rows(i_b, i_h, i_c, T, H, TC, RY, RYP)
    acc = tl.zeros([TC * RXP, TC * RYP], dtype=tl.float32)
    for k0 in tl.static_range(0, K, BK):
        o_k = k0 + tl.arange(0, BK)
        m_k = o_k < K
        if HX:
            X = _hh_rows(k, hmask, x, fx, vx, rkx, i_h, o_k, m_k, K, RX, HH, HX == 2)
        else:
            X = _load_rows(x, fx, vx, o_k, m_k, K)
        if HY:
            Y = _hh_rows(k, hmask, y, fy, vy, rky, i_h, o_k, m_k, K, RY, HH, HY == 2)
        else:
            Y = _load_rows(y, fy, vy, o_k, m_k, K)
        acc += _input_dot(X, Y, x, y, LP, PRECISION)
    return acc * _decays(Gx, Gy, tokx, toky, STRICT, GATE)


@triton.jit
def _hh_grams(q, k, hmask, i_b, i_h, i_c, T, H: tl.constexpr, K: tl.constexpr, TC: tl.constexpr,
              RAB: tl.constexpr, RABP: tl.constexpr, HH: tl.constexpr, PRECISION: tl.constexpr, LP: tl.constexpr):
    """Head-in-Head's products from per-group Grams (HH 1: hmask [H, r, r], 2: [B, T, H, r, r]; K / r channels a
    group, a power of two of at least 16). With a_i = k ⊙ 1[group i] and b_j = k ⊙ M[j, group(·)], every product
    of its rows is a Gram of q or k over one group's channels, G^x_i[t, s] = x_t|_i · k_s|_i, times mask entries:
    M_QA[t, (s, i)] = G^q_i[t, s], L_BA[(t, j), (s, i)] = M_t[j, i] G^k_i[t, s], L_BK[(t, j), s] = Σ_i M_t[j, i]
    G^k_i[t, s] and M_QK = Σ_i G^q_i. Returns (G^q, G^k) [TC, TC, RABP] (zero past RAB) and the mask's entries
    M_t[j, i] [TC, RABP, RABP] (zero past RAB or T), undecayed: r products of [TC, K / r] by [K / r, TC] instead of
    [TC r, K] by [K, TC r]."""
    W: tl.constexpr = K // RAB
    tok, _, _, valid, flat = _rows(i_b, i_h, i_c, T, H, TC, 1, 1)
    r_i = tl.arange(0, RABP)
    Gq = tl.zeros([TC, TC, RABP], dtype=tl.float32)
    Gk = tl.zeros([TC, TC, RABP], dtype=tl.float32)
    for i in tl.static_range(RAB):
        o_k = i * W + tl.arange(0, W)
        m_k = o_k < K
        Q = _load_rows(q, flat, valid, o_k, m_k, K)
        Kt = _load_rows(k, flat, valid, o_k, m_k, K)
        slot = (r_i == i)[None, None, :]
        Gq = tl.where(slot, _input_dot(Q, Kt, q, k, LP, PRECISION)[:, :, None], Gq)
        Gk = tl.where(slot, _input_dot(Kt, Kt, k, k, LP, PRECISION)[:, :, None], Gk)
    ji = r_i[:, None] * RAB + r_i[None, :]  # M[j, i]
    m_ji = (r_i[:, None] < RAB) & (r_i[None, :] < RAB)
    base = flat * (RAB * RAB) if HH == 2 else i_h * (RAB * RAB) + 0 * flat  # the token's mask, or the head's
    Mt = tl.load(hmask + base[:, None, None] + ji[None, :, :], mask=valid[:, None, None] & m_ji[None, :, :],
                 other=0.0).to(tl.float32)
    return Gq, Gk, Mt


@triton.jit
def _tied_products(q, k, Gq, Gk, Gk_ex, i_b, i_h, i_c, T, H: tl.constexpr, K: tl.constexpr, TC: tl.constexpr,
                   GATE: tl.constexpr, BK: tl.constexpr, PRECISION: tl.constexpr, LP_QK: tl.constexpr,
                   LP_KK: tl.constexpr):
    """The delta rule's two products in one pass over the key channels, each k block loaded once:
    (M_QK [TC, TC], P [TC, TC]) = ``_products(q, k, ...)`` and ``_products(k, k, ..., STRICT)``
    with a decay per row (GATE 0 or 1); Gk_ex is k's exclusive log-cumsum (the b rows' G^x)."""
    tok, _, _, vr, fr = _rows(i_b, i_h, i_c, T, H, TC, 1, 1)
    m = tl.zeros([TC, TC], dtype=tl.float32)
    p = tl.zeros([TC, TC], dtype=tl.float32)
    for k0 in tl.static_range(0, K, BK):
        o_k = k0 + tl.arange(0, BK)
        m_k = o_k < K
        Q = _load_rows(q, fr, vr, o_k, m_k, K)
        Kr = _load_rows(k, fr, vr, o_k, m_k, K)
        m += _input_dot(Q, Kr, q, k, LP_QK, PRECISION)
        p += _input_dot(Kr, Kr, k, k, LP_KK, PRECISION)
    m = m * _decays(Gq, Gk, tok, tok, False, GATE)
    p = p * _decays(Gk_ex, Gk, tok, tok, True, GATE)
    return m, p


@triton.jit
def _dot_merge(X, Y, MERGE: tl.constexpr):
    """X @ Y of the UT inverse's 16 x 16 blocks at the merges' precision: "ieee", exact fp32 on the FMA units
    (the default), or "tf32", one tensor-core pass (``_KNOBS["merge"]``; measured, not kept: BENCHMARKS.md
    session 25)."""
    return tl.dot(X, Y, input_precision=MERGE)


def intra_registers(scaled: bool, precision: str, k: torch.Tensor, v: torch.Tensor) -> int | None:
    """The intra kernel's register cap (Triton's ``maxnreg``): 168, three programs of 4 warps per SM, for the
    delta rule's scaled forward at the bf16 products' precision with 16-bit k and v and K <= 128, where it
    compiles without spills for sm_90 and was measured faster (H100 GDN: 262 -> 237 µs, BENCHMARKS.md
    session 25); else None, the compiler's choice (up to 255: two programs per SM)."""
    ok = scaled and precision == "bf16" and _is16(k) and _is16(v) and k.shape[-1] <= 128
    return 168 if ok else None


@triton.jit
def _block(lptr, i, j, N: tl.constexpr, blk):
    """The 16 x 16 block (i, j) of an [N, N] tile stored row-major at lptr."""
    return tl.load(lptr + 16 * (i * N + j) + blk)


@triton.jit
def _merge_block(L10, D0, D1, MERGE: tl.constexpr):
    """The lower-left block -D1 L10 D0 of (I + L)^{-1} for L = [[L00, 0], [L10, L11]], given the inverses
    D0 and D1 of its diagonal blocks."""
    return -_dot_merge(D1, _dot_merge(L10, D0, MERGE), MERGE)


@triton.jit
def _unit_lower_inverse(lptr, sptr, N: tl.constexpr, MERGE: tl.constexpr = "ieee", NILP: tl.constexpr = 0):
    """(I + L)^{-1} for a strictly lower-triangular [N, N] L (N = 16, 32, 64 or 128), as [N, N].

    ``lptr``: L as stored row-major [N, N] by the calling program (the caller has stored
    it); ``sptr``: [N, N] scratch.

    1. The 16 x 16 diagonal blocks D_i = I + L_ii are inverted together on [N / 16, 16, 16] tiles. With NILP
       (a power of two: L_ii^NILP = 0, as where each block holds NILP tokens of rows that couple only to earlier
       tokens' rows; ``neumann_blocks``): D^{-1} = (I - L_ii)(I + L_ii^2)...(I + L_ii^(NILP/2)), batched exact
       products. Else by forward substitution, row r of every block at once: row r of
       D^{-1} is e_r - L_r D^{-1}, which reads only rows already final. The rows L_r are read
       back from ``lptr``, so no step waits on a reduction to extract them.
    2. The blocks below the diagonal follow as two levels of 2 x 2 block inverses,
       [[T0, 0], [-T1 L10 T0, T1]]: first the 16 x 16 pairs on the diagonal, then (N = 64) the
       lower-left 32 x 32 quadrant, block by block from registers. These are 16 products of
       16 x 16 blocks at MERGE: exact fp32 ("ieee", on the FMA units), where whole-tile tensor-core
       products would need three TF32 passes each; or, as a benchmarking knob, one TF32 pass ("tf32").
       The finished blocks are stored in ``sptr`` and the whole inverse read back once.
    """
    BS: tl.constexpr = 16
    NB: tl.constexpr = N // BS
    bb = tl.arange(0, NB)[:, None, None]
    ii = tl.arange(0, BS)[None, :, None]
    jj = tl.arange(0, BS)[None, None, :]
    diag = (BS * bb + ii) * N + BS * bb + jj  # [NB, BS, BS] offsets of the diagonal blocks
    b2 = tl.arange(0, NB)[:, None]
    j2 = tl.arange(0, BS)[None, :]
    tl.debug_barrier()  # L, stored by every thread of this program, is read back by others
    inv = (ii == jj).to(tl.float32) + tl.zeros([NB, BS, BS], dtype=tl.float32)
    if NILP > 0:  # L_ii^NILP = 0: (I + L_ii)^{-1} = (I - L_ii)(I + L_ii^2)(I + L_ii^4)..., batched exact products
        Np = tl.load(lptr + diag)
        inv = inv - Np
        for _ in tl.static_range(NILP.bit_length() - 2):
            Np = tl.dot(Np, Np, input_precision="ieee")
            inv = inv + tl.dot(inv, Np, input_precision="ieee")
    else:
        for i in tl.static_range(1, BS):
            row = tl.load(lptr + (BS * b2 + i) * N + BS * b2 + j2)  # [NB, BS]: row i of every diagonal block
            new = (jj == i).to(tl.float32) - tl.sum(row[:, :, None] * inv, axis=1)[:, None, :]
            inv = tl.where(ii == i, new, inv)
    if NB == 1:
        out = tl.reshape(inv, [N, N])
    else:
        o = tl.arange(0, BS)
        blk = o[:, None] * N + o[None, :]  # offsets of the 16 x 16 block at (0, 0)
        tl.store(sptr + diag, inv)
        tl.debug_barrier()  # the diagonal blocks, one by one below
        D0 = tl.load(sptr + blk)
        D1 = tl.load(sptr + BS * (N + 1) + blk)
        for h in tl.static_range(0, NB, 4 if NB > 2 else 2):  # each 64-row half (N = 128) or the whole tile
            D0 = tl.load(sptr + BS * h * (N + 1) + blk)
            D1 = tl.load(sptr + BS * (h + 1) * (N + 1) + blk)
            X10 = _merge_block(_block(lptr, h + 1, h, N, blk), D0, D1, MERGE)
            tl.store(sptr + BS * ((h + 1) * N + h) + blk, X10)
            if NB >= 4:
                # the lower-left 32 x 32 quadrant -T1 L' T0, T0 = [[D0, 0], [X10, D1]] and T1 = [[D2, 0], [X32, D3]]
                # the inverses of the diagonal quadrants: 16 x 16 products in registers, no block waits on a store
                D2 = tl.load(sptr + BS * (h + 2) * (N + 1) + blk)
                D3 = tl.load(sptr + BS * (h + 3) * (N + 1) + blk)
                X32 = _merge_block(_block(lptr, h + 3, h + 2, N, blk), D2, D3, MERGE)
                L21 = _block(lptr, h + 2, h + 1, N, blk)
                L31 = _block(lptr, h + 3, h + 1, N, blk)
                Y20 = _dot_merge(_block(lptr, h + 2, h, N, blk), D0, MERGE) + _dot_merge(L21, X10, MERGE)  # L' T0
                Y30 = _dot_merge(_block(lptr, h + 3, h, N, blk), D0, MERGE) + _dot_merge(L31, X10, MERGE)
                Y21 = _dot_merge(L21, D1, MERGE)
                Y31 = _dot_merge(L31, D1, MERGE)
                tl.store(sptr + BS * ((h + 3) * N + h + 2) + blk, X32)
                tl.store(sptr + BS * ((h + 2) * N + h) + blk, -_dot_merge(D2, Y20, MERGE))
                tl.store(sptr + BS * ((h + 2) * N + h + 1) + blk, -_dot_merge(D2, Y21, MERGE))
                tl.store(sptr + BS * ((h + 3) * N + h) + blk,
                         -(_dot_merge(X32, Y20, MERGE) + _dot_merge(D3, Y30, MERGE)))
                tl.store(sptr + BS * ((h + 3) * N + h + 1) + blk,
                         -(_dot_merge(X32, Y21, MERGE) + _dot_merge(D3, Y31, MERGE)))
        if NB == 8:  # N = 128: the lower-left 64 x 64 quadrant -T1 L10 T0 from the two halves' inverses
            tl.debug_barrier()
            H2: tl.constexpr = N // 2
            hr = tl.arange(0, H2)
            lower = (hr[:, None] // BS) >= (hr[None, :] // BS)
            T0 = tl.load(sptr + hr[:, None] * N + hr[None, :], mask=lower, other=0.0)
            T1 = tl.load(sptr + (H2 + hr[:, None]) * N + H2 + hr[None, :], mask=lower, other=0.0)
            L10 = tl.load(lptr + (H2 + hr[:, None]) * N + hr[None, :])
            tl.store(sptr + (H2 + hr[:, None]) * N + hr[None, :],
                     -_dot_merge(T1, _dot_merge(L10, T0, MERGE), MERGE))
        tl.debug_barrier()  # every block is stored before the whole inverse is read back
        r = tl.arange(0, N)
        out = tl.load(sptr + r[:, None] * N + r[None, :], mask=(r[:, None] // BS) >= (r[None, :] // BS), other=0.0)
        tl.debug_barrier()  # every read of the scratch is done before the caller may reuse it
    return out


@triton.jit
def _scalar_cumsums(g, i_b, i_h, t, tok, rk, T, H: tl.constexpr, KG: tl.constexpr,
                    GATE: tl.constexpr):
    """Scalar gate (GATE 1), per row: (inclusive, exclusive) fp64 log-cumsums from the chunk's start.
    Any other gate: fp64 zeros [1] (unused, but they keep one code path in the kernels)."""
    if GATE == 1:
        g_tok = _g_at(g, i_b, i_h, t, rk >= 0, T, H, KG).to(tl.float64)
        incl = tl.cumsum(tl.where(rk == 0, g_tok, 0.0), axis=0)  # each token's gate counted once, on its first row
        return incl, incl - g_tok
    else:
        none = tl.zeros([1], dtype=tl.float64)
        return none, none


# the log-cumsum kernel's (key block, warps), alone and with PREP, by tokens per chunk (other sizes take 64's;
# benchmarks/prep_variants.py). H100, bf16, B8 T2048 H16 K128 (BENCHMARKS.md session 32): at 32-token chunks
# (HDLA's at 64-row tiles, KDA's now) PREP took 248 µs on 64's launch and 190 on (32, 1), the plain kernel 83 µs
# and 76 on (64, 2).
# At 16-token chunks (HDLA's), PREP took 275 µs on 64's launch and 144 on
# (32, 1), the plain kernel 85 µs and 73 on (64, 1) (BENCHMARKS.md session 42). On the H200, with the kernel as it is
# now (session 58), PREP there takes 157 µs on (32, 1) and 142 on (64, 1), 171 on (16, 1), 189 on (32, 2), 201 on
# (128, 2).
# hdla: with HDLA's rows (HROWS). At 16-token chunks, B8 T2048 H16 K128 (BENCHMARKS.md session 50): 311–323 µs on
# (128, 2), 332 on (128, 4), 665 on (128, 1), 327 on (64, 2), 369 on (64, 1), 362 on (32, 2), 394 on (32, 1), 450
# on (16, 1); the other chunk sizes take 16's
_LOG_CUMSUM = {64: dict(plain=(16, 2), prep=(16, 8), hdla=(128, 2)),
               32: dict(plain=(64, 2), prep=(32, 1), hdla=(128, 2)),
               16: dict(plain=(64, 1), prep=(64, 1), hdla=(128, 2))}


def log_cumsum_launch(chunk_size: int, prep: bool, hdla: bool = False, launch=None) -> tuple[int, int]:
    """The log-cumsum kernel's (key block, warps) at ``chunk_size`` tokens per chunk, with or without PREP (and
    HDLA's rows); ``launch``: None, or (key block, warps) to take instead, either None for this table's."""
    table = _LOG_CUMSUM.get(chunk_size, _LOG_CUMSUM[64])["hdla" if hdla else "prep" if prep else "plain"]
    return tuple(x or y for x, y in zip(launch or (None, None), table))


@triton.jit
def _chunk_log_cumsum_kernel(g, gc, T, q, k, qd, kd, dch, scale, H: tl.constexpr, K: tl.constexpr, TC: tl.constexpr,
                             BK: tl.constexpr, PREP: tl.constexpr = False, RKV: tl.constexpr = 1,
                             RKVP: tl.constexpr = 1, kg=None, b=None, KGO: tl.constexpr = False,
                             KDO: tl.constexpr = True, cp=None, CPART: tl.constexpr = False,
                             KG_K: tl.constexpr = False, ad=None, hb=None, HROWS: tl.constexpr = False,
                             flags=None, SPAN: tl.constexpr = 0.0):
    # PREP (the fused forward with a per-channel gate): also Q̃ = scale q ⊙ e^G, K̃ = k ⊙ e^{G_C - G} (k's RKV
    # rows per token, padded to RKVP with zero rows; not with KDO False) and e^{G_C}, from the log-cumsums in
    # registers; KGO: also b ⊙ e^{G_{t-1}} in kg (kd's layout, b [B, T, H, RKV, K]: the scaled form's decayed rows
    # of B; KG_K: b = e^g ⊙ k, KDA's, is not read, and kg is k ⊙ e^{G_t}, the same). CPART (HDLA, RKV 1): this
    # key block's share of c = kᵀ(λ ⊙ k), λ = e^g, per token, to cp [B, H, NC, key blocks, TC] (``hdla_c``), from
    # which the products' and intra kernels form a2 themselves. HROWS (with CPART; HDLA's scaled forward): also its
    # update rows [k, a2] ⊙ e^{G_C - G} in ad and B ⊙ e^{G_{i-1}} ([k ⊙ e^{G_t}, k ⊙ e^{G_{t-1}}]) in kg, both
    # [B, H, NC, 2 TC, K], the intra kernel's HDLA rows (hb: β [B, T, H]), formed here where k and G are in registers
    # already (c from every key block's k and g), so that the intra kernel reads neither k nor G.
    # SPAN > 0 (all of K in one key block; HDLA's products from those rows, ``channel.hdla_row_products``): flags
    # [B, H, NC] (int32) marks the chunks whose log-cumsums stray beyond SPAN from 0, and only theirs are stored
    i_k, i_c, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_h = i_bh // H, i_bh % H
    r = tl.arange(0, TC)
    t = i_c * TC + r
    o_k = i_k * BK + tl.arange(0, BK)
    m_k = o_k < K
    m_t = (t < T)[:, None] & m_k[None, :]
    rows = ((i_b * T + t[:, None]) * H + i_h) * K + o_k[None, :]
    x = tl.maximum(tl.load(g + rows, mask=m_t, other=0.0).to(tl.float32), _FLOOR)
    c = i_bh * tl.num_programs(1) + i_c
    G64 = tl.cumsum(x.to(tl.float64), axis=0)
    G = G64.to(gc.dtype.element_ty)  # summed in fp64, kept in gc's dtype
    block = (c * TC + r[:, None]) * K + o_k[None, :]
    if SPAN > 0:  # (past T and K the gates count as 0: G stays the last token's, or 0)
        far = (tl.max(tl.max(tl.abs(G.to(tl.float32)), axis=1), axis=0) > SPAN).to(tl.int32)
        tl.store(flags + c, far)
        tl.store(gc + block, G, mask=m_k[None, :] & (tl.zeros([TC, BK], dtype=tl.int32) + far != 0))
    else:
        tl.store(gc + block, G, mask=m_k[None, :])
    if PREP:
        G_end = tl.sum(tl.where(r[:, None] == TC - 1, G, 0.0), axis=0)
        Q = tl.load(q + rows, mask=m_t, other=0.0).to(tl.float32)
        tl.store(qd + block, Q * tl.exp(G.to(tl.float32)) * scale, mask=m_k[None, :])
        dk = tl.exp((G_end[None, :] - G).to(tl.float32))
        for rk in tl.static_range(RKVP):
            if KDO:
                if rk < RKV:
                    Kr = tl.load(k + (((i_b * T + t[:, None]) * H + i_h) * RKV + rk) * K + o_k[None, :], mask=m_t,
                                 other=0.0).to(tl.float32)
                else:  # a padding row
                    Kr = tl.zeros([TC, BK], dtype=tl.float32)
                tl.store(kd + ((c * TC + r[:, None]) * RKVP + rk) * K + o_k[None, :], Kr * dk, mask=m_k[None, :])
            if KGO:
                if rk >= RKV:
                    Bg = tl.zeros([TC, BK], dtype=tl.float32)
                elif KG_K:  # b_t ⊙ e^{G_{t-1}} = k_t ⊙ e^{G_t}
                    Bg = tl.load(k + (((i_b * T + t[:, None]) * H + i_h) * RKV + rk) * K + o_k[None, :], mask=m_t,
                                 other=0.0).to(tl.float32) * tl.exp(G64.to(tl.float32))
                else:
                    Bg = tl.load(b + (((i_b * T + t[:, None]) * H + i_h) * RKV + rk) * K + o_k[None, :], mask=m_t,
                                 other=0.0).to(tl.float32) * tl.exp((G64 - x.to(tl.float64)).to(tl.float32))
                tl.store(kg + ((c * TC + r[:, None]) * RKVP + rk) * K + o_k[None, :], Bg, mask=m_k[None, :])
        tl.store(dch + c * K + o_k, tl.exp(G_end.to(tl.float32)), mask=m_k)
        if CPART:
            Kr = tl.load(k + rows, mask=m_t, other=0.0).to(tl.float32)
            cc = tl.sum(Kr * Kr * tl.exp(x.to(tl.float32)), axis=1)
            tl.store(cp + (c * tl.num_programs(0) + i_k) * TC + r, cc)
            if HROWS and BK < K:  # c whole: every key block's share in hdla_c's order (the others' k and g from L2)
                cc = tl.zeros([TC], dtype=tl.float32)
                for j0 in tl.static_range(0, K, BK):
                    o_j = j0 + tl.arange(0, BK)
                    m_j = (t < T)[:, None] & (o_j < K)[None, :]
                    r_j = ((i_b * T + t[:, None]) * H + i_h) * K + o_j[None, :]
                    Kj = tl.load(k + r_j, mask=m_j, other=0.0).to(tl.float32)
                    cc += tl.sum(Kj * Kj * tl.exp(tl.load(g + r_j, mask=m_j, other=0.0).to(tl.float32)), axis=1)
            if HROWS:  # (λ = e^{G_t - G_{t-1}} from the stored log-cumsums, as the products kernel takes it)
                Gp = (G64 - x.to(tl.float64)).to(gc.dtype.element_ty)
                be = tl.load(hb + (i_b * T + t) * H + i_h, mask=t < T, other=0.0).to(tl.float32)
                two = ((c * TC + r[:, None]) * 2) * K + o_k[None, :]  # row (t, 0); (t, 1) is K further
                tl.store(ad + two, Kr * dk, mask=m_k[None, :])
                tl.store(ad + two + K, hdla_a2(Kr, tl.exp((G - Gp).to(tl.float32)), be, cc) * dk, mask=m_k[None, :])
                tl.store(kg + two, Kr * tl.exp(G.to(tl.float32)), mask=m_k[None, :])
                tl.store(kg + two + K, Kr * tl.exp(Gp.to(tl.float32)), mask=m_k[None, :])


def chunk_log_cumsum(g: torch.Tensor, chunk_size: int, dtype: torch.dtype = torch.float64, prep=None,
                     c_parts: bool = False, hdla_rows=None, launch=None, flags=None, span: float = 0.0):
    """Chunk-local inclusive log-cumsums of a per-channel log-gate, summed in fp64.

    g: [B, T, H, K] (any float dtype). Returns [B, H, NC, chunk_size, K] in ``dtype`` (fp64, or
    fp32: ``log_cumsum_dtype``) with NC = ceil(T / chunk_size): entry t of chunk n is the sum of g
    over tokens n*C .. n*C + t; past T the gates count as 0. Every per-channel decay inside a
    chunk is the exp of a difference of two of these (``_channel_decays``, ``channel``).

    prep: None, or (q, k, qd, kd, dch, scale[, kg, b]) with q [B, T, H, K], k [B, T, H, Rkv, K] and the chunk
    tensors qd [B, H, NC, C, K], kd [B, H, NC, C * pow2(Rkv), K] (or None: not formed), dch [B, H, NC, K] to fill
    with scale q ⊙ e^G, k ⊙ e^{G_C - G} and e^{G_C} (``chunk_dplr_fwd``'s forms for a per-channel gate)
    in the same pass, and kg (kd's shape, or None) with b ⊙ e^{G_{t-1}} (b of k's shape; b None: b = e^g ⊙ k,
    KDA's, and kg = k ⊙ e^G, b not read).

    c_parts (with prep, k of one row per token: HDLA's): also each key block's share of c = kᵀ(λ ⊙ k) per token,
    λ = e^g, and return (gc, those shares [B, H, NC, key blocks, chunk_size] fp32), from which the products' and intra
    kernels form HDLA's a2 = β k ⊙ (λ - β c) themselves (``chunk_dplr_fwd``'s ``hdla_form_a2``).

    hdla_rows (with c_parts): None, or (β [B, T, H], ad, kg) with ad and kg [B, H, NC, 2 * chunk_size, K] to fill with
    HDLA's update rows [k, a2] ⊙ e^{G_C - G} and [k ⊙ e^{G_t}, k ⊙ e^{G_{t-1}}] (its scaled forward's Ã and
    B ⊙ e^{G_{i-1}}, token-major).
    launch: None, or the kernel's (key block, warps), either None for ``log_cumsum_launch``'s.

    flags ([B, H, NC] int32, with span > 0 and all of K in one key block): set to 1 for the chunks whose log-cumsums
    stray more than ``span`` from 0 (else 0), and only those chunks' log-cumsums are stored (the rest of the
    returned tensor is left unset: ``channel.hdla_row_products``)."""
    B, T, H, K = g.shape
    NC = _cdiv(T, chunk_size)
    gc = torch.empty(B, H, NC, chunk_size, K, device=g.device, dtype=dtype)
    knob = log_cumsum_launch(chunk_size, prep is not None, hdla_rows is not None, launch)
    BK = min(knob[0], max(16, _pow2(K)))
    NKB = _cdiv(K, BK)
    q, k, qd, kd, dch, scale, kg, b = ((*prep, None, None)[:8] if prep is not None
                                       else (gc, gc[..., None, :], gc, gc, gc, 1.0, None, None))
    if c_parts and (prep is None or k.shape[-2] != 1):
        raise ValueError("c_parts: HDLA's shares of c need prep with one row of k per token")
    if hdla_rows is not None and not c_parts:
        raise ValueError("hdla_rows: HDLA's rows need c_parts (their c)")
    hb, ad, hkg = hdla_rows if hdla_rows is not None else (None, None, None)
    if flags is not None and (span <= 0 or NKB != 1):
        raise ValueError(f"flags: the chunks' spans need span > 0 and all of K = {K} in one key block (of {BK})")
    cp = torch.empty(B, H, NC, NKB, chunk_size, device=g.device, dtype=torch.float32) if c_parts else None
    kdo = kd is not None
    _chunk_log_cumsum_kernel[(NKB, NC, B * H)](
        g.contiguous(), gc, T, q, k, qd, kd if kdo else gc, dch, scale, H=H, K=K, TC=chunk_size, BK=BK,
        PREP=prep is not None, RKV=k.shape[-2], RKVP=_pow2(k.shape[-2]),
        kg=hkg if hkg is not None else gc if kg is None else kg,
        b=gc if kg is None or b is None else b, KGO=kg is not None, KDO=kdo, cp=gc if cp is None else cp,
        CPART=c_parts, KG_K=kg is not None and b is None, ad=ad, hb=hb, HROWS=hdla_rows is not None,
        flags=flags, SPAN=float(span) if flags is not None else 0.0, num_warps=knob[1])
    return (gc, cp) if c_parts else gc


def log_cumsum_dtype(precision: str) -> torch.dtype:
    """The per-channel log-cumsums' dtype at a products' precision: fp64 at fp32 accuracy ("tf32x3",
    "ieee"), where a difference of two fp32 log-cumsums of large magnitude (strong decays) could be
    off by more than the products' own error; fp32 where the products are rounded anyway (TF32, bf16:
    an fp32 log-cumsum is off by at most 2^-24 of its magnitude, far below 2^-8), which halves the
    registers and loads of every decay. ``channel._CHANNEL["log_cumsum"]`` overrides it."""
    forced = _CHANNEL["log_cumsum"]
    if forced is not None:
        return forced
    return torch.float64 if precision in ("tf32x3", "ieee") else torch.float32


@triton.jit
def _intra_kernel(
    q, k, v, a, b, g, sa, sv, qd, mqk, mqa, kd, vf, w, uv, ad, dch, tinv, lba, lbk, kf, af, qf, kdec, hb, scale, T, NC,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, KG: tl.constexpr, TC: tl.constexpr,
    RKV: tl.constexpr, RKVP: tl.constexpr, RAB: tl.constexpr, RABP: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, GATE: tl.constexpr, PRECISION: tl.constexpr,
    LP_QK: tl.constexpr, LP_QA: tl.constexpr, LP_BA: tl.constexpr, LP_BK: tl.constexpr, SAVE: tl.constexpr,
    ASC: tl.constexpr, VSC: tl.constexpr, E_B: tl.constexpr, E_V: tl.constexpr, TIED: tl.constexpr = False,
    SCALED: tl.constexpr = False, MERGE: tl.constexpr = "ieee", HDLA: tl.constexpr = False,
    GROUPED: tl.constexpr = False, NILP: tl.constexpr = 0, hmask=None, HH: tl.constexpr = 0, cp=None,
    NKB: tl.constexpr = 1, FORM_A2: tl.constexpr = False, KDA_B: tl.constexpr = False, HG_PROD: tl.constexpr = False,
    HROWS: tl.constexpr = False, UT: tl.constexpr = 0,
):
    # LP_XY: x and y are both 16-bit (their undecayed products are exact in their own dtype).
    # ASC / VSC: a's / v's rows carry the fp32 factors sa / sv, applied to the products' columns
    # and to the loaded rows (so 16-bit a and v stay 16-bit). E_B / E_V: b / v are 16-bit, and
    # T B̃ and L_BK V take two TF32 passes (``chunk_state._dot_ex``), decays and factors moved onto T and L.
    # A decay per row (GATE 0 or 1): the rows' decays to the chunk's end (with a's and v's factors)
    # go to kf and af and q's decays (with the scale) to qf, for the ``RAW`` forms of the state and
    # output kernels, and with SAVE the decays alone to kdec (the backward's K̃ = kdec ⊙ k). A
    # per-channel gate (GATE 2): Q̃, K̃, Ã and V (with its factors) are stored instead.
    # TIED (a = b = k, ranks 1, a decay per row: the delta rule): M_QA = M_QK ⊙ sa and L_BA = L_BK ⊙ sa
    # share their products, so two of the four are taken; M_QA is stored only for the backward (SAVE).
    # SCALED (TIED, no SAVE; ``scaled_update``): the rows' update comes scaled by a's factors D = diag(sa),
    # with D T = T' D for T' = (I + D L_BK)^{-1} and T' D L_BK = I - T': sv ⊙ v - D U = T' (sv ⊙ v - D e^{G_{i-1}}
    # ⊙ K S_0). Only T' (in uv, [NA, NA]) and the rows' factors D e^{G_{i-1}} (in af) are stored; the state
    # kernel takes the rest, so no W, Ũ or L_BK V is formed here. With a per-channel gate (a = k with factors,
    # ``kda``; not TIED) the same: T' from the products' L_BK, and af = D (the decays e^{G_{i-1}} of B are in the
    # log-cumsum kernel's kg).
    # HDLA (a per-channel gate, RAB 2, ``chunk_dplr_fwd``'s ``hdla_beta``: hb [B, T, H]): a1 = β k, b1 = λ ⊙ k
    # and b2 = k are formed from k, and only a's second rows a2 are read (b1 ⊙ e^{G_{t-1}} = k ⊙ e^{G_t}).
    # HDLA with SCALED (``chunk_dplr_fwd``'s ``hdla_scaled``): the update rows are [k, a2] (a1 = β k, so the writes
    # k vᵀ lie on them), D = diag(β, 1) on the products' L_BA rows, T' = (I + D L_BA)^{-1} in uv, D in af,
    # Ã = [k, a2] ⊙ e^{G_C - G} in ad and B ⊙ e^{G_{i-1}} in w (the state kernel's kg).
    # GROUPED (with SCALED; ``chunk_dplr_fwd``'s ``grouped``: a's rows are k split into groups of channels, their
    # sum k, Head-in-Head's): the update's rows are a's, so only M_QA (without a's factors: they are in Y) and
    # T' = (I + D L_BA)^{-1} are formed, no M_QK or L_BK.
    # HH (1: hmask [H, r, r], 2: [B, T, H, r, r]; ``chunk_dplr_fwd``'s ``hh_mask``): a and b are Head-in-Head's rows
    # of k and this mask (``factors.hh_factors``'), formed from k here (``_hh_rows``) and not read.
    # FORM_A2 (with HDLA; ``chunk_dplr_fwd``'s ``hdla_form_a2``): a is not read either; a2 = β k ⊙ (λ - β c) is
    # formed from k, the log-cumsums, β and c (the log-cumsum kernel's shares in cp: ``channel.hdla_c``).
    # HROWS (with HDLA, SCALED and FORM_A2): the log-cumsum kernel wrote Ã and B ⊙ e^{G_{i-1}} (its HROWS), so this
    # kernel forms T' and D alone.
    # KDA_B (a per-channel gate, ranks 1, b = e^g ⊙ k: ``chunk_dplr_fwd``'s ``kda_b``): b is not read, B ⊙ e^{G_{t-1}}
    # is formed as k ⊙ e^{G_t}.
    # HG_PROD (with HH, K / r a power of two of at least 16: ``hh_gram_products``): Head-in-Head's products come from
    # per-group Grams of q and k and the mask's entries (``_hh_grams``), not from its rows.
    # UT (with SAVE, not SCALED; ``chunk_dplr_fwd``'s ``u_from_t``): the state kernels form U_n = T (B̃ S_n + L_BK V)
    # from T (saved anyway), so w holds B̃ = B ⊙ e^{G_{i-1}} itself, not W = T B̃, and no Ũ = T L_BK V is formed.
    # UT 2: T is also stored in uv, in the dtype of the tensors between kernels, for the state kernels to read.
    i_c, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    c = i_bh * NC + i_c  # chunk row of [B, H, NC, ...]
    NK: tl.constexpr = TC * RKVP
    NA: tl.constexpr = TC * RABP
    gc = g + c * TC * KG  # a per-channel gate (GATE 2): g is chunk_log_cumsum's [B, H, NC, TC, K]
    tokq, rkq, tq, vq, fq = _rows(i_b, i_h, i_c, T, H, TC, 1, 1)
    tokk, rkk, tk, vk, fk = _rows(i_b, i_h, i_c, T, H, TC, RKV, RKVP)
    Gq, Gq_ex = _scalar_cumsums(g, i_b, i_h, tq, tokq, rkq, T, H, KG, GATE)
    Gk, _ = _scalar_cumsums(g, i_b, i_h, tk, tokk, rkk, T, H, KG, GATE)
    G_end = tl.sum(Gq - Gq_ex, axis=0)  # the chunk's total log-decay (scalar gate)
    r_q = tl.arange(0, TC)
    r_k = tl.arange(0, NK)

    # O's intra-chunk products (the scale folded in); tied, with L_BA's before its factors. A per-channel
    # gate's products (GATE 2) are in mqk, mqa, lba and lbk already (``channel.channel_product``).
    if TIED:
        M, P = _tied_products(q, k, Gq, Gk, Gq_ex, i_b, i_h, i_c, T, H, K, TC, GATE, BK, PRECISION, LP_QK, LP_BA)
    elif HG_PROD:  # Head-in-Head's products from per-group Grams (``_hh_grams``), decayed where used
        GQ, GK, Mt = _hh_grams(q, k, hmask, i_b, i_h, i_c, T, H, K, TC, RAB, RABP, HH, PRECISION, LP_QK)
        if not GROUPED:
            M = tl.sum(GQ, axis=2) * _decays(Gq, Gk, tokq, tokk, False, GATE)
    elif GATE < 2 and not GROUPED:
        M = _products(q, k, Gq, Gk, i_b, i_h, i_c, T, H, K, TC, 1, 1, RKV, RKVP, False, GATE, BK, PRECISION, LP_QK)
    if GATE < 2 and not GROUPED:
        tl.store(mqk + (c * TC + r_q[:, None]) * NK + r_k[None, :], M * scale)
    if RAB > 0:
        toka, rka, ta, va, fa = _rows(i_b, i_h, i_c, T, H, TC, RAB, RABP)
        r_a = tl.arange(0, NA)
        Ga, Gb = _scalar_cumsums(g, i_b, i_h, ta, toka, rka, T, H, KG, GATE)
        if ASC:
            fac_a = _row_factor(sa, fa, va)
        if GATE < 2 and (SAVE or not TIED):  # tied, the output kernel forms M_QA U from M_QK itself
            if HG_PROD:
                M = tl.reshape(GQ, (TC, NA)) * _decays(Gq, Ga, tokq, toka, False, GATE)
            elif not TIED:  # tied, M_QA is M_QK times a's factors
                M = _products(q, a, Gq, Ga, i_b, i_h, i_c, T, H, K, TC, 1, 1, RAB, RABP, False, GATE, BK, PRECISION,
                              LP_QA, k, hmask, 0, 1 if HH else 0, HH)
            if ASC and not GROUPED:
                M = M * fac_a[None, :]
            tl.store(mqa + (c * TC + r_q[:, None]) * NA + r_a[None, :], M * scale)
        # The UT transform: (I + L_BA) U = (B ⊙ e^{G_{i-1}}) S_0 + L_BK V
        if GATE < 2:
            if HG_PROD:  # L_BA[(t, j), (s, i)] = M_t[j, i] G^k_i[t, s]
                P = tl.reshape(Mt[:, :, None, :] * GK[:, None, :, :], (NA, NA)) * _decays(Gb, Ga, toka, toka, True,
                                                                                         GATE)
            elif not TIED:
                P = _products(b, a, Gb, Ga, i_b, i_h, i_c, T, H, K, TC, RAB, RABP, RAB, RABP, True, GATE, BK,
                              PRECISION, LP_BA, k, hmask, 2 if HH else 0, 1 if HH else 0, HH)
            L = P
            if SCALED:  # D L_BK: a's factors on the rows
                L = L * fac_a[:, None]
            elif ASC:
                L = L * fac_a[None, :]
            # saved, and read back by the inverse, which reads only the blocks on and below the diagonal:
            # without SAVE the 16 x 16 blocks above it (zeros) are not written
            m_lba = (r_a[:, None] // 16 >= r_a[None, :] // 16) | SAVE
            tl.store(lba + (c * NA + r_a[:, None]) * NA + r_a[None, :], L, mask=m_lba)
        elif SCALED:  # a per-channel gate: D on the rows of the products' L, D into af (B's decays are in kg's rows)
            if HDLA:  # update rows [k, a2]: D = diag(β, 1) on L_BA (taken without β)
                fac_d = tl.where(rka == 0, tl.load(hb + fa // 2, mask=va, other=0.0).to(tl.float32), 1.0)
                L = tl.load(lba + (c * NA + r_a[:, None]) * NA + r_a[None, :])
            else:  # a = k with factors (``kda``): D = diag(sa) on L_BK
                fac_d = fac_a
                L = tl.load(lbk + (c * NA + r_a[:, None]) * NK + r_k[None, :])
            tl.store(lba + (c * NA + r_a[:, None]) * NA + r_a[None, :], L * fac_d[:, None],
                     mask=r_a[:, None] // 16 >= r_a[None, :] // 16)
            tl.store(af + c * NA + r_a, fac_d)
        Tinv = _unit_lower_inverse(lba + c * NA * NA, tinv + c * NA * NA, NA, MERGE, NILP)
        if TIED:  # L_BK is L_BA before a's factors (unused in the scaled form)
            L = P
        elif not SCALED:  # L_BK (the scaled forms read none)
            if HG_PROD:  # L_BK[(t, j), s] = Σ_i M_t[j, i] G^k_i[t, s] (formed again: not held across the inverse)
                L = (tl.reshape(tl.sum(Mt[:, :, None, :] * GK[:, None, :, :], axis=3), (NA, NK))
                     * _decays(Gb, Gk, toka, tokk, True, GATE))
            elif GATE < 2:
                L = _products(b, k, Gb, Gk, i_b, i_h, i_c, T, H, K, TC, RAB, RABP, RKV, RKVP, True, GATE, BK,
                              PRECISION, LP_BK, k, hmask, 2 if HH else 0, 0, HH)
            else:
                L = tl.load(lbk + (c * NA + r_a[:, None]) * NK + r_k[None, :])
        if SCALED or UT == 2:  # T' (or T) itself, for the state kernels (in uv's place)
            tl.store(uv + (c * NA + r_a[:, None]) * NA + r_a[None, :], Tinv)
        if SAVE:  # for the backward: T (but for UT 2's copy in uv, which the backward reads), L_BA and L_BK
            if UT != 2:  # (tinv is then the inverse's scratch alone: its blocks above the diagonal stay unwritten)
                tl.store(tinv + (c * NA + r_a[:, None]) * NA + r_a[None, :], Tinv)
            if GATE < 2:
                tl.store(lbk + (c * NA + r_a[:, None]) * NK + r_k[None, :], L)
    # V in the chunk layout the state kernel reads and, with a low-rank decay, Ũ = T L_BK V
    if VSC:
        fac_v = _row_factor(sv, fk, vk)
        if RAB > 0 and not SCALED and not UT:
            L = L * fac_v[None, :]  # Ũ = T (L_BK ⊙ sv) v, with v as given (L_BK is saved above)
    # (none in the scaled forms; with UT only a per-channel gate's V with its factors, no Ũ)
    for v0 in tl.static_range(0, V if not SCALED and (not UT or (GATE == 2 and VSC)) else 0, BV):
        o_v = v0 + tl.arange(0, BV)
        m_v = o_v < V
        V16 = _load_rows(v, fk, vk, o_v, m_v, V)
        if VSC:
            Vr = V16 * fac_v[:, None]
        else:
            Vr = V16
        if GATE == 2 and VSC:  # without factors the later kernels read v as given (RAW_V)
            tl.store(vf + (c * NK + r_k[:, None]) * V + o_v[None, :], Vr, mask=m_v[None, :])
        if RAB > 0 and not UT:
            LV = _dot_ex(L, V16, PRECISION, E_V)
            tl.store(uv + (c * NA + r_a[:, None]) * V + o_v[None, :], _dot(Tinv, LV, PRECISION),
                     mask=m_v[None, :])

    # Per key channel: W = T (B ⊙ e^{G_{i-1}}), and with a per-channel gate A ⊙ e^{G_C - G} (Q̃, K̃ and
    # e^{G_C} come from ``chunk_log_cumsum``); with a decay per row, K's, A's and Q's decays as row factors
    if RAB > 0 and GATE == 1 and not UT:
        Tinv_b = Tinv * tl.exp(Gb.to(tl.float32))[None, :]  # W = (T e^{G_{i-1}}) B: B as given
    if GATE != 2:
        if GATE == 1:
            dec_k = tl.exp((G_end - Gk).to(tl.float32))
            tl.store(qf + c * TC + r_q, tl.exp(Gq.to(tl.float32)) * scale)
        else:
            dec_k = tl.full([NK], 1.0, tl.float32)
            tl.store(qf + c * TC + r_q, tl.full([TC], 1.0, tl.float32) * scale)
        if SAVE:
            tl.store(kdec + c * NK + r_k, dec_k)
        if VSC and not SCALED:
            tl.store(kf + c * NK + r_k, dec_k * fac_v)
        else:
            tl.store(kf + c * NK + r_k, dec_k)
        if SCALED:  # the rows' factors D e^{G_{i-1}} of K S_0
            if GATE == 1:
                tl.store(af + c * NA + r_a, fac_a * tl.exp(Gb.to(tl.float32)))
            else:
                tl.store(af + c * NA + r_a, fac_a)
        elif RAB > 0:
            fa_end = tl.full([NA], 1.0, tl.float32)
            if ASC:
                fa_end = fa_end * fac_a
            if GATE == 1:
                fa_end = fa_end * tl.exp((G_end - Ga).to(tl.float32))
            tl.store(af + c * NA + r_a, fa_end)
    if HDLA:
        if SCALED:  # the update rows are [k, a2] (β is on L_BA's rows)
            be = tl.full([NA, 1], 1.0, tl.float32)
        else:
            be = tl.load(hb + fa // 2, mask=va, other=0.0).to(tl.float32)[:, None]  # the row's token's β
        if FORM_A2 and not HROWS:  # a2's β and c, per row
            bt = tl.load(hb + fa // 2, mask=va, other=0.0).to(tl.float32)
            ct = hdla_c(cp, c, toka, va, NKB, TC)
    for k0 in tl.static_range(0, K if (not SCALED or HDLA) and not HROWS else 0, BK):
        o_k = k0 + tl.arange(0, BK)
        m_k = o_k < K
        if HDLA:
            if FORM_A2:
                Gt = _gc_at(gc, toka, toka >= 0, o_k, m_k, KG)
                Gp = _gc_at(gc, toka - 1, toka > 0, o_k, m_k, KG)  # G_{-1} = 0
                Kt = _load_rows(k, fa // 2, va, o_k, m_k, K)
                A = tl.where((rka == 0)[:, None], be * Kt, hdla_a2(Kt, tl.exp((Gt - Gp).to(tl.float32)), bt, ct))
                Gc = _gc_at(gc, toka * 0 + TC - 1, toka >= 0, o_k, m_k, KG)  # to the chunk's end
                A = A * tl.exp((Gc - Gt).to(tl.float32))
                Bm = Kt * tl.exp(tl.where((rka == 0)[:, None], Gt, Gp).to(tl.float32))
            else:
                Kt, A = _hdla_rows(k, a, be, fa, va, rka, o_k, m_k, K)
                A = A * _channel_decays(gc, toka, o_k, m_k, KG, TC, True, False)
                # b_r ⊙ e^{G_{t-1}}: k ⊙ e^{G_t} (r = 0), k ⊙ e^{G_{t-1}} (r = 1; G_{-1} = 0)
                Bm = Kt * tl.exp(_gc_at(gc, toka - rka, toka - rka >= 0, o_k, m_k, KG).to(tl.float32))
            tl.store(ad + (c * NA + r_a[:, None]) * K + o_k[None, :], A, mask=m_k[None, :])
            if SCALED or UT:  # B ⊙ e^{G_{i-1}} itself, for the state kernels (in w's place; the scaled form's kg)
                tl.store(w + (c * NA + r_a[:, None]) * K + o_k[None, :], Bm, mask=m_k[None, :])
            else:
                tl.store(w + (c * NA + r_a[:, None]) * K + o_k[None, :], _dot(Tinv, Bm, PRECISION),
                         mask=m_k[None, :])
        elif RAB > 0:
            if HH:
                Bm = _hh_rows(k, hmask, b, fa, va, rka, i_h, o_k, m_k, K, RAB, HH, True)
            elif KDA_B:  # B ⊙ e^{G_{t-1}} = K ⊙ e^{G_t} (ranks 1: a's rows are k's), its decays below
                Bm = _load_rows(k, fa, va, o_k, m_k, K)
            else:
                Bm = _load_rows(b, fa, va, o_k, m_k, K)
            if UT and GATE == 1:  # B̃ itself: B with its rows' decays
                W = Bm * tl.exp(Gb.to(tl.float32))[:, None]
            elif GATE == 1:
                W = _dot_ex(Tinv_b, Bm, PRECISION, E_B)
            elif GATE == 2:
                A = _load_rows(a, fa, va, o_k, m_k, K)
                if ASC:
                    A = A * fac_a[:, None]
                A = A * _channel_decays(gc, toka, o_k, m_k, KG, TC, True, False)
                tl.store(ad + (c * NA + r_a[:, None]) * K + o_k[None, :], A, mask=m_k[None, :])
                Bm = Bm * _channel_decays(gc, toka, o_k, m_k, KG, TC, False, not KDA_B)
                W = Bm if UT else _dot(Tinv, Bm, PRECISION)
            else:
                W = Bm if UT else _dot_ex(Tinv, Bm, PRECISION, E_B)
            tl.store(w + (c * NA + r_a[:, None]) * K + o_k[None, :], W, mask=m_k[None, :])
    if GATE == 1:
        tl.store(dch + c + tl.arange(0, 1), tl.exp(G_end.to(tl.float32)) + tl.zeros([1], dtype=tl.float32))


@triton.jit
def _output_kernel(
    s0, v, u, o, T, NC, qd, qf, mqk, mqa, sv, sa,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, TC: tl.constexpr, NK: tl.constexpr, NA: tl.constexpr,
    RKV: tl.constexpr, RKVP: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PRECISION: tl.constexpr,
    RAW: tl.constexpr, VSC: tl.constexpr, E_Q: tl.constexpr, E_V: tl.constexpr, TIED: tl.constexpr = False,
    ASC: tl.constexpr = False, VALUES: tl.constexpr = False,
):
    # O = Q̃ S_n + M_QK (sv ⊙ v) - M_QA U_n, with v as given (its factors on M_QK's columns, so a
    # 16-bit v takes two TF32 passes, ``_dot_ex``). RAW: qd is q [B, T, H, K] as given and
    # Q̃ = qf ⊙ q, the factors applied to Q S_n's rows. TIED (the intra kernel's; M_QA = M_QK ⊙ sa):
    # O = Q̃ S_n + M_QK (sv ⊙ v - sa ⊙ U_n), one product. VALUES (the scaled form's, ``scaled_update``): u holds
    # the chunk's whole value update Y = sv ⊙ v - sa ⊙ U_n from the state kernel, and O = Q̃ S_n + M_QK Y.
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
        S = tl.load(s0 + (c * K + o_k[:, None]) * V + o_v[None, :], mask=m_k[:, None] & m_v[None, :],
                    other=0.0).to(tl.float32)
        acc += _query_state(qd, qf, S, c, i_bh, i_c, T, H, TC, K, o_k, m_k, RAW, E_Q, PRECISION)
    if VALUES:  # Y's rows are k's
        Y = tl.load(u + (c * NK + r_k[:, None]) * V + o_v[None, :], mask=m_v[None, :], other=0.0).to(tl.float32)
        acc += _dot(_chunk_cols(mqk, c, r_q, r_k, r_k < NK, TC, NK), Y, PRECISION)
    else:
        Vr = _raw_rows(v, r_k, i_bh, i_c, T, H, TC, RKV, RKVP, o_v, m_v, V)
        if TIED:  # U's rows are k's
            U = tl.load(u + (c * NK + r_k[:, None]) * V + o_v[None, :], mask=m_v[None, :], other=0.0).to(tl.float32)
        else:  # (unused)
            U = Vr
        acc += _values_out(mqk, c, r_q, r_k, r_k < NK, Vr, U, sv, sa, i_bh, i_c, T, H, TC, NK, RKV, RKVP, TIED, VSC,
                           ASC, E_V, PRECISION)
    if NA > 0 and not TIED and not VALUES:
        r_a = tl.arange(0, NA)
        U = tl.load(u + (c * NA + r_a[:, None]) * V + o_v[None, :], mask=m_v[None, :], other=0.0).to(tl.float32)
        acc -= _dot(_chunk_cols(mqa, c, r_q, r_a, r_a < NA, TC, NA), U, PRECISION)
    t = i_c * TC + r_q
    tl.store(o + ((i_b * T + t[:, None]) * H + i_h) * V + o_v[None, :], acc, mask=(t < T)[:, None] & m_v[None, :])


# Module-wide overrides of chunk_dplr_fwd's _config (benchmarks, debugging). "stored" / "stored_state":
# the dtype of the per-chunk tensors one kernel hands another as a product's operand (W, Ũ, the M
# tiles, the decayed inputs / S_n and U_n, and with them dS and dU in the backward). By default
# (``stored_dtype``) bf16 where the products take bf16 operands anyway (matmul precision "medium"),
# which halves that traffic and costs only Ũ's and U's rounding, else fp32. Every kernel takes
# those tensors to fp32 as it loads them. Not at K > 128, whose state kernels take a 32-wide value
# block: on the H100 with Triton 3.6 that block, with bf16 W and S_n, was miscompiled (wrong
# results, out-of-range shared reads under compute-sanitizer), BENCHMARKS.md sessions 13 and 14.
# Launch knobs: "intra_warps", "intra_bk" (the intra kernel's key block), "output_bv" (the output
# kernel's value block), "output_warps", "fuse_output" (True / False: the outputs from the state kernel
# or the output kernel; None, the default: ``fuse_output``'s choice), "state_stages" (the state kernel's
# num_stages; None, the default: ``state_stages``'s choice), "scaled" (False: not ``scaled_update``'s form),
# "intra_maxnreg" (the intra kernel's register cap; 0: the compiler's; absent: ``intra_registers``'s choice),
# "state_bv" (the forward state kernel's value block; None: ``state_value_block``'s choice),
# "merge" ("ieee", the default, or "tf32": the UT inverse's block merges), "tie_a_k" (0: a = k with factors
# (``kda``) takes its four per-channel products apart, forward and backward, as before they were paired),
# "neumann" (True / False: the UT inverse's diagonal blocks as Neumann products or by substitution; None, the
# default: ``neumann_blocks``'s choice), "rows" (32, 64 or 128: the rows of a chunk tile, tokens times the padded
# rank, ``fused_chunk_size``'s; absent: ``MAX_ROWS``), "channel_rows" (the same for a per-channel gate with a
# low-rank decay, before "rows": 32, the default, gives KDA 32-token chunks and HDLA 16; 64 gives them 64 and 32),
# "segments" (the segments of each sequence's chunks that the state kernel walks in parallel; 1: one walk; absent:
# ``segments``' rule), "form_a2" (0: HDLA's forward without autograd builds a2 with the factor kernel, as before
# its kernels formed it: ``chunk_bwd.chunk_hdla``, ``chunk_dplr_fwd``'s ``hdla_form_a2``), "kda_pair" (0: KDA's
# per-channel products in two kernels, M_QK and L_BK (with autograd, and their scaled twins M_QA and L_BA) apart,
# as before ``channel_product``'s x2 took them in one; 1, the default: one kernel), "kda_rows" (1, the default: KDA's
# training backward forms b = e^g ⊙ k in step 4 and carries a's and b's gradients on to k and g there,
# ``chunk_bwd.chunk_dplr``, H100 KDA forward+backward 5.30-5.32 -> 4.80-4.82 ms, BENCHMARKS.md session 46; 0: autograd
# takes them through b's factor kernel, as before), "kda_pair_bwd" (1, the default, with kda_rows: the backward takes
# the four per-channel products' gradients in one pass too, b's rows as k's through G_t, ``channel_product_bwd``'s x2,
# H100 KDA forward+backward 4.80-4.82 -> 4.62-4.63 ms, BENCHMARKS.md session 47; 0: two passes), "hdla_finish" (1, the
# default: HDLA's step 4 also adds the rows' share through c = kᵀ(λ⊙k) and forms dβ, in each chunk's last key block to
# be done, ``chunk_bwd._grad_kernel``'s HFIN; 0: ``factors.hdla_factors_finish``, a kernel of its own, after it),
# "hh_sparse_inputs" (1, the default: Head-in-Head's inputs' kernel by groups reads and multiplies only its key
# block's groups' rows of U, ``chunk_bwd._block_groups``, H100 HH-GDN r=4 forward+backward 6.99-7.03 -> 6.91-6.94
# ms, BENCHMARKS.md session 47; 0: all of them, masked after), "hh_grams" (1, the default: Head-in-Head's products in
# the intra kernel from per-group Grams of q and k, ``hh_gram_products``, H100 HH-GDN r=4 intra 1.23 -> 1.12 ms,
# session 47; 0: from its rows), "hdla_cumsum_rows" (1, the default: HDLA's scaled forward without autograd takes
# its rows Ã and B ⊙ e^{G_{i-1}} from the log-cumsum kernel, ``chunk_log_cumsum``'s hdla_rows; 0: the intra kernel
# forms them), "hdla_cumsum_bk" and "hdla_cumsum_warps" (that kernel's key block and warps there; absent:
# ``log_cumsum_launch``'s), "hdla_row_products" (1, the default: with those rows, HDLA's products from them,
# ``channel.hdla_row_products``, the log-cumsums stored only for the chunks it leaves to the levels; 0: the products
# kernel from q, k and the log-cumsums), "u_from_t" (True / False: the training forward's state kernels form U_n from
# T and the intra kernel forms neither W nor Ũ, or not; None, the default: ``u_from_t``'s choice), "u_from_t_16"
# (1 / 0: with it, T for the state kernels in the 16-bit dtype of the tensors between kernels, or in fp32; None, the
# default: ``u_from_t_16``'s choice).
_KNOBS: dict = {}
# every name _KNOBS and chunk_dplr_fwd's _config may hold (the comment above; "precision" / "state_precision": the
# products' precision of every kernel / of the state kernels, "intra_warps": the intra kernel's, "tie_a_k": below,
# ``ties_keys``' and ``pairs_keys``'); ``check_knobs`` refuses the rest, so that a misspelt knob is not silently a no-op
KNOB_NAMES = frozenset({
    "channel_rows", "form_a2", "fuse_output", "hdla_cumsum_bk", "hdla_cumsum_rows", "hdla_cumsum_warps", "hdla_finish",
    "hdla_products", "hdla_row_products", "hh_grams", "hh_sparse_inputs", "intra_bk", "intra_maxnreg", "intra_warps",
    "kda_pair", "kda_pair_bwd", "kda_rows", "merge", "neumann", "output_bv", "output_warps", "precision", "rows",
    "scaled", "segments", "state_bv", "state_maxnreg", "state_precision", "state_stages", "stored", "stored_state",
    "tie_a_k", "u_from_t", "u_from_t_16",
})


def check_knobs(knobs: dict, where: str = "chunk_fwd._KNOBS") -> None:
    """Raises ValueError naming every key of ``knobs`` that is not a knob (``KNOB_NAMES``)."""
    unknown = sorted(set(knobs) - KNOB_NAMES)
    if unknown:
        raise ValueError(f"{where}: no knob named {', '.join(map(repr, unknown))}; the knobs are {sorted(KNOB_NAMES)}")


def hdla_fused_products(precision: str, cfg: dict | None = None) -> bool:
    """Whether HDLA's products (``hdla_beta``) are taken as six of token rows, in the forward
    (``channel.hdla_products``) and the backward (``channel.hdla_products_bwd``): where they are bf16's. At fp32
    accuracy the one kernel spills and was slower (H100 HDLA forward: 11.8 -> 17.0 ms; BENCHMARKS.md session
    28). ``_KNOBS["hdla_products"]`` True / False forces either way."""
    return (_KNOBS if cfg is None else cfg).get("hdla_products", precision.startswith("bf16"))


def stored_dtype(precision: str, K: int, device: torch.device) -> torch.dtype:
    """The default dtype of the tensors between the fused kernels (``_KNOBS``): bf16 on a GPU at
    the "bf16" products' precision with K <= 128, else fp32."""
    return torch.bfloat16 if precision == "bf16" and K <= 128 and device.type == "cuda" else torch.float32


def fuse_output(programs: int, device: torch.device, scalable: bool = False, save: bool = False,
                chunk_size: int = 64, channel_rank: bool = False) -> bool:
    """Whether the state kernel forms the outputs itself (``_state_fwd_kernel``'s FUSE_O) rather than a
    separate output kernel, one program per chunk: where its ``programs`` (value blocks x sequences x
    heads) alone fill every SM of the GPU. Fused, S_n and U_n need not be written out (without the
    backward) nor read back; with fewer programs the output kernel's parallelism over chunks wins.
    ``scalable``: the delta rule's forward without the backward, which fused takes the scaled form
    (``scaled_update``); that wins at every grid measured (H100 GDN forward, µs of GPU time: B2 T8192
    1122 -> 639, B1 T32768 3253 -> 1928, B1 T4096 422 -> 257; BENCHMARKS.md session 25), so it is fused
    whatever the grid. Not where the backward follows (``save``) with chunks under 64 tokens (``chunk_size``: ranks
    above 1): S_n and U_n are stored for the backward anyway, so the output kernel only reads them back, while
    the outputs' products would lengthen a walk over twice as many chunks or more. H100 forward+backward, ms:
    HDLA (32-token chunks) 8.71 -> 8.55, its state kernel 0.87 -> 0.47 plus 0.22 for the output kernel; HH-GDN
    (16) 9.92 -> 9.88; at 64 tokens fused stays faster (GDN 2.25 against 2.35, GLA 2.31 against 2.35), and so
    does HDLA's forward alone (3.06 against 3.10; BENCHMARKS.md session 30). Nor with a per-channel gate and a
    low-rank decay (``channel_rank``) at 64-token chunks (KDA: the state kernel with the outputs took 566 µs, without
    them 242 plus 166 for the output kernel; BENCHMARKS.md session 33), but for its scaled form (KDA's forward
    alone, ``scalable``: 247 µs with the outputs against 189 plus 126; session 34). Off on the CPU (the
    interpreter: the tests force each form, ``_KNOBS["fuse_output"]``)."""
    if device.type != "cuda" or (save and chunk_size < 64) or (channel_rank and chunk_size >= 64 and not scalable):
        return False
    return scalable or programs >= _sm_count(device)


def state_value_block(scaled: bool, BV: int, sequences_heads: int, V: int, device: torch.device,
                      tied_save: bool = False, K: int = 128) -> int:
    """The state kernel's value block: ``_blocks``'s ``BV``, or 32 in place of 64 for the scaled form
    (``scaled_update``) where the 64-wide grid (value blocks x ``sequences_heads``) leaves SMs idle, to double
    its programs. H100 GDN forward, state kernel µs: B1 T32768 1399 -> 1251, B2 T8192 373 -> 336, and at
    B8 T2048 (a full grid) 148 -> 203, so not there; the results were bitwise the same (BENCHMARKS.md
    session 25). The 32-wide block that Triton 3.6 miscompiled (sessions 13, 14) had bf16 W tiles, which
    the scaled form does not read.

    16 in place of 32 for the delta rule's walk before the backward (``tied_save``: Gated DeltaNet's, DeltaNet's,
    Gated DeltaProduct's training) at K > 128, where its [K, 32] state and row tiles spill (sm_90: 1628 bytes at
    K = V = 256, none on 16). H200, B4 T2048 H16 K = V = 256 bf16: 3.11 -> 2.40 ms (BENCHMARKS.md session 60). Not
    for its forward without autograd (1.81 -> 2.00 ms) nor for the other mechanisms' walks (KDA 1.27 -> 1.92, HDLA
    2.31 -> 3.50, Head-in-Head 5.40 -> 8.03), nor for the backward's walk (Gated DeltaNet 1.25 -> 1.27)."""
    if tied_save and not scaled and K > 128 and BV == 32 and device.type == "cuda":
        return 16
    if scaled and BV == 64 and device.type == "cuda" and _cdiv(V, 64) * sequences_heads < _sm_count(device):
        return 32
    return BV


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def state_stages(fuse: bool, tied: bool, precision: str, k: torch.Tensor, v: torch.Tensor,
                 per_channel: bool = False, channel_scaled: bool = False, low_rank: bool = True,
                 hh: bool = False) -> int:
    """The forward state kernel's ``num_stages``, where its tiles allow more than one (the bf16 products' precision,
    16-bit k and v, K <= 128; elsewhere fp32 tiles overflowed shared memory); with more, the next chunk's tiles load
    during this chunk's products. BENCHMARKS.md has each figure (sessions 23, 24, 31, 35, 50, 57, 59).

    - 3 for a per-channel gate's scaled form (``channel_scaled``: KDA's and HDLA's forward without autograd), whose
      chunks carry the most tiles: H100 state kernel KDA 364 -> 220 µs, HDLA 399 -> 362.
    - 2 for a walk that forms the outputs (``fuse``) with the delta rule's rows (``tied``: H100 GDN 231 -> 197 µs;
      Head-in-Head's scaled form over a's rows, passed as tied: 784 -> 501) or with a per-channel gate and no
      low-rank decay (GLA: H200 137 -> 108 µs).
    - 2 for a walk that stores the states for the output kernel or the backward (not ``fuse``) with a per-channel
      gate (H100 HDLA 465 -> 432 µs), the delta rule's rows (where the grid is too small to fuse: H200 GDN training
      B2 T8192 399 -> 341 µs, B1 T32768 782 -> 685) or Head-in-Head's rows formed from k (``hh``: H200 984 -> 943).
    - 1 elsewhere: HDLA's fused walk and the engine's own rows at a scalar gate (H200, Rab 2 and Rkv 2: 516 µs on 1
      against 743 on 2 storing the states, 619 against 773 fused; Rab 2 Rkv 1 466 against 485; Rab 4 Rkv 1 888
      against 874, within 2 %)."""
    tiles = precision.startswith("bf16") and _is16(k) and _is16(v) and k.shape[-1] <= 128
    if tiles and channel_scaled:
        return 3
    if fuse:  # with the outputs: the delta rule's, or a per-channel gate without a low-rank decay (GLA)
        ok = tied or (per_channel and not low_rank)
    else:  # storing S_n (and U_n) for the output kernel or the backward; not for general rows of their own
        ok = per_channel or tied or hh
    ok = ok and tiles
    return 2 if ok else _LAUNCH["stages"]


def state_warps(hh: bool, K: int) -> int:
    """The forward state kernel's warps: ``chunk_state._LAUNCH["warps"]`` (4), but 8 for Head-in-Head's rows (``hh``:
    formed from k in the kernel, with autograd or without) at K > 128, where on 4 its state and rows spill (sm_90: 1700
    bytes at K = V = 256, 376 on 8). H200, B4 T2048 H16 K = V = 256 bf16 (BENCHMARKS.md session 59): the walk before
    the backward 6.67 -> 5.43 ms, the whole forward without autograd 13.7 -> 8.1 ms. Not for the others: Gated
    DeltaNet's forward 2.10 -> 3.25 ms, KDA's and HDLA's walks 1.27 -> 1.96 and 2.32 -> 3.77; nor for the backward's
    walk, which took 3.65 -> 5.43 for Head-in-Head."""
    return 8 if hh and K > 128 else _LAUNCH["warps"]


def intra_warps(hdla: bool, neumann: bool = True, hh: bool = False, K: int = 128) -> int:
    """The intra kernel's warps: 4, but 2 for HDLA's rows formed in the kernel (``hdla_fused_products``) with the
    UT inverse's diagonal blocks by substitution (``neumann``: ``neumann_blocks``; H100 HDLA, B8 T2048 H16
    K=V=128: 0.872 -> 0.812 ms; BENCHMARKS.md session 31), and 2 for Head-in-Head (``hh``): on 4 warps its kernel
    holds 248 registers a thread, so two programs share an SM; on 2, at 255 and 144 bytes of spills (sm_90), four do
    (H200 HH-GDN r=4 in training: 0.835 -> 0.714 ms; session 58), up to K = 128: at K = V = 256 it spills 660 bytes
    on 2 and 28 on 4 (B4 T2048 H16: 1.65 ms on 2, 0.90 on 4; session 59). With the Neumann blocks HDLA's takes 617 µs
    on 4 warps against 838 on 2 (session 35). GDN (0.42 against 0.65 ms on 2), Gated DeltaProduct (1.09 against 2.81)
    kept 4 (session 31); HH-GDN, 1.70 either way then, before its rows were formed in the kernel (session 39)."""
    return 2 if (hdla and not neumann) or (hh and K <= 128) else 4


def neumann_blocks(knob=None) -> bool:
    """Whether the UT inverse's 16 x 16 diagonal blocks are taken as Neumann products (``_unit_lower_inverse``'s
    NILP) rather than by forward substitution: each block holds 16 / Rab tokens and couples a row only to earlier
    tokens' rows, so L_ii^(16 / Rab) = 0 and (I + L_ii)^{-1} = (I - L_ii)(I + L_ii^2)(I + L_ii^4)...: two to six
    exact batched [16, 16] products in place of 15 dependent row steps. H100, intra kernel µs (B8 T2048 H16
    K=V=128 bf16): Gated DeltaNet 235 -> 188, HH-GDN r=4 872 -> 616, Gated DeltaProduct 452 -> 364, KDA 148 -> 108,
    HDLA 795 -> 617 (on 4 warps: ``intra_warps``); results within 2e-7 of the substitution's at fp32 accuracy
    (BENCHMARKS.md session 35). ``knob`` (``_KNOBS["neumann"]``) False takes the substitution."""
    return True if knob is None else bool(knob)


def scaled_update(tied: bool, one_block: bool, fuse: bool, save: bool, knob=None) -> bool:
    """Whether the delta rule's forward takes its rows' update already scaled by a's factors (the kernels'
    SCALED): with D = diag(a_scale), D T = T' D for T' = (I + D L_BK)^{-1}, and T' D L_BK = I - T', so the
    chunk's whole value update is sv ⊙ v - D U = T' (sv ⊙ v - D e^{G_{i-1}} ⊙ K S_n). The intra kernel then
    inverts I + D L_BK and stores T' alone: no L_BK V, W or Ũ (three [64, 64] x [64, 128] products and 32 KB
    per chunk less), and the state kernel forms that update from k, v and T' in one more [64, 64] product.
    H100 GDN forward: intra kernel 357 -> 264 µs, state kernel 199 -> 148 µs (BENCHMARKS.md session 25).
    Only for ``tied`` keys whose chunk rows are ``one_block`` of the state kernel's (``_blocks``' BCA = NA: K <=
    128), since each of its programs reads T' whole; with the outputs formed in the state kernel (``fuse``);
    and with nothing saved (``save``): the backward and the output kernel read T and U_n themselves.
    ``knob`` (``_KNOBS["scaled"]``): False turns it off. ``chunk_dplr_fwd`` also takes this form for a per-channel
    gate where a is k with factors (``kda``; its ``channel_scaled``): there T' comes from the products' L_BK, the
    state kernel reads B ⊙ e^{G_{i-1}} from the log-cumsum kernel, and the output kernel can read S_n and the value
    update instead (H100 KDA forward: intra kernel 508 -> 147 µs, 1.95 -> 1.39 ms; BENCHMARKS.md session 34). And
    for HDLA's rows (``hdla_scaled``) over its update rows [k, a2]: a1 = β k, so the writes k vᵀ lie on them, with
    D = diag(β, 1) on the rows of L_BA taken without β; the intra kernel stores T', Ã and B ⊙ e^{G_{i-1}} (no W, Ũ,
    M_QK or L_BK). H100 HDLA forward: intra 615 -> 366 µs, state 618 -> 434 (374 on two stages), 2.48 -> 1.92 ms
    (session 35)."""
    return tied and one_block and fuse and not save and (knob is None or bool(knob))


def u_from_t(gate: int, tied: bool, hh: bool, knob=None) -> bool:
    """Whether the training forward's state kernels form each chunk's U_n = T (B̃ S_n + L_BK V) from T themselves
    (``_state_fwd_kernel``'s UT), so that the intra kernel forms neither W = T B̃ nor Ũ = T L_BK V and w holds B̃ =
    B ⊙ e^{G_{i-1}}; the backward's state kernel then takes Wᵀ dU_n as B̃ᵀ (Tᵀ dU_n) and hands dX_n = Tᵀ dU_n to the
    values kernel, which no longer forms it. One more [rows, rows] product on each walk's chain, for less work and
    traffic in the intra and values kernels: on for a per-channel gate (``gate`` 2) and for Head-in-Head's rows
    (``hh``), where measured faster. H100, bf16, B8 T2048 H16 K=V=128, forward+backward ms (BENCHMARKS.md session
    52): HDLA 5.52-5.56 -> 5.28 (intra 0.45 -> 0.26, values 0.38 -> 0.31, state kernels 1.13 -> 1.13), KDA 4.03-4.04
    -> 3.89-3.90, HH-GDN r=4 6.65-6.68 -> 6.61-6.63 (its walks 1.59 -> 2.01 ms, intra and values 1.74 -> 1.27);
    Gated DeltaNet (``tied``: 64-token chunks, whose intra kernel had less of it to save) 2.17 -> 2.20, so not
    there. ``knob`` (``_KNOBS["u_from_t"]``) True / False forces it; it needs the chunk's rows in one block of the
    state kernels' (``chunk_dplr_fwd`` checks)."""
    if knob is not None:
        return bool(knob)
    return (gate == 2 or hh) and not tied


def u_from_t_16(stored: torch.dtype, knob=None) -> bool:
    """Whether, with ``u_from_t``, the intra kernel stores T for the state kernels in ``stored``, the dtype of the
    tensors between kernels, and the backward's state kernel reads that copy (else both read T in fp32): by default
    where that is bf16, as on a GPU at the bf16 products' precision, whose products round T to bf16 anyway, so the
    results are the same for half of T's reads. bf16 has fp32's range; fp16 (only by ``_KNOBS["stored"]``) has not,
    and T's entries are not bounded by 1, so it takes fp32 unless forced. H100, bf16, B8 T2048 H16 K=V=128,
    forward+backward ms, alternated (BENCHMARKS.md session 53): HH-GDN r=4 6.64-6.65 -> 6.52-6.53 (its state
    kernels 1.09 + 0.91 -> 1.04 + 0.84), HDLA 5.27-5.34 -> 5.26-5.30, KDA 3.89-3.90 -> 3.86-3.88; peak memory 16-128 MB
    lower. With it no fp32 T is stored beside the copy (tinv is then the inverse's scratch alone): HH-GDN 6.51-6.54
    -> 6.49-6.51. ``knob`` (``_KNOBS["u_from_t_16"]``) 1 / 0 forces it either way for a 16-bit ``stored``."""
    if stored == torch.float32:
        return False
    return bool(knob) if knob is not None else stored == torch.bfloat16


def grouped_update(grouped: bool, raw: bool, Rab: int, Rkv: int, a_scaled: bool, one_block: bool, save: bool,
                   knob=None) -> bool:
    """Whether the forward takes ``scaled_update``'s form over a's rows, where they are k split into groups of
    channels (``chunk_dplr_fwd``'s ``grouped``: Head-in-Head's ``a_r = k ⊙ 1[group r]``, whose sum is k). The
    writes k (sv ⊙ v)ᵀ are then Σ_r a_r (sv ⊙ v)ᵀ, so the chunk's whole update is Ãᵀ Y over a's rows with
    Y = T' (sv ⊙ v - D e^{G_{i-1}} ⊙ B S_n) for T' = (I + D L_BA)^{-1}, D = diag(a_scale), v repeated over the
    groups: the intra kernel forms M_QA and T' alone (no M_QK, L_BK, W, Ũ or L_BK V), and the state kernel forms
    Y, the state and the outputs (forms a's rows from k itself). For a decay per row (``raw``), Rkv = 1, a's
    factors given (``a_scaled``), the rows one block of the state kernel's (``one_block``), nothing saved
    (``save``: the backward reads W and U); ``knob`` (``_KNOBS["scaled"]``) False turns it off."""
    return (grouped and raw and Rab > 0 and Rkv == 1 and a_scaled and one_block and not save
            and (knob is None or bool(knob)))


VARLEN_ALIGN = 64  # packed sequences start at multiples of this many tokens: of every fused chunk size


def varlen_sequences(offsets: torch.Tensor, B: int, TC: int) -> int:
    """The number of sequences N of ``chunk_dplr_fwd``'s ``offsets`` (int32 [N + 1], their first tokens' multiples
    of ``VARLEN_ALIGN``, which the chunk size TC must divide), with B = 1."""
    if B != 1 or offsets.dim() != 1 or offsets.dtype != torch.int32 or VARLEN_ALIGN % TC:
        raise ValueError(f"offsets: int32 [N + 1] with B = 1 and chunks dividing {VARLEN_ALIGN} tokens, got "
                         f"{offsets.dtype} {list(offsets.shape)}, B = {B}, chunks of {TC}")
    return offsets.shape[0] - 1


def segments(NC: int, sequences_heads: int, V: int, device: torch.device, knob=None, K: int = 128,
             packed: bool = False) -> tuple[int, int]:
    """How many segments of each sequence's chunks the state kernels (the forward's, and the backward's in reverse)
    walk in parallel, and the chunks of each: (1, 0) but for long walks on a grid that leaves SMs idle.

    The walk from chunk to chunk is sequential, and at B = 1 and T = 32k its 16 x (V / BV) programs each walk 512
    chunks, one step at a time, most SMs idle. The state kernel is linear in its state, so a segment of chunks maps an
    entering state S to P S + H, with P [K, K] its transition and H its state from 0. A first walk (the
    state kernel's EYE) takes every segment at once from [0 | I], a state V + K wide, to [H | P]; the segments'
    entering states follow one from another (``chain_segments``: NS - 1 [K, K] x [K, V] products, fp32); the second
    walk, the usual one with its outputs, takes every segment at once from its entering state. Twice the work on NS
    times the programs. Not above K = 128 (``_SEGMENT_RULE["max_keys"]``), where the first walk's [K, V + K] state
    and the chaining's [K, K] products cost more than the segments save: H200, K = V = 256, B1 T32768 H16, Gated
    DeltaNet's forward 31.4 -> 10.9 ms and forward+backward 47.7 -> 23.8 without them, HDLA's 21.4 -> 15.8 and
    72.5 -> 57.1, Head-in-Head's forward 64.6 -> 28.7 (BENCHMARKS.md session 60).
    ``knob`` (``_KNOBS["segments"]``) forces NS (1: off). ``packed`` (``chunk_dplr_fwd``'s ``offsets``): none, the
    programs walk each packed sequence's own chunks instead."""
    if packed:
        ns = 1
    elif knob is not None:
        ns = max(1, min(int(knob), NC))
    elif device.type != "cuda" or NC < _SEGMENT_RULE["min_chunks"] or K > _SEGMENT_RULE["max_keys"]:
        ns = 1
    else:
        programs = _cdiv(V, 64) * sequences_heads
        ns = 1
        while (2 * ns * programs <= _SEGMENT_RULE["programs_per_sm"] * _sm_count(device)
               and NC // (2 * ns) >= _SEGMENT_RULE["min_segment"]):
            ns *= 2
        if ns < _SEGMENT_RULE["min_segments"]:  # two segments did not pay for the first walk
            ns = 1
    if ns == 1:
        return 1, 0
    ls = _cdiv(NC, ns)
    return _cdiv(NC, ls), ls


# the automatic rule of ``segments``: walks of at least min_chunks chunks, split while the second walk's programs
# stay within programs_per_sm per SM and each segment keeps min_segment chunks, up to K = max_keys
_SEGMENT_RULE = dict(min_chunks=64, programs_per_sm=2, min_segment=16, min_segments=4, max_keys=128)


def chain_segments(h0, ends, K: int, V: int, BK: int, reverse: bool = False) -> torch.Tensor:
    """The segments' entering states [NS, B, H, K, V] (fp32) from their [H | P] in ends [NS, B, H, K, V + K] (the
    first walk of ``segments``, the state kernel's EYE) and h0 [B, H, K, V] or None:
    ``chunk_state._segment_starts_kernel``, from the first segment or, with ``reverse`` (the backward's walk, h0 its
    dht), from the last."""
    ns, B, H = ends.shape[:3]
    starts = torch.empty(ns, B, H, K, V, device=ends.device, dtype=torch.float32)
    BV = min(32, max(16, _pow2(V)))
    _segment_starts_kernel[(_cdiv(V, BV), B * H)](
        ends if h0 is None else h0, ends, starts, ns, K=K, V=V, BK=BK, BV=BV, BR=BK if BK <= 128 else 32,
        HAS_H0=h0 is not None, PRECISION="tf32x3" if ends.is_cuda else "ieee", REVERSE=reverse, num_warps=8,
        num_stages=2)
    return starts


def fused_chunk_size(Rab: int, Rkv: int, per_channel: bool = False, knobs: dict | None = None) -> int | None:
    """Tokens per chunk of the fused forward: the rows of a chunk tile over the padded rank, at most 64 tokens; None
    for ranks above 4, which need the unfused path. The rows: ``knobs["channel_rows"]`` (``_KNOBS`` where not given)
    for a ``per_channel`` gate with a low-rank decay (Rab > 0: KDA, HDLA) where set, else ``knobs["rows"]``, else
    ``MAX_ROWS``; ``channel_rows`` is 32 where not given, and takes no fewer than 16 tokens (a padded rank of 4
    keeps 64 rows, as before: chunks of 8 tokens would give the kernels [8, 8] tiles). So Gated DeltaNet and GLA
    take 64 tokens, KDA 32, HDLA 16, Head-in-Head at r = 4 16.

    32 rows for a per-channel gate against 64 (H100, B8 T2048 H16 K=V=128 bf16, the same session): HDLA 1.87 / 7.38
    -> 1.54 / 7.05 ms forward / forward+backward, KDA 1.41 / 5.55 -> 1.37 / 5.44; its per-channel products cost per
    token in proportion to the chunk (BENCHMARKS.md sessions 42, 43)."""
    rank = max(_pow2(Rab), _pow2(Rkv), 1)
    if rank > 4:
        return None
    knobs = _KNOBS if knobs is None else knobs
    channel = knobs.get("channel_rows", 32) if per_channel and Rab > 0 else None
    if channel:
        return min(64, max(16, channel // rank))
    return min(64, (knobs.get("rows") or MAX_ROWS) // rank)


def _lowp(*xs) -> bool:
    """Every tensor 16-bit of one dtype: products of them are exact on tensor cores in that dtype.

    (Not bf16 under the CPU interpreter, whose bf16 tl.dot is wrong on Triton 3.x: there it
    stays fp32; the CPU tests cover this path with fp16.)
    """
    dt = {x.dtype for x in xs}
    return len(dt) == 1 and (dt == {torch.float16} or (dt == {torch.bfloat16} and xs[0].is_cuda))


def ties_keys(k, a, b, g, a_scale) -> bool:
    """Whether a and b are k itself (the delta rule: ``a = a_scale ⊙ k``, ``b = k``, the same tensor
    object, ranks 1, a decay per row): the forward then takes two of its four products and the
    backward forms k's gradient as key, decay row and update row in one pass."""
    return (a is k and b is k and k.shape[-2] == 1 and a_scale is not None
            and (g is None or g.shape[-1] == 1))


def pairs_keys(k, a, g, a_scale, cfg: dict | None = None) -> bool:
    """Whether a is k itself with its rows' factors (a = a_scale ⊙ k: ``kda``) under a per-channel gate: Q A's
    product is then Q K's with a_scale on its columns, and B A's is B K's, so each pair comes from one product,
    forward and backward (``chunk_dplr_fwd``'s "paired"; ``cfg``: its knobs, ``_KNOBS``'s by default)."""
    return bool(a is k and a_scale is not None and g is not None and g.shape[-1] > 1
                and (_KNOBS if cfg is None else cfg).get("tie_a_k", 1))


def hh_gram_products(K: int, r: int, Rkv: int, cfg: dict | None = None) -> bool:
    """Whether the intra kernel takes Head-in-Head's products (r groups of K / r channels, Rkv = 1) from per-group
    Grams of q and k (``_hh_grams``): where K / r is a power of two of at least 16 (a product's smallest width),
    unless ``_KNOBS["hh_grams"]`` is 0."""
    w = K // r if r and K % r == 0 else 0
    return bool(Rkv == 1 and w >= 16 and w & (w - 1) == 0 and (_KNOBS if cfg is None else cfg).get("hh_grams", 1))


def carries_kda_rows(k, a, g, a_scale, kda_b: bool, cfg: dict | None = None) -> bool:
    """Whether KDA's rows (``kda_b``: b = e^g ⊙ k, and a = a_scale ⊙ k, its products paired with k's:
    ``pairs_keys``) have their gradients carried on to k and g in step 4 (``chunk_bwd._backward``'s ``kda_rows``), so
    that b is taken without autograd and its factor kernel's backward never runs (H100 KDA forward+backward
    5.30-5.32 -> 4.80-4.82 ms, BENCHMARKS.md session 46; ``_KNOBS["kda_rows"] = 0``: not; ``cfg``: the knobs)."""
    cfg = _KNOBS if cfg is None else cfg
    return bool(kda_b and pairs_keys(k, a, g, a_scale, cfg) and cfg.get("kda_rows", 1))


def kda_b_formed(k, a, g, a_scale, cfg: dict | None = None) -> bool:
    """Whether KDA's training (``chunk_dplr_fwd`` with ``kda_b`` and ``save``, and its backward) reads no b = e^g ⊙ k
    at all, so that b may be a placeholder (``factors.placeholder``) and its factor kernel never runs: its rows'
    gradients carried on in step 4 (``carries_kda_rows``), the forward's products in one kernel ("kda_pair") and the
    backward's four products' gradients in one pass ("kda_pair_bwd"), each forming what it needs of b from k and the
    gate (``cfg``: the knobs, ``_KNOBS``'s by default)."""
    cfg = _KNOBS if cfg is None else cfg
    return bool(carries_kda_rows(k, a, g, a_scale, True, cfg) and cfg.get("kda_pair", 1) >= 1
                and cfg.get("kda_pair_bwd", 1))


@opaque(2)  # (``save`` is for the autograd Functions, which call it eagerly)
def chunk_dplr_fwd(q, k, v, a, b, g, scale: float, initial_state, save: bool = False,
                   _config: dict | None = None, a_scale=None, v_scale=None, hdla_beta=None, grouped: bool = False,
                   hh_mask=None, hdla_form_a2: bool = False, kda_b: bool = False, offsets=None):
    """Forward of the chunked algorithm in three Triton kernels (no autograd).

    Canonical inputs (``rankdecay.ops._inputs``): q [B, T, H, K], k [B, T, H, Rkv, K],
    v [B, T, H, Rkv, V], a, b [B, T, H, Rab, K] or None, g [B, T, H, 1 | K] or None,
    any float dtype; initial_state [B, H, K, V] or None; a_scale [B, T, H, Rab], v_scale
    [B, T, H, Rkv] or None: per-row factors of a and v (``dplr``'s). ``hdla_beta`` [B, T, H]: a and b are
    HDLA's rows for this β (``factors.hdla_factors``; a per-channel gate), whose products then take one
    kernel (``channel.hdla_products``) at the bf16 products' precision (``hdla_fused_products``), where the intra
    kernel forms a1 and b from k and β itself: there b may be None and a's first rows unset
    (``factors.hdla_factors_fwd``'s ``a2_only``). ``grouped``: a's rows are k split into Rab groups of channels
    (``a_r = k ⊙ 1[group r]``, so that their sum is k: Head-in-Head's), with a decay per row and Rkv = 1; without
    ``save`` the forward then takes the scaled form over a's rows (``grouped_update``). Without ``save``, HDLA's
    rows take the same form over its update rows [k, a2] (``scaled_update``). ``hh_mask`` ([H, r, r] or
    [B, T, H, r, r]): a and b are Head-in-Head's rows of k and this mask (``factors.hh_factors``'), which the kernels
    then form from k and the mask instead of reading them (a scalar gate or none, Rkv = 1): only their shapes and
    dtypes count, and ``factors.hh_placeholders`` stand in for them; but with ``grouped`` the state kernel of the
    scaled form reads b (formed there, the H100 HH-GDN forward took 1.82 ms against 1.37: ``factors.hh_update_rows``
    builds b alone). ``hdla_form_a2`` (with ``hdla_beta`` where its products take one kernel, without ``save``):
    a's a2 rows are not read either but formed where they are needed, a2 = β k ⊙ (λ - β c), from k, the
    log-cumsums, β and c = kᵀ(λ ⊙ k), whose key-block shares the log-cumsum kernel writes; a may be a placeholder
    (``factors.placeholder``), and no factor kernel runs. ``kda_b`` (a per-channel gate, a = k with a_scale,
    ranks 1): b is e^g ⊙ k (``kda``'s), and may be a placeholder: without ``save`` always, with it where the
    training reads no b (``kda_b_formed``; else b is given, its backward reads it). Since b_t ⊙ e^{G_{t-1}} =
    k_t ⊙ e^{G_t}, the intra kernel forms its rows from k (its KDA_B), the scaled form reads none, and the products
    take L_BK (and L_BA) as k's, in M_QK's kernel; where a form still reads b (a not paired with k, or the products
    apart), without ``save`` it is built here (``factors.kda_factor``). Returns (o [B, T, H, V] in q's dtype, final state [B, H, K, V] fp32), and with
    ``save`` a dict of the per-chunk tensors the backward needs (``rankdecay.ops.triton.chunk_bwd``), with "inputs":
    (q, k, v, a, b, g) as the kernels read them, contiguous where they read them (the backward's kernels take the
    same strides; the autograd Functions save these rather than their arguments). Needs
    ``fused_chunk_size(Rab, Rkv)``.

    ``offsets`` (int32 [N + 1], on q's device): N sequences lie along one row (B = 1), sequence i on tokens
    [offsets[i], offsets[i + 1]), each starting at a multiple of ``VARLEN_ALIGN`` (zero tokens between: the identity
    step; ``dplr``'s ``cu_seqlens`` laid out so, ``_inputs.varlen_aligned``). The state restarts at each, from
    initial_state [N, H, K, V], and the final state is [N, H, K, V]: only the state kernel's walk differs (a chunk's
    other work is its own), one program per (sequence, head) over its chunks. No segments (``segments``).
    """
    check_knobs(_KNOBS)
    check_knobs(_config or {}, "_config")
    B, T, H, K = q.shape
    Rkv, V = v.shape[-2], v.shape[-1]
    Rab = a.shape[-2] if a is not None else 0
    TC = fused_chunk_size(Rab, Rkv, gate_kind(g) == 2, {**_KNOBS, **(_config or {})})
    if TC is None:
        raise ValueError(f"the fused forward takes ranks up to 4, got Rab={Rab}, Rkv={Rkv}")
    NC = _cdiv(T, TC)
    NK, NA = TC * _pow2(Rkv), TC * _pow2(Rab)
    gate = gate_kind(g)
    KG = 1 if g is None else g.shape[-1]
    tied = ties_keys(k, a, b, g, a_scale)  # before .contiguous(), which may copy k
    # a's products paired with k's, forward and backward (saved as "paired"). Without the backward it takes the
    # scaled form instead (``channel_scaled``).
    paired = pairs_keys(k, a, g, a_scale, {**_KNOBS, **(_config or {})})
    prec = _precision(q)
    # the output kernel's value block: 128 with bf16 products (H100 GDN: 150 against 165 µs at 64;
    # BENCHMARKS.md session 15), 64 with fp32 tiles, twice the registers
    cfg = dict(intra_warps=None, precision=prec, state_precision=prec, output_bv=128 if prec.startswith("bf16") else 64,
               output_warps=4)
    cfg.update(_KNOBS, **(_config or {}))  # benchmarking knobs
    prec = cfg["precision"]
    f32 = dict(device=q.device, dtype=torch.float32)
    # products' operands between kernels
    st = dict(device=q.device, dtype=cfg.get("stored", stored_dtype(prec, K, q.device)))
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    hdla_beta = hdla_beta.contiguous() if hdla_beta is not None else None
    if hh_mask is not None:
        if gate == 2 or Rkv != 1 or Rab < 1:
            raise ValueError("hh_mask: Head-in-Head's rows a and b (Rab >= 1, Rkv = 1) with a scalar gate or none only")
        hh_mask = hh_mask.contiguous()
    # (Head-in-Head's rows, formed from k and the mask, may be placeholders: ``factors.hh_placeholders``; so may
    # HDLA's a, formed from k, the log-cumsums, β and c: ``hdla_form_a2``)
    a = a.contiguous() if a is not None and hh_mask is None and not hdla_form_a2 else a
    # KDA's b: maybe a placeholder, formed where needed; with save, a placeholder where nothing reads it
    placeholder_b = kda_b and (not save or kda_b_formed(k, a, g, a_scale, cfg))
    b = b.contiguous() if b is not None and (hh_mask is None or grouped) and not placeholder_b else b
    g = g.contiguous() if g is not None else None
    sa = a_scale.float().contiguous() if a_scale is not None and Rab else None
    sv = v_scale.float().contiguous() if v_scale is not None else None
    read = (q, k, v, a, b, g)  # as the kernels read them: the backward's kernels read these (saved "inputs")
    # a decay per row (scalar gate or none): the state and output kernels, and the backward's,
    # read q, k, v and a as given, with the rows' decays as factors (their RAW forms); no decayed
    # copies Q̃, K̃, Ã or V are stored
    raw = gate != 2
    # a per-channel gate without v's factors: the state kernel and the backward read v as given (RAW_V),
    # no copy in the chunk layout; with no low-rank decay either (GLA) that leaves the intra kernel nothing
    # to do (Q̃, K̃ and e^{G_C} come with the log-cumsums)
    raw_v = gate == 2 and sv is None
    intra = not (raw_v and Rab == 0)
    blocks = _blocks(K, V, NK, NA)
    # the state kernel forms the outputs itself where its grid alone fills the GPU (``fuse_output``)
    scalable = scaled_update(tied, blocks["BCA"] == NA, True, save, cfg.get("scaled"))  # where fused
    # the same scaled form for a per-channel gate where a is k with factors (``kda``): paired, not saved, the rows
    # one block of the state kernel's; its outputs from either kernel (the output kernel reads S_n and Y)
    channel_scaled = paired and scaled_update(True, blocks["BCA"] == NA, True, save, cfg.get("scaled"))
    kda_pair = kda_b and cfg.get("kda_pair", 1) >= 1  # (with a paired with k) L_BK in M_QK's kernel
    if kda_b:
        if gate != 2 or Rkv != 1 or Rab != 1:
            raise ValueError("kda_b: b = e^g ⊙ k (kda's) with a per-channel gate and ranks 1")
        # the forms that read b: the products taken apart, or L_BK's own kernel with its scaled twin (the intra kernel
        # forms B ⊙ e^{G_{t-1}} from k: its KDA_B)
        if placeholder_b and (not paired or (not kda_pair and not channel_scaled)):
            if save:  # (``kda_b_formed`` says none of these reads it)
                raise RuntimeError("kda_b: b is a placeholder where the training forward reads it")
            from .factors import kda_factor, rows_dtype

            b = kda_factor(k, g.contiguous().view(k.shape), dtype=rows_dtype(k, prec))
    # and HDLA's over its rows [k, a2] (a1 = β k: the writes k vᵀ lie on them), its products taken without β
    fused = gate == 2 and hdla_beta is not None and hdla_fused_products(prec, cfg)
    hdla_scaled = fused and scaled_update(True, blocks["BCA"] == NA, True, save, cfg.get("scaled"))
    if hdla_form_a2 and (not fused or save):
        raise ValueError("hdla_form_a2: HDLA's a2 is formed in the kernels only with hdla_beta, its products in one "
                         "kernel (hdla_fused_products) and no save (the backward reads a2)")
    # and in the scaled form its rows Ã and B ⊙ e^{G_{i-1}} by the log-cumsum kernel (its HROWS)
    hdla_rows = hdla_form_a2 and hdla_scaled and bool(cfg.get("hdla_cumsum_rows", 1))
    # and its products from those rows where a chunk is one sub-block, the log-cumsum kernel holds all of K and the
    # products may take one product (``channel.hdla_row_products``); the log-cumsum kernel flags the chunks beyond
    # ``row_span``, which alone keep their log-cumsums and go by levels
    cumsum_launch = (cfg.get("hdla_cumsum_bk"), cfg.get("hdla_cumsum_warps")) if hdla_rows else None
    span = row_span(log_cumsum_dtype(prec)) if hdla_rows else 0.0
    row_products = (span > 0 and hdla_one_block(TC) and bool(cfg.get("hdla_row_products", 1))
                    and log_cumsum_launch(TC, True, True, cumsum_launch)[0] >= K)
    row_flags = torch.empty(B, H, NC, device=q.device, dtype=torch.int32) if row_products else None
    # the same over a's rows where they sum to k (Head-in-Head's), its outputs from the state kernel
    if grouped and (Rab < 1 or K % Rab):
        raise ValueError(f"grouped: a's Rab = {Rab} rows are k's channels in equal groups, so Rab must divide K = {K}")
    grouped = grouped_update(grouped, raw, Rab, Rkv, sa is not None, blocks["BCA"] == NA, save, cfg.get("scaled"))
    fuse = True if grouped or hdla_scaled else cfg.get("fuse_output")
    if fuse is None:
        fuse = fuse_output(_cdiv(V, blocks["BV"]) * B * H, q.device, scalable or channel_scaled, save, TC,
                           channel_rank=gate == 2 and Rab > 0)
    scaled = (scalable and fuse) or channel_scaled or grouped or hdla_scaled
    # (the 32-wide block for the delta rule's alone: with KDA's bf16 kg and K̃ tiles it read wrong results on the
    # H100, as the 32-wide block with bf16 W tiles did in sessions 13 and 14; BENCHMARKS.md session 34)
    blocks["BV"] = cfg.get("state_bv") or blocks["BV"]  # (the first walk of ``segments`` takes this one)
    kf = torch.empty(B, H, NC, NK, **f32) if raw else None
    af = torch.empty(B, H, NC, NA, **f32) if (raw or channel_scaled or hdla_scaled) and Rab else None
    kg = torch.empty(B, H, NC, NK, K, **st) if channel_scaled else None  # B ⊙ e^{G_{i-1}}
    if hdla_scaled:  # B ⊙ e^{G_{i-1}} from the intra kernel
        kg = torch.empty(B, H, NC, NA, K, **st)
    qd = torch.empty(B, H, NC, TC, K, **st) if not raw else None
    qf = torch.empty(B, H, NC, TC, **f32) if raw else None
    kdec = torch.empty(B, H, NC, NK, **f32) if raw and save else None
    # (HDLA's scaled form takes M_QA over its update rows [k, a2] in M_QK's place: no M_QK nor L_BK, 100 MB at B8
    # T2048 H16 K128; a stand-in of M_QK's shape and dtype, never read, is the dummy pointer)
    mqk = placeholder((B, H, NC, TC, NK), st["dtype"], q.device) if hdla_scaled else torch.empty(B, H, NC, TC, NK, **st)
    # HDLA's scaled form reads Ã's rows (ad) in K̃'s place, so K̃ is not formed (67 MB at B8 T2048 H16 K128)
    kd = torch.empty(B, H, NC, NK, K, **st) if not (raw or hdla_scaled) else None
    vf = torch.empty(B, H, NC, NK, V, **st) if not (raw or raw_v or channel_scaled) else None
    mqa = torch.empty(B, H, NC, TC, NA, **st) if Rab and (grouped or hdla_scaled or not scaled) else None
    w = torch.empty(B, H, NC, NA, K, **st) if Rab and not scaled else None
    ad = torch.empty(B, H, NC, NA, K, **st) if Rab and (hdla_scaled or not (raw or scaled)) else None
    # scaled: T' [NA, NA] in Ũ's place
    # the training forward's U_n formed by the state kernels from T (``u_from_t``): no W nor Ũ, B̃ in w's place
    ut = (save and Rab > 0 and not scaled and blocks["BCA"] == NA
          and u_from_t(gate, tied, hh_mask is not None, cfg.get("u_from_t")))
    # and T for the state kernels in the 16-bit dtype of the tensors between kernels (``u_from_t_16``): at the bf16
    # products' precision their products round T to bf16 anyway, so the results are the same, for half of T's reads
    t16 = ut and u_from_t_16(st["dtype"], cfg.get("u_from_t_16"))
    uv = torch.empty(B, H, NC, NA, NA if scaled or t16 else V, **st) if Rab and (t16 or not ut) else None
    dch = torch.empty(B, H, NC, KG, **f32) if gate else None
    # the inverse's scratch, and with save the backward's T (but for t16's copy in uv)
    tinv = torch.empty(B, H, NC, NA, NA, **f32) if Rab else None
    t_read = uv if t16 else tinv  # T as the backward (and with ut both walks) read it
    lbk = torch.empty(B, H, NC, NA, NK, **f32) if Rab and (save or gate == 2) and not hdla_scaled else None
    lba = torch.empty(B, H, NC, NA, NA, **f32) if Rab else None
    # the intra kernel's key block: 32 for a per-channel gate without a low-rank decay (GLA); with one
    # (HDLA) 64 even where K is 32 (masked): at 32, Triton 3.6 on the H100 miscompiled that kernel with
    # bf16 products (wrong results at K = 32 and 128, out-of-range shared-memory reads, an illegal
    # access); at 64 it is right (BENCHMARKS.md session 17)
    BK = min(64, max(16, _pow2(K)))
    if gate == 2:
        BK = (64 if K > 16 else 16) if Rab else min(BK, 32)
    BK = cfg.get("intra_bk", BK)
    BV = min(64, max(16, _pow2(V)))
    dummy = mqk
    opt = lambda x: dummy if x is None else x  # noqa: E731
    # HDLA: six products of token rows instead of nine (H100 HDLA forward: 4.1 -> 3.0 ms), and its rows formed from
    # k, β and a2 in the intra kernel (HDLA), so that the factor kernel writes a2 alone and b is None (H100 HDLA
    # forward 3.05 -> 2.81 ms; BENCHMARKS.md session 30)
    if b is None and Rab and not fused:
        raise ValueError("b is None: only HDLA's rows (hdla_beta) at the bf16 products' precision can do without it")
    if gate == 2:  # the kernels read per-channel decays as differences of these
        # (KDA's b not built: PREP forms kg = k ⊙ e^G)
        g = chunk_log_cumsum(g, TC, log_cumsum_dtype(prec), prep=(q, k, qd, kd, dch, scale,
                                                                      kg if channel_scaled else None,
                                                                      None if kda_b and channel_scaled else b),
                             c_parts=hdla_form_a2,
                             hdla_rows=(hdla_beta, ad, kg) if hdla_rows else None, launch=cumsum_launch,
                             flags=row_flags, span=span)
        g, cparts = g if hdla_form_a2 else (g, None)
        # and the intra kernel reads the products (``channel``), each in sub-blocks of the chunk
        prod = dict(T=T, TC=TC, precision=prec)
        if fused:
            if Rab != 2 or Rkv != 1 or sa is not None or sv is not None:
                raise ValueError("hdla_beta takes HDLA's rows: Rab = 2, Rkv = 1, no a_scale or v_scale")
            if row_products:  # the chunks near 0 from the rows, the flagged ones by levels
                hdla_row_products(qd, kg, ad, dch, row_flags, mqa, lba, TC, prec)
            hdla_products(q, k[..., 0, :], a, g, hdla_beta, mqk, mqa, lba, lbk, scale=scale, scaled=hdla_scaled,
                          c_parts=cparts, flags=row_flags, **prod)
        elif paired:
            # M_QK and L_BK, and unless the forward takes the scaled form (channel_scaled, which needs no more) their
            # scaled twins M_QA and L_BA (D on their columns) from the same kernels (H100 KDA: 1.29 -> 0.69 ms for
            # the products, BENCHMARKS.md session 33). KDA's b = e^g ⊙ k through G_{t-1} is k through G_t: L_BK
            # (and L_BA) are k's product with itself, taken in M_QK's kernel (forward without autograd, H200:
            # 1.17 -> 1.07 ms, session 45; forward+backward, H100: 5.31-5.33 -> 5.29-5.31 ms, session 46)
            twins = not channel_scaled
            # the four in one kernel (KDA's training) under a register cap of 128 (168 uncapped, 3 programs an SM):
            # H100, bf16, K = 128, 0.414 -> 0.364 ms (BENCHMARKS.md session 51)
            cap = 128 if twins and kda_pair and prec.startswith("bf16") and K <= 128 else 0
            channel_product(q, k, g, mqk, strict=False, lowp=_lowp(q, k), scale=scale,
                            **(dict(y_scale=sa, out_scaled=mqa) if twins else {}),
                            **(dict(x2=k, out2=lbk, out2_scaled=lba if twins else None) if kda_pair else {}),
                            maxnreg=cap, **prod)
            if not kda_pair:  # b's own kernel; where b is a placeholder, k's through G_t (x_at_t)
                at_t = kda_b and not twins
                rows = k if at_t else b
                channel_product(rows, k, g, lbk, strict=True, lowp=_lowp(rows, k), x_at_t=at_t,
                                **(dict(y_scale=sa, out_scaled=lba) if twins else {}), **prod)
        else:
            channel_product(q, k, g, mqk, strict=False, lowp=_lowp(q, k), scale=scale, **prod)
        if Rab and not fused and not paired:
            channel_product(q, a, g, mqa, strict=False, lowp=_lowp(q, a), scale=scale, y_scale=sa, **prod)
            channel_product(b, a, g, lba, strict=True, lowp=_lowp(b, a), y_scale=sa, **prod)
            channel_product(b, k, g, lbk, strict=True, lowp=_lowp(b, k), **prod)
    # Head-in-Head's rows formed from k and the mask in the intra kernel (1: a static mask, 2: one per token), and
    # a's in the state kernel (its GROUPED, reading k)
    hh = hh_mask.dim() // 2 if hh_mask is not None else 0
    if intra:
        neumann = neumann_blocks(cfg.get("neumann"))
        _intra_kernel[(NC, B * H)](
            q, k, v, a if Rab else dummy, opt(b if Rab else None), g if gate else dummy, opt(sa), opt(sv), opt(qd), mqk,
            mqa if Rab else dummy, opt(kd), opt(vf), opt(kg if hdla_scaled else w), opt(uv), opt(ad), opt(dch),
            opt(tinv), opt(lba), opt(lbk),
            opt(kf), opt(af), opt(qf), opt(kdec), hdla_beta if fused else dummy, scale, T, NC,
            H=H, K=K, V=V, KG=KG, TC=TC, RKV=Rkv, RKVP=_pow2(Rkv), RAB=Rab, RABP=_pow2(Rab), BK=BK, BV=BV, GATE=gate,
            PRECISION=prec, LP_QK=_lowp(q, k), LP_QA=Rab > 0 and _lowp(q, a),
            LP_BA=b is not None and _lowp(b, a), LP_BK=b is not None and _lowp(b, k), SAVE=save, ASC=sa is not None,
            VSC=sv is not None,
            E_B=b is not None and _is16(b), E_V=_is16(v), TIED=tied, SCALED=scaled,
            MERGE=cfg.get("merge") or "ieee", HDLA=fused, GROUPED=grouped,
            hmask=hh_mask if hh else None, HH=hh, cp=cparts if hdla_form_a2 else None,
            NKB=cparts.shape[3] if hdla_form_a2 else 1, FORM_A2=hdla_form_a2, KDA_B=kda_b, HROWS=hdla_rows,
            HG_PROD=bool(hh) and hh_gram_products(K, Rab, Rkv, cfg),
            NILP=16 // _pow2(Rab) if Rab and neumann else 0, UT=2 if t16 else int(ut),
            num_warps=cfg["intra_warps"] or intra_warps(fused, neumann, bool(hh), K), num_stages=1,
            **_maxnreg(cfg.get("intra_maxnreg", intra_registers(scalable and fuse, prec, k, v))),
        )
    o = torch.empty(B, T, H, V, device=q.device, dtype=_out_dtype(q))
    store = save or not fuse  # S_n and U_n: read by the output kernel, or saved for the backward
    stages = state_stages(fuse, tied or grouped or hdla_scaled, cfg["state_precision"], k, v, per_channel=gate == 2,
                          channel_scaled=channel_scaled or hdla_scaled, low_rank=Rab > 0, hh=bool(hh))
    blocks = dict(blocks, num_stages=cfg.get("state_stages") or stages, num_warps=state_warps(bool(hh) or grouped, K))
    sst = dict(st, dtype=cfg.get("stored_state", st["dtype"]))
    s0 = torch.empty(B, H, NC, K, V, **sst) if store else None
    u = torch.empty(B, H, NC, NA, V, **sst) if store else None
    h0 = initial_state.float().contiguous() if initial_state is not None else None
    N = B if offsets is None else varlen_sequences(offsets, B, TC)
    ns, ls = segments(NC, B * H, V, q.device, cfg.get("segments"), K=K, packed=offsets is not None)
    ht = torch.empty(ns, N, H, K, V, **f32)  # each segment's leaving state; the last one's is the final state
    # a is k (the delta rule), one row block each: the state kernel's SAME_AK
    same_ak = (raw and Rab == Rkv and same_memory(a, k) and a.shape == k.shape and a.stride() == k.stride()
               and a.dtype == k.dtype and blocks["BCR"] == NK and blocks["BCA"] == NA) if Rab else False
    # the output's arguments, for the output kernel or the state kernel (FUSE_O)
    # (where Y's rows are a's, the state kernel's outputs take M_QA in M_QK's place)
    out = dict(qd=q if raw else qd, qf=opt(qf), mqk=mqa if hdla_scaled or grouped else mqk, mqa=opt(mqa), sv=opt(sv),
               sa=opt(sa), TIED=tied,
               VSC=sv is not None, ASC=sa is not None, E_Q=_is16(q), E_V=_is16(v))
    rows = (opt(dch), ad if hdla_scaled else (k if raw else kd), v if raw or raw_v or channel_scaled else vf, opt(w),
            t_read if ut else opt(uv), opt(k if hh else a if raw else ad))
    kinds = dict(K=K, V=V, CR=NK, CA=NA, GATE=gate, PRECISION=cfg["state_precision"], RAW=raw, H=H, TC=TC, RKV=Rkv,
                 RKVP=_pow2(Rkv), RAB=max(Rab, 1), RABP=max(_pow2(Rab), 1), E_K=_is16(k), E_A=_is16(k if hh else a),
                 SAME_AK=same_ak, RAW_V=raw_v, SCALED=scaled, kg=opt(kg), GROUPED=grouped or bool(hh),
                 bb=b if grouped else None, HDLA=hdla_scaled, E_B=grouped and _is16(b), UT=ut,
                 lbk=lbk if ut else None)
    if ns > 1:  # long walks on few programs: segments walked in parallel, twice (``segments``)
        ends = torch.empty(ns, B, H, K, V + K, **f32)  # each segment's [H | P], from the EYE walk
        _state_fwd_kernel[(_cdiv(V + K, blocks["BV"]), B * H * ns)](
            dummy, *rows, dummy, dummy, ends, NC, opt(kf), opt(af), T, HAS_H0=False, o=dummy, FUSE_O=False,
            STORE=False, NS=ns, LS=ls, VS=V + K, EYE=True, **kinds, **out, **blocks)
        h0 = chain_segments(h0, ends, K, V, blocks["BK"])
    blocks["BV"] = cfg.get("state_bv") or state_value_block(scalable and fuse, blocks["BV"], N * H * ns, V, q.device,
                                                            tied and save, K)
    _state_fwd_kernel[(_cdiv(V, blocks["BV"]), N * H * ns)](
        opt(h0), *rows, opt(s0), opt(u), ht, NC, opt(kf), opt(af), T, HAS_H0=h0 is not None, o=o,
        FUSE_O=fuse, STORE=store, NS=ns, LS=ls, **kinds, **out, **blocks, **_maxnreg(cfg.get("state_maxnreg")),
        cs=offsets, VARLEN=offsets is not None,
    )
    ht = ht[-1]
    if not fuse:
        BKo = min(64, max(16, _pow2(K)))
        BVo = min(cfg["output_bv"], max(16, _pow2(V)))
        _output_kernel[(_cdiv(V, BVo), NC, B * H)](
            s0, v, u, o, T, NC, H=H, K=K, V=V, TC=TC, NK=NK, NA=NA, RKV=Rkv, RKVP=_pow2(Rkv), BK=BKo, BV=BVo,
            PRECISION=prec, RAW=raw, VALUES=scaled, num_warps=cfg["output_warps"], num_stages=1, **out,
        )
    if not save:
        return o, ht
    # Ũ is not needed: dL_BA = -dX Uᵀ. A per-channel gate's log-cumsums (gc) are kept rather than taken again in the
    # backward: the same values, one kernel fewer
    # (with ``u_from_t`` only the backward's state kernel reads T: the 16-bit copy where there is one)
    saved = dict(qd=qd, mqk=mqk, mqa=mqa, kd=kd, vf=vf, w=w, ad=ad, dch=dch, tinv=t_read, lba=lba,
                 lbk=lbk, s0=s0, u=u, qf=qf, af=af, kdec=kdec, gc=g if gate == 2 else None, TC=TC, paired=paired,
                 ut=ut, inputs=read)
    return o, ht, saved
