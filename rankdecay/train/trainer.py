"""The training loop: one process or many (``torchrun``), CPU or GPU, resumable bit for bit.

``train(config)`` builds the model and data from a ``TrainConfig`` and runs AdamW with a
warm-up + cosine schedule, gradient accumulation, clipping, autocast, optional
``torch.compile``; under ``torchrun`` it wraps the model in DistributedDataParallel (or
FSDP2's ``fully_shard`` with ``fsdp=True``). Only rank 0 writes. Every ``save_every`` steps
a checkpoint folder ``checkpoint-NNNNNNN`` (a ``from_pretrained``-loadable model plus
``trainer_state.pt``: optimizer, scheduler, step, RNG) appears atomically; ``resume=True``
continues from the newest one, on any world size with the same global batch.
"""
from __future__ import annotations

import gc
import json
import math
import os
import random
import re
import shutil
import signal
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from ..data import ByteTokenizer
from .config import TrainConfig
from .data import Corpus, WindowSampler, build_tokenizer, make_batch, token_bytes, tokenizer_vocab_size

CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")
STATE_FILE = "trainer_state.pt"
CONFIG_FILE = "train_config.json"
METRICS_FILE = "metrics.jsonl"

# Dense bf16 matmul peaks (TFLOP/s) for model FLOPs utilisation, by device-name substring.
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10G": 125.0, "4090": 165.0}


# ----------------------------------------------------------------------------- processes
def resolve_device(device: str) -> torch.device:
    """``"auto"``: CUDA when available, else the CPU; anything else as given."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(device)


class Dist:
    """This process's place in a ``torchrun`` job (or a job of one)."""

    def __init__(self, device: str):
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.device = resolve_device(device)
        if self.device.type == "cuda" and self.device.index is None:  # one GPU per process: LOCAL_RANK picks it
            self.device = torch.device("cuda", self.local_rank)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.started = False
        if self.world > 1 and not dist.is_initialized():
            dist.init_process_group("nccl" if self.device.type == "cuda" else "gloo")
            self.started = True

    @property
    def main(self) -> bool:
        return self.rank == 0

    def all_sum(self, values: list[float]) -> list[float]:
        if self.world == 1:
            return values
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return t.tolist()

    def barrier(self):
        if self.world > 1:
            dist.barrier()

    def close(self):
        """Destroy the process group this object started, once every rank has met at a barrier, so that no rank
        tears its group down, and exits, while another still has collective work in flight (gloo's worker threads
        can then abort the process at exit). For a run that ended normally: after an error ``train`` does not call
        it, since destroying the group while other ranks wait in a collective would hang them (the launcher stops
        them instead).

        Garbage is collected first: the trained model (FSDP2's or DDP's hooks hold it in reference cycles) with the
        collective work its last steps left would otherwise be freed at interpreter exit, after the group is gone,
        where freeing such work aborted a gloo rank ("terminate called without an active exception", CI sessions 57
        and 64; the mechanism pytorch/pytorch#179291 describes)."""
        if self.started:
            gc.collect()
            dist.barrier()
            dist.destroy_process_group()
            self.started = False


# ----------------------------------------------------------------------------- schedule
def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up to ``lr`` over ``warmup_steps``, then a cosine down to ``min_lr`` at ``steps``."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(1, cfg.steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * progress))


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on matrices and convolution filters; none on norms, biases, gate scalars
    (A_log, dt_bias) and Head-in-Head mask logits."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        skip = p.ndim < 2 or any(s in name for s in ("A_log", "dt_bias", "mask_org", "norm"))
        (no_decay if skip else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


# ----------------------------------------------------------------------------- model
def build_model(cfg: TrainConfig, tokenizer, data_overrides: dict | None = None):
    from ..models import RankDecayConfig, RankDecayForCausalLM

    if cfg.init_from:
        return RankDecayForCausalLM.from_pretrained(cfg.init_from, dtype=torch.float32)
    overrides = {**(data_overrides or {}), **cfg.model}
    if tokenizer is None:
        return RankDecayForCausalLM(RankDecayConfig.from_preset(cfg.model_preset, mixer=cfg.mixer, **overrides))
    if isinstance(tokenizer, ByteTokenizer):
        specials = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                        pad_token_id=tokenizer.pad_token_id)
        overrides = {"vocab_size": 264, **specials, **overrides}
    else:
        n = tokenizer_vocab_size(tokenizer)
        overrides = {"vocab_size": 64 * -(-n // 64), "bos_token_id": tokenizer.bos_token_id,
                     "eos_token_id": tokenizer.eos_token_id,
                     "pad_token_id": tokenizer.pad_token_id if tokenizer.pad_token_id is not None
                     else tokenizer.eos_token_id, **overrides}
    config = RankDecayConfig.from_preset(cfg.model_preset, mixer=cfg.mixer, **overrides)
    if config.vocab_size < tokenizer_vocab_size(tokenizer):
        raise ValueError(f"model vocab_size {config.vocab_size} is smaller than the tokenizer's "
                         f"{tokenizer_vocab_size(tokenizer)}")
    return RankDecayForCausalLM(config)


def autocast_dtype(dtype: str, device: torch.device):
    """The autocast dtype for ``dtype`` ("auto": bf16 on CUDA, none on CPU); None: no autocast."""
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else None
    return {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": None}[dtype]


def matmul_precision(setting: str, device: torch.device, dtype: str) -> str:
    """``TrainConfig.matmul_precision`` resolved: "auto" is "medium" (bf16 products in the kernels, fla's precision)
    on CUDA under 16-bit autocast, "highest" otherwise (on a CPU "medium" may let fp32 matmuls take bf16)."""
    if setting != "auto":
        return setting
    return "medium" if device.type == "cuda" and autocast_dtype(dtype, device) is not None else "highest"


def memory_stats(device: torch.device) -> dict:
    """``{"max_memory_gib": ...}``: the most GPU memory this process's tensors have held since it started (the
    figure to size batches by; ``torch.cuda.max_memory_allocated``), on a CUDA device; nothing elsewhere."""
    if device.type != "cuda":
        return {}
    return {"max_memory_gib": torch.cuda.max_memory_allocated(device) / 2 ** 30}


# ----------------------------------------------------------------------------- loss
def token_losses(model, batch: dict, amp_dtype, return_logits: bool = False):
    """Per-token next-token losses [B, T-1] (fp32, 0 where the target is -100) and the target mask, for
    ``make_batch`` output; with ``return_logits`` also the logits that scored them, [B, T-1, vocab] (fp32).
    Without ``return_logits`` a ``RankDecayForCausalLM`` forms the losses itself (``loss_reduction="none"``), so
    with ``fuse_linear_cross_entropy`` it holds no logits in training; a model that returns no loss (the synthetic
    tasks' wrappers) is scored from its logits."""
    ctx = torch.autocast(batch["input_ids"].device.type, dtype=amp_dtype) if amp_dtype else nullcontext()
    targets = batch["labels"][:, 1:]
    valid = targets != -100
    losses = {} if return_logits else dict(labels=batch["labels"], loss_reduction="none")
    with ctx:
        out = model(input_ids=batch["input_ids"], cu_seqlens=batch.get("cu_seqlens"), use_cache=False, **losses)
    if not return_logits and getattr(out, "loss", None) is not None:
        return out.loss.float() * valid, valid
    logits = out.logits[:, :-1].float()
    loss = torch.nn.functional.cross_entropy(logits.transpose(1, 2), targets.clamp_min(0), reduction="none")
    return (loss * valid, valid, logits) if return_logits else (loss * valid, valid)


def eval_chunks(n: int, micro: int, dist_: "Dist"):
    """This process's share of ``n`` evaluation items in micro-batches, as ``(indices, weight)``.
    A process with nothing (left) to do still gets one chunk ``[0]`` of weight 0: FSDP needs
    every process in each collective forward."""
    mine = list(range(dist_.rank, n, dist_.world))
    for i in range(0, max(len(mine), 1), micro):
        chunk = mine[i:i + micro]
        yield (chunk, 1.0) if chunk else ([0], 0.0)


def sample_ranges(step: int, rank: int, world: int, batch_size: int, micro: int) -> list[range]:
    """Global sample indices of this process's micro-batches of step ``step``: the global batch
    ``batch_size`` is split evenly over ``world`` processes, each share into micro-batches."""
    base = step * batch_size + rank * (batch_size // world)
    return [range(base + i * micro, base + (i + 1) * micro) for i in range(batch_size // world // micro)]


@torch.no_grad()
def evaluate_loss(model, sampler: WindowSampler, num_windows: int, micro: int, dist_: Dist, pack: str,
                  eos_id: int, amp_dtype, bytes_per_token: np.ndarray) -> dict:
    """Mean validation loss, perplexity and bits per byte over the first ``num_windows`` windows
    (shared out over the processes)."""
    was_training = model.training
    model.eval()
    total = targets = nbytes = 0.0
    table = torch.as_tensor(bytes_per_token)
    for chunk, weight in eval_chunks(min(num_windows, sampler.num_windows), micro, dist_):
        batch = make_batch(sampler.tokens(chunk), pack, eos_id, dist_.device)
        loss, valid = token_losses(model, batch, amp_dtype)
        total += weight * loss.sum().item()
        targets += weight * valid.sum().item()
        tgt = batch["labels"][:, 1:].clamp_min(0).cpu()
        nbytes += weight * (table[tgt] * valid.cpu()).sum().item()
    total, targets, nbytes = dist_.all_sum([total, targets, nbytes])
    model.train(was_training)
    loss = total / max(targets, 1)
    return {"val_loss": loss, "val_ppl": math.exp(min(loss, 50)),
            "val_bpb": total / math.log(2) / nbytes if nbytes else float("nan")}


class TextData:
    """What the trainer trains on, for text: the corpus, its windows and its evaluation.

    The trainer needs only ``tokenizer`` (or None), ``description``, ``model_overrides``,
    ``batches(step, rank, world, batch_size, micro, device)`` (this process's micro-batches of
    global step ``step``: dicts with ``input_ids``, ``labels`` and optional ``cu_seqlens``) and
    ``evaluate(model, micro, dist_, amp) -> dict`` of ``val_*`` metrics, and optionally
    ``wrap_model(model)`` (a read-out around the language model). Other data (the synthetic tasks)
    provide the same.
    """

    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
        self.tokenizer = build_tokenizer(cfg.tokenizer)
        self.corpus = Corpus.load(cfg.data, self.tokenizer, cfg.val_fraction, cfg.text_suffixes)
        self.train = WindowSampler(self.corpus.train, cfg.seq_len, cfg.seed)
        self.val = WindowSampler(self.corpus.val, cfg.seq_len, cfg.seed, shuffle=False)
        self.description = self.corpus.description
        self.model_overrides: dict = {}
        self._bytes = None

    def batches(self, step: int, rank: int, world: int, batch_size: int, micro: int, device) -> list[dict]:
        return [make_batch(self.train.tokens(r), self.cfg.pack, self.tokenizer.eos_token_id, device)
                for r in sample_ranges(step, rank, world, batch_size, micro)]

    def evaluate(self, model, micro: int, dist_: "Dist", amp) -> dict:
        if self._bytes is None:
            vocab = getattr(getattr(model, "module", model), "config").vocab_size
            self._bytes = token_bytes(self.tokenizer, vocab)
        return evaluate_loss(model, self.val, self.cfg.eval_batches * micro, micro, dist_, self.cfg.pack,
                             self.tokenizer.eos_token_id, amp, self._bytes)


# ----------------------------------------------------------------------------- checkpoints
def checkpoints(out_dir: Path) -> list[Path]:
    """Complete checkpoint folders of ``out_dir``, oldest first."""
    if not out_dir.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in out_dir.iterdir() if (m := CHECKPOINT_RE.match(p.name))
             and (p / STATE_FILE).exists()]
    return [p for _, p in sorted(found)]


def _state_dicts(model, optimizer):
    """Full (unsharded) model and optimizer state dicts keyed by parameter name, on rank 0."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_state_dict(model, optimizer, options=opts)


def _load_optimizer(model, optimizer, state: dict) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    set_optimizer_state_dict(model, optimizer, state, options=StateDictOptions(full_state_dict=True))


def save_checkpoint(path: Path, raw_model, wrapped, optimizer, step: int, cfg: TrainConfig, tokenizer,
                    dist_: Dist, extra: dict) -> None:
    """Write ``path`` atomically (a temporary folder renamed into place) from rank 0."""
    model_sd, optim_sd = _state_dicts(wrapped, optimizer)
    if dist_.main:
        tmp = path.with_name(path.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        raw_model.save_pretrained(tmp, state_dict={k: v.contiguous() for k, v in model_sd.items()})
        save_tokenizer(tokenizer, tmp)
        state = {"step": step, "optimizer": optim_sd, "world_size": dist_.world,
                 "rng": {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate(),
                         "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None},
                 **extra}
        torch.save(state, tmp / STATE_FILE)
        (tmp / CONFIG_FILE).write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
        if path.exists():
            shutil.rmtree(path)
        os.replace(tmp, path)
    dist_.barrier()


def save_tokenizer(tokenizer, directory: Path) -> None:
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)


# ----------------------------------------------------------------------------- the run
class _Interrupt:
    """First SIGINT/SIGTERM: finish the step, save, stop. Second: stop at once."""

    def __init__(self):
        self.requested = False
        self._old = {}

    def __enter__(self):
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self._old[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread
                pass
        return self

    def _handle(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        print(f"\n{signal.Signals(signum).name}: saving a checkpoint after this step, then stopping "
              "(again to stop at once)", file=sys.stderr, flush=True)

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)


def train(cfg: TrainConfig, data=None) -> dict:
    """Run training as configured; returns a summary (final losses, tokens/s, paths).

    ``data``: what to train on (default: ``TextData(cfg)``, the text sources of ``cfg``); see
    ``TextData`` for the interface (``rankdecay.train.synth.SyntheticData`` provides the synthetic tasks)."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # checkpoints are written without "Writing model shards" bars
    dist_ = Dist(cfg.device)
    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(matmul_precision(cfg.matmul_precision, dist_.device, cfg.dtype))
    try:
        summary = _train(cfg, dist_, data)
    finally:
        torch.set_float32_matmul_precision(precision)
    dist_.close()  # not after an error (``Dist.close``)
    return summary


def _log(dist_: Dist, *msg):
    if dist_.main:
        print(*msg, flush=True)


def _train(cfg: TrainConfig, dist_: Dist, data=None) -> dict:
    out_dir = cfg.resolved_out_dir()
    G, W = cfg.batch_size, dist_.world
    if G % W:
        raise ValueError(f"batch_size {G} must be divisible by the number of processes {W}")
    micro = cfg.micro_batch_size or G // W
    if (G // W) % micro:
        raise ValueError(f"batch_size / processes = {G // W} must be a multiple of micro_batch_size {micro}")
    accum = G // W // micro

    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    data = data if data is not None else TextData(cfg)
    tokenizer = data.tokenizer

    start_step, resume_state = 0, None
    existing = checkpoints(out_dir)
    if cfg.resume:
        if not existing:
            raise FileNotFoundError(f"resume: no checkpoint in {out_dir}")
        resume_from = existing[-1]
        resume_state = torch.load(resume_from / STATE_FILE, map_location="cpu", weights_only=False)
        start_step = resume_state["step"]
        from ..models import RankDecayForCausalLM

        model = RankDecayForCausalLM.from_pretrained(resume_from, dtype=torch.float32)
    else:
        if existing and dist_.main:
            raise ValueError(f"out_dir {out_dir} already holds checkpoints; pass --resume to continue, or "
                             "choose another --out-dir")
        model = build_model(cfg, tokenizer, data.model_overrides)
    if hasattr(data, "wrap_model"):  # e.g. a task-specific read-out around the language model
        model = data.wrap_model(model)
    model.to(dist_.device)
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    model.train()
    raw_model = model
    amp = autocast_dtype(cfg.dtype, dist_.device)

    if cfg.fsdp:
        if W == 1:
            raise ValueError("fsdp needs several processes (run under torchrun)")
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mp = MixedPrecisionPolicy(param_dtype=amp, reduce_dtype=torch.float32) if amp else MixedPrecisionPolicy()
        # the mesh on the run's device: fully_shard's default takes the machine's accelerator, so --device cpu on
        # a GPU machine would put every rank on a GPU (one per local rank, more than a one-GPU host has)
        mesh = init_device_mesh(dist_.device.type, (W,))
        for block in raw_model.model.layers:
            fully_shard(block, mesh=mesh, mp_policy=mp)
        fully_shard(raw_model, mesh=mesh, mp_policy=mp)
        wrapped = raw_model
    elif W > 1:
        from torch.nn.parallel import DistributedDataParallel

        wrapped = DistributedDataParallel(raw_model, device_ids=[dist_.device.index] if dist_.device.type == "cuda"
                                          else None)
    else:
        wrapped = raw_model
    if cfg.compile:
        wrapped.compile()

    optimizer = torch.optim.AdamW(param_groups(raw_model, cfg.weight_decay), lr=cfg.lr,
                                  betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                                  fused=dist_.device.type == "cuda" and not cfg.fsdp)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_at(s, cfg) / cfg.lr)
    if resume_state is not None:
        _load_optimizer(wrapped, optimizer, resume_state["optimizer"])
        scheduler.load_state_dict(resume_state["scheduler"])
        rng = resume_state["rng"]
        torch.set_rng_state(rng["torch"])
        np.random.set_state(rng["numpy"])
        random.setstate(rng["python"])

    n_params = raw_model.num_params()
    flops_per_token = raw_model.flops_per_token(cfg.seq_len, training=True)
    peak = cfg.peak_tflops
    if peak is None and dist_.device.type == "cuda":
        name = torch.cuda.get_device_name(dist_.device)
        peak = next((v for k, v in PEAK_TFLOPS.items() if k in name), None)

    metrics_path = out_dir / METRICS_FILE
    if dist_.main:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / CONFIG_FILE).write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
        if resume_state is not None and metrics_path.exists():  # drop what the interrupted run logged later
            kept = [line for line in metrics_path.read_text().splitlines()
                    if line and json.loads(line)["step"] <= start_step]
            metrics_path.write_text("".join(line + "\n" for line in kept))
        elif resume_state is None:
            metrics_path.write_text("")
    _log(dist_, f"data: {data.description}")
    _log(dist_, f"model: {cfg.model_preset} {raw_model.config.mixers[0]} x {raw_model.config.num_hidden_layers} "
                f"layers, {n_params / 1e6:.2f}M parameters, {flops_per_token / 1e6:.1f} MFLOP/token (fwd+bwd)")
    _log(dist_, f"run: {cfg.steps} steps x {G} sequences x {cfg.seq_len} tokens "
                f"({W} process(es) x {accum} micro-batch(es) of {micro}) on {dist_.device}"
                f"{' with ' + str(amp).replace('torch.', '') + ' autocast' if amp else ''}, matmul precision "
                f"{torch.get_float32_matmul_precision()}; "
                f"writing to {out_dir}" + (f"; resuming at step {start_step}" if start_step else ""))

    def log(record: dict):
        if dist_.main:
            with metrics_path.open("a") as f:
                f.write(json.dumps(record) + "\n")

    def eval_now(step: int) -> dict:
        res = data.evaluate(wrapped, micro, dist_, amp)
        log({"step": step, "split": "val", **res})
        return res

    def save(step: int):
        path = out_dir / f"checkpoint-{step:07d}"
        save_checkpoint(path, raw_model, wrapped, optimizer, step, cfg, tokenizer, dist_,
                        {"scheduler": scheduler.state_dict()})
        if dist_.main and cfg.keep_checkpoints:
            for old in checkpoints(out_dir)[:-cfg.keep_checkpoints]:
                shutil.rmtree(old, ignore_errors=True)

    bar = None
    if dist_.main and cfg.progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=cfg.steps, initial=start_step, desc="train", unit="step", dynamic_ncols=True)
    # Tokens are counted as the batches hold them: G x seq_len for text windows; a synthetic
    # mixture's steps differ in length (resumed runs count the steps before at G x seq_len).
    tokens_seen = start_step * G * cfg.seq_len
    window_time, window_steps, window_loss = 0.0, 0, 0.0  # time in training steps only (not evaluation or saving)
    window_tokens = 0
    run_t0 = time.perf_counter()
    last: dict = {}
    val: dict = {}
    stopped_early = False
    step = start_step
    with _Interrupt() as interrupt:
        for step in range(start_step, cfg.steps):
            step_t0 = time.perf_counter()
            batches = data.batches(step, dist_.rank, W, G, micro, dist_.device)
            n_targets = dist_.all_sum([float(sum((b["labels"][:, 1:] != -100).sum().item() for b in batches))])[0]
            loss_sum = 0.0
            for i, batch in enumerate(batches):
                sync = i == accum - 1 or W == 1 or cfg.fsdp
                ctx = wrapped.no_sync() if not sync else nullcontext()
                with ctx:
                    loss, _ = token_losses(wrapped, batch, amp)
                    loss = loss.sum()
                    # DDP averages gradients over processes: scale so the result is the global token mean.
                    (loss * (W / n_targets)).backward()
                loss_sum += loss.item()
            grad_norm = torch.nn.utils.clip_grad_norm_(wrapped.parameters(), cfg.grad_clip if cfg.grad_clip > 0
                                                       else float("inf"))
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            train_loss = dist_.all_sum([loss_sum])[0] / n_targets  # (.item() syncs the device)
            window_time += time.perf_counter() - step_t0
            window_steps += 1
            step_tokens = W * sum(b["input_ids"].numel() for b in batches)
            window_tokens += step_tokens
            tokens_seen += step_tokens
            window_loss += train_loss
            done = step + 1
            # past the time limit, every process stops at this step (the slowest one's clock decides)
            timed_out = cfg.time_limit > 0 and done != cfg.steps and \
                dist_.all_sum([float(time.perf_counter() - run_t0 > cfg.time_limit)])[0] > 0
            if done % max(cfg.log_every, 1) == 0 or done == cfg.steps or timed_out:
                tps = window_tokens / window_time
                last = {"step": done, "split": "train", "loss": window_loss / window_steps, "last_loss": train_loss,
                        "lr": scheduler.get_last_lr()[0], "grad_norm": float(grad_norm), "tokens": tokens_seen,
                        "tokens_per_s": tps, "elapsed_s": time.perf_counter() - run_t0, **memory_stats(dist_.device)}
                if peak:
                    last["mfu"] = flops_per_token * tps / (peak * 1e12 * W)
                log(last)
                if bar is None:
                    _log(dist_, f"step {done}/{cfg.steps}  loss {last['loss']:.4f}  lr {last['lr']:.2e}  "
                                f"{tps:,.0f} tok/s" + (f"  MFU {last['mfu']:.1%}" if "mfu" in last else "")
                         + (f"  peak {last['max_memory_gib']:.1f} GiB" if "max_memory_gib" in last else ""))
                window_time, window_steps, window_loss, window_tokens = 0.0, 0, 0.0, 0
            if bar is not None:
                post = {"loss": f"{train_loss:.3f}"}
                if last:
                    post["tok/s"] = f"{last['tokens_per_s']:,.0f}"
                    if "mfu" in last:
                        post["MFU"] = f"{last['mfu']:.1%}"
                    if "max_memory_gib" in last:
                        post["peak"] = f"{last['max_memory_gib']:.1f} GiB"
                if val:
                    post["val"] = f"{val['val_loss']:.3f}"
                bar.set_postfix(post, refresh=False)
                bar.update(1)
            if cfg.eval_every and done % cfg.eval_every == 0 and done != cfg.steps and not timed_out:
                val = eval_now(done)
            if interrupt.requested:
                save(done)
                stopped_early = True
                break
            if cfg.save_every and done % cfg.save_every == 0 and done != cfg.steps and not timed_out:
                save(done)
            if timed_out:  # evaluated and saved below, as at the end
                _log(dist_, f"time limit of {cfg.time_limit:g} s reached at step {done} of {cfg.steps}")
                break
        else:
            done = cfg.steps
    if bar is not None:
        bar.close()
    if stopped_early:
        _log(dist_, f"stopped at step {done}; checkpoint saved in {out_dir} (continue with --resume)")
        raise KeyboardInterrupt
    if start_step < cfg.steps or not val:
        val = eval_now(done)
    if start_step < cfg.steps:
        save(done)
    if dist_.main:
        final = checkpoints(out_dir)[-1]
        # The final model is also the run folder itself: `rankdecay generate/eval OUT_DIR` work.
        for item in final.iterdir():
            if item.name != STATE_FILE:
                shutil.copy2(item, out_dir / item.name)
        plot_path = plot_metrics(metrics_path, out_dir / "loss.png")
        extra = "".join(f", {k[4:]} {v:.4f}" for k, v in val.items() if k in ("val_bpb", "val_acc"))
        _log(dist_, f"done: train loss {last.get('loss', float('nan')):.4f}, validation loss {val['val_loss']:.4f}"
                    f"{extra}; model in {out_dir}" + (f", curves in {plot_path}" if plot_path else ""))
    dist_.barrier()
    return {"out_dir": str(out_dir), **{k: v for k, v in last.items() if k != "split"}, **val, "steps": done}


def read_metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def plot_metrics(metrics_path: Path, png: Path) -> Path | None:
    """Training and validation loss against the step (PNG); None without matplotlib."""
    from .._plot import finish, pyplot

    plt = pyplot()
    if plt is None:
        return None
    records = read_metrics(metrics_path)
    train = [r for r in records if r.get("split") == "train"]
    val = [r for r in records if r.get("split") == "val"]
    if not train:
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([r["step"] for r in train], [r["loss"] for r in train], label="train")
    if val:
        ax.plot([r["step"] for r in val], [r["val_loss"] for r in val], "o-", label="validation")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(png.parent.name)
    return finish(fig, [ax], png)
