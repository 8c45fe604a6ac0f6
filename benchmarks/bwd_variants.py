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
call of every Triton kernel.
"""
from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

import rankdecay.ops.triton.channel as ch
import rankdecay.ops.triton.chunk_bwd as cb
import rankdecay.ops.triton.chunk_fwd as cf
import rankdecay.ops.triton.chunk_state as cs
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
    parser.add_argument("--matmul-precision", choices=["highest", "high", "medium"], default="highest")
    parser.add_argument("--shape", nargs=5, type=int, metavar=("B", "T", "H", "K", "V"),
                        default=[8, 2048, 16, 128, 128])
    args = parser.parse_args()
    torch.set_float32_matmul_precision(args.matmul_precision)
    for name in args.cases:
        case = CASES[name]
        inputs = case.make(*args.shape, "cuda", torch.bfloat16)
        default, state_default, ch_default = dict(cb._CONFIG), dict(cs._LAUNCH), dict(ch._CHANNEL)
        lc_default = {c: dict(t) for c, t in cf._LOG_CUMSUM.items()}
        for label in ["default"] + args.set:
            cb._CONFIG.update(default)
            cs._LAUNCH.update(state_default)
            ch._CHANNEL.update(ch_default)
            cf._KNOBS.clear()
            cf._LOG_CUMSUM.update({c: dict(t) for c, t in lc_default.items()})
            for pair in label.split(",") if label != "default" else []:  # knobs joined by commas go together
                key, value = pair.split("=")
                if key.startswith("lc_"):  # the log-cumsum kernel's launch, e.g. lc_16_prep=64x2 (key block x warps)
                    size, kind = key.removeprefix("lc_").split("_")
                    cf._LOG_CUMSUM[int(size)][kind] = tuple(int(x) for x in value.split("x"))
                elif key.startswith("state_"):
                    cs._LAUNCH[key.removeprefix("state_")] = int(value)
                elif key.startswith("fwd_"):  # the forward's knobs (chunk_fwd._KNOBS), e.g. fwd_intra_warps=8
                    cf._KNOBS[key.removeprefix("fwd_")] = int(value)
                elif key.startswith("ch_"):  # the products' kernels' (channel._CHANNEL), e.g. ch_hdla_bwd_warps=2
                    ch._CHANNEL[key.removeprefix("ch_")] = int(value)
                else:
                    cb._CONFIG[key] = int(value)
            try:
                times = per_kernel(case, inputs)
            except Exception as e:  # a knob the compiler refuses (shared memory): say so, go on
                print(f"{name} {label}: failed: {str(e).splitlines()[0][:160]}", flush=True)
                continue
            print(f"{name} {label}: " + ", ".join(f"{k} {v:.3f} ms" for k, v in sorted(times.items())), flush=True)
        cb._CONFIG.update(default)
        cs._LAUNCH.update(state_default)
        ch._CHANNEL.update(ch_default)
        cf._KNOBS.clear()
        cf._LOG_CUMSUM.update(lc_default)


if __name__ == "__main__":
    main()
