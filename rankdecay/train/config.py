"""The training configuration: one typed dataclass, named presets, TOML/YAML files and flags.

Precedence, lowest first: the dataclass defaults, the preset (``preset = "tiny"`` by
default), a config file (``--config run.toml`` / ``.yaml``), then command-line flags.
Every field is a flag (``lr`` -> ``--lr``, ``warmup_steps`` -> ``--warmup-steps``); model
fields are overridden with ``--set key=value`` or a ``[model]`` table in the file.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import typing
from dataclasses import dataclass, field
from pathlib import Path

# Training presets. "tiny" is the README's main job: the tiny model on the embedded
# corpus (the Python standard library's sources), a few minutes on 2 CPU cores. "340m"
# and "1.3b" follow Head-in-Head App. C.2 / Table 9 (context 2048, AdamW 0.9/0.95,
# peak lr 3e-4 with a cosine to 3e-5, weight decay 0.01, clip 1.0, 512 warm-up steps,
# global batch 256 / 1024 sequences); steps are left to the user's budget.
TRAIN_PRESETS: dict[str, dict] = {
    "tiny": dict(model_preset="tiny", seq_len=256, batch_size=16, steps=800, lr=3e-3, min_lr=3e-4,
                 warmup_steps=50, weight_decay=0.1, eval_every=200, save_every=200, log_every=10),
    "340m": dict(model_preset="340m", seq_len=2048, batch_size=256, micro_batch_size=8, steps=30720, lr=3e-4,
                 min_lr=3e-5, warmup_steps=512, weight_decay=0.01, eval_every=1000, save_every=1000,
                 tokenizer="bytes"),
    "1.3b": dict(model_preset="1.3b", seq_len=2048, batch_size=1024, micro_batch_size=4, steps=50016, lr=3e-4,
                 min_lr=3e-5, warmup_steps=512, weight_decay=0.01, eval_every=1000, save_every=1000,
                 tokenizer="bytes", fsdp=True),
}


@dataclass
class TrainConfig:
    """Everything ``rankdecay train`` needs. Sizes are in sequences of ``seq_len`` tokens."""

    # --- what to train
    preset: str = "tiny"
    """Training preset (see ``TRAIN_PRESETS``); sets the fields below it does not override."""
    model_preset: str = "tiny"
    """Model preset of ``RankDecayConfig.from_preset`` (tiny, 340m, 1.3b)."""
    mixer: str = "gdn"
    """Token mixer of every layer (gdn, hdla, hh-gdn, deltanet, gla, ...)."""
    model: dict = field(default_factory=dict)
    """Overrides of model config fields, e.g. {"hh_rank": 2, "num_hidden_layers": 4}."""
    init_from: str | None = None
    """Start from the weights (and config) of a saved model directory instead of a fresh init."""

    # --- data
    data: list = field(default_factory=lambda: ["stdlib"])
    """Sources: "stdlib" (the Python standard library's sources; no download), text files or
    folders, or "hf:NAME[:CONFIG[:SPLIT]]" for a Hugging Face dataset (needs `datasets`)."""
    tokenizer: str = "bytes"
    """"bytes" (UTF-8 bytes + bos/eos/pad), a tokenizer.json file, or a Hugging Face tokenizer name/dir."""
    seq_len: int = 256
    """Training length in tokens."""
    val_fraction: float = 0.02
    """Fraction of documents held out for validation (chosen by a hash of each document's name)."""
    pack: str = "concat"
    """"concat": documents joined by <eos> and cut into windows; "varlen": the same windows, but
    every document restarts the recurrent state (cu_seqlens; no cross-document leakage)."""
    text_suffixes: list = field(default_factory=lambda: [".py", ".txt", ".md", ".rst", ".json", ".toml", ".c", ".h"])
    """File suffixes read from folders."""

    # --- optimisation
    steps: int = 400
    """Optimizer steps."""
    time_limit: float = 0.0
    """Stop after this many seconds of training (0: no limit), then evaluate and save the model
    at the step reached, as at the end. The learning-rate schedule is still that of ``steps``."""
    batch_size: int = 16
    """Global batch: sequences per optimizer step over all processes and accumulation."""
    micro_batch_size: int | None = None
    """Sequences per forward pass on each process (default: batch_size / world size);
    gradient accumulation makes up the rest."""
    lr: float = 3e-3
    min_lr: float = 3e-4
    """The cosine schedule's floor."""
    warmup_steps: int = 40
    weight_decay: float = 0.1
    """AdamW weight decay (not applied to norms, biases, gates' scalars and embeddings)."""
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0
    """Max global gradient norm (0 disables clipping)."""

    # --- runtime
    out_dir: str | None = None
    """Where checkpoints, logs and the final model go (default: runs/<preset>-<mixer>)."""
    device: str = "auto"
    """"auto" (cuda if available), "cpu", "cuda", "cuda:1", ..."""
    dtype: str = "auto"
    """Autocast dtype: "auto" (bfloat16 on CUDA, float32 on CPU), "bfloat16", "float16", "float32"."""
    compile: bool = False
    """torch.compile the model: the first steps compile it (about a minute), then it trains faster (the 340m preset on
    an H200: 1.0-1.8x, with less memory). The chunked Triton ops are opaque operators of the one compiled graph."""
    matmul_precision: str = "auto"
    """``torch.set_float32_matmul_precision`` during training, which the Triton kernels' products follow: "highest"
    (fp32-accurate products), "high" (TF32) or "medium" (bf16 products with fp32 accumulation, as fla's kernels; on
    CUDA it also lets the HDLA-style ops take the fused Triton kernels, see ``rankdecay.ops.dplr``). "auto": "medium"
    on CUDA under 16-bit autocast (whose linear maps already hand the kernels bf16 inputs), else "highest"."""
    gradient_checkpointing: bool = False
    fsdp: bool = False
    """Shard the model with FSDP2 (``fully_shard``) instead of replicating it with DDP."""
    seed: int = 0
    log_every: int = 10
    eval_every: int = 100
    """Validation every N steps (0: only at the end)."""
    eval_batches: int = 8
    """Validation batches (of micro_batch_size sequences) per evaluation."""
    save_every: int = 100
    """Checkpoint every N steps (0: only at the end)."""
    keep_checkpoints: int = 2
    """How many step checkpoints to keep (the final model is always written)."""
    resume: bool = False
    """Continue from the newest checkpoint in out_dir."""
    peak_tflops: float | None = None
    """Accelerator peak for MFU (default: known GPUs' dense bf16 peak; none on CPU)."""
    progress: bool = True
    """Show a progress bar (loss, tokens/s, ETA)."""

    def __post_init__(self):
        self.validate()

    # ------------------------------------------------------------------ checks
    def validate(self) -> None:
        """Clear errors for values no run can use."""
        from ..models import MIXERS, PRESETS

        if self.model_preset not in PRESETS:
            raise ValueError(f"model_preset: unknown model preset {self.model_preset!r}; choose from "
                             f"{', '.join(PRESETS)}")
        if self.mixer not in MIXERS:
            raise ValueError(f"mixer: unknown mixer {self.mixer!r}; choose from {', '.join(MIXERS)}")
        positive = ("seq_len", "batch_size", "steps", "eval_batches")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.micro_batch_size is not None and self.micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {self.micro_batch_size}")
        if self.seq_len < 2:
            raise ValueError(f"seq_len must be >= 2 (one input and one target), got {self.seq_len}")
        if not 0 < self.val_fraction < 1:
            raise ValueError(f"val_fraction must be in (0, 1), got {self.val_fraction}")
        if self.pack not in ("concat", "varlen"):
            raise ValueError(f"pack must be 'concat' or 'varlen', got {self.pack!r}")
        if self.lr <= 0 or self.min_lr < 0 or self.min_lr > self.lr:
            raise ValueError(f"need 0 <= min_lr <= lr and lr > 0; got lr={self.lr}, min_lr={self.min_lr}")
        for name in ("warmup_steps", "log_every", "eval_every", "save_every", "keep_checkpoints", "time_limit"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.matmul_precision not in ("auto", "highest", "high", "medium"):
            raise ValueError(f"matmul_precision must be auto, highest, high or medium; got {self.matmul_precision!r}")
        if self.dtype not in ("auto", "bfloat16", "float16", "float32"):
            raise ValueError(f"dtype must be auto, bfloat16, float16 or float32; got {self.dtype!r}")
        if not isinstance(self.data, list) or not self.data:
            raise ValueError("data must name at least one source (\"stdlib\", a path, or hf:NAME)")
        if not isinstance(self.model, dict):
            raise ValueError(f"model must be a table of model config overrides, got {type(self.model).__name__}")

    # ----------------------------------------------------------- construction
    @classmethod
    def from_sources(cls, preset: str | None = None, file: str | Path | None = None,
                     overrides: dict | None = None) -> "TrainConfig":
        """Defaults <- preset <- file <- overrides (each a dict of field values)."""
        values: dict = {}
        file_values = load_config_file(file) if file is not None else {}
        overrides = {k: v for k, v in (overrides or {}).items() if v is not None}
        preset = overrides.get("preset") or file_values.get("preset") or preset or "tiny"
        if preset not in TRAIN_PRESETS:
            raise ValueError(f"preset: unknown training preset {preset!r}; choose from {', '.join(TRAIN_PRESETS)}")
        values.update(TRAIN_PRESETS[preset], preset=preset)
        for layer in (file_values, overrides):
            model = {**values.get("model", {}), **layer.get("model", {})}
            values.update(layer)
            values["model"] = model
        unknown = sorted(set(values) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ValueError(f"unknown training option(s): {', '.join(unknown)}")
        return cls(**values)

    def resolved_out_dir(self) -> Path:
        return Path(self.out_dir) if self.out_dir else Path("runs") / f"{self.preset}-{self.mixer}"

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def load_config_file(path: str | Path) -> dict:
    """Field values from a TOML or YAML file (a ``[model]`` table holds model overrides)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"config file {path} does not exist")
    if path.suffix == ".toml":
        import tomllib

        with path.open("rb") as f:
            values = tomllib.load(f)
    elif path.suffix in (".yaml", ".yml"):
        try:
            import yaml
        except ImportError as e:  # pragma: no cover - depends on the environment
            raise ImportError("reading a YAML config needs PyYAML (pip install pyyaml), or use TOML") from e
        values = yaml.safe_load(path.read_text()) or {}
    elif path.suffix == ".json":
        values = json.loads(path.read_text())
    else:
        raise ValueError(f"config file {path}: expected .toml, .yaml/.yml or .json")
    if not isinstance(values, dict):
        raise ValueError(f"config file {path} must hold a table of options")
    return values


# ------------------------------------------------------------------ argparse
_FLAG_HELP_SKIP = {"model"}


def _field_type(f: dataclasses.Field):
    hint = typing.get_type_hints(TrainConfig)[f.name]
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if args else hint


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per ``TrainConfig`` field (default None: 'not given', so presets and files apply)."""
    parser.add_argument("--config", help="a TOML or YAML file of options (flags override it)")
    parser.add_argument("--set", action="append", metavar="KEY=VALUE", dest="model_set",
                        help="override a model config field, e.g. --set hh_rank=2 --set num_hidden_layers=4")
    docs = _field_docs()
    for f in dataclasses.fields(TrainConfig):
        if f.name in _FLAG_HELP_SKIP:
            continue
        flag = "--" + f.name.replace("_", "-")
        kind = _field_type(f)
        help_text = docs.get(f.name, "")
        if kind is bool:
            parser.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        elif kind is list or typing.get_origin(kind) is list:
            parser.add_argument(flag, dest=f.name, nargs="+", default=None, help=help_text)
        else:
            parser.add_argument(flag, dest=f.name, type=kind, default=None, help=help_text)


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    overrides = {f.name: getattr(args, f.name, None) for f in dataclasses.fields(TrainConfig)
                 if f.name not in _FLAG_HELP_SKIP}
    model = {}
    for item in getattr(args, "model_set", None) or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--set expects key=value, got {item!r}")
        try:
            model[key] = json.loads(value)
        except json.JSONDecodeError:
            model[key] = value
    if model:
        overrides["model"] = model
    return TrainConfig.from_sources(file=args.config, overrides=overrides)


def _field_docs() -> dict[str, str]:
    """The attribute docstrings above, for --help."""
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(TrainConfig))
    body = tree.body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
            docs[node.target.id] = " ".join(str(nxt.value.value).split()).replace("%", "%%")
    return docs
