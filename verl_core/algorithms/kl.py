"""KL regularisation towards the reference policy: estimators, controllers, reward penalty, loss.

Per-token KL estimators from samples of the policy (J. Schulman, "Approximating KL Divergence",
2020, http://joschu.net/blog/kl-approx.html), with r = ref_logp - logp = log(π_ref / π):

* ``k1`` (alias ``kl``): -log r  = logp - ref_logp       unbiased, high variance, can be < 0
* ``abs``:               |logp - ref_logp|
* ``k2`` (alias ``mse``): ½ (log r)^2                     biased, low variance, >= 0
* ``k3`` (alias ``low_var_kl``): e^{log r} - log r - 1    unbiased, low variance, >= 0

Each has a straight-through twin named with a ``+`` (``k1+``/``kl+``, ``abs+``, ``k2+``/``mse+``,
``k3+``/``low_var_kl+``): the value of the base estimator, the gradient of k2. k1 and k3 are
unbiased estimates of the KL's *value*, but differentiating them does not estimate the KL's
gradient (k1's gradient ∇log π has expectation 0; k3's estimates ∇KL(π_ref || π), the other
direction); k2's gradient, (log π - log π_ref) ∇log π, is an unbiased estimate of the per-token
∇KL(π || π_ref) (Tang & Munos 2025, "On a few pitfalls in KL divergence gradient estimation for
RL", arXiv:2506.09477; their other caveat, that a per-token loss misses a token's effect on the
later tokens' distributions, applies to every estimator here). Use a ``+`` form in
``kl_loss``; in the reward penalty, which carries no gradient, it equals its base estimator.

Each estimator: ``fn(logp (N, T), ref_logp (N, T)) -> (N, T)``. Definitions follow verl's
``kl_penalty`` / ``kl_penalty_forward`` in ``verl/trainer/ppo/core_algos.py``.

Two uses, as in verl: ``apply_kl_penalty`` subtracts β·KL from the token rewards before advantage
estimation (Ziegler et al. 2019, arXiv:1909.08593; InstructGPT), with β from a
:class:`FixedKLController` or :class:`AdaptiveKLController`; ``kl_loss`` adds KL to the actor loss
(GRPO style). What does not belong here: the policy-gradient loss, advantages.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from verl_core.algorithms.aggregation import agg_loss
from verl_core.algorithms.registry import Registry
from verl_core.algorithms.utils import masked_mean


def _kl_prototype(logp: Tensor, ref_logp: Tensor) -> Tensor:
    raise NotImplementedError  # the one signature every KL estimator repeats


KL_ESTIMATORS = Registry("KL estimator", prototype=_kl_prototype)


@KL_ESTIMATORS.register("k1", "kl")
def k1(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """k1 = log π - log π_ref, (N, T)."""
    return logp - ref_logp


@KL_ESTIMATORS.register("abs")
def abs_kl(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """|log π - log π_ref|, (N, T)."""
    return (logp - ref_logp).abs()


@KL_ESTIMATORS.register("k2", "mse")
def k2(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """k2 = ½ (log π - log π_ref)^2, (N, T)."""
    return 0.5 * (logp - ref_logp).square()


@KL_ESTIMATORS.register("k3", "low_var_kl")
def k3(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """k3 = r - log r - 1 with log r = log π_ref - log π, (N, T); >= 0 since e^x >= 1 + x.

    As verl: log r is clamped to [-20, 20] before exp and the result to [-10, 10] (so large
    deviations contribute a bounded penalty and a zero gradient).
    """
    log_r = torch.clamp(ref_logp - logp, min=-20.0, max=20.0)  # log r = log π_ref - log π
    kld = torch.exp(log_r) - log_r - 1.0  # k3 = r - log r - 1
    return torch.clamp(kld, min=-10.0, max=10.0)


def _straight_through(value: Tensor, logp: Tensor, ref_logp: Tensor) -> Tensor:
    """``value``'s numbers with k2's gradient, (N, T), as verl ``kl_penalty`` for a ``+`` name:

        out = k2 - sg[k2] + sg[value]       value: sg[value]; ∇out = ∇k2 = (logp - ref_logp) ∇logp

    (k2 - sg[k2] is exactly 0 in floating point, so the value is ``value`` bit for bit.)
    """
    k2_val = k2(logp, ref_logp)
    return k2_val - k2_val.detach() + value.detach()


@KL_ESTIMATORS.register("k1+", "kl+")
def k1_plus(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """k1's value, k2's gradient (straight-through), (N, T)."""
    return _straight_through(k1(logp, ref_logp), logp, ref_logp)


@KL_ESTIMATORS.register("abs+")
def abs_kl_plus(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """|log π - log π_ref|'s value, k2's gradient (straight-through), (N, T)."""
    return _straight_through(abs_kl(logp, ref_logp), logp, ref_logp)


@KL_ESTIMATORS.register("k2+", "mse+")
def k2_plus(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """k2 itself (value and gradient already k2's), (N, T); accepted because verl accepts it."""
    return _straight_through(k2(logp, ref_logp), logp, ref_logp)


@KL_ESTIMATORS.register("k3+", "low_var_kl+")
def k3_plus(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """k3's value (clamped as in :func:`k3`), k2's gradient (straight-through), (N, T). Unlike
    k3 the gradient is not cut where k3's clamps bind."""
    return _straight_through(k3(logp, ref_logp), logp, ref_logp)


# ---------------------------------------------------------------- controllers (host-side state)
class FixedKLController:
    """β stays at ``kl_coef``."""

    def __init__(self, kl_coef: float):
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op; same signature as the adaptive controller."""

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """Proportional controller steering the measured KL towards ``target_kl``.

    Ziegler et al. 2019, "Fine-Tuning Language Models from Human Preferences", arXiv:1909.08593;
    follows verl ``AdaptiveKLController``:

        e = clip(KL / KL_target - 1, -0.2, 0.2)
        β ← β (1 + e · n_steps / horizon)

    ``n_steps`` is the number of samples the KL was measured on (verl passes the batch size).
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int):
        if not target_kl > 0:
            raise ValueError(f"target_kl={target_kl} must be > 0")
        if not horizon > 0:
            raise ValueError(f"horizon={horizon} must be > 0")
        self.value = float(init_kl_coef)
        self.target_kl = float(target_kl)
        self.horizon = float(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        error = min(max(float(current_kl) / self.target_kl - 1.0, -0.2), 0.2)  # e = clip(KL/target - 1)
        self.value *= 1.0 + error * n_steps / self.horizon  # β ← β (1 + e n / H)

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value, "target_kl": self.target_kl, "horizon": self.horizon}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])
        self.target_kl = float(state["target_kl"])
        self.horizon = float(state["horizon"])


def make_kl_controller(kind: str, *, kl_coef: float, target_kl: float, horizon: int):
    """``"fixed"`` -> :class:`FixedKLController`, ``"adaptive"`` -> :class:`AdaptiveKLController`
    (``algorithm.kl_ctrl_type``); anything else raises ``ValueError``."""
    if kind == "fixed":
        return FixedKLController(kl_coef)
    if kind == "adaptive":
        return AdaptiveKLController(kl_coef, target_kl, horizon)
    raise ValueError(f"unknown KL controller {kind!r}; known: adaptive, fixed")


# ---------------------------------------------------------------- the two uses
def apply_kl_penalty(token_level_scores: Tensor, logp: Tensor, ref_logp: Tensor,
                     response_mask: Tensor, *, kl_coef: float,
                     kl_penalty: str) -> tuple[Tensor, dict[str, Tensor]]:
    """Token rewards with the KL penalty: r_t = score_t - β · KL_t on valid tokens.

    Follows verl ``apply_kl_penalty`` (``verl/trainer/ppo/ray_trainer.py``), minus the controller
    update, which the caller does with the returned metric (so this stays pure):
    ``ctrl.update(float(metrics["kl"]), n_steps=N)`` as verl does with ``n_steps`` = batch size.
    All tensors (N, T); ``logp`` is the rollout policy's (verl's ``old_log_probs``). ``kl`` is the
    batch mean of each response's token-mean KL (an empty response counts 0, as in verl).
    """
    mask = response_mask.to(token_level_scores.dtype)
    kld = KL_ESTIMATORS.get(kl_penalty)(logp, ref_logp) * mask  # (N, T) KL_t on valid tokens
    token_level_rewards = token_level_scores - kl_coef * kld  # r_t = s_t - β KL_t
    seq_kl = masked_mean(kld, mask, dim=-1)  # (N,) per-response mean KL
    return token_level_rewards, {"kl": seq_kl.mean().detach()}


def kl_loss(logp: Tensor, ref_logp: Tensor, response_mask: Tensor, *, kl_loss_type: str,
            loss_agg_mode: str, loss_scale_factor: Optional[float] = None) -> Tensor:
    """KL(π || π_ref) estimated per token and aggregated into a scalar loss term.

    Follows verl's actor (``dp_actor.update_policy``: ``kl_penalty`` then ``agg_loss``); the
    caller multiplies by ``kl_loss_coef``. GRPO (Shao et al. 2024, arXiv:2402.03300 eq. 4) uses k3;
    a ``+`` form gives an unbiased gradient. All tensors (N, T), ``logp`` with the gradient.
    """
    return agg_loss(KL_ESTIMATORS.get(kl_loss_type)(logp, ref_logp), response_mask, loss_agg_mode,
                    loss_scale_factor=loss_scale_factor)
