"""Parameter counts and FLOPs/token of the 340m and 1.3b presets (built on the meta device).

    python benchmarks/model_sizes.py [--mixers gdn hdla hh-gdn ...]

Prints a Markdown table. The papers' nominal sizes: Head-in-Head Table 9 (340M: 24
layers, d 1024, 4 heads, tied; 1.3B: 24 layers, d 2048, 8 heads, untied), Gated
DeltaNet §4 (1.3B), HDLA §4 (0.4B / 1.45B, its own shapes).
"""
from __future__ import annotations

import argparse

import torch

from rankdecay.models import RankDecayConfig, RankDecayForCausalLM


def count(preset: str, mixer: str, **overrides) -> tuple[int, int, float]:
    with torch.device("meta"):
        model = RankDecayForCausalLM(RankDecayConfig.from_preset(preset, mixer=mixer, **overrides))
    return model.num_params(), model.num_params(exclude_embeddings=True), model.flops_per_token(seq_len=2048)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mixers", nargs="+", default=["gdn", "hdla", "hh-gdn", "gdn-h1"])
    args = parser.parse_args()
    print("| preset | mixer | params | non-embedding | training GFLOPs/token (T=2048) |")
    print("|---|---|---:|---:|---:|")
    for preset in ("340m", "1.3b"):
        layers = RankDecayConfig.from_preset(preset).num_hidden_layers
        for mixer in args.mixers:
            overrides = {"hh_rank": 4} if mixer.startswith("hh-") else {}
            if mixer == "gdn-h1":  # Gated DeltaNet-H1: GDN and SWA alternating
                overrides = {"layer_mixers": ["gdn", "swa"] * (layers // 2)}
            total, non_emb, flops = count(preset, "gdn" if mixer == "gdn-h1" else mixer, **overrides)
            print(f"| {preset} | {mixer} | {total / 1e6:.1f}M | {non_emb / 1e6:.1f}M | {flops / 1e9:.2f} |")


if __name__ == "__main__":
    main()
