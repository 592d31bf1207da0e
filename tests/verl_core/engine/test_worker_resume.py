"""Exact resume at the worker level, on a local store and on a real S3 server (moto):
a run resumed from the checkpoint of step k has bit-identical weights at every later step, and a
worker that lost its memory rebuilds any state from checkpoint + lineage replay."""
import hashlib
import json

import pytest
import torch

from verl_core.checkpoint.store import RunStore
from verl_core.config import preset
from verl_core.engine.assets import publish_assets
from verl_core.engine.worker import RunWorker, StateUnavailableError, get_batch, put_batch
from verl_core.trainer import compute_advantages, prepare_assets, score_batch

STEPS = 5


def _cfg(**over):
    base = {"total_steps": STEPS, "model.warmup_sft_steps": 20, "model.warmup_target_accuracy": 1.0,
            "data.synthetic_train_size": 128, "data.synthetic_val_size": 16,
            "data.train_batch_size": 8, "trainer.ppo_mini_batch_size": 4, "rollout.n": 4,
            "trainer.ppo_micro_batch_size": 8, "checkpoint.checkpoint_interval": 2,
            "checkpoint.async_save": False, "num_threads": 1}
    base.update(over)
    return preset("ppo", **{**base, "algorithm.use_kl_in_reward": True,
                            "algorithm.kl_ctrl_type": "adaptive"})


def _weights_sha(worker) -> str:
    h = hashlib.sha256()
    for model in (worker.trainer.actor, worker.trainer.critic):
        for k, v in sorted(model.state_dict().items()):
            h.update(k.encode())
            h.update(v.detach().contiguous().numpy().tobytes())
    h.update(json.dumps(worker.trainer.kl_ctrl.state_dict()).encode())
    return h.hexdigest()


def _step(worker, step):
    ref, _ = worker.rollout(step)
    batch = get_batch(worker.store, ref)
    batch, _ = score_batch(batch, worker.trainer.scorer, worker.trainer.tokenizer)
    batch, _ = compute_advantages(batch, worker.cfg.algorithm)
    worker.update(step, put_batch(worker.store, batch))
    worker.checkpoint(step + 1)


def _worker(uri, cfg, index, storage_options=None):
    return RunWorker(uri, json.dumps(cfg.to_dict()), index, storage_options)


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return prepare_assets(_cfg(), str(tmp_path_factory.mktemp("assets")), log=lambda *_: None)


def _exact_resume(uri, assets, storage_options=None):
    cfg = _cfg()
    index = publish_assets(RunStore(uri, storage_options), assets)
    a = _worker(uri, cfg, index, storage_options)
    shas = {0: _weights_sha(a)}
    for s in range(STEPS):
        _step(a, s)
        shas[s + 1] = _weights_sha(a)
    ckpt = [i for i in a.ckpt.list_checkpoints() if i.step == 2][0]
    a.close()

    # a new run (own store) resumed from the step-2 checkpoint of the first one
    uri_b = uri.rstrip("/") + "-resumed"
    cfg_b = _cfg(**{"checkpoint.resume_from_checkpoint": ckpt.uri})
    b = _worker(uri_b, cfg_b, publish_assets(RunStore(uri_b, storage_options), assets),
                storage_options)
    assert b.step == 2 and _weights_sha(b) == shas[2]
    for s in range(2, STEPS):
        _step(b, s)
        assert _weights_sha(b) == shas[s + 1], f"step {s + 1} differs after resume"
    b.close()

    # a worker with no memory rebuilds every state: checkpoint (steps 2, 4) + lineage replay
    c = _worker(uri, cfg, index, storage_options)
    for s in (3, 5, 1, 4):
        c.ensure_state(s)
        assert _weights_sha(c) == shas[s], f"rebuilt state {s} differs"
    assert c.replayed >= 3
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
    index = publish_assets(RunStore(uri), assets)
    a = _worker(uri, cfg, index)
    for s in range(3):
        _step(a, s)
    a.close()
    store = RunStore(uri)
    store.delete_json(f"lineage/{cfg.config_hash()[:16]}/{1:09d}")
    b = _worker(uri, cfg, index)
    with pytest.raises(StateUnavailableError, match=r"batch of update 1 is not in .*overwrite-cache"):
        b.ensure_state(3)
    b.close()
