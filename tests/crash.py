"""Crash tests' common step: wait until a running command reaches a marker file, then SIGKILL it
with everything it started (its process group: workers, tool hosts, scorer pools)."""
import os
import signal
import subprocess
import time


def kill_at_marker(proc: subprocess.Popen, marker, what: str, timeout_s: float = 600.0,
                   poll_s: float = 0.2, also=None) -> None:
    """SIGKILL ``proc``'s process group (start it with ``start_new_session=True``) once
    ``marker`` exists (and ``also()`` holds, when given: e.g. a checkpoint that commits in the
    background has committed); fails with the command's output if it ends first, or naming
    ``what`` it never reached within ``timeout_s``."""
    deadline = time.time() + timeout_s
    while not (marker.exists() and (also is None or also())):
        assert proc.poll() is None, proc.stdout.read()[-4000:]
        assert time.time() < deadline, f"the run never reached {what}"
        time.sleep(poll_s)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)
