"""The policy table: severity order, escalation (skips -> rollback -> halt), rollback targets."""
from dataclasses import dataclass

import pytest

from verl_core.config import ConfigError, GuardConfig, RunConfig, with_overrides
from verl_core.guard.policy import (GUARD_DEFAULTS, after_rollback, after_skip, decide,
                                    halt_report, rollback_target)


@dataclass(frozen=True)
class A:  # the fields of detectors.Anomaly that the policy reads
    detector: str
    signal: str = "x"
    value: float = 1.0
    threshold: float = 0.5
    message: str = "m"

    def to_dict(self):
        return self.__dict__


def test_nothing_fired_is_no_action():
    assert decide([], GUARD_DEFAULTS, GuardConfig()).action == "none"


def test_most_severe_policy_wins():
    cfg = GuardConfig(loss_spike_policy="warn", grad_explosion_policy="skip_batch",
                      kl_spike_policy="halt")
    assert decide([A("loss_spike")], GUARD_DEFAULTS, cfg).action == "warn"
    assert decide([A("loss_spike"), A("grad_explosion")], GUARD_DEFAULTS, cfg).action == "skip_batch"
    assert decide([A("grad_explosion"), A("kl_spike")], GUARD_DEFAULTS, cfg).action == "halt"


def test_repeated_skips_escalate_to_rollback_then_halt():
    cfg = GuardConfig(max_consecutive_skips=3, max_rollbacks=1)
    g = dict(GUARD_DEFAULTS)
    for step in range(2):  # the first two skips stay skips
        d = decide([A("nonfinite")], g, cfg)
        assert d.action == "skip_batch" and not d.escalated
        g = after_skip(g, step)
    d = decide([A("nonfinite")], g, cfg)  # the third in a row
    assert d.action == "rollback" and "3 steps in a row" in d.escalated
    g = after_rollback(g, 2, 0.5)
    assert g["consecutive_skips"] == 0 and g["rollbacks"] == 1 and g["lr_scale"] == 0.5
    assert g["skipped_steps"] == [0, 1] and g["rollback_steps"] == [2]
    d = decide([A("reward_collapse")], g, cfg)  # policy rollback, but one was already done
    assert d.action == "halt" and "max_rollbacks=1" in d.escalated
    report = halt_report(d, 7, "update")
    assert "step 7" in report and "reward_collapse" in report and "resume_from_checkpoint" in report


def test_applied_update_resets_the_skip_run():
    cfg = GuardConfig(max_consecutive_skips=2)
    g = after_skip(dict(GUARD_DEFAULTS), 0)
    assert decide([A("nonfinite")], g, cfg).action == "rollback"
    g = {**g, "consecutive_skips": 0}  # what RLTrainer._remember does after an applied update
    assert decide([A("nonfinite")], g, cfg).action == "skip_batch"


def test_rollback_with_nowhere_to_go_halts():
    d = decide([A("reward_collapse")], GUARD_DEFAULTS, GuardConfig(), can_roll_back=False)
    assert d.action == "halt" and "no earlier state" in d.escalated


@pytest.mark.parametrize("step,interval,base,want", [
    (5, 2, 0, 4), (4, 2, 0, 2), (1, 10, 0, 0), (10, 10, 0, 0), (11, 10, 0, 10), (12, 10, 11, 11),
    (0, 10, 0, None), (3, 5, 3, None)])
def test_rollback_target_is_the_newest_scheduled_checkpoint_strictly_before(step, interval, base,
                                                                            want):
    assert rollback_target(step, checkpoint_interval=interval, base_step=base) == want


def test_config_refuses_clock_driven_skips_and_bad_values():
    with pytest.raises(ConfigError, match="latency_spike_policy"):
        GuardConfig(latency_spike_policy="skip_batch")
    with pytest.raises(ConfigError, match="unknown value"):
        GuardConfig(nonfinite_policy="ignore")
    with pytest.raises(ConfigError, match="rollback_lr_scale"):
        GuardConfig(rollback_lr_scale=2.0)
    with pytest.raises(ConfigError, match="phase_timeout_s"):
        GuardConfig(phase_timeout_s=0)


def test_wall_clock_settings_do_not_change_the_trajectory():
    base = RunConfig()
    same = with_overrides(base, {"guard.phase_timeout_s": 5.0,
                                 "guard.latency_spike_policy": "halt"})
    other = with_overrides(base, {"guard.nonfinite_policy": "halt"})
    assert same.trajectory_hash() == base.trajectory_hash()
    assert other.trajectory_hash() != base.trajectory_hash()
