"""The phases of a run, one typed function each: what its Flyte task calls (``tasks/`` adds only
caching, retries, the phase log and Decks), and what tests and benchmarks call directly.

    rollout(spec, state)        -> PhaseOut   sample on the run's worker(s): the batch
    reward(spec, sampled)       -> PhaseOut   score it (rule/custom scorers here; a reward model on
                                              the workers)
    advantage(spec, scored)     -> PhaseOut   token rewards, KL penalty, the advantage estimator
    update(spec, advantaged)    -> StepState  PPO epochs on the worker(s), under the guard
    checkpoint(spec, state)     -> StepState  save where one is due (``checkpoint_due``), then
                                              end_step; on the other steps the update task
                                              calls end_step (the step's metrics recorded)
    evaluate(spec, state)       -> Metrics    greedy held-out accuracy of a state
    finalize(spec, state)       -> dict       final checkpoint committed, export, metrics table

Everything crossing a phase boundary is typed (``RunSpec`` with its ``RunConfig``, ``PhaseOut``,
``StepState``, metrics as ``dict[str, float]``) and points only at content-addressed objects in the
run store, so a Flyte cache hit, a retry on another host or a re-run reads exactly what the phase
wrote. Where the work runs (in this process, a Ray actor, a worker group, an attached cluster) is
:mod:`verl_core.engine.runtime`'s business.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from verl_core.engine import runtime
from verl_core.engine.runtime import RunSpec

Metrics = dict[str, float]


def merged(before: Metrics, new: dict) -> Metrics:
    """``before`` updated with ``new`` as floats, keys sorted (a Flyte literal of a dict keeps
    its order, so a stable order keeps cache keys stable)."""
    out = {**before, **{k: float(v) for k, v in new.items()}}
    return dict(sorted(out.items()))


@dataclass(frozen=True)
class PhaseOut:
    """A phase's result: the batch it wrote and the step's metrics so far."""

    step: int
    """RL step this batch belongs to."""
    batch: str
    """Object name (sha256) of the batch parquet in the run store."""
    metrics: Metrics = field(default_factory=dict)
    """Metrics of this and the earlier phases of the step."""


@dataclass(frozen=True)
class StepState:
    """The training state after ``step`` updates (it lives in the workers; rebuilt from the
    store when they do not hold it)."""

    step: int
    """Number of updates applied."""
    metrics: Metrics = field(default_factory=dict)
    """Metrics of the step that produced this state."""


def rollout(spec: RunSpec, state: StepState) -> PhaseOut:
    """Sample ``rollout.n`` responses per prompt of the step's batch from the state after
    ``state.step`` updates (with reference log-probs and critic values when the algorithm needs
    them); the batch is validated and stored."""
    ref, metrics = runtime.call_worker(spec, "rollout", state.step)
    return PhaseOut(step=state.step, batch=ref, metrics=merged({}, metrics))


def reward(spec: RunSpec, sampled: PhaseOut) -> PhaseOut:
    """Score the sampled batch (``reward`` scorers; ``reward_model`` on the workers)."""
    ref, metrics = runtime.reward_phase(spec, sampled.step, sampled.batch)
    return PhaseOut(step=sampled.step, batch=ref, metrics=merged(sampled.metrics, metrics))


def advantage(spec: RunSpec, scored: PhaseOut) -> PhaseOut:
    """Token rewards (KL penalty when configured) and the advantage estimator."""
    ref, metrics = runtime.advantage_phase(spec, scored.step, scored.batch)
    return PhaseOut(step=scored.step, batch=ref, metrics=merged(scored.metrics, metrics))


def checkpoint_due(spec: RunSpec, step: int) -> bool:
    """Whether a checkpoint phase follows the update that makes the state after ``step``
    updates: on the step schedule (every ``checkpoint.checkpoint_interval`` steps, the last
    step) and, with a time-based ``checkpoint.checkpoint_interval_s``, on every step (the worker
    decides). On the other steps it could only answer "not now", so the workflow leaves it out
    (on a Flyte cluster every node is a pod) and the update task ends the step
    (:func:`end_step`)."""
    return runtime.checkpoint_due(spec.config, step)


def update(spec: RunSpec, advantaged: PhaseOut) -> StepState:
    """Apply the update of step ``advantaged.step`` under the guard; the state after it is
    recorded in the lineage before anyone is told it exists."""
    metrics = runtime.call_worker(spec, "update", advantaged.step, advantaged.batch)
    return StepState(step=advantaged.step + 1, metrics=merged(advantaged.metrics, metrics))


def checkpoint(spec: RunSpec, state: StepState) -> StepState:
    """Save the state on the checkpoint schedule (committed, or its write queued and awaited
    later), then end the step (:func:`end_step`). The workflow calls it only where
    :func:`checkpoint_due`."""
    return end_step(spec, state, runtime.checkpoint_phase(spec, state.step))


def end_step(spec: RunSpec, state: StepState, checkpoint_metrics: dict | None = None
             ) -> StepState:
    """Record the finished step's metrics (store table, trackers; the guard's event counts of
    the step join them). The checkpoint phase ends the steps where one is due; on the others the
    update task calls this after the update's wall-clock detectors ran (so their events count),
    with the ``checkpoint/saved=0`` the checkpoint phase would have added."""
    extra = {"checkpoint/saved": 0.0} if checkpoint_metrics is None else checkpoint_metrics
    done = StepState(step=state.step, metrics=merged(state.metrics, extra))
    runtime.record_step_metrics(spec, done.step, done.metrics)
    return done


def evaluate(spec: RunSpec, state: StepState) -> Metrics:
    """Greedy held-out accuracy of the state after ``state.step`` updates (recorded)."""
    metrics = merged({}, runtime.call_worker(spec, "evaluate", state.step))
    runtime.record_step_metrics(spec, state.step, metrics)
    return metrics


def finalize(spec: RunSpec, state: StepState) -> dict:
    """The final checkpoint committed, every checkpoint verified (damaged ones rebuilt), the
    final policy exported as a Hugging Face folder, the metrics table written; the run's lease
    (and, attached, its workers) released."""
    return runtime.finalize_run(spec, state.step)
