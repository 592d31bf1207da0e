"""Crash tests' common step: wait until a running command reaches a marker file, then SIGKILL it
with everything it started (its process group: workers, tool hosts, scorer pools)."""
import os
import signal
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def train_command(work, overrides: dict, **env) -> tuple[list[str], dict]:
    """The plain loop's command (``python -m verl_core.train``) on ``work`` with ``overrides``
    (dotted keys, ``--set``), and its environment: this one, the repository on the path,
    ``env`` added (``VERL_FAULTS_DIR``, ``VERL_ASSET_CACHE``)."""
    cmd = [sys.executable, "-m", "verl_core.train", "--workdir", str(work)]
    for k, v in overrides.items():
        cmd += ["--set", f"{k}={v}"]
    return cmd, {**os.environ, "PYTHONPATH": REPO, **{k: str(v) for k, v in env.items()}}


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


def kill_then_resume(cmd: list[str], env: dict, marker, summary_json) -> dict:
    """Start ``cmd`` (a plain-loop command), SIGKILL it once ``marker`` exists (the first
    checkpoint's ``latest.json``), run the same command again to the end, and return its summary
    (written to ``summary_json``) after checking it exited 0 and said it resumed."""
    import json

    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True, env=env)
    kill_at_marker(proc, marker, "the first checkpoint", poll_s=0.05)
    done = subprocess.run(cmd + ["--summary-json", str(summary_json)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "resuming from the checkpoint of step" in done.stdout
    with open(summary_json) as f:
        return json.load(f)


def weights_sha(final: str) -> str:
    """sha-256 over the ``.safetensors`` files of a model folder, local or in an ``s3://`` run
    store (a run's export, its summary's ``final_model``): docs/resume.md's comparison (a)."""
    import hashlib

    import fsspec

    from verl_core.store import resolve_storage_options

    fs, root = fsspec.core.url_to_fs(final, **resolve_storage_options(final))
    h = hashlib.sha256()
    for path in sorted(fs.ls(root, detail=False)):
        if path.endswith(".safetensors"):
            h.update(fs.cat_file(path))
    return h.hexdigest()


def rerun_until_done(cmd: list[str], env: dict, faults: list[dict], logs, tries: int,
                     cwd=None) -> list[int]:
    """Run ``cmd`` (in ``cwd``, when given) with the faults ``faults`` declared (VERL_FAULTS;
    each fires once, counted in ``logs/faults``) until it exits 0 or ``tries`` runs ended: the
    exit code of each run. Output goes to files in ``logs`` (a pipe would hang on a child the
    kill orphaned), and what a killed run left of its process group (a tool host, a sampler
    process, a local Ray instance) is killed after it."""
    import json

    env = {**env, "VERL_FAULTS": json.dumps(faults), "VERL_FAULTS_DIR": str(logs / "faults")}
    codes = []
    for i in range(tries):
        with open(logs / f"run{i}.out", "w") as out:
            proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)
            codes.append(proc.wait(timeout=900))
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if codes[-1] == 0:
            break
    return codes
