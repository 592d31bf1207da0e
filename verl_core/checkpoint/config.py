"""The ``checkpoint`` section of :class:`~verl_core.config.RunConfig`: when and how the durable
state is saved, kept and resumed, beside the checkpoint manager. Composed into the run, checked
against the other sections and hashed in ``verl_core/config.py``. No field is in the trajectory.
"""

from __future__ import annotations

import datetime as _dt
import re
from dataclasses import dataclass

from verl_core.config_fields import (_check_types, _fail, _non_negative, _positive,
                                     not_in_trajectory)

_DURATION = re.compile(r"^(?:(\d+):)?(\d+):(\d{1,2}):(\d{1,2})$")


def parse_must_save_by(text: str, started: float) -> float | None:
    """The deadline ``text`` names, as unix seconds: a duration from ``started`` (``HH:MM:SS`` or
    ``DD:HH:MM:SS``, as NeMo-RL writes it), an ISO 8601 time (with a zone, or UTC), or unix
    seconds. None for ""; ValueError naming the forms for anything else."""
    text = str(text).strip()
    if not text:
        return None
    m = _DURATION.match(text)
    if m:
        days, hours, minutes, seconds = (int(g or 0) for g in m.groups())
        if minutes > 59 or seconds > 59:
            raise ValueError(f"{text!r}: minutes and seconds run 0-59")
        return started + ((days * 24 + hours) * 60 + minutes) * 60 + seconds
    try:
        return float(text)
    except ValueError:
        pass
    try:
        when = _dt.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise ValueError(f"{text!r}: give a duration from the start (HH:MM:SS or DD:HH:MM:SS), "
                         "an ISO 8601 time (2026-12-04T18:00:00Z) or unix seconds") from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=_dt.timezone.utc)
    return when.timestamp()


@dataclass(frozen=True)
class CheckpointConfig:
    """When and how the durable state is saved (the names users of verl-style trainers know)."""

    checkpoint_interval: int = not_in_trajectory(10)
    """Save a verified checkpoint every k steps (the last step is always saved). Between
    checkpoints a crashed run recovers by replaying the stored batches of the finished updates."""
    last_step_only: bool = not_in_trajectory(False)
    """Save the run's last step only (verl's ``trainer.save_freq=-1``, "never save", as close as
    a durable run gets): a crash before it replays the stored batches from the start (or from
    the checkpoint a run resumed from). The run header says so."""
    checkpoint_interval_s: float = not_in_trajectory(0.0)
    """Also save when this many seconds passed since the last save (0: off)."""
    save_optimizer_state: bool = not_in_trajectory(True)
    """Include optimizer + scheduler state (needed for exact resume; off = weights only)."""
    resume_from_checkpoint: str = not_in_trajectory("auto")
    """``auto`` (newest valid checkpoint of this run store, if any), ``none``, a checkpoint
    manifest path/URI (``<store>/checkpoints/<name>.json``), or another run store's folder (its
    newest valid checkpoint). Anything else is a permanent error at prepare."""
    keep_last: int = not_in_trajectory(3)
    """Keep the newest N checkpoints (0: keep all)."""
    keep_every: int = not_in_trajectory(0)
    """Also keep every checkpoint whose step is a multiple of this (0: off)."""
    async_save: bool = not_in_trajectory(True)
    """Snapshot to CPU memory and write in the background while the next phases run."""
    gc_grace_s: float = not_in_trajectory(600.0)
    """Garbage collection (after retention deletes a checkpoint) never deletes an object younger
    than this. Safety margin only: gc never deletes what a kept checkpoint, the assets, the
    lineage or a pending phase output names, whatever its age."""
    keep_best: str = not_in_trajectory("")
    """Keep the checkpoint of the best evaluated step by this held-out metric (``val/accuracy``;
    NeMo-RL's ``metric_name``, OpenRLHF's ``best_metric_key``) through retention and gc, recorded
    in ``best.json``; ``python -m verl_core.checkpoint export <store> best <out>`` exports it.
    Every evaluated step must be a checkpoint step (``eval_every`` a multiple of
    ``checkpoint_interval``). "": off."""
    keep_best_higher: bool = not_in_trajectory(True)
    """Whether a higher ``keep_best`` value is better (NeMo-RL's ``higher_is_better``); a tie
    keeps the earlier step."""
    preempt_grace_s: float = not_in_trajectory(25.0)
    """On SIGTERM (Kubernetes' grace period, a Ray drain, a spot notice) the plain loop lets the
    phase in flight finish for up to this long, then saves the newest state that has no
    checkpoint and exits; a phase still running then is abandoned (every finished phase and
    checkpoint stays). Keep it under the pod's ``terminationGracePeriodSeconds`` (30 s by
    default). 0: exit at once, as on Ctrl-C."""
    must_save_by: str = not_in_trajectory("")
    """A time the run must have saved by (NeMo-RL's ``checkpoint_must_save_by``): a duration from
    the start (``HH:MM:SS``, ``DD:HH:MM:SS``), an ISO 8601 time or unix seconds. The plain loop
    saves and stops once less than a step and a save are left (``checkpoint/deadline.py``); the
    same command continues. A capacity-block expiration in the environment (verl's
    ``MLP_/SAGEMAKER_CURRENT_CAPACITY_BLOCK_EXPIRATION_TIMESTAMP``) counts too."""
    must_save_margin_s: float = not_in_trajectory(0.0)
    """Seconds more kept in hand before ``must_save_by`` (verl's ``trainer.esi_redundant_time``)."""
    local_dir: str = not_in_trajectory("")
    """Local-disk tier (off when empty): commit checkpoints to ``<local_dir>/<store id>`` first
    and replicate them to the run store in the background (docs/checkpoints.md; W = 1 only)."""

    def __post_init__(self):
        _check_types("checkpoint", self)
        if "://" in self.local_dir:
            _fail("checkpoint", "local_dir", self.local_dir,
                  "must be a local folder (a local SSD), not a URL; the run store is the shared tier")
        _positive("checkpoint", self, "checkpoint_interval")
        _non_negative("checkpoint", self, "checkpoint_interval_s", "keep_last", "keep_every",
                      "gc_grace_s", "preempt_grace_s", "must_save_margin_s")
        if self.keep_best and not self.keep_best.startswith("val/"):
            _fail("checkpoint", "keep_best", self.keep_best,
                  "name a held-out metric (val/accuracy, val/reward, ...): the best is judged at "
                  "evaluations")
        try:
            parse_must_save_by(self.must_save_by, 0.0)
        except ValueError as e:
            _fail("checkpoint", "must_save_by", self.must_save_by, str(e).split(": ", 1)[1])
        if not self.resume_from_checkpoint:
            _fail("checkpoint", "resume_from_checkpoint", self.resume_from_checkpoint,
                  "use 'auto', 'none' or a checkpoint path")

    def due(self, step: int, total_steps: int, since_save_s: float | None = None) -> bool:
        """Whether the state after ``step`` of ``total_steps`` updates is saved: every
        ``checkpoint_interval`` steps, at the last step, and with ``checkpoint_interval_s`` when
        ``since_save_s`` seconds since the last save reach it. ``since_save_s=None`` (not known
        yet, as when a workflow is planned): every step may be due, the worker decides."""
        if step == total_steps:
            return True
        if self.last_step_only:
            return False
        if step % self.checkpoint_interval == 0:
            return True
        if not self.checkpoint_interval_s:
            return False
        return since_save_s is None or since_save_s >= self.checkpoint_interval_s


def schedule_line(cfg) -> str:
    """The run header's line when ``cfg`` (a ``RunConfig``) saves its last step only
    (``checkpoint.last_step_only``, verl's ``trainer.save_freq=-1``), else ""."""
    if not cfg.checkpoint.last_step_only:
        return ""
    return (f"[verl] checkpoints: the last step only (checkpoint.last_step_only, verl's "
            f"trainer.save_freq=-1, which saves none: a run here always saves its end, step "
            f"{cfg.total_steps}); a crash before it replays the stored batches from the start")
