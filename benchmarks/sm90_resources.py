"""Registers, spills and shared memory of the fused forward's kernels on Hopper, compiled on this machine.

    python benchmarks/sm90_resources.py [--shape B T H K V] [--knob NAME=VALUE ...]

No GPU needed: runs ``chunk_fwd.chunk_dplr_fwd`` for Gated DeltaNet (tied keys, bf16 inputs, the "medium"
precision, outputs from the state kernel, no backward: the scaled form) on CPU tensors with its Triton
launches captured instead of run, compiles each captured launch for sm_90 (``triton.compile`` on an
``ASTSource`` with ``GPUTarget("cuda", 90, 32)``), and reads the cubin's resource usage with the
``cuobjdump`` that Triton ships. A launch's knobs (``chunk_fwd._KNOBS``: intra_warps, intra_maxnreg,
state_stages, scaled, merge, ...) change what is compiled. Install the Triton version of the GPU you
compare with (the H100 image: 3.6.0); register counts differ between versions.
"""
from __future__ import annotations

import argparse
import ast
import os
import subprocess
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler.compiler import ASTSource

from rankdecay.ops.triton import chunk_fwd

TYPES = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32", torch.float64: "*fp64"}
KERNELS = ("_intra_kernel", "_state_fwd_kernel", "_output_kernel")


def capture(shape, knobs: dict) -> dict:
    """The launches ``chunk_dplr_fwd`` makes for GDN on CPU tensors, as {name: (fn, args, kwargs)}."""
    launches, saved = {}, {n: getattr(chunk_fwd, n) for n in KERNELS}

    class Capture:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            return lambda *args, **kw: launches.__setitem__(self.name, (saved[self.name], args, kw))

    B, T, H, K, V = shape
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(B, T, H, K, generator=gen).bfloat16() for _ in range(2))
    v = torch.randn(B, T, H, V, generator=gen).bfloat16()
    g, beta = -torch.rand(B, T, H, 1, generator=gen), torch.rand(B, T, H, generator=gen)
    k1 = k[..., None, :]
    cfg = dict(precision="bf16", state_precision="bf16", stored=torch.bfloat16, fuse_output=True, **knobs)
    try:
        for n in KERNELS:
            setattr(chunk_fwd, n, Capture(n))
        chunk_fwd.chunk_dplr_fwd(q, k1, v[..., None, :], k1, k1, g, K ** -0.5, None, _config=cfg,
                                 a_scale=(beta * g[..., 0].exp())[..., None], v_scale=beta[..., None])
    finally:
        for n, fn in saved.items():
            setattr(chunk_fwd, n, fn)
    return launches


def compile_sm90(fn, args, kw) -> tuple:
    """Compile one captured launch for sm_90, as the JIT would on an H100 (16-bit products in their dtype,
    16-byte aligned pointers); returns (cuobjdump's resource line, shared bytes, warps, stages)."""
    kw = dict(kw)
    options = {o: kw.pop(o) for o in ("num_warps", "num_stages", "maxnreg") if o in kw}
    for flag in ("LP_QK", "LP_QA", "LP_BA", "LP_BK"):  # the interpreter's bf16 stand-in turns these off
        if flag in kw and kw.get("RAB", 1) > 0:
            kw[flag] = True
    values = dict(zip(fn.arg_names, args), **kw)
    signature, constants, attrs = {}, {}, {}
    for i, (name, param) in enumerate(zip(fn.arg_names, fn.params)):
        x = values.get(name, param.default)
        if param.is_constexpr or x is None:
            signature[name], constants[name] = "constexpr", x
        elif isinstance(x, torch.Tensor):
            signature[name], attrs[(i,)] = TYPES[x.dtype], [["tt.divisibility", 16]]
        elif isinstance(x, bool):
            signature[name] = "i1"
        elif isinstance(x, int):
            signature[name] = "i32"
            if x % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            signature[name] = "fp32"
    if constants.get("PRECISION") == "bf16_ieee":
        constants["PRECISION"] = "bf16"
    kernel = triton.compile(ASTSource(fn, signature, constants, attrs), target=GPUTarget("cuda", 90, 32),
                            options=options)
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        usage = subprocess.run([cuobjdump, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    line = next(ln.strip() for ln in usage.splitlines() if "REG:" in ln)
    return line, kernel.metadata.shared, options.get("num_warps", 4), options.get("num_stages", 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", nargs=5, type=int, default=[1, 256, 2, 128, 128], metavar=("B", "T", "H", "K", "V"))
    parser.add_argument("--knob", nargs="*", default=[], metavar="NAME=VALUE", help="chunk_fwd._KNOBS, Python literals")
    args = parser.parse_args()
    knobs = {name: ast.literal_eval(value) for name, value in (kv.split("=", 1) for kv in args.knob)}
    print(f"Triton {triton.__version__}, sm_90, GDN forward {args.shape}, knobs {knobs or 'none'}")
    for name, (fn, a, kw) in capture(args.shape, knobs).items():
        line, shared, warps, stages = compile_sm90(fn, a, kw)
        print(f"{name}: {line} | shared {shared} B, {warps} warps, {stages} stages")


if __name__ == "__main__":
    main()
