"""Where the host's time goes in one case of benchmarks/kernels.py: cProfile over repeated calls.

    python benchmarks/host_profile.py gdn [--backward] [--reps 50] [--rows 30] [--matmul-precision medium]

The GPU runs asynchronously, so a call whose host time exceeds its GPU time is launch-bound
(``kernels.py``'s "host ms" column); this says which Python functions that host time is spent in.
"""
from __future__ import annotations

import argparse
import cProfile
import pstats

import torch

from kernels import CASES  # noqa: E402  (run from benchmarks/)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("case", choices=list(CASES))
    parser.add_argument("--backward", action="store_true")
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--rows", type=int, default=30)
    parser.add_argument("--matmul-precision", choices=["highest", "high", "medium"], default="highest")
    args = parser.parse_args()
    torch.set_float32_matmul_precision(args.matmul_precision)
    case = CASES[args.case]
    x = {k: (v.requires_grad_(args.backward) if v.is_floating_point() and k != "mask" else v)
         for k, v in case.make(8, 2048, 16, 128, 128, "cuda", torch.bfloat16).items()}

    def step():
        if args.backward:
            o = case.ours(x)
            o.backward(torch.ones_like(o))
        else:
            with torch.no_grad():
                case.ours(x)

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    for _ in range(args.reps):  # the GPU drained between calls, so no launch waits on a full queue
        prof.enable()
        step()
        prof.disable()
        torch.cuda.synchronize()
    stats = pstats.Stats(prof)
    print(f"host seconds per call: {stats.total_tt / args.reps * 1e3:.3f} ms")
    stats.sort_stats("tottime").print_stats(args.rows)


if __name__ == "__main__":
    main()
