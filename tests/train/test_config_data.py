"""Training configuration, data sources, the split, packing and the sampler."""
import argparse

import numpy as np
import pytest
import torch

from rankdecay.data import ByteTokenizer
from rankdecay.train import TRAIN_PRESETS, Corpus, TrainConfig, WindowSampler, lr_at, make_batch
from rankdecay.train.config import add_train_arguments, config_from_args
from rankdecay.train.data import is_validation


def parse(*argv):
    p = argparse.ArgumentParser()
    add_train_arguments(p)
    return config_from_args(p.parse_args(list(argv)))


# ----------------------------------------------------------------------------- config
def test_precedence_defaults_preset_file_flags(tmp_path):
    file = tmp_path / "run.toml"
    file.write_text('lr = 1e-3\nsteps = 7\nmixer = "hdla"\n[model]\nnum_hidden_layers = 3\n')
    cfg = parse("--config", str(file), "--steps", "9", "--set", "hidden_size=32")
    assert cfg.preset == "tiny" and cfg.seq_len == TRAIN_PRESETS["tiny"]["seq_len"]  # preset
    assert cfg.lr == 1e-3 and cfg.mixer == "hdla"                                     # file
    assert cfg.steps == 9                                                            # flag beats file
    assert cfg.model == {"num_hidden_layers": 3, "hidden_size": 32}                   # both merged
    assert parse("--preset", "340m").seq_len == 2048


def test_yaml_and_bool_flags(tmp_path):
    file = tmp_path / "run.yaml"
    file.write_text("compile: true\ndata: [a, b]\n")
    cfg = parse("--config", str(file), "--no-compile")
    assert cfg.compile is False and cfg.data == ["a", "b"]


@pytest.mark.parametrize("overrides, message", [
    ({"preset": "huge"}, "unknown training preset"),
    ({"mixer": "mamba9"}, "unknown mixer"),
    ({"model_preset": "7b"}, "unknown model preset"),
    ({"seq_len": 1}, "seq_len"),
    ({"batch_size": 0}, "batch_size"),
    ({"val_fraction": 1.0}, "val_fraction"),
    ({"pack": "zip"}, "pack"),
    ({"lr": 1e-3, "min_lr": 1e-2}, "min_lr"),
    ({"learning_rate": 1e-3}, "unknown training option"),
])
def test_bad_config_is_refused(overrides, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig.from_sources(overrides=overrides)


def test_schedule_warmup_cosine_floor():
    cfg = TrainConfig(steps=100, warmup_steps=10, lr=1.0, min_lr=0.1)
    lrs = [lr_at(s, cfg) for s in range(100)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert all(a <= b for a, b in zip(lrs[:10], lrs[1:10]))           # rising
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:]))            # then falling
    assert lr_at(55, cfg) == pytest.approx(0.55)                      # cosine midpoint
    assert min(lrs) >= 0.1 and lr_at(100, cfg) == pytest.approx(0.1)  # the floor


# ----------------------------------------------------------------------------- data
def write_docs(folder, n=40, size=300, seed=0):
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        words = rng.choice(["alpha", "beta", "gamma", "delta", "\n", "def", "x = 1"], size=size // 5)
        (folder / f"doc{i:03d}.txt").write_text(" ".join(words))
    return folder


def test_split_is_by_document_hash_and_stable(tmp_path):
    folder = write_docs(tmp_path / "d")
    corpus = Corpus.load([str(folder)], ByteTokenizer(), 0.25, [".txt"])
    held = [f"doc{i:03d}.txt" for i in range(40) if is_validation(f"doc{i:03d}.txt", 0.25)]
    assert 0 < len(held) < 40 and corpus.val.num_docs == len(held)
    eos = ByteTokenizer.eos_token_id
    assert (corpus.val.tokens == eos).sum() == len(held) and (corpus.train.tokens == eos).sum() == 40 - len(held)
    # Adding documents does not move any existing one across the split.
    (folder / "extra.txt").write_text("more text " * 50)
    again = Corpus.load([str(folder)], ByteTokenizer(), 0.25, [".txt"])
    assert again.val.num_docs == len(held) + is_validation("extra.txt", 0.25)
    # The validation text is exactly the held-out documents, joined in name order.
    expected = b"".join((folder / n).read_bytes() + b"" for n in held)
    got = bytes(int(t) for t in corpus.val.tokens if t != eos)
    assert got == expected


def test_single_file_holds_out_its_tail(tmp_path):
    f = tmp_path / "one.txt"
    f.write_text("x" * 1000)
    corpus = Corpus.load([str(f)], ByteTokenizer(), 0.1, [".txt"])
    assert len(corpus.val.tokens) == 101 and len(corpus.train.tokens) == 900


def test_missing_and_empty_sources(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        Corpus.load([str(tmp_path / "nope")], ByteTokenizer(), 0.1, [".txt"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no text found"):
        Corpus.load([str(tmp_path / "empty")], ByteTokenizer(), 0.1, [".txt"])


def test_stdlib_corpus_is_real_python():
    corpus = Corpus.load(["stdlib"], ByteTokenizer(), 0.02, [])
    assert corpus.train.num_docs > 100 and corpus.val.num_docs > 5
    text = bytes(int(t) for t in corpus.train.tokens[:200000] if t < 256).decode("utf-8", "replace")
    assert "def " in text and "import " in text


def test_sampler_is_seeded_epoch_permutation_and_too_long_windows_refused(tmp_path):
    corpus = Corpus.load([str(write_docs(tmp_path / "d"))], ByteTokenizer(), 0.2, [".txt"])
    s1, s2 = WindowSampler(corpus.train, 32, seed=3), WindowSampler(corpus.train, 32, seed=3)
    n = s1.num_windows
    first = [s1.window(i) for i in range(n)]
    assert sorted(first) == list(range(n))                                   # each window once per epoch
    assert [s2.window(i) for i in range(2 * n - 1, -1, -1)][::-1][:n] == first  # order-free lookups
    assert [s1.window(i) for i in range(n, 2 * n)] != first                  # a new order next epoch
    assert first != [WindowSampler(corpus.train, 32, seed=4).window(i) for i in range(n)]
    with pytest.raises(ValueError, match="seq_len .* longer than the data"):
        WindowSampler(corpus.train, len(corpus.train.tokens) + 1, seed=0)


def test_varlen_packing_restarts_at_documents():
    eos = ByteTokenizer.eos_token_id
    windows = np.array([[1, 2, eos, 3, 4, 5], [6, eos, 7, 8, eos, 9]])
    batch = make_batch(windows, "varlen", eos, "cpu")
    assert batch["input_ids"].shape == (1, 12)
    assert batch["cu_seqlens"].tolist() == [0, 3, 6, 8, 11, 12]
    labels = batch["labels"][0].tolist()
    assert [i for i, t in enumerate(labels) if t == -100] == [0, 3, 6, 8, 11]
    concat = make_batch(windows, "concat", eos, "cpu")
    assert torch.equal(concat["input_ids"], concat["labels"]) and concat["input_ids"].shape == (2, 6)


def test_varlen_loss_has_no_cross_document_leakage():
    """The packed loss equals the sum of the documents' losses computed one at a time."""
    from rankdecay.models import RankDecayConfig, RankDecayForCausalLM
    from rankdecay.train.trainer import token_losses

    torch.manual_seed(0)
    model = RankDecayForCausalLM(RankDecayConfig.from_preset("tiny", mixer="gdn")).eval()
    eos = ByteTokenizer.eos_token_id
    windows = np.array([[10, 11, 12, eos, 20, 21, 22, 23, 24, eos, 30, 31]])
    packed, valid = token_losses(model, make_batch(windows, "varlen", eos, "cpu"), None)
    total = 0.0
    for doc in ([10, 11, 12, eos], [20, 21, 22, 23, 24, eos], [30, 31]):
        ids = torch.tensor([doc])
        loss, _ = token_losses(model, {"input_ids": ids, "labels": ids}, None)
        total += loss.sum().item()
    assert valid.sum().item() == 12 - 3
    assert packed.sum().item() == pytest.approx(total, rel=1e-5)
