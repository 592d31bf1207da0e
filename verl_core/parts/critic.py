"""The critic (GAE's value model): the policy's backbone with a fresh scalar head, its optimizer
and LR schedule (``optim.critic_lr``, ``optim.critic_warmup_steps``); its checkpoint groups are
``critic`` and ``critic_optimizer``. It trains in the actor's update loop
(``Actor.update(critic=...)``)."""

from __future__ import annotations

import torch

from verl_core.models import load_critic
from verl_core.parts.trained import Trained
from verl_core.training import sharding
from verl_core.training.dist import DataParallel
from verl_core.training.optim import make_optimizer, make_scheduler


class Critic(Trained):
    WEIGHTS, OPTIMIZER, SCHEDULER = "critic", "critic_optimizer", "critic_scheduler"

    def __init__(self, cfg, model_path: str, dp: DataParallel, device: torch.device, seed: int):
        # the value head is freshly initialised: seed it, so every worker builds the same one
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = load_critic(model_path, "float32").to(device)
        sharding.train_in(model, sharding.COMPUTE_DTYPES[cfg.model.dtype],
                          distributed=dp.distributed)
        optimizer = make_optimizer(model.parameters(), cfg.optim, cfg.optim.critic_lr)
        own = cfg.optim.critic_warmup_steps
        scheduler = make_scheduler(optimizer, cfg.optim, cfg.total_optimizer_steps,
                                   cfg.optimizer_steps_per_rl_step,
                                   warmup_steps=own if own >= 0 else None)
        super().__init__(model, optimizer, scheduler, dp)
        self._estimator = cfg.algorithm.adv_estimator

    def load_state_dict(self, groups: dict, meta: dict) -> None:
        if self.WEIGHTS not in groups:
            raise ValueError("checkpoint has no critic but this run trains one "
                             f"(algorithm.adv_estimator={self._estimator!r})")
        super().load_state_dict(groups, meta)
