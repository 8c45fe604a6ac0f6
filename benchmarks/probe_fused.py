"""Does the fused path run, and agree with the unfused one (``dplr._fused_applies`` forced either way)?

    python benchmarks/probe_fused.py hdla [--shape B T H K V] [--matmul-precision medium] [--backward]
        [--knob intra_warps 8] [--knob intra_bk 16]

Runs one case of ``kernels.py`` (HDLA: per-channel gates with a low-rank decay) forward (and
backward) through the fused Triton kernels and through the unfused path at the same precision,
and prints the relative error and both times; ``--knob`` tries other launch parameters. Run it
in its own process: a kernel fault ends the process.
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
    parser.add_argument("--knob", nargs=2, action="append", default=[], metavar=("NAME", "VALUE"),
                        help="a launch knob of the fused kernels (chunk_fwd._KNOBS, chunk_bwd._CONFIG, or with a ch_ "
                        "prefix channel._CHANNEL), e.g. --knob intra_bk 64, --knob ch_rows 32")
    args = parser.parse_args()
    fwd = importlib.import_module("rankdecay.ops.triton.chunk_fwd")
    bwd = importlib.import_module("rankdecay.ops.triton.chunk_bwd")
    channel = importlib.import_module("rankdecay.ops.triton.channel")
    for name, value in args.knob:
        if name.startswith("ch_"):  # channel._CHANNEL (the per-channel products)
            knobs, name = channel._CHANNEL, name[3:]
        else:
            knobs = bwd._CONFIG if name in bwd._CONFIG else fwd._KNOBS
        knobs[name] = int(value) if value.lstrip("-").isdigit() else value
    torch.set_float32_matmul_precision(args.matmul_precision)
    case = CASES[args.case]
    x = case.make(*args.shape, "cuda", torch.bfloat16)
    def run(fused: bool):
        dplr._fused_applies = lambda *a: fused
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
