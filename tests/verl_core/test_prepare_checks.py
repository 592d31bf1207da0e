"""Every permanent check at prepare (issue 21 item 5, 7): bad model folders, a batch larger than
the dataset, unknown data sources and bad VERL_FAULTS are refused by ``check_run_inputs`` before
any work, with a fix named; a permanent error raised in a Ray worker keeps its class."""

from __future__ import annotations

import importlib.util
import json
import os
import struct

import pandas as pd
import pytest

from verl_core.engine import workers
from verl_core.config import RunConfig, with_overrides
from verl_core.data.synthetic import write_arithmetic_dataset
from verl_core.guard.faults import FaultSpecError, check_faults
from verl_core.models import ModelLoadError, build_tiny_model, check_model_folder
from verl_core.validation import RunInputError, check_run_inputs


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    """A valid tiny model folder (safetensors) to damage copies of."""
    path = str(tmp_path_factory.mktemp("tiny"))
    model, tok = build_tiny_model(hidden_size=32, layers=1, heads=2, seed=0)
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return path


def _copy(src, dst):
    os.makedirs(dst)
    for name in os.listdir(src):
        with open(os.path.join(src, name), "rb") as f, open(os.path.join(dst, name), "wb") as g:
            g.write(f.read())
    return str(dst)


def test_valid_folder_passes(tiny_folder):
    check_model_folder(tiny_folder)


def test_pickle_only_folder_is_refused_with_the_safe_fix(tiny_folder, tmp_path):
    path = _copy(tiny_folder, tmp_path / "m")
    os.rename(os.path.join(path, "model.safetensors"), os.path.join(path, "pytorch_model.bin"))
    cfg = with_overrides(RunConfig(), {"model.path": path})
    with pytest.raises(ModelLoadError, match="convert it to safetensors") as e:
        check_run_inputs(cfg)
    assert "weights_only" not in str(e.value) and "pytorch_model.bin" in str(e.value)


def test_garbage_truncated_and_misshapen_weights_are_refused(tiny_folder, tmp_path):
    st = "model.safetensors"
    garbage = _copy(tiny_folder, tmp_path / "garbage")
    size = os.path.getsize(os.path.join(garbage, st))
    with open(os.path.join(garbage, st), "wb") as f:
        f.write(os.urandom(size))  # a random u64 header length cannot fit in the file
    with pytest.raises(ModelLoadError, match=r"model\.safetensors is not a valid safetensors"):
        check_model_folder(garbage, "reward_model.path")
    cut = _copy(tiny_folder, tmp_path / "cut")
    with open(os.path.join(cut, st), "r+b") as f:
        f.truncate(size - 4)  # the tensors' spans now exceed the file by 4 bytes
    with pytest.raises(ModelLoadError, match=r"span \d+ bytes, the file holds \d+"):
        check_model_folder(cut)
    wrong = _copy(tiny_folder, tmp_path / "wrong")
    cfg_path = os.path.join(wrong, "config.json")
    config = json.load(open(cfg_path))
    config["vocab_size"] += 1  # the embedding rows no longer match the config
    json.dump(config, open(cfg_path, "w"))
    with pytest.raises(ModelLoadError, match="different models"):
        check_model_folder(wrong)


def test_reward_model_folder_is_checked_at_prepare(tmp_path):
    rm = tmp_path / "rm"
    rm.mkdir()
    (rm / "config.json").write_text("{}")
    # a header that claims one F32 tensor of 4 elements, 12 bytes of data present
    header = json.dumps({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}).encode()
    (rm / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 12)
    cfg = with_overrides(RunConfig(), {"reward_model.enable": True, "reward_model.path": str(rm)})
    with pytest.raises(ModelLoadError, match=r"reward_model\.path=.*the file holds 12"):
        check_run_inputs(cfg)


def test_batch_larger_than_the_dataset_is_refused():
    # the synthetic task has 3000 training rows by default
    with pytest.raises(RunInputError, match=r"train_batch_size=5000 is larger than the "
                                            r"synthetic task's 3000"):
        check_run_inputs(with_overrides(RunConfig(), {"data.train_batch_size": 5000,
                                                      "actor.ppo_mini_batch_size": 5000,
                                                      "actor.ppo_micro_batch_size": 8}))


def _files(tmp_path, train_size=40, source=None):
    train, val = write_arithmetic_dataset(str(tmp_path), train_size=train_size, val_size=10,
                                          max_operand=9, seed=0)
    if source:
        df = pd.read_parquet(val)
        df.loc[3, "data_source"] = source
        df.to_parquet(val, index=False)
    return train, val


def test_batch_size_against_given_files(tmp_path):
    train, val = _files(tmp_path)
    cfg = with_overrides(RunConfig(), {"data.train_files": train, "data.val_files": val,
                                       "data.train_batch_size": 64,
                                       "actor.ppo_mini_batch_size": 32})
    with pytest.raises(RunInputError, match=r"larger than the 40 rows of data.train_files"):
        check_run_inputs(cfg)


def test_unknown_data_source_is_refused_naming_the_file(tmp_path):
    train, val = _files(tmp_path, source="my/task")
    cfg = with_overrides(RunConfig(), {"data.train_files": train, "data.val_files": val,
                                       "data.train_batch_size": 8,
                                       "actor.ppo_mini_batch_size": 4,
                                       "actor.ppo_micro_batch_size": 8})
    with pytest.raises(RunInputError, match=r"val.*data_source 'my/task' has no rule scorer"):
        check_run_inputs(cfg)
    # a scorer that takes every row: no data_source routing, so no refusal
    check_run_inputs(with_overrides(cfg, {"reward.scorer": "arithmetic"}))


@pytest.mark.parametrize("spec, match", [
    ("[{phase: reward}]", "not JSON"),
    ('[{"phase": "updat", "step": 1, "kind": "transient"}]', "'updat' is not a phase"),
    ('[{"step": 1, "kind": "kill"}]', "None is not a phase"),
    ('[{"phase": "update", "kind": "kill"}]', 'needs "step"'),
    ('[{"phase": "reward", "step": "1"}]', 'needs "step"'),
    ('[{"phase": "reward", "step": 1, "kind": "nan_grad"}]', "fires only in phase 'update'"),
    ('[{"phase": "reward", "step": 1, "kind": "boom"}]', "unknown kind 'boom'"),
    ('[{"phase": "reward", "step": 1, "time": 2}]', r"unknown key\(s\) \['time'\]"),
    ('[{"phase": "reward", "step": 1, "times": 0}]', '"times" must be'),
])
def test_bad_faults_are_refused_at_prepare(monkeypatch, spec, match):
    monkeypatch.setenv("VERL_FAULTS", spec)
    with pytest.raises(FaultSpecError, match=match):
        check_run_inputs(RunConfig())


def test_good_faults_pass(monkeypatch):
    monkeypatch.setenv("VERL_FAULTS", json.dumps([
        {"phase": "update-rank1", "step": 1, "kind": "hang", "times": 1},
        {"phase": "reward", "step": 0, "kind": "slow", "seconds": 2.5},
        {"phase": "update", "step": 3, "kind": "nan_grad"}]))
    assert check_faults() == 3


@pytest.fixture
def ray_local():
    ray = pytest.importorskip("ray")
    ray.init(address="local", num_cpus=1, include_dashboard=False, configure_logging=False)
    yield ray
    ray.shutdown()


def test_worker_errors_keep_their_class(ray_local, tmp_path):
    """An actor whose construction fails permanently (here: an asset index with a name that is
    not a sha256) raises that error's class from its calls, not ActorDiedError (which the
    runtime maps to a lost worker, retried as transient)."""
    from verl_core.engine import cluster
    from verl_core.errors import PermanentError

    actor = ray_local.remote(num_cpus=1)(cluster.RayRunWorker).remote(
        str(tmp_path / "store"), json.dumps(RunConfig().to_dict()),
        {"model": {"config.json": "not-a-sha"}, "train": [], "val": [], "id": "0" * 64}, 1)
    with pytest.raises(PermanentError) as e:
        workers.call(actor, "rollout", 0, timeout_s=120)
    assert getattr(e.value, "worker_init_failed", False)


@pytest.mark.vllm
def test_a_head_size_vllms_cpu_kernel_cannot_run_is_refused_at_prepare(tiny_folder):
    """rollout.engine=vllm on vLLM's CPU backend (run in .venv-vllm): a head size its attention
    kernel lacks is refused before any work, naming the keys and the sizes that work. Where
    vLLM is its CUDA build the check has nothing to say (its backend is picked per GPU)."""
    from verl_core.rollout.vllm import on_cpu_backend

    if not on_cpu_backend():
        pytest.skip("vLLM's CUDA build: head sizes are checked by the backend it picks per GPU")
    # the tiny model at 4 heads: head size 16
    cfg = with_overrides(RunConfig(), {"rollout.engine": "vllm", "model.tiny_heads": 4})
    with pytest.raises(RunInputError, match=r"head size is 16 \(model\.tiny_hidden_size=64 / "
                                            r"model\.tiny_heads=4\).*32, 64, 80.*set "
                                            r"model\.tiny_heads to 2 or 1"):
        check_run_inputs(cfg)
    check_run_inputs(with_overrides(cfg, {"model.tiny_heads": 2}))  # the default: head size 32
    check_run_inputs(with_overrides(cfg, {"rollout.engine": "hf"}))  # hf runs any head size
    # a model folder you bring: hidden 32 over 2 heads
    mine = with_overrides(RunConfig(), {"rollout.engine": "vllm", "model.path": tiny_folder})
    with pytest.raises(RunInputError, match=r"model\.path=.*attention head size 16.*"
                                            r"rollout\.engine='hf'"):
        check_run_inputs(mine)


def test_without_vllm_the_head_size_is_left_to_the_engine(monkeypatch):
    """Where vLLM is not installed (the light image a prepare may run in), prepare does not
    refuse rollout.engine=vllm: the engine, when a worker builds it, names the install."""
    import sys

    from verl_core.rollout.vllm import supported_head_sizes

    monkeypatch.setitem(sys.modules, "vllm", None)
    monkeypatch.setitem(sys.modules, "vllm.platforms", None)
    assert supported_head_sizes() is None
    check_run_inputs(with_overrides(RunConfig(), {"rollout.engine": "vllm",
                                                  "model.tiny_heads": 4}))


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None,
                    reason="vLLM is installed here: nothing is missing")
def test_a_missing_vllm_is_refused_by_the_plain_loop_before_any_work(tmp_path, capsys):
    # verl's scripts say rollout.name=vllm: without vLLM the plain loop says so and how to install
    # it before the run store, the warm start or any asset exists
    from verl_core.train import main

    work = tmp_path / "run"
    assert main(["actor_rollout_ref.rollout.name=vllm", "--workdir", str(work)]) == 2
    err = capsys.readouterr().err
    assert "rollout.engine='vllm' needs the vllm package" in err and "rollout.engine='hf'" in err
    assert not work.exists()
