"""One table and one grouped-bar PNG from several `rankdecay synth` result folders.

    python benchmarks/synth_report.py benchmarks/results/synth/mad/* --out benchmarks/results/synth/mad/mad

reads each folder's results.json (best learning rate per mechanism and setting) and writes
OUT.md (mechanisms x tasks, with the average, in percent) and OUT.png.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from rankdecay._plot import finish, pyplot


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folders", nargs="+", type=Path)
    ap.add_argument("--out", type=Path, required=True, help="path prefix for .md and .png")
    ap.add_argument("--rows", choices=["mechanism", "folder", "parent"], default="mechanism",
                    help="label rows by mechanism, by folder name, or by the parent folder name (one mechanism in two configurations: CONFIG/TASK folders)")
    args = ap.parse_args()
    acc: dict[str, dict[str, float]] = {}
    tasks = []
    for folder in args.folders:
        if not (folder / "results.json").exists():
            continue
        runs = json.loads((folder / "results.json").read_text())
        task = runs["runs"][0]["task"]
        several = len({json.dumps(r["setting"], sort_keys=True) for r in runs["summary"]}) > 1
        for row in runs["summary"]:
            column = f"{task} ({runs.get('label', 'setting')}={row['x']})" if several else task
            if column not in tasks:
                tasks.append(column)
            name = {"mechanism": row["mixer"], "folder": folder.name, "parent": folder.parent.name}[args.rows]
            acc.setdefault(name, {})[column] = 100 * row["acc"]
    lines = ["| mechanism | " + " | ".join(tasks) + " | average |", "|---|" + "---:|" * (len(tasks) + 1)]
    for mixer, by_task in acc.items():
        vals = [by_task.get(t) for t in tasks]
        done = [v for v in vals if v is not None]
        lines.append(f"| {mixer} | " + " | ".join("-" if v is None else f"{v:.1f}" for v in vals)
                     + f" | {sum(done) / len(done):.1f} |")
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(1.6 * len(tasks) + 2, 4))
    width = 0.8 / max(len(acc), 1)
    for i, (mixer, by_task) in enumerate(acc.items()):
        ax.bar([j + i * width for j in range(len(tasks))], [by_task.get(t, 0) for t in tasks], width, label=mixer)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(tasks))], [t.replace("_", "\n") for t in tasks], fontsize=8)
    ax.set_ylabel("test accuracy (%)")
    ax.set_ylim(0, 102)
    finish(fig, [ax], args.out.with_suffix(".png"))
    print(f"wrote {args.out.with_suffix('.md')} and .png")


if __name__ == "__main__":
    main()
