"""The guard in the plain loop (``verl_core.train``), on the real tiny model: the decisions of the
workflow's update phase (``RunWorker.update``, the same code), carried out on the run store the
workdir is, so a skip rebuilds the state before the update and a rollback returns to the state of
a scheduled checkpoint, as in the workflow. The fault is real: NaN gradients injected into the
backward pass of an update (VERL_FAULTS ``nan_grad``), which the optimizer refuses and the
update's metrics report."""
import json
import math
import re

import pytest

from tests.presets import tiny_run
from verl_core.store.lease import read_lease
from verl_core.guard.policy import GuardHaltError
from verl_core.layout import lineage_doc
from verl_core.store import RunStore
from verl_core.train import train


@pytest.fixture
def nan_grad(tmp_path, monkeypatch):
    def at(step: int) -> None:
        monkeypatch.setenv("VERL_FAULTS", json.dumps([{"kind": "nan_grad", "phase": "update",
                                                       "step": step}]))
        monkeypatch.setenv("VERL_FAULTS_DIR", str(tmp_path / "faults"))
    return at


def _lineage(workdir, cfg, step: int) -> dict:
    return RunStore(str(workdir)).get_json(lineage_doc(cfg.trajectory_hash(), step))


def test_a_nonfinite_update_is_skipped(tmp_path, nan_grad):
    # nonfinite_policy=skip_batch (the default): the state after update 1 is the state before it,
    # rebuilt from the store, and the lineage says so (a resume replays the skip)
    nan_grad(1)
    cfg, logs = tiny_run(total_steps=3), []
    summary = train(cfg, str(tmp_path / "w"), log=logs.append)
    history = summary["history"]
    fired = [h.get("guard/anomalies", 0.0) for h in history]
    assert fired[0] == fired[2] == 0.0 and fired[1] >= 1.0, fired
    assert history[1]["guard/skip_batch"] == fired[1] and "guard/warn" not in history[1]
    assert history[1]["update/skipped_nonfinite_steps"] >= 1
    told = [line for line in logs if line.startswith("guard: step 1 ")]
    assert len(told) == fired[1] and any(" nonfinite: " in line for line in told), logs
    assert all(line.endswith("-> skip_batch (skipped)") for line in told), told
    assert _lineage(tmp_path / "w", cfg, 1)["action"] == "skip"
    assert "action" not in _lineage(tmp_path / "w", cfg, 2)
    assert math.isfinite(history[2]["actor/grad_norm"])  # the weights stayed finite


def test_a_rollback_returns_to_the_scheduled_checkpoint(tmp_path, nan_grad):
    # what the plain loop could not do before it had a run store: the state after update 3
    # (0-based) is the state of step 2 (the newest step of the checkpoint schedule before it),
    # its optimizer and LR schedule included, and the updates after it run at half the LR
    nan_grad(3)
    cfg = tiny_run(total_steps=5, **{"guard.nonfinite_policy": "rollback",
                                     "guard.rollback_lr_scale": 0.5,
                                     "checkpoint.checkpoint_interval": 2})
    logs: list[str] = []
    summary = train(cfg, str(tmp_path / "w"), log=logs.append)
    history = summary["history"]
    assert [h["step"] for h in history] == [1, 2, 3, 4, 5]
    assert history[3]["guard/rollback"] >= 1.0  # update 3 (0-based) made state 4
    told = [line for line in logs if line.startswith("guard: step 3 ")]
    assert told and all(line.endswith("-> rollback (rolled back to step 2)") for line in told)
    rec = _lineage(tmp_path / "w", cfg, 3)
    assert rec["action"] == "rollback" and rec["to"] == 2 and rec["guard"]["rollbacks"] == 1
    # the LR schedule (a warm-up) goes on from where state 2 had it, at half
    assert history[4]["actor/lr"] == pytest.approx(history[2]["actor/lr"] * 0.5, rel=1e-12)
    assert math.isfinite(history[4]["actor/grad_norm"])


def test_a_halt_policy_stops_the_plain_loop_with_the_report(tmp_path, nan_grad):
    nan_grad(1)
    cfg = tiny_run(total_steps=3, **{"guard.nonfinite_policy": "halt"})
    with pytest.raises(GuardHaltError, match=r"(?s)halted by the guard at update of step 1.*"
                                             r"nonfinite: actor/grad_norm"):
        train(cfg, str(tmp_path / "w"), log=lambda *_: None)
    # the failed loop gave its lease up (another may write the workdir at once) and kept what
    # it committed: the lineage of update 0, which a re-run replays
    assert read_lease(RunStore(str(tmp_path / "w"))).released
    assert _lineage(tmp_path / "w", cfg, 0)["batch"]


def test_no_learning_signal_is_said_then_halts_when_asked(tmp_path):
    # no warm start: the untrained tiny model never writes an answer, every response scores 0,
    # every group's rewards are equal: the step line counts it, and after no_signal_steps
    # steps in a row the guard says so with the likely cause
    over = {"model.warmup_sft_steps": 0, "guard.no_signal_steps": 2}
    cfg, logs = tiny_run(total_steps=2, **over), []
    summary = train(cfg, str(tmp_path / "w"), log=logs.append)
    assert [h["rollout/zero_variance_frac"] for h in summary["history"]] == [1.0, 1.0]
    assert [h["reward/mean"] for h in summary["history"]] == [0.0, 0.0]
    [told] = [line for line in logs if " no_signal: " in line]
    assert told.startswith("guard: step 1 no_signal: no learning signal: every group's rewards "
                           "were equal") and "every response scored 0" in told, told
    assert told.endswith("-> warn (logged)"), told
    step_lines = [line for line in logs if re.match(r"step \d+/2 ", line)]
    assert len(step_lines) == 2 and all(" flat=1.00 " in line for line in step_lines), logs
    # halt: the run stops at that step with the same message
    halt = tiny_run(total_steps=3, **over, **{"guard.no_signal_policy": "halt"})
    with pytest.raises(GuardHaltError, match="no learning signal"):
        train(halt, str(tmp_path / "h"), log=lambda *_: None)
