"""Exact resume at the worker level, on a local store and on a real S3 server (moto):
a run resumed from the checkpoint of step k has bit-identical weights at every later step, and a
worker that lost its memory rebuilds any state from checkpoint + lineage replay."""
import hashlib
import json

import pytest
import torch

from tests.presets import tiny_run
from verl_core.checkpoint import CheckpointManager
from verl_core.store import RunStore
from verl_core.engine.assets import publish_assets
from verl_core.engine.worker import RunWorker, StateUnavailableError, get_batch, put_batch
from verl_core.training.advantage import compute_advantages
from verl_core.assets import prepare_assets
from verl_core.reward.scoring import score_batch

STEPS = 5


def _cfg(**over):
    return tiny_run("ppo", **{
        "total_steps": STEPS, "model.warmup_sft_steps": 20, "data.synthetic_train_size": 128,
        "data.synthetic_val_size": 16, "checkpoint.checkpoint_interval": 2,
        "checkpoint.async_save": False, **over,
        "algorithm.use_kl_in_reward": True, "algorithm.kl_ctrl_type": "adaptive"})


def _weights_sha(worker) -> str:
    h = hashlib.sha256()
    for model in (worker.trainer.actor.model, worker.trainer.critic.model):
        for k, v in sorted(model.state_dict().items()):
            h.update(k.encode())
            h.update(v.detach().contiguous().numpy().tobytes())
    h.update(json.dumps(worker.trainer.actor.kl_ctrl.state_dict()).encode())
    return h.hexdigest()


def _memory(worker):
    return dict(worker.trainer.guard), [dict(h) for h in worker.trainer.history]


def _step(worker, step):
    ref, _ = worker.rollout(step)
    batch = get_batch(worker.store, ref)
    batch, _ = score_batch(batch, worker.trainer.scorer, worker.trainer.tokenizer)
    batch, _ = compute_advantages(batch, worker.cfg.algorithm)
    worker.update(step, put_batch(worker.store, batch))
    worker.checkpoint(step + 1)


def _worker(uri, cfg, index, storage_options=None):
    return RunWorker(uri, json.dumps(cfg.to_dict()), index, storage_options)


def _finished_run(uri, cfg, assets, steps):
    """Publish the assets into a new store and run ``steps`` steps there; returns the index."""
    index = publish_assets(RunStore(uri), assets)
    w = _worker(uri, cfg, index)
    for s in range(steps):
        _step(w, s)
    w.close()
    return index


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return prepare_assets(_cfg(), str(tmp_path_factory.mktemp("assets")), log=lambda *_: None)


def _exact_resume(uri, assets, storage_options=None):
    cfg = _cfg()
    index = publish_assets(RunStore(uri, storage_options), assets)
    a = _worker(uri, cfg, index, storage_options)
    shas = {0: _weights_sha(a)}
    memory = {0: _memory(a)}  # guard counters + metrics history, checkpointed with the weights
    for s in range(STEPS):
        _step(a, s)
        shas[s + 1] = _weights_sha(a)
        memory[s + 1] = _memory(a)
    assert [h["step"] for h in memory[STEPS][1]] == list(range(STEPS))
    assert all("reward/mean" in h and "actor/pg_loss" in h for h in memory[STEPS][1])
    ckpt = [i for i in a.ckpt.list_checkpoints() if i.step == 2][0]
    a.close()

    # a new run (own store) resumed from the step-2 checkpoint of the first one
    uri_b = uri.rstrip("/") + "-resumed"
    cfg_b = _cfg(**{"checkpoint.resume_from_checkpoint": ckpt.uri})
    b = _worker(uri_b, cfg_b, publish_assets(RunStore(uri_b, storage_options), assets),
                storage_options)
    assert b.step == 2 and _weights_sha(b) == shas[2] and _memory(b) == memory[2]
    for s in range(2, STEPS):
        _step(b, s)
        assert _weights_sha(b) == shas[s + 1], f"step {s + 1} differs after resume"
        assert _memory(b) == memory[s + 1], f"step {s + 1} guard/history differ after resume"
    b.close()

    # a worker with no memory rebuilds every state: checkpoint (steps 2, 4) + lineage replay
    c = _worker(uri, cfg, index, storage_options)
    for s in (3, 5, 1, 4):
        c.ensure_state(s)
        assert _weights_sha(c) == shas[s], f"rebuilt state {s} differs"
        assert _memory(c) == memory[s], f"rebuilt guard/history {s} differ"
    # 3 = ckpt 2 + replay of update 2; 5 = ckpt 5; 1 = initial model + replay of update 0;
    # 4 = ckpt 4 (a checkpoint ahead of the in-memory state beats replaying)
    assert c.replayed == 2
    c.close()


def test_exact_resume_local(tmp_path, assets):
    _exact_resume(str(tmp_path / "store"), assets)


@pytest.mark.slow
def test_exact_resume_s3(moto_s3, assets):
    endpoint, bucket, opts = moto_s3
    _exact_resume(f"s3://{bucket}/run", assets, opts)


def test_missing_lineage_and_checkpoints_is_a_clear_error(tmp_path, assets):
    cfg = _cfg(**{"checkpoint.checkpoint_interval": 100})
    uri = str(tmp_path / "store")
    index = _finished_run(uri, cfg, assets, steps=3)
    store = RunStore(uri)
    store.delete_json(f"lineage/{cfg.trajectory_hash()[:16]}/{1:09d}")
    b = _worker(uri, cfg, index)
    with pytest.raises(StateUnavailableError, match=r"batch of update 1 is not in .*overwrite-cache"):
        b.ensure_state(3)
    b.close()


def test_store_outage_during_resume_is_retried_not_replayed(tmp_path, assets, monkeypatch):
    # a transient store error while loading a checkpoint must reach the retry policy; falling
    # back to an older checkpoint (or to step 0 and a full replay) would hide the outage
    from verl_core.checkpoint import CheckpointManager, StoreUnavailableError

    cfg = _cfg()
    uri = str(tmp_path / "store")
    index = _finished_run(uri, cfg, assets, steps=3)

    def outage(self, *a, **k):
        raise StoreUnavailableError("reading object 00ab…: store unavailable (ConnectionError)")

    b = _worker(uri, cfg, index)
    with monkeypatch.context() as m:
        m.setattr(CheckpointManager, "load", outage)
        with pytest.raises(StoreUnavailableError):
            b.ensure_state(3)
    assert b.replayed == 0
    b.ensure_state(3)  # the retry, once the store is back: checkpoint 2 + update 2 replayed
    assert b.step == 3 and b.replayed == 1
    b.close()


def _straight_shas(uri, cfg, assets, steps):
    index = publish_assets(RunStore(uri), assets)
    a = _worker(uri, cfg, index)
    shas = []
    for s in range(steps):
        _step(a, s)
        shas.append(_weights_sha(a))
    a.close()
    return index, shas


def test_update_failing_half_way_is_rebuilt_not_trusted(tmp_path, assets, monkeypatch):
    # an update that dies after changing the weights (OOM, a killed collective) leaves the live
    # state between two steps; the retry must rebuild it, not update it a second time
    cfg = _cfg(**{"checkpoint.checkpoint_interval": 100})
    _, shas = _straight_shas(str(tmp_path / "a"), cfg, assets, 3)
    uri = str(tmp_path / "b")
    b = _worker(uri, cfg, publish_assets(RunStore(uri), assets))
    _step(b, 0)
    _step(b, 1)
    ref, _ = b.rollout(2)
    batch = get_batch(b.store, ref)
    batch, _ = score_batch(batch, b.trainer.scorer, b.trainer.tokenizer)
    batch, _ = compute_advantages(batch, b.cfg.algorithm)
    batch_ref = put_batch(b.store, batch)
    import verl_core.parts.actor

    real = verl_core.parts.actor.ppo_update

    def dies_after_stepping(*a, **k):
        real(*a, **k)  # the optimizer has stepped
        raise RuntimeError("CUDA out of memory (injected)")

    with monkeypatch.context() as m:
        m.setattr(verl_core.parts.actor, "ppo_update", dies_after_stepping)
        with pytest.raises(RuntimeError, match="injected"):
            b.update(2, batch_ref)
    b.update(2, batch_ref)  # the retry: initial model + replay of updates 0 and 1, then update 2
    assert _weights_sha(b) == shas[2] and b.replayed == 2
    b.close()


def test_failed_in_place_load_is_not_trusted(tmp_path, assets):
    # checkpoints are read straight into the live weights; when one turns out damaged half-way,
    # the weights it already wrote must not be used as the start of a replay
    cfg = _cfg()
    uri = str(tmp_path / "store")
    index, shas = _straight_shas(uri, cfg, assets, 3)  # checkpoint at step 2
    mgr = CheckpointManager(RunStore(uri))
    _, m = mgr.read_manifest("latest")
    tensors = m["groups"]["policy"]["tensors"]
    last = max({c["sha"] for e in tensors.values() for c in e["chunks"]},
               key=lambda sha: max(i for i, e in enumerate(tensors.values())
                                   if any(c["sha"] == sha for c in e["chunks"])))
    path = RunStore(uri).object_path(last)
    data = bytearray(open(path, "rb").read())
    data[-1] ^= 0xFF
    open(path, "wb").write(bytes(data))
    c = _worker(uri, cfg, index)
    c.ensure_state(3)  # checkpoint 2 rejected -> initial model + replay of updates 0, 1, 2
    assert _weights_sha(c) == shas[2] and c.replayed == 3
    c.close()


def test_extending_a_finished_run_continues_its_trajectory(tmp_path, assets):
    """`--steps 5` after a finished 3-step run with the same run name continues from step 3 (the
    run length is not part of the trajectory with a constant LR schedule) and ends bit-identical
    to a straight 5-step run."""
    from verl_core.prepare import resume_step

    short, long_ = _cfg(total_steps=3), _cfg(total_steps=5)
    assert short.trajectory_hash() == long_.trajectory_hash() != short.full_hash()
    assert _cfg(total_steps=3, **{"optim.lr_schedule": "cosine"}).trajectory_hash() != \
        _cfg(total_steps=5, **{"optim.lr_schedule": "cosine"}).trajectory_hash()

    uri = str(tmp_path / "store")
    index = _finished_run(uri, short, assets, steps=3)
    start = resume_step(RunStore(uri), long_)
    assert start == 3
    b = _worker(uri, long_, index)
    b.ensure_state(start)
    assert b.replayed == 0  # loaded the step-3 checkpoint, nothing to replay
    for s in range(start, 5):
        _step(b, s)

    uri_c = str(tmp_path / "straight")
    c = _worker(uri_c, long_, publish_assets(RunStore(uri_c), assets))
    for s in range(5):
        _step(c, s)
    assert _weights_sha(b) == _weights_sha(c)
    b.close()
    c.close()


def test_checkpoint_export_of_a_run_is_a_complete_hf_folder(tmp_path, assets):
    """`python -m verl_core.checkpoint export` of a run's checkpoint loads with transformers
    (model and tokenizer) and gives the trainer's logits."""
    import subprocess
    import sys

    from transformers import AutoModelForCausalLM, AutoTokenizer

    uri = str(tmp_path / "store")
    w = _worker(uri, _cfg(), publish_assets(RunStore(uri), assets))
    for s in range(2):
        _step(w, s)
    out = tmp_path / "hf"
    res = subprocess.run([sys.executable, "-m", "verl_core.checkpoint", "export", uri, "latest",
                          str(out)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    model = AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    tok = AutoTokenizer.from_pretrained(out, local_files_only=True)
    ids = tok(["12+7="], return_tensors="pt").input_ids
    with torch.no_grad():
        assert torch.equal(model(ids).logits, w.trainer.actor.model(ids).logits)
    w.close()
