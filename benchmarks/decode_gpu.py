"""Per-token decode latency of whole models on a GPU: transformers' generate, the eager step, the CUDA graph.

    python benchmarks/decode_gpu.py [--preset 340m] [--mixers gdn hdla hh-gdn gdn-h1] [--batches 1 64]

Random weights in bf16. For each mixer and batch size, after a prompt of --prompt tokens:
- ``generate``: ``model.generate`` (transformers' loop and dynamic cache), ms per new token;
- ``eager``: ``GraphDecoder(cuda_graph=False).step``, the same step on static buffers, launched
  kernel by kernel;
- ``graph``: ``GraphDecoder().step``, the step replayed as one CUDA graph.
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
    kw = {"layer_mixers": ["gdn", "swa"] * 12} if mixer == "gdn-h1" else {"mixer": mixer}
    kw["state_dtype"] = state_dtype
    if mixer.startswith("hh-"):
        kw["hh_rank"] = 4
    torch.manual_seed(0)
    return RankDecayForCausalLM(RankDecayConfig.from_preset(preset, **kw)).cuda().to(torch.bfloat16).eval()


@torch.no_grad()
def run(model, B: int, prompt: int, steps: int, new_tokens: int) -> dict:
    ids = torch.randint(0, model.config.vocab_size, (B, prompt), device="cuda")
    row = {}
    for name, decoder in (("eager", GraphDecoder(model, cuda_graph=False)), ("graph", GraphDecoder(model))):
        decoder.prefill(ids)
        token = torch.zeros(B, dtype=torch.long, device="cuda")
        for _ in range(3):
            decoder.step(token)
        row[f"{name}_ms"] = per_step(lambda: decoder.step(token), steps)  # noqa: B023
    kw = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
    model.generate(ids, max_new_tokens=4, min_new_tokens=4, **kw)
    short = per_step(lambda: model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kw), 3)
    long = per_step(lambda: model.generate(ids, max_new_tokens=new_tokens + 1, min_new_tokens=new_tokens + 1, **kw), 3)
    row["generate_ms"] = (long - short) / new_tokens
    return row


@torch.no_grad()
def profile(model, B: int, prompt: int, steps: int, top: int = 25) -> None:
    """Print the CUDA kernels of ``steps`` eager decode steps, by total GPU time, and the kernels per step."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    decoder = GraphDecoder(model, cuda_graph=False)
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
    parser.add_argument("--json", default=None)
    parser.add_argument("--profile", type=int, default=0, metavar="N", help="profile N eager steps per mixer")
    args = parser.parse_args()
    import transformers
    import triton

    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, "
          f"transformers {transformers.__version__}; preset {args.preset}, bf16, prompt {args.prompt}")
    print("| mixer | state | B | generate ms/token | eager step ms | graph step ms | graph speed-up |")
    print("|---|---|---:|---:|---:|---:|---:|")
    rows = []
    for mixer in args.mixers:
        for state_dtype in args.state_dtypes:
            model = build(args.preset, mixer, state_dtype)
            for B in args.batches:
                r = dict(mixer=mixer, state_dtype=state_dtype, B=B, preset=args.preset,
                         **run(model, B, args.prompt, args.steps, args.new_tokens))
                rows.append(r)
                print(f"| {mixer} | {state_dtype} | {B} | {r['generate_ms']:.2f} | {r['eager_ms']:.2f} | "
                      f"{r['graph_ms']:.3f} | {r['eager_ms'] / r['graph_ms']:.1f}x |", flush=True)
            if args.profile:
                print(f"\nprofile: {mixer}, {state_dtype}, B={args.batches[0]}")
                profile(model, args.batches[0], args.prompt, args.profile)
                print()
            del model
            torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
