"""``rankdecay eval``: validation loss, perplexity, bits per byte, and loss by position.

The length-extrapolation curve (Gated DeltaNet Fig. 2, Head-in-Head Fig. 3) is the mean
next-token loss in position buckets of windows longer than the training length. Windows
are the first ``seq_len`` tokens of validation documents at least that long, so a
position is a position in a document; when fewer than ``min_docs`` documents are that
long, windows are cut from the joined validation stream instead (and the report says so).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from .data import Corpus, make_batch, token_bytes
from .trainer import CONFIG_FILE, autocast_dtype, resolve_device, token_losses


@dataclass
class EvalResult:
    model: str
    data: str
    seq_len: int
    train_seq_len: int | None
    windows: int
    window_source: str
    loss: float
    ppl: float
    bpb: float
    buckets: list = field(default_factory=list)  # [{"start", "end", "loss", "ppl", "tokens"}]
    loss_within_train_len: float | None = None
    loss_beyond_train_len: float | None = None

    def markdown(self) -> str:
        lines = [f"model {self.model}: {self.windows} windows of {self.seq_len} tokens ({self.window_source})",
                 f"validation loss {self.loss:.4f} nats/token, perplexity {self.ppl:.3f}, {self.bpb:.4f} bits/byte"]
        if self.loss_beyond_train_len is not None:
            lines.append(f"loss within the training length ({self.train_seq_len}) {self.loss_within_train_len:.4f}, "
                         f"beyond it {self.loss_beyond_train_len:.4f}")
        lines += ["", "| positions | loss | ppl | targets |", "|---|---:|---:|---:|"]
        for b in self.buckets:
            mark = " *" if self.train_seq_len and b["start"] >= self.train_seq_len else ""
            lines.append(f"| {b['start']}-{b['end'] - 1}{mark} | {b['loss']:.4f} | {b['ppl']:.3f} | {b['tokens']} |")
        if self.train_seq_len:
            lines.append(f"\n(* beyond the training length {self.train_seq_len})")
        return "\n".join(lines)


def bucket_edges(seq_len: int, first: int = 64) -> list[int]:
    """0, first, 2 first, 4 first, ... up to seq_len (doubling, as on a log-x plot)."""
    first = max(1, min(first, seq_len // 8 or 1))
    edges, e = [0], first
    while e < seq_len:
        edges.append(e)
        e *= 2
    return edges + [seq_len]


def select_windows(split, seq_len: int, max_windows: int, min_docs: int = 4) -> tuple[np.ndarray, str]:
    lengths, starts = split.doc_lengths(), split.doc_starts
    long_docs = [int(s) for s, n in zip(starts, lengths) if n >= seq_len]
    if len(long_docs) >= min_docs and split.num_docs > 1:
        picked = long_docs[:max_windows]
        how = f"the first {seq_len} tokens of {len(picked)} validation documents"
    else:
        n = len(split.tokens) // seq_len
        if n < 1:
            raise ValueError(f"seq_len {seq_len} is longer than the validation data ({len(split.tokens):,} tokens); "
                             "use a shorter --seq-len or more data")
        picked = [i * seq_len for i in range(min(n, max_windows))]
        how = (f"{len(picked)} consecutive windows of the joined validation stream (fewer than {min_docs} "
               f"documents are {seq_len} tokens long)")
    windows = np.stack([split.tokens[s:s + seq_len] for s in picked])
    return windows, how


def load_saved(model_dir: str | Path, device: str = "auto", data: list[str] | None = None,
               val_fraction: float | None = None):
    """A model saved by ``rankdecay train`` (or any ``save_pretrained`` folder) with its tokenizer,
    the training config it saved (``{}`` if none), and the corpus it was trained on (or ``data``),
    split as in training. Returns ``(model, tokenizer, corpus, train_cfg, data)``."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from ..data import load_tokenizer

    hf_logging.disable_progress_bar()
    model_dir = Path(model_dir)
    if not (model_dir / "config.json").exists():
        raise FileNotFoundError(f"{model_dir} is not a saved model (no config.json)")
    train_cfg = json.loads((model_dir / CONFIG_FILE).read_text()) if (model_dir / CONFIG_FILE).exists() else {}
    data = list(data or train_cfg.get("data") or ["stdlib"])
    val_fraction = val_fraction or train_cfg.get("val_fraction", 0.02)
    suffixes = train_cfg.get("text_suffixes") or [".py", ".txt", ".md", ".rst"]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(resolve_device(device)).eval()
    tokenizer = load_tokenizer(model_dir, model.config.vocab_size)
    return model, tokenizer, Corpus.load(data, tokenizer, val_fraction, suffixes), train_cfg, data


@torch.no_grad()
def evaluate_model(model_dir: str | Path, data: list[str] | None = None, seq_len: int | None = None,
                   max_windows: int = 64, batch_size: int = 4, device: str = "auto", dtype: str = "auto",
                   val_fraction: float | None = None, progress: bool = True) -> EvalResult:
    """Evaluate a saved model on the validation split of ``data`` (default: the data it was trained on)."""
    if seq_len is not None and seq_len < 2:
        raise ValueError(f"seq_len must be >= 2, got {seq_len}")
    model, tokenizer, corpus, train_cfg, data = load_saved(model_dir, device, data, val_fraction)
    dev = next(model.parameters()).device
    train_len = train_cfg.get("seq_len")
    seq_len = seq_len or (4 * train_len if train_len else 2048)
    windows, how = select_windows(corpus.val, seq_len, max_windows)
    amp = autocast_dtype(dtype, dev)
    table = torch.as_tensor(token_bytes(tokenizer, model.config.vocab_size))
    loss_pos = torch.zeros(seq_len - 1, dtype=torch.float64)
    count_pos = torch.zeros(seq_len - 1, dtype=torch.float64)
    nbytes = 0.0
    it = range(0, len(windows), batch_size)
    if progress:
        from tqdm.auto import tqdm

        it = tqdm(it, desc="eval", unit="batch", leave=False)
    for i in it:
        batch = make_batch(windows[i:i + batch_size], "concat", tokenizer.eos_token_id, dev)
        loss, valid = token_losses(model, batch, amp)
        loss_pos += loss.double().sum(0).cpu()
        count_pos += valid.double().sum(0).cpu()
        nbytes += float((table[batch["labels"][:, 1:].cpu()] * valid.cpu()).sum())
    total = float(loss_pos.sum())
    mean = total / float(count_pos.sum())
    buckets = []
    edges = bucket_edges(seq_len)
    # Target position p + 1 is predicted at position p; bucket by the target's position.
    for lo, hi in zip(edges[:-1], edges[1:]):
        a, b = max(lo - 1, 0), hi - 1
        n = float(count_pos[a:b].sum())
        if n:
            lb = float(loss_pos[a:b].sum()) / n
            buckets.append({"start": lo, "end": hi, "loss": lb, "ppl": math.exp(min(lb, 50)), "tokens": int(n)})
    res = EvalResult(model=str(model_dir), data=", ".join(data), seq_len=seq_len, train_seq_len=train_len,
                     windows=len(windows), window_source=how, loss=mean, ppl=math.exp(min(mean, 50)),
                     bpb=total / math.log(2) / nbytes if nbytes else float("nan"), buckets=buckets)
    if train_len and train_len < seq_len:
        k = train_len - 1
        res.loss_within_train_len = float(loss_pos[:k].sum() / count_pos[:k].sum())
        res.loss_beyond_train_len = float(loss_pos[k:].sum() / count_pos[k:].sum())
    return res


def save_eval(res: EvalResult, out_dir: str | Path) -> list[Path]:
    """``eval.json``, ``eval.md`` and ``eval_positions.png`` in ``out_dir``."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / "eval.json", out_dir / "eval.md"]
    paths[0].write_text(json.dumps(res.__dict__, indent=2) + "\n")
    paths[1].write_text(res.markdown() + "\n")
    from .._plot import finish, pyplot

    plt = pyplot()
    if plt is None:
        return paths
    fig, ax = plt.subplots(figsize=(6, 4))
    mids = [(b["start"] + b["end"]) / 2 for b in res.buckets]
    ax.plot(mids, [b["loss"] for b in res.buckets], "o-", label=Path(res.model).name)
    if res.train_seq_len and res.train_seq_len < res.seq_len:
        ax.axvline(res.train_seq_len, color="gray", ls="--", label=f"training length {res.train_seq_len}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("token position")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title("loss by position")
    return paths + [finish(fig, [ax], out_dir / "eval_positions.png")]
