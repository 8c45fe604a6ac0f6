"""`rankdecay train` / `rankdecay eval` end to end on the CPU: the main job, resume, DDP, errors, SIGINT."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import weakref
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rankdecay.cli import main
from rankdecay.train import checkpoints, read_metrics

from .test_config_data import write_docs

REPO = Path(__file__).resolve().parents[2]
SMALL = ["--seq-len", "32", "--batch-size", "4", "--no-progress", "--eval-batches", "2", "--device", "cpu",
         "--set", "num_hidden_layers=1", "--set", "hidden_size=32", "--set", "intermediate_size=64"]


def env():
    e = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    e.pop("RANKDECAY_DEBUG", None)
    return e


@pytest.fixture(scope="module")
def docs(tmp_path_factory):
    return write_docs(tmp_path_factory.mktemp("data") / "docs", n=60, size=600)


def weights(folder):
    return load_file(str(Path(folder) / "model.safetensors"))


def train_losses(folder):
    return [(r["step"], r["last_loss"]) for r in read_metrics(Path(folder) / "metrics.jsonl") if r["split"] == "train"]


@pytest.mark.slow
def test_main_job_learns_and_its_model_generates_and_evaluates(tmp_path, capsys):
    """The README's `rankdecay train` (tiny preset, stdlib corpus) at a reduced step count."""
    out = tmp_path / "run"
    assert main(["train", "--steps", "40", "--warmup-steps", "5", "--eval-every", "20", "--save-every", "20",
                 "--log-every", "5", "--out-dir", str(out), "--no-progress"]) == 0
    records = read_metrics(out / "metrics.jsonl")
    train = [r for r in records if r["split"] == "train"]
    val = [r for r in records if r["split"] == "val"]
    assert train[0]["loss"] > 5.0 and train[-1]["loss"] < train[0]["loss"] - 1.0   # loss falls
    assert val[-1]["val_loss"] < val[0]["val_loss"] and val[-1]["val_bpb"] < 8.0     # beats uniform bytes
    assert all(r["tokens_per_s"] > 0 for r in train)
    assert [p.name for p in checkpoints(out)] == ["checkpoint-0000020", "checkpoint-0000040"]
    assert (out / "loss.png").stat().st_size > 1000 and (out / "model.safetensors").exists()

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out / "checkpoint-0000040")
    assert model.config.mixer == "gdn" and model.config.vocab_size == 264
    capsys.readouterr()
    assert main(["generate", str(out), "--prompt", "import ", "--max-new-tokens", "8"]) == 0
    assert capsys.readouterr().out.startswith("import ")
    assert main(["eval", str(out), "--max-windows", "4", "--no-progress"]) == 0
    text = capsys.readouterr().out
    assert "bits/byte" in text and "beyond the training length 256" in text
    report = json.loads((out / "eval" / "eval.json").read_text())
    assert report["seq_len"] == 1024 and report["buckets"][-1]["end"] == 1024
    assert abs(report["loss"] - val[-1]["val_loss"]) < 0.5
    assert (out / "eval" / "eval_positions.png").exists()


def test_resume_continues_bit_for_bit(tmp_path, docs):
    args = ["train", "--data", str(docs), *SMALL, "--steps", "6", "--warmup-steps", "2", "--save-every", "3",
            "--keep-checkpoints", "0", "--log-every", "1", "--eval-every", "0", "--mixer", "hdla"]
    full = tmp_path / "full"
    assert main(args + ["--out-dir", str(full)]) == 0
    part = tmp_path / "part"
    shutil.copytree(full, part)
    shutil.rmtree(part / "checkpoint-0000006")
    assert main(args + ["--out-dir", str(part), "--resume"]) == 0
    assert train_losses(part) == train_losses(full)          # steps 1-3 kept, 4-6 recomputed, identical
    a, b = weights(full), weights(part)
    assert all(torch.equal(a[k], b[k]) for k in a)
    opt_a = torch.load(full / "checkpoint-0000006" / "trainer_state.pt", weights_only=False)["optimizer"]["state"]
    opt_b = torch.load(part / "checkpoint-0000006" / "trainer_state.pt", weights_only=False)["optimizer"]["state"]
    assert all(torch.equal(opt_a[k]["exp_avg_sq"], opt_b[k]["exp_avg_sq"]) for k in opt_a)


def test_time_limit_stops_evaluates_and_saves_where_it_got(tmp_path, docs, capsys):
    out = tmp_path / "run"
    assert main(["train", "--data", str(docs), *SMALL, "--steps", "50", "--time-limit", "1e-9", "--log-every", "10",
                 "--eval-every", "0", "--out-dir", str(out)]) == 0
    assert "time limit of 1e-09 s reached at step 1 of 50" in capsys.readouterr().out
    assert [p.name for p in checkpoints(out)] == ["checkpoint-0000001"] and (out / "model.safetensors").exists()
    records = read_metrics(out / "metrics.jsonl")
    assert [(r["split"], r["step"]) for r in records] == [("train", 1), ("val", 1)]
    assert main(["train", "--data", str(docs), *SMALL, "--time-limit", "-1", "--out-dir", str(tmp_path / "x")]) == 2
    assert "time_limit must be >= 0" in capsys.readouterr().err


def torchrun(args, nproc=2):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "rankdecay", *args]
    res = subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return res


@pytest.mark.slow
def test_ddp_and_fsdp_equal_one_process_and_resume_on_another_world_size(tmp_path, docs):
    common = ["train", "--data", str(docs), *SMALL, "--steps", "6", "--warmup-steps", "2", "--save-every", "3",
              "--keep-checkpoints", "0", "--log-every", "1", "--eval-every", "3", "--pack", "varlen"]
    one = tmp_path / "one"
    assert main(common + ["--out-dir", str(one), "--micro-batch-size", "2"]) == 0
    two = tmp_path / "two"
    torchrun(common + ["--out-dir", str(two), "--micro-batch-size", "1"])  # 2 processes x 2 accumulated
    w1, w2 = weights(one), weights(two)
    assert w1.keys() == w2.keys()
    worst = max((w1[k] - w2[k]).abs().max().item() for k in w1)
    assert worst < 1e-5, f"DDP weights differ from one process by {worst:.2e}"
    l1, l2 = train_losses(one), train_losses(two)
    assert [s for s, _ in l1] == [s for s, _ in l2]
    assert all(abs(a - b) < 1e-5 for (_, a), (_, b) in zip(l1, l2))
    # Only rank 0 wrote: one metrics line per step and evaluation.
    assert len(read_metrics(two / "metrics.jsonl")) == len(read_metrics(one / "metrics.jsonl"))

    # FSDP2 (fully_shard) over the same 2 processes: the same weights again.
    sharded = tmp_path / "fsdp"
    torchrun(common + ["--out-dir", str(sharded), "--fsdp"])
    w4 = weights(sharded)
    assert max((w1[k] - w4[k]).abs().max().item() for k in w1) < 1e-5

    # A checkpoint of the 2-process run continues in 1 process (same global batch) to the same weights.
    resumed = tmp_path / "resumed"
    shutil.copytree(two, resumed)
    shutil.rmtree(resumed / "checkpoint-0000006")
    assert main(common + ["--out-dir", str(resumed), "--resume"]) == 0
    w3 = weights(resumed)
    assert max((w1[k] - w3[k]).abs().max().item() for k in w1) < 1e-5

    # The test can fail: another seed's run is far from these weights.
    other = tmp_path / "other"
    assert main(common + ["--out-dir", str(other), "--seed", "1"]) == 0
    assert max((w1[k] - weights(other)[k]).abs().max().item() for k in w1) > 1e-3


def test_process_group_meets_at_a_barrier_before_it_goes_and_is_left_after_an_error(monkeypatch):
    from rankdecay.train import trainer

    calls = []
    monkeypatch.setattr(trainer.dist, "barrier", lambda: calls.append("barrier"))
    monkeypatch.setattr(trainer.dist, "destroy_process_group", lambda: calls.append("destroy"))
    started = trainer.Dist.__new__(trainer.Dist)  # as a torchrun rank that started the group
    started.started, started.device = True, torch.device("cpu")
    monkeypatch.setattr(trainer, "Dist", lambda device: started)

    def trains(cfg, d, data):  # leaves a reference cycle behind, as a model wrapped by FSDP2 or DDP does
        cycle = {}
        cycle["self"] = cycle
        holder = type("Model", (), {})()
        holder.cycle = cycle
        cycle["model"] = holder
        weakref.finalize(holder, calls.append, "freed")
        return {"done": True}

    monkeypatch.setattr(trainer, "_train", trains)
    assert trainer.train(trainer.TrainConfig()) == {"done": True}
    # what the run left is freed while the group is alive, then every rank meets, then the group goes
    assert calls == ["freed", "barrier", "destroy"] and not started.started
    started.close()  # once only
    assert calls == ["freed", "barrier", "destroy"]

    calls.clear()
    started.started = True

    def fails(cfg, d, data):
        raise RuntimeError("rank 1 ran out of data")

    monkeypatch.setattr(trainer, "_train", fails)
    with pytest.raises(RuntimeError, match="ran out of data"):
        trainer.train(trainer.TrainConfig())
    assert calls == [] and started.started


@pytest.mark.parametrize("args, message", [
    (["--data", "/no/such/folder"], "does not exist"),
    (["--data", "{empty}"], "no text found"),
    (["--seq-len", "100000"], "longer than the data"),
    (["--preset", "giant"], "unknown training preset"),
    (["--mixer", "transformer++"], "unknown mixer"),
    (["--batch-size", "3", "--micro-batch-size", "2"], "multiple of micro_batch_size"),
    (["--config", "/no/such.toml"], "does not exist"),
])
def test_bad_input_is_one_clear_line(tmp_path, docs, capsys, args, message):
    (tmp_path / "empty").mkdir()
    args = [a.replace("{empty}", str(tmp_path / "empty")) for a in args]
    if "--data" not in args:
        args = ["--data", str(docs), *args]
    rc = main(["train", *args, "--out-dir", str(tmp_path / "out"), "--steps", "2", "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and message in err and "Traceback" not in err, err


def test_existing_run_needs_resume_and_eval_needs_a_model(tmp_path, docs, capsys):
    args = ["train", "--data", str(docs), *SMALL, "--steps", "2", "--out-dir", str(tmp_path / "r")]
    assert main(args) == 0
    assert main(args) == 2
    assert "--resume" in capsys.readouterr().err
    assert main(["eval", str(tmp_path / "nothing")]) == 2
    assert "not a saved model" in capsys.readouterr().err


@pytest.mark.slow
def test_sigint_saves_a_checkpoint_and_leaves_it_intact(tmp_path, docs):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "rankdecay", "train", "--data", str(docs), *SMALL, "--steps", "100000",
           "--save-every", "4", "--eval-every", "0", "--out-dir", str(out)]
    proc = subprocess.Popen(cmd, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 240
        while not checkpoints(out) and time.time() < deadline and proc.poll() is None:
            time.sleep(0.2)
        assert checkpoints(out), "no checkpoint appeared"
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130, stderr[-2000:]
    assert "Traceback" not in stderr and "--resume" in stdout
    last = checkpoints(out)[-1]
    state = torch.load(last / "trainer_state.pt", weights_only=False)
    assert last.name == f"checkpoint-{state['step']:07d}"
    assert not list(out.glob("*.tmp"))
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(last)
    assert torch.isfinite(model(torch.tensor([[1, 2, 3]])).logits).all()
    # ... and the run continues from it.
    assert main(["train", "--data", str(docs), *SMALL, "--steps", str(state["step"] + 2), "--eval-every", "0",
                 "--out-dir", str(out), "--resume"]) == 0
    assert checkpoints(out)[-1].name == f"checkpoint-{state['step'] + 2:07d}"


def test_a_local_tokenizer_file_trains_saves_and_generates(tmp_path, docs, capsys):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    tok.train([str(p) for p in sorted(docs.iterdir())],
              trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "</s>"]))
    tok.save(str(tmp_path / "tokenizer.json"))
    out = tmp_path / "run"
    assert main(["train", "--data", str(docs), *SMALL, "--steps", "3", "--tokenizer", str(tmp_path / "tokenizer.json"),
                 "--out-dir", str(out)]) == 0
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out)
    n = tok.get_vocab_size()
    assert model.config.vocab_size == 64 * -(-n // 64)  # padded to a multiple of 64
    assert model.config.eos_token_id == tok.token_to_id("</s>")
    assert (out / "tokenizer.json").exists()
    capsys.readouterr()
    assert main(["generate", str(out), "--prompt", "alpha", "--max-new-tokens", "4"]) == 0
    assert capsys.readouterr().out.startswith("alpha")
    assert main(["generate", str(out), "--prompt", "alpha beta", "--prompt", "", "--max-new-tokens", "4"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and lines[0].startswith("alpha beta"), lines
    assert main(["eval", str(out), "--seq-len", "32", "--max-windows", "2", "--no-progress"]) == 0


def test_memory_stats_only_on_a_gpu():
    """The train log's peak memory: ``torch.cuda.max_memory_allocated`` in GiB on a CUDA device, nothing on the
    CPU (where no allocator counts it)."""
    from rankdecay.train.trainer import memory_stats

    assert memory_stats(torch.device("cpu")) == {}
    if torch.cuda.is_available():
        x = torch.empty(2 ** 28, dtype=torch.uint8, device="cuda")  # 0.25 GiB held
        assert memory_stats(torch.device("cuda"))["max_memory_gib"] >= 0.25
        del x


def test_auto_matmul_precision_is_bf16_products_under_16_bit_autocast_on_cuda():
    """``matmul_precision="auto"`` (the default): "medium" (the kernels' products in bf16, as fla's) on CUDA under
    bf16 or fp16 autocast, whose linear maps already hand the kernels bf16 inputs; "highest" without autocast and on
    the CPU; a setting given is kept."""
    from rankdecay.train import TrainConfig
    from rankdecay.train.trainer import matmul_precision

    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert TrainConfig().matmul_precision == "auto"
    assert [matmul_precision("auto", cuda, d) for d in ("auto", "bfloat16", "float16", "float32")] == \
        ["medium", "medium", "medium", "highest"]
    assert [matmul_precision("auto", cpu, d) for d in ("auto", "bfloat16", "float32")] == ["highest"] * 3
    assert [matmul_precision(s, cuda, "auto") for s in ("highest", "high", "medium")] == ["highest", "high", "medium"]
    with pytest.raises(ValueError, match="matmul_precision must be auto, highest, high or medium"):
        TrainConfig.from_sources(overrides={"matmul_precision": "low"})
