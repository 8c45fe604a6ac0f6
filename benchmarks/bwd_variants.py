"""Backward kernels under launch knobs: per-kernel GPU time of one case's forward+backward.

    python benchmarks/bwd_variants.py gdn gla [--set grad=8 grad_bk=16 state_stages=2 ...] [--matmul-precision medium]
        [--shape B T H K V]

Profiles ``kernels.py``'s case (B8 T2048 H16 K=V=128 bf16 unless ``--shape``) with the default knobs of
``rankdecay.ops.triton.chunk_bwd._CONFIG`` (and ``state_*``: ``chunk_state._LAUNCH``, the
state kernels' warps, stages and value block; ``fwd_*``: ``chunk_fwd._KNOBS``, the forward's,
e.g. ``fwd_intra_warps=8``; ``ch_*``: ``channel._CHANNEL``, the per-channel products' kernels', e.g.
``ch_hdla_bwd_warps=2``; ``lc_<chunk>_<plain|prep|hdla>=BKxWARPS``: ``chunk_fwd._LOG_CUMSUM``'s, the log-cumsum
kernel's, e.g. ``lc_16_prep=64x2``), then with each override given (several joined by commas act together:
``ch_bwd_bk=64,ch_hdla_bwd_warps=4``), and prints the milliseconds per
call of every Triton kernel. The overrides go through ``kernels.apply_knobs`` (a name no table has is refused) and
every table is put back after each (``kernels.knobs_restored``).
"""
from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from kernels import CASES, _prefixed_tables, apply_knobs, knobs_restored, measure  # noqa: E402  (from benchmarks/)

# the prefixes ``kernels.apply_knobs`` reads; a name without one is chunk_bwd._CONFIG's here (``bwd_`` there)
_PREFIXES = (*_prefixed_tables(), "fwd_", "lc_")


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
    parser.add_argument("--matmul-precision", choices=["highest", "high", "medium"], default="highest")
    parser.add_argument("--shape", nargs=5, type=int, metavar=("B", "T", "H", "K", "V"),
                        default=[8, 2048, 16, 128, 128])
    args = parser.parse_args()
    torch.set_float32_matmul_precision(args.matmul_precision)
    for name in args.cases:
        case = CASES[name]
        inputs = case.make(*args.shape, "cuda", torch.bfloat16)
        for label in ["default"] + args.set:
            pairs = label.split(",") if label != "default" else []  # knobs joined by commas go together
            with knobs_restored():
                apply_knobs([kv if kv.startswith(_PREFIXES) else f"bwd_{kv}" for kv in pairs])
                try:
                    times = per_kernel(case, inputs)
                except Exception as e:  # a knob the compiler refuses (shared memory): say so, go on
                    print(f"{name} {label}: failed: {str(e).splitlines()[0][:160]}", flush=True)
                    continue
            print(f"{name} {label}: " + ", ".join(f"{k} {v:.3f} ms" for k, v in sorted(times.items())), flush=True)


if __name__ == "__main__":
    main()
