"""The actor: the policy being trained and everything that belongs to it.

Its float32 master weights (PEFT adapters on a frozen base with ``model.lora_rank``), their
optimizer and LR schedule, the reference policy (a frozen copy in ``model.dtype``, or the policy
with its adapters off), the KL controller, and :meth:`Actor.update`, the PPO epochs. Whether the
policy is LoRA is decided once, here (:attr:`Actor.lora`); everything that needs to know asks the
actor (its merged weights, its reference, its checkpoint groups, its export)."""

from __future__ import annotations

import contextlib

import torch

from verl_core.algorithms import make_kl_controller
from verl_core.models import load_causal_lm
from verl_core.models.lora import apply_lora, lora_meta, merged_state, scalings, split_state
from verl_core.parts.trained import Trained, model_state
from verl_core.training import sharding
from verl_core.training.dist import DataParallel
from verl_core.training.optim import make_optimizer, make_scheduler
from verl_core.training.ppo import UpdateOptions, ppo_update


class Actor(Trained):
    """The policy, its optimizer, schedule, reference and KL controller (one worker's share of
    them with W > 1: FSDP2 shards)."""

    WEIGHTS, OPTIMIZER, SCHEDULER = "policy", "optimizer", "scheduler"

    def __init__(self, cfg, model_path: str, dp: DataParallel, device: torch.device, seed: int):
        algo = cfg.algorithm
        model = load_causal_lm(model_path, "float32")
        if cfg.model.gradient_checkpointing:  # renamed in transformers 5.x; the old name warns
            enable = getattr(model, "activation_checkpointing_enable", None)
            (enable or model.gradient_checkpointing_enable)()
        self.lora: dict | None = None
        """``model.lora_rank > 0``: the adapters' settings (what a checkpoint's ``meta["lora"]``
        and an export keep); None for a full-weight policy."""
        self._scale: dict[str, float] = {}  # LoRA: each adapted layer's scale
        if cfg.model.lora_rank > 0:
            # PEFT adapters on the float32 policy, the base frozen; the reference is then the
            # policy with its adapters off (no second copy), models/lora.py
            model = apply_lora(model, cfg.model, seed)
            self.lora, self._scale = lora_meta(model), scalings(model)
        model.to(device)
        self._model_path, self._cfg, self._device = model_path, cfg, device
        super().__init__(model, None, None, dp)

    def build(self) -> "Actor":
        """The second half of the build, once the behaviour policy's copy (if any) was loaded:
        shard (W > 1) or set the compute dtype, the reference, the optimizer, the schedule and the
        KL controller."""
        cfg, dp, algo = self._cfg, self.dp, self._cfg.algorithm
        # model.dtype=bfloat16: float32 master weights and optimizer state, bf16 compute (FSDP2's
        # MixedPrecisionPolicy with W > 1, sharding.compute_in on one worker)
        sharding.train_in(self.model, sharding.COMPUTE_DTYPES[cfg.model.dtype],
                          distributed=dp.distributed)
        self.ref = None  # a separate frozen reference (none with LoRA: the adapters go off)
        if algo.uses_reference and self.lora is None:
            self.ref = load_causal_lm(self._model_path, cfg.model.dtype).requires_grad_(False)
            self.ref.to(self._device)
            if dp.distributed:
                sharding.shard(self.ref)
        total = cfg.total_optimizer_steps
        self.optimizer = make_optimizer(self.model.parameters(), cfg.optim, cfg.optim.lr)
        self.scheduler = make_scheduler(self.optimizer, cfg.optim, total,
                                        cfg.optimizer_steps_per_rl_step)
        self.kl_ctrl = make_kl_controller(algo.kl_ctrl_type, kl_coef=algo.kl_coef,
                                          target_kl=algo.kl_target, horizon=algo.kl_horizon)
        return self

    # ------------------------------------------------------------------ weights
    def merged_state(self, full: dict | None = None) -> dict[str, torch.Tensor]:
        """The policy's weights as a plain model's state dict: a LoRA policy's merged
        (W + s B A), else as they are. ``full``: its full state dict when sharded (gathered)."""
        state = self.model.state_dict() if full is None else full
        return merged_state(state, self._scale) if self.lora is not None else state

    def gathered_merged_state(self) -> dict[str, torch.Tensor]:
        """W > 1: :meth:`merged_state` of the full weights, gathered from the shards on every
        worker (a collective)."""
        return self.merged_state(sharding.full_model_state(self.model, rank0_only=False))

    @contextlib.contextmanager
    def reference(self):
        """The model that computes the reference log-probs: the frozen copy, or the policy with
        its adapters off (LoRA)."""
        if self.ref is not None:
            yield self.ref
        elif self.lora is not None:
            with self.model.disable_adapter():
                yield self.model
        else:
            yield self.model

    def export(self, folder: str, source: str) -> None:
        """Write the policy as a Hugging Face folder faithful to ``source`` (the user's model
        folder): merged weights, plus the adapters as PEFT writes them for a LoRA policy. With
        W > 1 a collective (the weights are gathered); only rank 0 writes."""
        from verl_core.checkpoint.hf_export import export_trained

        full = sharding.full_model_state(self.model, rank0_only=True) \
            if self.dp.distributed else self.model.state_dict()
        if self.dp.rank == 0:
            export_trained(self.model, folder, source, full, merged=self.merged_state(full),
                           lora=self.lora)

    # ------------------------------------------------------------------ checkpoint groups
    def weight_groups(self) -> dict:
        """``{"policy": the policy's state}``; a LoRA policy's is its adapters, and its frozen
        base goes to ``base``, a shared group (stored once per run, linked by later saves)."""
        state = model_state(self.model)
        if self.lora is None:
            return {"policy": state}
        adapters, base = split_state(self.model, state)
        return {"policy": adapters, "base": base}

    def state_dict(self, *, with_optimizer: bool = True) -> tuple[dict, dict]:
        groups, meta = super().state_dict(with_optimizer=with_optimizer)
        if self.ref is not None:  # a "shared" group: stored once per run, linked by later saves
            groups["reference"] = model_state(self.ref)
        meta.update(kl_ctrl=self.kl_ctrl.state_dict(), hf_config=self.model.config.to_dict())
        if self.lora is not None:  # what an export rebuilds the adapters with
            meta["lora"] = dict(self.lora)
        return groups, meta

    def load_state_dict(self, groups: dict, meta: dict) -> None:
        super().load_state_dict(groups, meta)
        self.kl_ctrl.load_state_dict(meta["kl_ctrl"])

    def _load_weights(self, weights: dict) -> None:
        if self.lora is None:
            return super()._load_weights(weights)
        # the adapters; the base is the assets' own
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        got = set_model_state_dict(self.model, weights, options=StateDictOptions(strict=False))
        # everything but the adapters (tied weights appear once as parameters, under every name
        # in the state dict)
        frozen = set(self.model.state_dict()) - {n for n, p in self.model.named_parameters()
                                                 if p.requires_grad}
        wrong = sorted(set(got.missing_keys) - frozen) + sorted(got.unexpected_keys)
        if wrong:
            raise ValueError(f"this checkpoint's policy is not this run's LoRA adapters "
                             f"(missing or unexpected: {wrong[:5]}); resume it with the "
                             "model.lora_* settings that wrote it")

    # ------------------------------------------------------------------ update
    def update(self, batch, *, seed: int, critic=None, after_backward=None) -> dict:
        """The KL controller (``use_kl_in_reward``), then the PPO epochs over the advantaged
        ``batch`` (:func:`~verl_core.training.ppo.ppo_update`), seeded by ``seed``; with a
        ``critic`` (:class:`~verl_core.parts.Critic`) its value loss in the same loop."""
        c = self._cfg
        metrics = {}
        if c.algorithm.use_kl_in_reward:
            # the controller moves here, not in the advantage phase, so the state it belongs to
            # changes in exactly one phase (the one that also changes the weights)
            self.kl_ctrl.update(batch.meta["reward_kl"], batch.num_rows)
            metrics["actor/kl_coef"] = self.kl_ctrl.value
        metrics.update(ppo_update(
            self.model, self.optimizer, self.scheduler, batch, UpdateOptions.from_config(c),
            seed=seed, critic=critic and critic.model,
            critic_optimizer=critic and critic.optimizer,
            critic_scheduler=critic and critic.scheduler, dp=self.dp,
            after_backward=after_backward))
        return metrics
