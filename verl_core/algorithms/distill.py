"""On-policy distillation's per-token signal (PG OPD): the teacher's log-probs on the student's
sampled tokens turned into a per-token advantage.

The form is verl's PG OPD (``docs/algo/opd.md``, "PG OPD"; ``verl/trainer/distillation/
losses.py``) and Thinking Machines' on-policy distillation (K. Lu et al., "On-Policy
Distillation", Connectionism, Oct. 2025), which TRL's on-policy distillation also follows: per
response token t, with y_t sampled from the student π and ν the teacher,

    D_t = KL estimator of KL(π(·|s_t) || ν(·|s_t)) from the one sample y_t
          (k1: log π(y_t|s_t) - log ν(y_t|s_t), the reverse-KL estimate)
    r_t = -D_t  (k1: log ν(y_t|s_t) - log π(y_t|s_t))

used as a per-token advantage (no discounting, no baseline, no whitening: verl passes
``advantages=-distillation_losses`` to its policy loss as they are). The estimators are the KL
registry's (``kl.py``: k1/kl, abs, k2/mse, k3/low_var_kl), as verl's ``loss_mode`` names them.

What is not here: where the log-probs come from (the rollout phase stores the teacher's with the
batch, ``RLTrainer.model_inputs``) and how the signal joins the outcome advantage (the advantage
phase, ``training/advantage.py``).
"""

from __future__ import annotations

from torch import Tensor

from verl_core.algorithms.kl import KL_ESTIMATORS
from verl_core.algorithms.utils import masked_mean

DISTILL_LOSS_MODES = ("k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl")
"""``algorithm.distill_loss_mode``'s values: verl's single-sample estimators (its
``forward_kl_topk`` needs the teacher's top-k distribution and is not offered)."""


def distill_signal(student_logp: Tensor, teacher_logp: Tensor, response_mask: Tensor, *,
                   loss_mode: str = "k1", loss_max_clamp: float = 0.0
                   ) -> tuple[Tensor, dict[str, Tensor]]:
    """The per-token distillation advantage r_t = -D_t (module docstring), 0 off the mask.

    ``student_logp`` (N, T): the student's log-probs of its sampled tokens (the rollout's);
    ``teacher_logp`` (N, T): the teacher's of the same tokens; ``response_mask`` (N, T): 1 on
    sampled tokens. ``loss_max_clamp`` > 0 clamps D_t to [-c, c] first (verl's
    ``loss_max_clamp``). Returns r (N, T) and metrics over the sampled tokens, before the clamp:
    ``loss`` (the mean of D_t: the reverse KL being minimised, with k1) and ``abs_loss`` (the
    mean of |D_t|, verl's ``distillation/abs_loss``: k1 can be negative)."""
    mask = response_mask.to(student_logp.dtype)
    d = KL_ESTIMATORS.get(loss_mode)(student_logp, teacher_logp)  # (N, T) D_t
    metrics = {"loss": masked_mean(d, mask), "abs_loss": masked_mean(d.abs(), mask)}
    if loss_max_clamp > 0:
        d = d.clamp(min=-loss_max_clamp, max=loss_max_clamp)  # verl: k1 can be negative
    return -d * mask, metrics  # (N, T) r_t = -D_t on sampled tokens, 0 elsewhere
