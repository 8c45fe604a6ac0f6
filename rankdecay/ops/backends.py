"""Which execution paths this installation can run."""
from __future__ import annotations

import importlib.util

import torch


def backends() -> dict[str, tuple[bool, str]]:
    """``{path: (available, why)}`` for the execution paths of ``dplr(mode=...)``.

    ``naive`` and ``chunk`` are PyTorch and always there; ``triton`` needs a CUDA GPU,
    the ``triton`` package and the kernels of this version of rankdecay.
    """
    out = {"naive": (True, "PyTorch per-token loop"), "chunk": (True, "PyTorch chunkwise WY/UT")}
    has_kernels = importlib.util.find_spec("rankdecay.ops.triton") is not None
    if not has_kernels:
        out["triton"] = (False, "no Triton kernels in this version of rankdecay")
    elif importlib.util.find_spec("triton") is None:
        out["triton"] = (False, "the triton package is not installed")
    elif not torch.cuda.is_available():
        out["triton"] = (False, "no CUDA device")
    else:
        out["triton"] = (True, f"Triton kernels on {torch.cuda.get_device_name()}")
    return out
