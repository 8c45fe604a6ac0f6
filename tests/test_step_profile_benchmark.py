"""``benchmarks/step_profile.py`` runs end to end on the CPU on a tiny step, and sorts kernels into families."""
import json
import sys

from benchmarks import step_profile


def test_kernel_families():
    assert step_profile.family("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT") == "matmul"
    assert step_profile.family("_grad_inputs_kernel") == "triton"
    assert step_profile.family("void at::native::vectorized_elementwise_kernel<4, CUDAFunctor_add<float>>") == \
        "elementwise / reduction"
    assert step_profile.family("void at::native::(anonymous namespace)::cunn_SoftMaxForward<4>") == "other"


def test_step_profile_prints_and_writes_a_row_per_mixer(monkeypatch, capsys, tmp_path):
    out = tmp_path / "step.json"
    monkeypatch.setattr(sys, "argv", ["step_profile.py", "--preset", "tiny", "--mixers", "gdn", "deltanet",
                                      "--batch-size", "2", "--seq-len", "16", "--host-shape", "1", "8", "--steps",
                                      "2", "--warmup", "1", "--top", "3", "--device", "cpu", "--json", str(out)])
    step_profile.main()
    lines = capsys.readouterr().out.splitlines()
    rows = [line.split("|")[1:-1] for line in lines if line.startswith("| gdn |") or line.startswith("| deltanet |")]
    assert [r[0].strip() for r in rows] == ["gdn", "deltanet"]
    data = json.loads(out.read_text())
    assert [r["mixer"] for r in data["rows"]] == ["gdn", "deltanet"]
    for r in data["rows"]:
        assert r["step"]["B"] == 2 and r["host_only"]["T"] == 8
        assert 0 < r["step"]["wall_ms_min"] <= r["step"]["wall_ms_median"]
        assert abs(sum(f["ms"] for f in r["families"].values()) - r["device_ms"]) < 1e-6
        assert r["families"]["matmul"]["launches"] > 0 and len(r["top"]) == 3


def test_use_cache_leaves_the_forward_at_the_configs_default():
    """--use-cache calls the model as transformers' Trainer does (use_cache unset); without it, use_cache=False."""
    import torch

    seen = []

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(()))

        def forward(self, ids, labels=None, use_cache=None):
            seen.append(use_cache)
            return type("Out", (), {"loss": self.w * ids.float().mean()})

    ids = torch.ones(1, 4, dtype=torch.long)
    for use_cache in (True, False):
        step_profile.make_step(Model(), ids, torch.device("cpu"), use_cache)()
    assert seen == [None, False]
