"""Checkpoint phase (Ray): at the interval, snapshot the state and write a verified checkpoint
(in the background when checkpoint.async_save). Its Deck is a light card: the step's key metrics
and guard events, no plots."""

from flytekit import task

from tasks import decks
from tasks.common import RAY_CONFIG, RETRIES, cache_for, run_phase, store_call
from tasks.images import GPU_IMAGE
from verl_core import phases, report
from verl_core import runlog
from verl_core.types import RunSpec, StepState


@task(task_config=RAY_CONFIG, cache=cache_for("checkpoint"), retries=RETRIES, enable_deck=True,
      deck_fields=(), container_image=GPU_IMAGE)
def checkpoint(spec: RunSpec, state: StepState) -> StepState:
    return _checkpoint(spec, state)


@task(cache=cache_for("checkpoint"), retries=RETRIES, enable_deck=True, deck_fields=())
def checkpoint_attached(spec: RunSpec, state: StepState) -> StepState:
    """``checkpoint`` as a plain task on the attached cluster (cluster.mode=attached)."""
    return _checkpoint(spec, state)


def _checkpoint(spec: RunSpec, state: StepState, attach=decks.attach) -> StepState:
    done = run_phase(spec, "checkpoint", state.step, phases.checkpoint, spec, state)
    events = store_call(f"guard events of step {done.step}",
                        lambda: runlog.step_events(spec, done.step - 1))
    attach("Step", report.step_card(done.step, done.metrics, events=events), only=True)
    return done
