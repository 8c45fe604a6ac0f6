"""cu_seqlens: packed variable-length sequences equal a loop over the single sequences."""
import pytest
import torch
import torch.nn.functional as F

from rankdecay import ops
from rankdecay.ops import dplr, gated_delta_product, hdla

from ..conftest import assert_matches

f64 = torch.float64


@pytest.mark.parametrize("mode", ["naive", "chunk", "chunk-compiling"])
@pytest.mark.parametrize("gate", ["scalar", "channel"])
def test_varlen_equals_loop_over_sequences(mode, gate, monkeypatch):
    """Packed sequences against a loop over them, outputs, final states and every gradient; "chunk-compiling": as
    the chunked path runs under ``torch.compile``, the lengths never on the host (the row as long as any packing of
    these T tokens in 5 sequences needs, ``_inputs.aligned_row``, the last sequence extended over its zero tokens)."""
    if mode == "chunk-compiling":
        import rankdecay.ops._inputs as inputs

        monkeypatch.setattr(inputs, "_compiling", lambda: True)
        mode = "chunk"
    lengths = [5, 70, 1, 0, 33]  # a zero-length sequence passes its initial state through
    T, H, K, V, Rab = sum(lengths), 2, 8, 6, 2
    cu = torch.tensor([0] + lengths).cumsum(0)
    x = dict(
        q=torch.randn(1, T, H, K, dtype=f64),
        k=F.normalize(torch.randn(1, T, H, K, dtype=f64), dim=-1),
        v=torch.randn(1, T, H, V, dtype=f64),
        a=0.3 * F.normalize(torch.randn(1, T, H, Rab, K, dtype=f64), dim=-1),
        b=F.normalize(torch.randn(1, T, H, Rab, K, dtype=f64), dim=-1),
        g=-F.softplus(torch.randn(1, T, H, *((K,) if gate == "channel" else ()), dtype=f64)),
    )
    h0 = torch.randn(len(lengths), H, K, V, dtype=f64)
    leaves = [t.requires_grad_() for t in (*x.values(), h0)]

    o, s = dplr(**x, initial_state=h0, output_final_state=True, cu_seqlens=cu, mode=mode, chunk_size=16)
    pieces, states = [], []
    for n, (start, end) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        part = {name: t[:, start:end] for name, t in x.items()}
        o_n, s_n = dplr(**part, initial_state=h0[n:n + 1], output_final_state=True, mode="naive")
        pieces.append(o_n)
        states.append(s_n)
    o_ref, s_ref = torch.cat(pieces, 1), torch.cat(states, 0)
    assert_matches(o, o_ref, 1e-10, "output")
    assert_matches(s, s_ref, 1e-10, "final states")
    torch.testing.assert_close(s[3], h0[3].detach(), rtol=0, atol=0)

    gen = torch.Generator().manual_seed(2)
    do, ds = torch.randn(o.shape, generator=gen, dtype=f64), torch.randn(s.shape, generator=gen, dtype=f64)
    grads = torch.autograd.grad((o * do).sum() + (s * ds).sum(), leaves)
    grads_ref = torch.autograd.grad((o_ref * do).sum() + (s_ref * ds).sum(), leaves)
    for g1, g2 in zip(grads, grads_ref):
        assert_matches(g1, g2, 1e-10, "gradient")


def test_chunk_path_walks_sequences_along_one_row(monkeypatch):
    """The PyTorch chunked path takes cu_seqlens along one row, each sequence from one of its chunks (not padded to
    the longest): its rows hold sum(ceil(length / C)) chunks, and its one state walk restarts from each sequence's
    own initial state at the sequence's first chunk, found on the device from the offsets (the result is checked
    against a loop over the sequences in the test above)."""
    import sys

    dplr_module = sys.modules["rankdecay.ops.dplr"]  # (the package's name dplr is the function)

    seen = []

    def spy(q, *args, **kwargs):
        seen.append((tuple(q.shape), kwargs["offsets"].tolist()))
        return core(q, *args, **kwargs)

    core = dplr_module.chunk_dplr_core
    monkeypatch.setattr(dplr_module, "chunk_dplr_core", spy)
    lengths, H, K, V = [5, 70, 0, 33, 16], 2, 8, 6
    T = sum(lengths)
    q, k = torch.randn(1, T, H, K, dtype=f64), F.normalize(torch.randn(1, T, H, K, dtype=f64), dim=-1)
    v, g = torch.randn(1, T, H, V, dtype=f64), -torch.rand(1, T, H, dtype=f64)
    cu = torch.tensor([0] + lengths).cumsum(0)
    o, s = dplr(q, k, v, None, None, g, output_final_state=True, cu_seqlens=cu, mode="chunk", chunk_size=16)
    assert seen == [((1, 16 * (1 + 5 + 0 + 3 + 1), H, K), [0, 16, 96, 96, 144, 160])]
    assert o.shape == (1, T, H, V) and s.shape == (len(lengths), H, K, V)
    o_ref, s_ref = dplr(q, k, v, None, None, g, output_final_state=True, cu_seqlens=cu, mode="naive")
    assert_matches(o, o_ref, 1e-10, "output")
    assert_matches(s, s_ref, 1e-10, "final states")
    with pytest.raises(ValueError, match="offsets: the sequences lie along one row of whole chunks"):
        core(q, k, v, None, None, g, 1.0, None, f64, 16, offsets=torch.tensor([0, 48]))


def test_chunk_path_cu_seqlens_under_torch_compile_fullgraph():
    """The PyTorch chunked path with cu_seqlens through ``torch.compile(fullgraph=True)``: no graph break (the state
    walk finds each sequence's first chunk on the device, ``chunk._state_passing``; until session 75 it split the row
    by lengths read on the host), and a new packing of as many sequences compiles nothing again; the loss and every
    gradient as eagerly. Dynamo alone (``aot_eager``): no C++ compiler."""
    def loss(q, k, v, g, beta, h0, cu):
        o, s = ops.gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu,
                                    chunk_size=16, mode="chunk")
        return (o * o).sum() + s.sin().sum()

    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")
    T, H, K = 124, 2, 8
    torch._dynamo.reset()
    try:
        for i, lengths in enumerate([[5, 70, 0, 33, 16], [30, 30, 40, 10, 14], [0, 0, 100, 24, 0]]):
            cu = torch.tensor([0] + lengths).cumsum(0)
            gen = torch.Generator().manual_seed(i)
            x = [torch.randn(1, T, H, K, generator=gen, dtype=f64),
                 F.normalize(torch.randn(1, T, H, K, generator=gen, dtype=f64), dim=-1),
                 torch.randn(1, T, H, K, generator=gen, dtype=f64), -5 * torch.rand(1, T, H, generator=gen, dtype=f64),
                 2 * torch.rand(1, T, H, generator=gen, dtype=f64), torch.randn(5, H, K, K, generator=gen, dtype=f64)]
            results = []
            for fn in (compiled, loss):
                leaves = [t.clone().requires_grad_() for t in x]
                with torch._dynamo.config.patch(error_on_recompile=i > 0):
                    value = fn(*leaves, cu)
                value.backward()
                results.append([value.detach()] + [t.grad for t in leaves])
            for name, got, want in zip(["loss", "dq", "dk", "dv", "dg", "dbeta", "dh0"], *results, strict=True):
                assert_matches(got, want, 1e-10, f"packing {i}: {name}")
    finally:
        torch._dynamo.reset()


def test_varlen_mechanisms_with_rank_writes():
    """Gated DeltaProduct (rank-2 writes, k has T * n_h rows) and HDLA with cu_seqlens."""
    lengths, H, K, V, nh = [9, 30, 4], 2, 8, 8, 2
    T = sum(lengths)
    cu = torch.tensor([0] + lengths).cumsum(0)
    q = torch.randn(1, T, H, K, dtype=f64)
    k = F.normalize(torch.randn(1, T * nh, H, K, dtype=f64), dim=-1)
    v = torch.randn(1, T * nh, H, V, dtype=f64)
    beta = 2 * torch.rand(1, T * nh, H, dtype=f64)
    g = -torch.rand(1, T, H, dtype=f64)
    o, s = gated_delta_product(q, k, v, g, beta, nh, output_final_state=True, cu_seqlens=cu)
    gk = -torch.rand(1, T, H, K, dtype=f64)
    o2, s2 = hdla(q, k[:, ::nh], v[:, ::nh], gk, beta[:, ::nh], output_final_state=True, cu_seqlens=cu)
    for n, (start, end) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        o_n, s_n = gated_delta_product(q[:, start:end], k[:, start * nh:end * nh], v[:, start * nh:end * nh],
                                       g[:, start:end], beta[:, start * nh:end * nh], nh, output_final_state=True)
        assert_matches(o[:, start:end], o_n, 1e-10, f"sequence {n} output")
        assert_matches(s[n:n + 1], s_n, 1e-10, f"sequence {n} state")
        o_n, s_n = hdla(q[:, start:end], k[:, start * nh:end * nh:nh], v[:, start * nh:end * nh:nh], gk[:, start:end],
                        beta[:, start * nh:end * nh:nh], output_final_state=True)
        assert_matches(o2[:, start:end], o_n, 1e-10, f"hdla sequence {n} output")
        assert_matches(s2[n:n + 1], s_n, 1e-10, f"hdla sequence {n} state")


@pytest.mark.parametrize("host", [True, False], ids=["lengths-on-host", "compiling"])
def test_varlen_aligned_layout(host):
    """The fused kernels' layout of cu_seqlens (``_inputs.varlen_aligned``): each sequence from a multiple of 64
    tokens along one row, zeros between, in order; unpacking gives the tokens back, and the gradient of each
    direction is the other. With the lengths on the host the row ends where the last sequence's rounding does; while
    compiling it is as long as any 5 sequences of these 264 tokens may need (``aligned_row``: 640), the last
    sequence extended to its end (every chunk is then walked: no chunk's entering state is left unwritten)."""
    from rankdecay.ops._inputs import aligned_row, aligned_starts, pack_varlen, unpack_varlen, varlen_aligned

    lengths = [70, 0, 5, 125, 64]
    T, cu = sum(lengths), torch.tensor([0] + lengths).cumsum(0)
    row = aligned_starts(lengths, 64)[-1] if host else aligned_row(T, len(lengths), 64)
    packing = varlen_aligned(cu, T, 64, row, "cpu")
    offsets = packing.offsets
    assert offsets.dtype == torch.int32 and offsets.tolist() == [0, 128, 128, 192, 320, 384 if host else 640]
    x = torch.arange(1.0, T + 1, dtype=f64)[None, :, None].repeat(1, 1, 3).requires_grad_()
    packed = pack_varlen(x, packing)
    assert packed.shape == (1, row, 3)
    starts = cu.tolist()
    for n, length in enumerate(lengths):
        piece = packed[0, offsets[n]:offsets[n + 1]]
        assert torch.equal(piece[:length], x[0, starts[n]:starts[n] + length]), n
        assert not piece[length:].any(), n
    assert torch.equal(unpack_varlen(packed, packing), x)
    torch.autograd.gradcheck(lambda t: pack_varlen(t, packing), (x,))
    torch.autograd.gradcheck(lambda t: unpack_varlen(t, packing), (packed.detach().requires_grad_(),))
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):  # the bound holds for any lengths
        lengths = torch.randint(0, 300, (int(torch.randint(1, 20, (1,), generator=gen)),), generator=gen).tolist()
        assert aligned_starts(lengths, 64)[-1] <= aligned_row(sum(lengths), len(lengths), 64), lengths


def test_varlen_benchmark_boundaries():
    """``benchmarks/varlen_speed.py``'s batch: windows cut at every window and at documents' ends."""
    from benchmarks.varlen_speed import boundaries

    cu = boundaries(4, 256, 50, seed=0)
    assert cu[0] == 0 and cu[-1] == 1024 and all(w in cu for w in range(0, 1024, 256))
    assert all(a < b for a, b in zip(cu[:-1], cu[1:])) and len(cu) > 10


def test_a_models_layers_read_cu_seqlens_on_the_host_once(monkeypatch):
    """Reading cu_seqlens on the host waits for the GPU; every layer of a model passes the same tensor, so a forward
    reads it once (``_inputs.host_lengths`` remembers the last one), and again once it is written in place. An
    inference tensor, which keeps no version counter, is read each time. (On the CPU, where a read costs no wait,
    nothing is remembered: the test makes the CPU count as a device that waits.)"""
    from rankdecay.models import RankDecayConfig, RankDecayForCausalLM
    from rankdecay.ops import _inputs

    monkeypatch.setattr(_inputs, "_read_waits", lambda t: True)
    reads = []
    tolist = torch.Tensor.tolist
    cu = torch.tensor([0, 5, 6, 20])
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: reads.append(self is cu) or tolist(self))
    torch.manual_seed(0)
    model = RankDecayForCausalLM(RankDecayConfig.from_preset("tiny", mixer="gdn", num_hidden_layers=3)).eval()
    ids = torch.randint(0, 256, (1, 20))
    with torch.no_grad():
        first = model(ids, cu_seqlens=cu, use_cache=False).logits
        assert reads.count(True) == 1, reads
        model(ids, cu_seqlens=cu, use_cache=False)
        assert reads.count(True) == 1, "the same tensor, unchanged: not read again"
        cu[1] = 4
        moved = model(ids, cu_seqlens=cu, use_cache=False).logits
        assert reads.count(True) == 2, "written in place: read again"
        assert not torch.allclose(first, moved)
    with torch.inference_mode():
        cu = torch.tensor([0, 5, 6, 20])
        model(ids, cu_seqlens=cu, use_cache=False)
    assert reads.count(True) == 2 + 3, "an inference tensor: read by each of the 3 layers"


def test_cu_seqlens_on_the_cpu_is_read_every_time():
    """A write through a NumPy view leaves a tensor's version counter as it was: on the CPU, where reading costs no
    wait, cu_seqlens is read each call, so such a write is seen."""
    from rankdecay.ops import _inputs

    cu = torch.tensor([0, 5, 6, 20])
    assert _inputs.host_lengths(cu, 20) == [5, 1, 14]
    cu.numpy()[1] = 4
    assert _inputs.host_lengths(cu, 20) == [4, 2, 14]
