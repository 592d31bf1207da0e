"""Finalize (Ray): wait for background checkpoints, export the final model, write the metrics
table, return the summary; its Deck is the run's report (plots, held-out samples, guard events)."""

from dataclasses import dataclass
from typing import Optional

from flytekit import task

from tasks import decks
from tasks.common import RAY_CONFIG, RETRIES, cache_for, run_phase, store_call
from tasks.evaluate import EvalResult
from tasks.images import GPU_IMAGE
from verl_core import phases, report, tracking
from verl_core.types import RunSpec, StepState


@dataclass(frozen=True)
class Summary:
    algorithm: str
    """Advantage estimator of the run."""
    steps: int
    """RL steps completed."""
    start_accuracy: Optional[float]
    """Held-out greedy accuracy before RL (None with val_before_train=False: not measured)."""
    end_accuracy: float
    """Held-out greedy accuracy after RL."""
    first_reward: float
    """Mean training reward of the first step of this run."""
    last_reward: float
    """Mean training reward of the last step."""
    final_model: str
    """Hugging Face folder of the final policy (in the run store)."""
    metrics_table: str
    """Per-step metrics (parquet) in the run store."""
    store: str
    """The run store."""


@task(task_config=RAY_CONFIG, cache=cache_for("finalize"), retries=RETRIES, enable_deck=True,
      deck_fields=decks.REPORT_DECK_FIELDS, container_image=GPU_IMAGE)
def finalize(spec: RunSpec, last: StepState, start: Optional[EvalResult],
             end: EvalResult) -> Summary:
    return _finalize(spec, last, start, end)


@task(cache=cache_for("finalize"), retries=RETRIES, enable_deck=True,
      deck_fields=decks.REPORT_DECK_FIELDS)
def finalize_attached(spec: RunSpec, last: StepState, start: Optional[EvalResult],
                      end: EvalResult) -> Summary:
    """``finalize`` as a plain task on the attached cluster (cluster.mode=attached); it removes
    the run's detached workers from the cluster."""
    return _finalize(spec, last, start, end)


def _finalize(spec: RunSpec, last: StepState, start: Optional[EvalResult],
              end: EvalResult, attach=decks.attach) -> Summary:
    out = run_phase(spec, "finalize", last.step, phases.finalize, spec, last)
    s = Summary(algorithm=spec.config.algorithm.adv_estimator, steps=last.step,
                start_accuracy=None if start is None else start.accuracy, end_accuracy=end.accuracy,
                first_reward=out["first_reward"], last_reward=out["last_reward"],
                final_model=out["final_model"], metrics_table=out["metrics_table"],
                store=spec.store)
    accuracy = (f"{s.end_accuracy:.3f} (no evaluation before training)" if start is None else
                f"{s.start_accuracy:.3f} -> {s.end_accuracy:.3f}")  # as the plain loop says it
    evaluated = {end.step} if start is None else {start.step, end.step}
    print(f"[verl] done: accuracy {accuracy}, reward {s.first_reward:.3f} -> "
          f"{s.last_reward:.3f}; final model: {s.final_model}; metrics: {s.metrics_table}"
          f"{tracking.where(spec.config.tracking)}; run store: {s.store}", flush=True)
    attach("RL run", store_call("the run report", lambda: report.for_run(
        spec, title=f"{s.algorithm}: {s.steps} steps",
        sample_steps=sorted(evaluated))))
    return s
