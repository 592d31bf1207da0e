"""Which detectors judge what, and where: the glue between the detectors and the phases.

- :func:`batch_anomalies` and :func:`update_anomalies`: the deterministic detectors, run on what
  the batch says about the step and on the update's own metrics, each against the history of the
  steps before. Their decisions change the trajectory (skip, rollback), so they read only numbers
  that a re-run reproduces.
- :func:`judge_batch` before the update and :func:`judge_update` after it: the guard's decision
  on an update (``RunWorker.update`` runs the update between them and carries the decision out).
- The wall-clock detectors (:data:`TIMING`) are judged where the time is measured
  (``runlog.watch_phase``), never in the update's decision.
"""

from __future__ import annotations

import torch

from verl_core.guard.config import TIMING_DETECTORS, GuardConfig
from verl_core.data.batch import Batch
from verl_core.guard import detectors, policy

TIMING = TIMING_DETECTORS
"""Wall-clock detectors (latency, throughput, accelerator utilisation)."""


def batch_signals(batch: Batch) -> dict[str, float]:
    """The step's deterministic signals as the batch holds them (reward, response length,
    advantages), named like the phase metrics so the detectors' history lines up."""
    out = {"response_length/mean": float(batch.response_attn.sum()) / max(batch.num_rows, 1)}
    if batch.score is not None:
        out["reward/mean"] = float(batch.score.double().mean())
        out["reward/min"], out["reward/max"] = float(batch.score.min()), float(batch.score.max())
        out.update(zero_variance_groups(batch.score, batch.group))
    if batch.advantages is not None:
        adv = batch.advantages.double()[batch.response_mask.bool()]
        if adv.numel():
            out["advantages/abs_max"] = float(adv.abs().max())
    return out


def zero_variance_groups(score: torch.Tensor, group: torch.Tensor) -> dict[str, float]:
    """``rollout/zero_variance_groups``: how many of the batch's groups (its prompts' G rows,
    ``group`` (N,)) have all G scores (``score`` (N,)) equal, and ``rollout/zero_variance_frac``
    their share. Such a group has advantage 0 on every row for every group-relative estimator
    (GRPO, RLOO, ...): it teaches nothing. All of them: the step has no learning signal.
    Groups of one response are not counted (there is nothing to compare: PPO's G = 1, or verl's
    GRPO with n = 1, whose advantage is the score itself); a batch of only those has no entry."""
    ids, inverse = torch.unique(group, return_inverse=True)  # (B,), (N,)
    s = score.double()
    count = torch.zeros(len(ids), dtype=torch.float64).index_add_(0, inverse, torch.ones_like(s))
    hi = torch.full((len(ids),), -torch.inf, dtype=torch.float64).scatter_reduce(
        0, inverse, s, "amax")  # (B,) each group's max score
    lo = torch.full((len(ids),), torch.inf, dtype=torch.float64).scatter_reduce(
        0, inverse, s, "amin")  # (B,) its min
    several = count >= 2  # (B,)
    if not bool(several.any()):
        return {}
    flat = int(((hi == lo) & several).sum())
    return {"rollout/zero_variance_groups": float(flat),
            "rollout/zero_variance_frac": flat / int(several.sum())}


def _unique(anomalies: list) -> list:
    """One anomaly per (detector, signal): a signal seen by two phases' detectors counts once."""
    seen, out = set(), []
    for a in anomalies:
        if (a.detector, a.signal) not in seen:
            seen.add((a.detector, a.signal))
            out.append(a)
    return out


def batch_anomalies(step: int, batch: Batch, history: list[dict], cfg: GuardConfig) -> list:
    """Deterministic detectors over the batch of ``step`` before it is applied: non-finite
    values in any float column, and the rollout/reward/advantage detectors on its signals."""
    if not cfg.enabled:
        return []
    current = batch_signals(batch)
    found = [a for phase in ("rollout", "reward", "advantage")
             for a in detectors.detect(phase, step, current, history, cfg)
             if a.detector not in TIMING]
    for column, n in detectors.nonfinite_counts(batch).items():
        if n:
            found.append(detectors.Anomaly(
                detector="nonfinite", phase="update", step=step, signal=column, value=float(n),
                threshold=0.0, message=f"{n} non-finite value(s) in the batch's {column}"))
    return _unique(found)


def update_anomalies(step: int, metrics: dict, history: list[dict], cfg: GuardConfig) -> list:
    """Deterministic detectors over the update's metrics (loss, KL, entropy, gradient norm) and
    the optimizer steps it had to refuse for non-finite gradients."""
    if not cfg.enabled:
        return []
    found = [a for a in detectors.detect("update", step, metrics, history, cfg)
             if a.detector not in TIMING]
    skipped = metrics.get("update/skipped_nonfinite_steps", 0)
    if skipped:
        found.append(detectors.Anomaly(
            detector="nonfinite", phase="update", step=step, signal="actor/grad_norm",
            value=float("nan"), threshold=0.0,
            message=f"non-finite gradients in {int(skipped)} optimizer step(s) of the update"))
    return _unique(found)


def judge_batch(step: int, batch: Batch, history: list[dict], guard: dict, cfg: GuardConfig, *,
                can_roll_back: bool) -> policy.Decision:
    """The guard's decision on update ``step`` before it runs, from the batch alone: the update
    runs only when it is ``none`` or ``warn``. ``guard``: the guard state before the step (the
    update itself resets its counters); ``can_roll_back``: an earlier state exists to return
    to."""
    return policy.decide(batch_anomalies(step, batch, history, cfg), dict(guard), cfg,
                         can_roll_back=can_roll_back)


def judge_update(step: int, before: policy.Decision, metrics: dict, history: list[dict],
                 guard: dict, cfg: GuardConfig, *, can_roll_back: bool) -> policy.Decision:
    """The decision on update ``step`` once it ran: the update's metrics judged together with
    the batch's anomalies (``before``, :func:`judge_batch`'s decision), against the same
    ``history`` and ``guard`` state as before the update. A skip decided now is still carried
    out: the worker rebuilds the state before the update from the run store. The caller carries
    out the decision."""
    after = update_anomalies(step, metrics, history, cfg)
    if not after:
        return before
    return policy.decide([*before.anomalies, *after], dict(guard), cfg,
                         can_roll_back=can_roll_back)
