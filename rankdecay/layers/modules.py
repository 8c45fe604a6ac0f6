"""Building blocks shared by the token mixers: norms and the short causal convolution."""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..ops.backends import _HAS_TRITON

if _HAS_TRITON:
    from ..ops.triton.conv import short_conv_step as _short_conv_step


class RMSNorm(nn.Module):
    """RMSNorm over the last axis, computed in fp32."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x * rsqrt(mean(x²) + eps) * weight in fp32; PyTorch's fused kernel where it has one
        # (fewer launches in a decode step)
        return F.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.eps).to(x.dtype)


GATE_ACTIVATIONS = ("silu", "sigmoid", None)  # an output gate's activation (None: the gate as it is)


def gate_activation(gate: torch.Tensor, activation: str | None) -> torch.Tensor:
    """``silu(gate)``, ``sigmoid(gate)`` or the gate itself (activation None): an output gate's activation."""
    if activation == "silu":
        return F.silu(gate)
    return gate.sigmoid() if activation == "sigmoid" else gate


class GatedRMSNorm(RMSNorm):
    """``RMSNorm(o) * act(gate)``: the output norm and gate of GDN Fig. 1 (act = SiLU; Kimi Linear's: sigmoid), per
    head."""

    def __init__(self, dim: int, eps: float = 1e-6, activation: str | None = "silu"):
        super().__init__(dim, eps)
        if activation not in GATE_ACTIVATIONS:
            raise ValueError(f"activation must be 'silu', 'sigmoid' or None, got {activation!r}")
        self.activation = activation

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * gate_activation(gate, self.activation)


def sequence_starts(T: int, cu_seqlens: torch.Tensor | None, device) -> torch.Tensor | None:
    """For packed sequences, the index of the first token of each token's sequence ([T])."""
    if cu_seqlens is None:
        return None
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    return torch.repeat_interleave(cu_seqlens[:-1], lengths, output_size=T).to(device)


class ShortConvolution(nn.Module):
    """Depthwise causal convolution over time (kernel 4 by default), no bias.

    ``forward(x [B, T, D], state [B, D, kernel - 1] | None, starts [T] | None)`` returns
    ``(y [B, T, D], new_state [B, D, kernel - 1])``. ``state`` holds the inputs of the
    last ``kernel - 1`` steps (zeros at the start of a sequence); with ``starts`` (packed
    sequences) no tap reaches across the start of a sequence.
    """

    def __init__(self, dim: int, kernel_size: int = 4, activation: str | None = "silu", groups: int | None = None):
        super().__init__()
        self.kernel_size = kernel_size
        self.activation = activation
        self.dim = dim
        # groups: one filter shared by the dim / groups channels of each group (a head):
        # "shared convolutions" (state-reduction paper App. D.6), which commute with any
        # rotation of a head's channels.
        if groups is not None and (groups < 1 or dim % groups):
            raise ValueError(f"groups must divide dim = {dim}, got {groups!r}")
        self.groups = groups
        n = groups or dim
        self.weight = nn.Parameter(torch.empty(n, kernel_size))
        nn.init.kaiming_uniform_(self.weight.view(n, 1, kernel_size), a=5 ** 0.5)

    def filters(self) -> torch.Tensor:
        """The per-channel filters [dim, kernel] (shared filters repeated over their group)."""
        if self.groups is None:
            return self.weight
        return self.weight.repeat_interleave(self.dim // self.groups, dim=0)

    def forward(self, x, state=None, starts=None):
        B, T, D = x.shape
        past = self.kernel_size - 1
        if state is None:
            state = x.new_zeros(B, D, past)
        full = torch.cat([state.transpose(1, 2).to(x.dtype), x], dim=1)  # [B, past + T, D]
        w = self.filters().to(x.dtype)
        if T == 1 and starts is None:  # a decode step: one product and one sum instead of a kernel pair per tap
            y = (full * w.t()).sum(1, keepdim=True)
            return (F.silu(y) if self.activation == "silu" else y), full[:, 1:].transpose(1, 2)
        y = torch.zeros_like(x)
        t = torch.arange(T, device=x.device)
        for i in range(self.kernel_size):  # y_t = sum_i w_i x_{t - i}; the newest input pairs with the last weight
            tap = full[:, past - i : past - i + T] * w[:, past - i]
            if starts is not None and i > 0:
                tap = tap * (t - i >= starts)[None, :, None]
            y = y + tap
        if self.activation == "silu":
            y = F.silu(y)
        # contiguous (a small copy per prompt): a decode step on a GPU then updates it in place (``conv_step``)
        return y, full[:, T:].transpose(1, 2).contiguous()


def conv_step(convs: Sequence[ShortConvolution], xs: Sequence[torch.Tensor],
              states: Sequence[torch.Tensor | None]) -> list[torch.Tensor] | None:
    """One decode token through several short convolutions (a mixer's q, k and v) in one Triton kernel, each
    ``states[i]`` updated in place (``rankdecay.ops.triton.conv``); or None where that does not apply, and the
    caller runs each ``convs[i](xs[i], states[i])``.

    It applies to inputs ``[B, 1, D_i]`` without autograd where Triton is installed (the caller decides that the
    step runs on the GPU's decode route), with up to three plain ``ShortConvolution``s of one kernel size (at
    least 2) and activation, and states that are contiguous and in x's dtype (as ``ShortConvolution`` returns
    them). Returns ``[y_i]``, each of x_i's shape; the states then hold the shifted inputs, x last."""
    if not _HAS_TRITON or torch.is_grad_enabled() or not 1 <= len(convs) <= 3:
        return None
    first = convs[0]
    for conv, x, state in zip(convs, xs, states):
        if (type(conv) is not ShortConvolution or conv.kernel_size != first.kernel_size or conv.kernel_size < 2
                or conv.activation != first.activation or conv.activation not in ("silu", None)
                or x.dim() != 3 or x.shape[1] != 1 or x.stride(-1) != 1 or x.dtype == torch.float64
                or state is None or not state.is_contiguous() or state.dtype != x.dtype
                or state.shape != (x.shape[0], conv.dim, conv.kernel_size - 1)):
            return None
    return _short_conv_step(xs, states, [conv.filters().contiguous() for conv in convs], first.activation)
