"""Advantage estimators: token rewards (and critic values) -> advantages and returns.

Every estimator has exactly one signature (enforced at registration)::

    fn(token_level_rewards (N, T), response_mask (N, T), group_index (N,) long,
       values (N, T) | None, *, gamma: float, lam: float, norm_adv_by_std_in_grpo: bool)
    -> (advantages (N, T), returns (N, T))

so the trainer calls ``get_advantage_estimator(cfg.adv_estimator)(...)`` whatever the name.
Arguments an estimator does not use are accepted and ignored. ``group_index[i]`` says which prompt
row ``i`` answers; only equality matters (any long values, groups need not be contiguous).
Outcome estimators (grpo, rloo, reinforce_plus_plus_baseline) read one score per response,
``token_level_rewards.sum(-1)``, as verl does; rewards outside the mask are expected to be 0
(``outcome_to_token_rewards`` and ``apply_kl_penalty`` guarantee it).

Numbers follow verl's ``verl/trainer/ppo/core_algos.py`` (function named in each docstring) on
every position where ``response_mask`` is set. One deliberate difference: every estimator
returns exactly 0 where ``response_mask`` is 0 (verl leaves whitened or carried values there that
every consumer masks out anyway).

Group statistics are computed in float64 with ``index_add_`` over ``group_index``, not Python
dicts; on CUDA they are bitwise reproducible under ``torch.use_deterministic_algorithms(True)``. The token
recursions (GAE, REINFORCE++ returns) loop over T and are vectorised over N.

What does not belong here: policy losses, KL, anything that reads a config.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from verl_core.algorithms.registry import Registry
from verl_core.algorithms.utils import masked_whiten

GRPO_EPSILON = 1e-6  # verl's epsilon in (s - mean) / (std + eps)


def _estimator_prototype(token_level_rewards: Tensor, response_mask: Tensor, group_index: Tensor,
                         values: Optional[Tensor], *, gamma: float, lam: float,
                         norm_adv_by_std_in_grpo: bool) -> tuple[Tensor, Tensor]:
    raise NotImplementedError  # the one signature every estimator repeats


ADVANTAGE_ESTIMATORS = Registry("advantage estimator", prototype=_estimator_prototype)


def register_advantage(name: str, *aliases: str):
    """Decorator registering an advantage estimator under ``name`` (and ``aliases``)."""
    return ADVANTAGE_ESTIMATORS.register(name, *aliases)


def get_advantage_estimator(name: str):
    """The estimator registered as ``name``; an unknown name raises listing the known ones."""
    return ADVANTAGE_ESTIMATORS.get(name)


# ---------------------------------------------------------------- helpers
def _check(token_level_rewards: Tensor, response_mask: Tensor, group_index: Tensor,
           values: Optional[Tensor]) -> None:
    if token_level_rewards.dim() != 2:
        raise ValueError(f"token_level_rewards must be (N, T), got {tuple(token_level_rewards.shape)}")
    N, T = token_level_rewards.shape
    if tuple(response_mask.shape) != (N, T):
        raise ValueError(f"response_mask must be (N, T)=({N}, {T}), got {tuple(response_mask.shape)}")
    if tuple(group_index.shape) != (N,):
        raise ValueError(f"group_index must be (N,)=({N},), got {tuple(group_index.shape)}")
    if values is not None and tuple(values.shape) != (N, T):
        raise ValueError(f"values must be (N, T)=({N}, {T}), got {tuple(values.shape)}")


def _group_stats(scores: Tensor, group_index: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per-row statistics of the row's group, in float64.

    Args:
        scores: (N,) one score per response.
        group_index: (N,) long, rows with equal values form a group.
    Returns:
        (count, mean, std), each (N,) float64: the size n of the row's group, the group mean and
        the unbiased group std sqrt(sum (s - mean)^2 / (n - 1)) (as ``torch.std``); std is 0 for
        groups of size one (callers decide what a singleton means).

    float64 because a group whose responses all score the same must get advantage 0: in float32
    eight scores of 0.7 have a mean that is off by one ulp, and (s - mean) / (std + 1e-6) turns
    that into a spurious advantage of ~0.06 (verl, which works in float32, has this artefact).
    """
    x = scores.to(torch.float64)
    ids, group = torch.unique(group_index, return_inverse=True)  # group: (N,) dense ids in [0, K)
    K = ids.numel()  # unique syncs once on CUDA to size its output; nothing else is read back
    count = torch.zeros(K, dtype=x.dtype, device=x.device).index_add_(0, group, torch.ones_like(x))
    total = torch.zeros(K, dtype=x.dtype, device=x.device).index_add_(0, group, x)
    mean = total / count  # (K,) every group has >= 1 row
    sq_dev = (x - mean[group]) ** 2  # (N,)
    ss = torch.zeros(K, dtype=x.dtype, device=x.device).index_add_(0, group, sq_dev)
    std = torch.sqrt(ss / (count - 1).clamp(min=1.0))  # (K,) unbiased; 0 for singletons
    return count[group], mean[group], std[group]  # (N,) each


# ---------------------------------------------------------------- estimators
@register_advantage("gae")
@torch.no_grad()
def gae(token_level_rewards: Tensor, response_mask: Tensor, group_index: Tensor,
        values: Optional[Tensor], *, gamma: float, lam: float,
        norm_adv_by_std_in_grpo: bool) -> tuple[Tensor, Tensor]:
    """Generalised Advantage Estimation (Schulman et al. 2016, arXiv:1506.02438).

    Follows verl ``compute_gae_advantage_return`` (recent form): the backward recursion moves
    ``next_value`` and ``last_gae`` only on positions where the mask is set, so masked positions
    (padding, or observation tokens inside a multi-turn response) are skipped rather than treated
    as zero-valued states. Returns are the un-whitened advantages plus the values; advantages
    are then whitened over all valid tokens of the batch.

    Args:
        token_level_rewards: (N, T) r_t.
        response_mask: (N, T).
        group_index: (N,) unused.
        values: (N, T) critic values V_t; required.
        gamma: discount; lam: GAE lambda. norm_adv_by_std_in_grpo: unused.
    Returns:
        advantages (N, T) whitened, returns (N, T) = A_t + V_t (before whitening); 0 where masked.
    """
    if values is None:
        raise ValueError("the 'gae' advantage estimator needs critic values (N, T); got values=None "
                         "(compute values with the critic, or pick an outcome estimator such as 'grpo')")
    _check(token_level_rewards, response_mask, group_index, values)
    # at least float32: a bf16 critic's values would otherwise make the recursion bf16
    dtype = torch.promote_types(torch.promote_types(token_level_rewards.dtype, values.dtype),
                                torch.float32)
    token_level_rewards, values = token_level_rewards.to(dtype), values.to(dtype)
    mask = response_mask.to(dtype)  # (N, T)
    N, T = token_level_rewards.shape
    next_value = torch.zeros(N, dtype=values.dtype, device=values.device)  # V of the next valid token
    last_gae = torch.zeros_like(next_value)  # A of the next valid token
    advantages = torch.zeros_like(values)  # (N, T)
    for t in reversed(range(T)):
        delta = token_level_rewards[:, t] + gamma * next_value - values[:, t]  # δ_t = r_t + γV_{t+1} - V_t
        gae_t = delta + gamma * lam * last_gae  # A_t = δ_t + γλ A_{t+1}
        m = mask[:, t]
        next_value = m * values[:, t] + (1 - m) * next_value  # carry across masked positions
        last_gae = m * gae_t + (1 - m) * last_gae
        advantages[:, t] = last_gae
    returns = (advantages + values) * mask  # R_t = A_t + V_t
    advantages = masked_whiten(advantages, mask) * mask
    return advantages, returns


@register_advantage("grpo")
@torch.no_grad()
def grpo(token_level_rewards: Tensor, response_mask: Tensor, group_index: Tensor,
         values: Optional[Tensor], *, gamma: float, lam: float,
         norm_adv_by_std_in_grpo: bool) -> tuple[Tensor, Tensor]:
    """Group-relative outcome advantage (GRPO, Shao et al. 2024, arXiv:2402.03300 sec. 4.1.2).

    Follows verl ``compute_grpo_outcome_advantage``: with s_i the response score and the group's
    mean and unbiased std (``torch.std``),
        A_i = (s_i - mean) / (std + 1e-6)   if ``norm_adv_by_std_in_grpo``  (GRPO)
        A_i = s_i - mean                      otherwise  (Dr. GRPO, Liu et al. 2025, arXiv:2503.20783)
    broadcast over the response's tokens. A group of one response uses mean 0 and std 1, so its
    advantage is s / (1 + 1e-6) (or s): verl's convention, not a zero.

    Args:
        token_level_rewards: (N, T); the score is its row sum.
        response_mask: (N, T). group_index: (N,) long.
        values, gamma, lam: unused.
    Returns:
        advantages (N, T) and returns (N, T), equal (verl returns the same tensor twice).
    """
    _check(token_level_rewards, response_mask, group_index, values)
    scores = token_level_rewards.sum(dim=-1).to(torch.float64)  # (N,) s_i
    count, mean, std = _group_stats(scores, group_index)  # (N,) each
    single = count < 2
    mean = torch.where(single, torch.zeros_like(mean), mean)
    std = torch.where(single, torch.ones_like(std), std)
    if norm_adv_by_std_in_grpo:
        adv = (scores - mean) / (std + GRPO_EPSILON)  # (s - μ) / (σ + ε)
    else:
        adv = scores - mean  # Dr. GRPO: s - μ
    return _outcome_over_tokens(adv, token_level_rewards.dtype, response_mask)


def _outcome_over_tokens(adv: Tensor, dtype: torch.dtype, response_mask: Tensor):
    """A per-response advantage (N,) broadcast over its valid tokens: (advantages, returns), both
    (N, T) and equal (outcome estimators have no separate return)."""
    adv = adv.to(dtype)
    advantages = adv.unsqueeze(-1) * response_mask.to(adv.dtype)  # (N, T)
    return advantages, advantages.clone()


@register_advantage("rloo")
@torch.no_grad()
def rloo(token_level_rewards: Tensor, response_mask: Tensor, group_index: Tensor,
         values: Optional[Tensor], *, gamma: float, lam: float,
         norm_adv_by_std_in_grpo: bool) -> tuple[Tensor, Tensor]:
    """REINFORCE Leave-One-Out (Ahmadian et al. 2024, arXiv:2402.14740;
    Kool et al. 2019, "Buy 4 REINFORCE samples, get a baseline for free").

    Follows verl ``compute_rloo_outcome_advantage``: in a group of n > 1 responses with mean μ,
        A_i = s_i * n/(n-1) - μ * n/(n-1)  =  s_i - mean_{j != i} s_j
    broadcast over the response's tokens; a group of one keeps its raw score.

    Args:
        token_level_rewards: (N, T); the score is its row sum.
        response_mask: (N, T). group_index: (N,) long.
        values, gamma, lam, norm_adv_by_std_in_grpo: unused.
    Returns:
        advantages (N, T) and returns (N, T), equal.
    """
    _check(token_level_rewards, response_mask, group_index, values)
    scores = token_level_rewards.sum(dim=-1).to(torch.float64)  # (N,)
    count, mean, _ = _group_stats(scores, group_index)
    factor = count / (count - 1).clamp(min=1.0)  # n / (n - 1)
    adv = torch.where(count > 1, scores * factor - mean * factor, scores)  # s·n/(n-1) - μ·n/(n-1)
    return _outcome_over_tokens(adv, token_level_rewards.dtype, response_mask)


@register_advantage("reinforce_plus_plus")
@torch.no_grad()
def reinforce_plus_plus(token_level_rewards: Tensor, response_mask: Tensor, group_index: Tensor,
                        values: Optional[Tensor], *, gamma: float, lam: float,
                        norm_adv_by_std_in_grpo: bool) -> tuple[Tensor, Tensor]:
    """REINFORCE++ (Hu 2025, arXiv:2501.03262): discounted returns, whitened over the batch.

    Follows verl ``compute_reinforce_plus_plus_outcome_advantage`` as fixed for verl issue #7278
    (PR #7300): the backward scan moves only on valid tokens, like GAE's. A masked span inside a
    response (observation tokens of a multi-turn rollout) neither resets nor discounts the running
    return, so the tokens before it still receive the reward that comes after it:
        G_t = r_t + γ G_{t'}     where m_t = 1, with t' the next valid position after t
                                 (G_{t'} = 0 past the last valid token, so padding stays 0)
        G_t = 0                  where m_t = 0 (the running return passes through unchanged; a
                                 reward on a masked position is not added, as in verl)
        A = masked_whiten(G)     over all valid tokens of the batch
    With mask [1,1,0,0,1,1], γ = 1 and reward 1 on the last token, G = [1,1,0,0,1,1]: the first
    turn gets the outcome reward too (before the fix it got [0,0,0,0,1,1]). No critic, no group
    baseline.

    Args:
        token_level_rewards: (N, T) r_t. response_mask: (N, T).
        gamma: discount. group_index, values, lam, norm_adv_by_std_in_grpo: unused.
    Returns:
        advantages (N, T) whitened, returns (N, T) = G; 0 where masked.
    """
    _check(token_level_rewards, response_mask, group_index, values)
    mask = response_mask.to(token_level_rewards.dtype)  # (N, T)
    valid = response_mask.bool()  # (N, T)
    N, T = token_level_rewards.shape
    returns = torch.zeros_like(token_level_rewards)  # (N, T)
    running = torch.zeros(N, dtype=returns.dtype, device=returns.device)  # G of next valid token
    for t in reversed(range(T)):
        g_t = token_level_rewards[:, t] + gamma * running  # G_t = r_t + γ G_{t'}
        returns[:, t] = torch.where(valid[:, t], g_t, torch.zeros_like(g_t))
        running = torch.where(valid[:, t], g_t, running)  # masked: carried unchanged
    advantages = masked_whiten(returns, mask) * mask
    return advantages, returns


@register_advantage("reinforce_plus_plus_baseline")
@torch.no_grad()
def reinforce_plus_plus_baseline(token_level_rewards: Tensor, response_mask: Tensor,
                                 group_index: Tensor, values: Optional[Tensor], *, gamma: float,
                                 lam: float, norm_adv_by_std_in_grpo: bool) -> tuple[Tensor, Tensor]:
    """REINFORCE++ with a group-mean baseline (Hu 2025, arXiv:2501.03262).

    Follows verl ``compute_reinforce_plus_plus_baseline_outcome_advantage``:
        a_i = s_i - mean_group(s)         (a group of one keeps its raw score: mean taken as 0)
        A = masked_whiten(a tiled over the response's tokens)   over all valid tokens of the batch
    i.e. the group mean removes the prompt's difficulty and the batch-wide (token-weighted) std
    sets the scale, instead of GRPO's per-group std.

    Args:
        token_level_rewards: (N, T); the score is its row sum.
        response_mask: (N, T). group_index: (N,) long.
        values, gamma, lam, norm_adv_by_std_in_grpo: unused.
    Returns:
        advantages (N, T) and returns (N, T), equal; 0 where masked.
    """
    _check(token_level_rewards, response_mask, group_index, values)
    mask = response_mask.to(token_level_rewards.dtype)  # (N, T)
    scores = token_level_rewards.sum(dim=-1).to(torch.float64)  # (N,)
    count, mean, _ = _group_stats(scores, group_index)
    centred = scores - torch.where(count > 1, mean, torch.zeros_like(mean))  # s_i - μ_group
    centred = centred.to(token_level_rewards.dtype)
    tiled = centred.unsqueeze(-1) * mask  # (N, T) the score on every valid token
    advantages = masked_whiten(tiled, mask) * mask
    return advantages, advantages.clone()
