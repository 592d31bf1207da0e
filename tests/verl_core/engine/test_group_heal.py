"""Self-healing phase outputs on a worker group of W = 2 Ray actors (FSDP2 over gloo): rank 0's
view decides that a batch is damaged, every worker recomputes it together (the rollout and the
reward are collectives), rank 0 writes it back, and the update goes on. A rank that healed alone
would leave the other waiting in a collective, so this is the case a single worker cannot test."""
import hashlib
import os

import pytest

from verl_core import phases
from verl_core.engine.workers import WORKERS, RunWorkers
from verl_core.prepare import prepare_run
from verl_core.types import PhaseOut
from verl_core.engine.worker import PENDING_PHASES
from verl_core.layout import pending_doc
from tests.damage import flip_bytes
from tests.presets import tiny_run

pytestmark = pytest.mark.slow


@pytest.fixture
def local_ray(tmp_path, monkeypatch):
    ray = pytest.importorskip("ray")
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    monkeypatch.setenv("VERL_ASSET_CACHE", str(tmp_path / "assets"))  # the actors inherit it
    monkeypatch.delenv("VERL_FAULTS", raising=False)
    ray.init(address="local", num_cpus=2, include_dashboard=False, configure_logging=False)
    try:
        yield
    finally:
        WORKERS.release_all()
        ray.shutdown()


def _flip(path, n=64):
    flip_bytes(path, n)


def test_two_workers_recompute_damaged_pending_batches_together(tmp_path, local_ray):
    cfg = tiny_run(**{
        "total_steps": 1, "data.synthetic_train_size": 48, "data.train_batch_size": 6,
        "actor.ppo_mini_batch_size": 6, "checkpoint.async_save": False,
        "trainer.n_gpus_per_node": 2, "trainer.worker_timeout_s": 120.0})
    spec = prepare_run(cfg, str(tmp_path / "store"), "r", log_fn=lambda *_: None)
    ref, _ = RunWorkers(spec).rollout(0)
    ref = phases.reward(spec, PhaseOut(0, ref)).batch
    ref = phases.advantage(spec, PhaseOut(0, ref)).batch
    WORKERS.release_all()  # a fresh group, as after a lost pod

    st = spec.open_store()
    refs = [st.get_json(pending_doc(spec.trajectory_hash, 0, p))["batch"] for p in PENDING_PHASES]
    for sha in refs:
        _flip(st.object_path(sha))
    RunWorkers(spec).update(0, ref)  # recomputed by both workers, then applied
    for sha in refs:
        assert hashlib.sha256(open(st.object_path(sha), "rb").read()).hexdigest() == sha
    assert len(os.listdir(os.path.join(st.root, "quarantine"))) == 3
    assert st.get_json(f"lineage/{spec.trajectory_hash[:16]}/000000000")["batch"] == ref
