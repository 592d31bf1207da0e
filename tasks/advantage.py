"""Advantage phase: token rewards (KL penalty if configured) and the advantage estimator."""

from flytekit import task

from tasks.common import RETRIES, cache_for, run_phase
from verl_core import phases
from verl_core.types import RunSpec
from verl_core.phases import PhaseOut


@task(cache=cache_for("advantage"), retries=RETRIES)
def advantage(spec: RunSpec, scored: PhaseOut) -> PhaseOut:
    return run_phase(spec, "advantage", scored.step, phases.advantage, spec, scored)
