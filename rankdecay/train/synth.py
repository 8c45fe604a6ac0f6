"""``rankdecay synth``: train each mechanism on a synthetic task with the shared trainer, evaluate, tabulate.

A *suite* is a task with settings (e.g. MQAR at several lengths), a model shape and a training
budget, in a ``cpu`` preset (minutes on 2 cores) and a ``paper`` preset (the papers'
hyper-parameters: Head-in-Head Tables 7-8, HDLA App. D, Zoology, MAD). Every (mechanism,
setting, learning rate, seed) is one ``train(cfg, data=SyntheticData(...))`` run; the reported
accuracy per (mechanism, setting) is the best learning rate's mean over seeds, as the papers
report the best of their sweeps. Accuracy is token accuracy on the scored positions of the
held-out test set (generated from a different seed).
"""
from __future__ import annotations

import csv
import dataclasses
import inspect
import json
import math
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

from ..data import synthetic as S
from .config import TrainConfig
from .data import EpochOrder
from .trainer import Dist, eval_chunks, sample_ranges, token_losses, train


class SyntheticData:
    """A synthetic task as trainer data (see ``TextData`` for the interface).

    ``params``: the generator's parameters; ``test_params`` override them for the test set.
    ``train_mix``: train on a mixture instead, a list of parameter overrides each with ``n``, its
    number of sequences (e.g. Zoology's MQAR curriculum of short sequences); every training batch
    is drawn from one part of the mixture (chosen per step with probability proportional to
    ``n``), so short sequences are not padded to the longest. ``test_settings``: several test
    sets (overrides of ``params``), each of ``test_size`` sequences, scored separately
    (``val_acc_by_test``)."""

    def __init__(self, task: str, params: dict, train_size: int, test_size: int, vocab_size: int, seed: int = 0,
                 test_params: dict | None = None, train_mix: list[dict] | None = None,
                 test_settings: list[dict] | None = None):
        if task not in S.TASKS:
            raise ValueError(f"unknown task {task!r}; choose from {', '.join(S.TASKS)}")
        gen = S.TASKS[task]
        takes_train = "train" in inspect.signature(gen).parameters
        train_kw = {**params, **({"train": True} if takes_train else {})}
        test_kw = {**params, **(test_params or {}), **({"train": False} if takes_train else {})}
        if train_mix is not None and (not train_mix or any(int(m.get("n", 0)) < 1 for m in train_mix)):
            raise ValueError(f"train_mix must be a non-empty list of settings each with n >= 1, got {train_mix}")
        self.parts = [gen(int(m["n"]), seed=S.split_seed(seed, "train", i),
                          **{**train_kw, **{k: v for k, v in m.items() if k != "n"}})
                      for i, m in enumerate(train_mix or [])]
        if not self.parts:
            self.parts = [gen(train_size, seed=S.split_seed(seed, "train"), **train_kw)]
        test_settings = list(test_settings or [{}])
        self.tests = [gen(test_size, seed=S.split_seed(seed, "test", i), **{**test_kw, **t})
                      for i, t in enumerate(test_settings)]
        self.train_x, self.train_y = max(self.parts, key=lambda p: p[0].shape[1])  # the longest part
        top = int(max(max(int(x.max()) for x, _ in self.parts), max(int(x.max()) for x, _ in self.tests)))
        if top >= vocab_size:
            raise ValueError(f"{task}: tokens up to {top} need vocab_size > {top}, got {vocab_size}")
        self.tokenizer = None
        sizes = np.array([len(x) for x, _ in self.parts], dtype=np.float64)
        self._weights = sizes / sizes.sum()
        self._seed = seed
        self._orders = [EpochOrder(len(x), (seed, 7, i) if i else (seed, 7)) for i, (x, _) in enumerate(self.parts)]
        self.model_overrides = {"vocab_size": 8 * -(-vocab_size // 8), "bos_token_id": None, "eos_token_id": None,
                                "pad_token_id": None}
        train_desc = (f"{int(sizes.sum())} training sequences of "
                      + " / ".join(str(x.shape[1]) for x, _ in self.parts) + " tokens"
                      + (f" (a mixture: {train_mix})" if train_mix else ""))
        tests_desc = [{**test_kw, **t} for t in test_settings]
        self.description = (f"{task} {params} (test {tests_desc}): {train_desc}, {test_size} test sequences per test "
                            f"set, vocab {vocab_size}")
        self.task = task
        self.seq_len = self.train_x.shape[1]

    def wrap_model(self, model):
        """The model the trainer trains: the language model itself, or for MAD's compression task
        the language model with MAD's reconstruction decoder on the last position."""
        return CompressionModel(model, self.seq_len + 1) if self.task == "compression" else model

    @staticmethod
    def model_batch(x: np.ndarray, y: np.ndarray, device) -> dict:
        """Inputs with one dummy token appended and labels ``[IGNORE] + targets``, so that the
        model's shift scores ``logits[t]`` against ``targets[t]`` for every t (the last one included)."""
        n = len(x)
        ids = np.concatenate([x, np.zeros((n, 1), dtype=np.int64)], 1)
        labels = np.concatenate([np.full((n, 1), S.IGNORE, dtype=np.int64), y], 1)
        return {"input_ids": torch.from_numpy(ids).to(device), "labels": torch.from_numpy(labels).to(device)}

    def part_of_step(self, step: int) -> int:
        """Which part of the training mixture step ``step`` draws from (the same on every process)."""
        if len(self.parts) == 1:
            return 0
        return int(np.random.default_rng([self._seed, 11, step]).choice(len(self.parts), p=self._weights))

    def batches(self, step: int, rank: int, world: int, batch_size: int, micro: int, device) -> list[dict]:
        p = self.part_of_step(step)
        x, y = self.parts[p]
        out = []
        for samples in sample_ranges(step, rank, world, batch_size, micro):
            idx = [self._orders[p](s) for s in samples]
            out.append(self.model_batch(x[idx], y[idx], device))
        return out

    @torch.no_grad()
    def evaluate(self, model, micro: int, dist_: Dist, amp) -> dict:
        """Loss and accuracy on the scored positions of the test set(s): with several test sets,
        ``val_loss`` / ``val_acc`` pool all their scored positions and ``val_acc_by_test`` lists each."""
        was = model.training
        model.eval()
        per_test = []
        for test_x, test_y in self.tests:
            loss = correct = count = 0.0
            # longer test sequences in proportionally smaller batches: the training batches' tokens at most
            per_batch = max(1, micro * self.seq_len // test_x.shape[1])
            for chunk, weight in eval_chunks(len(test_x), per_batch, dist_):
                batch = self.model_batch(test_x[chunk], test_y[chunk], dist_.device)
                ce, ok, logits = token_losses(model, batch, amp, return_logits=True)
                loss += weight * float(ce.sum())
                correct += weight * float(((logits.argmax(-1) == batch["labels"][:, 1:]) & ok).sum())
                count += weight * float(ok.sum())
            per_test.append(dist_.all_sum([loss, correct, count]))
        model.train(was)
        loss, correct, count = (sum(t[i] for t in per_test) for i in range(3))
        res = {"val_loss": loss / max(count, 1), "val_acc": correct / max(count, 1)}
        if len(per_test) > 1:
            res["val_acc_by_test"] = [c / max(n, 1) for _, c, n in per_test]
        return res


def _sincos(n: int, d: int) -> torch.Tensor:
    """Sinusoidal position embeddings ``[n, d]``."""
    pos = torch.arange(n, dtype=torch.float32)[:, None]
    freq = torch.exp(-math.log(10000.0) * torch.arange(0, d, 2, dtype=torch.float32) / d)
    out = torch.zeros(n, d)
    out[:, 0::2] = torch.sin(pos * freq)
    out[:, 1::2] = torch.cos(pos * freq)[:, :d // 2]
    return out


class CompressionModel(torch.nn.Module):
    """MAD's compression protocol: the sequence is encoded by the model's backbone, only the
    last input position's hidden state (the ``<compress>`` token) is kept, and a small decoder
    (RMSNorm, Linear, GELU twice, then RMSNorm and a vocabulary projection; no expansion) reads
    token ``t`` back from that vector plus a sinusoidal embedding of ``t``.

    Inputs follow ``SyntheticData.model_batch`` (one dummy token appended, so the encoding is
    taken at position ``-2``); ``logits[:, t]`` predicts token ``t`` of the sequence. Attributes
    not found here (``config``, ``save_pretrained``, ``num_params`` ...) are the language model's;
    ``save_pretrained`` saves the language model only, not the decoder.
    """

    def __init__(self, lm, max_len: int):
        super().__init__()
        self.lm = lm
        d, vocab = lm.config.hidden_size, lm.config.vocab_size
        self.register_buffer("positions", _sincos(max_len, d), persistent=False)
        self.decoder = torch.nn.Sequential(
            torch.nn.RMSNorm(d), torch.nn.Linear(d, d), torch.nn.GELU(),
            torch.nn.RMSNorm(d), torch.nn.Linear(d, d), torch.nn.GELU(),
            torch.nn.RMSNorm(d), torch.nn.Linear(d, vocab))

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(super().__getattr__("lm"), name)

    def forward(self, input_ids: torch.Tensor, use_cache: bool = False, **_) -> SimpleNamespace:
        T = input_ids.shape[1]
        if T > self.positions.shape[0]:
            raise ValueError(f"input_ids has {T} positions, the decoder was built for {self.positions.shape[0]}")
        h = self.lm.model(input_ids=input_ids, use_cache=False).last_hidden_state[:, -2]
        return SimpleNamespace(logits=self.decoder(h[:, None, :] + self.positions[:T].to(h.dtype)))


# ----------------------------------------------------------------------------- suites
@dataclass
class Suite:
    """One task's benchmark: settings, model shape, data sizes and training budget.

    ``batch_size`` may be a list (one per setting, as MQAR's); the number of steps is
    ``epochs x train_size / batch_size`` (the papers count epochs over a fixed training set)."""
    task: str
    vocab_size: int
    settings: list            # generator parameters per setting, e.g. [{"seq_len": 64, "num_kv_pairs": 4}]
    model: dict               # model config overrides (shape)
    train_size: int
    test_size: int
    epochs: float
    batch_size: int | list
    lrs: list
    weight_decay: float = 0.1
    min_lr: float = 1e-5
    test_params: dict = field(default_factory=dict)  # e.g. longer test sequences (length generalisation)
    label: str = "setting"
    # Train once per (mechanism, lr, seed) on this mixture (overrides of the settings' parameters,
    # each with ``n`` sequences) and test on every setting; None: one training per setting.
    train_mix: list | None = None

    def batch_for(self, i: int) -> int:
        return self.batch_size[i] if isinstance(self.batch_size, (list, tuple)) else self.batch_size

    def steps_for(self, i: int) -> int:
        return max(1, math.ceil(self.epochs * self.train_size / self.batch_for(i)))


CPU_MODEL = dict(hidden_size=64, num_hidden_layers=2, num_heads=4, head_k_dim=16, head_v_dim=16,
                 intermediate_size=128, chunk_size=32, hh_rank=2)
# Head-in-Head Table 7 (MAD, after von Oswald et al. 2025): d 128, 2 layers, 8 heads of d_k = d_v = 16.
MAD_MODEL = dict(hidden_size=128, num_hidden_layers=2, num_heads=8, head_k_dim=16, head_v_dim=16,
                 intermediate_size=256, chunk_size=64, hh_rank=4)
# Head-in-Head Table 8 (MQAR): d 128, 2 layers, 2 heads of d_v = 64.
MQAR_MODEL = dict(hidden_size=128, num_hidden_layers=2, num_heads=2, head_k_dim=64, head_v_dim=64,
                  intermediate_size=256, chunk_size=64, hh_rank=4)
MAD_LRS = [3e-3, 1e-3, 5e-4, 1e-4]          # Head-in-Head Table 7 (weight decay 0.1 of their {0.01, 0.1})
MQAR_LRS = [float(x) for x in np.logspace(-4, -2, 4)]  # Head-in-Head Table 8 / Zoology


def _mad(task: str, settings: dict, train_size: int = 12800, cpu: bool = False) -> Suite:
    """MAD's task defaults (mad-lab configs/tasks), 12,800 / 1,280 sequences, 200 epochs at batch 32
    (Head-in-Head Table 7); the cpu preset shrinks sequences, data and epochs."""
    if cpu:
        return Suite(task, settings["vocab_size"], [settings], CPU_MODEL, train_size, 512, 300 * 32 / train_size, 32,
                     [3e-3])
    return Suite(task, settings["vocab_size"], [settings], MAD_MODEL, train_size, 1280, 200, 32, MAD_LRS)


SUITES: dict[str, dict[str, Suite]] = {
    "mqar": {
        "cpu": Suite("mqar", 32, [{"seq_len": L, "num_kv_pairs": 8, "vocab_size": 32} for L in (32, 64)],
                     CPU_MODEL, 20000, 512, 600 * 32 / 20000, 32, [3e-3], label="seq_len"),
        # Zoology / Head-in-Head Table 8: 64 epochs, batch 128/64/64 at 512/1024/2048 with 64/128/256 pairs.
        "paper": Suite("mqar", 8192, [{"seq_len": L, "num_kv_pairs": P, "vocab_size": 8192}
                                      for L, P in ((512, 64), (1024, 128), (2048, 256))],
                       MQAR_MODEL, 100000, 3000, 64, [128, 64, 64], MQAR_LRS, label="seq_len"),
        # The same model trained once on a curriculum mixture of short sequences (as Zoology's earlier MQAR
        # configs: 64 tokens with 4 pairs up to 256 with 64) and tested at 256-2048 tokens with one pair per
        # 8 tokens (the papers' density): length generalisation, at a fraction of the papers' training cost.
        "zoology": Suite("mqar", 8192, [{"seq_len": L, "num_kv_pairs": L // 8, "vocab_size": 8192}
                                        for L in (256, 512, 1024, 2048)],
                         MQAR_MODEL, 120000, 1000, 16, 128, MQAR_LRS, label="seq_len",
                         train_mix=[{"seq_len": 64, "num_kv_pairs": 4, "n": 40000},
                                    {"seq_len": 128, "num_kv_pairs": 8, "n": 20000},
                                    {"seq_len": 256, "num_kv_pairs": 16, "n": 20000},
                                    {"seq_len": 256, "num_kv_pairs": 32, "n": 20000},
                                    {"seq_len": 256, "num_kv_pairs": 64, "n": 20000}]),
    },
    "in_context_recall": {
        "cpu": _mad("in_context_recall", {"seq_len": 64, "vocab_size": 16}, 6400, cpu=True),
        "paper": _mad("in_context_recall", {"seq_len": 128, "vocab_size": 16})},
    "fuzzy_in_context_recall": {
        "cpu": _mad("fuzzy_in_context_recall", {"seq_len": 64, "vocab_size": 16}, 6400, cpu=True),
        "paper": _mad("fuzzy_in_context_recall", {"seq_len": 128, "vocab_size": 16})},
    "noisy_in_context_recall": {
        "cpu": _mad("noisy_in_context_recall", {"seq_len": 64, "vocab_size": 32, "noise_vocab_size": 16,
                                                "frac_noise": 0.2}, 6400, cpu=True),
        "paper": _mad("noisy_in_context_recall", {"seq_len": 128, "vocab_size": 32, "noise_vocab_size": 16,
                                                  "frac_noise": 0.2})},
    "selective_copying": {
        "cpu": _mad("selective_copying", {"seq_len": 64, "vocab_size": 16, "num_tokens_to_copy": 8}, 6400, cpu=True),
        "paper": _mad("selective_copying", {"seq_len": 256, "vocab_size": 16, "num_tokens_to_copy": 16})},
    "compression": {
        "cpu": _mad("compression", {"seq_len": 16, "vocab_size": 16}, 6400, cpu=True),
        "paper": _mad("compression", {"seq_len": 32, "vocab_size": 16})},
    "memorization": {  # MAD: 256 training sequences of one fixed key -> value map
        "cpu": _mad("memorization", {"seq_len": 32, "vocab_size": 64}, 256, cpu=True),
        "paper": _mad("memorization", {"seq_len": 32, "vocab_size": 256}, 256)},
    "parity": {
        # train on lengths up to L, test on lengths 2L..4L, scoring the parities of prefixes longer than L only
        # (Grazzi et al.: length generalisation; chance is 0.5)
        "cpu": Suite("parity", 3, [{"seq_len": 32, "min_len": 2}], CPU_MODEL, 20000, 256, 300 * 32 / 20000, 32,
                     [3e-3], test_params={"seq_len": 128, "min_len": 64, "score_from": 32}),
        "paper": Suite("parity", 3, [{"seq_len": 64, "min_len": 3}], MAD_MODEL, 100000, 1000, 13, 64, MAD_LRS,
                       test_params={"seq_len": 256, "min_len": 128, "score_from": 64}),
    },
    "modular_arithmetic": {
        "cpu": Suite("modular_arithmetic", 12, [{"seq_len": 16, "modulus": 5}], CPU_MODEL, 20000, 256,
                     300 * 32 / 20000, 32, [3e-3]),
        "paper": Suite("modular_arithmetic", 12, [{"seq_len": 64, "modulus": 5, "brackets": b} for b in (False, True)],
                       MAD_MODEL, 100000, 1000, 13, 64, MAD_LRS, label="brackets"),
    },
    "passkey": {
        "cpu": Suite("passkey", 16, [{"seq_len": L, "digits": 3} for L in (64, 256)], CPU_MODEL, 6400, 256,
                     300 * 32 / 6400, 32, [3e-3], label="seq_len"),
        "paper": Suite("passkey", 16, [{"seq_len": L, "digits": 5} for L in (512, 2048, 8192)], MQAR_MODEL, 20000,
                       500, 8, 32, MAD_LRS, label="seq_len"),
    },
}


def _one_run(spec: dict) -> list[dict]:
    """Train and evaluate one (mechanism, setting or test settings, lr, seed); returns its result rows."""
    suite = spec["suite"]
    tests = spec["tests"]
    data = SyntheticData(suite.task, tests[0], suite.train_size, suite.test_size, suite.vocab_size, spec["seed"],
                         suite.test_params, train_mix=suite.train_mix, test_settings=tests if suite.train_mix else None)
    n_steps = spec["steps"]
    with tempfile.TemporaryDirectory() as tmp:
        cfg = TrainConfig.from_sources(preset="tiny", overrides=dict(
            mixer=spec["mixer"], model={**suite.model, **spec["overrides"]}, steps=n_steps,
            batch_size=spec["batch_size"], lr=spec["lr"], min_lr=min(suite.min_lr, spec["lr"] / 10),
            warmup_steps=max(1, n_steps // 20), weight_decay=suite.weight_decay, beta2=0.98, eval_every=0,
            save_every=0, eval_batches=1, log_every=max(1, n_steps // 10), out_dir=tmp, seed=spec["seed"],
            progress=spec["progress"], device=spec["device"], seq_len=max(2, data.seq_len),
            time_limit=spec.get("time_limit", 0.0), **spec.get("train_overrides", {})))
        res = train(cfg, data=data)
    accs = res.get("val_acc_by_test", [res["val_acc"]])
    return [{"task": suite.task, "preset": spec["preset"], "mixer": spec["mixer"], "setting": setting,
             "lr": spec["lr"], "seed": spec["seed"], "steps": res["steps"], "planned_steps": n_steps,
             "batch_size": spec["batch_size"],
             "acc": acc, "loss": res["val_loss"], "tokens_per_s": res.get("tokens_per_s")}
            for setting, acc in zip(tests, accs)]


def run_synth(task: str, mechanisms: list[str], preset: str = "cpu", seeds: int = 1, lrs: list | None = None,
              out: str | Path = "synth", steps: int | None = None, batch_size: int | None = None,
              overrides: dict | None = None, device: str = "auto", progress: bool = True, jobs: int = 1,
              only: dict | None = None, task_params: dict | None = None, time_limit: float = 0.0,
              train_overrides: dict | None = None) -> list[dict]:
    """Train and evaluate every (mechanism, setting, lr, seed); write ``results.{md,csv,json,png}`` to ``out``.

    ``only={"seq_len": [512, 1024]}`` keeps the settings whose values are listed;
    ``task_params={"vocab_size": 512}`` changes the generator's parameters in every setting.
    ``jobs > 1`` runs that many trainings at once in separate processes (small models leave a GPU
    mostly idle; on a CPU, jobs share the cores); with several GPUs and ``device="auto"`` the runs
    are spread over them in turn. ``time_limit`` (seconds, per run) stops a training early and
    evaluates it where it got (``steps`` < ``planned_steps`` in its row); ``train_overrides``
    (e.g. ``{"matmul_precision": "medium"}``) go to every run's ``TrainConfig``. Results are rewritten
    after every finished run."""
    if task not in SUITES:
        raise ValueError(f"unknown task {task!r}; choose from {', '.join(SUITES)}")
    if preset not in SUITES[task]:
        raise ValueError(f"preset must be one of {', '.join(SUITES[task])}, got {preset!r}")
    if jobs < 1:
        raise ValueError(f"jobs must be >= 1, got {jobs}")
    from ..models.config import MIXERS

    bad = [m for m in mechanisms if m not in MIXERS]
    if bad or not mechanisms:
        raise ValueError(f"unknown mechanism(s) {', '.join(map(repr, bad)) or '(none given)'}; choose from "
                         f"{', '.join(MIXERS)}")
    suite = SUITES[task][preset]
    lrs = lrs or suite.lrs
    out = Path(out)
    chosen = [(si, st) for si, st in enumerate(suite.settings)
              if all(str(st.get(k)) in {str(v) for v in vs} for k, vs in (only or {}).items())]
    if not chosen:
        raise ValueError(f"no {task} setting matches {only}; the {preset} settings are {suite.settings}")
    if task_params:
        chosen = [(si, {**st, **task_params}) for si, st in chosen]
        if "vocab_size" in task_params:
            suite = dataclasses.replace(suite, vocab_size=int(task_params["vocab_size"]))
    # one training per setting, or with a training mixture one per (mechanism, lr, seed) tested on every setting
    groups = [[(si, st)] for si, st in chosen] if suite.train_mix is None else [chosen]
    specs = [dict(suite=suite, preset=preset, tests=[st for _, st in group], mixer=mixer, lr=lr, seed=seed,
                  steps=steps or suite.steps_for(group[0][0]), batch_size=batch_size or suite.batch_for(group[0][0]),
                  overrides=dict(overrides or {}), device=device, progress=progress and jobs == 1,
                  time_limit=time_limit, train_overrides=dict(train_overrides or {}))
             for group in groups for mixer in mechanisms for lr in lrs for seed in range(seeds)]
    if jobs > 1:
        import torch

        for spec, dev in zip(specs, spread_devices(device, len(specs), torch.cuda.device_count())):
            spec["device"] = dev
    runs: list[dict] = []
    table: list[dict] = []

    finished = 0

    def done(rows: list[dict]) -> None:
        nonlocal table, finished
        runs.extend(rows)
        finished += 1
        table = summarise(runs, suite.label)
        write_results(table, runs, out, task, suite.label)  # after every run: partial results survive
        for row in rows:
            print(f"[{finished}/{len(specs)} done] {row['mixer']} {row['setting']} lr {row['lr']:.2g} seed "
                  f"{row['seed']}: test accuracy {row['acc']:.4f}", flush=True)

    failures: list[str] = []

    def failed(spec: dict, err: BaseException) -> None:
        what = f"{spec['mixer']} {' / '.join(map(str, spec['tests']))} lr {spec['lr']:.2g} seed {spec['seed']}"
        failures.append(f"{what}: {type(err).__name__}: {err}")
        print(f"[failed] {failures[-1]}", flush=True)

    mix = f" (trained on the mixture {suite.train_mix})" if suite.train_mix else ""
    for i, spec in enumerate(specs):
        print(f"[{i + 1}/{len(specs)}] {task} {spec['mixer']} {' / '.join(map(str, spec['tests']))}{mix} lr "
              f"{spec['lr']:.2g} seed {spec['seed']}: {spec['steps']} steps x {spec['batch_size']}", flush=True)
    # A run that fails (e.g. out of memory) is reported and the others go on; the sweep then fails.
    if jobs == 1:
        for spec in specs:
            try:
                rows = _one_run(spec)
            except Exception as err:  # noqa: BLE001 - reported, and raised below
                failed(spec, err)
                continue
            done(rows)
    else:
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor, as_completed

        with ProcessPoolExecutor(max_workers=jobs, mp_context=mp.get_context("spawn")) as pool:
            futures = {pool.submit(_one_run, spec): spec for spec in specs}
            for fut in as_completed(futures):
                try:
                    rows = fut.result()
                except Exception as err:  # noqa: BLE001 - reported, and raised below
                    failed(futures[fut], err)
                    continue
                done(rows)
    if failures:
        raise SynthRunsFailed(f"{len(failures)} of {len(specs)} runs failed (the others' results are in {out}): "
                              + "; ".join(failures))
    return table


class SynthRunsFailed(RuntimeError):
    """Some runs of a ``run_synth`` sweep raised; the finished ones' results were written."""


def spread_devices(device: str, runs: int, gpus: int) -> list[str]:
    """Where each of ``runs`` parallel trainings goes: with ``device="auto"`` and several GPUs,
    round-robin over them (``cuda:0``, ``cuda:1``, ...); otherwise ``device`` for every run."""
    if device != "auto" or gpus < 2:
        return [device] * runs
    return [f"cuda:{i % gpus}" for i in range(runs)]


def summarise(runs: list[dict], label: str) -> list[dict]:
    """Best learning rate (by mean accuracy over seeds) per (mechanism, setting)."""
    groups: dict = {}
    for r in runs:
        key = (r["mixer"], json.dumps(r["setting"], sort_keys=True))
        groups.setdefault(key, {}).setdefault(r["lr"], []).append(r["acc"])
    table = []
    for (mixer, setting), by_lr in groups.items():
        lr, accs = max(by_lr.items(), key=lambda kv: np.mean(kv[1]))
        s = json.loads(setting)
        table.append({"mixer": mixer, "setting": s, "x": _x(s, label), "best_lr": lr, "acc": float(np.mean(accs)),
                      "acc_std": float(np.std(accs)), "seeds": len(accs)})
    return table


def _x(setting: dict, label: str):
    """The value a setting is tabulated/plotted under: ``setting[label]``, or all of it compactly."""
    if label in setting:
        return setting[label]
    return ", ".join(f"{k}={v}" for k, v in setting.items() if k != "vocab_size") or "-"


def write_results(table: list[dict], runs: list[dict], out: Path, task: str, label: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"task": task, "label": label, "summary": table, "runs": runs}, indent=2, default=float) + "\n")
    with (out / "results.csv").open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["mixer", label, "best_lr", "acc", "acc_std", "seeds"])
        for r in table:
            w.writerow([r["mixer"], r["x"], r["best_lr"], f"{r['acc']:.4f}", f"{r['acc_std']:.4f}", r["seeds"]])
    (out / "results.md").write_text(markdown(table, task, label) + "\n")
    from .._plot import finish, pyplot

    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    settings = list(dict.fromkeys(json.dumps(r["setting"], sort_keys=True) for r in _in_setting_order(table)))
    for mixer in dict.fromkeys(r["mixer"] for r in table):
        rows = {json.dumps(r["setting"], sort_keys=True): r for r in table if r["mixer"] == mixer}
        xs = [str(rows[s]["x"]) for s in settings if s in rows]
        ax.plot(xs, [rows[s]["acc"] for s in settings if s in rows], "o-", label=mixer)
    ax.set_xlabel(label)
    ax.set_ylabel("test accuracy")
    ax.set_ylim(0, 1.02)
    ax.set_title(task)
    finish(fig, [ax], out / "results.png")


def _in_setting_order(table: list[dict]) -> list[dict]:
    """Rows ordered by their setting's value: numbers numerically (seq_len 256 before 1024), then text."""
    return sorted(table, key=lambda r: (0, r["x"], "") if isinstance(r["x"], (int, float)) else (1, 0, str(r["x"])))


def markdown(table: list[dict], task: str, label: str) -> str:
    settings = list(dict.fromkeys(str(r["x"]) for r in _in_setting_order(table)))
    lines = [f"{task}: test accuracy (best learning rate; mean over seeds)", "",
             f"| mechanism | " + " | ".join((f"{label}={s}" if label != "setting" else s) for s in settings) + " |",
             "|---|" + "---:|" * len(settings)]
    for mixer in dict.fromkeys(r["mixer"] for r in table):
        cells = []
        for s in settings:
            r = next((r for r in table if r["mixer"] == mixer and str(r["x"]) == s), None)
            cells.append("-" if r is None else f"{r['acc']:.3f}" + (f" ± {r['acc_std']:.3f}" if r["seeds"] > 1 else ""))
        lines.append(f"| {mixer} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
