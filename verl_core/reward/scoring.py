"""The reward phase's scoring: a batch's responses decoded as scorers see them
(``reward/decode.py``), scored by the rule scorer (``reward/manager.py``) and/or given the reward
model's scores (``reward/model.py``), DAPO's overlong penalty added (``reward/overlong.py``), and a
ReMax batch's greedy baselines scored once per group.

What does not belong here: the scorers themselves (``reward/registry.py``, ``reward/custom.py``),
running the reward model (``RLTrainer.model_scores``), advantages (``algorithms/``). Imports
torch: not imported by ``verl_core.reward`` (custom-scorer workers import that package).
"""

from __future__ import annotations

from typing import Sequence

import torch

from verl_core.agent.openai_server import join_agent_rewards
from verl_core.data.batch import Batch
from verl_core.guard import checks
from verl_core.reward.decode import decode_responses
from verl_core.reward.manager import RewardScorer
from verl_core.reward.overlong import OverlongBuffer


def decoded(tokenizer, batch: Batch):
    """The batch's responses as scorers see them (``reward/decode.py``; a multi-turn row's whole
    transcript)."""
    multi = batch.response_attention_mask is not None
    return decode_responses(tokenizer, batch.response_ids, batch.response_attn,
                            sampled_mask=batch.response_mask if multi else None)


def turn_extra_info(infos: list[dict], turns: list[dict]) -> list[dict]:
    """Each multi-turn row's ``extra_info`` as verl's reward managers give it to a scorer: the
    row's own, plus ``num_turns`` (assistant turns) and ``tool_rewards`` (each call's step
    reward, then each tool's ``calc_reward``), with simulated users ``turn_scores`` (verl's:
    the user's turn scores, in order; what a scorer adds to the reward, docs/agent.md), and an
    agent loop's ``extra_fields``."""
    return [{**(info or {}), "num_turns": len(t["turns"]), "tool_rewards": list(t["tool_rewards"]),
             **({"turn_scores": list(t["turn_scores"])} if "turn_scores" in t else {}),
             **(t.get("agent") or {}).get("extra_fields", {})}  # an agent loop's extra_fields
            for info, t in zip(infos, turns)]


def with_loop_scores(scores: torch.Tensor, turns: list[dict] | None) -> torch.Tensor:
    """``scores`` (N,) with each row whose agent loop set ``reward_score`` (a failed loop: 0)
    given that score instead, as verl uses a loop's own score (``agent/loops.py``)."""
    from verl_core.agent.loops import loop_scores

    got = loop_scores(turns)
    if got is None:
        return scores
    return torch.tensor([float(s) if g is None else float(g)
                         for s, g in zip(scores.tolist(), got)], dtype=torch.float32)


def score_batch(batch: Batch, scorer: RewardScorer, tokenizer, *,
                model_scores: Sequence[float] | None = None,
                baseline_model_scores: Sequence[float] | None = None,
                combine: str = "replace", overlong: OverlongBuffer | None = None,
                details: dict | None = None) -> tuple[Batch, dict]:
    """Reward phase: decode the responses (each cut at its first EOS, special tokens kept, see
    ``reward/decode.py``) and score them. Adds ``score`` (N,). With ``overlong`` (DAPO's overlong
    buffer, ``reward/overlong.py``) the scorer's score gets its length penalty added, as verl's
    DAPO reward manager (a reward model's score replaces it unpenalised). ``details`` (a dict):
    filled with ``score`` (N,), the score before that penalty, and ``acc`` (N,), the scorer's
    ``acc`` where it returns one, else that score (what DAPO's group filter may read). A batch
    that carries greedy baseline responses (ReMax) also gets ``baseline_score`` (N,): each
    prompt's greedy response is scored once, by the same scorer, and its score given to the
    prompt's G rows.

    With a reward model (``reward_model.enable``): ``model_scores`` (N,) are its scores of the
    rows and ``baseline_model_scores`` (B,) of the greedy responses, one per group in the order of
    :func:`group_first_rows` (both from :meth:`~verl_core.trainer.RLTrainer.model_scores`).
    ``combine="replace"``: the model's score is the score and the scorer is not called (verl 0.9
    without a custom reward function); ``"add"``: score = scorer's + model's. Adds
    ``reward/model_mean`` (and ``reward/rule_mean`` when added)."""
    dec = decoded(tokenizer, batch)
    rule, timeouts = None, 0
    if model_scores is None or combine == "add":
        res = scorer.score(batch.data_source, dec.texts, batch.ground_truth, batch.extra_info,
                           special_token=dec.special_token)
        rule, timeouts = torch.tensor(res.scores, dtype=torch.float32), res.num_timeouts  # (N,)
        rule = with_loop_scores(rule, batch.turns)
    score = _combine(rule, model_scores, combine)  # (N,)
    if any("agent_error" in (i or {}) for i in batch.extra_info):  # rollout.openai_agent's rows
        score = join_agent_rewards(score, batch.extra_info)
    overlong_metrics = {}
    if details is not None:
        details.update(score=score, acc=_acc(res.extras, score) if rule is not None else score)
    if overlong is not None and rule is not None:
        penalty, overlong_metrics = overlong.penalty(batch.response_attn)  # (N,)
        score = score + penalty
    n = max(1, batch.num_rows)
    metrics = {"reward/mean": float(score.mean()), "reward/max": float(score.max()),
               "reward/min": float(score.min()), "reward/timeouts": float(timeouts),
               "reward/timeout_fraction": timeouts / n,
               "reward/special_token_fraction": sum(dec.special_token) / n}
    metrics.update(overlong_metrics)
    # groups whose G scores are all equal (zero advantage): the guard's no_signal counts them
    metrics.update(checks.zero_variance_groups(score, batch.group))
    if model_scores is not None:
        metrics["reward/model_mean"] = float(_combine(None, model_scores, "replace").mean())
        if rule is not None:
            metrics["reward/rule_mean"] = float(rule.mean())
    changes = {"score": score}
    if batch.baseline_response_ids is not None:
        if model_scores is not None and baseline_model_scores is None:
            raise ValueError("score_batch: this batch has greedy baseline responses; pass "
                             "baseline_model_scores with model_scores")
        changes["baseline_score"], baseline_metrics = _score_baseline(
            batch, scorer, tokenizer, baseline_model_scores, combine, overlong)
        metrics.update(baseline_metrics)
    return batch.replace(**changes), metrics


def _acc(extras: dict, score: torch.Tensor) -> torch.Tensor:
    """(N,) the scorer's ``acc`` (verl's DAPO reward manager: a dict scorer's ``acc``, a number
    scorer's score), ``score`` (N,) where a row has none."""
    acc = extras.get("acc")
    if acc is None:
        return score
    return torch.tensor([float(s) if a is None else float(a) for a, s in zip(acc, score.tolist())],
                        dtype=torch.float32)


def _combine(rule: torch.Tensor | None, model: Sequence[float] | None,
             combine: str) -> torch.Tensor:
    """The score (n,) float32 from the scorer's (n,) and the reward model's (n,) scores."""
    if model is None:
        return rule
    m = torch.tensor(list(model), dtype=torch.float32)  # (n,)
    if combine == "replace":
        return m
    if combine == "add":
        return rule + m
    raise ValueError(f"combine={combine!r}: known: replace, add")


def group_first_rows(group: torch.Tensor) -> list[int]:
    """(B,) the first row of each group, in order of first appearance: the rows whose greedy
    baseline response is scored (a group's rows share the prompt, hence that response)."""
    first: dict[int, int] = {}  # group id -> its first row
    for i, g in enumerate(group.tolist()):
        first.setdefault(g, i)
    return list(first.values())


def _score_baseline(batch: Batch, scorer: RewardScorer, tokenizer,
                    model_scores: Sequence[float] | None = None,
                    combine: str = "replace",
                    overlong: OverlongBuffer | None = None) -> tuple[torch.Tensor, dict]:
    """``baseline_score`` (N,): the score of each row's greedy baseline response, computed once
    per group; ``model_scores`` (B,) combine with it as in :func:`score_batch`."""
    rows = group_first_rows(batch.group)  # (B,)
    idx = torch.tensor(rows, dtype=torch.long)
    rule, timeouts = None, 0
    if model_scores is None or combine == "add":
        dec = decode_responses(tokenizer, batch.baseline_response_ids[idx],
                               batch.baseline_response_mask[idx])
        res = scorer.score([batch.data_source[i] for i in rows], dec.texts,
                           [batch.ground_truth[i] for i in rows],
                           [batch.extra_info[i] for i in rows], special_token=dec.special_token)
        rule, timeouts = torch.tensor(res.scores, dtype=torch.float32), res.num_timeouts  # (B,)
        if overlong is not None:  # verl's REMAX baseline is scored by the same reward manager
            rule = rule + overlong.penalty(batch.baseline_response_mask[idx])[0]
    per_prompt = _combine(rule, model_scores, combine)  # (B,)
    per_group = dict(zip(batch.group[idx].tolist(), per_prompt.tolist()))
    baseline = torch.tensor([per_group[g] for g in batch.group.tolist()], dtype=torch.float32)
    values = res.scores if model_scores is None else per_prompt.tolist()
    return baseline, {"reward/baseline_mean": sum(values) / max(1, len(rows)),
                      "reward/baseline_timeouts": float(timeouts)}
