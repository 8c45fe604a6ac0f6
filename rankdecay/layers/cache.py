"""The decoding cache: per layer, what a mixer needs to continue a sequence."""
from __future__ import annotations

import torch


class Cache:
    """Decoding state of a whole model, one slot per layer.

    A linear mixer keeps ``{"conv": (q, k, v) conv states [B, D, kernel - 1],
    "recurrent": [B, H, K, V]}`` (on the GPU's decode route a step writes both back into the same
    tensors); sliding-window attention keeps its last
    ``window - 1`` keys and values and which of them are real tokens. The size is
    fixed whatever the context length (but for full attention, ``window_size=None``, which keeps every key).
    ``seen_tokens`` counts the steps fed so far.

    ``projections``: per layer, ``{"mixer": PackedLinears | None, "mlp": PackedLinears | None}``, the layer's
    linear maps of one input packed into one product (``rankdecay.layers.packing``), or None (each map its own
    product). ``GraphDecoder`` sets them for its decode steps; layers use them only without autograd.
    """

    # What transformers' generate asks of a cache given to it (``generate(ids, cache=...)``, continuing a
    # conversation): not one of its static caches (no compiled step, no 4-D masks), not croppable (a recurrent state
    # cannot be rolled back), and ``is_linear`` False for every layer, which is what makes generate feed only the
    # tokens after ``get_seq_length()`` (for its own Mamba-like layers it feeds them all)
    is_compileable = False
    is_croppable = False

    @property
    def is_linear(self) -> list[bool]:
        return [False] * len(self.layers)

    def __init__(self, num_layers: int):
        self.layers: list[dict | None] = [None] * num_layers
        self.seen_tokens = 0
        self.projections: list[dict] | None = None

    def packed(self, layer_idx: int, part: str):
        """Layer ``layer_idx``'s pack for ``part`` ("mixer" or "mlp"), or None."""
        return None if self.projections is None else self.projections[layer_idx].get(part)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen_tokens

    def reorder_cache(self, beam_idx: torch.Tensor) -> None:
        """Select batch rows (beam search): every cached tensor is indexed along its batch axis."""

        def pick(x):
            if isinstance(x, torch.Tensor):
                return x.index_select(0, beam_idx.to(x.device))
            if isinstance(x, (tuple, list)):
                return type(x)(pick(t) for t in x)
            if isinstance(x, dict):
                return {key: pick(value) for key, value in x.items()}
            return x

        self.layers = [pick(layer) for layer in self.layers]

    def __len__(self) -> int:
        return len(self.layers)


def check_packed_rows(rows: int, cu_seqlens: torch.Tensor | None) -> None:
    """Packed tokens (``cu_seqlens`` [N + 1]) continue one row of a layer's cache (``rows`` of them) each."""
    if cu_seqlens is not None and rows != cu_seqlens.shape[0] - 1:
        raise ValueError(f"the cache has {rows} rows but cu_seqlens packs N = {cu_seqlens.shape[0] - 1} sequences: "
                         "packed tokens continue one cache row per sequence")
