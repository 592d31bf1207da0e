"""Where and how phases run: run preparation, the run's workers, retries, deadlines, the guard's
wall-clock detectors, the phase log and metrics.

Everything here is plain Python (no flytekit). The typed phase functions that ``tasks/`` call are
:mod:`verl_core.phases`, built on these; tests call both. A phase takes a :class:`RunSpec` (which
pins the physical store, its incarnation, the typed config and the assets) plus refs into the
store, and returns refs into the store plus float metrics.

Where compute runs: with Ray initialised (the Flyte Ray tasks start or join a cluster), the
heavy phases call a named Ray actor that keeps the :class:`RunWorker` warm between phases;
without Ray they use an in-process worker. Either way the state is rebuilt from the store when
the worker does not have it, so the store is always enough.
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import hashlib
import json
import logging
import os
import random
import socket
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Callable, TypeVar

from verl_core.alarm import alarm
from verl_core.checkpoint.hf_export import publish_export
from verl_core.checkpoint.manager import CheckpointManager
from verl_core.errors import (CorruptObjectError, PermanentError, TransientError,
                              UnsafeManifestError)
from verl_core.store import RunStore, check_doc_name
from verl_core.threads import intra_op_threads, pin_num_threads
from verl_core.config import ConfigError, RunConfig
from verl_core.engine import cluster
from verl_core.engine.assets import (GIVEN_KINDS, check_pinned, index_assets,
                                     materialize_assets, publish_assets, record_assets,
                                     unpublish_assets)
from verl_core.engine.group import WorkerGroup, WorkerLostError  # noqa: F401 (re-exported)
from verl_core.engine.worker import (RunWorker, checkpoint_due, eval_samples_doc, get_batch,
                                     pending_doc, put_batch)
from verl_core.guard import faults
from verl_core.guard.events import read_events
from verl_core.guard.lease import Fence, LeaseHeldError, RunLease
from verl_core.models import load_tokenizer
from verl_core.reward.manager import RewardScorer
from verl_core.tracking import Trackers, default_run_name, flat_params
from verl_core.trainer import compute_advantages, prepare_assets, score_batch
from verl_core.validation import check_run_inputs, validate_and_record

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class RunSpec:
    """Everything that identifies a prepared run. Every phase takes it as an input, so Flyte's
    cache keys are scoped to the physical store (its incarnation id): a deleted and re-created
    store misses the cache instead of hitting entries that point at deleted data."""

    store: str
    """URI of this run's store (``<--store>/<--run-name>``)."""
    incarnation: str
    """Random id written when the store was created."""
    config: RunConfig
    """The validated config (a Flyte dataclass literal: typed, and part of every cache key)."""
    config_hash: str
    """:meth:`RunConfig.trajectory_hash` (names checkpoints, lineage and metrics)."""
    assets_json: str
    """Index of the model/dataset objects in the store."""
    start_step: int
    """Step the loop starts at (> 0 when resuming from a checkpoint)."""
    total_steps: int
    """Step the loop ends at."""

    @property
    def config_json(self) -> str:
        """The config as canonical JSON: what the workers are built from, and what names them."""
        return _config_json(self.config)

    def to_json(self) -> str:
        """Canonical JSON of the whole spec (what crosses Flyte task boundaries), the config as
        the fields that differ from the defaults (:meth:`RunConfig.non_default`): what the user
        set is what the console shows, and the literal is ~3x shorter (flytekit formats every
        task input into two log lines in a local run: BENCHMARKS.md "Small costs"). The
        literal still changes whenever the config does; ``config_hash`` covers every field
        of the trajectory, defaults included."""
        return self._json

    @functools.cached_property
    def _json(self) -> str:
        # computed once per spec (frozen, so it cannot go stale): every task input of a run
        # converts the same spec, and walking the ~180 config fields each time showed in the step
        return json.dumps({**{f.name: getattr(self, f.name) for f in dataclasses.fields(self)},
                           "config": self.config.non_default()},
                          sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> "RunSpec":
        d = json.loads(text)
        return cls(**{**d, "config": RunConfig.from_dict(d["config"])})

    def open_store(self) -> RunStore:
        return _store(self.store)


@functools.lru_cache(maxsize=32)
def _config_json(cfg: RunConfig) -> str:
    """Canonical JSON of a config, once per process (RunConfig is frozen and hashable)."""
    return json.dumps(cfg.to_dict(), sort_keys=True)


_STORES: dict[str, RunStore] = {}


def _store(uri: str) -> RunStore:
    if uri not in _STORES:
        _STORES[uri] = RunStore(uri)
    return _STORES[uri]


# ---------------------------------------------------------------------- preparation
def run_store_uri(store: str, run_name: str) -> str:
    """``<store>/<run_name>``. The name becomes a path segment on every store and in Ray actor
    names, so it is held to the rule its error states (the store's doc-segment rule): a space,
    ``\\``, a newline, non-ASCII or ``..`` would each mean something else to some filesystem."""
    try:
        ok = isinstance(run_name, str) and "/" not in run_name and bool(check_doc_name(run_name))
    except UnsafeManifestError:
        ok = False
    if not ok:
        raise ConfigError(f"--run-name {run_name!r}: use a plain name (letters, digits, - _ .): "
                          "ASCII only, at most 200 characters, starting with a letter, a digit "
                          "or _, no '..'")
    base = store or os.environ.get("VERL_STORE") or os.path.join(os.getcwd(), "runs")
    return f"{base.rstrip('/')}/{run_name}"


def prepare_run(cfg: RunConfig, store: str, run_name: str, log_fn=print) -> RunSpec:
    """Validate data and model, publish the assets into the run store, pick the start step.

    Every permanent check runs first, before the warm start and before anything is copied
    (:func:`~verl_core.validation.check_run_inputs`). A trajectory that ran before trains on the
    assets it recorded then: a file the user gave that changed since is refused
    (:func:`~verl_core.engine.assets.check_pinned`), and generated assets come from the record,
    so the reference model is always the one the run started from."""
    uri = run_store_uri(store, run_name)
    if cfg.cluster.mode == "attached":
        cluster.address(cfg.cluster)  # no cluster to attach to: refused before any work
    st = _store(uri)
    _hold(st, cfg.guard.lease_ttl_s)  # a second launch of this run fails here, before any work
    check_run_inputs(cfg)
    # the thread count every worker of the run computes with, recorded at its first prepare
    cfg = pin_num_threads(st, cfg)
    h = cfg.trajectory_hash()
    with tempfile.TemporaryDirectory(prefix="verl-prepare-") as work:
        # checks every dataset file (rows, columns, prompt lengths) before the warm start
        assets = prepare_assets(cfg, work, log=log_fn)
        indexed = index_assets(assets)
        index, _, sources = indexed
        given = tuple(k for k, on in zip(GIVEN_KINDS, (
            cfg.model.path, cfg.data.train_files, cfg.data.train_files, cfg.reward_model.enable))
            if on)
        pinned = check_pinned(st, h, given, sources, index, cfg.data.assets_id)
        # only an index this prepare created is undone on failure (another trajectory of the
        # run may share it)
        published = pinned is None and not st.has_json(f"assets/{index['id']}")
        index = pinned or publish_assets(st, assets, indexed=indexed)
    try:
        start = resume_step(st, cfg)
        if pinned is None:
            record_assets(st, h, index, sources)
    except BaseException:
        if published:
            unpublish_assets(st, index)  # a failed prepare keeps nothing alive
        raise
    if start:
        log_fn(f"resuming from the checkpoint of step {start} in {uri}")
    return RunSpec(store=st.uri, incarnation=st.incarnation_id, config=cfg,
                   config_hash=h,
                   assets_json=json.dumps(index, sort_keys=True),
                   start_step=min(start, cfg.total_steps), total_steps=cfg.total_steps)


def resume_step(st: RunStore, cfg: RunConfig) -> int:
    """``resume_from_checkpoint=auto``: the step of the newest checkpoint of this config that
    verifies (hash check); 0 when there is none or resume is ``none``."""
    spec = cfg.checkpoint.resume_from_checkpoint
    if spec in ("none", ""):
        return 0
    if spec != "auto":  # an explicit checkpoint: it must exist and verify, or we fail now
        from verl_core.checkpoint.manager import open_checkpoint

        mgr, ref = open_checkpoint(spec, st.storage_options)
        problems = mgr.verify(ref)
        if problems:
            raise ValueError(f"checkpoint.resume_from_checkpoint={spec!r} does not verify: "
                             + "; ".join(problems[:5]))
        return mgr.read_manifest(ref)[0].step
    mgr = CheckpointManager(st)
    h = cfg.trajectory_hash()
    for info in sorted(mgr.list_checkpoints(), key=lambda i: i.step, reverse=True):
        if info.error is None and info.config_hash == h and not mgr.verify(info.name):
            return info.step
        log.warning("checkpoint %s not usable for resume", info.name)
    return 0


# ---------------------------------------------------------------------- the writer lease
_LEASES: dict[tuple, RunLease] = {}
_LEASES_LOCK = threading.Lock()


def _hold(st: RunStore, ttl_s: float) -> RunLease | None:
    """Take or renew this process's writer lease on ``st`` (None when ``ttl_s`` is 0: no lease).
    One :class:`RunLease` (and renewal thread) per store and ttl in a process. A lease renewed
    within the last ``ttl_s / 3`` is only checked (:meth:`RunLease.hold`)."""
    if not ttl_s:
        return None
    with _LEASES_LOCK:
        lease = _LEASES.get((st.uri, ttl_s))
        if lease is None:
            lease = _LEASES[(st.uri, ttl_s)] = RunLease(st, ttl_s)
    lease.hold()
    faults.set_second_writer_hook(lambda f: _second_writer_drill(st, ttl_s))
    return lease


def _release_leases_at_exit() -> None:
    """A process that is the writer (not one pod of a Flyte execution, whose next pod carries
    on) frees its leases when it exits, even after a failure: a relaunch on any host may start at
    once instead of waiting for the expiry. (SIGKILL skips this; the same-host check covers it.)"""
    me = f"{socket.gethostname()}:{os.getpid()}"
    for lease in list(_LEASES.values()):
        if lease.owner != me:  # a Flyte execution's lease, or one a forked child inherited
            continue
        try:
            lease.release()
        except Exception as e:  # noqa: BLE001 - exiting anyway; the lease expires by itself
            log.warning("releasing the lease of %s at exit failed: %s", lease.store.uri, e)


atexit.register(_release_leases_at_exit)


def hold_lease(spec: RunSpec) -> None:
    """At the start of every phase: renew this run's single-writer lease, or take it (a new pod
    of the same Flyte execution, the first phase after a relaunch). Raises
    :class:`~verl_core.guard.lease.LeaseHeldError` (permanent) naming the holder when another
    launch of the run holds it; a no-op with ``guard.lease_ttl_s=0``."""
    _hold(spec.open_store(), spec.config.guard.lease_ttl_s)


def release_lease(spec: RunSpec) -> None:
    """Give the run's lease up (end of the run): the next launch takes it at once."""
    ttl_s = spec.config.guard.lease_ttl_s
    with _LEASES_LOCK:
        lease = _LEASES.pop((spec.store, ttl_s), None)
    if lease is not None:
        lease.release()
        faults.set_second_writer_hook(None)  # no lease held: the drill reports that


def run_fence(spec: RunSpec) -> Fence | None:
    """The :class:`~verl_core.guard.lease.Fence` of this process's hold on the run's lease: what
    the run's workers commit under (None without a lease: ``guard.lease_ttl_s=0``, or none taken
    in this process). Raises :class:`~verl_core.guard.lease.LeaseLostError` if it was lost."""
    with _LEASES_LOCK:
        lease = _LEASES.get((spec.store, spec.config.guard.lease_ttl_s))
    return lease.fence() if lease is not None else None


def commit_fence(spec: RunSpec) -> Callable[[str], None] | None:
    """The fence check for a commit this process makes itself (finalize's export): called with
    what is committed, it raises unless this launch still holds the run (None: no lease)."""
    fence = run_fence(spec)
    return None if fence is None else functools.partial(fence.check, spec.open_store())


_FENCED: dict[tuple, tuple] = {}  # worker key -> (worker, fence) last handed to that worker


def _hand_fence(spec: RunSpec, worker) -> None:
    """Give the run's worker the fence its commits are made under (``RunWorker.set_fence``):
    once per worker and lease generation, so it costs one call per run, not per phase."""
    fence = run_fence(spec)
    key = _worker_key(spec)
    sent = _FENCED.get(key)
    if sent is not None and sent[0] is worker and sent[1] == fence:
        return
    call(worker, "set_fence", fence, timeout_s=spec.config.guard.phase_timeout_s)
    _FENCED[key] = (worker, fence)


def _second_writer_drill(st: RunStore, ttl_s: float) -> None:
    """The ``second_writer`` fault (VERL_FAULTS): another writer tries to take the lease this
    process holds; it must be refused."""
    intruder = RunLease(st, ttl_s, owner=f"second-writer-drill:{os.getpid()}")
    try:
        intruder.acquire()
    except LeaseHeldError as e:
        log.warning("VERL_FAULTS second_writer: refused, as it must be: %s", e)
        return
    intruder.release()
    raise faults.InjectedPermanentFault(f"second_writer fault: a second writer was admitted to "
                                        f"{st.uri} while this run held its lease")


# ---------------------------------------------------------------------- workers
_WORKERS: dict[tuple, object] = {}


def _worker_key(spec: RunSpec) -> tuple:
    return (spec.store, spec.incarnation, spec.config_json)


def worker_for(spec: RunSpec):
    """A callable-style handle: ``call(worker, "rollout", step)``. With ``cluster.mode=attached``
    the run's detached actors on the attached cluster (``engine.cluster``). Otherwise, with
    ``trainer.nnodes x trainer.n_gpus_per_node`` > 1 a :class:`WorkerGroup` (Ray actors, FSDP2;
    Ray is started locally if needed); else a Ray actor when Ray is initialised (kept alive for
    the whole run), else an in-process :class:`RunWorker`."""
    key = _worker_key(spec)
    if key not in _WORKERS:
        index = json.loads(spec.assets_json)
        tc = spec.config.trainer
        if spec.config.cluster.mode == "attached":
            _WORKERS[key] = (cluster.group_workers(spec, index) if tc.world_size > 1
                             else cluster.single_worker(spec, index))
        elif tc.world_size > 1:
            if not cluster.connected():
                start_local_ray()
            _WORKERS[key] = WorkerGroup(spec.store, spec.config_json, index, nnodes=tc.nnodes,
                                        n_gpus_per_node=tc.n_gpus_per_node,
                                        timeout_s=tc.worker_timeout_s,
                                        num_threads=intra_op_threads(spec.config))
        elif cluster.connected():
            import ray

            cfg_id = hashlib.sha256(spec.config_json.encode()).hexdigest()[:12]
            name = f"verl-{spec.incarnation[:12]}-{cfg_id}"
            actor_cls = ray.remote(num_cpus=1)(cluster.RayRunWorker)
            _WORKERS[key] = actor_cls.options(name=name, get_if_exists=True).remote(
                spec.store, spec.config_json, index, intra_op_threads(spec.config))
        else:
            _WORKERS[key] = RunWorker(spec.store, spec.config_json, index)
    return _WORKERS[key]


class PhaseTimeoutError(TransientError):
    """A phase (or a call on the run's worker) passed its deadline, ``guard.phase_timeout_s``:
    a hang. The worker is replaced and the phase retried; the state is rebuilt from the store."""


def call(worker, method: str, *args, timeout_s: float | None = None):
    if isinstance(worker, WorkerGroup):
        return worker.call(method, *args)  # every wait has the group's own deadline
    if isinstance(worker, RunWorker):
        return getattr(worker, method)(*args)  # in-process: the phase deadline (SIGALRM) holds
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
                                f"{timeout_s:.0f}s (guard.phase_timeout_s); the worker was "
                                "killed") from e


def call_worker(spec: RunSpec, method: str, *args):
    """``method`` on the run's worker (created on first use), within ``guard.phase_timeout_s``.
    A dead or hung actor is forgotten and reported as a transient error (:class:`WorkerLostError`,
    :class:`PhaseTimeoutError`), so a retry gets a fresh one."""
    worker = worker_for(spec)
    try:
        _hand_fence(spec, worker)  # it commits only while this launch holds the run's lease
        return call(worker, method, *args, timeout_s=spec.config.guard.phase_timeout_s)
    except (WorkerLostError, PhaseTimeoutError):
        _WORKERS.pop(_worker_key(spec), None)  # the worker is gone: the retry starts a new one
        raise
    except Exception as e:
        if isinstance(worker, WorkerGroup) or getattr(e, "worker_init_failed", False):
            # a group tore itself down when the error surfaced; an actor whose construction
            # failed (cluster.RayRunWorker) is useless: the retry of a transient one gets a new one
            _WORKERS.pop(_worker_key(spec), None)
            if not isinstance(worker, (WorkerGroup, RunWorker)):
                _kill_actor(worker)
        if type(e).__name__ in ("RayActorError", "ActorDiedError", "ActorUnavailableError"):
            _WORKERS.pop(_worker_key(spec), None)
            raise WorkerLostError(f"the run's worker died during {method}: {e}") from e
        raise


def _kill_actor(worker) -> None:
    import ray

    try:
        ray.kill(worker)
    except Exception as e:  # noqa: BLE001 - it is being replaced either way
        log.debug("could not kill the failed worker: %s", e)


def start_local_ray() -> None:
    """For local runs without RAY_ADDRESS: start the local Ray instance ourselves, lean (no
    dashboard or metrics agent, which take CPU from training on a small machine), before the
    Flyte Ray plugin's own ``ray.init`` (which then reuses it). On a cluster (or with
    RAY_ADDRESS) this does nothing.

    Ray turns token authentication on for a new local instance unless ``RAY_AUTH_MODE`` says
    otherwise, and warns about it at the top of every run. Token authentication stays on; only
    its notice is quieted (the logger of Ray's token set-up; its errors still show). Setting
    ``RAY_AUTH_MODE=token`` here instead would not do: Ray reads it when it is imported, and a
    driver that reads it later starts a GCS it cannot talk to."""
    if os.environ.get("RAY_ADDRESS") or os.environ.get("FLYTE_INTERNAL_EXECUTION_ID"):
        return
    import ray

    if not ray.is_initialized():
        logging.getLogger("ray._private.authentication.authentication_token_setup").setLevel(
            logging.ERROR)
        ray.init(include_dashboard=False, configure_logging=False,
                 _system_config={"metrics_report_interval_ms": 60_000})


def release_run_workers(spec: RunSpec) -> None:
    """Close the run's workers (pending writes finish) and, in ``attached`` mode, remove every
    detached actor and placement group of the run from the cluster."""
    w = _WORKERS.pop(_worker_key(spec), None)
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


def release_workers() -> None:
    """Close in-process workers and kill actors (end of a run, tests)."""
    for key, w in list(_WORKERS.items()):
        try:
            if isinstance(w, (RunWorker, WorkerGroup)):
                w.close()
            else:
                import ray

                ray.get(w.call.remote("close"))
                ray.kill(w)
        except Exception as e:  # noqa: BLE001
            log.warning("closing worker %s failed: %s", key, e)
        _WORKERS.pop(key, None)
    while _TRACKERS:
        _TRACKERS.popitem()[1].close()


# ---------------------------------------------------------------------- light phases
_LIGHT: dict[tuple, tuple] = {}


def _light(spec: RunSpec):
    key = _worker_key(spec)
    if key not in _LIGHT:
        cfg = spec.config
        # the reward and advantage math of this process (batch-wide sums) with the run's count
        import torch

        torch.set_num_threads(intra_op_threads(cfg))
        assets = materialize_assets(spec.open_store(), json.loads(spec.assets_json))
        scorer = RewardScorer.from_config(cfg.reward)
        _LIGHT[key] = (load_tokenizer(assets.model_path), scorer, cfg)
    return _LIGHT[key]


def _input_batch(spec: RunSpec, step: int, phase: str, ref: str):
    """The batch ``ref`` that ``phase`` of ``step`` wrote, read by a light phase; a damaged or
    missing one is recomputed by the run's worker (``RunWorker.batch``: bit-identical or a
    clear error), since a cache hit upstream may point at it."""
    st = spec.open_store()
    try:
        return get_batch(st, ref)
    except CorruptObjectError as e:
        log.warning("%s; asking the run's worker to recompute it", e)
        call_worker(spec, "restore_batch", step, phase, ref)
        return get_batch(st, ref)


def reward_phase(spec: RunSpec, step: int, batch_ref: str) -> tuple[str, dict]:
    """Score the rollout batch ``batch_ref``. Rule and custom scorers run here (light); with
    ``reward_model.enable`` the run's worker(s) score it (``RunWorker.score_with_model``), where
    the reward model lives next to the policy, and write the batch."""
    t0 = time.perf_counter()
    st = spec.open_store()
    batch = ref = None
    if spec.config.reward_model.enable:
        ref, metrics = call_worker(spec, "score_with_model", step, batch_ref)
    else:
        tok, scorer, _ = _light(spec)
        batch, metrics = score_batch(_input_batch(spec, step, "rollout", batch_ref), scorer,
                                     tok)
    if faults.take("nan_reward", "reward", step):  # a VERL_FAULTS drill; None otherwise
        batch = get_batch(st, ref) if batch is None else batch
        score = batch.score.clone()
        score[0] = float("nan")
        batch, ref = batch.replace(score=score), None
    validate_and_record(st, spec.config_hash, step, "reward", batch or get_batch(st, ref),
                        spec.config)
    if ref is None:
        ref = put_batch(st, batch, pending=pending_doc(spec.config_hash, step, "reward"))
    metrics["timing/reward_s"] = time.perf_counter() - t0
    return ref, metrics


def advantage_phase(spec: RunSpec, step: int, batch_ref: str) -> tuple[str, dict]:
    t0 = time.perf_counter()
    _, _, cfg = _light(spec)
    st = spec.open_store()
    batch, metrics = compute_advantages(_input_batch(spec, step, "reward", batch_ref),
                                        cfg.algorithm)
    validate_and_record(st, spec.config_hash, step, "advantage", batch, cfg)
    ref = put_batch(st, batch, pending=pending_doc(spec.config_hash, step, "advantage"))
    metrics["timing/advantage_s"] = time.perf_counter() - t0
    return ref, metrics


def checkpoint_phase(spec: RunSpec, step: int) -> dict:
    """The checkpoint phase of the state after ``step`` updates: the run's worker saves it
    (``RunWorker.checkpoint``). When it is not due (:func:`checkpoint_due`: off the step
    schedule, no time-based interval) there is nothing to save and the answer is the worker's
    own no-save answer, given here without a call on the worker (the workflow leaves the phase
    out on those steps; a direct caller still gets the right answer)."""
    if not checkpoint_due(spec.config, step):
        return {"checkpoint/saved": 0.0}
    return call_worker(spec, "checkpoint", step)


# ---------------------------------------------------------------------- deadlines + guard
def deadline(seconds: float, what: str):
    """Raise :class:`PhaseTimeoutError` in this thread if the block runs past ``seconds``.

    SIGALRM interrupts a Python-level wait (a sleep, a lock, a socket read, a Ray wait loop) at
    its next bytecode, which is what a hang of the driver looks like; calls on Ray workers have
    their own timeout as well (:func:`call`). Signals only reach the main thread: elsewhere the
    block runs without this deadline (the worker calls inside keep theirs)."""
    return alarm(seconds, lambda: PhaseTimeoutError(
        f"{what} passed its deadline of {seconds:.0f}s (guard.phase_timeout_s): a hang"))


def forget_workers(spec: RunSpec) -> None:
    """Drop (and kill, if it is a Ray actor) the run's worker: after a hang its state and its
    queue are unknown; the next call starts a fresh one that rebuilds from the store."""
    w = _WORKERS.pop(_worker_key(spec), None)
    if w is None or isinstance(w, RunWorker):
        if w is not None:
            w._live_valid = False  # in-process: interrupted mid-change, so rebuild the state
            _WORKERS[_worker_key(spec)] = w
        return
    try:
        if isinstance(w, WorkerGroup):
            w.close()
        else:
            import ray

            ray.kill(w)
    except Exception as e:  # noqa: BLE001 - it is being replaced either way
        log.warning("could not stop the hung worker: %s", e)


_TIMING: dict[tuple, list[dict]] = {}  # (store, trajectory) -> wall-clock history of this process


def watch_phase(spec: RunSpec, phase: str, step: int, seconds: float, metrics: dict) -> None:
    """The wall-clock detectors (latency spike, throughput drop, accelerator utilisation drop)
    on a finished phase, against this process's recent history of the same phase. Their events
    go to the store; ``retry_phase`` and ``halt`` raise (``warn`` only logs). A fresh process
    starts with an empty history, so these detectors warm up again after a restart."""
    cfg = spec.config.guard
    from verl_core.guard import detectors, policy

    if not cfg.enabled or phase not in detectors.PHASES:  # the four phases of a step
        return
    from verl_core.guard.events import make_event, record_event
    from verl_core.guard.checks import TIMING

    current = {f"timing/{phase}_s": float(seconds)}
    for k in ("rollout/tokens_per_s", "rollout/time_s", "gpu/utilization"):
        if k in metrics:
            current[k] = float(metrics[k])
    if "gpu/utilization" not in current:
        util = detectors.gpu_utilization()
        if util is not None:
            current["gpu/utilization"] = util
    history = _TIMING.setdefault((spec.store, spec.config_hash, phase), [])
    found = [a for a in detectors.detect(phase, step, current, history, cfg)
             if a.detector in TIMING]
    history.append({"step": step, **current})
    del history[:-256]
    decision = policy.decide(found, {}, cfg)
    if not decision.fired:
        return
    outcome = {"warn": "logged", "retry_phase": "retrying", "halt": "halted"}[decision.action]
    st = spec.open_store()
    for a in decision.anomalies:
        log.warning("guard: step %d %s: %s -> %s", step, a.detector, a.message, decision.action)
        record_event(st, spec.config_hash, make_event(
            step=step, phase=phase, detector=a.detector, action=decision.action, outcome=outcome,
            signal=a.signal, value=a.value, threshold=a.threshold, message=a.message))
    if decision.action == "halt":
        raise policy.GuardHaltError(policy.halt_report(decision, step, phase))
    if decision.action == "retry_phase":
        history.pop()  # the retry's time replaces this one
        raise policy.GuardRetryError(f"guard: retrying {phase} of step {step}: "
                                     + "; ".join(a.message for a in decision.anomalies))


def step_events(spec: RunSpec, step: int) -> list[dict]:
    """The guard events of RL step ``step`` (0-based), oldest first."""
    from verl_core.guard.events import read_events

    return read_events(spec.open_store(), spec.config_hash, step)


# ---------------------------------------------------------------------- retries + log
def with_retries(fn: Callable[[], T], *, what: str, attempts: int = 3, backoff_s: float = 1.0,
                 sleep=time.sleep) -> T:
    """Run ``fn``; retry :class:`TransientError` (storage I/O, a dead worker) up to ``attempts``
    times with exponential backoff and jitter, then re-raise. Anything else fails at once.

    Flyte applies ``retries=`` only on a cluster; this is the same policy for local runs."""
    for attempt in range(1, attempts + 1):
        try:
            return fn()
        except TransientError as e:
            if attempt == attempts:
                raise
            delay = backoff_s * 2 ** (attempt - 1) * (1 + 0.25 * random.random())
            log.warning("%s: transient failure (%s), attempt %d/%d, retrying in %.1fs",
                        what, e, attempt, attempts, delay)
            sleep(delay)
    raise AssertionError("unreachable")


def log_phase(spec: RunSpec, phase: str, step: int, metrics: dict | None = None,
              started: float | None = None) -> None:
    """Append one record to the run store's phase execution log (only executed phases write:
    a cache hit never runs the task body). ``time`` is when the phase body finished."""
    rec = {"phase": phase, "step": step, "time": time.time(), "started": started, "pid": os.getpid(),
           "host": socket.gethostname(), "config_hash": spec.config_hash[:16]}
    if metrics:
        rec["metrics"] = {k: float(v) for k, v in metrics.items()}
    spec.open_store().append_log("phases", rec)


def read_phase_log(store_uri: str) -> list[dict]:
    return _store(store_uri).read_log("phases")


# ---------------------------------------------------------------------- metrics + final
def record_step_metrics(spec: RunSpec, step: int, metrics: dict) -> None:
    """Append the finished step's metrics to the run store (the per-step table's source), and
    the same scalars to the trackers switched on in ``tracking`` (TensorBoard, MLflow). The
    guard's event counts of the step join them (``guard/anomalies``, ``guard/<action>``)."""
    from verl_core.guard.events import event_metrics

    guard = event_metrics(step_events(spec, step - 1)) if step > 0 else {}
    record = {"step": step, "time": time.time(),
              **{k: float(v) for k, v in {**metrics, **guard}.items()}}
    spec.open_store().append_log(f"metrics-{spec.config_hash[:16]}", record)
    trackers = trackers_for(spec)
    if trackers.enabled:
        trackers.log(step, record, walltime=record["time"])


_TRACKERS: dict[tuple, Trackers] = {}


def trackers_for(spec: RunSpec) -> Trackers:
    """The run's trackers in this process (opened on first use, kept open). One MLflow run per
    physical store and trajectory: every phase process finds it again by that key."""
    key = _worker_key(spec)
    if key not in _TRACKERS:
        cfg = spec.config
        _TRACKERS[key] = Trackers(cfg.tracking, run_name=default_run_name(spec.store),
                                  config_hash=spec.config_hash,
                                  run_key=f"{spec.config_hash[:16]}-{spec.incarnation[:16]}",
                                  params=flat_params(cfg.to_dict()))
    return _TRACKERS[key]


def eval_samples(spec: RunSpec, step: int) -> list[dict]:
    """The held-out samples the evaluation of the state after ``step`` updates stored, each with
    its ``step`` ([] when that evaluation stored none)."""
    doc = spec.open_store().get_json(eval_samples_doc(spec.config_hash, step), default=None)
    return [{"step": step, **s} for s in doc["samples"]] if doc else []


def guard_events(spec: RunSpec) -> list[dict]:
    """Every guard event of this trajectory, oldest step first (one step: :func:`step_events`)."""
    return read_events(spec.open_store(), spec.config_hash)


def metrics_table(spec: RunSpec):
    """Per-step metrics as a DataFrame (the last record of a step wins: a phase re-run after a
    crash appends again)."""
    import pandas as pd

    rows = spec.open_store().read_log(f"metrics-{spec.config_hash[:16]}")
    if not rows:
        return pd.DataFrame({"step": []})
    df = pd.DataFrame(rows).sort_values(["step", "time"])
    # one row per step: the newest non-null value of each column (evaluation writes its own
    # record for a step; a phase re-run after a crash appends again)
    return df.groupby("step", as_index=False).last()


def finalize_run(spec: RunSpec, step: int) -> dict:
    """Make sure the final checkpoint committed (re-saving it if its write was lost), export the
    final policy as a Hugging Face folder into the store, and write the metrics table next to it."""
    import fsspec

    call_worker(spec, "commit_final", step)  # the final checkpoint is committed, or we fail here
    # every checkpoint of the run verified (re-hashed); a damaged one is rebuilt and saved again
    scrubbed = call_worker(spec, "scrub", step)
    st = spec.open_store()
    tag = f"{spec.config_hash[:12]}-step{step:06d}"
    with tempfile.TemporaryDirectory(prefix="verl-export-") as tmp:
        call_worker(spec, "export_final", step, tmp)
        final_uri = f"{st.uri}/exports/{tag}"
        fs, path = fsspec.core.url_to_fs(final_uri, **st.storage_options)
        # renamed into place (local) or config.json + marker last (S3), under the run's lease
        publish_export(tmp, fs, path, fence=commit_fence(spec))
    df = metrics_table(spec)
    table_uri = f"{st.uri}/metrics/{spec.config_hash[:12]}.parquet"
    fs, path = fsspec.core.url_to_fs(table_uri, **st.storage_options)
    fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
    with fs.open(path, "wb") as f:
        df.to_parquet(f, index=False)
    rewards = df["reward/mean"].dropna().tolist() if "reward/mean" in df else []
    rewards = rewards or [float("nan")]
    if spec.config.cluster.mode == "attached":
        release_run_workers(spec)  # the run's detached actors and placement groups go now
    release_lease(spec)  # the run is complete: a relaunch (or another run) may write now
    return {"final_model": final_uri, "metrics_table": table_uri,
            "first_reward": float(rewards[0]), "last_reward": float(rewards[-1]), **scrubbed}
