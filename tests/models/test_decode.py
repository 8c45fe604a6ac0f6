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


@pytest.mark.parametrize("mixer", MIXERS + ("hh-gdn-data", "attn"))
def test_full_equals_token_by_token_equals_pieces(mixer):
    """(``attn``: full attention, whose ring of keys doubles as the steps fill it: 16 -> 32 -> 64 -> 128.)"""
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


@pytest.mark.parametrize("mixer,overrides", [
    ("gdn", {}), ("deltanet", {"allow_neg_eigval": True}), ("gdn", {"allow_neg_eigval": False}), ("hh-gdn", {}),
    ("kda", {}), ("kda", {"gate_lower_bound": -5.0, "allow_neg_eigval": True}), ("hdla", {}),
    ("hdla", {"allow_neg_eigval": False, "gate_logit_normalizer": 1.0}), ("hh-gdn", {"hh_mask": "data"}),
    ("hh-dn", {"allow_neg_eigval": True}), ("gdp", {}), ("gdp", {"use_forget_gate": False}),
    ("gdn", {"num_v_heads": 4}), ("deltanet", {"num_v_heads": 6}),
])
def test_decode_kernel_steps_match_full(mixer, overrides, monkeypatch):
    """The GPU decode route, forced here (the kernel under the interpreter): GDN and DeltaNet take
    ops.gated_delta_rule_decode, KDA ops.kda_decode, HDLA ops.hdla_decode and Head-in-Head (a static mask or one
    per token, gated or not) ops.hh_delta_rule_decode, which form the L2 norms, the gates (and the mask) inside one
    kernel; Gated DeltaProduct (with its decay or without) ops.gated_delta_product_decode, its n_h sub-steps in the
    kernel too; grouped value heads (num_v_heads), each value head reading its key head in the kernel. Each matches
    the full forward."""
    import rankdecay.layers.mixers as mixers

    calls = []
    name = {"kda": "kda_decode", "hdla": "hdla_decode", "hh-gdn": "hh_delta_rule_decode",
            "hh-dn": "hh_delta_rule_decode", "gdp": "gated_delta_product_decode"}.get(mixer, "gated_delta_rule_decode")
    decode = getattr(mixers.ops, name)
    monkeypatch.setattr(mixers, "_recurrent_mode", lambda x: "fused_recurrent")
    monkeypatch.setattr(mixers.ops, name, lambda *a, **kw: calls.append(kw["mode"]) or decode(*a, **kw))
    device = "cuda" if torch.cuda.is_available() else "cpu"  # the kernel runs on a GPU, or interpreted on the CPU
    model = tiny_model(mixer, **overrides).to(device)
    ids = random_ids(2, 24).to(device)
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        split = _decode(model, ids, [12] + [1] * 12)
    assert_matches(split, full, 1e-5, f"{mixer} {overrides}")
    assert calls == ["fused_recurrent"] * 13 * model.config.num_hidden_layers


@pytest.mark.parametrize("state_dtype,tol", [("float32", 1e-5), ("float16", 1e-4)])
@pytest.mark.parametrize("mixer", ["gdn", "hdla", "hh-gdn", "gla", "kda", "gdp"])
def test_decode_kernel_updates_the_cache_in_place(mixer, state_dtype, tol, monkeypatch):
    """On the GPU's per-token route (the delta rule's decode kernel; GLA: the generic DPLR kernel) the kernel
    writes each layer's state back into the cache (one tensor for every step, so a CUDA graph copies
    nothing), in the cache's dtype, and the logits are the PyTorch route's with the same cache dtype.
    (fp16 rather than bf16 here: Triton's interpreter converts to bf16 by truncation; the GPU rounds.
    Both round the same fp32 steps, so they differ only where fp32's last bits flip a rounding.)"""
    import rankdecay.layers.mixers as mixers

    device = "cuda" if torch.cuda.is_available() else "cpu"  # the kernel runs on a GPU, or interpreted on the CPU
    model = tiny_model(mixer, state_dtype=state_dtype).to(device)
    ids = random_ids(2, 24).to(device)
    with torch.no_grad():
        ref = _decode(model, ids, [12] + [1] * 12)
        monkeypatch.setattr(mixers, "_recurrent_mode", lambda x: "fused_recurrent")
        cache = output_cache(model(ids[:, :12], use_cache=True))
        states = [layer["recurrent"] for layer in cache.layers]
        logits = [model(ids[:, t:t + 1], past_key_values=cache, use_cache=True).logits for t in range(12, 24)]
    assert all(layer["recurrent"] is s for layer, s in zip(cache.layers, states)), "a step replaced the state"
    assert all(s.dtype == getattr(torch, state_dtype) for s in states)
    assert_matches(torch.cat(logits, 1), ref[:, 12:], tol, f"{mixer}, {state_dtype}")


@pytest.mark.parametrize("state_dtype,tol", [("bfloat16", 2e-2), ("float16", 2e-3)])
def test_a_16_bit_state_cache_costs_its_precision(state_dtype, tol):
    """state_dtype halves the cache; the logits stay within the 16-bit state's precision of the fp32
    cache's (2^-8 for bf16, 2^-11 for fp16, a few roundings deep)."""
    ids = random_ids(2, 40)
    with torch.no_grad():
        ref = _decode(tiny_model("gdn"), ids, [20] + [1] * 20)
        model = tiny_model("gdn", state_dtype=state_dtype)
        got = _decode(model, ids, [20] + [1] * 20)
        half = _cache_bytes(output_cache(model(ids, use_cache=True)))
        full = _cache_bytes(output_cache(tiny_model("gdn")(ids, use_cache=True)))
    assert_matches(got, ref, tol, state_dtype)
    assert not torch.equal(got, ref)
    recurrent = 2 * 2 * 2 * 32 * 32  # layers x B x heads x K x V of the tiny model
    assert full - half == recurrent * 2, "the recurrent states should take 2 bytes an entry"


def test_state_dtype_is_checked():
    with pytest.raises(ValueError, match="state_dtype must be one of float32, bfloat16, float16"):
        tiny_model("gdn", state_dtype="float64")


@pytest.mark.parametrize("mixer", ["gdn", "swa", "attn"])
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


# Packed prompts: an empty one, a one-token one and one longer than the tiny SWA window (32); 81 tokens in all, so
# the prefill takes the chunked path (more than 64) and the packed continuation (2 tokens each) the recurrent one.
PACKED = (7, 1, 0, 70, 3)


def _packed_then_batched(model, seqs, lengths, steps=2):
    """Prompts packed into one row (cu_seqlens) fill a cache of one row per prompt; then 2 more tokens of each,
    packed again, continue every row; then ``steps`` one-token steps as a batch [N, 1]. Returns the logits of
    each part and the cache."""
    device = next(model.parameters()).device
    cu = torch.tensor([0, *lengths], device=device).cumsum(0)
    prompt = torch.cat([s[:, :n] for s, n in zip(seqs, lengths)], 1)
    out = model(prompt, cu_seqlens=cu, use_cache=True)
    more = torch.cat([s[:, n:n + 2] for s, n in zip(seqs, lengths)], 1)
    cu_more = torch.arange(0, 2 * len(lengths) + 1, 2, device=device)
    cont = model(more, cu_seqlens=cu_more, past_key_values=output_cache(out), use_cache=True)
    cache, batched = output_cache(cont), []
    for j in range(steps):
        token = torch.cat([s[:, n + 2 + j:n + 3 + j] for s, n in zip(seqs, lengths)])
        batched.append(model(token, past_key_values=cache, use_cache=True).logits[:, 0])
    return out.logits[0], cu, cont.logits[0], cu_more, torch.stack(batched, 1), cache


def _check_each_alone(model, seqs, lengths, parts, what, tol=1e-5):
    prefill, cu, cont, cu_more, batched, cache = parts
    for i, (s, n) in enumerate(zip(seqs, lengths)):
        ref = model(s, use_cache=False).logits[0]
        assert_matches(prefill[cu[i]:cu[i + 1]], ref[:n], tol, f"{what}: prompt {i}'s prefill")
        assert_matches(cont[cu_more[i]:cu_more[i + 1]], ref[n:n + 2], tol, f"{what}: prompt {i}'s packed continuation")
        assert_matches(batched[i], ref[n + 2:], tol, f"{what}: prompt {i}'s steps")


@pytest.mark.parametrize("mixer", MIXERS + ("gdn+swa", "gdn+attn"))
def test_packed_prompts_fill_one_cache_row_each(mixer):
    """Packed prefill for serving: N prompts of any lengths in one row (cu_seqlens), no padding, fill a cache of N
    rows (the short convolutions' states [N, D, 3], each from its own prompt's last inputs; the recurrent states
    [N, H, K, V]; SWA's last window - 1 keys of each prompt); packed tokens continue each row; one-token steps then
    decode the N rows as a batch. Every logit is that sequence's alone."""
    model = (tiny_model("gdn", layer_mixers=["gdn", "swa"]) if mixer == "gdn+swa" else tiny_model(mixer))
    if mixer == "gdn+attn":  # (full attention: each row keeps as many keys as the longest prompt, 70 + 2)
        assert output_cache(model(random_ids(1, 72), cu_seqlens=torch.tensor([0, 70, 72]), use_cache=True)).layers[
            1]["k"].shape[:3] == (2, 70, 2)
    seqs = [random_ids(1, n + 4, seed=i) for i, n in enumerate(PACKED)]
    with torch.no_grad():
        parts = _packed_then_batched(model, seqs, PACKED)
        _check_each_alone(model, seqs, PACKED, parts, mixer)
    cache = parts[-1]
    assert cache.get_seq_length() == max(PACKED) + 4, "as a left-padded batch of the prompts counts"
    for layer in cache.layers:
        for tensor in ([layer["k"], layer["v"], layer["count"]] if "k" in layer
                       else [t for t in layer["conv"] if t is not None] + [layer["recurrent"]]):
            assert tensor.shape[0] == len(PACKED), "one cache row per prompt"


def test_packed_tokens_need_one_cache_row_per_sequence():
    """Packed tokens continue a cache row each: a cache of another number of rows is refused by name."""
    for mixer in ("gdn", "swa"):
        model = tiny_model(mixer)
        with torch.no_grad():
            cache = output_cache(model(random_ids(2, 5), use_cache=True))
            with pytest.raises(ValueError, match="the cache has 2 rows but cu_seqlens packs N = 3 sequences"):
                model(random_ids(1, 6), cu_seqlens=torch.tensor([0, 2, 4, 6]), past_key_values=cache, use_cache=True)


@pytest.mark.parametrize("mixer", ["gdn", "kda", "hdla", "hh-gdn", "gdp", "gla"])
def test_packed_continuation_takes_the_decode_kernels(mixer, monkeypatch):
    """The GPU decode route, forced here (the kernels under the interpreter): a packed continuation of a cache of N
    rows runs each mechanism's decode kernel (GLA: the generic DPLR one) with cu_seqlens, each sequence from its own
    row of the cache and written back into it in place; the logits are each sequence's alone."""
    import rankdecay.layers.mixers as mixers

    calls = []
    op = getattr(mixers.ops, "gla" if mixer == "gla" else {
        "kda": "kda_decode", "hdla": "hdla_decode", "hh-gdn": "hh_delta_rule_decode",
        "gdp": "gated_delta_product_decode"}.get(mixer, "gated_delta_rule_decode"))
    monkeypatch.setattr(mixers, "_recurrent_mode", lambda x: "fused_recurrent")
    monkeypatch.setattr(mixers.ops, op.__name__, lambda *a, **kw: calls.append(
        (kw["mode"], kw["cu_seqlens"] is not None, kw["inplace_final_state"])) or op(*a, **kw))
    device = "cuda" if torch.cuda.is_available() else "cpu"  # the kernel runs on a GPU, or interpreted on the CPU
    model = tiny_model(mixer).to(device)
    lengths = (5, 1, 9)
    seqs = [random_ids(1, n + 3, seed=i).to(device) for i, n in enumerate(lengths)]
    with torch.no_grad():
        parts = _packed_then_batched(model, seqs, lengths, steps=1)
        layers = model.config.num_hidden_layers
        # the prefill (15 tokens, no cache yet), the packed continuation (in place), the batched step (in place)
        assert calls == [("fused_recurrent", True, False)] * layers + [("fused_recurrent", True, True)] * layers + [
            ("fused_recurrent", False, True)] * layers, calls
        _check_each_alone(model, seqs, lengths, parts, mixer)


@pytest.mark.parametrize("mixer", ["swa", "gdn", "attn"])
def test_packed_tokens_continue_a_cache_after_steps(mixer):
    """Packed tokens after one-token steps: SWA's cache is then a ring of window slots (rolled back into time
    order), the convolutions' states were shifted by the steps; each sequence continues as alone."""
    model = tiny_model(mixer)
    lengths = (40, 3, 9)
    seqs = [random_ids(1, n + 5, seed=i) for i, n in enumerate(lengths)]
    with torch.no_grad():
        cu = torch.tensor([0, *lengths]).cumsum(0)
        cache = output_cache(model(torch.cat([s[:, :n] for s, n in zip(seqs, lengths)], 1), cu_seqlens=cu,
                                   use_cache=True))
        for j in range(2):
            token = torch.cat([s[:, n + j:n + j + 1] for s, n in zip(seqs, lengths)])
            cache = output_cache(model(token, past_key_values=cache, use_cache=True))
        more = torch.cat([s[:, n + 2:n + 5] for s, n in zip(seqs, lengths)], 1)
        got = model(more, cu_seqlens=torch.tensor([0, 3, 6, 9]), past_key_values=cache, use_cache=True).logits[0]
        for i, (s, n) in enumerate(zip(seqs, lengths)):
            assert_matches(got[3 * i:3 * i + 3], model(s, use_cache=False).logits[0, n + 2:], 1e-5, f"{mixer} {i}")
