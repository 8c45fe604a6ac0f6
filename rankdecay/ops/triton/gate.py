"""Per-channel log-decays as one Triton kernel forward and one backward: Kimi Delta Attention's, and GLA's and
HDLA's ``logsigmoid(z) / τ``.

``ops.mechanisms.kda_log_decay`` in PyTorch is five passes over the [B, T, H, K] projection forward (the cast to
fp32, the bias, the softplus, the scale, and the bounded form's products) and as many backward, each over a tensor
K times the size of a scalar gate's: on an H200 (B8 T2048 H16 K128) they cost more than a third of KDA's chunked
forward (BENCHMARKS.md, session 82). Here one pass reads the projection and writes the fp32 log-decay; the backward
reads it and the gradient once, writes the projection's gradient, and sums the bias's and ``A_log``'s gradients per
column over blocks of rows (partial sums in fp32, added in a fixed order: deterministic).

``g = -exp(A_log[h]) softplus(a + dt_bias)`` or, with a lower bound b < 0 (fla's),
``g = b sigmoid(exp(A_log[h]) (a + dt_bias))`` (without ``A_log``: ``b sigmoid(a + dt_bias)``).

GLA's and HDLA's gate, ``logsigmoid(z) / τ``, is three passes forward (the cast, the log-sigmoid, the division) and
as many backward in PyTorch; :func:`logsigmoid_gate` is one each way.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable

BLOCK_R, BLOCK_C, ROW_BLOCKS, WARPS = 16, 128, 16, 4  # a program: ROW_BLOCKS blocks of BLOCK_R rows x BLOCK_C columns


@triton.jit
def _log1p_exp_neg_abs(f):
    # log(1 + e^-|f|), with log1p's accuracy where e^-|f| is tiny
    x = tl.exp(-tl.abs(f))
    return tl.where(x < 1e-4, x * (1.0 - 0.5 * x), tl.log(1.0 + x))


@triton.jit
def _softplus(f):
    # log(1 + e^f) as PyTorch's (f itself above 20)
    return tl.where(f > 20.0, f, tl.maximum(f, 0.0) + _log1p_exp_neg_abs(f))


@triton.jit
def _gate_inputs(a_ptr, A_ptr, dt_ptr, rows, cols, R, C, K, HAS_A: tl.constexpr, HAS_DT: tl.constexpr):
    """The block's a + dt_bias [rows, cols] in fp32, exp(A_log) per column, the block's mask and offsets."""
    m = (rows < R)[:, None] & (cols < C)[None, :]
    offs = rows.to(tl.int64)[:, None] * C + cols[None, :]
    f = tl.load(a_ptr + offs, mask=m, other=0.0).to(tl.float32)
    if HAS_DT:
        f += tl.load(dt_ptr + cols, mask=cols < C, other=0.0).to(tl.float32)[None, :]
    if HAS_A:
        s = tl.exp(tl.load(A_ptr + cols // K, mask=cols < C, other=0.0).to(tl.float32))
    else:
        s = tl.zeros_like(cols).to(tl.float32) + 1.0
    return f, s[None, :], m, offs


@triton.jit
def _kda_gate_fwd(a_ptr, A_ptr, dt_ptr, g_ptr, R, C, K, n_c, lower,
                  HAS_A: tl.constexpr, HAS_DT: tl.constexpr, BOUNDED: tl.constexpr,
                  BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, ROW_BLOCKS: tl.constexpr):
    pid = tl.program_id(0)
    rb, cb = pid // n_c, pid % n_c
    cols = cb * BLOCK_C + tl.arange(0, BLOCK_C)
    for i in range(ROW_BLOCKS):
        rows = (rb * ROW_BLOCKS + i) * BLOCK_R + tl.arange(0, BLOCK_R)
        f, s, m, offs = _gate_inputs(a_ptr, A_ptr, dt_ptr, rows, cols, R, C, K, HAS_A, HAS_DT)
        if BOUNDED:
            g = lower * tl.sigmoid(s * f)
        else:
            g = -s * _softplus(f)
        tl.store(g_ptr + offs, g, mask=m)


@triton.jit
def _kda_gate_bwd(a_ptr, A_ptr, dt_ptr, dg_ptr, da_ptr, pdt_ptr, pA_ptr, R, C, K, n_c, lower,
                  HAS_A: tl.constexpr, HAS_DT: tl.constexpr, BOUNDED: tl.constexpr,
                  BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, ROW_BLOCKS: tl.constexpr):
    pid = tl.program_id(0)
    rb, cb = pid // n_c, pid % n_c
    cols = cb * BLOCK_C + tl.arange(0, BLOCK_C)
    sum_dt = tl.zeros((BLOCK_C,), tl.float32)
    sum_A = tl.zeros((BLOCK_C,), tl.float32)
    for i in range(ROW_BLOCKS):
        rows = (rb * ROW_BLOCKS + i) * BLOCK_R + tl.arange(0, BLOCK_R)
        f, s, m, offs = _gate_inputs(a_ptr, A_ptr, dt_ptr, rows, cols, R, C, K, HAS_A, HAS_DT)
        dg = tl.load(dg_ptr + offs, mask=m, other=0.0).to(tl.float32)  # 0 outside: no share in the sums
        if BOUNDED:  # g = b sigmoid(z), z = s f
            z = s * f
            sig = tl.sigmoid(z)
            dz = dg * lower * sig * (1.0 - sig)
            df, dA = dz * s, dz * z
        else:  # g = -s softplus(f): dg/df = -s sigmoid(f), dg/dA_log = g
            df = -dg * s * tl.sigmoid(f)
            dA = -dg * s * _softplus(f)
        tl.store(da_ptr + offs, df.to(da_ptr.dtype.element_ty), mask=m)
        sum_dt += tl.sum(df, axis=0)
        sum_A += tl.sum(dA, axis=0)
    if HAS_DT:
        tl.store(pdt_ptr + rb * C + cols, sum_dt, mask=cols < C)
    if HAS_A:
        tl.store(pA_ptr + rb * C + cols, sum_A, mask=cols < C)


BLOCK = 1024  # logsigmoid_gate's elements a program


@triton.jit
def _logsigmoid_fwd(z_ptr, g_ptr, N, inv_tau, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    z = tl.load(z_ptr + offs, mask=offs < N, other=0.0).to(tl.float32)
    tl.store(g_ptr + offs, (tl.minimum(z, 0.0) - _log1p_exp_neg_abs(z)) * inv_tau, mask=offs < N)


@triton.jit
def _logsigmoid_bwd(z_ptr, dg_ptr, dz_ptr, N, inv_tau, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    z = tl.load(z_ptr + offs, mask=offs < N, other=0.0).to(tl.float32)
    dg = tl.load(dg_ptr + offs, mask=offs < N, other=0.0).to(tl.float32)
    tl.store(dz_ptr + offs, (dg * tl.sigmoid(-z) * inv_tau).to(dz_ptr.dtype.element_ty), mask=offs < N)


class _LogSigmoidGate(torch.autograd.Function):
    @staticmethod
    def forward(ctx, z, tau):
        z = z.contiguous()
        g = torch.empty(z.shape, device=z.device, dtype=torch.float32)
        _logsigmoid_fwd[(triton.cdiv(z.numel(), BLOCK),)](z, g, z.numel(), 1.0 / tau, BLOCK=BLOCK, num_warps=WARPS)
        ctx.save_for_backward(z)
        ctx.tau = tau
        return g

    @staticmethod
    @once_differentiable
    def backward(ctx, dg):
        (z,) = ctx.saved_tensors
        dz = torch.empty_like(z)
        _logsigmoid_bwd[(triton.cdiv(z.numel(), BLOCK),)](z, dg.contiguous(), dz, z.numel(), 1.0 / ctx.tau,
                                                          BLOCK=BLOCK, num_warps=WARPS)
        return dz, None


def logsigmoid_gate(z: torch.Tensor, tau: float) -> torch.Tensor:
    """``logsigmoid(z) / tau`` in fp32 of z (fp32 / bf16 / fp16, any shape), differentiable in z."""
    return _LogSigmoidGate.apply(z, float(tau))


def _grid(R: int, C: int) -> tuple[int, int, int]:
    n_r, n_c = triton.cdiv(R, BLOCK_R * ROW_BLOCKS), triton.cdiv(C, BLOCK_C)
    return n_r, n_c, n_r * n_c


class _KDAGate(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, A_log, dt_bias, lower_bound):
        a = a.contiguous()
        A_log, dt_bias = (None if x is None else x.contiguous() for x in (A_log, dt_bias))  # read by index
        H, K = a.shape[-2:]
        R, C = a.numel() // (H * K), H * K
        g = torch.empty(a.shape, device=a.device, dtype=torch.float32)
        n_r, n_c, programs = _grid(R, C)
        _kda_gate_fwd[(programs,)](
            a, A_log if A_log is not None else a, dt_bias if dt_bias is not None else a, g, R, C, K, n_c,
            float(lower_bound or 0.0), HAS_A=A_log is not None, HAS_DT=dt_bias is not None,
            BOUNDED=lower_bound is not None, BLOCK_R=BLOCK_R, BLOCK_C=BLOCK_C, ROW_BLOCKS=ROW_BLOCKS,
            num_warps=WARPS)
        ctx.save_for_backward(a, A_log, dt_bias)
        ctx.lower_bound = lower_bound
        return g

    @staticmethod
    @once_differentiable
    def backward(ctx, dg):
        a, A_log, dt_bias = ctx.saved_tensors
        H, K = a.shape[-2:]
        R, C = a.numel() // (H * K), H * K
        n_r, n_c, programs = _grid(R, C)
        da = torch.empty_like(a)
        pdt = torch.empty(n_r, C, device=a.device, dtype=torch.float32) if dt_bias is not None else None
        pA = torch.empty(n_r, C, device=a.device, dtype=torch.float32) if A_log is not None else None
        _kda_gate_bwd[(programs,)](
            a, A_log if A_log is not None else a, dt_bias if dt_bias is not None else a, dg.contiguous(), da,
            pdt if pdt is not None else da, pA if pA is not None else da, R, C, K, n_c,
            float(ctx.lower_bound or 0.0), HAS_A=A_log is not None, HAS_DT=dt_bias is not None,
            BOUNDED=ctx.lower_bound is not None, BLOCK_R=BLOCK_R, BLOCK_C=BLOCK_C, ROW_BLOCKS=ROW_BLOCKS,
            num_warps=WARPS)
        dA = pA.sum(0).view(H, K).sum(1).to(A_log.dtype) if A_log is not None else None
        ddt = pdt.sum(0).to(dt_bias.dtype) if dt_bias is not None else None
        return da, dA, ddt, None


def takes(a: torch.Tensor, *parameters: torch.Tensor | None) -> bool:
    """Whether the kernels take these: a (for :func:`kda_gate` ``[..., H, K]``) and the gate's parameters (None
    or tensors) in fp32 / bf16 / fp16."""
    floats = (torch.float32, torch.bfloat16, torch.float16)
    return (a.dtype in floats and a.dim() >= 2 and a.numel() > 0
            and all(x is None or x.dtype in floats for x in parameters))


def kda_gate(a: torch.Tensor, A_log: torch.Tensor | None, dt_bias: torch.Tensor | None,
             lower_bound: float | None = None) -> torch.Tensor:
    """KDA's log-decay of its projection a ``[..., H, K]`` (fp32 / bf16 / fp16), with ``A_log`` ``[H]`` and
    ``dt_bias`` ``[H * K]`` (either may be None: ``A_log`` only with a lower bound): fp32, differentiable in a,
    ``A_log`` and ``dt_bias`` (module docstring)."""
    return _KDAGate.apply(a, A_log, dt_bias, lower_bound)
