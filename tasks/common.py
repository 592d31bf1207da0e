"""What every phase task shares: cache versions, the Ray config, retries, progress printing."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from typing import Callable, TypeVar

from flytekit import Cache
from flytekit.exceptions.user import FlyteRecoverableException
from flytekitplugins.ray import HeadNodeConfig, RayJobConfig, WorkerNodeConfig

import verl_core
from verl_core.checkpoint.errors import TransientError
from verl_core.engine import runtime
from verl_core.engine.runtime import RunSpec
from verl_core.guard.events import event_line
from verl_core.guard.faults import maybe_inject

T = TypeVar("T")

# Every Ray task re-enters ray.init (the plugin does it); Ray logs each re-entry at INFO, which
# would bury the progress lines. Warnings still show.
logging.getLogger("ray").setLevel(logging.WARNING)

# Bump one phase's entry when its behaviour changes; a package version bump invalidates all.
PHASE_VERSIONS = {"prepare": "2", "rollout": "1", "reward": "2", "advantage": "1",
                  "update": "2", "checkpoint": "1", "evaluate": "3", "finalize": "2"}
# prepare/reward/evaluate v2: responses are scored cut at the first EOS, special tokens kept
# update v2: the guard decides (skip/rollback records in the lineage); finalize v2: scrub
# evaluate v3: stores held-out samples for the reports (Decks)

RETRIES = 3
"""Cluster retries of a phase (Flyte applies them only on a cluster; locally
:func:`run_phase` applies the same policy to transient faults)."""


def cache_for(phase: str) -> Cache:
    """Cache key = task name + this version + hash of the inputs (which include the run store's
    incarnation id, so a re-created store never hits stale entries)."""
    return Cache(version=f"{verl_core.__version__}-{phase}-v{PHASE_VERSIONS[phase]}")


# Locally the plugin calls ray.init(address=None): RAY_ADDRESS (if set) joins an existing
# cluster, otherwise a local instance starts. On Kubernetes, KubeRay creates this cluster.
RAY_CONFIG = RayJobConfig(
    head_node_config=HeadNodeConfig(ray_start_params={"num-cpus": "2"}),
    worker_node_config=[WorkerNodeConfig(group_name="workers", replicas=0)],
    shutdown_after_job_finishes=True,
    ttl_seconds_after_finished=300,
)


@dataclass(frozen=True)
class PhaseOut:
    """A phase's result: the batch it wrote and the step's metrics so far."""

    step: int
    """RL step this batch belongs to."""
    batch: str
    """sha256 of the batch parquet object in the run store."""
    metrics_json: str
    """Metrics of this and the earlier phases of the step (JSON dict of floats)."""


@dataclass(frozen=True)
class StepState:
    """The training state after ``step`` updates (lives in the worker; rebuilt from the store)."""

    step: int
    """Number of updates applied."""
    metrics_json: str = "{}"
    """Metrics of the step that produced this state."""


def merge(metrics_json: str, new: dict) -> str:
    return json.dumps({**json.loads(metrics_json), **{k: float(v) for k, v in new.items()}},
                      sort_keys=True)


def run_phase(spec: RunSpec, phase: str, step: int, fn: Callable[[], T]) -> T:
    """Run a phase body with the local retry policy, log it in the run store's phase log, and map
    a transient fault that outlived the retries to FlyteRecoverableException (so a cluster
    retries only this phase). Permanent faults propagate unchanged: they fail fast."""
    t0 = time.time()
    timeout = spec.config.guard.phase_timeout_s
    verl_core.beat()  # a phase started (the probe fails if none starts or ends for too long)

    def attempt():
        t = time.perf_counter()
        try:
            with runtime.deadline(timeout, f"{phase} of step {step}"):
                runtime.hold_lease(spec)  # one writer per run: renewed (or taken) per phase
                # VERL_FAULTS (tests, chaos drills); a no-op otherwise
                maybe_inject(phase, step, deadline_s=timeout)
                out = fn()
        except runtime.PhaseTimeoutError:
            runtime.forget_workers(spec)  # hung: its state and queue are unknown
            raise
        metrics = out[-1] if isinstance(out, tuple) else out
        runtime.watch_phase(spec, phase, step, time.perf_counter() - t,
                            metrics if isinstance(metrics, dict) else {})
        return out

    try:
        out = runtime.with_retries(attempt, what=f"{phase} step {step}", attempts=RETRIES)
    except TransientError as e:
        raise FlyteRecoverableException(f"{phase} of step {step}: {e}") from e
    runtime.log_phase(spec, phase, step, started=t0)
    verl_core.beat()  # the liveness probe's heartbeat (VERL_HEARTBEAT_FILE), at the end too
    return out


_T0: dict[str, tuple[float, int]] = {}


def progress(spec: RunSpec, step: int, metrics: dict) -> None:
    """One console line per finished step: step, reward, speed, ETA."""
    t0, s0 = _T0.setdefault(spec.store, (time.time(), step - 1))
    done = step - s0
    eta = (time.time() - t0) / max(done, 1) * (spec.total_steps - step)
    parts = [f"step {step}/{spec.total_steps}", f"reward={metrics.get('reward/mean', 0):.3f}"]
    for k, name in (("response_length/mean", "len"), ("actor/pg_clipfrac", "clip"),
                    ("actor/grad_norm", "gnorm"), ("critic/vf_loss", "vf")):
        if k in metrics:
            parts.append(f"{name}={metrics[k]:.3f}")
    parts.append(f"ETA {eta:.0f}s")
    events = runtime.step_events(spec, step - 1)  # the step's guard events (one store listing)
    if events:
        parts.append(event_line(events))
    print("[verl] " + " ".join(parts), flush=True)
