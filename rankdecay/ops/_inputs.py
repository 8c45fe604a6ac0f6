"""Input checking and layout normalisation shared by every execution path.

Public tensors are ``[B, T, H, ...]``; the paths work on a canonical form:

    q [B, T, H, K]          k [B, T, H, Rkv, K]      v [B, T, H, Rkv, V]
    a, b [B, T, H, Rab, K]  (or None when Rab = 0)
    a_scale [B, T, H, Rab]  v_scale [B, T, H, Rkv]   per-row factors of a and v (or None)
    g [B, T, H, Kg]         with Kg = 1 (one log-decay per head) or Kg = K (or None)

Everything is checked once here, so every path can assume well-formed input and
every mistake is reported with the argument's name and the expected shape.
"""
from __future__ import annotations

import operator
import weakref
from dataclasses import dataclass

import torch

MODES = ("auto", "naive", "chunk", "triton", "fused_recurrent")


def _is_tensor(x, name: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    return x


def check_float(x: torch.Tensor, name: str) -> torch.Tensor:
    _is_tensor(x, name)
    if not x.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor (fp16, bf16, fp32 or fp64), got {x.dtype}")
    return x


def check_shape(x: torch.Tensor, name: str, expected: tuple, labels: str) -> None:
    """Check ``x.shape == expected``; ``labels`` names the axes, e.g. "[B, T, H, K]"."""
    if tuple(x.shape) != tuple(expected):
        raise ValueError(f"{name} must have shape {labels} = {list(expected)}, got {list(x.shape)}")


@dataclass
class Canonical:
    """Inputs of the recurrence in the canonical layout (see module docstring)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    a: torch.Tensor | None
    b: torch.Tensor | None
    g: torch.Tensor | None
    scale: float
    initial_state: torch.Tensor | None
    cu_seqlens: torch.Tensor | None
    lengths: list[int] | None  # per-sequence lengths when cu_seqlens is given, but not while compiling (``host_lengths``)
    kv_rank_axis: bool  # whether k/v came with an explicit rank axis
    a_scale: torch.Tensor | None = None  # a's rows are a_scale[..., None] * a
    v_scale: torch.Tensor | None = None  # v's rows are v_scale[..., None] * v

    @property
    def compute_dtype(self) -> torch.dtype:
        return compute_dtype([self.q, self.k, self.v, self.a, self.b, self.g, self.initial_state, self.a_scale,
                              self.v_scale])


def compute_dtype(tensors) -> torch.dtype:
    """fp32 state and accumulation whatever the input dtype; fp64 in, fp64 out (None entries skipped)."""
    if any(t is not None and t.dtype == torch.float64 for t in tensors):
        return torch.float64
    return torch.float32


def resolve_scale(scale, K: int) -> float:
    """The query scale: ``K ** -0.5`` when None, else a checked float. Under ``torch.compile(dynamic=True)`` K is
    a symbol: ``operator.index`` makes Dynamo specialise it (K is fixed by the model), so the default is a constant
    of the graph, as the Triton ops' opaque operators need."""
    if scale is None:
        return operator.index(K) ** -0.5
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a float or None, got {type(scale).__name__}")
    return float(scale)


STATE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what a state updated in place may be stored in


def check_inplace_state(initial_state: torch.Tensor | None) -> torch.Tensor:
    """``inplace_final_state``'s target: an ``initial_state`` that is contiguous and fp32, bf16 or fp16
    (a 16-bit cache is read and written in its dtype and updated in fp32), and that needs no gradient."""
    if initial_state is None:
        raise ValueError("inplace_final_state=True needs an initial_state to update")
    if initial_state.dtype not in STATE_DTYPES or not initial_state.is_contiguous():
        raise ValueError("inplace_final_state=True needs a contiguous fp32, bf16 or fp16 initial_state, got "
                         f"{initial_state.dtype}{'' if initial_state.is_contiguous() else ' (not contiguous)'}")
    if initial_state.requires_grad and torch.is_grad_enabled():
        raise RuntimeError("inplace_final_state=True overwrites initial_state and has no backward; "
                           "call it under torch.no_grad() or on a state that does not require grad")
    return initial_state


def check_chunk_size(chunk_size) -> None:
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")


def check_devices(device, named) -> None:
    """Every ``(name, tensor or None)`` of ``named`` on q's ``device``."""
    for name, t in named:
        if t is not None and t.device != device:
            raise ValueError(f"{name} is on {t.device} but q is on {device}; all inputs must share a device")


def _row_scale(x, name: str, of: str, shape: tuple, rank_axis: bool) -> torch.Tensor | None:
    """A per-row factor of ``of``: [B, T, H] (every rank) or [B, T, H, R] -> [B, T, H, R]."""
    if x is None:
        return None
    check_float(x, name)
    B, T, H, R = shape
    if x.dim() == 3:
        check_shape(x, name, (B, T, H), "[B, T, H]")
        return x.unsqueeze(-1).expand(B, T, H, R)
    labels = f"[B, T, H] or [B, T, H, {'Rab' if of == 'a' else 'Rkv'}]" if rank_axis else "[B, T, H]"
    if x.dim() != 4 or not rank_axis and x.shape[-1] != 1:
        raise ValueError(f"{name} must have shape {labels} (one factor per row of {of}), got {list(x.shape)}")
    check_shape(x, name, shape, labels)
    return x


def _compiling() -> bool:
    return torch.compiler.is_compiling()


def canonicalize(q, k, v, a, b, g, scale, initial_state, cu_seqlens, chunk_size, mode,
                 a_scale=None, v_scale=None) -> Canonical:
    """Validate the arguments of :func:`rankdecay.ops.dplr` and bring them to canonical form."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    check_chunk_size(chunk_size)

    check_float(q, "q")
    if q.dim() != 4:
        raise ValueError(f"q must have shape [B, T, H, K], got {q.dim()} dims {list(q.shape)}")
    B, T, H, K = q.shape
    device = q.device

    check_float(k, "k")
    check_float(v, "v")
    if k.dim() != v.dim() or k.dim() not in (4, 5):
        raise ValueError(
            "k and v must both be [B, T, H, K] / [B, T, H, V] or both carry a rank axis "
            f"[B, T, H, Rkv, K] / [B, T, H, Rkv, V]; got k {list(k.shape)} and v {list(v.shape)}"
        )
    kv_rank_axis = k.dim() == 5
    if not kv_rank_axis:
        k, v = k.unsqueeze(3), v.unsqueeze(3)
    Rkv, V = v.shape[3], v.shape[4]
    if Rkv < 1:
        raise ValueError(f"the rank axis of k and v (Rkv) must be >= 1, got {Rkv}")
    check_shape(k, "k", (B, T, H, Rkv, K), "[B, T, H, Rkv, K]" if kv_rank_axis else "[B, T, H, K]")
    if not kv_rank_axis:
        check_shape(v, "v", (B, T, H, 1, V), "[B, T, H, V]")

    if (a is None) != (b is None):
        raise ValueError("a and b must be given together (both [B, T, H, Rab, K]) or both be None")
    if a is not None:
        check_float(a, "a")
        check_float(b, "b")
        if a.dim() != 5:
            raise ValueError(f"a must have shape [B, T, H, Rab, K], got {list(a.shape)}")
        Rab = a.shape[3]
        check_shape(a, "a", (B, T, H, Rab, K), "[B, T, H, Rab, K]")
        check_shape(b, "b", (B, T, H, Rab, K), "[B, T, H, Rab, K]")
        if Rab == 0:
            a = b = None

    if g is not None:
        check_float(g, "g")
        if g.dim() == 3:
            check_shape(g, "g", (B, T, H), "[B, T, H]")
            g = g.unsqueeze(-1)
        elif g.dim() == 4:
            check_shape(g, "g", (B, T, H, K), "[B, T, H, K]")
        else:
            raise ValueError(f"g must have shape [B, T, H] or [B, T, H, K], got {list(g.shape)}")

    scale = resolve_scale(scale, K)

    N, lengths = check_cu_seqlens(cu_seqlens, B, T)

    if initial_state is not None:
        check_float(initial_state, "initial_state")
        check_shape(initial_state, "initial_state", (N, H, K, V), "[N, H, K, V]")

    if a_scale is not None and a is None:
        raise ValueError("a_scale scales the rows of a, but a is None (Rab = 0)")
    a_scale = _row_scale(a_scale, "a_scale", "a", (B, T, H, a.shape[3]) if a is not None else (), True)
    v_scale = _row_scale(v_scale, "v_scale", "v", (B, T, H, Rkv), kv_rank_axis)

    check_devices(device, (("k", k), ("v", v), ("a", a), ("b", b), ("g", g), ("initial_state", initial_state),
                           ("a_scale", a_scale), ("v_scale", v_scale)))

    return Canonical(q, k, v, a, b, g, scale, initial_state, cu_seqlens, lengths, kv_rank_axis,
                     a_scale, v_scale)


@dataclass(frozen=True)
class Packing:
    """Where ``cu_seqlens``' tokens go when the sequences are laid out for the kernels: the packed input's token i
    goes to row ``dest[i] // cols``, column ``dest[i] % cols`` of a [rows, cols] layout whose other places are zero
    tokens (the identity step of the recurrence: no write, no low-rank term, no decay; so a state after them is the
    state at its sequence's end). ``dest`` is an injection, so both directions are an ``index_select`` and an
    ``index_copy_`` (no accumulating scatter, as indexing's backward would be). ``offsets``: the sequences' first
    places along the one row of :func:`varlen_aligned`'s layout, int32 [N + 1], and None for
    :func:`varlen_index`'s."""
    dest: torch.Tensor
    rows: int
    cols: int
    offsets: torch.Tensor | None = None


def sequence_ids(cu_seqlens: torch.Tensor, T: int, device=None) -> torch.Tensor:
    """The sequence each of T packed tokens belongs to ([T], int64, on ``device``, else cu_seqlens'), on the
    device: no sync, and under ``torch.compile`` no graph break."""
    cu = cu_seqlens.to(device=device if device is not None else cu_seqlens.device, dtype=torch.long)
    return torch.repeat_interleave(torch.arange(cu.shape[0] - 1, device=cu.device), cu[1:] - cu[:-1], output_size=T)


def _destinations(cu: torch.Tensor, starts: torch.Tensor, T: int) -> torch.Tensor:
    """dest [T]: sequence n's p-th token (``cu`` [N + 1], int64, its offsets) to ``starts[n] + p``; on the device."""
    seq = sequence_ids(cu, T)
    return starts[seq] + torch.arange(T, device=cu.device) - cu[seq]


def check_cu_seqlens(cu_seqlens: torch.Tensor | None, B: int, T: int) -> tuple[int, list[int] | None]:
    """The number of sequences N (B without ``cu_seqlens``) and their lengths on the host, ``cu_seqlens`` checked:
    an int32 / int64 tensor [N + 1] from 0 to T, non-decreasing, with B = 1. The values are read on the host (one
    sync), except under ``torch.compile``, where they are asserted on the device and the lengths are None."""
    if cu_seqlens is None:
        return B, None
    check_cu_seqlens_layout(cu_seqlens, B)
    if _compiling():
        # Reading the values on the host would break the graph here and make each new packing a constant of the
        # graph after it (a compile per packing); the chunked paths' layout needs none of them (varlen_aligned)
        lens = cu_seqlens[1:] - cu_seqlens[:-1]
        torch._assert_async((cu_seqlens[0] == 0) & (cu_seqlens[-1] == T) & (lens >= 0).all(),
                             "cu_seqlens must start at 0, end at T and be non-decreasing")
        return cu_seqlens.shape[0] - 1, None
    return cu_seqlens.shape[0] - 1, host_lengths(cu_seqlens, T)


def check_cu_seqlens_layout(cu_seqlens: torch.Tensor, B: int) -> int:
    """The number of sequences N, ``cu_seqlens``' type and shape checked ([N + 1], int32 / int64, B = 1) but not
    its values, which a layer leaves to the op after it: reading them on the host waits for the GPU, and under
    ``torch.inference_mode`` (no version counter, nothing remembered) each read would be one more wait."""
    _is_tensor(cu_seqlens, "cu_seqlens")
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"cu_seqlens must be an int32 or int64 tensor, got {cu_seqlens.dtype}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must be a 1-D tensor [N + 1] with N >= 1, got shape {list(cu_seqlens.shape)}")
    if B != 1:
        raise ValueError(f"with cu_seqlens, sequences are packed along T and B must be 1, got B = {B}")
    return cu_seqlens.shape[0] - 1


# the last cu_seqlens read on the host: (a weak reference to it, its version counter, T, its lengths)
_LAST_LENGTHS: tuple = (None, None, None, None)


def _read_waits(t: torch.Tensor) -> bool:
    """Whether reading t on the host waits for a device (so that :func:`host_lengths` remembers it)."""
    return t.device.type != "cpu"


def host_lengths(cu_seqlens: torch.Tensor, T: int) -> list[int]:
    """The sequences' lengths from ``cu_seqlens`` [N + 1] (checked: from 0 to T, non-decreasing), on the host.

    Reading a GPU tensor waits for the GPU: a model's layers all pass the same tensor, so the last one read is
    remembered (while it lives and is not written in place) and a forward waits once, not once per layer. A CPU
    tensor is read every time: that costs no wait, and a write through a NumPy view of it (``.numpy()``) would
    leave its version counter as it was."""
    global _LAST_LENGTHS
    try:
        version = cu_seqlens._version if _read_waits(cu_seqlens) else None
    except RuntimeError:  # an inference tensor keeps no version counter: read it every time
        version = None
    ref, last_version, last_T, lengths = _LAST_LENGTHS
    if version is not None and ref is not None and ref() is cu_seqlens and last_version == version and last_T == T:
        return list(lengths)
    offsets = cu_seqlens.tolist()
    if offsets[0] != 0 or offsets[-1] != T:
        raise ValueError(f"cu_seqlens must start at 0 and end at T = {T}, got {offsets[0]} ... {offsets[-1]}")
    lengths = [e - s for s, e in zip(offsets[:-1], offsets[1:])]
    if min(lengths) < 0:
        raise ValueError(f"cu_seqlens must be non-decreasing, got {offsets}")
    if version is not None:
        _LAST_LENGTHS = (weakref.ref(cu_seqlens), version, T, list(lengths))
    return lengths


def aligned_starts(lengths: list[int], align: int) -> list[int]:
    """Where :func:`varlen_aligned` lays each sequence, and the row's end: [N + 1], on the host."""
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] - (-n // align) * align)
    return starts


def aligned_row(T: int, N: int, align: int) -> int:
    """A row that holds any N sequences of T tokens in all laid by :func:`varlen_aligned`, from their sizes alone:
    each sequence's rounding adds at most ``align - 1`` tokens."""
    return -(-(T + N * (align - 1)) // align) * align


def varlen_index(cu_seqlens: torch.Tensor, lengths: list[int], device) -> Packing:
    """The packed sequences as a batch [N, max(lengths)], each right-padded with zero tokens."""
    cols = max(max(lengths), 1)
    cu = cu_seqlens.to(device=device, dtype=torch.long)
    return Packing(_destinations(cu, torch.arange(len(lengths), device=device) * cols, sum(lengths)), len(lengths),
                   cols)


def varlen_aligned(cu_seqlens: torch.Tensor, T: int, align: int, row: int, device) -> Packing:
    """The packed sequences laid along one row of ``row`` tokens, each from the multiple of ``align`` after the
    previous one (the fused kernels' ``offsets``), zero tokens between them and after the last, which extends to
    the row's end (its walk goes on over identity steps, so that every chunk of the row is walked). ``row``: at
    least ``aligned_starts(lengths, align)[-1]``, which it is when the lengths are known on the host, else
    :func:`aligned_row` (T + N (align - 1) at most, against N max(lengths) for :func:`varlen_index`'s layout).
    Computed on the device from ``cu_seqlens`` alone: no sync, and under ``torch.compile`` no graph break."""
    cu = cu_seqlens.to(device=device, dtype=torch.long)
    ends = torch.cumsum(-torch.div(cu[:-1] - cu[1:], align, rounding_mode="floor") * align, 0)
    # the last offset set to row by a mask (not row cat'd after ends[:-1]: a size N - 1, which Dynamo specialises at 1)
    offsets = torch.cat([ends.new_zeros(1), ends])
    offsets = torch.where(torch.arange(offsets.shape[0], device=device) == offsets.shape[0] - 1, row, offsets)
    return Packing(_destinations(cu, offsets, T), 1, row, offsets.to(torch.int32))


def row_packing(cu_seqlens: torch.Tensor, lengths: list[int] | None, T: int, align: int, device) -> Packing:
    """:func:`varlen_aligned`'s layout with its row: the exact one from the lengths on the host, or without them
    (``canonicalize`` leaves them None while compiling) :func:`aligned_row`'s bound."""
    row = aligned_row(T, cu_seqlens.shape[0] - 1, align) if lengths is None else aligned_starts(lengths, align)[-1]
    return varlen_aligned(cu_seqlens, T, align, row, device)


class _Spread(torch.autograd.Function):
    """[1, T, ...] -> [rows, cols, ...]: token i to place dest[i], zeros elsewhere."""

    @staticmethod
    def forward(ctx, x, dest, rows, cols):
        ctx.save_for_backward(dest)
        out = x.new_zeros((rows * cols,) + x.shape[2:])
        return out.index_copy_(0, dest, x[0]).view((rows, cols) + x.shape[2:])

    @staticmethod
    def backward(ctx, grad):
        (dest,) = ctx.saved_tensors
        return grad.flatten(0, 1).index_select(0, dest)[None], None, None, None


class _Collect(torch.autograd.Function):
    """[rows, cols, ...] -> [1, T, ...]: the inverse of :class:`_Spread`."""

    @staticmethod
    def forward(ctx, x, dest):
        ctx.save_for_backward(dest)
        ctx.layout = x.shape[:2]
        return x.flatten(0, 1).index_select(0, dest)[None]

    @staticmethod
    def backward(ctx, grad):
        (dest,) = ctx.saved_tensors
        rows, cols = ctx.layout
        out = grad.new_zeros((rows * cols,) + grad.shape[2:])
        return out.index_copy_(0, dest, grad[0]).view((rows, cols) + grad.shape[2:]), None


def pack_varlen(x: torch.Tensor | None, packing: Packing) -> torch.Tensor | None:
    """[1, T, ...] packed sequences -> [rows, cols, ...] in ``packing``'s layout, zero tokens between them."""
    if x is None:
        return None
    return _Spread.apply(x, packing.dest, packing.rows, packing.cols)


def unpack_varlen(x: torch.Tensor, packing: Packing) -> torch.Tensor:
    """[rows, cols, ...] -> [1, T, ...], the inverse of :func:`pack_varlen`."""
    return _Collect.apply(x, packing.dest)
