"""Text data for training and evaluation: sources, tokenisation, a deterministic split, packing.

A source is ``"stdlib"`` (the running interpreter's standard-library ``.py`` files: real
text on every machine, nothing to download), a text file, a folder (read recursively),
or ``"hf:NAME[:CONFIG[:SPLIT]]"`` (a Hugging Face dataset's ``text`` column; needs the
optional ``datasets`` package). Documents go to validation by a hash of their name, so
the split does not depend on the order or number of the other documents. Each split is
one token stream (documents joined by ``<eos>``), cut into windows of ``seq_len`` tokens.
"""
from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..data import ByteTokenizer


# ----------------------------------------------------------------------------- sources
def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def iter_documents(sources: list[str], suffixes: list[str]):
    """``(name, text_or_bytes)`` for every document of ``sources``, in a fixed order."""
    for source in sources:
        if source == "stdlib":
            root = stdlib_root()
            files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.relative_to(root).parts)
            for path in files:
                yield f"stdlib/{path.relative_to(root).as_posix()}", path.read_bytes()
        elif source.startswith("hf:"):
            yield from _hf_documents(source)
        else:
            path = Path(source).expanduser()
            if not path.exists():
                raise FileNotFoundError(f"data: {source} does not exist (give a text file, a folder, "
                                        "\"stdlib\" or hf:NAME)")
            if path.is_file():
                yield path.name, path.read_bytes()
            else:
                files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in suffixes)
                for file in files:
                    yield file.relative_to(path).as_posix(), file.read_bytes()


def _hf_documents(source: str):
    try:
        import datasets
    except ImportError as e:
        raise ImportError(f"data: {source} needs the `datasets` package (pip install datasets)") from e
    name, config, split = (source[3:].split(":") + [None, None])[:3]
    ds = datasets.load_dataset(name, config or None, split=split or "train")
    if "text" not in ds.column_names:
        raise ValueError(f"data: {source} has no 'text' column (columns: {ds.column_names})")
    for i, row in enumerate(ds):
        yield f"{source}/{i}", row["text"]


def is_validation(name: str, fraction: float) -> bool:
    """Whether document ``name`` is held out: a stable hash, independent of everything else."""
    h = int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little")
    return h / 2 ** 64 < fraction


# ----------------------------------------------------------------------------- tokenizers
def build_tokenizer(spec: str):
    """``"bytes"`` -> ``ByteTokenizer``; a ``tokenizer.json`` file or a Hugging Face name/folder
    -> a ``transformers`` fast tokenizer."""
    if spec == "bytes":
        return ByteTokenizer()
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    path = Path(spec).expanduser()
    if path.is_file():
        tok = PreTrainedTokenizerFast(tokenizer_file=str(path))
    else:
        tok = AutoTokenizer.from_pretrained(spec)
    if tok.eos_token_id is None:  # a bare tokenizer.json: find its end-of-text token by the usual names
        vocab = tok.get_vocab()
        name = next((n for n in ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "[SEP]") if n in vocab), None)
        if name is None:
            raise ValueError(f"tokenizer: {spec} has no end-of-sequence token (looked for <|endoftext|>, </s>, "
                             "<eos>, [SEP]); documents need a separator")
        tok.eos_token = name
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token  # batched generation pads on the left; pads are masked out
    return tok


def tokenizer_vocab_size(tokenizer) -> int:
    return tokenizer.vocab_size if isinstance(tokenizer, ByteTokenizer) else len(tokenizer)


def encode_documents(tokenizer, docs) -> tuple[list[np.ndarray], list[str]]:
    """Token arrays (each ending with ``<eos>``) and names of ``docs``."""
    arrays, names = [], []
    eos = tokenizer.eos_token_id
    for name, content in docs:
        if isinstance(tokenizer, ByteTokenizer):
            raw = content if isinstance(content, bytes) else content.encode("utf-8")
            ids = np.frombuffer(raw, dtype=np.uint8).astype(np.int32)
        else:
            text = content.decode("utf-8", errors="replace") if isinstance(content, bytes) else content
            ids = np.asarray(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=np.int32)
        if ids.size == 0:
            continue
        arrays.append(np.concatenate([ids, np.array([eos], dtype=np.int32)]))
        names.append(name)
    return arrays, names


def token_bytes(tokenizer, vocab_size: int) -> np.ndarray:
    """UTF-8 bytes each token id stands for (0 for special tokens), for bits per byte."""
    if isinstance(tokenizer, ByteTokenizer):
        out = np.zeros(vocab_size, dtype=np.int64)
        out[:256] = 1
        return out
    special = set(tokenizer.all_special_ids)
    out = np.zeros(vocab_size, dtype=np.int64)
    for i in range(min(vocab_size, len(tokenizer))):
        if i not in special:
            out[i] = len(tokenizer.decode([i]).encode("utf-8"))
    return out


# ----------------------------------------------------------------------------- corpus
@dataclass
class Split:
    """One split's token stream and where its documents start."""

    tokens: np.ndarray      # [N] int32, documents joined (each ends with <eos>)
    doc_starts: np.ndarray  # [D] int64 offsets of the documents in ``tokens``
    num_docs: int

    def windows(self, seq_len: int) -> int:
        return len(self.tokens) // seq_len

    def doc_lengths(self) -> np.ndarray:
        return np.diff(np.append(self.doc_starts, len(self.tokens)))


@dataclass
class Corpus:
    train: Split
    val: Split
    tokenizer: object
    description: str

    @classmethod
    def load(cls, sources: list[str], tokenizer, val_fraction: float, suffixes: list[str]) -> "Corpus":
        arrays, names = encode_documents(tokenizer, iter_documents(sources, suffixes))
        if not arrays:
            raise ValueError(f"data: no text found in {', '.join(sources)} (suffixes read from folders: "
                             f"{', '.join(suffixes)})")
        held = [is_validation(n, val_fraction) for n in names]
        if all(held) or not any(held):
            # Too few documents for a split by document: hold out the stream's tail instead.
            stream = np.concatenate(arrays)
            cut = int(len(stream) * (1 - val_fraction))
            train = Split(stream[:cut], np.array([0]), len(arrays))
            val = Split(stream[cut:], np.array([0]), 1)
            how = f"last {val_fraction:.0%} of the tokens held out"
        else:
            train = _join([a for a, h in zip(arrays, held) if not h])
            val = _join([a for a, h in zip(arrays, held) if h])
            how = f"{val.num_docs} of {len(arrays)} documents held out"
        desc = (f"{', '.join(sources)}: {len(train.tokens) + len(val.tokens):,} tokens in {len(arrays):,} "
                f"documents ({how}; train {len(train.tokens):,}, validation {len(val.tokens):,} tokens)")
        return cls(train, val, tokenizer, desc)


def _join(arrays: list[np.ndarray]) -> Split:
    starts = np.cumsum([0] + [len(a) for a in arrays[:-1]]).astype(np.int64)
    return Split(np.concatenate(arrays), starts, len(arrays))


# ----------------------------------------------------------------------------- batches
class EpochOrder:
    """Which of ``n`` items sample ``i`` is: item ``perm_e[i % n]`` of epoch ``e = i // n``, with
    ``perm_e`` a permutation seeded by ``(*key, e)`` (the identity when ``shuffle`` is off)."""

    def __init__(self, n: int, key: tuple, shuffle: bool = True):
        self.n, self.key, self.shuffle = n, tuple(key), shuffle
        self._epoch, self._perm = None, None

    def __call__(self, sample: int) -> int:
        if not self.shuffle:
            return sample % self.n
        epoch = sample // self.n
        if epoch != self._epoch:
            self._perm = np.random.default_rng([*self.key, epoch]).permutation(self.n)
            self._epoch = epoch
        return int(self._perm[sample % self.n])


class WindowSampler:
    """A fixed, seeded order of a split's windows, epoch after epoch.

    Sample ``i`` of the run (counting over all processes) is window ``perm_e[i % n]`` of
    epoch ``e = i // n``; a step of global batch ``G`` takes samples ``[step G, (step+1) G)``
    and process ``r`` of ``W`` its ``r``-th ``G / W`` of them. So the data position is just
    the step, and a run resumes on any world size with the same global batch.
    """

    def __init__(self, split: Split, seq_len: int, seed: int, shuffle: bool = True):
        self.split, self.seq_len, self.seed, self.shuffle = split, seq_len, seed, shuffle
        self.num_windows = split.windows(seq_len)
        if self.num_windows < 1:
            raise ValueError(f"seq_len {seq_len} is longer than the data ({len(split.tokens):,} tokens in this "
                             "split); use a shorter --seq-len or more data")
        self.window = EpochOrder(self.num_windows, (seed,), shuffle)  # sample -> window index

    def tokens(self, samples) -> np.ndarray:
        L = self.seq_len
        return np.stack([self.split.tokens[w * L:(w + 1) * L] for w in map(self.window, samples)])


def make_batch(tokens: np.ndarray, pack: str, eos_id: int, device) -> dict:
    """Model inputs for windows ``tokens`` [m, L]: ``input_ids`` and ``labels`` (and, for
    ``pack="varlen"``, the windows laid along one row with ``cu_seqlens`` at every window
    and document boundary; the first token of each segment is not a target)."""
    ids = torch.from_numpy(tokens.astype(np.int64))
    if pack == "concat":
        return {"input_ids": ids.to(device), "labels": ids.clone().to(device)}
    m, L = ids.shape
    flat = ids.reshape(1, m * L)
    starts = set(range(0, m * L, L))
    ends = (np.flatnonzero(tokens.reshape(-1) == eos_id) + 1).tolist()
    starts.update(e for e in ends if e < m * L)
    cu = torch.tensor(sorted(starts) + [m * L], dtype=torch.int32)
    labels = flat.clone()
    labels[0, cu[:-1].long()] = -100  # predicted across a boundary: not a target
    return {"input_ids": flat.to(device), "labels": labels.to(device), "cu_seqlens": cu.to(device)}
