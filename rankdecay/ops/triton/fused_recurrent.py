"""The per-token recurrence in one Triton kernel, for decoding.

    S_t = Diag(exp g_t) S_{t-1} - sum_r a_{t,r} (b_{t,r}^T S_{t-1}) + sum_j k_{t,j} v_{t,j}^T
    o_t = scale * S_t^T q_t

One program per (value block, sequence x head) keeps its [K, BV] slice of the state
in registers for the whole sequence; the ranks Rab, Rkv and the gate kind are
compile-time constants, so one kernel serves every mechanism.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _sequence(cu_seqlens, i_n, T, IS_VARLEN: tl.constexpr):
    """Sequence ``i_n``'s first token (a row of the tokens' axis, int64 when packed) and its length: from
    ``cu_seqlens`` when the sequences are packed along T, else row i_n of [N, T]."""
    if IS_VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        seq_len = (tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos).to(tl.int32)
    else:
        bos = i_n * T
        seq_len = T
    return bos, seq_len


@triton.jit
def _fused_recurrent_fwd_kernel(
    q, k, v, a, b, g, h0, o, ht, cu_seqlens, scale, T,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    RKV: tl.constexpr, RAB: tl.constexpr, GATE: tl.constexpr, HAS_H0: tl.constexpr, IS_VARLEN: tl.constexpr,
):
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    bos, seq_len = _sequence(cu_seqlens, i_n, T, IS_VARLEN)
    # fp32 whatever the caller passes (torch.compile's launches type Python floats as fp64)
    scale = tl.cast(scale, tl.float32)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k, m_v = o_k < K, o_v < V
    m_h = m_k[:, None] & m_v[None, :]
    p_h = i_nh * K * V + o_k[:, None] * V + o_v[None, :]
    S = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_H0:
        S += tl.load(h0 + p_h, mask=m_h, other=0.0).to(tl.float32)
    for t in range(seq_len):
        tok = (bos + t) * H + i_h  # row of [N, T, H]
        if RAB > 0:
            low_rank = tl.zeros([BK, BV], dtype=tl.float32)
            for r in tl.static_range(RAB):
                b_r = tl.load(b + (tok * RAB + r) * K + o_k, mask=m_k, other=0.0).to(tl.float32)
                a_r = tl.load(a + (tok * RAB + r) * K + o_k, mask=m_k, other=0.0).to(tl.float32)
                bS = tl.sum(b_r[:, None] * S, axis=0)  # b_r^T S_{t-1}: [BV]
                low_rank += a_r[:, None] * bS[None, :]
        if GATE == 1:
            S = S * tl.exp(tl.load(g + tok).to(tl.float32))
        elif GATE == 2:
            S = S * tl.exp(tl.load(g + tok * K + o_k, mask=m_k, other=0.0).to(tl.float32))[:, None]
        if RAB > 0:
            S = S - low_rank
        for j in tl.static_range(RKV):
            k_j = tl.load(k + (tok * RKV + j) * K + o_k, mask=m_k, other=0.0).to(tl.float32)
            v_j = tl.load(v + (tok * RKV + j) * V + o_v, mask=m_v, other=0.0).to(tl.float32)
            S += k_j[:, None] * v_j[None, :]
        q_t = tl.load(q + tok * K + o_k, mask=m_k, other=0.0).to(tl.float32) * scale
        tl.store(o + tok * V + o_v, tl.sum(q_t[:, None] * S, axis=0), mask=m_v)
    tl.store(ht + p_h, S.to(ht.dtype.element_ty), mask=m_h)


def _pow2(n: int) -> int:
    """The next power of two >= n (0 for 0), in plain Python: ``triton.next_power_of_2``'s value, which Triton 3.6
    wraps as a constexpr function costing about 2 µs of host time a call (a decode step's host time is its cost, and
    a forward took some 20 such calls)."""
    return 0 if n == 0 else 1 << (n - 1).bit_length()


def _cdiv(a: int, b: int) -> int:
    """ceil(a / b) for host code, in plain Python (``triton.cdiv``'s value; see ``_pow2``)."""
    return -(-a // b)


def gate_kind(g: torch.Tensor | None) -> int:
    """The kernels' GATE constant for a canonical log-gate [..., 1 | K]: 0 none, 1 scalar, 2 per channel."""
    return 0 if g is None else (1 if g.shape[-1] == 1 else 2)


# The GDN decode kernel's "bv" / "warps" where set (benchmarks/decode_variants.py). Else 32-wide value
# blocks (K > 64) on 4 warps, or 2 for a 16-bit state: 26 against 29 us at B = 64 (BENCHMARKS.md, session 26)
_LAUNCH: dict = {}


def _final_state_buffer(q: torch.Tensor, initial_state: torch.Tensor | None, inplace: bool, shape) -> torch.Tensor:
    """Where a kernel writes the final state: ``initial_state`` itself with ``inplace`` (each program reads
    its slice whole before it writes it; the ops checked it, ``_inputs.check_inplace_state``), else a new
    fp32 tensor."""
    return initial_state if inplace else q.new_empty(shape, dtype=torch.float32)


def fused_recurrent_dplr(q, k, v, a, b, g, scale: float, initial_state: torch.Tensor | None,
                         inplace_final_state: bool = False,
                         cu_seqlens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Canonical inputs (``rankdecay.ops._inputs``): q [N, T, H, K], k [N, T, H, Rkv, K],
    v [N, T, H, Rkv, V], a/b [N, T, H, Rab, K] or None, g [N, T, H, 1|K] or None,
    initial_state [N, H, K, V] or None. Returns (o [N, T, H, V] fp32, S_T [N, H, K, V] fp32).

    ``cu_seqlens`` [N + 1] (int32 or int64, on q's device; checked by the caller): N sequences packed along T, the
    inputs [1, T, ...] and o [1, T, H, V]; each program walks its own sequence, so nothing is padded or gathered.

    With ``inplace_final_state``, the final state is written into ``initial_state`` (contiguous;
    fp32, or bf16 / fp16 for a 16-bit cache: read and written in its dtype, updated in fp32) and
    that tensor is returned: a decode step allocates nothing and moves the state once each way.
    """
    B, T, H, K = q.shape
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    Rkv, V = v.shape[-2], v.shape[-1]
    Rab = a.shape[-2] if a is not None else 0
    ht = _final_state_buffer(q, initial_state, inplace_final_state, (N, H, K, V))
    o = q.new_empty(B, T, H, V, dtype=torch.float32)
    BK = _pow2(K)
    BV = min(_pow2(V), 32 if BK > 128 else 64)
    dummy = q  # never read when its constexpr flag is off
    grid = (-(-V // BV), N * H)
    _fused_recurrent_fwd_kernel[grid](
        q.contiguous(), k.contiguous(), v.contiguous(),
        a.contiguous() if a is not None else dummy, b.contiguous() if b is not None else dummy,
        g.contiguous() if g is not None else dummy,
        initial_state.contiguous() if initial_state is not None else dummy, o, ht,
        cu_seqlens if cu_seqlens is not None else dummy, scale, T,
        H=H, K=K, V=V, BK=BK, BV=BV, RKV=Rkv, RAB=Rab, GATE=gate_kind(g),
        HAS_H0=initial_state is not None, IS_VARLEN=cu_seqlens is not None, num_warps=4 if BK * BV <= 8192 else 8,
    )
    return o, ht


@triton.jit
def _softplus(x):
    """log(1 + e^x) in fp32 as torch's softplus (x above 20 taken as is): max(x, 0) + log1p(e^-|x|),
    with log1p(y) = log(u) y / (u - 1), u = 1 + y, accurate where 1 + y rounds (Goldberg)."""
    y = tl.exp(-tl.abs(x))
    u = 1.0 + y
    log1p = tl.where(u == 1.0, y, tl.log(u) * y / tl.where(u == 1.0, 1.0, u - 1.0))
    return tl.where(x > 20.0, x, tl.maximum(x, 0.0) + log1p)


@triton.jit
def _load_key_value_beta(k, v, beta, row, row_k, o_k, o_v, m_k, m_v, beta_max, K: tl.constexpr, V: tl.constexpr,
                         QK_L2NORM: tl.constexpr, RAW_GATES: tl.constexpr):
    """Row ``row`` (of [N * T * H]) of v and β (β_max sigmoid(b) with RAW_GATES) and row ``row_k`` of k
    (L2-normalised with QK_L2NORM), in fp32."""
    k_t = tl.load(k + row_k * K + o_k, mask=m_k, other=0.0).to(tl.float32)
    if QK_L2NORM > 0:  # x / max(||x||, 1e-6), as F.normalize
        k_t = k_t / tl.maximum(tl.sqrt(tl.sum(k_t * k_t)), 1e-6)
    v_t = tl.load(v + row * V + o_v, mask=m_v, other=0.0).to(tl.float32)
    b_t = tl.load(beta + row).to(tl.float32)
    if RAW_GATES:
        b_t = beta_max * tl.sigmoid(b_t)
    return k_t, v_t, b_t


@triton.jit
def _fused_recurrent_gdn_kernel(
    q, k, v, beta, g, h0, o, ht, cu_seqlens, scale, T, A_log, dt_bias, beta_max, lower_bound, mask, gate_scale,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    GATE: tl.constexpr, HAS_H0: tl.constexpr, QK_L2NORM: tl.constexpr, RAW_GATES: tl.constexpr,
    DECAY_FIRST: tl.constexpr, BOUNDED: tl.constexpr, HOUSEHOLDER: tl.constexpr, GROUPS: tl.constexpr,
    MASK_PER_TOKEN: tl.constexpr, LOGSIGMOID: tl.constexpr, MASK_RAW: tl.constexpr, NH: tl.constexpr,
    QK_GROUPS: tl.constexpr, IS_VARLEN: tl.constexpr,
):
    # S = α S;  u = β (v - Sᵀ k);  S += k uᵀ;  o = scale Sᵀ q   (GDN eq. 10, fla's form;
    # a per-channel α applies after the reflection, as in ops.gated_delta_rule, or with DECAY_FIRST
    # before it, Kimi Delta Attention's order, ops.kda).
    # QK_L2NORM: q and k are L2-normalised here (fla's use_qk_l2norm_in_kernel; 2: k only, HDLA's). RAW_GATES: beta
    # and g hold the layer's projections: β = beta_max sigmoid(beta), and g = -exp(A_log)
    # softplus(g + dt_bias), per head (a scalar gate: Mamba2's α, as the GatedDeltaNet layer forms it)
    # or per channel (dt_bias [H, K]: the KDA layer's), or with BOUNDED (per channel)
    # g = lower_bound sigmoid(exp(A_log) (g + dt_bias)) (fla's KDA with a lower_bound), or with LOGSIGMOID
    # (per channel) g = gate_scale logsigmoid(g) (GLA's and HDLA's λ = sigmoid(W x)^(1/τ), gate_scale = 1/τ).
    # HOUSEHOLDER: HDLA's step instead (its eq. 27), the decay between two reflections and the write unscaled:
    # S = (I - β k kᵀ) Diag(α) (I - β k kᵀ) S + k vᵀ.
    # GROUPS r > 0: Head-in-Head's step (its eq. 10), the reflection masked by the r x r mask between the key's r
    # groups of K / r channels (K = BK): (k kᵀ ⊙ expand(M)) S = k ⊙ expand(M P), P_j = Σ_{l in group j} k_l S_l.
    # MASK_RAW: mask holds M_org, and M = N Nᵀ is formed here (ops.head_in_head_mask of softplus(M_org)).
    # NH > 1: Gated DeltaProduct's step (a scalar gate or none): the gate once, then NH delta-rule sub-steps with
    # rows t * NH + j of k, v and beta, the query read after the last.
    # QK_GROUPS > 1: grouped value heads (fla's GVA): H counts v's heads, q and k have H / QK_GROUPS, and value head
    # h reads key head h // QK_GROUPS.
    # IS_VARLEN: the sequences packed along T (q [1, T, ...]), sequence n from token cu_seqlens[n] to cu_seqlens[n + 1].
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    bos, seq_len = _sequence(cu_seqlens, i_n, T, IS_VARLEN)
    # fp32 whatever the caller passes (torch.compile's launches type Python floats as fp64)
    scale, beta_max = tl.cast(scale, tl.float32), tl.cast(beta_max, tl.float32)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k, m_v = o_k < K, o_v < V
    m_h = m_k[:, None] & m_v[None, :]
    p_h = i_nh * K * V + o_k[:, None] * V + o_v[None, :]
    S = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_H0:
        S += tl.load(h0 + p_h, mask=m_h, other=0.0).to(tl.float32)
    if RAW_GATES and GATE == 1:
        neg_a = -tl.exp(tl.load(A_log + i_h).to(tl.float32))
        bias = tl.load(dt_bias + i_h).to(tl.float32)
    if RAW_GATES and GATE == 2 and not LOGSIGMOID:
        a_h = tl.exp(tl.load(A_log + i_h).to(tl.float32))
        bias_k = tl.load(dt_bias + i_h * K + o_k, mask=m_k, other=0.0).to(tl.float32)
    for t in range(seq_len):
        tok = (bos + t) * H + i_h
        tok_k = (bos + t) * (H // QK_GROUPS) + i_h // QK_GROUPS  # q's and k's row
        if NH == 1:
            k_t, v_t, b_t = _load_key_value_beta(k, v, beta, tok, tok_k, o_k, o_v, m_k, m_v, beta_max, K, V,
                                                 QK_L2NORM, RAW_GATES)
        q_t = tl.load(q + tok_k * K + o_k, mask=m_k, other=0.0).to(tl.float32)
        if QK_L2NORM == 1:
            q_t = q_t / tl.maximum(tl.sqrt(tl.sum(q_t * q_t)), 1e-6)
        q_t = q_t * scale
        if GATE == 1:
            g_t = tl.load(g + tok).to(tl.float32)
            if RAW_GATES:
                g_t = neg_a * _softplus(g_t + bias)
        if GATE == 2:
            g_k = tl.load(g + tok * K + o_k, mask=m_k, other=0.0).to(tl.float32)
            if RAW_GATES:
                if LOGSIGMOID:
                    g_k = -tl.cast(gate_scale, tl.float32) * _softplus(-g_k)
                elif BOUNDED:
                    g_k = tl.cast(lower_bound, tl.float32) * tl.sigmoid(a_h * (g_k + bias_k))
                else:
                    g_k = -a_h * _softplus(g_k + bias_k)
        if NH > 1:  # α S, then S <- (I - β_j k_j k_jᵀ) S + β_j k_j v_jᵀ for j < NH
            if GATE == 1:
                S = S * tl.exp(g_t)
            for j in tl.static_range(NH):
                row = ((bos + t) * NH + j) * H + i_h
                k_t, v_t, b_t = _load_key_value_beta(k, v, beta, row, row, o_k, o_v, m_k, m_v, beta_max, K, V,
                                                     QK_L2NORM, RAW_GATES)
                u = b_t * (v_t - tl.sum(k_t[:, None] * S, axis=0))
                S += k_t[:, None] * u[None, :]
        elif GROUPS > 0:  # α (I - β (k kᵀ ⊙ expand(M))) S + β k vᵀ, the per-channel decay after the reflection
            o_r = tl.arange(0, GROUPS)
            m_base = (tok if MASK_PER_TOKEN else i_h) * GROUPS * GROUPS
            m = tl.load(mask + m_base + o_r[:, None] * GROUPS + o_r[None, :]).to(tl.float32)  # [r, r]
            if MASK_RAW:  # N: softplus(M_org)'s rows scaled by their largest entry, then L2-normalised; M = N Nᵀ
                n = _softplus(m)
                n = n / tl.maximum(tl.max(tl.abs(n), axis=1), 1.1754943508222875e-38)[:, None]
                n = n / tl.maximum(tl.sqrt(tl.sum(n * n, axis=1)), 1e-6)[:, None]
                m = tl.sum(n[:, None, :] * n[None, :, :], axis=2)
            P = tl.sum(tl.reshape(k_t[:, None] * S, (GROUPS, BK // GROUPS, BV)), axis=1)  # [r, BV]
            MP = tl.sum(m[:, :, None] * P[None, :, :], axis=1)  # [r, BV]
            k_g = tl.reshape(k_t, (GROUPS, BK // GROUPS))
            S = S - b_t * tl.reshape(k_g[:, :, None] * MP[:, None, :], (BK, BV))
            if GATE == 2:
                S = S * tl.exp(g_k)[:, None]
            elif GATE == 1:
                S = S * tl.exp(g_t)
            S += b_t * k_t[:, None] * v_t[None, :]
        elif HOUSEHOLDER:
            S = S - b_t * k_t[:, None] * tl.sum(k_t[:, None] * S, axis=0)[None, :]
            if GATE == 2:
                S = S * tl.exp(g_k)[:, None]
            elif GATE == 1:
                S = S * tl.exp(g_t)
            S = S - b_t * k_t[:, None] * tl.sum(k_t[:, None] * S, axis=0)[None, :] + k_t[:, None] * v_t[None, :]
        elif GATE == 2 and DECAY_FIRST:  # (I - β k kᵀ) Diag(α) S + β k vᵀ
            S = S * tl.exp(g_k)[:, None]
            u = b_t * (v_t - tl.sum(k_t[:, None] * S, axis=0))
            S += k_t[:, None] * u[None, :]
        elif GATE == 2:  # Diag(α)(I - β k kᵀ) S + β k vᵀ: the per-channel decay acts after the reflection
            kS = tl.sum(k_t[:, None] * S, axis=0)
            S = (S - b_t * k_t[:, None] * kS[None, :]) * tl.exp(g_k)[:, None]
            S += b_t * k_t[:, None] * v_t[None, :]
        else:
            if GATE == 1:
                S = S * tl.exp(g_t)
            u = b_t * (v_t - tl.sum(k_t[:, None] * S, axis=0))
            S += k_t[:, None] * u[None, :]
        tl.store(o + tok * V + o_v, tl.sum(q_t[:, None] * S, axis=0).to(o.dtype.element_ty), mask=m_v)
    tl.store(ht + p_h, S.to(ht.dtype.element_ty), mask=m_h)


def fused_recurrent_gated_delta_rule(q, k, v, g, beta, scale: float, initial_state=None,
                                     inplace_final_state: bool = False, use_qk_l2norm: bool = False,
                                     raw_gates: tuple | None = None, decay_first: bool = False,
                                     lower_bound: float | None = None, householder: bool = False,
                                     mask: torch.Tensor | None = None, norm_q: bool = True,
                                     logsigmoid_scale: float | None = None, mask_raw: bool = False,
                                     num_householder: int = 1, cu_seqlens: torch.Tensor | None = None):
    """Gated DeltaNet's recurrence in one kernel, without building DPLR factors (the decode
    fast path). Canonical inputs (``rankdecay.ops._inputs``, contiguous): q [N, T, H, K],
    k [N, T, H, 1, K], v [N, T, H, 1, V], beta [N, T, H], g None or [N, T, H, 1 | K],
    initial_state [N, H, K, V] or None. Returns (o [N, T, H, V] in q's dtype,
    S_T [N, H, K, V] fp32); with ``inplace_final_state`` the state is updated in ``initial_state``
    (fp32, bf16 or fp16, contiguous; ``fused_recurrent_dplr``).

    ``use_qk_l2norm``: q and k are L2-normalised in the kernel (k alone with ``norm_q=False``).
    ``raw_gates = (A_log [H], dt_bias [H] (a per-channel g: [H * K]) or None when g is None, beta_max)``: beta and g
    are the layer's projections, and the kernel forms β = beta_max · sigmoid(beta) and g = -exp(A_log) · softplus(g +
    dt_bias), or with ``lower_bound`` (a per-channel g) g = lower_bound · sigmoid(exp(A_log) · (g + dt_bias)).
    With ``logsigmoid_scale`` s (raw gates, a per-channel g): g = s · logsigmoid(g) instead (HDLA's and GLA's).
    ``decay_first``: a per-channel decay acts before the reflection (Kimi Delta Attention), not after.
    ``householder``: HDLA's step, (I - β k kᵀ) Diag(e^g) (I - β k kᵀ) S + k vᵀ (g scalar or per channel, as given).
    ``mask``: Head-in-Head's step with this r x r mask ([H, r, r] or [N, T, H, r, r], contiguous; K a power of two
    that r divides), α (I - β (k kᵀ ⊙ expand(M))) S + β k vᵀ; with ``mask_raw`` it holds M_org and the kernel forms
    M = head_in_head_mask(softplus(M_org)).
    ``num_householder`` n > 1: Gated DeltaProduct's step, k [N, T * n, H, 1, K], v [N, T * n, H, 1, V] and beta
    [N, T * n, H] (row t * n + j: sub-step j of token t), g None or [N, T, H, 1]: α S, then n delta-rule sub-steps.
    Grouped value heads (fla's GVA; n = 1, no mask): q and k [N, T, H', ...] with H' dividing v's H; v, beta, g,
    the gates' parameters and the state have H heads, and value head h reads key head h // (H / H').
    ``cu_seqlens`` [N + 1]: N sequences packed along T (``fused_recurrent_dplr``'s), the state [N, H, K, V]."""
    B, T, HK, K = q.shape
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    H, V = v.shape[2], v.shape[-1]
    ht = _final_state_buffer(q, initial_state, inplace_final_state, (N, H, K, V))
    o = q.new_empty(B, T, H, V)
    BK = _pow2(K)
    BV = _LAUNCH.get("bv") or min(_pow2(V), 32 if BK > 64 else 64)
    grid = (-(-V // BV), N * H)
    A_log, dt_bias, beta_max = raw_gates if raw_gates is not None else (None, None, 1.0)
    _fused_recurrent_gdn_kernel[grid](
        q, k, v, beta, g if g is not None else q, initial_state if initial_state is not None else q, o, ht,
        cu_seqlens if cu_seqlens is not None else q, scale, T, A_log if A_log is not None else q,
        dt_bias if dt_bias is not None else q, float(beta_max),
        float(lower_bound or 0.0), mask if mask is not None else q, float(logsigmoid_scale or 1.0),
        H=H, K=K, V=V, BK=BK, BV=BV, GATE=gate_kind(g), HAS_H0=initial_state is not None,
        QK_L2NORM=(1 if norm_q else 2) if use_qk_l2norm else 0, LOGSIGMOID=logsigmoid_scale is not None,
        RAW_GATES=raw_gates is not None, DECAY_FIRST=decay_first, BOUNDED=lower_bound is not None,
        HOUSEHOLDER=householder, GROUPS=0 if mask is None else mask.shape[-1],
        MASK_PER_TOKEN=mask is not None and mask.dim() == 5, MASK_RAW=mask_raw, NH=num_householder, QK_GROUPS=H // HK,
        IS_VARLEN=cu_seqlens is not None,
        num_warps=_LAUNCH.get("warps", 2 if ht.element_size() == 2 else 4),
    )
    return o, ht
