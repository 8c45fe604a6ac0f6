"""Synthetic task generators: exact semantics on small examples, determinism, split hygiene."""
import numpy as np
import pytest

from rankdecay.data.synthetic import (
    IGNORE, MOD_TOKENS, TASKS, _evaluate, compression, fuzzy_in_context_recall, in_context_recall, memorization,
    memorization_map, modular_arithmetic, mqar, noisy_in_context_recall, overlap, parity, passkey, selective_copying,
    split_seed, to_labels,
)

SMALL = {"mqar": dict(seq_len=64, num_kv_pairs=8, vocab_size=64)}


@pytest.mark.parametrize("name", sorted(TASKS))
def test_deterministic_per_seed_and_shapes(name):
    f = TASKS[name]
    a = f(6, seed=3, **SMALL.get(name, {}))
    b = f(6, seed=3, **SMALL.get(name, {}))
    c = f(6, seed=4, **SMALL.get(name, {}))
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not np.array_equal(a[0], c[0])
    x, y = a
    assert x.shape == y.shape and x.dtype == np.int64 and (x >= 0).all()
    assert ((y == IGNORE) | (y >= 0)).all() and (y != IGNORE).any()


def test_mqar_answer_is_the_value_paired_with_the_key():
    x, y = mqar(50, seq_len=128, num_kv_pairs=16, vocab_size=256, seed=0)
    for row, tgt in zip(x, y):
        pairs = dict(zip(row[0:32:2].tolist(), row[1:32:2].tolist()))
        assert len(pairs) == 16 and all(k < 128 <= v for k, v in pairs.items())  # distinct keys, split vocab
        q = np.flatnonzero(tgt != IGNORE)
        assert len(q) == 16 and (q >= 32).all() and (q % 2 == 0).all()
        assert sorted(row[q].tolist()) == sorted(pairs)       # every key queried once
        assert all(tgt[p] == pairs[row[p]] for p in q)        # the answer is its value
    # power-law placement: most queries soon after the context
    gaps = np.concatenate([(np.flatnonzero(t != IGNORE) - 32) // 2 for t in y])
    assert np.median(gaps) < 48 / 2


def test_mqar_filler_is_zero_unless_random_non_queries():
    x, y = mqar(20, seq_len=128, num_kv_pairs=16, vocab_size=256, seed=1)
    xr, yr = mqar(20, seq_len=128, num_kv_pairs=16, vocab_size=256, random_non_queries=True, seed=1)
    filler = np.ones_like(x, dtype=bool)
    filler[:, :32] = False
    filler &= y == IGNORE
    assert (x[filler] == 0).all() and (x[~filler] > 0).all()
    assert (xr[filler] > 0).all() and (xr[filler] != 0).mean() == 1 and len(np.unique(xr[filler])) > 100
    assert np.array_equal(x[~filler], xr[~filler]) and np.array_equal(y, yr)  # same pairs and queries


def test_in_context_recall_single_query_probes_a_key_seen_before():
    x, y = in_context_recall(200, seq_len=32, vocab_size=16, train=False, multi_query=False, seed=0)
    assert x.shape == (200, 32)
    for row, tgt in zip(x, y):
        assert row[-2] == 15 and (tgt[:-1] == IGNORE).all()  # <copy> k*, scored only at k*
        k_star, v_star = row[-1], tgt[-1]
        earlier = [(row[j], row[j + 1]) for j in range(0, len(row) - 3, 2)]
        assert (k_star, v_star) in earlier
        assert len({v for k, v in earlier if k == k_star}) == 1  # a key keeps its value
    xt, yt = in_context_recall(4, seq_len=32, train=True, seed=0)
    assert np.array_equal(yt[:, :-1], xt[:, 1:])  # MAD trains on every next token


def test_in_context_recall_multi_query_scores_every_repeated_key():
    x, y = in_context_recall(100, seq_len=32, vocab_size=16, train=False, seed=0)
    assert x.shape == (100, 31) and x.max() <= 15 and not (x == 15).all(1).any()
    for row, tgt in zip(x, y):
        full = np.append(row, tgt[-1])  # the sequence with its final value
        seen, want = {}, np.full(31, IGNORE)
        for j in range(0, 32, 2):
            k, v = full[j], full[j + 1]
            assert k < 8 <= v  # keys and values split the whole vocabulary
            if k in seen:
                assert seen[k] == v
                want[j] = v  # the value is predicted at its key
            seen[k] = v
        want[-1] = full[-1]  # the final probe, always a key seen before
        assert full[-2] in seen and np.array_equal(tgt, want)


def test_selective_copying_and_compression_and_memorization():
    x, y = selective_copying(20, seq_len=40, vocab_size=16, num_tokens_to_copy=6, seed=0)
    for row, tgt in zip(x, y):
        copy_at = int(np.flatnonzero(row == 15)[0])
        data = row[:copy_at][row[:copy_at] != 14]
        assert tgt[copy_at + 1:].tolist() == data.tolist() and (row[copy_at + 1:] == 14).all()
        assert (tgt[:copy_at + 1] == IGNORE).all()  # token j is predicted at the j-th blank after <copy>
    x, y = compression(5, seq_len=16, vocab_size=16, seed=0)
    assert (x[:, -1] == 15).all() and np.array_equal(x, y)
    kv = memorization_map(32)
    x, y = memorization(10, seq_len=16, vocab_size=32, seed=0)
    assert (x[:, 1::2] == 31).all() and all(y[i, j + 1] == kv[x[i, j]] for i in range(10) for j in range(0, 16, 2))
    x2, y2 = memorization(10, seq_len=16, vocab_size=32, seed=1)  # other sequences, same facts
    assert all(y2[i, j + 1] == kv[x2[i, j]] for i in range(10) for j in range(0, 16, 2))


def test_parity_labels_and_variable_lengths():
    x, y = parity(50, seq_len=20, seed=0)
    assert np.array_equal(y, np.cumsum(x, 1) % 2)
    assert parity(1, 4, seed=0)[1].tolist()[0] == [int(sum(parity(1, 4, seed=0)[0][0][:i + 1]) % 2)
                                                   for i in range(4)]
    x, y = parity(50, seq_len=20, min_len=5, seed=0)
    for row, tgt in zip(x, y):
        bits = row[row != 2]
        assert 5 <= len(bits) <= 20 and tgt[-len(bits):].tolist() == (np.cumsum(bits) % 2).tolist()
        assert (tgt[:20 - len(bits)] == IGNORE).all()
    x, y = parity(50, seq_len=20, min_len=12, score_from=10, seed=0)
    full = parity(50, seq_len=20, min_len=12, seed=0)[1]
    for row, tgt, ref in zip(x, y, full):
        n_bits = np.cumsum(row != 2)
        assert (tgt[n_bits <= 10] == IGNORE).all() and np.array_equal(tgt[n_bits > 10], ref[n_bits > 10])


def test_modular_arithmetic_values():
    assert _evaluate([3, "*", "(", 0, "+", 4, ")", "*", 2, "*", 3, "+", 2], 5) == 74 % 5
    assert _evaluate([4, "-", 2, "*", 3], 5) == (4 - 6) % 5
    inv = {v + 5: k for k, v in MOD_TOKENS.items()}
    for brackets in (False, True):
        x, y = modular_arithmetic(100, seq_len=24, modulus=5, brackets=brackets, seed=0)
        saw_bracket = False
        for row, tgt in zip(x, y):
            expr = [int(t) if t < 5 else inv[int(t)] for t in row if t != 11]
            assert expr[-1] == "=" and (tgt[:-1] == IGNORE).all()
            saw_bracket |= "(" in expr
            # evaluate independently with Python on the text
            text = "".join(str(t) for t in expr[:-1])
            assert eval(text) % 5 == tgt[-1]  # noqa: S307 - digits and + - * ( ) only
        assert saw_bracket == brackets


def test_passkey_answer_is_the_needle():
    x, y = passkey(30, seq_len=64, digits=5, seed=0)
    for row, tgt in zip(x, y):
        at = int(np.flatnonzero(row == 10)[0])
        q = int(np.flatnonzero(row == 11)[0])
        code = row[at + 1:at + 6]
        assert tgt[q:q + 5].tolist() == code.tolist() and (tgt != IGNORE).sum() == 5
    depths = [int(np.flatnonzero(r == 10)[0]) for r in passkey(200, seq_len=64, seed=1)[0]]
    assert min(depths) < 10 and max(depths) > 40  # needles at every depth


def test_train_and_test_sets_do_not_overlap():
    tr, te = split_seed(0, "train"), split_seed(0, "test")
    assert tr != te
    a, _ = mqar(2000, seq_len=64, num_kv_pairs=8, vocab_size=64, seed=tr)
    b, _ = mqar(500, seq_len=64, num_kv_pairs=8, vocab_size=64, seed=te)
    assert overlap(a, b) == 0
    a, _ = in_context_recall(2000, seq_len=64, seed=tr)
    b, _ = in_context_recall(500, seq_len=64, train=False, seed=te)
    assert overlap(a, b) == 0
    assert overlap(a, a[:10]) == 10  # the check itself works


def test_to_labels_aligns_targets_with_the_models_shift():
    targets = np.array([[5, IGNORE, 7]])
    assert to_labels(targets).tolist() == [[IGNORE, 5, IGNORE]]


def test_bad_parameters_are_refused():
    with pytest.raises(ValueError, match="seq_len"):
        mqar(1, seq_len=10, num_kv_pairs=8)
    with pytest.raises(ValueError, match="frac_noise"):
        in_context_recall(1, frac_noise=0.5, noise_vocab_size=0)
    with pytest.raises(ValueError, match="num_tokens_to_copy"):
        selective_copying(1, seq_len=10, num_tokens_to_copy=8)
