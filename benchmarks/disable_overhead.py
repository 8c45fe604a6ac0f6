"""What the kernels' entry points' torch.compile wrappers cost the host in eager calls (no torch.compile).

    python benchmarks/disable_overhead.py      # on a CUDA GPU (the first part runs anywhere)

The chunked entry points are opaque operators under torch.compile (``rankdecay.ops.triton.opaque``; until session
72 they were ``torch.compiler.disable``d). Eagerly their wrappers only ask ``torch.compiler.is_compiling()`` and
call through. This times a trivial function plain, ``torch.compiler.disable``d and wrapped by ``opaque``, then Gated
DeltaNet's forward (B8 T2048 H16 K=V=128, bf16, matmul precision "medium": host-bound when the host is slow) with
the wrappers in place and with every one of them in ``rankdecay``'s modules replaced by the function it wraps.
"host" is the time to issue a call, "wall" the time per call once the GPU has finished.
"""
from __future__ import annotations

import sys
import time

import torch
import torch.nn.functional as F

import rankdecay.ops as ops
import rankdecay.ops.triton  # noqa: F401  (every module holding a wrapped entry point)
from rankdecay.ops.triton.opaque import _CALLS, OpaqueFunction, opaque


def _trivial(x):
    return x


def per_call_us(fn, x, n: int = 20000) -> float:
    t = time.perf_counter()
    for _ in range(n):
        fn(x)
    return (time.perf_counter() - t) / n * 1e6


def unwrap() -> int:
    """Replace each ``opaque`` wrapper in rankdecay's modules by the function it wraps, and each ``OpaqueFunction``
    by its autograd Function."""
    n = 0
    for name, mod in list(sys.modules.items()):
        if name.startswith("rankdecay"):
            for attr, val in list(vars(mod).items()):
                orig = val.function if isinstance(val, OpaqueFunction) else getattr(val, "__wrapped__", None)
                if orig is not None and (isinstance(val, OpaqueFunction)
                                         or f"{val.__module__}.{val.__qualname__}" in _CALLS):
                    setattr(mod, attr, orig)
                    n += 1
    return n


def main() -> None:
    disabled = torch.compiler.disable(_trivial)
    wrapped = opaque(1)(_trivial)
    x = torch.zeros(1)
    for fn, label in ((_trivial, "plain"), (disabled, "torch.compiler.disable"), (wrapped, "opaque")) * 2:
        print(f"trivial call {label}: {per_call_us(fn, x):.2f} us")
    if not torch.cuda.is_available():
        return

    torch.set_float32_matmul_precision("medium")
    B, T, H, K, V = 8, 2048, 16, 128, 128
    q = torch.randn(B, T, H, K, device="cuda", dtype=torch.bfloat16)
    k = F.normalize(torch.randn(B, T, H, K, device="cuda"), dim=-1).bfloat16()
    v = torch.randn(B, T, H, V, device="cuda", dtype=torch.bfloat16)
    g = F.logsigmoid(torch.randn(B, T, H, device="cuda") + 3)
    beta = torch.rand(B, T, H, device="cuda").bfloat16()

    @torch.no_grad()
    def host_and_wall_ms(n: int = 50) -> tuple[float, float]:
        for _ in range(5):
            ops.gated_delta_rule(q, k, v, g, beta)
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(n):
            ops.gated_delta_rule(q, k, v, g, beta)
        host = (time.perf_counter() - t) / n * 1e3
        torch.cuda.synchronize()
        return host, (time.perf_counter() - t) / n * 1e3

    for label in ("wrapped", "unwrapped"):
        if label == "unwrapped":
            print(f"unwrapped {unwrap()} names")
        for _ in range(2):
            host, wall = host_and_wall_ms()
            print(f"GDN forward {label}: host {host:.3f} ms per call, wall {wall:.3f} ms per call")


if __name__ == "__main__":
    main()
