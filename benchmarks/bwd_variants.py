"""Backward kernels under launch knobs: per-kernel GPU time of one case's forward+backward.

    python benchmarks/bwd_variants.py gdn gla [--set grad=8 grad_bk=16 ...]

Profiles ``kernels.py``'s case (B8 T2048 H16 K=V=128 bf16) with the default knobs of
``rankdecay.ops.triton.chunk_bwd._CONFIG``, then with each override given, and prints the
milliseconds per call of every Triton kernel.
"""
from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

import rankdecay.ops.triton.chunk_bwd as cb
from kernels import CASES, measure  # noqa: E402  (run from benchmarks/)


def per_kernel(case, inputs, reps=5) -> dict:
    measure(case.ours, inputs, True)  # compile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            out = case.ours({k: v.detach().requires_grad_(v.is_floating_point() and k != "mask")
                             for k, v in inputs.items()})
            out.float().sum().backward()
        torch.cuda.synchronize()
    return {e.key: e.device_time_total / 1e3 / reps for e in prof.key_averages() if "kernel" in e.key and
            e.key.startswith("_")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cases", nargs="+", choices=list(CASES))
    parser.add_argument("--set", nargs="*", default=[], help="overrides, e.g. grad=8 grad_bk=16")
    args = parser.parse_args()
    for name in args.cases:
        case = CASES[name]
        inputs = case.make(8, 2048, 16, 128, 128, "cuda", torch.bfloat16)
        default = dict(cb._CONFIG)
        for label, override in [("default", {})] + [(w, {w.split("=")[0]: int(w.split("=")[1])}) for w in args.set]:
            cb._CONFIG.update(default, **override)
            times = per_kernel(case, inputs)
            print(f"{name} {label}: " + ", ".join(f"{k} {v:.3f} ms" for k, v in sorted(times.items())), flush=True)
        cb._CONFIG.update(default)


if __name__ == "__main__":
    main()
