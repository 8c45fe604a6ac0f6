"""Prompts of mixed lengths on a GPU: packed into one row (``cu_seqlens``) against a left-padded batch.

    python benchmarks/packed_prefill.py [--preset 340m] [--mixers gdn hdla gdn-h1] [--prompts 32]
        [--min-len 64] [--max-len 2048] [--new-tokens 64] [--json out.json]

Random weights in bf16 (``decode_gpu.build``). --prompts prompts with lengths drawn uniformly from
[--min-len, --max-len] (seeded). For each mixer:
- ``prefill``: the model over the prompts with ``use_cache=True``: left-padded to the longest with an
  ``attention_mask`` ([N, max]), against packed (``[1, sum]`` with ``cu_seqlens``), each filling a cache of N rows;
  milliseconds (median of --reps) and prompt tokens per second (real tokens only);
- ``generate``: ``GraphDecoder().generate`` of --new-tokens greedy tokens per prompt, from the padded batch and
  from the list of prompts (packed prefill, then the same CUDA graph steps); milliseconds end to end;
- ``logits gap``: the relative L2 difference of the prompts' last logits, packed against padded (bf16: the two
  round differently; random weights make near-flat logits, so greedy tokens flip at near ties and are not
  compared).
Prints a Markdown table; --json writes the rows.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from decode_gpu import build, per_step  # noqa: E402  (from benchmarks/)

from rankdecay.models import GraphDecoder  # noqa: E402


def prompts_of(n: int, lo: int, hi: int, vocab: int, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(lo, hi + 1, (n,), generator=gen).tolist()
    return [torch.randint(0, vocab, (length,), generator=gen).cuda() for length in lengths]


def padded(prompts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    L = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), L, dtype=torch.long, device="cuda")
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, L - len(p):], mask[i, L - len(p):] = p, 1
    return ids, mask


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="340m")
    parser.add_argument("--mixers", nargs="+", default=["gdn", "hdla", "gdn-h1"])
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--min-len", type=int, default=64)
    parser.add_argument("--max-len", type=int, default=2048)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    rows = []
    for mixer in args.mixers:
        model = build(args.preset, mixer)
        prompts = prompts_of(args.prompts, args.min_len, args.max_len, model.config.vocab_size)
        ids, mask = padded(prompts)
        packed = torch.cat(prompts)[None]
        cu = torch.tensor([0] + [len(p) for p in prompts], device="cuda").cumsum(0)
        real = int(cu[-1])
        with torch.no_grad():
            pad_ms = per_step(lambda: model(ids, attention_mask=mask, use_cache=True), args.reps)
            pack_ms = per_step(lambda: model(packed, cu_seqlens=cu, use_cache=True), args.reps)
        decoder = GraphDecoder(model)
        kw = dict(max_new_tokens=args.new_tokens, eos_token_id=[])
        decoder.generate(ids, mask, **kw), decoder.generate(prompts, **kw)  # record both graphs' first
        gen_pad = per_step(lambda: decoder.generate(ids, mask, **kw), 3)
        gen_pack = per_step(lambda: decoder.generate(prompts, **kw), 3)
        with torch.no_grad():
            last_pad = model(ids, attention_mask=mask, use_cache=True).logits[:, -1].float()
            last_pack = model(packed, cu_seqlens=cu, use_cache=True).logits[0, cu[1:] - 1].float()
        gap = ((last_pack - last_pad).norm() / last_pad.norm()).item()
        row = dict(mixer=mixer, prompts=len(prompts), real_tokens=real, padded_tokens=ids.numel(),
                   prefill_padded_ms=pad_ms, prefill_packed_ms=pack_ms,
                   prefill_padded_tok_s=real / pad_ms * 1e3, prefill_packed_tok_s=real / pack_ms * 1e3,
                   generate_padded_ms=gen_pad, generate_packed_ms=gen_pack, logits_gap=gap)
        rows.append(row)
        print(row, flush=True)
        del model, decoder
        torch.cuda.empty_cache()
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}, preset {args.preset}, bf16; "
          f"{args.prompts} prompts of {args.min_len}-{args.max_len} tokens, {args.new_tokens} new tokens each\n")
    print("| mixer | real / padded tokens | prefill padded ms | packed ms | speedup | generate padded ms | packed ms "
          "| logits gap |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['mixer']} | {r['real_tokens']} / {r['padded_tokens']} | {r['prefill_padded_ms']:.2f} | "
              f"{r['prefill_packed_ms']:.2f} | {r['prefill_padded_ms'] / r['prefill_packed_ms']:.2f}x | "
              f"{r['generate_padded_ms']:.1f} | {r['generate_packed_ms']:.1f} | {r['logits_gap']:.1e} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
