"""Per-token decode latency of whole models on a GPU: transformers' generate, the eager step, the CUDA graph.

    python benchmarks/decode_gpu.py [--preset 340m] [--mixers gdn hdla hh-gdn gdn-h1] [--batches 1 64]

Mixers: any of ``rankdecay.models.config.MIXERS``, ``gdn-h1`` (Gated DeltaNet with every other layer sliding-window
attention), ``gdn-h1-gqa`` (the same with attention layers of 16 heads of 64 over 4 key/value heads, as fla's
hybrids make them), ``gdn-h1-mha16`` (16 heads of 64, each its own key/value head), ``kda-kimi`` (KDA as fla's
checkpoints convert: a sigmoid output gate through a low-rank map, the decay bounded by -5).

Random weights in bf16. For each mixer and batch size, after a prompt of --prompt tokens:
- ``generate``: ``model.generate`` (transformers' loop and dynamic cache), ms per new token;
- ``eager``: ``GraphDecoder(cuda_graph=False).step``, the same step on static buffers, launched
  kernel by kernel;
- ``graph``: ``GraphDecoder().step``, the step replayed as one CUDA graph;
- with --compile, ``compiled``: ``GraphDecoder(compile=True).step``, the step through torch.compile, then
  replayed as one CUDA graph; the seconds its first step took (compiling), and how far both graphs' logits are
  from an fp32 copy of the model after --new-tokens teacher-forced steps (relative L2 error: bf16 alone puts
  the graph's some way off on random weights; the compiled one should be no further);
- with --unpacked, the graph (and with --compile the compiled graph) with ``pack_projections=False``: each
  linear map of a layer's input its own matrix-vector product, as before the packs.
--no-fused-norms runs the one-row kernel without the prologues that take each layer's norms, gates and adds
(``rankdecay.layers.packing``'s ``fused_*`` return None, so the layers form them with kernels of their own): the
"off" side of an A/B of those fusions.
Median of --steps steps, each synchronised. Prints a Markdown table; --json writes the rows.
--profile N also profiles N eager steps per mixer (B = the first batch size) and prints the kernels
that take the most GPU time and the number of kernels per step.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from rankdecay.models import GraphDecoder, RankDecayConfig, RankDecayForCausalLM


def per_step(fn, steps: int) -> float:
    """Median milliseconds of ``fn()``, synchronised around each call."""
    times = []
    for _ in range(steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def build(preset: str, mixer: str, state_dtype: str = "float32") -> RankDecayForCausalLM:
    kw = {"layer_mixers": ["gdn", "swa"] * 12} if mixer.startswith("gdn-h1") else {"mixer": mixer}
    if mixer == "gdn-h1-gqa":
        kw.update(swa_num_heads=16, swa_num_kv_heads=4)
    if mixer == "gdn-h1-mha16":
        kw.update(swa_num_heads=16)
    if mixer == "kda-kimi":
        head_v = RankDecayConfig.from_preset(preset).head_v_dim
        kw = dict(mixer="kda", output_gate_act="sigmoid", output_gate_rank=head_v, gate_lower_bound=-5.0)
    kw["state_dtype"] = state_dtype
    if mixer.startswith("hh-"):
        kw["hh_rank"] = 4
    torch.manual_seed(0)
    return RankDecayForCausalLM(RankDecayConfig.from_preset(preset, **kw)).cuda().to(torch.bfloat16).eval()


@torch.no_grad()
def run(model, B: int, prompt: int, steps: int, new_tokens: int, compiled: bool = False,
        unpacked: bool = False, max_length: int | None = None) -> dict:
    ids = torch.randint(0, model.config.vocab_size, (B, prompt), device="cuda")
    row = {}
    ring = dict(max_length=max_length)
    decoders = [("eager", GraphDecoder(model, cuda_graph=False, **ring)), ("graph", GraphDecoder(model, **ring))]
    if compiled:
        decoders.append(("compiled", GraphDecoder(model, compile=True, **ring)))
    if unpacked:
        decoders.append(("graph_unpacked", GraphDecoder(model, pack_projections=False, **ring)))
        if compiled:
            decoders.append(("compiled_unpacked", GraphDecoder(model, compile=True, pack_projections=False, **ring)))
    for name, decoder in decoders:
        t0 = time.perf_counter()
        decoder.prefill(ids)
        token = torch.zeros(B, dtype=torch.long, device="cuda")
        for _ in range(3):
            decoder.step(token)
        if name.startswith("compiled"):
            row[name.replace("compiled", "compile_s")] = time.perf_counter() - t0
        row[f"{name}_ms"] = per_step(lambda: decoder.step(token), steps)  # noqa: B023
    if compiled:
        named = dict(decoders)
        row["graph_err"], row["compiled_err"] = drift(model, ids, [named["graph"], named["compiled"]], new_tokens)
    kw = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
    model.generate(ids, max_new_tokens=4, min_new_tokens=4, **kw)
    short = per_step(lambda: model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kw), 3)
    long = per_step(lambda: model.generate(ids, max_new_tokens=new_tokens + 1, min_new_tokens=new_tokens + 1, **kw), 3)
    row["generate_ms"] = (long - short) / new_tokens
    return row


@torch.no_grad()
def drift(model, ids, decoders, steps: int) -> list[float]:
    """The relative L2 distance of each decoder's logits from an fp32 copy of the model's, after ``steps``
    teacher-forced random tokens."""
    ref = RankDecayForCausalLM(model.config).cuda().eval()
    ref.load_state_dict({name: w.float() for name, w in model.state_dict().items()})
    decoders = [GraphDecoder(ref)] + list(decoders)
    logits = [d.prefill(ids) for d in decoders]
    for token in torch.randint(0, model.config.vocab_size, (steps, ids.shape[0]), device=ids.device):
        logits = [d.step(token) for d in decoders]
    want = logits[0].float()
    return [((got.float() - want).norm() / want.norm()).item() for got in logits[1:]]


@torch.no_grad()
def profile(model, B: int, prompt: int, steps: int, top: int = 25, compiled: bool = False) -> None:
    """Print the CUDA kernels of ``steps`` eager decode steps (``compiled``: through torch.compile), by total GPU
    time, and the kernels per step."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    decoder = GraphDecoder(model, cuda_graph=False, compile=compiled)
    decoder.prefill(torch.randint(0, model.config.vocab_size, (B, prompt), device="cuda"))
    token = torch.zeros(B, dtype=torch.long, device="cuda")
    for _ in range(3):
        decoder.step(token)
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            decoder.step(token)
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    total = sum(e.time_range.elapsed_us() for e in kernels) / steps
    print(f"{len(kernels) / steps:.0f} kernels per step, {total / 1e3:.3f} ms of kernel time per step")
    by_name: dict[str, list[float]] = {}
    for e in kernels:
        by_name.setdefault(e.name, []).append(e.time_range.elapsed_us())
    rows = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:top]
    print("| kernel | calls/step | us/step | share |")
    print("|---|---:|---:|---:|")
    for name, t in rows:
        print(f"| {name[:90]} | {len(t) / steps:.0f} | {sum(t) / steps:.1f} | {sum(t) / steps / total:.1%} |")


# where the layers call the one-row kernel's prologues (each module imports the function under this name)
FUSED = (("rankdecay.layers.mixers", "_fused_output_linear"), ("rankdecay.models.modeling", "_fused_output_linear"),
         ("rankdecay.models.modeling", "_fused_input_projections"))


def no_fused_norms() -> list[str]:
    """Turn the one-row kernel's prologues off for this process: each call site's ``fused_*`` returns None, so
    the layers take their separate norms, gates and adds. Returns the call sites patched."""
    import importlib

    for module_name, attr in FUSED:
        setattr(importlib.import_module(module_name), attr, lambda *args, **kwargs: None)
    return [f"{module_name}.{attr}" for module_name, attr in FUSED]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="340m")
    parser.add_argument("--mixers", nargs="+", default=["gdn", "hdla", "hh-gdn", "gdn-h1"])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 64])
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--new-tokens", type=int, default=32, help="tokens per generate() call")
    parser.add_argument("--state-dtypes", nargs="+", default=["float32"], choices=["float32", "bfloat16", "float16"],
                        help="the cache's recurrent-state dtype (RankDecayConfig.state_dtype); each is a row")
    parser.add_argument("--json", default=None, help="also write the rows as JSON, rewritten after each row")
    parser.add_argument("--profile", type=int, default=0, metavar="N", help="profile N eager steps per mixer")
    parser.add_argument("--compile", action="store_true",
                        help="also GraphDecoder(compile=True): the step through torch.compile, as a CUDA graph")
    parser.add_argument("--unpacked", action="store_true",
                        help="also the graphs with pack_projections=False (one product per linear map)")
    parser.add_argument("--no-fused-norms", action="store_true",
                        help="the one-row kernel without its prologues (norms, gates, adds in kernels of their own)")
    parser.add_argument("--max-length", type=int, default=None,
                        help="GraphDecoder(max_length=): sliding-window rings of min(window, N) slots; N must hold "
                             "the prompt and 3 + --steps steps (and --new-tokens)")
    args = parser.parse_args()
    if args.max_length is not None and args.prompt + max(args.steps + 3, args.new_tokens) > args.max_length:
        parser.error(f"--max-length {args.max_length} must hold the prompt ({args.prompt}) and "
                     f"max(3 + --steps, --new-tokens) = {max(args.steps + 3, args.new_tokens)} steps")
    if args.no_fused_norms:
        print("prologues off:", ", ".join(no_fused_norms()))
    import transformers
    import triton

    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, "
          f"transformers {transformers.__version__}; preset {args.preset}, bf16, prompt {args.prompt}"
          + (f", max_length {args.max_length}" if args.max_length else ""))
    extra = " compiled graph ms | compile s | graph / compiled vs fp32 |" if args.compile else ""
    if args.unpacked:
        extra += " unpacked graph ms |" + (" unpacked compiled ms |" if args.compile else "")
    print("| mixer | state | B | generate ms/token | eager step ms | graph step ms | graph speed-up |" + extra)
    print("|---|---|---:|---:|---:|---:|---:|" + ("---:|---:|---:|" if args.compile else "")
          + ("---:|" * (1 + args.compile) if args.unpacked else ""))
    rows = []
    for mixer in args.mixers:
        for state_dtype in args.state_dtypes:
            model = build(args.preset, mixer, state_dtype)
            for B in args.batches:
                r = dict(mixer=mixer, state_dtype=state_dtype, B=B, preset=args.preset,
                         **run(model, B, args.prompt, args.steps, args.new_tokens, args.compile, args.unpacked,
                               args.max_length))
                rows.append(r)
                extra = (f" {r['compiled_ms']:.3f} | {r['compile_s']:.0f} | {r['graph_err']:.1e} / "
                         f"{r['compiled_err']:.1e} |" if args.compile else "")
                if args.unpacked:
                    extra += f" {r['graph_unpacked_ms']:.3f} |" + (f" {r['compiled_unpacked_ms']:.3f} |"
                                                                   if args.compile else "")
                print(f"| {mixer} | {state_dtype} | {B} | {r['generate_ms']:.2f} | {r['eager_ms']:.2f} | "
                      f"{r['graph_ms']:.3f} | {r['eager_ms'] / r['graph_ms']:.1f}x |" + extra, flush=True)
                if args.json:  # after each row, so that a run cut short keeps what it measured
                    with open(args.json, "w") as f:
                        json.dump(rows, f, indent=1)
            if args.profile:
                for compiled in (False, True) if args.compile else (False,):
                    print(f"\nprofile: {mixer}, {state_dtype}, B={args.batches[0]}" + (", compiled" * compiled))
                    profile(model, args.batches[0], args.prompt, args.profile, compiled=compiled)
                print()
            del model
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
