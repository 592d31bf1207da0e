"""Reward phase: decode and score the responses (rule or custom scorer, with timeouts; with
``reward_model.enable``, the reward model on the run's workers)."""

from flytekit import task

from tasks.common import RETRIES, cache_for, run_phase
from verl_core import phases
from verl_core.types import RunSpec
from verl_core.phases import PhaseOut


@task(cache=cache_for("reward"), retries=RETRIES)
def reward(spec: RunSpec, rollout: PhaseOut) -> PhaseOut:
    return run_phase(spec, "reward", rollout.step, phases.reward, spec, rollout)
