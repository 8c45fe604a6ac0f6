"""The sequential part of the chunked algorithm: the state from chunk to chunk.

For chunk n with entering state S_n (HDLA eqs. 13 and 17, in ``rankdecay.ops.chunk``'s
notation, everything already decayed to the chunk's end):

    U_n     = W_n S_n + Ũ_n                               pseudo-values, [C*Rab, V]
    S_{n+1} = d_n ⊙ S_n + K̃_n^T V_n - Ã_n^T U_n            d_n = exp(G_C): [1] or [K]

The forward kernel keeps a [K, BV] slice of the state in registers and walks the
chunks, writing every S_n and U_n. Its backward walks them in reverse:

    dU_n^tot = dU_n - Ã_n dS_{n+1}
    dS_n     = d_n ⊙ dS_{n+1} + W_n^T dU_n^tot + dS_n^out

and writes dS_{n+1} and dU_n^tot for every chunk; the gradients of K̃, V, W, Ũ, Ã and
d are then one batched matmul each over all chunks at once (``_Function.backward``).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable

from .fused_recurrent import _cdiv, _pow2, gate_kind
from .opaque import matmul_precision, opaque_function


@triton.jit
def _hi(X):
    """X with its mantissa cut to TF32's 10 bits: exact on TF32 tensor cores, and X - _hi(X) exact in fp32."""
    return (X.to(tl.uint32, bitcast=True) & 0xFFFFE000).to(tl.float32, bitcast=True)


@triton.jit
def _dot(X, Y, PRECISION: tl.constexpr):
    """X @ Y accumulated in fp32 at PRECISION: "ieee", "tf32x3" (fp32-accurate), "tf32" (one pass)
    or "bf16" (both operands rounded to bf16, as fla's kernels take their products; "bf16_ieee" is
    its stand-in under the CPU interpreter, whose bf16 tl.dot is wrong: bf16 operands, fp32 product)."""
    if PRECISION == "bf16":
        return tl.dot(X.to(tl.bfloat16), Y.to(tl.bfloat16))
    elif PRECISION == "bf16_ieee":
        return tl.dot(X.to(tl.float32).to(tl.bfloat16, fp_downcast_rounding="rtne").to(tl.float32),
                      Y.to(tl.float32).to(tl.bfloat16, fp_downcast_rounding="rtne").to(tl.float32),
                      input_precision="ieee")
    else:
        return tl.dot(X, Y, input_precision=PRECISION)


@triton.jit
def _dot_ex(X, Y, PRECISION: tl.constexpr, EXACT: tl.constexpr):
    """X @ Y; with EXACT, Y's entries are 16-bit numbers (exact in TF32), and two TF32 passes, X's
    high and low parts times Y, are as accurate as tf32x3's three (whose third multiplies Y's low
    part, here zero). At a reduced PRECISION ("tf32", "bf16") it is one pass whatever EXACT says."""
    if EXACT and (PRECISION == "tf32x3" or PRECISION == "ieee"):
        Xh = _hi(X)
        return tl.dot(X - Xh, Y, tl.dot(Xh, Y, input_precision="tf32"), input_precision="tf32")
    else:
        return _dot(X, Y, PRECISION)


@triton.jit
def _dot_xe(X, Y, PRECISION: tl.constexpr, EXACT: tl.constexpr):
    """X @ Y with, under EXACT, X's entries 16-bit numbers (``_dot_ex`` the other way round)."""
    if EXACT and (PRECISION == "tf32x3" or PRECISION == "ieee"):
        Yh = _hi(Y)
        return tl.dot(X, Y - Yh, tl.dot(X, Yh, input_precision="tf32"), input_precision="tf32")
    else:
        return _dot(X, Y, PRECISION)


@triton.jit
def _chunk_rows(o_r, i_b, i_h, n, T, H: tl.constexpr, TC: tl.constexpr, R: tl.constexpr, RP: tl.constexpr):
    """Rows o_r of chunk n of a [B, T, H, R, D] tensor (token in chunk major, rank padded to RP):
    token in chunk, rank, time, valid, flat row."""
    tok = o_r // RP
    rk = o_r % RP
    t = n * TC + tok
    valid = (rk < R) & (t < T) & (tok < TC)
    flat = ((i_b * T + t) * H + i_h) * R + rk
    return tok, rk, t, valid, flat


@triton.jit
def _load_rows(x, flat, valid, o_d, m_d, D: tl.constexpr):
    """Rows ``flat`` (where valid) of x [..., D], columns o_d: read in x's dtype, returned as fp32."""
    return tl.load(x + flat[:, None] * D + o_d[None, :], mask=valid[:, None] & m_d[None, :], other=0.0).to(tl.float32)


@triton.jit
def _raw_rows(x, o_r, i_bh, n, T, H: tl.constexpr, TC: tl.constexpr, R: tl.constexpr, RP: tl.constexpr,
              o_d, m_d, D: tl.constexpr):
    """Rows o_r of chunk n of x [B, T, H, R, D] as given (read in x's dtype, returned as fp32)."""
    _, _, _, valid, flat = _chunk_rows(o_r, i_bh // H, i_bh % H, n, T, H, TC, R, RP)
    return _load_rows(x, flat, valid, o_d, m_d, D)


@triton.jit
def _hh_mask_rows(hmask, fa, va, rka, i_h, o_k, m_k, K: tl.constexpr, RAB: tl.constexpr, HH: tl.constexpr):
    """The mask's entries M[j, group(l)] of a chunk's rows (token, j), columns o_k, as fp32 [rows, BK]."""
    if HH == 2:  # mask[.., j, 0] of row (token, j)
        pm = fa * RAB
    else:
        pm = (i_h * RAB + rka) * RAB
    return tl.load(hmask + pm[:, None] + (o_k // (K // RAB))[None, :], mask=va[:, None] & m_k[None, :],
                   other=0.0).to(tl.float32)


@triton.jit
def _hh_rows(k, hmask, ref, flat, valid, rk, i_h, o_k, m_k, K: tl.constexpr, R: tl.constexpr, HH: tl.constexpr,
             B_ROWS: tl.constexpr):
    """Head-in-Head's rows (token, j) of a chunk, columns o_k, formed from k [B, T, H, 1, K] and the mask (HH 1:
    [H, r, r], 2: [B, T, H, r, r]) as ``factors.hh_factors`` forms them: a_j = k ⊙ 1[group j], or with B_ROWS
    b_j = k ⊙ M[j, group(·)] rounded to the dtype of ``ref`` (b as that kernel stored it). As fp32 [rows, BK]."""
    Kt = _load_rows(k, flat // R, valid, o_k, m_k, K)
    if B_ROWS:
        return (Kt * _hh_mask_rows(hmask, flat, valid, rk, i_h, o_k, m_k, K, R, HH)).to(ref.dtype.element_ty).to(
            tl.float32)
    return tl.where((o_k // (K // R))[None, :] == rk[:, None], Kt, 0.0)


@triton.jit
def _group_rows(k, o_a, i_bh, n, T, H: tl.constexpr, TC: tl.constexpr, RAB: tl.constexpr, RABP: tl.constexpr,
                o_k, m_k, K: tl.constexpr):
    """Rows o_a (token, j) of chunk n of a whose rows are k [B, T, H, 1, K] split into RAB groups of channels
    (Head-in-Head's a_j = k ⊙ 1[group j]; zero for a padded rank), formed from k (as fp32)."""
    tok, rk = o_a // RABP, o_a % RABP
    Kr = _raw_rows(k, tok, i_bh, n, T, H, TC, 1, 1, o_k, m_k, K)
    return tl.where(o_k[None, :] // (K // RAB) == rk[:, None], Kr, 0.0)


@triton.jit
def _row_factor(s, flat, valid):
    """[rows] per-row factors (``a_scale`` / ``v_scale`` of ``dplr``) of a [B, T, H, R, D] tensor's rows."""
    return tl.load(s + flat, mask=valid, other=0.0).to(tl.float32)


@triton.jit
def _chunk_factor(s, o_r, i_bh, n, T, H: tl.constexpr, TC: tl.constexpr, R: tl.constexpr, RP: tl.constexpr):
    """[rows] per-row factors s [B, T, H, R] (``a_scale`` / ``v_scale`` of ``dplr``) of rows o_r of chunk n."""
    _, _, _, valid, flat = _chunk_rows(o_r, i_bh // H, i_bh % H, n, T, H, TC, R, RP)
    return _row_factor(s, flat, valid)


@triton.jit
def _chunk_cols(m, c, r_q, o_r, m_r, TC: tl.constexpr, N: tl.constexpr):
    """Columns o_r of chunk c's [TC, N] tile of m [B, H, NC, TC, N] (M_QK, M_QA), as fp32."""
    return tl.load(m + (c * TC + r_q[:, None]) * N + o_r[None, :], mask=m_r[None, :], other=0.0).to(tl.float32)


@triton.jit
def _values_out(mqk, c, r_q, o_r, m_r, Vr, U, sv, sa, i_bh, n, T, H: tl.constexpr, TC: tl.constexpr,
                N: tl.constexpr, R: tl.constexpr, RP: tl.constexpr, TIED: tl.constexpr, VSC: tl.constexpr,
                ASC: tl.constexpr, E_V: tl.constexpr, PRECISION: tl.constexpr):
    """The outputs' share M_QK[:, o_r] (sv ⊙ v) of chunk n's value rows o_r (Vr: v as given, [rows, BV]; M_QK
    chunk c's [TC, N] tile of mqk): v's factors on M_QK's columns, two TF32 passes on a 16-bit v (E_V). TIED (a is
    k, ranks 1, so M_QA = M_QK ⊙ sa): minus M_QA U (U [rows, BV]) in the same product, M_QK (sv ⊙ v - sa ⊙ U)."""
    Mk = _chunk_cols(mqk, c, r_q, o_r, m_r, TC, N)
    if TIED:
        if VSC:
            Vr = Vr * _chunk_factor(sv, o_r, i_bh, n, T, H, TC, R, RP)[:, None]
        if ASC:
            U = U * _chunk_factor(sa, o_r, i_bh, n, T, H, TC, R, RP)[:, None]
        return _dot(Mk, Vr - U, PRECISION)
    else:
        if VSC:
            Mk = Mk * _chunk_factor(sv, o_r, i_bh, n, T, H, TC, R, RP)[None, :]
        return _dot_ex(Mk, Vr, PRECISION, E_V)


@triton.jit
def _query_state(qd, qf, S, c, i_bh, n, T, H: tl.constexpr, TC: tl.constexpr, K: tl.constexpr, o_k, m_k,
                 RAW: tl.constexpr, E_Q: tl.constexpr, PRECISION: tl.constexpr):
    """Q̃ S for chunk n's queries and a key block o_k of a state slice S [BK, BV]: [TC, BV]. RAW: qd is q
    [B, T, H, K] as given and Q̃ = qf ⊙ q (two TF32 passes when q is 16-bit, E_Q); else qd is Q̃ in the
    chunk layout [B, H, NC, TC, K]."""
    r_q = tl.arange(0, TC)
    if RAW:
        Q = _raw_rows(qd, r_q, i_bh, n, T, H, TC, 1, 1, o_k, m_k, K)
        return _dot_xe(Q, S, PRECISION, E_Q) * tl.load(qf + c * TC + r_q)[:, None]
    else:
        Q = tl.load(qd + (c * TC + r_q[:, None]) * K + o_k[None, :], mask=m_k[None, :], other=0.0).to(tl.float32)
        return _dot(Q, S, PRECISION)


@triton.jit
def _segment(NS, LS, NC, EYE: tl.constexpr, SKIP_LAST: tl.constexpr, cs=None, VARLEN: tl.constexpr = False,
             H: tl.constexpr = 1, TC: tl.constexpr = 16):
    """A state kernel's program on axis 1 as (sequence x head, segment) (``chunk_fwd.segments``): returns its sequence
    x head, the row of its segment's entering / leaving state in [NS, B, H, ...] (segment major), and the chunks
    [n0, n1) it walks (LS 0: all NC). In the EYE walk the segment whose transition is not needed (SKIP_LAST: the last,
    as the forward goes; else the first) walks nothing.

    VARLEN (NS 1): the sequences lie along one row (B = 1), each from a chunk's first token (``chunk_fwd``'s
    ``offsets``); the program (sequence, head) walks its sequence's chunks [cs[i] / TC, cs[i + 1] / TC) of that
    row, and its entering / leaving state is the sequence's."""
    i_bs = tl.program_id(1)
    if VARLEN:
        i_bh = i_bs % H
        i_st = i_bs
        n0 = tl.load(cs + i_bs // H) // TC
        n1 = tl.load(cs + i_bs // H + 1) // TC
    else:
        seg = i_bs % NS
        i_bh = i_bs // NS
        i_st = seg * (tl.num_programs(1) // NS) + i_bh
        n0 = seg * LS
        n1 = NC
        if LS > 0:
            n1 = tl.minimum(n0 + LS, NC)
        if EYE:
            if seg == (NS - 1 if SKIP_LAST else 0):
                n1 = n0
    return i_bh, i_st, n0, n1


@triton.jit
def _state_fwd_kernel(
    h0, d, kd, vf, w, uv, ad, s0, u, ht, NC, kf, af, T,
    K: tl.constexpr, V: tl.constexpr, CR: tl.constexpr, CA: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, BCR: tl.constexpr, BCA: tl.constexpr,
    GATE: tl.constexpr, HAS_H0: tl.constexpr, PRECISION: tl.constexpr,
    RAW: tl.constexpr = False, H: tl.constexpr = 1, TC: tl.constexpr = 16, RKV: tl.constexpr = 1,
    RKVP: tl.constexpr = 1, RAB: tl.constexpr = 1, RABP: tl.constexpr = 1, E_K: tl.constexpr = False,
    E_A: tl.constexpr = False, SAME_AK: tl.constexpr = False, RAW_V: tl.constexpr = False,
    qd=None, qf=None, mqk=None, mqa=None, sv=None, sa=None, o=None, FUSE_O: tl.constexpr = False,
    STORE: tl.constexpr = True, TIED: tl.constexpr = False, VSC: tl.constexpr = False, ASC: tl.constexpr = False,
    E_Q: tl.constexpr = False, E_V: tl.constexpr = False, SCALED: tl.constexpr = False, kg=None,
    GROUPED: tl.constexpr = False, bb=None, E_B: tl.constexpr = False, HDLA: tl.constexpr = False,
    NS=1, LS=0, VS: tl.constexpr = 0, EYE: tl.constexpr = False, UT: tl.constexpr = False, lbk=None,
    cs=None, VARLEN: tl.constexpr = False,
):
    # Rows of K̃/V (CR = C*Rkv) and of W/Ũ/Ã (CA = C*Rab) are taken BCR / BCA at a time,
    # so that the tiles in shared memory stay small whatever the ranks.
    # RAW (a decay per row: scalar gate or none): kd, vf and ad are the inputs k [B, T, H, Rkv, K],
    # v [B, T, H, Rkv, V] and a [B, T, H, Rab, K] as given, the rows' decays and factors in
    # kf [B, H, NC, CR] and af [B, H, NC, CA] (K̃ᵀ V = kᵀ (kf ⊙ v), Ã = af ⊙ a), put on the value
    # side of each product: two TF32 passes when k is 16-bit (E_K, ``_dot_xe``), and 16-bit reads.
    # SAME_AK: a is k (one row block each): K̃ᵀ V - Ãᵀ U = kᵀ (kf ⊙ v - af ⊙ U), one product.
    # RAW_V (not RAW: a per-channel gate without v's factors): vf is v [B, T, H, Rkv, V] as given.
    # FUSE_O: the chunk's output O = Q̃ S_n + M_QK (sv ⊙ v) - M_QA U_n (``chunk_fwd._output_kernel``'s, same
    # arguments: qd, qf, mqk, mqa, sv, sa, TIED, VSC, ASC, E_Q, E_V) is formed here, from S_n and U_n in
    # registers, and stored in o; STORE: S_n and U_n are stored (the output kernel's or the backward's).
    # SCALED (no backward to follow; ``chunk_fwd.scaled_update``): uv is T' [CA, CA] per chunk and af the rows'
    # factors D e^{G_{i-1}}, and Y = T' (sv ⊙ v - D e^{G_{i-1}} ⊙ K S_n) is the chunk's whole value update
    # (sv ⊙ v - sa ⊙ U_n): S += K̃ᵀ Y and O = Q̃ S_n + M_QK Y (FUSE_O), or S_n and Y stored (STORE) for the output
    # kernel (its VALUES); w is not read. A decay per row (SAME_AK and TIED): k and v as given (RAW). A per-channel
    # gate (a = k with factors: ``kda``): vf is v as given, kg holds B ⊙ e^{G_{i-1}}, kd K̃, af D alone.
    # GROUPED (RAW, Rkv = 1): a's rows are k split into RAB groups of channels (Head-in-Head's), formed here from k
    # (``_group_rows``; without SCALED, ad is k: ``chunk_fwd.chunk_dplr_fwd``'s ``hh_mask``). With SCALED
    # (``chunk_fwd.chunk_dplr_fwd``'s ``grouped``): Y's rows are a's, (token, group), with
    # Y = T' (sv ⊙ v - D e^{G_{i-1}} ⊙ B S_n) (bb: b as given, E_B: 16-bit), S += Ãᵀ Y and O = Q̃ S_n + M_QA Y
    # (M_QA passed as mqk).
    # HDLA (with SCALED, a per-channel gate; ``chunk_fwd.chunk_dplr_fwd``'s ``hdla_scaled``): the rows are HDLA's
    # update rows [k, a2], (token, rank), v on rank 0 alone; kd holds their Ã, kg B ⊙ e^{G_{i-1}}, af D = (β, 1),
    # and mqk is M_QA.
    # UT (not SCALED, the chunk's rows one block: BCA = CA; ``chunk_fwd.u_from_t``): w holds B̃ = B ⊙ e^{G_{i-1}}, uv
    # T [CA, CA] and lbk L_BK [CA, CR] (fp32, without v's factors), and U_n = T (B̃ S_n + L_BK V) is formed here
    # (the intra kernel formed neither W = T B̃ nor Ũ = T L_BK V).
    # NS, LS (``chunk_fwd.segments``; LS 0: all NC): each sequence's chunks fall into NS segments of LS chunks,
    # walked by programs of their own; program axis 1 is (sequence x head, segment), and h0 / ht hold each segment's
    # entering / leaving state [NS, B, H, K, VS]. VS: the state's width where it is not v's (v's columns from V on
    # read as 0). EYE (VS = V + K, no h0, nothing stored): the state's column V + j starts as the identity's column
    # j, so that the walk ends on [H | P], the segment's state from 0 and its transition: from an entering state S
    # it leaves P S + H. The last segment's is not needed, and its programs stop at once (``_segment``).
    # VARLEN: cs [N + 1] (``_segment``'s): program axis 1 is (sequence x head), h0 / ht hold each sequence's state.
    VW: tl.constexpr = V if VS == 0 else VS
    i_v = tl.program_id(0)
    i_bh, i_st, n0, n1 = _segment(NS, LS, NC, EYE, True, cs, VARLEN, H, TC)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k, m_v = o_k < K, o_v < V
    m_h = m_k[:, None] & m_v[None, :]
    S = tl.zeros([BK, BV], dtype=tl.float32)
    if EYE:
        S = tl.where(o_k[:, None] == (o_v - V)[None, :], 1.0, 0.0)
    if HAS_H0:
        S += tl.load(h0 + i_st * K * VW + o_k[:, None] * VW + o_v[None, :], mask=m_k[:, None] & (o_v < VW)[None, :],
                     other=0.0)
    for n in range(n0, n1):
        c = i_bh * NC + n  # chunk row of [B, H, NC, ...]
        if STORE:
            tl.store(s0 + c * K * V + o_k[:, None] * V + o_v[None, :], S, mask=m_h)
        if FUSE_O:
            r_q = tl.arange(0, TC)
            O = _query_state(qd, qf, S, c, i_bh, n, T, H, TC, K, o_k, m_k, RAW, E_Q, PRECISION)
        acc = tl.zeros([BK, BV], dtype=tl.float32)  # everything this chunk adds to d ⊙ S
        if not SAME_AK and not SCALED:  # (scaled, Y holds v's share too)
            for r0 in tl.static_range(0, CR, BCR):
                o_r = r0 + tl.arange(0, BCR)
                m_r = o_r < CR
                if RAW:
                    Kr = _raw_rows(kd, o_r, i_bh, n, T, H, TC, RKV, RKVP, o_k, m_k, K)
                    Vr = _raw_rows(vf, o_r, i_bh, n, T, H, TC, RKV, RKVP, o_v, m_v, V)
                    fk = tl.load(kf + c * CR + o_r, mask=m_r, other=0.0)
                    acc += _dot_xe(tl.trans(Kr), Vr * fk[:, None], PRECISION, E_K)
                    if FUSE_O:  # M_QK (sv ⊙ v) alone: tied, M_QA U follows with U (below)
                        O += _values_out(mqk, c, r_q, o_r, m_r, Vr, Vr, sv, sa, i_bh, n, T, H, TC, CR, RKV, RKVP,
                                         False, VSC, ASC, E_V, PRECISION)
                else:
                    Kd = tl.load(kd + c * CR * K + o_r[:, None] * K + o_k[None, :],
                                 mask=m_r[:, None] & m_k[None, :], other=0.0).to(tl.float32)
                    if RAW_V:
                        Vf = _raw_rows(vf, o_r, i_bh, n, T, H, TC, RKV, RKVP, o_v, m_v, V)
                    else:
                        Vf = tl.load(vf + c * CR * V + o_r[:, None] * V + o_v[None, :],
                                     mask=m_r[:, None] & m_v[None, :], other=0.0).to(tl.float32)
                    acc += _dot(tl.trans(Kd), Vf, PRECISION)
                    if FUSE_O:  # Vf is v as given (RAW_V) or with its factors in (vf)
                        O += _dot_ex(_chunk_cols(mqk, c, r_q, o_r, m_r, TC, CR), Vf, PRECISION, E_V and RAW_V)
        for a0 in tl.static_range(0, CA, BCA):
            o_a = a0 + tl.arange(0, BCA)
            m_a = o_a < CA
            m_av = m_a[:, None] & m_v[None, :]
            m_ak = m_a[:, None] & m_k[None, :]
            if SCALED:  # Y = T' (sv ⊙ v - D e^{G_{i-1}} ⊙ K S_n): one row block (BCA = CA), T' is [CA, CA]
                if GROUPED or HDLA:  # rows (token, rank) of a's: v on each group's row (GROUPED) or on rank 0 alone
                    tok, rk = o_a // RABP, o_a % RABP
                    R = _raw_rows(vf, tok, i_bh, n, T, H, TC, 1, 1, o_v, m_v, V)
                    R = R * ((rk < RAB) if GROUPED else (rk == 0))[:, None]
                    if VSC:
                        R = R * _chunk_factor(sv, tok, i_bh, n, T, H, TC, 1, 1)[:, None]
                else:
                    tok = o_a
                    R = _raw_rows(vf, o_a, i_bh, n, T, H, TC, RKV, RKVP, o_v, m_v, V)
                    if VSC:
                        R = R * _chunk_factor(sv, o_a, i_bh, n, T, H, TC, RKV, RKVP)[:, None]
                Tt = tl.load(uv + (c * CA + o_a[:, None]) * CA + o_a[None, :]).to(tl.float32)
                if GATE == 2:  # kg: B ⊙ e^{G_{i-1}} and kd: K̃ = k ⊙ e^{G_C - G}, in the chunk layout; af: D
                    Kg = tl.load(kg + c * CA * K + o_a[:, None] * K + o_k[None, :], mask=m_ak,
                                 other=0.0).to(tl.float32)
                    R -= _dot(Kg, S, PRECISION) * tl.load(af + c * CA + o_a, mask=m_a, other=0.0)[:, None]
                    Y = _dot(Tt, R, PRECISION)
                    Kd = tl.load(kd + c * CA * K + o_a[:, None] * K + o_k[None, :], mask=m_ak,
                                 other=0.0).to(tl.float32)
                    acc += _dot(tl.trans(Kd), Y, PRECISION)
                else:  # k and v as given; GROUPED: b's rows project S_n, and a's rows (k's channels of the row's
                    # group, none for a padded rank) take Y
                    if GROUPED:
                        Pr = _raw_rows(bb, o_a, i_bh, n, T, H, TC, RAB, RABP, o_k, m_k, K)
                        Kr = _group_rows(kd, o_a, i_bh, n, T, H, TC, RAB, RABP, o_k, m_k, K)
                    else:
                        Kr = _raw_rows(kd, o_a, i_bh, n, T, H, TC, RKV, RKVP, o_k, m_k, K)
                        Pr = Kr
                    R -= _dot_xe(Pr, S, PRECISION, E_B if GROUPED else E_K) * tl.load(af + c * CA + o_a, mask=m_a,
                                                                                       other=0.0)[:, None]
                    Y = _dot(Tt, R, PRECISION)
                    fk = tl.load(kf + c * CR + tok, mask=m_a, other=0.0)
                    acc += _dot_xe(tl.trans(Kr), Y * fk[:, None], PRECISION, E_K)
                if FUSE_O:  # (mqk is M_QA where Y's rows are a's: GROUPED, HDLA)
                    O += _dot(_chunk_cols(mqk, c, r_q, o_a, m_a, TC, CA), Y, PRECISION)
                elif STORE:  # Y for the output kernel (its VALUES); S_n is stored above
                    tl.store(u + c * CA * V + o_a[:, None] * V + o_v[None, :], Y, mask=m_av)
            else:
                W = tl.load(w + c * CA * K + o_a[:, None] * K + o_k[None, :], mask=m_ak, other=0.0).to(tl.float32)
                Uc = _dot(W, S, PRECISION)
                if UT:  # U = T (B̃ S_n + L_BK V), V with its factors (one row block: o_a is every row)
                    r_r = tl.arange(0, CR)
                    Lr = tl.load(lbk + (c * CA + o_a[:, None]) * CR + r_r[None, :], mask=m_a[:, None], other=0.0)
                    if RAW or RAW_V:  # v as given, its factors on L's columns
                        Vu = _raw_rows(vf, r_r, i_bh, n, T, H, TC, RKV, RKVP, o_v, m_v, V)
                        if VSC and RAW:
                            Lr = Lr * _chunk_factor(sv, r_r, i_bh, n, T, H, TC, RKV, RKVP)[None, :]
                    else:
                        Vu = tl.load(vf + c * CR * V + r_r[:, None] * V + o_v[None, :], mask=m_v[None, :],
                                     other=0.0).to(tl.float32)
                    Uc += _dot_ex(Lr, Vu, PRECISION, E_V and (RAW or RAW_V))
                    Tt = tl.load(uv + (c * CA + o_a[:, None]) * CA + o_a[None, :], mask=m_a[:, None] & m_a[None, :],
                                 other=0.0).to(tl.float32)
                    Uc = _dot(Tt, Uc, PRECISION)
                else:
                    Uc += tl.load(uv + c * CA * V + o_a[:, None] * V + o_v[None, :], mask=m_av,
                                  other=0.0).to(tl.float32)
                if STORE:
                    tl.store(u + c * CA * V + o_a[:, None] * V + o_v[None, :], Uc, mask=m_av)
                if FUSE_O and not TIED:
                    O -= _dot(_chunk_cols(mqa, c, r_q, o_a, m_a, TC, CA), Uc, PRECISION)
                if SAME_AK:
                    Kr = _raw_rows(kd, o_a, i_bh, n, T, H, TC, RKV, RKVP, o_k, m_k, K)
                    Vr = _raw_rows(vf, o_a, i_bh, n, T, H, TC, RKV, RKVP, o_v, m_v, V)
                    fk = tl.load(kf + c * CR + o_a, mask=m_a, other=0.0)
                    fa = tl.load(af + c * CA + o_a, mask=m_a, other=0.0)
                    acc += _dot_xe(tl.trans(Kr), Vr * fk[:, None] - Uc * fa[:, None], PRECISION, E_K)
                    if FUSE_O:  # not tied, M_QA U_n is taken above
                        O += _values_out(mqk, c, r_q, o_a, m_a, Vr, Uc, sv, sa, i_bh, n, T, H, TC, CR, RKV, RKVP,
                                         TIED, VSC, ASC, E_V, PRECISION)
                else:
                    if FUSE_O and TIED:  # the rows of U are k's (CA = CR); the state's share follows below
                        Ma = _chunk_cols(mqk, c, r_q, o_a, m_a, TC, CA)
                        if ASC:
                            Ma = Ma * _chunk_factor(sa, o_a, i_bh, n, T, H, TC, RAB, RABP)[None, :]
                        O -= _dot(Ma, Uc, PRECISION)
                    if RAW:
                        if GROUPED:  # a's rows formed from k (ad is k)
                            Ar = _group_rows(ad, o_a, i_bh, n, T, H, TC, RAB, RABP, o_k, m_k, K)
                        else:
                            Ar = _raw_rows(ad, o_a, i_bh, n, T, H, TC, RAB, RABP, o_k, m_k, K)
                        fa = tl.load(af + c * CA + o_a, mask=m_a, other=0.0)
                        acc -= _dot_xe(tl.trans(Ar), Uc * fa[:, None], PRECISION, E_A)
                    else:
                        Ad = tl.load(ad + c * CA * K + o_a[:, None] * K + o_k[None, :], mask=m_ak,
                                     other=0.0).to(tl.float32)
                        acc -= _dot(tl.trans(Ad), Uc, PRECISION)
        if GATE == 1:
            S = S * tl.load(d + c)
        elif GATE == 2:
            S = S * tl.load(d + c * K + o_k, mask=m_k, other=0.0)[:, None]
        S += acc
        if FUSE_O:
            t = n * TC + r_q
            tl.store(o + (((i_bh // H) * T + t[:, None]) * H + i_bh % H) * V + o_v[None, :], O,
                     mask=(t < T)[:, None] & m_v[None, :])
    tl.store(ht + i_st * K * VW + o_k[:, None] * VW + o_v[None, :], S, mask=m_k[:, None] & (o_v < VW)[None, :])


@triton.jit
def _segment_starts_kernel(h0, ends, starts, NS, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
                           BV: tl.constexpr, BR: tl.constexpr, HAS_H0: tl.constexpr, PRECISION: tl.constexpr,
                           REVERSE: tl.constexpr = False):
    """The segments' entering states (``chunk_fwd.segments``): S_0 = h0 (or 0), S_{i+1} = P_i S_i + H_i, where ends
    [NS, B, H, K, V + K] holds each segment's [H_i | P_i] (``_state_fwd_kernel``'s EYE); starts [NS, B, H, K, V].
    One program per (value block, sequence x head), fp32 accurate (PRECISION "tf32x3" or "ieee"). With BR = BK the
    state stays in registers and each P_i is read whole; else (K > 128) S_i is read back from starts and S_{i+1}
    formed BR rows at a time. REVERSE (the backward's walk, ``_state_bwd_kernel``): the segments chain from the
    last, S_{NS-1} = h0 (dht) and S_{i-1} = P_i S_i + H_i."""
    i_v, i_bh = tl.program_id(0), tl.program_id(1)
    BH = tl.num_programs(1)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k, m_v = o_k < K, o_v < V
    m_h = m_k[:, None] & m_v[None, :]
    S = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_H0:
        S += tl.load(h0 + i_bh * K * V + o_k[:, None] * V + o_v[None, :], mask=m_h, other=0.0)
    j0 = NS - 1 if REVERSE else 0
    step = -1 if REVERSE else 1
    tl.store(starts + (j0 * BH + i_bh) * K * V + o_k[:, None] * V + o_v[None, :], S, mask=m_h)
    for i in range(NS - 1):
        j = j0 + step * i  # this segment; its [H | P] takes S_j to the next one's
        e = ends + (j * BH + i_bh) * K * (V + K)
        nxt = starts + ((j + step) * BH + i_bh) * K * V
        if BR == BK:
            P = tl.load(e + o_k[:, None] * (V + K) + V + o_k[None, :], mask=m_k[:, None] & m_k[None, :], other=0.0)
            S = _dot(P, S, PRECISION) + tl.load(e + o_k[:, None] * (V + K) + o_v[None, :], mask=m_h, other=0.0)
            tl.store(nxt + o_k[:, None] * V + o_v[None, :], S, mask=m_h)
        else:
            tl.debug_barrier()  # S_i, stored by every thread of the program, read back whole
            S = tl.load(starts + (j * BH + i_bh) * K * V + o_k[:, None] * V + o_v[None, :], mask=m_h, other=0.0)
            for r0 in tl.static_range(0, BK, BR):
                o_r = r0 + tl.arange(0, BR)
                m_r = o_r < K
                P = tl.load(e + o_r[:, None] * (V + K) + V + o_k[None, :], mask=m_r[:, None] & m_k[None, :],
                            other=0.0)
                Sr = _dot(P, S, PRECISION)
                Sr += tl.load(e + o_r[:, None] * (V + K) + o_v[None, :], mask=m_r[:, None] & m_v[None, :], other=0.0)
                tl.store(nxt + o_r[:, None] * V + o_v[None, :], Sr, mask=m_r[:, None] & m_v[None, :])


@triton.jit
def _state_bwd_kernel(
    dht, d, w, ad, ds0, du, dh_next, du_tot, dh0, qd, mqa, do, NC, T, qf, af,
    K: tl.constexpr, V: tl.constexpr, CA: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BCA: tl.constexpr,
    GATE: tl.constexpr, HAS_DHT: tl.constexpr, PRECISION: tl.constexpr,
    FROM_OUT: tl.constexpr, H: tl.constexpr, TC: tl.constexpr, E_DO: tl.constexpr,
    RAW: tl.constexpr = False, RAB: tl.constexpr = 1, RABP: tl.constexpr = 1, E_Q: tl.constexpr = False,
    E_A: tl.constexpr = False, GROUPED: tl.constexpr = False,
    NS=1, LS=0, VS: tl.constexpr = 0, EYE: tl.constexpr = False, STORE: tl.constexpr = True,
    UT: tl.constexpr = False, tinv=None, cs=None, VARLEN: tl.constexpr = False,
):
    # NS, LS, VS, EYE: ``_state_fwd_kernel``'s, the walk in reverse: dht / dh0 hold each segment's entering (at its
    # last chunk) / leaving (before its first) dS [NS, B, H, K, VS], and the first segment's transition is the one
    # not needed. STORE: dS_{n+1} and the total dU_n are stored (not in the EYE walk).
    # FROM_OUT: the outputs' share of dS_n and dU_n (Q̃ᵀ dO and -M_QAᵀ dO, with O = Q̃ S_n + ... - M_QA U_n)
    # is formed here from dO [B, T, H, V] and the chunk's Q̃ [TC, K] and M_QA [TC, CA] (the fused
    # forward's saved tensors); else it is read from ds0 and du. E_DO: dO is 16-bit (``_dot_ex``).
    # RAW (with FROM_OUT; a decay per row): qd and ad are q [B, T, H, K] and a [B, T, H, Rab, K]
    # as given, Q̃ = qf ⊙ q and Ã = af ⊙ a (``_state_fwd_kernel``'s RAW): Q̃ᵀ dO = qᵀ (qf ⊙ dO) and
    # Ã dS = af ⊙ (a dS), two TF32 passes each when q / a are 16-bit (E_Q / E_A). GROUPED (RAW): a's rows are k
    # split into RAB groups of channels (Head-in-Head's), formed here from k, which ad is (``_group_rows``).
    # UT (``_state_fwd_kernel``'s: w holds B̃, not W = T B̃; one row block, BCA = CA): Wᵀ dU_n = B̃ᵀ dX_n with
    # dX_n = Tᵀ dU_n (T in tinv [CA, CA]: fp32, or the 16-bit copy of ``chunk_fwd.u_from_t_16``), and dX_n is
    # stored in du_tot (the values kernel then reads it). VARLEN, cs: ``_state_fwd_kernel``'s.
    VW: tl.constexpr = V if VS == 0 else VS
    i_v = tl.program_id(0)
    i_bh, i_st, n0, n1 = _segment(NS, LS, NC, EYE, False, cs, VARLEN, H, TC)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k, m_v = o_k < K, o_v < V
    m_h = m_k[:, None] & m_v[None, :]
    m_s = m_k[:, None] & (o_v < VW)[None, :]
    dS = tl.zeros([BK, BV], dtype=tl.float32)
    if EYE:
        dS = tl.where(o_k[:, None] == (o_v - V)[None, :], 1.0, 0.0)
    if HAS_DHT:
        dS += tl.load(dht + i_st * K * VW + o_k[:, None] * VW + o_v[None, :], mask=m_s, other=0.0)
    for i in range(n1 - n0):
        n = n1 - 1 - i
        c = i_bh * NC + n
        if STORE:
            tl.store(dh_next + c * K * V + o_k[:, None] * V + o_v[None, :], dS, mask=m_h)
        if FROM_OUT:
            r_q = tl.arange(0, TC)
            t = n * TC + r_q
            dO = tl.load(do + (((i_bh // H) * T + t[:, None]) * H + i_bh % H) * V + o_v[None, :],
                         mask=(t < T)[:, None] & m_v[None, :], other=0.0).to(tl.float32)
            if RAW:
                Q = _raw_rows(qd, r_q, i_bh, n, T, H, TC, 1, 1, o_k, m_k, K)
                dS_prev = _dot_xe(tl.trans(Q), dO * tl.load(qf + c * TC + r_q)[:, None], PRECISION, E_Q)
            else:
                Qd = tl.load(qd + (c * TC + r_q[:, None]) * K + o_k[None, :], mask=m_k[None, :],
                             other=0.0).to(tl.float32)
                dS_prev = _dot_ex(tl.trans(Qd), dO, PRECISION, E_DO)
        else:
            dS_prev = tl.load(ds0 + c * K * V + o_k[:, None] * V + o_v[None, :], mask=m_h, other=0.0)
        if GATE == 1:
            dS_prev += dS * tl.load(d + c)
        elif GATE == 2:
            dS_prev += dS * tl.load(d + c * K + o_k, mask=m_k, other=0.0)[:, None]
        else:
            dS_prev += dS
        for a0 in tl.static_range(0, CA, BCA):
            o_a = a0 + tl.arange(0, BCA)
            m_av = (o_a < CA)[:, None] & m_v[None, :]
            m_ak = (o_a < CA)[:, None] & m_k[None, :]
            if FROM_OUT:
                Ma = tl.load(mqa + (c * TC + r_q[:, None]) * CA + o_a[None, :], mask=(o_a < CA)[None, :],
                             other=0.0).to(tl.float32)
                dU = -_dot_ex(tl.trans(Ma), dO, PRECISION, E_DO)
            else:
                dU = tl.load(du + c * CA * V + o_a[:, None] * V + o_v[None, :], mask=m_av, other=0.0).to(tl.float32)
            if RAW:
                if GROUPED:  # a's rows formed from k (ad is k)
                    Ar = _group_rows(ad, o_a, i_bh, n, T, H, TC, RAB, RABP, o_k, m_k, K)
                else:
                    Ar = _raw_rows(ad, o_a, i_bh, n, T, H, TC, RAB, RABP, o_k, m_k, K)
                fa = tl.load(af + c * CA + o_a, mask=o_a < CA, other=0.0)
                dU -= _dot_xe(Ar, dS, PRECISION, E_A) * fa[:, None]
            else:
                Ad = tl.load(ad + c * CA * K + o_a[:, None] * K + o_k[None, :], mask=m_ak, other=0.0).to(tl.float32)
                dU -= _dot(Ad, dS, PRECISION)
            if UT:  # dX = Tᵀ dU, which B̃ᵀ takes on to dS_n
                Tt = tl.load(tinv + (c * CA + o_a[:, None]) * CA + o_a[None, :],
                             mask=(o_a < CA)[:, None] & (o_a < CA)[None, :], other=0.0).to(tl.float32)
                dU = _dot(tl.trans(Tt), dU, PRECISION)
            if STORE:
                tl.store(du_tot + c * CA * V + o_a[:, None] * V + o_v[None, :], dU, mask=m_av)
            W = tl.load(w + c * CA * K + o_a[:, None] * K + o_k[None, :], mask=m_ak, other=0.0).to(tl.float32)
            dS_prev += _dot(tl.trans(W), dU, PRECISION)
        dS = dS_prev
    tl.store(dh0 + i_st * K * VW + o_k[:, None] * VW + o_v[None, :], dS, mask=m_s)


# launch knobs of the state kernels (benchmarks/bwd_variants.py sweeps them: --set state_stages=2 ...);
# bv / bwd_bv: the forward's / backward's value block, 0 for _blocks' choice; stages / bwd_stages: the forward's /
# backward's num_stages (bwd_stages 0: ``bwd_stages``' choice)
_LAUNCH = dict(warps=4, stages=1, bwd_stages=0, bv=0, bwd_bv=0)


def _blocks(K: int, V: int, CR: int, CA: int, backward: bool = False, precision: str = "") -> dict:
    """Tile sizes: the whole key dim, a slice of the values, <= 64 rows of a chunk at a time.

    The value block is 64 wide up to K = 128 in the forward (H100: 0.22 against 0.32 ms at 32
    for GDN; and at 32 with bf16 W and S_n, Triton 3.6 miscompiled the kernel, BENCHMARKS.md
    session 14). In the backward it is 64 wide up to K = 128 with bf16 products (0.26 against
    0.40 ms) and 32 at fp32 accuracy, where 64 was the slower (session 9).
    """
    BK = max(16, _pow2(K))
    wide = 64 if BK <= (128 if not backward or precision.startswith("bf16") else 64) else 32
    BV = _LAUNCH["bwd_bv" if backward else "bv"] or max(16, min(_pow2(V), wide))
    rows = lambda n: max(16, min(64 if BK <= 128 else 32, _pow2(max(n, 1))))  # noqa: E731
    return dict(BK=BK, BV=BV, BCR=rows(CR), BCA=rows(CA), num_warps=_LAUNCH["warps"], num_stages=_LAUNCH["stages"])


def bwd_stages(precision: str, K: int, e_do: bool) -> int:
    """The backward state kernel's ``num_stages``: ``_LAUNCH["bwd_stages"]`` where set, else 2 (the previous chunk's
    tiles load during this chunk's products) at the bf16 products' precision with 16-bit tiles (the stored ones
    and do) and K <= 128, where it was faster for every mechanism (H100, B8 T2048 H16 K=V=128, ms: GDN 0.263 ->
    0.244, GLA 0.129 -> 0.118, Gated DeltaProduct 0.503 -> 0.446, HH-GDN 0.819 -> 0.663, HDLA 0.433 -> 0.374;
    BENCHMARKS.md session 31); else 1, as fp32 tiles twice the size would press on shared memory."""
    if _LAUNCH["bwd_stages"]:
        return _LAUNCH["bwd_stages"]
    return 2 if precision == "bf16" and K <= 128 and e_do else 1


def _maxnreg(n) -> dict:
    """A kernel launch's register cap (Triton's ``maxnreg``), where a knob sets one."""
    return {"maxnreg": int(n)} if n else {}


def _is16(x) -> bool:
    """Whether x is a 16-bit tensor: its entries are exact in TF32 (``_dot_ex``)."""
    return x is not None and x.dtype in (torch.float16, torch.bfloat16)


def _out_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a kernel stores a result of x's dtype in: x's own (accumulated in fp32, rounded
    on store), except bf16 under the CPU interpreter, which truncates there: fp32, cast by torch."""
    return torch.float32 if x.dtype == torch.bfloat16 and not x.is_cuda else x.dtype


_MATMUL_PRECISION = {"high": "tf32", "medium": "bf16"}


def _precision(x: torch.Tensor) -> str:
    """The products' precision, from PyTorch's ``torch.get_float32_matmul_precision()``, which
    governs the PyTorch path's fp32 matmuls too:

    - "highest" (PyTorch's default): fp32 accuracy, three TF32 passes per product on tensor cores
      ("tf32x3"; two where one operand is 16-bit), "ieee" under the CPU interpreter;
    - "high": one TF32 pass (~1e-3 relative error per product);
    - "medium": bf16 operands with fp32 accumulation, the precision fla's kernels use.

    The diagonal blocks of the UT inverse stay in exact fp32 at every setting.
    """
    reduced = _MATMUL_PRECISION.get(matmul_precision())
    if reduced == "bf16" and not x.is_cuda:
        return "bf16_ieee"
    if reduced is not None:
        return reduced
    return "tf32x3" if x.is_cuda else "ieee"


@opaque_function(3, saves_outputs=True)
class _ChunkStatePassing(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h0, d, kd, vf, w, uv, ad, offsets, chunk_size):
        B, H, NC, CR, K = kd.shape
        V = vf.shape[-1]
        CA = w.shape[-2] if w is not None else 0
        N = B if offsets is None else offsets.shape[0] - 1
        gate = gate_kind(d)
        blocks = _blocks(K, V, CR, CA)
        s0 = kd.new_empty(B, H, NC, K, V)
        u = kd.new_empty(B, H, NC, CA, V)
        ht = kd.new_empty(N, H, K, V)
        dummy = kd
        grid = (_cdiv(V, blocks["BV"]), N * H)
        _state_fwd_kernel[grid](
            h0 if h0 is not None else dummy, d if d is not None else dummy, kd, vf,
            w if w is not None else dummy, uv if uv is not None else dummy, ad if ad is not None else dummy,
            s0, u, ht, NC, dummy, dummy, 0, K=K, V=V, CR=CR, CA=CA, GATE=gate, HAS_H0=h0 is not None,
            PRECISION=_precision(kd), **blocks, **_varlen(offsets, H, chunk_size),
        )
        ctx.save_for_backward(h0, d, kd, vf, w, ad, s0, u, offsets)  # the gradients do not need Ũ
        ctx.gate, ctx.chunk_size = gate, chunk_size
        return s0, u, ht

    @staticmethod
    @once_differentiable
    def backward(ctx, ds0, du, dht):
        h0, d, kd, vf, w, ad, s0, u, offsets = ctx.saved_tensors
        dh0, *grads = state_passing_backward(d, kd, vf, w, ad, s0, u, ds0, du, dht, offsets, ctx.chunk_size)
        return (dh0 if h0 is not None else None), *grads, None, None


def _varlen(offsets, H: int, chunk_size: int) -> dict:
    """The state kernels' arguments for sequences along one row (``offsets`` [N + 1], tokens, each a multiple of
    ``chunk_size``): one program per (value block, sequence x head) walks its sequence's chunks (``_segment``)."""
    return {} if offsets is None else dict(cs=offsets, VARLEN=True, H=H, TC=chunk_size)


def state_passing_backward(d, kd, vf, w, ad, s0, u, ds0, du, dht, offsets=None, chunk_size=16):
    """Gradients of ``chunk_state_passing`` from those of its outputs (any may be None).

    Returns (dh0, d_d, d_kd, d_vf, d_w, d_uv, d_ad); the last three are None when Rab = 0.
    """
    B, H, NC, CR, K = kd.shape
    V = vf.shape[-1]
    CA = u.shape[-2]
    N = B if offsets is None else offsets.shape[0] - 1
    gate = gate_kind(d)
    blocks = _blocks(K, V, CR, CA, backward=True, precision=_precision(kd))
    ds0 = torch.zeros_like(s0) if ds0 is None else ds0.contiguous()
    du = torch.zeros_like(u) if du is None else du.contiguous()
    dh_next = torch.empty_like(s0)
    du_tot = torch.empty_like(u)
    dh0 = kd.new_empty(N, H, K, V)
    dummy = kd
    grid = (_cdiv(V, blocks["BV"]), N * H)
    varlen = _varlen(offsets, H, chunk_size) or dict(H=1, TC=16)
    _state_bwd_kernel[grid](
        dht.contiguous() if dht is not None else dummy, d if d is not None else dummy,
        w if w is not None else dummy, ad if ad is not None else dummy, ds0, du, dh_next, du_tot, dh0,
        dummy, dummy, dummy, NC, 0, dummy, dummy, K=K, V=V, CA=CA, BK=blocks["BK"], BV=blocks["BV"], BCA=blocks["BCA"],
        GATE=gate, HAS_DHT=dht is not None, PRECISION=_precision(kd), FROM_OUT=False, E_DO=False,
        num_warps=blocks["num_warps"], num_stages=blocks["num_stages"], **varlen,
    )
    # Everything else is parallel over chunks: one batched matmul each.
    d_vf = kd @ dh_next  # S_{n+1} += K̃ᵀ V
    d_kd = vf @ dh_next.transpose(-1, -2)
    d_d = None
    if d is not None:
        prod = s0 * dh_next
        d_d = prod.sum((-1, -2))[..., None] if gate == 1 else prod.sum(-1)
    d_w = d_uv = d_ad = None
    if CA:
        d_ad = -(u @ dh_next.transpose(-1, -2))
        d_w = du_tot @ s0.transpose(-1, -2)
        d_uv = du_tot
    return dh0, d_d, d_kd, d_vf, d_w, d_uv, d_ad


def chunk_state_passing(h0, d, kd, vf, w=None, uv=None, ad=None, offsets=None, chunk_size=16):
    """States entering each chunk, the pseudo-values, and the final state.

    h0 [B, H, K, V] or None; d [B, H, NC, 1|K] (exp of the chunk's total log-decay) or
    None; kd [B, H, NC, C*Rkv, K]; vf [B, H, NC, C*Rkv, V]; w, ad [B, H, NC, C*Rab, K]
    and uv [B, H, NC, C*Rab, V], or all None (Rab = 0). All fp32.
    Returns (S [B, H, NC, K, V], U [B, H, NC, C*Rab, V], S_final [B, H, K, V]).

    ``offsets`` [N + 1] (int32, on the device): B = 1 holds N sequences along its row, sequence n on tokens
    ``offsets[n]`` up to ``offsets[n + 1]``, each a multiple of ``chunk_size`` C (the last the row's end); each is
    walked from ``h0[n]`` by programs of its own, in one launch, and h0 and S_final are [N, H, K, V].
    """
    c = lambda x: x.contiguous() if x is not None else None  # noqa: E731
    return _ChunkStatePassing.apply(c(h0), c(d), c(kd), c(vf), c(w), c(uv), c(ad), offsets, chunk_size)
