"""Incremental decoding: one full forward == token by token == in pieces, for every mixer."""
import pytest
import torch

from rankdecay.layers import Cache
from rankdecay.models import MIXERS, output_cache

from ..conftest import assert_matches
from .common import random_ids, tiny_model

# T exceeds the tiny window (32) so SWA's bounded cache is exercised, is not a multiple of
# the chunk size (16), and one piece (70 > 64 tokens) takes the chunked path with an
# initial state while the others take the recurrent one.
T = 83
PIECES = (5, 1, 70, 7)


def _decode(model, ids, pieces):
    cache, logits, start = None, [], 0
    for n in pieces:
        out = model(ids[:, start:start + n], past_key_values=cache, use_cache=True)
        cache, start = output_cache(out), start + n
        logits.append(out.logits)
    assert isinstance(cache, Cache) and cache.get_seq_length() == ids.shape[1]
    return torch.cat(logits, 1)


@pytest.mark.parametrize("mixer", MIXERS + ("hh-gdn-data",))
def test_full_equals_token_by_token_equals_pieces(mixer):
    extra = {"hh_mask": "data"} if mixer == "hh-gdn-data" else {}
    model = tiny_model(mixer.removesuffix("-data"), **extra)
    ids = random_ids(2, T)
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        steps = _decode(model, ids, [1] * T)
        pieces = _decode(model, ids, PIECES)
    assert_matches(steps, full, 1e-5, f"{mixer}: token by token")
    assert_matches(pieces, full, 1e-5, f"{mixer}: pieces {PIECES}")


@pytest.mark.parametrize("mixer", ["gdn", "hdla", "hh-gdn", "gla", "swa"])
def test_prefill_then_decode_matches_full(mixer):
    """A long prompt in one chunked call, then single tokens, as generation does."""
    model = tiny_model(mixer)
    ids = random_ids(1, 100)
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        split = _decode(model, ids, [90] + [1] * 10)
    assert_matches(split, full, 1e-5, mixer)


@pytest.mark.parametrize("mixer,overrides", [("gdn", {}), ("deltanet", {"allow_neg_eigval": True}),
                                              ("gdn", {"allow_neg_eigval": False}), ("hh-gdn", {})])
def test_decode_kernel_steps_match_full(mixer, overrides, monkeypatch):
    """The GPU decode route, forced here (the kernel under the interpreter): GDN and DeltaNet take
    ops.gated_delta_rule_decode, which forms the L2 norms and the gates inside one kernel, and
    match the full forward; Head-in-Head, whose decay is not the delta rule's, keeps its own route."""
    import rankdecay.layers.mixers as mixers

    calls = []
    decode = mixers.ops.gated_delta_rule_decode
    monkeypatch.setattr(mixers, "_recurrent_mode", lambda x: "fused_recurrent")
    monkeypatch.setattr(mixers.ops, "gated_delta_rule_decode",
                        lambda *a, **kw: calls.append(kw["mode"]) or decode(*a, **kw))
    device = "cuda" if torch.cuda.is_available() else "cpu"  # the kernel runs on a GPU, or interpreted on the CPU
    model = tiny_model(mixer, **overrides).to(device)
    ids = random_ids(2, 24).to(device)
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        split = _decode(model, ids, [12] + [1] * 12)
    assert_matches(split, full, 1e-5, f"{mixer} {overrides}")
    expected = 0 if mixer.startswith("hh-") else 13 * model.config.num_hidden_layers
    assert calls == ["fused_recurrent"] * expected


@pytest.mark.parametrize("mixer", ["gdn", "swa"])
def test_cache_reorder_selects_rows(mixer):
    """Beam search's reorder, after a prompt and after decode steps (SWA's ring)."""
    model = tiny_model(mixer)
    ids = random_ids(3, 40)
    with torch.no_grad():
        cache = output_cache(model(ids[:, :30], use_cache=True))
        for t in range(30, 40):
            cache = output_cache(model(ids[:, t:t + 1], past_key_values=cache, use_cache=True))
        cache.reorder_cache(torch.tensor([2, 0]))
        nxt = random_ids(2, 1, seed=5)
        got = model(nxt, past_key_values=cache, use_cache=True).logits
        ref = model(torch.cat([ids[[2, 0]], nxt], 1), use_cache=False).logits[:, -1:]
    assert_matches(got, ref, 1e-5)


def _cache_bytes(cache) -> int:
    def size(x):
        if isinstance(x, torch.Tensor):
            return x.numel() * x.element_size()
        if isinstance(x, (tuple, list)):
            return sum(size(t) for t in x)
        if isinstance(x, dict):
            return sum(size(t) for t in x.values())
        return 0

    return sum(size(layer) for layer in cache.layers)


@pytest.mark.parametrize("mixer", MIXERS)
def test_cache_size_does_not_grow_with_the_context(mixer):
    """What makes decode cost per token independent of the context length."""
    model = tiny_model(mixer)
    with torch.no_grad():
        sizes = [_cache_bytes(output_cache(model(random_ids(1, n), use_cache=True))) for n in (40, 300)]
    assert sizes[0] == sizes[1] > 0
