"""Where the host's time goes in one case of benchmarks/kernels.py: cProfile over repeated calls.

    python benchmarks/host_profile.py gdn [--backward] [--reps 50] [--rows 30] [--matmul-precision medium]
    python benchmarks/host_profile.py gdn --backward --launches   # host µs per call inside each Triton launch
    python benchmarks/host_profile.py hdla --split   # each launch replayed: binder, driver and the rest of its µs

The GPU runs asynchronously, so a call whose host time exceeds its GPU time is launch-bound
(``kernels.py``'s "host ms" column); this says which Python functions that host time is spent in.
"""
from __future__ import annotations

import argparse
import collections
import cProfile
import pstats
import time

import torch

from kernels import CASES  # noqa: E402  (run from benchmarks/)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("case", choices=list(CASES))
    parser.add_argument("--backward", action="store_true")
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--rows", type=int, default=30)
    parser.add_argument("--matmul-precision", choices=["highest", "high", "medium"], default="highest")
    parser.add_argument("--launches", action="store_true",
                        help="no cProfile: the host's time per call, and the part of it inside each Triton launch")
    parser.add_argument("--split", action="store_true",
                        help="each Triton launch of one call replayed alone: its host µs in the binder (argument "
                             "specialisation), in the rest of JITFunction.run, and in the driver's launch")
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
    if args.launches:
        launches(step, args.reps)
        return
    if args.split:
        split(step, args.reps)
        return
    prof = cProfile.Profile()
    for _ in range(args.reps):  # the GPU drained between calls, so no launch waits on a full queue
        prof.enable()
        step()
        prof.disable()
        torch.cuda.synchronize()
    stats = pstats.Stats(prof)
    print(f"host seconds per call: {stats.total_tt / args.reps * 1e3:.3f} ms")
    stats.sort_stats("tottime").print_stats(args.rows)


def launches(step, reps: int) -> None:
    """The host's time per call without a profiler, and the part spent in Triton's launcher (``JITFunction.run``:
    argument specialisation, cache lookup, the driver's launch), by kernel."""
    from triton.runtime.jit import JITFunction

    spent, calls = collections.Counter(), collections.Counter()
    run = JITFunction.run

    def timed(self, *a, **kw):
        t0 = time.perf_counter()
        try:
            return run(self, *a, **kw)
        finally:
            spent[self.__name__] += time.perf_counter() - t0
            calls[self.__name__] += 1

    total = 0.0
    JITFunction.run = timed
    try:
        for _ in range(reps):  # the GPU drained between calls, as above
            t0 = time.perf_counter()
            step()
            total += time.perf_counter() - t0
            torch.cuda.synchronize()
    finally:
        JITFunction.run = run
    inside = sum(spent.values())
    print(f"host ms per call: {total / reps * 1e3:.3f}; inside Triton launches {inside / reps * 1e3:.3f} "
          f"({sum(calls.values()) / reps:.0f} launches); elsewhere {(total - inside) / reps * 1e3:.3f}")
    for name, t in spent.most_common():
        print(f"  {name}: {t / calls[name] * 1e6:.1f} µs per launch, {calls[name] / reps:.0f} per call")


def split(step, reps: int) -> None:
    """Each Triton launch of one call, captured and replayed ``reps`` times alone: host µs per launch for the whole
    of ``JITFunction.run``, for its binder alone (each argument's specialisation and the constexprs' binding), and
    for the driver's launch of the compiled kernel alone (``CompiledKernel.run`` with the bound arguments). What is
    left (run minus the two) is the cache key, the globals' check and the launch metadata. Triton 3.6's layout of
    ``JITFunction.device_caches``."""
    from triton.runtime.driver import driver
    from triton.runtime.jit import JITFunction

    captured = []
    run = JITFunction.run

    def capture(self, *a, **kw):
        kernel = run(self, *a, **kw)
        captured.append((self, a, dict(kw), kernel))
        return kernel

    JITFunction.run = capture
    try:
        step()
    finally:
        JITFunction.run = run
    torch.cuda.synchronize()
    device = driver.active.get_current_device()
    stream = driver.active.get_current_stream(device)

    def per_launch(fn) -> float:
        fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        t = time.perf_counter() - t0
        torch.cuda.synchronize()
        return t / reps * 1e6

    print(f"{'kernel':<34} {'args':>5} {'run µs':>8} {'binder µs':>10} {'driver µs':>10} {'rest µs':>8}")
    totals = collections.Counter()
    for fn, a, kw, kernel in captured:
        binder = fn.device_caches[device][4]
        bind_kw = {k: v for k, v in kw.items() if k not in ("grid", "warmup")}
        bound, _, _ = binder(*a, **bind_kw)
        grid = kw["grid"]
        grid = tuple(grid) + (1,) * (3 - len(grid))
        values = tuple(bound.values())
        t_run = per_launch(lambda: fn.run(*a, **kw))
        t_bind = per_launch(lambda: binder(*a, **bind_kw))
        t_drv = per_launch(lambda: kernel.run(grid[0], grid[1], grid[2], stream, kernel.function,
                                              kernel.packed_metadata, None, None, None, *values))
        totals.update(run=t_run, binder=t_bind, driver=t_drv)
        print(f"{fn.__name__:<34} {len(values):>5} {t_run:>8.1f} {t_bind:>10.1f} {t_drv:>10.1f} "
              f"{t_run - t_bind - t_drv:>8.1f}")
    print(f"{'all ' + str(len(captured)) + ' launches':<34} {'':>5} {totals['run']:>8.1f} {totals['binder']:>10.1f} "
          f"{totals['driver']:>10.1f} {totals['run'] - totals['binder'] - totals['driver']:>8.1f}")


if __name__ == "__main__":
    main()
