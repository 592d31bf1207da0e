"""The worker group: W = ``trainer.nnodes`` x ``trainer.n_gpus_per_node`` Ray actors training one
run in lock-step with FSDP2, rolling out on the same workers (verl's colocated hybrid engine).

What belongs here: placing the actors (one placement group per node), the rendezvous of their
process group, fanning a phase call out to every worker with a deadline, and tearing the group
down when any worker fails; for ``cluster.mode=attached`` (``cluster.py``, which builds on this
module) detached actors that reap themselves when idle, and finding their placement groups.
What a worker does per phase is :class:`RunWorker`'s (rank-aware: only rank 0 writes to the
store); the data-parallel math is ``training/dist.py`` and ``sharding.py``.

Failure semantics: a worker that dies, or a phase call that outlives ``trainer.worker_timeout_s``,
kills the whole group (the others may be blocked in a collective with the dead one) and raises
:class:`WorkerLostError` (transient): the retry builds a new group, which rebuilds its state from
the store (checkpoint + lineage replay), exactly as a single worker does. An error a worker raises
itself (bad data, a damaged store) also takes the group down, then propagates unchanged.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field

from verl_core.errors import TransientError
from verl_core.engine.worker import RunWorker
from verl_core.threads import default_num_threads

log = logging.getLogger(__name__)


class WorkerLostError(TransientError):
    """A worker of the run died or stopped answering (node lost, OOM-killed, a hung collective).
    Transient: the next attempt starts new workers, which rebuild the state from the run store."""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _rendezvous_address() -> tuple[str, int]:
    """(IP, free port) of the node this runs on: rank 0's node, where the TCP store listens."""
    import ray

    return ray.util.get_node_ip_address(), _free_port()


class GroupWorker(RunWorker):
    """One rank of the group (the body of a Ray actor)."""

    def __init__(self, rank: int, world_size: int, init_method: str, store_uri: str,
                 config_json: str, assets_index: dict, num_threads: int, timeout_s: float):
        import torch

        from verl_core.training.dist import init_process_group

        from verl_core.training.device import resolve_device

        torch.set_num_threads(num_threads)
        if torch.cuda.is_available():
            torch.cuda.set_device(0)  # Ray gives each actor one GPU: CUDA_VISIBLE_DEVICES
        # NCCL between the workers' GPUs; gloo on the CPU (trainer.device=cpu, or no GPU)
        setting = json.loads(config_json).get("trainer", {}).get("device", "auto")
        backend = "nccl" if resolve_device(setting).type == "cuda" else "gloo"
        dp = init_process_group(backend, init_method, rank, world_size, timeout_s)
        super().__init__(store_uri, config_json, assets_index, dp=dp)

    def ready(self) -> int:
        return self.dp.rank

    def call(self, method: str, *args):
        return getattr(self, method)(*args)

    def pid(self) -> int:
        return os.getpid()

    def node_id(self) -> str:
        """The Ray node this worker runs on."""
        import ray

        return ray.get_runtime_context().get_node_id()

    def shutdown(self) -> None:
        import torch.distributed as dist

        try:
            self.close()
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()


class IdleReaper:
    """Mixed into a detached actor: after ``idle_s`` without a call (and none running), the actor
    removes its placement group and exits, freeing the cluster of a run that never reached its
    finalize task. A call that is running holds the reaper off, however long it takes."""

    def _start_reaper(self, idle_s: float) -> None:
        self._calls = 0
        self._last_call = time.monotonic()
        self._idle_s = float(idle_s)
        if self._idle_s > 0:
            threading.Thread(target=self._reap, name="verl-idle-reaper", daemon=True).start()

    def _reap(self) -> None:
        while True:
            time.sleep(min(self._idle_s / 4, 30.0))
            if self._calls == 0 and time.monotonic() - self._last_call > self._idle_s:
                break
        log.warning("no call for %.0fs (cluster.idle_timeout_s): removing this worker",
                    self._idle_s)
        from ray.util.placement_group import (get_current_placement_group,
                                              remove_placement_group)

        try:
            self.close()  # pending checkpoint writes finish first
        finally:
            pg = get_current_placement_group()
            if pg is not None:
                try:
                    remove_placement_group(pg)  # kills the group's other workers too
                except Exception as e:  # noqa: BLE001 - exiting anyway
                    log.debug("remove placement group: %s", e)
            os._exit(0)

    def call(self, method: str, *args):
        if getattr(self, "_init_error", None) is not None:  # see RayRunWorker
            raise self._init_error
        self._calls += 1
        self._last_call = time.monotonic()
        try:
            return getattr(self, method)(*args)
        finally:
            self._calls -= 1
            self._last_call = time.monotonic()


class DetachedGroupWorker(IdleReaper, GroupWorker):
    """A rank of an ``attached``-mode group (a detached actor, see ``engine.cluster``): it checks
    its weight version against the store before it trusts its state, and reaps itself when idle."""

    def __init__(self, *args, idle_s: float):
        super().__init__(*args)
        self.verify_live = True
        self._start_reaper(idle_s)


@dataclass(frozen=True)
class Detached:
    """Make the group's actors (and placement groups) detached and named, in ``namespace``, so
    the next phase task of the run finds them warm (``cluster.mode=attached``)."""

    prefix: str
    """Actor names: ``<prefix>-rank<r>``; placement groups: ``<namespace>/<prefix>-...``."""
    namespace: str
    """The run's Ray namespace."""
    idle_timeout_s: float = 0.0
    """Each actor removes itself after this long without a call (0: never)."""
    env: dict = field(default_factory=dict)
    """Environment variables for the actors (they do not inherit the task's)."""


class WorkerGroup:
    """Driver-side handle of the W workers of one run; ``call(method, *args)`` returns rank 0's
    result once every worker has finished.

    With ``detached`` the workers outlive this handle: a later handle (another phase task, on
    any host) with the same names adopts them when all W answer, or else removes what is left
    of them and starts a new group."""

    def __init__(self, store_uri: str, config_json: str, assets_index: dict, *, nnodes: int,
                 n_gpus_per_node: int, timeout_s: float, num_threads: int = 0,
                 detached: Detached | None = None):
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.timeout_s = timeout_s
        self.world_size = W = nnodes * n_gpus_per_node
        self.detached = detached
        self._pgs: list = []
        self.actors: list = []
        self.adopted = detached is not None and self._adopt()
        if self.adopted:
            return
        gpus = int(ray.cluster_resources().get("GPU", 0))
        use_gpu = gpus >= W
        # CPU workers: an equal share of the free CPUs, at most one each (fractional when W
        # exceeds them, e.g. W = 3 on 2 cores: the OS shares the cores, placement still succeeds)
        cpus = max(0.01, min(1.0, float(ray.available_resources().get("CPU", 0)) / W))
        bundle = {"CPU": cpus, **({"GPU": 1} if use_gpu else {})}
        named = [{} for _ in range(nnodes)]
        if detached is not None:  # a new name per generation: a removed group's may linger
            gen = uuid.uuid4().hex[:8]
            named = [{"lifetime": "detached",
                      "name": f"{detached.namespace}/{detached.prefix}-{gen}-node{i}"}
                     for i in range(nnodes)]
        self._pgs = [placement_group([dict(bundle)] * n_gpus_per_node, strategy="STRICT_PACK",
                                     **named[i]) for i in range(nnodes)]
        try:
            ray.get([pg.ready() for pg in self._pgs], timeout=timeout_s)

            def on(rank: int):
                return PlacementGroupSchedulingStrategy(
                    placement_group=self._pgs[rank // n_gpus_per_node],
                    placement_group_bundle_index=rank % n_gpus_per_node)

            ip, port = ray.get(ray.remote(num_cpus=0)(_rendezvous_address).options(
                scheduling_strategy=on(0)).remote(), timeout=timeout_s)
            threads = num_threads or default_num_threads(W)
            args = (W, f"tcp://{ip}:{port}", store_uri, config_json, assets_index, threads,
                    timeout_s)
            if detached is None:
                actor_cls = ray.remote(GroupWorker)
                self.actors = [
                    actor_cls.options(num_cpus=cpus, num_gpus=1 if use_gpu else 0,
                                      scheduling_strategy=on(r)).remote(r, *args)
                    for r in range(W)]
            else:
                actor_cls = ray.remote(max_restarts=0)(DetachedGroupWorker)
                self.actors = [
                    actor_cls.options(
                        num_cpus=cpus, num_gpus=1 if use_gpu else 0, scheduling_strategy=on(r),
                        name=self._name(r), namespace=detached.namespace, lifetime="detached",
                        runtime_env={"env_vars": detached.env} if detached.env else None,
                    ).remote(r, *args, idle_s=detached.idle_timeout_s)
                    for r in range(W)]
            self._wait([a.ready.remote() for a in self.actors], "start")
        except BaseException:
            self.shutdown()
            raise
        log.info("worker group of %d started (rendezvous %s:%d)", W, ip, port)

    def _name(self, rank: int) -> str:
        return f"{self.detached.prefix}-rank{rank}"

    def _adopt(self) -> bool:
        """Take over the run's detached workers if all W exist and answer; otherwise remove what
        is left of them (a partial group is useless: its process group lost a rank)."""
        import ray

        ns = self.detached.namespace
        found = []
        for r in range(self.world_size):
            try:
                found.append(ray.get_actor(self._name(r), namespace=ns))
            except ValueError:
                break
        if len(found) == self.world_size:
            self.actors = found
            try:
                ranks = ray.get([a.ready.remote() for a in found],
                                timeout=min(self.timeout_s, 60.0))
                if ranks == list(range(self.world_size)):
                    log.info("adopted the run's %d warm workers", self.world_size)
                    return True
            except Exception as e:  # noqa: BLE001 - dead or hung: replaced below
                log.warning("the run's detached workers do not answer (%s): replacing them", e)
        elif found:
            log.warning("only %d of the run's %d detached workers are alive: replacing them",
                        len(found), self.world_size)
        self.actors = found
        self.shutdown()
        return False

    def _wait(self, refs: list, what: str) -> list:
        """Results of ``refs`` (one per worker), failing fast: the first worker that dies or
        raises ends the wait, and so does the deadline."""
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        deadline = time.monotonic() + self.timeout_s
        pending = list(refs)
        try:
            while pending:
                left = deadline - time.monotonic()
                done, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, left))
                if not done:
                    raise GetTimeoutError(f"no answer within trainer.worker_timeout_s="
                                          f"{self.timeout_s:g}s")
                ray.get(done)  # raises the worker's error or its death at once
            return ray.get(list(refs))
        except (GetTimeoutError, RayActorError) as e:
            self.shutdown()
            raise WorkerLostError(f"worker group lost during {what}: {type(e).__name__}: {e}; "
                                  "the retry starts a new group") from e
        except BaseException:
            self.shutdown()  # the others may wait forever in a collective with the failed one
            raise

    def call(self, method: str, *args):
        return self._wait([a.call.remote(method, *args) for a in self.actors], method)[0]

    def close(self) -> None:
        """Orderly end of the run: close every worker (pending checkpoint writes finish)."""
        import ray

        try:
            ray.get([a.shutdown.remote() for a in self.actors], timeout=self.timeout_s)
            for a in self.actors:
                a.__ray_terminate__.remote()  # a clean exit, after the queued calls
            self.actors = []
        finally:
            self.shutdown()

    def shutdown(self) -> None:
        """Kill the actors and free their placement groups (idempotent)."""
        import ray
        from ray.util.placement_group import remove_placement_group

        for a in self.actors:
            try:
                ray.kill(a)
            except Exception as e:  # noqa: BLE001 - already gone
                log.debug("kill: %s", e)
        self.actors = []
        pgs = self._pgs
        if self.detached is not None:  # an adopted group's are known by name only
            pgs = run_placement_groups(f"{self.detached.namespace}/{self.detached.prefix}-")
        for pg in pgs:
            try:
                remove_placement_group(pg)
            except Exception as e:  # noqa: BLE001
                log.debug("remove placement group: %s", e)
        self._pgs = []


def run_placement_groups(prefix: str) -> list:
    """The placement groups (not removed) whose name starts with ``prefix``."""
    from ray.util.placement_group import PlacementGroup, placement_group_table
    from ray._raylet import PlacementGroupID

    return [PlacementGroup(PlacementGroupID(bytes.fromhex(pg_id)))
            for pg_id, info in placement_group_table().items()
            if info.get("name", "").startswith(prefix) and info.get("state") != "REMOVED"]
