"""Training throughput (tokens/s, and MFU on a GPU) of `rankdecay train`, mechanism against mechanism.

    python benchmarks/train_throughput.py                                  # tiny preset, CPU
    python benchmarks/train_throughput.py --preset 340m --batch-size 8 --steps 30 --warmup 10   # GPU
    python benchmarks/train_throughput.py --compile ...                    # the model through torch.compile
    python benchmarks/train_throughput.py --pack varlen ...                # documents packed with cu_seqlens
    python benchmarks/train_throughput.py --matmul-precision medium ...    # bf16 products in the kernels, as fla

Runs the real trainer (the same code as `rankdecay train`: data, autocast, AdamW, clipping)
for each mixer on the embedded corpus, and reports the steady-state throughput: the
tokens/s of the steps after the first ``--warmup`` (compilation, autotuning and caches
are in those). MFU is model FLOPs (``flops_per_token``: 6 per weight plus the chunked
mixers' work, x3 for the backward) over the device's dense bf16 peak. Markdown + JSON.
"""
from __future__ import annotations

import argparse
import json
import platform
import tempfile

import torch

from rankdecay.train import TrainConfig, train


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--mixers", nargs="+", default=["gdn", "hdla", "hh-gdn"])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=20, help="steps left out of the measurement")
    parser.add_argument("--batch-size", type=int, default=None, help="global batch (default: the preset's)")
    parser.add_argument("--micro-batch-size", type=int, default=None)
    parser.add_argument("--seq-len", type=int, default=None)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="model overrides")
    parser.add_argument("--compile", action="store_true", help="torch.compile the model (`rankdecay train --compile`)")
    parser.add_argument("--pack", choices=["concat", "varlen"], default=None,
                        help="`rankdecay train --pack`: varlen restarts the state at every document (cu_seqlens)")
    parser.add_argument("--matmul-precision", choices=["highest", "high", "medium"], default=None,
                        help="the trainer's matmul_precision (default: its own default)")
    parser.add_argument("--json", default=None, help="also write the rows to this JSON file")
    args = parser.parse_args()
    if args.steps <= args.warmup:
        parser.error("--steps must be larger than --warmup")
    model = {k: json.loads(v) for k, v in (item.split("=", 1) for item in args.set)}
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU ({torch.get_num_threads()} threads)"
    print(f"torch {torch.__version__}, python {platform.python_version()}, {device}, preset {args.preset}")
    rows = []
    for mixer in args.mixers:
        with tempfile.TemporaryDirectory() as out:
            overrides = dict(preset=args.preset, mixer=mixer, steps=args.steps, warmup_steps=min(10, args.steps),
                             out_dir=out, eval_every=0, save_every=0, eval_batches=1, log_every=args.warmup,
                             progress=False, batch_size=args.batch_size, micro_batch_size=args.micro_batch_size,
                             seq_len=args.seq_len, model=model, compile=args.compile or None,
                             pack=args.pack, matmul_precision=args.matmul_precision)
            cfg = TrainConfig.from_sources(overrides={k: v for k, v in overrides.items() if v is not None})
            if cfg.steps % cfg.log_every:
                raise SystemExit("--steps - --warmup must be a multiple of --warmup so the last window is whole")
            while True:
                try:
                    res = train(cfg)
                    break
                except torch.cuda.OutOfMemoryError:
                    micro = cfg.micro_batch_size or cfg.batch_size
                    if micro == 1:
                        raise
                    cfg.micro_batch_size = micro // 2  # same global batch, more accumulation
                    print(f"out of memory: retrying {mixer} with micro_batch_size {cfg.micro_batch_size}")
                    torch.cuda.empty_cache()
            peak_mb = torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_available() else None
            label = mixer + (" (compiled)" if args.compile else "") + (f", --pack {args.pack}" if args.pack else "")
            label += f", {args.matmul_precision}" if args.matmul_precision else ""
            rows.append({"mixer": label, "preset": args.preset,
                         "batch_size": cfg.batch_size,
                         "micro_batch_size": cfg.micro_batch_size or cfg.batch_size, "seq_len": cfg.seq_len,
                         "tokens_per_s": res["tokens_per_s"], "mfu": res.get("mfu"), "peak_mem_mb": peak_mb,
                         "final_loss": res["loss"], "device": device, "torch": torch.__version__})
            if torch.cuda.is_available():
                torch.cuda.reset_peak_memory_stats()
    print("\n| mixer | batch x len (micro) | tokens/s | MFU | peak memory |")
    print("|---|---|---:|---:|---:|")
    for r in rows:
        mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "-"
        mem = f"{r['peak_mem_mb'] / 1024:.1f} GiB" if r["peak_mem_mb"] else "-"
        print(f"| {r['mixer']} | {r['batch_size']} x {r['seq_len']} ({r['micro_batch_size']}) | {r['tokens_per_s']:,.0f} | {mfu} | {mem} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
