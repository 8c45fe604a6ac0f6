"""Where an op's GPU time goes: torch.profiler's table for one case of benchmarks/kernels.py.

    python benchmarks/profile_op.py gdn [--backward] [--shape B T H K V] [--rows 25] [--matmul-precision medium]
                                        [--resources] [--peer fla] [--knob form_a2=0 ...]

``--peer`` profiles that peer's call of the case (``kernels.py``'s ``peers``) instead of ours.

``--resources`` also prints, for every compiled variant of our Triton kernels, its registers per
thread, spilled registers, shared memory and warps (what limits how many programs share an SM).
"""
from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from kernels import CASES, KNOB_HELP, apply_knobs, measure  # noqa: E402  (run from benchmarks/ or with it on sys.path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("case", choices=list(CASES))
    parser.add_argument("--backward", action="store_true")
    parser.add_argument("--shape", nargs=5, type=int, default=[8, 2048, 16, 128, 128])
    parser.add_argument("--rows", type=int, default=25)
    parser.add_argument("--matmul-precision", choices=["highest", "high", "medium"], default="highest")
    parser.add_argument("--resources", action="store_true", help="registers / shared memory per kernel")
    parser.add_argument("--peer", default=None, help="profile this peer's call (e.g. fla) instead of ours")
    parser.add_argument("--knob", nargs="*", default=[], metavar="NAME=VALUE", help="kernels.py's: " + KNOB_HELP)
    args = parser.parse_args()
    apply_knobs(args.knob)
    torch.set_float32_matmul_precision(args.matmul_precision)
    case = CASES[args.case]
    inputs = case.make(*args.shape, "cuda", torch.bfloat16)
    if args.peer is not None and args.peer not in case.peers:
        raise SystemExit(f"--peer {args.peer}: case {args.case} has peers {sorted(case.peers)}")
    call = case.peers[args.peer] if args.peer else case.ours
    measure(call, inputs, args.backward)  # warm up, compile
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        measure(call, inputs, args.backward)
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.rows, max_name_column_width=60))
    if args.resources:
        print_resources()


def print_resources() -> None:
    """Registers, spills, shared memory and warps of every compiled variant of our kernels."""
    import rankdecay.ops.triton as rt
    from triton.runtime.jit import JITFunction

    mods = [m for name, m in vars(rt).items() if getattr(m, "__name__", "").startswith(rt.__name__ + ".")]
    for mod in mods:
        for name, fn in vars(mod).items():
            if not isinstance(fn, JITFunction):
                continue
            for entry in getattr(fn, "device_caches", {}).values():
                cache = entry[0] if isinstance(entry, tuple) else entry
                for kernel in cache.values():
                    md = kernel.metadata
                    print(f"{name}: {kernel.n_regs} registers, {kernel.n_spills} spilled, "
                          f"{md.shared} B shared, {md.num_warps} warps")


if __name__ == "__main__":
    main()
