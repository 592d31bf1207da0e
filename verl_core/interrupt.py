"""Ctrl-C and SIGTERM for both front doors: one line that says what was kept and the command that
continues, and an exit within seconds.

What belongs here: the signal handlers, the run's current activity as the line reports it
(:func:`status`), the stop flag that loops which can stop cleanly poll (:func:`requested`: the
warm start saves its progress first) and the exit. What does not: what is saved (the loops' own
business) and how a phase commits (atomically, by the store: a phase cut off half-way is never
taken as done, so exiting without unwinding is as safe as the SIGKILL the resume tests use).

Why not let ``KeyboardInterrupt`` unwind: in ``pyflyte run`` it surfaced as flytekit's traceback
after 8-11 s of Ray and flytekit teardown, and said nothing of what was kept. The first signal
sets the stop flag and starts a short grace timer; a loop that polls the flag saves and exits at
once, anything else (a phase in a Ray actor, a store call) is abandoned when the timer fires. A
second signal exits at once.
"""

from __future__ import annotations

import os
import shlex
import signal
import sys
import threading

GRACE_S = 3.0
"""Seconds a polling loop (the warm start: a step is well under a second) has to save before the
process exits anyway. The issue's bound is 5 s from the signal to the exit."""

PREEMPT_GRACE_S = 0.0
"""On SIGTERM, the grace a loop that saves on preemption asked for (:func:`on_preemption`; the
plain loop: ``checkpoint.preempt_grace_s``); 0: :data:`GRACE_S`, as for Ctrl-C."""

_STOP = threading.Event()
_LOCK = threading.Lock()
_STATUS = {"where": "", "kept": "", "store": ""}
_SIGNAL: list[int] = []


def requested() -> bool:
    """True once SIGINT or SIGTERM arrived: a loop that can stop cleanly saves and calls
    :func:`exit_now`."""
    return _STOP.is_set()


def on_preemption(grace_s: float) -> None:
    """A loop that saves its newest state on SIGTERM (a preemption: Kubernetes' grace period, a
    Ray drain) takes ``grace_s`` seconds from the signal before the process exits anyway."""
    global PREEMPT_GRACE_S
    PREEMPT_GRACE_S = float(grace_s)


def preempted() -> bool:
    """True once SIGTERM asked the process to stop (Ctrl-C is not a preemption)."""
    return _STOP.is_set() and bool(_SIGNAL) and _SIGNAL[0] == signal.SIGTERM


def status(where: str | None = None, kept: str | None = None, store: str | None = None) -> None:
    """What the run is doing now (``where``: "the rollout of step 7"), what an interrupt keeps
    (``kept``) and where (``store``): the interrupt line reads them."""
    with _LOCK:
        for k, v in (("where", where), ("kept", kept), ("store", store)):
            if v is not None:
                _STATUS[k] = v


def continue_command(argv: list[str] | None = None) -> str:
    """The command line this process was started with, as a person would type it again: a
    program inside the current folder relative to it (``.venv/bin/pyflyte``), the plain loop as
    ``python -m verl_core.train`` with this interpreter."""
    argv = list(sys.argv if argv is None else argv)
    if not argv:
        return ""
    prog = argv[0]
    modules = {os.path.join("verl_core", "train.py"): "verl_core.train",
               os.path.join("verl_core", "__main__.py"): "verl_core"}
    module = next((m for f, m in modules.items() if prog.endswith(f)), None)
    prog_words = [_short(sys.executable), "-m", module] if module else [_short(prog)]
    return shlex.join(prog_words + argv[1:])


def _short(path: str) -> str:
    """``path`` relative to the current folder when it lies inside it, else as given."""
    try:
        rel = os.path.relpath(path)
    except ValueError:
        return path
    return rel if not rel.startswith("..") else path


def line(signum: int | None = None) -> str:
    """The one line printed on an interrupt."""
    name = signal.Signals(signum).name if signum else "interrupt"
    with _LOCK:
        where, kept, store = _STATUS["where"], _STATUS["kept"], _STATUS["store"]
    text = f"[verl] interrupted ({name})"
    if where:
        text += f" during {where}"
    kept = kept or "every finished phase and checkpoint"
    text += f": kept {kept}" + (f" in {store}" if store else "")
    cmd = continue_command()
    if cmd:
        text += f"; continue with: {cmd}"
    return text


def exit_now() -> None:
    """Print the interrupt line and end the process without unwinding (no teardown that could
    take longer than the grace: a local Ray instance started by this process dies with it)."""
    signum = _SIGNAL[0] if _SIGNAL else None
    try:
        sys.stdout.flush()
    except Exception:  # noqa: BLE001 - a closed stdout must not stop the exit
        pass
    try:
        os.write(2, (line(signum) + "\n").encode())
    except OSError:
        pass
    os._exit(128 + (signum or signal.SIGINT))


def _handler(signum, frame) -> None:  # noqa: ARG001 - signal handler signature
    if _STOP.is_set():  # a second signal: at once
        exit_now()
    _SIGNAL.append(signum)
    _STOP.set()
    grace = PREEMPT_GRACE_S if signum == signal.SIGTERM and PREEMPT_GRACE_S > 0 else GRACE_S
    timer = threading.Timer(grace, exit_now)
    timer.daemon = True
    timer.start()


def install() -> bool:
    """Install the handlers for SIGINT and SIGTERM, again where something (``ray.init``) put its
    own in their place since. False where handlers cannot be set (not the main thread: an
    embedding program keeps its own; a task on a Flyte cluster, where the pod's SIGTERM is
    flytekit's and Kubernetes' business)."""
    if os.environ.get("FLYTE_INTERNAL_EXECUTION_ID"):
        return False
    if threading.current_thread() is not threading.main_thread():
        return False
    for sig in (signal.SIGINT, signal.SIGTERM):
        if signal.getsignal(sig) is not _handler:
            signal.signal(sig, _handler)
    return True
