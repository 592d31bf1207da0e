"""Off-policy rollout (``rollout.max_staleness`` 1, issue 27, and 2, issue 42) in the plain loop
(the workflow's phases, one process): a guard rollback drops the rollouts sampling from the
discarded weights, and real SIGKILLs (mid-update while the next rollouts sample in the
background, inside a background rollout, mid-rollout) resume to the uninterrupted run's batches
and weights, bit for bit."""
import hashlib
import json
import os
import subprocess

import pytest

from tests.crash import kill_at_marker, train_command
from tests.presets import TINY, tiny_run
from verl_core.engine.worker import RunWorker, get_batch
from verl_core.writer import release_lease
from verl_core.prepare import prepare_run
from verl_core.layout import lineage_doc
from verl_core.store import RunStore
from verl_core.train import train

REPO = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
ASYNC = {**TINY, "model.warmup_sft_steps": 400, "model.warmup_target_accuracy": 0.2,
         "rollout.max_staleness": 1, "algorithm.rollout_is": "token", "total_steps": 5,
         "checkpoint.checkpoint_interval": 2, "val_before_train": False}


def _lineage(work, cfg, step: int) -> dict:
    return RunStore(str(work)).get_json(lineage_doc(cfg.trajectory_hash(), step))


def _batch(work, cfg, step: int):
    return get_batch(RunStore(str(work)), _lineage(work, cfg, step)["batch"])


@pytest.mark.parametrize("k, versions, staleness", [
    (1, [0, 0, 1, 4], [0.0, 1.0, 1.0, 1.0, 0.0]),
    (2, [0, 0, 0, 4], [0.0, 1.0, 2.0, 2.0, 0.0]),  # issue 42: staleness k
])
def test_a_rollback_drops_the_rollout_in_flight(tmp_path, monkeypatch, k, versions, staleness):
    # NaN gradients in update 3 roll the run back to the checkpoint of step 2. The rollout of
    # step 4 was sampling from an older state meanwhile: dropped. Step 4 samples the rolled-
    # back weights (lag 0: the queue of versions is reset), and a fresh worker replaying the
    # lineage samples the same batch.
    monkeypatch.setenv("VERL_FAULTS", json.dumps([{"kind": "nan_grad", "phase": "update",
                                                   "step": 3}]))
    monkeypatch.setenv("VERL_FAULTS_DIR", str(tmp_path / "faults"))
    cfg = tiny_run(**{**ASYNC, "guard.nonfinite_policy": "rollback", "rollout.max_staleness": k})
    work = tmp_path / "w"
    history = train(cfg, str(work), log=lambda *_: None)["history"]
    rec = _lineage(work, cfg, 3)
    assert rec["action"] == "rollback" and rec["to"] == 2
    assert [_batch(work, cfg, s).meta["policy_version"] for s in (0, 1, 2, 4)] == versions
    assert [h["rollout/staleness"] for h in history] == staleness
    assert [h["rollout/prefetched"] for h in history] == [0.0, 1.0, 1.0, 1.0, 0.0]

    monkeypatch.delenv("VERL_FAULTS")
    spec = prepare_run(cfg, str(tmp_path), "w", log_fn=lambda *_: None)
    w = RunWorker(spec.store, spec.config_json, json.loads(spec.assets_json))
    try:
        ref, m = w.rollout(4)  # from the checkpoint of step 4 (its behaviour: step 4's own)
        assert m["rollout/staleness"] == 0.0 and w.replayed == 0
        assert get_batch(w.store, ref).response_ids.equal(_batch(work, cfg, 4).response_ids)
    finally:
        w.close()
    # without the checkpoints after step 2: checkpoint 2, update 2 and the rollback replayed
    for manifest in (work / "checkpoints").glob("00000000000[45]-*.json"):
        manifest.unlink()
    w = RunWorker(spec.store, spec.config_json, json.loads(spec.assets_json))
    try:
        assert w.rollout(4)[0] == ref
        assert w.replayed == 2 and w.trainer.behaviour.version == 4
    finally:
        w.close()
        release_lease(spec)


def _sha256(folder: str) -> str:
    with open(os.path.join(folder, "model.safetensors"), "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


@pytest.mark.parametrize("k, kills", [
    # 1. killed inside update 1, while the rollout of step 2 samples in the background;
    # 2. killed inside the rollout of step 3 (the checkpoint of step 2 written, update 2 done)
    (1, (("update-rank0", 1), ("rollout", 3))),
    # staleness 2 (issue 42): killed inside the background rollout of step 3 (started when
    # update 1 began, from the weights of step 1), inside update 2 (the rollouts of
    # steps 3 and 4 in flight or done, never stored), inside the rollout of step 4
    (2, (("background_rollout", 3), ("update-rank0", 2), ("rollout", 4))),
    # partial rollout (issue 42): killed inside update 2, while the rollout of step 3 goes on
    # with the weights of step 2 (its first segment sampled with those of step 1), then inside
    # the background rollout of step 4
    ("2-partial", (("update-rank0", 2), ("background_rollout", 4))),
])
def test_sigkills_mid_update_and_mid_rollout_resume_bit_identical(tmp_path, k, kills):
    over = {**ASYNC, "rollout.max_staleness": k}
    if k == "2-partial":
        over.update({"rollout.max_staleness": 2, "rollout.partial_rollout": True,
                     "rollout.max_new_tokens": 4})
    cfg = tiny_run(**over)
    reference = train(cfg, str(tmp_path / "ref"), log=lambda *_: None)
    work, faults = tmp_path / "work", tmp_path / "faults"
    cmd, env = train_command(work, over, VERL_FAULTS_DIR=faults)
    for phase, step in kills:
        hang = json.dumps([{"phase": phase, "step": step, "kind": "hang"}])
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True,
                                env={**env, "VERL_FAULTS": hang})
        kill_at_marker(proc, faults / f"{phase}-{step}.entered", f"the {phase} of step {step}",
                       poll_s=0.05)
    done = subprocess.run(cmd + ["--summary-json", str(tmp_path / "s.json")], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    got = json.loads((tmp_path / "s.json").read_text())
    assert _sha256(got["final_model"]) == _sha256(reference["final_model"])
    # every update read the reference run's batch (no prompt dropped or repeated, every one
    # sampled with the same behaviour policy)
    for s in range(cfg.total_steps):
        assert _lineage(work, cfg, s)["batch"] == _lineage(tmp_path / "ref", cfg, s)["batch"]
