"""DAPO's dynamic sampling end to end on the real tiny model (the plain loop, no mocks): steps
that needed more than one generation batch, a SIGKILL in the middle of the run, and the same
command again ending bit-identical to an undisturbed run (the data position each step consumed
is stored with its batch, so the resumed run samples exactly the prompts the undisturbed one
did)."""
import hashlib
import json
import os
import subprocess
import sys
import textwrap

from tests.crash import kill_at_marker
from tests.presets import TINY, tiny_run
from verl_core.runlog import read_phase_log
from verl_core.train import train

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
STEPS = 3

# half the responses score 1 (an even length): most groups of 4 are mixed, some are all-equal,
# so a generation batch of 4 prompts often keeps fewer than 4 groups
PARITY = textwrap.dedent('''
    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        return float(len(solution_str) % 2)
''')


def _latest_step(work) -> int:
    try:
        return json.loads((work / "latest.json").read_text())["step"]
    except (OSError, ValueError, KeyError):
        return -1


def _over(scorer) -> dict:
    return {**TINY, "data.train_batch_size": 4, "actor.ppo_mini_batch_size": 2,
            "algorithm.filter_groups_enable": True, "data.gen_batch_size": 4,
            "algorithm.filter_groups_metric": "acc", "algorithm.max_num_gen_batches": 0,
            "reward.scorer": f"{scorer}:compute_score", "reward.overlong_buffer_enable": True,
            "reward.overlong_buffer_len": 2, "reward.overlong_penalty_factor": 0.5,
            "checkpoint.checkpoint_interval": 1, "val_before_train": False,
            "total_steps": STEPS}


def _sha256(model_folder: str) -> str:
    with open(os.path.join(model_folder, "model.safetensors"), "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def test_dynamic_sampling_resumes_bit_identical_after_sigkill(tmp_path):
    scorer = tmp_path / "parity.py"
    scorer.write_text(PARITY)
    over = _over(scorer)

    # 1. undisturbed
    ref = train(tiny_run(**over), str(tmp_path / "ref"), log=lambda *_: None)
    gen = [h["train/num_gen_batches"] for h in ref["history"]]
    assert max(gen) > 1, gen  # some step's first generation batch did not fill the batch
    assert all(h["train/num_kept_groups"] >= 4 for h in ref["history"])
    assert sum(h["train/num_filtered_groups"] for h in ref["history"]) > 0
    assert all(h["reward/min"] >= -0.5 for h in ref["history"])  # score 0 + the penalty >= -0.5

    # 2. the same run in another workdir; SIGKILL while the rollout of step 2 runs (after the
    #    checkpoints of steps 1 and 2: the resume reads step 2's data position from the store)
    work, faults = tmp_path / "work", tmp_path / "faults"
    cmd = [sys.executable, "-m", "verl_core.train", "--workdir", str(work)]
    for k, v in over.items():
        cmd += ["--set", f"{k}={v}"]
    env = {**os.environ, "PYTHONPATH": REPO, "VERL_FAULTS_DIR": str(faults),
           "VERL_ASSET_CACHE": str(tmp_path / "assets")}
    hang = {"VERL_FAULTS": json.dumps([{"phase": "rollout", "step": 2, "kind": "hang"}])}
    proc = subprocess.Popen(cmd, cwd=REPO, env={**env, **hang}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    marker = faults / "rollout-2.entered"
    # the checkpoint of step 2 commits in the background (checkpoint.async_save) while the
    # rollout hangs: kill once it has, so the resume starts from it (under load it once lagged
    # the marker, and the resume re-ran the update of step 1 from checkpoint 1)
    kill_at_marker(proc, marker, "the rollout of step 2", poll_s=0.5,
                   also=lambda: _latest_step(work) >= 2)
    before = [(r["phase"], r["step"]) for r in read_phase_log(str(work))]
    assert ("update", 1) in before and ("rollout", 2) not in before

    # 3. the same command again: resumes, and ends with the undisturbed run's weights
    res = subprocess.run(cmd + ["--summary-json", str(tmp_path / "s.json")], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    resumed = json.loads((tmp_path / "s.json").read_text())
    assert "resuming from the checkpoint of step" in res.stdout
    log = [(r["phase"], r["step"]) for r in read_phase_log(str(work))]
    assert sorted(s for p, s in log if p == "update") == list(range(STEPS))  # none ran twice
    assert _sha256(resumed["final_model"]) == _sha256(ref["final_model"])
    steps_run = [h["step"] for h in resumed["history"]]
    assert [h["train/num_gen_batches"] for h in resumed["history"]] == gen[steps_run[0] - 1:]
    assert [h["reward/mean"] for h in resumed["history"]] == \
        [h["reward/mean"] for h in ref["history"][steps_run[0] - 1:]]
