"""Fenced writers through `pyflyte run` (issue 21.3). Real processes, real signals, real store.

The run is `cluster.mode=attached` against a long-lived local Ray cluster (`ray start --head`),
where the worker is a detached actor: it outlives its launcher by design, so a survivor is
certain, not a race against Ray's teardown (a worker of a local per_task run dies with the Ray
head in the launcher's process group, the issue saw it commit ~90 ms after the kill first).

1. SIGKILL of the whole `pyflyte` process group while the run's worker (another process
   group) writes a checkpoint: it must commit nothing after the kill (no manifest, no `latest`
   move). The worker is held with SIGSTOP from the moment its in-flight marker appears until
   the launcher is dead and reaped, so the kill always lands mid-write on a 2-core machine;
   then it runs on (SIGCONT) as a survivor would.
2. The same command again, SIGKILLed (process group) while finalize publishes the export: no
   folder under ``exports/`` may look like an export without being a complete one.
3. The same command again: it finishes, and its export verifies (marker, sizes, hashes).
"""
import json
import os
import signal
import subprocess
import time

import pytest

from conftest import REPO, flyte_env, ppo_cmd
from test_resume import _summary
from tests.ray_nodes import RayNodes

pytestmark = pytest.mark.slow


def _start(cmd, env, log):
    # its own session: the process group a terminal (or a pod's kill) would SIGKILL as a whole
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)


def _poll(cond, proc, timeout_s: float, what: str, log_path):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        if proc.poll() is not None:
            pytest.fail(f"the run ended ({proc.returncode}) before {what}:\n"
                        + open(log_path).read()[-6000:])
        time.sleep(0.001)
    pytest.fail(f"no {what} within {timeout_s}s:\n" + open(log_path).read()[-6000:])


def _inflight_save(run_store):
    """(marker path, pid of the writing worker) of a checkpoint save in flight, or None."""
    folder = run_store / "inflight"
    try:
        names = os.listdir(folder)
    except FileNotFoundError:
        return None
    for name in names:
        try:
            doc = json.loads((folder / name).read_text())
        except (OSError, ValueError):  # being written
            continue
        if doc.get("kind") == "save":
            return folder / name, doc["pid"]
    return None


def _commits(run_store) -> tuple:
    """What a reader sees as committed: `latest` and the manifest index."""
    latest = run_store / "latest.json"
    folder = run_store / "checkpoints"
    return (latest.read_bytes() if latest.exists() else None,
            sorted(os.listdir(folder)) if folder.exists() else [])


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


def _kill_group(proc) -> float:
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)  # reaped: its pid is gone, as after kill -9 of a shell's job
    return time.time()


def test_survivor_of_a_killed_launcher_commits_nothing_and_exports_appear_only_complete(
        tmp_path):
    nodes = RayNodes(tmp_path / "ray", num_cpus=2)
    try:
        _three_launches(tmp_path, nodes.address)
    finally:
        nodes.stop()


def _three_launches(tmp_path, ray_address: str):
    from verl_core.checkpoint.hf_export import verify_export

    store, env = tmp_path / "s", flyte_env(tmp_path / "f", RAY_ADDRESS=ray_address)
    run_store = store / "t"
    cmd = ppo_cmd(store, steps=4, overrides={"cluster.mode": "attached"})

    # 1. kill -9 of the launcher's process group while its worker writes a checkpoint
    log1 = tmp_path / "run-1.txt"
    with open(log1, "w") as log:
        proc = _start(cmd, env, log)
        try:
            marker, worker = _poll(lambda: _inflight_save(run_store), proc, 600,
                                   "checkpoint write", log1)
            os.kill(worker, signal.SIGSTOP)
            before = _commits(run_store)
            assert marker.exists(), "the save committed before the worker could be held"
            assert os.getpgid(worker) != proc.pid  # it outlives a kill of the launcher's group
            killed_at = _kill_group(proc)
        finally:
            if proc.poll() is None:
                _kill_group(proc)
    os.kill(worker, signal.SIGCONT)
    # the survivor runs on (a detached actor: until it is reaped when idle, or adopted); its
    # save is done, refused or not, when its in-flight marker is gone
    deadline = time.time() + 60
    while marker.exists() and _alive(worker) and time.time() < deadline:
        time.sleep(0.05)
    assert not marker.exists(), "the survivor's save never ended"
    time.sleep(1.0)  # anything after the marker (a latest written late) would be there now
    after = _commits(run_store)
    assert after == before, (f"committed after the launcher was killed at {killed_at}: "
                             f"{before} -> {after}")

    # 2. the same command, SIGKILLed while finalize publishes the export
    exports = run_store / "exports"
    log2 = tmp_path / "run-2.txt"
    with open(log2, "w") as log:
        proc = _start(cmd, env, log)
        try:
            _poll(lambda: exports.exists() and os.listdir(exports), proc, 600, "an export", log2)
            os.killpg(proc.pid, signal.SIGSTOP)  # mid-publish, whatever it has written so far
            _kill_group(proc)
        finally:
            if proc.poll() is None:
                _kill_group(proc)
    visible = [n for n in os.listdir(exports) if not n.startswith(".")]
    for name in visible:  # anything at an export's name is a complete export
        assert verify_export(str(exports / name)) == [], open(log2).read()[-3000:]

    # 3. the same command finishes, and its export is complete
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    final = _summary(done.stdout).split("final_model='", 1)[1].split("'", 1)[0]
    assert os.path.dirname(final) == str(exports)
    assert verify_export(final, hashes=True) == []
    assert [n for n in os.listdir(exports) if not n.startswith(".")] == [os.path.basename(final)]
