"""What a trained part shares: a float32 model, its optimizer and LR schedule, their checkpoint
groups (torch.distributed.checkpoint's layout: parameters by name, DTensor shards with W > 1, so a
checkpoint loads on any W) and the learning-rate scale the guard's rollback applies."""

from __future__ import annotations

import torch

from verl_core.training.dist import DataParallel


def model_state(model) -> dict:
    """``model``'s state dict in DCP's layout (a sharded model's shards)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(model)


class Trained:
    """A model trained by this worker, with its optimizer and schedule. Subclasses name the
    checkpoint groups (``WEIGHTS``, ``OPTIMIZER``) and the meta key of the schedule."""

    WEIGHTS = OPTIMIZER = SCHEDULER = ""

    def __init__(self, model: torch.nn.Module, optimizer, scheduler, dp: DataParallel):
        self.model, self.optimizer, self.scheduler, self.dp = model, optimizer, scheduler, dp

    def weight_groups(self) -> dict:
        """``{WEIGHTS: the model's state}`` (the actor's LoRA splits it)."""
        return {self.WEIGHTS: model_state(self.model)}

    def state_dict(self, *, with_optimizer: bool = True) -> tuple[dict, dict]:
        """The checkpoint groups and meta of this part. An optimizer that never stepped has no
        state to save (asking torch for its state dict would create one: a zero-gradient step);
        a resume then starts it fresh too."""
        groups, meta = self.weight_groups(), {}
        if with_optimizer and self.optimizer.state:
            groups[self.OPTIMIZER] = self._optim_state()
            meta[self.SCHEDULER] = self.scheduler.state_dict()
        return groups, meta

    def load_targets(self) -> dict:
        """Views of the live state for a load to fill in place (no second copy). Optimizer views
        (W > 1 only) give the optimizer zero-initialised moments first (torch's way); the load
        overwrites them."""
        out = {self.WEIGHTS: self.weight_groups()[self.WEIGHTS]}
        if self.dp.distributed:
            out[self.OPTIMIZER] = self._optim_state()
        return out

    def load_state_dict(self, groups: dict, meta: dict) -> None:
        """Inverse of :meth:`state_dict` (a checkpoint without optimizer state restarts the
        moments). Optimizer state may be by parameter name (DCP's layout, what this saves) or by
        index (``Optimizer.state_dict()``, checkpoints written before worker groups)."""
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        self._load_weights(groups[self.WEIGHTS])
        optim_state = groups.get(self.OPTIMIZER)
        if optim_state is None:  # no stale moments from whatever this part held before
            self.optimizer.state.clear()
        elif all(isinstance(k, int) for k in optim_state.get("state", {})):
            if self.dp.distributed:
                raise ValueError("this checkpoint stores the optimizer by parameter index (written "
                                 "before worker groups); resume it with one worker first")
            self.optimizer.load_state_dict(optim_state)
        else:
            set_optimizer_state_dict(self.model, self.optimizer, optim_state)
        if optim_state is not None:
            self.scheduler.load_state_dict(meta[self.SCHEDULER])

    def _load_weights(self, weights: dict) -> None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        set_model_state_dict(self.model, weights)  # W > 1: the loaded shards (in place already)

    def _optim_state(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return get_optimizer_state_dict(self.model, self.optimizer)

    def scale_lr(self, factor: float) -> None:
        """Multiply the learning rate by ``factor`` from now on: the current LR and the
        schedule's base, so the warmup/cosine shape is kept. The base LRs are part of the
        scheduler's state, so checkpoints carry the scaled schedule."""
        for g in self.optimizer.param_groups:
            g["lr"] *= factor
            if "initial_lr" in g:
                g["initial_lr"] *= factor
        self.scheduler.base_lrs = [b * factor for b in self.scheduler.base_lrs]
