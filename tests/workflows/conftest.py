"""Helpers to run the real workflow with `pyflyte run` in a subprocess (no mocked phases)."""
import json
import os
import pathlib
import subprocess
import sys
import time
from dataclasses import dataclass

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
PYFLYTE = str(pathlib.Path(sys.executable).with_name("pyflyte"))

# Small enough for a 2-core CI machine, big enough to exercise every phase and a checkpoint.
TINY = {"model.warmup_sft_steps": 30, "model.warmup_target_accuracy": 1.0,
        "data.synthetic_train_size": 200, "data.synthetic_val_size": 32,
        "checkpoint.checkpoint_interval": 2}


def flyte_env(tmp_path: pathlib.Path, **extra) -> dict:
    env = dict(os.environ)
    env.update({
        "HOME": str(tmp_path / "home"),  # isolates flytekit's local cache (~/.flyte/local-cache)
        "RAY_AUTH_MODE": "disabled",
        "PYTHONPATH": str(REPO),
        "VERL_ASSET_CACHE": str(tmp_path / "assets"),
        "VERL_FAULTS_DIR": str(tmp_path / "faults"),
    })
    env.pop("RAY_ADDRESS", None)
    env.update(extra)
    (tmp_path / "home").mkdir(parents=True, exist_ok=True)
    return env


def ppo_cmd(store, run_name="t", steps=4, overrides=None, **opts):
    cmd = [PYFLYTE, "run", "workflows/ppo.py", "ppo", "--store", str(store), "--run-name", run_name,
           "--steps", str(steps), "--batch-size", "8", "--rollout-n", "4",
           "--overrides", json.dumps({**TINY, **(overrides or {})})]
    for k, v in opts.items():
        cmd += [f"--{k.replace('_', '-')}", str(v)]
    return cmd


def run(cmd, env, timeout=600, check=True):
    try:
        out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True,
                             timeout=timeout)
    except subprocess.TimeoutExpired as e:  # say where it was stuck
        text = [(x.decode(errors="replace") if isinstance(x, bytes) else x or "")
                for x in (e.stdout, e.stderr)]
        pytest.fail(f"{' '.join(cmd)} timed out after {timeout}s:\n{text[0][-4000:]}\n"
                    f"{text[1][-6000:]}")
    if check and out.returncode != 0:
        pytest.fail(f"{' '.join(cmd)} failed ({out.returncode}):\n{out.stdout[-4000:]}\n"
                    f"{out.stderr[-6000:]}")
    return out


@dataclass(frozen=True)
class Reference:
    """An undisturbed run: its console output, its run store (``<store>/t``) and its wall time
    (the machine's pace now: what a test derives its deadlines from)."""
    stdout: str
    run_store: pathlib.Path
    wall_s: float = 0.0


@pytest.fixture(scope="session")
def reference_run(tmp_path_factory):
    """``reference_run(steps)``: the undisturbed ``ppo_cmd(store, steps=steps)`` run (TINY, no
    other overrides, no faults), run once per session and shared by every test that compares a
    disturbed run of the same trajectory against it (a pyflyte launch costs ~15 s before its
    first step on a 2-core machine). Tests whose disturbed run also sets keys outside the
    trajectory (``guard.phase_timeout_s``, ``checkpoint.*``: ``RunConfig.trajectory_hash`` leaves
    them out) compare against it too: they must not change a weight."""
    runs: dict[int, Reference] = {}

    def get(steps: int) -> Reference:
        if steps not in runs:
            tmp = tmp_path_factory.mktemp(f"reference-{steps}")
            t0 = time.monotonic()
            out = run(ppo_cmd(tmp / "store", steps=steps), flyte_env(tmp / "env"), timeout=900)
            runs[steps] = Reference(out.stdout, tmp / "store" / "t", time.monotonic() - t0)
        return runs[steps]

    return get
