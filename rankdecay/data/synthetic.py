"""Synthetic tasks the papers evaluate on: MQAR, the six MAD tasks, state tracking, passkey retrieval.

Every generator is a pure function of its parameters and a seed: ``task(n, seed=..., **params)``
returns ``(inputs, targets)``, two int64 arrays ``[n, seq_len]``. ``targets[i, t]`` is the token
expected *after* ``inputs[i, t]`` (the prediction made at position ``t``), ``-100`` where nothing
is scored; accuracy is measured on the positions with a target only. ``to_labels`` turns them
into the model's ``labels`` (which the model shifts itself).

Train and test sets come from different seeds (``split_seed``); where a protocol forbids
overlap (MQAR, the recall tasks) the test examples are checked to be absent from training by
``overlap``. Token layouts are documented per task; special tokens sit at the top of the vocabulary.
"""
from __future__ import annotations

import numpy as np

IGNORE = -100


def split_seed(seed: int, split: str, part: int = 0) -> int:
    """Independent seeds for the train and test sets of one run seed (and for the parts of a
    training mixture or the test sets of several settings: ``part``)."""
    entropy = [seed, {"train": 0, "test": 1}[split]] + ([part] if part else [])
    return int(np.random.SeedSequence(entropy).generate_state(1)[0])


def to_labels(targets: np.ndarray) -> np.ndarray:
    """``labels[t + 1] = targets[t]`` (the model scores ``logits[t]`` against ``labels[t + 1]``)."""
    labels = np.full_like(targets, IGNORE)
    labels[:, 1:] = targets[:, :-1]
    return labels


def overlap(a: np.ndarray, b: np.ndarray) -> int:
    """How many rows of ``b`` also occur in ``a``."""
    seen = {row.tobytes() for row in a}
    return sum(row.tobytes() in seen for row in b)


def _check(name, value, low=None, high=None):
    if not isinstance(value, (int, np.integer)) or (low is not None and value < low) or (high is not None and value > high):
        raise ValueError(f"{name} must be an int in [{low}, {high}], got {value!r}")


# ----------------------------------------------------------------------------- MQAR
def mqar(n: int, seq_len: int = 256, num_kv_pairs: int = 16, vocab_size: int = 8192, power_a: float = 0.01,
         random_non_queries: bool = False, seed: int = 0):
    """Multi-query associative recall (Zoology, Arora et al. 2023).

    Layout: ``k_1 v_1 k_2 v_2 ... k_P v_P`` (keys distinct, from ``[1, V/2)``; values from
    ``[V/2, V)``), then the rest of the sequence holds each key once more as a query, at even
    offsets whose distance from the context is drawn from a power law ``p(d) ~ d^(a - 1)``
    (most queries come soon after the context, some far). The other positions hold token 0
    (as in the Zoology experiment configs the papers train with), or random tokens with
    ``random_non_queries=True`` (Zoology's generator default: harder, since filler tokens can
    look like queries). The target at a query key is its value; token 0 is never a key or value.
    """
    _check("num_kv_pairs", num_kv_pairs, 1)
    if seq_len < 4 * num_kv_pairs:
        raise ValueError(f"seq_len {seq_len} must be >= 4 x num_kv_pairs ({4 * num_kv_pairs})")
    if vocab_size // 2 - 1 < num_kv_pairs:
        raise ValueError(f"vocab_size {vocab_size} has fewer than num_kv_pairs = {num_kv_pairs} keys")
    rng = np.random.default_rng(seed)
    ctx = 2 * num_kv_pairs
    space = (seq_len - ctx) // 2  # query slots at even offsets after the context
    p = power_a * np.arange(1, space + 1, dtype=np.float64) ** (power_a - 1)
    p /= p.sum()
    inputs = rng.integers(1, vocab_size, size=(n, seq_len))  # drawn either way: same pairs and queries per seed
    if not random_non_queries:
        inputs[:] = 0
    targets = np.full((n, seq_len), IGNORE, dtype=np.int64)
    for i in range(n):
        keys = rng.choice(np.arange(1, vocab_size // 2), num_kv_pairs, replace=False)
        values = rng.integers(vocab_size // 2, vocab_size, num_kv_pairs)
        inputs[i, 0:ctx:2], inputs[i, 1:ctx:2] = keys, values
        slots = rng.choice(space, num_kv_pairs, replace=False, p=p)
        pos = ctx + 2 * slots
        inputs[i, pos] = keys
        targets[i, pos] = values
    return inputs.astype(np.int64), targets


# ----------------------------------------------------------------------------- MAD (Poli et al. 2024)
def _shifted_lm(inputs: np.ndarray) -> np.ndarray:
    """MAD trains on next-token prediction of the whole sequence."""
    t = np.full_like(inputs, IGNORE)
    t[:, :-1] = inputs[:, 1:]
    return t


def in_context_recall(n: int, seq_len: int = 128, vocab_size: int = 16, train: bool = True, noise_vocab_size: int = 0,
                      frac_noise: float = 0.0, multi_query: bool = True, seed: int = 0):
    """MAD in-context recall (and, with noise, noisy in-context recall).

    Layout: ``seq_len / 2 - 1`` key-value pairs ``k v`` (keys from the first half of the plain
    vocabulary, values from the second; a key keeps its value within a sequence), each replaced
    by a noise pair (two tokens of the noise vocabulary, the top ``noise_vocab_size`` plain
    tokens) with probability ``frac_noise``, then a probe ``k* v*`` with ``k*`` a key seen before.
    ``multi_query=True`` (the MAD benchmark's setting): test scores the value of *every* key that
    was presented before (and the probe), sequences have ``seq_len - 1`` tokens, all ``vocab_size``
    tokens are plain. ``multi_query=False``: the probe is preceded by ``<copy> = V - 1`` and only
    ``v*`` is scored; sequences have ``seq_len`` tokens. Training (both): every next token.
    """
    _check("vocab_size", vocab_size, 4 + noise_vocab_size)
    if not 0 <= frac_noise < 1 or (frac_noise > 0 and noise_vocab_size < 1):
        raise ValueError("frac_noise must be in [0, 1), and > 0 needs noise_vocab_size >= 1")
    if seq_len % 2 or seq_len < 4:
        raise ValueError(f"seq_len must be even and >= 4, got {seq_len}")
    rng = np.random.default_rng(seed)
    copy = vocab_size - 1
    plain = (vocab_size if multi_query else vocab_size - 1) - noise_vocab_size
    keys, vals = np.arange(plain // 2), np.arange(plain // 2, plain)
    noise = np.arange(plain, plain + noise_vocab_size)
    pairs = seq_len // 2 - 1
    length = 2 * pairs + 2 + (0 if multi_query else 1)  # the full sequence; inputs drop its last token
    full = np.zeros((n, length), dtype=np.int64)
    scored = np.zeros((n, length), dtype=bool)  # full[t] is a scored answer (predicted at t - 1)
    for i in range(n):
        seq, hit, kv = [], [], {}
        keep = rng.integers(pairs)  # at least one real pair
        for j in range(pairs):
            if frac_noise and j != keep and rng.random() < frac_noise:
                seq += [int(x) for x in rng.choice(noise, 2)]
                hit += [False, False]
                continue
            k = int(rng.choice(keys))
            hit += [False, multi_query and k in kv]
            seq += [k, kv.setdefault(k, int(rng.choice(vals)))]
        k_star = int(rng.choice(sorted(kv)))
        tail = ([] if multi_query else [copy]) + [k_star, kv[k_star]]
        full[i] = seq + tail
        scored[i] = hit + [False] * (len(tail) - 1) + [True]
    return _recall_arrays(full, train, scored)


def _recall_arrays(full: np.ndarray, train: bool, scored: np.ndarray):
    """Inputs ``full[:, :-1]``; targets: the next token everywhere (train, MAD's protocol) or the
    answers marked in ``scored`` (test)."""
    inputs = full[:, :-1].copy()
    if train:
        return inputs, full[:, 1:].copy()
    return inputs, np.where(scored[:, 1:], full[:, 1:], IGNORE)


def fuzzy_in_context_recall(n: int, seq_len: int = 128, vocab_size: int = 16, max_key_len: int = 3,
                            max_value_len: int = 3, train: bool = True, multi_query: bool = True, seed: int = 0):
    """MAD fuzzy in-context recall: keys and values are motifs of 1..``max_*_len`` tokens.

    Layout: left padding, motif pairs ``key value`` (a key keeps its value; one of them is the
    probe pair), then the probe ``key* value*`` again. Test keys all have the maximum length
    (training keys any length). ``multi_query=True`` (MAD's benchmark setting): test scores the
    value tokens of every key presented before and of the final probe; ``<pad> = V - 1``.
    ``multi_query=False``: ``<copy> = V - 1`` precedes the final probe, only its value is scored,
    ``<pad> = V - 2``. Sequences have ``seq_len`` tokens.
    """
    _check("vocab_size", vocab_size, 6)
    rng = np.random.default_rng(seed)
    pad = vocab_size - 1 if multi_query else vocab_size - 2
    copy = vocab_size - 1
    plain = vocab_size - 1 if multi_query else vocab_size - 2
    key_vocab, val_vocab = np.arange(plain // 2), np.arange(plain // 2, plain)

    def motif(vocab, longest, fixed=False):
        return tuple(int(x) for x in rng.choice(vocab, longest if fixed else int(rng.integers(1, longest + 1))))

    full = np.full((n, seq_len + 1), pad, dtype=np.int64)
    scored = np.zeros((n, seq_len + 1), dtype=bool)
    for i in range(n):
        probe_k, probe_v = motif(key_vocab, max_key_len, fixed=not train), motif(val_vocab, max_value_len)
        kv = {probe_k: probe_v}
        tail = ([] if multi_query else [copy]) + [*probe_k, *probe_v]
        budget = seq_len + 1 - len(tail) - len(probe_k) - len(probe_v)
        pairs = []
        while True:
            k = motif(key_vocab, max_key_len, fixed=not train)
            v = kv.setdefault(k, motif(val_vocab, max_value_len))
            if len(k) + len(v) > budget:
                break
            pairs.append((k, v))
            budget -= len(k) + len(v)
        pairs.insert(int(rng.integers(len(pairs) + 1)), (probe_k, probe_v))  # the probe pair, somewhere
        seq, hit, seen = [], [], set()
        for k, v in pairs:
            seq += [*k, *v]
            hit += [False] * len(k) + [multi_query and k in seen] * len(v)
            seen.add(k)
        seq += tail
        hit += [False] * (len(tail) - len(probe_v)) + [True] * len(probe_v)
        full[i, seq_len + 1 - len(seq):] = seq  # left padding
        scored[i, seq_len + 1 - len(seq):] = hit
    return _recall_arrays(full, train, scored)


def noisy_in_context_recall(n: int, seq_len: int = 128, vocab_size: int = 32, noise_vocab_size: int = 16,
                            frac_noise: float = 0.2, train: bool = True, multi_query: bool = True, seed: int = 0):
    """MAD noisy in-context recall: in-context recall with a share ``frac_noise`` of noise pairs."""
    return in_context_recall(n, seq_len, vocab_size, train, noise_vocab_size, frac_noise, multi_query, seed)


def selective_copying(n: int, seq_len: int = 256, vocab_size: int = 16, num_tokens_to_copy: int = 16, seed: int = 0):
    """MAD selective copying: ``num_tokens_to_copy`` tokens scattered among ``<blank>`` tokens, then
    ``<copy>`` and ``num_tokens_to_copy`` blanks during which the tokens are reproduced in order
    (token ``j`` predicted at the ``j``-th blank after ``<copy>``, as MAD scores it; train = test
    targets). ``<blank> = V - 2``, ``<copy> = V - 1``."""
    if seq_len <= 2 * num_tokens_to_copy + 1:
        raise ValueError(f"seq_len must be > 2 x num_tokens_to_copy + 1 = {2 * num_tokens_to_copy + 1}")
    rng = np.random.default_rng(seed)
    blank, copy = vocab_size - 2, vocab_size - 1
    region = seq_len - num_tokens_to_copy - 1
    inputs = np.full((n, seq_len), blank, dtype=np.int64)
    targets = np.full((n, seq_len), IGNORE, dtype=np.int64)
    for i in range(n):
        tokens = rng.integers(0, vocab_size - 2, num_tokens_to_copy)
        where = np.sort(rng.choice(region, num_tokens_to_copy, replace=False))
        inputs[i, where] = tokens
        inputs[i, region] = copy
        targets[i, region + 1:] = tokens  # predicted at the blanks after <copy>
    return inputs, targets


def compression(n: int, seq_len: int = 32, vocab_size: int = 16, seed: int = 0):
    """MAD compression: random tokens then ``<compress>`` (``V - 1``); the model must reproduce
    the whole sequence from the last position's representation. The targets are the inputs;
    scoring needs MAD's decoder head on the last position (``rankdecay synth`` adds it)."""
    rng = np.random.default_rng(seed)
    inputs = rng.integers(0, vocab_size - 1, size=(n, seq_len))
    inputs[:, -1] = vocab_size - 1
    return inputs.astype(np.int64), inputs.astype(np.int64).copy()


def memorization_map(vocab_size: int, map_seed: int = 12345) -> dict[int, int]:
    """MAD memorization's fixed key -> value map (keys: first half, values: second half)."""
    plain = vocab_size - 1
    rng = np.random.default_rng(map_seed)
    keys, vals = rng.permutation(plain // 2), rng.permutation(np.arange(plain // 2, plain))
    return {int(k): int(v) for k, v in zip(keys, vals)}


def memorization(n: int, seq_len: int = 32, vocab_size: int = 256, map_seed: int = 12345, seed: int = 0):
    """MAD memorization: ``k <insert>`` pairs; the target at ``<insert>`` (``V - 1``) is the value
    of ``k`` in a map fixed across all sequences (train and test share the map: it is the thing
    to memorise), so it cannot be read from the context."""
    rng = np.random.default_rng(seed)
    kv = memorization_map(vocab_size, map_seed)
    keys = np.array(sorted(kv))
    inputs = np.full((n, seq_len), vocab_size - 1, dtype=np.int64)
    targets = np.full((n, seq_len), IGNORE, dtype=np.int64)
    ks = rng.choice(keys, size=(n, seq_len // 2))
    inputs[:, 0::2][:, :ks.shape[1]] = ks
    targets[:, 1::2][:, :ks.shape[1]] = np.vectorize(kv.get)(ks)
    return inputs, targets


# ----------------------------------------------------------------------------- state tracking
def parity(n: int, seq_len: int = 64, min_len: int | None = None, score_from: int = 0, seed: int = 0):
    """Parity (Grazzi et al. 2025): bits ``0``/``1``; the target at every position is the parity
    of the bits so far (tokens 0/1), so length generalisation can be read position by position.
    With ``min_len``, each sequence has a random length in [min_len, seq_len], left-padded with
    ``<pad> = 2`` (unscored). ``score_from``: only the parities of prefixes longer than this are
    scored (a test set for length generalisation scores beyond the training length only)."""
    rng = np.random.default_rng(seed)
    bits = rng.integers(0, 2, size=(n, seq_len))
    targets = np.cumsum(bits, axis=1) % 2
    inputs, targets = bits.astype(np.int64), targets.astype(np.int64)
    if min_len is not None:
        lengths = rng.integers(min_len, seq_len + 1, n)
        for i, L in enumerate(lengths):
            inputs[i, :seq_len - L], targets[i, :seq_len - L] = 2, IGNORE
            targets[i, seq_len - L:] = np.cumsum(inputs[i, seq_len - L:]) % 2
    if score_from:
        prefix_len = np.cumsum(inputs != 2, axis=1)  # bits so far at each position
        targets[prefix_len <= score_from] = IGNORE
    return inputs, targets


MOD_TOKENS = {"+": 0, "-": 1, "*": 2, "(": 3, ")": 4, "=": 5}


def modular_arithmetic(n: int, seq_len: int = 64, modulus: int = 5, brackets: bool = False, seed: int = 0):
    """Modular arithmetic with or without brackets (Deletang et al. 2023, as in Grazzi et al. 2025).

    An expression over ``Z_modulus`` with ``+ - *`` (usual precedence; with ``brackets``, random
    nesting), then ``=`` and the value (scored). Tokens: numbers ``0..m-1``, then ``+ - * ( ) =``
    at ``m + MOD_TOKENS[op]``, ``<pad> = m + 6`` (left padding). The expression fills ``seq_len - 2``
    tokens at most.
    """
    _check("modulus", modulus, 2)
    if seq_len < 5:
        raise ValueError(f"seq_len must be >= 5, got {seq_len}")
    rng = np.random.default_rng(seed)
    m = modulus
    pad = m + 6
    inputs = np.full((n, seq_len), pad, dtype=np.int64)
    targets = np.full((n, seq_len), IGNORE, dtype=np.int64)
    budget = seq_len - 1  # the expression and "=", the answer is predicted at "="
    for i in range(n):
        target_len = int(rng.integers(min(5, budget), budget + 1))
        expr = _expression(rng, m, target_len, brackets)
        value = _evaluate(expr, m)
        toks = [t if isinstance(t, int) else m + MOD_TOKENS[t] for t in expr] + [m + MOD_TOKENS["="]]
        inputs[i, seq_len - len(toks):] = toks
        targets[i, -1] = value
    return inputs, targets


def _expression(rng, m, max_len, brackets):
    """Random token list of at most ``max_len`` tokens (and at least one number)."""
    out: list = [int(rng.integers(m))]
    while True:
        if brackets and rng.random() < 0.3 and len(out) + 5 <= max_len:
            inner_len = int(rng.integers(3, max(4, (max_len - len(out) - 3) // 2 + 1)))
            inner = _expression(rng, m, inner_len, True)
            piece = [str(rng.choice(list("+-*")))] + ["("] + inner + [")"]
        else:
            piece = [str(rng.choice(list("+-*"))), int(rng.integers(m))]
        if len(out) + len(piece) > max_len:
            return out
        out += piece


def _evaluate(expr, m):
    """Value of a token list mod m (recursive descent: * before + and -)."""
    pos = 0

    def atom():
        nonlocal pos
        tok = expr[pos]
        pos += 1
        if tok == "(":
            v = sum_()
            pos += 1  # ")"
            return v
        return tok

    def prod():
        nonlocal pos
        v = atom()
        while pos < len(expr) and expr[pos] == "*":
            pos += 1
            v = v * atom() % m
        return v

    def sum_():
        nonlocal pos
        v = prod()
        while pos < len(expr) and expr[pos] in "+-":
            op = expr[pos]
            pos += 1
            w = prod()
            v = (v + w) % m if op == "+" else (v - w) % m
        return v

    return sum_()


# ----------------------------------------------------------------------------- retrieval
def passkey(n: int, seq_len: int = 512, digits: int = 5, seed: int = 0):
    """Passkey / S-NIAH-1-style retrieval: a haystack of filler tokens with a needle
    ``<key> d_1 .. d_digits`` at a random depth, then ``<query>`` and the digits (scored).
    Tokens: digits 0-9, ``<key> = 10``, ``<query> = 11``, filler tokens 12..15 (a repeating,
    predictable pattern with random phase, as in the passkey test). Vocabulary 16."""
    if seq_len < 2 * digits + 4:
        raise ValueError(f"seq_len must be >= 2 x digits + 4 = {2 * digits + 4}")
    rng = np.random.default_rng(seed)
    inputs = np.zeros((n, seq_len), dtype=np.int64)
    targets = np.full((n, seq_len), IGNORE, dtype=np.int64)
    hay = seq_len - digits - 1  # query block: <query> then digits (the last digit is not an input)
    for i in range(n):
        code = rng.integers(0, 10, digits)
        filler = 12 + (np.arange(hay) + rng.integers(4)) % 4
        at = int(rng.integers(0, hay - digits - 1 + 1))
        filler[at] = 10
        filler[at + 1:at + 1 + digits] = code
        seq = np.concatenate([filler, [11], code])
        inputs[i] = seq[:seq_len]
        targets[i, hay:hay + digits] = code  # predicted at <query> and the digits typed so far
    return inputs, targets


TASKS = {
    "mqar": mqar, "in_context_recall": in_context_recall, "fuzzy_in_context_recall": fuzzy_in_context_recall,
    "noisy_in_context_recall": noisy_in_context_recall, "selective_copying": selective_copying,
    "compression": compression, "memorization": memorization, "parity": parity,
    "modular_arithmetic": modular_arithmetic, "passkey": passkey,
}
