"""The guard in the plain loop (``verl_core.train``), on the real tiny model: the same decision as
the workflow's update (``guard.checks.guarded_update``), carried out without a run store. The
fault is real: NaN gradients injected into the backward pass of update 1 (VERL_FAULTS
``nan_grad``), which the optimizer refuses and the update's metrics report."""
import json
import math

import pytest

from tests.presets import tiny_run
from verl_core.guard.policy import GuardHaltError
from verl_core.train import train


@pytest.fixture
def nan_grad_at_step_1(tmp_path, monkeypatch):
    monkeypatch.setenv("VERL_FAULTS", json.dumps([{"kind": "nan_grad", "phase": "update",
                                                   "step": 1}]))
    monkeypatch.setenv("VERL_FAULTS_DIR", str(tmp_path / "faults"))


def test_a_skip_after_the_update_only_warns(tmp_path, nan_grad_at_step_1):
    # nonfinite_policy=skip_batch: the workflow would rebuild the state before update 1; the
    # plain loop cannot, so it warns (the optimizer refused the NaN gradients already)
    logs = []
    summary = train(tiny_run(total_steps=3), str(tmp_path / "w"), log=logs.append)
    history = summary["history"]
    fired = [h.get("guard/anomalies", 0.0) for h in history]
    assert fired[0] == fired[2] == 0.0 and fired[1] >= 1.0, fired
    assert history[1]["guard/warn"] == fired[1] and "guard/skip_batch" not in history[1]
    assert history[1]["update/skipped_nonfinite_steps"] >= 1
    warned = [line for line in logs if line.startswith("guard: step 1 ")]
    assert len(warned) == fired[1] and any(" nonfinite: " in line for line in warned), logs
    assert all(line.endswith("-> warn (the plain loop cannot undo an applied update)")
               for line in warned), warned
    assert math.isfinite(history[2]["actor/grad_norm"])  # the weights stayed finite


def test_a_halt_policy_stops_the_plain_loop_with_the_report(tmp_path, nan_grad_at_step_1):
    cfg = tiny_run(total_steps=3, **{"guard.nonfinite_policy": "halt"})
    with pytest.raises(GuardHaltError, match=r"(?s)halted by the guard at update of step 1.*"
                                             r"nonfinite: actor/grad_norm"):
        train(cfg, str(tmp_path / "w"), log=lambda *_: None)
