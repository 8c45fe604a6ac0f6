"""Mechanisms' DPLR factors built in one Triton kernel each way, instead of a dozen PyTorch ops.

HDLA (``mechanisms.hdla``) turns ``k``, ``g`` and ``β`` into the rank-2 decay's rows

    a = [β k, β (λ⊙k - β (kᵀ(λ⊙k)) k)],   b = [λ⊙k, k],   λ = exp(g)

In PyTorch that is about ten elementwise ops forward and twenty in autograd's backward, each a
pass over ``[B, T, H, 2, K]`` fp32 tensors: 4.5 ms of HDLA's 16.7 ms forward+backward at
B8 T2048 H16 K128 on the H100 (BENCHMARKS.md session 20). Here one program takes a block of
rows (tokens x heads) whole along K, forward and backward, in fp32.

Kimi Delta Attention (``mechanisms.kda``) needs ``b = e^g ⊙ k`` in fp32: in PyTorch an fp32 copy of k, the exp and
the product forward, four more passes backward (``kda_factor``: one each way).

Head-in-Head (``mechanisms.hh_delta_rule``) builds ``a_j = k ⊙ 1[group j]`` and
``b_j = k ⊙ M[j, group(·)]`` for r groups of key channels: PyTorch's gather of the mask and its
backward (a scatter-add) cost about 3 ms of HH-GDN's forward+backward at the same size.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable

from .fused_recurrent import _cdiv, _pow2
from .opaque import compiling, opaque, opaque_function, shapes_only

# Rows per program: the [ROWS, BK] tiles of k, g and the four factor rows stay in registers.
_ELEMS = 4096


@triton.jit
def _hdla_factors_fwd_kernel(k, g, beta, a, b, cs, N, K: tl.constexpr, BK: tl.constexpr, ROWS: tl.constexpr,
                             A2_ONLY: tl.constexpr = False, STORE_C: tl.constexpr = False):
    # A2_ONLY: only a's second rows are written (a's first rows and b are left as they are). STORE_C: c = kᵀ(λ⊙k)
    # per token to cs [N] too (``hdla_factors_finish``'s)
    o_n = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    o_k = tl.arange(0, BK)
    m = (o_n < N)[:, None] & (o_k < K)[None, :]
    p = o_n[:, None] * K + o_k[None, :]
    k_ = tl.load(k + p, mask=m, other=0.0).to(tl.float32)
    lk = tl.exp(tl.load(g + p, mask=m, other=0.0).to(tl.float32)) * k_
    be = tl.load(beta + o_n, mask=o_n < N, other=0.0).to(tl.float32)[:, None]
    c = tl.sum(k_ * lk, axis=1)[:, None]
    p2 = o_n[:, None] * 2 * K + o_k[None, :]  # row r of token n: (2 n + r) K
    tl.store(a + p2 + K, be * (lk - be * c * k_), mask=m)
    if STORE_C:
        tl.store(cs + o_n, tl.sum(c, axis=1), mask=o_n < N)
    if not A2_ONLY:
        tl.store(a + p2, be * k_, mask=m)
        tl.store(b + p2, lk, mask=m)
        tl.store(b + p2 + K, k_, mask=m)


@triton.jit
def _hdla_factors_bwd_kernel(k, g, beta, da, db, dk, dg, dbeta, N, K: tl.constexpr, BK: tl.constexpr,
                             ROWS: tl.constexpr, ACC: tl.constexpr = False):
    # ACC: dk and dg hold the gradients k and g have from elsewhere (the chunked kernels'); the factors' are
    # added to them in fp32 and stored in dk's and dg's dtypes
    o_n = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    o_k = tl.arange(0, BK)
    m = (o_n < N)[:, None] & (o_k < K)[None, :]
    p = o_n[:, None] * K + o_k[None, :]
    p2 = o_n[:, None] * 2 * K + o_k[None, :]
    k_ = tl.load(k + p, mask=m, other=0.0).to(tl.float32)
    lam = tl.exp(tl.load(g + p, mask=m, other=0.0).to(tl.float32))
    lk = lam * k_
    be = tl.load(beta + o_n, mask=o_n < N, other=0.0).to(tl.float32)[:, None]
    c = tl.sum(k_ * lk, axis=1)[:, None]
    da1 = tl.load(da + p2, mask=m, other=0.0).to(tl.float32)
    da2 = tl.load(da + p2 + K, mask=m, other=0.0).to(tl.float32)
    db1 = tl.load(db + p2, mask=m, other=0.0).to(tl.float32)
    db2 = tl.load(db + p2 + K, mask=m, other=0.0).to(tl.float32)
    # a1 = β k;  a2 = β lk - β² c k;  b1 = lk;  b2 = k;  c = Σ k lk;  lk = λ k
    d_beta = tl.sum(da1 * k_ + da2 * (lk - 2.0 * be * c * k_), axis=1)
    dc = -be * be * tl.sum(da2 * k_, axis=1)[:, None]
    dlk = be * da2 + db1 + dc * k_
    dk_ = be * da1 - be * be * c * da2 + db2 + dc * lk + dlk * lam
    dg_ = dlk * lk  # d/dg of λ k = λ k
    if ACC:
        dk_ += tl.load(dk + p, mask=m, other=0.0).to(tl.float32)
        dg_ += tl.load(dg + p, mask=m, other=0.0).to(tl.float32)
    tl.store(dk + p, dk_, mask=m)
    tl.store(dg + p, dg_, mask=m)
    tl.store(dbeta + o_n, d_beta, mask=o_n < N)


def _grid(N: int, K: int) -> tuple[int, int, tuple[int]]:
    BK = _pow2(K)
    rows = max(1, min(64, _ELEMS // BK))
    return BK, rows, (_cdiv(N, rows),)


def hdla_factors_fwd(k: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, a2_only: bool = False,
                     with_c: bool = False, a2_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, ...]:
    """``hdla_factors``' (a, b) without autograd (inputs contiguous). ``a2_only``: a [B, T, H, 2, K] with only its
    second rows a2 written and b None, for kernels that form a1 = β k and b = [λ ⊙ k, k] from k themselves (HDLA
    with its products in one kernel: ``chunk_fwd.chunk_dplr_fwd``'s ``hdla_beta``, ``chunk_bwd._HDLA``): a quarter
    of the writes, in ``a2_dtype`` (16 bits where the kernels take a2's products in bf16 anyway). ``with_c``:
    (a, b, c), c = kᵀ(λ⊙k) [B, T, H] fp32 as well, for ``hdla_factors_finish``."""
    K = k.shape[-1]
    N = k.numel() // K
    a = k.new_empty(*k.shape[:-1], 2, K, dtype=a2_dtype if a2_only else torch.float32)
    b = None if a2_only else torch.empty_like(a)
    c = torch.empty(k.shape[:-1], dtype=torch.float32, device=k.device) if with_c else None
    BK, rows, grid = _grid(N, K)
    _hdla_factors_fwd_kernel[grid](k, g, beta, a, a if a2_only else b, a if c is None else c, N, K=K, BK=BK,
                                   ROWS=rows, A2_ONLY=a2_only, STORE_C=with_c)
    return (a, b, c) if with_c else (a, b)


def hdla_factors_bwd(k, g, beta, da, db, dk=None, dg=None):
    """The gradients of k, g and β through (a, b) given da and db ([B, T, H, 2, K], contiguous): (dk, dg, dβ),
    fp32. With dk and dg given ([B, T, H, K], any float dtype), the factors' share is added to them in place
    (in fp32, stored in their dtypes) and they are returned."""
    K = k.shape[-1]
    N = k.numel() // K
    acc = dk is not None
    if not acc:
        dk = torch.empty(k.shape, dtype=torch.float32, device=k.device)
        dg = torch.empty_like(dk)
    dbeta = torch.empty(beta.shape, dtype=torch.float32, device=k.device)
    BK, rows, grid = _grid(N, K)
    _hdla_factors_bwd_kernel[grid](k, g, beta, da, db, dk, dg, dbeta, N, K=K, BK=BK, ROWS=rows, ACC=acc)
    return dk, dg, dbeta


@triton.jit
def _hdla_finish_rows(k, g, beta, cs, part, dk, dg, dbeta, dbr, o_n, m_n, NKB, K: tl.constexpr, BK: tl.constexpr,
                      HAS_DBR: tl.constexpr, CACHE: tl.constexpr):
    # the share of HDLA's rows' gradient that needs their whole K, for rows o_n (where m_n): dc = -β² Σ_k da2 k
    # (c = kᵀ(λ⊙k)) into dk and dg, and dβ, from the key blocks' sums s1 = Σ da1 k + da2 λk and s2 = Σ da2 k
    # (part [N, NKB, 2]), added block by block from zero; dk and dg taken BK channels at a time. CACHE: the cache
    # modifier of the reads of part, dk and dg (".cg" where other programs just wrote them: ``chunk_bwd``'s HFIN)
    s1 = tl.zeros(o_n.shape, dtype=tl.float32)
    s2 = tl.zeros(o_n.shape, dtype=tl.float32)
    for j in range(NKB):
        s1 += tl.load(part + (o_n * NKB + j) * 2, mask=m_n, other=0.0, cache_modifier=CACHE)
        s2 += tl.load(part + (o_n * NKB + j) * 2 + 1, mask=m_n, other=0.0, cache_modifier=CACHE)
    be = tl.load(beta + o_n, mask=m_n, other=0.0).to(tl.float32)
    d_beta = s1 - 2.0 * be * tl.load(cs + o_n, mask=m_n, other=0.0) * s2
    if HAS_DBR:
        d_beta += tl.load(dbr + o_n, mask=m_n, other=0.0)
    tl.store(dbeta + o_n, d_beta, mask=m_n)
    dc = (-be * be * s2)[:, None]
    for k0 in tl.static_range(0, K, BK):
        o_k = k0 + tl.arange(0, BK)
        m = m_n[:, None] & (o_k < K)[None, :]
        p = o_n[:, None] * K + o_k[None, :]
        k_ = tl.load(k + p, mask=m, other=0.0).to(tl.float32)
        lk = tl.exp(tl.load(g + p, mask=m, other=0.0).to(tl.float32)) * k_
        # dk: dc ⊙ λk through c's k and again through its λk; dg: dc ⊙ k ⊙ λk
        d_k = tl.load(dk + p, mask=m, other=0.0, cache_modifier=CACHE).to(tl.float32) + 2.0 * dc * lk
        d_g = tl.load(dg + p, mask=m, other=0.0, cache_modifier=CACHE).to(tl.float32) + dc * k_ * lk
        tl.store(dk + p, d_k.to(dk.dtype.element_ty), mask=m)
        tl.store(dg + p, d_g.to(dg.dtype.element_ty), mask=m)


@triton.jit
def _hdla_factors_finish_kernel(k, g, beta, cs, part, dk, dg, dbeta, dbr, N, NKB, K: tl.constexpr, BK: tl.constexpr,
                                ROWS: tl.constexpr, HAS_DBR: tl.constexpr):
    o_n = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    _hdla_finish_rows(k, g, beta, cs, part, dk, dg, dbeta, dbr, o_n, o_n < N, NKB, K, BK, HAS_DBR, "")


def hdla_factors_finish(k, g, beta, c, part, dk, dg, dbeta_rows=None) -> torch.Tensor:
    """The end of HDLA's rows' backward where step 4 (``chunk_bwd._grad_kernel``'s HDLA) took the rest: k, g
    [B, T, H, K], β [B, T, H], c = kᵀ(λ⊙k) [B, T, H] fp32 (``hdla_factors_fwd``'s ``with_c``), part
    [B, T, H, NKB, 2] fp32 (each key block's Σ da1 k + da2 λk and Σ da2 k), dk and dg [B, T, H, K] (added to in
    place, in fp32, stored in their dtypes), dbeta_rows [B, T, H] fp32 or None (β's share from elsewhere, added).
    Returns dβ [B, T, H] fp32."""
    K = k.shape[-1]
    N = k.numel() // K
    dbeta = torch.empty(beta.shape, dtype=torch.float32, device=k.device)
    BK, rows, grid = _grid(N, K)
    _hdla_factors_finish_kernel[grid](k, g, beta, c, part, dk, dg, dbeta, dbeta if dbeta_rows is None else dbeta_rows,
                                      N, part.shape[-2], K=K, BK=BK, ROWS=rows, HAS_DBR=dbeta_rows is not None)
    return dbeta


@opaque_function(2)
class _HDLAFactors(torch.autograd.Function):
    @staticmethod
    def forward(ctx, k, g, beta):
        a, b = hdla_factors_fwd(k, g, beta)
        ctx.save_for_backward(k, g, beta)
        return a, b

    @staticmethod
    @once_differentiable
    def backward(ctx, da, db):
        k, g, beta = ctx.saved_tensors
        da = torch.zeros(*k.shape[:-1], 2, k.shape[-1], device=k.device) if da is None else da.contiguous()
        db = torch.zeros_like(da) if db is None else db.contiguous()
        dk, dg, dbeta = hdla_factors_bwd(k, g, beta, da, db)
        return dk.to(k.dtype), dg.to(g.dtype), dbeta.to(beta.dtype)


def hdla_factors(k: torch.Tensor, g: torch.Tensor, beta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    r"""HDLA's rank-2 decay rows (HDLA App. C.2), differentiable in all three inputs.

    Args:
        k: ``[B, T, H, K]`` keys (any float dtype; read in fp32).
        g: ``[B, T, H, K]`` log-decays, ``λ = exp(g)``.
        beta: ``[B, T, H]``.

    Returns:
        ``(a, b)``, each ``[B, T, H, 2, K]`` fp32: ``a = [βk, β(λ⊙k - β(kᵀ(λ⊙k))k)]``,
        ``b = [λ⊙k, k]``, the factors of ``dplr`` for
        :math:`(I - βkkᵀ)\,\mathrm{Diag}(λ)\,(I - βkkᵀ) = \mathrm{Diag}(λ) - a_1b_1ᵀ - a_2b_2ᵀ`.
    """
    if k.dim() != 4 or g.shape != k.shape or beta.shape != k.shape[:-1]:
        raise ValueError(f"hdla_factors expects k and g [B, T, H, K] and beta [B, T, H]; got k {list(k.shape)}, "
                         f"g {list(g.shape)}, beta {list(beta.shape)}")
    return _HDLAFactors.apply(k.contiguous(), g.contiguous(), beta.contiguous())


def rows_dtype(k: torch.Tensor, precision: str) -> torch.dtype:
    """The dtype of decay rows built from k (Head-in-Head's b, KDA's b, HDLA's a2): k's 16 bits where the kernels
    take the rows' products in bf16 anyway (``precision``, ``chunk_state._precision``'s, "bf16…"), which halves
    their traffic (H100 HH-GDN r=4: 9.67 -> 9.01 ms forward+backward; BENCHMARKS.md session 34); else fp32."""
    low = precision.startswith("bf16") and k.dtype in (torch.float16, torch.bfloat16)
    return k.dtype if low else torch.float32


def decay_rows_dtype(k: torch.Tensor, q: torch.Tensor) -> torch.dtype:
    """``rows_dtype`` at the products' precision for these inputs (``chunk_state._precision(q)``): what a mechanism
    asks before it hands the kernels rows they form themselves. Traced by torch.compile, the precision is a constant
    of the graph (``opaque.matmul_precision``: traced, the query broke the graph inside ``_precision`` and Dynamo
    compiled its resumption again for every layer of a step, up to its recompile limit; H200, session 64)."""
    from .chunk_state import _precision

    return rows_dtype(k, _precision(q))


@triton.jit
def _kda_factor_kernel(k, g, b, db, dk, dg, N, K: tl.constexpr, BK: tl.constexpr, ROWS: tl.constexpr,
                       BACKWARD: tl.constexpr):
    # b = e^g ⊙ k (fp32); BACKWARD: dk = db ⊙ e^g and dg = db ⊙ b, each in its tensor's dtype
    o_n = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    o_k = tl.arange(0, BK)
    m = (o_n < N)[:, None] & (o_k < K)[None, :]
    p = o_n[:, None] * K + o_k[None, :]
    e = tl.exp(tl.load(g + p, mask=m, other=0.0).to(tl.float32))
    k_ = tl.load(k + p, mask=m, other=0.0).to(tl.float32)
    if BACKWARD:
        db_ = tl.load(db + p, mask=m, other=0.0).to(tl.float32)
        tl.store(dk + p, (db_ * e).to(dk.dtype.element_ty), mask=m)
        tl.store(dg + p, (db_ * e * k_).to(dg.dtype.element_ty), mask=m)
    else:
        tl.store(b + p, e * k_, mask=m)


@opaque_function(1)
class _KDAFactor(torch.autograd.Function):
    @staticmethod
    def forward(ctx, k, g, dtype):
        N, K = k.numel() // k.shape[-1], k.shape[-1]
        b = torch.empty(k.shape, dtype=dtype, device=k.device)
        BK, rows, grid = _grid(N, K)
        _kda_factor_kernel[grid](k, g, b, b, b, b, N, K=K, BK=BK, ROWS=rows, BACKWARD=False)
        ctx.save_for_backward(k, g)
        return b

    @staticmethod
    @once_differentiable
    def backward(ctx, db):
        k, g = ctx.saved_tensors
        N, K = k.numel() // k.shape[-1], k.shape[-1]
        dk, dg = torch.empty_like(k), torch.empty_like(g)
        BK, rows, grid = _grid(N, K)
        _kda_factor_kernel[grid](k, g, k, db.contiguous(), dk, dg, N, K=K, BK=BK, ROWS=rows, BACKWARD=True)
        return dk, dg, None


def kda_factor(k: torch.Tensor, g: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    r"""Kimi Delta Attention's decay row ``b = e^{g} ⊙ k`` (``k``'s shape, in ``dtype``: fp32, or 16 bits where
    its products are taken in bf16 anyway), differentiable in ``k`` and ``g``: one Triton kernel forward and one
    backward (dk and dg in their inputs' dtypes).

    Args:
        k: keys ``[..., K]``, any float dtype.
        g: per-channel log-decays of ``k``'s shape.
        dtype: b's dtype (its gradient comes back in it).
    """
    if g.shape != k.shape:
        raise ValueError(f"kda_factor expects g of k's shape {list(k.shape)}, got {list(g.shape)}")
    return _KDAFactor.apply(k.contiguous(), g.contiguous(), dtype)


@triton.jit
def _hh_factors_fwd_kernel(k, mask, a, b, N, H, K: tl.constexpr, BK: tl.constexpr, ROWS: tl.constexpr,
                           R: tl.constexpr, STATIC: tl.constexpr, WRITE_A: tl.constexpr = True):
    o_n = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    o_k = tl.arange(0, BK)
    m_n = o_n < N
    m = m_n[:, None] & (o_k < K)[None, :]
    k_ = tl.load(k + o_n[:, None] * K + o_k[None, :], mask=m, other=0.0)
    group = (o_k // (K // R))[None, :]
    p_m = ((o_n % H) if STATIC else o_n)[:, None] * R * R + group  # mask[.., j, group(l)] = p_m + j R
    for j in tl.static_range(R):
        p = (o_n[:, None] * R + j) * K + o_k[None, :]
        if WRITE_A:
            tl.store(a + p, tl.where(group == j, k_, 0.0).to(a.dtype.element_ty), mask=m)
        m_j = tl.load(mask + p_m + j * R, mask=m, other=0.0).to(tl.float32)
        tl.store(b + p, k_.to(tl.float32) * m_j, mask=m)


@triton.jit
def _hh_factors_bwd_kernel(k, mask, da, db, dk, dmask, N, H, K: tl.constexpr, BK: tl.constexpr,
                           ROWS: tl.constexpr, R: tl.constexpr, STATIC: tl.constexpr):
    o_n = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    o_k = tl.arange(0, BK)
    m_n = o_n < N
    m = m_n[:, None] & (o_k < K)[None, :]
    k_ = tl.load(k + o_n[:, None] * K + o_k[None, :], mask=m, other=0.0).to(tl.float32)
    group = (o_k // (K // R))[None, :]
    p_m = ((o_n % H) if STATIC else o_n)[:, None] * R * R + group
    dk_ = tl.zeros([ROWS, BK], dtype=tl.float32)
    for j in tl.static_range(R):
        p = (o_n[:, None] * R + j) * K + o_k[None, :]
        da_j = tl.load(da + p, mask=m, other=0.0).to(tl.float32)
        db_j = tl.load(db + p, mask=m, other=0.0).to(tl.float32)
        dk_ += tl.where(group == j, da_j, 0.0) + db_j * tl.load(mask + p_m + j * R, mask=m, other=0.0).to(tl.float32)
        dbk = db_j * k_
        for i in tl.static_range(R):  # this row's share of dM[j, i]: its channels in group i
            tl.store(dmask + (o_n * R + j) * R + i, tl.sum(tl.where(group == i, dbk, 0.0), axis=1), mask=m_n)
    tl.store(dk + o_n[:, None] * K + o_k[None, :], dk_, mask=m)


@opaque_function(2)
class _HHFactors(torch.autograd.Function):
    @staticmethod
    def forward(ctx, k, mask, b_dtype):
        B, T, H, K = k.shape
        R = mask.shape[-1]
        N = k.numel() // K
        a = k.new_empty(B, T, H, R, K)
        b = torch.empty(B, T, H, R, K, dtype=b_dtype, device=k.device)
        BK, rows, grid = _grid(N, K)
        _hh_factors_fwd_kernel[grid](k, mask, a, b, N, H, K=K, BK=BK, ROWS=rows, R=R, STATIC=mask.dim() == 3)
        ctx.save_for_backward(k, mask)
        return a, b

    @staticmethod
    @once_differentiable
    def backward(ctx, da, db):
        k, mask = ctx.saved_tensors
        B, T, H, K = k.shape
        R = mask.shape[-1]
        N = k.numel() // K
        da = torch.zeros(B, T, H, R, K, dtype=k.dtype, device=k.device) if da is None else da.contiguous()
        db = torch.zeros(B, T, H, R, K, device=k.device) if db is None else db.contiguous()
        dk = torch.empty(k.shape, dtype=torch.float32, device=k.device)
        dmask = torch.empty(B, T, H, R, R, dtype=torch.float32, device=k.device)  # per-row shares
        BK, rows, grid = _grid(N, K)
        _hh_factors_bwd_kernel[grid](k, mask, da, db, dk, dmask, N, H, K=K, BK=BK, ROWS=rows, R=R,
                                     STATIC=mask.dim() == 3)
        if mask.dim() == 3:
            dmask = dmask.sum((0, 1))
        return dk.to(k.dtype), dmask.to(mask.dtype), None


def hh_factors(k: torch.Tensor, mask: torch.Tensor,
               b_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    r"""Head-in-Head's decay rows (Head-in-Head App. B), differentiable in ``k`` and ``mask``.

    Args:
        k: ``[B, T, H, K]`` keys.
        mask: ``[H, r, r]`` (static) or ``[B, T, H, r, r]`` (per token), r dividing K.
        b_dtype: b's dtype: fp32, or 16-bit where the kernels take b's products in bf16 anyway (then its
            gradient comes back in that dtype too).

    Returns:
        ``(a, b)``, each ``[B, T, H, r, K]``: ``a_j = k ⊙ 1[group j]`` in ``k``'s dtype (exact),
        ``b_j = k ⊙ M[j, group(·)]`` in ``b_dtype``, with channel l in group ``l // (K / r)``; then
        :math:`\sum_j a_j b_jᵀ = k kᵀ ⊙ \mathrm{expand}(M)`.
    """
    B, T, H, K = k.shape
    R = mask.shape[-1]
    if mask.shape not in ((H, R, R), (B, T, H, R, R)) or K % R:
        raise ValueError(f"hh_factors expects mask [H, r, r] or [B, T, H, r, r] with r dividing K = {K}; "
                         f"got {list(mask.shape)}")
    return _HHFactors.apply(k.contiguous(), mask.contiguous(), b_dtype)


_PLACEHOLDERS: dict = {}


def placeholder(shape, dtype: torch.dtype, device) -> torch.Tensor:
    """A stand-in for rows the fused kernels form themselves (Head-in-Head's a and b: ``hh_placeholders``; HDLA's a,
    ``chunk_fwd.chunk_dplr_fwd``'s ``hdla_form_a2``; KDA's b, its ``kda_b``) or for a tensor no kernel of a form
    touches (HDLA's M_QK in its scaled forward): one element expanded to ``shape``, so no memory and no kernel, with
    the shape and dtype the kernels read off it. Its contents must never be read nor written. The element is made
    once per dtype and device and kept (a zeros kernel per call cost the H100's host 10 µs or so)."""
    if compiling() or shapes_only():  # traced (a graph's zeros cost nothing), or a fake run: nothing kept
        return torch.zeros((), dtype=dtype, device=device).expand(*shape)
    key = (dtype, torch.device(device))
    one = _PLACEHOLDERS.get(key)
    if one is None:
        one = _PLACEHOLDERS[key] = torch.zeros((), dtype=dtype, device=device)
    return one.expand(*shape)


def hh_placeholders(shape, r: int, k_dtype: torch.dtype, b_dtype: torch.dtype,
                    device) -> tuple[torch.Tensor, torch.Tensor]:
    """Stand-ins for Head-in-Head's rows (``hh_factors``' a and b, ``[B, T, H, r, K]`` for ``shape`` = (B, T, H, K))
    where the fused kernels form them from k and the mask themselves (``chunk_fwd.chunk_dplr_fwd``'s ``hh_mask``):
    one element each, expanded, so no memory and no kernel, with the shapes and dtypes (a: k's, b: ``b_dtype``)
    the kernels read off them. Their contents must never be read."""
    B, T, H, K = shape
    return tuple(placeholder((B, T, H, r, K), dt, device) for dt in (k_dtype, b_dtype))


def hh_update_rows(k: torch.Tensor, mask: torch.Tensor, b_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``hh_factors``' (a, b) without autograd for the fused forward with ``grouped`` and ``hh_mask``
    (``chunk_fwd.chunk_dplr_fwd``), whose kernels form a from k and read b alone: (a placeholder, b). One kernel
    writing b, half of ``hh_factors``' traffic."""
    return hh_placeholders(k.shape, mask.shape[-1], k.dtype, b_dtype, k.device)[0], _hh_update_b(k, mask, b_dtype)


@opaque(1)
def _hh_update_b(k: torch.Tensor, mask: torch.Tensor, b_dtype: torch.dtype) -> torch.Tensor:
    """``hh_update_rows``' b."""
    B, T, H, K = k.shape
    R = mask.shape[-1]
    N = k.numel() // K
    k, mask = k.contiguous(), mask.contiguous()
    b = torch.empty(B, T, H, R, K, dtype=b_dtype, device=k.device)
    BK, rows, grid = _grid(N, K)
    _hh_factors_fwd_kernel[grid](k, mask, b, b, N, H, K=K, BK=BK, ROWS=rows, R=R, STATIC=mask.dim() == 3,
                                 WRITE_A=False)
    return b
