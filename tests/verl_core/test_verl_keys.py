"""verl's command line and YAML configs (verl_core/verl_keys/), and the rename of our update
sizes from ``trainer`` to ``actor``."""
import json
import os
import re
import shlex
import textwrap

import pytest

from verl_core.checkpoint.config import schedule_line
from verl_core.config import ConfigError, RunConfig, preset, typed_overrides, with_overrides
from verl_core.verl_keys import (DEFAULTS_FILE, NO_EFFECT, READ_WITH_GET, SPEED_ONLY,
                                 VERL_TO_OURS, load_yaml, overrides_from, parse_cli, run_config,
                                 to_ours, verl_defaults)

A = "actor_rollout_ref.actor."
R = "actor_rollout_ref.rollout."


@pytest.mark.parametrize("old", ["trainer.ppo_mini_batch_size", "trainer.ppo_micro_batch_size",
                                 "trainer.ppo_epochs"])
def test_old_trainer_keys_name_their_new_home(old):
    new = old.replace("trainer.", "actor.")
    for call in (lambda: with_overrides(RunConfig(), {old: 4}), lambda: typed_overrides({old: 4}),
                 lambda: to_ours({old: 4}),
                 lambda: RunConfig.from_dict({"trainer": {old.split(".")[1]: 4}})):
        with pytest.raises(ConfigError, match=f"'{old}' was renamed to '{new}'"):
            call()


# verl key=value -> {our key: value}; the arithmetic of a transform in the comment
MAPPED = [
    (f"{A}ppo_mini_batch_size=64", {"actor.ppo_mini_batch_size": 64}),
    # verl's per-GPU micro-batch counts responses, as ours counts a worker's rows
    (f"{A}ppo_micro_batch_size_per_gpu=16", {"actor.ppo_micro_batch_size": 16}),
    (f"{A}ppo_epochs=2", {"actor.ppo_epochs": 2}),
    ("actor_rollout_ref.rollout.n=8", {"rollout.n": 8}),
    (f"{A}optim.lr=1e-6", {"optim.lr": 1e-6}),
    (f"{A}optim.betas=[0.9,0.999]", {"optim.beta1": 0.9, "optim.beta2": 0.999}),
    (f"{A}optim.clip_grad=0.5", {"optim.grad_clip": 0.5}),
    # verl's scheduler steps once per RL step: its warmup and cosine count RL steps
    (f"{A}optim.lr_warmup_steps=5", {"optim.warmup_steps": 5, "optim.lr_schedule_unit": "rl_step"}),
    (f"{A}optim.lr_scheduler_type=cosine", {"optim.lr_schedule": "cosine",
                                           "optim.lr_schedule_unit": "rl_step"}),
    # lr_warmup_steps, when set, wins over the ratio (verl); the ratio alone waits for the
    # run's length (run_config)
    (f"{A}optim.lr_warmup_steps=3 {A}optim.lr_warmup_steps_ratio=0.5",
     {"optim.warmup_steps": 3, "optim.lr_schedule_unit": "rl_step"}),
    (f"{A}optim.lr_warmup_steps_ratio=0.25 critic.optim.lr_warmup_steps_ratio=0.05",
     {"optim.lr_warmup_steps_ratio": 0.25, "optim.critic_lr_warmup_steps_ratio": 0.05,
      "optim.lr_schedule_unit": "rl_step"}),
    # override_config field by field (a command line) or as one mapping (a YAML file)
    ("actor_rollout_ref.model.override_config.attention_dropout=0.0 "
     "+actor_rollout_ref.model.override_config.rope_theta=500000",
     {"model.override_config": '{"attention_dropout": 0.0, "rope_theta": 500000}'}),
    ("critic.optim.lr_warmup_steps=4", {"optim.critic_warmup_steps": 4,
                                        "optim.lr_schedule_unit": "rl_step"}),
    ("critic.optim.lr=1e-5", {"optim.critic_lr": 1e-5}),
    ("algorithm.kl_ctrl.kl_coef=0.001", {"algorithm.kl_coef": 0.001}),
    ("algorithm.kl_ctrl.type=adaptive", {"algorithm.kl_ctrl_type": "adaptive"}),
    ("algorithm.kl_ctrl.target_kl=0.05", {"algorithm.kl_target": 0.05}),
    ("algorithm.kl_ctrl.horizon=500", {"algorithm.kl_horizon": 500}),
    ("algorithm.adv_estimator=rloo", {"algorithm.adv_estimator": "rloo"}),
    (f"{A}use_kl_loss=True", {"algorithm.use_kl_loss": True}),
    (f"{A}kl_loss_coef=0.01", {"algorithm.kl_loss_coef": 0.01}),
    (f"{A}kl_loss_type=k3", {"algorithm.kl_loss_type": "k3"}),
    (f"{A}clip_ratio=0.3", {"algorithm.clip_ratio_low": 0.3, "algorithm.clip_ratio_high": 0.3}),
    (f"{A}clip_ratio_high=0.28", {"algorithm.clip_ratio_high": 0.28}),
    (f"{A}loss_agg_mode=seq-mean-token-sum-norm",
     {"algorithm.loss_agg_mode": "seq-mean-token-sum-norm"}),
    (f"{A}entropy_coeff=0.01", {"algorithm.entropy_coeff": 0.01}),
    (f"{A}policy_loss.loss_mode=gspo", {"algorithm.policy_loss": "gspo"}),
    ("algorithm.rollout_correction.bypass_mode=true", {"algorithm.policy_loss": "bypass_mode"}),
    ("actor_rollout_ref.model.path=/m", {"model.path": "/m"}),
    ("actor_rollout_ref.model.enable_gradient_checkpointing=True",
     {"model.gradient_checkpointing": True}),
    ("data.train_files=[/a.parquet,/b.parquet]", {"data.train_files": "/a.parquet,/b.parquet"}),
    ("data.max_prompt_length=128", {"data.max_prompt_length": 128}),
    ("data.max_response_length=512", {"rollout.max_new_tokens": 512}),
    ("data.train_batch_size=64", {"data.train_batch_size": 64}),
    ("trainer.total_training_steps=200", {"total_steps": 200}),
    ("trainer.save_freq=20", {"checkpoint.checkpoint_interval": 20}),
    ("trainer.test_freq=5", {"eval_every": 5}),
    ("trainer.test_freq=-1", {"eval_every": 0}),  # verl's -1 (never) is our 0 (start and end)
    ("trainer.resume_mode=auto", {"checkpoint.resume_from_checkpoint": "auto"}),
    ("trainer.resume_mode=disable", {"checkpoint.resume_from_checkpoint": "none"}),
    ("trainer.resume_mode=resume_path trainer.resume_from_path=/s/run",
     {"checkpoint.resume_from_checkpoint": "/s/run"}),
    ("trainer.max_actor_ckpt_to_keep=2", {"checkpoint.keep_last": 2}),
    ("trainer.nnodes=1 trainer.n_gpus_per_node=2", {"trainer.nnodes": 1,
                                                     "trainer.n_gpus_per_node": 2}),
    # epochs become steps once the rows are counted (run_config); the pair caps them
    ("trainer.total_epochs=15 trainer.total_training_steps=3",
     {"trainer.total_epochs": 15, "total_steps": 3}),
    ("trainer.val_before_train=False", {"val_before_train": False}),
    # the critic starts from the actor's model: the same path is accepted
    ("actor_rollout_ref.model.path=/m critic.model.path=/m", {"model.path": "/m"}),
    ("critic.ppo_micro_batch_size_per_gpu=4 actor_rollout_ref.rollout.calculate_log_probs=True",
     {}),
    ("custom_reward_function.path=/r.py custom_reward_function.name=score",
     {"reward.scorer": "/r.py:score"}),
    ("custom_reward_function.path=/r.py", {"reward.scorer": "/r.py:compute_score"}),
    ("reward_model.enable=True reward_model.model.path=/rm",
     {"reward_model.enable": True, "reward_model.path": "/rm"}),
    ("reward_model.micro_batch_size_per_gpu=8", {"reward_model.micro_batch_size": 8}),
    # bookkeeping and memory placement: accepted, no effect
    ("trainer.project_name=p trainer.experiment_name=e trainer.logger=['console']", {}),
    (f"{A}fsdp_config.param_offload=True", {}),
    ("actor_rollout_ref.model.use_remove_padding=True critic.model.use_remove_padding=True",
     {"actor.use_remove_padding": True}),
    ("actor_rollout_ref.rollout.tensor_model_parallel_size=1", {}),
    # prompts over data.max_prompt_length: cut as verl cuts them, or refused (never dropped)
    ("data.truncation=left data.filter_overlong_prompts=False", {"data.truncation": "left"}),
    ("data.truncation=error data.filter_overlong_prompts=True", {"data.truncation": "error"}),
    # sampled evaluation (verl's DAPO recipe)
    ("actor_rollout_ref.rollout.val_kwargs.do_sample=True "
     "actor_rollout_ref.rollout.val_kwargs.temperature=1.0 "
     "actor_rollout_ref.rollout.val_kwargs.top_p=0.7 actor_rollout_ref.rollout.val_kwargs.top_k=-1 "
     "actor_rollout_ref.rollout.val_kwargs.n=4",
     {"rollout.val_do_sample": True, "rollout.val_temperature": 1.0, "rollout.val_top_p": 0.7,
      "rollout.val_top_k": -1, "rollout.val_n": 4}),
]


@pytest.mark.parametrize("cli,expected", MAPPED, ids=[m[0][:60] for m in MAPPED])
def test_each_verl_key_lands_on_our_field(cli, expected):
    assert to_ours(parse_cli(shlex.split(cli))) == expected


def test_mapped_values_build_a_valid_config():
    over = to_ours(parse_cli(shlex.split(
        f"{A}optim.lr=1e-6 algorithm.kl_ctrl.kl_coef=0.001 {A}ppo_mini_batch_size=16 "
        "data.max_response_length=12 trainer.test_freq=5 trainer.save_freq=20")))
    cfg = with_overrides(preset("grpo"), over)
    assert (cfg.optim.lr, cfg.algorithm.kl_coef, cfg.actor.ppo_mini_batch_size,
            cfg.rollout.max_new_tokens, cfg.eval_every, cfg.checkpoint.checkpoint_interval) == \
        (1e-6, 0.001, 16, 12, 5, 20)


@pytest.mark.parametrize("cli,match", [
    ("actor_rollout_ref.rollout.tensor_model_parallel_size=2",
     r"tensor_model_parallel_size=2 cannot apply here: tensor parallelism \(a multi-GPU layout\)"),
    ("trainer.logger=['console','tensorboard']",
     r"trainer.logger=.*\['tensorboard'\] not offered.*tracking.tensorboard_dir"),
    ("trainer.save_freq=1.5", r"trainer.save_freq=1.5: give an interval in steps"),
    (f"{A}optim.lr_warmup_steps_ratio=2", r"lr_warmup_steps_ratio=2: must be a fraction"),
    ("trainer.total_epochs=0", r"trainer.total_epochs=0: must be a positive integer"),
    ("actor_rollout_ref.model.path=/m critic.model.path=/other",
     r"critic.model.path='/other': the critic starts from the actor's model"),
    ("critic.model.lora_rank=32", r"lora_rank=32 cannot apply here: LoRA on the critic"),
    ("actor_rollout_ref.model.trust_remote_code=True",
     r"trust_remote_code=True cannot apply here: a model folder's own Python code is never run"),
    (f"{A}use_dynamic_bsz=True critic.use_dynamic_bsz=False",
     r"both set actor.use_dynamic_bsz \(True vs False\)"),
    ("data.truncation=left data.filter_overlong_prompts=True",
     r"filter_overlong_prompts=True with data.truncation='left': verl drops .* never dropped"),
    ("trainer.default_local_dir=/ckpt",
     r"default_local_dir='/ckpt' cannot apply here: the run store .*--workdir"),
    # a verl key with no table entry: refused unless at verl's default
    ("actor_rollout_ref.rollout.multi_turn.format=gpt-oss",
     r"multi_turn.format='gpt-oss' cannot apply here: .*hermes"),
    ("actor_rollout_ref.rollout.agent.custom_async_server.path=/s.py",
     r"path='/s.py' cannot apply here: a custom async rollout server is not offered"),
    ("actor_rollout_ref.rollout.mode=sync",
     r"rollout.mode='sync' is not built here yet \(only verl's default 'async'"),
    ("critic.optim.weight_decay=0.1", r"weight_decay=0.1 cannot apply here: the critic trains "
                                      r"with the actor's update sizes"),
    ("actor_rollout_ref.rollout.expert_parallel_size=2", r"cannot apply here: a multi-GPU layout"),
    ("actor_rollout_ref.model.mtp.enable=True", r"multi-token-prediction heads are not built"),
    ("+async_training.staleness_threshold=0.5",
     r"staleness_threshold=0.5 cannot apply here: .*a fraction of samples.*rollout.max_staleness=k"),
    ("trainer.resume_from_path=/x", r"resume_from_path.*only with trainer.resume_mode"),
    ("custom_reward_function.name=score", r"custom_reward_function.name='score': does nothing"),
    (f"{A}ppo_micro_batch_size=64", r"deprecated in verl.*ppo_micro_batch_size_per_gpu"),
    ("actor_rollout_ref.actor.nope=1", r"unknown config key 'actor_rollout_ref.actor.nope'"),
    ("~trainer.logger", r"~key \(delete\)"),
])
def test_refused_by_name_with_the_reason(cli, match):
    with pytest.raises(ConfigError, match=match):
        to_ours(parse_cli(shlex.split(cli)))


def test_the_fully_async_partial_rollout_switch_maps_and_needs_a_lag_of_two():
    # verl's fully-async recipe: its partial-rollout switch is ours; alone (no lag of 2 or
    # more) the run is refused, naming why
    from tests.presets import tiny_run

    got = to_ours(parse_cli(shlex.split("+async_training.partial_rollout=True")))
    assert got == {"rollout.partial_rollout": True}
    with pytest.raises(ConfigError, match=r"rollout.partial_rollout=True: needs "
                                          r"rollout.max_staleness >= 2 \(it is 0\)"):
        tiny_run(**got)
    assert tiny_run(**got, **{"rollout.max_staleness": 2, "algorithm.rollout_is": "token"})


def test_verl_default_value_is_accepted_on_the_command_line():
    assert to_ours({"actor_rollout_ref.rollout.multi_turn.interaction_config_path": None}) == {}


def test_verl_interaction_config_path_maps_onto_the_rollout():
    got = to_ours(parse_cli(shlex.split(
        "actor_rollout_ref.rollout.multi_turn.enable=True "
        "actor_rollout_ref.rollout.multi_turn.interaction_config_path=/i.yaml")))
    assert got == {"rollout.multi_turn": True, "rollout.interaction_config_path": "/i.yaml"}


def test_verl_multi_turn_keys_map_onto_the_rollout():
    m = "actor_rollout_ref.rollout.multi_turn."
    got = to_ours(parse_cli(shlex.split(
        f"{m}enable=True {m}tool_config_path=/t.yaml {m}max_assistant_turns=null "
        f"{m}max_user_turns=3 {m}max_parallel_calls=2 {m}max_tool_response_length=64 "
        f"{m}tool_response_truncate_side=left {m}format=hermes "
        f"{m}tokenization_sanity_check_mode=disable data.tool_config_path=/t.yaml")))
    assert got == {"rollout.multi_turn": True, "rollout.tool_config_path": "/t.yaml",
                   "rollout.max_assistant_turns": 0, "rollout.max_user_turns": 3,
                   "rollout.max_parallel_calls": 2, "rollout.max_tool_response_length": 64,
                   "rollout.tool_response_truncate_side": "left"}


def test_verl_key_and_ours_for_one_field_must_agree():
    with pytest.raises(ConfigError, match=r"optim.lr=0.001 and actor_rollout_ref.actor.optim.lr="
                                          r"1e-06 both set optim.lr"):
        to_ours({"optim.lr": 1e-3, f"{A}optim.lr": 1e-6})
    assert to_ours({"optim.lr": 1e-6, f"{A}optim.lr": 1e-6}) == {"optim.lr": 1e-6}


def test_every_table_key_is_a_verl_key():
    defaults = verl_defaults()
    assert set(VERL_TO_OURS) | set(NO_EFFECT) <= set(defaults) | READ_WITH_GET


def test_verl_default_yaml_changes_nothing():
    # the vendored _generated_ppo_trainer.yaml: hundreds of keys, all at verl's default
    flat = load_yaml(DEFAULTS_FILE)
    assert len(flat) > 400
    assert to_ours(flat, from_file=DEFAULTS_FILE) == {}


SMALL_YAML = textwrap.dedent("""\
    actor_rollout_ref:
      actor:
        optim: {lr: 2e-6}          # no dot: a float for OmegaConf, and here
        ppo_mini_batch_size: 16
        ppo_micro_batch_size_per_gpu: 64
        use_kl_loss: true
      rollout: {n: 4, tensor_model_parallel_size: 2}   # 2 is verl's default: skipped
    algorithm:
      kl_ctrl: {kl_coef: 0.002}
    data: {max_response_length: 12, max_prompt_length: 512}  # 512: verl's default, skipped
    trainer: {test_freq: 5, project_name: demo, logger: [console]}
""")


def test_small_verl_yaml_loads_and_the_command_line_wins(tmp_path):
    path = tmp_path / "verl.yaml"
    path.write_text(SMALL_YAML)
    over = overrides_from(str(path), {"trainer.test_freq": 2})
    assert over == {"optim.lr": 2e-6, "actor.ppo_mini_batch_size": 16,
                    "actor.ppo_micro_batch_size": 64,
                    "algorithm.use_kl_loss": True, "rollout.n": 4, "algorithm.kl_coef": 0.002,
                    "rollout.max_new_tokens": 12, "eval_every": 2}
    path.write_text(SMALL_YAML.replace("logger: [console]", "logger: [wandb]"))
    assert overrides_from(str(path))["tracking.wandb_project"] == "demo"  # trainer.project_name
    path.write_text(SMALL_YAML.replace("logger: [console]", "logger: [swanlab]"))
    with pytest.raises(ConfigError, match=r"trainer.logger=\['swanlab'\]: \['swanlab'\] not "):
        overrides_from(str(path))
    path.write_text("defaults:\n  - actor@actor_rollout_ref.actor: dp_actor\n")
    with pytest.raises(ConfigError, match=r"Hydra cannot compose its defaults list \(In "
                                          r"'primary': Could not find 'actor/dp_actor'\).*"
                                          "_generated_ppo_trainer.yaml"):
        overrides_from(str(path))
    with pytest.raises(ConfigError, match="cannot read it"):
        overrides_from(str(tmp_path / "missing.yaml"))


def test_workflow_options_take_verl_keys_and_the_yaml(tmp_path):
    from tasks.prepare import build_config

    path = tmp_path / "verl.yaml"
    path.write_text(SMALL_YAML)
    cfg = build_config("grpo", "", "", "", 0, 0, 0, json.dumps({"trainer.save_freq": 3}),
                       str(path))
    assert (cfg.optim.lr, cfg.rollout.n, cfg.eval_every, cfg.checkpoint.checkpoint_interval) == \
        (2e-6, 4, 5, 3)


# --------------------------------------------------------------- done when: a verl example runs
# The overrides of verl's examples/grpo_trainer/run_qwen2-7b.sh, in its order. Changed beyond
# paths, for a 2-core CPU and this project (docs/verl-keys.md): sizes shrunk (train_batch_size
# 1024 -> 4, max_prompt_length 512 -> 64, max_response_length 1024 -> 8, ppo_mini_batch_size
# 256 -> 2, ppo_micro_batch_size_per_gpu 40 -> 10, n_gpus_per_node 8 -> 1); the vLLM-only keys
# tensor_model_parallel_size 2 -> 1 (refused otherwise) and rollout.name vllm -> hf (a GPU engine);
# trainer.logger drops wandb (it needs a login); trainer.total_training_steps=2 added (total_epochs=15 is
# kept: verl lets total_training_steps replace it).
VERL_EXAMPLE = """
    algorithm.adv_estimator=grpo
    data.train_files={train}
    data.val_files={val}
    data.train_batch_size=4
    data.max_prompt_length=64
    data.max_response_length=8
    data.filter_overlong_prompts=True
    data.truncation='error'
    actor_rollout_ref.model.path={model}
    actor_rollout_ref.actor.optim.lr=1e-6
    actor_rollout_ref.model.use_remove_padding=True
    actor_rollout_ref.actor.ppo_mini_batch_size=2
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=10
    actor_rollout_ref.actor.use_kl_loss=True
    actor_rollout_ref.actor.kl_loss_coef=0.001
    actor_rollout_ref.actor.kl_loss_type=low_var_kl
    actor_rollout_ref.actor.entropy_coeff=0
    actor_rollout_ref.model.enable_gradient_checkpointing=True
    actor_rollout_ref.actor.fsdp_config.param_offload=False
    actor_rollout_ref.actor.fsdp_config.optimizer_offload=False
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=40
    actor_rollout_ref.rollout.tensor_model_parallel_size=1
    actor_rollout_ref.rollout.name=hf
    actor_rollout_ref.rollout.gpu_memory_utilization=0.6
    actor_rollout_ref.rollout.n=5
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=40
    actor_rollout_ref.ref.fsdp_config.param_offload=True
    algorithm.use_kl_in_reward=False
    trainer.critic_warmup=0
    trainer.logger='["console"]'
    trainer.project_name='verl_grpo_example_gsm8k'
    trainer.experiment_name='qwen2_7b_function_rm'
    trainer.n_gpus_per_node=1
    trainer.nnodes=1
    trainer.save_freq=20
    trainer.test_freq=5
    trainer.total_epochs=15
    trainer.total_training_steps=2
"""


@pytest.fixture(scope="module")
def verl_example(tmp_path_factory):
    """The example's overrides (shell-split, as bash hands them to verl) with local files: a
    saved tiny model and the synthetic arithmetic parquet."""
    from verl_core.data.synthetic import write_arithmetic_dataset
    from verl_core.models.tiny import build_tiny_model

    root = tmp_path_factory.mktemp("verl-example")
    train, val = write_arithmetic_dataset(str(root / "data"), train_size=40, val_size=8,
                                          max_operand=20, seed=0)
    model, tok = build_tiny_model()
    model.save_pretrained(root / "model", safe_serialization=True)
    tok.save_pretrained(root / "model")
    return shlex.split(VERL_EXAMPLE.format(train=train, val=val, model=root / "model"))


def test_verl_example_translates(verl_example):
    from verl_core.verl_keys import run_config

    # total_epochs=15 x (40 rows // 4) = 150 steps, capped by total_training_steps=2
    cfg = run_config("", "", parse_cli(verl_example))
    assert (cfg.total_steps, cfg.rollout.n, cfg.actor.ppo_micro_batch_size, cfg.optim.lr,
            cfg.eval_every, cfg.model.gradient_checkpointing) == (2, 5, 10, 1e-6, 5, True)


@pytest.mark.slow
def test_verl_example_runs_two_steps_in_the_plain_loop(verl_example, tmp_path):
    from verl_core.train import main

    out = tmp_path / "summary.json"
    assert main([*verl_example, "--workdir", str(tmp_path / "run"),
                 "--summary-json", str(out)]) == 0
    summary = json.loads(out.read_text())
    assert [h["step"] for h in summary["history"]] == [1, 2]


@pytest.mark.slow
def test_verl_example_runs_two_steps_through_pyflyte(verl_example, tmp_path):
    import pandas as pd

    from tests.workflows.conftest import PYFLYTE, flyte_env, run

    overrides = json.dumps(parse_cli(verl_example))  # verl keys as they are
    res = run([PYFLYTE, "run", "workflows/ppo.py", "ppo", "--store", str(tmp_path / "store"),
               "--run-name", "verl", "--overrides", overrides], flyte_env(tmp_path))
    line = [ln for ln in res.stdout.splitlines() if ln.startswith("Summary(")][-1]
    table = pd.read_parquet(line.split("metrics_table='", 1)[1].split("'", 1)[0])
    assert table["step"].tolist() == [0, 1, 2]


# both entry points' keys (the plain loop's --set, the workflow's --overrides) go through
# run_config: a typo is answered with the nearest key of the same family, ours or verl's
@pytest.mark.parametrize("key,near", [
    ("optim.learning_rate", "optim.lr"),
    (f"{A}optim.lrr", f"{A}optim.lr"),
    (f"{A}optim.learning_rate", f"{A}optim.lr"),  # not ...optim.min_lr_ratio, nearer as a string
    ("actor_rollout_ref.rollout.temprature", "actor_rollout_ref.rollout.temperature"),
    ("trainer.totl_epochs", "trainer.total_epochs"),
])
def test_an_unknown_key_names_the_near_one_ours_or_verls(key, near):
    with pytest.raises(ConfigError) as e:
        run_config(overrides={key: 1e-4})
    msg = str(e.value)
    assert msg == (f"unknown config key '{key}': neither ours (docs/options.md) nor verl's at "
                   "the commit the defaults come from (verl_core/verl_defaults/ppo_trainer.yaml):"
                   f" a typo, or a key of a newer verl; did you mean {near}?")


def test_an_unknown_key_with_nothing_near_gets_no_guess():
    for key in ("zzz.qqq", f"{A}nope"):  # nope: no field of verl's actor is near it
        with pytest.raises(ConfigError, match=rf"key '{key}': neither ours .*a key of a newer verl$"):
            run_config(overrides={key: 1})


def test_set_values_are_read_as_verl_overrides_are():
    """``--set model.gradient_checkpointing=false`` (YAML's spelling, what a verl user types) is
    False, as ``actor_rollout_ref.model.enable_gradient_checkpointing=false`` is; numbers, lists
    and Python's spellings keep working, and anything else stays text."""
    from verl_core.train import _parse_value

    assert [_parse_value(t) for t in ("false", "True", "TRUE", "null", "1e-4", "8", "[1, 2]",
                                      "[a,b]", "$HOME/x.parquet")] == \
        [False, True, True, None, 1e-4, 8, [1, 2], ["a", "b"], "$HOME/x.parquet"]
    cfg = with_overrides(RunConfig(), {"model.gradient_checkpointing": _parse_value("false")})
    assert cfg.model.gradient_checkpointing is False
    # YAML 1.1's other booleans are text, as in Hydra's grammar: validation.mode=off is "off"
    assert [_parse_value(t) for t in ("off", "on", "yes", "No")] == ["off", "on", "yes", "No"]
    assert with_overrides(RunConfig(), {"validation.mode": _parse_value("off")}).validation.mode \
        == "off"


def test_warmup_ratio_and_save_freq_minus_one_follow_the_run_length():
    # verl: int(ratio x total training steps) warmup RL steps; save_freq=-1 (never save) is the
    # last step only here, said in the run header
    cfg = run_config("grpo", "", parse_cli([f"{A}optim.lr_warmup_steps_ratio=0.3",
                                            "critic.optim.lr_warmup_steps_ratio=0.5",
                                            "trainer.total_training_steps=7",
                                            "trainer.save_freq=-1"]))
    assert (cfg.total_steps, cfg.optim.warmup_steps, cfg.optim.critic_warmup_steps,
            cfg.optim.lr_schedule_unit, cfg.checkpoint.checkpoint_interval,
            cfg.checkpoint.last_step_only) == (7, 2, 3, "rl_step", 7, True)
    assert [s for s in range(1, 8) if cfg.checkpoint.due(s, 7)] == [7]
    assert "the last step only" in schedule_line(cfg) and "save_freq=-1" in schedule_line(cfg)
    # the header line is for that choice only: a short run with the default interval has none
    assert schedule_line(run_config("grpo", "", {"trainer.total_training_steps": 7,
                                                 "trainer.save_freq": 10})) == ""


def test_engine_knobs_map_onto_the_rollout_and_a_short_context_is_refused():
    over = to_ours({f"{R}max_num_seqs": 64, f"{R}max_model_len": 4096,
                    f"{R}enable_chunked_prefill": False})
    assert over == {"rollout.max_num_seqs": 64, "rollout.max_model_len": 4096,
                    "rollout.enable_chunked_prefill": False}
    cfg = with_overrides(preset("grpo"), over)
    assert (cfg.rollout.max_num_seqs, cfg.rollout.max_model_len) == (64, 4096)
    need = cfg.data.max_prompt_length + cfg.rollout.max_new_tokens
    with pytest.raises(ConfigError, match=rf"rollout.max_model_len={need - 1}: is shorter than "
                                          rf"data.max_prompt_length \+ rollout.max_new_tokens"):
        with_overrides(preset("grpo"), {"rollout.max_model_len": need - 1})


@pytest.mark.parametrize("key", sorted(SPEED_ONLY))
def test_speed_only_keys_change_nothing_and_a_wrong_value_says_why(key):
    ok, why = SPEED_ONLY[key]
    value = next(v for v in (True, 2, -1, "safetensors", None) if ok(v))
    assert to_ours({key: value}) == {}
    assert "speed or memory only" in why or "vLLM" in why
    with pytest.raises(ConfigError, match=re.escape(f"{key}={{}}".format("{'bad': 1}")) +
                       " cannot apply here: "):
        to_ours({key: {"bad": 1}})


def test_every_verl_key_refused_at_another_value_says_why():
    # each of verl's keys, given a value that is not verl's default: refused naming the key with
    # a reason after it (multi-GPU, not built yet, no meaning here, what to give), never as an
    # unknown key
    for key, default in verl_defaults().items():
        if key.endswith("_target_"):
            continue
        value = {"verl-test": 1} if not isinstance(default, dict) else 7
        try:
            to_ours({key: value})
        except ConfigError as e:
            msg = str(e)
            assert key in msg and "unknown config key" not in msg, msg
            assert re.search(r"(: |not built here yet).{20,}", msg.split(key, 1)[1]), msg


VERL_CONFIGS = os.path.join(os.path.dirname(__file__), "data", "verl_configs")


def test_verl_example_configs_compose_with_hydra():
    # verl's own example configs (defaults: [ppo_trainer, _self_]), vendored as test data: Hydra
    # composes them against verl's generated defaults, and only what they change applies
    multi = load_yaml(os.path.join(VERL_CONFIGS, "gsm8k_multiturn_grpo.yaml"))
    assert len(multi) > 500 and multi[f"{R}multi_turn.max_assistant_turns"] == 5
    over = to_ours({k: v for k, v in multi.items() if k != f"{R}name"}, from_file="x.yaml")
    assert over == {"rollout.multi_turn": True, "rollout.max_assistant_turns": 5,
                    "data.max_prompt_length": 1024, "rollout.max_new_tokens": 1024,
                    "data.train_batch_size": 256}
    # its rollout engine is SGLang: refused as GPU-only, by name
    with pytest.raises(ConfigError, match="rollout.name='sglang': SGLang serves rollouts on CUDA"):
        to_ours(multi, from_file="x.yaml")
    dapo = load_yaml(os.path.join(VERL_CONFIGS, "dapo_trainer.yaml"))
    # data.gen_batch_size: ${data.train_batch_size}, resolved in the composed config, after the
    # command line's keys, as verl resolves it
    assert dapo["data.gen_batch_size"] == verl_defaults()["data.train_batch_size"]
    over = overrides_from(os.path.join(VERL_CONFIGS, "dapo_trainer.yaml"),
                          {"data.train_batch_size": 8})
    assert (over["data.gen_batch_size"], over["data.train_batch_size"]) == (8, 8)
    assert to_ours(dapo, from_file="dapo.yaml")["reward.overlong_buffer_enable"] is False


def test_hydra_config_path_and_name_on_the_command_line(tmp_path, capsys):
    from verl_core.train import main

    (tmp_path / "mine.yaml").write_text(textwrap.dedent("""\
        hydra:
          searchpath:
            - file://verl/trainer/config
        defaults:
          - ppo_trainer
          - extra
          - _self_
        actor_rollout_ref:
          rollout:
            n: 3
            response_length: ${data.max_response_length}
        data:
          max_response_length: 7
        """))
    (tmp_path / "extra.yaml").write_text("trainer:\n  test_freq: 4\n")  # found next to it
    over = overrides_from(str(tmp_path / "mine.yaml"), {})
    assert (over["rollout.n"], over["rollout.max_new_tokens"], over["eval_every"]) == (3, 7, 4)
    (tmp_path / "bad.yaml").write_text("defaults:\n  - nowhere\n  - _self_\n")
    with pytest.raises(ConfigError, match=r"bad.yaml'.*Hydra cannot compose its defaults list"):
        load_yaml(str(tmp_path / "bad.yaml"))
    assert main(["--config-path", str(tmp_path), "--config-name", "bad"]) == 2
    assert "Hydra cannot compose" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # the pair, or --config
        main(["--config-name", "bad"])
    assert "give both" in capsys.readouterr().err


def test_verl_agent_loop_keys_map_onto_the_rollout():
    a = "actor_rollout_ref.rollout.agent."
    got = to_ours(parse_cli(shlex.split(
        f"{a}default_agent_loop=my_agent {a}agent_loop_config_path=/loops.yaml "
        f"{a}num_workers=4")))
    assert got == {"rollout.agent_loop": "my_agent",
                   "rollout.agent_loop_config_path": "/loops.yaml"}
    # verl's two built-in names keep the loop following multi_turn.enable (as before)
    for name in ("single_turn_agent", "tool_agent"):
        assert to_ours(parse_cli([f"{a}default_agent_loop={name}"])) == {}
    got = to_ours(parse_cli([f"{a}default_agent_loop=loops/my.py:MyLoop"]))
    assert got == {"rollout.agent_loop": "loops/my.py:MyLoop"}
