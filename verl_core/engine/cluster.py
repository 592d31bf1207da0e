"""``cluster.mode=attached``: the run's workers live warm on a long-lived Ray cluster.

On a Flyte cluster every Ray task is its own KubeRay RayJob, so in ``per_task`` mode each heavy
phase starts a fresh Ray cluster and rebuilds the workers from the run store (checkpoint + lineage
replay). In ``attached`` mode the phase tasks are plain tasks that join one long-lived Ray cluster
(``cluster.address`` or ``RAY_ADDRESS``; deploy/k8s/raycluster.yaml) and find the run's workers
there as **detached named actors in a per-run namespace** (``verl-<store incarnation>``), each
holding a weight version: the step of the state in memory, plus the digest of the lineage record
that made it. A phase uses that state only when its step is the one the phase's inputs name and
the record is the one in the store (``RunWorker.ensure_state``); otherwise the same actors
rebuild it from the store. The store, not the actors, is the source of truth, so Flyte cache hits,
``recover`` and re-runs stay correct, and losing every actor costs a rebuild, never data.

Clean-up: the run's finalize task removes every actor and placement group of the run
(:func:`teardown`), and each detached actor removes itself (and its placement group) after
``cluster.idle_timeout_s`` without a call, so a run that died before finalize frees the cluster.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time

from verl_core.engine.group import Detached, IdleReaper, WorkerGroup, run_placement_groups
from verl_core.engine.worker import RunWorker
from verl_core.errors import PermanentError
from verl_core.threads import intra_op_threads

log = logging.getLogger(__name__)

FORWARDED_ENV = ("VERL_FAULTS", "VERL_FAULTS_DIR", "VERL_ASSET_CACHE")
"""Environment a phase passes to the detached actors it creates (they run in the cluster's
processes, not the task's): fault drills and the asset cache. Store credentials are not
forwarded (they would be stored in Ray's job table); the RayCluster's pods carry their own."""


class AttachError(PermanentError):
    """``cluster.mode=attached`` without a Ray cluster to join."""


def namespace(incarnation: str) -> str:
    """The run's Ray namespace: one per physical run store."""
    return f"verl-{incarnation[:16]}"


def actor_prefix(config_json: str) -> str:
    """Names of one trajectory's workers (and placement groups) inside the run's namespace."""
    return "w-" + hashlib.sha256(config_json.encode()).hexdigest()[:12]


def address(cluster_cfg) -> str:
    """The Ray cluster ``attached`` mode joins ("" when this process is connected to one
    already); refuses to guess."""
    addr = cluster_cfg.address or os.environ.get("RAY_ADDRESS", "")
    if not addr and not connected():
        raise AttachError("cluster.mode='attached' needs a running Ray cluster: set "
                          "cluster.address (e.g. ray://<head>:10001) or RAY_ADDRESS, or use "
                          "cluster.mode='per_task'")
    return addr


def connect(cluster_cfg) -> None:
    """Join the attached cluster (once per process). A process already connected to a Ray
    cluster keeps that connection: a local ``pyflyte run`` joins ``RAY_ADDRESS`` either way."""
    import ray

    if ray.is_initialized():
        return
    addr = address(cluster_cfg)
    _reachable(addr)
    ray.init(address=addr, include_dashboard=False, configure_logging=False, log_to_driver=False)


def _reachable(addr: str, timeout_s: float = 30.0) -> None:
    """Fail with the address in the message when nothing listens there (``ray.init`` would
    retry for minutes before it says so)."""
    import socket

    hostport = addr.removeprefix("ray://")
    host, _, port = hostport.rpartition(":")
    if addr == "auto" or not host or not port.isdigit():
        return  # "auto" and unusual forms: Ray resolves them
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection((host, int(port)), timeout=5).close()
            return
        except OSError as e:
            if time.monotonic() > deadline:
                raise AttachError(f"cluster.mode='attached': no Ray cluster answers at {addr!r} "
                                  f"(cluster.address or RAY_ADDRESS): {e}; start it (ray start "
                                  "--head, or the RayCluster of deploy/k8s) or fix the "
                                  "address") from e
            time.sleep(1.0)


def connected() -> bool:
    """This process is connected to a Ray cluster (Ray installed and initialised)."""
    try:
        import ray
    except ImportError:
        return False
    return ray.is_initialized()


def forwarded_env() -> dict:
    return {k: os.environ[k] for k in FORWARDED_ENV if k in os.environ}


class RayRunWorker(RunWorker):
    """The single worker as a Ray actor: Ray pins actors to one thread unless told otherwise."""

    def __init__(self, store_uri, config_json, assets_index, num_threads: int):
        import torch

        torch.set_num_threads(num_threads)
        # An error of the constructor would reach the caller as ActorDiedError, its class lost
        # (a permanent error retried as a lost worker): keep it and raise it from every call
        self._init_error: Exception | None = None
        try:
            super().__init__(store_uri, config_json, assets_index)
        except Exception as e:  # noqa: BLE001 - raised again by call()
            e.worker_init_failed = True  # engine.workers.RunWorkers replaces this actor
            self._init_error = e

    def call(self, method: str, *args):
        if self._init_error is not None:
            raise self._init_error
        return getattr(self, method)(*args)


class AttachedRunWorker(IdleReaper, RayRunWorker):
    """The single worker as a detached actor of ``attached`` mode: checks its weight version
    against the store before it trusts its state, and reaps itself when idle."""

    def __init__(self, store_uri, config_json, assets_index, num_threads: int, idle_s: float):
        super().__init__(store_uri, config_json, assets_index, num_threads)
        self.verify_live = True
        self._start_reaper(idle_s)


def single_worker(spec, index: dict):
    """Get the run's detached single worker, or create it (a new one rebuilds from the store)."""
    import ray

    cfg = spec.config
    connect(cfg.cluster)
    threads = intra_op_threads(cfg)  # the run's recorded count, as in every other mode
    env = forwarded_env()
    actor_cls = ray.remote(num_cpus=1, max_restarts=0)(AttachedRunWorker)
    return actor_cls.options(
        name=f"{actor_prefix(spec.config_json)}-single", namespace=namespace(spec.incarnation),
        lifetime="detached", get_if_exists=True,
        runtime_env={"env_vars": env} if env else None).remote(
        spec.store, spec.config_json, index, threads, cfg.cluster.idle_timeout_s)


def group_workers(spec, index: dict):
    """The run's detached worker group (W = nnodes x n_gpus_per_node), adopted when all W
    workers answer, else rebuilt."""
    cfg = spec.config
    connect(cfg.cluster)
    tc = cfg.trainer
    return WorkerGroup(spec.store, spec.config_json, index, nnodes=tc.nnodes,
                       n_gpus_per_node=tc.n_gpus_per_node, timeout_s=tc.worker_timeout_s,
                       num_threads=intra_op_threads(cfg),
                       detached=Detached(prefix=actor_prefix(spec.config_json),
                                         namespace=namespace(spec.incarnation),
                                         idle_timeout_s=cfg.cluster.idle_timeout_s,
                                         env=forwarded_env()))


def run_actors(ns: str, prefix: str = "") -> list[str]:
    """Names of the live named actors of a run's namespace (``prefix``: one trajectory's)."""
    import ray

    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                  if a["namespace"] == ns and a["name"].startswith(prefix))


def teardown(incarnation: str) -> list[str]:
    """Remove every detached actor and placement group of the run with this store incarnation
    (the run's finalize, tests). Returns the names of the actors removed."""
    import ray
    from ray.util.placement_group import remove_placement_group

    ns = namespace(incarnation)
    names = run_actors(ns)
    for name in names:
        try:
            ray.kill(ray.get_actor(name, namespace=ns), no_restart=True)
        except ValueError:  # gone meanwhile
            pass
    for pg in run_placement_groups(f"{ns}/"):
        try:
            remove_placement_group(pg)
        except Exception as e:  # noqa: BLE001 - removed meanwhile
            log.debug("remove placement group: %s", e)
    return names


# ---------------------------------------------------------------------- what a phase reads
def bytes_read_per_phase(n_params: int, *, mode: str, param_bytes: int = 4,
                         optim_bytes_per_param: int = 8, ref_bytes: int = 2,
                         critic: bool = False, batch_bytes: int = 0) -> dict[str, int]:
    """Bytes a heavy phase reads from the run store before it can start, per mode, for a policy of
    ``n_params`` parameters: fp32 weights (``param_bytes``), AdamW's two fp32 moments
    (``optim_bytes_per_param``), a reference model in bf16 (``ref_bytes``; 0 without KL), a critic
    of the same size with its own optimizer when ``critic``. ``batch_bytes``: the step's batch.

    ``per_task``: every heavy phase starts a fresh worker group, which reads the newest checkpoint
    (weights + optimizer; the reference model from the assets) before it can work, plus the
    batches it replays (ignored here: at most ``checkpoint_interval`` - 1 of them).
    ``attached``: warm workers read only the batch the phase consumes; a rebuild (after a fault)
    costs what ``per_task`` pays, once."""
    if mode not in ("per_task", "attached"):
        raise ValueError(f"mode={mode!r}: use 'per_task' or 'attached'")
    state = n_params * (param_bytes + optim_bytes_per_param) * (2 if critic else 1)
    state += n_params * ref_bytes
    phases = {"rollout": 0, "update": batch_bytes, "checkpoint": 0, "evaluate": 0}
    if mode == "per_task":
        return {k: v + state for k, v in phases.items()}
    return phases
