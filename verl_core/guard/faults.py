"""Fault injection for crash and retry tests (and for chaos drills on a real cluster).

Faults are declared in the environment, so they never change a cache key or a config hash:

    VERL_FAULTS='[{"phase": "reward", "step": 1, "kind": "transient", "times": 2}]'
    VERL_FAULTS_DIR=/tmp/faults      # attempt counters and markers (shared across processes)

kinds:
  transient  raise a TransientError (a flaky store, a lost worker) the first ``times`` attempts
  permanent  raise a PermanentError (bad data) every time
  hang       write ``<dir>/<phase>-<step>.entered``, then sleep ``seconds`` (default 3600): a test
             waits for the marker and kills the process in the middle of the phase (with
             ``times``: only the first ``times`` attempts hang)

Phases: the task-level names (``rollout``, ``reward``, ``advantage``, ``update``, ``checkpoint``,
``evaluate``, ``finalize``), plus ``update-rank<r>`` inside worker r of a worker group, in the
middle of its update (after the batch is read, before the optimizer steps).
"""

from __future__ import annotations

import json
import os
import time

from verl_core.checkpoint.errors import PermanentError, TransientError


class InjectedTransientFault(TransientError):
    """A transient fault raised on purpose (VERL_FAULTS)."""


class InjectedPermanentFault(PermanentError):
    """A permanent fault raised on purpose (VERL_FAULTS)."""


def _faults() -> list[dict]:
    spec = os.environ.get("VERL_FAULTS", "")
    if not spec:
        return []
    try:
        faults = json.loads(spec)
    except json.JSONDecodeError as e:
        raise ValueError(f"VERL_FAULTS is not JSON: {e}") from e
    return faults if isinstance(faults, list) else [faults]


def maybe_inject(phase: str, step: int) -> None:
    """Raise/hang if a declared fault matches (phase, step). A no-op without VERL_FAULTS."""
    for f in _faults():
        if f.get("phase") != phase or int(f.get("step", -1)) != step:
            continue
        state_dir = os.environ.get("VERL_FAULTS_DIR") or "/tmp/verl-faults"
        os.makedirs(state_dir, exist_ok=True)
        kind = f.get("kind", "transient")
        if kind == "hang":
            if "times" in f and _count(state_dir, phase, step) >= int(f["times"]):
                continue
            with open(os.path.join(state_dir, f"{phase}-{step}.entered"), "w") as fh:
                fh.write(str(os.getpid()))
            time.sleep(float(f.get("seconds", 3600)))
            continue
        if kind == "permanent":
            raise InjectedPermanentFault(f"injected permanent fault in {phase} of step {step}")
        n = _count(state_dir, phase, step)
        if n < int(f.get("times", 1)):
            raise InjectedTransientFault(
                f"injected transient fault in {phase} of step {step} (attempt {n + 1})")


def _count(state_dir: str, phase: str, step: int) -> int:
    """Attempts of (phase, step) before this one; counts this one (shared across processes)."""
    counter = os.path.join(state_dir, f"{phase}-{step}.attempts")
    n = int(open(counter).read()) if os.path.exists(counter) else 0
    with open(counter, "w") as fh:
        fh.write(str(n + 1))
    return n
