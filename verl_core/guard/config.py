"""The ``guard`` section of :class:`~verl_core.config.RunConfig` (docs/guard.md): the policy of
each anomaly detector, their thresholds, escalation, deadlines and the run lease, beside the
detectors (``detectors.py``), policies (``policy.py``) and checks (``checks.py``) that read it.
Composed into the run and hashed in ``verl_core/config.py``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from verl_core.config_fields import (_check_types, _fail, _non_negative, _one_of, _positive,
                                     in_trajectory, not_in_trajectory)


GUARD_POLICIES = ("warn", "skip_batch", "retry_phase", "rollback", "halt")
"""What a detector may do when it fires (docs/guard.md)."""

TIMING_DETECTORS = ("latency_spike", "throughput_drop", "gpu_util_drop")
"""Detectors on wall-clock signals: not reproducible, so they may only ``warn``, ``retry_phase``
or ``halt`` (a skip or rollback decided by a clock would make a re-run diverge)."""


@dataclass(frozen=True)
class GuardConfig:
    """The training guard: anomaly detectors over a window of recent steps and what each one does
    when it fires. Policies: ``warn`` (log the event), ``skip_batch`` (the update is not
    applied), ``retry_phase`` (the phase is retried, bounded, with backoff), ``rollback`` (to the
    newest verified checkpoint before the anomaly), ``halt`` (stop with a report). Repeated skips
    escalate to a rollback, repeated rollbacks to a halt."""

    enabled: bool = in_trajectory(True)
    """Run the detectors (off: only non-finite gradients are refused, as the optimizer must)."""
    nonfinite_policy: str = in_trajectory("skip_batch")
    """NaN/Inf in rewards, advantages, log-probs, the loss or the gradients."""
    grad_explosion_policy: str = in_trajectory("skip_batch")
    """Gradient norm far above its recent median."""
    loss_spike_policy: str = in_trajectory("warn")
    """Policy loss far from its recent median."""
    kl_spike_policy: str = in_trajectory("warn")
    """KL to the reference (or rollout) policy far above its recent median."""
    reward_collapse_policy: str = in_trajectory("rollback")
    """Mean reward fallen far below its recent median."""
    entropy_collapse_policy: str = in_trajectory("warn")
    """Policy entropy fallen far below its recent median."""
    length_anomaly_policy: str = in_trajectory("warn")
    """Mean response length collapsed or run away from its recent median."""
    # wall-clock detectors (TIMING_DETECTORS) never change the trajectory
    latency_spike_policy: str = not_in_trajectory("warn")
    """A phase took far longer than its recent median (wall clock)."""
    throughput_drop_policy: str = not_in_trajectory("warn")
    """Rollout tokens/s fell far below its recent median (wall clock)."""
    gpu_util_drop_policy: str = not_in_trajectory("warn")
    """Accelerator utilisation (NVML) fell far below its recent median; unavailable on CPU."""
    no_signal_policy: str = not_in_trajectory("warn")
    """Every group's rewards were equal (``rollout/zero_variance_frac`` = 1: zero advantage on
    every row) for ``no_signal_steps`` steps in a row: nothing is being learnt. ``warn`` (the
    message names the likely causes) or ``halt``; a skip or rollback would change nothing."""
    no_signal_steps: int = not_in_trajectory(5)
    """Steps in a row without signal before ``no_signal`` fires (again every this many steps
    while it lasts)."""
    # Detector thresholds (verl_core/guard/detectors.py; docs/guard.md). A windowed detector
    # fires when the robust z-score (x - median) / (1.4826 MAD) passes its ``_z`` AND the change
    # passes its floor, so a flat series (MAD 0) never fires on noise.
    window: int = in_trajectory(32)
    """Detectors compare a signal with the median and MAD of its last this many finite values."""
    warmup_steps: int = in_trajectory(10)
    """A windowed detector fires only once its signal has this many finite values in history."""
    grad_explosion_z: float = in_trajectory(6.0)
    """Gradient norm: robust z above the median past which it counts as exploding."""
    grad_explosion_min_ratio: float = in_trajectory(10.0)
    """Gradient norm: ... and at least this many times its median."""
    loss_spike_z: float = in_trajectory(6.0)
    """Policy/value loss: robust z (either way for the policy loss, up for the value loss)."""
    loss_spike_min_change: float = in_trajectory(0.5)
    """Policy/value loss: ... and at least this far from its median (loss units)."""
    kl_spike_z: float = in_trajectory(6.0)
    """KL loss / reward KL: robust z above the median."""
    kl_spike_min_change: float = in_trajectory(0.25)
    """KL loss / reward KL: ... and at least this many nats above its median. 0.25 is about
    log(1 + clip_ratio_high) = log 1.28: the most one clipped PPO step moves a token's log-prob,
    so a healthy step raises the KL by less; a jump past it is more than one step's worth."""
    kl_spike_min_ratio: float = in_trajectory(2.0)
    """KL loss / reward KL: ... and above this many times its median. The batch KL is a mean of
    a positive, right-skewed per-token estimate, so its upper spread is wider than the MAD says;
    a spike is a jump in the KL's own scale (like the gradient norm's ratio)."""
    reward_collapse_z: float = in_trajectory(5.0)
    """Mean reward: robust z below the median."""
    reward_collapse_min_drop: float = in_trajectory(0.25)
    """Mean reward: ... and at least this far below its median (reward units; rule scorers give
    0..1)."""
    entropy_collapse_z: float = in_trajectory(6.0)
    """Policy entropy: robust z below the median."""
    entropy_collapse_min_drop: float = in_trajectory(0.5)
    """Policy entropy: ... and below (1 - this) times its median."""
    length_anomaly_z: float = in_trajectory(6.0)
    """Mean response length: robust z either way."""
    length_anomaly_min_ratio: float = in_trajectory(2.0)
    """Mean response length: ... and below median / this (collapse) or above median x this."""
    latency_spike_z: float = not_in_trajectory(6.0)
    """Phase wall time: robust z above the median."""
    latency_spike_min_ratio: float = not_in_trajectory(3.0)
    """Phase wall time: ... and at least this many times its median."""
    latency_spike_min_s: float = not_in_trajectory(60.0)
    """Phase wall time: ... and at least this many seconds above its median."""
    throughput_drop_z: float = not_in_trajectory(6.0)
    """Rollout tokens/s: robust z below the median."""
    throughput_drop_min_drop: float = not_in_trajectory(0.5)
    """Rollout tokens/s: ... and below (1 - this) times its median."""
    throughput_drop_min_lost_s: float = not_in_trajectory(60.0)
    """Rollout tokens/s: ... and the drop cost at least this many seconds of the rollout."""
    gpu_util_drop_z: float = not_in_trajectory(6.0)
    """Accelerator utilisation: robust z below the median."""
    gpu_util_drop_min_drop: float = not_in_trajectory(30.0)
    """Accelerator utilisation: ... and at least this many percentage points below its median."""
    max_consecutive_skips: int = in_trajectory(3)
    """A skip this many steps in a row escalates to a rollback."""
    max_rollbacks: int = in_trajectory(2)
    """A rollback past this many in one run escalates to a halt."""
    rollback_lr_scale: float = in_trajectory(1.0)
    """Multiply the learning rate by this at each rollback (e.g. 0.5)."""
    phase_timeout_s: float = not_in_trajectory(3600.0)
    """Deadline of every phase call on a worker; past it the call fails as transient (a hang),
    the worker is replaced and the phase is retried."""
    restore_timeout_s: float = not_in_trajectory(3600.0)
    """Added to ``phase_timeout_s`` for a new worker's first phase, which also restores the state
    it starts from (start-up, a checkpoint read, the updates since it replayed): a resume whose
    restore outlasts a phase's deadline is not taken for a hang, and retried from scratch."""
    lease_ttl_s: float = not_in_trajectory(60.0)
    """Single-writer run lease: a dead run's lease frees after this many seconds without renewal
    (renewed every third of it); 0 = take no lease (docs/checkpoints.md)."""

    def __post_init__(self):
        _check_types("guard", self)
        for f in dataclasses.fields(self):
            if f.name.endswith("_policy"):
                value = getattr(self, f.name)
                _one_of("guard", f.name, value, GUARD_POLICIES)
                if f.name[:-len("_policy")] in TIMING_DETECTORS and value in ("skip_batch",
                                                                               "rollback"):
                    _fail("guard", f.name, value, "a wall-clock detector may only warn, "
                          "retry_phase or halt (a skip or rollback decided by a clock would not "
                          "replay identically)")
        if self.no_signal_policy not in ("warn", "halt"):
            _fail("guard", "no_signal_policy", self.no_signal_policy, "must be warn or halt (a "
                  "step without signal changes no weight: skipping or rolling it back would "
                  "change nothing)")
        _positive("guard", self, "max_consecutive_skips", "rollback_lr_scale", "phase_timeout_s",
                  "restore_timeout_s", "no_signal_steps")
        _non_negative("guard", self, "max_rollbacks", "lease_ttl_s")
        if self.rollback_lr_scale > 1:
            _fail("guard", "rollback_lr_scale", self.rollback_lr_scale, "must be in (0, 1]")
        self._check_detector_thresholds()

    def _check_detector_thresholds(self) -> None:
        names = [f.name for f in dataclasses.fields(self)]
        _positive("guard", self, "window", "loss_spike_min_change", "kl_spike_min_change",
                  "reward_collapse_min_drop", *(n for n in names if n.endswith("_z")))
        _non_negative("guard", self, "latency_spike_min_s", "throughput_drop_min_lost_s")
        if not 3 <= self.warmup_steps <= self.window:
            _fail("guard", "warmup_steps", self.warmup_steps,
                  f"must be in [3, guard.window={self.window}] (a median and MAD need a few "
                  "values, and the window holds at most `window`)")
        for n in ("grad_explosion_min_ratio", "kl_spike_min_ratio", "length_anomaly_min_ratio",
                  "latency_spike_min_ratio"):
            if getattr(self, n) <= 1:
                _fail("guard", n, getattr(self, n), "must be > 1 (a ratio to the median)")
        for n in ("entropy_collapse_min_drop", "throughput_drop_min_drop"):
            if not 0 < getattr(self, n) < 1:
                _fail("guard", n, getattr(self, n), "must be in (0, 1) (a fraction of the median)")
        if not 0 < self.gpu_util_drop_min_drop <= 100:
            _fail("guard", "gpu_util_drop_min_drop", self.gpu_util_drop_min_drop,
                  "must be in (0, 100] (percentage points)")
