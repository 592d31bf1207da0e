"""The RL math: advantages, policy/value/entropy/KL losses, loss aggregation.

Pure functions of tensors and scalars. They return tensors and dicts of 0-d metric tensors; the
caller reduces and logs. No config objects, I/O or host syncs in here. Each family is a
:class:`Registry` whose entries share one signature, so callers look algorithms up by the
config's name and never branch on it:

* ``ADVANTAGE_ESTIMATORS`` (``algorithm.adv_estimator``): one decorated function per estimator
  in ``advantages.py`` (``ADVANTAGE_ESTIMATORS.names()`` lists them), each taking one
  :class:`EstimatorInputs`; each entry carries its :class:`EstimatorTraits` (critic, groups,
  greedy baseline, Σπ²);
* ``POLICY_LOSSES`` (``algorithm.policy_loss``): vanilla, gspo, cispo, dppo_tv, dppo_kl, sapo,
  geo_mean, gpg, dro, clip_cov, kl_cov, bypass_mode; hyper-parameters in one
  :class:`PolicyLossOptions`, rollout importance weights from :func:`rollout_is_weights`, the mismatch they correct
  measured by :func:`rollout_probs_diff`;
* ``KL_ESTIMATORS`` (``algorithm.kl_loss_type`` / ``kl_penalty``): k1/kl, abs, k2/mse,
  k3/low_var_kl, and their straight-through ``+`` forms (k1+/kl+, abs+, k2+/mse+,
  k3+/low_var_kl+);
* ``LOSS_AGG_MODES`` (``algorithm.loss_agg_mode``): token-mean, seq-mean-token-sum,
  seq-mean-token-mean, seq-mean-token-sum-norm, token-sum.

Shapes: N rows (responses), T response tokens, V vocabulary (see ``verl_core``'s docstring).
"""

from verl_core.algorithms.advantages import (
    ADVANTAGE_ESTIMATORS,
    EstimatorInputs,
    EstimatorTraits,
    get_advantage_estimator,
    register_advantage,
)
from verl_core.algorithms.aggregation import LOSS_AGG_MODES, agg_loss, micro_batch_weight
from verl_core.algorithms.kl import (
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    kl_loss,
    make_kl_controller,
)
from verl_core.algorithms.policy_losses import (
    POLICY_LOSSES,
    PolicyLossOptions,
    PolicyLossTraits,
    get_policy_loss,
    register_policy_loss,
)
from verl_core.algorithms.registry import Registry, UnknownNameError
from verl_core.algorithms.rollout_correction import rollout_is_weights, rollout_probs_diff
from verl_core.algorithms.utils import (
    entropy_from_logits,
    logprobs_from_logits,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
    outcome_to_token_rewards,
)
from verl_core.algorithms.value import entropy_loss, value_loss

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "EstimatorInputs",
    "KL_ESTIMATORS",
    "LOSS_AGG_MODES",
    "POLICY_LOSSES",
    "AdaptiveKLController",
    "EstimatorTraits",
    "FixedKLController",
    "PolicyLossOptions",
    "PolicyLossTraits",
    "Registry",
    "UnknownNameError",
    "agg_loss",
    "micro_batch_weight",
    "apply_kl_penalty",
    "entropy_from_logits",
    "entropy_loss",
    "get_advantage_estimator",
    "get_policy_loss",
    "kl_loss",
    "logprobs_from_logits",
    "make_kl_controller",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "outcome_to_token_rewards",
    "register_advantage",
    "register_policy_loss",
    "rollout_is_weights",
    "rollout_probs_diff",
    "value_loss",
]
