"""Which execution paths this installation can run."""
from __future__ import annotations

import importlib.util
import os

import torch


# looked up once, at import: a module constant is what torch.compile can trace through (find_spec is not)
_HAS_TRITON = importlib.util.find_spec("triton") is not None


def backends() -> dict[str, tuple[bool, str]]:
    """``{path: (available, why)}`` for the execution paths of ``dplr(mode=...)``.

    ``naive`` and ``chunk`` are PyTorch and always there; ``triton`` needs a CUDA GPU,
    the ``triton`` package and the kernels of this version of rankdecay.
    """
    out = {"naive": (True, "PyTorch per-token loop"), "chunk": (True, "PyTorch chunkwise WY/UT")}
    if not _HAS_TRITON:
        out["triton"] = (False, "the triton package is not installed (pip install triton)")
    elif torch.cuda.is_available():
        out["triton"] = (True, f"Triton kernels on {torch.cuda.get_device_name()}")
    elif interpreting():
        out["triton"] = (True, "Triton kernels under TRITON_INTERPRET=1 (CPU, slow: for tests)")
    else:
        out["triton"] = (False, "no CUDA device")
    return out


def interpreting() -> bool:
    """Whether Triton kernels run in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def triton_runs_on(x: torch.Tensor) -> bool:
    """Whether the Triton kernels can take tensors like ``x``: CUDA (or any device under
    the interpreter), with triton installed."""
    return _HAS_TRITON and (x.is_cuda or interpreting())


def active_autocast_dtype(x: torch.Tensor) -> torch.dtype | None:
    """Autocast's dtype where autocast is on for x's device, else None (also on devices autocast has no state for,
    such as meta, where asking raises)."""
    device = x.device.type
    if torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return None


# Log-gates below this count as it on the chunked paths (PyTorch and Triton), where decays are exps of differences of
# log-cumsums: e^-1000 is 0 in fp64 as in fp32, so every decay over such a step is 0 as it would be, while -inf
# (a gate of 0, "forget") made the differences inf - inf = NaN and -1e30 swallowed the other gates of its chunk's
# log-cumsums. The per-token paths multiply by e^g and need no floor.
LOG_GATE_FLOOR = -1000.0


def resolve_mode(mode: str, q: torch.Tensor, compute_dtype: torch.dtype) -> str:
    """``mode`` with "auto" made concrete: "triton" for fp32-computed CUDA tensors when triton is
    installed, else "chunk"; any other mode is returned as given, but "triton" for inputs without tokens (B or T
    zero): those take "chunk" (nothing to launch; the kernels' backward has no empty form), which returns the state
    as it came in, and its gradient as the final state's."""
    if mode in ("auto", "triton") and (q.shape[0] == 0 or q.shape[1] == 0):
        return "chunk"
    if mode != "auto":
        return mode
    return "triton" if compute_dtype == torch.float32 and q.is_cuda and triton_runs_on(q) else "chunk"


def recurrent_mode(x: torch.Tensor) -> str:
    """The per-token path for inputs like ``x``: ``"fused_recurrent"`` (the Triton kernel) for
    inference on a GPU, else ``"naive"`` (the PyTorch loop, with autograd and fp64)."""
    fused = x.is_cuda and x.dtype != torch.float64 and not torch.is_grad_enabled() and triton_runs_on(x)
    return "fused_recurrent" if fused else "naive"


def chunk_flops_per_token(K: int, V: int, chunk_size: int = 64, Rab: int = 0, Rkv: int = 1) -> float:
    """Forward FLOPs per token and head of the chunked algorithm (2 per multiply-add).

    Intra-chunk: the causal halves of the [C, C] decayed products of q and b against
    [k, a] and their use on v and U; the state: reading it (q S, W S), writing it
    (k^T v, a^T U) and the decay; the UT transform's triangular solve. The backward
    is about twice this.
    """
    C, cols = chunk_size, Rkv + Rab
    intra = C * K * (1 + Rab) * cols + C * V * cols
    state = 2 * K * V * (1 + cols + Rab)
    ut = C * Rab * Rab * (K + V) if Rab else 0
    return float(intra + state + ut)


def needs_grad(tensors) -> bool:
    """Whether autograd will record an op on these tensors (None entries are skipped)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def check_triton_mode(mode: str, q: torch.Tensor, tensors, compute_dtype: torch.dtype) -> None:
    """Clear errors when ``mode`` ("triton" / "fused_recurrent") cannot run on these inputs."""
    if compute_dtype != torch.float32:
        raise ValueError(f"mode={mode!r} computes in fp32; fp64 inputs take mode='chunk' or 'naive'")
    if not triton_runs_on(q):
        raise RuntimeError(f"mode={mode!r} needs triton and a CUDA tensor (or TRITON_INTERPRET=1); "
                           f"{backends()['triton'][1]}")
    if mode == "fused_recurrent" and needs_grad(tensors):
        raise RuntimeError("mode='fused_recurrent' is for inference (it has no backward); "
                           "use mode='auto' or 'chunk' to train, or run under torch.no_grad()")
