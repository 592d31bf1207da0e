"""Fault injection for crash, retry and chaos tests, and for users rehearsing failures.

Off unless declared. Faults live in the environment, so they never change a cache key or a
config hash (a Ray actor inherits the environment of the process that started Ray):

    VERL_FAULTS='[{"phase": "reward", "step": 1, "kind": "transient", "times": 2}]'
    VERL_FAULTS_DIR=/tmp/faults      # attempt counters and markers (shared across processes)

Every fault takes ``phase`` and ``step`` (the RL step the phase belongs to; both required, checked
at prepare by :func:`check_faults`, since a fault without them never fires) and fires at most
``times`` times (counted in ``VERL_FAULTS_DIR``, so across processes and re-runs; default 1,
except ``permanent`` and ``hang`` which default to every time). Kinds:

  transient       raise a TransientError (a flaky store, a lost worker): the phase is retried
  permanent       raise a PermanentError (bad data): the phase fails at once
  hang            write ``<dir>/<phase>-<step>.entered``, then sleep ``seconds`` (default 3600):
                  a test waits for the marker and kills the process in the middle of the phase
  kill            SIGKILL the process running the phase (a node or pod lost mid-phase)
  term            send SIGTERM to the process running the phase (a preemption: a pod evicted,
                  a spot notice) and go on: the plain loop finishes the phase, saves the newest
                  state and exits 128 + SIGTERM (``checkpoint.preempt_grace_s``)
  slow            sleep ``seconds`` (default: the phase deadline + 5 s) inside the phase, so
                  its deadline (``guard.phase_timeout_s``) fires and the phase is retried
  store_outage    from the start of the phase, every run-store call fails as unavailable for
                  ``seconds`` (default 2): retries with backoff must ride it out
  nan_grad        the update's gradients become NaN (phase ``update``)
  nan_reward      one response's reward becomes NaN (phase ``reward``)
  corrupt_object  after the checkpoint of ``step`` commits, one of its objects is overwritten
                  with garbage of the same size (phase ``checkpoint``)
  second_writer   a second process tries to take the run's writer lease while the run holds
                  it; it must be refused (the phase fails if it is not)
  engine_kill     SIGKILL the rollout engine's process once its generation has its first
                  tokens (phase ``rollout``; ``rollout.engine=vllm`` in its own process): the
                  engine is rebuilt and the generation repeated (docs/vllm.md#engine-health)
  engine_hang     SIGSTOP it instead (a hung engine): ``rollout.engine_timeout_s`` expires, the
                  engine is killed, rebuilt and the generation repeated

Phases: the task-level names (``rollout``, ``reward``, ``advantage``, ``update``, ``checkpoint``,
``evaluate``, ``finalize``), plus ``update-rank<r>`` inside worker r of a worker group (0 with
one worker), in the middle of its update (after the batch is read and, with
``rollout.max_staleness``, the next step's rollout started in the background; before the
optimizer steps), and ``warm_start``, whose ``step`` counts the warm start's own supervised
steps done (prepare's warm start, ``verl_core/warmstart.py``, after each step and before its
periodic save: a ``term`` there saves it at once, as a real SIGTERM does; nothing retries the
warm start, so a raised fault fails the run, and the same command resumes it). Three more points
lie inside a rollout, each firing in the process that runs it: ``tool_call`` once the tool calls of
a turn of step ``step``'s training rollout are sent to the tool host and before their answers are
read (a ``kill`` there ends the trainer while its calls run); ``background_rollout`` as the
background rollout of step ``step`` (``rollout.max_staleness``) starts, in the worker's thread (a
``kill`` ends the worker while the update before it runs); ``sampler`` as the sampler process
(``rollout.async_mode=process``) starts sampling step ``step`` (a ``kill`` ends that process
alone: the worker samples the step again in the foreground and starts a new one). ``restore``
fires as a worker starts rebuilding the state after ``step`` updates (a checkpoint read, the
updates since replayed: the first phase of a resumed run, or after a worker was replaced).

Where they fire, all from here: a phase task calls :func:`maybe_inject` at its start (each worker
of a group at ``update-rank<r>``, the warm start after each of its steps); the in-code kinds at the named points of :data:`HOOKS`
(:func:`hook`); ``store_outage`` in every run-store call (``store.before_io``); ``second_writer``
against the lease the writer code reports with :func:`lease_held`.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time

from verl_core.errors import PermanentError, StoreUnavailableError, TransientError
from verl_core.store import before_io

log = logging.getLogger(__name__)

KINDS = ("transient", "permanent", "hang", "kill", "term", "slow", "store_outage", "nan_grad",
         "nan_reward", "corrupt_object", "second_writer", "engine_kill", "engine_hang")
HOOKS = {"reward_scored": ("reward", "nan_reward"),
         "after_backward": ("update", "nan_grad"),
         "checkpoint_committed": ("checkpoint", "corrupt_object"),
         "rollout_started": ("rollout", "engine_kill"),
         "rollout_started_hang": ("rollout", "engine_hang")}
"""The named points in the library's code where a fault is applied by that code itself
(:func:`hook`): point -> (phase, kind). The reward phase once its scores are computed, the update
after its first backward, the checkpoint phase once the checkpoint of its step committed, the
rollout as it starts sampling (:func:`engine_drill`)."""
IN_CODE = tuple(kind for _, kind in HOOKS.values())
"""Kinds that the phase's own code applies (at a :data:`HOOKS` point), not :func:`maybe_inject`."""


PHASES = ("rollout", "reward", "advantage", "update", "checkpoint", "evaluate", "finalize",
          "warm_start", "tool_call", "background_rollout", "sampler", "restore")
"""The phases a fault can name: the tasks', the warm start, three points inside a rollout and a
worker's restore of its state (plus ``update-rank<r>``, see the module docstring)."""
IN_CODE_PHASE = {kind: phase for phase, kind in HOOKS.values()}
"""The one phase whose code applies each in-code kind: elsewhere it would never fire."""
_KEYS = {"kind", "phase", "step", "times", "seconds"}


class InjectedTransientFault(TransientError):
    """A transient fault raised on purpose (VERL_FAULTS)."""


class InjectedPermanentFault(PermanentError):
    """A permanent fault raised on purpose (VERL_FAULTS)."""


class FaultSpecError(PermanentError, ValueError):
    """``VERL_FAULTS`` is not a valid fault list: a fault that would silently never fire (a
    misspelt phase, no step) is refused, at prepare, before any work."""


def _faults() -> list[dict]:
    spec = os.environ.get("VERL_FAULTS", "")
    if not spec:
        return []
    return parse_faults(spec)


def check_faults() -> int:
    """Validate ``VERL_FAULTS`` (prepare calls this before any work); returns how many faults it
    declares. Raises :class:`FaultSpecError` naming the fault and the fix."""
    return len(_faults())


def parse_faults(spec: str) -> list[dict]:
    """The faults of a ``VERL_FAULTS`` value: one JSON object or a list of them, each with a
    known ``kind`` (default ``transient``), a known ``phase`` and an integer ``step`` >= 0."""
    try:
        faults = json.loads(spec)
    except json.JSONDecodeError as e:
        raise FaultSpecError(f"VERL_FAULTS is not JSON: {e}; expected e.g. "
                             '[{"phase": "reward", "step": 1, "kind": "transient"}]') from e
    faults = faults if isinstance(faults, list) else [faults]
    for i, f in enumerate(faults):
        where = f"VERL_FAULTS[{i}]={json.dumps(f)}"
        if not isinstance(f, dict):
            raise FaultSpecError(f"{where}: a fault is a JSON object with kind, phase and step")
        kind = f.get("kind", "transient")
        if kind not in KINDS:
            raise FaultSpecError(f"{where}: unknown kind {kind!r}; known: {', '.join(KINDS)}")
        unknown = sorted(set(f) - _KEYS)
        if unknown:
            raise FaultSpecError(f"{where}: unknown key(s) {unknown}; known: "
                                 f"{', '.join(sorted(_KEYS))}")
        phase = f.get("phase")
        rank = isinstance(phase, str) and phase.startswith("update-rank") and \
            phase[len("update-rank"):].isdigit()
        if phase not in PHASES and not rank:
            raise FaultSpecError(f"{where}: phase {phase!r} is not a phase, so the fault would "
                                 f"never fire; use one of {', '.join(PHASES)} or update-rank<r>")
        if kind in IN_CODE_PHASE and phase != IN_CODE_PHASE[kind]:
            raise FaultSpecError(f"{where}: kind {kind!r} fires only in phase "
                                 f"{IN_CODE_PHASE[kind]!r}; set \"phase\": "
                                 f"\"{IN_CODE_PHASE[kind]}\"")
        step = f.get("step")
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise FaultSpecError(f"{where}: needs \"step\": the RL step (an integer >= 0, "
                                 "0-based) whose phase it fires in; without it it never fires")
        times = f.get("times")
        if times is not None and (not isinstance(times, int) or isinstance(times, bool)
                                  or times < 1):
            raise FaultSpecError(f"{where}: \"times\" must be an integer >= 1 (or absent)")
        seconds = f.get("seconds")
        if seconds is not None and (isinstance(seconds, bool) or not isinstance(
                seconds, (int, float)) or not seconds >= 0):
            raise FaultSpecError(f"{where}: \"seconds\" must be a number >= 0 (or absent)")
    return faults


def _state_dir() -> str:
    d = os.environ.get("VERL_FAULTS_DIR") or "/tmp/verl-faults"
    os.makedirs(d, exist_ok=True)
    return d


def _matching(phase: str, step: int, kinds) -> list[dict]:
    return [f for f in _faults() if f.get("phase") == phase and f["step"] == step
            and f.get("kind", "transient") in kinds]


def _count(state_dir: str, phase: str, step: int, kind: str = "") -> int:
    """Firings of (phase, step[, kind]) before this one; counts this one (across processes)."""
    counter = os.path.join(state_dir, f"{phase}-{step}{'-' + kind if kind else ''}.attempts")
    n = int(open(counter).read()) if os.path.exists(counter) else 0
    with open(counter, "w") as fh:
        fh.write(str(n + 1))
    return n


def _fires(f: dict, phase: str, step: int, default_times: int | None) -> bool:
    """Whether fault ``f`` fires now (counting it if so). ``default_times`` None: every time."""
    kind = f.get("kind", "transient")
    times = f.get("times", default_times)
    if times is None:
        return True
    # transient and hang faults keep their historical counter name (tests read and write it)
    n = _count(_state_dir(), phase, step, "" if kind in ("transient", "hang") else kind)
    return n < int(times)


def maybe_inject(phase: str, step: int, *, deadline_s: float = 0.0) -> None:
    """Raise, hang, sleep, kill, preempt or start an outage if a declared fault matches (phase,
    step). A no-op without VERL_FAULTS. ``deadline_s``: the phase's deadline (``slow``'s
    default)."""
    for f in _matching(phase, step, [k for k in KINDS if k not in IN_CODE]):
        kind = f.get("kind", "transient")
        if kind == "hang":
            if not _fires(f, phase, step, None):
                continue
            with open(os.path.join(_state_dir(), f"{phase}-{step}.entered"), "w") as fh:
                fh.write(str(os.getpid()))
            time.sleep(float(f.get("seconds", 3600)))
        elif kind == "permanent":
            if _fires(f, phase, step, None):
                raise InjectedPermanentFault(f"injected permanent fault in {phase} of step {step}")
        elif kind == "transient":
            if _fires(f, phase, step, 1):
                raise InjectedTransientFault(f"injected transient fault in {phase} of step {step}")
        elif kind == "kill":
            if _fires(f, phase, step, 1):
                log.warning("VERL_FAULTS: killing pid %d in %s of step %d", os.getpid(), phase,
                            step)
                os.kill(os.getpid(), signal.SIGKILL)
        elif kind == "term":
            if _fires(f, phase, step, 1):
                log.warning("VERL_FAULTS: SIGTERM to pid %d in %s of step %d", os.getpid(),
                            phase, step)
                os.kill(os.getpid(), signal.SIGTERM)
        elif kind == "slow":
            if _fires(f, phase, step, 1):
                time.sleep(float(f.get("seconds", deadline_s + 5.0)))
        elif kind == "store_outage":
            if _fires(f, phase, step, 1):
                until = time.time() + float(f.get("seconds", 2.0))
                with open(os.path.join(_state_dir(), "store-outage-until"), "w") as fh:
                    fh.write(repr(until))
        elif kind == "second_writer":
            if _fires(f, phase, step, 1):
                _second_writer(f)


def hook(point: str, step: int) -> dict | None:
    """The fault declared for hook ``point`` (:data:`HOOKS`) of ``step``, if it fires now
    (counted): the code at that point applies it. None without VERL_FAULTS."""
    phase, kind = HOOKS[point]
    for f in _matching(phase, step, (kind,)):
        if _fires(f, phase, step, 1):
            log.warning("VERL_FAULTS: injecting %s in %s of step %d", kind, phase, step)
            return f
    return None


def engine_drill(engine, step: int) -> None:
    """The ``engine_kill``/``engine_hang`` faults of ``step``'s rollout, if declared: ``engine``
    gets SIGKILL/SIGSTOP in its process once its next generation has its first tokens."""
    for point, sig in (("rollout_started", signal.SIGKILL),
                       ("rollout_started_hang", signal.SIGSTOP)):
        if "engine_" in os.environ.get("VERL_FAULTS", "") and hook(point, step):
            send = getattr(engine, "signal_when_generating", None)
            if send is None:
                raise InjectedPermanentFault(
                    f"{HOOKS[point][1]} fault: the {type(engine).__name__} rollout engine has no "
                    "process of its own to signal (rollout.engine=vllm has)")
            send(sig)


def store_outage_active() -> bool:
    """True while an injected store outage lasts (checked by every run-store call)."""
    path = os.path.join(os.environ.get("VERL_FAULTS_DIR") or "/tmp/verl-faults",
                        "store-outage-until")
    try:
        return time.time() < float(open(path).read())
    except (OSError, ValueError):
        return False


def _store_outage(what: str) -> None:
    """Run before every run-store call of a process that imported this module (every phase
    process and worker does): fails it while a declared ``store_outage`` lasts."""
    if "store_outage" in os.environ.get("VERL_FAULTS", "") and store_outage_active():
        raise StoreUnavailableError(f"{what}: store unavailable (injected store_outage)")


before_io(_store_outage)


_LEASE: tuple | None = None
"""(store, ttl_s) of the writer lease this process holds: what a ``second_writer`` fault tries
to take too."""


def lease_held(store, ttl_s: float) -> None:
    """Hook: this process holds (took or renewed) the run's writer lease on ``store``."""
    global _LEASE
    _LEASE = (store, ttl_s)


def lease_released() -> None:
    """Hook: this process gave the run's writer lease up."""
    global _LEASE
    _LEASE = None


def _second_writer(f: dict) -> None:
    """The ``second_writer`` fault: another writer tries to take the lease this process holds;
    it must be refused."""
    from verl_core.store.lease import LeaseHeldError, RunLease

    if _LEASE is None:
        raise InjectedPermanentFault("second_writer fault: no run lease is held in this process "
                                     "(guard.lease_ttl_s=0?), so nothing can refuse a second "
                                     "writer")
    store, ttl_s = _LEASE
    intruder = RunLease(store, ttl_s, owner=f"second-writer-drill:{os.getpid()}")
    try:
        intruder.acquire()
    except LeaseHeldError as e:
        log.warning("VERL_FAULTS second_writer: refused, as it must be: %s", e)
        return
    intruder.release()
    raise InjectedPermanentFault(f"second_writer fault: a second writer was admitted to "
                                 f"{store.uri} while this run held its lease")


def corrupt_checkpoint(store, name: str, manifest: dict) -> None:
    """The ``corrupt_object`` fault: overwrite the largest object of checkpoint ``name`` (its
    ``manifest``) with garbage (bit rot, a bad disk). Loads and ``RunWorker.scrub`` find it."""
    sha = max(manifest["objects"], key=manifest["objects"].get)
    log.warning("VERL_FAULTS: corrupting object %s of checkpoint %s", sha[:12], name)
    corrupt_object(store, sha)


def corrupt_object(store, sha: str) -> None:
    """Overwrite object ``sha`` in ``store`` with garbage of the same size, in place (a disk or
    bit-rot fault; the content hash no longer matches)."""
    path = store.object_path(sha)
    size = store.fs.size(path)
    with store.fs.open(path, "wb") as fh:
        fh.write(os.urandom(max(1, size)))
