"""The guard's event log: every anomaly and every action, in the run store.

One JSON doc per (step, phase, detector, signal), named so that a retried or replayed phase
rewrites its own event instead of adding a second one::

    events/<short trajectory hash>/<step:09d>-<phase>-<detector>-<signal>.json

    {"step", "phase", "detector", "signal", "value", "threshold", "action", "outcome", "message",
     "time"}

``action`` is what the policy decided (after escalation: ``warn``, ``skip_batch``,
``retry_phase``, ``rollback``, ``halt``; ``restart_engine`` for a rollout engine rebuilt after
it died or hung, :func:`engine_restart_event`), ``outcome`` what happened (``logged``, ``skipped``,
``rolled back to step j``, ``retrying``, ``halted``, ``refused``). Events are small docs, not
gc roots (they name no object). They also reach the per-step metrics table (``guard/*``
columns) and the console line of the step (see ``tasks.common.progress``).
"""

from __future__ import annotations

import math
import re
import time

from verl_core.layout import event_folder
from verl_core.store import RunStore

_SAFE = re.compile(r"[^A-Za-z0-9_.\-]")


def event_name(config_hash: str, step: int, phase: str, detector: str, signal: str = "") -> str:
    parts = [f"{step:09d}", phase, detector] + ([signal] if signal else [])
    return f"{event_folder(config_hash)}/" + "-".join(_SAFE.sub("_", p) for p in parts)[:180]


def _num(v):
    """JSON has no NaN: a non-finite value is kept as its string ("nan", "inf")."""
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v


def make_event(*, step: int, phase: str, detector: str, action: str, outcome: str,
               signal: str = "", value=None, threshold=None, message: str = "") -> dict:
    return {"step": int(step), "phase": phase, "detector": detector, "signal": signal,
            "value": _num(value), "threshold": _num(threshold), "action": action,
            "outcome": outcome, "message": message, "time": time.time()}


def engine_restart_event(*, step: int, phase: str, restarts: float, timeouts: float,
                         max_restarts: int) -> dict:
    """The event of a phase whose rollout engine died or hung and was rebuilt ``restarts`` times
    (``timeouts`` of them past ``rollout.engine_timeout_s``), each call repeated with the same
    seeds (docs/vllm.md#engine-health); the bound is the rebuilds allowed per call."""
    return make_event(step=step, phase=phase, detector="rollout_engine", signal="restarts",
                      value=float(restarts), threshold=float(max_restarts),
                      action="restart_engine", outcome="rebuilt, call repeated",
                      message=f"the rollout engine died or hung and was rebuilt {restarts:g} "
                              f"time(s) ({timeouts:g} past rollout.engine_timeout_s); its calls "
                              "were repeated with the same seeds")


def record_event(store: RunStore, config_hash: str, event: dict) -> None:
    """Write ``event`` (see :func:`make_event`); a rewrite of the same (step, phase, detector,
    signal) replaces the earlier one."""
    store.put_json(event_name(config_hash, event["step"], event["phase"], event["detector"],
                              event.get("signal", "")), event)


def read_events(store: RunStore, config_hash: str, step: int | None = None) -> list[dict]:
    """Every event of the trajectory (or of RL step ``step`` only), oldest step first."""
    out = []
    prefix = "" if step is None else f"{step:09d}-"
    for name in store.list_json(event_folder(config_hash)):
        if not name.rsplit("/", 1)[-1].startswith(prefix):
            continue
        doc = store.get_json(name, default=None)
        if doc is not None:
            out.append(doc)
    return sorted(out, key=lambda e: (e["step"], e["time"]))


def event_metrics(events: list[dict]) -> dict[str, float]:
    """The per-step metric columns for a step's events: counts of anomalies and of each action."""
    m: dict[str, float] = {}
    if not events:
        return m
    m["guard/anomalies"] = float(len(events))
    for e in events:
        key = f"guard/{e['action']}"
        m[key] = m.get(key, 0.0) + 1.0
    return m


def event_line(events: list[dict]) -> str:
    """The console text for a step's events, e.g. ``guard: grad_explosion=41.2>9.8 -> skip_batch``."""
    parts = []
    for e in events:
        v, t = e.get("value"), e.get("threshold")
        val = f"{v:.4g}" if isinstance(v, (int, float)) else str(v)
        thr = f"{t:.4g}" if isinstance(t, (int, float)) else str(t)
        parts.append(f"{e['detector']}={val} (bound {thr}) -> {e['action']}")
    return "guard: " + "; ".join(parts)
