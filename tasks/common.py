"""What every phase task shares: cache versions, the Ray config, retries, progress printing."""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import time
from dataclasses import dataclass
from typing import TypeVar

import msgpack
from flytekit import Cache
from flytekit.core.constants import FLYTE_USE_OLD_DC_FORMAT, MESSAGEPACK
from flytekit.core.type_engine import DataclassTransformer
from flytekit.core.utils import str2bool
from flytekit.exceptions.user import FlyteRecoverableException
from flytekit.core.context_manager import ExecutionParameters, FlyteContextManager
from flytekit.extend import TaskPlugins, TypeEngine, TypeTransformer
from flytekit.models.literals import Binary, Literal, Primitive, Scalar
from flytekit.models.types import LiteralType, SimpleType
from flytekitplugins.ray import HeadNodeConfig, RayJobConfig, WorkerNodeConfig
from flytekitplugins.ray.task import RayFunctionTask

import verl_core
from verl_core import interrupt, phases, runlog
from verl_core.types import PhaseOut, RunSpec, StepState
from verl_core.guard.events import event_line
from verl_core.train import format_step
from verl_core.validation import clipped_responses_warning

T = TypeVar("T")

# Every Ray task re-enters ray.init (the plugin does it); Ray logs each re-entry at INFO, which
# would bury the progress lines. Warnings still show.
logging.getLogger("ray").setLevel(logging.WARNING)

# Bump one phase's entry when its behaviour changes; a package version bump invalidates all.
PHASE_VERSIONS = {"prepare": "2", "rollout": "2", "reward": "2", "advantage": "1",
                  "update": "3", "checkpoint": "1", "evaluate": "4", "finalize": "2"}
# prepare/reward/evaluate v2: responses are scored cut at the first EOS, special tokens kept
# update v2: the guard decides (skip/rollback records in the lineage); finalize v2: scrub
# evaluate v3: stores held-out samples for the reports (Decks); v4: their tokens as the model saw
# them (special tokens visible), the first one printed
# rollout v2: a multi-turn batch no longer stores each call's measured latency_s (metrics only)

RETRIES = phases.ATTEMPTS
"""Cluster retries of a phase (Flyte applies them only on a cluster; locally
:func:`run_phase` applies the same policy to transient faults)."""


def cache_for(phase: str) -> Cache:
    """Cache key = task name + this version + hash of the inputs (which include the run store's
    incarnation id, so a re-created store never hits stale entries)."""
    return Cache(version=f"{verl_core.__version__}-{phase}-v{PHASE_VERSIONS[phase]}")


class _RunSpecTransformer(TypeTransformer[RunSpec]):
    """A :class:`RunSpec` (with its typed :class:`RunConfig`) crosses tasks as one canonical JSON
    string literal. Why not flytekit's dataclass transformer: it builds a JSON schema of the ~180
    nested config fields for every task interface that names RunSpec (seconds of start-up) and
    re-evaluates their annotations on every input conversion (BENCHMARKS.md "Small costs");
    this parses one string. Tasks still see a typed spec."""

    def __init__(self):
        super().__init__("RunSpec", RunSpec)

    def get_literal_type(self, t=None) -> LiteralType:
        return LiteralType(simple=SimpleType.STRING)

    def to_literal(self, ctx, python_val: RunSpec, python_type, expected) -> Literal:
        return Literal(scalar=Scalar(primitive=Primitive(string_value=python_val.to_json())))

    def to_python_value(self, ctx, lv: Literal, expected_python_type) -> RunSpec:
        return _spec_from_json(lv.scalar.primitive.string_value)


@functools.lru_cache(maxsize=8)
def _spec_from_json(text: str) -> RunSpec:
    """Every task of a run gets the same spec literal: parse and validate its ~180 config fields
    once per process, not once per task. Safe to share: RunSpec and RunConfig are
    frozen."""
    return RunSpec.from_json(text)


TypeEngine.register(_RunSpecTransformer())


class _PhaseResultTransformer(TypeTransformer[T]):
    """:class:`PhaseOut` and :class:`StepState` (what every phase returns) as flytekit's own
    dataclass literal: the same literal type (schema and all, so a cluster still type-checks the
    wiring and the console shows the fields) and byte-identical msgpack values (so cache keys
    are unchanged). Why not flytekit's DataclassTransformer itself: on every conversion it walks
    the value looking for Flyte file types and re-reads the type hints (per task output,
    BENCHMARKS.md "Small costs"); these two types hold only ints, strings and a float
    map, so ``msgpack.dumps(asdict(v))`` is the whole job (tests/workflows/test_spec_literal.py
    checks the bytes against flytekit's). Anything else (FLYTE_USE_OLD_DC_FORMAT, a JSON literal
    from the console or an older run) goes through flytekit's transformer."""

    def __init__(self, cls: type[T]):
        super().__init__(cls.__name__, cls)
        self._cls = cls
        self._flytekit = DataclassTransformer()
        self._type = self._flytekit.get_literal_type(cls)

    def get_literal_type(self, t=None) -> LiteralType:
        return self._type

    def to_literal(self, ctx, python_val: T, python_type, expected) -> Literal:
        if type(python_val) is not self._cls or str2bool(os.getenv(FLYTE_USE_OLD_DC_FORMAT)):
            return self._flytekit.to_literal(ctx, python_val, python_type, expected)
        data = msgpack.dumps(dataclasses.asdict(python_val))
        return Literal(scalar=Scalar(binary=Binary(value=data, tag=MESSAGEPACK)))

    def to_python_value(self, ctx, lv: Literal, expected_python_type) -> T:
        binary = lv.scalar.binary if lv.scalar else None
        if binary is None or binary.tag != MESSAGEPACK:
            return self._flytekit.to_python_value(ctx, lv, expected_python_type)
        return self._cls(**msgpack.loads(binary.value))


TypeEngine.register(_PhaseResultTransformer(PhaseOut))
TypeEngine.register(_PhaseResultTransformer(StepState))


@dataclass
class _RayConfig(RayJobConfig):
    """The Ray plugin's config, routed to :class:`_RayTask` (flytekit picks a task's plugin by
    the exact type of its ``task_config``); serialized exactly as a ``RayJobConfig``."""


class _RayTask(RayFunctionTask):
    """The Ray plugin's task (type ``ray``, same serialization) minus one local cost: the
    plugin's ``pre_execute`` calls ``ray.init`` before every Ray task, and with no address Ray
    first looks for a running cluster by reading every process's command line on the host
    (psutil; BENCHMARKS.md "Small costs"), three times per RL step, only to return at once
    because this process is connected already. Locally, when Ray is initialised, that call is
    a no-op and is skipped; the first Ray task of a local run and every task on a cluster run
    the plugin's own ``pre_execute``. Locally that first Ray task (a re-run whose prepare was a
    cache hit starts Ray here, not in prepare) starts the lean local instance prepare would have
    (:func:`~verl_core.engine.workers.start_local_ray`: the plugin's own ``ray.init`` adds a
    dashboard, its agents and their subprocesses, seconds of CPU on every re-run), and its
    ``ray.init`` puts Ray's SIGTERM handler (``sys.exit``) in place of the interrupt's, so the
    handlers are installed again after it, as prepare does after its own start of Ray."""

    def pre_execute(self, user_params: ExecutionParameters) -> ExecutionParameters:
        if FlyteContextManager.current_context().execution_state.is_local_execution():
            import ray

            if ray.is_initialized():
                return user_params
            from verl_core.engine import workers

            workers.start_local_ray()  # lean, as prepare starts it: the plugin's init reuses it
            params = super().pre_execute(user_params)
            interrupt.install()
            return params
        return super().pre_execute(user_params)


TaskPlugins.register_pythontask_plugin(_RayConfig, _RayTask)

# Locally the plugin calls ray.init(address=None): RAY_ADDRESS (if set) joins an existing
# cluster, otherwise start_local_ray has already started a new local instance, which it reuses. On Kubernetes, KubeRay creates this cluster.
RAY_CONFIG = _RayConfig(
    head_node_config=HeadNodeConfig(ray_start_params={"num-cpus": "2"}),
    worker_node_config=[WorkerNodeConfig(group_name="workers", replicas=0)],
    shutdown_after_job_finishes=True,
    ttl_seconds_after_finished=300,
)


run_phase = functools.partial(phases.run_phase, give_up=FlyteRecoverableException)
""":func:`verl_core.phases.run_phase` for a task: a transient fault that outlived the local
attempts is raised as FlyteRecoverableException, so a Flyte cluster retries only this phase (a raw
StoreUnavailableError would fail the run)."""

store_call = functools.partial(phases.store_call, give_up=FlyteRecoverableException)
""":func:`verl_core.phases.store_call` for the store calls a task makes around its phase body
(the progress line's guard events, a Deck's reads, prepare), mapped as :data:`run_phase` maps."""


class StepClock:
    """The wall time of each step of a run as this process saw it (one per run store), for the
    progress line's ETA. A step's time is the wall time since the previous step's line, unless an
    evaluation ran in between (evaluations are not steps: :func:`verl_core.train.eta_s`)."""

    def __init__(self) -> None:
        self._runs: dict[str, dict] = {}  # store -> {"last": (step, time), "seconds": [...]}

    def tick(self, spec: RunSpec, step: int) -> list[float]:
        """Record that ``step`` ended now; the step times known so far."""
        seen = self._runs.setdefault(spec.store, {"last": None, "seconds": []})
        now, every = time.time(), spec.config.eval_every
        last = seen["last"]
        if last is not None and step == last[0] + 1 and not (every and last[0] % every == 0):
            seen["seconds"].append(now - last[1])
        seen["last"] = (step, now)
        return seen["seconds"]

    def reset(self) -> None:
        self._runs.clear()


STEP_CLOCK = StepClock()
PHASE_TIMINGS = ("timing/rollout_s", "timing/reward_s", "timing/advantage_s", "timing/update_s")


def progress(spec: RunSpec, step: int, metrics: dict) -> None:
    """One console line per finished step: step, reward, speed, ETA (:class:`StepClock`; until
    one step interval is known, the first line or a fresh process on a cluster, the step's own
    phase timings)."""
    seconds = STEP_CLOCK.tick(spec, step)
    own = [sum(float(metrics.get(k, 0.0)) for k in PHASE_TIMINGS)]
    # the plain loop's line (no timing/step_s here: the step ran as separate tasks)
    parts = [format_step({**metrics, "step": step}, spec.total_steps, seconds or own)]
    # the step's guard events (one store listing)
    events = store_call(f"guard events of step {step}",
                        lambda: runlog.step_events(spec, step - 1))
    if events:
        parts.append(event_line(events))
    print("[verl] " + " ".join(parts), flush=True)
    warning = clipped_responses_warning(metrics, spec.config, step)  # as the plain loop warns
    if warning:
        print("[verl] " + warning, flush=True)
