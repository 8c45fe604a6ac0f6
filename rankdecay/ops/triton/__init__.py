"""Triton kernels of the engine (GPU; on the CPU only under ``TRITON_INTERPRET=1``).

- ``fused_recurrent_dplr``: the per-token recurrence in one kernel (decoding; no autograd);
  ``fused_recurrent_gated_delta_rule``: the same for (Gated) DeltaNet without building
  the DPLR factors, the decode fast path.
- ``chunk_dplr_fwd``: the whole chunked forward fused (intra-chunk products, the UT
  transform, state passing, outputs) in three kernels; used without autograd.
- ``chunk_dplr``: the same forward with autograd: it keeps its per-chunk tensors and the
  backward is written out (``chunk_bwd``: the state kernel in reverse and two per-chunk kernels).
- ``chunk_gated_delta_rule``: (Gated) DeltaNet on those kernels as one autograd node, β e^g formed
  inside and the gradients of g and β formed in the backward's gate kernel (``ops.gated_delta_rule``
  takes it for unpacked sequences); ``chunk_hdla``: HDLA the same way, a and b built inside and its
  products taken as six of token rows (``channel.hdla_products``).
- ``chunk_state_passing``: the sequential part of the chunked algorithm — the state
  carried from chunk to chunk, with the pseudo-values U of each chunk — forward and
  backward, as a ``torch.autograd.Function``. The parallel parts (decayed products,
  the UT transform, outputs, and the gradients that follow from the per-chunk states)
  are batched PyTorch around it (``rankdecay.ops.chunk``).
- ``gemv.gemv``: one row times a matrix, for a B = 1 decode step's projections (``rankdecay.layers.packing``
  routes them to it on a GPU); traced into a compiled graph as the decode kernels are.
- ``conv.short_conv_step``: a decode step of a mixer's three short convolutions in one launch, their states
  shifted in place (``rankdecay.layers.modules.conv_step`` routes a GPU decode step to it); traced likewise.
- ``cross_entropy``: the softmax's statistics and gradient over one slice of the LM head's logits, each a read of
  the slice (``rankdecay.layers.linear_cross_entropy`` on a GPU, eager; under ``torch.compile`` it takes its
  PyTorch form, which inductor fuses).

Under ``torch.compile`` the chunked entry points above (and the factor builders in ``factors``) are opaque
operators of the graph (``opaque``: ``torch.library`` custom ops running our Python and kernels as written, and the
autograd Functions' backward likewise), so a compiled model is one graph, ``fullgraph=True`` included. Traced,
inductor would launch our kernels itself, with arguments typed its own way (None for the pointers a constexpr
flag leaves unread, fp64 for Python floats), which does not compile (BENCHMARKS.md session 63). The decode
kernels (``fused_recurrent_*``) are traced into the compiled graph, which ``GraphDecoder(compile=True)`` relies on:
they take no None, and cast their float arguments to fp32.

Importing this package needs ``triton``; ``rankdecay.ops.backends()`` says whether it runs.
"""
from .chunk_bwd import chunk_dplr, chunk_gated_delta_rule, chunk_hdla, padded_dplr
from .chunk_fwd import chunk_dplr_fwd
from .chunk_state import chunk_state_passing
from .fused_recurrent import fused_recurrent_dplr, fused_recurrent_gated_delta_rule

__all__ = ["chunk_dplr", "chunk_gated_delta_rule", "chunk_hdla", "chunk_dplr_fwd", "chunk_state_passing",
           "fused_recurrent_dplr", "fused_recurrent_gated_delta_rule"]
