"""Checkpoint phase (Ray): at the interval, snapshot the state and write a verified checkpoint
(in the background when checkpoint.async_save). Its Deck is a light card: the step's key metrics
and guard events, no plots."""

import json

from flytekit import task

from tasks import decks
from tasks.common import RAY_CONFIG, RETRIES, StepState, cache_for, merge, run_phase
from tasks.images import GPU_IMAGE
from verl_core import report
from verl_core.engine import runtime
from verl_core.engine.runtime import RunSpec


@task(task_config=RAY_CONFIG, cache=cache_for("checkpoint"), retries=RETRIES, enable_deck=True,
      deck_fields=(), container_image=GPU_IMAGE)
def checkpoint(spec: RunSpec, state: StepState) -> StepState:
    metrics = run_phase(spec, "checkpoint", state.step,
                        lambda: runtime.call_worker(spec, "checkpoint", state.step))
    merged = merge(state.metrics_json, metrics)
    runtime.record_step_metrics(spec, state.step, json.loads(merged))
    decks.attach("Step", report.step_card(state.step, json.loads(merged),
                                          events=runtime.step_events(spec, state.step - 1)))
    return StepState(step=state.step, metrics_json=merged)
