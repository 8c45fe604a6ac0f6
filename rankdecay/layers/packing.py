"""Several linear maps of one input as one matrix product: a decode step's projections, packed.

A one-token decode step is a chain of matrix-vector products, and at small batch each costs its launch and its
few thread blocks rather than the bandwidth its weights need. A linear mixer applies six maps to the same input
(q, k, v, the output gate, β, α) and the SwiGLU two (gate, up). Packed, each group is one product against the
concatenated weights, split afterwards: on an H200, the 340m preset's projections in a CUDA graph took 1.52 ->
0.80 ms per step at B = 1 (``benchmarks/packed_projections.py``).

At B = 1 on a GPU the packed products, and the layers' own output maps, take a Triton matrix-vector kernel
(:func:`decode_linear`), which reaches more of the GPU's bandwidth than cuBLAS there. The output maps' kernel also
forms what comes just before them (:func:`fused_output_linear`): a mixer's output norm and gate, a SwiGLU's
``silu(gate) * up``; a block's packed input projections form its residual add and input norm
(:func:`fused_input_projections`).

:class:`PackedLinears` holds a copy of the weights, which :meth:`PackedLinears.refresh` updates where any weight
changed (its storage, its in-place version, its shape). ``GraphDecoder`` packs every layer when decoding starts and
hands the packs to the model through ``Cache.projections``; the layers use them only without autograd, so a
gradient never meets a copy.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..ops.backends import _HAS_TRITON
from .modules import GatedRMSNorm, RMSNorm

if _HAS_TRITON:
    from ..ops.triton.gemv import block_k as _block_k
    from ..ops.triton.gemv import gemv as _gemv


def _on_kernel_device(x: torch.Tensor) -> bool:
    """Where the one-row kernel runs: a GPU (tests patch this to run it interpreted on the CPU)."""
    return x.is_cuda


def _one_row(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether ``F.linear(x, weight, bias)`` takes the one-row kernel: one row on a GPU, no autograd, one dtype."""
    return (_HAS_TRITON and x.numel() == x.shape[-1] and _on_kernel_device(x) and not torch.is_grad_enabled()
            and x.dtype == weight.dtype and (bias is None or bias.dtype == x.dtype) and weight.stride(-1) == 1)


def decode_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``. One row on a GPU (a B = 1 decode step; no autograd) takes the Triton
    matrix-vector kernel (``rankdecay.ops.triton.gemv``), which reaches more of the GPU's bandwidth there than
    cuBLAS; anything else takes ``F.linear``."""
    if _one_row(x, weight, bias):
        return _gemv(x.contiguous(), weight, bias).view(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight, bias)


def _plain_linear(module: nn.Module) -> bool:
    """An ``nn.Linear`` itself (not a subclass or wrapper with its own forward) over a plain tensor."""
    return type(module) is nn.Linear and type(module.weight.data) is torch.Tensor


class PackedLinears:
    """The maps ``module.<name>`` for ``names`` (each an ``nn.Linear`` of the same input) as one product.

    ``packed(x)`` returns ``{name: module.<name>(x)}``, from one ``F.linear`` with the weights stacked along the
    outputs (the biases likewise, zeros where a map has none). Use :func:`pack` to build one: it returns None where
    the maps cannot be packed (fewer than two, not plain ``nn.Linear``, different input widths, dtypes or devices).
    """

    def __init__(self, module: nn.Module, names: Sequence[str]):
        self.module, self.names = module, tuple(names)
        self.weight: torch.Tensor | None = None
        self.bias: torch.Tensor | None = None
        self.widths: tuple[int, ...] = ()
        self._key = None
        self.refresh()

    def linears(self) -> list[nn.Linear]:
        return [self.module.get_submodule(name) for name in self.names]

    def _state(self, linears) -> tuple:
        def tensor(t):
            return None if t is None else (t.data_ptr(), t._version, tuple(t.shape), t.dtype, t.device)
        return tuple((tensor(m.weight), tensor(m.bias)) for m in linears)

    @torch.no_grad()
    def refresh(self) -> bool:
        """Copy the weights in again if any changed since the last copy. Returns True where the packed tensors
        were allocated anew (shapes, dtype or device changed; a recorded CUDA graph must then be recorded again)."""
        linears = self.linears()
        state = self._state(linears)
        if state == self._key:
            return False
        widths = tuple(m.out_features for m in linears)
        w0 = linears[0].weight
        has_bias = any(m.bias is not None for m in linears)
        new = (self.weight is None or widths != self.widths or self.weight.shape[1] != w0.shape[1]
               or self.weight.dtype != w0.dtype or self.weight.device != w0.device
               or has_bias != (self.bias is not None))
        if new:
            self.weight = torch.empty(sum(widths), w0.shape[1], dtype=w0.dtype, device=w0.device)
            self.bias = torch.empty(sum(widths), dtype=w0.dtype, device=w0.device) if has_bias else None
            self.widths = widths
        torch.cat([m.weight for m in linears], out=self.weight)
        if has_bias:
            torch.cat([m.bias if m.bias is not None else m.weight.new_zeros(m.out_features) for m in linears],
                      out=self.bias)
        self._key = state  # (reading the weights into the copy leaves their versions as they were)
        return new

    def __call__(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """``{name: module.<name>(x)}`` for x [..., in_features], from one product."""
        return dict(zip(self.names, decode_linear(x, self.weight, self.bias).split(self.widths, -1)))

    def __repr__(self) -> str:
        return f"PackedLinears({', '.join(self.names)}: {list(self.weight.shape)})"


def packable(module: nn.Module, names: Sequence[str]) -> bool:
    """Whether ``module``'s maps ``names`` can be one product: at least two, each a plain ``nn.Linear`` (not a
    subclass or a wrapper such as a LoRA layer, whose forward is its own), of the same input width, dtype and
    device."""
    linears = [module.get_submodule(name) for name in names]
    if len(linears) < 2 or not all(_plain_linear(m) for m in linears):
        return False
    first = linears[0].weight
    return not any((m.in_features, m.weight.dtype, m.weight.device) != (first.shape[1], first.dtype, first.device)
                   or (m.bias is not None and m.bias.dtype != first.dtype) for m in linears)


def pack(module: nn.Module, names: Sequence[str]) -> PackedLinears | None:
    """``module``'s linear maps ``names`` of one input packed into one product, or None where they cannot be
    (:func:`packable`)."""
    return PackedLinears(module, names) if packable(module, names) else None


def output_linear(linear: nn.Linear, x: torch.Tensor, packed: PackedLinears | None) -> torch.Tensor:
    """``linear(x)``, through :func:`decode_linear` where the layer decodes with a pack (no autograd): a layer's
    map of its own output (a mixer's output projection, the SwiGLU's down projection) has no other map of the same
    input to pack with, but takes the same one-row kernel."""
    if packed is None or torch.is_grad_enabled() or not _plain_linear(linear):
        return linear(x)
    return decode_linear(x, linear.weight, linear.bias)


def fused_output_linear(linear: nn.Linear, x: torch.Tensor, packed: PackedLinears | None, *,
                        u: torch.Tensor | None = None, x_act: str | None = None, u_act: str | None = None,
                        norm: nn.Module | None = None) -> torch.Tensor | None:
    """``linear(pre(x) * post(u))`` in the one-row kernel, where a layer decodes one row with a pack on a GPU
    (no autograd); else None, and the caller forms it as it would without (same result up to rounding: the
    kernel keeps the prologue in fp32 and rounds once).

    ``pre(x)``: ``norm(x)`` over each group of ``norm``'s width (an ``RMSNorm`` per head: its weight and eps; the
    group a power of two), ``silu(x)`` (``x_act="silu"``), or x. ``post(u)``: ``silu(u)`` (``u_act="silu"``),
    ``sigmoid(u)`` (``"sigmoid"``), u, or 1 without u. So a mixer's output norm and gate (``GatedRMSNorm``), or a
    SwiGLU's ``silu(gate) * up``, are read by the output map's kernel instead of taking kernels of their own."""
    if packed is None or not _plain_linear(linear) or not _one_row(x, linear.weight, linear.bias):
        return None
    if u is not None and (u.shape != x.shape or u.dtype != x.dtype):
        return None
    weight = None
    if norm is not None:  # (the gate's activation comes in u_act)
        K, G = x.shape[-1], norm.weight.numel()
        if (type(norm) not in (RMSNorm, GatedRMSNorm) or x_act is not None or G & (G - 1) or K % G
                or _block_k(K) % G or norm.weight.dtype not in (torch.float32, x.dtype)):
            return None
        x_act, weight = "rms_norm", norm.weight
    y = _gemv(x.contiguous(), linear.weight, linear.bias, u=None if u is None else u.contiguous(), x_act=x_act,
              u_act=u_act, norm_weight=weight, eps=norm.eps if norm is not None else 1e-6)
    return y.view(*x.shape[:-1], linear.weight.shape[0])


def fused_input_projections(packed: PackedLinears | None, x: torch.Tensor, norm: nn.Module,
                            residual: torch.Tensor | None = None
                            ) -> tuple[dict[str, torch.Tensor], torch.Tensor] | None:
    """A block's first product with its residual add and input norm inside: ``(packed(norm(s)), s)`` with
    ``s = x + residual`` (x without one), in the one-row kernel where it decodes one row on a GPU (no autograd);
    else None, and the caller adds, norms and projects as it would without (same result up to rounding: the
    kernel keeps the norm in fp32 and rounds the products once).

    x, residual: [..., D], one row. ``norm``: an ``RMSNorm`` over D (its weight and eps)."""
    if packed is None or not _one_row(x, packed.weight, packed.bias) or type(norm) is not RMSNorm:
        return None
    D = x.shape[-1]
    if norm.weight.numel() != D or norm.weight.dtype not in (torch.float32, x.dtype):
        return None
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        return None
    s = torch.empty_like(x) if residual is not None else x
    y = _gemv(x.contiguous(), packed.weight, packed.bias, x_act="rms_norm_row", norm_weight=norm.weight,
              eps=norm.eps, residual=None if residual is None else residual.contiguous(),
              out_sum=s if residual is not None else None)
    return dict(zip(packed.names, y.view(*x.shape[:-1], -1).split(packed.widths, -1))), s


def projections(module: nn.Module, names: Sequence[str], x: torch.Tensor,
                packed: PackedLinears | None) -> dict[str, torch.Tensor] | None:
    """The packed projections of x where ``packed`` applies (no autograd: the pack is a copy of the weights),
    else None (the caller applies each map itself)."""
    if packed is None or torch.is_grad_enabled() or packed.module is not module:
        return None
    return packed(x)
