"""AdamW and the LR schedule (linear warmup, then constant or cosine to a floor)."""

from __future__ import annotations

import math

import torch

from verl_core.training.config import OptimConfig


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


def _fused_supported(params: list) -> bool:
    """torch's fused AdamW kernel covers these parameters: floating point, all on devices it
    supports (CPU included since torch 2.4). Its state dict has the same keys and shapes as the
    for-loop implementation's, so checkpoints load either way."""
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices
    devices = _get_fused_kernels_supported_devices()
    return all(p.device.type in devices and torch.is_floating_point(p) for p in params)


def make_optimizer(params, cfg: OptimConfig, lr: float) -> torch.optim.AdamW:
    """AdamW, fused where torch has the kernel (one pass over every tensor per step instead of
    one small op per tensor per moment: the for-loop default on CPU is ~3x slower on the tiny
    model), else the multi-tensor ``foreach`` path."""
    params = [p for p in params if p.requires_grad]
    fast = {"fused": True} if _fused_supported(params) else {"foreach": True}
    opt = torch.optim.AdamW(params, lr=lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                            weight_decay=cfg.weight_decay, **fast)

    def keep_fast_path(optimizer):
        # load_state_dict restores every param-group key, the implementation flags included: a
        # checkpoint from the for-loop AdamW would switch a resumed run back to it
        for group in optimizer.param_groups:
            group.update(fast)

    opt.register_load_state_dict_post_hook(keep_fast_path)
    return opt


def optimizer_steps_line(cfg) -> str:
    """The run header's account of the optimizer steps one RL step takes (a ``RunConfig``):
    ``--batch-size B`` alone changes the batch, not the mini-batch, so it changes this count."""
    n = cfg.optimizer_steps_per_rl_step
    a = cfg.actor
    return (f"{n} optimizer step{'s' if n != 1 else ''} per RL step (data.train_batch_size "
            f"{cfg.data.train_batch_size} / actor.ppo_mini_batch_size {a.ppo_mini_batch_size}"
            f" x actor.ppo_epochs {a.ppo_epochs})")


def make_scheduler(optimizer, cfg: OptimConfig, total_steps: int, per_rl_step: int = 1,
                   warmup_steps: int | None = None):
    """The LR schedule over ``total_steps`` optimizer steps, stepped once per applied optimizer
    step. ``cfg.lr_schedule_unit == "rl_step"``: warmup and cosine count RL steps of
    ``per_rl_step`` optimizer steps each, and the LR holds within an RL step (verl's scheduler,
    stepped once per update). ``warmup_steps``: in place of ``cfg.warmup_steps`` (the critic's
    own, ``cfg.critic_warmup_steps``)."""
    k = per_rl_step if cfg.lr_schedule_unit == "rl_step" else 1
    warmup = cfg.warmup_steps if warmup_steps is None else warmup_steps
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s // k, warmup_steps=warmup,
                                       total_steps=total_steps // k, schedule=cfg.lr_schedule,
                                       min_lr_ratio=cfg.min_lr_ratio))
