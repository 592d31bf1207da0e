import dataclasses
import subprocess
import sys
import typing

import numpy as np
import pytest

from verl_core.config import (SECTIONS, TRAJECTORY, AlgorithmConfig, ConfigError,
                              DataConfig, OptimConfig, ActorConfig, RunConfig, preset,
                              typed_overrides, with_overrides)


def test_defaults_are_valid_and_derived_values():
    cfg = RunConfig()
    # 32 prompts x 8 samples = 256 rows per mini-batch, micro 128 -> 2 accumulation steps
    assert cfg.grad_accum_steps == 2
    # 64 prompts / 32 per mini-batch = 2 optimizer steps per RL step
    assert cfg.optimizer_steps_per_rl_step == 2
    assert cfg.total_optimizer_steps == 2 * cfg.total_steps


def test_mini_batch_must_divide_batch():
    with pytest.raises(ConfigError, match=r"actor.ppo_mini_batch_size=12.*train_batch_size=64"):
        RunConfig(actor=ActorConfig(ppo_mini_batch_size=12))


def test_micro_batch_larger_than_mini_batch_is_zero_accumulation():
    with pytest.raises(ConfigError, match="zero gradient-accumulation steps"):
        RunConfig(actor=ActorConfig(ppo_mini_batch_size=4, ppo_micro_batch_size=64))


@pytest.mark.parametrize("lr", [0.0, -1e-4])
def test_learning_rate_must_be_positive(lr):
    with pytest.raises(ConfigError, match=r"optim.lr=.*must be > 0"):
        OptimConfig(lr=lr)


def test_unknown_algorithm_lists_known_ones():
    with pytest.raises(ConfigError, match=r"adv_estimator='grpoo'.*grpo.*rloo"):
        AlgorithmConfig(adv_estimator="grpoo")
    with pytest.raises(ConfigError, match="known: ppo, gae, gdpo, gpg, grpo, .*, remax, rloo"):
        preset("nope")


@pytest.mark.parametrize("name", ["grpo", "grpo_vectorized", "rloo"])
def test_grpo_and_rloo_take_one_sample_as_verl_runs_them(name):
    # verl's functions give a group of one its raw score (GRPO: mean 0, std 1): REINFORCE with
    # no baseline, which verl's scripts with rollout.n=1 run
    cfg = with_overrides(RunConfig(), {"algorithm.adv_estimator": name, "rollout.n": 1,
                                       "actor.ppo_micro_batch_size": 16})
    assert cfg.rollout.n == 1


@pytest.mark.parametrize("name", ["grpo_passk", "opo", "gpg", "gdpo", "optimal_token_baseline",
                                  "tir_optimal_token_baseline", "rloo_vectorized"])
def test_every_group_estimator_needs_several_samples(name):
    # the rule reads the registry entry's needs_groups trait, not a list of names in config.py
    over = {"algorithm.adv_estimator": name, "rollout.n": 1, "actor.ppo_micro_batch_size": 16}
    with pytest.raises(ConfigError, match=f"rollout.n=1: algorithm.adv_estimator='{name}' "
                                          r"compares responses within a group \(a group of one gets advantage 0\); "
                                          "use rollout.n >= 2"):
        with_overrides(RunConfig(), over)


def test_remax_and_reinforce_plus_plus_run_with_one_sample():
    for name in ("remax", "reinforce_plus_plus"):
        cfg = with_overrides(RunConfig(), {"algorithm.adv_estimator": name, "rollout.n": 1,
                                           "actor.ppo_micro_batch_size": 16})
        assert cfg.rollout.n == 1 and not cfg.algorithm.uses_critic


def test_overrides_and_round_trip():
    cfg = with_overrides(preset("ppo"), {"optim.lr": 1e-4, "total_steps": 3})
    assert cfg.optim.lr == 1e-4 and cfg.algorithm.adv_estimator == "gae"
    assert RunConfig.from_dict(cfg.to_dict()) == cfg
    assert cfg.full_hash() == RunConfig.from_dict(cfg.to_dict()).full_hash()
    assert cfg.full_hash() != preset("ppo").full_hash()
    with pytest.raises(ConfigError, match="unknown config key 'optim.lrr'"):
        with_overrides(cfg, {"optim.lrr": 1.0})


@pytest.mark.parametrize("key,near", [
    ("optim.lrr", "optim.lr"),  # a typo: the nearest field of the section
    ("optim.learning_rate", "optim.lr"),  # Hugging Face Trainer's name for it
    ("rollout.temprature", "rollout.temperature"),
    ("optm.lr", "optim.lr"),  # a misspelled section
    ("seeed", "seed"),
])
def test_an_unknown_key_names_the_near_one(key, near):
    for call in (lambda: with_overrides(RunConfig(), {key: 1.0}),
                 lambda: typed_overrides({key: 1.0})):
        with pytest.raises(ConfigError, match=rf"unknown config \w+ '.*; did you mean {near}\?$"):
            call()


@pytest.mark.parametrize("key", ["optim.zzz", "trainer.lr", "qqq.zzz", "zzz"])
def test_an_unknown_key_with_nothing_near_gets_no_guess(key):
    # trainer.lr: near trainer.logger as a whole string, but no trainer field is near "lr"
    with pytest.raises(ConfigError, match="unknown config") as e:
        with_overrides(RunConfig(), {key: 1.0})
    assert "did you mean" not in str(e.value)


def test_synthetic_sizes_checked_against_unique_problems():
    with pytest.raises(ConfigError, match="unique problems"):
        DataConfig(synthetic_max_operand=5, synthetic_train_size=100)


# ---------------------------------------------------------------- field types and finiteness
# One case per kind of wrong value: (dotted key, value, what the message must say).
WRONG_TYPES = [
    ("optim.lr", "abc", r"optim.lr='abc': must be a finite number \(not str\)"),
    ("optim.lr", float("nan"), r"optim.lr=nan: must be a finite number"),
    ("optim.lr", float("inf"), r"optim.lr=inf: must be a finite number"),
    ("algorithm.gamma", float("-inf"), r"algorithm.gamma=-inf: must be a finite number"),
    ("optim.lr", None, r"optim.lr=None: must be a finite number \(not NoneType\)"),
    ("optim.lr", True, r"optim.lr=True: must be a finite number \(not bool\)"),
    ("rollout.n", 2.5, r"rollout.n=2.5: must be an integer \(not float\); e.g. the default 8"),
    ("rollout.n", True, r"rollout.n=True: must be an integer \(not bool\)"),
    ("rollout.n", "8", r"rollout.n='8': must be an integer \(not str\)"),
    ("rollout.n", float("nan"), r"rollout.n=nan: must be an integer"),
    ("data.shuffle", "false", r"data.shuffle='false': must be True or False \(not str\)"),
    ("data.shuffle", 1, r"data.shuffle=1: must be True or False \(not int\)"),
    ("model.dtype", 32, r"model.dtype=32: must be a string \(not int\); e.g. the default 'float32'"),
    ("total_steps", 2.5, r"run.total_steps=2.5: must be an integer"),
]


@pytest.mark.parametrize("key,value,message", WRONG_TYPES)
def test_wrong_type_or_non_finite_value_is_refused_naming_the_field(key, value, message):
    with pytest.raises(ConfigError, match=message):
        with_overrides(RunConfig(), {key: value})
    with pytest.raises(ConfigError, match=message):
        typed_overrides({key: value})


@pytest.mark.parametrize("key,value,message", WRONG_TYPES)
def test_wrong_type_is_refused_at_construction(key, value, message):
    section, _, name = key.rpartition(".")
    with pytest.raises(ConfigError, match=message):
        if section:
            RunConfig(**{section: SECTIONS[section](**{name: value})})
        else:
            RunConfig(**{name: value})


def test_every_field_is_type_checked():
    """The check is driven by the annotations, so no field can be forgotten: every field of
    every section refuses a value of a foreign type."""
    foreign = {int: "x", float: "x", str: 1.5, bool: "x"}
    for section, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            with pytest.raises(ConfigError, match=rf"^{section}\.{f.name}="):
                cls(**{f.name: foreign[type(f.default)]})


def test_numbers_are_stored_as_the_annotated_type_so_hashes_agree():
    # 1 and 1.0 (JSON writes either) must give the same config and the same hash
    a = with_overrides(RunConfig(), {"optim.lr": 1, "rollout.n": 8.0, "algorithm.gamma": 1})
    b = with_overrides(RunConfig(), {"optim.lr": 1.0, "rollout.n": 8, "algorithm.gamma": 1.0})
    assert type(a.optim.lr) is float and type(a.rollout.n) is int
    assert a == b and a.full_hash() == b.full_hash()
    assert a.trajectory_hash() == b.trajectory_hash()
    # numpy scalars are stored as Python numbers (json.dumps in full_hash refuses numpy ints)
    c = with_overrides(RunConfig(), {"optim.lr": np.float32(0.5), "rollout.n": np.int64(8)})
    assert type(c.optim.lr) is float and type(c.rollout.n) is int and c.full_hash()
    # the defaults already have their annotated types: the type pass leaves a default config,
    # and so its hashes, as they were
    for cfg in (RunConfig(), preset("ppo")):
        for section in SECTIONS:
            sub = getattr(cfg, section)
            for f in dataclasses.fields(sub):
                assert type(getattr(sub, f.name)).__name__ == f.type, (section, f.name)


def test_sections_must_be_mappings():
    with pytest.raises(ConfigError, match=r"config section 'optim'=5: must be a mapping"):
        with_overrides(RunConfig(), {"optim": 5})
    with pytest.raises(ConfigError, match=r"overrides=\[1\]: must be a mapping of dotted keys"):
        with_overrides(RunConfig(), [1])
    with pytest.raises(ConfigError, match=r"run.data=\{\}: must be a DataConfig"):
        RunConfig(data={})


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "verl_core.train", *args], capture_output=True,
                          text=True, timeout=120)


@pytest.mark.parametrize("setting,message", [
    ("optim.lr=abc", "optim.lr='abc': must be a finite number"),
    ("optim.lr=1e999", "optim.lr=inf: must be a finite number"),  # parsed as float('inf')
    ("rollout.n=2.5", "rollout.n=2.5: must be an integer"),
])
def test_cli_prints_the_error_without_traceback_and_exits_2(setting, message, tmp_path):
    out = _cli("--steps", "1", "--workdir", str(tmp_path), "--set", setting)
    assert out.returncode == 2, out.stderr
    assert message in out.stderr and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.startswith("python -m verl_core.train: error: ")
    assert not list(tmp_path.iterdir())  # nothing was prepared


def test_reward_timeout_policy_fields():
    from verl_core.config import RewardConfig

    with pytest.raises(ConfigError, match=r"reward.max_timeout_fraction=1.5: must be in \[0, 1\]"):
        RewardConfig(max_timeout_fraction=1.5)
    with pytest.raises(ConfigError, match=r"reward.on_timeouts='retry'.*known: fail, warn"):
        RewardConfig(on_timeouts="retry")
    with pytest.raises(ConfigError, match=r"reward.import_timeout_s=0.0: must be > 0"):
        RewardConfig(import_timeout_s=0)
    # they decide whether a run fails, never its scores: same trajectory, same checkpoints
    other = RunConfig(reward=RewardConfig(import_timeout_s=5.0, max_timeout_fraction=1.0,
                                          on_timeouts="warn"))
    assert other.trajectory_hash() == RunConfig().trajectory_hash()
    assert other.full_hash() != RunConfig().full_hash()


# ---------------------------------------------------------------- policy-loss options (issue 9)
@pytest.mark.parametrize("kwargs, message", [
    (dict(policy_loss="dro"), "algorithm.dro_beta=0.0: must be > 0 with policy_loss=dro"),
    (dict(clip_cov_ratio=0.0), "algorithm.clip_cov_ratio=0.0: must be in"),
    (dict(kl_cov_ratio=1.5), "algorithm.kl_cov_ratio=1.5: must be in"),
    (dict(clip_cov_lb=5.0), "algorithm.clip_cov_lb=5.0: must be < clip_cov_ub"),
    (dict(tau_neg=0.0), "algorithm.tau_neg=0.0: must be > 0"),
    (dict(loss_scale_factor=-1.0), "algorithm.loss_scale_factor=-1.0: must be >= 0"),
    (dict(rollout_is="seq"), "algorithm.rollout_is='seq': unknown value; known: , sequence, token"),
    (dict(rollout_is_threshold=0.0), "algorithm.rollout_is_threshold=0.0: must be > 0"),
    (dict(rollout_is_threshold_lower=3.0), "must be <= rollout_is_threshold=2.0"),
    (dict(bypass_loss_type="ppo"), "algorithm.bypass_loss_type='ppo': unknown value"),
    (dict(policy_loss="bypass_mode", rollout_is_batch_normalize=True),
     "algorithm.rollout_is_batch_normalize=True: is not offered with policy_loss=bypass_mode"),
    (dict(loss_agg_mode="token-median"), "algorithm.loss_agg_mode='token-median': unknown"),
    (dict(kl_loss_type="k4+"), "algorithm.kl_loss_type='k4+': unknown"),
])
def test_policy_loss_options_are_validated(kwargs, message):
    with pytest.raises(ConfigError, match=message.replace("+", r"\+")):
        AlgorithmConfig(**kwargs)


def test_new_losses_modes_and_estimators_are_accepted():
    for loss in ("cispo", "dppo_tv", "dppo_kl", "sapo", "geo_mean", "gpg", "clip_cov", "kl_cov",
                 "bypass_mode"):
        AlgorithmConfig(policy_loss=loss)
    AlgorithmConfig(policy_loss="dro", dro_beta=0.05)
    for mode in ("token-sum", "seq-mean-token-sum-norm"):
        AlgorithmConfig(loss_agg_mode=mode, loss_scale_factor=512.0)
    for kl in ("k1+", "kl+", "abs+", "k2+", "mse+", "k3+", "low_var_kl+"):
        AlgorithmConfig(kl_loss_type=kl, kl_penalty=kl)
    AlgorithmConfig(rollout_is="sequence", rollout_is_threshold=5.0, rollout_is_threshold_lower=0.5,
                    rollout_is_batch_normalize=True)


def test_only_bypass_mode_takes_the_rollout_logprobs_as_old():
    from verl_core.config import POLICY_LOSSES as NAMES
    for name in NAMES:
        algo = AlgorithmConfig(policy_loss=name, dro_beta=0.1)
        assert algo.old_logp_from_rollout == (name == "bypass_mode"), name


def test_demo_temperature_only_for_the_builtin_tiny_model(tmp_path):
    """The demo samples at DEMO_TEMPERATURE; a model you bring keeps verl's 1.0, through every
    front door (presets, the plain loop's CLI keys, the workflow's options and verl's keys), and
    an explicit temperature always wins."""
    import json

    from tasks.prepare import build_config
    from verl_core.config import DEMO_TEMPERATURE, RolloutConfig, preset

    assert RolloutConfig().temperature == 1.0  # verl's default
    for algo in ("grpo", "ppo", "rloo"):
        assert preset(algo).rollout.temperature == DEMO_TEMPERATURE
        assert preset(algo, **{"model.path": str(tmp_path)}).rollout.temperature == 1.0
        assert preset(algo, **{"rollout.temperature": 0.9}).rollout.temperature == 0.9
    assert build_config("grpo", "", "", "", 0, 0, 0, "").rollout.temperature == DEMO_TEMPERATURE
    assert build_config("grpo", str(tmp_path), "", "", 0, 0, 0, "").rollout.temperature == 1.0
    verl_model = json.dumps({"actor_rollout_ref.model.path": str(tmp_path)})
    assert build_config("grpo", "", "", "", 0, 0, 0, verl_model).rollout.temperature == 1.0
    verl_temp = json.dumps({"actor_rollout_ref.rollout.temperature": 1.0})
    assert build_config("grpo", "", "", "", 0, 0, 0, verl_temp).rollout.temperature == 1.0


# trajectory_hash of these configs before each field declared its membership (at 79f3ce0): the
# checkpoints, lineage and metrics of existing run stores are named by it
_PINNED_TRAJECTORY_HASHES = {
    "RunConfig()": (RunConfig, "ed67d0c373a7d8617271401a6daf8fb4dc7be6e26fbe4a884148973fb821c5b6"),
    "grpo": (lambda: preset("grpo"),
             "e625266297b92f80c33ce9cfc43151deb9cb02f9e2701de6632033f7dc7db133"),
    "ppo": (lambda: preset("ppo"),
            "a21c0685c1165ef445a647b038d69576b19c74b755de0e825f07f9ec91743e61"),
    "cosine": (lambda: preset("grpo", **{"optim.lr_schedule": "cosine", "total_steps": 30}),
               "b6f09e08509ea5aa8e7ca019c5561a13109cc8d8714cea30428204b6ec004838"),
    "reward_model": (lambda: preset("grpo", **{"reward_model.enable": True,
                                               "reward_model.path": "/m",
                                               "reward_model.micro_batch_size": 8}),
                     "b6c29ec892e3d5175d89498fc7c46972a2916dd9797779d5cbde165ad5aa0fdb"),
    "outside": (lambda: preset("grpo", **{"data.assets_id": "abc", "checkpoint.keep_last": 1,
                                          "guard.latency_spike_policy": "halt",
                                          "guard.phase_timeout_s": 5.0, "trainer.nnodes": 2,
                                          "reward.num_workers": 3, "eval_every": 2,
                                          "data.val_batch_size": 16}),
                "db66f8aeb0f825670cec330a12e16d2ce3d29b6351e35601c497d3b8f38c711f"),
}


@pytest.mark.parametrize("case", sorted(_PINNED_TRAJECTORY_HASHES))
def test_trajectory_hash_is_unchanged(case):
    make, expected = _PINNED_TRAJECTORY_HASHES[case]
    assert make().trajectory_hash() == expected


def test_every_config_field_declares_whether_it_is_in_the_trajectory():
    """A field without ``in_trajectory``/``not_in_trajectory`` is refused here, so a new field
    never joins (or leaves) the trajectory unnoticed; a section kept out takes all its fields."""
    def walk(cls, path, outside):
        for f in dataclasses.fields(cls):
            name = f"{path}{f.name}"
            assert TRAJECTORY in f.metadata, f"{name} does not declare its trajectory membership"
            inside = f.metadata[TRAJECTORY]
            assert inside in (True, False) or callable(inside), name
            assert not (outside and inside), f"{name} is in the trajectory, its section is not"
            kind = typing.get_type_hints(cls)[f.name]
            if dataclasses.is_dataclass(kind):
                yield from walk(kind, f"{name}.", outside or inside is False)
            yield name

    names = list(walk(RunConfig, "", False))
    assert len(names) == len(set(names)) > len(SECTIONS) * 5


# where each config name lives (torchtitan style: a section beside the component it configures);
# ``verl_core.config`` composes them and re-exports every one
_HOMES = {
    "verl_core.config_fields": ("ConfigError", "TRAJECTORY", "in_trajectory",
                                "not_in_trajectory", "_fields_of"),
    "verl_core.data.config": ("DataConfig",),
    "verl_core.models.config": ("ModelConfig",),
    "verl_core.rollout.config": ("RolloutConfig",),
    "verl_core.reward.config": ("RewardConfig", "RewardModelConfig", "REWARD_MODEL_COMBINE"),
    "verl_core.training.config": ("OptimConfig", "ActorConfig"),
    "verl_core.checkpoint.config": ("CheckpointConfig",),
    "verl_core.guard.config": ("GuardConfig", "GUARD_POLICIES", "TIMING_DETECTORS"),
    "verl_core.config": ("AlgorithmConfig", "POLICY_LOSSES", "TrainerConfig", "ClusterConfig",
                         "TrackingConfig", "ValidationConfig", "RunConfig", "SECTIONS", "preset"),
}


@pytest.mark.parametrize("home", sorted(_HOMES))
def test_each_config_lives_beside_its_component_and_is_exported_by_verl_core_config(home):
    import importlib

    import verl_core.config

    module = importlib.import_module(home)
    for name in _HOMES[home]:
        obj = getattr(module, name)
        assert getattr(verl_core.config, name) is obj, f"verl_core.config.{name}"
        assert name.startswith("_") or name in verl_core.config.__all__, name
        if isinstance(obj, type):
            assert obj.__module__ == home, f"{name} is defined in {obj.__module__}, not {home}"


def test_every_section_is_homed_and_exported():
    import verl_core.config

    homed = {n for names in _HOMES.values() for n in names}
    assert {cls.__name__ for cls in SECTIONS.values()} <= homed
    assert all(hasattr(verl_core.config, n) for n in verl_core.config.__all__)


@pytest.mark.parametrize("overrides, match", [
    ({"rollout.multi_turn": True}, r"rollout.tool_config_path='': rollout.multi_turn=True needs"),
    ({"rollout.multi_turn": True, "rollout.tool_config_path": "t.yaml",
      "algorithm.adv_estimator": "remax"}, r"adv_estimator='remax': its greedy baseline"),
    ({"rollout.tool_response_truncate_side": "top"}, r"tool_response_truncate_side='top'"),
    ({"rollout.max_parallel_calls": 0}, r"rollout.max_parallel_calls=0"),
    ({"model.warmup_tool_fraction": 1.5}, r"model.warmup_tool_fraction=1.5: must be in \[0, 1\]"),
])
def test_multi_turn_settings_are_checked(overrides, match):
    with pytest.raises(ConfigError, match=match):
        preset("grpo", **overrides)


def test_the_calculator_task_brings_its_settings_and_needs_the_tool():
    cfg = preset("grpo", **{"data.synthetic_task": "calculator"})
    assert cfg.rollout.multi_turn and cfg.rollout.tool_config_path == "builtin:calculator"
    assert cfg.rollout.max_new_tokens == 112 and cfg.data.max_prompt_length == 16
    # set afterwards, without the preset's settings: refused with the fix
    with pytest.raises(ConfigError, match=r"synthetic_task='calculator': is answered with the "
                                          r"calculator tool: set rollout.multi_turn=True"):
        with_overrides(preset("grpo"), {"data.synthetic_task": "calculator"})
    # the multi-turn fields do not change the hash of a run that does not use them
    assert preset("grpo").trajectory_hash() == preset(
        "grpo", **{"rollout.max_user_turns": 3, "model.warmup_tool_fraction": 0.5}
    ).trajectory_hash()
