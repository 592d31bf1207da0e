"""The Flyte 2 front door (workflows/ppo_flyte2.py), run as users run it: ``flyte run --local``
in a subprocess, real phases, real signals. It trains the defaults (TINY, 3 steps: the smallest
run tests/workflows compares against); a phase that fails past its local attempts is retried
alone by Flyte 2; SIGKILL in the middle of a phase and the same command again ends with the same
weights; a run begun by either front door is finished by the other (from the run store: the two
front doors share no cache). Each comparison is against the undisturbed weights of this module's
first run, itself checked against nothing but the other runs (all must agree)."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from tests.crash import kill_at_marker
from tests.workflows.conftest import REPO, TINY, flyte_env, ppo_cmd, run

pytest.importorskip("flyte", reason="needs the flyte2 extra (bash .ci/install puts it in .venv)")

STEPS = 3


def flyte2_cmd(store, steps=STEPS, run_name="t"):
    """``flyte run --local workflows/ppo_flyte2.py ppo`` with ppo_cmd's options (the dashed
    spellings, as a user types them)."""
    return [sys.executable, "-c", "import sys; from flyte.cli.main import main; sys.exit(main())",
            "run", "--local", "workflows/ppo_flyte2.py", "ppo", "--store", str(store),
            "--run-name", run_name, "--steps", str(steps), "--batch-size", "8",
            "--rollout-n", "4", "--overrides", json.dumps(TINY)]


def pyflyte_cmd(store, steps=STEPS):
    """ppo_cmd through this interpreter (the venv running the tests holds both front doors)."""
    cmd = ppo_cmd(store, steps=steps)
    return [sys.executable, "-c", "import sys; from flytekit.clis.sdk_in_container.pyflyte "
            "import main; sys.exit(main())"] + cmd[1:]


def phase_log(run_store):
    from verl_core.runlog import read_phase_log

    return [(r["phase"], r["step"]) for r in read_phase_log(str(run_store))]


def final_sha(stdout: str) -> str:
    from tests.crash import weights_sha

    lines = [ln for ln in stdout.splitlines() if ln.startswith("Summary(")]
    assert lines, stdout[-4000:]
    return weights_sha(lines[-1].split("final_model='", 1)[1].split("'", 1)[0])


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The module's reference: the defaults trained STEPS steps by the Flyte 2 front door, with
    the reward phase of step 2 failing with a transient fault 3 times (every local attempt of
    ``run_phase``): only Flyte 2's retry of that one task gets it through."""
    tmp = tmp_path_factory.mktemp("flyte2-ref")
    env = flyte_env(tmp / "env", VERL_FAULTS=json.dumps(
        [{"phase": "reward", "step": 1, "kind": "transient", "times": 3}]))
    t0 = time.monotonic()
    out = run(flyte2_cmd(tmp / "store"), env, timeout=900)
    return {"out": out.stdout + out.stderr, "sha": final_sha(out.stdout), "tmp": tmp,
            "wall_s": time.monotonic() - t0}


def test_flyte2_trains_the_defaults_and_retries_a_failed_phase_alone(trained):
    out = trained["out"]
    for line in ("[verl] 3 RL steps", "[verl] run store:", "[verl] eval after 0 steps",
                 "[verl] step 3/3 reward=", "[verl] done: accuracy"):
        assert line in out, out[-4000:]
    log = phase_log(trained["tmp"] / "store" / "t")
    # every phase ran exactly once: the retry of the reward of step 2 re-ran that task alone
    assert len(log) == len(set(log)), log
    assert ("reward", 1) in log and ("finalize", 3) in log
    # 4 attempts of it: run_phase's 3 local ones failed, the 4th is Flyte 2's retry of the task
    attempts = trained["tmp"] / "env" / "faults" / "reward-1.attempts"
    assert attempts.read_text().strip() == "4", attempts.read_text()
    # the same command again: every phase a cache hit, nothing executes, the same summary
    again = run(flyte2_cmd(trained["tmp"] / "store"), flyte_env(trained["tmp"] / "env"))
    assert phase_log(trained["tmp"] / "store" / "t") == log
    assert final_sha(again.stdout) == trained["sha"]


def test_sigkill_mid_phase_then_the_same_command_is_bit_identical_and_flytekit_can_finish_it(
        trained, tmp_path):
    """Killed in the rollout of step 3 (after the checkpoint of step 2); the same command
    finishes without re-running a finished phase, and ``pyflyte run workflows/ppo.py`` finishes
    a copy of the killed store: both end with the reference weights."""
    store, env = tmp_path / "store", flyte_env(tmp_path / "env")
    hang = {"VERL_FAULTS": json.dumps([{"phase": "rollout", "step": 2, "kind": "hang"}])}
    proc = subprocess.Popen(flyte2_cmd(store), cwd=REPO, env={**env, **hang},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    kill_at_marker(proc, tmp_path / "env" / "faults" / "rollout-2.entered",
                   "the rollout of step 3")
    before = phase_log(store / "t")
    assert ("checkpoint", 2) in before and ("rollout", 2) not in before
    shutil.copytree(store, tmp_path / "copy")

    res = run(flyte2_cmd(store), env)
    after = phase_log(store / "t")
    assert after[:len(before)] == before
    resumed = after[len(before):]
    assert ("rollout", 2) in resumed
    assert not set(resumed) & set(before), f"finished phases ran again: {set(resumed) & set(before)}"
    assert final_sha(res.stdout) == trained["sha"]

    # the other front door, on the killed run's store (a fresh cache: it resumes from the store)
    other = run(pyflyte_cmd(tmp_path / "copy"), flyte_env(tmp_path / "env-k"))
    assert final_sha(other.stdout) == trained["sha"]


def test_a_run_begun_by_flytekit_is_continued_by_flyte2_for_more_steps(trained, tmp_path):
    store = tmp_path / "store"
    first = run(pyflyte_cmd(store, steps=STEPS - 1), flyte_env(tmp_path / "env-k"))
    assert f"[verl] step {STEPS - 1}/{STEPS - 1}" in first.stdout
    more = run(flyte2_cmd(store, steps=STEPS), flyte_env(tmp_path / "env-2"))
    assert f"(start step {STEPS - 1})" in more.stdout, more.stdout[-4000:]
    assert f"[verl] step {STEPS}/{STEPS}" in more.stdout
    assert final_sha(more.stdout) == trained["sha"]
