"""``rankdecay prune``: prune a saved model, measure it before and after, optionally recover it."""
from __future__ import annotations

import json
import math
import time
from pathlib import Path

import numpy as np
import torch

from ..train.data import WindowSampler, make_batch, token_bytes
from ..train.evaluate import load_saved
from ..train.trainer import CONFIG_FILE, token_losses
from .api import prune
from .core import linear_mixers
from .metrics import diagnostics_table, plot_diagnostics, state_diagnostics
from .rft import recover


@torch.no_grad()
def bits_per_byte(model, windows: np.ndarray, tokenizer, batch_size: int = 8) -> dict:
    table = torch.as_tensor(token_bytes(tokenizer, model.config.vocab_size))
    device = next(model.parameters()).device
    total = count = nbytes = 0.0
    for i in range(0, len(windows), batch_size):
        batch = make_batch(windows[i:i + batch_size], "concat", tokenizer.eos_token_id, device)
        loss, valid = token_losses(model, batch, None)
        total += float(loss.sum())
        count += float(valid.sum())
        nbytes += float((table[batch["labels"][:, 1:].cpu()] * valid.cpu()).sum())
    return {"loss": total / count, "ppl": math.exp(min(total / count, 50)), "bpb": total / math.log(2) / nbytes}


@torch.no_grad()
def mixer_speed(model, batch: int = 4, seq_len: int = 512, repeats: int = 5) -> dict:
    """Forward time (median ms) and, on CUDA, peak memory of the first linear mixer alone."""
    i, m = next(iter(linear_mixers(model).items()))
    device = next(model.parameters()).device
    x = torch.randn(batch, seq_len, model.config.hidden_size, device=device)
    times = []
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        m(x)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    out = {"ms": 1e3 * float(np.median(times[1:])), "batch": batch, "seq_len": seq_len}
    if device.type == "cuda":
        out["peak_mb"] = torch.cuda.max_memory_allocated() / 2**20
    return out


def run_prune(model_dir, method: str, ratio: float, out: str | Path, calib: list[str] | None = None,
              calib_samples: int = 128, seq_len: int | None = None, select: str = "kq", budget: str = "uniform",
              tolerance: float = 1.1, rft_steps: int = 0, rft_lr: float = 1e-4, rft_batch_size: int = 8,
              eval_windows: int = 32, diag_tokens: int = 128, device: str = "auto", seed: int = 0,
              progress: bool = True, pca_adversarial: bool = False) -> dict:
    model_dir, out = Path(model_dir), Path(out)
    model, tokenizer, corpus, train_cfg, sources = load_saved(model_dir, device, calib)
    dev = next(model.parameters()).device
    seq_len = seq_len or train_cfg.get("seq_len") or 256
    train = WindowSampler(corpus.train, seq_len, seed)
    val = WindowSampler(corpus.val, seq_len, seed, shuffle=False)
    # Calibration: the first calib_samples windows of a seeded order over the training split;
    # recovery fine-tuning: the windows after them; evaluation: the validation split.
    calib_ids = [torch.from_numpy(train.tokens(range(s, min(s + 8, calib_samples))).astype(np.int64))
                 for s in range(0, calib_samples, 8)]
    eval_w = val.tokens(range(min(eval_windows, val.num_windows)))
    diag_ids = torch.from_numpy(val.tokens(range(min(4, val.num_windows)))[:, :diag_tokens].astype(np.int64)).to(dev)

    t0 = time.perf_counter()
    pruned, info = prune(model, method, ratio, calib_ids, select=select, budget=budget, tolerance=tolerance, seed=seed,
                         pca_adversarial=pca_adversarial)
    info["seconds"] = time.perf_counter() - t0
    report = {"model": str(model_dir), "method": method, "ratio": ratio, "select": select, "budget": budget,
              "head_k_dim": [model.config.head_k_dim or model.config.hidden_size // model.config.num_heads,
                             pruned.config.head_k_dim],
              "calibration": f"{calib_samples} windows of {seq_len} tokens from {', '.join(sources)}",
              "info": {k: v for k, v in info.items() if k != "budgets"}}
    report["before"] = bits_per_byte(model, eval_w, tokenizer)
    report["after"] = bits_per_byte(pruned, eval_w, tokenizer)
    named = {"baseline": state_diagnostics(model, diag_ids, skip=min(16, diag_tokens // 2)),
             f"{method} {ratio:.0%}": state_diagnostics(pruned, diag_ids, skip=min(16, diag_tokens // 2))}
    if rft_steps:
        batches = [torch.from_numpy(train.tokens(range(calib_samples + s * rft_batch_size,
                                                       calib_samples + (s + 1) * rft_batch_size)).astype(np.int64))
                   for s in range(rft_steps)]
        losses = recover(pruned, model, batches, lr=rft_lr, progress=progress)
        report["rft"] = {"steps": rft_steps, "lr": rft_lr, "batch_size": rft_batch_size, "first_loss": losses[0],
                         "last_loss": losses[-1]}
        report["after_rft"] = bits_per_byte(pruned, eval_w, tokenizer)
        named[f"{method} {ratio:.0%} + RFT"] = state_diagnostics(pruned, diag_ids, skip=min(16, diag_tokens // 2))
    report["rank"] = {name: {str(i): {"utilization": [round(float(x), 4) for x in d["utilization"]],
                                      "effective_rank": [round(float(x), 3) for x in d["effective_rank"]]}
                             for i, d in diag["layers"].items()} for name, diag in named.items()}
    report["similarity_entropy"] = {n: d["similarity"]["entropy"] for n, d in named.items() if d["similarity"]}
    report["mixer_speed"] = {"before": mixer_speed(model), "after": mixer_speed(pruned)}

    out.mkdir(parents=True, exist_ok=True)
    pruned.save_pretrained(out)
    tokenizer.save_pretrained(out)
    if train_cfg:
        (out / CONFIG_FILE).write_text(json.dumps(train_cfg, indent=2) + "\n")
    (out / "prune_report.json").write_text(json.dumps(report, indent=2) + "\n")
    md = report_markdown(report, diagnostics_table(named))
    (out / "prune_report.md").write_text(md + "\n")
    plot_diagnostics(named, out / "prune_spectra.png")
    report["markdown"] = md
    return report


def report_markdown(r: dict, rank_table: str) -> str:
    k0, k1 = r["head_k_dim"]
    name = r["method"] + (" (adversarial)" if r["info"].get("pca_adversarial") else "")
    lines = [f"# {name} at {r['ratio']:.0%} ({r['select']}, {r['budget']} budget): head_k_dim {k0} -> {k1}",
             f"model {r['model']}; calibration: {r['calibration']}", "",
             "| | loss | perplexity | bits/byte |", "|---|---:|---:|---:|"]
    for key, name in (("before", "before"), ("after", "after pruning"), ("after_rft", "after recovery")):
        if key in r:
            lines.append(f"| {name} | {r[key]['loss']:.4f} | {r[key]['ppl']:.3f} | {r[key]['bpb']:.4f} |")
    if "rft" in r:
        lines.append(f"\nrecovery: {r['rft']['steps']} steps of {r['rft']['batch_size']} windows, lr {r['rft']['lr']:g} "
                     "(LoRA r=16 alpha=32, convolutions unfrozen, KL to the unpruned model + LM loss)")
    b, a = r["mixer_speed"]["before"], r["mixer_speed"]["after"]
    mem = ""
    if "peak_mb" in b:
        mem = f", peak memory {b['peak_mb']:.0f} -> {a['peak_mb']:.0f} MB ({a['peak_mb'] / b['peak_mb']:.2f}x)"
    lines.append(f"\nsequence mixer (layer 0, B={b['batch']}, T={b['seq_len']}): {b['ms']:.2f} -> {a['ms']:.2f} ms "
                 f"({b['ms'] / a['ms']:.2f}x){mem}")
    if "drrqr" in r["info"]:
        d = r["info"]["drrqr"]
        lines.append(f"DRRQR: tolerance f = {d['tolerance']}, {d['swaps']} swaps after QRCP, max rho {d['rho_max']:.3f}")
    lines += ["", "Rank utilisation u = er(S) / min(K, V) and effective rank of the states (validation text):", "",
              rank_table]
    return "\n".join(lines)
