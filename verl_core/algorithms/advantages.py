"""Advantage estimators: token rewards (and critic values) -> advantages and returns.

Every estimator takes one record and returns two tensors (the registry enforces the signature)::

    fn(inp: EstimatorInputs) -> (advantages (N, T), returns (N, T))

so the advantage phase (``verl_core/training/advantage.py``) builds one :class:`EstimatorInputs`
and calls ``get_advantage_estimator(cfg.adv_estimator)(inp)`` whatever the name, and the
estimators' docstrings give only their formula. Fields an estimator does not use are ignored.
``returns`` is the estimator's return where it has one (GAE: A + V; the
reward-to-go estimators: G) and a copy of ``advantages`` for the outcome estimators (verl returns
one tensor twice); both are 0 where ``response_mask`` is 0. ``group_index[i]`` says which prompt
row ``i`` answers; only equality matters (any long values, groups need not be contiguous).
Outcome estimators (grpo, rloo, reinforce_plus_plus_baseline, opo, gpg, grpo_passk, gdpo) read one
score per response, ``token_level_rewards.sum(-1)``, as verl does; rewards outside the mask are
expected to be 0 (``outcome_to_token_rewards`` and ``apply_kl_penalty`` guarantee it).

The optional fields are the inputs only some estimators read (their field docs say which). Each
entry's *traits* (:class:`EstimatorTraits`, declared at registration) say which of these the run
must produce and whether the estimator needs a critic or groups of responses; the config and the
trainer ask the registry (``ADVANTAGE_ESTIMATORS.traits(name)``), never a list of names.

Numbers follow verl's ``verl/trainer/ppo/core_algos.py`` (v0.9; function named in each
docstring) on every position where ``response_mask`` is set. One deliberate difference: every
estimator returns exactly 0 where ``response_mask`` is 0 (verl leaves whitened or carried values
there, e.g. reward-to-go inside an observation span, that every consumer masks out anyway).
Other differences are named in the estimator's docstring.

Group statistics are computed in float64 with ``index_add_`` over ``group_index``, not Python
dicts; on CUDA they are bitwise reproducible under ``torch.use_deterministic_algorithms(True)``. The token
recursions (GAE, REINFORCE++ returns) loop over T and are vectorised over N.

What does not belong here: policy losses, KL, anything that reads a config.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from verl_core.algorithms.registry import Registry
from verl_core.algorithms.utils import masked_whiten

GRPO_EPSILON = 1e-6  # verl's epsilon in (s - mean) / (std + eps)
OTB_EPSILON = 1e-8  # verl's epsilon in the optimal token baseline's denominator
GPG_F_NORM = 1.0  # verl's F_norm in GPG's A = α (s - mean) / F_norm


@dataclass(frozen=True)
class EstimatorTraits:
    """What an advantage estimator needs from the rest of the run, declared where it is
    registered (``@register_advantage("gae", needs_critic=True)``)."""

    needs_critic: bool = False
    """Reads ``values`` (N, T): the trainer builds and trains a critic."""
    needs_groups: bool = False
    """Compares the responses to one prompt with each other: the config refuses ``rollout.n < 2``
    unless ``one_response_ok``."""
    one_response_ok: bool = False
    """A group of one response still gets an advantage (its raw score, as in verl's function), so
    ``rollout.n = 1`` is accepted as verl runs it (REINFORCE with no baseline)."""
    needs_greedy_baseline: bool = False
    """Reads ``baseline_score`` (N,): the rollout also decodes one greedy response per prompt and
    the reward phase scores it."""
    needs_sum_pi_squared: bool = False
    """Reads ``old_logprobs`` and ``sum_pi_squared`` (N, T): the rollout runs one more no-grad
    forward pass of the policy for Σ_v π_v² at every response token."""


@dataclass(frozen=True, kw_only=True)
class EstimatorInputs:
    """Everything an advantage estimator may read: one record, built once per advantage phase.

    Construction checks the shapes of the tensors every estimator reads (a mismatch raises
    ``ValueError`` naming the field); an estimator checks the optional fields it needs."""

    token_level_rewards: Tensor
    """(N, T) reward of each response token: the outcome score on the last valid token (minus the
    reward KL when ``use_kl_in_reward``), 0 outside ``response_mask``."""
    response_mask: Tensor
    """(N, T) 1 on the tokens the policy sampled (0 on padding and on tool output)."""
    group_index: Tensor
    """(N,) long: which prompt each row answers (only equality matters)."""
    gamma: float
    """Discount γ (``algorithm.gamma``): GAE and REINFORCE++."""
    lam: float
    """GAE's λ (``algorithm.lam``)."""
    norm_adv_by_std_in_grpo: bool
    """Divide by the group's std (GRPO) or not (Dr. GRPO): grpo, grpo_passk, gdpo."""
    values: Optional[Tensor] = None
    """(N, T) critic values V_t: GAE (``needs_critic``)."""
    baseline_score: Optional[Tensor] = None
    """(N,) score of a greedy response to each row's prompt: remax (``needs_greedy_baseline``)."""
    old_logprobs: Optional[Tensor] = None
    """(N, T) the rollout policy's log-prob of each sampled token: the optimal token baselines
    (``needs_sum_pi_squared``)."""
    sum_pi_squared: Optional[Tensor] = None
    """(N, T) Σ_v π_v² of the rollout policy at each response token: the optimal token
    baselines (``needs_sum_pi_squared``)."""
    reward_components: Optional[Tensor] = None
    """(N, K) K separately scored reward dimensions: gdpo (batches carry one score, so the
    trainer leaves it None)."""

    def __post_init__(self):
        if self.token_level_rewards.dim() != 2:
            raise ValueError("token_level_rewards must be (N, T), "
                             f"got {tuple(self.token_level_rewards.shape)}")
        N, T = self.token_level_rewards.shape
        for name, want, shape in (("response_mask", "(N, T)", (N, T)),
                                  ("group_index", "(N,)", (N,)), ("values", "(N, T)", (N, T))):
            x = getattr(self, name)
            if x is not None and tuple(x.shape) != shape:
                raise ValueError(f"{name} must be {want}={shape}, got {tuple(x.shape)}")


def _estimator_prototype(inp: EstimatorInputs) -> tuple[Tensor, Tensor]:
    raise NotImplementedError  # the one signature every estimator repeats


ADVANTAGE_ESTIMATORS = Registry("advantage estimator", prototype=_estimator_prototype,
                                traits=EstimatorTraits)


def register_advantage(name: str, *aliases: str, **traits):
    """Decorator registering an advantage estimator under ``name`` (and ``aliases``), with its
    :class:`EstimatorTraits` as keywords."""
    return ADVANTAGE_ESTIMATORS.register(name, *aliases, **traits)


def get_advantage_estimator(name: str):
    """The estimator registered as ``name``; an unknown name raises listing the known ones."""
    return ADVANTAGE_ESTIMATORS.get(name)


# ---------------------------------------------------------------- helpers
def _need(estimator: str, name: str, x: Optional[Tensor], shape: tuple, what: str) -> Tensor:
    """``x`` when it is given with ``shape`` (``None`` in it: any size), else a ValueError saying
    what the estimator needs and where it comes from."""
    if x is None:
        raise ValueError(f"the {estimator!r} advantage estimator needs {name} {what}; got {name}=None")
    if x.dim() != len(shape) or any(s is not None and s != d for s, d in zip(shape, x.shape)):
        raise ValueError(f"{name} must have shape {tuple('K' if s is None else s for s in shape)}, "
                         f"got {tuple(x.shape)}")
    return x


def _dense_groups(group_index: Tensor) -> tuple[Tensor, int]:
    """(group (N,) dense ids in [0, K), K). ``unique`` syncs on CUDA to size its output; the
    only other read-back in this module is grpo_passk's check for groups of one."""
    ids, group = torch.unique(group_index, return_inverse=True)
    return group, ids.numel()


def _group_sum(x: Tensor, group: Tensor, K: int) -> Tensor:
    """Σ over each group's rows: x (N, ...) -> (K, ...)."""
    return torch.zeros((K, *x.shape[1:]), dtype=x.dtype, device=x.device).index_add_(0, group, x)


def _reward_to_go(token_level_rewards: Tensor, mask: Tensor) -> Tensor:
    """G_t = Σ_{t' >= t} m_t' r_t' (N, T) float64: undiscounted, masked rewards left out (verl's
    ``(r * mask).flip(-1).cumsum(-1).flip(-1)``)."""
    return (token_level_rewards.to(torch.float64) * mask).flip(-1).cumsum(-1).flip(-1)


def _group_stats(scores: Tensor, group_index: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(count, mean, std) of each row's group, each (N,) float64, for scores (N,): the group's
    size n, mean and unbiased std sqrt(Σ (s - mean)² / (n - 1)) (as ``torch.std``; 0 for a group
    of one, whose meaning the caller decides).

    float64 because a group whose responses all score the same must get advantage 0: in float32
    eight scores of 0.7 have a mean that is off by one ulp, and (s - mean) / (std + 1e-6) turns
    that into a spurious advantage of ~0.06 (verl, which works in float32, has this artefact).
    """
    x = scores.to(torch.float64)
    group, K = _dense_groups(group_index)  # group: (N,) dense ids in [0, K)
    count = torch.zeros(K, dtype=x.dtype, device=x.device).index_add_(0, group, torch.ones_like(x))
    total = torch.zeros(K, dtype=x.dtype, device=x.device).index_add_(0, group, x)
    mean = total / count  # (K,) every group has >= 1 row
    sq_dev = (x - mean[group]) ** 2  # (N,)
    ss = torch.zeros(K, dtype=x.dtype, device=x.device).index_add_(0, group, sq_dev)
    std = torch.sqrt(ss / (count - 1).clamp(min=1.0))  # (K,) unbiased; 0 for singletons
    return count[group], mean[group], std[group]  # (N,) each


# ---------------------------------------------------------------- estimators
@register_advantage("gae", needs_critic=True)
@torch.no_grad()
def gae(inp: EstimatorInputs) -> tuple[Tensor, Tensor]:
    """Generalised Advantage Estimation (Schulman et al. 2016, arXiv:1506.02438).

    Follows verl ``compute_gae_advantage_return`` (recent form): the backward recursion moves
    ``next_value`` and ``last_gae`` only on positions where the mask is set, so masked positions
    (padding, or observation tokens inside a multi-turn response) are skipped rather than treated
    as zero-valued states. Returns are the un-whitened advantages plus the values; advantages
    are then whitened over all valid tokens of the batch.
    """
    if inp.values is None:
        raise ValueError("the 'gae' advantage estimator needs critic values (N, T); got values=None "
                         "(compute values with the critic, or pick an outcome estimator such as 'grpo')")
    gamma, lam = inp.gamma, inp.lam
    # at least float32: a bf16 critic's values would otherwise make the recursion bf16
    dtype = torch.promote_types(
        torch.promote_types(inp.token_level_rewards.dtype, inp.values.dtype), torch.float32)
    rewards, values = inp.token_level_rewards.to(dtype), inp.values.to(dtype)  # (N, T) each
    mask = inp.response_mask.to(dtype)  # (N, T)
    N, T = rewards.shape
    next_value = torch.zeros(N, dtype=values.dtype, device=values.device)  # V of the next valid token
    last_gae = torch.zeros_like(next_value)  # A of the next valid token
    advantages = torch.zeros_like(values)  # (N, T)
    for t in reversed(range(T)):
        delta = rewards[:, t] + gamma * next_value - values[:, t]  # δ_t = r_t + γV_{t+1} - V_t
        gae_t = delta + gamma * lam * last_gae  # A_t = δ_t + γλ A_{t+1}
        m = mask[:, t]
        next_value = m * values[:, t] + (1 - m) * next_value  # carry across masked positions
        last_gae = m * gae_t + (1 - m) * last_gae
        advantages[:, t] = last_gae
    returns = (advantages + values) * mask  # R_t = A_t + V_t
    advantages = masked_whiten(advantages, mask) * mask
    return advantages, returns


@register_advantage("grpo", "grpo_vectorized", needs_groups=True, one_response_ok=True)
@torch.no_grad()
def grpo(inp: EstimatorInputs) -> tuple[Tensor, Tensor]:
    """Group-relative outcome advantage (GRPO, Shao et al. 2024, arXiv:2402.03300 sec. 4.1.2).

    Follows verl ``compute_grpo_outcome_advantage``: with s_i the response score and the group's
    mean and unbiased std (``torch.std``),
        A_i = (s_i - mean) / (std + 1e-6)   if ``norm_adv_by_std_in_grpo``  (GRPO)
        A_i = s_i - mean                      otherwise  (Dr. GRPO, Liu et al. 2025, arXiv:2503.20783)
    broadcast over the response's tokens. A group of one response uses mean 0 and std 1, so its
    advantage is s / (1 + 1e-6) (or s): verl's convention, not a zero.

    ``grpo_vectorized`` is an alias: verl's vectorized function gives the same numbers.
    """
    scores = inp.token_level_rewards.sum(dim=-1)  # (N,) s_i
    adv = _grpo_scores(scores, inp.group_index, inp.norm_adv_by_std_in_grpo)
    return _outcome_over_tokens(adv, inp.token_level_rewards.dtype, inp.response_mask)


def _grpo_scores(scores: Tensor, group_index: Tensor, norm_by_std: bool) -> Tensor:
    """GRPO's per-response advantage (N,) float64 of scores (N,); see :func:`grpo`."""
    scores = scores.to(torch.float64)
    count, mean, std = _group_stats(scores, group_index)  # (N,) each
    single = count < 2
    mean = torch.where(single, torch.zeros_like(mean), mean)
    std = torch.where(single, torch.ones_like(std), std)
    if norm_by_std:
        return (scores - mean) / (std + GRPO_EPSILON)  # (s - μ) / (σ + ε)
    return scores - mean  # Dr. GRPO: s - μ


def _outcome_over_tokens(adv: Tensor, dtype: torch.dtype, response_mask: Tensor):
    """A per-response advantage (N,) broadcast over its valid tokens: (advantages, returns), both
    (N, T) and equal (outcome estimators have no separate return)."""
    adv = adv.to(dtype)
    advantages = adv.unsqueeze(-1) * response_mask.to(adv.dtype)  # (N, T)
    return advantages, advantages.clone()


@register_advantage("rloo", needs_groups=True, one_response_ok=True)
@torch.no_grad()
def rloo(inp: EstimatorInputs) -> tuple[Tensor, Tensor]:
    """REINFORCE Leave-One-Out (Ahmadian et al. 2024, arXiv:2402.14740;
    Kool et al. 2019, "Buy 4 REINFORCE samples, get a baseline for free").

    Follows verl ``compute_rloo_outcome_advantage`` (its loop version): in a group of n > 1
    responses with mean μ,
        A_i = s_i * n/(n-1) - μ * n/(n-1)  =  s_i - mean_{j != i} s_j
    broadcast over the response's tokens; a group of one keeps its raw score, A_i = s_i.
    :func:`rloo_vectorized` differs from it on groups of one only, as verl's two functions do.
    """
    scores = inp.token_level_rewards.sum(dim=-1).to(torch.float64)  # (N,)
    adv = _leave_one_out(scores, inp.group_index, singleton=scores)
    return _outcome_over_tokens(adv, inp.token_level_rewards.dtype, inp.response_mask)


@register_advantage("rloo_vectorized", needs_groups=True)
@torch.no_grad()
def rloo_vectorized(inp: EstimatorInputs) -> tuple[Tensor, Tensor]:
    """RLOO as verl ``compute_rloo_vectorized_outcome_advantage`` computes it:
        A_i = (n s_i - Σ_j s_j) / max(n - 1, 1) * [n > 1]
    :func:`rloo`'s numbers, except that a group of one gets 0 (nothing to compare with) where
    :func:`rloo` keeps its score: each name gives its own verl function's numbers.
    """
    scores = inp.token_level_rewards.sum(dim=-1).to(torch.float64)  # (N,)
    adv = _leave_one_out(scores, inp.group_index, singleton=torch.zeros_like(scores))
    return _outcome_over_tokens(adv, inp.token_level_rewards.dtype, inp.response_mask)


def _leave_one_out(scores: Tensor, group_index: Tensor, *, singleton: Tensor) -> Tensor:
    """s_i minus the mean of the other scores of its group (N,) float64, for scores (N,)
    float64; ``singleton`` (N,) where the group has one response."""
    count, mean, _ = _group_stats(scores, group_index)
    factor = count / (count - 1).clamp(min=1.0)  # n / (n - 1)
    return torch.where(count > 1, scores * factor - mean * factor, singleton)  # s·n/(n-1) - μ·n/(n-1)


@register_advantage("reinforce_plus_plus")
@torch.no_grad()
def reinforce_plus_plus(inp: EstimatorInputs) -> tuple[Tensor, Tensor]:
    """REINFORCE++ (Hu 2025, arXiv:2501.03262): discounted returns, whitened over the batch.

    Follows verl ``compute_reinforce_plus_plus_outcome_advantage`` as fixed for verl issue #7278
    (PR #7300): the scan moves only on valid tokens, so a masked span inside a response (a
    multi-turn observation) neither resets nor discounts the return of the tokens before it:
        G_t = r_t + γ G_{t'}     where m_t = 1, t' the next valid position (G = 0 past the last)
        G_t = 0                  where m_t = 0 (carried through; a masked reward is not added)
        A = masked_whiten(G)     over all valid tokens of the batch
    Mask [1,1,0,0,1,1], γ = 1, reward 1 at the end: G = [1,1,0,0,1,1] (before the fix
    [0,0,0,0,1,1]).
    """
    mask = inp.response_mask.to(inp.token_level_rewards.dtype)  # (N, T)
    valid = inp.response_mask.bool()  # (N, T)
    N, T = inp.token_level_rewards.shape
    returns = torch.zeros_like(inp.token_level_rewards)  # (N, T)
    running = torch.zeros(N, dtype=returns.dtype, device=returns.device)  # G of next valid token
    for t in reversed(range(T)):
        g_t = inp.token_level_rewards[:, t] + inp.gamma * running  # G_t = r_t + γ G_{t'}
        returns[:, t] = torch.where(valid[:, t], g_t, torch.zeros_like(g_t))
        running = torch.where(valid[:, t], g_t, running)  # masked: carried unchanged
    advantages = masked_whiten(returns, mask) * mask
    return advantages, returns


@register_advantage("reinforce_plus_plus_baseline", needs_groups=True)
@torch.no_grad()
def reinforce_plus_plus_baseline(inp: EstimatorInputs) -> tuple[Tensor, Tensor]:
    """REINFORCE++ with a group-mean baseline (Hu 2025, arXiv:2501.03262).

    Follows verl ``compute_reinforce_plus_plus_baseline_outcome_advantage``:
        a_i = s_i - mean_group(s)         (a group of one keeps its raw score: mean taken as 0)
        A = masked_whiten(a tiled over the response's tokens)   over all valid tokens of the batch
    i.e. the group mean removes the prompt's difficulty and the batch-wide (token-weighted) std
    sets the scale, instead of GRPO's per-group std.
    """
    mask = inp.response_mask.to(inp.token_level_rewards.dtype)  # (N, T)
    scores = inp.token_level_rewards.sum(dim=-1).to(torch.float64)  # (N,)
    count, mean, _ = _group_stats(scores, inp.group_index)
    centred = scores - torch.where(count > 1, mean, torch.zeros_like(mean))  # s_i - μ_group
    centred = centred.to(inp.token_level_rewards.dtype)
    tiled = centred.unsqueeze(-1) * mask  # (N, T) the score on every valid token
    advantages = masked_whiten(tiled, mask) * mask
    return advantages, advantages.clone()


@register_advantage("remax", needs_greedy_baseline=True)
@torch.no_grad()
def remax(inp: EstimatorInputs) -> tuple[Tensor, Tensor]:
    """ReMax: REINFORCE with the greedy response's reward as baseline (Li et al. 2023,
    "ReMax: A Simple, Effective, and Efficient Reinforcement Learning Method for Aligning Large
    Language Models", arXiv:2310.10505).

    Follows verl ``compute_remax_outcome_advantage``: with b the score of the greedy (argmax)
    response to the row's prompt, generated by the rollout and scored by the reward phase,
        G_t = Σ_{t' >= t} m_t' r_t'     reward-to-go over valid tokens (undiscounted, as verl)
        A_t = G_t - b
    The baseline costs one greedy decode per prompt instead of a critic or a group, so ReMax
    works with ``rollout.n = 1``.
    """
    N = inp.token_level_rewards.shape[0]
    b = _need("remax", "baseline_score", inp.baseline_score, (N,),
              "(N,), the score of a greedy response to each row's prompt (the trainer's rollout "
              "makes it when the estimator's traits say needs_greedy_baseline)")
    mask = inp.response_mask.to(torch.float64)  # (N, T)
    returns = _reward_to_go(inp.token_level_rewards, mask) * mask  # G_t
    advantages = (returns - b.to(torch.float64).unsqueeze(-1)) * mask  # A_t = G_t - b
    dtype = inp.token_level_rewards.dtype
    return advantages.to(dtype), returns.to(dtype)


@register_advantage("opo", needs_groups=True)
@torch.no_grad()
def opo(inp: EstimatorInputs) -> tuple[Tensor, Tensor]:
    """On-Policy RL with Optimal reward baseline (OPO, Hao et al. 2025, "On-Policy RL with Optimal
    Reward Baseline", arXiv:2505.23585).

    Follows verl ``compute_opo_outcome_advantage``: the baseline is the group's mean score
    weighted by response length l_j (valid tokens), the variance-minimising baseline when the
    gradient's squared norm grows with length:
        b = Σ_j l_j s_j / Σ_j l_j      over the group
        A_i = s_i - b                   broadcast over the response's tokens
    A group of one has b = 0 (keeps its raw score), as in verl. A group whose responses are all
    empty has b = 0 too (verl divides by zero there; its advantages are masked out either way).
    """
    scores = inp.token_level_rewards.sum(dim=-1).to(torch.float64)  # (N,) s_i
    length = inp.response_mask.sum(dim=-1).to(torch.float64)  # (N,) l_i
    count, mean, _ = _group_stats(scores, inp.group_index)  # (N,) n, μ
    group, K = _dense_groups(inp.group_index)
    # b = Σ l s / Σ l, written as μ + Σ l (s - μ) / Σ l: the same number, but exactly μ when all
    # scores are equal, so such a group gets advantage 0 (as GRPO's float64 statistics ensure)
    weighted = _group_sum(length * (scores - mean), group, K)[group]  # (N,) Σ l (s - μ)
    total_length = _group_sum(length, group, K)[group]  # (N,) Σ l
    b = torch.where((count > 1) & (total_length > 0), mean + weighted / total_length.clamp(min=1.0),
                    torch.zeros_like(scores))
    return _outcome_over_tokens(scores - b, inp.token_level_rewards.dtype, inp.response_mask)


@register_advantage("gpg", needs_groups=True)
@torch.no_grad()
def gpg(inp: EstimatorInputs) -> tuple[Tensor, Tensor]:
    """Group Policy Gradient (GPG, Chu et al. 2025, "GPG: A Simple and Strong Reinforcement
    Learning Baseline for Model Reasoning", arXiv:2504.02546).

    Follows verl ``compute_gpg_outcome_advantage``: the group mean as baseline, no std, rescaled
    by α, which undoes the dilution of the batch-mean gradient by rows with no signal:
        α = N / max(1, #{i : s_i != 0})      over the whole batch
        A_i = α (s_i - mean_group(s)) / F_norm,   F_norm = 1
    The paper counts the rows of groups whose rewards are all equal; verl, and we, count zero
    scores. A group of one uses mean 0, as in verl. Usable with any policy loss (the paper pairs
    it with ``policy_loss="gpg"``).
    """
    scores = inp.token_level_rewards.sum(dim=-1).to(torch.float64)  # (N,) s_i
    count, mean, _ = _group_stats(scores, inp.group_index)
    mean = torch.where(count < 2, torch.zeros_like(mean), mean)
    nonzero = (scores != 0).sum().to(torch.float64).clamp(min=1.0)  # #{s_i != 0}, at least 1
    alpha = scores.numel() / nonzero  # α = N / #{s_i != 0}
    adv = alpha * (scores - mean) / GPG_F_NORM  # A = α (s - μ) / F_norm
    return _outcome_over_tokens(adv, inp.token_level_rewards.dtype, inp.response_mask)


@register_advantage("grpo_passk", needs_groups=True)
@torch.no_grad()
def grpo_passk(inp: EstimatorInputs) -> tuple[Tensor, Tensor]:
    """Pass@k advantage (Tang et al. 2025, "Optimizing Language Models for Inference Time
    Objectives using Reinforcement Learning", arXiv:2503.19595, the paper verl cites; see also
    Chen et al. 2025, "Pass@k Training for Adaptively Balancing Exploration and Exploitation",
    arXiv:2508.10751).

    Follows verl ``compute_grpo_passk_outcome_advantage``: the objective is the best score of the
    k = n responses of a group; its leave-one-out gradient credits only the best response, by how
    much it beats the runner-up:
        A_i = s_(1) - s_(2)   for the best response, if it is the only one with the top score
        A_i = 0               for every other response (and for all of them on a tie at the top)
        A_i /= std_group + 1e-6   if ``norm_adv_by_std_in_grpo``
    with s_(1) >= s_(2) the group's two largest scores (equal on a tie, so a tie gives 0 to all,
    whichever row verl's ``topk`` would have picked).

    Raises ``ValueError`` on a group of one response, as verl does (pass@k needs k >= 2 samples);
    the config refuses ``rollout.n < 2`` for it.
    """
    scores = inp.token_level_rewards.sum(dim=-1).to(torch.float64)  # (N,) s_i
    group, K = _dense_groups(inp.group_index)
    count = _group_sum(torch.ones_like(scores), group, K)  # (K,)
    lone = int((count < 2).sum())  # a host sync, like unique's; pass@k is undefined otherwise
    if lone:
        raise ValueError("the 'grpo_passk' advantage estimator needs at least 2 responses per "
                         f"group; {lone} group(s) have 1 (use rollout.n >= 2)")
    neg_inf = torch.full((K,), float("-inf"), dtype=scores.dtype, device=scores.device)
    top = neg_inf.scatter_reduce(0, group, scores, "amax")  # (K,) s_(1)
    is_top = scores == top[group]  # (N,)
    n_top = _group_sum(is_top.to(scores.dtype), group, K)[group]  # (N,) rows with the top score
    runner_up = neg_inf.scatter_reduce(0, group, scores.masked_fill(is_top, float("-inf")),
                                       "amax")  # (K,) best score below the top
    best = is_top & (n_top == 1)  # the unique best response of its group
    adv = torch.where(best, scores - runner_up[group], torch.zeros_like(scores))  # s_(1) - s_(2)
    if inp.norm_adv_by_std_in_grpo:
        _, _, std = _group_stats(scores, inp.group_index)
        adv = adv / (std + GRPO_EPSILON)
    return _outcome_over_tokens(adv, inp.token_level_rewards.dtype, inp.response_mask)


@register_advantage("gdpo", needs_groups=True)
@torch.no_grad()
def gdpo(inp: EstimatorInputs) -> tuple[Tensor, Tensor]:
    """Group reward-Decoupled normalization Policy Optimization (GDPO, Liu et al. 2026, "GDPO:
    Group reward-Decoupled Normalization Policy Optimization for Multi-reward RL Optimization",
    arXiv:2601.05242).

    Follows verl ``compute_gdpo_outcome_advantage``: each of K reward dimensions r_k is
    normalised within its group separately (GRPO's formula, so one dominant reward cannot drown
    the others), the K advantages are summed, then whitened over the batch:
        A_k,i = GRPO(r_k)_i          (s - μ_group) / (σ_group + 1e-6), or s - μ with Dr. GRPO
        a_i = Σ_k A_k,i              equal weights
        A = masked_whiten(a tiled over the response's tokens)   over all valid tokens of the batch

    Where this cannot follow verl: verl reads the K dimensions from its reward manager's keys
    (``algorithm.gdpo_reward_keys``); batches here carry one score, so the trainer passes no
    ``reward_components`` and GDPO uses that score, verl's own fallback (GRPO, then whitening).
    Given ``reward_components`` (N, K) it computes the multi-reward form, equal weights.
    """
    N = inp.token_level_rewards.shape[0]
    if inp.reward_components is None:
        comps = inp.token_level_rewards.sum(dim=-1, keepdim=True)  # (N, 1)
    else:
        comps = _need("gdpo", "reward_components", inp.reward_components, (N, None), "(N, K)")
    total = torch.zeros(N, dtype=torch.float64, device=comps.device)  # (N,) a_i
    for k in range(comps.shape[1]):
        total += _grpo_scores(comps[:, k], inp.group_index, inp.norm_adv_by_std_in_grpo)  # Σ_k A_k
    mask = inp.response_mask.to(inp.token_level_rewards.dtype)  # (N, T)
    tiled = total.to(inp.token_level_rewards.dtype).unsqueeze(-1) * mask  # (N, T)
    advantages = masked_whiten(tiled, mask) * mask
    return advantages, advantages.clone()


# ---------------------------------------------------------------- optimal token baseline
def _token_baseline(returns: Tensor, energy: Tensor, valid: Tensor, lengths: Tensor,
                    group_index: Tensor, member: Tensor) -> Tensor:
    """The optimal token baseline of every row, float64, on aligned positions.

    Args:
        returns: (N, L) G_t. energy: (N, L) W_t. valid: (N, L) 1 where the position exists.
        lengths: (N,) long, valid positions per row. member: (N,) bool, rows that count in their
        group (others get a baseline but are not part of anyone's).
    Returns:
        baseline (N, L):
            B_t = Σ_i G_t^i W_t^i m_t^i / (Σ_i W_t^i m_t^i + 1e-8)    over the members of the group
            B = 0 for a group of one member (its advantage is its return);
            and, as verl's ``handle_zero_tail``, B_t = 0 for t >= l_(2) on the group's longest
            member when it is the only one of that length, l_(2) the second-longest length
            (past l_(2) the baseline would average the longest response with nothing but itself).
    """
    group, K = _dense_groups(group_index)
    keep = member.to(torch.float64).unsqueeze(-1) * valid  # (N, L)
    num = _group_sum(returns * energy * keep, group, K)  # (K, L) Σ G W
    den = _group_sum(energy * keep, group, K) + OTB_EPSILON  # (K, L) Σ W + ε
    baseline = (num / den)[group]  # (N, L) B*_t
    count = _group_sum(member.to(torch.float64), group, K)[group]  # (N,) members
    baseline = torch.where((count > 1).unsqueeze(-1), baseline, torch.zeros_like(baseline))
    # zero tail: the unique longest member, from the second-longest length on
    L = torch.where(member, lengths, torch.full_like(lengths, -1))  # (N,) -1 outside
    none = torch.full((K,), -1, dtype=L.dtype, device=L.device)
    longest = none.scatter_reduce(0, group, L, "amax")  # (K,) l_(1)
    at_max = member & (lengths == longest[group])  # (N,)
    n_at_max = _group_sum(at_max.to(torch.float64), group, K)[group]  # (N,)
    second = none.scatter_reduce(0, group, L.masked_fill(at_max, -1), "amax")  # (K,) l_(2)
    tail_row = at_max & (n_at_max == 1) & (count > 1)  # (N,)
    pos = torch.arange(returns.shape[1], device=returns.device)  # (L,)
    tail = tail_row.unsqueeze(-1) & (pos.unsqueeze(0) >= second[group].unsqueeze(-1))  # (N, L)
    return baseline.masked_fill(tail, 0.0)


def _token_energy(old_logprobs: Tensor, sum_pi_squared: Tensor, mask: Tensor) -> Tensor:
    """W_t = Σ_{j <= t} m_j (1 - 2 π_j + Σ_v π_v²)  (N, T) float64: the logit-gradient proxy
    ||e_j - π||² of each sampled token's score-function norm, accumulated over valid tokens."""
    pi = old_logprobs.to(torch.float64).exp()  # π_j, the sampled token's probability
    w = 1.0 - 2.0 * pi + sum_pi_squared.to(torch.float64)  # ||s_j||² = 1 - 2π_j + Σπ²
    return (w * mask).cumsum(dim=-1)  # W_t


_OTB_INPUTS = ("(N, T), from the rollout (the trainer makes them when the estimator's traits say "
               "needs_sum_pi_squared)")


@register_advantage("optimal_token_baseline", needs_groups=True, needs_sum_pi_squared=True)
@torch.no_grad()
def optimal_token_baseline(inp: EstimatorInputs) -> tuple[Tensor, Tensor]:
    """Optimal Token Baseline (OTB, Li et al. 2026, "The Optimal Token Baseline: Variance
    Reduction for Long-Horizon LLM-RL", arXiv:2602.07078).

    Follows verl ``compute_optimal_token_baseline_advantage``: a baseline per token position t,
    the group's rewards-to-go weighted by each trajectory's accumulated gradient energy so far:
        G_t = Σ_{t' >= t} m_t' r_t'                         reward-to-go
        W_t = Σ_{j <= t} m_j (1 - 2 π_j + Σ_v π_v,j²)       realized energy (logit-gradient proxy)
        B_t = Σ_i G_t^i W_t^i m_t^i / (Σ_i W_t^i m_t^i + 1e-8)   over the group, at column t
        A_t = G_t - B_t
    with verl's ``handle_zero_tail=True`` (see :func:`_token_baseline`); a group of one keeps
    A = G. Positions are columns, as in verl: for responses with masked spans inside
    (multi-turn), ``tir_optimal_token_baseline`` aligns valid tokens instead.

    Where this cannot follow verl: verl may scale w_j by ρ̄_j² (truncated rollout importance
    weights); rollout and training share weights here, so ρ = 1. π_j is the rollout's log-prob
    of the sampled token (``old_logprobs``), with Σ_v π_v² from ``sum_pi_squared``.
    """
    N, T = inp.token_level_rewards.shape
    logp = _need("optimal_token_baseline", "old_logprobs", inp.old_logprobs, (N, T), _OTB_INPUTS)
    sq = _need("optimal_token_baseline", "sum_pi_squared", inp.sum_pi_squared, (N, T), _OTB_INPUTS)
    mask = inp.response_mask.to(torch.float64)  # (N, T)
    returns = _reward_to_go(inp.token_level_rewards, mask)  # (N, T) G_t
    energy = _token_energy(logp, sq, mask)  # (N, T) W_t
    lengths = inp.response_mask.sum(dim=-1).long()  # (N,)
    baseline = _token_baseline(returns, energy, mask, lengths, inp.group_index,
                               member=torch.ones_like(lengths, dtype=torch.bool))
    advantages = (returns - baseline) * mask  # A_t = G_t - B_t
    dtype = inp.token_level_rewards.dtype
    return advantages.to(dtype), (returns * mask).to(dtype)


@register_advantage("tir_optimal_token_baseline", needs_groups=True, needs_sum_pi_squared=True)
@torch.no_grad()
def tir_optimal_token_baseline(inp: EstimatorInputs) -> tuple[Tensor, Tensor]:
    """Optimal Token Baseline for tool-integrated (multi-turn) responses (Li et al. 2026,
    arXiv:2602.07078).

    Follows verl ``compute_multi_turn_optimal_token_baseline_advantage``: the same G_t, W_t and
    B = Σ G W / (Σ W + 1e-8) as ``optimal_token_baseline``, but trajectories are aligned by the
    k-th *valid* token rather than by column, so observation spans inside a response (tool
    output, masked) do not shift one trajectory against another:
        k(t) = Σ_{t' <= t} m_t' - 1          the valid-token index of column t
        B_k over the group at valid index k;  A_t = G_t - B_k(t)
    Responses with no valid token take no part in their group (a group left with one member
    keeps A = G); zero tail as in ``optimal_token_baseline``, on valid-token indices. The same
    note on rollout importance weights applies.
    """
    N, T = inp.token_level_rewards.shape
    name = "tir_optimal_token_baseline"
    logp = _need(name, "old_logprobs", inp.old_logprobs, (N, T), _OTB_INPUTS)
    sq = _need(name, "sum_pi_squared", inp.sum_pi_squared, (N, T), _OTB_INPUTS)
    mask = inp.response_mask.to(torch.float64)  # (N, T)
    returns = _reward_to_go(inp.token_level_rewards, mask)  # (N, T) G_t
    energy = _token_energy(logp, sq, mask)  # (N, T) W_t
    valid = inp.response_mask.bool()
    lengths = valid.sum(dim=-1)  # (N,) long
    # column t -> valid-token index k(t); masked columns go to a spare last slot, dropped after
    k = torch.where(valid, valid.long().cumsum(dim=-1) - 1, torch.full_like(lengths, T)[:, None])
    packed_returns = torch.zeros(N, T + 1, dtype=torch.float64, device=mask.device)
    packed_returns.scatter_(1, k, returns)
    packed_energy = torch.zeros_like(packed_returns).scatter_(1, k, energy)
    packed_returns, packed_energy = packed_returns[:, :T], packed_energy[:, :T]  # (N, T) by k
    packed_valid = (torch.arange(T, device=mask.device)[None] < lengths[:, None]).to(torch.float64)
    baseline = _token_baseline(packed_returns, packed_energy, packed_valid, lengths,
                               inp.group_index, member=lengths > 0)  # (N, T) B_k
    packed_adv = torch.cat([packed_returns - baseline,
                            torch.zeros(N, 1, dtype=torch.float64, device=mask.device)], dim=1)
    advantages = packed_adv.gather(1, k) * mask  # A_t = G_t - B_k(t)
    dtype = inp.token_level_rewards.dtype
    return advantages.to(dtype), (returns * mask).to(dtype)
