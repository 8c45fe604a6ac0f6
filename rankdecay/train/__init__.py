"""Training and evaluation: ``TrainConfig`` -> ``train()``; ``evaluate_model()`` for saved models."""
from .config import TRAIN_PRESETS, TrainConfig, load_config_file
from .data import Corpus, WindowSampler, build_tokenizer, iter_documents, make_batch
from .evaluate import EvalResult, evaluate_model, save_eval
from .trainer import checkpoints, lr_at, plot_metrics, read_metrics, train

__all__ = ["TRAIN_PRESETS", "TrainConfig", "load_config_file", "Corpus", "WindowSampler", "build_tokenizer",
           "iter_documents", "make_batch", "EvalResult", "evaluate_model", "save_eval", "checkpoints", "lr_at",
           "plot_metrics", "read_metrics", "train"]
