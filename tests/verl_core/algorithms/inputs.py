"""One typed record per registry signature: a test builds a case once and calls it on as many
advantage estimators or policy losses as it compares, instead of spelling out the signature at
each call. Fields follow the registry's one signature (for estimators, the fields of
:class:`verl_core.algorithms.EstimatorInputs`; its tests check that), with the defaults the tests
share; shapes as in ``verl_core/__init__.py`` (N rows, T response tokens)."""
import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from verl_core.algorithms import PolicyLossOptions, get_advantage_estimator, get_policy_loss
from verl_core.algorithms import advantages

LOSS_OPTIONS = PolicyLossOptions(dro_beta=0.05)  # verl's defaults, plus the β dro needs


@dataclass(frozen=True)
class EstimatorInputs:
    """What an advantage estimator takes, positional and with defaults for the tests (``group_index``
    None: one group); ``record`` is the library's :class:`~verl_core.algorithms.EstimatorInputs`,
    ``call`` returns an estimator's (advantages, returns) on it, each (N, T)."""

    token_level_rewards: Tensor  # (N, T)
    response_mask: Tensor  # (N, T)
    group_index: Optional[Tensor] = None  # (N,) prompt id of each row; None: one group
    values: Optional[Tensor] = None  # (N, T) critic values
    gamma: float = 1.0
    lam: float = 1.0
    norm_adv_by_std_in_grpo: bool = True
    baseline_score: Optional[Tensor] = None  # (N,) greedy response's score (remax)
    old_logprobs: Optional[Tensor] = None  # (N, T)
    sum_pi_squared: Optional[Tensor] = None  # (N, T) Σ_v π_v² at each token
    reward_components: Optional[Tensor] = None  # (N, K) separately scored rewards (gdpo)

    def record(self) -> advantages.EstimatorInputs:
        index = self.group_index
        if index is None:
            index = torch.zeros(self.token_level_rewards.shape[0], dtype=torch.long)
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return advantages.EstimatorInputs(**{**fields, "group_index": index})

    def call(self, name: str) -> tuple[Tensor, Tensor]:
        return get_advantage_estimator(name)(self.record())

    def rows(self, order: Tensor) -> "EstimatorInputs":
        """The same case with its rows taken in ``order`` (N,): every per-row tensor reordered."""
        return dataclasses.replace(self, **{
            f.name: getattr(self, f.name)[order] for f in dataclasses.fields(self)
            if isinstance(getattr(self, f.name), Tensor)})


@dataclass(frozen=True)
class LossInputs:
    """What a policy loss takes; ``call`` returns its (loss, metrics). ``seed`` seeds a fresh
    generator at each call (the random token choice of clip_cov), so calls repeat exactly."""

    old_logp: Tensor  # (N, T)
    logp: Tensor  # (N, T)
    advantages: Tensor  # (N, T)
    response_mask: Optional[Tensor] = None  # (N, T); None: every token valid
    loss_agg_mode: str = "token-mean"
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.28
    clip_ratio_c: float = 3.0
    loss_scale_factor: Optional[float] = None
    rollout_is_weights: Optional[Tensor] = None  # (N, T)
    options: PolicyLossOptions = LOSS_OPTIONS
    seed: int = 0

    def call(self, name: str) -> tuple[Tensor, dict[str, Tensor]]:
        mask = torch.ones_like(self.logp) if self.response_mask is None else self.response_mask
        return get_policy_loss(name)(
            self.old_logp, self.logp, self.advantages, mask, clip_ratio_low=self.clip_ratio_low,
            clip_ratio_high=self.clip_ratio_high, clip_ratio_c=self.clip_ratio_c,
            loss_agg_mode=self.loss_agg_mode, loss_scale_factor=self.loss_scale_factor,
            rollout_is_weights=self.rollout_is_weights, options=self.options,
            generator=torch.Generator().manual_seed(self.seed))
