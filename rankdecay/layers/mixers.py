"""Token mixers: one shared block (GDN paper Fig. 1, §3.4), a mechanism per subclass.

The block: q/k/v linear projections -> short causal depthwise convolution + SiLU
-> (L2 norm of q, k for the delta family) -> the recurrence -> output RMSNorm
with a SiLU output gate -> output projection. A subclass adds only its gates (the
projections of alpha, beta, lambda, the Head-in-Head mask) and names the op it
calls; the layer never launches kernels itself (``rankdecay.ops`` picks the path).
A subclass's ``gate_projections()`` names the linear maps its ``gates`` apply to x, and
``gates`` reads them through ``projected(name, x, p)``: a decode step then takes them
with q, k, v and the output gate in one packed product (``rankdecay.layers.packing``).

Every mixer takes ``forward(x [B, T, D], attention_mask [B, T] | None, cache | None,
use_cache, cu_seqlens | None) -> (o [B, T, D], cache)``. Padding positions
(``attention_mask == 0``) are made identity steps of the recurrence: zero input,
zero log-decay. So a left-padded prompt leaves exactly the state the prompt alone
leaves.
"""
from __future__ import annotations

import abc
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from .. import ops
from ..ops.backends import recurrent_mode as _recurrent_mode  # the decode path (tests patch this name)
from ..ops._inputs import STATE_DTYPES, sequence_ids
from ..ops.mechanisms import _up  # gates in at least fp32, fp64 kept
from ..ops.mechanisms import kda_log_decay, l2norm, logsigmoid_log_decay, mamba2_log_decay
from .cache import Cache, check_packed_rows
from .modules import GATE_ACTIVATIONS, GatedRMSNorm, RMSNorm, ShortConvolution, conv_step, gate_activation
from .packing import fused_output_linear as _fused_output_linear
from .packing import output_linear as _output_linear
from .packing import projections as _packed_projections

RECURRENT_MAX_TOKENS = 64  # with a cache and without autograd, inputs this short run the recurrent (decode) path


_STATE_DTYPES = {str(d).removeprefix("torch."): d for d in STATE_DTYPES}  # "float32": torch.float32, ...


def _state_dtype(x: torch.dtype | str) -> torch.dtype:
    """The cache's recurrent-state dtype from a torch dtype or its name ("float32", "bfloat16", "float16")."""
    dtype = _STATE_DTYPES.get(x) if isinstance(x, str) else x
    if dtype not in _STATE_DTYPES.values():
        raise ValueError(f"state_dtype must be one of {', '.join(_STATE_DTYPES)} (or that torch dtype), got {x!r}")
    return dtype


class LinearMixer(nn.Module, abc.ABC):
    """The block shared by every linear-attention mixer.

    Args:
        hidden_size: model width D.
        num_heads: H.
        head_k_dim: K per head (default D / H).
        head_v_dim: V per head (default K; ``expand_v`` in fla terms is V / K).
        use_short_conv: short causal depthwise convolution + SiLU on q, k, v; without
            it q, k, v get only the SiLU.
        conv_size: its kernel size.
        qkv_activation: that SiLU ("silu"), or None: q, k, v as the convolution (or the projections) leave
            them (fla's GLA without a convolution).
        qk_norm: "l2" (q and k, the delta family), "k" (k only, HDLA) or None.
        output_norm: RMSNorm on each head's output before the gate.
        gate_act: activation of the output gate: "silu", "sigmoid" (Kimi Linear's) or None (a linear gate).
        use_output_gate: whether there is an output gate at all.
        output_gate_rank: None: the output gate is one linear map of x (``g_proj``); an int r: a low-rank one,
            ``Linear(D, r) -> Linear(r, H V)`` with a bias on the second (fla's ``KimiDeltaAttention``, r = V).
        chunk_size: chunk size of the chunked path.
        mode: "chunk" (training and prefill) or "recurrent" (always the per-token path).
            With a cache, inputs of <= 64 tokens use the recurrent path either way.
        norm_eps: epsilon of the output norm.
        layer_idx: this layer's slot in a :class:`Cache`.
        shared_qk_conv: one convolution filter per head for q and for k (shared by the
            head's key channels; state-reduction paper App. D.6), so that rotations of the
            key space (PCA pruning) commute with the convolution.
        scale: the query scale of the op (default ``head_k_dim ** -0.5``); a pruned model
            keeps its original scale (``rankdecay.prune``).
        state_dtype: the dtype of the recurrent state in the :class:`Cache` (fp32, or bf16 / fp16
            to halve the cache and a decode step's memory traffic). Updates are fp32 either way.
            On the GPU decode kernel's route the state is updated in place in the cache.
        num_v_heads: grouped value heads (fla's GVA; DeltaNet and Gated DeltaNet only): HV value heads, a multiple
            of H, value head h reading query and key head h // (HV / H); v, the output gate, β, the decay and the
            state have HV heads (default: H).
    """

    kv_per_token = 1  # keys and values per token (Gated DeltaProduct: n_h)
    grouped_value_heads = False  # whether num_v_heads may exceed num_heads (the op reads key head h // (HV / H))

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        head_k_dim: int | None = None,
        head_v_dim: int | None = None,
        *,
        use_short_conv: bool = True,
        conv_size: int = 4,
        qk_norm: str | None = "l2",
        output_norm: bool = True,
        gate_act: str | None = "silu",
        use_output_gate: bool = True,
        output_gate_rank: int | None = None,
        qkv_activation: str | None = "silu",
        chunk_size: int = 64,
        mode: str = "chunk",
        norm_eps: float = 1e-6,
        layer_idx: int = 0,
        scale: float | None = None,
        shared_qk_conv: bool = False,
        state_dtype: torch.dtype | str = torch.float32,
        num_v_heads: int | None = None,
    ):
        super().__init__()
        for name, value in (("hidden_size", hidden_size), ("num_heads", num_heads), ("conv_size", conv_size),
                            ("chunk_size", chunk_size)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if head_k_dim is None:
            if hidden_size % num_heads:
                raise ValueError(f"hidden_size {hidden_size} is not divisible by num_heads {num_heads}; "
                                 "give head_k_dim explicitly")
            head_k_dim = hidden_size // num_heads
        head_v_dim = head_k_dim if head_v_dim is None else head_v_dim
        for name, value in (("head_k_dim", head_k_dim), ("head_v_dim", head_v_dim)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        num_v_heads = num_heads if num_v_heads is None else num_v_heads
        if not isinstance(num_v_heads, int) or num_v_heads < num_heads or num_v_heads % num_heads:
            raise ValueError(f"num_v_heads must be a multiple of num_heads = {num_heads}, got {num_v_heads!r}")
        if num_v_heads != num_heads and not self.grouped_value_heads:
            raise ValueError(f"num_v_heads = {num_v_heads}: {type(self).__name__} has no grouped value heads "
                             f"(DeltaNet and Gated DeltaNet have); give num_v_heads = num_heads")
        if qk_norm not in ("l2", "k", None):
            raise ValueError(f"qk_norm must be 'l2', 'k' or None, got {qk_norm!r}")
        if gate_act not in GATE_ACTIVATIONS:
            raise ValueError(f"gate_act must be 'silu', 'sigmoid' or None, got {gate_act!r}")
        if output_gate_rank is not None and (not isinstance(output_gate_rank, int) or output_gate_rank < 1):
            raise ValueError(f"output_gate_rank must be None or a positive int, got {output_gate_rank!r}")
        if qkv_activation not in ("silu", None):
            raise ValueError(f"qkv_activation must be 'silu' or None, got {qkv_activation!r}")
        if mode not in ("chunk", "recurrent"):
            raise ValueError(f"mode must be 'chunk' or 'recurrent', got {mode!r}")
        self.hidden_size, self.num_heads, self.num_v_heads = hidden_size, num_heads, num_v_heads
        self.head_k_dim, self.head_v_dim = head_k_dim, head_v_dim
        self.qk_norm, self.chunk_size, self.mode, self.layer_idx = qk_norm, chunk_size, mode, layer_idx
        self.scale = head_k_dim ** -0.5 if scale is None else float(scale)
        self.shared_qk_conv = shared_qk_conv
        self.state_dtype = _state_dtype(state_dtype)
        self.qk_hook = None  # called as qk_hook(self, q, k) with the op's q and k (calibration, diagnostics)
        self.use_short_conv, self.use_output_gate, self.output_norm = use_short_conv, use_output_gate, output_norm
        self.qkv_activation = qkv_activation
        n = self.kv_per_token
        key_dim, value_dim = num_heads * head_k_dim, num_v_heads * head_v_dim
        self.q_proj = nn.Linear(hidden_size, key_dim, bias=False)
        self.k_proj = nn.Linear(hidden_size, n * key_dim, bias=False)
        self.v_proj = nn.Linear(hidden_size, n * value_dim, bias=False)
        if use_short_conv:
            act = qkv_activation
            self.q_conv = ShortConvolution(key_dim, conv_size, act, groups=num_heads if shared_qk_conv else None)
            self.k_conv = ShortConvolution(n * key_dim, conv_size, act,
                                           groups=n * num_heads if shared_qk_conv else None)
            self.v_conv = ShortConvolution(n * value_dim, conv_size, act)
        self.output_gate_rank = output_gate_rank if use_output_gate else None
        if use_output_gate and output_gate_rank is None:
            self.g_proj = nn.Linear(hidden_size, value_dim, bias=False)
        elif use_output_gate:
            self.g_proj = nn.Sequential(nn.Linear(hidden_size, output_gate_rank, bias=False),
                                        nn.Linear(output_gate_rank, value_dim, bias=True))
        if output_norm:
            self.o_norm = GatedRMSNorm(head_v_dim, norm_eps, gate_act) if use_output_gate else RMSNorm(head_v_dim, norm_eps)
        self.gate_act = gate_act
        self.o_proj = nn.Linear(value_dim, hidden_size, bias=False)

    # --- what a mechanism provides -------------------------------------------------

    decode_kernel = False  # decode_gates() feeds decode_op() (the delta rule, one key per token)
    decode_qk_norm = "l2"  # the qk_norm that decode_op() forms inside its kernel

    def decode_op(self):
        """The one-kernel decode step that ``decode_gates`` feeds: ``ops.gated_delta_rule_decode``."""
        return ops.gated_delta_rule_decode

    def gate_projections(self) -> tuple[str, ...]:
        """The names of the linear maps (submodules) that ``gates`` applies to x itself."""
        return ()

    def input_projections(self) -> tuple[str, ...]:
        """Every linear map of the mixer's input x: q, k, v, the output gate and the gates' own. A decode step
        takes them as one packed product (``rankdecay.layers.packing``)."""
        gate = () if not self.use_output_gate else ("g_proj",) if self.output_gate_rank is None else ("g_proj.0",)
        return ("q_proj", "k_proj", "v_proj") + gate + self.gate_projections()

    def projected(self, name: str, x: torch.Tensor, p: dict[str, torch.Tensor] | None) -> torch.Tensor:
        """The map ``name`` of x: taken from ``p`` (a packed product's outputs) where given, else applied."""
        return p[name] if p is not None else self.get_submodule(name)(x)

    def output_gate(self, x: torch.Tensor, p: dict[str, torch.Tensor] | None = None, packed=None) -> torch.Tensor:
        """The output gate's pre-activation [..., H V]: ``g_proj x`` (a low-rank gate's second map applied to its
        first's output, which ``p`` may hold; in a step that decodes with packs, through the one-row kernel)."""
        if self.output_gate_rank is None:
            return self.projected("g_proj", x, p)
        return _output_linear(self.g_proj[1], self.projected("g_proj.0", x, p), packed)

    def decode_gates(self, x: torch.Tensor, p: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """The gate projections of x for ``decode_op()`` (``a``, ``b``, ``A_log``, ``dt_bias``, ``beta_max``, ...):
        the same gates as ``gates(x, None)``, formed inside its kernel. ``p``: as in ``gates``."""
        raise NotImplementedError

    def gates(self, x: torch.Tensor, mask: torch.Tensor | None,
              p: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """Per-token gate tensors from the (masked) input x [B, T, D]. ``p``: the outputs of
        ``gate_projections()`` on x where the caller formed them already (``projected`` reads them)."""
        return {}

    @abc.abstractmethod
    def mix(self, q, k, v, gates, *, initial_state, cu_seqlens, mode, inplace=False):
        """Call the op: q [B, T, H, K], k [B, T*n, H, K], v [B, T*n, H, V] -> (o, final state). ``inplace``:
        the op writes the final state into ``initial_state`` (the cache's tensor) and returns it."""

    # --- the shared block ----------------------------------------------------------

    @staticmethod
    def masked_log_gate(g: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """Zero log-decay at padding positions, so that they are identity steps."""
        if mask is None:
            return g
        return g * mask.reshape(mask.shape + (1,) * (g.dim() - 2)).to(g.dtype)

    def forward(self, x, attention_mask=None, cache: Cache | None = None, use_cache: bool = False,
                cu_seqlens: torch.Tensor | None = None, projected: dict[str, torch.Tensor] | None = None):
        """x [B, T, D] -> (o [B, T, D], cache). ``projected``: ``input_projections()`` of x where the caller
        formed them already (a block's decode step whose first product also took its residual add and norm,
        ``layers.packing.fused_input_projections``); x then gives only the shapes."""
        B, T, _ = x.shape
        H, K, V, n = self.num_heads, self.head_k_dim, self.head_v_dim, self.kv_per_token
        HV = self.num_v_heads
        mask = None
        if attention_mask is not None:
            if attention_mask.shape != (B, T):
                raise ValueError(f"attention_mask must have shape [B, T] = [{B}, {T}], got {list(attention_mask.shape)}")
            mask = attention_mask.to(x.dtype)
            x = x * mask[..., None]
        state = cache.layers[self.layer_idx] if cache is not None else None
        if state is not None:
            check_packed_rows(state["recurrent"].shape[0], cu_seqlens)
        conv_states = state["conv"] if state is not None else (None, None, None)
        seq = sequence_ids(cu_seqlens, T, x.device) if cu_seqlens is not None else None

        # decoding with a pack (GraphDecoder): every map of x in one product
        packed = cache.packed(self.layer_idx, "mixer") if cache is not None else None
        p = projected if projected is not None else _packed_projections(self, self.input_projections(), x, packed)
        q, k, v = (self.projected(name, x, p) for name in ("q_proj", "k_proj", "v_proj"))
        # with a cache, short inputs take the per-token (decode) path; under autograd (a training forward that
        # left use_cache on, as transformers' Trainer does) the chunked one, the fast path with a backward
        recurrent = self.mode == "recurrent" or (cache is not None and T <= RECURRENT_MAX_TOKENS
                                                 and not torch.is_grad_enabled())
        mode = _recurrent_mode(x) if recurrent else "auto"
        if self.use_short_conv:
            convs = (self.q_conv, self.k_conv, self.v_conv)
            # a decode step on the GPU's route: the three in one kernel, the cache's states shifted in place
            fused = (conv_step(convs, (q, k, v), conv_states)
                     if mode == "fused_recurrent" and use_cache and T == 1 and seq is None else None)
            if fused is not None:
                (q, k, v), new_conv = fused, tuple(conv_states)
            else:
                (q, cq), (k, ck), (v, cv) = (conv(y, s, cu_seqlens, use_cache, seq=seq)
                                             for conv, y, s in zip(convs, (q, k, v), conv_states))
                new_conv = (cq, ck, cv)
        else:
            if self.qkv_activation == "silu":
                q, k, v = F.silu(q), F.silu(k), F.silu(v)
            new_conv = (None, None, None)
        q = q.view(B, T, H, K)
        k = k.view(B, T, n, H, K).flatten(1, 2)  # row t * n + j: the j-th key of token t
        v = v.view(B, T, n, HV, V).flatten(1, 2)
        initial_state = state["recurrent"] if state is not None else None
        # on the GPU's per-token kernels, with a cache to update, the kernel writes the state back into
        # the cache's tensor (in its dtype): a decode step allocates no state and nothing copies it
        inplace = (mode == "fused_recurrent" and use_cache and initial_state is not None
                   and initial_state.dtype == self.state_dtype and initial_state.is_contiguous())
        if not inplace and initial_state is not None and initial_state.dtype != torch.float32:
            initial_state = initial_state.float()  # a 16-bit cache: the other paths start from fp32
        if (self.decode_kernel and mode == "fused_recurrent" and mask is None
                and self.qk_norm == self.decode_qk_norm and self.qk_hook is None):
            # one kernel for the L2 norms, the gates and the recurrence (the GPU decode step; packed sequences
            # each from its own row of the cache)
            o, final_state = self.decode_op()(q, k, v, **self.decode_gates(x, p), scale=self.scale,
                                              initial_state=initial_state, output_final_state=True,
                                              inplace_final_state=inplace, cu_seqlens=cu_seqlens, mode=mode)
        else:
            if self.qk_norm == "l2":
                q = l2norm(q)
            if self.qk_norm in ("l2", "k"):
                k = l2norm(k)
            if self.qk_hook is not None:
                self.qk_hook(self, q, k)
            o, final_state = self.mix(q, k, v, self.gates(x, mask, p), initial_state=initial_state,
                                      cu_seqlens=cu_seqlens, mode=mode, inplace=inplace)
        gate = self.output_gate(x, p, packed).view(B, T, HV, V) if self.use_output_gate else None
        fused = None
        if packed is not None:  # a B = 1 decode step on a GPU: the norm and the gate inside the output map's kernel
            act = (self.o_norm.activation if self.output_norm else self.gate_act) if gate is not None else None
            fused = _fused_output_linear(self.o_proj, o.reshape(B, T, HV * V), packed,
                                         u=None if gate is None else gate.reshape(B, T, HV * V), u_act=act,
                                         norm=self.o_norm if self.output_norm else None)
        if fused is not None:
            o = fused
        else:
            if gate is not None and self.output_norm:
                o = self.o_norm(o, gate)
            elif gate is not None:
                o = o * gate_activation(gate, self.gate_act)
            elif self.output_norm:
                o = self.o_norm(o)
            o = _output_linear(self.o_proj, o.reshape(B, T, HV * V), packed)
        if cache is not None and use_cache:
            cache.layers[self.layer_idx] = {"conv": new_conv, "recurrent": final_state.to(self.state_dtype)}
        return o, cache

    def extra_repr(self) -> str:
        heads = (self.num_heads if self.num_v_heads == self.num_heads
                 else f"{self.num_heads}, v_heads={self.num_v_heads}")
        return (f"heads={heads}, head_k_dim={self.head_k_dim}, head_v_dim={self.head_v_dim}, "
                f"conv={self.use_short_conv}, qk_norm={self.qk_norm}, mode={self.mode}")

    def _op_kwargs(self, initial_state, cu_seqlens, mode, inplace=False):
        return dict(scale=self.scale, initial_state=initial_state, output_final_state=True, cu_seqlens=cu_seqlens,
                    chunk_size=self.chunk_size, mode=mode, inplace_final_state=inplace)


def _mamba2_decay_params(module: nn.Module, num_heads: int) -> None:
    """alpha = exp(-exp(A_log) * softplus(W x + dt_bias)) (Mamba2), initialised as Mamba2 does."""
    module.A_log = nn.Parameter(torch.log(torch.empty(num_heads).uniform_(1, 16)))
    dt = torch.exp(torch.rand(num_heads) * (math.log(0.1) - math.log(0.001)) + math.log(0.001)).clamp_min(1e-4)
    module.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))  # inverse softplus
    module.A_log._no_weight_decay = True
    module.dt_bias._no_weight_decay = True


class DeltaNet(LinearMixer):
    """DeltaNet: S_t = (I - β k kᵀ) S_{t-1} + β k vᵀ, β = sigmoid(W_β x) (× 2 with ``allow_neg_eigval``)."""

    def __init__(self, hidden_size, num_heads, head_k_dim=None, head_v_dim=None, *, allow_neg_eigval=False, **kwargs):
        super().__init__(hidden_size, num_heads, head_k_dim, head_v_dim, **kwargs)
        self.allow_neg_eigval = allow_neg_eigval
        self.b_proj = nn.Linear(hidden_size, self.num_v_heads * self.kv_per_token, bias=False)

    decode_kernel = True
    grouped_value_heads = True

    def gate_projections(self):
        return ("b_proj",)

    def gates(self, x, mask, p=None):
        beta = _up(self.projected("b_proj", x, p)).sigmoid()
        return {"beta": 2 * beta if self.allow_neg_eigval else beta}

    def decode_gates(self, x, p=None):
        return {"a": None, "b": self.projected("b_proj", x, p), "beta_max": 2.0 if self.allow_neg_eigval else 1.0}

    def mix(self, q, k, v, gates, *, initial_state, cu_seqlens, mode, inplace=False):
        return ops.delta_rule(q, k, v, gates["beta"], **self._op_kwargs(initial_state, cu_seqlens, mode, inplace))


class GatedDeltaNet(DeltaNet):
    """Gated DeltaNet (GDN eq. 10): α from the Mamba2 parameterisation (A_log, dt_bias, softplus)."""

    def __init__(self, hidden_size, num_heads, head_k_dim=None, head_v_dim=None, **kwargs):
        super().__init__(hidden_size, num_heads, head_k_dim, head_v_dim, **kwargs)
        self.a_proj = nn.Linear(hidden_size, self.num_v_heads, bias=False)
        _mamba2_decay_params(self, self.num_v_heads)

    def gate_projections(self):
        return super().gate_projections() + ("a_proj",)

    def gates(self, x, mask, p=None):
        g = mamba2_log_decay(self.projected("a_proj", x, p), self.A_log, self.dt_bias)
        return {**super().gates(x, mask, p), "g": self.masked_log_gate(g, mask)}

    def decode_gates(self, x, p=None):
        return {**super().decode_gates(x, p), "a": self.projected("a_proj", x, p), "A_log": self.A_log,
                "dt_bias": self.dt_bias}

    def mix(self, q, k, v, gates, *, initial_state, cu_seqlens, mode, inplace=False):
        return ops.gated_delta_rule(q, k, v, gates["g"], gates["beta"],
                                    **self._op_kwargs(initial_state, cu_seqlens, mode, inplace))


class KDA(DeltaNet):
    """Kimi Delta Attention (``ops.kda``): S_t = (I - β k kᵀ) Diag(α_t) S_{t-1} + β k vᵀ, β = sigmoid(W_β x), with
    Kimi Linear's per-channel decay log α = -exp(A_log) softplus(W_up W_down x + dt_bias): ``A_log`` per head,
    ``dt_bias`` per key channel, W_down of rank ``head_v_dim`` (as fla's ``KimiDeltaAttention``, so that pruning
    key channels leaves it whole). With ``gate_lower_bound`` b < 0 (fla's ``lower_bound``) the decay is bounded
    instead: log α = b sigmoid(exp(A_log) (W_up W_down x + dt_bias)), in (b, 0). The block around it is the shared
    one, by default with a SiLU output gate; Kimi Linear's, a sigmoid through a low-rank map, is
    ``gate_act="sigmoid", output_gate_rank=head_v_dim`` (``rankdecay.models.from_fla`` sets them)."""

    decode_kernel = True  # ops.kda_decode: the gate, β, the norms and the step in one kernel
    grouped_value_heads = False

    def __init__(self, hidden_size, num_heads, head_k_dim=None, head_v_dim=None, *, gate_lower_bound=None, **kwargs):
        if gate_lower_bound is not None and not (isinstance(gate_lower_bound, (int, float)) and gate_lower_bound < 0):
            raise ValueError(f"gate_lower_bound must be None or a negative number, got {gate_lower_bound!r}")
        super().__init__(hidden_size, num_heads, head_k_dim, head_v_dim, **kwargs)
        self.gate_lower_bound = None if gate_lower_bound is None else float(gate_lower_bound)
        self.f_proj = nn.Sequential(nn.Linear(hidden_size, self.head_v_dim, bias=False),
                                    nn.Linear(self.head_v_dim, num_heads * self.head_k_dim, bias=False))
        _mamba2_decay_params(self, num_heads)
        self.dt_bias = nn.Parameter(self.dt_bias.detach().repeat_interleave(self.head_k_dim))  # per key channel
        self.dt_bias._no_weight_decay = True

    def gate_projections(self):
        return super().gate_projections() + ("f_proj.0",)

    def decode_op(self):
        return ops.kda_decode

    def _decay_projection(self, x, p):
        """W_up W_down x, [B, T, H, K] (the gate's pre-activation before dt_bias)."""
        B, T = x.shape[:2]
        return self.f_proj[1](self.projected("f_proj.0", x, p)).view(B, T, self.num_heads, self.head_k_dim)

    def decode_gates(self, x, p=None):
        return {**super().decode_gates(x, p), "a": self._decay_projection(x, p), "A_log": self.A_log,
                "dt_bias": self.dt_bias, "lower_bound": self.gate_lower_bound}

    def gates(self, x, mask, p=None):
        g = kda_log_decay(self._decay_projection(x, p), self.A_log, self.dt_bias, self.gate_lower_bound)
        return {**super().gates(x, mask, p), "g": self.masked_log_gate(g, mask)}  # g [B, T, H, K]

    def mix(self, q, k, v, gates, *, initial_state, cu_seqlens, mode, inplace=False):
        return ops.kda(q, k, v, gates["g"], gates["beta"], **self._op_kwargs(initial_state, cu_seqlens, mode, inplace))


class GatedDeltaProduct(GatedDeltaNet):
    """Gated DeltaProduct: ``num_householder`` keys, values and betas per token; ``use_forget_gate=False`` is
    DeltaProduct (no decay, and none of its parameters: fla's default)."""

    decode_kernel = True  # ops.gated_delta_product_decode: the gate, the β's, the norms and the n_h sub-steps
    grouped_value_heads = False

    def __init__(self, hidden_size, num_heads, head_k_dim=None, head_v_dim=None, *, num_householder=2,
                 use_forget_gate=True, **kwargs):
        if not isinstance(num_householder, int) or num_householder < 1:
            raise ValueError(f"num_householder must be a positive int, got {num_householder!r}")
        self.kv_per_token = num_householder
        self.use_forget_gate = use_forget_gate
        super().__init__(hidden_size, num_heads, head_k_dim, head_v_dim, **kwargs)
        if not use_forget_gate:
            del self.a_proj, self.A_log, self.dt_bias

    def gate_projections(self):
        return super().gate_projections() if self.use_forget_gate else DeltaNet.gate_projections(self)

    def gates(self, x, mask, p=None):
        gates = super().gates(x, mask, p) if self.use_forget_gate else {**DeltaNet.gates(self, x, mask, p), "g": None}
        gates["beta"] = self._sub_step_rows(gates["beta"])
        return gates

    def _sub_step_rows(self, b: torch.Tensor) -> torch.Tensor:
        """[B, T, n_h H] -> [B, T * n_h, H]: row t * n_h + j is sub-step j of token t."""
        B, T = b.shape[:2]
        return b.view(B, T, self.kv_per_token, self.num_heads).flatten(1, 2)

    def decode_op(self):
        return ops.gated_delta_product_decode

    def decode_gates(self, x, p=None):
        gates = super().decode_gates(x, p) if self.use_forget_gate else DeltaNet.decode_gates(self, x, p)
        return {**gates, "b": self._sub_step_rows(gates["b"]), "num_householder": self.kv_per_token}

    def mix(self, q, k, v, gates, *, initial_state, cu_seqlens, mode, inplace=False):
        return ops.gated_delta_product(q, k, v, gates["g"], gates["beta"], self.kv_per_token,
                                       **self._op_kwargs(initial_state, cu_seqlens, mode, inplace))


class GLA(LinearMixer):
    """Gated linear attention: per-channel log-decay logsigmoid(W2 W1 x) / 16 through a low-rank projection."""

    def __init__(self, hidden_size, num_heads, head_k_dim=None, head_v_dim=None, *, gate_low_rank_dim=16,
                 gate_logit_normalizer=16.0, qk_norm=None, **kwargs):
        super().__init__(hidden_size, num_heads, head_k_dim, head_v_dim, qk_norm=qk_norm, **kwargs)
        self.gate_logit_normalizer = gate_logit_normalizer
        self.gk_proj = nn.Sequential(nn.Linear(hidden_size, gate_low_rank_dim, bias=False),
                                     nn.Linear(gate_low_rank_dim, num_heads * self.head_k_dim, bias=True))

    def gate_projections(self):
        return ("gk_proj.0",)

    def gates(self, x, mask, p=None):
        B, T = x.shape[:2]
        g = logsigmoid_log_decay(self.gk_proj[1](self.projected("gk_proj.0", x, p)), self.gate_logit_normalizer)
        return {"g": self.masked_log_gate(g.view(B, T, self.num_heads, self.head_k_dim), mask)}

    def mix(self, q, k, v, gates, *, initial_state, cu_seqlens, mode, inplace=False):
        return ops.gla(q, k, v, gates["g"], **self._op_kwargs(initial_state, cu_seqlens, mode, inplace))


class SimpleGLA(LinearMixer):
    """Scalar-gated linear attention with the Mamba2 decay: S_t = α_t S_{t-1} + k vᵀ."""

    def __init__(self, hidden_size, num_heads, head_k_dim=None, head_v_dim=None, *, qk_norm=None, **kwargs):
        super().__init__(hidden_size, num_heads, head_k_dim, head_v_dim, qk_norm=qk_norm, **kwargs)
        self.a_proj = nn.Linear(hidden_size, num_heads, bias=False)
        _mamba2_decay_params(self, num_heads)

    def gate_projections(self):
        return ("a_proj",)

    def gates(self, x, mask, p=None):
        g = mamba2_log_decay(self.projected("a_proj", x, p), self.A_log, self.dt_bias)
        return {"g": self.masked_log_gate(g, mask)}

    def mix(self, q, k, v, gates, *, initial_state, cu_seqlens, mode, inplace=False):
        return ops.simple_gla(q, k, v, gates["g"], **self._op_kwargs(initial_state, cu_seqlens, mode, inplace))


class LinearAttention(LinearMixer):
    """Linear attention without decay: S_t = S_{t-1} + k vᵀ (normalised by the output RMSNorm)."""

    def __init__(self, hidden_size, num_heads, head_k_dim=None, head_v_dim=None, *, qk_norm=None, **kwargs):
        super().__init__(hidden_size, num_heads, head_k_dim, head_v_dim, qk_norm=qk_norm, **kwargs)

    def mix(self, q, k, v, gates, *, initial_state, cu_seqlens, mode, inplace=False):
        return ops.linear_attn(q, k, v, **self._op_kwargs(initial_state, cu_seqlens, mode, inplace))


class HDLA(LinearMixer):
    """Householder-diagonalised linear attention (HDLA eq. 27) with the block of its App. C.1.

    λ = sigmoid(W_λ x) per key channel (eq. 6), β = 2 sigmoid(W_β x) in (0, 2) (§3.1.2);
    q, k, v through SiLU (eq. 25), only k L2-normalised (eq. 26), and a linear output
    gate o = y ⊙ (W_g x) without output norm (eqs. 29-30). Each is a flag here.

    ``gate_logit_normalizer`` τ: λ = sigmoid(W_λ x)^(1/τ), GLA's form (the paper makes λ
    "analogous to GLA's" decay). The default τ = 16 is GLA's: λ starts near 0.96 per token.
    τ = 1 is eq. 6 as written: λ starts near 1/2, a memory of a few tokens, and on MQAR such
    a model had learned next to nothing where τ = 16 had learned it (RESULTS.md).
    """

    def __init__(self, hidden_size, num_heads, head_k_dim=None, head_v_dim=None, *, allow_neg_eigval=True,
                 qk_norm="k", output_norm=False, gate_act=None, gate_logit_normalizer=16.0, **kwargs):
        super().__init__(hidden_size, num_heads, head_k_dim, head_v_dim, qk_norm=qk_norm, output_norm=output_norm,
                         gate_act=gate_act, **kwargs)
        if not gate_logit_normalizer > 0:
            raise ValueError(f"gate_logit_normalizer must be > 0, got {gate_logit_normalizer!r}")
        self.allow_neg_eigval = allow_neg_eigval
        self.gate_logit_normalizer = float(gate_logit_normalizer)
        self.lambda_proj = nn.Linear(hidden_size, num_heads * self.head_k_dim, bias=True)
        self.b_proj = nn.Linear(hidden_size, num_heads, bias=False)

    decode_kernel = True  # ops.hdla_decode: k's norm, λ, β and the step in one kernel
    decode_qk_norm = "k"

    def decode_op(self):
        return ops.hdla_decode

    def decode_gates(self, x, p=None):
        B, T = x.shape[:2]
        return {"a": self.projected("lambda_proj", x, p).view(B, T, self.num_heads, self.head_k_dim),
                "b": self.projected("b_proj", x, p), "gate_logit_normalizer": self.gate_logit_normalizer,
                "beta_max": 2.0 if self.allow_neg_eigval else 1.0}

    def gate_projections(self):
        return ("lambda_proj", "b_proj")

    def gates(self, x, mask, p=None):
        B, T = x.shape[:2]
        g = logsigmoid_log_decay(self.projected("lambda_proj", x, p), self.gate_logit_normalizer)  # log λ
        g = g.view(B, T, self.num_heads, self.head_k_dim)
        beta = _up(self.projected("b_proj", x, p)).sigmoid()
        return {"g": self.masked_log_gate(g, mask), "beta": 2 * beta if self.allow_neg_eigval else beta}

    def mix(self, q, k, v, gates, *, initial_state, cu_seqlens, mode, inplace=False):
        return ops.hdla(q, k, v, gates["g"], gates["beta"], **self._op_kwargs(initial_state, cu_seqlens, mode, inplace))


class HeadInHead(GatedDeltaNet):
    """Head-in-Head over DeltaNet (``gated=False``, HH-DN) or Gated DeltaNet (HH-GDN).

    Each head's key channels form ``rank`` groups; the transition is
    α(I − β (k kᵀ ⊙ expand(M))) with M = N Nᵀ, N the row-L2-normalised softplus of
    M_org (paper §3.3). ``mask="static"`` learns M_org [H, r, r]; ``mask="data"``
    projects it from x per token. M_org starts constant, so M starts as all ones:
    the model starts as its r = 1 baseline.
    """

    decode_kernel = True  # ops.hh_delta_rule_decode: the norms, the gates, the mask and the step in one kernel
    grouped_value_heads = False

    def decode_op(self):
        return ops.hh_delta_rule_decode

    def decode_gates(self, x, p=None):
        gates = {**DeltaNet.decode_gates(self, x, p), "a": None}
        if self.gated:
            gates.update(a=self.projected("a_proj", x, p), A_log=self.A_log, dt_bias=self.dt_bias)
        if self.mask_kind == "static":
            m_org = self.mask_org
        else:
            B, T = x.shape[:2]
            m_org = self.projected("mask_proj", x, p).view(B, T, self.num_heads, self.rank, self.rank)
        return {**gates, "m_org": m_org}

    def __init__(self, hidden_size, num_heads, head_k_dim=None, head_v_dim=None, *, rank=4, mask="static",
                 gated=True, **kwargs):
        super().__init__(hidden_size, num_heads, head_k_dim, head_v_dim, **kwargs)
        if not isinstance(rank, int) or rank < 1 or self.head_k_dim % rank:
            raise ValueError(f"Head-in-Head rank r = {rank!r} must be a positive int dividing head_k_dim = {self.head_k_dim}")
        if mask not in ("static", "data"):
            raise ValueError(f"mask must be 'static' or 'data', got {mask!r}")
        self.rank, self.mask_kind, self.gated = rank, mask, gated
        if mask == "static":
            self.mask_org = nn.Parameter(torch.zeros(num_heads, rank, rank))
        else:
            self.mask_proj = nn.Linear(hidden_size, num_heads * rank * rank, bias=True)
            self.mask_proj._zero_init = True  # model initialisers keep it at zero: M starts as all ones
            nn.init.zeros_(self.mask_proj.weight)
            nn.init.zeros_(self.mask_proj.bias)
        if not gated:
            del self.a_proj, self.A_log, self.dt_bias

    def gate_projections(self):
        mask = ("mask_proj",) if self.mask_kind == "data" else ()
        return (("b_proj", "a_proj") if self.gated else ("b_proj",)) + mask

    def gates(self, x, mask, p=None):
        gates = DeltaNet.gates(self, x, mask, p)
        if self.gated:
            g = mamba2_log_decay(self.projected("a_proj", x, p), self.A_log, self.dt_bias)
            gates["g"] = self.masked_log_gate(g, mask)
        r = self.rank
        if self.mask_kind == "static":
            m_org = self.mask_org
        else:
            B, T = x.shape[:2]
            m_org = self.projected("mask_proj", x, p).view(B, T, self.num_heads, r, r)
        gates["mask"] = ops.head_in_head_mask(F.softplus(_up(m_org)))
        return gates

    def mix(self, q, k, v, gates, *, initial_state, cu_seqlens, mode, inplace=False):
        return ops.hh_delta_rule(q, k, v, gates["beta"], gates["mask"], gates.get("g"),
                                 **self._op_kwargs(initial_state, cu_seqlens, mode, inplace))

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rank={self.rank}, mask={self.mask_kind}, gated={self.gated}"
