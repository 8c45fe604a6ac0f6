"""The short convolution's Triton kernels on a GPU, under tile shapes: forward and backward times.

    python benchmarks/conv_backward.py [--shapes 8x2048x512 8x2048x1024] [--kernel-size 4] [--packed]
    python benchmarks/conv_backward.py --configs 16x64x1 32x128x4 --breakdown   # tiles: tokens x channels x warps

The backward is ``ops.triton.conv._ShortConv.backward`` alone (no autograd graph around it: g = dy * act'(pre) and
the filters' partial gradients, then dx from g, then the partials summed), the forward ``short_conv`` without
autograd; each timed as a CUDA graph (``triton.testing.do_bench_cudagraph``: the device's time, not the host's
launches), bf16, silu. Beside them the bytes the backward moves at the least (x and dy read, dx written in bf16, g
written and read in fp32) as a time at --peak-tbs. --configs times every shape once per tile shape of the three
kernels (``CONV_BT``, ``CONV_BD``, warps; default: the module's); --breakdown prints each kernel's µs per call
(torch.profiler over 20 calls). Markdown on stdout; --json writes the rows.

Session 85 (H200) measured a one-kernel backward here too (g_{t+i} recomputed where dx reads it, g never stored):
slower at every tile shape tried (best 0.100 ms against the two kernels' 0.074 at D = 512), so not kept.
"""
from __future__ import annotations

import argparse
import json
from types import SimpleNamespace

import torch
import triton.testing

from rankdecay.ops.triton import conv


def breakdown(fn, calls: int = 20) -> dict[str, float]:
    """µs per call of each kernel ``fn`` launches (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return {e.key[:60]: e.device_time_total / calls for e in prof.key_averages()
            if e.device_type.name == "CUDA" and e.device_time_total}


def run(B: int, T: int, D: int, kernel_size: int, packed: bool, peak: float, show: bool) -> dict:
    torch.manual_seed(0)
    x = torch.randn(B, T, D, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(D, kernel_size, device="cuda", dtype=torch.bfloat16) / kernel_size
    dy = torch.randn_like(x)
    cu = seq = None
    if packed:  # the rows' tokens as one packed row of sequences of 1/4, 1/4 and 1/2 of a row each
        x, dy = x.view(1, B * T, D), dy.view(1, B * T, D)
        lengths = [T // 4, T // 4, T - T // 2] * B
        cu = torch.tensor([0] + lengths, device="cuda").cumsum(0).to(torch.int32)
        seq = torch.repeat_interleave(torch.arange(len(lengths), device="cuda", dtype=torch.int32),
                                      torch.tensor(lengths, device="cuda"))
    ctx = SimpleNamespace(saved_tensors=(x, weight, None, cu, seq), silu=True, needs_input_grad=(True,) * 6)

    def backward():
        return conv._ShortConv.backward(ctx, dy)

    tiles = f"{conv.CONV_BT}x{conv.CONV_BD}x{conv.CONV_WARPS}"
    bwd = triton.testing.do_bench_cudagraph(backward, rep=200)
    fwd = triton.testing.do_bench_cudagraph(lambda: conv.short_conv(x, weight, cu_seqlens=cu, seq=seq), rep=200)
    if show:
        print(f"{B}x{T}x{D}{' packed' if packed else ''}, tiles {tiles}: " +
              ", ".join(f"{k} {v:.1f} µs" for k, v in sorted(breakdown(backward).items(), key=lambda kv: -kv[1])))
    floor = 14 * x.numel() / peak / 1e9  # bytes: x, dy, dx in bf16; g out and back in fp32
    return dict(shape=f"{B}x{T}x{D}", tiles=tiles, kernel_size=kernel_size, packed=packed, forward_ms=fwd,
                backward_ms=bwd, backward_floor_ms=floor)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=["8x2048x512", "8x2048x1024"], metavar="BxTxD")
    parser.add_argument("--kernel-size", type=int, default=4)
    parser.add_argument("--packed", action="store_true", help="also each shape as packed sequences")
    parser.add_argument("--peak-tbs", type=float, default=4.8, help="the device's DRAM bandwidth, TB/s (H200)")
    parser.add_argument("--configs", nargs="+", default=None, metavar="BTxBDxWARPS",
                        help="tile shapes to time (default: the module's)")
    parser.add_argument("--breakdown", action="store_true", help="print each kernel's time per call")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("conv_backward.py times Triton kernels on a GPU; none is available")
    default = (conv.CONV_BT, conv.CONV_BD, conv.CONV_WARPS)
    rows = []
    try:
        for tiles in args.configs or ["x".join(map(str, default))]:
            conv.CONV_BT, conv.CONV_BD, conv.CONV_WARPS = (int(v) for v in tiles.split("x"))
            for shape in args.shapes:
                B, T, D = (int(v) for v in shape.split("x"))
                for packed in (False, True) if args.packed else (False,):
                    rows.append(run(B, T, D, args.kernel_size, packed, args.peak_tbs, args.breakdown))
    finally:
        conv.CONV_BT, conv.CONV_BD, conv.CONV_WARPS = default
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}\n")
    print("| shape | tiles | taps | packed | forward ms | backward ms | backward's bytes at peak, ms |")
    print("|---|---|---:|---|---:|---:|---:|")
    for r in rows:
        print(f"| {r['shape']} | {r['tiles']} | {r['kernel_size']} | {r['packed']} | {r['forward_ms']:.3f} | "
              f"{r['backward_ms']:.3f} | {r['backward_floor_ms']:.3f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
