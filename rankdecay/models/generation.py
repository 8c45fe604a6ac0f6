"""Fast decoding: the whole model's one-token step captured once as a CUDA graph.

A recurrent model's decode step is a few dozen small kernels per layer whose launches,
not their work, set the time per token at small batch (the state is fixed-size, so the
work is tiny). Captured as a CUDA graph the step is one launch (Mamba's ``cg=True``)::

    from rankdecay.models import GraphDecoder

    decoder = GraphDecoder(model)                 # CUDA graph on a GPU, the same steps eagerly on a CPU
    out = decoder.generate(input_ids, attention_mask=mask, max_new_tokens=64)   # [B, T + new]
    out = model.generate(input_ids, attention_mask=mask, max_new_tokens=64, graph_decoder=True)  # the same

The prompt is prefilled eagerly (the chunked kernels). The cache is then copied into
static buffers, and the step ``logits = model(token, cache); cache <- new cache`` is
recorded once per batch size and replayed per token; the copy back into the buffers is
part of the graph. Each layer's linear maps of one input (a mixer's q, k, v, output gate and gates; the
SwiGLU's gate and up) are packed into one product for the step (``rankdecay.layers.packing``), and its short
convolutions take one kernel that shifts their states in place (``rankdecay.ops.triton.conv``). Sliding-window
attention's cache is its ring of ``window`` slots
(``SlidingWindowAttention.ring_cache``), written in place, so every buffer keeps its shape
from step to step.

``generate`` follows ``transformers``' ``model.generate`` for what it supports: greedy
or sampled (``temperature``, ``top_k``, ``top_p``, through transformers' logits warpers),
``eos_token_id`` / ``pad_token_id``, left-padded batches with ``attention_mask``, and it
returns the prompt followed by the new tokens.
"""
from __future__ import annotations

import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from ..layers.cache import Cache
from ..layers.packing import PackedLinears, packable
from ..ops._inputs import check_cu_seqlens
from .modeling import output_cache


def _leaves(x) -> list[torch.Tensor]:
    """The tensors of a cache entry (dicts, tuples, lists, None) in a fixed order."""
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, dict):
        return [t for key in sorted(x) for t in _leaves(x[key])]
    if isinstance(x, (tuple, list)):
        return [t for item in x for t in _leaves(item)]
    return []


def _clone(x):
    """A copy of a cache entry with fresh, contiguous tensors (the static buffers). Contiguous whatever the prompt
    left: a short convolution's state is a view into its prompt, with strides that follow the prompt's length, and
    the compiled step would otherwise be compiled again for every prompt length."""
    if isinstance(x, torch.Tensor):
        return x.clone(memory_format=torch.contiguous_format)
    if isinstance(x, dict):
        return {key: _clone(value) for key, value in x.items()}
    if isinstance(x, (tuple, list)):
        return type(x)(_clone(item) for item in x)
    return x


def _setting(value, config, name: str, fallback):
    """``value``, else the generation config's, else transformers' default."""
    if value is not None:
        return value
    return fallback if getattr(config, name, None) is None else getattr(config, name)


class GraphDecoder:
    """Token-by-token decoding of a ``RankDecayForCausalLM`` with the step as a CUDA graph.

    Args:
        model: the language model (any mixer, hybrids with sliding-window attention too).
        cuda_graph: record and replay the step as a CUDA graph. Default: when the model
            is on a GPU. ``False`` runs the very same static-buffer steps eagerly (CPU).
        compile: run the step through ``torch.compile`` (before the capture, with ``cuda_graph``).
            Inductor fuses the step's small elementwise kernels (casts, norms, the short
            convolutions' steps, gates, residual adds, the copy of the cache back into its buffers),
            so the graph replays fewer kernels. The first step of each batch size then compiles
            (tens of seconds for the 340m preset); the tokens are those of the uncompiled step up to
            the rounding of the fused kernels. On a CPU, inductor needs a C++ compiler (g++ or clang++).
            Decoders of models of the same structure and batch size share one compiled step; a process keeps
            up to ``torch._dynamo.config.recompile_limit`` (8) different ones, and runs any more uncompiled.
        pack_projections: take each layer's linear maps of one input as one matrix product in the step (a
            mixer's q, k, v, output gate and gates; the SwiGLU's gate and up): a one-token step's products are
            bound by their launches, not their weights (the 340m preset's took 1.52 -> 0.80 ms per step in a
            CUDA graph on an H200). It keeps a copy of those weights (214M of the 340m preset's 341M parameters:
            408 MiB in bf16), taken again at each ``prefill`` where a weight changed. At B = 1 on a GPU the packed
            products and the layers' output maps take a one-row Triton kernel (``ops.triton.gemv``); ``False``
            turns both off.
        max_length: the most tokens a row will hold, its prompt (with its left padding) and the new tokens, as
            transformers' ``max_cache_len``. Sliding-window attention's rings then take ``min(window, max_length)``
            slots, not the window's: with a window of 2048, 64 rows of a 128-token prompt and 64 new tokens keep
            rings of 192 slots, not 2048 (the 340m GDN-H1's 12 rings: 0.6 GiB in bf16, not 6.0). ``prefill``
            refuses a prompt of ``max_length`` tokens or more, and ``step`` / ``generate`` raise before a row would
            pass it. Default None: rings of the window, and no bound. A model with full attention layers (no
            window: ``swa_window=None``) needs it: their rings hold ``max_length`` slots.

    Each ``prefill`` records the step again where a parameter of the model has moved (``model.to``, a load with
    ``assign=True``), so the graph never reads a freed weight; weights changed in place are read as they are.

    One graph is kept for the last batch size and dtype seen; a new batch size records a
    new one (a few eager warm-up steps and the capture: milliseconds to a second).
    """

    def __init__(self, model, cuda_graph: bool | None = None, compile: bool = False, pack_projections: bool = True,
                 max_length: int | None = None):
        device = next(model.parameters()).device
        if cuda_graph is None:
            cuda_graph = device.type == "cuda"
        if cuda_graph and device.type != "cuda":
            raise ValueError(f"cuda_graph=True needs the model on a CUDA device; it is on {device}")
        if not isinstance(compile, bool):
            raise ValueError(f"compile must be True or False, got {compile!r}")
        if not isinstance(pack_projections, bool):
            raise ValueError(f"pack_projections must be True or False, got {pack_projections!r}")
        if max_length is not None and (isinstance(max_length, bool) or not isinstance(max_length, int)
                                       or max_length < 2):
            raise ValueError(f"max_length must be an int >= 2 (a prompt token and a new one) or None, "
                             f"got {max_length!r}")
        if max_length is None and None in _attention_windows(model):
            raise ValueError("the model has full attention layers (no window), whose keys a decoder keeps in rings "
                             "of max_length slots: give max_length (the most tokens a row will hold)")
        self.max_length, self._room = max_length, None  # _room: the steps left before max_length
        self.model, self.device, self.cuda_graph = model, device, bool(cuda_graph)
        self.pack_projections = pack_projections
        self._packs = None  # per layer {"mixer": PackedLinears | None, "mlp": ...}, built at the first prefill
        # dynamic=False: the step's shapes are fixed per batch size (a new one compiles again)
        self._compiled = torch.compile(self._forward, dynamic=False) if compile else None
        self._key = None
        self._graph = None

    # -- the step ---------------------------------------------------------------------------

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
        """Run the prompt ``input_ids [B, T]`` (``attention_mask [B, T]``, 0 at left padding) and
        load its cache into the step's buffers. Returns the last position's logits ``[B, vocab]``.

        ``cu_seqlens`` ([N + 1], each prompt at least one token): N prompts packed along T in ``input_ids [1, T]``,
        no padding; the steps then continue them as a batch of N (``step(token [N])``), and the logits returned
        are each prompt's last ``[N, vocab]``."""
        if input_ids.dim() != 2 or input_ids.shape[1] < 1:
            raise ValueError(f"input_ids must have shape [B, T] with T >= 1, got {list(input_ids.shape)}")
        rows, longest = input_ids.shape
        if cu_seqlens is not None:
            rows, lengths = check_cu_seqlens(cu_seqlens, rows, input_ids.shape[1])
            if min(lengths) < 1:
                raise ValueError(f"every packed prompt needs at least one token, got cu_seqlens {cu_seqlens.tolist()}")
            longest = max(lengths)
        if self.max_length is not None and longest >= self.max_length:
            raise ValueError(f"a prompt of {longest} tokens leaves no room for a new one under max_length = "
                             f"{self.max_length}")
        out = self.model(input_ids, attention_mask=attention_mask, use_cache=True, cu_seqlens=cu_seqlens,
                         return_dict=True)
        cache = output_cache(out)
        layers = [self._static_shape(i, entry) for i, entry in enumerate(cache.layers)]
        self._pack()
        key = (rows, tuple((tuple(t.shape), t.dtype) for entry in layers for t in _leaves(entry)), self._addresses())
        if key != self._key:
            self._build(rows, layers)
            self._key = key
        self._load(layers)
        self._cache.seen_tokens = cache.seen_tokens
        self._room = None if self.max_length is None else self.max_length - longest
        if cu_seqlens is not None:
            return out.logits[0, cu_seqlens[1:].to(out.logits.device) - 1]
        return out.logits[:, -1]

    @torch.no_grad()
    def step(self, token: torch.Tensor) -> torch.Tensor:
        """Feed one token per row (``token [B]``); returns the next logits ``[B, vocab]``.
        The returned tensor is a static buffer: the next ``step`` overwrites it."""
        if self._key is None:
            raise RuntimeError("call prefill(input_ids) before step()")
        if token.shape != (self._key[0],):
            raise ValueError(f"token must have shape [B] = [{self._key[0]}], got {list(token.shape)}")
        if self._room is not None:
            if self._room <= 0:
                raise RuntimeError(f"max_length = {self.max_length} reached: the rows hold that many tokens (a "
                                   "sliding-window ring of that size would write over one still in its window); "
                                   "prefill again, or make the decoder with a larger max_length")
            self._room -= 1
        self._ids.copy_(token[:, None])
        if self._graph is not None:
            self._graph.replay()
        else:
            self._run()
        self._cache.seen_tokens += 1
        return self._logits

    def _pack(self) -> None:
        """Build the layers' packs (the first time) or copy changed weights into them."""
        if not self.pack_projections:
            return
        layers = [{"mixer": layer.mixer, "mlp": layer.mlp} for layer in self.model.model.layers]
        if self._packs is None or len(self._packs) != len(layers):
            self._packs = [{"mixer": None, "mlp": None} for _ in layers]
        for packs, layer in zip(self._packs, layers):
            for part, module in layer.items():
                names = module.input_projections() if hasattr(module, "input_projections") else ()
                old = packs[part]
                if not packable(module, names):  # e.g. a map wrapped (LoRA) or cast on its own since
                    packs[part] = None
                elif old is None or old.module is not module or old.names != tuple(names):
                    packs[part] = PackedLinears(module, names)  # first use, or the module was replaced
                else:
                    old.refresh()

    def _addresses(self) -> tuple[int, ...]:
        """Where every tensor the step reads lives: the model's parameters and buffers and the packs."""
        packed = [p for packs in self._packs or [] for p in packs.values() if p is not None]
        return (tuple(t.data_ptr() for t in self.model.parameters()) + tuple(t.data_ptr() for t in self.model.buffers())
                + tuple(t.data_ptr() for p in packed for t in (p.weight, p.bias) if t is not None))

    def _static_shape(self, i: int, entry):
        mixer = self.model.model.layers[i].mixer
        if not hasattr(mixer, "ring_cache"):
            return entry
        return mixer.ring_cache(entry, min(mixer.window_size or self.max_length, self.max_length or mixer.window_size))

    def _build(self, B: int, layers: list) -> None:
        """Allocate the static buffers and, with ``cuda_graph``, record the step."""
        self._graph = None
        self._buffers = [_clone(entry) for entry in layers]
        self._cache = Cache(len(layers))
        self._cache.layers = list(self._buffers)
        self._cache.projections = self._packs
        self._ids = torch.zeros(B, 1, dtype=torch.long, device=self.device)
        self._logits = None
        self._run(check=True)  # also the first compile of every kernel
        if not self.cuda_graph:
            return
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm-up on a side stream, as torch.cuda.graphs asks
                self._run()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        self._graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self._graph):
            self._run()

    def _forward(self, check: bool = False) -> torch.Tensor:
        """The model on the buffers, then its new cache copied into them; the last logits [B, vocab]."""
        out = self.model(self._ids, past_key_values=self._cache, use_cache=True, return_dict=True)
        for i, (old, new) in enumerate(zip(self._buffers, self._cache.layers)):
            olds, news = _leaves(old), _leaves(new)
            if check and [t.shape for t in olds] != [t.shape for t in news]:
                raise RuntimeError(f"layer {i}'s cache changes shape from step to step "
                                   f"({[list(t.shape) for t in olds]} -> {[list(t.shape) for t in news]}); "
                                   "a CUDA graph needs a fixed-size cache")
            for dst, src in zip(olds, news):
                if src is not dst:  # SWA's ring is written in place
                    dst.copy_(src)
        return out.logits[:, -1]

    def _run(self, check: bool = False) -> None:
        """The recorded step (the first one, with ``check``, uncompiled)."""
        seen = self._cache.seen_tokens  # the forward counts the token; step() does, once per replay
        if check or self._compiled is None:
            logits = self._forward(check)
        else:
            # positions live in the cache's tensors: the count the compiled step sees stays the same, so that it
            # is not compiled again for every token
            self._cache.seen_tokens = 0
            logits = self._compiled()
        self._cache.seen_tokens = seen
        self._cache.layers = list(self._buffers)
        if self._logits is None:
            self._logits = logits.clone()
        else:
            self._logits.copy_(logits)

    def _load(self, layers: list) -> None:
        for buffer, entry in zip(self._buffers, layers):
            for dst, src in zip(_leaves(buffer), _leaves(entry)):
                dst.copy_(src)
        self._cache.layers = list(self._buffers)

    # -- generation -------------------------------------------------------------------------

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor | list[torch.Tensor], attention_mask: torch.Tensor | None = None, *,
                 max_new_tokens: int = 32, do_sample: bool = False, temperature: float | None = None,
                 top_k: int | None = None, top_p: float | None = None, eos_token_id: int | list[int] | None = None,
                 pad_token_id: int | None = None, generator: torch.Generator | None = None,
                 streamer=None) -> torch.Tensor | list[torch.Tensor]:
        """Continue ``input_ids [B, T]`` by ``max_new_tokens``; returns ``[B, T + n]`` (n is
        smaller when every row has ended with an EOS token; ended rows are padded with
        ``pad_token_id``). Defaults for ``eos_token_id`` / ``pad_token_id`` come from the
        model's generation config, and so do ``temperature``, ``top_k`` and ``top_p`` when
        None (transformers' defaults: 1.0, 50, 1.0). Greedy unless ``do_sample``.
        ``streamer``: a transformers streamer (``TextStreamer``, ``TextIteratorStreamer``): given the prompt, then
        each new token ``[B]`` as it is chosen, then ``end()``, as ``model.generate`` does.

        ``input_ids`` may also be a list of N prompts (1-D token tensors of any lengths, at least one token each):
        they are prefilled packed (``cu_seqlens``, no padding and no mask) and decoded as a batch of N. Returns a
        list: each prompt followed by its new tokens, up to and with its EOS token (no padding)."""
        if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be a non-negative int, got {max_new_tokens!r}")
        prompts = None
        if isinstance(input_ids, (list, tuple)):
            prompts = list(input_ids)
            if not prompts or any(not isinstance(x, torch.Tensor) or x.dim() != 1 or x.numel() < 1 for x in prompts):
                raise ValueError("a list of prompts must hold 1-D token tensors of at least one token each")
            if attention_mask is not None:
                raise ValueError("a list of prompts is packed, not padded: give no attention_mask")
            if streamer is not None and len(prompts) > 1:
                raise ValueError("a streamer takes one row: give one prompt, or a [1, T] tensor")
            lengths = torch.tensor([0] + [x.numel() for x in prompts])
            cu_seqlens = lengths.cumsum(0).to(self.device)
            input_ids = torch.cat(prompts).to(self.device)[None]
        longest = input_ids.shape[-1] if prompts is None else max(x.numel() for x in prompts)
        if self.max_length is not None and longest + max_new_tokens > self.max_length:
            raise ValueError(f"a prompt of {longest} tokens and max_new_tokens = {max_new_tokens} pass the decoder's "
                             f"max_length = {self.max_length}")
        config = self.model.generation_config
        eos = config.eos_token_id if eos_token_id is None else eos_token_id
        eos = torch.tensor([eos] if isinstance(eos, int) else list(eos or []), device=self.device)
        pad = pad_token_id if pad_token_id is not None else config.pad_token_id
        if eos.numel() and pad is None:
            if prompts is None:
                raise ValueError("pad_token_id is needed to fill rows that ended (or give eos_token_id=[])")
            pad = int(eos[0])  # a list's rows end at their EOS: the filler is never returned
        warpers = LogitsProcessorList()
        if do_sample:
            temperature = _setting(temperature, config, "temperature", 1.0)
            top_k, top_p = _setting(top_k, config, "top_k", 50), _setting(top_p, config, "top_p", 1.0)
            if temperature <= 0:
                raise ValueError(f"temperature must be > 0 when sampling, got {temperature}")
            if temperature != 1.0:
                warpers.append(TemperatureLogitsWarper(temperature))
            if top_k:
                warpers.append(TopKLogitsWarper(top_k))
            if top_p is not None and top_p < 1.0:
                warpers.append(TopPLogitsWarper(top_p))
        tokens = [input_ids if prompts is None else input_ids.new_zeros(len(prompts), 0)]
        if streamer is not None:
            streamer.put(input_ids.cpu())
        if max_new_tokens == 0:
            if streamer is not None:
                streamer.end()
            return input_ids if prompts is None else [x.clone() for x in prompts]
        logits = self.prefill(input_ids, attention_mask, None if prompts is None else cu_seqlens)
        done = torch.zeros(logits.shape[0], dtype=torch.bool, device=self.device)
        for i in range(max_new_tokens):
            if do_sample:
                probs = warpers(torch.cat(tokens, 1), logits.float()).softmax(-1)
                nxt = torch.multinomial(probs, 1, generator=generator)[:, 0]
            else:
                nxt = logits.argmax(-1)
            if eos.numel():
                nxt = torch.where(done, pad, nxt)
                done = done | torch.isin(nxt, eos)
            tokens.append(nxt[:, None])
            if streamer is not None:
                streamer.put(nxt.cpu())
            if i + 1 == max_new_tokens or (eos.numel() and bool(done.all())):
                break
            logits = self.step(nxt)
        if streamer is not None:
            streamer.end()
        if prompts is None:
            return torch.cat(tokens, 1)
        new = torch.cat(tokens, 1)  # [N, n]
        ended = torch.isin(new, eos) if eos.numel() else torch.zeros_like(new, dtype=torch.bool)
        # each row up to and with its first EOS token
        kept = torch.where(ended.any(1), ended.int().argmax(1) + 1, new.shape[1]).tolist()
        return [torch.cat([x, row[:n].to(x.device)]) for x, row, n in zip(prompts, new, kept)]


# what ``model.generate(graph_decoder=True)`` takes from a generation config; the rest must keep its default
_GRAPH_SETTINGS = ("max_new_tokens", "max_length", "do_sample", "temperature", "top_k", "top_p", "eos_token_id",
                   "pad_token_id", "bos_token_id", "use_cache", "output_attentions", "output_hidden_states")
_GRAPH_BOOKKEEPING = {"_from_model_config", "transformers_version"}  # a config's own records, not settings


def _attention_windows(model) -> list[int | None]:
    """The windows of the model's attention layers (None: full attention)."""
    return [layer.mixer.window_size for layer in model.model.layers if hasattr(layer.mixer, "ring_cache")]


def _ring_length(model, needed: int) -> int | None:
    """The ``max_length`` of the decoder ``generate(graph_decoder=True)`` keeps (uncompiled): ``needed`` rounded up
    to a power of two, and to 64 at least (the SWA step's kernel walks 64 slots a program: a shorter ring is one
    block either way), so that sliding-window rings hold the generation, not the window, and a later call needs a
    new decoder (a new capture: milliseconds to a second) only where it holds more than any before: with a window
    of 2048 at most five times (64 ... 1024). None (rings of the window, no bound) where the model has no such ring
    or the power of two reaches its largest window; never None with a full attention layer (no window)."""
    windows = _attention_windows(model)
    length = max(64, 1 << (needed - 1).bit_length())
    return length if windows and (None in windows or length < max(windows)) else None


def graph_generate(model, inputs, generation_config, compile: bool, kwargs: dict) -> torch.Tensor:
    """``RankDecayForCausalLM.generate(graph_decoder=True)``: the generation config's settings through the decoder
    kept on the model (``model._graph_decoder``, built again where ``compile`` changed)."""
    import copy

    kwargs = dict(kwargs)
    input_ids = inputs if inputs is not None else kwargs.pop("input_ids", None)
    if not isinstance(input_ids, torch.Tensor):
        raise ValueError("generate(graph_decoder=True) needs input_ids [B, T] (as inputs or input_ids=)")
    attention_mask = kwargs.pop("attention_mask", None)
    streamer = kwargs.pop("streamer", None)
    config = copy.deepcopy(generation_config if generation_config is not None else model.generation_config)
    unused = config.update(**kwargs)
    if unused:
        raise ValueError(f"generate(graph_decoder=True) does not take {sorted(unused)}; it takes input_ids, "
                         f"attention_mask, streamer and the settings {sorted(_GRAPH_SETTINGS)}")
    other = sorted(set(config.to_diff_dict()) - set(_GRAPH_SETTINGS) - _GRAPH_BOOKKEEPING)
    if other:
        raise ValueError(f"generate(graph_decoder=True) cannot honour {other} (set in the arguments or the "
                         f"generation config); it takes {sorted(_GRAPH_SETTINGS)}")
    max_new = config.max_new_tokens
    if max_new is None:  # transformers' rule: max_length counts the prompt
        max_new = max(config.max_length - input_ids.shape[1], 0)
    needed = input_ids.shape[1] + max(max_new, 1)  # what the rows will hold (a prompt alone still prefills)
    decoder = model.__dict__.get("_graph_decoder")
    if (decoder is None or (decoder._compiled is not None) != compile
            or (decoder.max_length is not None and needed > decoder.max_length)):
        # compiled, a new ring size compiles the step again (tens of seconds, and towards the recompile limit):
        # rings of the window, as GraphDecoder makes them, unless the caller makes one with max_length (full
        # attention has no window: rings of the generation, compiled again for each power of two)
        length = _ring_length(model, needed)
        decoder = GraphDecoder(model, compile=compile,
                               max_length=None if compile and None not in _attention_windows(model) else length)
        model.__dict__["_graph_decoder"] = decoder
    return decoder.generate(input_ids, attention_mask, max_new_tokens=max_new, do_sample=bool(config.do_sample),
                            temperature=config.temperature, top_k=config.top_k, top_p=config.top_p,
                            eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id, streamer=streamer)
