"""Bits per byte after pruning, per scorer and ratio, before and after recovery (state-reduction Table 1's shape).

    python benchmarks/prune_table.py runs/tiny-gdn --ratios 0.3 0.5 0.75 --rft 50 --rft-lr 1e-3

Runs ``rankdecay prune`` for every (method, ratio), prints a Markdown table and writes
``prune_table.json`` and ``prune_table.png`` (bits/byte against ratio) to ``--out``.
"""
from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from rankdecay.prune.run import run_prune


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model_dir")
    p.add_argument("--methods", nargs="+", default=["rand", "l1", "s-wanda", "grad", "drrqr", "pca"])
    p.add_argument("--ratios", nargs="+", type=float, default=[0.3, 0.5, 0.75])
    p.add_argument("--rft", type=int, default=50)
    p.add_argument("--rft-lr", type=float, default=1e-3)
    p.add_argument("--eval-windows", type=int, default=64)
    p.add_argument("--out", default="prune-table")
    args = p.parse_args()
    rows = []
    for method in args.methods:
        for ratio in args.ratios:
            with tempfile.TemporaryDirectory() as tmp:
                r = run_prune(args.model_dir, method, ratio, tmp, rft_steps=args.rft, rft_lr=args.rft_lr,
                              eval_windows=args.eval_windows, progress=False)
            rows.append({"method": method, "ratio": ratio, "before": r["before"]["bpb"], "after": r["after"]["bpb"],
                         "after_rft": r.get("after_rft", {}).get("bpb"),
                         "util": {k: sum(sum(v["utilization"]) / len(v["utilization"]) for v in d.values()) / len(d)
                                  for k, d in r["rank"].items()},
                         "mixer_ms": [r["mixer_speed"]["before"]["ms"], r["mixer_speed"]["after"]["ms"]]})
            print(f"{method} {ratio:.0%}: {rows[-1]['after']:.4f} -> {rows[-1]['after_rft']:.4f} bits/byte", flush=True)
    base = rows[0]["before"]
    print(f"\nbaseline {base:.4f} bits/byte; each cell: after pruning / after recovery ({args.rft} steps)\n")
    print("| method | " + " | ".join(f"{r:.0%}" for r in args.ratios) + " |")
    print("|---|" + "---:|" * len(args.ratios))
    for method in args.methods:
        cells = [f"{x['after']:.3f} / {x['after_rft']:.3f}" for x in rows if x["method"] == method]
        print(f"| {method} | " + " | ".join(cells) + " |")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "prune_table.json").write_text(json.dumps({"model": args.model_dir, "baseline_bpb": base, "rows": rows},
                                                     indent=2) + "\n")
    from rankdecay._plot import finish, pyplot

    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for ax, key, title in ((axes[0], "after", "after pruning"), (axes[1], "after_rft", "after recovery")):
        for method in args.methods:
            pts = [(x["ratio"], x[key]) for x in rows if x["method"] == method]
            ax.plot(*zip(*pts), "o-", label=method)
        ax.axhline(base, color="gray", ls="--", label="unpruned")
        ax.set_title(title)
        ax.set_xlabel("fraction of key channels pruned")
    axes[0].set_ylabel("validation bits/byte")
    finish(fig, axes, out / "prune_table.png")


if __name__ == "__main__":
    main()
