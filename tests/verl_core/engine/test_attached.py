"""``cluster.mode=attached`` on a real two-node Ray cluster started on this machine (``ray start
--head`` plus a second ``ray start --address`` with its own resources and node label): a W = 2
group with one worker per node stays warm across phases as detached actors; a node lost in the
middle of an update, and every actor of the run killed between two phases, each cost a rebuild
from the store, and the runs end with the same weights as an undisturbed one."""
import json
import os
import signal
import threading
import time

import pytest
import torch

from tests.ray_nodes import RayNodes, alive_nodes
from verl_core import phases
from verl_core.engine.workers import WORKERS, RunWorkers
from verl_core.phases import with_retries
from verl_core.prepare import prepare_run
from verl_core.types import PhaseOut, StepState
from verl_core.engine import cluster

pytestmark = pytest.mark.slow

STEPS = 3
@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    ray = pytest.importorskip("ray")
    if ray.is_initialized():
        ray.shutdown()
    nodes = RayNodes(tmp_path_factory.mktemp("ray"), num_cpus=1)
    faults = tmp_path_factory.mktemp("faults")
    env = {"VERL_FAULTS_DIR": str(faults), "RAY_AUTH_MODE": "disabled",
           "VERL_ASSET_CACHE": str(tmp_path_factory.mktemp("assets"))}
    with pytest.MonkeyPatch.context() as mp:  # restored however the module ends
        for k, v in env.items():
            mp.setenv(k, v)
        try:
            nodes.start_second()
            deadline = time.time() + 120
            while True:
                try:
                    if not ray.is_initialized():
                        ray.init(address=nodes.address, include_dashboard=False,
                                 configure_logging=False, log_to_driver=False)
                    if len(alive_nodes(ray)) == 2:
                        break
                except ConnectionError:
                    pass
                assert time.time() < deadline, "the two-node Ray cluster did not start"
                time.sleep(0.5)
            yield ray, nodes, faults
        finally:
            WORKERS.release_all()
            ray.shutdown()
            nodes.stop()


def _cfg(**extra):
    from tests.presets import tiny_run

    return tiny_run("grpo", **{
        "total_steps": STEPS, "model.warmup_sft_steps": 150, "model.warmup_target_accuracy": 0.3,
        "data.synthetic_train_size": 120, "data.synthetic_val_size": 12,
        "data.train_batch_size": 6, "actor.ppo_mini_batch_size": 6,
        "checkpoint.checkpoint_interval": 2, "trainer.nnodes": 2, "trainer.n_gpus_per_node": 1,
        "trainer.worker_timeout_s": 120.0, "cluster.mode": "attached", **extra})


def _new_task_process():
    """What a new phase task (another pod) starts with: no handle on the run's workers."""
    WORKERS.reset()


def _phases(spec, between=lambda phase, step: None) -> None:
    """The phases of the workflow in order, each as if in its own task process."""
    for s in range(spec.start_step, spec.total_steps):
        def step(s=s):
            _new_task_process()
            ref, _ = RunWorkers(spec).rollout(s)
            between("rollout", s)
            ref = phases.reward(spec, PhaseOut(s, ref)).batch
            ref = phases.advantage(spec, PhaseOut(s, ref)).batch
            _new_task_process()
            RunWorkers(spec).update(s, ref)
            between("update", s)
            _new_task_process()
            RunWorkers(spec).checkpoint(s + 1)
        with_retries(step, what=f"step {s}", backoff_s=0.5)


def _final(spec) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    _new_task_process()
    out = phases.finalize(spec, StepState(spec.total_steps))
    return load_file(os.path.join(out["final_model"], "model.safetensors"))


def _versions(spec) -> list[dict]:
    """Every rank's weight version (a collective-free call on each actor)."""
    import ray

    ns = cluster.namespace(spec.incarnation)
    names = cluster.run_actors(ns)
    return [ray.get(ray.get_actor(n, namespace=ns).version.remote(), timeout=60) for n in names]


def _node_of(spec) -> dict[str, str]:
    import ray

    ns = cluster.namespace(spec.incarnation)
    return {n: ray.get(ray.get_actor(n, namespace=ns).node_id.remote(), timeout=60)
            for n in cluster.run_actors(ns)}


def _prepare(tmp_path, name):
    import ray

    addr = ray.get_runtime_context().gcs_address  # the cluster this test process joined
    return prepare_run(_cfg(**{"cluster.address": addr}), str(tmp_path / name), "r",
                               log_fn=lambda *_: None)


@pytest.fixture(scope="module")
def undisturbed(two_nodes, tmp_path_factory):
    """An attached W = 2 run where every phase is a new task process: the workers stay warm
    (same processes, nothing replayed), one on each node, and finalize removes them."""
    ray, nodes, _ = two_nodes
    spec = _prepare(tmp_path_factory.mktemp("undisturbed"), "a")
    pids: list[set] = []
    placed: list[dict] = []

    def between(phase, step):
        v = _versions(spec)
        assert all(x["valid"] and x["step"] == step + (phase == "update") for x in v), v
        pids.append({x["pid"] for x in v})
        placed.append(_node_of(spec))

    _phases(spec, between)
    assert len({frozenset(p) for p in pids}) == 1, pids  # the same two processes all along
    assert all(len(set(p.values())) == 2 for p in placed), placed  # one worker per node
    assert all(x["step"] == STEPS for x in _versions(spec))
    weights = _final(spec)
    assert cluster.run_actors(cluster.namespace(spec.incarnation)) == []  # finalize removed them
    assert cluster.run_placement_groups(cluster.namespace(spec.incarnation) + "/") == []
    return weights


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_attached_workers_stay_warm_across_phase_tasks(undisturbed):
    assert undisturbed  # the fixture's assertions are this test


def test_every_actor_killed_between_phases_costs_a_rebuild_not_the_run(two_nodes, undisturbed,
                                                                       tmp_path):
    """SIGKILL every worker process of the run after the rollout of step 1: the reward and
    advantage phases do not need them, the update's task finds them gone, starts a new group and
    rebuilds the state of step 1 from the store; the run ends bit-identical."""
    ray, _, _ = two_nodes
    spec = _prepare(tmp_path, "b")
    killed: list[int] = []

    def between(phase, step):
        if phase == "rollout" and step == 1 and not killed:
            for v in _versions(spec):
                os.kill(v["pid"], signal.SIGKILL)
                killed.append(v["pid"])

    _phases(spec, between)
    assert len(killed) == 2
    assert not set(killed) & {v["pid"] for v in _versions(spec)}
    assert _same(_final(spec), undisturbed)


def _guard(errors, fn):
    try:
        fn()
    except BaseException as e:  # noqa: BLE001 - reported by the test
        errors.append(e)


def test_a_node_lost_mid_update_fails_transient_and_the_run_ends_identical(two_nodes, undisturbed,
                                                                           tmp_path):
    """Both workers hang in the middle of the update of step 1 (a fault drill, so the kill
    lands inside the update); the second node's raylet is SIGKILLed; the update fails as
    transient (its worker died), the retry builds a new group (KubeRay would replace the node:
    here a new second node starts) and the run ends bit-identical to the undisturbed one."""
    ray, nodes, faults = two_nodes
    spec = _prepare(tmp_path, "c")
    os.environ["VERL_FAULTS"] = json.dumps(
        [{"phase": f"update-rank{r}", "step": 1, "kind": "hang", "times": 1} for r in (0, 1)])
    errors: list = []
    try:
        t = threading.Thread(target=lambda: _guard(errors, lambda: _phases(spec)))
        t.start()
        markers = [faults / f"update-rank{r}-1.entered" for r in (0, 1)]
        deadline = time.time() + 300
        while not all(m.exists() for m in markers):
            assert t.is_alive() and time.time() < deadline, errors
            time.sleep(0.2)
        nodes.kill_second_raylet()  # in the middle of the update of step 1
        while len(alive_nodes(ray)) != 1:  # the GCS declares the node dead ...
            assert time.time() < deadline
            time.sleep(0.2)
        nodes.start_second()  # ... and a replacement joins (KubeRay restarts the worker pod)
        t.join(timeout=600)
        assert not t.is_alive()
    finally:
        os.environ.pop("VERL_FAULTS", None)
    assert not errors, errors
    # each rank's update of step 1 ran twice: hung once, then on the rebuilt group
    assert [(faults / f"update-rank{r}-1.attempts").read_text() for r in (0, 1)] == ["2", "2"]
    assert _same(_final(spec), undisturbed)


def test_idle_detached_workers_remove_themselves_and_their_placement_groups(two_nodes, tmp_path):
    """A run that never reaches finalize: after cluster.idle_timeout_s without a call its workers
    remove their placement groups and exit, freeing the cluster."""
    import ray

    addr = ray.get_runtime_context().gcs_address
    spec = prepare_run(_cfg(**{"cluster.address": addr, "cluster.idle_timeout_s": 2.0}),
                               str(tmp_path), "r", log_fn=lambda *_: None)
    _new_task_process()
    assert RunWorkers(spec).version()["step"] == 0
    ns = cluster.namespace(spec.incarnation)
    assert len(cluster.run_actors(ns)) == 2 and len(cluster.run_placement_groups(ns + "/")) == 2
    deadline = time.time() + 60
    while cluster.run_actors(ns) or cluster.run_placement_groups(ns + "/"):
        assert time.time() < deadline, (cluster.run_actors(ns),
                                        cluster.run_placement_groups(ns + "/"))
        time.sleep(0.5)
    _new_task_process()
