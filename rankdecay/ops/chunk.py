"""The rank-generalised chunkwise algorithm (HDLA §3.2, App. C.3) in PyTorch.

Within a chunk of C tokens (local times 1..C, S_0 the state entering the chunk),
let G_t = sum_{s<=t} g_s (log-cumsum inside the chunk) and Γ_t = Diag(exp G_t).
Unrolling S_t = D_t S_{t-1} - A_t (B_t^T S_{t-1}) + K_t V_t^T with U_t^T := B_t^T S_{t-1}:

    S_t   = Γ_t S_0 + sum_{i<=t} Γ_t Γ_i^{-1} (K_i V_i^T - A_i U_i^T)
    U_i^T = B_i^T Γ_{i-1} S_0 + sum_{j<i} B_i^T Γ_{i-1} Γ_j^{-1} (K_j V_j^T - A_j U_j^T)

so, stacking the C*Rab rows (i, r) of U,

    (I + L_BA) U = (B ⊙ e^{G_{i-1}}) S_0 + L_BK V         (the UT transform, HDLA eqs. 13-14)
    L_XY[(i,r),(j,s)] = sum_k x_{i,r,k} y_{j,s,k} exp(G_{i-1,k} - G_{j,k}),  j < i

    U = W S_0 + Ũ,  W = (I + L_BA)^{-1} (B ⊙ e^{G_{i-1}}),  Ũ = (I + L_BA)^{-1} L_BK V
    O = (Q ⊙ e^{G}) S_0 + M_QK V - M_QA U                  (HDLA eq. 18)
    S_C = e^{G_C} ⊙ S_0 + (K ⊙ e^{G_C - G})^T V - (A ⊙ e^{G_C - G})^T U   (HDLA eq. 17)

with M_XY the same products as L_XY but exp(G_i - G_j) and j <= i. Every exponent
that is formed is a difference G_later - G_earlier <= 0 of log-cumsums (the paper's
A' ⊙ d and K' ⊘ d, eqs. 15-16, would divide by products that underflow). With a
per-channel gate the decay depends on the channel, so the [C, C] products are
built hierarchically: a block's lower-left half is a matmul through the log-cumsum
at its midpoint, where both factors exp(G_i - G_mid) and exp(G_mid - G_j) are <= 1
(the trick of fla's chunked GLA, applied recursively down to single tokens, which
need no decay at all; a chunk size with an odd factor leaves odd-sized blocks that
are formed elementwise).

Log-cumsums are kept in fp64: G_i - G_j of two large cumsums (a log-gate of -1e4 at
one step) would otherwise lose the small difference. Log-gates below ``LOG_GATE_FLOOR``
(-1000, where e^g is 0 in fp64 already) count as it: -inf gave inf - inf.
"""
from __future__ import annotations

import functools

import torch
import torch.utils.checkpoint

from .backends import LOG_GATE_FLOOR, needs_grad


def _causal_mask(n: int, strict: bool, device) -> torch.Tensor:
    return torch.ones(n, n, dtype=torch.bool, device=device).tril(-1 if strict else 0)


def _masked_exp(exponent: torch.Tensor, mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """exp of log-decay differences; masked entries are exactly 0, with zero gradient.

    The difference is formed in fp64; once formed it is small enough for ``dtype``.
    """
    return exponent.to(dtype).masked_fill(~mask, float("-inf")).exp()


def decayed_products(
    x: torch.Tensor,
    y: torch.Tensor,
    gx: torch.Tensor | None,
    gy: torch.Tensor | None,
    *,
    strict: bool,
) -> torch.Tensor:
    """Causal decayed inner products inside a chunk.

    Returns ``P[..., i, r, j, s] = sum_k x[..., i, r, k] y[..., j, s, k] exp(gx[..., i, k] - gy[..., j, k])``
    for ``j < i`` (``strict``) or ``j <= i``, and 0 elsewhere.

    x: [..., C, R1, K]; y: [..., C, R2, K]; gx, gy: [..., C, Kg] log-cumsums (Kg = 1 or K,
    fp64) or None for no decay; gy is the inclusive cumsum, gx that or the exclusive
    one, so that gx[i] <= gy[m] for every m < i when the log-gates are <= 0.
    Returns [..., C, R1, C, R2] in x's dtype.
    """
    C = x.shape[-3]
    dtype, device = x.dtype, x.device
    if gx is None or gx.shape[-1] == 1:
        s = torch.einsum("...irk,...jsk->...irjs", x, y)
        mask = _causal_mask(C, strict, device)
        w = mask.to(dtype) if gx is None else _masked_exp(gx[..., :, None, 0] - gy[..., None, :, 0], mask, dtype)
        return s * w[..., :, None, :, None]
    return _blocked_products(x, y, gx, gy, strict)


_LEAF = 1  # blocks this small (or of odd size) take the exact elementwise form


def _block_diagonal(out: torch.Tensor, m: int, quarter: tuple[int, int] | None) -> torch.Tensor:
    """View of the m diagonal blocks of ``out`` [..., C, R1, C, R2], as [..., c, R1, c, R2, m].

    With ``quarter = (row half, column half)``, the view is of that quarter of each block.
    """
    *batch, C, R1, _, R2 = out.shape
    c = C // m
    if quarter is None:
        v = out.view(*batch, m, c, R1, m, c, R2)
    else:
        v = out.view(*batch, m, 2, c // 2, R1, m, 2, c // 2, R2)[..., :, quarter[0], :, :, :, quarter[1], :, :]
    return v.diagonal(dim1=-6, dim2=-3)


def _blocked_products(x, y, gx, gy, strict):
    """Per-channel decays: x [..., C, R1, K], y [..., C, R2, K], g* [..., C, K] -> [..., C, R1, C, R2].

    Halve the blocks level by level (C, C/2, ...). Rows of a block's second half
    against columns of its first half go through the log-cumsum at the last column
    of the first half, ``ref``: exp(gx_i - gy_j) = exp(gx_i - ref) * exp(ref - gy_j),
    both factors <= 1, so each such quarter is a matmul and nothing overflows.
    What is left on the diagonal are blocks of one token (or of an odd size), formed
    elementwise.
    """
    C, R1, _ = x.shape[-3:]
    R2 = y.shape[-2]
    dtype, device = x.dtype, x.device
    out = x.new_zeros(*x.shape[:-3], C, R1, C, R2)
    m, c = 1, C  # m blocks of c tokens
    while c > _LEAF and c % 2 == 0:
        h = c // 2
        xv, yv = x.unflatten(-3, (m, 2, h)), y.unflatten(-3, (m, 2, h))  # [..., m, 2, h, R, K]
        gxv, gyv = gx.unflatten(-2, (m, 2, h)), gy.unflatten(-2, (m, 2, h))  # [..., m, 2, h, K]
        ref = gyv[..., :, 0, h - 1 : h, :]  # [..., m, 1, K]
        x_lo = xv[..., :, 1, :, :, :] * (gxv[..., :, 1, :, :] - ref).to(dtype).exp()[..., None, :]
        y_hi = yv[..., :, 0, :, :, :] * (ref - gyv[..., :, 0, :, :]).to(dtype).exp()[..., None, :]
        lower = torch.einsum("...mirk,...mjsk->...irjsm", x_lo, y_hi)  # [..., h, R1, h, R2, m]
        _block_diagonal(out, m, (1, 0)).copy_(lower)
        m, c = 2 * m, h
    xb, yb = x.unflatten(-3, (m, c)), y.unflatten(-3, (m, c))
    if c == 1:  # a token against itself: no decay; nothing at all when strict
        if not strict:
            _block_diagonal(out, m, None).copy_(torch.einsum("...mirk,...mjsk->...irjsm", xb, yb))
        return out
    gxb, gyb = gx.unflatten(-2, (m, c)), gy.unflatten(-2, (m, c))
    d = _masked_exp(gxb[..., :, None, :] - gyb[..., None, :, :], _causal_mask(c, strict, device)[..., None], dtype)
    xd = xb[..., :, :, None, :, :] * d[..., :, :, :, None, :]  # [..., m, c_i, c_j, R1, K]
    _block_diagonal(out, m, None).copy_(torch.einsum("...mijrk,...mjsk->...irjsm", xd, yb))
    return out


def _decayed_products_checkpointed(x, y, gx, gy, strict):
    # Recomputed in backward: the per-channel path scales x and y at every halving
    # level, more than the [C, C*R] result; keeping only the inputs keeps the
    # memory of the chunked path at O(C * R) per token.
    if needs_grad((x, y, gx, gy)):
        return torch.utils.checkpoint.checkpoint(
            decayed_products, x, y, gx, gy, strict=strict, use_reentrant=False
        )
    return decayed_products(x, y, gx, gy, strict=strict)


def chunk_dplr_core(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor | None,
    b: torch.Tensor | None,
    g: torch.Tensor | None,
    scale: float,
    initial_state: torch.Tensor | None,
    dtype: torch.dtype,
    chunk_size: int = 64,
    use_triton: bool = False,
    offsets: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Canonical inputs (see ``_inputs``) -> (o [B, T, H, V], S_T [B, H, K, V]), both in ``dtype``.

    Memory is linear in T: per chunk it keeps [C, C*R] products and one [K, V] state.
    ``use_triton`` runs the chunk-to-chunk state passing (forward and backward) as one
    Triton kernel instead of a Python loop over chunks (fp32 only). ``offsets`` [N + 1] (int, on the device;
    ``_inputs.varlen_aligned``'s layout): B = 1 holds N sequences along its row, sequence n on tokens ``offsets[n]``
    up to ``offsets[n + 1]``, each a multiple of C (zero tokens after its end; the last offset T); each starts from
    ``initial_state[n]``, and S_T is [N, H, K, V]. The offsets are read on the device alone (no sync; under
    ``torch.compile``, no graph break).
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    C = chunk_size
    NC = -(-T // C)
    pad = NC * C - T
    N = B if offsets is None else offsets.shape[0] - 1
    if offsets is not None and (B != 1 or T % C):
        raise ValueError(f"offsets: the sequences lie along one row of whole chunks (B = 1, T a multiple of "
                         f"{C}), got B = {B}, T = {T}")
    S = q.new_zeros(N, H, K, V, dtype=dtype) if initial_state is None else initial_state.to(dtype)
    if T == 0:
        return q.new_zeros(B, 0, H, V, dtype=dtype), S

    def chunked(x: torch.Tensor | None, to: torch.dtype) -> torch.Tensor | None:
        # [B, T, H, ...] -> [B, H, NC, C, ...]; zero padding is the identity step.
        if x is None:
            return None
        x = x.to(to).transpose(1, 2)
        if pad:
            x = torch.cat([x, x.new_zeros(x.shape[:2] + (pad,) + x.shape[3:])], dim=2)
        return x.unflatten(2, (NC, C)).contiguous()

    q = chunked(q, dtype) * scale  # [B, H, NC, C, K]
    k, v = chunked(k, dtype), chunked(v, dtype)  # [B, H, NC, C, Rkv, K|V]
    a, b = chunked(a, dtype), chunked(b, dtype)  # [B, H, NC, C, Rab, K]
    v_flat = v.flatten(-3, -2)  # [B, H, NC, C*Rkv, V]

    if g is None:
        G = G_prev = None
        q_dec, k_dec, a_dec = q, k, a
    else:
        G = chunked(g, torch.float64).clamp_min(LOG_GATE_FLOOR).cumsum(-2)  # [B, H, NC, C, Kg]
        G_prev = torch.cat([torch.zeros_like(G[..., :1, :]), G[..., :-1, :]], dim=-2)  # G_{i-1}
        G_last = G[..., -1:, :]
        to_end = (G_last - G).to(dtype).exp()[..., None, :]  # exp(G_C - G_i), [B, H, NC, C, 1, Kg]
        q_dec = q * G.to(dtype).exp()
        k_dec = k * to_end
        a_dec = a * to_end if a is not None else None
        chunk_decay = G_last[..., 0, :, None].to(dtype).exp()  # [B, H, NC, Kg, 1]

    # Rows (queries, or b) against columns [k, a] in one pass: one decay per row set.
    cols = k if a is None else torch.cat([k, a], dim=-2)  # [B, H, NC, C, Rkv+Rab, K]
    Rkv = k.shape[-2]

    def products(x, gx, strict):
        # contiguous: a slice of the last dim has no unit-stride dim, and CPU matmuls of such operands
        # (and their gradients) take a per-matrix loop, ~10x slower at these sizes
        p = _decayed_products_checkpointed(x, cols, gx, G, strict)  # [..., C, R1, C, Rkv+Rab]
        return tuple(p[..., s].flatten(-4, -3).flatten(-2, -1).contiguous() for s in (slice(None, Rkv),
                                                                                    slice(Rkv, None)))

    M_qk, M_qa = products(q[..., None, :], G, strict=False)  # [B, H, NC, C, C*Rkv], [.., C, C*Rab]
    k_dec = k_dec.flatten(-3, -2)  # [B, H, NC, C*Rkv, K]
    if a is not None:
        L_bk, L_ba = products(b, G_prev, strict=True)  # [B, H, NC, C*Rab, C*Rkv], [.., C*Rab, C*Rab]
        b_dec = b if G is None else b * G_prev.to(dtype).exp()[..., None, :]
        # HDLA eqs. 13-14: the UT transform, one unit lower-triangular solve for both
        # right-hand sides; the solve reads only the strictly lower part of L_ba.
        rhs = torch.cat([b_dec.flatten(-3, -2), L_bk @ v_flat], dim=-1)
        WU = torch.linalg.solve_triangular(L_ba, rhs, upper=False, unitriangular=True)
        W, U_v = WU[..., :K], WU[..., K:]
        a_dec = a_dec.flatten(-3, -2)  # [B, H, NC, C*Rab, K]

    if a is None:
        W = U_v = a_dec = None
    if use_triton:
        from .triton import chunk_state_passing

        decay = None if G is None else chunk_decay[..., 0]  # [B, H, NC, Kg]
        walk = functools.partial(chunk_state_passing, offsets=None if offsets is None else offsets.to(torch.int32),
                                 chunk_size=C)
    else:
        decay = None if G is None else chunk_decay
        walk = functools.partial(_state_passing, offsets=offsets, chunk_size=C)
    S0, U, S = walk(S, decay, k_dec, v_flat, W, U_v, a_dec)
    o = q_dec @ S0 + M_qk @ v_flat  # HDLA eq. 18
    if a is not None:
        o = o - M_qa @ U
    o = o.flatten(2, 3)[:, :, :T].transpose(1, 2)
    return o, S


def _state_passing(S, chunk_decay, k_dec, v_flat, W, U_v, a_dec, offsets=None, chunk_size=None):
    """HDLA eq. 17, one chunk at a time: (states entering each chunk, pseudo-values U, final state).

    S [B, H, K, V]; chunk_decay [B, H, NC, Kg, 1] or None; k_dec [B, H, NC, C*Rkv, K];
    v_flat [B, H, NC, C*Rkv, V]; W, a_dec [B, H, NC, C*Rab, K] and U_v [.., C*Rab, V] or None.
    ``offsets`` [N + 1], ``chunk_size``: ``chunk_dplr_core``'s (B = 1, S [N, H, K, V]): one walk along the row that
    restarts from S[n] at sequence n's first chunk; sequence n's final state is the one after its last chunk (S[n]
    itself for an empty sequence). Which chunk starts which sequence is computed on the device.
    """
    if offsets is not None:
        first = offsets.to(S.device, torch.long) // chunk_size  # [N + 1]: each sequence's first chunk, then NC
        NC = k_dec.shape[2]
        chunks = torch.arange(NC, device=S.device)
        owner = torch.searchsorted(first[1:], chunks, right=True)  # the sequence chunk n belongs to
        restarts = (first[owner] == chunks).unbind(0)  # a sequence starts at chunk n
        entering = S.index_select(0, owner).unsqueeze(1).unbind(0)  # its initial state, [1, H, K, V] each
        h0 = S
        S = entering[0]
    else:
        restarts = None

    # Every chunk's write k_decᵀ v in one batched product, and each chunk's slices by unbind: chunk n taken by
    # indexing inside the loop made autograd's backward allocate and zero-fill the whole tensor once per index
    # (O(NC²) work; HDLA's forward+backward on the CPU, B1 T2048 H4 K=V=64, spent 28 % of its time in zero fills).
    writes = (k_dec.transpose(-1, -2) @ v_flat).unbind(2)
    decays = chunk_decay.unbind(2) if chunk_decay is not None else None
    if W is not None:
        W, U_v, a_dec = W.unbind(2), U_v.unbind(2), a_dec.unbind(2)
    starts, pseudo_values, ends = [], [], []
    for n in range(len(writes)):
        if restarts is not None:
            S = torch.where(restarts[n], entering[n], S)
        starts.append(S)
        S_next = S if decays is None else decays[n] * S
        S_next = S_next + writes[n]
        if W is not None:
            U = W[n] @ S + U_v[n]
            pseudo_values.append(U)
            S_next = S_next - a_dec[n].transpose(-1, -2) @ U
        S = S_next
        if restarts is not None:
            ends.append(S)
    U = torch.stack(pseudo_values, dim=2) if pseudo_values else None
    if restarts is not None:  # the state after each sequence's last chunk, or its initial state if it has none
        last = (first[1:] - 1).clamp_min(0)
        empty = (first[1:] == first[:-1])[:, None, None, None]
        S = torch.where(empty, h0, torch.cat(ends).index_select(0, last))
    return torch.stack(starts, dim=2), U, S
