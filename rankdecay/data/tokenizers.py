"""Tokenizers: a byte-level one for tiny models, Hugging Face ones for everything else."""
from __future__ import annotations

import json
from pathlib import Path

import torch

BYTE_TOKENIZER_FILE = "rankdecay_tokenizer.json"


class ByteTokenizer:
    """UTF-8 bytes as tokens 0-255, then ``<bos>`` 256, ``<eos>`` 257, ``<pad>`` 258.

    Needs no files and no download, so tiny models (vocab 264, the ``tiny`` preset)
    train and generate anywhere. ``decode`` drops the special tokens and replaces
    invalid UTF-8 (a model may emit half a character).
    """

    bos_token_id, eos_token_id, pad_token_id = 256, 257, 258
    vocab_size = 259

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [self.bos_token_id] + ids if add_bos else ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        """Text of the byte tokens in ``ids`` (special tokens are always dropped)."""
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def __call__(self, texts: str | list[str], add_bos: bool = False, **_) -> dict[str, torch.Tensor]:
        """Left-padded ``input_ids`` and ``attention_mask`` [B, T], ready for ``generate``.
        (Hugging Face keywords such as ``return_tensors`` or ``padding`` are accepted and ignored.)"""
        texts = [texts] if isinstance(texts, str) else list(texts)
        return left_padded([self.encode(t, add_bos) for t in texts], self.pad_token_id)

    def save_pretrained(self, directory: str | Path) -> None:
        Path(directory, BYTE_TOKENIZER_FILE).write_text(json.dumps({"type": "bytes"}) + "\n")


def left_padded(rows: list[list[int]], pad_id: int) -> dict[str, torch.Tensor]:
    """``input_ids`` and ``attention_mask`` [B, T] of token rows, left-padded with ``pad_id`` (generation continues
    each row's end)."""
    T = max(len(row) for row in rows)
    ids = torch.full((len(rows), T), pad_id, dtype=torch.long)
    mask = torch.zeros(len(rows), T, dtype=torch.long)
    for i, row in enumerate(rows):
        if row:
            ids[i, T - len(row):] = torch.tensor(row)
            mask[i, T - len(row):] = 1
    return {"input_ids": ids, "attention_mask": mask}


def load_tokenizer(directory: str | Path, vocab_size: int | None = None):
    """The tokenizer saved with a model: the byte tokenizer if ``rankdecay_tokenizer.json``
    is there, a Hugging Face tokenizer if its files are, else the byte tokenizer when the
    model's vocabulary (``vocab_size``) can hold it."""
    directory = Path(directory)
    if (directory / BYTE_TOKENIZER_FILE).exists():
        return ByteTokenizer()
    if any((directory / name).exists() for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(directory)
    if vocab_size is not None and vocab_size >= ByteTokenizer.vocab_size:
        return ByteTokenizer()
    raise FileNotFoundError(f"no tokenizer in {directory} (expected {BYTE_TOKENIZER_FILE} or a Hugging Face "
                            f"tokenizer.json), and a vocabulary of {vocab_size} cannot hold the byte tokenizer")
