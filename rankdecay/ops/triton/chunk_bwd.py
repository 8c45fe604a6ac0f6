"""Training with the fused forward: its per-chunk tensors saved, the backward written out.

``chunk_dplr`` runs ``chunk_fwd.chunk_dplr_fwd`` (three Triton kernels) and keeps what it
computed per chunk; the backward follows the forward's equations in reverse (notation
of ``rankdecay.ops.chunk``; per chunk, rows of K̃/V are (token, rank) pairs, padded):

1. outputs, O = Q̃ S_0 + M_QK V - M_QA U:
   dQ̃ = dO S_0ᵀ, dM_QK = dO Vᵀ, dM_QA = -dO Uᵀ, dV = M_QKᵀ dO, dU = -M_QAᵀ dO, dS_0 = Q̃ᵀ dO;
2. the state from chunk to chunk, in reverse: the Triton kernel of ``chunk_state``;
3. the UT transform, W = T B̃ and Ũ = T L_BK V with T = (I + L_BA)^{-1}:
   dB̃ = Tᵀ dW, dX = Tᵀ dŨ, dL_BA = -(dB̃ Wᵀ + dX Ũᵀ), dL_BK = dX Vᵀ, dV += L_BKᵀ dX;
4. the decayed products P = Σ_k x_ik y_jk e^{G^x_ik - G^y_jk} give dx and dy, and the
   log-cumsums dG^x = Σ x ⊙ dx, dG^y = -Σ y ⊙ dy; every decayed input (Q̃, K̃, Ã, B̃, e^{G_C})
   adds its own term; dg is the reverse cumsum of dG inside each chunk plus dG_C.

Steps 1-3 are batched fp32 matmuls over all chunks at once. Step 4 is one Triton kernel
(``_grad_kernel``) with a scalar gate or none, and autograd through the blocked products
of ``rankdecay.ops.chunk`` with a per-channel gate.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..chunk import decayed_products
from .chunk_fwd import _decays, _load_rows, _pow2, _rows, _scalar_cumsums, chunk_dplr_fwd
from .chunk_state import _precision, state_passing_backward

_SAVED = ("qd", "mqk", "mqa", "kd", "vf", "w", "ad", "uv", "dch", "tinv", "lbk", "s0", "u")


def _to_chunks(x: torch.Tensor, C: int, RP: int, dtype=torch.float32) -> torch.Tensor:
    """[B, T, H, R, D] -> [B, H, NC, C, RP, D], zero-padded in time and rank."""
    B, T, H, R, D = x.shape
    NC = -(-T // C)
    out = x.new_zeros(B, NC * C, H, RP, D, dtype=dtype)
    out[:, :T, :, :R] = x
    return out.view(B, NC, C, H, RP, D).permute(0, 3, 1, 2, 4, 5)


def _from_chunks(x: torch.Tensor, T: int, R: int) -> torch.Tensor:
    """[B, H, NC, C, RP, D] -> [B, T, H, R, D]."""
    B, H, NC, C, RP, D = x.shape
    return x.permute(0, 2, 3, 1, 4, 5).reshape(B, NC * C, H, RP, D)[:, :T, :, :R]


def _product_grads(dP, x, y, gx, gy, strict: bool):
    """Gradients (dx, dy, dgx, dgy) of P = decayed_products(x, y, gx, gy) given dP [..., C, R1, C, R2]:
    autograd through the blocked per-channel products (gx, gy [..., C, K] fp64)."""
    with torch.enable_grad():
        leaves = [t.detach().requires_grad_() for t in (x, y, gx, gy)]
        P = decayed_products(*leaves, strict=strict)
        return torch.autograd.grad(P, leaves, dP)


@triton.jit
def _grad_kernel(
    q, k, a, b, g, dmqk, dmqa, dlba, dlbk, dqd, dkd, dad, dbd, dch, ddch, dq, dk, da, db, dg, scale, T, NC,
    H: tl.constexpr, K: tl.constexpr, TC: tl.constexpr, RKV: tl.constexpr, RKVP: tl.constexpr,
    RAB: tl.constexpr, RABP: tl.constexpr, BK: tl.constexpr, GATE: tl.constexpr, PRECISION: tl.constexpr,
):
    """Step 4 for one chunk, scalar gate (GATE 1) or none (0): dq, dk, da, db and dg from the
    gradients of the products (dM_QK, dM_QA, dL_BA, dL_BK) and of the decayed inputs."""
    i_c, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    c = i_bh * NC + i_c
    NK: tl.constexpr = TC * RKVP
    NA: tl.constexpr = TC * RABP
    tokq, rkq, tq, vq, fq = _rows(i_b, i_h, i_c, T, H, TC, 1, 1)
    tokk, rkk, tk, vk, fk = _rows(i_b, i_h, i_c, T, H, TC, RKV, RKVP)
    r_q = tl.arange(0, TC)
    r_k = tl.arange(0, NK)
    Gq = tl.zeros([1], dtype=tl.float64)
    Gk = tl.zeros([1], dtype=tl.float64)
    Ga = tl.zeros([1], dtype=tl.float64)
    Gb = tl.zeros([1], dtype=tl.float64)
    G_end = tl.zeros([1], dtype=tl.float64)
    if GATE == 1:
        Gq, Gq_ex = _scalar_cumsums(g, i_b, i_h, tq, tokq, rkq, T, H, 1)
        Gk, _ = _scalar_cumsums(g, i_b, i_h, tk, tokk, rkk, T, H, 1)
        G_end = tl.sum(Gq - Gq_ex, axis=0)
    # dP ⊙ decays: the gradients with respect to the undecayed products x yᵀ
    Pqk = tl.load(dmqk + (c * TC + r_q[:, None]) * NK + r_k[None, :]) * scale * _decays(Gq, Gk, tokq, tokk, False,
                                                                                         GATE)
    dGq = tl.zeros([TC], dtype=tl.float32)
    dGk = tl.zeros([NK], dtype=tl.float32)
    dGC = tl.zeros([1], dtype=tl.float32)
    if RAB > 0:
        toka, rka, ta, va, fa = _rows(i_b, i_h, i_c, T, H, TC, RAB, RABP)
        r_a = tl.arange(0, NA)
        if GATE == 1:
            Ga, Gb = _scalar_cumsums(g, i_b, i_h, ta, toka, rka, T, H, 1)
        Pqa = tl.load(dmqa + (c * TC + r_q[:, None]) * NA + r_a[None, :]) * scale * _decays(Gq, Ga, tokq, toka,
                                                                                             False, GATE)
        Pba = tl.load(dlba + (c * NA + r_a[:, None]) * NA + r_a[None, :]) * _decays(Gb, Ga, toka, toka, True, GATE)
        Pbk = tl.load(dlbk + (c * NA + r_a[:, None]) * NK + r_k[None, :]) * _decays(Gb, Gk, toka, tokk, True, GATE)
        dGa = tl.zeros([NA], dtype=tl.float32)
        dGb = tl.zeros([NA], dtype=tl.float32)
    for k0 in tl.static_range(0, K, BK):
        o_k = k0 + tl.arange(0, BK)
        m_k = o_k < K
        Q = _load_rows(q, fq, vq, o_k, m_k, K)
        Kr = _load_rows(k, fk, vk, o_k, m_k, K)
        dQ = tl.dot(Pqk, Kr, input_precision=PRECISION)
        dK = tl.dot(tl.trans(Pqk), Q, input_precision=PRECISION)
        if RAB > 0:
            A = _load_rows(a, fa, va, o_k, m_k, K)
            Bm = _load_rows(b, fa, va, o_k, m_k, K)
            dQ += tl.dot(Pqa, A, input_precision=PRECISION)
            dK += tl.dot(tl.trans(Pbk), Bm, input_precision=PRECISION)
            dA = tl.dot(tl.trans(Pqa), Q, input_precision=PRECISION) + tl.dot(tl.trans(Pba), Bm,
                                                                               input_precision=PRECISION)
            dB = tl.dot(Pba, A, input_precision=PRECISION) + tl.dot(Pbk, Kr, input_precision=PRECISION)
        # the decayed inputs: Q̃ = scale Q e^G, K̃ = K e^{G_C - G}, Ã = A e^{G_C - G}, B̃ = B e^{G_{i-1}}
        Dq = tl.load(dqd + (c * TC + r_q[:, None]) * K + o_k[None, :], mask=m_k[None, :], other=0.0) * scale
        Dk = tl.load(dkd + (c * NK + r_k[:, None]) * K + o_k[None, :], mask=m_k[None, :], other=0.0)
        if GATE == 1:
            eq = tl.exp(Gq.to(tl.float32))[:, None]
            ek = tl.exp((G_end - Gk).to(tl.float32))[:, None]
            dGq += tl.sum(Q * (dQ + eq * Dq), axis=1)
            dGk -= tl.sum(Kr * (dK + ek * Dk), axis=1)
            dGC += tl.sum(tl.sum(Kr * ek * Dk, axis=1), axis=0)
            Dq = Dq * eq
            Dk = Dk * ek
        tl.store(dq + fq[:, None] * K + o_k[None, :], dQ + Dq, mask=vq[:, None] & m_k[None, :])
        tl.store(dk + fk[:, None] * K + o_k[None, :], dK + Dk, mask=vk[:, None] & m_k[None, :])
        if RAB > 0:
            Da = tl.load(dad + (c * NA + r_a[:, None]) * K + o_k[None, :], mask=m_k[None, :], other=0.0)
            Db = tl.load(dbd + (c * NA + r_a[:, None]) * K + o_k[None, :], mask=m_k[None, :], other=0.0)
            if GATE == 1:
                ea = tl.exp((G_end - Ga).to(tl.float32))[:, None]
                eb = tl.exp(Gb.to(tl.float32))[:, None]
                dGa -= tl.sum(A * (dA + ea * Da), axis=1)
                dGb += tl.sum(Bm * (dB + eb * Db), axis=1)
                dGC += tl.sum(tl.sum(A * ea * Da, axis=1), axis=0)
                Da = Da * ea
                Db = Db * eb
            tl.store(da + fa[:, None] * K + o_k[None, :], dA + Da, mask=va[:, None] & m_k[None, :])
            tl.store(db + fa[:, None] * K + o_k[None, :], dB + Db, mask=va[:, None] & m_k[None, :])
    if GATE == 1:
        # per token: G_t = sum_{s <= t} g_s, G_{t-1} = sum_{s < t} g_s, G_C = sum_s g_s
        dG = dGq + tl.sum(tl.reshape(dGk, (TC, RKVP)), axis=1)
        dGex = tl.zeros([TC], dtype=tl.float32)
        if RAB > 0:
            dG += tl.sum(tl.reshape(dGa, (TC, RABP)), axis=1)
            dGex += tl.sum(tl.reshape(dGb, (TC, RABP)), axis=1)
        dGC += tl.load(dch + c + tl.arange(0, 1)) * tl.load(ddch + c + tl.arange(0, 1))
        dgt = tl.cumsum(dG, axis=0, reverse=True) + tl.cumsum(dGex, axis=0, reverse=True) - dGex + dGC
        tl.store(dg + (i_b * T + tq) * H + i_h, dgt, mask=tq < T)


class _ChunkDPLR(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, a, b, g, h0, scale):
        o, ht, saved = chunk_dplr_fwd(q, k, v, a, b, g, scale, h0, save=True)
        ctx.save_for_backward(q, k, v, a, b, g, h0, *(saved[n] for n in _SAVED))
        ctx.scale, ctx.C = scale, saved["TC"]
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, a, b, g, h0, *saved = ctx.saved_tensors
        qd, mqk, mqa, kd, vf, w, ad, uv, dch, tinv, lbk, s0, u = saved
        scale, C = ctx.scale, ctx.C
        B, T, H, K = q.shape
        Rkv, Rab = k.shape[-2], (a.shape[-2] if a is not None else 0)
        RKP, RAP = _pow2(Rkv), _pow2(Rab)
        dev = q.device
        tok_q = torch.arange(C, device=dev)
        tok_k = torch.arange(C * RKP, device=dev) // RKP
        tok_a = torch.arange(C * RAP, device=dev) // max(RAP, 1)
        if do is None:
            do = torch.zeros(B, T, H, v.shape[-1], device=dev)

        # 1. outputs
        do_c = _to_chunks(do.float()[..., None, :], C, 1).flatten(-3, -2)  # [B, H, NC, C, V]
        d_qd = do_c @ s0.transpose(-1, -2)
        dM_qk = (do_c @ vf.transpose(-1, -2)).masked_fill_(tok_q[:, None] < tok_k[None, :], 0.0)
        d_vf = mqk.transpose(-1, -2) @ do_c
        ds0 = qd.transpose(-1, -2) @ do_c
        dM_qa = du = None
        if Rab:
            dM_qa = (do_c @ u.transpose(-1, -2)).masked_fill_(tok_q[:, None] < tok_a[None, :], 0.0).neg_()
            du = -(mqa.transpose(-1, -2) @ do_c)
        # 2. the state, chunk to chunk
        dh0, d_dch, d_kd, d_vf2, d_w, d_uv, d_ad = state_passing_backward(dch, kd, vf, w, ad, s0, u, ds0, du, dht)
        d_vf += d_vf2
        # 3. the UT transform
        d_bd = dL_ba = dL_bk = None
        if Rab:
            d_bd = tinv.transpose(-1, -2) @ d_w
            dX = tinv.transpose(-1, -2) @ d_uv
            dL_ba = (d_bd @ w.transpose(-1, -2)).add_(dX @ uv.transpose(-1, -2))
            dL_ba = dL_ba.masked_fill_(tok_a[:, None] <= tok_a[None, :], 0.0).neg_()
            dL_bk = (dX @ vf.transpose(-1, -2)).masked_fill_(tok_a[:, None] <= tok_k[None, :], 0.0)
            d_vf += lbk.transpose(-1, -2) @ dX
        # 4. the decayed products and decays
        grads = _grads_triton if g is None or g.shape[-1] == 1 else _grads_per_channel
        dq, dk, da, db, dg = grads(q, k, a, b, g, dM_qk, dM_qa, dL_ba, dL_bk, d_qd, d_kd, d_ad, d_bd, dch, d_dch,
                                   qd, kd, ad, scale, C)
        dv = _from_chunks(d_vf.unflatten(-2, (C, RKP)), T, Rkv)
        cast = lambda x, ref: None if ref is None else x.to(ref.dtype)  # noqa: E731
        return (cast(dq, q), cast(dk, k), cast(dv, v), cast(da, a), cast(db, b), cast(dg, g), cast(dh0, h0), None)


def _grads_triton(q, k, a, b, g, dM_qk, dM_qa, dL_ba, dL_bk, d_qd, d_kd, d_ad, d_bd, dch, d_dch, qd, kd, ad,
                  scale, C):
    """Step 4 with a scalar gate or none: one Triton program per (chunk, sequence x head)."""
    B, T, H, K = q.shape
    Rkv, Rab = k.shape[-2], (a.shape[-2] if a is not None else 0)
    NC = -(-T // C)
    f32 = dict(device=q.device, dtype=torch.float32)
    dq, dk = torch.empty(B, T, H, K, **f32), torch.empty(k.shape, **f32)
    da = torch.empty(a.shape, **f32) if Rab else None
    db = torch.empty(b.shape, **f32) if Rab else None
    dg = torch.empty(g.shape, **f32) if g is not None else None
    dummy = dq
    opt = lambda x: dummy if x is None else x.contiguous()  # noqa: E731
    _grad_kernel[(NC, B * H)](
        q.contiguous(), k.contiguous(), opt(a), opt(b), opt(g), dM_qk, opt(dM_qa), opt(dL_ba), opt(dL_bk), d_qd,
        d_kd, opt(d_ad), opt(d_bd), opt(dch), opt(d_dch), dq, dk, opt(da), opt(db), opt(dg), scale, T, NC,
        H=H, K=K, TC=C, RKV=Rkv, RKVP=_pow2(Rkv), RAB=Rab, RABP=_pow2(Rab),
        BK=min(64, max(16, triton.next_power_of_2(K))), GATE=0 if g is None else 1, PRECISION=_precision(q),
        num_warps=4, num_stages=1,
    )
    return dq, dk, da, db, dg


def _grads_per_channel(q, k, a, b, g, dM_qk, dM_qa, dL_ba, dL_bk, d_qd, d_kd, d_ad, d_bd, dch, d_dch, qd, kd, ad,
                       scale, C):
    """Step 4 with a per-channel gate, in PyTorch (autograd through the blocked products)."""
    B, T, H, K = q.shape
    Rkv, Rab = k.shape[-2], (a.shape[-2] if a is not None else 0)
    RKP, RAP = _pow2(Rkv), _pow2(Rab)
    qc = _to_chunks(q[..., None, :], C, 1)  # [B, H, NC, C, 1, K]
    kc = _to_chunks(k, C, RKP)
    gc = _to_chunks(g[..., None, :], C, 1, torch.float64)[..., 0, :]  # [B, H, NC, C, K]
    G = gc.cumsum(-2)
    Gex, GC = G - gc, G[..., -1:, :]

    def unflat(x, R):  # [.., C*R, D] -> [.., C, R, D]
        return x.unflatten(-2, (C, R))

    def ex(x):  # exp of an fp64 exponent [.., C, K], broadcast over ranks
        return x.float().exp()[..., None, :]

    dq, dk, dgx, dgy = _product_grads(scale * dM_qk.unflatten(-1, (C, RKP)).unsqueeze(-3), qc, kc, G, G, False)
    k_end, d_kd = unflat(kd, RKP), unflat(d_kd, RKP)
    dk += d_kd * ex(GC - G)
    dq += unflat(d_qd, 1) * ex(G) * scale
    dG = dgx + dgy + (unflat(qd, 1) * unflat(d_qd, 1)).sum(-2) - (k_end * d_kd).sum(-2)
    dGex = torch.zeros_like(dG)
    dGC = (k_end * d_kd).sum((-3, -2))[..., None, :] + (dch * d_dch)[..., None, :]
    da = db = None
    if Rab:
        ac, bc = _to_chunks(a, C, RAP), _to_chunks(b, C, RAP)
        dq2, da, dgx, dgy = _product_grads(scale * dM_qa.unflatten(-1, (C, RAP)).unsqueeze(-3), qc, ac, G, G, False)
        dq += dq2
        db, da2, dgbx, dgay = _product_grads(dL_ba.unflatten(-1, (C, RAP)).unflatten(-3, (C, RAP)), bc, ac, Gex, G,
                                             True)
        db2, dk2, dgbx2, dgky = _product_grads(dL_bk.unflatten(-1, (C, RKP)).unflatten(-3, (C, RAP)), bc, kc, Gex, G,
                                               True)
        a_end, d_ad, d_bd = unflat(ad, RAP), unflat(d_ad, RAP), unflat(d_bd, RAP)
        da += da2 + d_ad * ex(GC - G)
        db += db2 + d_bd * ex(Gex)
        dk += dk2
        dG += dgx + dgy + dgay + dgky - (a_end * d_ad).sum(-2)
        dGex += dgbx + dgbx2 + (bc * ex(Gex) * d_bd).sum(-2)
        dGC += (a_end * d_ad).sum((-3, -2))[..., None, :]
    # G_t = sum_{s <= t} g_s, G_{t-1} = sum_{s < t} g_s, G_C = sum_s g_s
    dg = dG.flip(-2).cumsum(-2).flip(-2) + (dGex.flip(-2).cumsum(-2).flip(-2) - dGex) + dGC
    dg = _from_chunks(dg[..., None, :], T, 1)[..., 0, :]
    da = None if da is None else _from_chunks(da, T, Rab)
    db = None if db is None else _from_chunks(db, T, Rab)
    return _from_chunks(dq, T, 1)[..., 0, :], _from_chunks(dk, T, Rkv), da, db, dg


def chunk_dplr(q, k, v, a, b, g, scale: float, initial_state):
    """The fused forward (``chunk_dplr_fwd``) with autograd; same arguments and results."""
    return _ChunkDPLR.apply(q, k, v, a, b, g, initial_state, scale)
