"""State reduction: structured pruning of key/query channels (state-reduction paper), rank diagnostics
and recovery fine-tuning. ``prune(model, method, ratio, calib)`` returns a smaller model."""
from .api import prune
from .core import (
    METHODS, adaptive_budgets, apply_pruning, keep_to_transforms, linear_mixers, transform_model, uniform_budgets,
    zero_channels,
)
from .metrics import diagnostics_table, plot_diagnostics, state_diagnostics
from .rft import add_lora, merge_lora, recover
from .rrqr import qrcp, rrqr_quantities, strong_rrqr

__all__ = ["prune", "METHODS", "adaptive_budgets", "apply_pruning", "keep_to_transforms", "linear_mixers",
           "transform_model", "uniform_budgets", "zero_channels", "diagnostics_table", "plot_diagnostics",
           "state_diagnostics", "add_lora", "merge_lora", "recover", "qrcp", "rrqr_quantities", "strong_rrqr"]
