"""Building blocks shared by the token mixers: norms and the short causal convolution."""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..ops._inputs import check_cu_seqlens_layout, sequence_ids
from ..ops.backends import _HAS_TRITON, active_autocast_dtype

if _HAS_TRITON:
    from ..ops.triton import norm as _norm
    from ..ops.triton.conv import short_conv as _short_conv
    from ..ops.triton.conv import short_conv_step as _short_conv_step


def _on_kernel_device(x: torch.Tensor) -> bool:
    """Whether x is where the sequence convolution's and the norms' Triton kernels run (tests patch this to
    interpret them)."""
    return x.is_cuda


def _norm_kernels(x: torch.Tensor, *others: torch.Tensor) -> bool:
    """Whether the norms take ``ops.triton.norm``'s kernels: on their device (a GPU), outside ``torch.compile``
    (which fuses PyTorch's operations itself), in dtypes and widths they take."""
    return _HAS_TRITON and _on_kernel_device(x) and not torch.compiler.is_compiling() and _norm.takes(x, *others)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up``: on a GPU one Triton kernel each way (``ops.triton.norm.swiglu``: fp32, rounded once),
    else PyTorch's operations."""
    if gate.shape == up.shape and _norm_kernels(gate, up):
        return _norm.swiglu(gate, up)
    return F.silu(gate) * up


class RMSNorm(nn.Module):
    """RMSNorm over the last axis, computed in fp32, returned in x's dtype.

    ``autocast_output``: under autocast, return autocast's dtype instead (bf16 under bf16 autocast), rounded once.
    For a norm whose output only feeds linear maps (a block's norm before its mixer or MLP), which would each round
    it to that dtype themselves: the same products, but one rounding in the norm's kernel instead of a cast per map,
    and the maps' input gradients summed in that dtype instead of each cast back to fp32 and summed there (as in
    bf16 training without autocast)."""

    def __init__(self, dim: int, eps: float = 1e-6, autocast_output: bool = False):
        super().__init__()
        self.eps = eps
        self.autocast_output = autocast_output
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x * rsqrt(mean(x²) + eps) * weight in fp32: on a GPU one Triton kernel each way (``ops.triton.norm``),
        # else PyTorch's fused kernel where it has one
        dtype = (self.autocast_output and active_autocast_dtype(x)) or x.dtype
        if _norm_kernels(x, self.weight):
            return _norm.rms_norm(x, self.weight, self.eps, None, None, dtype)
        return F.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.eps).to(dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}" + (", autocast_output=True" if self.autocast_output else "")


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
        if gate.shape == x.shape and _norm_kernels(x, self.weight, gate):  # one kernel each way, rounded once
            return _norm.rms_norm(x, self.weight, self.eps, gate, self.activation,
                                  torch.promote_types(x.dtype, gate.dtype))
        return super().forward(x) * gate_activation(gate, self.activation)


class ShortConvolution(nn.Module):
    """Depthwise causal convolution over time (kernel 4 by default), no bias.

    ``forward(x [B, T, D], state, cu_seqlens, output_final_state=True)`` returns ``(y [B, T, D], final_state)``.
    A state holds the inputs of the last ``kernel - 1`` steps, oldest first: ``[B, D, kernel - 1]``, or
    ``[N, D, kernel - 1]`` with ``cu_seqlens`` ([N + 1] offsets of N sequences packed along T, B = 1), one per
    sequence. ``state`` None starts every sequence from zeros. With ``cu_seqlens`` no tap reaches across the start
    of a sequence (it reads that sequence's ``state`` instead), and the final state is each sequence's own last
    inputs (its initial state's where it is shorter than ``kernel - 1``), as fla's ``ShortConvolution`` gives
    them. ``output_final_state=False`` returns None for it.
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

    def forward(self, x: torch.Tensor, state: torch.Tensor | None = None, cu_seqlens: torch.Tensor | None = None,
                output_final_state: bool = True, *, seq: torch.Tensor | None = None):
        """x [B, T, D] -> (y [B, T, D], final_state [B or N, D, kernel - 1] | None). ``seq``: the caller's
        ``ops._inputs.sequence_ids(cu_seqlens, T)``, where it has it already (a mixer's three convolutions).

        On a GPU, more than one token (training, prefill) takes one Triton kernel forward and two backward
        (``ops.triton.conv.short_conv``, ``state`` differentiated too where it requires grad), not a pass over x
        per tap and per mask; ``torch.compile`` (which fuses these operations itself) keeps the PyTorch
        operations."""
        B, T, D = x.shape
        past = self.kernel_size - 1
        if D != self.dim:
            raise ValueError(f"x must have shape [B, T, {self.dim}], got {list(x.shape)}")
        rows, cu = B, None
        if cu_seqlens is not None:
            rows = check_cu_seqlens_layout(cu_seqlens, B)
            cu = cu_seqlens.to(device=x.device, dtype=torch.long)
            if seq is None:
                seq = sequence_ids(cu, T)
        if state is not None and state.shape != (rows, D, past):
            what = f"N = {rows} sequences" if cu_seqlens is not None else f"B = {B}"
            raise ValueError(f"state must have shape [{rows}, {D}, {past}] ({what}), got {list(state.shape)}")
        w = self.filters().to(x.dtype)
        if self._kernel_applies(x):
            y = _short_conv(x, w, state, cu, seq, self.activation)
        else:
            if cu is not None:
                y = self._packed(x, state, cu, seq, w)
            else:
                full = torch.cat([self._past(state, x), x], 1)  # [B, past + T, D]
                if T == 1:  # a decode step: one product and one sum instead of a kernel pair per tap
                    y = (full * w.t()).sum(1, keepdim=True)
                else:
                    y = sum(full[:, past - i: past - i + T] * w[:, past - i] for i in range(self.kernel_size))
            if self.activation == "silu":
                y = F.silu(y)
        return y, (self._final(x, state, cu) if output_final_state else None)

    def _kernel_applies(self, x) -> bool:
        return (_HAS_TRITON and _on_kernel_device(x) and x.shape[1] > 1 and self.activation in ("silu", None)
                and x.dtype in (torch.float32, torch.bfloat16, torch.float16) and not torch.compiler.is_compiling())

    def _past(self, state, x):
        """The inputs before x's rows [B, past, D] (zeros without a state)."""
        B, _, D = x.shape
        if state is None:
            return x.new_zeros(B, self.kernel_size - 1, D)
        return state.transpose(1, 2).to(x.dtype)

    def _final(self, x, state, cu):
        """The last ``past`` inputs of each row (each packed sequence), oldest first: ``[B or N, D, past]``,
        contiguous (a decode step on a GPU then updates it in place, ``conv_step``)."""
        past = self.kernel_size - 1
        if not past:
            return x.new_zeros(x.shape[0] if cu is None else cu.shape[0] - 1, x.shape[2], 0)
        if cu is None:
            return torch.cat([self._past(state, x), x[:, -past:]], 1)[:, -past:].transpose(1, 2).contiguous()
        n = torch.arange(cu.shape[0] - 1, device=x.device)[:, None]
        p = cu[1:, None] - past + torch.arange(past, device=x.device)  # [N, past]: each sequence's last inputs
        return self._inputs_at(x, state, cu, n, p).transpose(1, 2).contiguous()

    def _inputs_at(self, x, state, cu, n, p):
        """``[*p.shape, D]``: the packed input ``p`` of sequence ``n`` (broadcast together), which is x's token p
        from the sequence's start on and before it its state's slot ``past - (start - p)`` (zero without a state)."""
        begins = cu[:-1][n]
        inside = p >= begins
        if x.shape[1]:
            mine = x[0][p.clamp(min=0)]
        else:  # no tokens at all: every input is a state's
            mine = x.new_zeros(*inside.shape, x.shape[2])
        if state is None or self.kernel_size == 1:  # (one tap: a state of no slots, never read)
            return torch.where(inside[..., None], mine, 0)
        slot = (self.kernel_size - 1 - (begins - p)).clamp(0, self.kernel_size - 2)
        return torch.where(inside[..., None], mine, state.transpose(1, 2).to(x.dtype)[n, slot])

    def _packed(self, x, state, cu, seq, w):
        """Packed sequences in PyTorch: each tap masked at its sequence's start (no state) or gathered from the
        tokens and the states (``state`` [N, D, past])."""
        T, past = x.shape[1], self.kernel_size - 1
        t = torch.arange(T, device=x.device)
        starts = cu[:-1][seq]
        if state is None:  # training's case: one mask per tap, nothing gathered
            y = x * w[:, past]
            for i in range(1, self.kernel_size):
                y = y + F.pad(x, (0, 0, i, 0))[:, :T] * w[:, past - i] * (t - i >= starts)[None, :, None]
            return y
        return sum(self._inputs_at(x, state, cu, seq, t - i) * w[:, past - i] for i in range(self.kernel_size))[None]


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
