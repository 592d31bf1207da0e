"""The format warm start of a model you bring (``model.format_warmup_steps``,
``verl_core/format_warmup.py``), on the Qwen2.5-shaped stand-in: it trains a copy of the folder on
the rows' worked solutions, keeps the folder's tokenizer, template and EOS, is reused by key, is
refused before any work without solutions or without a model you bring, saves only its newest
state, and a recorded run checks the folder it started from."""
from __future__ import annotations

import json
import os

import pandas as pd
import pytest
import torch
from safetensors.torch import load_file

from tests.standins import folder_eos_ids, gsm8k_parquet, gsm8k_rows, qwen_folder
from verl_core.config import ConfigError, RunConfig, grpo_preset, with_overrides
from verl_core.data.dataset import DatasetError
from verl_core.engine.assets import AssetsChangedError
from verl_core.layout import warm_start_doc
from verl_core.prepare import prepare_run
from verl_core.store import RunStore
from verl_core.assets import prepare_assets
from verl_core.warmstart import WarmStart, warm_start_key


@pytest.fixture
def user_run(tmp_path, monkeypatch):
    monkeypatch.setenv("VERL_ASSET_CACHE", str(tmp_path / "cache"))
    src = qwen_folder(tmp_path / "src")
    train = gsm8k_parquet(tmp_path / "data" / "train.parquet", 12)
    val = gsm8k_parquet(tmp_path / "data" / "val.parquet", 4, split="test", seed=1)
    cfg = grpo_preset(**{
        "model.path": str(src), "data.train_files": str(train), "data.val_files": str(val),
        "model.format_warmup_steps": 3, "model.format_warmup_batch_size": 2,
        "model.format_warmup_lr": 1e-3, "data.train_batch_size": 4, "rollout.n": 2,
        "actor.ppo_mini_batch_size": 4, "data.max_prompt_length": 128,
        "rollout.max_new_tokens": 32,
        "guard.lease_ttl_s": 0.0, "validation.mode": "off"})
    return cfg, src, train


def test_it_trains_a_copy_that_keeps_the_folders_tokenizer_and_eos(user_run, tmp_path):
    cfg, src, train = user_run
    logs = []
    assets = prepare_assets(cfg, str(tmp_path / "work"), log=logs.append,
                            store=RunStore(str(tmp_path / "store")))
    out = assets.model_path
    assert out != str(src) and assets.model_source_path == str(src)
    text = "\n".join(logs)
    assert "warm start: up to 3 supervised steps of src on the rows' worked solutions" in text
    assert "warm start: 3 format steps in" in text
    before, after = load_file(src / "model.safetensors"), load_file(f"{out}/model.safetensors")
    assert set(before) == set(after)
    assert any(not torch.equal(before[k], after[k]) for k in before)  # it learnt
    assert all(after[k].dtype == before[k].dtype for k in before)
    assert folder_eos_ids(out) == folder_eos_ids(src)
    for name in ("generation_config.json", "tokenizer.json"):
        assert os.path.isfile(f"{out}/{name}"), name
    assert json.load(open(f"{out}/generation_config.json")) == \
        json.load(open(src / "generation_config.json"))

    # another run store with the same inputs: taken from the private cache, not trained again
    again = []
    second = prepare_assets(cfg, str(tmp_path / "work2"), log=again.append,
                            store=RunStore(str(tmp_path / "store2")))
    assert any("reused a finished one with the same inputs" in line for line in again), again
    assert not any("format steps in" in line for line in again)
    assert (open(f"{second.model_path}/model.safetensors", "rb").read()
            == open(f"{out}/model.safetensors", "rb").read())


def test_key_covers_the_source_folder_and_the_format_fields_not_rl(user_run, tmp_path):
    cfg, src, train = user_run
    key = warm_start_key(cfg, [str(train)], None)
    assert key == warm_start_key(with_overrides(cfg, {"optim.lr": 3e-6, "total_steps": 9,
                                                      "rollout.max_new_tokens": 7}),
                                 [str(train)], None)
    assert warm_start_key(with_overrides(cfg, {"model.format_warmup_lr": 2e-3}),
                          [str(train)], None) != key
    qwen_folder(src, seed=5)  # other weights in the same folder
    assert warm_start_key(cfg, [str(train)], None) != key


def test_rows_without_a_worked_solution_are_refused_before_any_work(user_run, tmp_path):
    cfg, src, train = user_run
    rows = gsm8k_rows(12)
    rows[3]["extra_info"] = {k: v for k, v in rows[3]["extra_info"].items() if k != "answer"}
    rows[7]["extra_info"]["answer"] = "  "
    pd.DataFrame(rows).to_parquet(train)
    logs = []
    with pytest.raises(DatasetError) as e:
        prepare_assets(cfg, str(tmp_path / "work"), log=logs.append)
    msg = str(e.value)
    assert "2 of 12 training rows" in msg and "rows 3, 7" in msg and str(train) in msg
    assert "extra_info.answer" in msg and "model.format_warmup_steps=0" in msg
    assert not any("warm start" in line for line in logs)  # no model work began


def test_config_refuses_it_without_a_model_and_hashes_as_before_when_off(tmp_path):
    with pytest.raises(ConfigError, match="model.format_warmup_steps.*set model.path"):
        with_overrides(RunConfig(), {"model.format_warmup_steps": 4})
    with pytest.raises(ConfigError, match="format_warmup_lr"):
        with_overrides(RunConfig(), {"model.path": "/x", "model.format_warmup_lr": 0.0})
    on = {"model.path": "/x"}
    base = with_overrides(RunConfig(), on)
    assert with_overrides(RunConfig(), {**on, "model.format_warmup_lr": 1e-3}
                          ).trajectory_hash() == base.trajectory_hash()
    assert with_overrides(RunConfig(), {**on, "model.format_warmup_steps": 2}
                          ).trajectory_hash() != base.trajectory_hash()


def test_only_the_newest_saved_state_is_kept(tmp_path):
    store = RunStore(str(tmp_path / "store"))
    ws = WarmStart(store, "b" * 64, lambda *_: None, total_steps=9, target=1.0)
    ws.save(1, {"w": torch.zeros(4)})
    first = store.get_json(warm_start_doc("b" * 64))["state"]
    ws.save(2, {"w": torch.ones(4)})
    second = store.get_json(warm_start_doc("b" * 64))["state"]
    assert first != second
    assert not store.has_object(first) and store.has_object(second)


def test_a_recorded_run_checks_the_folder_it_started_from(user_run, tmp_path):
    cfg, src, train = user_run
    logs = []
    first = prepare_run(cfg, str(tmp_path / "runs"), "r", log_fn=logs.append)
    index = json.loads(first.assets_json)
    assert index["model"]["model.safetensors"] != _sha(src / "model.safetensors")
    again = []
    second = prepare_run(cfg, str(tmp_path / "runs"), "r", log_fn=again.append)
    assert second.assets_json == first.assets_json
    assert not any("warm start" in line for line in again)  # the record's model, no warm start
    qwen_folder(src, seed=5)
    with pytest.raises(AssetsChangedError, match=str(src / "model.safetensors")):
        prepare_run(cfg, str(tmp_path / "runs"), "r", log_fn=lambda *_: None)


def _sha(path) -> str:
    import hashlib

    return hashlib.sha256(open(path, "rb").read()).hexdigest()
