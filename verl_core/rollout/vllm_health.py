"""Health of the ``vllm`` rollout engine's processes: liveness, the deadline, the teardown.

With ``rollout.engine_own_process`` (the default with one worker) vLLM's engine core runs in a
process of its own (vLLM's V1 multiprocessing: ``EngineCore``, and on the CPU backend a
``Worker`` process under it that holds the model), and the trainer's process talks to it over
ZMQ. Such an engine can die (a kernel's segfault, the OOM killer, a SIGKILL) or hang (a deadlock,
a stopped process) while the trainer lives on. vLLM 0.32's synchronous client notices a dead
engine core (its monitor thread marks it dead, and the next request raises ``EngineDeadError``),
but a call already waiting for its outputs or for a utility's answer waits forever, and nothing
bounds a hang. What this module adds, used by :class:`~verl_core.rollout.vllm.VLLMEngine`:

* :class:`EngineProcesses`: the engine's processes (taken when it is built: the engine core and
  every process under it) and the shared-memory segments they map; :meth:`~EngineProcesses.dead`
  says whether one of them is gone, :meth:`~EngineProcesses.kill` SIGKILLs them all, waits for
  them and unlinks the segments (a killed engine core leaves its 160 MiB message queue in
  ``/dev/shm`` until the trainer exits otherwise).
* :class:`Watchdog`: around one call into the engine, a thread that checks liveness every
  :data:`POLL_S` and the call's deadline (:func:`deadline_s`); when a process is gone, or the
  deadline passed (it kills the engine then), it wakes the blocked caller with
  ``EngineDeadError`` (:func:`unblock`).
* :func:`signal_when_generating`: the drills' and the tests' way to kill (or stop) the engine
  mid-rollout: a real signal to the real engine core process once a request has its first tokens.
* :func:`follow_trainer`: the other way round, the engine's processes end when the trainer's
  process is gone (a SIGKILL, the OOM killer): vLLM's engine core outlives its client otherwise,
  holding the model and the KV cache (minutes, here), and a resumed run would build another.

The rebuild itself (a new ``LLM``, the weights the old one held, the call again with the same
seeds) is the engine's (``vllm.py``). An engine in the worker's process (W > 1, or
``rollout.engine_own_process=False``) has nothing here: it dies with the worker (the resume's
case) and a hang is ``guard.phase_timeout_s``'s.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from dataclasses import dataclass

log = logging.getLogger(__name__)

TRAINER_ENV = "VERL_VLLM_TRAINER"
"""``<pid>:<start time>`` of the process that built the engine, given to the engine's processes
(:func:`follow_trainer`)."""
POLL_S = 0.1
"""How often a :class:`Watchdog` checks the engine's processes and the deadline."""
FLOOR_S = 300.0
"""The smallest derived deadline: an engine's first call (warm-up) and a loaded machine's
scheduling stay well under it."""
S_PER_TOKEN = 0.1
"""Derived deadline per token asked (prompts' and new tokens' upper bound, all rows): as if the
engine made 10 tokens a second, a rate far below any working engine's (vLLM's CPU backend makes
~80 tokens/s with a 31M-parameter model on 2 loaded cores, BENCHMARKS.md)."""
S_PER_MIB = 0.1
"""Derived deadline per MiB of weights handed to the engine (10 MiB/s)."""


def deadline_s(timeout_s: float, *, tokens: int = 0, mib: float = 0.0) -> float:
    """The deadline of one engine call: ``timeout_s`` (``rollout.engine_timeout_s``) when set,
    else derived from the work asked: :data:`FLOOR_S` + :data:`S_PER_TOKEN` x ``tokens`` +
    :data:`S_PER_MIB` x ``mib``."""
    if timeout_s > 0:
        return float(timeout_s)
    return FLOOR_S + S_PER_TOKEN * tokens + S_PER_MIB * mib


@dataclass(frozen=True)
class EngineFailure:
    """Why an engine call failed: ``kind`` ``dead`` (a process gone, or vLLM's EngineDeadError)
    or ``timeout`` (no result within the deadline); ``detail`` says which process, or the
    deadline."""

    kind: str
    detail: str


def _engine_dead_error():
    from vllm.v1.engine.exceptions import EngineDeadError

    return EngineDeadError


def failure_of(exc: BaseException) -> EngineFailure | None:
    """The failure an exception out of an engine call stands for (vLLM's ``EngineDeadError``),
    or None for any other exception (a bad request: raised as it is)."""
    if isinstance(exc, _engine_dead_error()):
        return EngineFailure("dead", f"vLLM raised {type(exc).__name__}")
    return None


class EngineProcesses:
    """The processes of one vLLM engine running in processes of its own, as built."""

    def __init__(self, llm):
        import psutil

        core = llm.llm_engine.engine_core
        self._resources = core.resources
        self._roots = list(core.resources.engine_manager.processes)  # multiprocessing.Process
        roots = [psutil.Process(p.pid) for p in self._roots]
        self.tree = roots + [c for r in roots for c in r.children(recursive=True)]
        """psutil.Process of the engine core(s) and every process under them, root first."""
        self.names = {p.pid: _pname(p) for p in self.tree}
        """Their names (``VLLM::EngineCore``, ``VLLM::Worker``), read while they run."""
        self.shm = sorted({m.path for p in self.tree for m in _memory_maps(p)
                           if m.path.startswith("/dev/shm/psm_")})
        """The shared-memory segments (``multiprocessing.shared_memory``) they map."""

    @classmethod
    def of(cls, llm) -> "EngineProcesses | None":
        """The processes of ``llm``'s engine; None when it runs in this process."""
        core = llm.llm_engine.engine_core
        manager = getattr(getattr(core, "resources", None), "engine_manager", None)
        return cls(llm) if getattr(manager, "processes", None) else None

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.tree]

    def dead(self) -> str:
        """"" while every process runs (a stopped one too: that is the deadline's); else which
        one is gone and how."""
        import psutil

        for root in self._roots:
            if root.exitcode is not None:  # polls (and reaps) our child
                return f"{_name(root.name, root.pid)} exited ({_exit(root.exitcode)})"
        for p in self.tree:
            try:
                gone = p.status() == psutil.STATUS_ZOMBIE
            except psutil.NoSuchProcess:
                gone = True
            if gone:
                return f"{_name(self.names[p.pid], p.pid)} is gone"
        if self._resources.engine_dead:
            return "vLLM's client marked its engine core dead"
        return ""

    def kill(self) -> None:
        """SIGKILL every process of the engine, wait until they are gone, and unlink the
        shared memory they mapped."""
        import psutil

        for p in self.tree:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
        for root in self._roots:  # our children: reaped by multiprocessing, which owns them
            root.join(timeout=30)
        _, alive = psutil.wait_procs(self.tree, timeout=30)  # the rest (reaped by init)
        if alive:
            log.warning("vllm engine: processes %s still there 30 s after SIGKILL",
                        [p.pid for p in alive])
        for path in self.shm:
            _unlink_shm(os.path.basename(path))


def _memory_maps(p) -> list:
    import psutil

    try:
        return p.memory_maps(grouped=True)
    except (psutil.Error, OSError):
        return []


def _pname(p) -> str:
    try:
        return p.name()
    except Exception:  # noqa: BLE001 - a gone process has no name left to read
        return "process"


def _name(name: str, pid: int) -> str:
    return f"vLLM's {name.removeprefix('VLLM::')} (pid {pid})"


def _exit(code: int) -> str:
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-code).name}"
    return f"exit status {code}"


def _unlink_shm(name: str) -> None:
    """Unlink a shared-memory segment a killed process left (and drop it from this process's
    resource tracker, which its creator shared: else it warns about a leak at exit)."""
    from multiprocessing import shared_memory

    try:
        seg = shared_memory.SharedMemory(name=name)
    except FileNotFoundError:
        return
    seg.close()
    with contextlib.suppress(FileNotFoundError):
        seg.unlink()


def unblock(llm) -> None:
    """Wake every caller waiting on ``llm``'s dead engine core with ``EngineDeadError``: the one
    waiting for outputs (``generate``) and those waiting for a utility's answer
    (``collective_rpc``, ``reset_prefix_cache``, sleep/wake), which vLLM 0.32 leaves waiting."""
    from concurrent.futures import InvalidStateError

    core = llm.llm_engine.engine_core
    dead = _engine_dead_error()
    queue = getattr(core, "outputs_queue", None)
    if queue is not None:
        queue.put_nowait(dead())
    for future in list(getattr(core, "utility_results", {}).values()):
        if not future.done():
            with contextlib.suppress(InvalidStateError):
                future.set_exception(dead())


class Watchdog:
    """``with Watchdog(llm, procs, deadline): <one engine call>``: :attr:`failure` is set when a
    process of the engine is gone during the call, or the deadline passed (the engine is killed
    then); either way the call is woken with ``EngineDeadError``."""

    def __init__(self, llm, procs: EngineProcesses, deadline: float):
        self.llm, self.procs, self.deadline = llm, procs, deadline
        self.failure: EngineFailure | None = None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="verl-vllm-watchdog",
                                        daemon=True)

    def __enter__(self) -> "Watchdog":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()

    def _watch(self) -> None:
        end = time.monotonic() + self.deadline
        while not self._done.wait(POLL_S):
            why = self.procs.dead()
            if why:
                self.failure = EngineFailure("dead", why)
            elif time.monotonic() >= end:
                self.failure = EngineFailure(
                    "timeout", f"no result within the deadline of {self.deadline:.0f} s "
                    "(rollout.engine_timeout_s)")
                self.procs.kill()
            if self.failure:
                unblock(self.llm)
                return


def trainer_env() -> dict[str, str]:
    """The environment that makes an engine's processes follow this one (:data:`TRAINER_ENV`)."""
    import psutil

    return {TRAINER_ENV: f"{os.getpid()}:{psutil.Process().create_time()!r}"}


def follow_trainer() -> None:
    """In a process of an engine that runs in processes of its own (:data:`TRAINER_ENV` set, and
    this is not the trainer's process): a thread that, once the trainer's process is gone, kills
    the engine core (this process's parent, when this is its worker) and this process. Called
    where vLLM imports the worker extension (``vllm_ext``), which runs in the engine's
    processes."""
    spec = os.environ.get(TRAINER_ENV, "")
    if not spec or int(spec.split(":")[0]) == os.getpid():
        return
    import psutil

    pid, created = int(spec.split(":")[0]), float(spec.split(":", 1)[1])
    parent = os.getppid()
    core = parent if parent != pid else None  # the engine core, when this is its worker

    def gone() -> bool:
        try:
            return psutil.Process(pid).create_time() != created  # a pid used again
        except psutil.NoSuchProcess:
            return True

    def watch():
        while not gone():
            time.sleep(1.0)
        log.warning("the trainer's process (pid %d) is gone: ending its vLLM engine", pid)
        if core is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(core, signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="verl-follow-trainer", daemon=True).start()


def signal_when_generating(current, sig: int, *, give_up_s: float = 600.0) -> threading.Thread:
    """Send ``sig`` (SIGKILL: a dead engine; SIGSTOP: a hung one) to the engine core process
    from a thread, as soon as a request has its first tokens (the engine is then mid-generate).
    ``current()``: the engine's ``(llm, EngineProcesses)`` now (a rebuild before the generate
    replaces them). Gives up after ``give_up_s`` without one. VERL_FAULTS' ``engine_kill`` /
    ``engine_hang`` drills and the tests use it."""
    def run():
        end = time.monotonic() + give_up_s
        while time.monotonic() < end:
            llm, procs = current()
            states = {} if llm is None else llm.llm_engine.output_processor.request_states
            if procs is not None and any(not getattr(s, "is_prefilling", True)
                                         for s in list(states.values())):
                pid = procs.pids[0]
                log.warning("sending %s to vLLM's engine core (pid %d) mid-generate",
                            signal.Signals(sig).name, pid)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
                return
            time.sleep(0.002)

    thread = threading.Thread(target=run, name="verl-vllm-signal", daemon=True)
    thread.start()
    return thread
