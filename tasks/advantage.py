"""Advantage phase: token rewards (KL penalty if configured) and the advantage estimator."""

from flytekit import task

from tasks.common import RETRIES, PhaseOut, cache_for, merge, run_phase
from verl_core.engine import runtime
from verl_core.engine.runtime import RunSpec


@task(cache=cache_for("advantage"), retries=RETRIES)
def advantage(spec: RunSpec, scored: PhaseOut) -> PhaseOut:
    ref, metrics = run_phase(spec, "advantage", scored.step,
                             lambda: runtime.advantage_phase(spec, scored.step, scored.batch))
    return PhaseOut(step=scored.step, batch=ref, metrics_json=merge(scored.metrics_json, metrics))
