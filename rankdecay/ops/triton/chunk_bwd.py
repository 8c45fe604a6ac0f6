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

Steps 1-3 are batched fp32 matmuls over all chunks at once; step 4 is one einsum pair
per product with a scalar (or no) gate, and autograd through the blocked products of
``rankdecay.ops.chunk`` with a per-channel gate.
"""
from __future__ import annotations

import torch

from ..chunk import decayed_products
from .chunk_fwd import _pow2, chunk_dplr_fwd
from .chunk_state import state_passing_backward

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
    """Gradients of P = decayed_products(x, y, gx, gy) (``rankdecay.ops.chunk``) given dP.

    dP [..., C, R1, C, R2]; x [..., C, R1, K]; y [..., C, R2, K]; gx, gy [..., C, Kg]
    (fp64) or None. Returns (dx, dy, dgx, dgy), the last two None without a gate.
    """
    C, R1, K = x.shape[-3:]
    R2 = y.shape[-2]
    if gx is not None and gx.shape[-1] > 1:  # per channel: through the blocked products
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_() for t in (x, y, gx, gy)]
            P = decayed_products(*leaves, strict=strict)
            return torch.autograd.grad(P, leaves, dP)
    tok = torch.arange(C, device=x.device)
    mask = tok[:, None] > tok[None, :] if strict else tok[:, None] >= tok[None, :]
    if gx is None:
        D = mask.to(x.dtype)
    else:
        D = (gx[..., :, None, 0] - gy[..., None, :, 0]).to(x.dtype).masked_fill(~mask, float("-inf")).exp()
    dPD = (dP * D[..., :, None, :, None]).flatten(-4, -3).flatten(-2, -1)  # [..., C*R1, C*R2]
    dx = (dPD @ y.flatten(-3, -2)).unflatten(-2, (C, R1))
    dy = (dPD.transpose(-1, -2) @ x.flatten(-3, -2)).unflatten(-2, (C, R2))
    if gx is None:
        return dx, dy, None, None
    return dx, dy, (x * dx).sum((-2, -1))[..., None], -(y * dy).sum((-2, -1))[..., None]


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

        # 1. outputs
        do_c = _to_chunks(do.float()[..., None, :], C, 1).flatten(-3, -2)  # [B, H, NC, C, V]
        d_qd = do_c @ s0.transpose(-1, -2)
        dM_qk = (do_c @ vf.transpose(-1, -2)).masked_fill(tok_q[:, None] < tok_k[None, :], 0.0)
        d_vf = mqk.transpose(-1, -2) @ do_c
        ds0 = qd.transpose(-1, -2) @ do_c
        du = None
        if Rab:
            dM_qa = -(do_c @ u.transpose(-1, -2)).masked_fill(tok_q[:, None] < tok_a[None, :], 0.0)
            du = -(mqa.transpose(-1, -2) @ do_c)
        # 2. the state, chunk to chunk
        dh0, d_dch, d_kd, d_vf2, d_w, d_uv, d_ad = state_passing_backward(dch, kd, vf, w, ad, s0, u, ds0, du, dht)
        d_vf += d_vf2
        # 3. the UT transform
        if Rab:
            d_bd = tinv.transpose(-1, -2) @ d_w
            dX = tinv.transpose(-1, -2) @ d_uv
            dL_ba = -(d_bd @ w.transpose(-1, -2) + dX @ uv.transpose(-1, -2))
            dL_ba = dL_ba.masked_fill(tok_a[:, None] <= tok_a[None, :], 0.0)
            dL_bk = (dX @ vf.transpose(-1, -2)).masked_fill(tok_a[:, None] <= tok_k[None, :], 0.0)
            d_vf += lbk.transpose(-1, -2) @ dX

        # 4. the decayed products and decays
        qc = _to_chunks(q[..., None, :], C, 1)  # [B, H, NC, C, 1, K]
        kc = _to_chunks(k, C, RKP)
        G = Gex = GC = None
        if g is not None:
            gc = _to_chunks(g[..., None, :], C, 1, torch.float64)[..., 0, :]  # [B, H, NC, C, Kg]
            G = gc.cumsum(-2)
            Gex, GC = G - gc, G[..., -1:, :]

        def unflat(x, R):  # [.., C*R, D] -> [.., C, R, D]
            return x.unflatten(-2, (C, R))

        def per_token(x):  # d(log-cumsum) of rows [.., C, R, K] -> [.., C, Kg]
            x = x.sum(-2)
            return x.sum(-1, keepdim=True) if g is not None and g.shape[-1] == 1 else x

        def ex(x):  # exp of an fp64 exponent [.., C, Kg], broadcast over ranks
            return x.float().exp()[..., None, :]

        dq, dk, dgx, dgy = _product_grads(scale * dM_qk.unflatten(-1, (C, RKP)).unsqueeze(-3), qc, kc, G, G,
                                          False)
        dk += (d_kd.unflatten(-2, (C, RKP)) * ex(GC - G)) if g is not None else unflat(d_kd, RKP)
        dG = None
        if g is not None:
            q_dec = unflat(qd, 1)
            dq += unflat(d_qd, 1) * ex(G) * scale
            dG = dgx + dgy + per_token(q_dec * unflat(d_qd, 1)) - per_token(unflat(kd, RKP) * unflat(d_kd, RKP))
            dGex = torch.zeros_like(dG)
            dGC = per_token(unflat(kd, RKP) * unflat(d_kd, RKP)).sum(-2, keepdim=True) + dch[..., None, :] * d_dch[
                ..., None, :]
        else:
            dq += unflat(d_qd, 1) * scale
        da = db = None
        if Rab:
            ac, bc = _to_chunks(a, C, RAP), _to_chunks(b, C, RAP)
            dq2, da, dgx, dgy = _product_grads(scale * dM_qa.unflatten(-1, (C, RAP)).unsqueeze(-3), qc, ac, G, G,
                                               False)
            dq += dq2
            db, da2, dgbx, dgay = _product_grads(dL_ba.unflatten(-1, (C, RAP)).unflatten(-3, (C, RAP)), bc, ac, Gex, G,
                                                 True)
            da += da2
            db2, dk2, dgbx2, dgky = _product_grads(dL_bk.unflatten(-1, (C, RKP)).unflatten(-3, (C, RAP)), bc, kc, Gex,
                                                   G, True)
            db += db2
            dk += dk2
            d_bd = unflat(d_bd, RAP)
            if g is not None:
                d_ad = unflat(d_ad, RAP)
                a_end = unflat(ad, RAP)
                da += d_ad * ex(GC - G)
                db += d_bd * ex(Gex)
                dG += dgx + dgy + dgay + dgky - per_token(a_end * d_ad)
                dGex += dgbx + dgbx2 + per_token(bc * ex(Gex) * d_bd)
                dGC += per_token(a_end * d_ad).sum(-2, keepdim=True)
            else:
                da += unflat(d_ad, RAP)
                db += d_bd
        dg = None
        if g is not None:
            # G_t = sum_{s <= t} g_s, G_{t-1} = sum_{s < t} g_s, G_C = sum_s g_s
            dg = dG.flip(-2).cumsum(-2).flip(-2) + (dGex.flip(-2).cumsum(-2).flip(-2) - dGex) + dGC
            dg = _from_chunks(dg[..., None, :], T, 1)[..., 0, :].to(g.dtype)
        dv = _from_chunks(unflat(d_vf, RKP), T, Rkv).to(v.dtype)
        grads = [_from_chunks(dq, T, 1)[..., 0, :].to(q.dtype), _from_chunks(dk, T, Rkv).to(k.dtype), dv]
        grads += [None if a is None else _from_chunks(da, T, Rab).to(a.dtype),
                  None if b is None else _from_chunks(db, T, Rab).to(b.dtype)]
        return (*grads, dg, None if h0 is None else dh0.to(h0.dtype), None)


def chunk_dplr(q, k, v, a, b, g, scale: float, initial_state):
    """The fused forward (``chunk_dplr_fwd``) with autograd; same arguments and results."""
    return _ChunkDPLR.apply(q, k, v, a, b, g, initial_state, scale)
