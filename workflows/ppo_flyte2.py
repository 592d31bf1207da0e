"""RL post-training on Flyte 2: ``flyte run --local workflows/ppo_flyte2.py ppo``.

The Flyte 2 front door beside the flytekit one (workflows/ppo.py): the same phases
(``verl_core.phases``, through the same task bodies in ``tasks/``), the same run store, the same
resume rule, lease, options and console lines. Flyte 2 tasks call tasks in plain Python, so
one driver task per run holds a per-step loop instead of flytekit's unrolled chunks:

    ppo (driver)  ->  configure (inline: header, lease) -> prepare
                      -> evaluate(start) -> per step: rollout -> reward -> advantage -> update
                         (-> checkpoint where one may be due) (-> evaluate every eval_every)
                      -> evaluate(end) -> finalize

Each phase is a cached Flyte 2 sub-task of :data:`phase_env`: its cache key is the task name,
the phase's version (``tasks.common.PHASE_VERSIONS``, the flytekit tasks' own) and its inputs
(the spec and the state or batch reference, as JSON: the inputs the flytekit tasks cache on), so
re-running the same command skips every finished phase, and a phase that fails is retried alone
(``retries=``; a permanent fault is raised as Flyte 2's NonRecoverableError: not retried). The
driver starts (or joins, with ``RAY_ADDRESS``/``cluster.mode=attached``) the run's Ray cluster
once and keeps it warm for every phase: no RayJob per phase (docs/cluster.md, "Flyte 2").

A run begun by either front door can be continued by the other: both resume from the run store
(the newest verified checkpoint and the batches since), not from each other's caches.
"""

from __future__ import annotations

import dataclasses
import json
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Optional

import flyte
import flyte.errors

from tasks.checkpoint import _checkpoint
from tasks.common import PHASE_VERSIONS, RETRIES, run_phase
from tasks.evaluate import EvalResult, _evaluate
from tasks.finalize import Summary, _finalize
from tasks.prepare import configure_spec, prepare_spec
from tasks.update import _update
from verl_core import phases
from verl_core.engine import workers
from verl_core.errors import PermanentError
from verl_core.types import PhaseOut, RunSpec, StepState
from workflows._cli import add_dashed_aliases_flyte2
import verl_core

add_dashed_aliases_flyte2()


def _reuse_policy() -> Optional[flyte.ReusePolicy]:
    """Reusable containers for the phase tasks where the backend offers them
    (``VERL_FLYTE2_REUSE=<replicas>`` at registration; unset: a container per phase task, what
    the open-source backend runs). Locally ignored: every task runs in the driver's process."""
    replicas = os.environ.get("VERL_FLYTE2_REUSE", "")
    if not replicas:
        return None
    if not replicas.isdigit() or int(replicas) < 1:
        from verl_core.config import ConfigError

        raise ConfigError(f"VERL_FLYTE2_REUSE={replicas!r}: the number of warm containers for the "
                          "phase tasks, a whole number >= 1 (unset: a container per phase task)")
    return flyte.ReusePolicy(replicas=int(replicas))


phase_env = flyte.TaskEnvironment(
    name="verl_phases",
    image=os.environ.get("VERL_FLYTE2_IMAGE", "auto"),  # the Dockerfile's gpu target, pushed
    resources=flyte.Resources(cpu=2, memory="8Gi"),
    reusable=_reuse_policy(),
)
"""The phase tasks: thin clients of the run's Ray cluster (the heavy work runs on its workers)."""

env = flyte.TaskEnvironment(
    name="verl_ppo",
    image=os.environ.get("VERL_FLYTE2_IMAGE", "auto"),
    resources=flyte.Resources(cpu=2, memory="8Gi"),
    depends_on=[phase_env],
)
"""The driver: one task per run, holding the step loop and the Ray connection."""


def _cache(phase: str) -> flyte.Cache:
    """``tasks.common.cache_for``'s version string, as a Flyte 2 cache (behaviour "auto": the
    only one a local run reads; the version is given, so the key does not hash the source)."""
    return flyte.Cache(behavior="auto",
                       version_override=f"{verl_core.__version__}-{phase}-v{PHASE_VERSIONS[phase]}")


def _as_flyte_error(fn: Callable[[], str]) -> str:
    """``fn()``; one of our permanent faults (bad input, a corrupt store) becomes Flyte 2's
    NonRecoverableError, so it fails the run at once instead of being retried."""
    from verl_core.train import USER_ERRORS

    try:
        return fn()
    except (PermanentError, *USER_ERRORS) as e:
        raise flyte.errors.NonRecoverableError(f"{type(e).__name__}: {e}") from e


def _warm_ray(spec: RunSpec) -> None:
    """Before a heavy phase executes: the run's Ray cluster, started (locally) or joined
    (``RAY_ADDRESS``) once per process and kept warm for every later phase; its worker (a Ray
    actor, or the detached actors of ``cluster.mode=attached``, which join by themselves) stays
    alive between phases. Not before: a re-run whose phases are all cache hits starts no Ray (as
    the flytekit front door's first Ray task starts it)."""
    import ray

    if spec.config.cluster.mode == "attached" or ray.is_initialized():
        return
    if workers.runs_on_this_host():
        # in the keeper thread: a local Ray's processes die with the thread that started them
        # (Linux's parent-death signal follows the thread), and a task's thread ends with it
        _RAY_KEEPER.submit(workers.start_local_ray).result()
    elif os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"], include_dashboard=False,
                 configure_logging=False)


_RAY_KEEPER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="verl-ray")
"""The thread that starts the local Ray instance and outlives every task of the run (Flyte 2
runs local tasks in threads that end with them)."""


def _spec(text: str) -> RunSpec:
    from tasks.common import _spec_from_json

    return _spec_from_json(text)


def _dump(value) -> str:
    """A typed phase value (PhaseOut, StepState, EvalResult, Summary) as canonical JSON (sorted
    keys, so equal values are equal cache inputs)."""
    return json.dumps(dataclasses.asdict(value), sort_keys=True)


def _report(name: str, html: str, **_) -> None:
    """The task's report tab (Flyte 2's report, the Decks of the flytekit front door)."""
    flyte.report.get_tab(name).replace(html)


@phase_env.task(cache=_cache("prepare"), retries=RETRIES)
def prepare(spec: str) -> str:
    _warm_ray(_spec(spec))  # before prepare_spec's own start of Ray, which would end with it
    return _as_flyte_error(lambda: prepare_spec(_spec(spec)).to_json())


@phase_env.task(cache=_cache("rollout"), retries=RETRIES)
def rollout(spec: str, state: str) -> str:
    s, st = _spec(spec), StepState(**json.loads(state))
    _warm_ray(s)
    return _as_flyte_error(lambda: _dump(run_phase(s, "rollout", st.step, phases.rollout, s, st)))


@phase_env.task(cache=_cache("reward"), retries=RETRIES)
def reward(spec: str, rollout: str) -> str:
    s, out = _spec(spec), PhaseOut(**json.loads(rollout))
    return _as_flyte_error(lambda: _dump(run_phase(s, "reward", out.step, phases.reward, s, out)))


@phase_env.task(cache=_cache("advantage"), retries=RETRIES)
def advantage(spec: str, scored: str) -> str:
    s, out = _spec(spec), PhaseOut(**json.loads(scored))
    return _as_flyte_error(
        lambda: _dump(run_phase(s, "advantage", out.step, phases.advantage, s, out)))


@phase_env.task(cache=_cache("update"), retries=RETRIES)
def update(spec: str, advantaged: str) -> str:
    _warm_ray(_spec(spec))
    return _as_flyte_error(
        lambda: _dump(_update(_spec(spec), PhaseOut(**json.loads(advantaged)))))


@phase_env.task(cache=_cache("checkpoint"), retries=RETRIES, report=True)
def checkpoint(spec: str, state: str) -> str:
    _warm_ray(_spec(spec))
    return _as_flyte_error(lambda: _dump(
        _checkpoint(_spec(spec), StepState(**json.loads(state)), attach=_report)))


@phase_env.task(cache=_cache("evaluate"), retries=RETRIES, report=True)
def evaluate(spec: str, state: str) -> str:
    _warm_ray(_spec(spec))
    return _as_flyte_error(lambda: _dump(
        _evaluate(_spec(spec), StepState(**json.loads(state)), attach=_report)))


@phase_env.task(cache=_cache("finalize"), retries=RETRIES, report=True)
def finalize(spec: str, last: str, start: str, end: str) -> str:
    """``start``: the evaluation before training as JSON, "" without one."""
    first = EvalResult(**json.loads(start)) if start else None
    _warm_ray(_spec(spec))
    return _as_flyte_error(lambda: _dump(_finalize(
        _spec(spec), StepState(**json.loads(last)), first, EvalResult(**json.loads(end)),
        attach=_report)))


@env.task
def ppo(algorithm: str = "", model: str = "", train_files: str = "", val_files: str = "",
        steps: int = 0, batch_size: int = 0, rollout_n: int = 0, run_name: str = "default",
        store: str = "", overrides: str = "", verl_config: str = "") -> str:
    """Train a causal LM with RL: configure, prepare, then a step loop of cached phase tasks.

    The options and their defaults are workflows/ppo.py's (``pyflyte run workflows/ppo.py ppo
    --help``; docs/options.md). Re-running the same command skips every phase that finished;
    either front door continues a run the other began. Returns the run's Summary as JSON (its
    repr is the last console line, as pyflyte prints it).
    """
    spec = _as_flyte_error(lambda: configure_spec(
        algorithm, model, train_files, val_files, steps, batch_size, rollout_n, run_name, store,
        overrides, verl_config).to_json())
    full = _spec(prepare(spec=spec))
    s = full.to_json()
    every = full.config.eval_every  # verl's trainer.test_freq; the last step's is the end eval
    state = _dump(StepState(step=full.start_step))
    # val_before_train=False: no evaluation at all, "" in finalize's key (as flytekit's None)
    start = evaluate(spec=s, state=state) if full.config.val_before_train else ""
    for k in range(full.start_step, full.total_steps):
        sampled = rollout(spec=s, state=state)
        scored = reward(spec=s, rollout=sampled)
        advantaged = advantage(spec=s, scored=scored)
        state = update(spec=s, advantaged=advantaged)
        if phases.checkpoint_follows(full, k + 1):
            state = checkpoint(spec=s, state=state)
        if every and (k + 1) % every == 0 and k + 1 < full.total_steps:
            evaluate(spec=s, state=state)
    end = evaluate(spec=s, state=state)
    summary = finalize(spec=s, last=state, start=start, end=end)
    print(Summary(**json.loads(summary)), flush=True)  # pyflyte's last line, for the same tools
    return summary
