"""One call of a benchmarks/kernels.py case, for Nsight Compute: the compiled kernels run once to warm up,
then once between ``cudaProfilerStart`` and ``cudaProfilerStop``.

    ncu --profile-from-start off --clock-control none --section SpeedOfLight ... \
        python benchmarks/ncu_op.py gdn [--backward] [--shape B T H K V] [--matmul-precision medium] [--peer fla]
                                   [--knob NAME VALUE]
"""
from __future__ import annotations

import argparse
import ast

import torch

from rankdecay.ops.triton import chunk_fwd
from kernels import CASES, make_step  # noqa: E402  (run from benchmarks/ or with it on sys.path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("case", choices=list(CASES))
    parser.add_argument("--backward", action="store_true")
    parser.add_argument("--peer", help="profile this peer of the case (fla, sdpa) instead of ours")
    parser.add_argument("--knob", nargs=2, action="append", default=[], metavar=("NAME", "VALUE"),
                        help="set chunk_fwd._KNOBS[NAME] = VALUE (a Python literal) first")
    parser.add_argument("--shape", nargs=5, type=int, default=[8, 2048, 16, 128, 128])
    parser.add_argument("--matmul-precision", choices=["highest", "high", "medium"], default="medium")
    args = parser.parse_args()
    torch.set_float32_matmul_precision(args.matmul_precision)
    for name, value in args.knob:
        chunk_fwd._KNOBS[name] = ast.literal_eval(value)
    case = CASES[args.case]
    call = case.peers[args.peer] if args.peer else case.ours
    step = make_step(call, case.make(*args.shape, "cuda", torch.bfloat16), args.backward)
    step()  # compile
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    step()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


if __name__ == "__main__":
    main()
