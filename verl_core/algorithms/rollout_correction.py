"""Importance weights that correct for the rollout engine sampling from a slightly different policy.

The rollout engine (vLLM, bf16 kernels, an older checkpoint in asynchronous training) samples
from π_rollout; the trainer's own forward of the same weights gives π_train ("old" log-probs,
recomputed before the update). The two differ, so the batch is off-policy for the policy the loss
optimises. verl's "rollout correction" (Liu, Li et al. 2025, "When Speed Kills Stability:
Demystifying RL Collapse from the Training-Inference Mismatch", https://richardli.xyz/rl-collapse)
reweights each token's loss by a truncated importance ratio; truncation (TIS) is from Yao et al.
2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training",
https://fengyao.notion.site/off-policy-rl; masking outside a band (IcePop) from Ling Team 2025,
"Every Step Evolves: Scaling Reinforcement Learning for Trillion-Scale Thinking Model",
arXiv:2510.18855.

Follows verl ``compute_rollout_correction_weights`` (``verl/trainer/ppo/rollout_corr_helper.py``).
Not here (not offered): verl's rejection sampling (``rollout_rs``: dropping tokens or sequences
whose divergence exceeds a bound) and its long list of diagnostic metrics. What does not belong
here: the losses that multiply by the weights (``policy_losses.py``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from verl_core.algorithms.aggregation import seq_mean_token_mean
from verl_core.algorithms.utils import masked_mean, masked_sum, masked_var

ROLLOUT_IS_LEVELS = ("token", "sequence")
_SAFETY_BOUND = 20.0  # |log w| is clamped here before exp, as verl (e^20 ≈ 4.9e8)


def rollout_is_weights(train_logp: Tensor, rollout_logp: Tensor, response_mask: Tensor, *,
                       level: str, threshold: float, threshold_lower: float = 0.0,
                       batch_normalize: bool = False) -> tuple[Tensor, dict[str, Tensor]]:
    """Truncated importance weights w ≈ π_train / π_rollout, (N, T), detached.

        log ρ_t = logp_train_t - logp_rollout_t
        token:     w_t = exp(clamp(log ρ_t, -20, 20))
        sequence:  w_t = exp(clamp(Σ_s m_s log ρ_s, -20, 20))      (every token of the response)
        TIS:       w_t ← min(w_t, threshold)                        (threshold_lower = 0)
        IcePop:    w_t ← w_t if threshold_lower <= w_t <= threshold else 0
        batch_normalize: w ← w / mean(w)   (the mean over valid tokens, or over non-empty
                   responses of their token mean for ``sequence``; skipped when mean <= 1e-8)

    Weights are 0 at masked positions. Token-level weights are biased but of low variance;
    the sequence-level product is unbiased and of high variance (verl's docs,
    ``docs/algo/rollout_corr.md``).

    Args:
        train_logp: (N, T) the trainer's log-probs of the sampled tokens (π_train).
        rollout_logp: (N, T) the rollout engine's log-probs of the same tokens (π_rollout).
        response_mask: (N, T).
        level: ``"token"`` or ``"sequence"``.
        threshold: the upper bound (> 0); threshold_lower: 0 for TIS, else IcePop's lower bound.
        batch_normalize: rescale to mean 1 over this batch (verl ``rollout_is_batch_normalize``).
    Returns:
        weights (N, T) and metrics (0-d, detached): ``rollout_is_mean`` (masked token mean of the
        weights before batch normalisation), ``rollout_is_ratio_fraction_high`` /
        ``rollout_is_ratio_fraction_low`` (fraction of tokens, or of responses for ``sequence``,
        whose raw weight was above ``threshold`` / below ``threshold_lower``), ``kl`` (masked mean
        of rollout_logp - train_logp, a k1 estimate of KL(π_rollout || π_train)).
    """
    if level not in ROLLOUT_IS_LEVELS:
        raise ValueError(f"unknown rollout IS level {level!r}; known: {', '.join(ROLLOUT_IS_LEVELS)}")
    if not threshold > 0:
        raise ValueError(f"threshold={threshold} must be > 0")
    if not 0.0 <= threshold_lower <= threshold:
        raise ValueError(f"threshold_lower={threshold_lower} must be in [0, threshold={threshold}]")
    if train_logp.shape != rollout_logp.shape or train_logp.shape != response_mask.shape:
        raise ValueError(f"train_logp, rollout_logp and response_mask must share one (N, T) shape, "
                         f"got {tuple(train_logp.shape)}, {tuple(rollout_logp.shape)}, "
                         f"{tuple(response_mask.shape)}")
    mask = response_mask.to(train_logp.dtype)
    log_ratio = (train_logp - rollout_logp).detach()  # (N, T) log ρ = log π_train - log π_rollout
    if level == "token":
        log_w = log_ratio
    else:
        log_w = masked_sum(log_ratio, mask, dim=-1).unsqueeze(-1).expand_as(log_ratio)  # (N,1)->(N,T)
    raw = torch.exp(log_w.clamp(min=-_SAFETY_BOUND, max=_SAFETY_BOUND))  # w = exp(clamp(log w))
    raw = torch.where(mask.bool(), raw, torch.zeros_like(raw))  # 0 on padding
    high = raw > threshold
    low = raw < threshold_lower  # never true for TIS: raw > 0 on valid tokens
    if threshold_lower > 0:
        weights = torch.where(high | low, torch.zeros_like(raw), raw)  # IcePop: drop outside band
    else:
        weights = raw.clamp(max=threshold)  # TIS: min(w, threshold)

    frac = masked_mean if level == "token" else seq_mean_token_mean  # per token / per response
    metrics = {
        "rollout_is_mean": masked_mean(weights, mask),
        "rollout_is_ratio_fraction_high": frac(high.to(mask.dtype), mask),
        "rollout_is_ratio_fraction_low": frac(low.to(mask.dtype), mask),
        "kl": masked_mean(-log_ratio, mask),
    }
    if batch_normalize:
        if level == "token":
            mean = masked_mean(weights, mask)
        else:  # one weight per response: the mean over non-empty responses
            mean = seq_mean_token_mean(weights, mask)
        weights = weights / torch.where(mean > 1e-8, mean, torch.ones_like(mean))  # w / mean(w)
    return weights, {k: v.detach() for k, v in metrics.items()}


def rollout_probs_diff(train_logp: Tensor, rollout_logp: Tensor,
                       response_mask: Tensor) -> dict[str, Tensor]:
    """How far the rollout engine's token probabilities are from the trainer's: verl's
    ``training/rollout_probs_diff_*`` (``calculate_debug_metrics``,
    ``verl/utils/debug/metrics.py``).

        d_t = |exp(logp_rollout_t) - exp(logp_train_t)|      over response tokens (m_t = 1)
        max = max_t d_t,  mean = Σ m d / Σ m,
        std = sqrt(Σ m (d - mean)² / (Σ m - 1))              (unbiased, as verl's ``torch.std``)

    A diagnostic of the training-inference mismatch that ``rollout_is_weights`` corrects for: it
    is 0 when both sides compute the same numbers (same weights, same kernels), and grows with
    bf16 kernels or stale weights. Computed in float64 so the statistics of differences near
    float32's rounding are not themselves rounding. Masked, not selected: no host sync; an empty
    mask gives 0 for all three, a single token a std of 0 (verl's ``torch.std`` gives NaN).
    ``train_logp`` (N, T) is the trainer's, before any step, ``rollout_logp`` (N, T) the engine's.
    """
    if train_logp.shape != rollout_logp.shape or train_logp.shape != response_mask.shape:
        raise ValueError(f"train_logp, rollout_logp and response_mask must share one (N, T) shape, "
                         f"got {tuple(train_logp.shape)}, {tuple(rollout_logp.shape)}, "
                         f"{tuple(response_mask.shape)}")
    mask = response_mask.to(torch.float64)
    d = (train_logp.detach().double().exp() - rollout_logp.detach().double().exp()).abs()  # (N, T)
    return {
        "rollout_probs_diff_max": torch.where(mask.bool(), d, torch.zeros_like(d)).max(),  # d >= 0
        "rollout_probs_diff_mean": masked_mean(d, mask),
        "rollout_probs_diff_std": masked_var(d, mask, unbiased=True).sqrt(),
    }
