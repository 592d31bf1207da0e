"""AdamW and the LR schedule (linear warmup, then constant or cosine to a floor)."""

from __future__ import annotations

import math

import torch

from verl_core.config import OptimConfig


def lr_factor(step: int, *, warmup_steps: int, total_steps: int, schedule: str,
              min_lr_ratio: float) -> float:
    """Multiplier of the peak LR at optimizer step ``step`` (0-based)."""
    if warmup_steps and step < warmup_steps:
        return (step + 1) / warmup_steps  # linear warmup reaching 1 at the last warmup step
    if schedule == "constant":
        return 1.0
    span = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    # cosine from 1 to min_lr_ratio: r + (1 - r) * (1 + cos(pi * progress)) / 2
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def make_optimizer(params, cfg: OptimConfig, lr: float) -> torch.optim.AdamW:
    return torch.optim.AdamW([p for p in params if p.requires_grad], lr=lr,
                             betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                             weight_decay=cfg.weight_decay)


def make_scheduler(optimizer, cfg: OptimConfig, total_steps: int):
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, warmup_steps=cfg.warmup_steps, total_steps=total_steps,
                                       schedule=cfg.lr_schedule, min_lr_ratio=cfg.min_lr_ratio))
