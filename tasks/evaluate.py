"""Evaluation (Ray): greedy accuracy on the held-out split for the state after `step` updates; its
Deck shows the run so far (plots over steps, held-out samples, guard events)."""

from dataclasses import dataclass

from flytekit import task

from tasks import decks
from tasks.common import RAY_CONFIG, RETRIES, cache_for, run_phase, store_call
from tasks.images import GPU_IMAGE
from verl_core import phases, report
from verl_core import runlog
from verl_core.types import RunSpec, StepState


@dataclass(frozen=True)
class EvalResult:
    step: int
    """State evaluated (updates applied)."""
    accuracy: float
    """Greedy held-out accuracy (mean score)."""
    response_length: float
    """Mean greedy response length in tokens."""


@task(task_config=RAY_CONFIG, cache=cache_for("evaluate"), retries=RETRIES, enable_deck=True,
      deck_fields=decks.REPORT_DECK_FIELDS, container_image=GPU_IMAGE)
def evaluate(spec: RunSpec, state: StepState) -> EvalResult:
    return _evaluate(spec, state)


@task(cache=cache_for("evaluate"), retries=RETRIES, enable_deck=True,
      deck_fields=decks.REPORT_DECK_FIELDS)
def evaluate_attached(spec: RunSpec, state: StepState) -> EvalResult:
    """``evaluate`` as a plain task on the attached cluster (cluster.mode=attached)."""
    return _evaluate(spec, state)


def _evaluate(spec: RunSpec, state: StepState, attach=decks.attach) -> EvalResult:
    m = run_phase(spec, "evaluate", state.step, phases.evaluate, spec, state)
    print(f"[verl] eval after {state.step} steps: accuracy={m['val/accuracy']:.3f}", flush=True)
    samples = store_call("held-out samples", lambda: runlog.eval_samples(spec, state.step))
    if samples:  # the first held-out row, as verl's reward manager prints it (and the Deck shows)
        print(report.sample_lines(samples[0]), flush=True)
    attach("RL run", report.for_run(spec, title=f"Evaluation after {state.step} steps",
                                          sample_steps=[state.step]))
    return EvalResult(step=state.step, accuracy=m["val/accuracy"],
                      response_length=m["val/response_length"])
