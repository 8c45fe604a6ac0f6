"""Launch configurations of the GDN decode kernel, timed as CUDA graph replays (GPU time only).

    python benchmarks/decode_variants.py [--batches 1 64] [--bv 16 32 64] [--warps 1 2 4 8]

One token, H=16, K=V=128, bf16 inputs, fp32 state read and a new fp32 state written (what a
decode step moves: 2 x B x 1 MB). Prints microseconds and the achieved bandwidth per config.
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from rankdecay.ops.triton.fused_recurrent import _fused_recurrent_gdn_kernel

try:
    from kernels import bench, graphed
except ImportError:  # run from the repository root
    from benchmarks.kernels import bench, graphed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 64])
    parser.add_argument("--bv", nargs="+", type=int, default=[16, 32, 64])
    parser.add_argument("--warps", nargs="+", type=int, default=[1, 2, 4, 8])
    args = parser.parse_args()
    H, K, V = 16, 128, 128
    print("| B | BV | warps | us | GB/s |\n|---:|---:|---:|---:|---:|")
    for B in args.batches:
        q = torch.randn(B, 1, H, K, device="cuda", dtype=torch.bfloat16)
        k = F.normalize(torch.randn(B, 1, H, 1, K, device="cuda"), dim=-1).to(torch.bfloat16)
        v = torch.randn(B, 1, H, 1, V, device="cuda", dtype=torch.bfloat16)
        g = F.logsigmoid(torch.randn(B, 1, H, 1, device="cuda"))
        beta = torch.rand(B, 1, H, device="cuda", dtype=torch.bfloat16)
        h0 = torch.randn(B, H, K, V, device="cuda")
        o, ht = torch.empty_like(v[:, :, :, 0]), torch.empty_like(h0)
        moved = 2 * h0.numel() * 4
        for bv in args.bv:
            for warps in args.warps:
                def launch(bv=bv, warps=warps):
                    _fused_recurrent_gdn_kernel[(V // bv, B * H)](
                        q, k, v, beta, g, h0, o, ht, K ** -0.5, 1, H=H, K=K, V=V, BK=K, BV=bv, GATE=1, HAS_H0=True,
                        num_warps=warps)
                us = bench(graphed(launch), reps=50)["ms"] * 1e3
                print(f"| {B} | {bv} | {warps} | {us:.1f} | {moved / us / 1e3:.0f} |", flush=True)


if __name__ == "__main__":
    main()
