"""``CheckpointConfig.due`` (``verl_core/checkpoint/config.py``): the one decision of whether the
state after a step is saved. The plan of a run (``phases.checkpoint_follows``: which steps get a
checkpoint phase) asks it without the clock; the worker asks it with the clock, in the phase."""

import pathlib
import re

from verl_core import phases
from verl_core.checkpoint.config import CheckpointConfig
from verl_core.config import RunConfig, with_overrides
from verl_core.types import RunSpec

ROOT = pathlib.Path(__file__).resolve().parents[3]


def test_due_on_the_step_schedule_the_last_step_and_the_clock():
    steps = CheckpointConfig(checkpoint_interval=4)
    # every 4th step and the last (10); the clock plays no part without checkpoint_interval_s
    assert [s for s in range(1, 11) if steps.due(s, 10)] == [4, 8, 10]
    assert not steps.due(5, 10, since_save_s=1e9)
    clock = CheckpointConfig(checkpoint_interval=4, checkpoint_interval_s=60.0)
    assert clock.due(5, 10)  # elapsed time unknown (planning): the worker decides
    assert not clock.due(5, 10, since_save_s=59.9)
    assert clock.due(5, 10, since_save_s=60.0)
    assert clock.due(8, 10, since_save_s=0.0)  # the schedule saves whatever the clock says
    assert clock.due(10, 10, since_save_s=0.0)  # and the last step, whatever the clock says


def test_last_step_only_saves_the_last_step_whatever_the_interval_or_the_clock():
    last = CheckpointConfig(checkpoint_interval=2, last_step_only=True, checkpoint_interval_s=1.0)
    assert [s for s in range(1, 8) if last.due(s, 7)] == [7]
    assert not last.due(4, 7, since_save_s=1e9)
    assert last.due(7, 7, since_save_s=0.0)


def _spec(**over) -> RunSpec:
    cfg = with_overrides(RunConfig(), {"total_steps": 7, **over})
    return RunSpec(store="memory://unused", incarnation="x", config=cfg, trajectory_hash="h",
                   assets_json="{}", start_step=0, total_steps=cfg.total_steps)


def test_the_plan_is_the_decision_without_the_clock():
    # which steps get a checkpoint phase: the schedule and the last step; with a clock interval
    # every step, and the worker decides there
    assert [s for s in range(1, 8)
            if phases.checkpoint_follows(_spec(**{"checkpoint.checkpoint_interval": 3}), s)] == \
        [3, 6, 7]
    clock = _spec(**{"checkpoint.checkpoint_interval": 3, "checkpoint.checkpoint_interval_s": 5.0})
    assert all(phases.checkpoint_follows(clock, s) for s in range(1, 8))


def test_due_is_asked_at_two_places_only():
    # the plan (phases.checkpoint_follows) and the decision (RunWorker.checkpoint); the workflow,
    # the plain loop and the update task ask the plan, so no other code decides a checkpoint
    callers = sorted(str(p.relative_to(ROOT)) for d in ("verl_core", "tasks", "workflows")
                     for p in (ROOT / d).rglob("*.py")
                     if re.search(r"\.due\(", p.read_text()))
    assert callers == ["verl_core/engine/worker.py", "verl_core/phases.py"]
