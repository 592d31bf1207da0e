"""docs/resume.md's table, a mode per test: one run of the plain loop stopped at several fault
points in turn (a VERL_FAULTS ``kill`` each, one ``term``: a preemption; each fires once), the
same command re-run after each stop, and the run that finishes ends with an uninterrupted run's
exact weights (the sha-256 of its exported ``.safetensors``). Real processes and real signals;
one chain per mode, so one run store resumes from each fault point in turn.

Every run has a learning signal (the warm start reaches 0.2 train-slice accuracy, so some groups'
rewards differ and the updates change the weights): equal weights are not the weights of a run
that never moved."""
import json
import os
import signal
import subprocess
import sys

import pytest

from tests.crash import rerun_until_done, weights_sha
from tests.presets import TINY, tiny_run
from verl_core.train import train

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS = 3
# a checkpoint after every step, so each re-run resumes past the fault before it; an evaluation
# after step 2 (and the last) for the evaluate fault
BASE = {**TINY, "model.warmup_sft_steps": 400, "model.warmup_target_accuracy": 0.2,
        "total_steps": STEPS, "checkpoint.checkpoint_interval": 1, "eval_every": 2,
        "val_before_train": False}
# (kind, phase, step), in the order a chain meets them (steps 0-based: the checkpoint of step k+1
# follows update k, the evaluation of state 2 follows it, finalize names the last state)
REWARD, ADVANTAGE, UPDATE = ("kill", "reward", 0), ("kill", "advantage", 1), ("kill", "update", 1)
CHECKPOINT, EVALUATE = ("kill", "checkpoint", 2), ("kill", "evaluate", 2)
FINALIZE = ("kill", "finalize", STEPS)
# a preemption as the rollout of step 1 runs: the phase ends, the loop waits for the checkpoint
# of step 1 (written in the background) to commit, and exits 128 + SIGTERM
TERM = ("term", "rollout", 1)
# a preemption in the warm start, after its 10th step: saved at once, resumed from there
WARM_TERM = ("term", "warm_start", 10)
EXIT = {"kill": -signal.SIGKILL, "term": 128 + signal.SIGTERM}
# inside a rollout: the trainer killed while step 0's tool calls run (its foreground rollout:
# the first of a process), the sampler process killed as it starts the background rollout of
# step 1 (the run goes on: step 1 is sampled again in the foreground, a new sampler started),
# the trainer killed as the background rollout of step 2 starts (update 1 runs beside it)
TOOL_CALL, SAMPLER = ("kill", "tool_call", 0), ("kill", "sampler", 1)
BACKGROUND = ("kill", "background_rollout", 2)
SURVIVED = {"sampler"}
"""Fault phases whose ``kill`` ends a process of the run's own, not the run: no exit code."""


@pytest.fixture(scope="module")
def asset_cache(shared_asset_cache):
    """One warm start per model for the module's runs (the reference's; the chains reuse it),
    in the session's shared cache (test_scaleout.py's W = 2 tool-call test takes the calculator's
    from there)."""
    with pytest.MonkeyPatch.context() as m:
        m.setenv("VERL_ASSET_CACHE", str(shared_asset_cache))
        yield


def _chain(tmp_path, settings: dict, points, store: str = "") -> None:
    """The run of ``settings`` uninterrupted (in this process), then the same run (a
    subprocess, in ``store``: a folder of ``tmp_path`` unless given) stopped at each of
    ``points`` ((kind, phase, step), one per process, in the order the run meets them) and
    re-run until it ends: every fault fired, and the weights are the uninterrupted run's."""
    cfg = tiny_run(**settings)
    straight = train(cfg, str(tmp_path / "straight") if not store else "", log=lambda *_: None,
                     store=store, run_name="straight")
    assert any(h["rollout/zero_variance_frac"] < 1.0 for h in straight["history"]), \
        "no step had a learning signal: equal weights would prove nothing"
    summary = tmp_path / "s.json"
    where = ["--store", store, "--run-name", "chain"] if store else \
        ["--workdir", str(tmp_path / "chain")]
    cmd = [sys.executable, "-m", "verl_core.train", *where, "--summary-json", str(summary)]
    for k, v in settings.items():
        cmd += ["--set", f"{k}={v}"]
    faults = [{"kind": k, "phase": p, "step": s} for k, p, s in points]
    env = {**os.environ, "PYTHONPATH": REPO}
    if WARM_TERM in points:  # a cache of its own: the chain warm-starts, not reuses the reference's
        env["VERL_ASSET_CACHE"] = str(tmp_path / "assets")
    ends = [p for p in points if p[1] not in SURVIVED]
    codes = rerun_until_done(cmd, env, faults, tmp_path, tries=len(ends) + 1)
    last = open(tmp_path / f"run{len(codes) - 1}.out").read()[-3000:]
    assert codes == [EXIT[k] for k, _, _ in ends] + [0], (codes, last)
    for k, phase, step in points:  # each fault fired (counted in VERL_FAULTS_DIR as it did)
        assert (tmp_path / "faults" / f"{phase}-{step}-{k}.attempts").exists(), (phase, last)
    if WARM_TERM in points:
        after = open(tmp_path / f"run{ends.index(WARM_TERM) + 1}.out").read()
        assert "warm start: resuming from step 10" in after, after[-3000:]
    got = json.loads(summary.read_text())["final_model"]
    assert weights_sha(got) == weights_sha(straight["final_model"]), last


@pytest.mark.slow
def test_off_policy_killed_or_preempted_at_each_fault_point_ends_as_uninterrupted(
        asset_cache, tmp_path):
    _chain(tmp_path, {**BASE, "rollout.max_staleness": 1, "algorithm.rollout_is": "token"},
           [WARM_TERM, REWARD, TERM, ADVANTAGE, CHECKPOINT, EVALUATE, FINALIZE])


@pytest.mark.slow
def test_lora_killed_or_preempted_at_each_fault_point_ends_as_uninterrupted(asset_cache,
                                                                             tmp_path):
    _chain(tmp_path, {**BASE, "model.lora_rank": 4, "model.lora_alpha": 8.0,
                      "algorithm.use_kl_loss": True, "algorithm.kl_loss_coef": 0.1},
           [WARM_TERM, REWARD, TERM, ADVANTAGE, UPDATE, EVALUATE, FINALIZE])


@pytest.mark.slow
def test_multi_turn_killed_or_preempted_at_each_fault_point_ends_as_uninterrupted(
        asset_cache, tmp_path):
    # the calculator task (its tool config built in): the warm start on call transcripts stops
    # at 0.2 accuracy (about 240 steps), where groups' rewards differ (100 steps: all equal).
    # Killed in a tool call of step 0 first, and as the rollout of step 2 starts
    _chain(tmp_path, {**BASE, "data.synthetic_task": "calculator", "model.warmup_mixed_steps": 0},
           [TOOL_CALL, REWARD, TERM, ADVANTAGE, UPDATE, CHECKPOINT, EVALUATE,
            ("kill", "rollout", 2), FINALIZE])


@pytest.mark.slow
def test_simulated_users_killed_mid_episode_or_preempted_end_as_uninterrupted(asset_cache,
                                                                              tmp_path):
    # the guess task (the scripted user built in; issue 45): 30 warm-start steps leave rewards
    # that differ within groups. Killed while step 0's user answers are in flight (mid-episode),
    # in the reward phase, preempted in a rollout, killed as the rollout of step 2 starts
    _chain(tmp_path, {**BASE, "data.synthetic_task": "guess", "model.warmup_sft_steps": 30,
                      "model.warmup_target_accuracy": 1.0},
           [TOOL_CALL, REWARD, TERM, ("kill", "rollout", 2), FINALIZE])


@pytest.mark.slow
def test_s3_store_killed_or_preempted_at_each_fault_point_ends_as_uninterrupted(
        asset_cache, moto_s3_readme, tmp_path):
    # the run store on a real S3 server (moto_server on 127.0.0.1, VERL_S3_ENDPOINT: every
    # process of the chain reaches it as docs/cluster.md says)
    _, bucket = moto_s3_readme
    _chain(tmp_path, BASE, [WARM_TERM, REWARD, TERM, ADVANTAGE, UPDATE, EVALUATE,
                            ("kill", "rollout", 2), FINALIZE],
           store=f"s3://{bucket}/runs")


@pytest.mark.slow
def test_inside_rollouts_off_policy_lora_multi_turn_s3_ends_as_uninterrupted(
        asset_cache, moto_s3_readme, tmp_path):
    # the fault points inside a rollout, in the modes that have them all at once: one-step
    # off-policy with its background rollout in a sampler process, LoRA adapters, the calculator
    # task (multi-turn: tool calls), the run store on S3; a tool call, the sampler process and
    # the background rollout (TOOL_CALL, SAMPLER, BACKGROUND above). The warm start is the
    # multi-turn chain's (the same key: LoRA and off-policy are RL settings)
    _, bucket = moto_s3_readme
    _chain(tmp_path, {**BASE, "data.synthetic_task": "calculator",
                      "model.warmup_mixed_steps": 0, "model.lora_rank": 4,
                      "model.lora_alpha": 8.0, "rollout.max_staleness": 1,
                      "algorithm.rollout_is": "token", "rollout.async_mode": "process"},
           [TOOL_CALL, SAMPLER, BACKGROUND], store=f"s3://{bucket}/inside")


@pytest.mark.slow
def test_multi_turn_warm_start_preempted_ends_as_an_undisturbed_one(tmp_path):
    # the calculator's warm start (on call transcripts, its probe a multi-turn rollout with the
    # tool) preempted after its 10th step and resumed: the warm-started model is the undisturbed
    # one's, byte for byte (docs/resume.md's (d)). 40 steps, no accuracy target: the chains'
    # 0.2 accuracy takes ~240 steps, twice (the preempted one has a cache of its own)
    sets = {**TINY, "data.synthetic_task": "calculator", "model.warmup_mixed_steps": 0,
            "model.warmup_sft_steps": 40, "model.warmup_target_accuracy": 1.0}

    def cmd(name):
        out = [sys.executable, "-m", "verl_core.train", "--steps", "1", "--store",
               str(tmp_path / "runs"), "--run-name", name]
        for k, v in sets.items():
            out += ["--set", f"{k}={v}"]
        return out

    env = {**os.environ, "PYTHONPATH": REPO, "VERL_ASSET_CACHE": str(tmp_path / "cache")}
    codes = rerun_until_done(cmd("chain"), env, [{"kind": "term", "phase": "warm_start",
                                                 "step": 10}], tmp_path, tries=2)
    assert codes == [EXIT["term"], 0], open(tmp_path / f"run{len(codes) - 1}.out").read()[-3000:]
    assert "warm start: resuming from step 10" in open(tmp_path / "run1.out").read()
    ref = subprocess.run(cmd("ref"), env={**env, "VERL_ASSET_CACHE": str(tmp_path / "cache-ref")},
                         capture_output=True, text=True, timeout=900)
    assert ref.returncode == 0, ref.stdout[-3000:] + ref.stderr[-3000:]
    assert "warm start: resuming" not in ref.stdout

    def model_sha(name):  # the warm-started model in the run's asset index
        [index] = (tmp_path / "runs" / name / "assets").glob("*.json")
        return json.loads(index.read_text())["model"]["model.safetensors"]

    assert model_sha("chain") == model_sha("ref")
