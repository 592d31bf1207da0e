"""The run's workers, seen from the process that runs a phase: which worker holds the run
(:data:`WORKERS`: an in-process :class:`RunWorker`, a named Ray actor, a :class:`WorkerGroup`, or
the detached actors of an attached cluster), and :class:`RunWorkers`, the typed proxy every phase
calls them through, within the phase deadline and under the run's fence.

Either way the state is rebuilt from the store when the worker does not have it, so the store is
always enough. What does not belong here: what a phase does with the answers (``phases.py``).
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import logging
import os
from typing import Callable, Concatenate, ParamSpec, TypeVar

from verl_core.alarm import alarm
from verl_core.engine import cluster
from verl_core.engine.group import WorkerGroup, WorkerLostError
from verl_core.engine.worker import RunWorker
from verl_core.errors import PermanentError, TransientError
from verl_core.writer import run_fence
from verl_core.threads import intra_op_threads
from verl_core.types import RunSpec

log = logging.getLogger(__name__)
P = ParamSpec("P")
R = TypeVar("R")


class PhaseTimeoutError(TransientError):
    """A phase (or a call on the run's worker) passed its deadline, ``guard.phase_timeout_s``:
    a hang. The worker is replaced and the phase retried; the state is rebuilt from the store."""


def deadline(seconds: float, what: str):
    """Raise :class:`PhaseTimeoutError` in this thread if the block runs past ``seconds``.

    SIGALRM interrupts a Python-level wait (a sleep, a lock, a socket read, a Ray wait loop) at
    its next bytecode, which is what a hang of the driver looks like; calls on Ray workers have
    their own timeout as well (:func:`call`). Signals only reach the main thread: elsewhere the
    block runs without this deadline (the worker calls inside keep theirs)."""
    return alarm(seconds, lambda: PhaseTimeoutError(
        f"{what} passed its deadline of {seconds:.0f}s (guard.phase_timeout_s, and "
        "guard.restore_timeout_s for a new worker's first phase): a hang"))


def runs_on_this_host() -> bool:
    """Whether the run's Ray workers run on this machine (a local run: no RAY_ADDRESS, not a task
    of a Flyte cluster), so what they will import can be checked here."""
    return not (os.environ.get("RAY_ADDRESS") or os.environ.get("FLYTE_INTERNAL_EXECUTION_ID"))


def start_local_ray() -> None:
    """For local runs without RAY_ADDRESS: start the local Ray instance ourselves, lean (no
    dashboard or metrics agent, which take CPU from training on a small machine), before the
    Flyte Ray plugin's own ``ray.init`` (which then reuses it). On a cluster (or with
    RAY_ADDRESS) this does nothing.

    Ray turns token authentication on for a new local instance unless ``RAY_AUTH_MODE`` says
    otherwise, and warns about it at the top of every run. Token authentication stays on; only
    its notice is quieted (the logger of Ray's token set-up; its errors still show). Setting
    ``RAY_AUTH_MODE=token`` here instead would not do: Ray reads it when it is imported, and a
    driver that reads it later starts a GCS it cannot talk to.

    ``address="local"``: a new instance even where another one on this host was started with
    ``ray start`` (a bare ``ray.init()`` joins the newest such instance, whose owner may stop it
    under this run); joining a cluster is what RAY_ADDRESS and ``cluster.mode=attached`` say.

    ``prestart_worker_first_driver=False``: Ray would start one idle worker process per CPU as
    this driver connects (~0.6 s of CPU each, BENCHMARKS.md "The test suite on a fresh clone");
    a run uses one actor, or a group's W, and Ray starts a worker for each when it is created."""
    if not runs_on_this_host():
        return
    import ray

    if not ray.is_initialized():
        logging.getLogger("ray._private.authentication.authentication_token_setup").setLevel(
            logging.ERROR)
        ray.init(address="local", include_dashboard=False, configure_logging=False,
                 _system_config={"metrics_report_interval_ms": 60_000,
                                 "prestart_worker_first_driver": False})


def call(worker, method: str, *args, timeout_s: float | None = None):
    """``method`` on one worker handle: a group or an in-process worker directly (a group's waits
    have its own deadline; in-process, the phase deadline holds), a Ray actor within
    ``timeout_s`` (a hung actor is killed)."""
    if isinstance(worker, WorkerGroup):
        return worker.call(method, *args)
    if isinstance(worker, RunWorker):
        return getattr(worker, method)(*args)
    import ray

    ref = worker.call.remote(method, *args)
    try:
        return ray.get(ref, timeout=timeout_s)
    except ray.exceptions.RayTaskError as e:
        # Ray raises a copy that subclasses the worker's error class, or, when that class
        # cannot be subclassed (an __init__ with other arguments), a bare RayTaskError: then
        # the worker's own error goes on, so a permanent error is never taken for another kind
        cause = getattr(e, "cause", None)
        if isinstance(cause, (PermanentError, TransientError)) and not isinstance(e, type(cause)):
            raise cause from e
        raise
    except ray.exceptions.GetTimeoutError as e:
        ray.kill(worker)  # a hung actor would run the retry after the hung call: replace it
        raise PhaseTimeoutError(f"{method} on the run's worker did not answer within "
                                f"{timeout_s:.0f}s (guard.phase_timeout_s, and "
                                "guard.restore_timeout_s for a new worker's first phase); the "
                                "worker was killed") from e


def _kill_actor(worker) -> None:
    import ray

    try:
        ray.kill(worker)
    except Exception as e:  # noqa: BLE001 - it is being replaced either way
        log.debug("could not kill the failed worker: %s", e)


class Workers:
    """This process's handles on the runs' workers (one per :attr:`RunSpec.key`), and the fence
    last handed to each, so a fence costs one call per run and lease generation, not per phase."""

    def __init__(self) -> None:
        self._handles: dict[tuple, object] = {}
        self._fenced: dict[tuple, tuple] = {}  # key -> (worker, fence) last handed to it
        self._restored: set[tuple] = set()  # keys whose worker has answered a phase call

    def deadline_s(self, spec: RunSpec) -> float:
        """A phase's deadline on the run's worker: ``guard.phase_timeout_s``, plus
        ``guard.restore_timeout_s`` until the worker this process holds has answered a phase
        call. A new worker's first phase (the first of a launch, of a task's pod, after a hung or
        lost worker was replaced) also restores the state it starts from: its start-up, a
        checkpoint read, the updates since replayed. Counted against a phase's deadline, a
        restore longer than it would be a hang every time, and the run could never resume."""
        g = spec.config.guard
        restored = spec.key in self._restored and spec.key in self._handles
        return g.phase_timeout_s + (0.0 if restored else g.restore_timeout_s)

    def answered(self, spec: RunSpec) -> None:
        """The run's worker answered a phase call: its state is restored."""
        self._restored.add(spec.key)

    def handle(self, spec: RunSpec):
        """The run's worker, created on first use. With ``cluster.mode=attached`` the run's
        detached actors on the attached cluster (``engine.cluster``). Otherwise, with
        ``trainer.nnodes x trainer.n_gpus_per_node`` > 1 a :class:`WorkerGroup` (Ray actors,
        FSDP2; Ray is started locally if needed); else a Ray actor when Ray is initialised (kept
        alive for the whole run), else an in-process :class:`RunWorker`."""
        key = spec.key
        if key not in self._handles:
            index = json.loads(spec.assets_json)
            tc = spec.config.trainer
            if spec.config.cluster.mode == "attached":
                w = (cluster.group_workers(spec, index) if tc.world_size > 1
                     else cluster.single_worker(spec, index))
            elif tc.world_size > 1:
                if not cluster.connected():
                    start_local_ray()
                w = WorkerGroup(spec.store, spec.config_json, index, nnodes=tc.nnodes,
                                n_gpus_per_node=tc.n_gpus_per_node,
                                timeout_s=tc.worker_timeout_s,
                                num_threads=intra_op_threads(spec.config))
            elif cluster.connected():
                import ray

                cfg_id = hashlib.sha256(spec.config_json.encode()).hexdigest()[:12]
                name = f"verl-{spec.incarnation[:12]}-{cfg_id}"
                actor_cls = ray.remote(num_cpus=1)(cluster.RayRunWorker)
                w = actor_cls.options(name=name, get_if_exists=True).remote(
                    spec.store, spec.config_json, index, intra_op_threads(spec.config))
            else:
                w = RunWorker(spec.store, spec.config_json, index)
            self._handles[key] = w
        return self._handles[key]

    def held(self, spec: RunSpec):
        """The run's worker if this process holds one (None otherwise); creates nothing."""
        return self._handles.get(spec.key)

    def drop(self, spec: RunSpec):
        """Forget the run's worker (it is gone, or being replaced); returns it (or None)."""
        self._restored.discard(spec.key)
        return self._handles.pop(spec.key, None)

    def hand_fence(self, spec: RunSpec, worker) -> None:
        """Give the run's worker the fence its commits are made under (``RunWorker.set_fence``):
        once per worker and lease generation."""
        fence = run_fence(spec)
        sent = self._fenced.get(spec.key)
        if sent is not None and sent[0] is worker and sent[1] == fence:
            return
        call(worker, "set_fence", fence, timeout_s=self.deadline_s(spec))  # a new actor starts
        self._fenced[spec.key] = (worker, fence)

    def forget(self, spec: RunSpec) -> None:
        """Drop (and kill, if it is a Ray actor) the run's worker: after a hang its state and
        its queue are unknown; the next call starts a fresh one that rebuilds from the store."""
        w = self._handles.get(spec.key)
        self._restored.discard(spec.key)  # its replacement, or its rebuilt state, restores again
        if isinstance(w, RunWorker):
            w._live_valid = False  # in-process: interrupted mid-change, so rebuild the state
            return
        self._handles.pop(spec.key, None)
        if w is None:
            return
        try:
            if isinstance(w, WorkerGroup):
                w.close()
            else:
                import ray

                ray.kill(w)
        except Exception as e:  # noqa: BLE001 - it is being replaced either way
            log.warning("could not stop the hung worker: %s", e)

    def release(self, spec: RunSpec) -> None:
        """Close the run's workers (pending writes finish) and, in ``attached`` mode, remove
        every detached actor and placement group of the run from the cluster."""
        self._restored.discard(spec.key)
        w = self._handles.pop(spec.key, None)
        try:
            if isinstance(w, (RunWorker, WorkerGroup)):
                w.close()
            elif w is not None:
                import ray

                ray.get(w.call.remote("close"), timeout=spec.config.trainer.worker_timeout_s)
        finally:
            if spec.config.cluster.mode == "attached":
                removed = cluster.teardown(spec.incarnation)
                log.info("removed the run's detached workers: %s", ", ".join(removed) or "none")

    def release_all(self) -> None:
        """Close in-process workers and kill actors (end of a run, tests)."""
        for key, w in list(self._handles.items()):
            try:
                if isinstance(w, (RunWorker, WorkerGroup)):
                    w.close()
                else:
                    import ray

                    ray.get(w.call.remote("close"))
                    ray.kill(w)
            except Exception as e:  # noqa: BLE001
                log.warning("closing worker %s failed: %s", key, e)
            self._handles.pop(key, None)
        self._restored.clear()

    def reset(self) -> None:
        """Forget every handle without closing it (what a new process knows)."""
        self._handles.clear()
        self._fenced.clear()
        self._restored.clear()


WORKERS = Workers()


def _on_worker(method: Callable[Concatenate[RunWorker, P], R]
               ) -> Callable[Concatenate[RunWorkers, P], R]:
    """A :class:`RunWorkers` method that calls ``method`` on the run's worker, typed with that
    method's own signature (so the proxy cannot drift from the worker), under the run's fence and
    within ``guard.phase_timeout_s``. A dead or hung actor is forgotten and reported as a
    transient error (:class:`WorkerLostError`, :class:`PhaseTimeoutError`), so a retry gets a
    fresh one."""
    name, signature = method.__name__, inspect.signature(method)

    @functools.wraps(method)
    def on_worker(self: RunWorkers, *args: P.args, **kwargs: P.kwargs) -> R:
        spec, worker = self.spec, WORKERS.handle(self.spec)
        positional = signature.bind(None, *args, **kwargs).args[1:]  # what a Ray call carries
        try:
            WORKERS.hand_fence(spec, worker)  # it commits only while this launch holds the lease
            out = call(worker, name, *positional, timeout_s=WORKERS.deadline_s(spec))
            WORKERS.answered(spec)
            return out
        except (WorkerLostError, PhaseTimeoutError):
            WORKERS.drop(spec)  # the worker is gone: the retry starts a new one
            raise
        except Exception as e:
            if isinstance(worker, WorkerGroup) or getattr(e, "worker_init_failed", False):
                # a group tore itself down when the error surfaced; an actor whose construction
                # failed (cluster.RayRunWorker) is useless: a retry gets a new one
                WORKERS.drop(spec)
                if not isinstance(worker, (WorkerGroup, RunWorker)):
                    _kill_actor(worker)
            if type(e).__name__ in ("RayActorError", "ActorDiedError", "ActorUnavailableError"):
                WORKERS.drop(spec)
                raise WorkerLostError(f"the run's worker died during {name}: {e}") from e
            raise

    return on_worker


class RunWorkers:
    """The run's worker(s) as typed methods: each is :class:`RunWorker`'s method of the same name
    (its signature and docstring), called where the run's worker lives (this process, a Ray
    actor, a worker group, an attached cluster: :meth:`Workers.handle`), created on first use."""

    def __init__(self, spec: RunSpec):
        self.spec = spec

    rollout = _on_worker(RunWorker.rollout)
    update = _on_worker(RunWorker.update)
    evaluate = _on_worker(RunWorker.evaluate)
    checkpoint = _on_worker(RunWorker.checkpoint)
    score_with_model = _on_worker(RunWorker.score_with_model)
    restore_batch = _on_worker(RunWorker.restore_batch)
    commit_final = _on_worker(RunWorker.commit_final)
    scrub = _on_worker(RunWorker.scrub)
    export_final = _on_worker(RunWorker.export_final)
    ensure_state = _on_worker(RunWorker.ensure_state)
    wait_checkpoints = _on_worker(RunWorker.wait_checkpoints)
    version = _on_worker(RunWorker.version)
