"""Cross-entropy through a linear map without the logits: a language model's loss in slices of the vocabulary.

A language model's last product maps N hidden rows [N, D] to logits [N, V]. With V = 32,000 and N = B·T = 16,384
the logits take 1 GiB in bf16 and 2 GiB once cast to fp32 for the softmax, and the backward holds a gradient of the
same size. :func:`linear_cross_entropy` never holds more than one slice of them, Vc vocabulary entries for every
token: the forward keeps each token's log-sum-exp ([N], fp32, merged slice by slice) and nothing of size N x V, and
the backward forms each slice's logits again, their softmax from the kept log-sum-exp, and from it the rows of the
weight's (and bias') gradient that the slice owns, whole, and its share of x's gradient, summed over the slices in
fp32. That is one product of the head more than the plain path (4 instead of 3). fla's and Liger-Kernel's fused
linear cross-entropy form the gradients in the forward instead, which ties them to a scalar loss; recomputing keeps
``reduction="none"`` (per-token losses, masked or weighted afterwards) exact as well.

Why slices of the vocabulary and not chunks of tokens: a chunk of tokens adds its share to every entry of the
weight's [V, D] gradient, so each chunk reads and writes all of it; a slice of the vocabulary owns its rows of that
gradient and adds to x's [N, D] gradient instead, the smaller of the two while a batch has fewer tokens than the
vocabulary has entries (the usual case: 8k-16k tokens, a 32k-150k vocabulary). A slice's logits hold up to 2^26
entries by default on a GPU (``default_vocab_chunk_size``): 4 slices at 8,192 tokens and a 32,000 vocabulary, 0.5
GiB at the loss' peak against the logits path's 3 GiB, and faster than it on an H200 (BENCHMARKS.md); 2^23 where
the softmax is PyTorch's (the CPU).

On a CUDA device the softmax's statistics and gradient over each slice are two Triton kernels that read its logits
once (``rankdecay.ops.triton.cross_entropy``); elsewhere they are PyTorch. Under ``torch.compile`` (``fullgraph=True``
too) the forward and the backward are each one opaque operator (``torch.ops.rankdecay.linear_cross_entropy_forward``
and ``..._backward``, ``torch.library`` custom ops), so a compiled model runs the same slices, kernels and products as
eager mode: traced through instead, inductor's fusion of the slices took 7.7 ms and 1,220 MiB at 8,192 tokens on an
H200 against eager mode's 4.9 ms and 521 MiB (BENCHMARKS.md, session 70).

Precision: each slice's product runs in the dtype ``F.linear`` would run it in (autocast's, bf16 under bf16
autocast; else the inputs'), the softmax and the loss in fp32 from the logits so rounded (as
``F.cross_entropy(logits.float())``), and x's gradient is summed over the slices in fp32. On CUDA, bf16 and fp16
products write fp32 themselves (``torch.mm``'s ``out_dtype``), so there x's gradient is summed inside its products
and the weight's is not rounded to bf16 on the way (the plain path under autocast rounds it).

``label_smoothing`` is ``F.cross_entropy``'s: its term needs only each row's sum of logits (x · Σ_j w_j) and adds to
the gradients in closed form, O(N·D + V·D), outside the slices and their kernels (with ``logit_softcapping`` the
capped logits' sums and gradients are not linear in x: then the slices take the term, kernels included).

``RankDecayConfig(fuse_linear_cross_entropy=True)`` makes ``RankDecayForCausalLM`` take it in training (its output's
logits are then None), and so ``rankdecay train --set fuse_linear_cross_entropy=true``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from ..ops.backends import _HAS_TRITON, active_autocast_dtype

REDUCTIONS = ("mean", "sum", "none")


SLICE_LOGITS = 1 << 26  # logits per slice by default with the Triton kernels: 128 MiB in bf16
SLICE_LOGITS_PYTORCH = 1 << 23  # without them (the PyTorch softmax holds a few fp32 copies of the slice)


def default_vocab_chunk_size(n: int, v: int, max_logits: int = SLICE_LOGITS) -> int:
    """Vocabulary entries per slice for n tokens: as many as keep a slice's logits (n x width) within max_logits,
    at least 256, evened out over the vocabulary (the same number of slices, each a multiple of 8 wide), at most
    v. Few wide slices are faster (each slice costs its launches and adds to x's gradient once); on an H200 at
    8,192 tokens and a 32,000 vocabulary, slices of 1,000 took 8.9 ms, of 4,000 4.9 ms and of 8,000 (this rule)
    4.5 ms, against 5.6 ms for the logits path (BENCHMARKS.md). ``linear_cross_entropy`` passes
    ``SLICE_LOGITS_PYTORCH`` (2^23) where the slices' softmax is PyTorch's (the CPU)."""
    width = max(256, max_logits // max(n, 1))
    slices = -(-v // width)
    each = -(-v // slices)
    return max(1, min(v, -(-each // 8) * 8))


def _product_dtype(x: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype ``F.linear(x, weight)`` computes in here: autocast's where it is on, else the inputs'."""
    return active_autocast_dtype(x) or torch.promote_types(x.dtype, weight.dtype)


def _wide(dtype: torch.dtype) -> torch.dtype:
    """The softmax's and the loss' dtype: fp32, or the products' where wider (fp64)."""
    return torch.promote_types(dtype, torch.float32)


def _triton_kernels(x: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether the slices' elementwise work runs in ``rankdecay.ops.triton.cross_entropy``: on CUDA, for fp16, bf16
    and fp32 products (the tests switch it on under the CPU interpreter). (Under ``torch.compile`` too: the slices
    run inside the opaque operators.)"""
    return _HAS_TRITON and x.is_cuda and dtype in (torch.float16, torch.bfloat16, torch.float32)


def _slice_logits(xd: torch.Tensor, wj: torch.Tensor, bias: torch.Tensor | None, v0: int, v1: int) -> torch.Tensor:
    """Entries v0 .. v1 - 1 of every row's logits, [N, v1 - v0] in the products' dtype (xd's); wj is the weight's
    rows v0 .. v1 - 1 in that dtype (the backward's product for x's gradient reads them too)."""
    return F.linear(xd, wj, None if bias is None else bias[v0:v1].to(xd.dtype))


def _torch_slice_logsumexp(logits, lse, picked, target, valid, v0, softcap=0.0, sums=None):
    """The PyTorch form of ``slice_logsumexp_``, out of place: the merged (lse, picked, sums)."""
    lf = logits.to(lse.dtype)
    if softcap:
        lf = softcap * torch.tanh(lf / softcap)
    idx = target - v0
    inside = valid & (idx >= 0) & (idx < lf.shape[1])
    chosen = lf.gather(1, torch.where(inside, idx, 0)[:, None])[:, 0]
    sums = None if sums is None else sums + lf.sum(-1)
    return torch.logaddexp(lse, torch.logsumexp(lf, -1)), torch.where(inside, chosen, picked), sums


def _torch_slice_softmax_grad(logits, lse, target, valid, grad, v0, softcap=0.0, smoothing=0.0, vocab=1):
    """The PyTorch form of ``slice_softmax_grad_``: (softmax - onehot) * grad over the slice, in logits' dtype (with
    a soft cap, label smoothing's share and the cap's derivative too)."""
    lf = logits.to(lse.dtype)
    th = torch.tanh(lf / softcap) if softcap else None
    p = torch.exp((softcap * th if softcap else lf) - lse[:, None])
    idx = target - v0
    inside = valid & (idx >= 0) & (idx < p.shape[1])
    hit = (1.0 - smoothing) if softcap else 1.0
    p = p.scatter_add(1, torch.where(inside, idx, 0)[:, None], -hit * inside[:, None].to(p.dtype))
    if softcap:
        p = (p - smoothing / vocab) * (1.0 - th * th)
    return (p * torch.where(valid, grad.to(p.dtype), 0.0)[:, None]).to(logits.dtype)


def _wide_products(a: torch.Tensor) -> bool:
    """Whether a product of fp16/bf16 operands can write fp32 itself (``torch.mm``'s ``out_dtype``, on CUDA where this
    PyTorch has it: tried once; under ``torch.compile`` too, inside the opaque operators): then x's gradient is summed over the slices inside the products,
    and the weight's comes out of its product in fp32, not rounded to the operands' dtype first."""
    if not a.is_cuda or a.dtype not in (torch.float16, torch.bfloat16):
        return False
    if a.dtype not in _OUT_DTYPE:
        try:
            one = torch.ones(1, 1, dtype=a.dtype, device=a.device)
            _OUT_DTYPE[a.dtype] = torch.mm(one, one, out_dtype=torch.float32).dtype == torch.float32
        except (TypeError, RuntimeError):
            _OUT_DTYPE[a.dtype] = False
    return _OUT_DTYPE[a.dtype]


_OUT_DTYPE: dict[torch.dtype, bool] = {}  # per operand dtype: whether torch.mm's out_dtype=fp32 works on CUDA


def _logit_sums(xd, weight, bias, wide):
    """Σ_j z_ij for every row i, [N] in ``wide``: x_i · Σ_j w_j (+ Σ_j b_j), no logits formed."""
    sums = xd.to(wide) @ weight.to(xd.dtype).sum(0, dtype=wide)
    return sums if bias is None else sums + bias.to(xd.dtype).sum(dtype=wide)


def _smoothing_grads(gs, target, valid, xd, weight, dx, dw, db):
    """Adds label smoothing's term to the gradients in place: d loss_i / d z_ij gains gs_i (onehot(t_i)_j - 1 / V)
    (gs_i = ε times the token's incoming gradient, 0 where ignored), so dx_i gains gs_i (w_{t_i} - mean_j w_j), the
    weight's row j gains Σ_{i: t_i = j} gs_i x_i - Σ_i gs_i x_i / V, and the bias likewise. O(N·D + V·D): once, not
    per slice."""
    V, t = weight.shape[0], torch.where(valid, target, 0)
    w = weight.to(xd.dtype)
    if dx is not None:
        dx += gs[:, None] * (w[t].to(dx.dtype) - w.sum(0, dtype=dx.dtype) / V)
    if dw is not None:
        xs = gs[:, None] * xd.to(gs.dtype)
        dw.index_add_(0, t, xs.to(dw.dtype))
        dw -= (xs.sum(0) / V).to(dw.dtype)
    if db is not None:
        db.index_add_(0, t, gs.to(db.dtype))
        db -= (gs.sum() / V).to(db.dtype)


# The two operators' schemas are written out: inferring them from annotations under ``from __future__ import
# annotations`` needs a newer PyTorch than this package's oldest
@torch.library.custom_op("rankdecay::linear_cross_entropy_forward", mutates_args=(), schema=(
    "(Tensor x, Tensor target, Tensor weight, Tensor? bias, int ignore_index, int width, ScalarType dtype, "
    "float smoothing, float softcap) -> (Tensor, Tensor)"))
def _forward(x, target, weight, bias, ignore_index, width, dtype, smoothing, softcap):
    """x [N, D], target [N] -> (per-token losses [N] fp32, 0 where ignored; the log-sum-exp [N], for the backward).
    softcap c > 0: the logits are c tanh(z / c) (then label smoothing's sums of logits are taken slice by slice)."""
    kernels = _triton_kernels(x, dtype)
    if kernels:
        from ..ops.triton.cross_entropy import slice_logsumexp_
    xd, V = x.to(dtype), weight.shape[0]
    valid = target != ignore_index
    lse = torch.full(target.shape, float("-inf"), dtype=_wide(dtype), device=x.device)
    picked = torch.zeros_like(lse)
    sums = torch.zeros_like(lse) if smoothing and softcap else None  # a capped row's sum of logits, slice by slice
    for v0 in range(0, V, width):
        v1 = min(V, v0 + width)
        logits = _slice_logits(xd, weight[v0:v1].to(dtype), bias, v0, v1)
        if kernels:
            slice_logsumexp_(logits, lse, picked, target, v0, softcap, sums)
        else:
            lse, picked, sums = _torch_slice_logsumexp(logits, lse, picked, target, valid, v0, softcap, sums)
    loss = lse - picked
    if smoothing:  # (1 - ε) of the target's term and ε of the mean logit's: ε (lse - Σ_j z_j / V) more
        sums = sums if softcap else _logit_sums(xd, weight, bias, lse.dtype)
        loss = loss + smoothing * (picked - sums / V)
    return torch.where(valid, loss, 0.0), lse


@_forward.register_fake
def _(x, target, weight, bias, ignore_index, width, dtype, smoothing, softcap):
    return x.new_empty(target.shape, dtype=_wide(dtype)), x.new_empty(target.shape, dtype=_wide(dtype))


@torch.library.custom_op("rankdecay::linear_cross_entropy_backward", mutates_args=(), schema=(
    "(Tensor grad, Tensor x, Tensor target, Tensor weight, Tensor? bias, Tensor lse, int ignore_index, int width, "
    "ScalarType dtype, float smoothing, float softcap, bool need_x, bool need_w, bool need_b) -> "
    "(Tensor, Tensor, Tensor)"))
def _backward(grad, x, target, weight, bias, lse, ignore_index, width, dtype, smoothing, softcap, need_x, need_w,
              need_b):
    """The gradients of x, weight and bias (each empty where not needed) from the losses' gradient grad [N]."""
    kernels = _triton_kernels(x, dtype)
    if kernels:
        from ..ops.triton.cross_entropy import slice_softmax_grad_
    V = weight.shape[0]
    xd = x.to(dtype)
    valid = target != ignore_index
    grad = grad.to(lse.dtype).contiguous()
    dx = torch.zeros(x.shape, dtype=_wide(dtype), device=x.device) if need_x else None
    dw = torch.empty_like(weight) if need_w else None
    db = torch.empty_like(bias) if need_b else None
    for v0 in range(0, V, width):
        v1 = min(V, v0 + width)
        wj = weight[v0:v1].to(dtype)
        logits = _slice_logits(xd, wj, bias, v0, v1)
        if kernels:  # d loss_i / d logits_i = softmax_i - onehot(t_i), times the token's incoming gradient
            p = slice_softmax_grad_(logits, lse, target, grad, v0, ignore_index, softcap, smoothing, V)
        else:
            p = _torch_slice_softmax_grad(logits, lse, target, valid, grad, v0, softcap, smoothing, V)
        wide = _wide_products(p)
        if need_b:
            db[v0:v1] = p.sum(0, dtype=lse.dtype).to(db.dtype)
        if need_w:
            dw[v0:v1] = torch.mm(p.t(), xd, out_dtype=torch.float32) if wide else (p.t() @ xd).to(dw.dtype)
        if need_x:
            dx = torch.addmm(dx, p, wj, out_dtype=dx.dtype) if wide else dx.add_(p @ wj)
    if smoothing and not softcap:  # the smoothing's share of d loss / d logits, ε (onehot - 1 / V), in closed form
        _smoothing_grads(smoothing * torch.where(valid, grad, 0.0), target, valid, xd, weight, dx, dw, db)
    empty = x.new_empty(0)
    return (empty if dx is None else dx.to(x.dtype)), (empty if dw is None else dw), (empty if db is None else db)


@_backward.register_fake
def _(grad, x, target, weight, bias, lse, ignore_index, width, dtype, smoothing, softcap, need_x, need_w, need_b):
    return (x.new_empty(x.shape if need_x else (0,)), weight.new_empty(weight.shape if need_w else (0,)),
            bias.new_empty(bias.shape) if need_b else x.new_empty(0))


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, target, weight, bias, ignore_index: int, width: int, dtype: torch.dtype, smoothing: float,
                softcap: float):
        losses, lse = _forward(x, target, weight, bias, ignore_index, width, dtype, smoothing, softcap)
        ctx.save_for_backward(x, target, weight, bias, lse)
        ctx.ignore_index, ctx.width, ctx.dtype, ctx.smoothing, ctx.softcap = ignore_index, width, dtype, smoothing, \
            softcap
        return losses

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        x, target, weight, bias, lse = ctx.saved_tensors
        need_x, _, need_w, need_b = ctx.needs_input_grad[:4]
        dx, dw, db = _backward(grad, x, target, weight, bias, lse, ctx.ignore_index, ctx.width, ctx.dtype,
                               ctx.smoothing, ctx.softcap, need_x, need_w, need_b and bias is not None)
        return (dx if need_x else None, None, dw if need_w else None, db if need_b and bias is not None else None,
                None, None, None, None, None)


def linear_cross_entropy(x: torch.Tensor, target: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                         ignore_index: int = -100, reduction: str = "mean", label_smoothing: float = 0.0,
                         logit_scale: float = 1.0, logit_softcapping: float | None = None,
                         vocab_chunk_size: int | None = None) -> torch.Tensor:
    """``F.cross_entropy(z, target, ignore_index=..., reduction=..., label_smoothing=...)`` with ``z = logit_scale *
    F.linear(x, weight, bias).float()`` (soft-capped with ``logit_softcapping``) over the leading dimensions, without
    forming all the logits at once (the module docstring says how).

    Args:
        x: [..., D] hidden rows (any floating dtype; under autocast the products take autocast's).
        target: [...] integer class indices in [0, V), or ``ignore_index`` for rows with no loss and no gradient.
        weight: [V, D]; bias: [V] or None (an LM head's ``weight`` and ``bias``).
        reduction: ``"mean"`` over the rows not ignored (NaN where every row is, as ``F.cross_entropy``), ``"sum"``,
            or ``"none"``: [...], 0 at ignored rows.
        label_smoothing: ε in [0, 1]: the target is (1 - ε) onehot + ε / V, as ``F.cross_entropy``'s (and fla's
            ``FusedLinearCrossEntropyLoss``'s). Its term needs each row's sum of logits, x · Σ_j w_j, and adds to the
            gradients in closed form: the slices are untouched.
        logit_scale: a factor on the logits (fla's ``FusedLinearCrossEntropyLoss(logit_scale=...)``, a µP-style
            output multiplier), applied as ``x * logit_scale`` and ``bias * logit_scale`` before the products (through
            autograd: one copy of x).
        logit_softcapping: None, or c > 0: the logits are soft-capped, z -> c tanh(z / c), before the softmax
            (fla's ``logit_softcapping``, Gemma 2's final-logit cap), in the slices (and their Triton kernels);
            label smoothing's term then sums each slice's capped logits instead of its closed form.
        vocab_chunk_size: vocabulary entries per slice (each slice's logits are [N, vocab_chunk_size]); None:
            ``default_vocab_chunk_size`` (a slice's logits within 2^26 entries on a GPU, 2^23 elsewhere).
    Returns a scalar (``"mean"``, ``"sum"``) or [...] (``"none"``), fp32 (fp64 for fp64 inputs), with autograd to
    x, weight and bias."""
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dim() < 1:
        raise TypeError(f"x must be a floating-point tensor [..., D]; got {type(x).__name__} "
                        f"{getattr(x, 'dtype', '')}")
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.shape[1] != x.shape[-1]:
        raise ValueError(f"weight must be [V, D] with D = {x.shape[-1]} (x's last dimension); got "
                         f"{list(getattr(weight, 'shape', []))}")
    V = weight.shape[0]
    if bias is not None and tuple(bias.shape) != (V,):
        raise ValueError(f"bias must be [V] = [{V}] or None; got {list(bias.shape)}")
    if not isinstance(target, torch.Tensor) or target.is_floating_point() or target.is_complex() \
            or target.dtype == torch.bool or tuple(target.shape) != tuple(x.shape[:-1]):
        raise ValueError(f"target must be an integer tensor shaped like x without its last dimension, "
                         f"{list(x.shape[:-1])}; got {getattr(target, 'dtype', type(target).__name__)} "
                         f"{list(getattr(target, 'shape', []))}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}; got {reduction!r}")
    if isinstance(label_smoothing, bool) or not isinstance(label_smoothing, (int, float)) \
            or not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be a number in [0, 1]; got {label_smoothing!r}")
    if isinstance(logit_scale, bool) or not isinstance(logit_scale, (int, float)) or not logit_scale > 0 \
            or logit_scale == float("inf"):
        raise ValueError(f"logit_scale must be a finite number > 0; got {logit_scale!r}")
    if logit_softcapping is not None and (isinstance(logit_softcapping, bool)
                                          or not isinstance(logit_softcapping, (int, float))
                                          or not 0 < logit_softcapping < float("inf")):
        raise ValueError(f"logit_softcapping must be None or a finite number > 0; got {logit_softcapping!r}")
    if vocab_chunk_size is not None and (not isinstance(vocab_chunk_size, int) or isinstance(vocab_chunk_size, bool)
                                         or vocab_chunk_size < 1):
        raise ValueError(f"vocab_chunk_size must be a positive int or None; got {vocab_chunk_size!r}")
    devices = {x.device, target.device, weight.device} | ({bias.device} if bias is not None else set())
    if len(devices) > 1:
        raise ValueError(f"x, target, weight and bias must be on one device; got {sorted(map(str, devices))}")
    if logit_scale != 1:
        x, bias = x * logit_scale, None if bias is None else bias * logit_scale
    shape = x.shape[:-1]
    xf, tf = x.reshape(-1, x.shape[-1]), target.reshape(-1).long()
    # (not under torch.compile, where reading the check's result would break the graph: there a class index out of
    # range is not caught, and its row's loss is its log-sum-exp)
    valid = tf != ignore_index
    out_of_range = valid & ((tf < 0) | (tf >= V))
    if not torch.compiler.is_compiling() and bool(out_of_range.any()):
        raise ValueError(f"target holds class indices outside [0, {V}) that are not ignore_index = {ignore_index}: "
                         f"{tf[out_of_range][:5].tolist()}")
    dtype = _product_dtype(x, weight)
    width = vocab_chunk_size or default_vocab_chunk_size(
        xf.shape[0], V, SLICE_LOGITS if _triton_kernels(xf, dtype) else SLICE_LOGITS_PYTORCH)
    with torch.autocast(x.device.type, enabled=False):
        losses = _LinearCrossEntropy.apply(xf, tf.contiguous(), weight, bias, ignore_index, width, dtype,
                                           float(label_smoothing), float(logit_softcapping or 0.0))
    if reduction == "none":
        return losses.view(shape)
    if reduction == "sum":
        return losses.sum()
    return losses.sum() / valid.sum()
