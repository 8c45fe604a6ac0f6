"""GraphDecoder: the step on static buffers (eager on the CPU, a CUDA graph on a GPU) decodes
exactly as transformers' generate with the dynamic cache."""
import itertools

import pytest
import torch

from rankdecay.models import GraphDecoder, RankDecayConfig, RankDecayForCausalLM

from ..conftest import NO_CPU_COMPILE, assert_matches, can_compile_on_cpu
from .common import random_ids, tiny_model

PAD = 258


def _left_padded(lengths, seed=10):
    L = max(lengths)
    ids = torch.full((len(lengths), L), PAD)
    mask = torch.zeros(len(lengths), L, dtype=torch.long)
    for i, n in enumerate(lengths):
        ids[i, L - n:] = random_ids(1, n, seed=seed + i)[0]
        mask[i, L - n:] = 1
    return ids, mask


def _hybrid():
    torch.manual_seed(0)
    config = RankDecayConfig.from_preset("tiny", layer_mixers=["gdn", "swa"], initializer_range=0.2)
    return RankDecayForCausalLM(config).eval()


@pytest.mark.parametrize("mixer", ["gdn", "hdla", "hh-gdn", "gla", "swa", "gdn+swa"])
@pytest.mark.parametrize("lengths", [(11, 4, 8), (45, 40)], ids=["short", "past-window"])
def test_greedy_equals_transformers_generate(mixer, lengths):
    """Left-padded batches; prompts shorter than the tiny SWA window (32) exercise its padded
    cache, longer ones the full window."""
    model = _hybrid() if mixer == "gdn+swa" else tiny_model(mixer)
    ids, mask = _left_padded(lengths)
    kw = dict(max_new_tokens=20, do_sample=False, pad_token_id=PAD, eos_token_id=[])
    with torch.no_grad():
        ref = model.generate(ids, attention_mask=mask, **kw)
    got = GraphDecoder(model, cuda_graph=False).generate(ids, attention_mask=mask, **kw)
    assert torch.equal(got, ref), mixer
    assert len(set(got[0, ids.shape[1]:].tolist())) > 1, "the test model should not emit a constant"


def test_step_logits_equal_a_full_forward_and_the_decoder_is_reused():
    """Two prompts of one batch size reuse the buffers; each step's logits are the full forward's."""
    model = tiny_model("hh-gdn")
    decoder = GraphDecoder(model, cuda_graph=False)
    for seed in (1, 2):
        ids = random_ids(2, 9 + seed, seed=seed)
        seq = decoder.generate(ids, max_new_tokens=12, eos_token_id=[])
        with torch.no_grad():
            full = model(seq, use_cache=False).logits[:, -1]
            decoder.prefill(seq[:, :-1])
            last = decoder.step(seq[:, -1])
        assert_matches(last, full, 1e-5, f"prompt {seed}")
        assert decoder._cache.get_seq_length() == seq.shape[1]


def test_eos_ends_rows_and_pads_them():
    model = tiny_model("gdn")
    ids = random_ids(3, 6)
    free = GraphDecoder(model, cuda_graph=False).generate(ids, max_new_tokens=15, eos_token_id=[])
    eos = int(free[0, 6 + 3])  # row 0 emits this token at its 4th step
    got = GraphDecoder(model, cuda_graph=False).generate(ids, max_new_tokens=15, eos_token_id=eos, pad_token_id=PAD)
    with torch.no_grad():
        ref = model.generate(ids, max_new_tokens=15, do_sample=False, eos_token_id=eos, pad_token_id=PAD)
    assert torch.equal(got, ref)
    assert (got[0, 6 + 4:] == PAD).all()


@pytest.mark.parametrize("mixer", ["gdn", "hdla", "hh-gdn", "swa", "gdn+swa"])
def test_a_list_of_prompts_decodes_as_the_left_padded_batch(mixer):
    """A list of prompts is prefilled packed (cu_seqlens: no padding, no mask) and decoded as a batch: each
    prompt's continuation is transformers' generate's on the left-padded batch (a one-token prompt and one past
    the SWA window among them), returned without the padding."""
    model = _hybrid() if mixer == "gdn+swa" else tiny_model(mixer)
    lengths = (11, 1, 45)
    ids, mask = _left_padded(lengths)
    kw = dict(max_new_tokens=20, eos_token_id=[])
    with torch.no_grad():
        ref = model.generate(ids, attention_mask=mask, do_sample=False, pad_token_id=PAD, **kw)
    L = ids.shape[1]
    prompts = [row[L - n:] for row, n in zip(ids, lengths)]
    got = GraphDecoder(model, cuda_graph=False).generate(prompts, **kw)
    assert [len(x) for x in got] == [n + 20 for n in lengths]
    for i, (x, n) in enumerate(zip(got, lengths)):
        assert torch.equal(x, ref[i, L - n:]), f"{mixer}: prompt {i}"


def test_a_list_of_prompts_ends_each_at_its_eos():
    """Rows of a list end at their EOS token, which they keep; nothing pads them (no pad_token_id needed)."""
    model = tiny_model("gdn")
    prompts = [random_ids(1, n, seed=n)[0] for n in (6, 3, 9)]
    decoder = GraphDecoder(model, cuda_graph=False)
    free = decoder.generate(prompts, max_new_tokens=15, eos_token_id=[])
    eos = int(free[1][3 + 4])  # prompt 1 emits it at its 5th step
    got = decoder.generate(prompts, max_new_tokens=15, eos_token_id=eos)
    for x, f, p in zip(got, free, prompts):
        new = f[len(p):]
        end = (new == eos).nonzero()
        want = f if not len(end) else f[:len(p) + int(end[0]) + 1]
        assert torch.equal(x, want)
    assert len(got[1]) <= 3 + 5 and int(got[1][-1]) == eos


def test_a_list_of_prompts_samples_seeded():
    """Sampling from a list of prompts: seeded, and top_k = 1 is the greedy list."""
    model = tiny_model("gdn")
    prompts = [random_ids(1, n, seed=n)[0] for n in (6, 2)]
    decoder = GraphDecoder(model, cuda_graph=False)
    kw = dict(max_new_tokens=12, eos_token_id=[], do_sample=True)
    a, b, c = (decoder.generate(prompts, top_k=0, generator=torch.Generator().manual_seed(s), **kw) for s in (4, 4, 5))
    greedy = decoder.generate(prompts, max_new_tokens=12, eos_token_id=[])
    top1 = decoder.generate(prompts, top_k=1, generator=torch.Generator().manual_seed(4), **kw)
    assert all(torch.equal(x, y) for x, y in zip(a, b)) and not all(torch.equal(x, y) for x, y in zip(a, c))
    assert all(torch.equal(x, y) for x, y in zip(top1, greedy))


def test_sampling_is_seeded_and_top_k_1_is_greedy():
    model = tiny_model("gdn")
    ids = random_ids(2, 7)
    decoder = GraphDecoder(model, cuda_graph=False)
    a = decoder.generate(ids, max_new_tokens=20, do_sample=True, top_k=0, eos_token_id=[],
                         generator=torch.Generator().manual_seed(4))
    b = decoder.generate(ids, max_new_tokens=20, do_sample=True, top_k=0, eos_token_id=[],
                         generator=torch.Generator().manual_seed(4))
    c = decoder.generate(ids, max_new_tokens=20, do_sample=True, top_k=0, eos_token_id=[],
                         generator=torch.Generator().manual_seed(5))
    greedy = decoder.generate(ids, max_new_tokens=20, eos_token_id=[])
    top1 = decoder.generate(ids, max_new_tokens=20, do_sample=True, top_k=1, eos_token_id=[],
                            generator=torch.Generator().manual_seed(4))
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert torch.equal(top1, greedy)


def test_bad_use_raises_clear_errors():
    model = tiny_model("gdn")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="cuda_graph=True needs the model on a CUDA device"):
            GraphDecoder(model, cuda_graph=True)
    decoder = GraphDecoder(model, cuda_graph=False)
    with pytest.raises(RuntimeError, match="call prefill"):
        decoder.step(torch.tensor([1]))
    with pytest.raises(ValueError, match="input_ids must have shape"):
        decoder.prefill(torch.tensor([1, 2]))
    decoder.prefill(random_ids(2, 5))
    with pytest.raises(ValueError, match=r"token must have shape \[B\] = \[2\]"):
        decoder.step(torch.tensor([1, 2, 3]))
    with pytest.raises(ValueError, match="max_new_tokens"):
        decoder.generate(random_ids(2, 5), max_new_tokens=-1)
    with pytest.raises(ValueError, match="compile must be True or False"):
        GraphDecoder(model, cuda_graph=False, compile="yes")
    prompts = [torch.tensor([1, 2]), torch.tensor([3])]
    with pytest.raises(ValueError, match="packed, not padded: give no attention_mask"):
        decoder.generate(prompts, torch.ones(2, 2))
    with pytest.raises(ValueError, match="1-D token tensors of at least one token each"):
        decoder.generate([torch.tensor([1, 2]), torch.tensor([], dtype=torch.long)])
    with pytest.raises(ValueError, match="a streamer takes one row"):
        decoder.generate(prompts, streamer=object())
    with pytest.raises(ValueError, match="every packed prompt needs at least one token"):
        decoder.prefill(torch.tensor([[1, 2, 3]]), cu_seqlens=torch.tensor([0, 3, 3]))
    with pytest.raises(ValueError, match=r"with cu_seqlens, sequences are packed along T and B must be 1, got B = 2"):
        decoder.prefill(random_ids(2, 3), cu_seqlens=torch.tensor([0, 3]))


@pytest.mark.parametrize("kernels", [False, True], ids=["pytorch", "swa-kernels"])
def test_max_length_sizes_the_rings_and_decodes_as_the_whole_window(monkeypatch, kernels):
    """``GraphDecoder(max_length=L)`` keeps sliding-window rings of min(window, L) slots: a hybrid (window 32)
    with L = 23 decodes the left-padded batch, and a list of prompts, token for token as with rings of the window
    (the rings wrap over their padding slots and fill to the last one); L past the window keeps the window. With
    ``kernels``, the SWA step's Triton kernels (on a GPU, or interpreted on the CPU), whose ring then is 23 slots."""
    from rankdecay.layers import attention

    device = "cpu"
    if kernels:
        if not attention._HAS_TRITON:
            pytest.skip("triton is not installed (pip install triton)")
        monkeypatch.setattr(attention, "_on_kernel_device", lambda t: True)
        device = "cuda" if torch.cuda.is_available() else "cpu"  # compiled kernels take no CPU tensor
    model = _hybrid().to(device)
    ids, mask = (t.to(device) for t in _left_padded((11, 4, 8)))
    kw = dict(max_new_tokens=12, eos_token_id=[])
    want = GraphDecoder(model, cuda_graph=False).generate(ids, mask, **kw)
    graphs = (False, True) if device == "cuda" else (False,)  # on a GPU, also the rings a CUDA graph replays
    for (max_length, slots), graph in itertools.product(((23, 23), (100, 32)), graphs):
        decoder = GraphDecoder(model, cuda_graph=graph, max_length=max_length)
        got = decoder.generate(ids, mask, **kw)
        assert decoder._buffers[1]["k"].shape[1] == slots
        assert torch.equal(got, want), (max_length, graph)
    prompts = [row[ids.shape[1] - n:] for row, n in zip(ids, (11, 4, 8))]
    got = GraphDecoder(model, cuda_graph=False, max_length=23).generate(prompts, **kw)
    for i, (x, n) in enumerate(zip(got, (11, 4, 8))):
        assert torch.equal(x, want[i, ids.shape[1] - n:]), f"prompt {i}"


def test_max_length_is_checked():
    """A bad max_length, a prompt that fills it, a generation that would pass it, a step past it: clear errors.
    Up to it, steps go on."""
    model = _hybrid()
    for bad in (1, 0, True, 2.5, "8"):
        with pytest.raises(ValueError, match="max_length must be an int >= 2"):
            GraphDecoder(model, cuda_graph=False, max_length=bad)
    decoder = GraphDecoder(model, cuda_graph=False, max_length=8)
    with pytest.raises(ValueError, match="a prompt of 8 tokens leaves no room for a new one under max_length = 8"):
        decoder.prefill(random_ids(2, 8))
    with pytest.raises(ValueError, match="a prompt of 6 tokens and max_new_tokens = 3 pass the decoder's max_length"):
        decoder.generate(random_ids(2, 6), max_new_tokens=3, eos_token_id=[])
    with pytest.raises(ValueError, match="a prompt of 7 tokens and max_new_tokens = 2"):
        decoder.generate([torch.tensor([1, 2]), random_ids(1, 7)[0]], max_new_tokens=2, eos_token_id=[])
    assert decoder.generate(random_ids(2, 6), max_new_tokens=2, eos_token_id=[]).shape == (2, 8)
    decoder.prefill(random_ids(2, 6))
    for token in (3, 4):
        assert torch.isfinite(decoder.step(torch.tensor([token, token]))).all()
    with pytest.raises(RuntimeError, match="max_length = 8 reached"):
        decoder.step(torch.tensor([5, 5]))
    decoder.prefill(random_ids(2, 7))  # a new prompt: room again
    decoder.step(torch.tensor([1, 1]))


def _every_kind():
    """A tiny fp32 model with a delta-rule layer, an HDLA layer, a Head-in-Head one and SWA."""
    torch.manual_seed(0)
    config = RankDecayConfig.from_preset("tiny", layer_mixers=["gdn", "hdla", "hh-gdn", "swa"], num_hidden_layers=4,
                                         hh_rank=2, initializer_range=0.2)
    return RankDecayForCausalLM(config).eval()


def _compiled_matches_uncompiled(model, ids, mask, cuda_graph: bool):
    kw = dict(max_new_tokens=16, eos_token_id=[])
    plain, compiled = (GraphDecoder(model, cuda_graph=cuda_graph, compile=c) for c in (False, True))
    ref, got = plain.generate(ids, mask, **kw), compiled.generate(ids, mask, **kw)
    assert torch.equal(got, ref)
    assert len(set(got[0, ids.shape[1]:].tolist())) > 1, "the test model should not emit a constant"
    with torch.no_grad():  # teacher-forced: the last step's logits after the whole continuation
        full_mask = torch.cat([mask, torch.ones_like(got[:, ids.shape[1]:-1])], 1)
        for decoder in (plain, compiled):
            decoder.prefill(got[:, :-1], full_mask)
        want = plain.step(got[:, -1]).clone()
        assert_matches(compiled.step(got[:, -1]), want, 1e-5, "compiled step")
    return compiled


@pytest.mark.slow
@pytest.mark.skipif(not can_compile_on_cpu(), reason=NO_CPU_COMPILE)
def test_compiled_step_decodes_as_the_uncompiled_one():
    """compile=True (torch.compile of the step, inductor's fused kernels): the same tokens and, up to the
    fused kernels' rounding, the same logits, for every kind of layer; then prompts of other lengths run the
    compiled step without compiling it again: once per batch size."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    model = _every_kind()
    ids, mask = _left_padded((12, 7, 9))
    torch._dynamo.reset()
    counters.clear()
    compiled = _compiled_matches_uncompiled(model, ids, mask, cuda_graph=False)
    compiled.generate(ids[:, 2:], mask[:, 2:], max_new_tokens=8, eos_token_id=[])
    for n in (70, 150):  # a decoder each: buffers of their own
        GraphDecoder(model, cuda_graph=False, compile=True).generate(random_ids(1, n, seed=n), max_new_tokens=3,
                                                                      eos_token_id=[])
    # once per batch size: not once per token (positions are in the cache's tensors, not the token count), nor per
    # prompt length (the buffers are contiguous, whatever strides the prompt's cache had)
    assert counters["stats"]["unique_graphs"] == 2


@pytest.mark.slow
@pytest.mark.skipif(not can_compile_on_cpu(), reason=NO_CPU_COMPILE)
@pytest.mark.parametrize("mixer", ["deltanet", "gdp", "kda", "gla", "simple_gla", "linear_attn", "hh-dn"])
def test_compiled_step_decodes_every_other_mixer(mixer):
    """compile=True for the mixers the test above leaves out (it has gdn, hdla, hh-gdn and swa): the uncompiled
    step's tokens, and its logits up to the fused kernels' rounding."""
    import torch._dynamo

    torch._dynamo.reset()
    ids, mask = _left_padded((9, 5))
    _compiled_matches_uncompiled(tiny_model(mixer), ids, mask, cuda_graph=False)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU (recorded in BENCHMARKS.md)")
@pytest.mark.parametrize("mixer", ["gdn", "hdla", "hh-gdn", "gdn+swa", "gdn-bf16-state"])
def test_cuda_graph_decodes_as_eager_steps(mixer):
    """On a GPU: the recorded graph gives the eager steps' tokens and logits (fp32 model; the
    fused decode kernel in both, updating the cache's state in place; a bf16 cache too)."""
    if mixer == "gdn+swa":
        model = _hybrid().cuda()
    else:
        bf16 = mixer.endswith("-bf16-state")
        model = tiny_model(mixer.removesuffix("-bf16-state"), **({"state_dtype": "bfloat16"} if bf16 else {})).cuda()
    ids, mask = _left_padded((40, 9, 25))
    ids, mask = ids.cuda(), mask.cuda()
    eager, graph = GraphDecoder(model, cuda_graph=False), GraphDecoder(model, cuda_graph=True)
    kw = dict(max_new_tokens=30, eos_token_id=[])
    ref, got = eager.generate(ids, mask, **kw), graph.generate(ids, mask, **kw)
    assert graph._graph is not None
    assert torch.equal(got, ref), mixer
    with torch.no_grad():
        for decoder in (eager, graph):
            decoder.prefill(got[:, :-1], torch.cat([mask, torch.ones_like(got[:, ids.shape[1]:-1])], 1))
        assert_matches(graph.step(got[:, -1]), eager.step(got[:, -1]).clone(), 1e-6, mixer)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU (recorded in BENCHMARKS.md)")
@pytest.mark.parametrize("mixer", ["gdn", "hdla", "gdn+swa"])
def test_cuda_graph_decodes_a_list_of_prompts_as_the_padded_batch(mixer):
    """On a GPU: a list of prompts, prefilled packed (the chunked kernels and the decode kernels with cu_seqlens),
    then the recorded graph's steps, gives each prompt the tokens of the left-padded batch's eager steps."""
    model = (_hybrid() if mixer == "gdn+swa" else tiny_model(mixer)).cuda()
    lengths = (40, 9, 25, 1)
    ids, mask = (t.cuda() for t in _left_padded(lengths))
    kw = dict(max_new_tokens=30, eos_token_id=[])
    ref = GraphDecoder(model, cuda_graph=False).generate(ids, mask, **kw)
    graph = GraphDecoder(model, cuda_graph=True)
    got = graph.generate([row[ids.shape[1] - n:] for row, n in zip(ids, lengths)], **kw)
    assert graph._graph is not None
    for i, (x, n) in enumerate(zip(got, lengths)):
        assert torch.equal(x, ref[i, ids.shape[1] - n:]), f"{mixer}: prompt {i}"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU (recorded in BENCHMARKS.md)")
def test_model_generate_with_graph_decoder_records_a_graph():
    """On a GPU ``model.generate(graph_decoder=True)`` replays a CUDA graph and gives transformers' tokens."""
    model = _hybrid().cuda()
    ids, mask = (t.cuda() for t in _left_padded((40, 9, 25)))
    with torch.no_grad():
        ref = model.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False, eos_token_id=[])
    got = model.generate(ids, attention_mask=mask, max_new_tokens=20, eos_token_id=[], graph_decoder=True)
    assert model.__dict__["_graph_decoder"]._graph is not None
    assert torch.equal(got, ref)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU (recorded in BENCHMARKS.md)")
def test_compiled_cuda_graph_decodes_as_the_plain_one():
    """On a GPU: the compiled step, with the fused decode kernels inside the compiled graph, recorded as a CUDA
    graph, gives the plain graph's tokens and logits (fp32 model)."""
    model = _every_kind().cuda()
    ids, mask = _left_padded((40, 9, 25))
    compiled = _compiled_matches_uncompiled(model, ids.cuda(), mask.cuda(), cuda_graph=True)
    assert compiled._graph is not None


def test_model_generate_with_graph_decoder_sizes_the_rings_to_the_generation():
    """``model.generate(graph_decoder=True)`` keeps a decoder whose sliding-window rings hold the generation rounded
    up to a power of two, 64 at least (a hybrid with a window of 256: a prompt of 11 and 5 new tokens, 64 slots; 11
    + 60, 128), makes a new one only where a call needs more (then the window's rings: 256 is the window), and
    gives transformers' tokens each time."""
    torch.manual_seed(0)
    config = RankDecayConfig.from_preset("tiny", layer_mixers=["gdn", "swa"], initializer_range=0.2, swa_window=256)
    model = RankDecayForCausalLM(config).eval()
    ids, mask = _left_padded((11, 4, 8))
    for new, max_length, same in ((5, 64, False), (3, 64, True), (60, 128, False), (130, None, False),
                                  (3, None, True)):
        before = model.__dict__.get("_graph_decoder")
        with torch.no_grad():
            ref = model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False, eos_token_id=[])
        got = model.generate(ids, attention_mask=mask, max_new_tokens=new, eos_token_id=[], graph_decoder=True)
        decoder = model.__dict__["_graph_decoder"]
        assert torch.equal(got, ref), new
        assert decoder.max_length == max_length and (decoder is before) == same, new
        assert decoder._buffers[1]["k"].shape[1] == (max_length or 256), new


def test_model_generate_compiled_keeps_the_windows_rings(monkeypatch):
    """Compiled, ``model.generate`` makes its decoder with rings of the window (no max_length): a new ring size would
    compile the step again. Full attention, which has no window, takes rings of the generation compiled too."""
    from rankdecay.models import generation

    made = []

    class Recorded(Exception):
        pass

    def record(model, compile=False, max_length=None, **kw):
        made.append((compile, max_length))
        raise Recorded

    monkeypatch.setattr(generation, "GraphDecoder", record)
    torch.manual_seed(0)
    config = RankDecayConfig.from_preset("tiny", layer_mixers=["gdn", "swa"], swa_window=256)
    model = RankDecayForCausalLM(config).eval()
    for compile in (True, False):
        with pytest.raises(Recorded):
            model.generate(random_ids(2, 11), max_new_tokens=5, compile=compile, graph_decoder=True)
    assert made == [(True, None), (False, 64)]
    with pytest.raises(Recorded):  # full attention has no window: rings of the generation, compiled too
        tiny_model("gdn+attn").generate(random_ids(2, 11), max_new_tokens=5, compile=True, graph_decoder=True)
    assert made[-1] == (True, 64)


@pytest.mark.parametrize("mixer", ["gdn", "hdla", "gdn+swa"])
def test_model_generate_with_graph_decoder(mixer):
    """``model.generate(graph_decoder=True)`` (Mamba's ``cg=True``) gives transformers' tokens, greedy, left-padded,
    with max_new_tokens or max_length, an EOS and the generation config's pad; it keeps one decoder on the model
    for later calls, leaves it out of copies, and refuses settings it cannot honour by name."""
    import copy

    model = _hybrid() if mixer == "gdn+swa" else tiny_model(mixer)
    ids, mask = _left_padded((11, 4, 8))
    for kw in (dict(max_new_tokens=12, eos_token_id=[]), dict(max_length=ids.shape[1] + 9, eos_token_id=[]),
               dict(max_new_tokens=12)):
        with torch.no_grad():
            ref = model.generate(ids, attention_mask=mask, do_sample=False, **kw)
        got = model.generate(ids, attention_mask=mask, do_sample=False, graph_decoder=True, **kw)
        assert torch.equal(got, ref), (mixer, kw)
    eos = int(ref[0, ids.shape[1] + 3])  # a token the first row emits: rows end at different steps
    with torch.no_grad():
        ref = model.generate(ids, attention_mask=mask, max_new_tokens=12, eos_token_id=eos)
    got = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, eos_token_id=eos, graph_decoder=True)
    assert torch.equal(got, ref) and (got == PAD).any()
    decoder = model.__dict__["_graph_decoder"]
    model.generate(ids, attention_mask=mask, max_new_tokens=2, graph_decoder=True)
    assert model.__dict__["_graph_decoder"] is decoder
    assert "_graph_decoder" not in copy.deepcopy(model).__dict__
    with pytest.raises(ValueError, match="cannot honour \\['num_beams'\\]"):
        model.generate(ids, attention_mask=mask, num_beams=2, graph_decoder=True)
    with pytest.raises(ValueError, match="does not take \\['streamer_like'\\]"):
        model.generate(ids, streamer_like=1, graph_decoder=True)
    with pytest.raises(ValueError, match="needs input_ids"):
        model.generate(graph_decoder=True, max_new_tokens=2)


class _Recorder:
    """A transformers streamer that keeps what it is given."""

    def __init__(self):
        self.puts, self.ends = [], 0

    def put(self, value):
        self.puts.append(value.clone())

    def end(self):
        self.ends += 1


def test_streamer_is_fed_as_transformers_feeds_it():
    """``GraphDecoder.generate(streamer=...)`` and ``model.generate(graph_decoder=True, streamer=...)`` feed a
    streamer as transformers' ``generate`` does: the prompt, then each new token [B] as it is chosen (the pad for
    rows that ended), then one ``end()``."""
    model = tiny_model()
    ids, mask = _left_padded((11, 4, 8))
    with torch.no_grad():
        free = model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, eos_token_id=[])
    eos = int(free[1, ids.shape[1] + 2])  # a token the second row emits: the rows end apart
    kw = dict(max_new_tokens=10, do_sample=False, eos_token_id=eos, pad_token_id=PAD)
    fed = {}
    for name in ("transformers", "decoder", "model"):
        rec = _Recorder()
        if name == "transformers":
            with torch.no_grad():
                out = model.generate(ids, attention_mask=mask, streamer=rec, **kw)
        elif name == "decoder":
            out = GraphDecoder(model, cuda_graph=False).generate(ids, mask, streamer=rec, **kw)
        else:
            out = model.generate(ids, attention_mask=mask, graph_decoder=True, streamer=rec, **kw)
        assert rec.ends == 1 and torch.equal(rec.puts[0], ids), name
        assert torch.equal(torch.cat([ids] + [p[:, None] for p in rec.puts[1:]], 1), out), name
        fed[name] = rec.puts
    assert (out == PAD).any(), "a row should have ended"
    for name in ("decoder", "model"):
        assert len(fed[name]) == len(fed["transformers"]), name
        assert all(torch.equal(a, b) for a, b in zip(fed[name], fed["transformers"])), name


def test_full_attention_decodes_in_rings_of_max_length():
    """A hybrid with full attention (no window; 4 query heads over 2 key/value heads, biases, q/k norms): a decoder
    without max_length is refused by name (its rings have no window to take their size from);
    ``model.generate(graph_decoder=True)`` sizes them to the generation (64, then 128) and gives transformers'
    tokens for a left-padded batch, as does a decoder of max_length 40 stepped to its last slot."""
    model = tiny_model("gdn+attn")
    with pytest.raises(ValueError, match="full attention layers .* give max_length"):
        GraphDecoder(model, cuda_graph=False)
    ids, mask = _left_padded((11, 4, 8))
    for new, slots in ((5, 64), (60, 128)):
        with torch.no_grad():
            ref = model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False, eos_token_id=[])
        got = model.generate(ids, attention_mask=mask, max_new_tokens=new, eos_token_id=[], graph_decoder=True)
        assert torch.equal(got, ref), new
        assert model.__dict__["_graph_decoder"]._buffers[1]["k"].shape[1] == slots
    decoder = GraphDecoder(model, cuda_graph=False, max_length=40)
    got = decoder.generate(ids, mask, max_new_tokens=40 - 11, eos_token_id=[])
    assert torch.equal(got, ref[:, :40]) and decoder._buffers[1]["k"].shape[1] == 40
