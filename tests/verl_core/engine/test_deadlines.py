"""Phase deadlines and the wall-clock watch, in this process: a blocked phase is cut by its
deadline (SIGALRM) as a transient error, and a latency spike against the phase's own history is
logged or acted on by its policy (retry_phase raises transient, halt permanent)."""
import threading
import time

import pytest

from verl_core.errors import PermanentError, TransientError
from verl_core.store import RunStore
from verl_core.config import RunConfig, with_overrides
from verl_core import runlog
from verl_core.engine import workers
from verl_core.types import RunSpec
from verl_core.guard.events import read_events
from verl_core.guard.policy import GuardHaltError, GuardRetryError


def test_deadline_cuts_a_blocked_block_as_transient():
    t0 = time.monotonic()
    with pytest.raises(workers.PhaseTimeoutError, match="reward of step 3 passed its deadline"):
        with workers.deadline(0.5, "reward of step 3"):
            threading.Event().wait(30)  # a hang: a wait that never ends
    assert time.monotonic() - t0 < 5
    assert issubclass(workers.PhaseTimeoutError, TransientError)
    with workers.deadline(0.3, "fast"):  # a block within its deadline is untouched
        time.sleep(0.01)
    time.sleep(0.5)  # and the timer is gone afterwards (no stray alarm)


def _spec(tmp_path, **guard):
    cfg = with_overrides(RunConfig(), {f"guard.{k}": v for k, v in guard.items()})
    st = RunStore(str(tmp_path / "run"))
    return RunSpec(store=st.uri, incarnation=st.incarnation_id,
                           config=cfg,
                           trajectory_hash=cfg.trajectory_hash(), assets_json="{}", start_step=0,
                           total_steps=cfg.total_steps)


@pytest.mark.parametrize("policy,error,outcome", [
    ("warn", None, "logged"), ("retry_phase", GuardRetryError, "retrying"),
    ("halt", GuardHaltError, "halted")])
def test_a_latency_spike_is_logged_and_acted_on_by_its_policy(tmp_path, policy, error, outcome):
    spec = _spec(tmp_path, latency_spike_policy=policy, latency_spike_min_s=1.0)
    for step in range(12):  # a steady history: ~0.2 s per rollout, well past the warm-up
        runlog.watch_phase(spec, "rollout", step, 0.2 + 0.01 * (step % 3), {})
    assert read_events(spec.open_store(), spec.trajectory_hash) == []
    if error is None:
        runlog.watch_phase(spec, "rollout", 12, 30.0, {})
    else:
        with pytest.raises(error, match="latency_spike|rollout") as e:
            runlog.watch_phase(spec, "rollout", 12, 30.0, {})
        assert isinstance(e.value, TransientError if policy == "retry_phase" else PermanentError)
    (ev,) = read_events(spec.open_store(), spec.trajectory_hash)
    assert (ev["step"], ev["phase"], ev["detector"], ev["action"], ev["outcome"]) == (
        12, "rollout", "latency_spike", policy, outcome)
    assert ev["signal"] == "timing/rollout_s" and ev["value"] == 30.0 and ev["threshold"] < 30


def test_the_guard_off_watches_nothing(tmp_path):
    spec = _spec(tmp_path, enabled=False)
    for step in range(12):
        runlog.watch_phase(spec, "rollout", step, 0.2, {})
    runlog.watch_phase(spec, "rollout", 12, 1e4, {})
    assert read_events(spec.open_store(), spec.trajectory_hash) == []


def test_a_restore_longer_than_a_phase_is_not_taken_for_a_hang(tmp_path):
    """A resumed run's first phase also restores the state it starts from (a new worker, a
    checkpoint read, the updates since replayed). Here that restore takes longer than
    ``guard.phase_timeout_s`` (a VERL_FAULTS ``slow`` at ``restore``, on every attempt): the run
    finishes, because a new worker's first phase has ``guard.restore_timeout_s`` on top. Counted
    against the phase's deadline, each attempt passed it and the retries repeated the restore
    until the run failed (what this test met before the fix)."""
    import json
    import os
    import subprocess
    import sys

    from tests.presets import TINY

    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__)))))
    phase_s = 20.0  # a tiny phase takes well under a second idle, a few on loaded cores
    cmd = [sys.executable, "-m", "verl_core.train", "--workdir", str(tmp_path / "run")]
    for k, v in {**TINY, "guard.phase_timeout_s": phase_s}.items():
        cmd += ["--set", f"{k}={v}"]
    env = {**os.environ, "PYTHONPATH": repo, "VERL_ASSET_CACHE": str(tmp_path / "assets"),
           "VERL_FAULTS_DIR": str(tmp_path / "faults")}
    first = subprocess.run([*cmd, "--steps", "2"], env=env, capture_output=True, text=True,
                           timeout=900)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    slow = [{"kind": "slow", "phase": "restore", "step": 2, "seconds": phase_s + 5, "times": 3}]
    again = subprocess.run([*cmd, "--steps", "3"], env={**env, "VERL_FAULTS": json.dumps(slow)},
                           capture_output=True, text=True, timeout=900)
    out = again.stdout + again.stderr
    assert again.returncode == 0, out[-3000:]
    assert (tmp_path / "faults" / "restore-2-slow.attempts").read_text() == "1", out[-3000:]
    assert "passed its deadline" not in out and "step 3/3" in out, out[-3000:]
