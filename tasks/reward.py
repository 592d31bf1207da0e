"""Reward phase: decode and score the responses (rule or custom scorer, with timeouts; with
``reward_model.enable``, the reward model on the run's workers)."""

from flytekit import task

from tasks.common import RETRIES, PhaseOut, cache_for, merge, run_phase
from verl_core.engine import runtime
from verl_core.engine.runtime import RunSpec


@task(cache=cache_for("reward"), retries=RETRIES)
def reward(spec: RunSpec, rollout: PhaseOut) -> PhaseOut:
    ref, metrics = run_phase(spec, "reward", rollout.step,
                             lambda: runtime.reward_phase(spec, rollout.step, rollout.batch))
    return PhaseOut(step=rollout.step, batch=ref, metrics_json=merge(rollout.metrics_json, metrics))
