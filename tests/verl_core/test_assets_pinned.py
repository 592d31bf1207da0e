"""Assets pinned to the run (issue 21 item 4, 7): prepare (the workflow's prepare task body,
``prepare_run``) refuses a dataset or model file that changed since the trajectory
recorded its assets, naming the file and both hashes; ``data.assets_id`` trains on the new files
as a new trajectory; a failed prepare keeps nothing alive for gc."""

from __future__ import annotations

import hashlib
import os

import pandas as pd
import pytest

from verl_core.checkpoint.manager import CheckpointManager
from verl_core.config import RunConfig, with_overrides
from verl_core.data.synthetic import write_arithmetic_dataset
from verl_core.prepare import prepare_run
from verl_core.types import STORES
from verl_core.engine.assets import AssetsChangedError
from verl_core.models import ModelLoadError, build_tiny_model


def _sha(path):
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def _model(path, seed):
    model, tok = build_tiny_model(hidden_size=32, layers=1, heads=2, seed=seed)
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return str(path)


@pytest.fixture
def run(tmp_path):
    train, val = write_arithmetic_dataset(str(tmp_path / "data"), train_size=40, val_size=10,
                                          max_operand=9, seed=0)
    cfg = with_overrides(RunConfig(), {
        "model.path": _model(tmp_path / "model", 0), "data.train_files": train,
        "data.val_files": val, "data.train_batch_size": 8, "actor.ppo_mini_batch_size": 4,
        "actor.ppo_micro_batch_size": 8, "guard.lease_ttl_s": 0.0, "validation.mode": "off"})
    return cfg, str(tmp_path / "runs"), train


def test_changed_dataset_is_refused_then_taken_as_a_new_trajectory(run, tmp_path):
    cfg, store, train = run
    first = prepare_run(cfg, store, "r", log_fn=lambda *_: None)
    again = prepare_run(cfg, store, "r", log_fn=lambda *_: None)
    assert again.assets_json == first.assets_json  # unchanged files: the same assets
    old = _sha(train)
    write_arithmetic_dataset(str(tmp_path / "data"), train_size=40, val_size=10,
                             max_operand=9, seed=7)  # another dataset at the same paths
    new = _sha(train)
    assert new != old
    with pytest.raises(AssetsChangedError) as e:
        prepare_run(cfg, store, "r", log_fn=lambda *_: None)
    msg = str(e.value)
    assert f"{train} (sha256 {old} -> {new})" in msg and "--run-name" in msg
    new_id = msg.split('"data.assets_id": "')[1][:64]
    other = prepare_run(with_overrides(cfg, {"data.assets_id": new_id}), store, "r",
                                log_fn=lambda *_: None)
    assert other.trajectory_hash != first.trajectory_hash  # a new trajectory, on the new files
    assert json_id(other) == new_id != json_id(first)
    with pytest.raises(AssetsChangedError, match="changed since this run recorded"):
        prepare_run(cfg, store, "r", log_fn=lambda *_: None)  # the old one stays pinned
    pd.read_parquet(train).head(20).to_parquet(train, index=False)  # and changed again:
    with pytest.raises(AssetsChangedError, match="changed since this run recorded"):
        prepare_run(with_overrides(cfg, {"data.assets_id": new_id}), store, "r",
                            log_fn=lambda *_: None)  # the new trajectory is pinned too
    with pytest.raises(AssetsChangedError, match=f"data.assets_id={'0' * 64} names other files"):
        prepare_run(with_overrides(cfg, {"data.assets_id": "0" * 64}), store, "r",
                            log_fn=lambda *_: None)


def json_id(spec):
    import json

    return json.loads(spec.assets_json)["id"]


def test_changed_model_folder_is_refused(run, tmp_path):
    cfg, store, _ = run
    prepare_run(cfg, store, "r", log_fn=lambda *_: None)
    weights = os.path.join(cfg.model.path, "model.safetensors")
    old = _sha(weights)
    _model(tmp_path / "model", 1)  # other weights in the same folder: the reference model too
    with pytest.raises(AssetsChangedError, match=f"{weights} \\(sha256 {old} -> {_sha(weights)}"):
        prepare_run(cfg, store, "r", log_fn=lambda *_: None)


def test_failed_prepare_keeps_nothing_alive(run, tmp_path):
    cfg, store, _ = run
    # fails after the assets were copied: the explicit checkpoint does not exist
    bad = with_overrides(cfg, {"checkpoint.resume_from_checkpoint": str(tmp_path / "none.json")})
    with pytest.raises(Exception):
        prepare_run(bad, store, "r", log_fn=lambda *_: None)
    st = STORES.open(f"{store}/r")
    assert not st.list_json("assets")
    objects = list(st.iter_objects())
    assert objects  # it had copied them
    assert CheckpointManager(st).gc(grace_s=0)["deleted"] == len(objects)


def test_garbage_reward_model_is_refused_before_any_copy(run, tmp_path):
    cfg, store, _ = run
    rm = tmp_path / "rm"
    rm.mkdir()
    (rm / "config.json").write_text('{"model_type": "llama"}')
    (rm / "model.safetensors").write_bytes(os.urandom(1 << 16))
    bad = with_overrides(cfg, {"reward_model.enable": True, "reward_model.path": str(rm)})
    with pytest.raises(ModelLoadError, match="not a valid safetensors"):
        prepare_run(bad, store, "r", log_fn=lambda *_: None)
    assert not list(STORES.open(f"{store}/r").iter_objects())
