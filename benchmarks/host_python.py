"""Our Python's host time per Gated DeltaNet forward on the Triton path, with every kernel launch a no-op.

    TRITON_INTERPRET=1 python benchmarks/host_python.py [LABEL]

Runs on the CPU: the interpreter lets CPU tensors take the Triton path, and each launch (``kernel[grid](...)``)
is replaced by a stub that only counts it, so what is timed is our wrappers, checks and allocations alone. Small
shapes (B1 T64 H2 K=V=128, bf16) keep the PyTorch work around the launches negligible. Run it at two commits (a
``git worktree`` each) to see whether a change added host work: on a GPU machine whose host is slow, a host-bound
row of ``kernels.py`` cannot tell our code from the launch path (BENCHMARKS.md, session 64).
"""
from __future__ import annotations

import sys
import time

import torch
import torch.nn.functional as F
import triton.runtime.autotuner as autotuner
import triton.runtime.interpreter as interpreter
import triton.runtime.jit as jit

LAUNCHES = [0]


class _Stub:
    def __init__(self, fn):
        self.fn = fn

    def __call__(self, *args, **kwargs):
        LAUNCHES[0] += 1


for cls in (jit.JITFunction, interpreter.InterpretedFunction, autotuner.Autotuner):
    cls.__getitem__ = lambda self, grid: _Stub(self)

from rankdecay import ops  # noqa: E402  (after the stubs)


def main() -> None:
    label = sys.argv[1] if len(sys.argv) > 1 else "this tree"
    torch.set_float32_matmul_precision("medium")
    B, T, H, K, V = 1, 64, 2, 128, 128
    q = torch.randn(B, T, H, K, dtype=torch.bfloat16)
    k = F.normalize(torch.randn(B, T, H, K), dim=-1).bfloat16()
    v = torch.randn(B, T, H, V, dtype=torch.bfloat16)
    g = F.logsigmoid(torch.randn(B, T, H) + 3)
    beta = torch.rand(B, T, H).bfloat16()
    n = 200
    with torch.no_grad():
        for _ in range(3):
            ops.gated_delta_rule(q, k, v, g, beta, mode="triton")
        LAUNCHES[0] = 0
        t = time.perf_counter()
        for _ in range(n):
            ops.gated_delta_rule(q, k, v, g, beta, mode="triton")
        ms = (time.perf_counter() - t) / n * 1e3
    print(f"{label}: {ms:.3f} ms per forward (launches stubbed), {LAUNCHES[0] / n:.0f} launches")


if __name__ == "__main__":
    main()
