"""The checkpoint phase (``phases.checkpoint``): the plan (``phases.checkpoint_follows``) runs it
on the steps of the schedule and the last step, and the worker decides there; on the other
steps the update ends the step with ``checkpoint/saved=0``, the worker's own no-save answer
(``CheckpointConfig.due`` is the one decision)."""

from verl_core import phases
from verl_core.checkpoint import CheckpointManager
from verl_core.engine.workers import WORKERS, RunWorkers


def test_off_schedule_steps_are_answered_as_the_worker_would(tracked_run):
    # checkpoint.checkpoint_interval=2 over 3 steps: step 2 (the schedule) and 3 (the last)
    spec = tracked_run.spec
    # the workflow runs the phase only where it may be due; the update records checkpoint/saved=0
    assert [phases.checkpoint_follows(spec, s) for s in (1, 2, 3)] == [False, True, True]
    saved = tracked_run.table.set_index("step")["checkpoint/saved"]
    assert [saved.loc[s] for s in (1, 2, 3)] == [0.0, 1.0, 1.0]
    store_steps = sorted(i.step for i in CheckpointManager(spec.open_store()).list_checkpoints()
                         if i.error is None)
    assert store_steps == [2, 3]
    try:
        assert RunWorkers(spec).checkpoint(1) == {"checkpoint/saved": 0.0}
    finally:
        WORKERS.release_all()
