"""What a run records about itself while it runs, and reads back: the phase execution log, the
per-step metrics table and the trackers it feeds (TensorBoard, MLflow), the guard's events and
the wall-clock detectors of finished phases, the held-out samples of the evaluations.

Everything goes to the run store; the only state here is this process's open trackers
(:data:`TRACKERS`) and its recent phase timings (:data:`TIMINGS`), each with a ``reset()``.
"""

from __future__ import annotations

import logging
import os
import socket
import time

from verl_core.guard.events import read_events
from verl_core.layout import PHASE_LOG, eval_samples_doc, metrics_log, short_hash
from verl_core.tracking import Trackers, default_run_name, flat_params
from verl_core.types import STORES, RunSpec

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------- phase log
def log_phase(spec: RunSpec, phase: str, step: int, metrics: dict | None = None,
              started: float | None = None) -> None:
    """Append one record to the run store's phase execution log (only executed phases write:
    a cache hit never runs the task body). ``time`` is when the phase body finished."""
    rec = {"phase": phase, "step": step, "time": time.time(), "started": started, "pid": os.getpid(),
           "host": socket.gethostname(), "config_hash": short_hash(spec.trajectory_hash)}
    if metrics:
        rec["metrics"] = {k: float(v) for k, v in metrics.items()}
    spec.open_store().append_log(PHASE_LOG, rec)


def read_phase_log(store_uri: str) -> list[dict]:
    return STORES.open(store_uri).read_log(PHASE_LOG)


# ---------------------------------------------------------------------- metrics + trackers
class OpenTrackers:
    """This process's open trackers, one per run (:attr:`RunSpec.key`): opened on first use,
    kept open. One MLflow run per physical store and trajectory: every phase process finds it
    again by that key."""

    def __init__(self) -> None:
        self._open: dict[tuple, Trackers] = {}

    def of(self, spec: RunSpec) -> Trackers:
        if spec.key not in self._open:
            cfg = spec.config
            self._open[spec.key] = Trackers(
                cfg.tracking, run_name=default_run_name(spec.store),
                config_hash=spec.trajectory_hash,
                run_key=f"{short_hash(spec.trajectory_hash)}-{spec.incarnation[:16]}",
                params=flat_params(cfg.to_dict()))
        return self._open[spec.key]

    def reset(self) -> None:
        """Close every open tracker (a new process would open them again)."""
        while self._open:
            self._open.popitem()[1].close()


TRACKERS = OpenTrackers()


def record_step_metrics(spec: RunSpec, step: int, metrics: dict) -> None:
    """Append the finished step's metrics to the run store (the per-step table's source), and
    the same scalars to the trackers switched on in ``tracking`` (TensorBoard, MLflow). The
    guard's event counts of the step join them (``guard/anomalies``, ``guard/<action>``)."""
    from verl_core.guard.events import event_metrics

    guard = event_metrics(step_events(spec, step - 1)) if step > 0 else {}
    record = {"step": step, "time": time.time(),
              **{k: float(v) for k, v in {**metrics, **guard}.items()}}
    spec.open_store().append_log(metrics_log(spec.trajectory_hash), record)
    trackers = TRACKERS.of(spec)
    if trackers.enabled:
        trackers.log(step, record, walltime=record["time"])


def metrics_table(spec: RunSpec):
    """Per-step metrics as a DataFrame (the last record of a step wins: a phase re-run after a
    crash appends again)."""
    import pandas as pd

    rows = spec.open_store().read_log(metrics_log(spec.trajectory_hash))
    if not rows:
        return pd.DataFrame({"step": []})
    df = pd.DataFrame(rows).sort_values(["step", "time"])
    # one row per step: the newest non-null value of each column (evaluation writes its own
    # record for a step; a phase re-run after a crash appends again)
    return df.groupby("step", as_index=False).last()


def eval_samples(spec: RunSpec, step: int) -> list[dict]:
    """The held-out samples the evaluation of the state after ``step`` updates stored, each with
    its ``step`` ([] when that evaluation stored none)."""
    doc = spec.open_store().get_json(eval_samples_doc(spec.trajectory_hash, step), default=None)
    return [{"step": step, **s} for s in doc["samples"]] if doc else []


# ---------------------------------------------------------------------- guard events + timing
def guard_events(spec: RunSpec) -> list[dict]:
    """Every guard event of this trajectory, oldest step first (one step: :func:`step_events`)."""
    return read_events(spec.open_store(), spec.trajectory_hash)


def step_events(spec: RunSpec, step: int) -> list[dict]:
    """The guard events of RL step ``step`` (0-based), oldest first."""
    return read_events(spec.open_store(), spec.trajectory_hash, step)


class PhaseTimings:
    """This process's wall-clock history of each phase, per store and trajectory (what the
    wall-clock detectors compare a finished phase against). A fresh process starts empty, so
    these detectors warm up again after a restart."""

    def __init__(self) -> None:
        self._history: dict[tuple, list[dict]] = {}

    def of(self, spec: RunSpec, phase: str) -> list[dict]:
        return self._history.setdefault((spec.store, spec.trajectory_hash, phase), [])

    def reset(self) -> None:
        self._history.clear()


TIMINGS = PhaseTimings()


def watch_phase(spec: RunSpec, phase: str, step: int, seconds: float, metrics: dict) -> None:
    """The wall-clock detectors (latency spike, throughput drop, accelerator utilisation drop)
    on a finished phase, against this process's recent history of the same phase
    (:data:`TIMINGS`). Their events go to the store; ``retry_phase`` and ``halt`` raise
    (``warn`` only logs)."""
    cfg = spec.config.guard
    from verl_core.guard import detectors, policy

    if not cfg.enabled or phase not in detectors.PHASES:  # the four phases of a step
        return
    from verl_core.guard.events import make_event, record_event
    from verl_core.guard.checks import TIMING

    current = {f"timing/{phase}_s": float(seconds)}
    for k in ("rollout/tokens_per_s", "rollout/time_s", "gpu/utilization"):
        if k in metrics:
            current[k] = float(metrics[k])
    if "gpu/utilization" not in current:
        util = detectors.gpu_utilization()
        if util is not None:
            current["gpu/utilization"] = util
    history = TIMINGS.of(spec, phase)
    found = [a for a in detectors.detect(phase, step, current, history, cfg)
             if a.detector in TIMING]
    history.append({"step": step, **current})
    del history[:-256]
    decision = policy.decide(found, {}, cfg)
    if not decision.fired:
        return
    outcome = {"warn": "logged", "retry_phase": "retrying", "halt": "halted"}[decision.action]
    st = spec.open_store()
    for a in decision.anomalies:
        log.warning("guard: step %d %s: %s -> %s", step, a.detector, a.message, decision.action)
        record_event(st, spec.trajectory_hash, make_event(
            step=step, phase=phase, detector=a.detector, action=decision.action, outcome=outcome,
            signal=a.signal, value=a.value, threshold=a.threshold, message=a.message))
    if decision.action == "halt":
        raise policy.GuardHaltError(policy.halt_report(decision, step, phase))
    if decision.action == "retry_phase":
        history.pop()  # the retry's time replaces this one
        raise policy.GuardRetryError(f"guard: retrying {phase} of step {step}: "
                                     + "; ".join(a.message for a in decision.anomalies))
