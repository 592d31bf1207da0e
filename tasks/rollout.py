"""Rollout phase (Ray): sample responses; reference log-probs and critic values when needed."""

from flytekit import task

from tasks.common import RAY_CONFIG, RETRIES, PhaseOut, StepState, cache_for, merge, run_phase
from tasks.images import GPU_IMAGE
from verl_core.engine import runtime
from verl_core.engine.runtime import RunSpec


@task(task_config=RAY_CONFIG, cache=cache_for("rollout"), retries=RETRIES,
      container_image=GPU_IMAGE)
def rollout(spec: RunSpec, state: StepState) -> PhaseOut:
    step = state.step
    ref, metrics = run_phase(spec, "rollout", step,
                             lambda: runtime.call_worker(spec, "rollout", step))
    return PhaseOut(step=step, batch=ref, metrics_json=merge("{}", metrics))
