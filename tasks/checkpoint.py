"""Checkpoint phase (Ray): at the interval, snapshot the state and write a verified checkpoint
(in the background when checkpoint.async_save)."""

import json

from flytekit import task

from tasks.common import RAY_CONFIG, RETRIES, StepState, cache_for, merge, run_phase
from verl_core.engine import runtime
from verl_core.engine.runtime import RunSpec


@task(task_config=RAY_CONFIG, cache=cache_for("checkpoint"), retries=RETRIES)
def checkpoint(spec: RunSpec, state: StepState) -> StepState:
    metrics = run_phase(spec, "checkpoint", state.step,
                        lambda: runtime.call_worker(spec, "checkpoint", state.step))
    merged = merge(state.metrics_json, metrics)
    runtime.record_step_metrics(spec, state.step, json.loads(merged))
    return StepState(step=state.step, metrics_json=merged)
