"""Rollout phase (Ray): sample responses; reference log-probs and critic values when needed."""

from flytekit import task

from tasks.common import RAY_CONFIG, RETRIES, cache_for, run_phase
from tasks.images import GPU_IMAGE
from verl_core import phases
from verl_core.types import PhaseOut, RunSpec, StepState


@task(task_config=RAY_CONFIG, cache=cache_for("rollout"), retries=RETRIES,
      container_image=GPU_IMAGE)
def rollout(spec: RunSpec, state: StepState) -> PhaseOut:
    return run_phase(spec, "rollout", state.step, phases.rollout, spec, state)


@task(cache=cache_for("rollout"), retries=RETRIES)
def rollout_attached(spec: RunSpec, state: StepState) -> PhaseOut:
    """``rollout`` as a plain task on the attached cluster (cluster.mode=attached)."""
    return run_phase(spec, "rollout", state.step, phases.rollout, spec, state)
