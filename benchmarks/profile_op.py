"""Where an op's GPU time goes: torch.profiler's table for one case of benchmarks/kernels.py.

    python benchmarks/profile_op.py gdn [--backward] [--shape B T H K V] [--rows 25] [--matmul-precision medium]
"""
from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from kernels import CASES, measure  # noqa: E402  (run from benchmarks/ or with it on sys.path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("case", choices=list(CASES))
    parser.add_argument("--backward", action="store_true")
    parser.add_argument("--shape", nargs=5, type=int, default=[8, 2048, 16, 128, 128])
    parser.add_argument("--rows", type=int, default=25)
    parser.add_argument("--matmul-precision", choices=["highest", "high", "medium"], default="highest")
    args = parser.parse_args()
    torch.set_float32_matmul_precision(args.matmul_precision)
    case = CASES[args.case]
    inputs = case.make(*args.shape, "cuda", torch.bfloat16)
    measure(case.ours, inputs, args.backward)  # warm up, compile
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        measure(case.ours, inputs, args.backward)
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.rows, max_name_column_width=60))


if __name__ == "__main__":
    main()
