"""Fused-forward variants on one GPU: ``chunk_dplr_fwd``'s kernels timed one by one under launch knobs.

    python benchmarks/fwd_variants.py gdn [hdla ...] --variants "" "scaled=0" "intra_maxnreg=168" ...

Captures the canonical inputs of each ``kernels.py`` case, then for each variant (comma-separated
``chunk_fwd._KNOBS`` settings, values as Python literals, or ``ch_*``: ``channel._CHANNEL``'s, the per-channel
products' kernels', e.g. ``ch_warps=2``; "" is the default) times ``chunk_dplr_fwd``
under the PyTorch profiler: the GPU time of each kernel, median over calls, so the host's speed does
not enter. Prints a table and writes ``$OUT/fwd_variants.json`` (or ./fwd_variants.json).
"""
import argparse
import ast
import json
import os
import statistics
import sys
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(__file__))
from kernels import CASES  # noqa: E402

import rankdecay.ops.triton as rt  # noqa: E402
import rankdecay.ops.triton.channel as ch  # noqa: E402
import rankdecay.ops.triton.chunk_fwd as cf  # noqa: E402


def knobs(spec: str) -> tuple[dict, dict]:
    """A variant's ``chunk_fwd._KNOBS`` and ``channel._CHANNEL`` settings (the latter prefixed ``ch_``); a name neither
    table has is refused (``SystemExit``), rather than timed as the default."""
    pairs = {k: ast.literal_eval(v) for k, v in (kv.split("=") for kv in spec.split(",") if kv)}
    config = {k: v for k, v in pairs.items() if not k.startswith("ch_")}
    channel = {k.removeprefix("ch_"): v for k, v in pairs.items() if k.startswith("ch_")}
    try:
        cf.check_knobs(config, f"--variants {spec!r}")
    except ValueError as e:
        raise SystemExit(str(e)) from None
    unknown = sorted(f"ch_{k}" for k in set(channel) - set(ch._CHANNEL))
    if unknown:
        raise SystemExit(f"--variants {spec!r}: no knob named {', '.join(unknown)}; ch_ takes channel._CHANNEL's "
                         f"{sorted(ch._CHANNEL)}")
    return config, channel


def kernel_times(fn, calls: int = 10) -> dict:
    """Median GPU µs per call of each kernel fn launches (after two calls that compile)."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    per = defaultdict(list)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per[e.name].append(e.device_time)
    return {name: statistics.median(ts) * len(ts) / calls for name, ts in per.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cases", nargs="+", choices=list(CASES))
    parser.add_argument("--variants", nargs="+", default=[""])
    parser.add_argument("--shape", nargs=5, type=int, default=[8, 2048, 16, 128, 128])
    parser.add_argument("--matmul-precision", choices=["highest", "high", "medium"], default="medium")
    args = parser.parse_args()
    for spec in args.variants:  # every variant's names checked before anything runs
        knobs(spec)
    torch.set_float32_matmul_precision(args.matmul_precision)
    captured = {}
    orig = cf.chunk_dplr_fwd

    def grab(*a, **k):
        captured["call"] = (a, k)
        return orig(*a, **k)

    import rankdecay.ops.triton.chunk_bwd as cb  # the one-node paths (Gated DeltaNet, HDLA) call it from there

    rt.chunk_dplr_fwd = cb.chunk_dplr_fwd = grab
    results = {}
    for case in args.cases:
        c = CASES[case]
        with torch.no_grad():
            c.ours(c.make(*args.shape, "cuda", torch.bfloat16))
        a, k = captured["call"]
        for spec in args.variants:
            config, channel = knobs(spec)
            default = dict(ch._CHANNEL)
            ch._CHANNEL.update(channel)
            try:
                times = kernel_times(lambda: orig(*a, **k, _config=config))
            except Exception as ex:  # a variant that does not compile or launch: say so, go on
                print(f"{case} [{spec or 'default'}]: {type(ex).__name__}: {str(ex)[:200]}", flush=True)
                continue
            finally:
                ch._CHANNEL.clear()
                ch._CHANNEL.update(default)
            results[f"{case} [{spec or 'default'}]"] = times
            parts = ", ".join(f"{n.split('(')[0][:24]} {t:.1f}" for n, t in sorted(times.items(), key=lambda x: -x[1]))
            print(f"{case} [{spec or 'default'}]: total {sum(times.values()):.1f} us: {parts}", flush=True)
    json.dump(results, open(os.path.join(os.environ.get("OUT", "."), "fwd_variants.json"), "w"), indent=1)


if __name__ == "__main__":
    main()
