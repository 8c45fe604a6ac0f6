"""The layers' per-row norms as one Triton kernel forward and one backward: the L2 norm of q and k, RMSNorm, and
RMSNorm times a gate's activation (a mixer's output norm and gate); and the SwiGLU's ``silu(gate) * up`` likewise.

In PyTorch, ``F.normalize`` over [B, T, H, K] in fp32 is five kernels forward (the cast, the norm, the clamp, the
division, the cast back) and about ten backward; a gated RMSNorm in 16 bits is five forward (the cast, the norm,
the cast back, the activation, the product) and eight backward, and PyTorch's norm backward sums the weight's
gradient over the rows in a kernel of its own. Here each is one pass forward that reads the inputs and writes
the output in its dtype, and one pass backward that reads the inputs and the output's gradient, recomputes the
norm, and writes the inputs' gradients; the weight's gradient is summed per column over blocks of rows into fp32
partial sums, added in a fixed order (deterministic). Every sum is in fp32.

- :func:`l2norm`: ``x / max(||x||, eps)`` over the last axis (``F.normalize``'s definition, its gradient with the
  clamp's: ``dx = dy / eps`` where the norm is below eps).
- :func:`rms_norm`: ``x / sqrt(mean(x²) + eps) * weight``, times ``act(gate)`` where a gate is given (act: SiLU,
  sigmoid or none), rounded once to the output's dtype.
- :func:`swiglu`: ``silu(gate) * up``, elementwise.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable

MAX_D = 16384  # the widest row the kernels take (one row's columns in one block)
FLOATS = (torch.float32, torch.bfloat16, torch.float16)
ACTIVATIONS = {None: 0, "silu": 1, "sigmoid": 2}


def _blocks(N: int, D: int) -> tuple[int, int, int]:
    """(BLOCK_D, BLOCK_N, warps): a row's columns in one block, rows to fill about 4,096 elements."""
    BLOCK_D = triton.next_power_of_2(D)
    BLOCK_N = max(1, min(64, 4096 // BLOCK_D))
    return BLOCK_D, BLOCK_N, 8 if BLOCK_D * BLOCK_N >= 4096 else 4


@triton.jit
def _tile(ptr, rows, cols, N, D, stride):
    m = (rows < N)[:, None] & (cols < D)[None, :]
    offs = rows.to(tl.int64)[:, None] * stride + cols[None, :]
    return tl.load(ptr + offs, mask=m, other=0.0).to(tl.float32), m, offs


@triton.jit
def _l2norm_fwd(x_ptr, y_ptr, N, D, sx, eps, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_D)
    x, m, _ = _tile(x_ptr, rows, cols, N, D, sx)
    r = 1.0 / tl.maximum(tl.sqrt(tl.sum(x * x, 1)), eps)
    out = rows.to(tl.int64)[:, None] * D + cols[None, :]
    tl.store(y_ptr + out, (x * r[:, None]).to(y_ptr.dtype.element_ty), mask=m)


@triton.jit
def _l2norm_bwd(x_ptr, dy_ptr, dx_ptr, N, D, sx, eps, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_D)
    x, m, _ = _tile(x_ptr, rows, cols, N, D, sx)
    dy, _, out = _tile(dy_ptr, rows, cols, N, D, D)
    n = tl.sqrt(tl.sum(x * x, 1))
    r = 1.0 / tl.maximum(n, eps)
    y = x * r[:, None]
    # y = x / n: dx = (dy - y <dy, y>) / n; below eps y = x / eps, whose gradient is dy / eps
    proj = tl.where(n < eps, 0.0, tl.sum(dy * y, 1))
    tl.store(dx_ptr + out, ((dy - y * proj[:, None]) * r[:, None]).to(dx_ptr.dtype.element_ty), mask=m)


@triton.jit
def _act(g, ACT: tl.constexpr):
    if ACT == 1:
        return g * tl.sigmoid(g)
    elif ACT == 2:
        return tl.sigmoid(g)
    else:
        return g


@triton.jit
def _act_grad(g, ACT: tl.constexpr):
    s = tl.sigmoid(g)
    if ACT == 1:
        return s * (1.0 + g * (1.0 - s))
    elif ACT == 2:
        return s * (1.0 - s)
    else:
        return tl.full(g.shape, 1.0, tl.float32)


@triton.jit
def _rms_fwd(x_ptr, w_ptr, g_ptr, y_ptr, N, D, sx, sg, eps, HAS_W: tl.constexpr, HAS_GATE: tl.constexpr,
             ACT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_D)
    x, m, _ = _tile(x_ptr, rows, cols, N, D, sx)
    y = x * tl.rsqrt(tl.sum(x * x, 1) / D + eps)[:, None]
    if HAS_W:
        y *= tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)[None, :]
    if HAS_GATE:
        g, _, _ = _tile(g_ptr, rows, cols, N, D, sg)
        y *= _act(g, ACT)
    out = rows.to(tl.int64)[:, None] * D + cols[None, :]
    tl.store(y_ptr + out, y.to(y_ptr.dtype.element_ty), mask=m)


@triton.jit
def _rms_bwd(x_ptr, w_ptr, g_ptr, dy_ptr, dx_ptr, dg_ptr, pw_ptr, N, D, sx, sg, eps, rows_per_program,
             HAS_W: tl.constexpr, HAS_GATE: tl.constexpr, ACT: tl.constexpr,
             BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    if HAS_W:
        w = tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)[None, :]
    else:
        w = tl.full((1, BLOCK_D), 1.0, tl.float32)
    dw = tl.zeros((BLOCK_D,), tl.float32)
    for start in range(0, rows_per_program, BLOCK_N):
        rows = pid * rows_per_program + start + tl.arange(0, BLOCK_N)
        x, m, _ = _tile(x_ptr, rows, cols, N, D, sx)
        dy, _, out = _tile(dy_ptr, rows, cols, N, D, D)
        rstd = tl.rsqrt(tl.sum(x * x, 1) / D + eps)[:, None]
        xh = x * rstd
        if HAS_GATE:
            g, _, _ = _tile(g_ptr, rows, cols, N, D, sg)
            tl.store(dg_ptr + out, (dy * xh * w * _act_grad(g, ACT)).to(dg_ptr.dtype.element_ty), mask=m)
            dy = dy * _act(g, ACT)
        dw += tl.sum(dy * xh, 0)
        dxh = dy * w
        dx = rstd * (dxh - xh * (tl.sum(dxh * xh, 1) / D)[:, None])
        tl.store(dx_ptr + out, dx.to(dx_ptr.dtype.element_ty), mask=m)
    if HAS_W:
        tl.store(pw_ptr + pid * D + cols, dw, mask=cols < D)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as [N, D] rows with contiguous columns (a view where it can be)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


class _L2Norm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, eps):
        rows = _rows(x)
        N, D = rows.shape
        y = torch.empty(N, D, device=x.device, dtype=x.dtype)
        BLOCK_D, BLOCK_N, warps = _blocks(N, D)
        if N:
            _l2norm_fwd[(triton.cdiv(N, BLOCK_N),)](rows, y, N, D, rows.stride(0), eps, BLOCK_N=BLOCK_N,
                                                    BLOCK_D=BLOCK_D, num_warps=warps)
        ctx.save_for_backward(rows)
        ctx.eps, ctx.shape = eps, x.shape
        return y.view(x.shape)

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        (rows,) = ctx.saved_tensors
        N, D = rows.shape
        dy = dy.reshape(N, D).contiguous()
        dx = torch.empty(N, D, device=rows.device, dtype=rows.dtype)
        BLOCK_D, BLOCK_N, warps = _blocks(N, D)
        if N:
            _l2norm_bwd[(triton.cdiv(N, BLOCK_N),)](rows, dy, dx, N, D, rows.stride(0), ctx.eps, BLOCK_N=BLOCK_N,
                                                    BLOCK_D=BLOCK_D, num_warps=warps)
        return dx.view(ctx.shape), None


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, gate, eps, activation, out_dtype):
        rows = _rows(x)
        N, D = rows.shape
        grows = _rows(gate) if gate is not None else None
        y = torch.empty(N, D, device=x.device, dtype=out_dtype)
        BLOCK_D, BLOCK_N, warps = _blocks(N, D)
        if N:
            _rms_fwd[(triton.cdiv(N, BLOCK_N),)](
                rows, weight if weight is not None else rows, grows if grows is not None else rows, y, N, D,
                rows.stride(0), grows.stride(0) if grows is not None else 0, eps, HAS_W=weight is not None,
                HAS_GATE=gate is not None, ACT=ACTIVATIONS[activation], BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D,
                num_warps=warps)
        ctx.save_for_backward(rows, weight, grows)
        ctx.eps, ctx.activation, ctx.shapes = eps, activation, (x.shape, None if gate is None else gate.shape)
        ctx.dtypes = (x.dtype, None if gate is None else gate.dtype)
        return y.view(x.shape)

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        rows, weight, grows = ctx.saved_tensors
        N, D = rows.shape
        dy = dy.reshape(N, D).contiguous()
        dx = torch.empty(N, D, device=rows.device, dtype=ctx.dtypes[0])
        dg = torch.empty(N, D, device=rows.device, dtype=ctx.dtypes[1]) if grows is not None else None
        BLOCK_D, BLOCK_N, warps = _blocks(N, D)
        programs = max(1, min(triton.cdiv(N, BLOCK_N), 1024))
        per = max(1, triton.cdiv(triton.cdiv(N, programs), BLOCK_N)) * BLOCK_N  # rows a program, whole blocks
        programs = max(1, triton.cdiv(N, per))
        pw = torch.empty(programs, D, device=rows.device, dtype=torch.float32) if weight is not None else None
        if N:
            _rms_bwd[(programs,)](
                rows, weight if weight is not None else rows, grows if grows is not None else rows, dy, dx,
                dg if dg is not None else dx, pw if pw is not None else dx, N, D, rows.stride(0),
                grows.stride(0) if grows is not None else 0, ctx.eps, per, HAS_W=weight is not None,
                HAS_GATE=grows is not None, ACT=ACTIVATIONS[ctx.activation], BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D,
                num_warps=warps)
        dw = None
        if weight is not None:
            dw = pw.sum(0).to(weight.dtype) if N else torch.zeros_like(weight)
        return (dx.view(ctx.shapes[0]), dw, None if dg is None else dg.view(ctx.shapes[1]), None, None, None)


SWIGLU_BLOCK = 1024  # swiglu's elements a program


@triton.jit
def _swiglu_fwd(g_ptr, u_ptr, y_ptr, N, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    g = tl.load(g_ptr + offs, mask=offs < N, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=offs < N, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs, (g * tl.sigmoid(g) * u).to(y_ptr.dtype.element_ty), mask=offs < N)


@triton.jit
def _swiglu_bwd(g_ptr, u_ptr, dy_ptr, dg_ptr, du_ptr, N, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    g = tl.load(g_ptr + offs, mask=offs < N, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=offs < N, other=0.0).to(tl.float32)
    dy = tl.load(dy_ptr + offs, mask=offs < N, other=0.0).to(tl.float32)
    s = tl.sigmoid(g)
    tl.store(dg_ptr + offs, (dy * u * s * (1.0 + g * (1.0 - s))).to(dg_ptr.dtype.element_ty), mask=offs < N)
    tl.store(du_ptr + offs, (dy * g * s).to(du_ptr.dtype.element_ty), mask=offs < N)


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        gate, up = gate.contiguous(), up.contiguous()
        y = torch.empty(gate.shape, device=gate.device, dtype=torch.promote_types(gate.dtype, up.dtype))
        N = gate.numel()
        if N:
            _swiglu_fwd[(triton.cdiv(N, SWIGLU_BLOCK),)](gate, up, y, N, BLOCK=SWIGLU_BLOCK, num_warps=4)
        ctx.save_for_backward(gate, up)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        gate, up = ctx.saved_tensors
        dg, du = torch.empty_like(gate), torch.empty_like(up)
        N = gate.numel()
        if N:
            _swiglu_bwd[(triton.cdiv(N, SWIGLU_BLOCK),)](gate, up, dy.contiguous(), dg, du, N, BLOCK=SWIGLU_BLOCK,
                                                         num_warps=4)
        return dg, du


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` (same shapes; fp32 / bf16 / fp16) in fp32, rounded once to the promoted dtype; one pass
    each way (a SwiGLU's product; in PyTorch two kernels forward and three backward)."""
    if gate.shape != up.shape:
        raise ValueError(f"up must have gate's shape {list(gate.shape)}, got {list(up.shape)}")
    return _SwiGLU.apply(gate, up)


def takes(x: torch.Tensor, *others: torch.Tensor | None) -> bool:
    """Whether the kernels take x (rows of at most ``MAX_D`` columns) and the others (None, or of x's shape for a
    gate / [D] for a weight), each fp32 / bf16 / fp16."""
    return (x.dim() >= 1 and 0 < x.shape[-1] <= MAX_D and x.dtype in FLOATS
            and all(t is None or t.dtype in FLOATS for t in others))


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / max(||x||, eps)`` over the last axis of x ``[..., D]`` (fp32 / bf16 / fp16), in fp32, rounded to x's
    dtype; differentiable (the module docstring)."""
    return _L2Norm.apply(x, float(eps))


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float, gate: torch.Tensor | None = None,
             activation: str | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x / sqrt(mean(x²) + eps) * weight * act(gate)`` over the last axis (weight ``[D]`` or None; gate of x's
    shape or None; act ``"silu"``, ``"sigmoid"`` or None), in fp32, rounded once to ``out_dtype`` (default x's
    dtype); differentiable in x, weight and gate."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be 'silu', 'sigmoid' or None, got {activation!r}")
    if gate is not None and gate.shape != x.shape:
        raise ValueError(f"gate must have x's shape {list(x.shape)}, got {list(gate.shape)}")
    if weight is not None and weight.shape != x.shape[-1:]:
        raise ValueError(f"weight must have shape [{x.shape[-1]}], got {list(weight.shape)}")
    return _RMSNorm.apply(x, weight if weight is None else weight.contiguous(), gate, float(eps), activation,
                          out_dtype or x.dtype)
