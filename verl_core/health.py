"""``health_check()`` for liveness/readiness probes: ``python -m verl_core.health [--store URI]``.

Checks are cheap (well under a second without a store) and each reports ok/fail with a reason:

* ``torch``: a tiny matmul is finite (catches a broken install or device);
* ``cuda``: when CUDA is visible, a tiny op on the GPU succeeds (a wedged GPU fails here);
* ``store``: when a store URI is given, a probe object round-trips (write, read, compare);
* ``heartbeat``: when a heartbeat file is given, it was touched within ``max_heartbeat_age_s``
  (a training process that hangs stops touching it: the probe then fails and the pod restarts).

Exit code of the CLI: 0 healthy, 1 unhealthy; the report is printed as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import uuid


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
    except OSError as e:
        return False, f"heartbeat {path} missing: {e}"
    return age <= max_age_s, f"heartbeat age {age:.1f}s (max {max_age_s:.0f}s)"


def health_check(store: str | None = None, *, storage_options: dict | None = None,
                 heartbeat_file: str | None = None, max_heartbeat_age_s: float = 600.0) -> dict:
    """Run the checks; returns ``{"ok": bool, "version": str, "checks": {name: {ok, detail}}}``."""
    from verl_core import __version__

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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m verl_core.health", description=__doc__.splitlines()[0])
    p.add_argument("--store", default=os.environ.get("VERL_STORE"), help="run store URI to probe")
    p.add_argument("--heartbeat-file", default=os.environ.get("VERL_HEARTBEAT_FILE"))
    p.add_argument("--max-heartbeat-age-s", type=float, default=600.0)
    args = p.parse_args(argv)
    report = health_check(args.store, heartbeat_file=args.heartbeat_file,
                          max_heartbeat_age_s=args.max_heartbeat_age_s)
    print(json.dumps(report, indent=1))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
