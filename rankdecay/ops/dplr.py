"""The general operator: diagonal-plus-rank-R decay, rank-Rkv writes (HDLA eq. 8)."""
from __future__ import annotations

import torch

from .backends import check_triton_mode, needs_grad, resolve_mode
from ._inputs import (canonicalize, check_inplace_state, host_lengths, pack_varlen, row_packing, unpack_varlen,
                      varlen_index)
from .chunk import chunk_dplr_core
from .naive import naive_dplr_core


def dplr(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor | None = None,
    b: torch.Tensor | None = None,
    g: torch.Tensor | None = None,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    chunk_size: int = 64,
    mode: str = "auto",
    a_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    inplace_final_state: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    r"""Linear attention with a diagonal-plus-rank-``Rab`` decay and rank-``Rkv`` writes.

    .. math::
        S_t = (\mathrm{Diag}(e^{g_t}) - \sum_r a_{t,r} b_{t,r}^\top) S_{t-1} + \sum_j k_{t,j} v_{t,j}^\top,
        \qquad o_t = \mathrm{scale} \cdot S_t^\top q_t

    Args:
        q: queries ``[B, T, H, K]``.
        k: keys ``[B, T, H, K]``, or ``[B, T, H, Rkv, K]`` for rank-``Rkv`` writes.
        v: values ``[B, T, H, V]``, or ``[B, T, H, Rkv, V]`` (same form as ``k``).
        a, b: the low-rank part of the decay, ``[B, T, H, Rab, K]`` each, or both None (``Rab = 0``).
        g: log-decay: None (no decay), ``[B, T, H]`` (one per head) or ``[B, T, H, K]``
            (one per key channel). Expected ``<= 0`` (decays in (0, 1]) and finite;
            ``-30`` per step or ``-1e4`` at one step are handled exactly.
        scale: query scale, default ``K ** -0.5``.
        initial_state: ``[N, H, K, V]`` with ``N = B``, or the number of sequences with ``cu_seqlens``.
        output_final_state: return the state after the last token.
        cu_seqlens: ``[N + 1]`` int offsets of variable-length sequences packed along T
            (requires ``B == 1``); the state restarts at each boundary.
        chunk_size: tokens per chunk of the chunked algorithm.
        mode: ``"naive"`` (per-token loop in PyTorch), ``"chunk"`` (chunkwise WY/UT
            algorithm in PyTorch), ``"triton"`` (the chunked algorithm in Triton: for ranks
            up to 4 a fused forward — intra-chunk products, UT transform, state passing and
            outputs — at the kernels' own chunk size, ``64 / max(padded ranks)`` tokens, whose
            backward is written out in five Triton kernels (the state kernel in reverse, then
            per-chunk kernels for every input's gradient); higher ranks, and per-channel gates with a
            low-rank decay on CUDA, run PyTorch intra-chunk parts around the Triton state kernel),
            ``"fused_recurrent"`` (the per-token loop as one Triton kernel: decoding,
            no autograd) or ``"auto"``: ``"triton"`` for CUDA tensors when triton is
            installed and the compute dtype is fp32, else ``"chunk"``. The Triton kernels'
            products follow ``torch.set_float32_matmul_precision``: fp32-accurate at
            ``"highest"`` (the default), one TF32 pass at ``"high"``, bf16 operands (fla's
            precision) at ``"medium"``; the state and accumulation stay fp32.
        a_scale: optional per-row factors of ``a``, ``[B, T, H, Rab]`` (or ``[B, T, H]`` for
            every rank): the decay uses ``a_scale[..., None] * a``. Same for ``v_scale``
            (``[B, T, H, Rkv]`` or ``[B, T, H]``) and the writes' values. Mechanisms use them
            for β and α (Gated DeltaNet: ``a = k``, ``a_scale = αβ``, ``v_scale = β``), so that a
            16-bit ``k`` stays 16-bit: the fused Triton kernels take its products exactly on
            tensor cores and apply the fp32 factors to the results, without an fp32 copy of
            ``αβk`` in memory. Other paths multiply them in, in the compute dtype.

        inplace_final_state: write the final state into ``initial_state`` (contiguous; fp32, or a
            16-bit cache's bf16 / fp16, updated in fp32 and rounded once) and return that tensor as
            the final state, as serving engines' decode steps do. The ``"fused_recurrent"`` kernel
            writes it there directly; the other paths copy their result in. No autograd through it.

    Returns:
        ``(o, final_state)``: ``o`` is ``[B, T, H, V]`` in ``q``'s dtype; ``final_state`` is
        ``[N, H, K, V]`` in fp32 (fp64 if any input is fp64), or None unless
        ``output_final_state``. Accumulation is fp32 (fp64) whatever the input dtype.
        Differentiable in every tensor argument, ``initial_state`` included.
    """
    return _dplr(q, k, v, a, b, g, scale, initial_state, output_final_state, cu_seqlens, chunk_size, mode, a_scale,
                 v_scale, inplace_final_state)


def _dplr(q, k, v, a, b, g, scale, initial_state, output_final_state, cu_seqlens, chunk_size, mode, a_scale, v_scale,
          inplace_final_state, grouped: bool = False, hh_mask=None, kda_b: bool = False):
    """``dplr`` itself. ``grouped``: a's rows are k split into groups of channels (Head-in-Head's
    ``a_r = k ⊙ 1[group r]``, whose sum is k), which the fused forward without autograd uses
    (``triton.chunk_fwd.grouped_update``); the caller vouches for it. ``hh_mask``: more so, a and b are
    Head-in-Head's rows of k and this mask (``triton.factors.hh_factors``' a and b, with a scalar gate or none), and
    the fused kernels form them from k and the mask themselves, so that a and b may be placeholders
    (``triton.factors.hh_placeholders``): with autograd both, without it a alone (the grouped forward's state kernel
    reads b: ``triton.factors.hh_update_rows``); their backward carries the rows' gradients on to k and the mask
    (``triton.chunk_bwd.chunk_dplr``'s). The caller vouches for this too, and that the fused kernels run.
    ``kda_b``: b is e^g ⊙ k (``kda``'s; ``triton.chunk_fwd.chunk_dplr_fwd``'s), and its contents are never read: it
    may be a placeholder, which the fused kernels form where they need it, with autograd or without
    (``triton.chunk_bwd.chunk_dplr``'s); the caller vouches that the fused kernels then run."""
    x = canonicalize(q, k, v, a, b, g, scale, initial_state, cu_seqlens, chunk_size, mode, a_scale, v_scale)
    if inplace_final_state:
        check_inplace_state(initial_state)
    dtype = x.compute_dtype
    mode = resolve_mode(mode, q, dtype)
    if mode in ("triton", "fused_recurrent"):
        check_triton_mode(mode, q, (q, k, v, a, b, g, initial_state, a_scale, v_scale), dtype)
    q, k, v, a, b, g, sa, sv = x.q, x.k, x.v, x.a, x.b, x.g, x.a_scale, x.v_scale
    tied = a is k and b is k  # the delta rule's a = b = k (one tensor): see chunk_fwd.ties_keys
    grad = needs_grad((q, k, v, a, b, g, x.initial_state, sa, sv, hh_mask))  # (packing below keeps it)
    # Head-in-Head without autograd: b is real (the grouped forward reads it), a a placeholder
    hh_rows_b = hh_mask is not None and not grad
    a_is_k = a is k
    fused = mode == "triton" and _fused_applies(q, k, a, g)
    # the chunked paths take the sequences along one row, each from one of their chunks (the fused kernels' 64-token
    # ``offsets``, ``chunk_dplr_fwd``'s; ``chunk_dplr_core``'s at its chunk size), the layout computed on the device
    offsets = None
    # one sequence is the plain [1, T] (no gathers; segments); the decode kernel walks each sequence where it lies
    packed = x.cu_seqlens is not None and x.cu_seqlens.shape[0] > 2 and mode != "fused_recurrent"
    if packed:
        T = q.shape[1]
        if mode in ("chunk", "triton"):  # (the lengths are not on the host while compiling: ``canonicalize``)
            from .triton.chunk_fwd import VARLEN_ALIGN

            packing = row_packing(x.cu_seqlens, x.lengths, T, VARLEN_ALIGN if fused else chunk_size, q.device)
            offsets = packing.offsets
        else:  # [N, max(lengths)]: the naive path, whose lengths are on the host (compiled: a graph break)
            lengths = host_lengths(x.cu_seqlens, T) if x.lengths is None else x.lengths
            packing = varlen_index(x.cu_seqlens, lengths, q.device)
        q, k, v, g, sa, sv = (pack_varlen(t, packing) for t in (q, k, v, g, sa, sv))
        if hh_mask is not None:  # Head-in-Head's rows are not read (b is without autograd): placeholders
            a = a.new_zeros(()).expand(*q.shape[:3], *a.shape[3:])
            b = pack_varlen(b, packing) if hh_rows_b else b.new_zeros(()).expand(*q.shape[:3], *b.shape[3:])
        elif kda_b:  # KDA's b is never read as given (a placeholder): not packed; a stays k, so the pairing holds
            a, b = k if a_is_k else pack_varlen(a, packing), b.new_zeros(()).expand(*q.shape[:3], *b.shape[3:])
        else:
            a, b = (k, k) if tied else (pack_varlen(a, packing), pack_varlen(b, packing))
        if hh_mask is not None and hh_mask.dim() == 5:  # a mask per token
            hh_mask = pack_varlen(hh_mask, packing)
    if hh_mask is not None and not fused:
        raise RuntimeError("hh_mask: Head-in-Head's rows are formed in the fused kernels, which these inputs miss")
    if kda_b and not fused:  # b a placeholder that only the fused kernels form
        raise RuntimeError("kda_b: KDA's b is formed in the fused kernels, which these inputs miss")
    if not fused:  # the other paths take the factors multiplied in
        if sa is not None:
            a = a.to(dtype) * sa.to(dtype)[..., None]
        if sv is not None:
            v = v.to(dtype) * sv.to(dtype)[..., None]

    if mode == "naive":
        o, state = naive_dplr_core(q, k, v, a, b, g, x.scale, x.initial_state, dtype)
    elif mode == "fused_recurrent":
        from .triton import fused_recurrent_dplr

        cu = x.cu_seqlens.to(q.device) if x.cu_seqlens is not None and x.cu_seqlens.shape[0] > 2 else None
        o, state = fused_recurrent_dplr(q, k, v, a, b, g, x.scale, x.initial_state, inplace_final_state, cu)
    elif fused:
        from .triton import chunk_dplr, chunk_dplr_fwd, padded_dplr

        if grad:
            o, state = chunk_dplr(q, k, v, a, b, g, x.scale, x.initial_state, a_scale=sa, v_scale=sv,
                                  hh_mask=hh_mask, kda_b=kda_b, offsets=offsets)
        else:  # heads below the GPU kernels' widths padded there (``padded_dplr``; a's groups kept where grouped)
            def run(q, k, v, a, b, g, h0):
                return chunk_dplr_fwd(q, k, v, a, b, g, x.scale, h0, a_scale=sa, v_scale=sv, grouped=grouped,
                                      hh_mask=hh_mask, kda_b=kda_b, offsets=offsets)

            o, state = padded_dplr(run, q, k, v, a, b, g, x.initial_state,
                                   a.shape[-2] if grouped and a is not None else 1)
    else:
        o, state = chunk_dplr_core(q, k, v, a, b, g, x.scale, x.initial_state, dtype, chunk_size,
                                   use_triton=mode == "triton", offsets=offsets)

    if packed:
        o = unpack_varlen(o, packing)
    if inplace_final_state and state is not initial_state:
        state = initial_state.copy_(state)
    return o.to(x.q.dtype), (state if output_final_state else None)


def _fused_applies(q, k, a, g) -> bool:
    """The fused Triton kernels run for ranks up to 4 (``chunk_fwd.fused_chunk_size``); larger
    ranks take the unfused path (``chunk_dplr_core`` with Triton pieces).

    Per-channel gates with a low-rank decay (HDLA, RWKV-7 style) are fused at every precision
    since their products moved into ``triton.channel`` (BENCHMARKS.md session 19); before, the
    intra kernel that held them did not compile in 150 s at fp32 accuracy on the H100.
    """
    from .triton.chunk_fwd import fused_chunk_size

    return fused_chunk_size(0 if a is None else a.shape[-2], k.shape[-2]) is not None
