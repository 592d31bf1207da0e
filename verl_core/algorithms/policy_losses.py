"""Policy-gradient surrogate losses: log-probs + advantages -> scalar loss and metrics.

Every loss has exactly one signature (enforced at registration)::

    fn(old_logp (N, T), logp (N, T), advantages (N, T), response_mask (N, T), *,
       clip_ratio_low: float, clip_ratio_high: float, clip_ratio_c: float, loss_agg_mode: str)
    -> (loss: scalar Tensor, metrics: {"pg_clipfrac", "pg_clipfrac_lower", "ppo_kl"} -> 0-d Tensors)

``old_logp`` is the behaviour policy (the rollout's log-probs, no gradient), ``logp`` the current
policy (carries the gradient). Every loss returns the same metric keys, so the caller logs them
without knowing which loss ran; a loss that has no such quantity reports 0. Arguments a loss does
not use (``clip_ratio_c`` for gspo) are accepted and ignored. Metrics are detached.

Definitions follow verl ``verl/trainer/ppo/core_algos.py`` (function named in each docstring).
What does not belong here: the KL and entropy terms (``kl.py``, ``value.py``), advantages.
"""

from __future__ import annotations

import torch
from torch import Tensor

from verl_core.algorithms.aggregation import agg_loss
from verl_core.algorithms.registry import Registry
from verl_core.algorithms.utils import masked_mean, masked_sum


def _policy_loss_prototype(old_logp: Tensor, logp: Tensor, advantages: Tensor,
                           response_mask: Tensor, *, clip_ratio_low: float,
                           clip_ratio_high: float, clip_ratio_c: float,
                           loss_agg_mode: str) -> tuple[Tensor, dict[str, Tensor]]:
    raise NotImplementedError  # the one signature every policy loss repeats


POLICY_LOSSES = Registry("policy loss", prototype=_policy_loss_prototype)


def register_policy_loss(name: str, *aliases: str):
    """Decorator registering a policy loss under ``name`` (and ``aliases``)."""
    return POLICY_LOSSES.register(name, *aliases)


def get_policy_loss(name: str):
    """The policy loss registered as ``name``; an unknown name raises listing the known ones."""
    return POLICY_LOSSES.get(name)


def _check(old_logp: Tensor, logp: Tensor, advantages: Tensor, response_mask: Tensor) -> None:
    shape = tuple(logp.shape)
    if len(shape) != 2:
        raise ValueError(f"logp must be (N, T), got {shape}")
    for name, x in (("old_logp", old_logp), ("advantages", advantages),
                    ("response_mask", response_mask)):
        if tuple(x.shape) != shape:
            raise ValueError(f"{name} must have the shape of logp (N, T)={shape}, got {tuple(x.shape)}")


@register_policy_loss("vanilla")
def vanilla(old_logp: Tensor, logp: Tensor, advantages: Tensor, response_mask: Tensor, *,
            clip_ratio_low: float, clip_ratio_high: float, clip_ratio_c: float,
            loss_agg_mode: str) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate with clip-higher and dual-clip, per token.

    PPO: Schulman et al. 2017, arXiv:1707.06347 eq. 7. Separate low/high clip ("clip-higher"):
    DAPO, Yu et al. 2025, arXiv:2503.14476 sec. 3.1. Dual-clip for A < 0: Ye et al. 2020,
    arXiv:1912.09729. Follows verl ``compute_policy_loss_vanilla``:

        ρ_t = exp(clamp(logp - old_logp, -20, 20))
        L_t = max(-A ρ_t, -A clip(ρ_t, 1 - ε_low, 1 + ε_high))
        L_t = min(L_t, -A c)   where A < 0     (the loss of a negative-advantage token is bounded)
        loss = agg(L, mask, loss_agg_mode)

    Args:
        old_logp, logp, advantages, response_mask: (N, T).
        clip_ratio_low: ε_low; clip_ratio_high: ε_high; clip_ratio_c: c > 1.
        loss_agg_mode: a ``LOSS_AGG_MODES`` name.
    Returns:
        loss (scalar) and metrics, masked token means: ``pg_clipfrac`` (the clipped term was the
        larger), ``pg_clipfrac_lower`` (the dual-clip bound was hit), ``ppo_kl`` (mean of
        old_logp - logp, a k1 estimate of KL(old || new)).
    """
    if not clip_ratio_c > 1.0:
        raise ValueError(f"clip_ratio_c={clip_ratio_c} must be > 1 (dual-clip lower bound)")
    _check(old_logp, logp, advantages, response_mask)
    log_ratio = torch.clamp(logp - old_logp, min=-20.0, max=20.0)  # log ρ, clamped for exp
    ratio = torch.exp(log_ratio)  # ρ = π/π_old
    ppo_kl = masked_mean(-log_ratio.detach(), response_mask)

    pg_losses1 = -advantages * ratio  # -A ρ
    pg_losses2 = -advantages * torch.clamp(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)  # -A clip(ρ)
    clipped = torch.maximum(pg_losses1, pg_losses2)  # max(-Aρ, -A clip(ρ))
    pg_clipfrac = masked_mean(torch.gt(pg_losses2, pg_losses1).to(logp.dtype), response_mask)

    pg_losses3 = -advantages * clip_ratio_c  # -A c
    dual = torch.minimum(pg_losses3, clipped)  # min(max(...), -A c)
    negative = advantages < 0
    pg_clipfrac_lower = masked_mean((torch.gt(clipped, pg_losses3) & negative).to(logp.dtype),
                                    response_mask)
    pg_losses = torch.where(negative, dual, clipped)  # dual-clip only for A < 0
    loss = agg_loss(pg_losses, response_mask, loss_agg_mode)
    return loss, {"pg_clipfrac": pg_clipfrac, "pg_clipfrac_lower": pg_clipfrac_lower,
                  "ppo_kl": ppo_kl}


@register_policy_loss("gspo")
def gspo(old_logp: Tensor, logp: Tensor, advantages: Tensor, response_mask: Tensor, *,
         clip_ratio_low: float, clip_ratio_high: float, clip_ratio_c: float,
         loss_agg_mode: str) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO: clipped surrogate on the length-normalised sequence ratio (GSPO-token form).

    Zheng et al. 2025, "Group Sequence Policy Optimization", arXiv:2507.18071 (GSPO-token).
    Follows verl ``compute_policy_loss_gspo``:

        log s_i   = (1/|y_i|) Σ_t m_it (logp_it - old_logp_it)        (sequence log-ratio)
        log s_it  = logp_it - sg[logp_it] + sg[log s_i],  clamped to <= 10
        L_it      = max(-A_it s_it, -A_it clip(s_it, 1 - ε_low, 1 + ε_high))
        loss      = agg(L, mask, loss_agg_mode)

    Every token of a response carries the value s_i; the gradient through token t is
    s_i ∇logp_it, so with ``seq-mean-token-mean`` and one advantage per response this is the
    paper's sequence-level GSPO gradient. No dual-clip (``clip_ratio_c`` is ignored) and no
    [-20, 20] clamp, as in verl. The paper's clip ranges are ~1e-3 (3e-4 / 4e-4), far smaller
    than PPO's token-level 0.2.

    Difference from verl: verl always aggregates GSPO with ``seq-mean-token-mean`` and ignores
    ``loss_agg_mode``; here the given mode is used (pass ``seq-mean-token-mean`` for verl's
    numbers), so one config field means the same thing for every loss.

    Args:
        old_logp, logp, advantages, response_mask: (N, T).
        clip_ratio_low, clip_ratio_high: ε_low, ε_high on s. clip_ratio_c: unused.
        loss_agg_mode: a ``LOSS_AGG_MODES`` name.
    Returns:
        loss (scalar) and metrics: ``pg_clipfrac`` (masked token mean), ``pg_clipfrac_lower``
        (always 0), ``ppo_kl`` (masked mean of old_logp - logp).
    """
    _check(old_logp, logp, advantages, response_mask)
    log_ratio = logp - old_logp  # (N, T)
    mask = response_mask.to(logp.dtype)
    seq_len = mask.sum(dim=-1).clamp(min=1.0)  # (N,) |y_i|
    seq_log_ratio = masked_sum(log_ratio, mask, dim=-1) / seq_len  # (N,) log s_i
    log_s = logp - logp.detach() + seq_log_ratio.detach().unsqueeze(-1)  # (N, T) log s_it
    log_s = torch.clamp(log_s, max=10.0)
    s = torch.exp(log_s)  # value s_i, gradient s_i ∇logp_it

    pg_losses1 = -advantages * s  # -A s
    pg_losses2 = -advantages * torch.clamp(s, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)  # -A clip(s)
    pg_losses = torch.maximum(pg_losses1, pg_losses2)
    loss = agg_loss(pg_losses, response_mask, loss_agg_mode)

    pg_clipfrac = masked_mean(torch.gt(pg_losses2, pg_losses1).to(logp.dtype), response_mask)
    ppo_kl = masked_mean(-log_ratio.detach(), response_mask)
    return loss, {"pg_clipfrac": pg_clipfrac,
                  "pg_clipfrac_lower": torch.zeros((), dtype=loss.dtype, device=loss.device),
                  "ppo_kl": ppo_kl}
