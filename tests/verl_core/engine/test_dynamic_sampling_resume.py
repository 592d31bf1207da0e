"""DAPO's dynamic sampling end to end on the real tiny model (the plain loop, no mocks): steps
that needed more than one generation batch, a SIGKILL in the middle of the run, and the same
command again ending bit-identical to an undisturbed run (the data position each step consumed
is stored with its batch, so the resumed run samples exactly the prompts the undisturbed one
did); and the same off-policy (``rollout.max_staleness`` 1 and 2: each step's dynamic sampling
in the background while the update before runs), with SIGKILLs mid-update and mid-rollout, a
guard rollback, and the foreground sampling it stands for compared bit for bit."""
import hashlib
import json
import os
import subprocess
import textwrap

from tests.crash import kill_at_marker, train_command
from tests.presets import TINY, tiny_run
from verl_core.assets import prepare_assets
from verl_core.data.dataset import load_prompt_rows
from verl_core.data.sampler import ResumableSampler
from verl_core.engine import dynamic_sampling
from verl_core.engine.dynamic_sampling import gen_batch_indices
from verl_core.engine.worker import get_batch
from verl_core.layout import lineage_doc
from verl_core.runlog import read_phase_log
from verl_core.store import RunStore
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
    cmd, env = train_command(work, over, VERL_FAULTS_DIR=faults,
                             VERL_ASSET_CACHE=tmp_path / "assets")
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


def _stored_batches(work, cfg) -> list:
    """The batch every update of the run read (through its lineage record), in step order."""
    store = RunStore(str(work))
    return [get_batch(store, store.get_json(lineage_doc(cfg.trajectory_hash(), s))["batch"])
            for s in range(cfg.total_steps)]


def _consumed(batches, cfg, tmp_path) -> list[int]:
    """Every generation batch the steps consumed, in order, after checking that each batch's
    prompts (its uids: dataset rows) are B of those of its generation batches."""
    assets = prepare_assets(cfg, str(tmp_path / "rows"), log=lambda *_: None, build_model=False)
    sampler = ResumableSampler(len(load_prompt_rows(assets.train_files)),
                               cfg.data.gen_batch_prompts, cfg.seed, shuffle=cfg.data.shuffle)
    out = []
    for b in batches:
        ks = list(range(b.meta["gen_batches_start"], b.meta["gen_batches_end"]))
        prompts = {i for k in ks for i in gen_batch_indices(sampler, k)}
        assert {int(u) for u in b.uid} <= prompts, (ks, b.uid)
        assert len(set(b.uid)) == cfg.data.train_batch_size  # B distinct prompts, G rows each
        out += ks
    return out


def test_dynamic_sampling_one_step_off_policy_resumes_exactly_after_sigkills(tmp_path):
    # DAPO with rollout.max_staleness=1: the dynamic sampling of step t + 1 (generation batches
    # sampled with the weights of step t, scored, filtered) runs in the background while update
    # t runs, from the position update t's batch ended at. SIGKILLs mid-update (that background
    # sampling running) and mid-rollout, then the same command: the same batches, the same
    # generation batches consumed (none dropped, none repeated), the same final weights.
    scorer = tmp_path / "parity.py"
    scorer.write_text(PARITY)
    over = {**_over(scorer), "rollout.max_staleness": 1, "algorithm.rollout_is": "token",
            "total_steps": 5}
    cfg = tiny_run(**over)

    # 1. undisturbed: every step t >= 1 sampled with the weights of step t - 1, in the
    #    background, contiguous generation batches from 0
    ref = train(cfg, str(tmp_path / "ref"), log=lambda *_: None)
    hist = ref["history"]
    assert [h["rollout/staleness"] for h in hist] == [0.0, 1.0, 1.0, 1.0, 1.0]
    assert [h["rollout/prefetched"] for h in hist] == [0.0, 1.0, 1.0, 1.0, 1.0]
    assert max(h["train/num_gen_batches"] for h in hist) > 1  # some step sampled again
    ref_batches = _stored_batches(tmp_path / "ref", cfg)
    assert [b.meta["policy_version"] for b in ref_batches] == [0, 0, 1, 2, 3]
    consumed = _consumed(ref_batches, cfg, tmp_path)
    assert consumed == list(range(len(consumed)))  # contiguous: none dropped, none repeated
    assert len(consumed) == sum(h["train/num_gen_batches"] for h in hist)

    # 2. killed inside update 1 (the background sampling of step 2 running), then inside the
    #    rollout of step 3 (the checkpoint of step 3 committed: the resume reads the data
    #    position of step 3 from the store); then the same command to the end
    work, faults = tmp_path / "work", tmp_path / "faults"
    cmd, env = train_command(work, over, VERL_FAULTS_DIR=faults,
                             VERL_ASSET_CACHE=tmp_path / "assets")
    for phase, step, also in (("update-rank0", 1, None),
                              ("rollout", 3, lambda: _latest_step(work) >= 3)):
        hang = json.dumps([{"phase": phase, "step": step, "kind": "hang"}])
        proc = subprocess.Popen(cmd, cwd=REPO, env={**env, "VERL_FAULTS": hang},
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        kill_at_marker(proc, faults / f"{phase}-{step}.entered", f"the {phase} of step {step}",
                       poll_s=0.05, also=also)
    res = subprocess.run(cmd + ["--summary-json", str(tmp_path / "s.json")], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    resumed = json.loads((tmp_path / "s.json").read_text())
    assert "resuming from the checkpoint of step" in res.stdout
    assert _sha256(resumed["final_model"]) == _sha256(ref["final_model"])
    # every update read the undisturbed run's batch: the same prompts, sampled with the same
    # behaviour weights, from the same generation batches
    store, ref_store, h = RunStore(str(work)), RunStore(str(tmp_path / "ref")), cfg.trajectory_hash()
    for s in range(cfg.total_steps):
        assert store.get_json(lineage_doc(h, s))["batch"] == \
            ref_store.get_json(lineage_doc(h, s))["batch"]
    assert _consumed(_stored_batches(work, cfg), cfg, tmp_path) == consumed
    # the resumed command sampled step 3 again in the foreground (the background result of
    # the killed run was never stored), then step 4 in the background again (the history
    # counts steps done: 4 and 5)
    assert [(h["step"], h["rollout/prefetched"]) for h in resumed["history"]] == \
        [(4, 0.0), (5, 1.0)]


def test_dynamic_sampling_with_staleness_2_matches_sampling_in_the_foreground(tmp_path,
                                                                             monkeypatch):
    # rollout.max_staleness=2: step t samples the weights of step t - 2; its dynamic sampling
    # still runs one step ahead only (its position is known when update t - 1 starts). The
    # same run with every step sampled in the foreground stores the same batches and ends
    # with the same weights.
    scorer = tmp_path / "parity.py"
    scorer.write_text(PARITY)
    cfg = tiny_run(**{**_over(scorer), "rollout.max_staleness": 2,
                      "algorithm.rollout_is": "token", "total_steps": 5})
    bg = train(cfg, str(tmp_path / "bg"), log=lambda *_: None)
    assert [h["rollout/prefetched"] for h in bg["history"]] == [0.0, 1.0, 1.0, 1.0, 1.0]
    assert [h["rollout/staleness"] for h in bg["history"]] == [0.0, 1.0, 2.0, 2.0, 2.0]
    batches = _stored_batches(tmp_path / "bg", cfg)
    assert [b.meta["policy_version"] for b in batches] == [0, 0, 0, 1, 2]
    consumed = _consumed(batches, cfg, tmp_path)
    assert consumed == list(range(len(consumed)))

    monkeypatch.setattr(dynamic_sampling, "samples_in_background", lambda cfg: False)
    fg = train(cfg, str(tmp_path / "fg"), log=lambda *_: None)
    assert [h["rollout/prefetched"] for h in fg["history"]] == [0.0] * 5
    assert _sha256(fg["final_model"]) == _sha256(bg["final_model"])
    fg_store, bg_store, h = RunStore(str(tmp_path / "fg")), RunStore(str(tmp_path / "bg")), \
        cfg.trajectory_hash()
    for s in range(cfg.total_steps):
        assert fg_store.get_json(lineage_doc(h, s))["batch"] == \
            bg_store.get_json(lineage_doc(h, s))["batch"]


def test_a_rollback_drops_the_dynamic_sampling_in_flight(tmp_path, monkeypatch):
    # NaN gradients in update 3 roll the run back. The dynamic sampling of step 4 was running
    # from the state of step 3 meanwhile: dropped; step 4 samples the rolled-back weights (lag
    # 0) in the foreground, from where update 3's batch ended (its data stays consumed).
    monkeypatch.setenv("VERL_FAULTS", json.dumps([{"kind": "nan_grad", "phase": "update",
                                                   "step": 3}]))
    monkeypatch.setenv("VERL_FAULTS_DIR", str(tmp_path / "faults"))
    scorer = tmp_path / "parity.py"
    scorer.write_text(PARITY)
    cfg = tiny_run(**{**_over(scorer), "rollout.max_staleness": 1,
                      "algorithm.rollout_is": "token", "total_steps": 5,
                      "guard.nonfinite_policy": "rollback"})
    work = tmp_path / "w"
    hist = train(cfg, str(work), log=lambda *_: None)["history"]
    store, h = RunStore(str(work)), cfg.trajectory_hash()
    assert store.get_json(lineage_doc(h, 3))["action"] == "rollback"
    batches = _stored_batches(work, cfg)
    assert [b.meta["policy_version"] for b in batches] == [0, 0, 1, 2, 4]
    assert [x["rollout/staleness"] for x in hist] == [0.0, 1.0, 1.0, 1.0, 0.0]
    assert [x["rollout/prefetched"] for x in hist] == [0.0, 1.0, 1.0, 1.0, 0.0]
    consumed = _consumed(batches, cfg, tmp_path)
    assert consumed == list(range(len(consumed)))
