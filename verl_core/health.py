"""Liveness probes: ``health_check()``, ``python -m verl_core health``, and the phases' heartbeat.

A probe needs no arguments: everything it checks comes from the environment of the pod.

* ``torch``: a tiny matmul is finite (catches a broken install or device);
* ``cuda``: when CUDA is visible, a tiny op on the GPU succeeds (a wedged GPU fails here);
* ``store``: when a store URI is given (``VERL_STORE``), a probe object round-trips;
* ``heartbeat``: when a heartbeat file is given (``VERL_HEARTBEAT_FILE``), it was touched within
  ``VERL_HEARTBEAT_MAX_AGE_S`` seconds (default 600). Every phase calls :func:`beat` when it starts
  and when it ends, so a phase that hangs for longer than that makes the probe fail and Kubernetes
  kill the pod (Flyte then retries the phase). The age limit must exceed the longest phase.
  A file that does not exist yet is healthy: no phase has started in this container (a pod that
  only submits a Ray job, or one still importing), and a probe must not kill a pod for that.

``health_check()`` raises :class:`UnhealthyError` (carrying the report) when a check fails, so
``python -c "import verl_core; verl_core.health_check()"`` exits non-zero; ``health_report()``
returns the same report without raising. The CLI prints the report as JSON and exits 0 healthy,
1 unhealthy, 2 for a bad argument or environment variable.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import uuid

from verl_core.errors import VerlError

STORE_ENV = "VERL_STORE"
"""Run store root a probe round-trips (the same variable names the default ``--store``)."""
HEARTBEAT_ENV = "VERL_HEARTBEAT_FILE"
"""File the phases touch (:func:`beat`) and the probe checks the age of."""
MAX_AGE_ENV = "VERL_HEARTBEAT_MAX_AGE_S"
"""Oldest heartbeat (seconds) the probe accepts."""
DEFAULT_MAX_HEARTBEAT_AGE_S = 600.0


class UnhealthyError(VerlError):
    """A health check failed; ``report`` is what :func:`health_report` returned."""

    def __init__(self, report: dict):
        self.report = report
        failed = "; ".join(f"{name}: {c['detail']}" for name, c in report["checks"].items()
                           if not c["ok"])
        super().__init__(f"verl_core {report['version']} unhealthy: {failed}")


def beat(path: str | None = None) -> None:
    """Touch the heartbeat file (``path``, else ``VERL_HEARTBEAT_FILE``); a no-op when neither is
    set. Called by every phase when it starts and when it ends."""
    path = path or os.environ.get(HEARTBEAT_ENV)
    if not path:
        return
    try:
        parent = os.path.dirname(path)
        if parent:
            os.makedirs(parent, exist_ok=True)
        with open(path, "a"):
            pass
        os.utime(path)
    except OSError as e:
        raise OSError(f"{HEARTBEAT_ENV}={path}: cannot touch the heartbeat file ({e}); point it "
                      "at a writable path or unset it") from e


def _check_torch() -> tuple[bool, str]:
    import torch

    x = torch.ones(4, 4)
    ok = bool(torch.isfinite(x @ x).all())
    return ok, f"torch {torch.__version__}"


def _check_cuda() -> tuple[bool, str] | None:
    import torch

    if not torch.cuda.is_available():
        return None
    try:
        y = torch.ones(8, device="cuda").sum()
        torch.cuda.synchronize()
        return bool(y.item() == 8.0), torch.cuda.get_device_name(0)
    except Exception as e:  # noqa: BLE001 - a probe reports, never raises
        return False, f"cuda error: {e}"


def _check_store(uri: str, storage_options: dict | None) -> tuple[bool, str]:
    import fsspec

    try:
        fs, root = fsspec.core.url_to_fs(uri, **(storage_options or {}))
        path = f"{root.rstrip('/')}/.health/{uuid.uuid4().hex}"
        payload = os.urandom(16)
        fs.makedirs(os.path.dirname(path), exist_ok=True)
        with fs.open(path, "wb") as f:
            f.write(payload)
        with fs.open(path, "rb") as f:
            back = f.read()
        fs.rm(path)
        return back == payload, f"round trip to {uri}"
    except Exception as e:  # noqa: BLE001
        return False, f"store {uri} unreachable: {type(e).__name__}: {e}"


def _check_heartbeat(path: str, max_age_s: float) -> tuple[bool, str]:
    try:
        age = time.time() - os.path.getmtime(path)
    except FileNotFoundError:
        return True, f"heartbeat {path} not written yet (no phase has started here)"
    except OSError as e:
        return False, f"heartbeat {path} unreadable: {e}"
    return age <= max_age_s, f"heartbeat age {age:.1f}s (max {max_age_s:g}s)"


def _max_age_from_env() -> float:
    text = os.environ.get(MAX_AGE_ENV, "")
    if not text:
        return DEFAULT_MAX_HEARTBEAT_AGE_S
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{MAX_AGE_ENV}={text!r}: must be a positive number of seconds, longer "
                         "than the longest phase (e.g. 2400)")
    return value


def health_report(store: str | None = None, *, storage_options: dict | None = None,
                  heartbeat_file: str | None = None,
                  max_heartbeat_age_s: float | None = None) -> dict:
    """Run the checks and return ``{"ok": bool, "version": str, "checks": {name: {ok, detail}}}``
    without raising. ``None`` takes a value from the environment (``VERL_STORE``,
    ``VERL_HEARTBEAT_FILE``, ``VERL_HEARTBEAT_MAX_AGE_S``); ``""`` skips that check."""
    from verl_core import __version__

    if store is None:
        store = os.environ.get(STORE_ENV, "")
    if heartbeat_file is None:
        heartbeat_file = os.environ.get(HEARTBEAT_ENV, "")
    if max_heartbeat_age_s is None:
        max_heartbeat_age_s = _max_age_from_env()
    elif not (math.isfinite(max_heartbeat_age_s) and max_heartbeat_age_s > 0):
        raise ValueError(f"max_heartbeat_age_s={max_heartbeat_age_s}: must be a positive number "
                         "of seconds, longer than the longest phase")
    checks: dict[str, dict] = {}

    def record(name, result):
        if result is not None:
            checks[name] = {"ok": bool(result[0]), "detail": result[1]}

    try:
        record("torch", _check_torch())
        record("cuda", _check_cuda())
    except Exception as e:  # noqa: BLE001
        record("torch", (False, f"{type(e).__name__}: {e}"))
    if store:
        record("store", _check_store(store, storage_options))
    if heartbeat_file:
        record("heartbeat", _check_heartbeat(heartbeat_file, max_heartbeat_age_s))
    return {"ok": all(c["ok"] for c in checks.values()), "version": __version__, "checks": checks}


def health_check(store: str | None = None, *, storage_options: dict | None = None,
                 heartbeat_file: str | None = None,
                 max_heartbeat_age_s: float | None = None) -> dict:
    """:func:`health_report`, raising :class:`UnhealthyError` (with ``.report``) when a check
    fails; returns the report when every check passed."""
    report = health_report(store, storage_options=storage_options, heartbeat_file=heartbeat_file,
                           max_heartbeat_age_s=max_heartbeat_age_s)
    if not report["ok"]:
        raise UnhealthyError(report)
    return report


def main(argv=None, prog: str = "python -m verl_core health") -> int:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    p.add_argument("--store", default=None,
                   help=f"run store URI to round-trip (default: ${STORE_ENV}; '' skips)")
    p.add_argument("--heartbeat-file", default=None,
                   help=f"heartbeat file to check (default: ${HEARTBEAT_ENV}; '' skips)")
    p.add_argument("--max-heartbeat-age-s", type=float, default=None,
                   help=f"oldest heartbeat accepted (default: ${MAX_AGE_ENV} or "
                        f"{DEFAULT_MAX_HEARTBEAT_AGE_S:g})")
    args = p.parse_args(argv)
    try:
        report = health_report(args.store, heartbeat_file=args.heartbeat_file,
                               max_heartbeat_age_s=args.max_heartbeat_age_s)
    except ValueError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(report, indent=1))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main(prog="python -m verl_core.health"))
