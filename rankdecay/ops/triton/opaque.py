"""The Triton ops as opaque operators of a ``torch.compile`` graph (``torch.library`` custom ops), so that a compiled
model takes them whole, ``fullgraph=True`` included.

Traced by Dynamo, the kernels' launches would be handed to inductor, which launches user kernels with arguments
typed its own way (None for pointers a constexpr flag leaves unread, fp64 for Python floats) that did not compile
(BENCHMARKS.md session 63). So the entry points run their Python and kernels as written, inside two generic
operators:

- ``rankdecay::opaque_forward(name, tensors, statics) -> Tensor[]`` runs a registered function, or the forward of a
  registered ``torch.autograd.Function``: its outputs, then the tensors it saved for its backward (those that are
  inputs or views of them, or of its outputs, as descriptors instead: an operator's outputs may not alias its
  inputs or each other), then a small CPU tensor with its context's attributes and those descriptors;
- ``rankdecay::opaque_backward(...)`` rebuilds that context and runs the Function's backward.

Their fake implementations (the shapes a graph is traced with) run the same Python with every Triton launch made a
no-op (``shapes_only``): the same decisions, the same allocations, as fake tensors; nothing is written twice.
``compiling()`` says whether a call is being traced (and not already running inside one of these operators), which
is when ``OpaqueFunction.apply`` and ``opaque`` take the operators; eagerly they call straight
through, at no cost.

The fake runs read no size as a number (``_meta`` leaves the descriptors' sizes unread there), so a dynamic sequence
length stays a symbol of the graph: a compiled model takes every new length in the graph it compiled at the second
(until session 73 each length became a constant, and each new one compiled again). Limits: non-tensor arguments are
baked into the graph as constants (``ops``' default ``scale`` is made one: ``_inputs.resolve_scale``), and the
precision query (``chunk_state._precision``) is read once when the graph is traced (``matmul_precision``).
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import json
import threading

import torch

from ..backends import needs_grad

_LOCAL = threading.local()  # .inside: running an operator's body; .shapes_only: its fake (shape-only) run
_FUNCTIONS: dict[str, "OpaqueFunction"] = {}  # name -> the registered autograd Function
_CALLS: dict[str, tuple] = {}  # name -> (function, outputs)


def compiling() -> bool:
    """Whether this call is being traced by ``torch.compile`` (and not already inside an opaque operator's body)."""
    return torch.compiler.is_compiling() and not getattr(_LOCAL, "inside", False)


def shapes_only() -> bool:
    """Whether this is an operator's fake run: tensors are fake, launches are no-ops, nothing may be cached."""
    return getattr(_LOCAL, "shapes_only", False)


_PATCHED = False


def _patch_launches() -> None:
    """Makes ``kernel[grid](...)`` a no-op in a thread's fake runs (once, for every Triton kernel: the launch
    goes through ``KernelInterface.__getitem__``, JIT, interpreted or autotuned alike)."""
    global _PATCHED
    if _PATCHED:
        return
    from triton.runtime.jit import KernelInterface

    launch = KernelInterface.__getitem__

    def getitem(self, grid):
        if getattr(_LOCAL, "shapes_only", False):
            return lambda *args, **kwargs: None
        return launch(self, grid)

    KernelInterface.__getitem__ = getitem
    _PATCHED = True


@contextlib.contextmanager
def _body(fake: bool):
    was = getattr(_LOCAL, "inside", False), getattr(_LOCAL, "shapes_only", False)
    if fake:
        _patch_launches()
    _LOCAL.inside, _LOCAL.shapes_only = True, fake
    try:
        with torch.no_grad():
            yield
    finally:
        _LOCAL.inside, _LOCAL.shapes_only = was


@torch.compiler.assume_constant_result
def matmul_precision() -> str:
    """``torch.get_float32_matmul_precision()``, a constant of a traced graph (traced, the query broke the graph
    on torch 2.11 and returned a fresh string each call: session 64)."""
    return torch.get_float32_matmul_precision()


# ---- non-tensor arguments, as one string argument of the operators ----

def _static(x):
    if isinstance(x, torch.dtype):
        return {"dtype": str(x).removeprefix("torch.")}
    if isinstance(x, torch.device):
        return {"device": str(x)}
    if isinstance(x, (tuple, list)):
        return [_static(y) for y in x]
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    if isinstance(x, dict):
        return {"dict": {k: _static(v) for k, v in x.items()}}
    raise TypeError(f"an opaque operator's non-tensor argument must be a constant (bool, int, float, str, dtype, "
                    f"device, or a list, tuple or dict of them); got {type(x).__name__}")


def _unstatic(x):
    if isinstance(x, dict):
        if "dtype" in x:
            return getattr(torch, x["dtype"])
        if "device" in x:
            return torch.device(x["device"])
        return {k: _unstatic(v) for k, v in x["dict"].items()}
    if isinstance(x, list):
        return [_unstatic(y) for y in x]
    return x


@torch.compiler.assume_constant_result
def _encode(*statics) -> str:
    return json.dumps([_static(s) for s in statics])


def _split(args) -> tuple[list, str]:
    """Arguments -> (their tensors, each once: autograd Functions traced by Dynamo may not take one tensor twice;
    the rest and where each tensor goes, as one string)."""
    unique, positions, statics = [], [], []
    for a in args:
        if isinstance(a, torch.Tensor):
            for j, u in enumerate(unique):
                if u is a:
                    break
            else:
                j = len(unique)
                unique.append(a)
            positions.append(j)
            statics.append(None)
        else:
            if isinstance(a, (torch.SymInt, torch.SymFloat, torch.SymBool)):
                raise TypeError("a non-tensor argument of the Triton ops is symbolic under torch.compile (a scale "
                                "computed from a dynamic size?): pass a Python constant, or keep that size static "
                                "(torch._dynamo.mark_static)")
            positions.append(-1)
            statics.append(("", a))  # ("", a): a constant, even None
    return unique, _encode(positions, *statics)


def _join(tensors, statics: str) -> tuple[list, list[int]]:
    """``_split`` undone: (the arguments, the index of each one's tensor in ``tensors`` or -1)."""
    positions, *rest = json.loads(statics)
    return [tensors[j] if s is None else _unstatic(s[1]) for j, s in zip(positions, rest)], positions


def same_memory(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Whether x and y start at the same address (``data_ptr``, which a fake tensor has not: there, the same storage
    and offset)."""
    if shapes_only():
        return _storage(x) == _storage(y) and x.storage_offset() == y.storage_offset()
    return x.data_ptr() == y.data_ptr()


# ---- descriptors of saved tensors that alias inputs, outputs or each other ----

def _storage(x: torch.Tensor) -> int:
    return x.untyped_storage()._cdata


def _describe(saved, inputs, outs):
    """(tensors to return, descriptor ints): each saved tensor is returned as itself, or described as a view
    (kind, index, ndim, size, stride, offset) of an input (kind 1), an output (2) or an earlier returned one (3)."""
    sources = {}
    for kind, group in ((1, inputs), (2, outs)):
        for i, t in enumerate(group):
            if isinstance(t, torch.Tensor):
                sources.setdefault(_storage(t), (kind, i))
    fresh, codes = [], []
    for x in saved:
        if x is None:
            codes.append(0)
            continue
        src = sources.get(_storage(x))
        if src is None:
            sources[_storage(x)] = (3, len(fresh))
            fresh.append(x)
            codes.append(4)
        else:
            codes += [src[0], src[1], x.dim(), *x.shape, *x.stride(), x.storage_offset()]
    return fresh, codes


def _rebuild(codes: list[int], inputs, outs, fresh) -> list:
    saved, i, n = [], 0, 0
    while i < len(codes):
        kind = codes[i]
        if kind == 0:
            saved.append(None)
            i += 1
        elif kind == 4:
            saved.append(fresh[n])
            n += 1
            i += 1
        else:
            index, nd = codes[i + 1], codes[i + 2]
            size, stride, offset = codes[i + 3:i + 3 + nd], codes[i + 3 + nd:i + 3 + 2 * nd], codes[i + 3 + 2 * nd]
            base = (inputs, outs, fresh)[kind - 1][index]
            saved.append(base.as_strided(size, stride, offset))
            i += 4 + 2 * nd
    return saved


class _Context:
    """What an autograd Function's forward and backward use of ``ctx``, outside autograd."""

    def __init__(self, needs=()):
        self.needs_input_grad = tuple(needs)
        self._saved = ()

    def save_for_backward(self, *tensors):
        self._saved = tensors

    @property
    def saved_tensors(self):
        return self._saved

    def set_materialize_grads(self, value: bool):
        pass

    def attributes(self) -> dict:
        return {k: v for k, v in vars(self).items() if k not in ("needs_input_grad", "_saved")}


def _meta(attributes: dict, codes: list, fake: bool) -> torch.Tensor:
    """The context's attributes (a JSON string's bytes) and the descriptors, as one int64 CPU tensor; in a fake run
    (``fake``) an empty one of the same length, whose values (sizes and strides in ``codes``, symbols where shapes
    are dynamic) are never read: reading them would make a dynamic size a constant of the graph."""
    text = list(json.dumps({k: _static(v) for k, v in attributes.items()}).encode())
    values = [len(text), *text, *codes]
    if fake:
        return torch.empty(len(values), dtype=torch.int64, device="cpu")
    return torch.tensor(values, dtype=torch.int64)


def _unmeta(meta: torch.Tensor) -> tuple[dict, list[int]]:
    values = meta.tolist()
    n = values[0]
    attributes = {k: _unstatic(v) for k, v in json.loads(bytes(values[1:1 + n]).decode()).items()}
    return attributes, values[1 + n:]


# ---- the operators ----

def _run_forward(name: str, tensors, statics: str, fake: bool) -> list[torch.Tensor]:
    if name in _CALLS:
        fn, outputs = _CALLS[name]
        with _body(fake):
            out = fn(*_join(tensors, statics)[0])
        return [out] if outputs == 1 else list(out)
    cls, outputs = _FUNCTIONS[name].function, _FUNCTIONS[name].outputs
    args = _join(tensors, statics)[0]
    ctx = _Context()
    with _body(fake):
        out = cls.forward(ctx, *args)
    outs = [out] if outputs == 1 else list(out)
    fresh, codes = _describe(ctx.saved_tensors, tensors, outs)
    return outs + fresh + [_meta(ctx.attributes(), codes, fake)]


_SCHEMA_FORWARD = "(str name, Tensor?[] tensors, str statics) -> Tensor[]"
# inductor hands the operators their inputs with the strides they were traced with (the kernels index by shape)
_TAGS = (getattr(torch.Tag, "needs_exact_strides", torch.Tag.needs_fixed_stride_order),)


@torch.library.custom_op("rankdecay::opaque_forward", mutates_args=(), schema=_SCHEMA_FORWARD, tags=_TAGS)
def _opaque_forward(name, tensors, statics):
    return _run_forward(name, tensors, statics, False)


@_opaque_forward.register_fake
def _(name, tensors, statics):
    return _run_forward(name, tensors, statics, True)


_SCHEMA_BACKWARD = ("(str name, Tensor?[] inputs, Tensor[] outs, Tensor[] saved, Tensor meta, Tensor?[] grads, "
                    "str statics, bool[] needs) -> Tensor[]")


@torch.library.custom_op("rankdecay::opaque_backward", mutates_args=(), schema=_SCHEMA_BACKWARD, tags=_TAGS)
def _opaque_backward(name, inputs, outs, saved, meta, grads, statics, needs):
    cls = _FUNCTIONS[name].function
    attributes, codes = _unmeta(meta)
    args, positions = _join(inputs, statics)
    ctx = _Context(needs[j] if j >= 0 else False for j in positions)
    vars(ctx).update(attributes)
    ctx.save_for_backward(*_rebuild(codes, inputs, outs, saved))
    with _body(False):
        result = cls.backward(ctx, *grads)
    sums = [None] * len(inputs)  # an input passed as several arguments: their gradients' sum
    for i, j in enumerate(positions):
        if j >= 0 and needs[j] and result[i] is not None:
            grad = result[i]
            if grad.shape != inputs[j].shape:
                raise RuntimeError(f"{name}'s backward returned a gradient of shape {list(grad.shape)} for its "
                                   f"argument {i} of shape {list(inputs[j].shape)}")
            sums[j] = grad if sums[j] is None else sums[j] + grad
    taken = {_storage(t) for t in (*inputs, *outs, *saved, *grads) if t is not None}
    out = []
    for x, need, grad in zip(inputs, needs, sums):
        if not need:
            out.append(torch.empty(0, device=meta.device if x is None else x.device))
            continue
        grad = torch.zeros_like(x) if grad is None else grad.to(x.dtype)
        if _storage(grad) in taken:  # an operator's outputs may not alias its inputs or each other
            grad = grad.clone()
        taken.add(_storage(grad))
        out.append(grad)
    return out


@_opaque_backward.register_fake
def _(name, inputs, outs, saved, meta, grads, statics, needs):
    return [torch.empty_like(x) if need else torch.empty(0, device="cpu" if x is None else x.device)
            for x, need in zip(inputs, needs)]


class _Opaque(torch.autograd.Function):
    """A registered autograd Function through the two operators (what ``OpaqueFunction.apply`` runs when compiling)."""

    @staticmethod
    def forward(ctx, name, statics, outputs, saves_outputs, *tensors):
        flat = torch.ops.rankdecay.opaque_forward(name, list(tensors), statics)
        outs, saved, meta = flat[:outputs], flat[outputs:-1], flat[-1]
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(*tensors, *(outs if saves_outputs else ()), *saved, meta)
        ctx.name, ctx.statics, ctx.count = name, statics, (len(tensors), len(outs) if saves_outputs else 0)
        return outs[0] if outputs == 1 else tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        everything = ctx.saved_tensors
        n, m = ctx.count
        inputs, outs, saved, meta = everything[:n], everything[n:n + m], everything[n + m:-1], everything[-1]
        needs = list(ctx.needs_input_grad[4:])
        result = torch.ops.rankdecay.opaque_backward(ctx.name, list(inputs), list(outs), list(saved), meta,
                                                     list(grads), ctx.statics, needs)
        return (None, None, None, None, *(g if need else None for g, need in zip(result, needs)))


class OpaqueFunction:
    """An autograd Function registered for the opaque operators (``opaque_function``'s result): ``apply`` is the
    Function's eagerly, and goes through the operators when traced by ``torch.compile``; every other attribute is
    the Function's."""

    def __init__(self, cls, outputs: int, saves_outputs: bool):
        self.function, self.name = cls, f"{cls.__module__}.{cls.__qualname__}"
        self.outputs, self.saves_outputs = outputs, saves_outputs
        _FUNCTIONS[self.name] = self

    def __getattr__(self, attribute):
        if attribute == "function":  # (not set yet: a copy being built)
            raise AttributeError(attribute)
        return getattr(self.function, attribute)

    def apply(self, *args):
        if not compiling():
            return self.function.apply(*args)
        tensors, statics = _split(args)
        return _Opaque.apply(self.name, statics, self.outputs, self.saves_outputs, *tensors)


def opaque_function(outputs: int, saves_outputs: bool = False):
    """Registers an autograd Function (class decorator, returning an ``OpaqueFunction``): ``outputs`` tensors from
    its forward (1: a tensor, else a tuple); ``saves_outputs``: its forward saves some of its outputs for the
    backward."""
    return lambda cls: OpaqueFunction(cls, outputs, saves_outputs)


def opaque(outputs: int, entry: bool = False):
    """A function that launches kernels (decorator): run as written eagerly, and as one opaque operator when traced
    by ``torch.compile``; ``outputs`` tensors (1: a tensor, else a tuple). ``entry``: an entry point whose body
    applies autograd Functions, an operator only where no tensor argument needs a gradient (the forward alone), else
    traced, its Functions through ``OpaqueFunction.apply``; without it, the function takes no autograd."""
    def wrap(fn):
        name = f"{fn.__module__}.{fn.__qualname__}"
        signature = inspect.signature(fn)
        _CALLS[name] = (fn, outputs)

        @functools.wraps(fn)
        def call(*args, **kwargs):
            if not compiling():
                return fn(*args, **kwargs)
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            tensors, statics = _split(bound.args)
            if entry and needs_grad(tensors):
                return fn(*args, **kwargs)
            out = torch.ops.rankdecay.opaque_forward(name, tensors, statics)
            return out[0] if outputs == 1 else tuple(out)
        return call
    return wrap
