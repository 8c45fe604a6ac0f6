"""Softmax attention with RoPE, over a sliding window (the SWA of Gated DeltaNet-H1) or every token before (full
causal attention: ``window_size=None``), with grouped key/value heads (GQA), q/k/v biases and q/k RMSNorm as fla's
``Attention`` layer has them. Through PyTorch SDPA with a mask, in blocks of queries over the keys in their window;
on a GPU in 16 bits without a cache or padding to read, PyTorch's flash attention for packed sequences
(``torch.nn.attention.varlen``), which takes the window itself."""
from __future__ import annotations

import inspect

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..ops._inputs import check_cu_seqlens_layout, sequence_ids
from ..ops.backends import _HAS_TRITON
from .cache import Cache, check_packed_rows
from .modules import RMSNorm
from .packing import output_linear as _output_linear
from .packing import projections as _packed_projections


_FREQUENCIES: dict = {}  # (D, theta, device) -> rotary_frequencies' tensor


def rotary_frequencies(D: int, theta: float, device) -> torch.Tensor:
    """The rotary embedding's frequencies ``theta^(-2i / D)``, i < D / 2: ``[D / 2]`` fp32 (not to be written in
    place). Remembered per (D, theta, device) outside ``torch.compile`` and CUDA graph capture: each layer's decode
    step would otherwise form them again, three small kernels."""
    device = torch.device(device)

    def form():
        return theta ** (-torch.arange(0, D, 2, device=device, dtype=torch.float32) / D)

    if torch.compiler.is_compiling() or (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        return form()
    key = (D, float(theta), device)
    if key not in _FREQUENCIES:
        with torch.inference_mode(False):  # a normal tensor, which autograd may save, even if first asked in one
            _FREQUENCIES[key] = form()
    return _FREQUENCIES[key]


def rotary(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary position embedding (rotate-half form). x [B, T, H, D], positions [B, T] or [T]. On a GPU (outside
    ``torch.compile``, which fuses these operations itself) one Triton kernel forward and one backward
    (``ops.triton.rotary``)."""
    inv_freq = rotary_frequencies(x.shape[-1], theta, x.device)
    if (_HAS_TRITON and _on_kernel_device(x) and not torch.compiler.is_compiling()
            and _rotary_kernel.takes(x, positions)):
        return _rotary_kernel.rotary(x, positions, inv_freq)
    angles = positions.float()[..., None] * inv_freq  # [B, T, D/2]
    if angles.dim() == 2:
        angles = angles[None]
    cos, sin = angles.cos()[:, :, None, :], angles.sin()[:, :, None, :]
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


if _HAS_TRITON:
    from ..ops.triton import rotary as _rotary_kernel
    from ..ops.triton import swa as _swa_kernels


# whether a compiled decode step calls the SWA step's kernels (else inductor fuses the PyTorch step): the kernels
# measured 1.8x faster at B = 64 (BENCHMARKS.md, session 79)
_STEP_KERNELS_COMPILED = True


def _on_kernel_device(x: torch.Tensor) -> bool:
    """Where the rotary embedding's and the decode step's Triton kernels run: a GPU (tests patch this to run them
    interpreted on the CPU)."""
    return x.is_cuda


try:  # PyTorch's flash attention over packed sequences, with a window from torch 2.10 on (CUDA, 16 bits)
    from torch.nn.attention.varlen import varlen_attn as _varlen_attn
except ImportError:  # older PyTorch
    _varlen_attn = None
_VARLEN_WINDOW = _varlen_attn is not None and "window_size" in inspect.signature(_varlen_attn).parameters
_VARLEN_GQA = _VARLEN_WINDOW and "enable_gqa" in inspect.signature(_varlen_attn).parameters


def _flash(q, k, v, cu, longest: int, window: int | None) -> torch.Tensor:
    """``_varlen_attn`` over packed sequences q [T, H, D], k, v [T, Hkv, D] (``cu`` int32 [N + 1], ``longest``
    bounding every sequence): causal, over the last ``window`` tokens or every one (None). Grouped key/value heads
    go to the kernel where it takes them (``enable_gqa``), else are repeated for it."""
    groups = q.shape[1] // k.shape[1]
    extra = {}
    if groups > 1 and _VARLEN_GQA:
        extra["enable_gqa"] = True
    elif groups > 1:
        k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    return _varlen_attn(q, k, v, cu, cu, longest, longest, window_size=(-1 if window is None else window - 1, 0),
                        **extra)


def _flash_varlen(q: torch.Tensor) -> bool:
    """Whether ``_varlen_attn`` takes these queries [1, T, H, D]: a CUDA GPU of compute capability 8.0 or more,
    fp16 / bf16, D <= 256 and a multiple of 8."""
    return (_VARLEN_WINDOW and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] <= 256
            and q.shape[-1] % 8 == 0 and torch.cuda.get_device_capability(q.device)[0] >= 8)


# queries per block of the masked path (at least the window): time and memory grow as T * (lead + block + window)
_QUERY_BLOCK = 1024


def _grouped(q: torch.Tensor, k: torch.Tensor) -> dict:
    """SDPA's keyword for queries [B, T, H, D] over fewer key/value heads [B, L, Hkv, D] (GQA): ``enable_gqa``, only
    where they are grouped (PyTorch 2.5 on)."""
    return {"enable_gqa": True} if q.shape[2] != k.shape[2] else {}


def _windowed(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, lead: int, window: int | None,
              allowed) -> torch.Tensor:
    """Masked SDPA for a sliding window, the queries in blocks: each block reads the ``lead`` keys any query may see
    (cache rows) and the tokens' keys of its window, not every key, so a long input costs T * (lead + block +
    window), not T * (lead + T), in time and in the masks' memory.

    q [B, T, H, D]; keys, values [B, lead + T, Hkv, D] (token t's key at lead + t; H a multiple of Hkv, query head
    h reading key head h // (H / Hkv)); ``window`` None: every token before (full attention: T * (lead + T));
    ``allowed(s, e, cols)``: the mask [B, e - s, len(cols)] of queries s..e-1 over the key columns ``cols`` (a
    LongTensor). Returns o [B, T, H, D]."""
    T = q.shape[1]
    block = _QUERY_BLOCK if window is None else max(window, _QUERY_BLOCK)
    spans = [(0, T)] if T <= 2 * block else [(s, min(s + block, T)) for s in range(0, T, block)]
    gqa = _grouped(q, keys)
    out = []
    for s, e in spans:
        lo = 0 if window is None else max(0, s - window + 1)  # the first token whose key is in the block's window
        cols = torch.cat([torch.arange(lead, device=q.device), torch.arange(lead + lo, lead + e, device=q.device)])
        if lead and lo:
            k, v = (torch.cat([z[:, :lead], z[:, lead + lo:lead + e]], 1) for z in (keys, values))
        else:
            k, v = keys[:, lo:lead + e], values[:, lo:lead + e]
        o = F.scaled_dot_product_attention(q[:, s:e].transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           attn_mask=allowed(s, e, cols)[:, None], **gqa)
        out.append(o.transpose(1, 2))
    return out[0] if len(out) == 1 else torch.cat(out, 1)


def _rolled(entry: dict, whole: bool = False) -> dict:
    """A ring cache (decode steps) back in time order: its ``window - 1`` newest slots, oldest first; ``whole``:
    every slot, the one ``next`` would take first (full attention, where that one may hold a token still seen)."""
    B, W = entry["real"].shape
    order = (entry["next"][:, None] + torch.arange(0 if whole else 1, W, device=entry["k"].device)) % W
    rows = torch.arange(B, device=order.device)[:, None]
    return {"k": entry["k"][rows, order], "v": entry["v"][rows, order], "real": entry["real"][rows, order],
            "count": entry["count"]}


class SlidingWindowAttention(nn.Module):
    """Causal softmax attention over the last ``window_size`` tokens, with RoPE; ``window_size=None`` is full causal
    attention (fla's ``Attention`` with ``window_size=None``, the attention layers of hybrids such as Gated
    DeltaNet-H2 and Kimi Linear).

    Args:
        hidden_size, num_heads: the model's width and the query heads.
        head_dim: each head's width (default hidden_size / num_heads, as fla's layer has it).
        window_size: the tokens a query sees, itself included; None: all before it.
        rope_theta: the rotary embedding's base (rotate-half form over the whole head).
        num_kv_heads: grouped key/value heads (GQA): a divisor of num_heads, query head h reading key/value head
            h // (num_heads / num_kv_heads); default num_heads.
        qkv_bias: biases on the q, k and v projections (fla's ``qkv_bias``).
        qk_norm: an RMSNorm with weights over each head of q and of k, before the rotary embedding (fla's
            ``qk_norm``), with ``norm_eps``.

    In decoding with a window it keeps only the last keys and values: the cache is bounded whatever
    the context length. Positions count real tokens only, so a left-padded prompt
    attends exactly as the prompt alone.

    The cache has two layouts. After a prompt (several tokens) it holds the last
    ``window_size - 1`` keys in time order. A one-token step turns it into a ring of
    ``window_size`` slots (``"next"`` [B]: the slot the next token overwrites). The step then
    writes its key into the ring in place (the token it replaces has left the window)
    and attends over the ring: no copy of the window per token, and fixed shapes (CUDA
    graphs). The order of keys does not matter to attention (RoPE is applied before
    they are stored). A later multi-token input rolls the ring back into time order.

    Full attention keeps every key: its ring has room for the tokens to come (a power of two of slots, 16 at least)
    and, decoding eagerly, doubles when a step would fill it (``"room"``: the steps left, a Python int); a ring of
    fixed size is the caller's promise that the rows never hold more tokens than its slots (``GraphDecoder`` needs
    ``max_length`` for such a model and keeps that promise).
    """

    def __init__(self, hidden_size: int, num_heads: int, head_dim: int | None = None, *,
                 window_size: int | None = 2048, rope_theta: float = 10000.0, layer_idx: int = 0,
                 num_kv_heads: int | None = None, qkv_bias: bool = False, qk_norm: bool = False,
                 norm_eps: float = 1e-5):
        super().__init__()
        if head_dim is None:
            if hidden_size % num_heads:
                raise ValueError(f"hidden_size {hidden_size} is not divisible by num_heads {num_heads}; give head_dim")
            head_dim = hidden_size // num_heads
        if head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {head_dim}")
        if window_size is not None and (isinstance(window_size, bool) or not isinstance(window_size, int)
                                        or window_size < 1):
            raise ValueError(f"window_size must be a positive int or None (full attention), got {window_size!r}")
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if not isinstance(num_kv_heads, int) or num_kv_heads < 1 or num_heads % num_kv_heads:
            raise ValueError(f"num_kv_heads must be a positive divisor of num_heads = {num_heads}, got "
                             f"{num_kv_heads!r}")
        self.num_heads, self.num_kv_heads, self.head_dim, self.window_size = num_heads, num_kv_heads, head_dim, \
            window_size
        self.rope_theta, self.layer_idx = rope_theta, layer_idx
        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=False)
        self.q_norm = RMSNorm(head_dim, norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, norm_eps) if qk_norm else None

    def input_projections(self) -> tuple[str, ...]:
        """The linear maps of the input x (one packed product when decoding: ``rankdecay.layers.packing``)."""
        return ("q_proj", "k_proj", "v_proj")

    def ring_cache(self, entry: dict, slots: int | None = None) -> dict:
        """A time-ordered cache entry as a ring of ``slots`` slots (default and at most ``window_size``): its last
        ``slots - 1`` keys, left-padded with slots marked as padding, and one free slot at the end, which the next
        token takes. A ring smaller than the window is the caller's promise that no row holds more tokens than it
        has slots, prompt and steps together (``GraphDecoder(max_length=)`` keeps it): the keys it leaves out must
        be padding, and a step past that would write over a token still in the window.

        Full attention (no window): ``slots`` is that promise; without it, room for the entry's keys and as many
        steps again (a power of two, 16 slots at least), and ``"room"``, the steps the ring takes before the step
        that would fill it doubles it."""
        if "next" in entry:
            return entry
        W = slots
        if slots is None and self.window_size is None:
            W = max(16, 1 << (2 * entry["k"].shape[1] - 1).bit_length())  # a power of two >= twice the keys
        elif slots is None:
            W = self.window_size
        if isinstance(W, bool) or not isinstance(W, int) or not 1 <= W <= (self.window_size or W):
            raise ValueError(f"slots must be an int from 1 to window_size = {self.window_size}, got {slots!r}")
        drop = entry["k"].shape[1] - (W - 1)
        if drop > 0:  # a packed prefill's rows are window - 1 long, padding first
            entry = {**entry, **{name: entry[name][:, drop:] for name in ("k", "v", "real")}}
        P = entry["k"].shape[1]

        def pad(x):
            B, rest = x.shape[0], tuple(x.shape[2:])
            return torch.cat([x.new_zeros((B, W - 1 - P) + rest), x, x.new_zeros((B, 1) + rest)], 1)

        ring = {"k": pad(entry["k"]), "v": pad(entry["v"]), "real": pad(entry["real"]), "count": entry["count"],
                "next": torch.full_like(entry["count"], W - 1)}
        if slots is None and self.window_size is None:
            ring["room"] = W - P  # the free slot and the padding slots before the keys
        return ring

    def forward(self, x, attention_mask=None, cache: Cache | None = None, use_cache: bool = False,
                cu_seqlens: torch.Tensor | None = None, projected: dict[str, torch.Tensor] | None = None):
        """x [B, T, D] -> (o [B, T, D], cache). ``projected``: q, k and v of x where the caller formed them
        already (as for the linear mixers: ``layers.packing.fused_input_projections``)."""
        B, T, _ = x.shape
        H, D, W = self.num_heads, self.head_dim, self.window_size
        real = torch.ones(B, T, dtype=torch.bool, device=x.device) if attention_mask is None else attention_mask.bool()
        state = cache.layers[self.layer_idx] if cache is not None else None
        if cu_seqlens is not None:
            return self._packed(x, real, cu_seqlens, state, cache, use_cache, projected, attention_mask is None)
        if state is None:
            state = self._empty(B, x, real)
        if T == 1 and cache is not None and use_cache:
            return self._step(x, real, self.ring_cache(state), cache, projected)
        if "next" in state:
            state = _rolled(state, whole=W is None)
        P = state["k"].shape[1]

        positions = state["count"][:, None] + real.long().cumsum(1) - real.long()  # real tokens before this one
        q, k, v = self._qkv(x, positions, cache, projected)
        if P:
            keys, values = torch.cat([state["k"], k], 1), torch.cat([state["v"], v], 1)
            key_real = torch.cat([state["real"], real], 1)  # [B, P + T]
        else:  # no cache before the tokens: nothing to copy
            keys, values, key_real = k, v, real
        if P == 0 and attention_mask is None and _flash_varlen(q):
            # the rows as B packed sequences of T tokens each (training, a prompt without padding)
            cu = torch.arange(0, (B + 1) * T, T, device=x.device, dtype=torch.int32)
            o = _flash(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu, T, W).view(B, T, H, D)
        else:
            def allowed(s, e, cols):  # the cache's keys are the window's first ones: every query reads them
                i = P + torch.arange(s, e, device=x.device)[:, None]  # the queries' places in the key buffer
                seen = (cols <= i) if W is None else (cols <= i) & (i - cols < W)
                return seen[None] & key_real[:, None, cols] | (cols == i)[None]

            o = _windowed(q, keys, values, P, W, allowed)  # a padding query sees itself, never an empty row
        o = self.o_proj(o.reshape(B, T, H * D))
        if cache is not None and use_cache:
            keep = P + T if W is None else W - 1  # full attention: every key
            cache.layers[self.layer_idx] = {
                "k": keys[:, -keep:] if keep else keys[:, :0], "v": values[:, -keep:] if keep else values[:, :0],
                "real": key_real[:, -keep:] if keep else key_real[:, :0],
                "count": state["count"] + real.long().sum(1),
            }
        return o, cache

    def _packed(self, x, real, cu_seqlens, state, cache, use_cache, projected, all_real):
        """Sequences packed along T (x [1, T, D], ``cu_seqlens`` [N + 1]): each token attends within its own
        sequence, over its tokens so far and, with a cache, its own row of the cache's keys (``[N, P]``: N rows,
        one per sequence, as a batched decode then reads them). The cache then keeps each sequence's last
        ``window - 1`` keys (full attention: as many as the longest row holds), its count of real tokens, and
        decodes as a batch of N.

        On a GPU in 16 bits, with no cache row to read and no padding (training on packed documents, a packed
        prefill), PyTorch's flash attention for packed sequences (``torch.nn.attention.varlen``) with the window:
        time and memory linear in T. Otherwise masked SDPA in blocks of queries (``_windowed``)."""
        B, T, _ = x.shape
        H, D, W = self.num_heads, self.head_dim, self.window_size
        check_cu_seqlens_layout(cu_seqlens, B)
        device = x.device
        cu = cu_seqlens.to(device=device, dtype=torch.long)
        N = cu.shape[0] - 1
        if state is None:
            state = self._empty(N, x, real)
        elif "next" in state:
            state = _rolled(state, whole=W is None)
        check_packed_rows(state["k"].shape[0], cu)
        P = state["k"].shape[1]
        t = torch.arange(T, device=device)
        seq = sequence_ids(cu, T)
        starts = cu[:-1][seq]
        offset = t - starts  # the token's place in its sequence's new tokens
        q, k, v = self._qkv(x, (state["count"][seq] + offset)[None], cache, projected)
        # the keys: every cache row's (row n's at N * n ...), then the packed tokens'
        keys, values, key_real = k[0], v[0], real[0]
        if P:
            keys = torch.cat([state["k"].flatten(0, 1), keys])
            values = torch.cat([state["v"].flatten(0, 1), values])
            key_real = torch.cat([state["real"].reshape(N * P), key_real])
        if P == 0 and all_real and _flash_varlen(q):
            # T bounds every sequence's length: no host sync (a compiled graph stays whole); blocks past a
            # sequence's end return at once
            cu32 = cu.to(torch.int32)
            o = _flash(q[0], k[0], v[0], cu32, T, W)[None]
        else:
            def allowed(s, e, cols):  # cache columns: their own sequence's row, inside the window; then the tokens'
                ti = t[s:e, None]
                j = cols[None] - N * P  # the token of a token column
                row, slot = (cols // P, cols % P) if P else (cols, cols)
                cached = row[None] == seq[s:e, None]
                mine = (j <= ti) & (j >= starts[s:e, None])
                if W is not None:
                    cached &= offset[s:e, None] + P - slot[None] < W
                    mine &= ti - j < W
                return (torch.where(j < 0, cached, mine) & key_real[cols][None] | (j == ti))[None]

            o = _windowed(q, keys[None], values[None], N * P, W, allowed)  # a padding query sees itself
        o = self.o_proj(o.reshape(B, T, H * D))
        if cache is not None and use_cache:
            # full attention: every key of the row that holds the most (one host sync, in a prefill)
            keep = P + int((cu[1:] - cu[:-1]).max()) if W is None else W - 1
            # sequence n's last `keep` keys, its new tokens after its cache row's; slots before both are padding
            back = (cu[1:] - cu[:-1])[:, None] - keep + torch.arange(keep, device=device)  # [N, keep], in new tokens
            rows = torch.arange(N, device=device)[:, None]
            at = torch.where(back >= 0, N * P + cu[:-1, None] + back,
                             torch.where(P + back >= 0, rows * P + P + back, N * P + T))

            def take(z):  # z [N * P + T, ...] and one padding row after it
                return torch.cat([z, z.new_zeros((1,) + z.shape[1:])])[at]

            counted = torch.zeros(N, dtype=torch.long, device=device).index_add_(0, seq, real[0].long())
            cache.layers[self.layer_idx] = {"k": take(keys), "v": take(values), "real": take(key_real),
                                            "count": state["count"] + counted}
        return o, cache

    def _empty(self, B: int, x: torch.Tensor, real: torch.Tensor) -> dict:
        """The cache entry of B rows before any token."""
        Hkv, D = self.num_kv_heads, self.head_dim
        return {"k": x.new_zeros(B, 0, Hkv, D), "v": x.new_zeros(B, 0, Hkv, D), "real": real.new_zeros(B, 0),
                "count": torch.zeros(B, dtype=torch.long, device=x.device)}

    def _projections(self, x, cache, projected=None):
        """q ``[B, T, H, D]``, k and v ``[B, T, Hkv, D]`` of x before the rotary embedding (q and k normed with
        ``qk_norm``)."""
        B, T, _ = x.shape
        p = projected if projected is not None else _packed_projections(
            self, self.input_projections(), x, cache.packed(self.layer_idx, "mixer") if cache is not None else None)
        if p is None:
            p = {name: getattr(self, name)(x) for name in self.input_projections()}
        q, k, v = (p[name].unflatten(-1, (-1, self.head_dim)) for name in self.input_projections())
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v

    def _qkv(self, x, positions, cache, projected=None):
        q, k, v = self._projections(x, cache, projected)
        return rotary(q, positions, self.rope_theta), rotary(k, positions, self.rope_theta), v

    def _step(self, x, real, ring: dict, cache: Cache, projected=None):
        """One token against the ring: its key written in place over the slot that left the window. On a GPU
        without autograd, two Triton kernels (``ops.triton.swa``: the rotary embedding, the ring's write and the
        attention split over the ring's slots), compiled or not; else PyTorch's operations."""
        B, _, _ = x.shape
        H, D = self.num_heads, self.head_dim
        if ring.get("room") == 0:  # full attention, eager: the ring is full; back in time order, then twice the slots
            ring = self.ring_cache(_rolled(ring, whole=True))
        slot = ring["next"]  # [B] (one value unless rows were reordered from different caches)
        q, k, v = self._projections(x, cache, projected)
        if (_HAS_TRITON and _on_kernel_device(x) and not torch.is_grad_enabled()
                and (_STEP_KERNELS_COMPILED or not torch.compiler.is_compiling())
                and _swa_kernels.takes(q[:, 0], ring["k"])):
            o = _swa_kernels.swa_step(q[:, 0], k[:, 0], v[:, 0], ring, real[:, 0],
                                      rotary_frequencies(D, self.rope_theta, x.device))[:, None]
        else:
            q, k = (rotary(z, ring["count"][:, None], self.rope_theta) for z in (q, k))
            at = (torch.arange(B, device=x.device), slot)
            ring["k"].index_put_(at, k[:, 0])
            ring["v"].index_put_(at, v[:, 0])
            ring["real"].index_put_(at, real[:, 0])
            mine = torch.arange(ring["k"].shape[1], device=x.device) == slot[:, None]  # a padding query sees itself
            allowed = (ring["real"] | mine)[:, None, None, :]  # [B, 1, 1, W]: every slot is within the window
            o = F.scaled_dot_product_attention(q.transpose(1, 2), ring["k"].transpose(1, 2),
                                               ring["v"].transpose(1, 2), attn_mask=allowed,
                                               **_grouped(q, ring["k"])).transpose(1, 2)
        cache.layers[self.layer_idx] = {**ring, "count": ring["count"] + real.long()[:, 0],
                                        "next": (slot + 1) % ring["k"].shape[1]}
        if "room" in ring:
            cache.layers[self.layer_idx]["room"] = ring["room"] - 1
        o = _output_linear(self.o_proj, o.reshape(B, 1, H * D), cache.packed(self.layer_idx, "mixer"))
        return o, cache

    def extra_repr(self) -> str:
        kv = f", kv_heads={self.num_kv_heads}" if self.num_kv_heads != self.num_heads else ""
        return f"heads={self.num_heads}{kv}, head_dim={self.head_dim}, window={self.window_size}"
