"""verl's DAPO recipe (recipe/dapo/run_dapo_qwen2.5_32b.sh, verl before the recipes moved to
verl-recipe) through verl_core.verl_keys and the plain loop, scaled down to the tiny model.

Its overrides as they are, but for sizes (prompts 512 -> 4, gen 3x -> 12, n 16 -> 4, mini-batch
32 -> 2, response 20480 -> 10 tokens with the buffer 4096 -> 2, prompt 2048 -> 64, token budgets
prompt + response), one worker (sp_size, gen_tp, n_gpus_per_node, nnodes -> 1),
``rollout.name=hf``, ``logger=["console"]``, and ``trainer.total_training_steps=2`` added;
``trainer.default_local_dir`` is the test's folder (the plain loop's run store). Left out (each
refused here, with its reason): the dataset and model paths (the synthetic task and the tiny
model; ``custom_reward_function.path`` added: a reward that gives the tiny model mixed groups,
where DAPO's math scorer would give all-wrong ones)."""
import json
import shlex
import textwrap

import pytest

from verl_core.train import main
from verl_core.verl_keys import parse_cli, run_config

RECIPE = """
    data.prompt_key=prompt
    data.truncation='left'
    data.max_prompt_length=64
    data.max_response_length=10
    data.gen_batch_size=12
    data.train_batch_size=4
    actor_rollout_ref.rollout.n=4
    algorithm.adv_estimator=grpo
    algorithm.use_kl_in_reward=False
    algorithm.kl_ctrl.kl_coef=0.0
    actor_rollout_ref.actor.use_kl_loss=False
    actor_rollout_ref.actor.kl_loss_coef=0.0
    actor_rollout_ref.actor.clip_ratio_low=0.2
    actor_rollout_ref.actor.clip_ratio_high=0.28
    actor_rollout_ref.actor.clip_ratio_c=10.0
    algorithm.filter_groups.enable=True
    algorithm.filter_groups.max_num_gen_batches=10
    algorithm.filter_groups.metric=acc
    actor_rollout_ref.model.use_remove_padding=True
    actor_rollout_ref.actor.use_dynamic_bsz=True
    actor_rollout_ref.ref.log_prob_use_dynamic_bsz=True
    actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=True
    actor_rollout_ref.actor.ppo_max_token_len_per_gpu=74
    actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=74
    actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=74
    actor_rollout_ref.model.enable_gradient_checkpointing=True
    actor_rollout_ref.actor.optim.lr=1e-6
    actor_rollout_ref.actor.optim.lr_warmup_steps=10
    actor_rollout_ref.actor.optim.weight_decay=0.1
    actor_rollout_ref.actor.ppo_mini_batch_size=2
    actor_rollout_ref.actor.fsdp_config.param_offload=True
    actor_rollout_ref.actor.fsdp_config.optimizer_offload=True
    actor_rollout_ref.actor.entropy_coeff=0
    actor_rollout_ref.actor.grad_clip=1.0
    actor_rollout_ref.actor.loss_agg_mode=token-mean
    actor_rollout_ref.actor.ulysses_sequence_parallel_size=1
    actor_rollout_ref.rollout.gpu_memory_utilization=0.80
    actor_rollout_ref.rollout.tensor_model_parallel_size=1
    actor_rollout_ref.rollout.enable_chunked_prefill=True
    actor_rollout_ref.rollout.max_num_batched_tokens=74
    actor_rollout_ref.rollout.temperature=1.0
    actor_rollout_ref.rollout.top_p=1.0
    actor_rollout_ref.rollout.top_k=-1
    actor_rollout_ref.rollout.val_kwargs.temperature=1.0
    actor_rollout_ref.rollout.val_kwargs.top_p=0.7
    actor_rollout_ref.rollout.val_kwargs.top_k=-1
    actor_rollout_ref.rollout.val_kwargs.do_sample=True
    actor_rollout_ref.rollout.val_kwargs.n=1
    actor_rollout_ref.rollout.name=hf
    actor_rollout_ref.ref.fsdp_config.param_offload=True
    actor_rollout_ref.ref.ulysses_sequence_parallel_size=1
    actor_rollout_ref.actor.fsdp_config.fsdp_size=-1
    reward_model.reward_manager=dapo
    reward_model.overlong_buffer.enable=True
    reward_model.overlong_buffer.len=2
    reward_model.overlong_buffer.penalty_factor=1.0
    trainer.logger='["console"]'
    trainer.project_name=DAPO
    trainer.experiment_name=DAPO-tiny
    trainer.n_gpus_per_node=1
    trainer.nnodes=1
    trainer.val_before_train=True
    trainer.test_freq=5
    trainer.save_freq=5
    trainer.total_epochs=1
    trainer.resume_mode=auto
    trainer.total_training_steps=2
"""

PARITY = textwrap.dedent('''
    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        return float(len(solution_str) % 2)
''')

# what a tiny run needs to be quick on a 2-core CPU (ours: not verl's keys)
TINY = ["--set", "model.warmup_sft_steps=5", "--set", "model.warmup_target_accuracy=1.0",
        "--set", "data.synthetic_train_size=96", "--set", "data.synthetic_val_size=8",
        "--set", "num_threads=1"]


def test_the_recipe_overrides_map_onto_our_fields():
    cfg = run_config(overrides=parse_cli(shlex.split(RECIPE)))
    a, d, r = cfg.algorithm, cfg.data, cfg.reward
    assert (a.adv_estimator, a.filter_groups_enable, a.filter_groups_metric,
            a.max_num_gen_batches) == ("grpo", True, "acc", 10)
    assert (d.train_batch_size, d.gen_batch_size, cfg.rollout.n) == (4, 12, 4)
    assert (r.overlong_buffer_enable, r.overlong_buffer_len, r.overlong_penalty_factor) == \
        (True, 2, 1.0)
    assert cfg.rollout.max_new_tokens == 10
    assert (a.clip_ratio_low, a.clip_ratio_high, a.clip_ratio_c, a.loss_agg_mode) == \
        (0.2, 0.28, 10.0, "token-mean")
    assert not a.use_kl_loss and not a.use_kl_in_reward and not a.uses_reference
    assert cfg.actor.use_dynamic_bsz and cfg.actor.ppo_max_token_len_per_gpu == 74
    assert cfg.total_steps == 2
    assert d.truncation == "left"
    rc = cfg.rollout
    assert (rc.val_do_sample, rc.val_temperature, rc.val_top_p, rc.val_top_k, rc.val_n) == \
        (True, 1.0, 0.7, -1, 1)


def _two_steps(tmp_path, recipe: str = RECIPE) -> dict:
    scorer = tmp_path / "parity.py"
    scorer.write_text(PARITY)
    out = tmp_path / "summary.json"
    rc = main(["--summary-json", str(out), *TINY, *shlex.split(recipe),
               f"trainer.default_local_dir={tmp_path / 'w'}",
               f"custom_reward_function.path={scorer}"])
    assert rc == 0
    return json.loads(out.read_text())


def test_the_recipe_trains_two_steps_of_the_tiny_model(tmp_path):
    s = _two_steps(tmp_path)
    assert s["algorithm"] == "grpo" and [h["step"] for h in s["history"]] == [1, 2]
    assert (tmp_path / "w" / "checkpoints").is_dir()  # default_local_dir is the run store
    for h in s["history"]:
        assert h["train/num_gen_batches"] >= 1 and h["train/num_kept_groups"] >= 4
        assert -1.0 <= h["reward/min"] and h["reward/max"] <= 1.0  # the penalty is >= -1
        assert all(v == v for v in h.values() if isinstance(v, float))  # no NaN metrics


def test_default_local_dir_and_another_workdir_are_refused_before_any_work(tmp_path, capsys):
    rc = main(["--workdir", str(tmp_path / "a"), f"trainer.default_local_dir={tmp_path / 'b'}"])
    assert rc == 2 and "both name the run store" in capsys.readouterr().err
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


@pytest.mark.vllm
@pytest.mark.slow
def test_the_recipe_samples_on_vllm_as_it_names_it(tmp_path):
    """The recipe's own ``rollout.name=vllm`` (vLLM's CPU backend in .venv-vllm, or CUDA): the
    generation batches of dynamic sampling and the sampled evaluation (top-p 0.7) on vLLM."""
    s = _two_steps(tmp_path, RECIPE.replace("rollout.name=hf", "rollout.name=vllm"))
    assert [h["step"] for h in s["history"]] == [1, 2]
    for h in s["history"]:
        assert h["train/num_gen_batches"] >= 1 and h["train/num_kept_groups"] >= 4
        assert 0.0 <= h["training/rollout_probs_diff_max"] <= 1e-4, h  # test_train_loop's bar
