"""Where an eager training step's time goes: the wall clock, the host's share, and the device's time by kernel family.

    python benchmarks/step_profile.py --preset 340m --mixers gdn hdla            # GPU: 8 x 2048, bf16 autocast
    python benchmarks/step_profile.py --preset tiny --batch-size 2 --seq-len 64   # CPU (ops' self time)
    python benchmarks/step_profile.py ... --json step.json --top 20
    python benchmarks/step_profile.py ... --compile                               # the step through torch.compile
    python benchmarks/step_profile.py ... --use-cache                             # the forward as HF's Trainer calls it
    python benchmarks/step_profile.py ... --matmul-precision medium               # bf16 products in the kernels

One step is the trainer's: the forward with labels under autocast (bf16 on a GPU), the backward, gradient clipping,
fused AdamW. For each mixer it reports the median and minimum wall time over ``--steps`` steps after ``--warmup``,
the time after which the host returned from the step (``host ms``; when it is about the wall time, the step is
bound by the host's launches, not by the device), the host's time for a step of ``--host-shape`` tokens (so small
that the device's work is negligible: the host's cost per step by itself), and one profiled step's device time
summed by kernel family: the Triton kernels, the matrix products (cuBLAS / CUTLASS), PyTorch's elementwise and
reduction kernels, and the rest, each with its number of launches, and the ``--top`` kernels by time. Markdown on
stdout; ``--json`` writes the rows too. On the CPU the families are the profiled operators' self time.
"""
from __future__ import annotations

import argparse
import collections
import json
import platform
import time

import torch
from torch.profiler import ProfilerActivity, profile

from rankdecay.models import RankDecayConfig, RankDecayForCausalLM

GEMM = ("gemm", "cutlass", "xmma", "nvjet", "cublas", "addmm", "aten::mm", "aten::bmm", "aten::linear")
ELEMENTWISE = ("elementwise", "reduce_kernel", "reduce", "vectorized", "unrolled", "copy", "aten::add", "aten::mul",
               "aten::to", "aten::fill", "aten::sum", "aten::div")


def family(name: str) -> str:
    """A kernel's (or on the CPU an operator's) family by its name."""
    low = name.lower()
    if any(s in low for s in GEMM):
        return "matmul"
    if name.startswith("_") or "triton" in low:
        return "triton"
    if any(s in low for s in ELEMENTWISE):
        return "elementwise / reduction"
    return "other"


def make_step(model, ids, device, use_cache=False):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    dtype = torch.bfloat16 if device.type == "cuda" else None

    def step():
        with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            # use_cache None: the config's default (True), as transformers' Trainer calls the model
            loss = model(ids, labels=ids, use_cache=None if use_cache else False).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(step, device, n):
    """(wall ms, host ms) per step, each sorted: host ms is when the host returned from the step."""
    wall, host = [], []
    for _ in range(n):
        t = time.perf_counter()
        step()
        h = time.perf_counter()
        sync(device)
        wall.append((time.perf_counter() - t) * 1e3)
        host.append((h - t) * 1e3)
    return sorted(wall), sorted(host)


def profiled(step, device):
    """One step's time (ms) and launches by family, and per kernel."""
    cuda = device.type == "cuda"
    with profile(activities=[ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]) as prof:
        step()
        sync(device)
    times, launches, per = collections.Counter(), collections.Counter(), collections.Counter()
    for e in prof.key_averages():
        if cuda and e.device_type.name != "CUDA":
            continue
        us = e.device_time_total if cuda else e.self_cpu_time_total
        if not us or (not cuda and not e.key.startswith("aten::")):
            continue
        times[family(e.key)] += us / 1e3
        launches[family(e.key)] += e.count
        per[e.key] += us / 1e3
    return times, launches, per


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="340m")
    parser.add_argument("--mixers", nargs="+", default=["gdn"])
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--host-shape", type=int, nargs=2, default=[1, 64], metavar=("B", "T"),
                        help="the tokens of the step that measures the host's cost alone")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--top", type=int, default=12, help="kernels listed by time")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="model overrides")
    parser.add_argument("--compile", action="store_true",
                        help="the model through torch.compile (`rankdecay train --compile`), compiled in the warm-up")
    parser.add_argument("--use-cache", action="store_true",
                        help="the forward with use_cache left at the config's default (on), as transformers' Trainer "
                             "calls the model; without it use_cache=False")
    parser.add_argument("--matmul-precision", choices=["highest", "high", "medium"], default="highest",
                        help="torch.set_float32_matmul_precision for the run (the ops' products follow it)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", default=None, help="also write the rows to this JSON file")
    args = parser.parse_args()
    if args.steps < 1 or args.warmup < 0:
        parser.error("--steps must be >= 1 and --warmup >= 0")
    device = torch.device(args.device)
    torch.set_float32_matmul_precision(args.matmul_precision)
    overrides = {k: json.loads(v) for k, v in (item.split("=", 1) for item in args.set)}
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({torch.get_num_threads()} threads)"
    print(f"torch {torch.__version__}, python {platform.python_version()}, {name}, preset {args.preset}, "
          f"B{args.batch_size} T{args.seq_len}, matmul precision {args.matmul_precision}")
    rows = []
    for mixer in args.mixers:
        torch.manual_seed(0)
        config = RankDecayConfig.from_preset(args.preset, mixer=mixer, **overrides)
        model = RankDecayForCausalLM(config).to(device)
        if args.compile:
            model = torch.compile(model)
        row = {"mixer": mixer + (", compiled" if args.compile else "")}
        for key, (B, T) in (("host_only", tuple(args.host_shape)), ("step", (args.batch_size, args.seq_len))):
            ids = torch.randint(0, config.vocab_size, (B, T), device=device)
            step = make_step(model, ids, device, args.use_cache)
            for _ in range(args.warmup):
                step()
            sync(device)
            wall, host = timed(step, device, args.steps)
            row[key] = {"B": B, "T": T, "wall_ms_median": wall[len(wall) // 2], "wall_ms_min": wall[0],
                        "host_ms_median": host[len(host) // 2]}
        times, launches, per = profiled(step, device)
        row["device_ms"] = sum(times.values())
        row["families"] = {k: {"ms": v, "launches": launches[k]} for k, v in times.most_common()}
        row["top"] = [{"ms": v, "kernel": k} for k, v in per.most_common(args.top)]
        rows.append(row)
        del model, step

    print("\n| mixer | step ms (median / min) | host ms | host-only step ms (B x T) | device ms, one step |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        s, h = r["step"], r["host_only"]
        print(f"| {r['mixer']} | {s['wall_ms_median']:.1f} / {s['wall_ms_min']:.1f} | {s['host_ms_median']:.1f} | "
              f"{h['wall_ms_median']:.1f} ({h['B']} x {h['T']}) | {r['device_ms']:.1f} |")
    for r in rows:
        print(f"\n{r['mixer']}: device time by family\n\n| family | ms | share | launches |\n|---|---:|---:|---:|")
        for k, v in r["families"].items():
            print(f"| {k} | {v['ms']:.1f} | {100 * v['ms'] / max(r['device_ms'], 1e-9):.1f} % | {v['launches']} |")
        print(f"\n| ms | kernel ({r['mixer']}) |\n|---:|---|")
        for t in r["top"]:
            print(f"| {t['ms']:.2f} | `{t['kernel'][:110]}` |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": name, "torch": torch.__version__, "preset": args.preset,
                       "matmul_precision": args.matmul_precision, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
