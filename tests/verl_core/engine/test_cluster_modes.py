"""``cluster.mode``: the config, the refusal without a cluster, and the bytes-per-phase formula
docs/cluster.md's table comes from. (The attached mode itself runs on a real two-node Ray cluster in
test_attached.py, and through ``pyflyte run`` in tests/workflows/test_scaleout.py.)"""
import pytest

from verl_core.prepare import prepare_run
from verl_core.config import ConfigError, RunConfig, with_overrides
from verl_core.engine import cluster


def test_the_mode_is_validated_and_never_part_of_the_trajectory():
    base = RunConfig()
    attached = with_overrides(base, {"cluster.mode": "attached", "cluster.idle_timeout_s": 60})
    assert attached.trajectory_hash() == base.trajectory_hash()
    with pytest.raises(ConfigError, match="cluster.mode"):
        with_overrides(base, {"cluster.mode": "detached"})
    with pytest.raises(ConfigError, match="cluster.idle_timeout_s"):
        with_overrides(base, {"cluster.idle_timeout_s": -1})


def test_attached_without_a_cluster_is_refused_before_any_work(tmp_path, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    ray = pytest.importorskip("ray")
    if ray.is_initialized():
        pytest.skip("this process is connected to a Ray cluster")
    cfg = with_overrides(RunConfig(), {"cluster.mode": "attached"})
    with pytest.raises(cluster.AttachError, match="cluster.address .* or RAY_ADDRESS"):
        prepare_run(cfg, str(tmp_path), "r", log_fn=lambda *_: None)
    assert list(tmp_path.iterdir()) == []  # no store was created


def test_bytes_read_per_phase():
    n, batch = 7_000_000_000, 50_000_000
    per_task = cluster.bytes_read_per_phase(n, mode="per_task", batch_bytes=batch)
    attached = cluster.bytes_read_per_phase(n, mode="attached", batch_bytes=batch)
    state = n * (4 + 8) + n * 2  # fp32 weights + two AdamW moments + a bf16 reference
    assert per_task == {"rollout": state, "update": state + batch, "checkpoint": state,
                        "evaluate": state}
    assert attached == {"rollout": 0, "update": batch, "checkpoint": 0, "evaluate": 0}
    critic = cluster.bytes_read_per_phase(n, mode="per_task", critic=True)
    assert critic["rollout"] == 2 * n * 12 + n * 2
    with pytest.raises(ValueError, match="mode"):
        cluster.bytes_read_per_phase(n, mode="warm")


def test_names_are_per_run_and_per_trajectory():
    assert cluster.namespace("a" * 32) == "verl-" + "a" * 16
    assert cluster.actor_prefix('{"x": 1}') != cluster.actor_prefix('{"x": 2}')


def test_an_unreachable_cluster_is_named(monkeypatch):
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(cluster.AttachError, match=f"127.0.0.1:{port}"):
        cluster._reachable(f"127.0.0.1:{port}", timeout_s=0.5)
