"""Update phase (Ray): PPO epochs over the batch; records the batch as the new state's lineage."""

import json

from flytekit import task

from tasks.common import RAY_CONFIG, RETRIES, PhaseOut, StepState, cache_for, merge, progress, run_phase
from tasks.images import GPU_IMAGE
from verl_core.engine import runtime
from verl_core.engine.runtime import RunSpec


@task(task_config=RAY_CONFIG, cache=cache_for("update"), retries=RETRIES,
      container_image=GPU_IMAGE)
def update(spec: RunSpec, advantaged: PhaseOut) -> StepState:
    step = advantaged.step
    metrics = run_phase(spec, "update", step,
                        lambda: runtime.call_worker(spec, "update", step, advantaged.batch))
    merged = merge(advantaged.metrics_json, metrics)
    progress(spec, step + 1, json.loads(merged))
    return StepState(step=step + 1, metrics_json=merged)
