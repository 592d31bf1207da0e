"""verl's own example scripts, as written, through the CLI's config builder (issue 39).

``data/verl_example_scripts.yaml`` holds the overrides of 24 of verl's example scripts and
verl-recipe's DAPO (the file and commit each came from), expanded as bash expands them. Here
only the model, data and checkpoint paths and the sizes (batch, mini- and micro-batch, sequence
lengths, workers) change. Each script is then accepted, or refused only for a GPU-only setting
(tensor or sequence parallelism, the SGLang engine: the words of ``verl_keys.MULTI_GPU``); with
those set to one device, every script builds a valid run config and trains one step on the tiny
model (MATH-style stand-in data for the MATH scripts; DAPO's two stop with dynamic sampling's
error, every group of the untrained model being all wrong).
"""

import json
import os
import re

import pandas as pd
import pytest
import yaml

from tests.verl_core.reward.test_reward_model import build_reward_model
from verl_core.config import ConfigError
from verl_core.verl_keys import MULTI_GPU, run_config

SCRIPTS = yaml.safe_load(open(os.path.join(os.path.dirname(__file__), "data",
                                           "verl_example_scripts.yaml")))
NAMES = [s["name"] for s in SCRIPTS]
A, R = "actor_rollout_ref.actor.", "actor_rollout_ref.rollout."
MATH_SOURCE = "DigitalLearningGmbH/MATH-lighteval"

# the sizes a 2-core CPU and the tiny model take; every other value stays as the script has it
SIZES = {
    "data.train_batch_size": 4, "data.gen_batch_size": 8, A + "ppo_mini_batch_size": 2,
    "data.max_prompt_length": 32, "data.max_response_length": 8, R + "prompt_length": 32,
    R + "response_length": 8, "reward_model.reward_kwargs.max_resp_len": 8,
    "reward_model.overlong_buffer.len": 4, "reward_model.reward_kwargs.overlong_buffer_cfg.len": 4,
    "trainer.n_gpus_per_node": 1, "trainer.nnodes": 1,
}
MICRO = re.compile(r"micro_batch_size(_per_gpu)?$")
TOKEN_BUDGET = re.compile(r"max_token_len_per_gpu$")
# GPU-only settings at their one-device values (the engine: hf, as .venv has no vLLM)
ONE_DEVICE = {R + "tensor_model_parallel_size": 1, "reward_model.rollout.tensor_model_parallel_size": 1,
              A + "ulysses_sequence_parallel_size": 1,
              "actor_rollout_ref.ref.ulysses_sequence_parallel_size": 1,
              "critic.ulysses_sequence_parallel_size": 1, R + "name": "hf"}


@pytest.fixture(scope="module")
def local_files(tmp_path_factory):
    """The tiny model saved as a folder, a tiny reward model, and arithmetic rows in verl's
    layout as GSM8K (``openai/gsm8k``) and MATH (``DigitalLearningGmbH/MATH-lighteval``)
    stand-ins."""
    from verl_core.data.synthetic import write_arithmetic_dataset
    from verl_core.models.tiny import build_tiny_model

    root = tmp_path_factory.mktemp("verl-examples")
    train, val = write_arithmetic_dataset(str(root / "arith"), train_size=16, val_size=4,
                                          max_operand=20, seed=0)
    files = {}
    for task, source in (("gsm8k", "openai/gsm8k"), ("math", MATH_SOURCE)):
        for split, path in (("train", train), ("test", val)):
            df = pd.read_parquet(path).assign(data_source=source)
            files[task, split] = str(root / f"{task}-{split}.parquet")
            df.to_parquet(files[task, split])
    model, tok = build_tiny_model()
    model.save_pretrained(root / "model", safe_serialization=True)
    tok.save_pretrained(root / "model")
    return {"root": root, "model": str(root / "model"), "files": files,
            "reward_model": build_reward_model(root / "rm")}


def _local(path, files: dict) -> str:
    """A script's data path -> the stand-in of its task and split."""
    task = "math" if "math" in str(path).lower() else "gsm8k"
    return files[task, "test" if "test" in str(path) or "val" in str(path) else "train"]


def as_here(script: dict, local: dict, workdir: str) -> dict:
    """The script's overrides with local paths and CPU sizes; nothing else changed."""
    out = {}
    for key, value in script["overrides"].items():
        bare = key.lstrip("+")
        if bare in ("data.train_files", "data.val_files"):
            value = [_local(p, local["files"]) for p in value] if isinstance(value, list) \
                else _local(value, local["files"])
        elif bare == "reward_model.model.path":
            value = local["reward_model"]
        elif bare.endswith("model.path"):
            value = local["model"]
        elif bare == "trainer.default_local_dir":
            value = workdir  # the run store: the plain loop's --workdir
        elif bare.endswith("tool_config_path"):
            value = "builtin:calculator"
        elif bare in SIZES:
            value = SIZES[bare]
        elif MICRO.search(bare) and value is not None:
            value = 2
        elif TOKEN_BUDGET.search(bare):
            value = 1024
        out[key] = value
    return out


@pytest.mark.parametrize("script", SCRIPTS, ids=NAMES)
def test_each_script_is_accepted_or_refused_for_a_gpu_only_setting(script, local_files, tmp_path):
    over = as_here(script, local_files, str(tmp_path / "run"))
    over.pop("trainer.default_local_dir", None)  # the CLI takes it as --workdir (main)
    try:
        run_config("", "", over)
    except ConfigError as e:
        lines = [ln for ln in str(e).splitlines() if ln.strip()]
        lines = lines[1:] if len(lines) > 1 else lines  # "N config keys cannot apply:" first
        assert all(MULTI_GPU in ln for ln in lines), str(e)


@pytest.mark.parametrize("script", SCRIPTS, ids=NAMES)
def test_each_script_builds_a_run_on_one_device(script, local_files, tmp_path):
    over = {**as_here(script, local_files, str(tmp_path / "run")),
            **{k: v for k, v in ONE_DEVICE.items() if k in script["overrides"]}}
    over.pop("trainer.default_local_dir", None)
    cfg = run_config("", "", over)
    est = script["overrides"].get("algorithm.adv_estimator", "gae")
    assert cfg.algorithm.adv_estimator == est
    assert cfg.model.path == local_files["model"]


def test_the_scripts_cover_the_refusals_the_issue_met():
    keys = {k.lstrip("+") for s in SCRIPTS for k in s["overrides"]}
    assert len(SCRIPTS) == 24
    for k in ("trainer.save_freq", A + "optim.lr_warmup_steps_ratio",
              "critic.optim.lr_warmup_steps_ratio", A + "clip_ratio_low",
              "reward_model.reward_kwargs.overlong_buffer_cfg.len", "trainer.log_val_generations",
              R + "over_sample_rate", A + "checkpoint.save_contents", R + "load_format",
              R + "layered_summon", A + "entropy_checkpointing", "reward_model.rollout.name"):
        assert k in keys, k
    assert any(s["overrides"].get("trainer.save_freq") == -1 for s in SCRIPTS)


DYNAMIC_SAMPLING = {"dapo-test-qwen2.5-7b", "dapo-qwen2.5-32b"}
"""DAPO's dynamic sampling keeps only groups with mixed rewards: the untrained tiny model scores
0 on every stand-in row, so every group is filtered and the run stops with the error that says
so (test_dapo_recipe.py trains DAPO's recipe with a reward that gives it mixed groups)."""


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_a_script_trains_one_step(name, local_files, tmp_path, capsys):
    from verl_core.engine.dynamic_sampling import FilterGroupsExhaustedError
    from verl_core.train import main

    script = SCRIPTS[NAMES.index(name)]
    over = {**as_here(script, local_files, str(tmp_path / "run")),
            **{k: v for k, v in ONE_DEVICE.items() if k in script["overrides"]},
            "trainer.total_training_steps": 1, "trainer.logger": ["console"]}
    out = tmp_path / "summary.json"
    argv = [f"{k}={json.dumps(v) if isinstance(v, (list, bool)) or v is None else v}"
            for k, v in over.items()]
    argv += ["--workdir", str(tmp_path / "run"), "--summary-json", str(out)]
    if name in DYNAMIC_SAMPLING:
        with pytest.raises(FilterGroupsExhaustedError, match="max_num_gen_batches=10 generation "
                                                             "batches sampled and only 0 of"):
            main(argv)
        return
    assert main(argv) == 0
    summary = json.loads(out.read_text())
    assert [h["step"] for h in summary["history"]] == [1]
    printed = capsys.readouterr()
    text = printed.out + printed.err
    if name.startswith("gspo"):  # MATH and GSM8K rows scored, samples printed, warmup in steps
        assert "val sample 2/2 after step" in text
    # save_freq=-1: the header says what is saved; no other script's header has the line
    assert ("checkpoints: the last step only" in text) == \
        (script["overrides"].get("trainer.save_freq") == -1)


@pytest.mark.slow
def test_override_config_trains_and_exports_the_changed_config(local_files, tmp_path, capsys):
    # verl's actor_rollout_ref.model.override_config.*: the run's copy of the folder has the
    # field changed in its config.json (the weights are the same files), and the export keeps it
    from verl_core.train import main

    files = local_files["files"]
    common = [f"actor_rollout_ref.model.path={local_files['model']}",
              f"data.train_files={files['gsm8k', 'train']}",
              f"data.val_files={files['gsm8k', 'test']}", "algorithm.adv_estimator=grpo",
              "data.train_batch_size=4", f"{A}ppo_mini_batch_size=2", f"{R}n=2",
              "data.max_prompt_length=32", "data.max_response_length=8",
              "trainer.total_training_steps=1"]
    out = tmp_path / "summary.json"
    assert main([*common, "actor_rollout_ref.model.override_config.rms_norm_eps=0.001",
                 "--workdir", str(tmp_path / "run"), "--summary-json", str(out)]) == 0
    summary = json.loads(out.read_text())
    exported = json.loads(open(os.path.join(summary["final_model"], "config.json")).read())
    original = json.loads(open(os.path.join(local_files["model"], "config.json")).read())
    assert exported["rms_norm_eps"] == 0.001 != original["rms_norm_eps"]
    # a field the config does not have: refused before any work, naming the fields
    capsys.readouterr()
    assert main([*common, "actor_rollout_ref.model.override_config.rms_eps=0.001",
                 "--workdir", str(tmp_path / "typo")]) == 2
    err = capsys.readouterr().err
    assert "model.override_config names ['rms_eps']" in err and "rms_norm_eps" in err
    assert not (tmp_path / "typo" / "checkpoints").exists()


@pytest.mark.slow
def test_numina_rows_train_with_prime_math_and_code_rows_without_tests_are_refused(
        local_files, tmp_path, capsys):
    # verl routes numina_* to prime_math: scored here too; a code source (taco) goes to the
    # `code` scorer, whose rows must hold tests: math answers as its ground truth are refused
    # before any work, saying what a code row's ground truth holds
    from verl_core.train import main

    files = {}
    for source in ("numina_cn_k12", "taco"):
        for split in ("train", "test"):
            df = pd.read_parquet(local_files["files"]["math", split]).assign(data_source=source)
            files[source, split] = str(tmp_path / f"{source}-{split}.parquet")
            df.to_parquet(files[source, split])

    def run(source, name):
        return main([f"actor_rollout_ref.model.path={local_files['model']}",
                     f"data.train_files={files[source, 'train']}",
                     f"data.val_files={files[source, 'test']}", "algorithm.adv_estimator=grpo",
                     "data.train_batch_size=4", f"{A}ppo_mini_batch_size=2", f"{R}n=2",
                     "data.max_prompt_length=32", "data.max_response_length=8",
                     "trainer.total_training_steps=1", "--workdir", str(tmp_path / name),
                     "--summary-json", str(tmp_path / f"{name}.json")])

    assert run("numina_cn_k12", "numina") == 0
    history = json.loads((tmp_path / "numina.json").read_text())["history"]
    assert [h["step"] for h in history] == [1]
    capsys.readouterr()
    assert run("taco", "taco") == 2
    err = capsys.readouterr().err
    assert "(data_source 'taco'): code scorer: the ground truth" in err, err
    assert "one Python 'assert ...' per line" in err, err
    assert not (tmp_path / "taco.json").exists()
