"""`rankdecay synth`: the synthetic tasks train through the shared trainer and learn above chance."""
import dataclasses
import json

import numpy as np
import pytest
import torch

from rankdecay.cli import main
from rankdecay.train.synth import SUITES, SyntheticData, spread_devices, summarise


def test_model_batch_scores_every_target_including_the_last():
    x = np.array([[1, 2, 3]])
    y = np.array([[-100, 7, 9]])
    b = SyntheticData.model_batch(x, y, "cpu")
    assert b["input_ids"].tolist() == [[1, 2, 3, 0]]
    # the model scores logits[t] against labels[t + 1] = targets[t]
    assert b["labels"][0, 1:].tolist() == [-100, 7, 9]


def test_synthetic_data_batches_shard_one_global_batch():
    d = SyntheticData("parity", {"seq_len": 8}, 64, 16, 3, seed=0)
    one = d.batches(3, 0, 1, 8, 8, "cpu")[0]["input_ids"]
    halves = [d.batches(3, r, 2, 8, 4, "cpu")[0]["input_ids"] for r in (0, 1)]
    assert torch.equal(one, torch.cat(halves))
    with pytest.raises(ValueError, match="vocab_size"):
        SyntheticData("parity", {"seq_len": 8}, 4, 4, 1)


def test_summary_takes_the_best_learning_rate_mean_over_seeds():
    runs = [{"mixer": "gdn", "setting": {"seq_len": 8}, "lr": lr, "seed": s, "acc": acc}
            for lr, s, acc in ((1e-3, 0, 0.5), (1e-3, 1, 0.7), (3e-3, 0, 0.9), (3e-3, 1, 0.3))]
    (row,) = summarise(runs, "seq_len")
    assert row["best_lr"] == 1e-3 and row["acc"] == pytest.approx(0.6) and row["seeds"] == 2


def test_tables_list_settings_in_numeric_order():
    from rankdecay.train.synth import markdown

    runs = [{"mixer": "gdn", "setting": {"seq_len": L}, "lr": 1e-3, "seed": 0, "acc": 0.5} for L in (1024, 256, 2048)]
    header = markdown(summarise(runs, "seq_len"), "mqar", "seq_len").splitlines()[2]
    assert header == "| mechanism | seq_len=256 | seq_len=1024 | seq_len=2048 |"


@pytest.mark.slow
@pytest.mark.parametrize("task, mixer, extra, chance, margin", [
    ("parity", "deltanet", ["--set", "allow_neg_eigval=true"], 1 / 2, 0.25),   # state tracking, tested 4x longer
    ("in_context_recall", "gdn", ["--steps", "200"], 1 / 8, 0.25),            # MAD recall: 8 values
    ("compression", "gdn", [], 1 / 15, 0.1),                                   # MAD compression: decoder read-out
    ("mqar", "gdn", ["--steps", "300"], 1 / 16, 0.1),                          # MQAR: 16 values, slow to learn
    ("passkey", "gdn", [], 1 / 10, 0.25),                                      # needle retrieval: digits
])
def test_tiny_synth_runs_learn_above_chance(tmp_path, capsys, monkeypatch, task, mixer, extra, chance, margin):
    suite = SUITES[task]["cpu"]
    monkeypatch.setitem(SUITES[task], "cpu", dataclasses.replace(suite, settings=suite.settings[:1]))  # one setting
    out = tmp_path / task
    assert main(["synth", task, "--mechanisms", mixer, "--no-progress", "--out", str(out), *extra]) == 0
    summary = json.loads((out / "results.json").read_text())["summary"]
    acc = summary[0]["acc"]
    assert acc > chance + margin, f"{task}: test accuracy {acc:.3f} vs chance {chance:.3f}"
    assert (out / "results.md").exists() and (out / "results.csv").exists() and (out / "results.png").exists()
    assert "test accuracy" in capsys.readouterr().out


def test_compression_model_reads_only_the_compress_token():
    from rankdecay.models import RankDecayConfig, RankDecayForCausalLM

    torch.manual_seed(0)
    lm = RankDecayForCausalLM(RankDecayConfig.from_preset("tiny", vocab_size=16, hidden_size=32, num_hidden_layers=1,
                                                          num_heads=2, head_k_dim=16, head_v_dim=16))
    data = SyntheticData("compression", {"seq_len": 8, "vocab_size": 16}, 4, 4, 16)
    model = data.wrap_model(lm)
    batch = SyntheticData.model_batch(data.train_x, data.train_y, "cpu")
    logits = model(input_ids=batch["input_ids"]).logits
    assert logits.shape == (4, 9, 16)
    other = batch["input_ids"].clone()
    other[:, -1] = 5  # the appended dummy is not read
    assert torch.equal(model(input_ids=other).logits, logits)
    other[:, 0] = (other[:, 0] + 1) % 15  # the sequence is, through the <compress> position
    assert not torch.allclose(model(input_ids=other).logits, logits)
    assert model.config is lm.config and model.num_params() == lm.num_params()  # the LM's attributes
    with pytest.raises(ValueError, match="positions"):
        model(input_ids=torch.zeros(1, 12, dtype=torch.long))


def test_every_task_has_both_presets():
    for task, presets in SUITES.items():
        assert {"cpu", "paper"} <= set(presets), task
        for suite in presets.values():
            for i, setting in enumerate(suite.settings):  # every preset generates, in the declared vocabulary
                d = SyntheticData(task, setting, 2, 2, suite.vocab_size, test_params=suite.test_params)
                assert d.train_x.max() < suite.vocab_size and suite.steps_for(i) >= 1
            for part in suite.train_mix or []:  # and so does every part of a training mixture
                d = SyntheticData(task, {**suite.settings[0], **{k: v for k, v in part.items() if k != "n"}}, 2, 2,
                                  suite.vocab_size)
                assert d.train_x.max() < suite.vocab_size


MIX = [{"seq_len": 16, "num_kv_pairs": 2, "n": 30}, {"seq_len": 32, "num_kv_pairs": 4, "n": 10}]


def test_training_mixture_draws_each_batch_from_one_part():
    setting = {"seq_len": 32, "num_kv_pairs": 4, "vocab_size": 64}
    tests = [setting, {**setting, "seq_len": 64, "num_kv_pairs": 8}]
    d = SyntheticData("mqar", setting, 0, 8, 64, seed=1, train_mix=MIX, test_settings=tests)
    assert [x.shape for x, _ in d.parts] == [(30, 16), (10, 32)]
    assert [x.shape for x, _ in d.tests] == [(8, 32), (8, 64)]
    parts = [d.part_of_step(s) for s in range(400)]
    assert 0.75 - 0.1 < parts.count(0) / 400 < 0.75 + 0.1, "parts are drawn in proportion to their sizes"
    for step in range(6):
        (batch,) = d.batches(step, 0, 1, 4, 4, "cpu")
        assert batch["input_ids"].shape == (4, MIX[parts[step]]["seq_len"] + 1), "one part per batch, unpadded"
        halves = [d.batches(step, r, 2, 4, 2, "cpu")[0]["input_ids"] for r in (0, 1)]
        assert torch.equal(batch["input_ids"], torch.cat(halves)), "every process draws from the same part"
    again = SyntheticData("mqar", setting, 0, 8, 64, seed=1, train_mix=MIX, test_settings=tests)
    assert all(torch.equal(d.batches(s, 0, 1, 4, 4, "cpu")[0]["input_ids"],
                           again.batches(s, 0, 1, 4, 4, "cpu")[0]["input_ids"]) for s in range(6)), "deterministic"
    x, y = d.parts[0]  # the MQAR semantics hold in the parts: each query's target is its key's value
    for row, tgt in zip(x, y):
        pairs = dict(zip(row[0:4:2], row[1:4:2]))
        assert all(tgt[t] == pairs[row[t]] for t in np.flatnonzero(tgt != -100))
    with pytest.raises(ValueError, match="train_mix"):
        SyntheticData("mqar", setting, 0, 8, 64, train_mix=[{"seq_len": 16, "num_kv_pairs": 2}])


def test_a_training_mixture_trains_once_and_tests_every_setting(tmp_path, monkeypatch):
    from rankdecay.train.synth import run_synth

    suite = dataclasses.replace(SUITES["mqar"]["cpu"], train_mix=MIX, test_size=8, label="seq_len",
                                settings=[{"seq_len": L, "num_kv_pairs": L // 8, "vocab_size": 32} for L in (32, 64)])
    monkeypatch.setitem(SUITES["mqar"], "cpu", suite)
    table = run_synth("mqar", ["gdn"], out=tmp_path, steps=3, batch_size=4, progress=False)
    assert sorted(r["x"] for r in table) == [32, 64]
    runs = json.loads((tmp_path / "results.json").read_text())["runs"]
    assert len(runs) == 2 and {r["lr"] for r in runs} == set(suite.lrs) and all(0 <= r["acc"] <= 1 for r in runs)


def test_parallel_jobs_give_the_sequential_results(tmp_path, monkeypatch):
    from rankdecay.train.synth import run_synth

    suite = SUITES["parity"]["cpu"]
    monkeypatch.setitem(SUITES["parity"], "cpu", dataclasses.replace(suite, train_size=64, test_size=16))
    kw = dict(mechanisms=["gdn", "deltanet"], steps=4, batch_size=4, progress=False)
    one = run_synth("parity", out=tmp_path / "one", **kw)
    two = run_synth("parity", out=tmp_path / "two", jobs=2, **kw)
    key = lambda rows: sorted((r["mixer"], r["acc"]) for r in rows)  # noqa: E731
    assert key(one) == key(two) and len(one) == 2
    with pytest.raises(ValueError, match="unknown mechanism"):
        run_synth("parity", mechanisms=["gdn", "mamba9"], out=tmp_path / "bad")
    with pytest.raises(ValueError, match="no parity setting matches"):
        run_synth("parity", mechanisms=["gdn"], out=tmp_path / "bad", only={"seq_len": [99]})


def test_parallel_runs_spread_over_the_gpus():
    assert spread_devices("auto", 5, 4) == ["cuda:0", "cuda:1", "cuda:2", "cuda:3", "cuda:0"]
    assert spread_devices("auto", 3, 1) == ["auto"] * 3, "one GPU (or none): every run where 'auto' puts it"
    assert spread_devices("cuda:1", 2, 8) == ["cuda:1", "cuda:1"], "an explicit device is kept"


def test_the_trainer_counts_a_mixtures_tokens_as_drawn(tmp_path):
    from rankdecay.train import read_metrics
    from rankdecay.train.config import TrainConfig
    from rankdecay.train.trainer import train

    setting = {"seq_len": 32, "num_kv_pairs": 4, "vocab_size": 32}
    data = SyntheticData("mqar", setting, 0, 4, 32, seed=3, train_mix=MIX)
    cfg = TrainConfig.from_sources(preset="tiny", overrides=dict(
        model={"hidden_size": 32, "num_hidden_layers": 1, "num_heads": 2, "intermediate_size": 64}, steps=6,
        batch_size=2, log_every=1, eval_every=0, save_every=0, progress=False, device="cpu", out_dir=str(tmp_path),
        seq_len=32))
    train(cfg, data=data)
    logged = [r["tokens"] for r in read_metrics(tmp_path / "metrics.jsonl") if r["split"] == "train"]
    drawn = np.cumsum([2 * (MIX[data.part_of_step(s)]["seq_len"] + 1) for s in range(6)])  # + the appended dummy
    assert logged == drawn.tolist()


def test_a_failing_run_is_reported_and_the_others_finish(tmp_path, monkeypatch, capsys):
    import rankdecay.train.synth as synth

    suite = SUITES["parity"]["cpu"]
    monkeypatch.setitem(SUITES["parity"], "cpu", dataclasses.replace(suite, train_size=64, test_size=16))
    real = synth._one_run

    def one_run(spec):
        if spec["mixer"] == "deltanet":
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real(spec)

    monkeypatch.setattr(synth, "_one_run", one_run)
    args = ["synth", "parity", "--mechanisms", "deltanet,gdn", "--steps", "2", "--batch-size", "4", "--no-progress",
            "--out", str(tmp_path)]
    assert main(args) == 1
    captured = capsys.readouterr()
    assert "[failed] deltanet" in captured.out and "1 of 2 runs failed" in captured.err
    summary = json.loads((tmp_path / "results.json").read_text())["summary"]
    assert [r["mixer"] for r in summary] == ["gdn"], "the run after the failed one finished and was written"
