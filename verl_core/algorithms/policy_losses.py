"""Policy-gradient surrogate losses: log-probs + advantages -> scalar loss and metrics.

Every loss has exactly one signature (enforced at registration)::

    fn(old_logp (N, T), logp (N, T), advantages (N, T), response_mask (N, T), *,
       clip_ratio_low: float, clip_ratio_high: float, clip_ratio_c: float, loss_agg_mode: str,
       loss_scale_factor: float | None = None, rollout_is_weights: (N, T) | None = None,
       options: PolicyLossOptions = PolicyLossOptions(), generator: torch.Generator | None = None)
    -> (loss: scalar Tensor, metrics: {"pg_clipfrac", "pg_clipfrac_lower", "ppo_kl"} -> 0-d Tensors)

``old_logp`` is the behaviour policy (the trainer's recomputed log-probs of the rollout, or the
rollout engine's own for ``bypass_mode``; no gradient), ``logp`` the current policy (carries the
gradient). ``loss_scale_factor`` is the constant of ``seq-mean-token-sum-norm`` (see
``aggregation.py``). ``rollout_is_weights`` (detached, from ``rollout_correction.py``) multiply the
per-token losses, correcting for the rollout engine's policy differing from the trainer's, as
every verl loss does. ``options`` holds the hyper-parameters only some losses read (one frozen
record, so the signature does not grow with each algorithm); ``generator`` is the randomness of
the losses that sample (``clip_cov``). Every loss returns the same metric keys, so the caller logs
them without knowing which loss ran; a loss that has no such quantity reports 0. Arguments a loss
does not use are accepted and ignored. Metrics are detached.

Definitions follow verl ``verl/trainer/ppo/core_algos.py`` (v0.9.0; function named in each
docstring). One difference runs through all of them: verl's ``gspo``, ``sapo`` and ``geo_mean``
fix their own aggregation, whatever ``loss_agg_mode`` says; here every loss aggregates with the
given mode, so that one config field means one thing and :func:`micro_batch_weight` (which
weighs micro-batches by that mode's denominator) keeps the loss independent of the split. Pass
``seq-mean-token-mean`` for verl's numbers there.

What does not belong here: the KL and entropy terms (``kl.py``, ``value.py``), advantages, the
rollout importance weights (``rollout_correction.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import Tensor

from verl_core.algorithms.aggregation import agg_loss
from verl_core.algorithms.registry import Registry
from verl_core.algorithms.rollout_correction import rollout_is_weights as _rollout_is_weights
from verl_core.algorithms.utils import masked_mean, masked_sum


def _option(default):
    # every option changes the loss, so it is part of a run's trajectory (the field metadata
    # ``TRAJECTORY`` of config_fields.py, which RunConfig.trajectory_hash reads)
    return field(default=default, metadata={"trajectory": True})


@dataclass(frozen=True)
class PolicyLossOptions:
    """Hyper-parameters read by some losses only; defaults are verl's (``actor.yaml``,
    ``rollout_correction.yaml``). ``AlgorithmConfig`` (verl_core/config.py) inherits these fields, so
    they are ``algorithm.*`` config keys under the same names, declared once here."""

    clip_cov_ratio: float = _option(0.0002)
    """clip_cov: fraction r of the valid tokens whose gradient is detached, in (0, 1]."""
    clip_cov_lb: float = _option(1.0)
    """clip_cov: only tokens with advantage-logp covariance > this are candidates."""
    clip_cov_ub: float = _option(5.0)
    """clip_cov: only tokens with covariance < this are candidates (> clip_cov_lb)."""
    kl_cov_ratio: float = _option(0.0002)
    """kl_cov: fraction k of the valid tokens (largest covariance) given the |log ratio|
    penalty, in (0, 1]."""
    ppo_kl_coef: float = _option(0.1)
    """kl_cov: coefficient of |log ρ| on the selected tokens (verl's yaml 0.1; its code falls
    back to 1.0 when the yaml value is missing)."""
    tau_pos: float = _option(1.0)
    """sapo: gate temperature for tokens with A > 0 (> 0)."""
    tau_neg: float = _option(1.05)
    """sapo: gate temperature for tokens with A <= 0 (> 0)."""
    dro_beta: float = _option(0.0)
    """dro: coefficient β of the quadratic log-ratio penalty; 0 means unset (verl's null), which
    dro refuses: set it > 0 for ``dro``."""
    rollout_is: str = _option("")
    """Rollout correction: importance weights pi_train / pi_rollout per ``token`` or per
    ``sequence``, multiplying every policy loss (``bypass_mode``: its reinforce form); empty: off."""
    rollout_is_threshold: float = _option(2.0)
    """Rollout correction: upper bound of the weights (truncated IS, or IcePop's upper bound)."""
    rollout_is_threshold_lower: float = _option(0.0)
    """Rollout correction: > 0 zeroes weights outside [lower, threshold] (IcePop) instead of
    truncating (TIS); must be <= rollout_is_threshold."""
    rollout_is_batch_normalize: bool = _option(False)
    """Rollout correction: rescale the weights to mean 1 over the tokens the loss is given (not
    with bypass_mode)."""
    bypass_loss_type: str = _option("ppo_clip")
    """bypass_mode: ``ppo_clip`` (vanilla against the rollout log-probs) or ``reinforce``
    (importance-weighted REINFORCE); verl's ``rollout_correction.loss_type``."""


DEFAULT_OPTIONS = PolicyLossOptions()


@dataclass(frozen=True)
class PolicyLossTraits:
    """What a policy loss needs from the update loop, declared where it is registered
    (``@register_policy_loss("bypass_mode", old_logp_from_rollout=True)``)."""

    old_logp_from_rollout: bool = False
    """``old_logp`` is the rollout engine's log-probs (``Batch.response_logprobs``), not the
    trainer's recomputation of them."""


def _policy_loss_prototype(old_logp: Tensor, logp: Tensor, advantages: Tensor,
                           response_mask: Tensor, *, clip_ratio_low: float,
                           clip_ratio_high: float, clip_ratio_c: float, loss_agg_mode: str,
                           loss_scale_factor: Optional[float] = None,
                           rollout_is_weights: Optional[Tensor] = None,
                           options: PolicyLossOptions = DEFAULT_OPTIONS,
                           generator: Optional[torch.Generator] = None,
                           ) -> tuple[Tensor, dict[str, Tensor]]:
    raise NotImplementedError  # the one signature every policy loss repeats


POLICY_LOSSES = Registry("policy loss", prototype=_policy_loss_prototype, traits=PolicyLossTraits)


def register_policy_loss(name: str, *aliases: str, **traits):
    """Decorator registering a policy loss under ``name`` (and ``aliases``), with its
    :class:`PolicyLossTraits` as keywords."""
    return POLICY_LOSSES.register(name, *aliases, **traits)


def get_policy_loss(name: str):
    """The policy loss registered as ``name``; an unknown name raises listing the known ones."""
    return POLICY_LOSSES.get(name)


def _check(old_logp: Tensor, logp: Tensor, advantages: Tensor, response_mask: Tensor,
           rollout_is_weights: Optional[Tensor] = None) -> None:
    shape = tuple(logp.shape)
    if len(shape) != 2:
        raise ValueError(f"logp must be (N, T), got {shape}")
    for name, x in (("old_logp", old_logp), ("advantages", advantages),
                    ("response_mask", response_mask), ("rollout_is_weights", rollout_is_weights)):
        if x is not None and tuple(x.shape) != shape:
            raise ValueError(f"{name} must have the shape of logp (N, T)={shape}, got {tuple(x.shape)}")


def _is_weighted(pg_losses: Tensor, rollout_is_weights: Optional[Tensor]) -> Tensor:
    """L_t · w_t (w detached) when rollout IS weights are given, else L_t; (N, T)."""
    return pg_losses if rollout_is_weights is None else pg_losses * rollout_is_weights.detach()


def _zero(like: Tensor) -> Tensor:
    return torch.zeros((), dtype=like.dtype, device=like.device)


def _metrics(pg_clipfrac: Tensor, pg_clipfrac_lower: Tensor, ppo_kl: Tensor) -> dict[str, Tensor]:
    return {"pg_clipfrac": pg_clipfrac.detach(), "pg_clipfrac_lower": pg_clipfrac_lower.detach(),
            "ppo_kl": ppo_kl.detach()}


# ---------------------------------------------------------------- PPO family
@register_policy_loss("vanilla")
def vanilla(old_logp: Tensor, logp: Tensor, advantages: Tensor, response_mask: Tensor, *,
            clip_ratio_low: float, clip_ratio_high: float, clip_ratio_c: float,
            loss_agg_mode: str, loss_scale_factor: Optional[float] = None,
            rollout_is_weights: Optional[Tensor] = None,
            options: PolicyLossOptions = DEFAULT_OPTIONS,
            generator: Optional[torch.Generator] = None) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate with clip-higher and dual-clip, per token.

    PPO: Schulman et al. 2017, arXiv:1707.06347 eq. 7. Separate low/high clip ("clip-higher"):
    DAPO, Yu et al. 2025, arXiv:2503.14476 sec. 3.1. Dual-clip for A < 0: Ye et al. 2020,
    arXiv:1912.09729. Follows verl ``compute_policy_loss_vanilla``:

        ρ_t = exp(clamp(logp - old_logp, -20, 20))
        L_t = max(-A ρ_t, -A clip(ρ_t, 1 - ε_low, 1 + ε_high))
        L_t = min(L_t, -A c)   where A < 0     (the loss of a negative-advantage token is bounded)
        loss = agg(L · w, mask, loss_agg_mode)     (w: rollout IS weights, 1 when not given)

    Args:
        old_logp, logp, advantages, response_mask: (N, T).
        clip_ratio_low: ε_low; clip_ratio_high: ε_high; clip_ratio_c: c > 1.
        loss_agg_mode: a ``LOSS_AGG_MODES`` name. options, generator: unused.
    Returns:
        loss (scalar) and metrics, masked token means: ``pg_clipfrac`` (the clipped term was the
        larger), ``pg_clipfrac_lower`` (the dual-clip bound was hit), ``ppo_kl`` (mean of
        old_logp - logp, a k1 estimate of KL(old || new)).
    """
    if not clip_ratio_c > 1.0:
        raise ValueError(f"clip_ratio_c={clip_ratio_c} must be > 1 (dual-clip lower bound)")
    _check(old_logp, logp, advantages, response_mask, rollout_is_weights)
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
    pg_losses = _is_weighted(pg_losses, rollout_is_weights)
    loss = agg_loss(pg_losses, response_mask, loss_agg_mode, loss_scale_factor=loss_scale_factor)
    return loss, _metrics(pg_clipfrac, pg_clipfrac_lower, ppo_kl)


@register_policy_loss("gspo")
def gspo(old_logp: Tensor, logp: Tensor, advantages: Tensor, response_mask: Tensor, *,
         clip_ratio_low: float, clip_ratio_high: float, clip_ratio_c: float,
         loss_agg_mode: str, loss_scale_factor: Optional[float] = None,
         rollout_is_weights: Optional[Tensor] = None,
         options: PolicyLossOptions = DEFAULT_OPTIONS,
         generator: Optional[torch.Generator] = None) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO: clipped surrogate on the length-normalised sequence ratio (GSPO-token form).

    Zheng et al. 2025, "Group Sequence Policy Optimization", arXiv:2507.18071 (GSPO-token).
    Follows verl ``compute_policy_loss_gspo``:

        log s_i   = (1/|y_i|) Σ_t m_it (logp_it - old_logp_it)        (sequence log-ratio)
        log s_it  = logp_it - sg[logp_it] + sg[log s_i],  clamped to <= 10
        L_it      = max(-A_it s_it, -A_it clip(s_it, 1 - ε_low, 1 + ε_high))
        loss      = agg(L · w, mask, loss_agg_mode)

    Every token of a response carries the value s_i; the gradient through token t is
    s_i ∇logp_it, so with ``seq-mean-token-mean`` and one advantage per response this is the
    paper's sequence-level GSPO gradient. No dual-clip (``clip_ratio_c`` is ignored) and no
    [-20, 20] clamp, as in verl. The paper's clip ranges are ~1e-3 (3e-4 / 4e-4), far smaller
    than PPO's token-level 0.2.

    Aggregation: verl v0.9.0's ``compute_policy_loss_gspo`` passes ``seq-mean-token-mean`` to
    ``agg_loss`` whatever ``loss_agg_mode`` is (its default argument and its recommendation);
    here the given mode is used, as for every loss (see the module docstring). Pass
    ``seq-mean-token-mean`` for the paper's objective and verl's numbers.

    Args:
        old_logp, logp, advantages, response_mask: (N, T).
        clip_ratio_low, clip_ratio_high: ε_low, ε_high on s. clip_ratio_c, options, generator:
        unused. loss_agg_mode: a ``LOSS_AGG_MODES`` name.
    Returns:
        loss (scalar) and metrics: ``pg_clipfrac`` (masked token mean), ``pg_clipfrac_lower``
        (always 0), ``ppo_kl`` (masked mean of old_logp - logp).
    """
    _check(old_logp, logp, advantages, response_mask, rollout_is_weights)
    log_ratio = logp - old_logp  # (N, T)
    mask = response_mask.to(logp.dtype)
    seq_len = mask.sum(dim=-1).clamp(min=1.0)  # (N,) |y_i|
    seq_log_ratio = masked_sum(log_ratio, mask, dim=-1) / seq_len  # (N,) log s_i
    log_s = logp - logp.detach() + seq_log_ratio.detach().unsqueeze(-1)  # (N, T) log s_it
    log_s = torch.clamp(log_s, max=10.0)
    s = torch.exp(log_s)  # value s_i, gradient s_i ∇logp_it

    pg_losses1 = -advantages * s  # -A s
    pg_losses2 = -advantages * torch.clamp(s, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)  # -A clip(s)
    pg_losses = _is_weighted(torch.maximum(pg_losses1, pg_losses2), rollout_is_weights)
    loss = agg_loss(pg_losses, response_mask, loss_agg_mode, loss_scale_factor=loss_scale_factor)

    pg_clipfrac = masked_mean(torch.gt(pg_losses2, pg_losses1).to(logp.dtype), response_mask)
    ppo_kl = masked_mean(-log_ratio.detach(), response_mask)
    return loss, _metrics(pg_clipfrac, _zero(loss), ppo_kl)


@register_policy_loss("cispo")
def cispo(old_logp: Tensor, logp: Tensor, advantages: Tensor, response_mask: Tensor, *,
          clip_ratio_low: float, clip_ratio_high: float, clip_ratio_c: float,
          loss_agg_mode: str, loss_scale_factor: Optional[float] = None,
          rollout_is_weights: Optional[Tensor] = None,
          options: PolicyLossOptions = DEFAULT_OPTIONS,
          generator: Optional[torch.Generator] = None) -> tuple[Tensor, dict[str, Tensor]]:
    """CISPO: REINFORCE weighted by the clipped, stop-gradient ratio; no token loses its gradient.

    MiniMax 2025, "MiniMax-M1: Scaling Test-Time Compute Efficiently with Lightning Attention",
    arXiv:2506.13585 (CISPO). Follows verl ``compute_policy_loss_cispo``:

        ρ_t = exp(clamp(logp - old_logp, -20, 20))
        L_t = -sg[clip(ρ_t, 1 - ε_low, 1 + ε_high)] · A_t · logp_t
        loss = agg(L · w, mask, loss_agg_mode)

    PPO's clip zeroes the gradient of a clipped token; here only the weight is clipped, so every
    token keeps ∇ = -clip(ρ) A ∇logp. (The paper sets no lower bound in practice: use a large
    ``clip_ratio_low`` close to 1 for that.)

    Returns:
        loss and metrics: ``pg_clipfrac`` (masked token fraction with clip(ρ) != ρ),
        ``pg_clipfrac_lower`` (0), ``ppo_kl`` (masked mean of -clamp(log ρ)).
    """
    _check(old_logp, logp, advantages, response_mask, rollout_is_weights)
    log_ratio = torch.clamp(logp - old_logp, min=-20.0, max=20.0)
    ratio = torch.exp(log_ratio)  # ρ
    clipped_ratio = torch.clamp(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high).detach()  # sg[clip(ρ)]
    pg_losses = -clipped_ratio * advantages * logp  # -sg[clip(ρ)] A logp
    pg_losses = _is_weighted(pg_losses, rollout_is_weights)
    loss = agg_loss(pg_losses, response_mask, loss_agg_mode, loss_scale_factor=loss_scale_factor)
    pg_clipfrac = masked_mean(torch.ne(ratio, clipped_ratio).to(logp.dtype), response_mask)
    ppo_kl = masked_mean(-log_ratio.detach(), response_mask)
    return loss, _metrics(pg_clipfrac, _zero(loss), ppo_kl)


def _dppo(old_logp: Tensor, logp: Tensor, advantages: Tensor, response_mask: Tensor,
          valid: Tensor, clip_ratio_c: float, loss_agg_mode: str,
          loss_scale_factor: Optional[float], rollout_is_weights: Optional[Tensor],
          ) -> tuple[Tensor, dict[str, Tensor]]:
    """The DPPO surrogate shared by ``dppo_tv`` and ``dppo_kl`` given the trust-region mask."""
    log_ratio = torch.clamp(logp - old_logp, min=-20.0, max=20.0)
    ratio = torch.exp(log_ratio)  # ρ
    truncated = torch.clamp(ratio, max=clip_ratio_c).detach()  # sg[min(ρ, c)]: TIS, not dual-clip
    valid = valid.detach().to(logp.dtype)
    pg_losses = -advantages * truncated * logp * valid  # -A sg[min(ρ, c)] logp · 1[in region]
    pg_losses = _is_weighted(pg_losses, rollout_is_weights)
    loss = agg_loss(pg_losses, response_mask, loss_agg_mode, loss_scale_factor=loss_scale_factor)
    pg_clipfrac = masked_mean(1.0 - valid, response_mask)  # tokens outside the trust region
    pg_clipfrac_lower = masked_mean((ratio > clip_ratio_c).to(logp.dtype) * valid, response_mask)
    ppo_kl = masked_mean(-log_ratio.detach(), response_mask)
    return loss, _metrics(pg_clipfrac, pg_clipfrac_lower, ppo_kl)


@register_policy_loss("dppo_tv")
def dppo_tv(old_logp: Tensor, logp: Tensor, advantages: Tensor, response_mask: Tensor, *,
            clip_ratio_low: float, clip_ratio_high: float, clip_ratio_c: float,
            loss_agg_mode: str, loss_scale_factor: Optional[float] = None,
            rollout_is_weights: Optional[Tensor] = None,
            options: PolicyLossOptions = DEFAULT_OPTIONS,
            generator: Optional[torch.Generator] = None) -> tuple[Tensor, dict[str, Tensor]]:
    """DPPO-Binary-TV: the trust region is a bound on the sampled token's probability change.

    Qi et al. 2026, "Rethinking the Trust Region in LLM Reinforcement Learning",
    arXiv:2602.04879 (Divergence PPO, binary total-variation approximation). Follows verl
    ``compute_policy_loss_dppo_tv``, with p = exp(logp), p_old = exp(old_logp):

        in_t = (p_t - p_old_t <= δ_high)   if A_t > 0
               (p_t - p_old_t >= -δ_low)   otherwise                 (detached)
        L_t  = -A_t · sg[min(ρ_t, c)] · logp_t · in_t
        loss = agg(L · w, mask, loss_agg_mode)

    A token outside the region loses its gradient, as a clipped PPO token does, but the region
    is measured in probability, not ratio, so rare tokens are not over-constrained. Here
    ``clip_ratio_low``/``clip_ratio_high`` are the TV thresholds δ (verl's DPPO example: 0.15)
    and ``clip_ratio_c`` truncates the importance weight instead of dual-clipping (the paper
    recommends a large c, verl's example sets 1e4; verl reads the actor's ``clip_ratio_c``,
    3.0 by default, as here).

    Returns:
        loss and metrics: ``pg_clipfrac`` (masked fraction outside the region),
        ``pg_clipfrac_lower`` (masked fraction inside it with ρ > c), ``ppo_kl``.
    """
    _check(old_logp, logp, advantages, response_mask, rollout_is_weights)
    with torch.no_grad():
        delta = torch.exp(logp) - torch.exp(old_logp)  # p - p_old
        valid = torch.where(advantages > 0, delta <= clip_ratio_high, delta >= -clip_ratio_low)
    return _dppo(old_logp, logp, advantages, response_mask, valid, clip_ratio_c, loss_agg_mode,
                 loss_scale_factor, rollout_is_weights)


@register_policy_loss("dppo_kl")
def dppo_kl(old_logp: Tensor, logp: Tensor, advantages: Tensor, response_mask: Tensor, *,
            clip_ratio_low: float, clip_ratio_high: float, clip_ratio_c: float,
            loss_agg_mode: str, loss_scale_factor: Optional[float] = None,
            rollout_is_weights: Optional[Tensor] = None,
            options: PolicyLossOptions = DEFAULT_OPTIONS,
            generator: Optional[torch.Generator] = None) -> tuple[Tensor, dict[str, Tensor]]:
    """DPPO-Binary-KL: the trust region is a bound on the KL of the binary "this token or not".

    Qi et al. 2026, arXiv:2602.04879 (binary KL approximation). Follows verl
    ``compute_policy_loss_dppo_kl``, with p = exp(logp), p_old = exp(old_logp):

        D_t  = p_old log(p_old / p) + (1 - p_old) log((1 - p_old + 1e-8) / (1 - p + 1e-8))
        in_t = (D_t <= δ_high) or (p_t <= p_old_t)    if A_t > 0   (only moves up are bounded)
               (D_t <= δ_low)  or (p_t >= p_old_t)    otherwise    (only moves down are bounded)
        L_t  = -A_t · sg[min(ρ_t, c)] · logp_t · in_t
        loss = agg(L · w, mask, loss_agg_mode)

    ``clip_ratio_low``/``clip_ratio_high`` are the KL thresholds δ (verl's DPPO example: 0.05);
    ``clip_ratio_c`` as in ``dppo_tv``. Metrics as ``dppo_tv``.
    """
    _check(old_logp, logp, advantages, response_mask, rollout_is_weights)
    with torch.no_grad():
        p, p_old = torch.exp(logp), torch.exp(old_logp)
        binary_kl = p_old * (old_logp - logp) + (1.0 - p_old) * torch.log(
            (1.0 - p_old + 1e-8) / (1.0 - p + 1e-8))  # KL(Bern(p_old) || Bern(p))
        valid = torch.where(advantages > 0, (binary_kl <= clip_ratio_high) | (p <= p_old),
                            (binary_kl <= clip_ratio_low) | (p >= p_old))
    return _dppo(old_logp, logp, advantages, response_mask, valid, clip_ratio_c, loss_agg_mode,
                 loss_scale_factor, rollout_is_weights)


# ---------------------------------------------------------------- smooth and sequence-level
@register_policy_loss("sapo")
def sapo(old_logp: Tensor, logp: Tensor, advantages: Tensor, response_mask: Tensor, *,
         clip_ratio_low: float, clip_ratio_high: float, clip_ratio_c: float,
         loss_agg_mode: str, loss_scale_factor: Optional[float] = None,
         rollout_is_weights: Optional[Tensor] = None,
         options: PolicyLossOptions = DEFAULT_OPTIONS,
         generator: Optional[torch.Generator] = None) -> tuple[Tensor, dict[str, Tensor]]:
    """SAPO: a smooth sigmoid gate on the ratio instead of a hard clip.

    Gao et al. 2025 (Qwen), "Soft Adaptive Policy Optimization", arXiv:2511.20347. Follows verl
    ``compute_policy_loss_sapo``:

        ρ_t  = exp(clamp(logp - old_logp, -20, 20))
        τ_t  = τ_pos if A_t > 0 else τ_neg
        f(ρ) = σ(τ (ρ - 1)) · 4 / τ
        L_t  = -f(ρ_t) A_t
        loss = agg(L · w, mask, loss_agg_mode)

    f'(ρ) = 4 σ(1 - σ), which is 1 at ρ = 1 (so on-policy it is the REINFORCE gradient) and
    decays smoothly away from it; a larger τ_neg damps negative-advantage tokens faster.
    ``clip_ratio_*`` are unused. Aggregation: verl passes ``seq-mean-token-mean`` whatever
    ``loss_agg_mode`` is; here the given mode is used (module docstring).

    Returns:
        loss and metrics: ``pg_clipfrac`` and ``pg_clipfrac_lower`` 0 (nothing is clipped),
        ``ppo_kl``.
    """
    if not (options.tau_pos > 0 and options.tau_neg > 0):
        raise ValueError(f"tau_pos={options.tau_pos}, tau_neg={options.tau_neg} must be > 0")
    _check(old_logp, logp, advantages, response_mask, rollout_is_weights)
    log_ratio = torch.clamp(logp - old_logp, min=-20.0, max=20.0)
    ratio = torch.exp(log_ratio)  # ρ
    tau = torch.where(advantages > 0, logp.new_tensor(options.tau_pos),
                      logp.new_tensor(options.tau_neg))  # (N, T) τ_t
    gate = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)  # f(ρ) = σ(τ(ρ - 1)) 4/τ
    pg_losses = _is_weighted(-gate * advantages, rollout_is_weights)  # -f(ρ) A
    loss = agg_loss(pg_losses, response_mask, loss_agg_mode, loss_scale_factor=loss_scale_factor)
    ppo_kl = masked_mean(-log_ratio.detach(), response_mask)
    return loss, _metrics(_zero(loss), _zero(loss), ppo_kl)


@register_policy_loss("geo_mean")
def geo_mean(old_logp: Tensor, logp: Tensor, advantages: Tensor, response_mask: Tensor, *,
             clip_ratio_low: float, clip_ratio_high: float, clip_ratio_c: float,
             loss_agg_mode: str, loss_scale_factor: Optional[float] = None,
             rollout_is_weights: Optional[Tensor] = None,
             options: PolicyLossOptions = DEFAULT_OPTIONS,
             generator: Optional[torch.Generator] = None) -> tuple[Tensor, dict[str, Tensor]]:
    """GMPO: the geometric mean of the token ratios, clipped per token in log space.

    Zhao et al. 2025, "Geometric-Mean Policy Optimization", arXiv:2507.20673. Follows verl
    ``compute_policy_loss_geo_mean``:

        l_t  = logp_t - old_logp_t                               (no [-20, 20] clamp, as verl)
        l̃_t  = sgn(A_t) · min(sgn(A_t) l_t, sgn(A_t) clip(l_t, -ε_low, ε_high))
        ρ̄_i  = exp(Σ_t m_it l̃_t / |y_i|),   Ā_i = Σ_t m_it A_it / |y_i|
        L_i  = -Ā_i ρ̄_i · w̄_i,   w̄_i = exp(Σ_t m_it log(w_it + 1e-10) / |y_i|)  (geometric mean)

    ``clip_ratio_low``/``clip_ratio_high`` bound the *log*-ratio (the paper's ε = 0.4 is a ratio
    range (e^-0.4, e^0.4)). The objective is defined per response and assumes one advantage per
    response (Ā_i is exact then). Aggregation: verl takes the plain mean of L_i over every row,
    empty ones included, ignoring ``loss_agg_mode``; here every valid token of response i carries
    L_i and the given mode aggregates, so ``seq-mean-token-mean`` is the mean of L_i over
    non-empty responses (verl's number when no row is empty) and the token modes weigh a
    response by its length.

    Returns:
        loss and metrics: ``pg_clipfrac`` / ``pg_clipfrac_lower`` (masked token fractions with
        the log-ratio outside the clip range and A > 0 / A < 0), ``ppo_kl``.
    """
    _check(old_logp, logp, advantages, response_mask, rollout_is_weights)
    mask = response_mask.to(logp.dtype)
    log_ratio = logp - old_logp  # (N, T) l
    sgn = torch.sign(advantages)
    log_ratio_clipped = torch.clamp(log_ratio, -clip_ratio_low, clip_ratio_high)  # clip(l)
    log_ratio_min = sgn * torch.minimum(sgn * log_ratio, sgn * log_ratio_clipped)  # l̃ (pessimistic)
    seq_len = mask.sum(dim=-1).clamp(min=1.0)  # (N,) |y_i|
    seq_ratio = torch.exp(masked_sum(log_ratio_min, mask, dim=-1) / seq_len)  # (N,) ρ̄_i
    seq_adv = masked_sum(advantages, mask, dim=-1) / seq_len  # (N,) Ā_i
    seq_losses = -seq_adv * seq_ratio  # (N,) L_i
    if rollout_is_weights is not None:
        log_w = torch.log(rollout_is_weights.detach() + 1e-10)
        seq_losses = seq_losses * torch.exp(masked_sum(log_w, mask, dim=-1) / seq_len)  # · w̄_i
    pg_losses = seq_losses.unsqueeze(-1).expand_as(logp)  # (N,) -> (N, T): L_i on every token
    loss = agg_loss(pg_losses, response_mask, loss_agg_mode, loss_scale_factor=loss_scale_factor)

    clipped = torch.ne(log_ratio, log_ratio_clipped)
    pg_clipfrac = masked_mean((clipped & (advantages > 0)).to(logp.dtype), response_mask)
    pg_clipfrac_lower = masked_mean((clipped & (advantages < 0)).to(logp.dtype), response_mask)
    ppo_kl = masked_mean(-log_ratio.detach(), response_mask)
    return loss, _metrics(pg_clipfrac, pg_clipfrac_lower, ppo_kl)


# ---------------------------------------------------------------- plain policy gradients
@register_policy_loss("gpg")
def gpg(old_logp: Tensor, logp: Tensor, advantages: Tensor, response_mask: Tensor, *,
        clip_ratio_low: float, clip_ratio_high: float, clip_ratio_c: float,
        loss_agg_mode: str, loss_scale_factor: Optional[float] = None,
        rollout_is_weights: Optional[Tensor] = None,
        options: PolicyLossOptions = DEFAULT_OPTIONS,
        generator: Optional[torch.Generator] = None) -> tuple[Tensor, dict[str, Tensor]]:
    """GPG: the plain policy gradient, no ratio and no clip.

    Chu et al. 2025, "GPG: A Simple and Strong Reinforcement Learning Baseline for Model
    Reasoning", arXiv:2504.02546. Follows verl ``compute_policy_loss_gpg``:

        L_t = -A_t · logp_t,   loss = agg(L · w, mask, loss_agg_mode)

    On-policy only in spirit: ``old_logp`` does not enter the loss (several epochs or
    mini-batches make later steps off-policy with no correction). GPG's corrected group
    advantage is an advantage estimator, not part of this loss.

    Returns:
        loss and metrics: ``pg_clipfrac``, ``pg_clipfrac_lower`` 0; ``ppo_kl`` (masked mean of
        old_logp - logp; verl reports no metric for gpg).
    """
    _check(old_logp, logp, advantages, response_mask, rollout_is_weights)
    pg_losses = _is_weighted(-advantages * logp, rollout_is_weights)  # -A logp
    loss = agg_loss(pg_losses, response_mask, loss_agg_mode, loss_scale_factor=loss_scale_factor)
    ppo_kl = masked_mean((old_logp - logp).detach(), response_mask)
    return loss, _metrics(_zero(loss), _zero(loss), ppo_kl)


@register_policy_loss("dro")
def dro(old_logp: Tensor, logp: Tensor, advantages: Tensor, response_mask: Tensor, *,
        clip_ratio_low: float, clip_ratio_high: float, clip_ratio_c: float,
        loss_agg_mode: str, loss_scale_factor: Optional[float] = None,
        rollout_is_weights: Optional[Tensor] = None,
        options: PolicyLossOptions = DEFAULT_OPTIONS,
        generator: Optional[torch.Generator] = None) -> tuple[Tensor, dict[str, Tensor]]:
    """DRO: the policy gradient with a quadratic penalty on the log-ratio.

    Direct Reward Optimisation, Richemond et al. 2024, "Offline Regularised Reinforcement
    Learning for Large Language Models Alignment", arXiv:2405.19107 (verl cites no paper). Follows
    verl ``compute_policy_loss_dro``:

        L_t = -(logp_t A_t - ½ β (logp_t - old_logp_t)^2),   loss = agg(L · w, mask, mode)

    ∇L_t = -(A_t - β log ρ_t) ∇logp_t: the policy-gradient half of the paper's squared loss
    ½ (r - V - β log(π/π_ref))^2 (up to a factor β) with π_old as the reference, the advantage
    standing for r - V. ``options.dro_beta`` must be > 0 (verl's null default is refused).

    Returns:
        loss and metrics: ``pg_clipfrac``, ``pg_clipfrac_lower`` 0; ``ppo_kl``.
    """
    beta = options.dro_beta
    if not beta > 0:
        raise ValueError(f"dro_beta={beta} must be > 0 for the dro policy loss")
    _check(old_logp, logp, advantages, response_mask, rollout_is_weights)
    log_ratio = logp - old_logp  # log ρ
    pg_losses = -(logp * advantages - 0.5 * beta * log_ratio.square())  # -(A logp - β/2 log²ρ)
    pg_losses = _is_weighted(pg_losses, rollout_is_weights)
    loss = agg_loss(pg_losses, response_mask, loss_agg_mode, loss_scale_factor=loss_scale_factor)
    ppo_kl = masked_mean(-log_ratio.detach(), response_mask)
    return loss, _metrics(_zero(loss), _zero(loss), ppo_kl)


# ---------------------------------------------------------------- covariance-selected tokens
def _centred_covariance(advantages: Tensor, logp: Tensor, mask: Tensor) -> Tensor:
    """(A_t - mean A) (logp_t - mean logp), means over the valid tokens; (N, T), detached."""
    logp = logp.detach()
    return (advantages - masked_mean(advantages, mask)) * (logp - masked_mean(logp, mask))


def _count(mask: Tensor, ratio: float) -> Tensor:
    """max(floor(ratio · valid tokens), 1), a 0-d tensor (float64, as Python's int(x * r))."""
    return torch.floor(mask.sum().to(torch.float64) * ratio).clamp(min=1.0)


def _rank(keys: Tensor) -> Tensor:
    """Position of each element of ``keys`` (N, T) in ascending stable order (ties: the earlier
    row-major position first); (N, T) long."""
    flat = keys.reshape(-1)  # (N·T,)
    order = torch.sort(flat, stable=True).indices
    rank = torch.empty_like(order)
    rank[order] = torch.arange(flat.numel(), device=flat.device)
    return rank.reshape(keys.shape)


@register_policy_loss("clip_cov")
def clip_cov(old_logp: Tensor, logp: Tensor, advantages: Tensor, response_mask: Tensor, *,
             clip_ratio_low: float, clip_ratio_high: float, clip_ratio_c: float,
             loss_agg_mode: str, loss_scale_factor: Optional[float] = None,
             rollout_is_weights: Optional[Tensor] = None,
             options: PolicyLossOptions = DEFAULT_OPTIONS,
             generator: Optional[torch.Generator] = None) -> tuple[Tensor, dict[str, Tensor]]:
    """Clip-Cov: detach the gradient of a few random tokens of high advantage-logp covariance.

    Cui et al. 2025, "The Entropy Mechanism of Reinforcement Learning for Reasoning Language
    Models", arXiv:2505.22617 (Clip-Cov): entropy falls through tokens whose log-prob and
    advantage covary strongly, so their updates are dropped to keep exploring. Follows verl
    ``compute_policy_loss_clip_cov``:

        ρ_t   = exp(logp_t - old_logp_t)                 (no [-20, 20] clamp, as verl)
        C_t   = (A_t - mean A)(logp_t - mean logp)        (means over the valid tokens)
        cand  = {t valid, PPO-unclipped : ω_low < C_t < ω_high}
        S     = min(max(floor(r · #valid), 1), |cand|) tokens of cand drawn uniformly at random
        L_t   = max(-A ρ_t, -A clip(ρ_t, 1 - ε_low, 1 + ε_high)) · 1[t ∉ S]
        loss  = agg(L · w, mask, loss_agg_mode)

    r = ``options.clip_cov_ratio``, ω = (``clip_cov_lb``, ``clip_cov_ub``). No dual-clip. The
    draw: each token gets a uniform key from ``generator`` (its device's global RNG when None)
    and S is the candidates with the smallest keys, which is a uniform random subset, computed
    without reading a count back to the host (verl draws a ``randperm`` of the candidates). The
    means and the count are over the tokens given, i.e. one micro-batch, as in verl, so the
    selection depends on the micro-batch size.

    Returns:
        loss and metrics: ``pg_clipfrac`` (masked fraction of tokens in S, as verl),
        ``pg_clipfrac_lower`` (0), ``ppo_kl`` (masked mean of old_logp - logp).
    """
    ratio_cov, lb, ub = options.clip_cov_ratio, options.clip_cov_lb, options.clip_cov_ub
    if not 0 < ratio_cov <= 1:
        raise ValueError(f"clip_cov_ratio={ratio_cov} must be in (0, 1]")
    _check(old_logp, logp, advantages, response_mask, rollout_is_weights)
    log_ratio = logp - old_logp
    ratio = torch.exp(log_ratio)  # ρ
    pg_losses1 = -advantages * ratio  # -A ρ
    pg_losses2 = -advantages * torch.clamp(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    valid = response_mask.bool()
    with torch.no_grad():
        cov = _centred_covariance(advantages, logp, response_mask)  # (N, T) C_t
        cand = valid & ~torch.gt(pg_losses2, pg_losses1) & (cov > lb) & (cov < ub)
        device = generator.device if generator is not None else logp.device
        keys = torch.rand(logp.shape, generator=generator, dtype=torch.float64, device=device)
        keys = torch.where(cand, keys.to(logp.device), 2.0)  # non-candidates sort after all of cand
        selected = cand & (_rank(keys) < _count(response_mask, ratio_cov))  # S
    keep = (~selected).to(logp.dtype)  # 1[t ∉ S]
    pg_losses = _is_weighted(torch.maximum(pg_losses1, pg_losses2) * keep, rollout_is_weights)
    loss = agg_loss(pg_losses, response_mask, loss_agg_mode, loss_scale_factor=loss_scale_factor)
    pg_clipfrac = masked_mean(selected.to(logp.dtype), response_mask)
    ppo_kl = masked_mean(-log_ratio.detach(), response_mask)
    return loss, _metrics(pg_clipfrac, _zero(loss), ppo_kl)


@register_policy_loss("kl_cov")
def kl_cov(old_logp: Tensor, logp: Tensor, advantages: Tensor, response_mask: Tensor, *,
           clip_ratio_low: float, clip_ratio_high: float, clip_ratio_c: float,
           loss_agg_mode: str, loss_scale_factor: Optional[float] = None,
           rollout_is_weights: Optional[Tensor] = None,
           options: PolicyLossOptions = DEFAULT_OPTIONS,
           generator: Optional[torch.Generator] = None) -> tuple[Tensor, dict[str, Tensor]]:
    """KL-Cov: a |log ρ| penalty on the tokens of largest advantage-logp covariance.

    Cui et al. 2025, arXiv:2505.22617 (KL-Cov). Follows verl
    ``compute_policy_loss_kl_cov``:

        ρ_t  = exp(logp_t - old_logp_t)                  (no clamp, no clip, as verl)
        C_t  = (A_t - mean A)(logp_t - mean logp)         (means over the valid tokens)
        S    = the max(floor(k · #valid), 1) valid tokens of largest C_t
        L_t  = -A_t ρ_t + β |log ρ_t| · 1[t ∈ S]
        loss = agg(L · w, mask, loss_agg_mode)

    k = ``options.kl_cov_ratio``, β = ``options.ppo_kl_coef``. Ties in C_t are broken by
    position (the earlier row-major token first), where verl's ``torch.topk`` leaves the choice
    to the kernel. As for ``clip_cov``, the means and the count are per micro-batch, as in verl.
    ``clip_ratio_*`` are unused.

    Returns:
        loss and metrics: ``pg_clipfrac``, ``pg_clipfrac_lower`` 0; ``ppo_kl`` (masked mean of
        old_logp - logp, like every loss here; verl reports the mean of |log ρ| under that name
        for kl_cov).
    """
    k, beta = options.kl_cov_ratio, options.ppo_kl_coef
    if not 0 < k <= 1:
        raise ValueError(f"kl_cov_ratio={k} must be in (0, 1]")
    _check(old_logp, logp, advantages, response_mask, rollout_is_weights)
    log_ratio = logp - old_logp
    ratio = torch.exp(log_ratio)  # ρ
    pg_losses1 = -advantages * ratio  # -A ρ
    pg_losses_kl = pg_losses1 + beta * log_ratio.abs()  # -A ρ + β |log ρ|
    valid = response_mask.bool()
    with torch.no_grad():
        cov = _centred_covariance(advantages, logp, response_mask)  # (N, T) C_t
        keys = torch.where(valid, -cov, torch.inf)  # ascending keys: largest C_t first, pads last
        selected = valid & (_rank(keys) < _count(response_mask, k))  # S
    pg_losses = _is_weighted(torch.where(selected, pg_losses_kl, pg_losses1), rollout_is_weights)
    loss = agg_loss(pg_losses, response_mask, loss_agg_mode, loss_scale_factor=loss_scale_factor)
    ppo_kl = masked_mean(-log_ratio.detach(), response_mask)
    return loss, _metrics(_zero(loss), _zero(loss), ppo_kl)


# ---------------------------------------------------------------- rollout log-probs as "old"
BYPASS_LOSS_TYPES = ("ppo_clip", "reinforce")


@register_policy_loss("bypass_mode", old_logp_from_rollout=True)
def bypass_mode(old_logp: Tensor, logp: Tensor, advantages: Tensor, response_mask: Tensor, *,
                clip_ratio_low: float, clip_ratio_high: float, clip_ratio_c: float,
                loss_agg_mode: str, loss_scale_factor: Optional[float] = None,
                rollout_is_weights: Optional[Tensor] = None,
                options: PolicyLossOptions = DEFAULT_OPTIONS,
                generator: Optional[torch.Generator] = None) -> tuple[Tensor, dict[str, Tensor]]:
    """Bypass mode: the rollout engine's log-probs are the behaviour policy; two policies, not three.

    verl ``compute_policy_loss_bypass_mode`` (rollout correction, Liu, Li et al. 2025, "When
    Speed Kills Stability", https://richardli.xyz/rl-collapse; Li et al. 2025, "Trust Region
    Masking for Long-Horizon LLM Reinforcement Learning", arXiv:2512.23075). The trainer skips
    recomputing old log-probs and passes the rollout's as ``old_logp`` (``ppo_update`` does so
    for every loss registered with the ``old_logp_from_rollout`` trait). By
    ``options.bypass_loss_type``:

        ppo_clip:   ``vanilla`` with ρ = π / π_rollout (the ratio is the importance weight and
                    its clip the correction; no extra weights, which would count it twice)
        reinforce:  L_t = -A_t · logp_t · w_t,   w = rollout_is_weights(logp, old_logp) of
                    ``rollout_correction.py`` with ``options.rollout_is*`` (no w when
                    ``options.rollout_is`` is empty); loss = agg(L, mask, loss_agg_mode)

    The ``rollout_is_weights`` argument is ignored (the weights are computed here, against the
    current policy), as in verl. Not offered: verl's rejection sampling (``rollout_rs``) and its
    ``rollout_corr/*`` metrics, which every other loss would have to report too.

    Returns:
        loss and metrics: ppo_clip: ``vanilla``'s; reinforce: ``pg_clipfrac`` and
        ``pg_clipfrac_lower`` 0, ``ppo_kl`` (masked mean of old_logp - logp).
    """
    if options.bypass_loss_type == "ppo_clip":
        return vanilla(old_logp, logp, advantages, response_mask, clip_ratio_low=clip_ratio_low,
                       clip_ratio_high=clip_ratio_high, clip_ratio_c=clip_ratio_c,
                       loss_agg_mode=loss_agg_mode, loss_scale_factor=loss_scale_factor,
                       rollout_is_weights=None, options=options, generator=generator)
    if options.bypass_loss_type != "reinforce":
        raise ValueError(f"unknown bypass_loss_type {options.bypass_loss_type!r}; known: "
                         f"{', '.join(BYPASS_LOSS_TYPES)}")
    _check(old_logp, logp, advantages, response_mask)
    pg_losses = -advantages * logp  # -A logp
    if options.rollout_is:
        weights, _ = _rollout_is_weights(
            logp.detach(), old_logp, response_mask, level=options.rollout_is,
            threshold=options.rollout_is_threshold,
            threshold_lower=options.rollout_is_threshold_lower,
            batch_normalize=options.rollout_is_batch_normalize)  # w ≈ π / π_rollout, detached
        pg_losses = pg_losses * weights  # -A logp · w
    loss = agg_loss(pg_losses, response_mask, loss_agg_mode, loss_scale_factor=loss_scale_factor)
    ppo_kl = masked_mean((old_logp - logp).detach(), response_mask)
    return loss, _metrics(_zero(loss), _zero(loss), ppo_kl)
