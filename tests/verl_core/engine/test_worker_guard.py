"""The guard inside the update: a poisoned step is skipped or rolled back before it reaches the
weights, the decision is written into the lineage, and a rebuilt state replays it bit-identically.
Faults are real: NaN gradients injected into the backward pass (VERL_FAULTS ``nan_grad``) and a
stored batch whose rewards hold a NaN."""
import json

import pytest
import torch

from tests.presets import tiny_run
from verl_core.store import RunStore
from verl_core.engine.assets import publish_assets
from verl_core.engine.worker import RunWorker, get_batch, put_batch
from verl_core.guard.events import read_events
from verl_core.guard.policy import GuardHaltError
from verl_core.training.advantage import compute_advantages
from verl_core.assets import prepare_assets
from verl_core.reward.scoring import score_batch

from test_worker_resume import _weights_sha


def _cfg(**over):
    return tiny_run("ppo", **{
        "total_steps": 6, "model.warmup_sft_steps": 20, "data.synthetic_train_size": 128,
        "data.synthetic_val_size": 16, "checkpoint.checkpoint_interval": 2,
        "checkpoint.async_save": False, "algorithm.use_kl_in_reward": True,
        "algorithm.kl_ctrl_type": "adaptive", **over})


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return prepare_assets(_cfg(), str(tmp_path_factory.mktemp("assets")), log=lambda *_: None)


@pytest.fixture
def faults(tmp_path, monkeypatch):
    def declare(*specs):
        monkeypatch.setenv("VERL_FAULTS", json.dumps(list(specs)))
        monkeypatch.setenv("VERL_FAULTS_DIR", str(tmp_path / "faults"))
    return declare


def _batch(w, step, *, nan_score=False):
    batch = get_batch(w.store, w.rollout(step)[0])
    batch, _ = score_batch(batch, w.trainer.scorer, w.trainer.tokenizer)
    if nan_score:
        score = batch.score.clone()
        score[3] = float("nan")
        batch = batch.replace(score=score)
    batch, _ = compute_advantages(batch, w.cfg.algorithm)
    return put_batch(w.store, batch)


def _run(uri, cfg, index, steps, nan_scores=()):
    w = RunWorker(uri, json.dumps(cfg.to_dict()), index)
    shas, metrics = {0: _weights_sha(w)}, {}
    for s in range(steps):
        metrics[s] = w.update(s, _batch(w, s, nan_score=s in nan_scores))
        w.checkpoint(s + 1)
        shas[s + 1] = _weights_sha(w)
    return w, shas, metrics


def _lineage(w, step):
    return w.store.get_json(w._lineage(step))


def _finite(w):
    return all(torch.isfinite(p).all() for p in w.trainer.actor.model.parameters())


def _rebuilt(uri, cfg, index, step):
    """A worker with no memory (another process) rebuilding ``step`` from the store."""
    fresh = RunWorker(uri, json.dumps(cfg.to_dict()), index)
    fresh.ensure_state(step)
    return fresh


def test_nan_gradients_skip_the_step_and_replay_identically(tmp_path, assets, faults):
    faults({"kind": "nan_grad", "phase": "update", "step": 2})
    cfg = _cfg()
    uri = str(tmp_path / "run")
    index = publish_assets(RunStore(uri), assets)
    w, shas, metrics = _run(uri, cfg, index, 4)
    assert shas[3] == shas[2] != shas[1]  # update 2 was not applied
    assert _finite(w)
    rec = _lineage(w, 2)
    assert rec["action"] == "skip" and rec["guard"]["consecutive_skips"] == 1
    assert metrics[2]["guard/skip_batch"] >= 1
    events = [e for e in read_events(w.store, w.trajectory_hash)]
    assert events and {(e["step"], e["detector"], e["action"], e["outcome"]) for e in events} == {
        (2, "nonfinite", "skip_batch", "skipped")}
    assert w.trainer.guard["consecutive_skips"] == 0  # update 3 was applied
    guard, history = dict(w.trainer.guard), [dict(h) for h in w.trainer.history]
    w.close()
    # rebuild from the checkpoint of step 2 through the skip record and update 3
    for start in ("run", "no-checkpoints"):
        if start == "no-checkpoints":  # replay from step 0 through every record
            for info in w.ckpt.list_checkpoints():
                w.store.delete_json(f"checkpoints/{info.name}")
        fresh = _rebuilt(uri, cfg, index, 4)
        assert _weights_sha(fresh) == shas[4]
        assert fresh.trainer.guard == guard and fresh.trainer.history == history
        fresh.close()


def test_nan_reward_is_caught_before_the_update(tmp_path, assets):
    cfg = _cfg()
    uri = str(tmp_path / "run")
    index = publish_assets(RunStore(uri), assets)
    w, shas, _ = _run(uri, cfg, index, 2, nan_scores=(1,))
    assert shas[2] == shas[1] and _finite(w)
    events = read_events(w.store, w.trajectory_hash)
    assert {e["detector"] for e in events} == {"nonfinite"} and {e["step"] for e in events} == {1}
    assert "score" in {e["signal"] for e in events}  # and what GAE made of it
    assert {e["action"] for e in events} == {"skip_batch"}
    w.close()


def test_rollback_restores_the_scheduled_checkpoint_and_scales_the_lr(tmp_path, assets, faults):
    faults({"kind": "nan_grad", "phase": "update", "step": 3})
    cfg = _cfg(**{"guard.nonfinite_policy": "rollback", "guard.rollback_lr_scale": 0.5})
    uri = str(tmp_path / "run")
    index = publish_assets(RunStore(uri), assets)
    w, shas, _ = _run(uri, cfg, index, 5)
    assert shas[4] == shas[2]  # state 2 is the newest scheduled checkpoint before step 3
    rec = _lineage(w, 3)
    assert rec["action"] == "rollback" and rec["to"] == 2 and rec["guard"]["rollbacks"] == 1
    lr0 = cfg.optim.lr
    assert w.trainer.actor.scheduler.base_lrs[0] == pytest.approx(lr0 * 0.5, rel=1e-12)
    final, guard = shas[5], dict(w.trainer.guard)
    w.close()
    fresh = _rebuilt(uri, cfg, index, 5)
    assert _weights_sha(fresh) == final and fresh.trainer.guard == guard
    assert fresh.trainer.actor.scheduler.base_lrs[0] == pytest.approx(lr0 * 0.5, rel=1e-12)
    fresh.close()


def test_consecutive_skips_escalate_to_rollback_and_rollbacks_to_halt(tmp_path, assets, faults):
    faults(*({"kind": "nan_grad", "phase": "update", "step": s} for s in (1, 2, 3, 4)))
    cfg = _cfg(**{"guard.max_consecutive_skips": 2, "guard.max_rollbacks": 1})
    uri = str(tmp_path / "run")
    index = publish_assets(RunStore(uri), assets)
    w = RunWorker(uri, json.dumps(cfg.to_dict()), index)
    for s in range(4):  # 0 applied, 1 skipped, 2 (second skip in a row) rolled back, 3 skipped
        w.update(s, _batch(w, s))
    assert [_lineage(w, s).get("action", "update") for s in range(4)] == [
        "update", "skip", "rollback", "skip"]
    assert _lineage(w, 2)["to"] == 0
    with pytest.raises(GuardHaltError, match=r"step 4[\s\S]*max_rollbacks=1"):
        w.update(4, _batch(w, 4))  # would roll back a second time
    assert not w.store.has_json(w._lineage(4))  # a halt records nothing
    actions = {(e["step"], e["action"]) for e in read_events(w.store, w.trajectory_hash)}
    assert actions == {(1, "skip_batch"), (2, "rollback"), (3, "skip_batch"), (4, "halt")}
    w.close()


def test_guard_off_keeps_the_optimizer_level_skip(tmp_path, assets, faults):
    faults({"kind": "nan_grad", "phase": "update", "step": 1})
    cfg = _cfg(**{"guard.enabled": False})
    uri = str(tmp_path / "run")
    index = publish_assets(RunStore(uri), assets)
    w, shas, metrics = _run(uri, cfg, index, 2)
    assert metrics[1]["update/skipped_nonfinite_steps"] >= 1 and _finite(w)
    assert "action" not in _lineage(w, 1) and not read_events(w.store, w.trajectory_hash)
    w.close()
