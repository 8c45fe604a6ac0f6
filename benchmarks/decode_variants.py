"""Launch configurations of the GDN decode kernel, timed as CUDA graph replays (GPU time only).

    python benchmarks/decode_variants.py [--batches 1 64] [--bv 16 32 64] [--warps 1 2 4 8]
                                         [--state-dtypes float32 bfloat16]

One token of the layers' decode step (``ops.gated_delta_rule_decode``, gates formed in the kernel),
H=16, K=V=128, bf16 inputs, the state read and written back in place in each state dtype (what a
decode step moves: 2 x B x 1 MB in fp32, half that in bf16), under ``fused_recurrent._LAUNCH``'s
value block and warps. Prints microseconds and the achieved bandwidth per config.
"""
from __future__ import annotations

import argparse

import torch

import rankdecay.ops.triton.fused_recurrent as fr
from rankdecay import ops

try:
    from kernels import bench, graphed, make_decode_raw
except ImportError:  # run from the repository root
    from benchmarks.kernels import bench, graphed, make_decode_raw


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 64])
    parser.add_argument("--bv", nargs="+", type=int, default=[16, 32, 64])
    parser.add_argument("--warps", nargs="+", type=int, default=[1, 2, 4, 8])
    parser.add_argument("--state-dtypes", nargs="+", default=["float32", "bfloat16"],
                        choices=["float32", "bfloat16", "float16"])
    args = parser.parse_args()
    H, K, V = 16, 128, 128
    print("| state | B | BV | warps | us | GB/s |\n|---|---:|---:|---:|---:|---:|")
    for name in args.state_dtypes:
        for B in args.batches:
            x = make_decode_raw(B, 1, H, K, V, "cuda", torch.bfloat16, state_dtype=getattr(torch, name))
            moved = 2 * x["initial_state"].numel() * x["initial_state"].element_size()
            for bv in args.bv:
                for warps in args.warps:
                    fr._LAUNCH.update(bv=bv, warps=warps)

                    def launch():
                        with torch.no_grad():
                            ops.gated_delta_rule_decode(**x, inplace_final_state=True, mode="fused_recurrent")

                    us = bench(graphed(launch), reps=50)["ms"] * 1e3
                    print(f"| {name} | {B} | {bv} | {warps} | {us:.1f} | {moved / us / 1e3:.0f} |", flush=True)
    fr._LAUNCH.clear()


if __name__ == "__main__":
    main()
