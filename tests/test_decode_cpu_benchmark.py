"""``benchmarks/decode_cpu.py`` runs end to end on tiny contexts, the full-attention contrast ("attn") included: it
once asked for a window of 2**30 slots, which decoding's ring of window slots cannot hold."""
import sys

import pytest
import torch

from benchmarks import decode_cpu

from .conftest import NO_CPU_COMPILE, can_compile_on_cpu


def test_decode_cpu_prints_a_row_per_mixer(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["decode_cpu.py", "--mixers", "gdn", "swa", "attn", "--contexts", "4", "12",
                                      "--steps", "2", "--threads", str(torch.get_num_threads())])
    decode_cpu.main()
    rows = [line.split("|")[1:-1] for line in capsys.readouterr().out.splitlines() if line.startswith("| ")][1:]
    assert [r[0].strip() for r in rows] == ["gdn", "swa", "attn"]
    for row in rows:
        ms = [float(x) for x in row[1:3]]
        assert all(m > 0 for m in ms) and abs(float(row[3]) - ms[1] / ms[0]) < 0.01


@pytest.mark.slow
@pytest.mark.skipif(not can_compile_on_cpu(), reason=NO_CPU_COMPILE)
def test_decode_cpu_compiled_rows(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["decode_cpu.py", "--mixers", "gdn", "--contexts", "4", "12", "--steps", "2",
                                      "--threads", str(torch.get_num_threads()), "--compile"])
    decode_cpu.main()
    rows = [line.split("|")[1:-1] for line in capsys.readouterr().out.splitlines() if line.startswith("| ")][1:]
    assert [r[0].strip() for r in rows] == ["gdn", "gdn, compiled"]
    assert all(float(x) > 0 for row in rows for x in row[1:3])
