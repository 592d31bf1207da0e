"""The advantage phase on a batch: token rewards, then the configured estimator.

What belongs here: turning a :class:`~verl_core.data.batch.Batch` into one
:class:`~verl_core.algorithms.EstimatorInputs` and the batch back (``advantages``, ``returns``),
with the phase's metrics as floats. What does not: the estimators' math (``algorithms/``, which
imports nothing but itself, hence this module) and the KL controller's update (the update phase
moves it, so its state changes in one phase only).
"""

from __future__ import annotations

from verl_core.algorithms import (EstimatorInputs, apply_kl_penalty, get_advantage_estimator,
                                  outcome_to_token_rewards)
from verl_core.algorithms.distill import distill_signal
from verl_core.algorithms.utils import masked_mean
from verl_core.data.batch import Batch


def compute_advantages(batch: Batch, algo) -> tuple[Batch, dict]:
    """Advantage phase: token rewards (the outcome score on the last response token, minus
    ``kl_coef * KL`` when ``use_kl_in_reward``), then the configured estimator. Adds
    ``advantages``/``returns`` (N, T); records the reward KL in ``meta["reward_kl"]``."""
    mask = batch.response_mask
    token_rewards = outcome_to_token_rewards(batch.score, mask)  # (N, T)
    metrics = {}
    meta = dict(batch.meta)
    if algo.use_kl_in_reward:
        # The rollout log-probs stand in for the actor's: the hf engine computes them with the
        # same weights and forward (within float rounding).
        token_rewards, kl_m = apply_kl_penalty(
            token_rewards, batch.response_logprobs, batch.ref_logprobs, mask,
            kl_coef=meta["kl_coef"], kl_penalty=algo.kl_penalty)
        meta["reward_kl"] = float(kl_m["kl"])
        metrics["actor/reward_kl"] = meta["reward_kl"]
    # every estimator gets every optional input the batch has: those its traits asked for
    # (rollout / reward phases), the rest are None. The rollout log-probs are the behaviour
    # policy's, as for the reward KL above.
    inp = EstimatorInputs(
        token_level_rewards=token_rewards, response_mask=mask, group_index=batch.group,
        gamma=algo.gamma, lam=algo.lam, norm_adv_by_std_in_grpo=algo.norm_adv_by_std_in_grpo,
        values=batch.values, baseline_score=batch.baseline_score,
        old_logprobs=batch.response_logprobs, sum_pi_squared=batch.sum_pi_squared)
    adv, ret = get_advantage_estimator(algo.adv_estimator)(inp)
    if algo.distills:
        adv = _with_distillation(adv, batch, algo, metrics)
    metrics["advantages/mean"] = float(masked_mean(adv, mask))
    metrics["advantages/abs_max"] = float((adv.abs() * mask).max()) if mask.any() else 0.0
    if batch.values is not None:
        metrics["critic/values_mean"] = float(masked_mean(batch.values, mask))
    return batch.replace(advantages=adv, returns=ret, meta=meta), metrics


def _with_distillation(adv, batch: Batch, algo, metrics: dict):
    """On-policy distillation (``algorithms/distill.py``): the stored teacher log-probs and the
    rollout's student log-probs give the per-token signal r_t (N, T); the advantage becomes
    ``adv + distill_coef * r`` (``distill_use_task_rewards``), else r alone. verl adds the two
    losses instead (``policy_loss + coef * distill_loss``, both vanilla PPO on the same ratio):
    the same value and gradient while no token is clipped."""
    if batch.teacher_logprobs is None:
        raise ValueError("algorithm.distill_teacher_path is set but the batch has no "
                         "teacher_logprobs (a batch stored by a run without distillation)")
    signal, m = distill_signal(batch.response_logprobs, batch.teacher_logprobs,
                               batch.response_mask, loss_mode=algo.distill_loss_mode,
                               loss_max_clamp=algo.distill_loss_max_clamp)  # (N, T)
    metrics.update({f"distillation/{k}": float(v) for k, v in m.items()})  # verl's names
    if algo.distill_use_task_rewards:
        metrics["distillation/task_advantages_mean"] = float(masked_mean(adv, batch.response_mask))
        return adv + algo.distill_coef * signal  # A_t + c r_t
    return signal
