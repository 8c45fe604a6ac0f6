"""The benchmark scripts' launch-knob overrides (``benchmarks/kernels.py``'s ``--knob``, which ``sm90_resources.py``
takes too): each prefix reaches its own table, and a name its table lacks is refused."""
import pytest
import torch

from benchmarks.kernels import apply_knobs
from rankdecay.ops.triton import channel, chunk_bwd, chunk_fwd, chunk_state

from .conftest import assert_matches


@pytest.fixture
def tables(monkeypatch):
    for table in (channel._CHANNEL, chunk_bwd._CONFIG, chunk_state._LAUNCH, *chunk_fwd._LOG_CUMSUM.values()):
        for key, value in dict(table).items():  # restored after the test
            monkeypatch.setitem(table, key, value)
    monkeypatch.setattr(chunk_fwd, "_KNOBS", {})


def test_each_prefix_reaches_its_table(tables):
    apply_knobs(["ch_bk=32", "bwd_inputs=2", "state_warps=8", "fwd_state_stages=1", "rows=128",
                 "stored=bfloat16", "fuse_output=True", "neumann=None", "merge=tf32", "lc_16_prep=128x2"])
    assert chunk_fwd._LOG_CUMSUM[16]["prep"] == (128, 2) and chunk_fwd.log_cumsum_launch(16, True) == (128, 2)
    assert channel._CHANNEL["bk"] == 32
    assert chunk_bwd._CONFIG["inputs"] == 2
    assert chunk_state._LAUNCH["warps"] == 8
    assert chunk_fwd._KNOBS == {"state_stages": 1, "rows": 128, "stored": torch.bfloat16, "fuse_output": True,
                                "neumann": None, "merge": "tf32"}


def test_unknown_name_is_refused(tables):
    with pytest.raises(SystemExit, match="ch_nonsense"):
        apply_knobs(["ch_nonsense=1"])
    for name in ("lc_16_fast", "lc_48_prep", "lc_prep"):
        with pytest.raises(SystemExit, match=name):
            apply_knobs([f"{name}=64x1"])
    for name in ("fwd_state_warps", "rowz"):  # chunk_fwd._KNOBS's names are checked too
        with pytest.raises(SystemExit, match=name):
            apply_knobs([f"{name}=8"])
    assert chunk_fwd._KNOBS == {}


def test_fwd_variants_refuse_unknown_names(tables):
    """``fwd_variants.py --variants``: ``chunk_fwd._KNOBS`` names as they are and ``ch_`` for ``channel._CHANNEL``;
    a name neither has is refused before anything is timed."""
    from benchmarks.fwd_variants import knobs

    assert knobs("") == ({}, {})
    assert knobs("state_bv=16,ch_warps=2,stored=None") == ({"state_bv": 16, "stored": None}, {"warps": 2})
    for spec in ("state_warps=8", "state_bv=16,ch_nonsense=1"):
        with pytest.raises(SystemExit, match=spec.split(",")[-1].split("=")[0]):
            knobs(spec)


def test_variants_alternate_and_restore_the_knobs(tables):
    """``kernels.py --variants``: each variant's knobs are in force while its cases run (on top of the knobs set
    before), the variants alternate round by round, the tables are put back after each, and every row is labelled;
    the summary gives each variant's ms round by round."""
    from benchmarks.kernels import run_variants, variant_summary

    apply_knobs(["ch_bk=32"])  # as --knob: under every variant
    before = [dict(t) for t in (chunk_fwd._KNOBS, channel._CHANNEL, chunk_bwd._CONFIG, chunk_state._LAUNCH,
                                *chunk_fwd._LOG_CUMSUM.values())]
    prep = chunk_fwd._LOG_CUMSUM[16]["prep"]
    seen = []

    labels = []

    def run(label):
        labels.append(label)
        seen.append((dict(chunk_fwd._KNOBS), channel._CHANNEL["warps"], channel._CHANNEL["bk"],
                     chunk_fwd._LOG_CUMSUM[16]["prep"]))
        return [dict(op="HDLA", pass_="fwd", ms=1.0 + len(seen), peak_mb=750.0)]

    rows = run_variants(["", "ch_warps=4,kda_pair=0,lc_16_prep=16x1", "fwd_state_stages=1"], 2, run)
    default_warps = before[1]["warps"]
    one_round = [({}, default_warps, 32, prep), ({"kda_pair": 0}, 4, 32, (16, 1)),
                 ({"state_stages": 1}, default_warps, 32, prep)]
    assert seen == one_round * 2
    assert [t for t in (chunk_fwd._KNOBS, channel._CHANNEL, chunk_bwd._CONFIG, chunk_state._LAUNCH,
                        *chunk_fwd._LOG_CUMSUM.values())] == before
    assert [(r["variant"], r["round"]) for r in rows] == [
        ("default", 1), ("ch_warps=4,kda_pair=0,lc_16_prep=16x1", 1), ("fwd_state_stages=1", 1),
        ("default", 2), ("ch_warps=4,kda_pair=0,lc_16_prep=16x1", 2), ("fwd_state_stages=1", 2)]
    assert labels == [dict(variant=r["variant"], round=r["round"]) for r in rows]  # run knows its label
    summary = variant_summary(rows)
    assert "| HDLA | fwd | default | 2.000 / 5.000 | 750 |" in summary
    assert "| HDLA | fwd | fwd_state_stages=1 | 4.000 / 7.000 | 750 |" in summary


def test_a_refused_variant_leaves_the_knobs_as_they_were(tables):
    from benchmarks.kernels import run_variants

    before = dict(channel._CHANNEL)
    with pytest.raises(SystemExit, match="ch_nonsense"):
        run_variants(["ch_warps=4,ch_nonsense=1"], 1, lambda label: [])
    assert channel._CHANNEL == before


def test_row_log_keeps_every_row_measured(tmp_path):
    """``kernels.py --json``: the file holds every row so far after each case, so a run cut short (a timeout, a
    later case's error) keeps what it measured; without a path nothing is written."""
    import json

    from benchmarks.kernels import RowLog

    path = tmp_path / "rows.json"
    log = RowLog(str(path))
    log.add([dict(op="GDN", pass_="fwd", ms=0.33)])
    assert json.loads(path.read_text()) == [dict(op="GDN", pass_="fwd", ms=0.33)]
    log.add([dict(op="HDLA", pass_="fwd", ms=0.9), dict(op="HDLA", pass_="fwd+bwd", ms=4.6)])
    assert [r["op"] for r in json.loads(path.read_text())] == ["GDN", "HDLA", "HDLA"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rows.json"]  # no temporary file left
    quiet = RowLog(None)
    quiet.add([dict(op="GDN")])
    assert quiet.rows == [dict(op="GDN")] and sorted(p.name for p in tmp_path.iterdir()) == ["rows.json"]


@pytest.mark.parametrize("name", ["gdn", "hdla", "kda", "hh-gdn", "gla", "gdp", "dplr-1-1", "dplr-2-1", "dplr-2-2",
                                  "dplr-4-1"])
def test_each_chunked_case_runs(name):
    """Every chunked case of ``kernels.py`` builds inputs its op accepts (at an awkward tiny size, on the CPU's chunked
    path): finite outputs of the right shape, finite gradients for every input the benchmark differentiates, and a
    positive FLOP count for its TFLOP/s column."""
    from benchmarks.kernels import CASES

    case = CASES[name]
    x = case.make(1, 37, 2, 16, 8, torch.device("cpu"), torch.float32)
    leaves = {k: (v.detach().requires_grad_(True) if v.is_floating_point() and k != "mask" else v)
              for k, v in x.items()}
    o = case.ours(leaves)
    o.square().sum().backward()
    assert o.shape == (1, 37, 2, 8) and torch.isfinite(o).all()
    grads = [v.grad for v in leaves.values() if v.requires_grad]
    assert grads and all(g is not None and torch.isfinite(g).all() for g in grads)
    assert case.flops_per_token_head(16, 8, 16) > 0


@pytest.mark.parametrize("name", ["gdn-decode", "gdn-decode-inplace", "gdn-decode-bf16", "kda-decode"])
def test_each_decode_case_runs_and_matches_its_peer(name):
    """Every decode case of ``kernels.py`` builds inputs its op accepts (one token through the decode kernel:
    interpreted on the CPU, on the GPU where there is one, as the kernel takes only CUDA tensors there): finite
    [B, 1, H, V] outputs; and where the case names fla's kernel as its peer, the same outputs from the same inputs,
    so that the benchmark's ratio compares the same step."""
    from benchmarks.kernels import CASES

    case = CASES[name]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    make = lambda: case.make(3, 1, 2, 16, 8, device, torch.float32)  # noqa: E731
    torch.manual_seed(0)
    x = make()
    with torch.no_grad():
        o = case.ours(x)
        assert o.shape == (3, 1, 2, 8) and torch.isfinite(o).all()
        if "fla" in case.peers:
            pytest.importorskip("fla.ops", reason="flash-linear-attention is in the test extra")
            torch.manual_seed(0)
            ref = case.peers["fla"](make())
            assert_matches(o, ref.to(o.dtype), 1e-5, name)
