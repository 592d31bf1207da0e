import pytest

from verl_core.config import (AlgorithmConfig, ConfigError, DataConfig, OptimConfig, RunConfig,
                              TrainerConfig, preset, with_overrides)


def test_defaults_are_valid_and_derived_values():
    cfg = RunConfig()
    # 16 prompts x 8 samples = 128 rows per mini-batch, micro 128 -> 1 accumulation step
    assert cfg.grad_accum_steps == 1
    # 32 prompts / 16 per mini-batch = 2 optimizer steps per RL step
    assert cfg.optimizer_steps_per_rl_step == 2
    assert cfg.total_optimizer_steps == 2 * cfg.total_steps


def test_mini_batch_must_divide_batch():
    with pytest.raises(ConfigError, match=r"trainer.ppo_mini_batch_size=12.*train_batch_size=32"):
        RunConfig(trainer=TrainerConfig(ppo_mini_batch_size=12))


def test_micro_batch_larger_than_mini_batch_is_zero_accumulation():
    with pytest.raises(ConfigError, match="zero gradient-accumulation steps"):
        RunConfig(trainer=TrainerConfig(ppo_mini_batch_size=4, ppo_micro_batch_size=64))


@pytest.mark.parametrize("lr", [0.0, -1e-4])
def test_learning_rate_must_be_positive(lr):
    with pytest.raises(ConfigError, match=r"optim.lr=.*must be > 0"):
        OptimConfig(lr=lr)


def test_unknown_algorithm_lists_known_ones():
    with pytest.raises(ConfigError, match=r"adv_estimator='grpoo'.*grpo.*rloo"):
        AlgorithmConfig(adv_estimator="grpoo")
    with pytest.raises(ConfigError, match="known: ppo, gae, grpo"):
        preset("nope")


def test_group_estimators_need_several_samples():
    with pytest.raises(ConfigError, match="rollout.n"):
        with_overrides(RunConfig(), {"rollout.n": 1, "trainer.ppo_micro_batch_size": 16})


def test_overrides_and_round_trip():
    cfg = with_overrides(preset("ppo"), {"optim.lr": 1e-4, "total_steps": 3})
    assert cfg.optim.lr == 1e-4 and cfg.algorithm.adv_estimator == "gae"
    assert RunConfig.from_dict(cfg.to_dict()) == cfg
    assert cfg.config_hash() == RunConfig.from_dict(cfg.to_dict()).config_hash()
    assert cfg.config_hash() != preset("ppo").config_hash()
    with pytest.raises(ConfigError, match="unknown config key 'optim.lrr'"):
        with_overrides(cfg, {"optim.lrr": 1.0})


def test_synthetic_sizes_checked_against_unique_problems():
    with pytest.raises(ConfigError, match="unique problems"):
        DataConfig(synthetic_max_operand=5, synthetic_train_size=100)
