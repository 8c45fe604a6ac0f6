"""Per-kernel time and DRAM traffic from Nsight Compute's CSV, as a Markdown table (and JSON).

Record one call of a case with the three metrics, then summarize (BENCHMARKS.md sessions 52-53):

    ncu --profile-from-start off --clock-control none --csv \
        --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum \
        python benchmarks/ncu_op.py hdla --backward > hdla.csv
    python benchmarks/ncu_bytes.py hdla.csv [more.csv ...] [--peak-tbs 3.35] [--json out.json]

Each kernel's launches are summed: time, bytes read and written, the bandwidth it reached, and its floor, the time
its bytes would take at the device's peak DRAM bandwidth (``--peak-tbs``; the H100 SXM's 3.35 TB/s by default).
Kernels run longest first; the total says how far the whole call is from its bytes' floor. The lines ncu and the
program print around the CSV are skipped.
"""
from __future__ import annotations

import argparse
import csv
import json
import re
from collections import defaultdict
from collections.abc import Iterable

METRICS = ("gpu__time_duration.sum", "dram__bytes_read.sum", "dram__bytes_write.sum")
# ncu's units, to microseconds and to megabytes (decimal, as ncu counts them)
_TIME = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3, "s": 1e6, "second": 1e6}
_BYTES = {"byte": 1e-6, "B": 1e-6, "Kbyte": 1e-3, "KB": 1e-3, "Mbyte": 1.0, "MB": 1.0, "Gbyte": 1e3, "GB": 1e3,
          "Tbyte": 1e6, "TB": 1e6}


def kernel_label(name: str, width: int = 60) -> str:
    """A kernel's name for the table: a Triton kernel's as it is; a C++ template's without ``void`` and its
    arguments, cut to ``width`` characters."""
    name = re.sub(r"^void\s+", "", name.strip())
    name = re.sub(r"\(.*$", "", name)  # a C++ kernel's argument list
    return name if len(name) <= width else name[:width - 3] + "..."


def summarize(lines: Iterable[str], width: int = 60) -> list[dict]:
    """Rows of ncu ``--csv`` output (with the three ``METRICS``) summed per kernel: dicts of ``kernel``,
    ``launches``, ``time_us``, ``read_mb`` and ``write_mb``, the longest-running first. Lines that are not the CSV's
    (ncu's ``==PROF==`` notes, the program's own output) are skipped."""
    rows = list(csv.reader(line for line in lines if line.startswith('"')))
    if not rows:
        raise ValueError("no ncu CSV rows found: record with `ncu --csv --metrics " + ",".join(METRICS) + " ...`")
    header = {h: i for i, h in enumerate(rows[0])}
    missing = [h for h in ("ID", "Kernel Name", "Metric Name", "Metric Unit", "Metric Value") if h not in header]
    if missing:
        raise ValueError(f"not ncu's CSV: its header lacks {missing}")
    found = set()
    acc: dict[str, dict] = defaultdict(lambda: dict(ids=set(), time_us=0.0, read_mb=0.0, write_mb=0.0))
    for row in rows[1:]:
        if len(row) < len(header):
            continue
        metric, unit = row[header["Metric Name"]], row[header["Metric Unit"]]
        if metric not in METRICS:
            continue
        value = float(row[header["Metric Value"]].replace(",", ""))
        table = _TIME if metric == METRICS[0] else _BYTES
        if unit not in table:
            raise ValueError(f"{metric}: unit {unit!r} not understood (expected one of {sorted(table)})")
        entry = acc[kernel_label(row[header["Kernel Name"]], width)]
        entry["ids"].add(row[header["ID"]])
        key = "time_us" if metric == METRICS[0] else "read_mb" if metric == METRICS[1] else "write_mb"
        entry[key] += value * table[unit]
        found.add(metric)
    if found != set(METRICS):
        raise ValueError(f"the CSV lacks the metrics {sorted(set(METRICS) - found)}: record with `--metrics "
                         + ",".join(METRICS) + "`")
    out = [dict(kernel=name, launches=len(e.pop("ids")), **e) for name, e in acc.items()]
    return sorted(out, key=lambda e: -e["time_us"])


def totals(rows: list[dict], peak_tbs: float) -> dict:
    """The whole call: time (µs), bytes (GB), average bandwidth (TB/s) and the bytes' floor at ``peak_tbs`` (µs)."""
    time_us = sum(r["time_us"] for r in rows)
    gb = sum(r["read_mb"] + r["write_mb"] for r in rows) / 1e3
    return dict(time_us=time_us, gb=gb, tbs=gb / time_us * 1e3 if time_us else 0.0, floor_us=gb / peak_tbs * 1e3)


def table(rows: list[dict], peak_tbs: float) -> str:
    """A Markdown table of ``summarize``'s rows and their total."""
    lines = ["| kernel | launches | µs | read MB | write MB | TB/s | floor µs |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        mb = r["read_mb"] + r["write_mb"]
        lines.append(f"| {r['kernel']} | {r['launches']} | {r['time_us']:.1f} | {r['read_mb']:.0f} | "
                     f"{r['write_mb']:.0f} | {mb / r['time_us'] if r['time_us'] else 0.0:.2f} | "
                     f"{mb / peak_tbs:.1f} |")
    t = totals(rows, peak_tbs)
    lines.append(f"| **total** | {sum(r['launches'] for r in rows)} | {t['time_us']:.1f} | "
                 f"{sum(r['read_mb'] for r in rows):.0f} | {sum(r['write_mb'] for r in rows):.0f} | {t['tbs']:.2f} | "
                 f"{t['floor_us']:.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("csv", nargs="+", help="ncu --csv output files")
    parser.add_argument("--peak-tbs", type=float, default=3.35, help="the device's peak DRAM bandwidth, TB/s")
    parser.add_argument("--width", type=int, default=60, help="kernel names cut to this many characters")
    parser.add_argument("--json", help="also write every file's rows and total here")
    args = parser.parse_args(argv)
    if args.peak_tbs <= 0:
        parser.error(f"--peak-tbs takes a positive bandwidth in TB/s, got {args.peak_tbs}")
    report = {}
    for path in args.csv:
        with open(path) as f:
            rows = summarize(f, args.width)
        t = totals(rows, args.peak_tbs)
        print(f"## {path}\n\n{table(rows, args.peak_tbs)}\n\n{t['gb']:.2f} GB in {t['time_us'] / 1e3:.3f} ms "
              f"({t['tbs']:.2f} TB/s); at {args.peak_tbs} TB/s those bytes take {t['floor_us'] / 1e3:.3f} ms\n")
        report[path] = dict(rows=rows, total=t)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(peak_tbs=args.peak_tbs, files=report), f, indent=1)


if __name__ == "__main__":
    main()
