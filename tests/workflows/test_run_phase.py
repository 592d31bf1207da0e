"""``tasks.common.run_phase`` with ``then``: the update task ends a step that has no checkpoint
phase after the update's wall-clock detectors ran, so the step's recorded guard counts include
an update that was slow (a real sleep against a real history, real store, no mocks)."""
import time

from tasks.common import run_phase
from verl_core import phases
from verl_core.config import RunConfig, with_overrides
from verl_core.engine import runtime
from verl_core.guard.events import read_events
from verl_core.store import RunStore


def test_a_slow_update_counts_in_the_metrics_of_the_step_it_ends(tmp_path):
    cfg = with_overrides(RunConfig(), {"guard.latency_spike_policy": "warn",
                                       "guard.latency_spike_min_s": 0.5,
                                       "checkpoint.checkpoint_interval": 10})
    st = RunStore(str(tmp_path / "run"))
    spec = runtime.RunSpec(store=st.uri, incarnation=st.incarnation_id, config=cfg,
                           config_hash=cfg.trajectory_hash(), assets_json="{}", start_step=0,
                           total_steps=cfg.total_steps)
    for step in range(12):  # a steady history of fast updates, past the detector's warm-up
        runtime.watch_phase(spec, "update", step, 0.02, {})
    assert not phases.checkpoint_due(spec, 13)

    def slow_update():
        time.sleep(1.0)
        return phases.StepState(step=13, metrics={"actor/pg_loss": 0.5})

    done = run_phase(spec, "update", 12, slow_update, then=lambda s: phases.end_step(spec, s))
    (event,) = read_events(st, spec.config_hash)
    assert (event["step"], event["phase"], event["detector"]) == (12, "update", "latency_spike")
    assert done.metrics == {"actor/pg_loss": 0.5, "checkpoint/saved": 0.0}
    row = runtime.metrics_table(spec).set_index("step").loc[13]
    assert row["guard/anomalies"] == 1 and row["checkpoint/saved"] == 0.0
    runtime.release_lease(spec)
