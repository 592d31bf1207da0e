"""Recovery policies: what the guard does when detectors fire, and how repeated trouble escalates.

One policy table (``GuardConfig.<detector>_policy``), ordered by severity::

    warn < retry_phase < skip_batch < rollback < halt

A step's anomalies take the most severe policy among them, then escalate:

- ``skip_batch`` when the ``max_consecutive_skips``-th step in a row would be skipped becomes
  ``rollback`` (the trouble is in the weights, not in one batch);
- ``rollback`` past ``max_rollbacks`` rollbacks in the run, or with no earlier state to go back
  to, becomes ``halt``.

The decision is a pure function of the anomalies, the guard state (saved in every checkpoint)
and the config, and the anomalies of the deterministic detectors are pure functions of the
trajectory, so a re-run reproduces every skip and rollback. What a decision did is recorded in
the lineage record of the update, and a rebuild of the state replays the record, never the
decision (see ``RunWorker.update``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Sequence

from verl_core.errors import PermanentError, TransientError
from verl_core.guard.config import GuardConfig

SEVERITY = {"warn": 0, "retry_phase": 1, "skip_batch": 2, "rollback": 3, "halt": 4}

GUARD_DEFAULTS = {"skipped_nonfinite_steps": 0, "last_skipped_step": None,
                  "consecutive_skips": 0, "rollbacks": 0, "lr_scale": 1.0,
                  "skipped_steps": [], "rollback_steps": [], "engine_restarts": 0}
"""The guard state a checkpoint carries (older checkpoints start with these). ``engine_restarts``:
rebuilds of a dead or hung rollout engine in the rollouts so far (docs/vllm.md#engine-health)."""

_KEEP = 64  # skipped/rolled-back step lists are bounded (the event log has them all)


class GuardHaltError(PermanentError):
    """A detector whose policy is ``halt`` fired (or a rollback escalated to a halt). The message
    is the report: detector, step, value, bound and what to do."""


class GuardRetryError(TransientError):
    """A detector whose policy is ``retry_phase`` fired: the phase is retried (bounded, with
    backoff). A deterministic anomaly fires again on every attempt, so after the retries the
    phase fails as transient; ``retry_phase`` suits the wall-clock detectors."""


def policy_of(detector: str, cfg: GuardConfig) -> str:
    return getattr(cfg, f"{detector}_policy")


@dataclass(frozen=True)
class Decision:
    """What the guard does about one phase's anomalies."""

    action: str
    """``none`` (nothing fired) or one of :data:`SEVERITY`."""
    anomalies: tuple = ()
    """The anomalies that fired (``detectors.Anomaly``)."""
    escalated: str = ""
    """Why the action is more severe than the detectors' policies ("" if it is not)."""
    extra: dict = field(default_factory=dict)
    """Details of the action (e.g. the rollback target)."""

    @property
    def fired(self) -> bool:
        return bool(self.anomalies)


def decide(anomalies: Sequence, guard: dict, cfg: GuardConfig, *,
           can_roll_back: bool = True) -> Decision:
    """The action for ``anomalies`` given the guard state ``guard`` (see the module docstring)."""
    if not anomalies:
        return Decision("none")
    action = max((policy_of(a.detector, cfg) for a in anomalies), key=SEVERITY.__getitem__)
    why = ""
    if action == "skip_batch" and guard.get("consecutive_skips", 0) + 1 >= cfg.max_consecutive_skips:
        action = "rollback"
        why = (f"{guard.get('consecutive_skips', 0) + 1} steps in a row would be skipped "
               f"(guard.max_consecutive_skips={cfg.max_consecutive_skips})")
    if action == "rollback":
        if guard.get("rollbacks", 0) >= cfg.max_rollbacks:
            action = "halt"
            why = (why + "; " if why else "") + (
                f"{guard.get('rollbacks', 0)} rollbacks already (guard.max_rollbacks="
                f"{cfg.max_rollbacks})")
        elif not can_roll_back:
            action = "halt"
            why = (why + "; " if why else "") + "no earlier state to roll back to"
    return Decision(action, tuple(anomalies), why)


def after_skip(guard: dict, step: int) -> dict:
    """The guard state after update ``step`` was skipped."""
    g = {**GUARD_DEFAULTS, **guard}
    return {**g, "consecutive_skips": g["consecutive_skips"] + 1,
            "skipped_steps": [*g["skipped_steps"], step][-_KEEP:]}


def after_rollback(guard: dict, step: int, lr_scale: float) -> dict:
    """The guard state after update ``step`` rolled the weights back (``guard`` is the state
    before the rollback: its counters carry on, whatever the restored checkpoint held)."""
    g = {**GUARD_DEFAULTS, **guard}
    return {**g, "consecutive_skips": 0, "rollbacks": g["rollbacks"] + 1,
            "lr_scale": g["lr_scale"] * lr_scale,
            "rollback_steps": [*g["rollback_steps"], step][-_KEEP:]}


def rollback_target(step: int, *, checkpoint_interval: int, base_step: int) -> int | None:
    """The state a rollback at update ``step`` returns to: the newest step of the checkpoint
    schedule strictly before ``step`` (the state that sampled ``step``'s batch is suspect), not
    before the run's first state. None when there is none (``step`` is the run's first).

    Chosen from the schedule, not from what the store happens to hold, so a re-run picks the
    same target; the state is loaded from its verified checkpoint, or rebuilt exactly (an older
    checkpoint + lineage replay) if that checkpoint was lost, corrupted or never committed."""
    if step <= base_step:
        return None
    return max(base_step, (step - 1) // checkpoint_interval * checkpoint_interval)


def halt_report(decision: Decision, step: int, phase: str) -> str:
    lines = [f"training halted by the guard at {phase} of step {step}"
             + (f" (escalated: {decision.escalated})" if decision.escalated else "") + ":"]
    for a in decision.anomalies:
        lines.append(f"  {a.detector}: {a.signal}={a.value!r} past {a.threshold!r}: {a.message}")
    lines.append("The run store keeps every committed checkpoint and the event log "
                 "(events/ in the store; `python -m verl_core.checkpoint events <store>`). To go "
                 "on, fix the cause (data, learning rate) or change the detector's threshold or "
                 "policy (guard.*) and run again; a changed guard setting starts a new "
                 "trajectory, so pass checkpoint.resume_from_checkpoint=<this store> to start it "
                 "from the newest checkpoint.")
    return "\n".join(lines)


def describe(decision: Decision) -> str:
    return json.dumps({"action": decision.action, "escalated": decision.escalated,
                       "anomalies": [a.to_dict() for a in decision.anomalies]}, default=str)
