"""Does the fused path run, and agree, where ``dplr._fused_applies`` keeps the unfused one?

    python benchmarks/probe_fused.py hdla [--shape B T H K V] [--matmul-precision medium] [--backward]

Forces the fused Triton kernels for one case of ``kernels.py`` (HDLA: per-channel gates with a
low-rank decay), runs forward (and backward) once against the unfused path at the same
precision, and prints the relative error and both times. Run it in its own process: a kernel
fault ends the process.
"""
from __future__ import annotations

import argparse
import importlib

import torch

from kernels import CASES, measure  # noqa: E402  (run from benchmarks/)

dplr = importlib.import_module("rankdecay.ops.dplr")  # the module (rankdecay.ops.dplr is also the function)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("case", choices=list(CASES))
    parser.add_argument("--shape", nargs=5, type=int, default=[8, 2048, 16, 128, 128])
    parser.add_argument("--matmul-precision", choices=["highest", "high", "medium"], default="highest")
    parser.add_argument("--backward", action="store_true")
    args = parser.parse_args()
    torch.set_float32_matmul_precision(args.matmul_precision)
    case = CASES[args.case]
    x = case.make(*args.shape, "cuda", torch.bfloat16)
    unfused = dplr._fused_applies

    def run(force: bool):
        dplr._fused_applies = (lambda *a: True) if force else unfused
        leaves = {k: (v.detach().requires_grad_(args.backward) if v.is_floating_point() and k != "mask" else v)
                  for k, v in x.items()}
        o = case.ours(leaves)
        grads = []
        if args.backward:
            o.float().square().sum().backward()
            grads = [v.grad for v in leaves.values() if v.grad is not None]
        torch.cuda.synchronize()
        t = measure(case.ours, x, args.backward)["ms"]
        return [o.float()] + [g.float() for g in grads], t

    ref, t_ref = run(False)
    out, t_fused = run(True)
    errs = [((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item() for a, b in zip(out, ref)]
    print(f"{args.case} {args.shape} fused {t_fused:.3f} ms, unfused {t_ref:.3f} ms, "
          f"max rel err (out, grads...) {['%.2e' % e for e in errs]}", flush=True)


if __name__ == "__main__":
    main()
