"""Decode latency per token on CPU, after contexts of different lengths.

    python benchmarks/decode_cpu.py [--preset tiny] [--mixers gdn hdla hh-gdn swa] [--contexts 100 2000]

A recurrent model's step costs the same whatever came before (a fixed-size state);
sliding-window attention's is bounded by its window; "attn" (SWA with, for each context, a window just longer than
the context and the steps timed after it: full causal attention) is the contrast, growing with the context. A
window far longer than that would not do: decoding keeps a ring of window slots and attends over all of them.
Each row: prefill a random context of the given length, then time single-token steps with the cache (median
of --steps). With --compile, a second row per mixer times ``GraphDecoder(compile=True).step`` instead: the same step
on static buffers through torch.compile (compiled during the warm-up steps, which are not timed). Prints a Markdown
table.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from rankdecay.models import GraphDecoder, RankDecayConfig, RankDecayForCausalLM, output_cache


WARMUP = 5


def _median_step(step, token, warmup: int, steps: int) -> float:
    """Median seconds of ``step(token) -> logits [1, vocab]`` over ``steps`` after ``warmup``; each next token is
    the argmax of the last logits, taken outside the timed call."""
    times = []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        logits = step(token)
        times.append(time.perf_counter() - t0)
        token = logits.argmax(-1)
    return statistics.median(times[warmup:])


@torch.no_grad()
def step_latency(model, context: int, steps: int, warmup: int = WARMUP) -> float:
    out = model(torch.randint(0, 256, (1, context)), use_cache=True)
    cache = output_cache(out)
    step = lambda token: model(token[:, None], past_key_values=cache, use_cache=True).logits[:, -1]  # noqa: E731
    return _median_step(step, out.logits[:, -1].argmax(-1), warmup, steps)


@torch.no_grad()
def compiled_step_latency(model, context: int, steps: int, warmup: int = WARMUP) -> float:
    """``step_latency`` for ``GraphDecoder(compile=True)``'s step (the first warm-up step compiles it)."""
    decoder = GraphDecoder(model, cuda_graph=False, compile=True)
    token = decoder.prefill(torch.randint(0, 256, (1, context))).argmax(-1)
    return _median_step(decoder.step, token, warmup, steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--mixers", nargs="+", default=["gdn", "hdla", "hh-gdn", "swa", "attn"])
    parser.add_argument("--contexts", nargs="+", type=int, default=[100, 2000])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--compile", action="store_true",
                        help="also time GraphDecoder(compile=True)'s step, a row per mixer (needs a C++ compiler)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} threads, preset {args.preset}, fp32, batch 1")
    print("| mixer | " + " | ".join(f"ms/token @ {c}" for c in args.contexts) + " | ratio |")
    print("|---|" + "---:|" * (len(args.contexts) + 1))
    def build(kind: str, **overrides):
        torch.manual_seed(0)  # the same weights for every mixer's contexts
        return RankDecayForCausalLM(RankDecayConfig.from_preset(args.preset, mixer=kind, **overrides)).eval()

    for mixer in args.mixers:
        if mixer != "attn":
            model = build(mixer, **({"hh_rank": 2} if mixer.startswith("hh-") and args.preset == "tiny" else {}))
        rows = {mixer: []}
        if args.compile:
            rows[f"{mixer}, compiled"] = []
        for c in args.contexts:
            if mixer == "attn":  # every token of the context and of the timed steps inside the window
                model = build("swa", swa_window=c + WARMUP + args.steps + 1)
            rows[mixer].append(1e3 * step_latency(model, c, args.steps))
            if args.compile:
                rows[f"{mixer}, compiled"].append(1e3 * compiled_step_latency(model, c, args.steps))
        for name, ms in rows.items():
            print(f"| {name} | " + " | ".join(f"{m:.3f}" for m in ms) + f" | {ms[-1] / ms[0]:.2f} |", flush=True)


if __name__ == "__main__":
    main()
