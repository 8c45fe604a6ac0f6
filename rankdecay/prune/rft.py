"""Recovery fine-tuning (state-reduction paper App. C): LoRA (rank 16, alpha 32) on every linear
layer, the short convolutions unfrozen, and distillation from the unpruned model (KL of the
next-token distributions) plus the language-model loss. The adapters are merged at the end,
so the result is a plain model of the same (pruned) shape."""
from __future__ import annotations

import math
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..train.trainer import lr_at


class LoRALinear(nn.Module):
    """``y = x W^T + (alpha / r) x A^T B^T`` with ``W`` frozen; B starts at zero."""

    def __init__(self, base: nn.Linear, rank: int = 16, alpha: float = 32.0):
        super().__init__()
        self.base = base
        base.weight.requires_grad_(False)
        if base.bias is not None:
            base.bias.requires_grad_(False)
        r = min(rank, base.in_features, base.out_features)
        self.scaling = alpha / rank
        self.A = nn.Parameter(torch.empty(r, base.in_features, device=base.weight.device))
        self.B = nn.Parameter(torch.zeros(base.out_features, r, device=base.weight.device))
        nn.init.kaiming_uniform_(self.A, a=math.sqrt(5))

    def forward(self, x):
        return self.base(x) + (x @ self.A.T.to(x.dtype)) @ self.B.T.to(x.dtype) * self.scaling

    def merged(self) -> nn.Linear:
        with torch.no_grad():
            self.base.weight += (self.B @ self.A * self.scaling).to(self.base.weight.dtype)
        self.base.weight.requires_grad_(True)
        return self.base


def _swap_children(model, make) -> None:
    """Replace each submodule for which ``make(full_name, module)`` returns a module (modules
    present before the call only: what ``make`` returns is not visited)."""
    for name, mod in list(model.named_modules()):
        for child_name, child in list(mod.named_children()):
            new = make(f"{name}.{child_name}" if name else child_name, child)
            if new is not None:
                setattr(mod, child_name, new)


def add_lora(model, rank: int = 16, alpha: float = 32.0) -> None:
    """Freeze ``model`` and wrap every linear layer but the LM head in a ``LoRALinear``; the
    short-convolution filters stay trainable."""
    for p in model.parameters():
        p.requires_grad_(False)
    _swap_children(model, lambda full, child: LoRALinear(child, rank, alpha)
                   if isinstance(child, nn.Linear) and not full.startswith("lm_head") else None)
    for name, p in model.named_parameters():
        if "_conv." in name:  # q_conv / k_conv / v_conv filters train in full
            p.requires_grad_(True)


def merge_lora(model) -> None:
    """Fold every ``LoRALinear`` back into a plain linear layer; all parameters trainable again."""
    _swap_children(model, lambda full, child: child.merged() if isinstance(child, LoRALinear) else None)
    for p in model.parameters():
        p.requires_grad_(True)


def recover(student, teacher, batches, lr: float = 1e-4, rank: int = 16, alpha: float = 32.0,
            kd_weight: float = 1.0, progress: bool = True) -> list[float]:
    """Fine-tune ``student`` in place on ``batches`` (token ids [B, T] each, one per step);
    returns the per-step losses. Warm-up over 5% of the steps, cosine from ``lr`` to ``lr / 10``."""
    steps = len(batches)
    if steps == 0:
        return []
    add_lora(student, rank, alpha)
    params = [p for p in student.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    sched = SimpleNamespace(steps=steps, warmup_steps=max(1, steps // 20), lr=lr, min_lr=lr / 10)
    student.train()
    teacher.eval()
    losses = []
    it = range(steps)
    if progress:
        from tqdm.auto import tqdm

        it = tqdm(it, desc="recovery fine-tuning", unit="step", leave=False)
    device = next(student.parameters()).device
    for step in it:
        for group in opt.param_groups:
            group["lr"] = lr_at(step, sched)
        ids = batches[step].to(device)
        with torch.no_grad():
            t_logits = teacher(input_ids=ids, use_cache=False).logits[:, :-1].float()
        # the distillation needs the student's logits, so its loss is formed from them here (with labels, a
        # model with fuse_linear_cross_entropy would return none)
        s_logits = student(input_ids=ids, use_cache=False).logits[:, :-1].float()
        ce = F.cross_entropy(s_logits.flatten(0, 1), ids[:, 1:].flatten())
        kd = F.kl_div(F.log_softmax(s_logits, -1), F.log_softmax(t_logits, -1), log_target=True,
                      reduction="none").sum(-1).mean()
        loss = ce + kd_weight * kd
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    merge_lora(student)
    student.eval()
    return losses
