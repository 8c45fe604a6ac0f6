"""``benchmarks/ncu_bytes.py``: Nsight Compute's CSV summed per kernel into time, DRAM bytes and their floor."""
import json

import pytest

from benchmarks.ncu_bytes import kernel_label, main, summarize, table, totals

HEADER = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size",'
          '"Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"')


def _row(i, kernel, metric, unit, value):
    return (f'"{i}","1","python3","host","{kernel}","1","7","(128, 1, 1)","(64, 1, 1)","0","9.0",'
            f'"Command line profiler metrics","{metric}","{unit}","{value}"')


def _csv(metrics=("gpu__time_duration.sum", "dram__bytes_read.sum", "dram__bytes_write.sum")):
    """Two launches of a Triton kernel (IDs 0 and 2, in ns / byte and in us / Kbyte), one C++ kernel between them, and
    ncu's and the program's own lines around the CSV."""
    launches = [(0, "_state_fwd_kernel", ("ns", "byte", "byte"), (400_000, "1,000,000,000", "500,000,000")),
                (1, "void at::native::vectorized_elementwise_kernel<4, at::FillFunctor<float>>(int, float)",
                 ("us", "Mbyte", "Mbyte"), (10, 0, 42)),
                (2, "_state_fwd_kernel", ("us", "Kbyte", "Kbyte"), (100, 250_000, 250_000))]
    lines = ["==PROF== Connected to process 1", "device NVIDIA H100, a line the program printed", HEADER]
    for i, kernel, units, values in launches:
        for metric, unit, value in zip(("gpu__time_duration.sum", "dram__bytes_read.sum", "dram__bytes_write.sum"),
                                       units, values):
            if metric in metrics:
                lines.append(_row(i, kernel, metric, unit, value))
    return [line + "\n" for line in lines + ["==PROF== Disconnected from process 1"]]


def test_summarize_sums_launches_per_kernel_in_common_units():
    rows = summarize(_csv())
    fill_name = "at::native::vectorized_elementwise_kernel<4, at::FillFunctor<float>>"  # without void and arguments
    assert [r["kernel"] for r in rows] == ["_state_fwd_kernel", fill_name[:57] + "..."]  # cut to 60 characters
    state, fill = rows
    assert state["launches"] == 2 and fill["launches"] == 1
    assert state["time_us"] == pytest.approx(500.0) and state["read_mb"] == pytest.approx(1250.0)
    assert state["write_mb"] == pytest.approx(750.0)
    assert fill["time_us"] == pytest.approx(10.0) and fill["write_mb"] == pytest.approx(42.0)
    t = totals(rows, peak_tbs=2.0)
    assert t["gb"] == pytest.approx(2.042) and t["time_us"] == pytest.approx(510.0)
    assert t["tbs"] == pytest.approx(2.042 / 510.0 * 1e3) and t["floor_us"] == pytest.approx(1021.0)
    md = table(rows, peak_tbs=2.0).splitlines()
    assert md[2] == "| _state_fwd_kernel | 2 | 500.0 | 1250 | 750 | 4.00 | 1000.0 |", md[2]
    assert md[-1] == "| **total** | 3 | 510.0 | 1250 | 792 | 4.00 | 1021.0 |", md[-1]


def test_kernel_label():
    assert kernel_label("_grad_kernel") == "_grad_kernel"
    assert kernel_label("void f<int>(int*, float)", width=60) == "f<int>"
    assert kernel_label("x" * 70, width=10) == "xxxxxxx..."


def test_summarize_refuses_what_it_cannot_read():
    with pytest.raises(ValueError, match="no ncu CSV rows found"):
        summarize(["==PROF== nothing profiled\n"])
    with pytest.raises(ValueError, match=r"lacks the metrics \['dram__bytes_write.sum'\]"):
        summarize(_csv(metrics=("gpu__time_duration.sum", "dram__bytes_read.sum")))
    bad = [line.replace('"ns"', '"cycle"') for line in _csv()]
    with pytest.raises(ValueError, match="unit 'cycle' not understood"):
        summarize(bad)


def test_main_prints_and_writes_json(tmp_path, capsys):
    path = tmp_path / "op.csv"
    path.write_text("".join(_csv()))
    main([str(path), "--peak-tbs", "2", "--json", str(tmp_path / "out.json")])
    out = capsys.readouterr().out
    assert "| _state_fwd_kernel | 2 |" in out and "2.04 GB in 0.510 ms" in out and "take 1.021 ms" in out
    report = json.loads((tmp_path / "out.json").read_text())
    assert report["peak_tbs"] == 2.0 and report["files"][str(path)]["total"]["gb"] == pytest.approx(2.042)
    with pytest.raises(SystemExit):
        main([str(path), "--peak-tbs", "0"])
