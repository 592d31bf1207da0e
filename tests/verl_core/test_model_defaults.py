"""The front door (verl_core.verl_keys.run_config, called by the plain loop and the workflow's
configure): model-aware defaults, the micro-batch fitted to the mini-batch, verl's epochs, the
effective-config line, the length-limit warning, and a batch larger than the dataset refused
before any work (issue 23 items 6 and 8)."""
import json

import pytest

from tests.standins import gsm8k_parquet, qwen_folder
from verl_core.config import (USER_MODEL_DEFAULTS, ConfigError, RunConfig, effective_line,
                              preset)
from verl_core.errors import PermanentError, TransientError
from verl_core.validation import RunInputError, clipped_responses_warning
from verl_core.verl_keys import parse_cli, run_config, to_ours, verl_defaults

A = "actor_rollout_ref.actor."
# each model-aware default and the verl key whose default it is (verl_defaults/ppo_trainer.yaml)
VERL_KEY_OF = {
    "data.max_prompt_length": "data.max_prompt_length",
    "rollout.max_new_tokens": "data.max_response_length",
    "optim.lr": A + "optim.lr",
    "optim.critic_lr": "critic.optim.lr",
    "optim.weight_decay": A + "optim.weight_decay",
    "optim.beta2": A + "optim.betas",
    "optim.warmup_steps": A + "optim.lr_warmup_steps_ratio",  # 0 (and steps -1): no warmup
    "optim.min_lr_ratio": A + "optim.min_lr_ratio",
    "algorithm.clip_ratio_high": A + "clip_ratio_high",
    "algorithm.lam": "algorithm.lam",
    "actor.ppo_epochs": A + "ppo_epochs",
    "model.gradient_checkpointing": "actor_rollout_ref.model.enable_gradient_checkpointing",
}


FITS = ["data.max_prompt_length=256", "data.max_response_length=16"]
"""Lengths that fit the stand-in's 512 positions (verl's 512 + 512 do not)."""


@pytest.fixture(scope="module")
def user_model(tmp_path_factory):
    root = tmp_path_factory.mktemp("user-model")
    return str(qwen_folder(root / "qwen")), str(gsm8k_parquet(root / "train.parquet", 200)), \
        str(gsm8k_parquet(root / "test.parquet", 8, split="test"))


def test_model_aware_defaults_are_verls_defaults():
    assert set(USER_MODEL_DEFAULTS) == set(VERL_KEY_OF)
    defaults = verl_defaults()
    for ours, verl in VERL_KEY_OF.items():
        # verl's default value, through the same translation as a verl command's
        assert to_ours({verl: defaults[verl]})[ours] == USER_MODEL_DEFAULTS[ours], ours


def test_a_model_you_bring_gets_verls_defaults_for_what_you_did_not_set(tmp_path):
    for algo in ("grpo", "ppo"):
        demo = preset(algo)
        assert (demo.optim.lr, demo.rollout.max_new_tokens, demo.data.max_prompt_length) == \
            (5e-4, 8, 64)  # the demo's sizes, for a 3-token arithmetic answer
        mine = preset(algo, **{"model.path": str(tmp_path), "optim.lr": 2e-6})
        assert mine.optim.lr == 2e-6  # what you set wins
        for key, value in USER_MODEL_DEFAULTS.items():
            if key != "optim.lr":
                section, name = key.split(".")
                assert getattr(getattr(mine, section), name) == value, (algo, key)


def test_both_front_doors_fit_the_micro_batch_to_a_small_mini_batch():
    from tasks.prepare import build_config

    small = {"data.train_batch_size": 4, "actor.ppo_mini_batch_size": 2}
    # 2 prompts x rollout.n=8 = 16 rows: the default 128 halves to 16 (it used to be refused by
    # the plain loop while the workflow fixed it)
    cfg = run_config("grpo", "", small)
    assert cfg.actor.ppo_micro_batch_size == 16
    assert build_config("grpo", "", "", "", 0, 0, 0, json.dumps(small)) == cfg
    # one you set is yours: too large is refused, naming it
    with pytest.raises(ConfigError, match=r"ppo_micro_batch_size=64: is larger than a mini"):
        run_config("grpo", "", {**small, "actor.ppo_micro_batch_size": 64})


def test_total_epochs_become_steps_as_verl_counts_them():
    # the synthetic task: 3000 rows // 64 prompts = 46 full batches per epoch (the rest dropped)
    assert run_config("", "", {"trainer.total_epochs": 2}).total_steps == 92
    # total_training_steps caps the epochs, as verl's loop stops at whichever comes first
    assert run_config("", "", {"trainer.total_epochs": 2,
                               "trainer.total_training_steps": 5}).total_steps == 5
    assert run_config("", "", {"trainer.total_epochs": 2,
                               "trainer.total_training_steps": 500}).total_steps == 92


def test_the_effective_config_line_lists_what_differs_from_the_defaults(tmp_path):
    assert effective_line(RunConfig()) == "[verl] config: the defaults"
    line = effective_line(preset("grpo", **{"model.path": str(tmp_path), "rollout.n": 4}))
    for item in ("optim.lr=1e-06", "rollout.max_new_tokens=512", "data.max_prompt_length=512",
                 "rollout.n=4", f"model.path='{tmp_path}'"):
        assert f" {item}" in line
    assert "rollout.top_p" not in line  # at its default: not listed


def test_a_step_of_mostly_cut_responses_warns():
    cfg = preset("grpo")
    assert clipped_responses_warning({"response_length/clip_ratio": 0.5}, cfg, 3) is None
    assert clipped_responses_warning({}, cfg, 3) is None
    msg = clipped_responses_warning({"response_length/clip_ratio": 0.75}, cfg, 3)
    assert msg.startswith("warning: step 3: 75% of the responses hit rollout.max_new_tokens=8")


def test_clip_ratio_is_in_the_history(tracked_run):
    # verl's metric, per step, from the rollout: the share of responses of 8 tokens (the demo's)
    ratios = tracked_run.table.set_index("step")["response_length/clip_ratio"]
    steps = range(1, tracked_run.steps + 1)
    assert all(0.0 <= ratios[s] <= 1.0 for s in steps)


def test_a_batch_larger_than_the_dataset_is_one_line_and_exit_2(user_model, tmp_path, capsys):
    from verl_core.train import main

    model, train, test = user_model
    code = main(["--model", model, "--train-files", train, "--val-files", test,
                 "--workdir", str(tmp_path / "w"), "data.train_batch_size=256",
                 *FITS])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert err.splitlines() == [err] and err.endswith(
        "data.train_batch_size=256 is larger than the 200 rows of data.train_files: every batch "
        "would be dropped; use a smaller --batch-size (data.train_batch_size) or more prompts")
    assert not (tmp_path / "w" / "assets").exists()  # refused before anything was copied


def test_the_workflow_refuses_it_as_permanent_before_any_work(user_model, tmp_path):
    from tasks.prepare import build_config
    from verl_core.prepare import prepare_run

    model, train, test = user_model
    over = json.dumps({"data.train_batch_size": 256, **parse_cli(FITS)})
    cfg = build_config("", model, train, test, 0, 0, 0, over)  # sizes alone: a valid config
    with pytest.raises(RunInputError, match=r"train_batch_size=256 is larger than the 200 rows"
                       ) as e:
        prepare_run(cfg, str(tmp_path / "store"), "r", log_fn=lambda *_: None)
    assert isinstance(e.value, PermanentError) and not isinstance(e.value, TransientError)
    assert not (tmp_path / "store" / "r" / "assets").exists()  # refused before any copy
    # with verl's epochs the front door counts the rows itself and refuses at configure
    epochs = json.dumps({"data.train_batch_size": 256, "trainer.total_epochs": 1})  # first
    with pytest.raises(RunInputError, match=r"larger than the 200 rows"):
        build_config("", model, train, test, 0, 0, 0, epochs)


def test_a_sequence_longer_than_the_models_positions_is_refused_naming_both(user_model,
                                                                              tmp_path, capsys):
    from verl_core.train import main

    model, train, test = user_model
    # the stand-in has 512 positions; verl's defaults ask 512 prompt + 512 response tokens
    code = main(["--model", model, "--train-files", train, "--val-files", test,
                 "--workdir", str(tmp_path / "w")])
    assert code == 2
    assert capsys.readouterr().err.strip().endswith(
        "data.max_prompt_length=512 + rollout.max_new_tokens=512 = 1024 tokens do not fit "
        f"model.path={model!r}: its max_position_embeddings is 512 (config.json); lower one of "
        "them (verl's data.max_prompt_length / data.max_response_length)")
