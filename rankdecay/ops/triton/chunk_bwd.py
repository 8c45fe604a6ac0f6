"""Training with the fused forward: its per-chunk tensors saved, the backward written out.

``chunk_dplr`` runs ``chunk_fwd.chunk_dplr_fwd`` (three Triton kernels) and keeps what it
computed per chunk; the backward follows the forward's equations in reverse (notation
of ``rankdecay.ops.chunk``; per chunk, rows of K̃/V are (token, rank) pairs, padded):

1. outputs, O = Q̃ S_0 + M_QK V - M_QA U:
   dQ̃ = dO S_0ᵀ, dM_QK = dO Vᵀ, dM_QA = -dO Uᵀ, dV = M_QKᵀ dO, dU = -M_QAᵀ dO, dS_0 = Q̃ᵀ dO;
2. the state from chunk to chunk, in reverse (``chunk_state._state_bwd_kernel``), which gives
   dS_{n+1}, the total dU, dK̃ = V dS_{n+1}ᵀ, dÃ = -U dS_{n+1}ᵀ, dW = dU S_0ᵀ, d e^{G_C} = Σ S_0 ⊙ dS_{n+1};
3. the UT transform, U = T (B̃ S_0 + L_BK V) with T = (I + L_BA)^{-1}: with dX = Tᵀ dU,
   dB̃ = dX S_0ᵀ, dL_BA = -dX Uᵀ, dL_BK = dX Vᵀ, dV += L_BKᵀ dX;
4. the decayed products P = Σ_k x_ik y_jk e^{G^x_ik - G^y_jk} give dx and dy, and the
   log-cumsums dG^x = Σ x ⊙ dx, dG^y = -Σ y ⊙ dy; every decayed input (Q̃, K̃, Ã, B̃, e^{G_C})
   adds its own term; dg is the reverse cumsum of dG inside each chunk plus dG_C.

Five kernels: the state kernel in reverse (forming the outputs' share Q̃ᵀ dO and -M_QAᵀ dO
itself); ``_grad_values_kernel`` (dV and dX = Tᵀ dU, per chunk and block of value channels; for a
low-rank decay with rows of its own, done inside the inputs' kernel instead: ``values_in_inputs``);
``_grad_products_kernel`` (the products' gradients, per chunk) and ``_grad_inputs_kernel`` (the
decayed inputs', per chunk and block of key channels); ``_grad_kernel`` (per chunk and block
of key channels: dq, dk, da, db and dg through the products and decays). With a per-channel gate, the
products' share of dq, dk, da and db comes first from ``channel.channel_product_bwd`` (HDLA's, from
``channel.hdla_products_bwd`` in one kernel, its a1 = β k's share in dk and β's).

With a decay per row (scalar gate or none) every kernel reads q, k, v and a as given, the rows'
decays and factors applied on the other side of each product, so the forward saves no decayed
copies. When a and b are k itself (the delta rule, ``ties_keys``), the tiles that meet the same
rows are added in the products kernel and step 4 writes k's three gradients as one.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable

from ..backends import needs_grad
from .channel import _input_dot, channel_product_bwd, hdla_products_bwd
from .chunk_fwd import (_KNOBS, _channel_decays, _decays, _hdla_rows, _load_rows, _lowp, _row_factor, _rows,
                        _scalar_cumsums, carries_kda_rows, chain_segments, chunk_dplr_fwd, hdla_fused_products,
                        kda_b_formed, segments, ties_keys, varlen_sequences)
from .factors import (_hdla_finish_rows, hdla_factors_bwd, hdla_factors_finish, hdla_factors_fwd, kda_factor,
                      placeholder, rows_dtype)
from .fused_recurrent import _cdiv, _pow2, gate_kind
from .opaque import opaque, opaque_function
from .chunk_state import (_blocks, _chunk_rows, _dot, _dot_ex, _dot_xe, _hh_mask_rows, _hh_rows, _is16, _maxnreg,
                          _out_dtype, _precision, _state_bwd_kernel, bwd_stages)

# launch knobs of the backward kernels (widths; the step-4 kernel's per-channel variant and key block).
# inputs_bk / grad_bk 0: _key_block's choice; products 0: by chunk size (_products_warps). grad_channel 0: step 4
# with a per-channel gate, not HDLA's, by rank (``_grad_channel_warps``).
# grad_hdla: step 4 where it also carries HDLA's rows' gradients on to k and g (``_hdla_rows_bwd``, since session
# 32): by chunk size (``_grad_hdla_warps``: 8 at 32 tokens, 4 at 16; sessions 37, 43). grad_hh: Head-in-Head's
# step 4 by groups (``_grad_hh_kernel``): 0, by K (``_grad_hh_warps``); hh_grouped 0 takes the general one instead,
# hh_bk caps its key block (benchmarks). hh_inputs 1: the inputs' kernel reduces dÃ and dB̃ to what step 4 by groups
# reads before storing them (its HG): H100 HH-GDN r=4, inputs 1.41 -> 1.58 ms, step 4 0.93 -> 0.76, fwd+bwd the same
# (7.03 / 7.02 -> 7.05 / 7.05 ms), peak memory 3935 -> 3583 MB (BENCHMARKS.md session 40; 0: stored whole).
# inputs 0: by chunk size, gate and K (``_inputs_warps``). values_in_inputs (1 / 0; None: ``values_in_inputs``'s rule):
# the values kernel's work inside the inputs' kernel, whose launch (warps, key block, cap) it then takes.
# hh_products (1 / 0; None: ``hh_tiles_once``'s rule): with hh_inputs, step 4 by groups takes each group's Gram of k
# first and reads each rank's tiles of dL_BA and dL_BK once, for X, Z and the mask's gradient together
# (``_grad_hh_kernel``'s HP); 0: twice, the mask's share per key block.
_CONFIG = dict(values=4, products=0, inputs=0, inputs_bk=0, grad=4, grad_channel=0, grad_hdla=0, grad_bk=0, grad_hh=0,
               hh_grouped=1, hh_bk=0, hh_inputs=1, state_bwd_maxnreg=0, inputs_maxnreg=None, products_maxnreg=None,
               grad_maxnreg=None, grad_hh_maxnreg=0, values_in_inputs=None, hh_products=None)
# (the *_maxnreg: a register cap (Triton's maxnreg) for that kernel's launches, 0 none; None: ``_register_cap``'s)


def _products_warps(C: int) -> int:
    """The products' gradient kernel's width: ``_CONFIG``'s where set, else 4 for chunks of 64 tokens and 2 for
    smaller ones (ranks above 1), where it was measured faster (H100: HH-GDN 0.98 -> 0.71 ms, HDLA 0.41 -> 0.30,
    against GDN 0.18 -> 0.21 at 64 tokens; BENCHMARKS.md session 28)."""
    return _CONFIG["products"] or (4 if C >= 64 else 2)


def _inputs_warps(C: int, gate: int, K: int = 128) -> int:
    """The inputs' kernel's width: ``_CONFIG``'s where set, else 2 for a per-channel gate in chunks of 16 tokens or
    fewer (HDLA) up to K = 128 and 4 otherwise (H100, bf16, K = 128: HDLA 1.19 -> 0.95 ms on 2; KDA at 32 tokens
    0.68 / 0.66, and Head-in-Head r = 4 at 16 tokens 1.58 -> 3.31 ms, so they keep 4; BENCHMARKS.md session 43). At
    K = V = 256 HDLA's spills 492 bytes on 2 warps and none on 4 (sm_90): H200, B4 T2048 H16, 4.06 -> 2.66 ms, its
    forward+backward 12.9 -> 11.5 ms (session 60)."""
    return _CONFIG["inputs"] or (2 if gate == 2 and C <= 16 and K <= 128 else 4)


def _grad_channel_warps(Rab: int) -> int:
    """Step 4's width with a per-channel gate (not HDLA's, ``_grad_hdla_warps``): ``_CONFIG["grad_channel"]`` where
    set, else 2 without a low-rank decay (GLA) and 4 with one (KDA). H100: 4 in place of 8 (GLA 0.49 -> 0.46 ms,
    HDLA 1.35 -> 1.10; BENCHMARKS.md session 28); H200, B8 T2048 H16 K=V=128 bf16: GLA 0.444 ms on 4, 0.357 on 2,
    0.486 on 8; KDA 0.490 on 4 (with ``_register_cap``'s 128), 0.509 on 2, 0.554 on 8 (session 58)."""
    return _CONFIG["grad_channel"] or (2 if Rab == 0 else 4)


def _grad_hh_warps(K: int) -> int:
    """Head-in-Head's step 4 by groups (``_grad_hh_kernel``): ``_CONFIG["grad_hh"]`` where set, else 1 warp up to
    K = 128 and 2 above. H100 HH-GDN r=4, K = V = 128: 0.93 ms on 1 against 1.22 on 2, 1.43 on 4, 3.59 on 8, and 2.06
    for the general step 4 (BENCHMARKS.md sessions 38, 39). At K = V = 256 it spills 668 bytes on 1 (sm_90) and 12 on
    2: H200, B4 T2048 H16, 0.881 -> 0.713 ms (sessions 59, 60)."""
    return _CONFIG["grad_hh"] or (1 if K <= 128 else 2)


def _register_cap(kernel: str, warps: int, C: int, gate: int, Rab: int, hh: bool, precision: str, K: int,
                  V: int) -> int:
    """A register cap for the products' gradient kernel (``kernel`` "products"), the inputs' ("inputs") or step 4's
    ("grad"), 0 for none: ``_CONFIG``'s ``<kernel>_maxnreg`` where set, else where measured faster. They run at 140-255
    registers a thread and are bound by latency more than by DRAM or the SMs; capped, more programs fit an SM. H100,
    bf16 products, K = V = 128, ms (BENCHMARKS.md session 51): the products' gradient on 2 warps with a per-channel gate
    and a low-rank decay, HDLA (16-token chunks) 0.36 -> 0.26 at 128 (0.29 at 112 and 168, 0.35 at 96), KDA (32) 0.21 ->
    0.17 at 168 (0.20 at 128); the inputs' kernel on 4 warps, Head-in-Head r = 4 1.51 -> 1.37 at 168 (2.52 at 128) and
    KDA 0.68 -> 0.56; step 4 of a per-channel gate of rank 1 at 32-token chunks (KDA) on 4 warps, 138 registers, 0.67 ->
    0.54 at 128. Not for the others measured: Head-in-Head's products' gradient (0.71 -> 1.29 at 168), HDLA's inputs'
    kernel on 2 warps (0.95 -> 1.31 at 200) and step 4 (0.93 -> 1.01 at 96), Gated DeltaNet's and GLA's products'
    gradient (no faster), nor at fp32 accuracy or K, V > 128 (not measured; more registers a tile)."""
    knob = _CONFIG[f"{kernel}_maxnreg"]
    if knob is not None:
        return knob
    if not precision.startswith("bf16") or K > 128 or V > 128:
        return 0
    if kernel == "products":
        return (128 if C <= 16 else 168) if gate == 2 and Rab > 0 and warps == 2 else 0
    if kernel == "grad":
        return 128 if warps == 4 and gate == 2 and Rab == 1 and C == 32 else 0
    return 168 if warps == 4 and (hh or (gate == 2 and Rab == 1 and C == 32)) else 0


def _block_groups(K: int, r: int, BK: int) -> int:
    """Head-in-Head's groups (K / r channels each) that a key block of BK channels covers, where it covers whole
    groups or lies inside one (1); else 0 (``_grad_inputs_kernel``'s NG, ``_KNOBS["hh_sparse_inputs"]`` 0: 0)."""
    width = K // r if K % r == 0 else 0
    if not width or not _KNOBS.get("hh_sparse_inputs", 1):
        return 0
    return BK // width if BK % width == 0 else 1 if width % BK == 0 else 0


def hh_tiles_once(K: int, knob=None) -> bool:
    """Whether Head-in-Head's step 4 by groups takes each group's Gram of k before its loop over the ranks and reads
    each rank's tiles of dL_BA and dL_BK once (``_grad_hh_kernel``'s HP) rather than again in every key block: where
    measured faster, up to K = 128. H200 HH-GDN r=4 B8 T2048 H16, step 4 at K = V = 128 0.749 -> 0.665 ms (forward+
    backward 5.65 -> 5.56), at K = V = 256 (B4) 0.699 -> 0.724 (BENCHMARKS.md session 61). ``knob``
    (``_CONFIG["hh_products"]``) 1 / 0 forces either; None: this rule."""
    return bool(knob) if knob is not None else K <= 128


def _grad_hdla_warps(C: int) -> int:
    """Step 4's width where it carries HDLA's rows' gradients on: ``_CONFIG``'s where set, else 8 for 32-token chunks
    (H100: 1.075 -> 0.870 ms against 4; BENCHMARKS.md session 37) and 4 for 16-token ones (0.87 -> 0.77 ms; 1.01 on
    2; session 43)."""
    return _CONFIG["grad_hdla"] or (4 if C <= 16 else 8)


def _key_block(knob: str, K: int, precision: str, per_channel: bool) -> int:
    """Key block of the inputs' (``inputs_bk``) and step-4 (``grad_bk``) kernels: 64 with bf16
    products (H100, GDN: 0.46 / 0.56 ms against 0.50 / 0.67 at 32; BENCHMARKS.md session 14), 32 at
    fp32 accuracy (64 was slower there, session 9) and in step 4 with a per-channel gate."""
    wide = precision.startswith("bf16") and not (knob == "grad_bk" and per_channel)
    return min(_CONFIG[knob] or (64 if wide else 32), max(16, _pow2(K)))


def values_in_inputs(Rab: int, tied: bool, precision: str, K: int, V: int, knob=None, hh: bool = False) -> bool:
    """Whether the values kernel's work (dV, and dX = Tᵀ dU) runs inside the inputs' kernel
    (``_grad_inputs_kernel``'s VALUES), which then reads dS_{n+1} and the chunk's dO, dX and U once for both:
    ``_CONFIG["values_in_inputs"]`` (1 / 0) where set, else for a low-rank decay with rows of its own (Rab > 0, not
    the delta rule's tied keys) at the bf16 products' precision and K, V <= 128, where it was measured faster. H100,
    B8 T2048 H16 K = V = 128, forward+backward ms (BENCHMARKS.md session 54): HDLA 5.29-5.32 -> 5.12-5.15 (inputs
    0.945 + values 0.312 -> 1.095), HH-GDN r=4 6.47-6.48 -> 6.17-6.24 (1.355 + 0.406 -> 1.459), KDA 3.88 -> 3.83-3.84.
    Not for Gated DeltaNet (tied) and GLA (no ranks), where it was no faster. H200, inputs' + values kernels apart
    against together, ms (session 59): at fp32 accuracy HDLA 6.84 / 9.52, KDA 3.65 / 4.17, HH-GDN 3.90 / 3.86 (off);
    at K = V = 256 (B4) HDLA 4.81 / 6.17 and KDA 2.29 / 2.51 (off), but Head-in-Head (``hh``) 4.39 / 4.03, so it
    takes the fused form at any K and V."""
    if knob is not None:
        return bool(knob)
    return Rab > 0 and not tied and precision.startswith("bf16") and (hh or (K <= 128 and V <= 128))


_SAVED = ("qd", "mqk", "mqa", "kd", "vf", "w", "ad", "dch", "tinv", "lba", "lbk", "s0", "u", "qf", "af", "kdec",
          "gc")


@triton.jit
def _hdla_rows_bwd(dA, dB, Kr, graw, hb, hc, hpart, rka, fq, vq, o_k, m_k, i_k, K: tl.constexpr, TC: tl.constexpr,
                   BK: tl.constexpr):
    """HDLA's rows' gradients da, db [2 TC, BK] (rows token-major, rank minor) carried on to k and g, a block of key
    channels at a time: a1 = β k, a2 = β (λk - β c k), b1 = λk, b2 = k with c = kᵀ(λk) (hc [B, T, H]) held fixed
    here. Returns (dk, dg) [TC, BK] of the chunk's tokens (Kr: k's rows, fq / vq: their flat index and validity) and
    stores this block's Σ da1 k + da2 λk and Σ da2 k to hpart, from which ``factors.hdla_factors_finish`` forms
    c's share (dc = -β² Σ_k da2 k) and dβ."""
    first = (rka == 0)[:, None]
    da1 = tl.sum(tl.reshape(tl.where(first, dA, 0.0), (TC, 2, BK)), axis=1)
    da2 = tl.sum(tl.reshape(tl.where(first, 0.0, dA), (TC, 2, BK)), axis=1)
    db1 = tl.sum(tl.reshape(tl.where(first, dB, 0.0), (TC, 2, BK)), axis=1)
    db2 = tl.sum(tl.reshape(tl.where(first, 0.0, dB), (TC, 2, BK)), axis=1)
    lam = tl.exp(_load_rows(graw, fq, vq, o_k, m_k, K))
    lk = lam * Kr
    be = tl.load(hb + fq, mask=vq, other=0.0).to(tl.float32)[:, None]
    c = tl.load(hc + fq, mask=vq, other=0.0)[:, None]
    dlk = be * da2 + db1  # d(λk), c's share aside
    part = hpart + (fq * tl.num_programs(0) + i_k) * 2
    tl.store(part, tl.sum(da1 * Kr + da2 * lk, axis=1), mask=vq)
    tl.store(part + 1, tl.sum(da2 * Kr, axis=1), mask=vq)
    return be * da1 - be * be * c * da2 + db2 + dlk * lam, dlk * lk


@triton.jit
def _hh_rows_bwd(dA, dB, k, hmask, fa, va, rka, i_h, hpart, i_k, o_k, m_k, K: tl.constexpr, TC: tl.constexpr,
                 RAB: tl.constexpr, RABP: tl.constexpr, BK: tl.constexpr, HH: tl.constexpr):
    """Head-in-Head's rows' gradients da, db [TC RABP, BK] (rows token-major, rank minor) carried on to k: returns
    Σ_j da_j ⊙ 1[group j] + db_j ⊙ M[j, group(·)] [TC, BK], and stores this key block's share of the mask's
    gradient, dM[j, i] = Σ_{l in group i} db_j[l] k[l], to hpart [B, T, H, r, key blocks, r]. Each [rows, BK] tile
    is reduced as soon as it is formed, and k's rows and the mask's entries are read here, not held through step 4.
    a and b themselves step 4 reads as stored: formed from k and the mask there, it spilled 70 registers on the
    H100 and took 2.22 ms against 1.81 (HH-GDN r=4; BENCHMARKS.md session 36)."""
    grp = (o_k // (K // RAB))[None, :]
    rows = tl.where(grp == rka[:, None], dA, 0.0)  # rows past T or r: their tokens' dk is not stored
    rows += dB * _hh_mask_rows(hmask, fa, va, rka, i_h, o_k, m_k, K, RAB, HH)
    dk = tl.sum(tl.reshape(rows, (TC, RABP, BK)), axis=1)
    dbk = dB * _load_rows(k, fa // RAB, va, o_k, m_k, K)
    part = hpart + (fa * tl.num_programs(0) + i_k) * RAB
    for i in tl.static_range(RAB):
        tl.store(part + i, tl.sum(tl.where(grp == i, dbk, 0.0), axis=1), mask=va)
    return dk


def hh_key_block(K: int, r: int) -> int | None:
    """Step 4's key block for Head-in-Head's groups (``_grad_hh_kernel``): the largest power of two up to 64 that
    divides K / r, so that every block lies inside one group; None where that is below 16 (the general step 4)."""
    n = K // r
    bk = min(n & -n, _CONFIG["hh_bk"] or 64)
    return bk if bk >= 16 and _CONFIG["hh_grouped"] else None


@triton.jit
def _hh_mask_col(hmask, fq, vq, i_h, j, i0, r_q, RAB: tl.constexpr, HH: tl.constexpr):
    """M_t[j, i0] for the chunk's tokens [TC] (fq / vq: their flat index and validity): a static mask hmask
    [H, r, r] (HH 1) or one per token [B, T, H, r, r] (HH 2; zero past T), as fp32."""
    if HH == 2:
        return tl.load(hmask + (fq * RAB + j) * RAB + i0, mask=vq, other=0.0).to(tl.float32)
    else:
        return tl.load(hmask + (i_h * RAB + j) * RAB + i0 + 0 * r_q).to(tl.float32)


@triton.jit
def _grad_hh_kernel(
    q, k, g, sa, dmqk, dmqa, dlba, dlbk, dqd, dkd, dad, dbd, dch, ddch, dq, dk, pdg, dsa, hpart, hmask, yb, T, NC,
    H: tl.constexpr, K: tl.constexpr, TC: tl.constexpr, RAB: tl.constexpr, RABP: tl.constexpr, BK: tl.constexpr,
    GATE: tl.constexpr, PRECISION: tl.constexpr, ASC: tl.constexpr, E_Q: tl.constexpr, E_K: tl.constexpr,
    HH: tl.constexpr, IG: tl.constexpr = False, NKI: tl.constexpr = 1, HP: tl.constexpr = False,
):
    """Step 4 of Head-in-Head (a scalar gate or none, one k row per token) for one chunk, a group of key channels at
    a time (``hh_key_block``: blocks of BK channels inside one group): ``_grad_kernel``'s results, with the rows'
    gradients carried on to k and the mask, from products of [TC, TC] tiles with the tokens' rows instead of
    [TC r, TC r] ones with the chunk's TC r rows.

    In group i0's channels a's rows are k's for rank i0 and zero for every other rank, and b's rows are M[j, i0] k:
    so of the products' gradients only dM_QA's and dL_BA's columns (s, i0) enter, and of b's gradients only their
    sum over the ranks with weights M[j, i0] (k's share) and each rank's dot with k (the mask's share). With
    P_BA,j [t, s] and P_BK,j [t, s] (dL_BA's rows (t, j) and columns (s, i0), dL_BK's rows (t, j); decayed) and
    m_j [t] = M_t[j, i0]:

        X = Σ_j m_j P_BA,j, Z = Σ_j m_j P_BK,j        [TC, TC]
        da_(s, i0) = P_QAᵀ Q + Xᵀ K + Da              (the gradient of sa ⊙ a)
        dq = (P_QK + P_QA sa) K + Dq
        dk = P_QKᵀ Q + Zᵀ K + sa ⊙ da + (X sa + Z) K + Σ_j m_j Db_j + Dk
        dM_t[j, i0] = Σ_s (P_BA,j sa + P_BK,j)[t, s] (K Kᵀ)[t, s] + Db_(t, j) · k_t

    Each [TC, TC] product with K or Q here stands for a [TC r, TC r] or [TC r, TC] one there. One program takes
    the whole chunk, so the mask's gradient, d sa and dg's sums are written once each, with no key blocks' shares
    (H100 HH-GDN r=4: BENCHMARKS.md session 38). IG: the inputs' kernel reduced its tiles to what this kernel
    reads (its HG): Da per token (dad [B, H, NC, TC, K]), Σ_j m_j Db_j itself (dbd) and each rank's Db_j · k_t per
    group and inputs' key block (yb, NKI of them, added here) are read as they are. HP (with IG): each group's Gram
    of k (over all its key blocks) is taken before the loop over the ranks, which then reads each rank's tiles of
    dL_BA and dL_BK once for X, Z and the products' share of the mask's gradient together; without it they are read
    again, with the Gram, in every key block."""
    i_c, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    c = i_bh * NC + i_c
    NA: tl.constexpr = TC * RABP
    KR: tl.constexpr = K // RAB  # channels per group
    tok, rk, t, vq, fq = _rows(i_b, i_h, i_c, T, H, TC, 1, 1)
    r_q = tl.arange(0, TC)
    Gq, Gq_ex = _scalar_cumsums(g, i_b, i_h, t, tok, rk, T, H, 1, GATE)
    G_end = tl.sum(Gq - Gq_ex, axis=0)
    Dqk = _decays(Gq, Gq, tok, tok, False, GATE)  # [t, s]: s <= t, e^{G_t - G_s}
    Dbs = _decays(Gq_ex, Gq, tok, tok, True, GATE)  # s < t, e^{G_{t-1} - G_s}
    Pqk = tl.load(dmqk + (c * TC + r_q[:, None]) * TC + r_q[None, :]).to(tl.float32) * Dqk
    if GATE == 1:
        eq = tl.exp(Gq.to(tl.float32))[:, None]
        ek = tl.exp((G_end - Gq).to(tl.float32))[:, None]
        eb = tl.exp(Gq_ex.to(tl.float32))[:, None]
    sQ = tl.zeros([TC], dtype=tl.float32)  # dg's sums (``_scalar_dg_kernel``)
    sKA = tl.zeros([TC], dtype=tl.float32)
    sB = tl.zeros([TC], dtype=tl.float32)
    eC = tl.zeros([BK], dtype=tl.float32)
    r_j = tl.arange(0, RABP)[None, :]
    for i0 in range(RAB):  # the groups (a loop, not unrolled: one group's tiles live at a time)
        if ASC:  # a's factors of the rows (s, i0)
            fac = tl.load(sa + fq * RAB + i0, mask=vq, other=0.0).to(tl.float32)
        else:
            fac = tl.full([TC], 1.0, tl.float32)
        Pqa = tl.load(dmqa + (c * TC + r_q[:, None]) * NA + r_q[None, :] * RABP + i0).to(tl.float32) * Dqk
        X = tl.zeros([TC, TC], dtype=tl.float32)
        Z = tl.zeros([TC, TC], dtype=tl.float32)
        y = tl.zeros([TC, RABP], dtype=tl.float32)  # the mask's gradient dM_t[j, i0]
        if IG:  # the ranks' Db_j · k_t over group i0, from the inputs' kernel's key blocks
            for ki in range(NKI):
                y += tl.load(yb + (((c * TC + r_q[:, None]) * RABP + r_j) * RAB + i0) * NKI + ki)
            if GATE == 1:
                y = y * eb
        if HP:  # the group's Gram first, so that each rank's tiles are read once for X, Z and y together
            Gram = tl.zeros([TC, TC], dtype=tl.float32)
            for k0 in range(i0 * KR, (i0 + 1) * KR, BK):
                o_k = k0 + tl.arange(0, BK)
                Kr = _load_rows(k, fq, vq, o_k, o_k < K, K)
                Gram += _dot_ex(Kr, tl.trans(Kr), PRECISION, E_K)
            Gram = Gram * Dbs
        for j in range(RAB):
            m = _hh_mask_col(hmask, fq, vq, i_h, j, i0, r_q, RAB, HH)
            rows = c * NA + r_q * RABP + j
            Pba = tl.load(dlba + rows[:, None] * NA + r_q[None, :] * RABP + i0).to(tl.float32)
            Pbk = tl.load(dlbk + rows[:, None] * TC + r_q[None, :]).to(tl.float32)
            X += m[:, None] * Pba
            Z += m[:, None] * Pbk
            if HP:
                y += tl.where(r_j == j, tl.sum((Pba * fac[None, :] + Pbk) * Gram, axis=1)[:, None], 0.0)
        X = X * Dbs
        Z = Z * Dbs
        s_a = tl.zeros([TC], dtype=tl.float32)
        for k0 in range(i0 * KR, (i0 + 1) * KR, BK):
            o_k = k0 + tl.arange(0, BK)
            m_k = o_k < K  # (every block lies inside K)
            Q = _load_rows(q, fq, vq, o_k, m_k, K)
            Kr = _load_rows(k, fq, vq, o_k, m_k, K)  # k's rows: one per token, as q's
            Dq = tl.load(dqd + (c * TC + r_q[:, None]) * K + o_k[None, :]).to(tl.float32)
            if GATE == 1:
                Dq = Dq * eq
                eC += tl.load(ddch + c * K + o_k)
            sQ += tl.sum(Q * Dq, axis=1)
            tl.store(dq + fq[:, None] * K + o_k[None, :], _dot_ex(Pqk + Pqa * fac[None, :], Kr, PRECISION, E_K) + Dq,
                     mask=vq[:, None])
            if IG:  # Σ_j m_j Db_j, from the inputs' kernel
                DbM = tl.load(dbd + (c * TC + r_q[:, None]) * K + o_k[None, :]).to(tl.float32)
                if GATE == 1:
                    DbM = DbM * eb
            else:
                DbM = tl.zeros([TC, BK], dtype=tl.float32)
            if not HP:  # the products' share of the mask's gradient, per key block
                Gram = _dot_ex(Kr, tl.trans(Kr), PRECISION, E_K)
                for j in range(RAB):
                    rows = c * NA + r_q * RABP + j
                    Pba = tl.load(dlba + rows[:, None] * NA + r_q[None, :] * RABP + i0).to(tl.float32)
                    Pbk = tl.load(dlbk + rows[:, None] * TC + r_q[None, :]).to(tl.float32)
                    yj = tl.sum((Pba * fac[None, :] + Pbk) * Dbs * Gram, axis=1)
                    if not IG:
                        m = _hh_mask_col(hmask, fq, vq, i_h, j, i0, r_q, RAB, HH)
                        Db = tl.load(dbd + rows[:, None] * K + o_k[None, :]).to(tl.float32)
                        if GATE == 1:
                            Db = Db * eb
                        DbM += m[:, None] * Db
                        yj += tl.sum(Db * Kr, axis=1)
                    y += tl.where(r_j == j, yj[:, None], 0.0)
            sB += tl.sum(Kr * DbM, axis=1)
            Dk = tl.load(dkd + (c * TC + r_q[:, None]) * K + o_k[None, :]).to(tl.float32)
            if IG:
                Da = tl.load(dad + (c * TC + r_q[:, None]) * K + o_k[None, :]).to(tl.float32)
            else:
                Da = tl.load(dad + (c * NA + r_q[:, None] * RABP + i0) * K + o_k[None, :]).to(tl.float32)
            if GATE == 1:
                Dk = Dk * ek
                Da = Da * ek
            sKA += tl.sum(Kr * (Dk + Da * fac[:, None]), axis=1)
            dA = _dot_ex(tl.trans(Pqa), Q, PRECISION, E_Q) + _dot_ex(tl.trans(X), Kr, PRECISION, E_K) + Da
            s_a += tl.sum(Kr * dA, axis=1)
            dK = (_dot_ex(tl.trans(Pqk), Q, PRECISION, E_Q) + _dot_ex(tl.trans(Z), Kr, PRECISION, E_K)
                  + _dot_ex(X * fac[None, :] + Z, Kr, PRECISION, E_K))
            tl.store(dk + fq[:, None] * K + o_k[None, :], dK + Dk + dA * fac[:, None] + DbM, mask=vq[:, None])
        if ASC:  # this group's row of d sa (the gradient of sa ⊙ a: zero for a's other rows in its channels)
            tl.store(dsa + fq * RAB + i0, s_a, mask=vq)
        tl.store(hpart + ((fq[:, None] * RAB + r_j) * RAB + i0), y, mask=vq[:, None] & (r_j < RAB))
    if GATE == 1:  # the chunk's sums for dg (the products' share: _grad_products_kernel)
        row = c * (3 * TC + 1)
        tl.store(pdg + row + r_q, sQ)
        tl.store(pdg + row + TC + r_q, sKA)
        tl.store(pdg + row + 2 * TC + r_q, sB)
        tl.store(pdg + row + 3 * TC + tl.arange(0, 1), tl.sum(eC, axis=0) * tl.load(dch + c)
                 + tl.zeros([1], dtype=tl.float32))


@triton.jit
def _grad_kernel(
    q, k, a, b, g, sa, dmqk, dmqa, dlba, dlbk, dqd, dkd, dad, dbd, dch, ddch, dq, dk, da, db, dg, pdg, dsa,
    pq, pk, pa, pb, graw, hb, hc, hpart, hmask, hdbeta, hdbr, hcnt, T, NC,
    H: tl.constexpr, K: tl.constexpr, KG: tl.constexpr, TC: tl.constexpr, RKV: tl.constexpr,
    RKVP: tl.constexpr, RAB: tl.constexpr, RABP: tl.constexpr, BK: tl.constexpr,
    GATE: tl.constexpr, PRECISION: tl.constexpr, ASC: tl.constexpr,
    E_Q: tl.constexpr, E_K: tl.constexpr, E_A: tl.constexpr, E_B: tl.constexpr, HDLA: tl.constexpr = False,
    HH: tl.constexpr = 0, KDA: tl.constexpr = 0, HFIN: tl.constexpr = False, HAS_DBR: tl.constexpr = False,
):
    """Step 4 for one chunk and block of key channels: dq, dk, da, db and dg from the gradients of
    the products (``_grad_products_kernel``) and of the decayed inputs (``_grad_inputs_kernel``).

    No gate (GATE 0) or a scalar one (1): each product's gradient times its decays, then plain
    products with the inputs, one product at a time; a scalar gate's dg sums over every key
    channel, so each block writes its share per token (pdg: dG_t, dG_{t-1}, dG_C) and
    ``_scalar_dg_kernel`` adds them up. Per channel (2): the products' share of dq, dk, da and db
    is read from pq, pk, pa and pb [B, H, NC, rows, K] (``channel.channel_product_bwd``), and dg
    is formed here.
    With ASC, a's rows carry the factors sa: everything runs on sa ⊙ a, and this block's share of
    d sa (Σ_k a ⊙ d(sa ⊙ a)) goes to dsa [rows, key blocks]. E_Q, E_K, E_A, E_B: that input is
    16-bit, and its products with fp32 tiles take two TF32 passes (``chunk_state._dot_ex``).


    HDLA (``_HDLA``'s products in one kernel): a1 = β k, b1 = λ ⊙ k (λ = e^g, graw the gate as given [B, T, H, K])
    and b2 = k are formed from k and β (hb [B, T, H]), as the factor kernel forms them, and only a2 is read: b may
    be absent. The rows' gradients da and db are not stored but carried on to k and g here (``_hdla_rows_bwd``,
    with c = kᵀ(λ⊙k) from hc [B, T, H]), all but the share through c, which needs the whole K: this block's sums
    for it go to hpart [B, T, H, key blocks, 2]. HFIN: the chunk's last key block to be done (a count per chunk
    in hcnt, int32 zeros) adds that share to every block's dk and dg and stores dβ to hdbeta [B, T, H] fp32, with
    hdbr (HAS_DBR: β's share through the products) added (``factors._hdla_finish_rows``, in the same order of
    operations as ``factors.hdla_factors_finish``, so the bits do not depend on which program came last); else that
    kernel does, after this one.

    HH (Head-in-Head with a scalar gate or none; 1: a static mask hmask [H, r, r], 2: one per token
    [B, T, H, r, r]): a_j = k ⊙ 1[group j] and b_j = k ⊙ M[j, group(·)], and their gradients are carried on to k
    here, the mask's per key block to hpart [B, T, H, r, key blocks, r] (``_hh_rows_bwd``): da and db are not
    stored. Where K / r is a multiple of 16, ``_grad_hh_kernel`` takes Head-in-Head's step 4 instead, by groups.

    KDA (a per-channel gate, ranks 1, a = k with its factors sa, b = e^g ⊙ k: ``kda``'s): b is not read but formed
    from k and the gate as given (graw [B, T, H, K]), and the rows' gradients are carried on to k and g here
    (dk += da + e^g ⊙ db, dg_t += b ⊙ db: what ``factors.kda_factor``'s backward and autograd's sums did): da and
    db are not stored. KDA 2: the products' share in pb is b's rows' taken as k through G_t (``channel_product_bwd``'s
    x2), e^g ⊙ db: it goes to dk as it is, and its decays' share b ⊙ db = k ⊙ (e^g ⊙ db) on G_t, where as b's it
    goes on G_{t-1} and to g_t directly (the same sum).

    The delta rule (a and b are k) has its own kernel, ``_grad_tied_kernel``.
    """
    i_k, i_c, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_h = i_bh // H, i_bh % H
    c = i_bh * NC + i_c
    NK: tl.constexpr = TC * RKVP
    NA: tl.constexpr = TC * RABP
    gc = g + c * TC * KG  # a per-channel gate (GATE 2): g is chunk_log_cumsum's [B, H, NC, TC, K]
    tokq, rkq, tq, vq, fq = _rows(i_b, i_h, i_c, T, H, TC, 1, 1)
    tokk, rkk, tk, vk, fk = _rows(i_b, i_h, i_c, T, H, TC, RKV, RKVP)
    r_q = tl.arange(0, TC)
    r_k = tl.arange(0, NK)
    o_k = i_k * BK + tl.arange(0, BK)
    m_k = o_k < K
    Gq, Gq_ex = _scalar_cumsums(g, i_b, i_h, tq, tokq, rkq, T, H, KG, GATE)
    Gk, _ = _scalar_cumsums(g, i_b, i_h, tk, tokk, rkk, T, H, KG, GATE)
    G_end = tl.sum(Gq - Gq_ex, axis=0)  # the chunk's total log-decay (scalar gate)
    Q = _load_rows(q, fq, vq, o_k, m_k, K)
    Kr = _load_rows(k, fk, vk, o_k, m_k, K)
    if RAB > 0:
        toka, rka, ta, va, fa = _rows(i_b, i_h, i_c, T, H, TC, RAB, RABP)
        r_a = tl.arange(0, NA)
        Ga, Gb = _scalar_cumsums(g, i_b, i_h, ta, toka, rka, T, H, KG, GATE)
        if HDLA:
            be = tl.load(hb + fa // 2, mask=va, other=0.0).to(tl.float32)[:, None]
            Kt, A16 = _hdla_rows(k, a, be, fa, va, rka, o_k, m_k, K)
            Bm = tl.where((rka == 0)[:, None], tl.exp(_load_rows(graw, fa // 2, va & (rka == 0), o_k, m_k, K)) * Kt,
                          Kt)
        elif HH:  # formed from k and the mask, as the forward's intra kernel forms them
            A16 = _hh_rows(k, hmask, a, fa, va, rka, i_h, o_k, m_k, K, RAB, HH, False)
            Bm = _hh_rows(k, hmask, b, fa, va, rka, i_h, o_k, m_k, K, RAB, HH, True)
        elif KDA:  # b = e^g ⊙ k (ranks 1: a's rows are k's, fa is fk)
            A16 = Kr
            eg = tl.exp(_load_rows(graw, fa, va, o_k, m_k, K))
            Bm = eg * Kr
        else:
            A16 = _load_rows(a, fa, va, o_k, m_k, K)  # a as given (16-bit inputs: exact in TF32)
            Bm = _load_rows(b, fa, va, o_k, m_k, K)
        if ASC:
            fac_a = tl.load(sa + fa, mask=va, other=0.0)
            A = A16 * fac_a[:, None]
        else:
            A = A16
    if GATE < 2:
        # dP ⊙ decays: the gradients of the undecayed products x yᵀ, one [C, C] tile live at a time
        # (products with A as P ⊙ sa times a as given: exact factors stay exact)
        P = (tl.load(dmqk + (c * TC + r_q[:, None]) * NK + r_k[None, :]).to(tl.float32)
             * _decays(Gq, Gk, tokq, tokk, False, GATE))
        dQ = _dot_ex(P, Kr, PRECISION, E_K)
        dK = _dot_ex(tl.trans(P), Q, PRECISION, E_Q)
        if RAB > 0:
            P = (tl.load(dmqa + (c * TC + r_q[:, None]) * NA + r_a[None, :]).to(tl.float32)
                 * _decays(Gq, Ga, tokq, toka, False, GATE))
            dA = _dot_ex(tl.trans(P), Q, PRECISION, E_Q)
            if ASC:
                P = P * fac_a[None, :]
            dQ += _dot_ex(P, A16, PRECISION, E_A)
            P = (tl.load(dlba + (c * NA + r_a[:, None]) * NA + r_a[None, :]).to(tl.float32)
                 * _decays(Gb, Ga, toka, toka, True, GATE))
            dA += _dot_ex(tl.trans(P), Bm, PRECISION, E_B)
            if ASC:
                P = P * fac_a[None, :]
            dB = _dot_ex(P, A16, PRECISION, E_A)
            P = (tl.load(dlbk + (c * NA + r_a[:, None]) * NK + r_k[None, :]).to(tl.float32)
                 * _decays(Gb, Gk, toka, tokk, True, GATE))
            dK += _dot_ex(tl.trans(P), Bm, PRECISION, E_B)
            dB += _dot_ex(P, Kr, PRECISION, E_K)
    else:  # the products' share, through their decays (``channel.channel_product_bwd``)
        dQ = tl.load(pq + (c * TC + r_q[:, None]) * K + o_k[None, :], mask=m_k[None, :], other=0.0).to(tl.float32)
        dK = tl.load(pk + (c * NK + r_k[:, None]) * K + o_k[None, :], mask=m_k[None, :], other=0.0).to(tl.float32)
        if RAB > 0:
            if HDLA:  # a2's rows alone (a1's share went to k's and β's)
                dA = tl.load(pa + (c * TC + r_a[:, None] // 2) * K + o_k[None, :],
                             mask=(rka == 1)[:, None] & m_k[None, :], other=0.0).to(tl.float32)
            else:
                dA = tl.load(pa + (c * NA + r_a[:, None]) * K + o_k[None, :], mask=m_k[None, :],
                             other=0.0).to(tl.float32)
            dB = tl.load(pb + (c * NA + r_a[:, None]) * K + o_k[None, :], mask=m_k[None, :], other=0.0).to(tl.float32)
    # the decayed inputs Q̃ = scale Q e^G, K̃ = K e^{G_C - G}, Ã = A e^{G_C - G}, B̃ = B e^{G_{i-1}}
    # and e^{G_C}: their gradients (dQ̃ times the scale) from _grad_inputs_kernel
    Dq = tl.load(dqd + (c * TC + r_q[:, None]) * K + o_k[None, :], mask=m_k[None, :], other=0.0).to(tl.float32)
    Dk = tl.load(dkd + (c * NK + r_k[:, None]) * K + o_k[None, :], mask=m_k[None, :], other=0.0).to(tl.float32)
    # dg: each decayed input's share directly as the cumulative sum over the gates it depends on
    # (sQ: Q̃_t ⊙ dQ̃_t, on g_s for s <= t; sKA: K̃ and Ã, s > t; sB: B̃, s < t; e^{G_C}: every s)
    if GATE == 1:
        eq = tl.exp(Gq.to(tl.float32))[:, None]
        ek = tl.exp((G_end - Gk).to(tl.float32))[:, None]
        Dq = Dq * eq
        Dk = Dk * ek
        sQ = tl.sum(Q * Dq, axis=1)
        sKA = tl.sum(tl.reshape(tl.sum(Kr * Dk, axis=1), (TC, RKVP)), axis=1)
        sB = tl.zeros([TC], dtype=tl.float32)
        eC = tl.sum(tl.load(ddch + c * K + o_k, mask=m_k, other=0.0), axis=0) * tl.load(dch + c)
    elif GATE == 2:
        eq = _channel_decays(gc, tokq, o_k, m_k, KG, TC, False, False)
        ek = _channel_decays(gc, tokk, o_k, m_k, KG, TC, True, False)
        Dq = Dq * eq
        Dk = Dk * ek
        sQ = Q * Dq
        sKA = tl.sum(tl.reshape(Kr * Dk, (TC, RKVP, BK)), axis=1)
        sB = tl.zeros([TC, BK], dtype=tl.float32)
        eC = tl.load(dch + c * KG + o_k, mask=m_k, other=0.0) * tl.load(ddch + c * K + o_k, mask=m_k, other=0.0)
        # the products' share per channel: x ⊙ dx on G^x (G_t, or G_{t-1} for B), -y ⊙ dy on G^y
        dG = Q * dQ - tl.sum(tl.reshape(Kr * dK, (TC, RKVP, BK)), axis=1)
        dGex = tl.zeros([TC, BK], dtype=tl.float32)
    tl.store(dq + fq[:, None] * K + o_k[None, :], dQ + Dq, mask=vq[:, None] & m_k[None, :])
    dK += Dk
    if not HDLA and not HH and not KDA:
        tl.store(dk + fk[:, None] * K + o_k[None, :], dK, mask=vk[:, None] & m_k[None, :])
    if RAB > 0:
        Da = tl.load(dad + (c * NA + r_a[:, None]) * K + o_k[None, :], mask=m_k[None, :], other=0.0).to(tl.float32)
        Db = tl.load(dbd + (c * NA + r_a[:, None]) * K + o_k[None, :], mask=m_k[None, :], other=0.0).to(tl.float32)
        if GATE == 1:
            Da = Da * tl.exp((G_end - Ga).to(tl.float32))[:, None]
            Db = Db * tl.exp(Gb.to(tl.float32))[:, None]
            sKA += tl.sum(tl.reshape(tl.sum(A * Da, axis=1), (TC, RABP)), axis=1)
            sB += tl.sum(tl.reshape(tl.sum(Bm * Db, axis=1), (TC, RABP)), axis=1)
        elif GATE == 2:
            Da = Da * _channel_decays(gc, toka, o_k, m_k, KG, TC, True, False)
            Db = Db * _channel_decays(gc, toka, o_k, m_k, KG, TC, False, True)
            sKA += tl.sum(tl.reshape(A * Da, (TC, RABP, BK)), axis=1)
            sB += tl.sum(tl.reshape(Bm * Db, (TC, RABP, BK)), axis=1)
            dG -= tl.sum(tl.reshape(A * dA, (TC, RABP, BK)), axis=1)
            if KDA == 2:  # dB is k's through G_t (ranks 1)
                dG += Kr * dB
            else:
                dGex += tl.sum(tl.reshape(Bm * dB, (TC, RABP, BK)), axis=1)
        dA += Da
        if ASC:  # d(sa ⊙ a) -> da and this block's share of d sa
            tl.store(dsa + fa * tl.num_programs(0) + i_k, tl.sum(A16 * dA, axis=1), mask=va)
            dA = dA * fac_a[:, None]
        if HDLA:  # on to k and g here (k's rows are q's: one rank)
            dk_rows, dg_rows = _hdla_rows_bwd(dA, dB + Db, Kr, graw, hb, hc, hpart, rka, fq, vq, o_k, m_k, i_k, K,
                                              TC, BK)
            dK += dk_rows
            tl.store(dk + fk[:, None] * K + o_k[None, :], dK, mask=vk[:, None] & m_k[None, :])
        elif HH:  # on to k and the mask here (k's rows are q's: one rank)
            dK += _hh_rows_bwd(dA, dB + Db, k, hmask, fa, va, rka, i_h, hpart, i_k, o_k, m_k, K, TC, RAB, RABP, BK,
                               HH)
            tl.store(dk + fk[:, None] * K + o_k[None, :], dK, mask=vk[:, None] & m_k[None, :])
        elif KDA == 2:  # the products' share already k's (and on G_t): the inputs' Db as below
            dK += dA + dB + eg * Db
            dg_rows = Bm * Db
            tl.store(dk + fk[:, None] * K + o_k[None, :], dK, mask=vk[:, None] & m_k[None, :])
        elif KDA:  # on to k (a's rows and b's through e^g) and g (b's own gate: b ⊙ db)
            dBt = dB + Db
            dK += dA + eg * dBt
            dg_rows = Bm * dBt
            tl.store(dk + fk[:, None] * K + o_k[None, :], dK, mask=vk[:, None] & m_k[None, :])
        else:
            tl.store(da + fa[:, None] * K + o_k[None, :], dA, mask=va[:, None] & m_k[None, :])
            tl.store(db + fa[:, None] * K + o_k[None, :], dB + Db, mask=va[:, None] & m_k[None, :])
    if GATE == 1:  # this block's share (the products' share: _grad_products_kernel)
        row = (c * tl.num_programs(0) + i_k) * (3 * TC + 1)
        tl.store(pdg + row + r_q, sQ)
        tl.store(pdg + row + TC + r_q, sKA)
        tl.store(pdg + row + 2 * TC + r_q, sB)
        tl.store(pdg + row + 3 * TC + tl.arange(0, 1), eC + tl.zeros([1], dtype=tl.float32))
    elif GATE == 2:
        # G_t = Σ_{s <= t} g_s, G_{t-1} = Σ_{s < t} g_s inside the chunk
        dgt = (tl.cumsum(dG, axis=0, reverse=True) + tl.cumsum(dGex, axis=0, reverse=True) - dGex
               + tl.cumsum(sQ, axis=0, reverse=True) + tl.cumsum(sKA, axis=0) - sKA
               + tl.cumsum(sB, axis=0, reverse=True) - sB + eC[None, :])
        if HDLA or KDA:  # b1 = λ ⊙ k's (HDLA) or b = e^g ⊙ k's (KDA) own share
            dgt += dg_rows
        tl.store(dg + ((i_b * T + tq[:, None]) * H + i_h) * KG + o_k[None, :], dgt,
                 mask=(tq < T)[:, None] & m_k[None, :])
        if HFIN:  # the chunk's last key block to finish takes c's share over all K, and dβ (hcnt: zeros per chunk)
            tl.debug_barrier()  # every thread's stores before the count (released with it, gpu scope)
            if tl.atomic_add(hcnt + c, 1, sem="acq_rel") == tl.num_programs(0) - 1:
                # (``factors.hdla_factors_finish``'s rows, the other blocks' reads from L2)
                _hdla_finish_rows(k, graw, hb, hc, hpart, dk, dg, hdbeta, hdbr, fq, vq, tl.num_programs(0), K, BK,
                                  HAS_DBR, ".cg")


@triton.jit
def _grad_tied_kernel(
    q, k, g, dmqk, dlbk, dqd, dkd, dbd, dch, ddch, dq, dk, pdg, T, NC,
    H: tl.constexpr, K: tl.constexpr, TC: tl.constexpr, BK: tl.constexpr, GATE: tl.constexpr,
    PRECISION: tl.constexpr, E_Q: tl.constexpr, E_K: tl.constexpr,
):
    """Step 4 of the delta rule (``ties_keys``: a = sa ⊙ k and b = k, one tensor; ranks 1; no gate or a
    scalar one) for one chunk and block of key channels.

    ``_grad_products_kernel`` stores the tiles that meet the same rows added: M = dM_QK + dM_QA sa
    in dmqk, N = dL_BK + dL_BA sa in dlbk; ``_grad_inputs_kernel`` stores dK̃ + sa ⊙ dÃ in dkd. Then
    dq = M k and dk + sa ⊙ da + db = Mᵀ q + N k + Nᵀ k (plus the decayed inputs' share), one dk:
    three products instead of eight. dq is finished and stored before dk starts, so few [C, BK]
    tiles are live at once. d sa: ``_grad_values_kernel``; a scalar gate's dg as in ``_grad_kernel``.
    """
    i_k, i_c, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_h = i_bh // H, i_bh % H
    c = i_bh * NC + i_c
    tok, rk, t, valid, flat = _rows(i_b, i_h, i_c, T, H, TC, 1, 1)  # q's rows are k's and a's
    r = tl.arange(0, TC)
    o_k = i_k * BK + tl.arange(0, BK)
    m_k = o_k < K
    m_rows = valid[:, None] & m_k[None, :]
    tile = (c * TC + r[:, None]) * TC + r[None, :]
    block = (c * TC + r[:, None]) * K + o_k[None, :]
    G, G_ex = _scalar_cumsums(g, i_b, i_h, t, tok, rk, T, H, 1, GATE)
    Q = _load_rows(q, flat, valid, o_k, m_k, K)
    Kr = _load_rows(k, flat, valid, o_k, m_k, K)
    # dq = M k + dQ̃ e^G (the decayed inputs' share)
    P = tl.load(dmqk + tile).to(tl.float32) * _decays(G, G, tok, tok, False, GATE)
    Dq = tl.load(dqd + block, mask=m_k[None, :], other=0.0).to(tl.float32)
    if GATE == 1:
        Dq = Dq * tl.exp(G.to(tl.float32))[:, None]
        sQ = tl.sum(Q * Dq, axis=1)
    tl.store(dq + flat[:, None] * K + o_k[None, :], _dot_ex(P, Kr, PRECISION, E_K) + Dq, mask=m_rows)
    # dk = Mᵀ q + N k + Nᵀ k + (dK̃ + sa ⊙ dÃ) e^{G_C - G} + dB̃ e^{G_{i-1}}
    dK = _dot_ex(tl.trans(P), Q, PRECISION, E_Q)
    P = tl.load(dlbk + tile).to(tl.float32) * _decays(G_ex, G, tok, tok, True, GATE)
    dK += _dot_ex(P, Kr, PRECISION, E_K) + _dot_ex(tl.trans(P), Kr, PRECISION, E_K)
    Dk = tl.load(dkd + block, mask=m_k[None, :], other=0.0).to(tl.float32)
    Db = tl.load(dbd + block, mask=m_k[None, :], other=0.0).to(tl.float32)
    if GATE == 1:
        Dk = Dk * tl.exp((tl.sum(G - G_ex, axis=0) - G).to(tl.float32))[:, None]
        Db = Db * tl.exp(G_ex.to(tl.float32))[:, None]
    tl.store(dk + flat[:, None] * K + o_k[None, :], dK + Dk + Db, mask=m_rows)
    if GATE == 1:  # this block's share of the decayed inputs' dg (_scalar_dg_kernel)
        row = (c * tl.num_programs(0) + i_k) * (3 * TC + 1)
        tl.store(pdg + row + r, sQ)
        tl.store(pdg + row + TC + r, tl.sum(Kr * Dk, axis=1))
        tl.store(pdg + row + 2 * TC + r, tl.sum(Kr * Db, axis=1))
        eC = tl.sum(tl.load(ddch + c * K + o_k, mask=m_k, other=0.0), axis=0) * tl.load(dch + c)
        tl.store(pdg + row + 3 * TC + tl.arange(0, 1), eC + tl.zeros([1], dtype=tl.float32))


@triton.jit
def _scalar_dg_kernel(dgp, pdg, dg, dsa, dsv, gs, sa, dbeta, T, NC, H: tl.constexpr, TC: tl.constexpr,
                      NKB: tl.constexpr, NVB: tl.constexpr, FOLD: tl.constexpr):
    """dg [B, T, H, 1] of a scalar gate for one chunk: the products' share dgp [B, H, NC, C] plus the
    decayed inputs', from the key blocks' per-token sums pdg [B, H, NC, NKB, 3C + 1] (sQ, sKA, sB,
    e^{G_C}'s share). Token t's sQ depends on the gates g_s, s <= t, so g_s takes the reverse
    cumulative sum; sKA (s > t) the exclusive cumulative sum, sB (s < t) the exclusive reverse
    one, and e^{G_C} every gate of the chunk. One launch where torch took a dozen.

    FOLD (``chunk_gated_delta_rule``: a_scale = β e^g, v_scale = β formed inside the autograd function): the
    factors' gradients, per token and value block dsa, dsv [B, T, H, 1, NVB], go on to the gate and β here,
    dg += Σ dsa ⊙ a_scale and dβ = Σ dsa e^g + Σ dsv (dbeta [B, T, H]; gs, sa: g and a_scale [B, T, H])."""
    i_c, i_bh = tl.program_id(0), tl.program_id(1)
    c = i_bh * NC + i_c
    r = tl.arange(0, TC)
    sQ = tl.zeros([TC], dtype=tl.float32)
    sKA = tl.zeros([TC], dtype=tl.float32)
    sB = tl.zeros([TC], dtype=tl.float32)
    eC = tl.zeros([1], dtype=tl.float32)
    for j in tl.static_range(NKB):
        row = (c * NKB + j) * (3 * TC + 1)
        sQ += tl.load(pdg + row + r)
        sKA += tl.load(pdg + row + TC + r)
        sB += tl.load(pdg + row + 2 * TC + r)
        eC += tl.load(pdg + row + 3 * TC + tl.arange(0, 1))
    d = (tl.load(dgp + c * TC + r) + tl.cumsum(sQ, axis=0, reverse=True) + tl.cumsum(sKA, axis=0) - sKA
         + tl.cumsum(sB, axis=0, reverse=True) - sB + tl.sum(eC, axis=0))
    t = i_c * TC + r
    tok = (i_bh // H * T + t) * H + i_bh % H
    ok = t < T
    if FOLD:
        s_a = tl.zeros([TC], dtype=tl.float32)
        s_v = tl.zeros([TC], dtype=tl.float32)
        for j in tl.static_range(NVB):
            s_a += tl.load(dsa + tok * NVB + j, mask=ok, other=0.0)
            s_v += tl.load(dsv + tok * NVB + j, mask=ok, other=0.0)
        d += s_a * tl.load(sa + tok, mask=ok, other=0.0)
        alpha = tl.exp(tl.load(gs + tok, mask=ok, other=0.0).to(tl.float32))
        tl.store(dbeta + tok, s_a * alpha + s_v, mask=ok)
    tl.store(dg + tok, d, mask=ok)


@triton.jit
def _grad_dv(dO, dX, mqk, kd, dhn, lbk, kdec, c, r_q, r_k, fk, vk, o_v, m_v, K: tl.constexpr, V: tl.constexpr,
             TC: tl.constexpr, NK: tl.constexpr, NA: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
             PRECISION: tl.constexpr, E_DO: tl.constexpr, RAW: tl.constexpr, E_K: tl.constexpr):
    """dV = M_QKᵀ dO + K̃ dS_{n+1} + L_BKᵀ dX [NK, BV] of chunk c and the value columns o_v, before v's factors
    (dO [TC, BV] and dX [NA, BV] at hand; dS_{n+1} read in key blocks of BK). RAW: kd is k as given, K̃ = kdec ⊙ k
    (two TF32 passes when k is 16-bit: E_K)."""
    Mk = tl.load(mqk + (c * TC + r_q[:, None]) * NK + r_k[None, :]).to(tl.float32)
    dV = _dot_ex(tl.trans(Mk), dO, PRECISION, E_DO)
    kdS = tl.zeros([NK, BV], dtype=tl.float32)
    for k0 in tl.static_range(0, K, BK):
        o_k = k0 + tl.arange(0, BK)
        m_k = o_k < K
        dS = tl.load(dhn + (c * K + o_k[:, None]) * V + o_v[None, :], mask=m_k[:, None] & m_v[None, :],
                     other=0.0).to(tl.float32)
        if RAW:
            kdS += _dot_xe(_load_rows(kd, fk, vk, o_k, m_k, K), dS, PRECISION, E_K)
        else:
            Kd = tl.load(kd + (c * NK + r_k[:, None]) * K + o_k[None, :], mask=m_k[None, :], other=0.0).to(tl.float32)
            kdS += _dot(Kd, dS, PRECISION)
    if RAW:
        kdS = kdS * tl.load(kdec + c * NK + r_k)[:, None]
    dV += kdS
    if NA > 0:
        r_a = tl.arange(0, NA)
        Lbk = tl.load(lbk + (c * NA + r_a[:, None]) * NK + r_k[None, :])
        dV += _dot(tl.trans(Lbk), dX, PRECISION)
    return dV


@triton.jit
def _store_dv(dV, dv, v, sv, dsv, u, dsa, c, fk, vk, o_v, m_v, i_v, NVB, V: tl.constexpr, NA: tl.constexpr,
              VSC: tl.constexpr, TIED: tl.constexpr):
    """dV's block i_v of NVB stored as v's gradient: with VSC (V = sv ⊙ v) dv = sv ⊙ dV and the block's share of
    d sv = Σ v ⊙ dV to dsv [..., NVB]; TIED (a = sa ⊙ k, b = k) the block's share of d sa, -Σ_v U ⊙ dV, to dsa."""
    if TIED:
        # d sa (a = sa ⊙ k, rows of a = rows of k; M_QA = M_QK sa, L_BA = L_BK sa, Ã = sa ⊙ K̃):
        # Σ_i dM_QA ⊙ M_QK + Σ_i dL_BA ⊙ L_BK + Σ_k K̃ ⊙ dÃ = -Σ_v U ⊙ (M_QKᵀ dO + L_BKᵀ dX + K̃ dS_{n+1}),
        # which is -U against dV before v's factors: this block of v's share
        r_a = tl.arange(0, NA)
        U = tl.load(u + (c * NA + r_a[:, None]) * V + o_v[None, :], mask=m_v[None, :], other=0.0).to(tl.float32)
        tl.store(dsa + fk * NVB + i_v, -tl.sum(U * dV, axis=1), mask=vk)
    if VSC:
        tl.store(dsv + fk * NVB + i_v, tl.sum(_load_rows(v, fk, vk, o_v, m_v, V) * dV, axis=1), mask=vk)
        dV = dV * tl.load(sv + fk, mask=vk, other=0.0)[:, None]
    tl.store(dv + fk[:, None] * V + o_v[None, :], dV, mask=vk[:, None] & m_v[None, :])


@triton.jit
def _grad_values_kernel(
    do, mqk, kd, dhn, tinv, lbk, du, dx, dv, v, sv, dsv, kdec, u, dsa, T, NC,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, TC: tl.constexpr, RKV: tl.constexpr, RKVP: tl.constexpr,
    NA: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PRECISION: tl.constexpr, VSC: tl.constexpr,
    E_DO: tl.constexpr, RAW: tl.constexpr, E_K: tl.constexpr, TIED: tl.constexpr = False, UT: tl.constexpr = False,
):
    """dV = M_QKᵀ dO + K̃ dS_{n+1} + L_BKᵀ dX and dX = Tᵀ dU (dU: the state kernel's total) for one
    chunk and block of value channels (O = ... + M_QK V, S_{n+1} = ... + K̃ᵀ V, Ũ = T L_BK V).
    With VSC, V = sv ⊙ v: dv = sv ⊙ dV, and this block's share of d sv = Σ v ⊙ dV goes to dsv.
    RAW (a decay per row): kd is k [B, T, H, Rkv, K] as given and K̃ = kdec ⊙ k (two TF32 passes
    when k is 16-bit: E_K). TIED (a = sa ⊙ k, b = k): all of d sa, this block's share -Σ_v U ⊙ dV,
    goes to dsa [B, T, H, 1, value blocks]. UT (``chunk_fwd.u_from_t``): the state kernel formed dX = Tᵀ dU and
    stored it in dx, which is read here (du and tinv are not). ``_grad_inputs_kernel``'s VALUES does the same
    there (``_grad_dv``, ``_store_dv``)."""
    i_v, i_c, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_h = i_bh // H, i_bh % H
    c = i_bh * NC + i_c
    NK: tl.constexpr = TC * RKVP
    _, _, _, vq, fq = _rows(i_b, i_h, i_c, T, H, TC, 1, 1)
    _, _, _, vk, fk = _rows(i_b, i_h, i_c, T, H, TC, RKV, RKVP)
    r_q = tl.arange(0, TC)
    r_k = tl.arange(0, NK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    dO = _load_rows(do, fq, vq, o_v, m_v, V)
    dX = dO  # (unused without ranks)
    if NA > 0:
        r_a = tl.arange(0, NA)
        if UT:
            dX = tl.load(dx + (c * NA + r_a[:, None]) * V + o_v[None, :], mask=m_v[None, :], other=0.0).to(tl.float32)
        else:
            Ti = tl.load(tinv + (c * NA + r_a[:, None]) * NA + r_a[None, :])
            dU = tl.load(du + (c * NA + r_a[:, None]) * V + o_v[None, :], mask=m_v[None, :],
                         other=0.0).to(tl.float32)
            dX = _dot(tl.trans(Ti), dU, PRECISION)
            tl.store(dx + (c * NA + r_a[:, None]) * V + o_v[None, :], dX, mask=m_v[None, :])
    dV = _grad_dv(dO, dX, mqk, kd, dhn, lbk, kdec, c, r_q, r_k, fk, vk, o_v, m_v, K, V, TC, NK, NA, BK, BV,
                  PRECISION, E_DO, RAW, E_K)
    _store_dv(dV, dv, v, sv, dsv, u, dsa, c, fk, vk, o_v, m_v, i_v, tl.num_programs(0), V, NA, VSC, TIED)


@triton.jit
def _straddle(Z, TC: tl.constexpr):
    """[TC] with entry t = Σ of Z[i, j] over the pairs j < t <= i (Z: [TC, TC], tokens)."""
    W = tl.cumsum(Z, axis=1) - Z  # W[i, t] = Σ_{j < t} Z[i, j]
    r = tl.arange(0, TC)
    return tl.sum(tl.where(r[:, None] >= r[None, :], W, 0.0), axis=0)


@triton.jit
def _token_sum(Z, TC: tl.constexpr, RX: tl.constexpr, RY: tl.constexpr):
    """[TC * RX, TC * RY] (rows and columns token-major, rank-minor) -> [TC, TC] summed over the ranks."""
    if RY > 1:
        Z = tl.sum(tl.reshape(Z, (TC * RX, TC, RY)), axis=2)
    if RX > 1:
        Z = tl.sum(tl.reshape(Z, (TC, RX, TC)), axis=1)
    return Z


@triton.jit
def _grad_products_kernel(
    do, vf, u, dx, mqk, mqa, lba, lbk, dmqk, dmqa, dlba, dlbk, dgp, sv, sa, scale, T, NC,
    H: tl.constexpr, V: tl.constexpr, TC: tl.constexpr, RKV: tl.constexpr, RKVP: tl.constexpr, RABP: tl.constexpr,
    BV: tl.constexpr, GATE: tl.constexpr, PRECISION: tl.constexpr, E_DO: tl.constexpr, RAW: tl.constexpr,
    VSC: tl.constexpr, LP_DV: tl.constexpr, E_V: tl.constexpr, TIED: tl.constexpr = False, RAW_V: tl.constexpr = False,
):
    """The gradients of one chunk's products, causally masked: dM_QK = scale dO Vᵀ and
    dM_QA = -scale dO Uᵀ (the forward folds the scale in), dL_BA = -dX Uᵀ, dL_BK = dX Vᵀ.

    With a scalar gate also the products' share of dg: an entry P_ij (token i's row, token j's
    column) is e^{G_i - G_j} (or e^{G_{i-1} - G_j}) times an undecayed product, so
    ∂P_ij/∂g_t = P_ij for the t it straddles, j < t <= i (or i - 1), and
    dg_t = Σ_{straddling pairs} dP_ij P_ij, summed as such (``_straddle``, once for all four
    products): no pair enters twice with opposite signs, as it would in reverse cumulative sums
    of x ⊙ dx - y ⊙ dy.

    RAW (a decay per row): vf is v [B, T, H, Rkv, V] as given (V = sv ⊙ v with VSC): dO vᵀ in
    the inputs' dtype when both are 16-bit (LP_DV, exact), dX vᵀ in two TF32 passes (E_V), and
    sv on the columns. RAW_V (not RAW: a per-channel gate without sv): vf is v as given.

    TIED (a = sa ⊙ k, b = k: ``_grad_tied_kernel``): the pairs of tiles that meet the same rows
    are stored added, dM_QK + dM_QA sa into dmqk and dL_BK + dL_BA sa into dlbk (M_QA = M_QK sa,
    L_BA = L_BK sa). Both sums are products with one tile, dO (sv ⊙ v - sa ⊙ u)ᵀ and
    dX (sv ⊙ v - sa ⊙ u)ᵀ: two accumulators instead of four. Their share of d sa comes from
    ``_grad_values_kernel``, which has M_QKᵀ dO + L_BKᵀ dX at hand."""
    i_c, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    c = i_bh * NC + i_c
    NK: tl.constexpr = TC * RKVP
    NA: tl.constexpr = TC * RABP
    _, _, _, vq, fq = _rows(i_b, i_h, i_c, T, H, TC, 1, 1)
    r_q = tl.arange(0, TC)
    r_k = tl.arange(0, NK)
    tokk = r_k // RKVP
    if RAW or RAW_V:
        _, _, _, vk, fk = _rows(i_b, i_h, i_c, T, H, TC, RKV, RKVP)
    Pqk = tl.zeros([TC, NK], dtype=tl.float32)
    if NA > 0:
        r_a = tl.arange(0, NA)
        toka = r_a // RABP
        Pbk = tl.zeros([NA, NK], dtype=tl.float32)
        if not TIED:
            Pqa = tl.zeros([TC, NA], dtype=tl.float32)
            Pba = tl.zeros([NA, NA], dtype=tl.float32)
    if TIED:  # the rows' factors, on the columns of both tiles
        fa = _row_factor(sa, fk, vk)[:, None]
        if VSC:
            fv = _row_factor(sv, fk, vk)[:, None]
        else:
            fv = tl.full([NK, 1], 1.0, dtype=tl.float32)
    for v0 in tl.static_range(0, V, BV):
        o_v = v0 + tl.arange(0, BV)
        m_v = o_v < V
        dO = _load_rows(do, fq, vq, o_v, m_v, V)
        if TIED:  # M_QA = M_QK sa and L_BA = L_BK sa: dO and dX against (sv ⊙ v - sa ⊙ u) once
            U = tl.load(u + (c * NA + r_a[:, None]) * V + o_v[None, :], mask=m_v[None, :], other=0.0).to(tl.float32)
            dX = tl.load(dx + (c * NA + r_a[:, None]) * V + o_v[None, :], mask=m_v[None, :], other=0.0).to(tl.float32)
            Wv = tl.trans(_load_rows(vf, fk, vk, o_v, m_v, V) * fv - U * fa)
            Pqk += _dot(dO, Wv, PRECISION)
            Pbk += _dot(dX, Wv, PRECISION)
        else:
            if RAW:
                Vf = _load_rows(vf, fk, vk, o_v, m_v, V)
                Pqk += _input_dot(dO, Vf, do, vf, LP_DV, PRECISION)
            else:
                if RAW_V:
                    Vf = _load_rows(vf, fk, vk, o_v, m_v, V)
                else:
                    Vf = tl.load(vf + (c * NK + r_k[:, None]) * V + o_v[None, :], mask=m_v[None, :],
                                 other=0.0).to(tl.float32)
                Pqk += _dot_xe(dO, tl.trans(Vf), PRECISION, E_DO)
            if NA > 0:
                U = tl.load(u + (c * NA + r_a[:, None]) * V + o_v[None, :], mask=m_v[None, :], other=0.0).to(tl.float32)
                dX = tl.load(dx + (c * NA + r_a[:, None]) * V + o_v[None, :], mask=m_v[None, :],
                             other=0.0).to(tl.float32)
                Pqa -= _dot_xe(dO, tl.trans(U), PRECISION, E_DO)
                Pba -= _dot(dX, tl.trans(U), PRECISION)
                if RAW:
                    Pbk += _dot_ex(dX, tl.trans(Vf), PRECISION, E_V)
                else:
                    Pbk += _dot(dX, tl.trans(Vf), PRECISION)
    if RAW and VSC and not TIED:
        fv = _row_factor(sv, fk, vk)[None, :]
        Pqk = Pqk * fv
        if NA > 0:
            Pbk = Pbk * fv
    tl.store(dmqk + (c * TC + r_q[:, None]) * NK + r_k[None, :],
             tl.where(r_q[:, None] >= tokk[None, :], Pqk * scale, 0.0))
    if TIED:
        if GATE == 1:
            Mq = tl.load(mqk + (c * TC + r_q[:, None]) * NK + r_k[None, :]).to(tl.float32)
            Z1 = tl.load(lbk + (c * NA + r_a[:, None]) * NK + r_k[None, :]) * Pbk
            dgt = (_straddle(Pqk * Mq + Z1, TC)
                   - tl.sum(tl.where(r_q[:, None] > r_q[None, :], Z1, 0.0), axis=1))
            tl.store(dgp + c * TC + r_q, dgt)
    elif GATE == 1:
        # Z[i, j] = dP P summed over the ranks of tokens i and j (M and L are stored causally masked)
        Z0 = _token_sum(Pqk * tl.load(mqk + (c * TC + r_q[:, None]) * NK + r_k[None, :]).to(tl.float32), TC, 1, RKVP)
        if NA > 0:
            Mqa = tl.load(mqa + (c * TC + r_q[:, None]) * NA + r_a[None, :]).to(tl.float32)
            Z0 += _token_sum(Pqa * Mqa, TC, 1, RABP)
            Z1 = (_token_sum(Pba * tl.load(lba + (c * NA + r_a[:, None]) * NA + r_a[None, :]), TC, RABP, RABP)
                  + _token_sum(Pbk * tl.load(lbk + (c * NA + r_a[:, None]) * NK + r_k[None, :]), TC, RABP, RKVP))
            # L's pairs straddle j < t <= i - 1: those of j < t <= i less the ones on row i = t
            dgt = _straddle(Z0 + Z1, TC) - tl.sum(tl.where(r_q[:, None] > r_q[None, :], Z1, 0.0), axis=1)
        else:
            dgt = _straddle(Z0, TC)
        tl.store(dgp + c * TC + r_q, dgt)
    if NA > 0:
        if not TIED:
            tl.store(dmqa + (c * TC + r_q[:, None]) * NA + r_a[None, :],
                     tl.where(r_q[:, None] >= toka[None, :], Pqa * scale, 0.0))
            tl.store(dlba + (c * NA + r_a[:, None]) * NA + r_a[None, :],
                     tl.where(toka[:, None] > toka[None, :], Pba, 0.0))
        tl.store(dlbk + (c * NA + r_a[:, None]) * NK + r_k[None, :], tl.where(toka[:, None] > tokk[None, :], Pbk, 0.0))


@triton.jit
def _grad_inputs_kernel(
    do, s0, dhn, vf, u, dx, dqd, dkd, dad, dbd, ddch, sv, sa, k, hmask, yb, mqk, kd, lbk, kdec, tinv, du, dv, v, dsv,
    dsa, scale, T, NC,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, TC: tl.constexpr, NK: tl.constexpr, NA: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, GATE: tl.constexpr, PRECISION: tl.constexpr, E_DO: tl.constexpr,
    RKV: tl.constexpr = 1, RKVP: tl.constexpr = 1, RAW: tl.constexpr = False, VSC: tl.constexpr = False,
    E_V: tl.constexpr = False, TIED: tl.constexpr = False, RAW_V: tl.constexpr = False, HG: tl.constexpr = 0,
    RAB: tl.constexpr = 1, RABP: tl.constexpr = 1, NG: tl.constexpr = 0, VALUES: tl.constexpr = False,
    BKV: tl.constexpr = 64, E_K: tl.constexpr = False, UT: tl.constexpr = True,
):
    """The gradients of the decayed inputs for one chunk and block of key channels: dQ̃ = dO S_nᵀ
    (stored times the scale, Q̃'s factor besides the decay),
    dK̃ = V dS_{n+1}ᵀ, dÃ = -U dS_{n+1}ᵀ, dB̃ = dX S_nᵀ and d e^{G_C} = Σ_v S_n ⊙ dS_{n+1} (per channel).
    RAW (a decay per row): vf is v [B, T, H, Rkv, V] as given, V = sv ⊙ v with VSC (two TF32
    passes when v is 16-bit: E_V). RAW_V (not RAW: a per-channel gate without sv): vf is v as given.

    TIED (a = sa ⊙ k, b = k): k's rows are a's, and dK̃ + sa ⊙ dÃ = (V - sa ⊙ U) dS_{n+1}ᵀ is
    stored in dkd, one accumulator for two (dad unused; d sa's share of dÃ comes from
    ``_grad_values_kernel``, or from this kernel's VALUES).

    HG (Head-in-Head with step 4 by groups, ``_grad_hh_kernel``'s IG; 1: a static mask hmask [H, r, r], 2: one per
    token): dÃ and dB̃ are taken whole, as without it, and reduced to what step 4 reads before they are stored, a
    quarter of them at r = 4: in channel l of group i, dÃ's row (t, i) to dad [B, H, NC, TC, K] and
    Σ_j M_t[j, i] dB̃_(t, j) to dbd [B, H, NC, TC, K], and each rank's dB̃_(t, j) · k_t over the block's channels of
    each group i to yb [B, H, NC, TC RABP, RAB, key blocks] (k [B, T, H, 1, K] as given; zero for a group the block
    does not reach), whose key blocks step 4 adds. NG (with HG: the key block's channels in NG whole groups, or in
    part of one: NG 1): dÃ's row (t, i) is kept on group i's channels alone, so only the block's groups' rows of U
    are read and multiplied, NG of every RAB (half of them at r = 4 and 64 channels a block).

    VALUES: ``_grad_values_kernel``'s work too, each value block by one of the chunk's key-block programs (block
    i_v by program i_v mod the key blocks), from the dO and dX it has at hand and dS_{n+1} read whole over the keys
    in blocks of BKV (its own block again from cache): dV to dv (and its shares of d sv to dsv and, TIED, of d sa to
    dsa, [..., value blocks]). mqk, kd, lbk, kdec, v, E_K and RAW are the values kernel's. Without UT, dX = Tᵀ dU
    is formed here from tinv and du for each value block and stored (for the products' kernel) by its owner.
    dS_{n+1} and the chunk's per-token tiles are then read once for both (``values_in_inputs``)."""
    i_k, i_c, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_h = i_bh // H, i_bh % H
    c = i_bh * NC + i_c
    _, _, _, vq, fq = _rows(i_b, i_h, i_c, T, H, TC, 1, 1)
    r_q = tl.arange(0, TC)
    r_k = tl.arange(0, NK)
    o_k = i_k * BK + tl.arange(0, BK)
    m_k = o_k < K
    if RAW or RAW_V or VALUES:
        _, _, _, vk, fk = _rows(i_b, i_h, i_c, T, H, TC, RKV, RKVP)
    Dq = tl.zeros([TC, BK], dtype=tl.float32)
    Dk = tl.zeros([NK, BK], dtype=tl.float32)
    Dd = tl.zeros([BK], dtype=tl.float32)
    if NA > 0:
        r_a = tl.arange(0, NA)
        Db = tl.zeros([NA, BK], dtype=tl.float32)
        if NG:  # the block's groups' rows (t, j0 + jj) of U, token-major
            r_s = tl.arange(0, TC * NG)
            j0 = (i_k * BK) // (K // RAB)
            row_u = (r_s // NG) * RABP + j0 + r_s % NG
            Da = tl.zeros([TC * NG, BK], dtype=tl.float32)
        elif not TIED:  # every row of U
            row_u = r_a
            Da = tl.zeros([NA, BK], dtype=tl.float32)
    if TIED:
        fa = _row_factor(sa, fk, vk)[:, None]
        if VSC:
            fv = _row_factor(sv, fk, vk)[:, None]
        else:
            fv = tl.full([NK, 1], 1.0, dtype=tl.float32)
    if VALUES and NA > 0 and not UT:
        Ti = tl.load(tinv + (c * NA + r_a[:, None]) * NA + r_a[None, :])
    for v0 in tl.static_range(0, V, BV):
        o_v = v0 + tl.arange(0, BV)
        m_v = o_v < V
        m_kv = m_k[:, None] & m_v[None, :]
        S0 = tl.load(s0 + (c * K + o_k[:, None]) * V + o_v[None, :], mask=m_kv, other=0.0).to(tl.float32)
        dS = tl.load(dhn + (c * K + o_k[:, None]) * V + o_v[None, :], mask=m_kv, other=0.0).to(tl.float32)
        dO = _load_rows(do, fq, vq, o_v, m_v, V)
        Dq += _dot_xe(dO, tl.trans(S0), PRECISION, E_DO)
        if TIED:
            U = tl.load(u + (c * NA + r_a[:, None]) * V + o_v[None, :], mask=m_v[None, :], other=0.0).to(tl.float32)
            Dk += _dot(_load_rows(vf, fk, vk, o_v, m_v, V) * fv - U * fa, tl.trans(dS), PRECISION)
        elif RAW:
            Dk += _dot_xe(_load_rows(vf, fk, vk, o_v, m_v, V), tl.trans(dS), PRECISION, E_V)
        else:
            if RAW_V:
                Vf = _load_rows(vf, fk, vk, o_v, m_v, V)
            else:
                Vf = tl.load(vf + (c * NK + r_k[:, None]) * V + o_v[None, :], mask=m_v[None, :],
                             other=0.0).to(tl.float32)
            Dk += _dot(Vf, tl.trans(dS), PRECISION)
        if GATE > 0:
            Dd += tl.sum(S0 * dS, axis=1)
        if NA > 0:
            if NG or not TIED:
                U = tl.load(u + (c * NA + row_u[:, None]) * V + o_v[None, :], mask=m_v[None, :],
                            other=0.0).to(tl.float32)
                Da -= _dot(U, tl.trans(dS), PRECISION)
            if VALUES and not UT:  # dX = Tᵀ dU, as the values kernel forms it
                dX = _dot(tl.trans(Ti), tl.load(du + (c * NA + r_a[:, None]) * V + o_v[None, :], mask=m_v[None, :],
                                                other=0.0).to(tl.float32), PRECISION)
            else:
                dX = tl.load(dx + (c * NA + r_a[:, None]) * V + o_v[None, :], mask=m_v[None, :],
                             other=0.0).to(tl.float32)
            Db += _dot(dX, tl.trans(S0), PRECISION)
        else:
            dX = dO  # (unused without ranks)
        if VALUES:
            i_v = v0 // BV
            if i_v % tl.num_programs(0) == i_k:  # this value block's dV is this program's
                if NA > 0 and not UT:
                    tl.store(dx + (c * NA + r_a[:, None]) * V + o_v[None, :], dX, mask=m_v[None, :])
                dV = _grad_dv(dO, dX, mqk, kd, dhn, lbk, kdec, c, r_q, r_k, fk, vk, o_v, m_v, K, V, TC, NK, NA, BKV,
                              BV, PRECISION, E_DO, RAW, E_K)
                _store_dv(dV, dv, v, sv, dsv, u, dsa, c, fk, vk, o_v, m_v, i_v, (V + BV - 1) // BV, V, NA, VSC,
                          TIED)
    if RAW and VSC and not TIED:
        Dk = Dk * _row_factor(sv, fk, vk)[:, None]
    tl.store(dqd + (c * TC + r_q[:, None]) * K + o_k[None, :], Dq * scale, mask=m_k[None, :])
    tl.store(dkd + (c * NK + r_k[:, None]) * K + o_k[None, :], Dk, mask=m_k[None, :])
    if GATE > 0:
        tl.store(ddch + c * K + o_k, Dd, mask=m_k)
    if HG:  # what step 4 by groups reads, per token (rows past T or r have zero mask entries and k rows)
        _, rka, _, va, fa = _chunk_rows(r_a, i_b, i_h, i_c, T, H, TC, RAB, RABP)
        grp = o_k // (K // RAB)  # each channel's group
        Dbk = Db * _load_rows(k, fa // RAB, va, o_k, m_k, K)
        Db = Db * _hh_mask_rows(hmask, fa, va, rka, i_h, o_k, m_k, K, RAB, HG)
        # the rows' sums per token and per group as products with 0/1 selections, two TF32 passes each (fp32
        # accuracy); reshaped and summed instead, the H100 took 1.66 against 1.58 ms (BENCHMARKS.md session 40)
        sel = tl.where(r_a[None, :] // RABP == r_q[:, None], 1.0, 0.0)  # [TC, NA]: row (t, j) to token t
        if NG > 1:  # the block's groups' rows, each on its own group's channels
            Da = tl.where((grp - j0)[None, :] == (r_s % NG)[:, None], Da, 0.0)
            Da = _dot_xe(tl.where(r_s[None, :] // NG == r_q[:, None], 1.0, 0.0), Da, "tf32x3", True)
        elif not NG:
            Da = tl.where(grp[None, :] == rka[:, None], Da, 0.0)
            Da = _dot_xe(sel, Da, "tf32x3", True)
        Db = _dot_xe(sel, Db, "tf32x3", True)
        r_i = tl.arange(0, 16)  # (a product's smallest width; the groups past RAB are not stored)
        gsel = tl.where(grp[:, None] == r_i[None, :], 1.0, 0.0)  # [BK, 16]: channel to group
        tl.store(yb + ((c * NA + r_a[:, None]) * RAB + r_i[None, :]) * tl.num_programs(0) + i_k,
                 _dot_ex(Dbk, gsel, "tf32x3", True), mask=r_i[None, :] < RAB)
        tl.store(dad + (c * TC + r_q[:, None]) * K + o_k[None, :], Da, mask=m_k[None, :])
        tl.store(dbd + (c * TC + r_q[:, None]) * K + o_k[None, :], Db, mask=m_k[None, :])
    elif NA > 0:
        if not TIED:
            tl.store(dad + (c * NA + r_a[:, None]) * K + o_k[None, :], Da, mask=m_k[None, :])
        tl.store(dbd + (c * NA + r_a[:, None]) * K + o_k[None, :], Db, mask=m_k[None, :])


@opaque_function(2)
class _ChunkDPLR(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, a, b, g, h0, scale, a_scale, v_scale, tied, hh_mask=None, kda_b=False, kda_rows=False,
                offsets=None):
        ctx.set_materialize_grads(False)  # an unused final state's gradient stays None: no [B, H, K, V] zeros
        # tied: a = b = k (a and b are None here), their gradients returned as k's. hh_mask: a and b are
        # Head-in-Head's rows of k and this mask (``chunk_dplr``), whose gradients go to k and the mask. kda_b: b is
        # e^g ⊙ k (``chunk_dplr``); kda_rows: and a is k, and their gradients go to k and g (da and db None)
        fa, fb = (k, k) if tied else (a, b)
        o, ht, saved = chunk_dplr_fwd(q, k, v, fa, fb, g, scale, h0, save=True, a_scale=a_scale, v_scale=v_scale,
                                      hh_mask=hh_mask, kda_b=kda_b, offsets=offsets)
        q, k, v, a, b, g = saved["inputs"]  # contiguous where the kernels read them, as the backward's kernels do
        a, b = (None, None) if tied else (a, b)
        ctx.save_for_backward(q, k, v, a, b, g, h0, a_scale, v_scale, *(saved[n] for n in _SAVED), hh_mask, offsets)
        ctx.scale, ctx.C, ctx.tied, ctx.paired, ctx.kda_rows = scale, saved["TC"], tied, saved["paired"], kda_rows
        ctx.ut = saved["ut"]
        return o, ht

    @staticmethod
    @once_differentiable
    def backward(ctx, do, dht):
        *tensors, hh_mask, offsets = ctx.saved_tensors
        grads = _backward(tensors, ctx.scale, ctx.C, ctx.tied, do, dht, paired=ctx.paired, hh_mask=hh_mask,
                          kda_rows=ctx.kda_rows, ut=ctx.ut, offsets=offsets)
        return grads + (None,) * (3 if hh_mask is not None else 4)


def _backward(tensors, scale: float, C: int, tied: bool, do, dht, fold=None, hdla_beta=None, hdla_c=None,
              paired: bool = False, hh_mask=None, kda_rows: bool = False, ut: bool = False, offsets=None):
    """The gradients of ``chunk_dplr_fwd``'s inputs from its saved tensors (``_ChunkDPLR``'s order), in the
    order of ``_ChunkDPLR.forward``'s arguments. ``fold`` (``_GatedDeltaRule``): β [B, T, H] as given, whose
    gradient then comes from a_scale's and v_scale's (a_scale = β e^g, v_scale = β; with a gate, in the gate's
    kernel: ``_scalar_dg_kernel``'s FOLD), and the result is (dq, dk, dv, dg, dh0, dβ). ``hdla_beta`` (``_HDLA``):
    HDLA's β [B, T, H]; where its products were taken as token rows (``hdla_fused_products``) so is their
    gradient (``channel.hdla_products_bwd``), with a1 = β k's share in dk and in one more result, β's share
    ([B, T, H] fp32; None where the products were taken apart). There, with ``hdla_c`` (c = kᵀ(λ⊙k) [B, T, H]
    fp32), step 4 also carries the rows' gradients on to dk and dg, da and db come back None, and three more results
    follow: β's share or all of dβ, the sums ``factors.hdla_factors_finish`` needs for the rest (None where the
    products were taken apart, or where step 4 took the rest too), and whether it did (``_KNOBS["hdla_finish"]``):
    then dk and dg are whole and the first of the three is dβ [B, T, H] fp32.
    ``paired``: the forward took a's products with k's (``chunk_dplr_fwd``'s saved "paired"), and so do their
    gradients here. ``hh_mask`` (Head-in-Head's mask, [H, r, r] or [B, T, H, r, r]; a scalar gate or none): a and b
    are its rows of k (``factors.hh_factors``'), whose gradients step 4 carries on to dk and the mask's: da and db
    come back None, and one more result holds the mask's gradient. ``kda_rows`` (``kda``'s rows: a per-channel gate,
    ranks 1, a = k with a_scale, b = e^g ⊙ k): step 4 reads no b, forms it from k and g, and carries a's and b's
    gradients on to dk and dg; da and db come back None. ``ut``: the forward formed U_n from T in its state kernel
    (its saved "ut", ``chunk_fwd.u_from_t``): w holds B̃, and the state kernel here forms dX_n = Tᵀ dU_n for the
    values kernel. ``offsets``: the forward's (``chunk_fwd.chunk_dplr_fwd``'s packed sequences), dh0 and dht
    [N, H, K, V]."""
    q, k, v, a, b, g, h0, sa, sv, *saved = tensors
    hdla_beta = hdla_beta.contiguous() if hdla_beta is not None else None
    if tied:
        a = b = k
    qd, mqk, mqa, kd, vf, w, ad, dch, tinv, lba, lbk, s0, u, qf, af, kdec, gc_saved = saved
    B, T, H, K = q.shape
    Rkv, V = v.shape[-2], v.shape[-1]
    Rab = a.shape[-2] if a is not None else 0
    NC, NK, NA = s0.shape[2], C * _pow2(Rkv), C * _pow2(Rab)
    f32 = dict(device=q.device, dtype=torch.float32)
    do = torch.zeros(B, T, H, V, **f32) if do is None else do.contiguous()  # 16-bit stays 16-bit
    e_do = _is16(do)
    dummy = do
    opt = lambda x: dummy if x is None else x  # noqa: E731
    prec = _precision(q)
    raw = qf is not None  # a decay per row: Q̃ and Ã as q and a with row factors (the forward's RAW)
    raw_v = not raw and vf is None  # v as given (the forward's RAW_V)
    hh = 0 if hh_mask is None else hh_mask.dim() // 2  # 1: [H, r, r], 2: [B, T, H, r, r]
    # the state from chunk to chunk, in reverse (with the outputs' share of dS_n and dU_n)
    # (Head-in-Head's a formed from k: the kernel's GROUPED)
    blocks = dict(_blocks(K, V, NK, NA, backward=True, precision=prec), num_stages=bwd_stages(prec, K, e_do))
    dhn = torch.empty_like(s0)
    # dX_n = Tᵀ dU_n for the values kernel, by the state kernel where the forward formed U_n from T (``ut``)
    dx = torch.empty_like(u) if Rab else None
    du = dx if ut else torch.empty_like(u)
    dht = dht.contiguous() if dht is not None else None
    rows = (opt(dch), opt(w), opt(k if hh else a if raw else ad))
    outs = (q if raw else qd, opt(mqa), do, NC, T, opt(qf), opt(af))
    kinds = dict(K=K, V=V, CA=NA, BK=blocks["BK"], BV=blocks["BV"], BCA=blocks["BCA"], GATE=gate_kind(dch),
                 PRECISION=prec, FROM_OUT=True, H=H, TC=C, E_DO=e_do, RAW=raw, RAB=max(Rab, 1),
                 RABP=max(_pow2(Rab), 1), E_Q=_is16(q), E_A=_is16(k if hh else a), GROUPED=bool(hh),
                 num_warps=blocks["num_warps"], num_stages=blocks["num_stages"], UT=ut, tinv=tinv if ut else None,
                 **_maxnreg(_CONFIG["state_bwd_maxnreg"]))
    # long walks on few programs: segments walked in parallel, twice, as in the forward (``chunk_fwd.segments``)
    N = B if offsets is None else varlen_sequences(offsets, B, C)
    ns, ls = segments(NC, B * H, V, q.device, _KNOBS.get("segments"), K=K, packed=offsets is not None)
    dh0 = torch.empty(ns, N, H, K, V, **f32)  # each segment's leaving dS; the first one's is dh0
    if ns > 1:
        ends = torch.empty(ns, B, H, K, V + K, **f32)  # each segment's [H | P], from the EYE walk
        _state_bwd_kernel[(_cdiv(V + K, blocks["BV"]), B * H * ns)](
            dummy, *rows, dummy, dummy, dummy, dummy, ends, *outs, HAS_DHT=False, NS=ns, LS=ls, VS=V + K, EYE=True,
            STORE=False, **kinds)
        dht = chain_segments(dht, ends, K, V, blocks["BK"], reverse=True)
    _state_bwd_kernel[(_cdiv(V, blocks["BV"]), N * H * ns)](
        opt(dht), *rows, dummy, dummy, dhn, opt(du if Rab else None), dh0, *outs, HAS_DHT=dht is not None, NS=ns,
        LS=ls, cs=offsets, VARLEN=offsets is not None, **kinds)
    dh0 = dh0[0]
    # dV and dX = Tᵀ dU
    like = lambda x: torch.empty(x.shape, dtype=_out_dtype(x), device=x.device)  # noqa: E731
    dv = like(v)
    BV = min(64, max(16, _pow2(V)))
    sv32 = sv.float().contiguous() if sv is not None else None
    NVB = _cdiv(V, BV)
    dsv = torch.empty(*v.shape[:-1], NVB, **f32) if sv is not None else None
    gate = gate_kind(g)
    # step 4's key block; Head-in-Head's inside one group where its groups allow (``_grad_hh_kernel``)
    bk_hh = hh_key_block(K, Rab) if hh and Rkv == 1 else None
    BKg = bk_hh or _key_block("grad_bk", K, prec, gate == 2)
    NKB = 1 if bk_hh else _cdiv(K, BKg)  # Head-in-Head's groups: one program per chunk
    asc = sa is not None and Rab > 0
    sa32 = sa.float().contiguous() if asc else None
    # d sa per row and block: of values when tied (_grad_values_kernel), else of keys (_grad_kernel)
    dsa = torch.empty(*a.shape[:-1], NVB if tied else NKB, **f32) if asc else None
    # the values kernel's arguments; its work inside the inputs' kernel where ``values_in_inputs`` says so
    vals = (mqk, k if raw else kd, opt(lbk), opt(kdec), opt(tinv), opt(du if Rab else None), dv, v, opt(dsv), opt(dsa))
    BKV = min(64, max(16, _pow2(K)))  # the values' key block
    fused_values = values_in_inputs(Rab, tied, prec, K, V, _CONFIG["values_in_inputs"], hh=bool(hh))
    if not fused_values:
        _grad_values_kernel[(NVB, NC, B * H)](
            do, mqk, k if raw else kd, dhn, opt(tinv), opt(lbk), opt(du if Rab else None), opt(dx), dv, v, opt(sv32),
            opt(dsv), opt(kdec), opt(u if Rab else None), opt(dsa), T, NC, H=H, K=K, V=V, TC=C, RKV=Rkv,
            RKVP=_pow2(Rkv), NA=NA, BK=BKV, BV=BV, PRECISION=prec,
            VSC=sv is not None, E_DO=e_do, RAW=raw, E_K=_is16(k), TIED=tied, UT=ut, num_warps=_CONFIG["values"],
            num_stages=1,
        )
    # the gradients of the decayed inputs
    f32c = lambda *shape: torch.empty(B, H, NC, *shape, **f32)  # noqa: E731
    # the tiles between the kernels in the forward's stored dtype (bf16 with bf16 products)
    stc = lambda *shape: torch.empty(B, H, NC, *shape, device=q.device, dtype=mqk.dtype)  # noqa: E731
    dqd, dkd = stc(C, K), stc(NK, K)
    # Head-in-Head by groups: the inputs' kernel stores only what step 4 reads (``hh_inputs``), dÃ's own rows and
    # dB̃ summed with the mask per token, and the ranks' dB̃ · k per group and key block
    ig = bool(bk_hh and _CONFIG["hh_inputs"])
    rows_in = C if ig else NA
    dad = stc(rows_in, K) if Rab and not tied else None  # tied: sa ⊙ dÃ comes added into dkd
    dbd = stc(rows_in, K) if Rab else None
    ddch = f32c(K) if g is not None else None
    BKi = _key_block("inputs_bk", K, prec, gate == 2)
    NKI = _cdiv(K, BKi)
    warps = _inputs_warps(C, gate, K)
    yb = f32c(NA, Rab, NKI) if ig else None
    _grad_inputs_kernel[(NKI, NC, B * H)](
        do, s0, dhn, v if raw or raw_v else vf, opt(u if Rab else None), opt(dx), dqd, dkd, opt(dad), opt(dbd),
        opt(ddch), opt(sv32), opt(sa32), k if ig else dummy, hh_mask if ig else dummy, opt(yb), *vals, scale, T, NC,
        H=H, K=K, V=V, TC=C, NK=NK, NA=NA, BK=BKi, BV=BV, GATE=gate, PRECISION=prec, E_DO=e_do, RKV=Rkv,
        RKVP=_pow2(Rkv), RAW=raw, VSC=sv is not None, E_V=_is16(v), TIED=tied, RAW_V=raw_v, HG=hh if ig else 0,
        RAB=max(Rab, 1), RABP=max(_pow2(Rab), 1), NG=_block_groups(K, Rab, BKi) if ig else 0,
        VALUES=fused_values, BKV=BKV, E_K=_is16(k), UT=ut, num_warps=warps, num_stages=1,
        **_maxnreg(_register_cap("inputs", warps, C, gate, Rab, bool(hh), prec, K, V)),
    )
    # the gradients of the products
    dmqk = stc(C, NK)
    # tied: dM_QA and dL_BA come added into dM_QK and dL_BK
    dmqa, dlba = (stc(C, NA), stc(NA, NA)) if Rab and not tied else (None, None)
    dlbk = stc(NA, NK) if Rab else None
    dgp = f32c(C) if gate == 1 else None
    warps = _products_warps(C)
    _grad_products_kernel[(NC, B * H)](
        do, v if raw or raw_v else vf, opt(u if Rab else None), opt(dx), mqk, opt(mqa), opt(lba), opt(lbk), dmqk,
        opt(dmqa), opt(dlba), opt(dlbk), opt(dgp), opt(sv32), opt(sa32), scale, T, NC, H=H, V=V,
        TC=C, RKV=Rkv, RKVP=_pow2(Rkv), RABP=_pow2(Rab), BV=min(32, BV), GATE=gate, PRECISION=prec, E_DO=e_do,
        RAW=raw, VSC=sv is not None, LP_DV=_lowp(do, v), E_V=_is16(v), TIED=tied, RAW_V=raw_v,
        num_warps=warps, num_stages=1, **_maxnreg(_register_cap("products", warps, C, gate, Rab, bool(hh), prec, K, V)),
    )
    # dq, dk, da, db, dg
    # the inputs' gradients in their own dtypes (the kernels accumulate in fp32 and cast on store)
    dq, dk = like(q), like(k)
    one = gate == 2 and hdla_beta is not None and hdla_fused_products(prec)
    # HDLA's rows' gradients go on to k and g inside step 4, all but c's share: its sums per key block to hpart
    hpart = torch.empty(B, T, H, NKB, 2, **f32) if one else None
    # and the share through c with dβ there too, by each chunk's last key block (``_KNOBS["hdla_finish"]``, 1 by
    # default; 0: ``factors.hdla_factors_finish`` after step 4): a count per chunk and dβ
    fin = one and _KNOBS.get("hdla_finish", 1)
    hcnt = torch.zeros(B * H * NC, device=q.device, dtype=torch.int32) if fin else None
    dbeta_fin = torch.empty(B, T, H, **f32) if fin else None
    if hh:  # Head-in-Head's rows' gradients go on to k and the mask inside step 4 (``chunk_dplr`` checked the
        # rows and the gate): the mask's per key block here
        hpart = torch.empty(B, T, H, Rab, NKB, Rab, **f32)
    if kda_rows and not (gate == 2 and paired and Rab == 1 and Rkv == 1 and not one and not hh and not tied):
        raise ValueError("kda_rows: KDA's rows (a per-channel gate, a = k with a_scale, b = e^g ⊙ k) only")
    da, db = ((like(a), like(a if b is None else b)) if Rab and not tied and not one and not hh and not kda_rows
              else (None, None))
    # KDA's rows: the products' gradients of b's rows taken as k's, in q's pass (``_KNOBS["kda_pair_bwd"]``)
    kda_pair_bwd = kda_rows and _KNOBS.get("kda_pair_bwd", 1)
    dg = like(g) if gate == 2 else None
    pdg = torch.empty(B, H, NC, NKB, 3 * C + 1, **f32) if gate == 1 else None
    if bk_hh:
        # HP: each rank's tiles of dL_BA and dL_BK read once for X, Z and the mask's gradient (``hh_products``)
        hp = ig and hh_tiles_once(K, _CONFIG["hh_products"])
        _grad_hh_kernel[(NC, B * H)](
            q, k, opt(g), opt(sa32), dmqk, dmqa, dlba, dlbk, dqd, dkd, dad, dbd, opt(dch), opt(ddch), dq, dk, opt(pdg),
            opt(dsa), hpart, hh_mask, opt(yb), T, NC, H=H, K=K, TC=C, RAB=Rab, RABP=_pow2(Rab), BK=BKg,
            GATE=gate, PRECISION=prec, ASC=asc, E_Q=_is16(q), E_K=_is16(k), HH=hh, IG=ig, NKI=NKI, HP=hp,
            num_warps=_grad_hh_warps(K), num_stages=1, **_maxnreg(_CONFIG["grad_hh_maxnreg"]),
        )
    elif tied:
        _grad_tied_kernel[(NKB, NC, B * H)](
            q, k, opt(g), dmqk, dlbk, dqd, dkd, dbd, opt(dch), opt(ddch), dq, dk, opt(pdg), T, NC,
            H=H, K=K, TC=C, BK=BKg, GATE=gate, PRECISION=prec, E_Q=_is16(q), E_K=_is16(k),
            num_warps=_CONFIG["grad"], num_stages=1,
        )
    else:
        # per channel: the decays' log-cumsums, as the forward saved them (not taken again)
        gc = gc_saved if gate == 2 else g
        pq = pk = pa = pb = dbeta_rows = None
        if b is None and Rab and not one:
            raise ValueError("b is None: only HDLA's rows (hdla_beta) at the bf16 products' precision can do "
                             "without it")
        if gate == 2:  # the products' share of dq, dk, da, db (d(sa ⊙ a)), in the chunk layout
            prod = dict(T=T, TC=C, precision=prec)
            # HDLA's one kernel writes each entry once: the stored dtype, as the tiles between the other kernels
            # (the four products' kernels add into theirs: fp32). H100 HDLA fwd+bwd: peak memory 4561 -> 4177 MB,
            # time the same (8.51 / 8.48 ms; BENCHMARKS.md session 30)
            mk = stc if one else f32c
            pq, pk = mk(C, K), mk(NK, K)
            pa, pb = (mk(C if one else NA, K), mk(NA, K)) if Rab else (None, None)  # HDLA's pa: a2's rows alone
            if one:
                dbeta_rows = hdla_products_bwd(q, k, a, gc, hdla_beta, dmqk, dmqa, dlba, dlbk, mqk, lbk,
                                               pq, pk, pa, pb, scale=scale, **prod)
            elif paired and kda_pair_bwd:  # KDA's four in one pass, b's rows as k's through G_t (step 4's KDA 2)
                channel_product_bwd(q, k, gc, dmqk, pq, pk, strict=False, acc_x=False, acc_y=False, y_scale=sa32,
                                    dp_scaled=dmqa, dy_scaled=pa, x2=k, dp2=dlbk, dp2_scaled=dlba, dx2=pb, **prod)
            elif paired:  # a = sa ⊙ k (``kda``): each pair of products in one pass, as the forward took them
                channel_product_bwd(q, k, gc, dmqk, pq, pk, strict=False, acc_x=False, acc_y=False, y_scale=sa32,
                                    dp_scaled=dmqa, dy_scaled=pa, **prod)
                channel_product_bwd(b, k, gc, dlbk, pb, pk, strict=True, acc_x=False, acc_y=True, y_scale=sa32,
                                    dp_scaled=dlba, dy_scaled=pa, acc_y_scaled=True, **prod)
            else:
                channel_product_bwd(q, k, gc, dmqk, pq, pk, strict=False, acc_x=False, acc_y=False, **prod)
                if Rab:
                    channel_product_bwd(q, a, gc, dmqa, pq, pa, strict=False, acc_x=True, acc_y=False, y_scale=sa32,
                                        **prod)
                    channel_product_bwd(b, a, gc, dlba, pb, pa, strict=True, acc_x=False, acc_y=True, y_scale=sa32,
                                        **prod)
                    channel_product_bwd(b, k, gc, dlbk, pb, pk, strict=True, acc_x=True, acc_y=True, **prod)
        warps = _grad_hdla_warps(C) if one else _grad_channel_warps(Rab) if gate == 2 else _CONFIG["grad"]
        _grad_kernel[(NKB, NC, B * H)](
            q, k, opt(a), opt(b), opt(gc), opt(sa32), dmqk, opt(dmqa), opt(dlba), opt(dlbk), dqd, dkd, opt(dad),
            opt(dbd), opt(dch), opt(ddch), dq, dk, opt(da), opt(db), opt(dg), opt(pdg), opt(dsa), opt(pq), opt(pk),
            opt(pa), opt(pb), g if one or kda_rows else dummy, hdla_beta if one else dummy, hdla_c if one else dummy,
            opt(hpart),
            hh_mask if hh else dummy, opt(dbeta_fin), opt(dbeta_rows), opt(hcnt), T, NC, H=H, K=K,
            KG=1 if g is None else g.shape[-1], TC=C, RKV=Rkv, RKVP=_pow2(Rkv),
            RAB=Rab, RABP=_pow2(Rab), BK=BKg, GATE=gate, PRECISION=prec, ASC=asc,
            E_Q=_is16(q), E_K=_is16(k), E_A=_is16(a), E_B=b is not None and _is16(b), HDLA=one, HH=hh,
            KDA=(2 if kda_pair_bwd else 1) if kda_rows else 0, HFIN=bool(fin), HAS_DBR=dbeta_rows is not None,
            num_warps=warps, num_stages=1, **_maxnreg(_register_cap("grad", warps, C, gate, Rab, bool(hh), prec, K, V)),
        )
    dbeta = None
    if gate == 1:
        dg = like(g)
        if fold is not None:  # β's gradient too, and the gate's through a_scale = β e^g
            dbeta = like(fold)
            _scalar_dg_kernel[(NC, B * H)](dgp, pdg, dg, dsa, dsv, g, sa32, dbeta, T, NC, H=H, TC=C, NKB=NKB,
                                           NVB=NVB, FOLD=True, num_warps=1)
        else:
            _scalar_dg_kernel[(NC, B * H)](dgp, pdg, dg, dgp, dgp, dgp, dgp, dgp, T, NC, H=H, TC=C, NKB=NKB,
                                           NVB=1, FOLD=False, num_warps=1)
    cast = lambda x, ref: None if ref is None or x is None else x.to(ref.dtype)  # noqa: E731
    if fold is not None:  # (dq, dk, dv, dg, dh0, dβ) of the delta rule: a = b = k, a_scale = β e^g, v_scale = β
        if dbeta is None:  # no gate: a_scale = v_scale = β
            dbeta = dsa.sum(-1).add_(dsv.sum(-1))
        return cast(dq, q), cast(dk, k), cast(dv, v), cast(dg, g), cast(dh0, h0), cast(dbeta, fold)
    if tied:
        da = db = a = b = None
    grads = (cast(dq, q), cast(dk, k), cast(dv, v), cast(da, a), cast(db, a if b is None else b), cast(dg, g),
             cast(dh0, h0), None,
             cast(dsa.sum(-1), sa) if asc else None, cast(dsv.sum(-1), sv) if sv is not None else None, None)
    if hh:  # the mask's gradient: the key blocks' shares added, and a static mask's over every token
        dmask = hpart.sum(-2)
        return grads + (cast(dmask.sum((0, 1)) if hh == 1 else dmask, hh_mask),)
    if fin:  # step 4 finished the rows' backward: dβ whole, no sums left
        return grads + (dbeta_fin, None, True)
    return grads if hdla_beta is None else grads + (dbeta_rows, hpart, False)


@opaque_function(2)
class _GatedDeltaRule(torch.autograd.Function):
    """(Gated) DeltaNet on the fused kernels as one autograd node: ``chunk_dplr`` with a = b = k, a_scale = β e^g
    and v_scale = β, those factors formed here and their gradients carried on to g and β inside the backward
    (``_scalar_dg_kernel``'s FOLD), not by a chain of recorded PyTorch ops (unsqueezes, a cast, exp, a product,
    each a node of autograd's engine and a launch or two on the host)."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, h0, scale):
        ctx.set_materialize_grads(False)
        k1, v1, g1, sa, sv = _delta_rule_rows(k, v, g, beta)
        o, ht, saved = chunk_dplr_fwd(q, k1, v1, k1, k1, g1, scale, h0, save=True, a_scale=sa, v_scale=sv)
        q, k1, v1, _, _, g1 = saved["inputs"]  # contiguous, as the backward's kernels read them
        ctx.save_for_backward(q, k1, v1, None, None, g1, h0, sa, sv, *(saved[n] for n in _SAVED), beta.contiguous())
        ctx.scale, ctx.C, ctx.ut = scale, saved["TC"], saved["ut"]
        return o, ht

    @staticmethod
    @once_differentiable
    def backward(ctx, do, dht):
        *tensors, beta = ctx.saved_tensors
        dq, dk, dv, dg, dh0, dbeta = _backward(tensors, ctx.scale, ctx.C, True, do, dht, fold=beta, ut=ctx.ut)
        B, T, H, K = dq.shape
        dg = dg.view(B, T, H) if dg is not None else None
        return dq, dk.view(B, T, H, K), dv.view(B, T, H, -1), dg, dbeta.view(B, T, H), dh0, None


def _delta_rule_rows(k, v, g, beta):
    """The delta rule's DPLR inputs from (Gated) DeltaNet's: k and v with a rank axis (views), g [B, T, H, 1],
    a_scale = β e^g and v_scale = β as fp32 [B, T, H, 1] (what ``gated_delta_rule`` builds through autograd)."""
    b32 = beta.float().unsqueeze(-1)
    g1 = g.unsqueeze(-1).contiguous() if g is not None else None
    sa = (b32 * g1.float().exp()).contiguous() if g is not None else b32.contiguous()
    return k.unsqueeze(3), v.unsqueeze(3), g1, sa, b32.contiguous()


GPU_MIN_VALUE_DIM = 64
GPU_MIN_KEY_DIM = 32


def value_padding(v: torch.Tensor) -> int:
    """Zero value columns the fused kernels add to v's (``padded_heads``): on a GPU, up to ``GPU_MIN_VALUE_DIM``.
    Narrower value heads (V = 8 to 32 at K >= 64, bf16 products) met Triton 3.6 miscompiles on the H100: kernels
    reading outside their shared memory, an illegal memory access in the intra kernel and in the values' gradient
    (BENCHMARKS.md session 37), where every kernel has been checked at V >= 64. None under the interpreter."""
    return max(0, GPU_MIN_VALUE_DIM - v.shape[-1]) if v.is_cuda else 0


def key_padding(k: torch.Tensor, groups: int = 1) -> int:
    """Zero key channels the fused kernels add to k's (``padded_heads``), ``groups`` equal groups of channels each
    padded alike: on a GPU, up to ``GPU_MIN_KEY_DIM`` (rounded up to a multiple of ``groups``). At K = 16 with bf16
    products Triton 3.6 compiled the kernels' 16-wide key tiles wrong on the H100: Head-in-Head's results off by 10 %
    and more, an illegal memory access in HDLA's (BENCHMARKS.md session 38); K = 32 is checked. None under the
    interpreter."""
    K = k.shape[-1]
    if not k.is_cuda or K >= GPU_MIN_KEY_DIM:
        return 0
    return -(-GPU_MIN_KEY_DIM // groups) * groups - K


def _pad_channels(x: torch.Tensor, width: int, groups: int) -> torch.Tensor:
    """x [..., K] widened to [..., width] with zero channels, each of its ``groups`` equal groups at its end."""
    *lead, K = x.shape
    return F.pad(x.reshape(*lead, groups, K // groups), (0, (width - K) // groups)).reshape(*lead, width)


def _cut_channels(x: torch.Tensor, width: int, groups: int) -> torch.Tensor:
    """``_pad_channels`` undone: x [..., K'] back to [..., width]."""
    *lead, K = x.shape
    return x.reshape(*lead, groups, K // groups)[..., :width // groups].reshape(*lead, width)


def padded_heads(run, keys: tuple, v, initial_state, groups: int = 1):
    """``run(keys, v, initial_state) -> (o, state)`` with the heads padded for the GPU kernels: the key channels of
    every tensor of ``keys`` ([..., K] each; None stays None) by ``key_padding`` (in ``groups`` equal groups, each
    padded at its end: Head-in-Head's rows keep their groups), the value columns of v [..., V] by ``value_padding``,
    and initial_state [..., K, V] (or None) both ways; o and state come back cut to V and K, contiguous. Exact: zero
    key channels add nothing to any product and leave their state rows zero, and the state's value columns never
    mix, so zero columns stay zero; nothing else changes, in any result or gradient."""
    K, V = keys[0].shape[-1], v.shape[-1]
    kpad, vpad = key_padding(keys[0], groups), value_padding(v)
    if not (kpad or vpad):
        return run(keys, v, initial_state)
    h0 = initial_state
    if kpad:  # a tensor given twice (the delta rule's a = b = k) stays one tensor, so the kernels still see the tie
        # (compared by identity, not ``id``: Dynamo traces this under torch.compile)
        wide = []
        for x in keys:
            same = next((w for y, w in zip(keys, wide) if y is x), None) if x is not None else None
            wide.append(same if same is not None or x is None else _pad_channels(x, K + kpad, groups))
        keys = tuple(wide)
        if h0 is not None:
            h0 = _pad_channels(h0.transpose(-1, -2), K + kpad, groups).transpose(-1, -2)
    if vpad:
        v = F.pad(v, (0, vpad))
        h0 = F.pad(h0, (0, vpad)) if h0 is not None else None
    o, state = run(keys, v, h0)
    o, state = o[..., :V], state[..., :V]
    if kpad:
        state = _cut_channels(state.transpose(-1, -2), K, groups).transpose(-1, -2)
    return o.contiguous(), state.contiguous()


def padded_dplr(run, q, k, v, a, b, g, initial_state, groups: int = 1):
    """``run(q, k, v, a, b, g, initial_state) -> (o, state)`` through ``padded_heads``: q, k, a and b padded as keys,
    and g with them where it is a gate per key channel (zero log-gates: no decay on the zero channels)."""
    channel = gate_kind(g) == 2
    return padded_heads(lambda x, v, h0: run(x[0], x[1], v, x[2], x[3], x[4] if channel else g, h0),
                        (q, k, a, b) + ((g,) if channel else ()), v, initial_state, groups)


def narrow_heads(keys: torch.Tensor, v: torch.Tensor, groups: int = 1) -> bool:
    """Whether ``padded_heads`` pads these heads (keys [..., K], v [..., V])."""
    return bool(key_padding(keys, groups) or value_padding(v))


@opaque(2, entry=True)
def chunk_gated_delta_rule(q, k, v, g, beta, scale: float, initial_state=None):
    """(Gated) DeltaNet on the fused kernels, inputs as ``ops.gated_delta_rule`` takes them and already checked:
    q, k [B, T, H, K], v [B, T, H, V], g [B, T, H] or None, beta [B, T, H], initial_state [B, H, K, V] or None.
    Returns (o [B, T, H, V], final state [B, H, K, V] fp32). With autograd when an input needs it (one node,
    ``_GatedDeltaRule``), else the forward alone."""
    if narrow_heads(k, v):
        return padded_heads(lambda x, v, h0: chunk_gated_delta_rule(*x, v, g, beta, scale, h0), (q, k), v,
                            initial_state)
    if needs_grad((q, k, v, g, beta, initial_state)):
        return _GatedDeltaRule.apply(q, k, v, g, beta, initial_state, scale)
    k1, v1, g1, sa, sv = _delta_rule_rows(k, v, g, beta)
    return chunk_dplr_fwd(q, k1, v1, k1, k1, g1, scale, initial_state, a_scale=sa, v_scale=sv)


def _hdla_factors(q, k, g, beta, with_c=False):
    """HDLA's rows (a, b) for ``chunk_dplr_fwd``: where the products take one kernel (the precision ``chunk_dplr_fwd``
    takes, ``_KNOBS``'s if set), the kernels form a1 and b from k themselves, so a2 alone and b None. ``with_c``:
    (a, b, c) with c = kᵀ(λ⊙k) [B, T, H] fp32 (the backward's ``hdla_factors_finish``)."""
    precision = _KNOBS.get("precision", _precision(q))
    return hdla_factors_fwd(k, g, beta, a2_only=hdla_fused_products(precision), with_c=with_c,
                            a2_dtype=rows_dtype(k, precision))


@opaque_function(2)
class _HDLA(torch.autograd.Function):
    """HDLA on the fused kernels as one autograd node: its rows a and b built inside (``factors.hdla_factors_fwd``;
    with the products in one kernel, a2 alone: the intra kernel and step 4 form a1 and b from k), its products
    taken as six of token rows (``channel.hdla_products``), and the rows' gradients carried on to k, g and β:
    with the products in one kernel, by step 4 itself and ``factors.hdla_factors_finish`` (the share through
    c = kᵀ(λ⊙k), which needs the whole K); else by the factors' backward kernel, added into the chunked kernels'
    dk and dg."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, h0, scale):
        ctx.set_materialize_grads(False)
        q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))  # as the kernels read them (ops.hdla's are)
        a, b, c = _hdla_factors(q, k, g, beta, with_c=True)
        k1, v1 = k.unsqueeze(3), v.unsqueeze(3)
        o, ht, saved = chunk_dplr_fwd(q, k1, v1, a, b, g, scale, h0, save=True, hdla_beta=beta)
        ctx.save_for_backward(q, k1, v1, a, b, g, h0, None, None, *(saved[n] for n in _SAVED), k, beta, c)
        ctx.scale, ctx.C, ctx.ut = scale, saved["TC"], saved["ut"]
        return o, ht

    @staticmethod
    @once_differentiable
    def backward(ctx, do, dht):
        *tensors, k, beta, c = ctx.saved_tensors
        dq, dk, dv, da, db, dg, dh0, *_, dbeta_rows, part, finished = _backward(
            tensors, ctx.scale, ctx.C, False, do, dht, hdla_beta=beta, hdla_c=c, ut=ctx.ut)
        dk = dk.view(k.shape)
        if finished:  # step 4 took the rows' gradients whole, c's share and dβ included
            dbeta = dbeta_rows
        elif part is not None:  # step 4 took the rows' gradients but c's share, added here with dβ
            dbeta = hdla_factors_finish(k, tensors[5], beta, c, part, dk, dg, dbeta_rows)
        else:
            _, _, dbeta = hdla_factors_bwd(k, tensors[5], beta, da, db, dk, dg)  # adds the rows' share to dk, dg
            if dbeta_rows is not None:  # a1 = β k's share through the products (``channel.hdla_products_bwd``)
                dbeta = dbeta + dbeta_rows
        return dq, dk, dv.view(*dv.shape[:3], -1), dg, dbeta.to(beta.dtype), dh0, None


@opaque(2, entry=True)
def chunk_hdla(q, k, v, g, beta, scale: float, initial_state=None):
    """HDLA (``ops.hdla``) on the fused kernels, inputs already checked and contiguous: q, k, g [B, T, H, K] (g
    per channel), v [B, T, H, V], beta [B, T, H], initial_state [B, H, K, V] or None. Returns (o [B, T, H, V],
    final state [B, H, K, V] fp32). With autograd when an input needs it (one node, ``_HDLA``), else the forward
    alone."""
    if narrow_heads(k, v):
        return padded_heads(lambda x, v, h0: chunk_hdla(x[0], x[1], v, x[2], beta, scale, h0), (q, k, g), v,
                            initial_state)
    if needs_grad((q, k, v, g, beta, initial_state)):
        return _HDLA.apply(q, k, v, g, beta, initial_state, scale)
    precision = _KNOBS.get("precision", _precision(q))
    if hdla_fused_products(precision) and _KNOBS.get("form_a2", 1):
        # no rows built: the kernels form a1, b and a2 from k, g and β (and c, from the log-cumsum kernel)
        a = placeholder((*k.shape[:-1], 2, k.shape[-1]), rows_dtype(k, precision), k.device)
        return chunk_dplr_fwd(q, k.unsqueeze(3), v.unsqueeze(3), a, None, g, scale, initial_state, hdla_beta=beta,
                              hdla_form_a2=True)
    a, b = _hdla_factors(q, k, g, beta)
    return chunk_dplr_fwd(q, k.unsqueeze(3), v.unsqueeze(3), a, b, g, scale, initial_state, hdla_beta=beta)


@opaque(2, entry=True)
def chunk_dplr(q, k, v, a, b, g, scale: float, initial_state, a_scale=None, v_scale=None, hh_mask=None,
               kda_b: bool = False, offsets=None):
    """The fused forward (``chunk_dplr_fwd``) with autograd; same arguments (``offsets``: sequences packed along
    the row, ``chunk_dplr_fwd``'s) and results.

    When a and b are k itself (``ties_keys``), k's three gradients are formed as one. ``hh_mask``: a and b are
    Head-in-Head's rows of k and this mask (``factors.hh_factors``' a and b; [H, r, r] or [B, T, H, r, r]; a scalar
    gate or none): the backward carries their gradients on to k and the mask in step 4 and returns them as k's and
    the mask's, without da and db (H100 HH-GDN r=4: BENCHMARKS.md session 36); a and b's own autograd is unused.
    ``kda_b``: b is e^g ⊙ k (``kda``'s), and may be a placeholder: where the training reads it
    (``chunk_fwd.kda_b_formed``) it is built here (``factors.kda_factor``, with autograd where its gradient is not
    carried on in step 4: ``carries_kda_rows``), else the kernels form what they need of it from k and g."""
    if hh_mask is not None:
        if a is None or b is None or gate_kind(g) == 2:
            raise ValueError("hh_mask: Head-in-Head's rows a and b with a scalar gate or none only")
    groups = a.shape[-2] if hh_mask is not None else 1  # Head-in-Head's rows: k's channels in Rab groups
    if narrow_heads(k, v, groups):
        # (KDA's b = e^g ⊙ k still holds on the padded channels: k and b are 0 there)
        return padded_dplr(lambda q, k, v, a, b, g, h0: chunk_dplr(q, k, v, a, b, g, scale, h0, a_scale, v_scale,
                                                                   hh_mask, kda_b, offsets), q, k, v, a, b, g,
                           initial_state, groups)
    if hh_mask is not None:
        return _ChunkDPLR.apply(q, k, v, a.detach(), b.detach(), g, initial_state, scale, a_scale, v_scale, False,
                                hh_mask.contiguous(), False, False, offsets)
    if ties_keys(k, a, b, g, a_scale):
        return _ChunkDPLR.apply(q, k, v, None, None, g, initial_state, scale, a_scale, v_scale, True, None, False,
                                False, offsets)
    if kda_b and not kda_b_formed(k, a, g, a_scale):  # something reads b: built (a placeholder's contents never are)
        b = kda_factor(k, g.unsqueeze(-2), dtype=b.dtype)
    kda_rows = carries_kda_rows(k, a, g, a_scale, kda_b)
    return _ChunkDPLR.apply(q, k, v, a, b.detach() if kda_rows else b, g, initial_state, scale, a_scale, v_scale,
                            False, None, kda_b, kda_rows, offsets)
