"""A Ray actor that dies mid-run is a transient fault: the retry gets a fresh actor that rebuilds
the state from the run store and produces the same (content-addressed) result."""
import pytest

from tests.presets import tiny_run
from verl_core.engine.worker import RunWorker
from verl_core.engine.workers import WORKERS, RunWorkers
from verl_core.phases import with_retries
from verl_core.prepare import prepare_run

pytestmark = pytest.mark.slow


@pytest.fixture
def local_ray(monkeypatch):
    ray = pytest.importorskip("ray")
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    ray.init(address="local", num_cpus=2, include_dashboard=False, configure_logging=False)
    yield ray
    WORKERS.release_all()
    ray.shutdown()


def test_dead_actor_is_retried_with_a_fresh_one(tmp_path, local_ray, monkeypatch):
    monkeypatch.setenv("VERL_ASSET_CACHE", str(tmp_path / "assets"))
    cfg = tiny_run(**{"total_steps": 2, "model.warmup_sft_steps": 10,
                      "actor.ppo_micro_batch_size": 16})
    spec = prepare_run(cfg, str(tmp_path / "store"), "r", log_fn=lambda *_: None)
    first, _ = RunWorkers(spec).rollout(0)
    actor = WORKERS.held(spec)
    assert not isinstance(actor, RunWorker)  # a real Ray actor
    local_ray.kill(actor)

    sleeps = []
    ref, _ = with_retries(lambda: RunWorkers(spec).rollout(0),
                                  what="rollout", sleep=sleeps.append)
    assert len(sleeps) == 1  # one failed attempt (the dead actor), then success
    assert ref == first  # same content: the new actor rebuilt the same state
    assert WORKERS.held(spec) is not actor
