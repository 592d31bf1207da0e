"""Update phase (Ray): PPO epochs over the batch; records the batch as the new state's lineage.
Where no checkpoint is due after it, it ends the step (records the step's metrics)."""

from functools import partial

from flytekit import task

from tasks.common import RAY_CONFIG, RETRIES, cache_for, progress, run_phase
from tasks.images import GPU_IMAGE
from verl_core import phases
from verl_core.types import PhaseOut, RunSpec, StepState


@task(task_config=RAY_CONFIG, cache=cache_for("update"), retries=RETRIES,
      container_image=GPU_IMAGE)
def update(spec: RunSpec, advantaged: PhaseOut) -> StepState:
    return _update(spec, advantaged)


@task(cache=cache_for("update"), retries=RETRIES)
def update_attached(spec: RunSpec, advantaged: PhaseOut) -> StepState:
    """``update`` as a plain task on the attached cluster (cluster.mode=attached)."""
    return _update(spec, advantaged)


def _update(spec: RunSpec, advantaged: PhaseOut) -> StepState:
    """The update task's body (both modes, both front doors): the phase, the step's line."""
    state = run_phase(spec, "update", advantaged.step, phases.update, spec, advantaged,
                      then=partial(phases.end_step_unless_checkpoint, spec))
    progress(spec, state.step, state.metrics)
    return state
