"""Preemption and deadlines in the plain loop (issue 40): a SIGTERM (Kubernetes' grace period, a
Ray drain) saves the newest state before the process goes, and ``checkpoint.must_save_by`` saves
and stops before the deadline; each run, continued by the same command, ends with the weights of
an uninterrupted run. Real processes and real signals."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.crash import rerun_until_done, weights_sha
from tests.presets import TINY
from verl_core.checkpoint.deadline import must_stop, parse_must_save_by

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS = 4
# a warm start to 0.2 accuracy: some groups' rewards differ, so the updates move the weights
# (TINY's 5 warm-start steps leave every reward equal: equal weights would prove nothing)
SETTINGS = {**TINY, "model.warmup_sft_steps": 400, "model.warmup_target_accuracy": 0.2,
            "checkpoint.checkpoint_interval": 100, "val_before_train": False}


def _argv(workdir, summary, **extra) -> list[str]:
    sets = [a for k, v in {**SETTINGS, **extra}.items() for a in ("--set", f"{k}={json.dumps(v)}")]
    return ["--workdir", str(workdir), "--steps", str(STEPS), "--summary-json", str(summary), *sets]


def _cli(argv, stderr=subprocess.PIPE):
    return subprocess.Popen([sys.executable, "-m", "verl_core.train", *argv], cwd=REPO,
                            env={**os.environ, "PYTHONPATH": REPO, "PYTHONUNBUFFERED": "1"},
                            text=True, stdout=subprocess.PIPE, stderr=stderr)


def _weights_sha(summary_file) -> str:
    return weights_sha(json.loads(open(summary_file).read())["final_model"])


def _steps_saved(workdir) -> set[int]:
    from verl_core.checkpoint.manager import CheckpointManager
    from verl_core.store import RunStore

    return {i.step for i in CheckpointManager(RunStore(str(workdir))).list_checkpoints()
            if i.error is None}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    root = tmp_path_factory.mktemp("straight")
    proc = _cli(_argv(root / "run", root / "s.json"))
    out, err = proc.communicate(timeout=1800)
    assert proc.returncode == 0, err[-3000:]
    import pandas as pd

    metrics = pd.read_parquet(next((root / "run" / "metrics").glob("*.parquet")))
    assert (metrics["rollout/zero_variance_frac"].dropna() < 1.0).any(), \
        "no step had a learning signal: equal weights would prove nothing"
    return _weights_sha(root / "s.json")


@pytest.mark.slow
def test_sigterm_saves_the_newest_state_and_the_same_command_ends_as_uninterrupted(
        uninterrupted, tmp_path):
    summary = tmp_path / "s.json"
    argv = _argv(tmp_path / "run", summary)
    errors = open(tmp_path / "stderr.txt", "w+")  # read after: a full pipe would block it
    proc = _cli(argv, stderr=errors)
    for line in proc.stdout:  # the step lines: SIGTERM once step 2 has ended
        if line.startswith(f"step 2/{STEPS}"):
            break
    else:
        proc.wait(timeout=600)
        pytest.fail(f"no step 2 line: {open(errors.name).read()[-3000:]}")
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=600)
    err = open(errors.name).read()
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert "[verl] interrupted (SIGTERM)" in err and "and the checkpoint of step" in err, err[-2000:]
    saved = int(err.split("and the checkpoint of step ")[1].split()[0])
    assert 2 <= saved < STEPS and saved in _steps_saved(tmp_path / "run"), (saved, err[-2000:])
    # interval 100: without the preemption save only the last step would ever be saved
    again = _cli(argv)
    _, err = again.communicate(timeout=1800)
    assert again.returncode == 0, err[-3000:]
    assert f"resuming from the checkpoint of step {saved}" in err + _, err[-2000:]
    assert _weights_sha(summary) == uninterrupted


@pytest.mark.slow
def test_must_save_by_saves_and_stops_then_the_same_command_ends_as_uninterrupted(
        uninterrupted, tmp_path):
    summary = tmp_path / "s.json"
    # a deadline a few seconds away: less than a step and a save (60 s before one is measured)
    proc = _cli(_argv(tmp_path / "run", summary,
                      **{"checkpoint.must_save_by": f"{time.time() + 30:.0f}"}))
    _, err = proc.communicate(timeout=1800)
    assert proc.returncode == 0, err[-3000:]
    assert "[verl] stopped after step 1: " in err and "checkpoint.must_save_by" in err, err[-2000:]
    assert not summary.exists() and _steps_saved(tmp_path / "run") == {1}
    again = _cli(_argv(tmp_path / "run", summary))
    out, err = again.communicate(timeout=1800)
    assert again.returncode == 0, err[-3000:]
    assert _weights_sha(summary) == uninterrupted


def test_the_deadline_rule_and_its_forms():
    assert parse_must_save_by("", 100.0) is None
    assert parse_must_save_by("01:00:00", 100.0) == 3700.0
    assert parse_must_save_by("1:00:00:30", 0.0) == 86430.0
    assert parse_must_save_by("2026-12-04T18:00:00Z", 0.0) == parse_must_save_by(
        "2026-12-04T19:00:00+01:00", 0.0) == 1796407200.0
    assert parse_must_save_by("1796407200", 0.0) == 1796407200.0
    with pytest.raises(ValueError, match="HH:MM:SS"):
        parse_must_save_by("tomorrow", 0.0)
    # stop when the time left is at most the longest step + the longest save + the margin
    assert must_stop(0.0, None, [5.0], [], 0.0) == (False, 0.0)
    assert must_stop(0.0, 100.0, [], [], 0.0) == (False, 0.0)  # nothing measured yet
    assert must_stop(0.0, 100.0, [5.0, 9.0], [], 0.0) == (False, 69.0)  # 60 s: verl's estimate
    assert must_stop(0.0, 100.0, [5.0, 9.0], [20.0], 71.0) == (True, 100.0)


@pytest.mark.slow
def test_sigkills_in_an_evaluation_and_in_finalize_then_the_same_command_ends_as_uninterrupted(
        uninterrupted, tmp_path):
    # docs/resume.md's evaluate and export/finalize rows: the process SIGKILLed as the evaluation
    # of step 2 starts, then as finalize (the export) starts; each re-run of the same command
    # goes on, and the last ends with the uninterrupted run's weights (evaluations change none)
    summary = tmp_path / "s.json"
    argv = _argv(tmp_path / "run", summary, eval_every=2)
    faults = [{"kind": "kill", "phase": "evaluate", "step": 2},
              {"kind": "kill", "phase": "finalize", "step": STEPS}]
    codes = rerun_until_done([sys.executable, "-m", "verl_core.train", *argv],
                             {**os.environ, "PYTHONPATH": REPO}, faults, tmp_path, tries=3)
    err = open(tmp_path / f"run{len(codes) - 1}.out").read()
    assert codes == [-signal.SIGKILL, -signal.SIGKILL, 0], (codes, err[-3000:])
    assert _weights_sha(summary) == uninterrupted
