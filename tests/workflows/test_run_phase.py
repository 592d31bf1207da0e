"""``tasks.common.run_phase`` with ``then``: the update task ends a step that has no checkpoint
phase after the update's wall-clock detectors ran, so the step's recorded guard counts include
an update that was slow (a real sleep against a real history, real store, no mocks)."""
import time

import pytest

from tasks.common import run_phase
from verl_core import phases
from verl_core.config import RunConfig, with_overrides
from verl_core import runlog
from verl_core import writer
from verl_core.types import RunSpec
from verl_core.guard.events import read_events
from verl_core.store import RunStore


def test_a_slow_update_counts_in_the_metrics_of_the_step_it_ends(tmp_path):
    cfg = with_overrides(RunConfig(), {"guard.latency_spike_policy": "warn",
                                       "guard.latency_spike_min_s": 0.5,
                                       "checkpoint.checkpoint_interval": 10})
    st = RunStore(str(tmp_path / "run"))
    spec = RunSpec(store=st.uri, incarnation=st.incarnation_id, config=cfg,
                           trajectory_hash=cfg.trajectory_hash(), assets_json="{}", start_step=0,
                           total_steps=cfg.total_steps)
    for step in range(12):  # a steady history of fast updates, past the detector's warm-up
        runlog.watch_phase(spec, "update", step, 0.02, {})
    assert not phases.checkpoint_follows(spec, 13)  # the update ends the step

    def slow_update():
        time.sleep(1.0)
        return phases.StepState(step=13, metrics={"actor/pg_loss": 0.5})

    done = run_phase(spec, "update", 12, slow_update, then=lambda s: phases.end_step(spec, s))
    (event,) = read_events(st, spec.trajectory_hash)
    assert (event["step"], event["phase"], event["detector"]) == (12, "update", "latency_spike")
    assert done.metrics == {"actor/pg_loss": 0.5, "checkpoint/saved": 0.0}
    row = runlog.metrics_table(spec).set_index("step").loc[13]
    assert row["guard/anomalies"] == 1 and row["checkpoint/saved"] == 0.0
    writer.release_lease(spec)


def _outage_after(seconds: float, faults_dir) -> None:
    """Start a store outage now, the way the ``store_outage`` fault does (its state file): every
    run-store call of this process fails as unavailable for ``seconds``."""
    (faults_dir / "store-outage-until").write_text(repr(time.time() + seconds))


def _outage_spec(tmp_path, monkeypatch):
    # a valid fault list naming store_outage (never firing by itself: no phase runs step 99)
    # switches the store's outage check on; the tests start the outage themselves
    monkeypatch.setenv("VERL_FAULTS", '[{"kind": "store_outage", "phase": "rollout", '
                                      '"step": 99, "seconds": 0}]')
    monkeypatch.setenv("VERL_FAULTS_DIR", str(tmp_path / "faults"))
    (tmp_path / "faults").mkdir()
    cfg = RunConfig()
    st = RunStore(str(tmp_path / "run"))
    return st, RunSpec(store=st.uri, incarnation=st.incarnation_id, config=cfg,
                               trajectory_hash=cfg.trajectory_hash(), assets_json="{}",
                               start_step=0, total_steps=cfg.total_steps)


def test_the_phase_log_rides_out_a_store_outage_without_redoing_the_body(tmp_path, monkeypatch):
    """The store goes away as the body ends: the phase log's append is retried like the body's
    store calls (backoff 1 s then 2 s, each x1-1.25: the third try comes 3.0-3.75 s later, after
    a 2.5 s outage), and the body is not run again."""
    st, spec = _outage_spec(tmp_path, monkeypatch)
    runs = []

    def body():
        runs.append(1)
        _outage_after(2.5, tmp_path / "faults")
        return {"x": 1.0}

    assert run_phase(spec, "reward", 5, body) == {"x": 1.0}
    assert len(runs) == 1
    assert [(r["phase"], r["step"]) for r in runlog.read_phase_log(st.uri)] == [("reward", 5)]
    writer.release_lease(spec)


def test_an_outage_longer_than_the_retries_is_recoverable_for_flyte(tmp_path, monkeypatch):
    """Past the retries the phase log's failure is a FlyteRecoverableException (a cluster
    retries the phase), never a raw StoreUnavailableError that fails the run."""
    from flytekit.exceptions.user import FlyteRecoverableException

    from verl_core.errors import StoreUnavailableError

    st, spec = _outage_spec(tmp_path, monkeypatch)
    runs = []

    def body():
        runs.append(1)
        _outage_after(60, tmp_path / "faults")  # longer than the ~3.75 s of backoff
        return {"x": 1.0}

    try:
        with pytest.raises(FlyteRecoverableException, match="phase log of reward step 5: .*"
                                                            "injected store_outage") as e:
            run_phase(spec, "reward", 5, body)
        assert isinstance(e.value.__cause__, StoreUnavailableError) and len(runs) == 1
    finally:
        (tmp_path / "faults" / "store-outage-until").unlink()
    assert runlog.read_phase_log(st.uri) == []
    writer.release_lease(spec)
