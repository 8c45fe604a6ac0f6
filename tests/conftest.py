import os
import shutil

import pytest
import torch

# Without a GPU the Triton kernels run in Triton's CPU interpreter. It is chosen when a
# kernel is defined, so before rankdecay.ops.triton is first imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _interpreter_without_overflow_checks() -> None:
    """Triton's interpreter checks every 32-bit integer add, sub and mul for overflow (its options'
    ``sanitize_overflow``, on by default there; compiled kernels check only in debug mode). The tests' tiny shapes
    cannot overflow an index, and the checks took a fifth of the kernels' interpreted time (37.9 -> 29.4 s for one
    HDLA test), so they are turned off. Index widths at real sizes are tested on the GPU (T = 65,536)."""
    try:
        import dataclasses

        from triton.runtime import interpreter
    except ImportError:  # no Triton: the kernels' tests skip
        return
    builder = getattr(interpreter, "interpreter_builder", None)
    options = getattr(builder, "options", None)
    if dataclasses.is_dataclass(options) and hasattr(options, "sanitize_overflow"):
        builder.options = dataclasses.replace(options, sanitize_overflow=False)


if os.environ.get("TRITON_INTERPRET") == "1":
    _interpreter_without_overflow_checks()

# Under pytest-xdist (the default: ``-n auto`` in pyproject.toml) each worker takes its share of the cores for
# torch's own threads, so that the workers do not oversubscribe the machine.
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _workers > 1:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // _workers))


def can_compile_on_cpu() -> bool:
    """Whether torch.compile's CPU backend (inductor's C++ code) finds a compiler here."""
    return any(shutil.which(cxx) for cxx in (os.environ.get("CXX", ""), "g++", "clang++", "c++") if cxx)


NO_CPU_COMPILE = "torch.compile on the CPU needs a C++ compiler (g++ or clang++), and none is on PATH"


def rel_rms(x: torch.Tensor, ref: torch.Tensor) -> float:
    """||x - ref|| / ||ref|| (root-mean-square error relative to the reference's RMS)."""
    x, ref = x.double(), ref.double()
    return ((x - ref).norm() / ref.norm().clamp_min(1e-300)).item()


def assert_matches(x: torch.Tensor, ref: torch.Tensor, tol: float, what: str = "") -> None:
    assert x.shape == ref.shape, f"{what}: shape {list(x.shape)} != {list(ref.shape)}"
    assert torch.isfinite(x).all(), f"{what}: non-finite values"
    if ref.dtype == torch.float64 and x.dtype == torch.float64 and tol <= 1e-9:
        err = (x - ref).abs().max().item()
        assert err <= tol * max(1.0, ref.abs().max().item()), f"{what}: max abs error {err:.3e} > {tol:g}"
    else:
        err = rel_rms(x, ref)
        assert err <= tol, f"{what}: relative RMS error {err:.3e} > {tol:g}"


def autograd_nodes(x: torch.Tensor) -> list[str]:
    """The class names of the autograd nodes x comes from, each node once. (On a GPU, heads narrower than the Triton
    kernels' widths are padded around the kernels' node: slices and a clone after it, ``chunk_bwd.padded_heads``.)"""
    seen, todo, names = set(), [x.grad_fn], []
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.append(type(node).__name__)
        todo.extend(n for n, _ in node.next_functions)
    return names


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
