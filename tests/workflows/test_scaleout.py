"""`pyflyte run … --overrides '{"trainer.n_gpus_per_node": 2}'`: the real workflow on a worker group
of 2 (Ray actors, FSDP2 over gloo) trains what one worker trains, up to float rounding; and
`cluster.mode=attached` against a long-lived local Ray cluster (`ray start --head`) ends with the
same weights as the default `per_task` mode, on the defaults: neither run pins `num_threads`, both
compute with the count their first prepare recorded (issue 21 item 8: the attached actor used to
get Ray's one thread, the per_task actor the host's CPU count, and the weights differed). And
docs/resume.md's W = 2 column: the same W = 2 run stopped at several fault points in turn and
re-run until done ends with the undisturbed W = 2 run's exact weights, and so do a W = 2
multi-turn run whose worker is SIGKILLed in a tool call and a W = 2 off-policy run SIGKILLed in
a background rollout."""
import json
import os
import pathlib
import re
import signal
import subprocess
import time

import pytest
import torch
from safetensors.torch import load_file

from conftest import REPO, flyte_env, ppo_cmd, run
from tests.crash import rerun_until_done
from tests.ray_nodes import RayNodes
from verl_core import threads

pytestmark = pytest.mark.slow

W2 = {"trainer.n_gpus_per_node": 2}


@pytest.fixture(scope="module")
def two_workers(tmp_path_factory):
    """The undisturbed 3-step W = 2 run (TINY): its console output and run store. Both tests
    compare against it (a W = 2 pyflyte run costs about 100 s on a 2-core machine)."""
    tmp = tmp_path_factory.mktemp("w2")
    out = run(ppo_cmd(tmp / "store", steps=3, overrides=W2), flyte_env(tmp / "env"), timeout=900)
    return out.stdout, tmp / "store" / "t"


def _final_weights(stdout: str) -> dict:
    line = [ln for ln in stdout.splitlines() if ln.startswith("Summary(")][-1]
    final = line.split("final_model='", 1)[1].split("'", 1)[0]
    return load_file(os.path.join(final, "model.safetensors"))


def _tokens(store_run) -> list:
    from verl_core.store import RunStore
    from verl_core.engine.worker import get_batch

    st = RunStore(str(store_run))
    [folder] = st.list_folders("lineage")
    return [get_batch(st, st.get_json(d)["batch"]).response_ids
            for d in sorted(st.list_json(folder))]


def _threads(store_run) -> int:
    """The intra-op thread count the run's first prepare recorded (verl_core.threads)."""
    return json.loads((store_run / "compute.json").read_text())["num_threads"]


def _assert_learned(stdout: str) -> None:
    """The undisturbed run learned something (some step's groups' rewards differ): equal weights
    are not the weights of a run that never moved."""
    import pandas as pd

    table = [ln for ln in stdout.splitlines() if ln.startswith("Summary(")][-1]
    table = table.split("metrics_table='", 1)[1].split("'", 1)[0]
    assert (pd.read_parquet(table)["rollout/zero_variance_frac"] < 1.0).any(), \
        "no step had a learning signal: equal weights would prove nothing"


def test_two_workers_match_one_and_attached_mode_matches_per_task_through_pyflyte(
        tmp_path, reference_run, two_workers):
    one = reference_run(3)  # W = 1, per_task: the plain run (shared with test_heal.py)
    two_stdout, two_store = two_workers
    # the same sampled tokens at every step (see tests/verl_core/engine/test_group.py for why
    # only float rounding separates W = 2 from W = 1, and the bound)
    a, b = _tokens(one.run_store), _tokens(two_store)
    assert len(a) == len(b) == 3 and all(torch.equal(x, y) for x, y in zip(a, b))
    wa, wb = _final_weights(one.stdout), _final_weights(two_stdout)
    assert max(float((wa[k] - wb[k]).abs().max()) for k in wa) <= 1e-5

    # cluster.mode=attached: plain tasks join a long-lived cluster where the worker is a
    # detached actor (Ray gives it one thread by default); it computes with the thread count its
    # prepare recorded, as the per_task run above does (the same host: the same count), so the
    # arithmetic, and the weights, are the same bit for bit
    recorded = _threads(one.run_store)
    assert recorded == threads.default_num_threads(1)
    nodes = RayNodes(tmp_path / "ray", num_cpus=2)
    try:
        attached = run(ppo_cmd(tmp_path / "w3", steps=3, overrides={"cluster.mode": "attached"}),
                       flyte_env(tmp_path / "c", RAY_ADDRESS=nodes.address))
        # the worker ran on that cluster as the detached actor (Ray logs each actor's class)
        logs = [f.read_text(errors="replace")
                for f in pathlib.Path(nodes.temp_dir).rglob("worker-*.out")]
        assert any(":actor_name:AttachedRunWorker" in text for text in logs)
    finally:
        nodes.stop()
    assert _threads(tmp_path / "w3" / "t") == recorded
    wc = _final_weights(attached.stdout)
    assert wa.keys() == wc.keys() and all(torch.equal(wa[k], wc[k]) for k in wa)


# (kind, phase, step) in the order the W = 2 run meets them (steps 0-based: the checkpoint of
# step k + 1 follows update k; TINY checkpoints after steps 2 and 3; the end evaluation and
# finalize name state 3). A fault fires in the pyflyte process, where prepare (the warm start)
# and the phases' tasks run: a ``kill`` takes its Ray instance (the worker group's two actors)
# with it. Each fault costs one more launch (about a minute on a loaded 2-core machine): the
# chain took 4 min on a quiet 2-core machine (5 with its reference), 10 at load 8-20.
# docs/resume.md's W = 2 column (footnote 14)
WARM_TERM = ("term", "warm_start", 10)
CHAIN = [WARM_TERM, ("kill", "rollout", 1), ("term", "update", 1), ("kill", "checkpoint", 2),
         ("kill", "evaluate", 3), ("kill", "finalize", 3)]
EXIT = {"kill": -signal.SIGKILL, "term": 128 + signal.SIGTERM}


def test_two_workers_killed_or_preempted_at_each_fault_point_end_as_uninterrupted(
        two_workers, tmp_path):
    """docs/resume.md's W = 2 column: the undisturbed W = 2 run's command, in a store of its
    own, stopped at each of CHAIN's points (one per process, each fires once) and run again
    until it exits 0: the exit codes are exactly the faults', and the final weights are the
    undisturbed run's, bit for bit.

    The preemption: the workflow's phases do not save on a SIGTERM (that is the plain loop's
    ``checkpoint.preempt_grace_s``): the interrupt handler exits 143 after its 3 s grace,
    abandoning the phase in flight. So the update of step 1 is held where the SIGTERM lands (a
    ``hang`` after the ``term``: otherwise the run could reach the next fault within the grace,
    and what it interrupts would depend on the machine's pace)."""
    stdout, _ = two_workers
    _assert_learned(stdout)
    faults = [{"kind": k, "phase": p, "step": s} for k, p, s in CHAIN]
    at = faults.index({"kind": "term", "phase": "update", "step": 1}) + 1
    faults.insert(at, {"kind": "hang", "phase": "update", "step": 1, "times": 1})
    codes = rerun_until_done(ppo_cmd(tmp_path / "store", steps=3, overrides=W2),
                             flyte_env(tmp_path / "env"), faults, tmp_path,
                             tries=len(CHAIN) + 1, cwd=REPO)
    outs = [(tmp_path / f"run{i}.out").read_text(errors="replace") for i in range(len(codes))]
    assert codes == [EXIT[k] for k, _, _ in CHAIN] + [0], (codes, outs[-1][-3000:])
    for (kind, phase, step), out in zip(CHAIN, outs):  # each run stopped where its fault is
        what = "killing" if kind == "kill" else "SIGTERM to"
        assert re.search(rf"VERL_FAULTS: {what} pid \d+ in {phase} of step {step}\n", out), \
            out[-3000:]
    # the warm start (TINY: 30 steps, in prepare) preempted after its 10th step saved itself, and
    # the re-run resumed it there: the chain's env has an asset cache of its own (flyte_env:
    # VERL_ASSET_CACHE under tmp_path), so it warm-starts rather than taking the reference's
    after = outs[CHAIN.index(WARM_TERM) + 1]
    assert "warm start: resuming from step 10" in after, after[-3000:]
    term = outs[CHAIN.index(("term", "update", 1))]
    assert "[verl] interrupted (SIGTERM) during the update of step 1" in term, term[-3000:]
    # the run was a W = 2 one throughout: both checkpoints written by two workers
    ckpts = sorted((tmp_path / "store" / "t" / "checkpoints").glob("*.json"))
    assert [json.loads(c.read_text())["world_size"] for c in ckpts] == [2, 2]
    want, got = _final_weights(stdout), _final_weights(outs[-1])
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)


# docs/resume.md's tool-call cell of the W = 2 column: the calculator task (multi-turn, its tool
# built in), warm-started on call transcripts until 0.2 train-slice accuracy (at most 400 steps)
# so that some groups' rewards differ, as test_resume_table.py's multi-turn chain is
CALCULATOR = {**W2, "data.synthetic_task": "calculator", "model.warmup_mixed_steps": 0,
              "model.warmup_sft_steps": 400, "model.warmup_target_accuracy": 0.2}
TOOL_CALL = ("kill", "tool_call", 1)


@pytest.mark.timeout(3600)  # two W = 2 multi-turn launches and a 400-step warm start, loaded
def test_two_workers_killed_in_a_tool_call_end_as_uninterrupted(tmp_path, shared_asset_cache):
    """A W = 2 multi-turn run SIGKILLed in a tool call ends with the undisturbed W = 2 run's
    exact weights.

    The ``tool_call`` fault fires where the calls run: in a worker of the group (each samples its
    block of rows and runs their tool calls), once the calls of step 1's first turn are sent to
    its tool host. The worker dies with its calls in flight; the rollout task finds it gone,
    tears the group down (WorkerLostError, transient) and retries in the same launch: a new
    group rebuilds state 1 from the run store (no checkpoint before step 2: the warm start plus
    update 0's replay) and samples step 1 again: the launch goes on and exits 0. Both runs take
    the calculator's warm start from the session's shared cache (the same key as
    test_resume_table.py's multi-turn chains: it is not what this test is about)."""
    cache = str(shared_asset_cache)  # test_resume_table.py's multi-turn chains warm it first
    ref = run(ppo_cmd(tmp_path / "ref", steps=3, overrides=CALCULATOR),
              flyte_env(tmp_path / "ref-env", VERL_ASSET_CACHE=cache), timeout=1500)
    _assert_learned(ref.stdout)
    env = flyte_env(tmp_path / "env", VERL_ASSET_CACHE=cache)
    kind, phase, step = TOOL_CALL
    codes = rerun_until_done(ppo_cmd(tmp_path / "store", steps=3, overrides=CALCULATOR), env,
                             [{"kind": kind, "phase": phase, "step": step}], tmp_path, tries=1,
                             cwd=REPO)
    outs = [(tmp_path / f"run{i}.out").read_text(errors="replace") for i in range(len(codes))]
    # the launch was not stopped: the kill ended a worker, and the rollout task's retry went on
    assert codes == [0], (codes, outs[-1][-3000:])
    # it fired (counted in VERL_FAULTS_DIR) in a worker of the group, inside the rollout of step 1
    assert (tmp_path / "faults" / f"{phase}-{step}-{kind}.attempts").exists(), outs[0][-3000:]
    assert "rollout of step 1: transient failure (worker group lost during rollout" in outs[0], \
        outs[0][-3000:]
    want, got = _final_weights(ref.stdout), _final_weights(outs[-1])
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)


# docs/resume.md's background-rollout cell of the W = 2 column (footnote 16): off-policy at
# staleness 2 (rollout.async_mode=thread, the default: each worker samples its block of rows in
# a thread of its own and the blocks are gathered on the rollout's gloo group). The background
# rollout of step 3 starts, in both workers, as update 1 begins (from the weights of step 1);
# there is no checkpoint before step 2, so the re-run rebuilds state 1 from the warm start and
# update 0's replay, with the queue of behaviour versions the rollouts of steps 2 and 3 sample
OFF_POLICY = {**W2, "rollout.max_staleness": 2, "algorithm.rollout_is": "token"}
BACKGROUND = ("background_rollout", 3)


def _batches(store_run) -> dict:
    """Each update's lineage record's batch ref (the stored batch it read), by step."""
    from verl_core.store import RunStore

    st = RunStore(str(store_run))
    [folder] = st.list_folders("lineage")
    records = [st.get_json(d) for d in sorted(st.list_json(folder))]
    return {r["step"]: r["batch"] for r in records}


def test_two_workers_off_policy_killed_in_a_background_rollout_end_as_uninterrupted(tmp_path):
    """A W = 2 off-policy run SIGKILLed while the background rollout of step 3 samples (beside
    update 1), and the same command run again, ends with the undisturbed W = 2 run's exact
    weights, every update having read the undisturbed run's batch.

    The ``background_rollout`` fault fires in each worker's background thread (both workers run
    one): a ``hang`` writes the marker and holds the thread, and the test SIGKILLs the launch's
    whole process group (pyflyte, its local Ray instance and the group's two actors), so the
    rollouts in flight die with the workers. The re-run's group rebuilds state 1 (the warm start,
    update 0 replayed) and its behaviour queue, and samples again what the killed one had not
    stored (in the run this test was written with: the batches of steps 2 and 3, the kill landing
    in update 1). At TINY's 30-step warm start only update 2 has a learning signal (the batch of
    step 2, sampled from the weights of step 0); the batch refs check the others."""
    ref = run(ppo_cmd(tmp_path / "ref", steps=4, overrides=OFF_POLICY),
              flyte_env(tmp_path / "ref-env"), timeout=900)
    _assert_learned(ref.stdout)
    # the reference's warm start (its asset cache): the warm start is not what this test is about
    env = flyte_env(tmp_path / "env", VERL_ASSET_CACHE=str(tmp_path / "ref-env" / "assets"))
    store = tmp_path / "store"
    cmd = ppo_cmd(store, steps=4, overrides=OFF_POLICY)
    phase, step = BACKGROUND
    hang = json.dumps([{"kind": "hang", "phase": phase, "step": step}])
    marker = tmp_path / "env" / "faults" / f"{phase}-{step}.entered"
    with open(tmp_path / "killed.out", "w") as out:  # a file: a pipe could fill and hang it
        proc = subprocess.Popen(cmd, cwd=REPO, env={**env, "VERL_FAULTS": hang}, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.time() + 900
        while not marker.exists():
            assert proc.poll() is None, (tmp_path / "killed.out").read_text()[-4000:]
            assert time.time() < deadline, f"the run never reached the {phase} of step {step}"
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
    # the marker's writer was a worker of the group (an actor, not the pyflyte process), and
    # it died with the group
    worker = int(marker.read_text())
    assert worker != proc.pid
    _gone(worker)
    # update 3, which needs the batch the hang holds, was not recorded
    assert 3 not in _batches(store / "t")
    done = run(cmd, env, timeout=900)
    want, got = _final_weights(ref.stdout), _final_weights(done.stdout)
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    assert _weights_sha(ref.stdout) == _weights_sha(done.stdout)
    # every update read the undisturbed run's batch: no prompt dropped or repeated, each sampled
    # with the same behaviour weights (a version off would change the tokens)
    assert _batches(store / "t") == _batches(tmp_path / "ref" / "t") != {}
    # the run was a W = 2 one throughout: the checkpoint of step 2 written by two workers
    ckpts = sorted((store / "t" / "checkpoints").glob("*.json"))
    assert ckpts and [json.loads(c.read_text())["world_size"] for c in ckpts] == \
        [2] * len(ckpts)


def _weights_sha(stdout: str) -> str:
    """docs/resume.md's comparison (a): the sha-256 of the run's exported weights."""
    from tests.crash import weights_sha

    line = [ln for ln in stdout.splitlines() if ln.startswith("Summary(")][-1]
    return weights_sha(line.split("final_model='", 1)[1].split("'", 1)[0])


def _gone(pid: int, timeout_s: float = 60.0) -> None:
    """Wait until process ``pid`` no longer exists (fails after ``timeout_s``)."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    raise AssertionError(f"worker process {pid} outlived its killed launch")
