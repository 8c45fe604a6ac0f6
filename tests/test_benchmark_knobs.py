"""The benchmark scripts' launch-knob overrides (``benchmarks/kernels.py``'s ``--knob``, which ``sm90_resources.py``
takes too): each prefix reaches its own table, and a name its table lacks is refused."""
import pytest
import torch

from benchmarks.kernels import apply_knobs
from rankdecay.ops.triton import channel, chunk_bwd, chunk_fwd, chunk_state


@pytest.fixture
def tables(monkeypatch):
    for table in (channel._CHANNEL, chunk_bwd._CONFIG, chunk_state._LAUNCH):
        for key, value in dict(table).items():  # restored after the test
            monkeypatch.setitem(table, key, value)
    monkeypatch.setattr(chunk_fwd, "_KNOBS", {})


def test_each_prefix_reaches_its_table(tables):
    apply_knobs(["ch_bk=32", "bwd_inputs=2", "state_warps=8", "fwd_state_stages=1", "rows=128",
                 "stored=bfloat16"])
    assert channel._CHANNEL["bk"] == 32
    assert chunk_bwd._CONFIG["inputs"] == 2
    assert chunk_state._LAUNCH["warps"] == 8
    assert chunk_fwd._KNOBS == {"state_stages": 1, "rows": 128, "stored": torch.bfloat16}


def test_unknown_name_is_refused(tables):
    with pytest.raises(SystemExit, match="ch_nonsense"):
        apply_knobs(["ch_nonsense=1"])
