"""The ``rankdecay`` command: ``info``, ``init``, ``train``, ``eval``, ``prune``, ``synth``, ``generate``."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _info(args) -> int:
    import platform

    import torch

    from . import __version__, ops
    from .models import MIXERS, PRESETS

    print(f"rankdecay {__version__}  (torch {torch.__version__}, python {platform.python_version()})")
    helpers = ("backends", "dplr", "head_in_head_mask", "chunk_flops_per_token")
    print("mechanisms (rankdecay.ops): " + ", ".join(name for name in ops.__all__ if name not in helpers))
    print("mixers (RankDecayConfig.mixer): " + ", ".join(MIXERS))
    print("presets: " + ", ".join(PRESETS))
    print("execution paths:")
    for name, (ok, why) in ops.backends().items():
        print(f"  {name:<7} {'yes' if ok else 'no ':<4} {why}")
    return 0


def _init(args) -> int:
    import torch

    from .data import ByteTokenizer
    from .models import RankDecayConfig, RankDecayForCausalLM

    overrides = _pairs(args.set, "--set")
    torch.manual_seed(args.seed)
    config = RankDecayConfig.from_preset(args.preset, mixer=args.mixer, **overrides)
    model = RankDecayForCausalLM(config)
    model.save_pretrained(args.model_dir)
    if config.vocab_size >= ByteTokenizer.vocab_size and args.preset == "tiny":
        ByteTokenizer().save_pretrained(args.model_dir)
    print(f"saved an untrained {args.preset} {config.mixers[0] if config.layer_mixers is None else config.mixers} "
          f"model ({model.num_params() / 1e6:.2f}M parameters) to {args.model_dir}")
    return 0


def _dtype(name: str | None):
    """The torch dtype of a ``--dtype`` choice (None stays None)."""
    import torch

    return None if name is None else {"float32": torch.float32, "bfloat16": torch.bfloat16,
                                      "float16": torch.float16}[name]


def _convert_fla(args) -> int:
    import shutil

    from .models import from_fla
    from .models.convert import FLA_NAMES, local_folder

    source = local_folder(args.source)
    model = from_fla(source, dtype=_dtype(args.dtype))
    model.save_pretrained(args.out)
    copied = []
    for f in sorted(source.iterdir()):  # its tokenizer, for `rankdecay generate` and AutoTokenizer
        if f.is_file() and (f.name.startswith("tokenizer") or f.name == "special_tokens_map.json"):
            shutil.copy2(f, Path(args.out, f.name))
            copied.append(f.name)
    attention = [i for i, mixer in enumerate(model.config.mixers) if mixer == "swa"]  # a hybrid's (fla's attn)
    hybrid = f" (attention at layers {', '.join(map(str, attention))})" if attention else ""
    print(f"converted fla's {FLA_NAMES[model.config.mixer]}{hybrid} in {args.source} ({model.num_params() / 1e6:.2f}M "
          f"parameters) to {args.out}" + (f", with {', '.join(copied)}" if copied else ""))
    return 0


def _parse_value(text: str):
    import json

    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _pairs(items, flag: str, parse=_parse_value) -> dict:
    """``["k=v", ...]`` from a repeated flag as a dict, values parsed by ``parse``."""
    out = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"{flag} expects key=value, got {item!r}")
        out[key] = parse(value)
    return out


def _prompt_ids(tokenizer, prompts: list[str]) -> list[list[int]]:
    """Each prompt's token ids; an empty prompt starts where a training document starts, after the end-of-text
    token that separates documents (the tokenizer's bos where it has no eos)."""
    rows = [list(tokenizer.encode(prompt)) for prompt in prompts]
    start = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else tokenizer.bos_token_id
    if start is None and not all(rows):
        raise SystemExit("an empty --prompt needs a token to start from, and the tokenizer has no eos or bos token")
    return [row or [start] for row in rows]


def _generate(args) -> int:
    import torch
    from transformers import AutoModelForCausalLM

    from .data import load_tokenizer
    from .data.tokenizers import left_padded

    if not Path(args.model_dir, "config.json").exists():
        raise SystemExit(f"{args.model_dir} is not a saved model (no config.json); create one with "
                         "`rankdecay init` or save one with model.save_pretrained()")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = _dtype(args.dtype)
    extra = {"state_dtype": args.state_dtype} if args.state_dtype else {}
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=dtype, **extra).to(device).eval()
    tokenizer = load_tokenizer(args.model_dir, model.config.vocab_size)
    prompts = args.prompt
    if getattr(tokenizer, "pad_token", "") is None:
        tokenizer.pad_token = tokenizer.eos_token  # masked out; only needed to pad a batch of prompts
    rows = _prompt_ids(tokenizer, prompts)
    batch = {key: x.to(device) for key, x in left_padded(rows, tokenizer.pad_token_id).items()}
    if args.seed is not None:
        torch.manual_seed(args.seed)
    sampling = args.temperature > 0
    kw = dict(max_new_tokens=args.max_new_tokens, do_sample=sampling,
              temperature=args.temperature if sampling else None, top_k=args.top_k if sampling else None,
              top_p=args.top_p if sampling else None,
              pad_token_id=tokenizer.eos_token_id if model.config.pad_token_id is None else model.config.pad_token_id)
    if len(prompts) == 1:  # one prompt: its continuation is printed as it comes
        from transformers import TextStreamer

        print(prompts[0], end="", flush=True)
        kw["streamer"] = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    if args.cuda_graph or args.compile:
        from .models import GraphDecoder

        # --cuda-graph: a graph where there is a GPU, the same steps eagerly on a CPU; one generation, so the
        # sliding-window rings take the prompt and the new tokens, not the whole window
        decoder = GraphDecoder(model, cuda_graph=None if args.cuda_graph else False, compile=args.compile,
                               pack_projections=not args.no_pack,
                               max_length=batch["input_ids"].shape[1] + max(args.max_new_tokens, 1))
        if len(prompts) > 1:  # packed into one row (cu_seqlens), no padding: a list in, a list out
            ids = [torch.tensor(row, device=device) for row in rows]
            outs = decoder.generate(ids, **kw)
            for prompt, row, out in zip(prompts, ids, outs):
                print(prompt + tokenizer.decode(out[len(row):], skip_special_tokens=True))
            return 0
        out = decoder.generate(batch["input_ids"], batch.get("attention_mask"), **kw)
    else:
        with torch.no_grad():
            out = model.generate(**batch, **kw)
    if len(prompts) > 1:
        new = out[:, batch["input_ids"].shape[1]:]
        for prompt, row in zip(prompts, new):
            print(prompt + tokenizer.decode(row, skip_special_tokens=True))
    return 0


def _train(args) -> int:
    from .train import train
    from .train.config import config_from_args

    cfg = config_from_args(args)
    train(cfg)
    return 0


def _eval(args) -> int:
    from .train import evaluate_model, save_eval

    res = evaluate_model(args.model_dir, data=args.data, seq_len=args.seq_len, max_windows=args.max_windows,
                         batch_size=args.batch_size, device=args.device, dtype=args.dtype,
                         progress=not args.no_progress)
    print(res.markdown())
    out = Path(args.out) if args.out else Path(args.model_dir) / "eval"
    paths = save_eval(res, out)
    print("\nwrote " + ", ".join(str(p) for p in paths))
    return 0


def _prune(args) -> int:
    from .prune.run import run_prune

    out = args.out or f"{str(args.model_dir).rstrip('/')}-{args.method}-{round(100 * args.ratio)}"
    report = run_prune(args.model_dir, args.method, args.ratio, out, calib=args.calib,
                       calib_samples=args.calib_samples, seq_len=args.seq_len, select=args.select, budget=args.budget,
                       tolerance=args.tolerance, rft_steps=args.rft, rft_lr=args.rft_lr,
                       rft_batch_size=args.rft_batch_size, eval_windows=args.eval_windows, device=args.device,
                       seed=args.seed, progress=not args.no_progress, pca_adversarial=args.pca_adversarial)
    print(report["markdown"])
    print(f"\nwrote the pruned model and prune_report.md/.json/prune_spectra.png to {out}")
    return 0


def _synth(args) -> int:
    from .train.synth import SUITES, markdown, run_synth

    out = args.out or f"synth-{args.task}-{args.preset}"
    lrs = [float(x) for x in args.lr_sweep] if args.lr_sweep else None
    table = run_synth(args.task, [m.strip() for m in args.mechanisms.split(",")], args.preset, args.seeds, lrs, out,
                      steps=args.steps, batch_size=args.batch_size, overrides=_pairs(args.set, "--set"),
                      jobs=args.jobs, only=_pairs(args.only, "--only", lambda v: v.split(",")),
                      task_params=_pairs(args.task_set, "--task-set"), device=args.device,
                      progress=not args.no_progress, time_limit=args.time_limit,
                      train_overrides=_pairs(args.train_set, "--train-set"))
    print(markdown(table, args.task, SUITES[args.task][args.preset].label))
    print(f"\nwrote results.md/.csv/.json/.png to {out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rankdecay", description="Linear attention with rank-enhanced decay.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("info", help="version, mechanisms and which execution paths (GPU kernels) are available")
    p.set_defaults(func=_info)

    p = sub.add_parser("init", help="save an untrained model from a preset (to try generation, or to train)")
    p.add_argument("model_dir", help="directory to write (config.json, model.safetensors, tokenizer)")
    p.add_argument("--preset", default="tiny", help="tiny, 340m or 1.3b (default: tiny)")
    p.add_argument("--mixer", default="gdn", help="token mixer of every layer (default: gdn)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="override a config field, e.g. --set hh_rank=2 --set 'layer_mixers=[\"gdn\",\"swa\"]'")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_init)

    p = sub.add_parser("train", help="train a language model (no arguments: the tiny preset on the Python "
                       "standard library's sources, about a minute on 2 CPU cores)",
                       description="Train a language model. Options: preset < --config file < flags. Under torchrun "
                                   "(torchrun --nproc-per-node N -m rankdecay train ...) it runs data-parallel.")
    from .train.config import add_train_arguments

    add_train_arguments(p)
    p.set_defaults(func=_train)

    p = sub.add_parser("eval", help="validation loss, perplexity, bits per byte and loss by position of a saved model")
    p.add_argument("model_dir", help="a saved model (a `rankdecay train` output folder or checkpoint)")
    p.add_argument("--data", nargs="+", default=None, help="sources (default: the data the model was trained on)")
    p.add_argument("--seq-len", type=int, default=None, help="window length (default: 4x the training length)")
    p.add_argument("--max-windows", type=int, default=64, help="most windows to evaluate (default 64)")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"])
    p.add_argument("--out", default=None, help="folder for eval.json/.md/_positions.png (default: MODEL_DIR/eval)")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=_eval)

    from .prune import METHODS

    p = sub.add_parser("prune", help="prune key/query channels of a saved model (state reduction), "
                                     "report bits/byte, rank metrics and mixer speed, optionally recover")
    p.add_argument("model_dir", help="a saved model (e.g. a `rankdecay train` output folder)")
    p.add_argument("--method", default="drrqr", choices=METHODS)
    p.add_argument("--ratio", type=float, default=0.5, help="fraction of key channels to drop, in [0, 1)")
    p.add_argument("--calib", nargs="+", default=None, help="calibration data (default: the model's training data)")
    p.add_argument("--calib-samples", type=int, default=128, help="calibration windows (default 128)")
    p.add_argument("--seq-len", type=int, default=None, help="window length (default: the training length)")
    p.add_argument("--select", default="kq", choices=["kq", "k", "q"], help="score keys and queries, or one")
    p.add_argument("--budget", default="uniform", choices=["uniform", "adaptive"])
    p.add_argument("--tolerance", type=float, default=1.1, help="DRRQR's f >= 1")
    p.add_argument("--pca-adversarial", action="store_true",
                   help="pca keeps the lowest-variance components (the paper's App. E.4.2 control)")
    p.add_argument("--rft", type=int, default=0, metavar="STEPS", help="recovery fine-tuning steps (0: none)")
    p.add_argument("--rft-lr", type=float, default=1e-4)
    p.add_argument("--rft-batch-size", type=int, default=8)
    p.add_argument("--eval-windows", type=int, default=32)
    p.add_argument("--out", default=None, help="output folder (default: MODEL_DIR-METHOD-PERCENT)")
    p.add_argument("--device", default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=_prune)

    from .train.synth import SUITES

    p = sub.add_parser("synth", help="synthetic benchmarks (MQAR, MAD, state tracking, passkey): train each "
                                     "mechanism, evaluate, tabulate")
    p.add_argument("task", choices=sorted(SUITES))
    p.add_argument("--mechanisms", default="gdn,hdla,hh-gdn,deltanet", help="comma-separated mixers")
    p.add_argument("--preset", default="cpu", choices=sorted({k for suites in SUITES.values() for k in suites}),
                   help="cpu: minutes on 2 cores; paper: the papers' shapes and sweeps; zoology (mqar): the paper "
                        "model trained once on short sequences (Zoology's curriculum), tested at 256-2048 tokens")
    p.add_argument("--seeds", type=int, default=1)
    p.add_argument("--lr-sweep", nargs="+", default=None, help="learning rates (default: the preset's)")
    p.add_argument("--steps", type=int, default=None, help="override the preset's training steps")
    p.add_argument("--batch-size", type=int, default=None, help="override the preset's batch size")
    p.add_argument("--time-limit", type=float, default=0.0, metavar="SECONDS",
                   help="stop each training after this long and evaluate it where it got (0: no limit)")
    p.add_argument("--train-set", action="append", metavar="KEY=VALUE",
                   help="trainer setting for every run, e.g. matmul_precision=medium or weight_decay=0.01")
    p.add_argument("--task-set", action="append", metavar="KEY=VALUE",
                   help="task generator parameter for every setting, e.g. vocab_size=512")
    p.add_argument("--only", action="append", metavar="KEY=V1,V2", help="run only the preset's settings with "
                                                                         "these values, e.g. seq_len=512,1024")
    p.add_argument("--jobs", type=int, default=1, help="runs trained at once in separate processes (e.g. 4 on one "
                                                        "GPU: the models are small)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="model config override, e.g. allow_neg_eigval=true")
    p.add_argument("--out", default=None)
    p.add_argument("--device", default="auto")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=_synth)

    p = sub.add_parser("convert-fla",
                       help="a flash-linear-attention Gated DeltaNet, DeltaNet, GLA, Gated DeltaProduct or KDA "
                            "checkpoint (a hybrid with attention layers too) as a rankdecay model")
    p.add_argument("source", help="a folder an fla GatedDeltaNetForCausalLM, DeltaNetForCausalLM, GLAForCausalLM, "
                                  "GatedDeltaProductForCausalLM or KDAForCausalLM was saved to (config.json + "
                                  "weights), "
                                  "or a Hugging Face Hub repository of one (org/name)")
    p.add_argument("out", help="where to save the rankdecay model (save_pretrained; the tokenizer files are copied)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="the weights' dtype (default: as stored)")
    p.set_defaults(func=_convert_fla)

    p = sub.add_parser("generate", help="continue prompts with a saved model")
    p.add_argument("model_dir", help="a directory saved by save_pretrained (or `rankdecay init`)")
    p.add_argument("--prompt", action="append", required=True, help="a prompt; repeat for a batch")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy; > 0: sampling")
    p.add_argument("--top-k", type=int, default=0, help="with sampling: keep the k most likely tokens (0: all)")
    p.add_argument("--top-p", type=float, default=1.0, help="with sampling: nucleus probability")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--state-dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="the decoding cache's recurrent-state dtype (default: the model config's, float32)")
    p.add_argument("--cuda-graph", action="store_true",
                   help="decode with rankdecay.models.GraphDecoder: the step as a CUDA graph on a GPU "
                        "(on a CPU the same static-buffer steps, eagerly); several prompts are prefilled packed "
                        "into one row (cu_seqlens), not left-padded")
    p.add_argument("--compile", action="store_true",
                   help="decode with GraphDecoder's step through torch.compile (its small kernels fused; with "
                        "--cuda-graph, then recorded as a graph): faster per token, after a compile of tens of "
                        "seconds")
    p.add_argument("--no-pack", action="store_true",
                   help="with --cuda-graph or --compile: each projection its own matrix product in the step, "
                        "rather than one per layer input against a copy of the weights (saves that copy's memory)")
    p.set_defaults(func=_generate)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # our commands print their own one-line summaries
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except RuntimeError as e:
        from .train.synth import SynthRunsFailed

        if not isinstance(e, SynthRunsFailed):
            raise
        print(f"rankdecay {args.command}: error: {e}", file=sys.stderr)  # each failure was printed as it happened
        return 1
    except (ValueError, FileNotFoundError, ImportError) as e:
        # Bad input (a path, a preset, a size): one clear line, no traceback.
        # RANKDECAY_DEBUG=1 shows the traceback.
        import os

        if os.environ.get("RANKDECAY_DEBUG"):
            raise
        print(f"rankdecay {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
