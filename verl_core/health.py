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

Bounded time: every check runs in its own thread with its own deadline (``VERL_HEALTH_TIMEOUT_S``,
default 10 s; all checks run at once, so the whole probe takes at most that, plus the interpreter's
start). A check that has not answered by then is reported failed, "stalled", with what it was
waiting for: a frozen S3 server accepts the connection and never replies, and botocore's own
timeouts and retries would keep a probe waiting for minutes. The deadline must stay well under the
probe's ``timeoutSeconds`` (30 s in ``deploy/k8s``: ~5 s to start Python and import torch, 10 s of
checks), or Kubernetes counts a timed-out probe, not our report. The store check builds its
filesystem from the run's resolved options (:func:`verl_core.store.resolve_storage_options`:
``VERL_S3_ENDPOINT`` included), the same ones the phases use.

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
import threading
import time
import uuid
from typing import Callable

from verl_core.errors import VerlError

STORE_ENV = "VERL_STORE"
"""Run store root a probe round-trips (the same variable names the default ``--store``)."""
HEARTBEAT_ENV = "VERL_HEARTBEAT_FILE"
"""File the phases touch (:func:`beat`) and the probe checks the age of."""
MAX_AGE_ENV = "VERL_HEARTBEAT_MAX_AGE_S"
"""Oldest heartbeat (seconds) the probe accepts."""
DEFAULT_MAX_HEARTBEAT_AGE_S = 600.0
TIMEOUT_ENV = "VERL_HEALTH_TIMEOUT_S"
"""Deadline (seconds) of each check; keep it well under the probe's ``timeoutSeconds``."""
DEFAULT_CHECK_TIMEOUT_S = 10.0


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


def _check_store(uri: str, storage_options: dict | None, timeout_s: float) -> tuple[bool, str]:
    import fsspec
    from fsspec.asyn import AsyncFileSystem

    from verl_core.store import resolve_storage_options

    try:
        fs, root = fsspec.core.url_to_fs(uri, **resolve_storage_options(uri, storage_options))
        # object stores: each call carries a deadline too, so the abandoned thread ends soon
        # after the report (a second later: the report itself always comes from _bounded)
        kw = {"timeout": timeout_s + 1} if isinstance(fs, AsyncFileSystem) else {}
        path = f"{root.rstrip('/')}/.health/{uuid.uuid4().hex}"
        payload = os.urandom(16)
        if not kw:  # a local folder; on S3 a makedirs could try to create the bucket
            fs.makedirs(os.path.dirname(path), exist_ok=True)
        fs.pipe_file(path, payload, **kw)
        back = fs.cat_file(path, **kw)
        fs.rm_file(path, **kw)
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


def _seconds_from_env(name: str, default: float, hint: str) -> float:
    text = os.environ.get(name, "")
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name}={text!r}: must be a positive number of seconds, {hint}")
    return value


def _max_age_from_env() -> float:
    return _seconds_from_env(MAX_AGE_ENV, DEFAULT_MAX_HEARTBEAT_AGE_S,
                             "longer than the longest phase (e.g. 2400)")


def _timeout_from_env() -> float:
    return _seconds_from_env(TIMEOUT_ENV, DEFAULT_CHECK_TIMEOUT_S,
                             "well under the liveness probe's timeoutSeconds (e.g. 10)")


def _import_first(store: str | None) -> None:
    """Import torch and the store's fsspec implementation (s3fs …) before the checks' clock
    starts: seconds of CPU on a busy node, part of the interpreter's start-up (which the
    probe's ``timeoutSeconds`` covers), not of any check. A failed import is left for the
    check itself to report."""
    try:
        import torch  # noqa: F401
    except Exception:  # noqa: BLE001
        pass
    if store:
        try:
            import fsspec

            fsspec.get_filesystem_class(fsspec.core.split_protocol(store)[0] or "file")
        except Exception:  # noqa: BLE001
            pass


def _bounded(checks: dict[str, tuple[Callable[[], tuple[bool, str] | None], str]],
             timeout_s: float) -> dict[str, tuple[bool, str] | None]:
    """Run every check (``name: (fn, what it waits for)``) at once, each in its own daemon
    thread, and wait for each until ``timeout_s`` after the start. A check still running then is
    reported failed, "stalled"; its thread is abandoned (a daemon: it cannot keep the probe's
    process alive)."""
    boxes: dict[str, list] = {}
    threads = []
    for name, (fn, _) in checks.items():
        box: list = []

        def target(fn=fn, box=box):
            try:
                box.append(fn())
            except Exception as e:  # noqa: BLE001 - a probe reports, never raises
                box.append((False, f"{type(e).__name__}: {e}"))

        boxes[name] = box
        t = threading.Thread(target=target, name=f"verl-health-{name}", daemon=True)
        t.start()
        threads.append(t)
    deadline = time.monotonic() + timeout_s
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    return {name: box[0] if box else
            (False, f"{checks[name][1]} stalled: no answer within {timeout_s:g}s "
                    f"({TIMEOUT_ENV} sets this deadline)")
            for name, box in boxes.items()}


def health_report(store: str | None = None, *, storage_options: dict | None = None,
                  heartbeat_file: str | None = None,
                  max_heartbeat_age_s: float | None = None,
                  timeout_s: float | None = None) -> dict:
    """Run the checks and return ``{"ok": bool, "version": str, "checks": {name: {ok, detail}}}``
    without raising, within ``timeout_s`` (each check's deadline). ``None`` takes a value from
    the environment (``VERL_STORE``, ``VERL_HEARTBEAT_FILE``, ``VERL_HEARTBEAT_MAX_AGE_S``,
    ``VERL_HEALTH_TIMEOUT_S``); ``""`` skips that check."""
    from verl_core._version import __version__

    if store is None:
        store = os.environ.get(STORE_ENV, "")
    if heartbeat_file is None:
        heartbeat_file = os.environ.get(HEARTBEAT_ENV, "")
    if max_heartbeat_age_s is None:
        max_heartbeat_age_s = _max_age_from_env()
    elif not (math.isfinite(max_heartbeat_age_s) and max_heartbeat_age_s > 0):
        raise ValueError(f"max_heartbeat_age_s={max_heartbeat_age_s}: must be a positive number "
                         "of seconds, longer than the longest phase")
    if timeout_s is None:
        timeout_s = _timeout_from_env()
    elif not (math.isfinite(timeout_s) and timeout_s > 0):
        raise ValueError(f"timeout_s={timeout_s}: must be a positive number of seconds, well "
                         "under the liveness probe's timeoutSeconds")
    _import_first(store)
    todo = {"torch": (_check_torch, "a matmul with torch"),
            "cuda": (_check_cuda, "an op on the GPU")}
    if store:
        todo["store"] = (lambda: _check_store(store, storage_options, timeout_s),
                         f"store {store}: the round trip")
    if heartbeat_file:
        todo["heartbeat"] = (lambda: _check_heartbeat(heartbeat_file, max_heartbeat_age_s),
                             f"heartbeat {heartbeat_file}: reading its age")
    checks = {name: {"ok": bool(r[0]), "detail": r[1]}
              for name, r in _bounded(todo, timeout_s).items() if r is not None}
    return {"ok": all(c["ok"] for c in checks.values()), "version": __version__, "checks": checks}


def health_check(store: str | None = None, *, storage_options: dict | None = None,
                 heartbeat_file: str | None = None,
                 max_heartbeat_age_s: float | None = None,
                 timeout_s: float | None = None) -> dict:
    """:func:`health_report`, raising :class:`UnhealthyError` (with ``.report``) when a check
    fails; returns the report when every check passed."""
    report = health_report(store, storage_options=storage_options, heartbeat_file=heartbeat_file,
                           max_heartbeat_age_s=max_heartbeat_age_s, timeout_s=timeout_s)
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
    p.add_argument("--timeout-s", type=float, default=None,
                   help=f"deadline of each check (default: ${TIMEOUT_ENV} or "
                        f"{DEFAULT_CHECK_TIMEOUT_S:g}); keep it under the probe's timeoutSeconds")
    args = p.parse_args(argv)
    try:
        report = health_report(args.store, heartbeat_file=args.heartbeat_file,
                               max_heartbeat_age_s=args.max_heartbeat_age_s,
                               timeout_s=args.timeout_s)
    except ValueError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(report, indent=1))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main(prog="python -m verl_core.health"))
