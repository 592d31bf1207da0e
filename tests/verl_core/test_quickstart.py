"""verl's quickstart PPO command (verl docs, start/quickstart.rst) as it is, on an offline
Qwen2.5-style stand-in and verl-layout GSM8K rows (tests/standins.py).

Changed for a 2-core CPU, sizes and paths only: train_batch_size 256 -> 8, max_prompt_length
512 -> 256, max_response_length 512 -> 16, ppo_mini_batch_size 64 -> 4, total_epochs 15 -> 1
(16 training rows // 8 = 2 steps, verl's arithmetic), and rollout.name vllm -> hf (vLLM runs from
.venv-vllm). Nothing is added: the command names no adv_estimator, so verl's default gae (PPO
with a critic) trains, as in verl.
"""
import json
import shlex

import pytest

from tests.standins import gsm8k_parquet, qwen_folder
from verl_core.config import ConfigError
from verl_core.verl_keys import parse_cli, run_config

QUICKSTART = """
    data.train_files={train}
    data.val_files={test}
    data.train_batch_size=8
    data.max_prompt_length=256
    data.max_response_length=16
    actor_rollout_ref.model.path={model}
    actor_rollout_ref.actor.optim.lr=1e-6
    actor_rollout_ref.actor.ppo_mini_batch_size=4
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4
    actor_rollout_ref.rollout.name=hf
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8
    actor_rollout_ref.rollout.tensor_model_parallel_size=1
    actor_rollout_ref.rollout.gpu_memory_utilization=0.4
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4
    critic.optim.lr=1e-5
    critic.model.path={model}
    critic.ppo_micro_batch_size_per_gpu=4
    algorithm.kl_ctrl.kl_coef=0.001
    trainer.logger=console
    trainer.val_before_train=False
    trainer.n_gpus_per_node=1
    trainer.nnodes=1
    trainer.save_freq=10
    trainer.test_freq=10
    trainer.total_epochs=1
"""


@pytest.fixture(scope="module")
def quickstart(tmp_path_factory):
    root = tmp_path_factory.mktemp("quickstart")
    model = qwen_folder(root / "Qwen2.5-0.5B-Instruct")
    train = gsm8k_parquet(root / "gsm8k" / "train.parquet", 16)
    test = gsm8k_parquet(root / "gsm8k" / "test.parquet", 8, split="test", seed=1)
    return shlex.split(QUICKSTART.format(train=train, test=test, model=model))


def test_quickstart_translates_with_verl_defaults(quickstart):
    from tasks.prepare import build_config

    cfg = run_config("", "", parse_cli(quickstart))
    assert cfg.algorithm.adv_estimator == "gae" and cfg.algorithm.uses_critic  # verl's default
    assert (cfg.total_steps, cfg.val_before_train, cfg.optim.lr, cfg.optim.critic_lr,
            cfg.actor.ppo_micro_batch_size, cfg.rollout.max_new_tokens) == \
        (2, False, 1e-6, 1e-5, 4, 16)  # 1 epoch x (16 rows // 8 prompts)
    # the workflow's front door builds the same config from the same keys
    assert build_config("", "", "", "", 0, 0, 0, json.dumps(parse_cli(quickstart))) == cfg
    # an explicit estimator wins over verl's default; our own keys alone keep our grpo
    assert run_config("grpo", "", parse_cli(quickstart)).algorithm.adv_estimator == "grpo"
    assert run_config("", "", {"data.train_batch_size": 64}).algorithm.adv_estimator == "grpo"


def test_every_refused_key_of_a_command_is_named_in_one_error(quickstart):
    bad = [*quickstart, "critic.model.lora_rank=32",
           "actor_rollout_ref.rollout.multi_turn.num_repeat_rollouts=2",
           "actor_rollout_ref.model.trust_remote_code=True",
           "critic.model.path=/elsewhere"]
    with pytest.raises(ConfigError) as e:
        run_config("", "", parse_cli(bad))
    msg = str(e.value)
    assert msg.startswith("4 config keys cannot apply:")
    for reason in ("critic.model.lora_rank=32 cannot apply here: LoRA on the critic is not offered",
                   "num_repeat_rollouts=2 cannot apply here: not offered",
                   "trust_remote_code=True cannot apply here: a model folder's own Python code",
                   "critic.model.path='/elsewhere': the critic starts from the actor's model"):
        assert reason in msg


@pytest.mark.slow  # ~15 s per step on the busy 2-core VM (a critic, gradient checkpointing)
def test_quickstart_runs_two_steps_in_the_plain_loop(quickstart, tmp_path, capsys):
    from verl_core.train import main

    out = tmp_path / "summary.json"
    assert main([*quickstart, "--workdir", str(tmp_path / "run"),
                 "--summary-json", str(out)]) == 0
    summary = json.loads(out.read_text())
    assert summary["algorithm"] == "gae" and summary["start_accuracy"] is None
    history = summary["history"]
    assert [h["step"] for h in history] == [1, 2]
    assert all("critic/vf_loss" in h for h in history)
    printed = capsys.readouterr().out
    assert "step 0:" not in printed  # val_before_train=False: no evaluation before step 1
    assert "[verl] config: " in printed and "optim.critic_lr=1e-05" in printed
    # verl's metric: the share of responses cut at 16 tokens; a step above half warns
    for h in history:
        ratio = h["response_length/clip_ratio"]
        assert 0.0 <= ratio <= 1.0
        assert (f"warning: step {h['step']}: " in printed) == (ratio > 0.5)


@pytest.mark.slow
def test_quickstart_runs_two_steps_through_pyflyte(quickstart, tmp_path):
    import pandas as pd

    from tests.workflows.conftest import PYFLYTE, flyte_env, run

    cmd = [PYFLYTE, "run", "workflows/ppo.py", "ppo", "--store", str(tmp_path / "store"),
           "--run-name", "quickstart", "--overrides", json.dumps(parse_cli(quickstart))]
    res = run(cmd, flyte_env(tmp_path))
    line = [ln for ln in res.stdout.splitlines() if ln.startswith("Summary(")][-1]
    table = pd.read_parquet(line.split("metrics_table='", 1)[1].split("'", 1)[0])
    # val_before_train=False: no evaluation of step 0 ran (none printed, none recorded), and the
    # summary says the gain was not measured instead of inventing one
    assert table["step"].tolist() == [1, 2]
    assert "[verl] eval after 0 steps" not in res.stdout
    assert "[verl] eval after 2 steps" in res.stdout
    assert "start_accuracy=None" in line
    assert "(no evaluation before training)" in res.stdout
    assert "critic/vf_loss" in table.columns
    # the same command again: every phase is a cache hit (no phase prints), the same summary
    again = run(cmd, flyte_env(tmp_path))
    assert [ln for ln in again.stdout.splitlines() if ln.startswith("Summary(")][-1] == line
    assert "[verl] eval after" not in again.stdout and "[verl] done:" not in again.stdout
