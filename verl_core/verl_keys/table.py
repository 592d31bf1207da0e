"""The key table: each verl key's transform to our keys (:data:`VERL_TO_OURS`), the keys that
are no-ops with their checked values (:data:`NO_EFFECT`, :data:`SPEED_ONLY`, :data:`RM_SERVING`)
and the keys refused by name or pattern, each with its reason."""

from __future__ import annotations

import json
import re
from typing import Callable

from verl_core.config import ConfigError
from verl_core.verl_keys.files import verl_defaults

A = "actor_rollout_ref.actor."
R = "actor_rollout_ref.rollout."

Pairs = list[tuple[str, object]]
Transform = Callable[[object, dict], Pairs]


def _to(target: str, fn=lambda v: v, skip_none: bool = True) -> Transform:
    def t(value, ctx):
        return [] if value is None and skip_none else [(target, fn(value))]
    t.target = target  # for the docs/verl-keys.md table and tests
    return t


def _verl_device(value) -> str:
    """verl's ``trainer.device``, given on the command line: ``cuda`` needs a GPU, as in verl
    (verl's YAML default ``cuda`` is skipped as a default: a verl config runs on the CPU of a
    machine without one, ``trainer.device=auto``); ``cpu`` is the CPU; ``npu`` is not offered."""
    if value in ("cuda", "cpu", "auto"):
        return value
    raise ConfigError(f"trainer.device={value!r}: only CUDA GPUs and the CPU are offered here "
                      "(trainer.device=cuda, cpu, or auto: the GPU when there is one)")


def _module_names(value) -> str:
    """verl's module list (or ``all-linear``) -> ``model.target_modules``' comma-separated
    string."""
    return value if isinstance(value, str) else ",".join(str(v) for v in value)


def _files(value):
    return ",".join(map(str, value)) if isinstance(value, (list, tuple)) else value


def _betas(value, ctx) -> Pairs:
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        raise ConfigError(f"{A}optim.betas={value!r}: must be a pair [beta1, beta2]")
    return [("optim.beta1", value[0]), ("optim.beta2", value[1])]


def _default_agent_loop(value, ctx) -> Pairs:
    """verl's ``agent.default_agent_loop``: its built-in names keep the loop following
    ``multi_turn.enable`` (``tool_agent`` when on, as before agent loops existed here); any
    other name, dotted path or ``file.py:Class`` is ``rollout.agent_loop``."""
    if value is None or value in ("single_turn_agent", "tool_agent"):
        return []
    return [("rollout.agent_loop", value)]


_default_agent_loop.target = "rollout.agent_loop"


def _clip_ratio(value, ctx) -> Pairs:
    return [("algorithm.clip_ratio_low", value), ("algorithm.clip_ratio_high", value)]


RL_STEP_UNIT = ("optim.lr_schedule_unit", "rl_step")
"""verl steps its LR scheduler once per RL step (``update_actor``): its warmup steps and cosine
count RL steps, so every verl schedule key sets our schedule's unit to them."""
WARMUP_RATIO = {"optim.lr_warmup_steps_ratio": "optim.warmup_steps",
                "optim.critic_lr_warmup_steps_ratio": "optim.critic_warmup_steps"}
"""Kept as they are by :func:`to_ours` (as :data:`TOTAL_EPOCHS`): each ratio becomes RL steps of
its field once the run's length is known, in :func:`run_config`."""


def _warmup_steps(target: str) -> Transform:
    def t(value, ctx) -> Pairs:
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value < 0:
            return []  # verl's -1: unset, lr_warmup_steps_ratio decides
        return [(target, value), RL_STEP_UNIT]
    return t


def _warmup_ratio(prefix: str, target: str, late: str) -> Transform:
    """verl's ``lr_warmup_steps_ratio``: used when ``lr_warmup_steps`` is unset (< 0), as
    ``int(ratio x total RL steps)`` warmup RL steps (``late``: resolved in :func:`run_config`)."""
    def t(value, ctx) -> Pairs:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
            raise ConfigError(f"{prefix}optim.lr_warmup_steps_ratio={value!r}: must be a fraction "
                              "of the run's RL steps in [0, 1]")
        steps = ctx.get(f"{prefix}optim.lr_warmup_steps", -1)
        if isinstance(steps, (int, float)) and steps >= 0:
            return []  # verl: lr_warmup_steps, when set, wins over the ratio
        return [(late, float(value)), RL_STEP_UNIT] if value else [(target, 0), RL_STEP_UNIT]
    return t


def _schedule(value, ctx) -> Pairs:
    return [] if value is None else [("optim.lr_schedule", value), RL_STEP_UNIT]


def _micro_global(value, ctx) -> Pairs:
    if value is None:
        return []
    raise ConfigError(f"{A}ppo_micro_batch_size={value!r}: deprecated in verl (a global size); "
                      f"give {A}ppo_micro_batch_size_per_gpu (rows per worker), i.e. "
                      "actor.ppo_micro_batch_size")


def _bypass(value, ctx) -> Pairs:
    return [("algorithm.policy_loss", "bypass_mode")] if value is True else []


TOTAL_EPOCHS = "trainer.total_epochs"
"""Kept as it is by :func:`to_ours`: epochs become RL steps only once the training rows are
counted, in :func:`run_config`."""


def _total_epochs(value, ctx) -> Pairs:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"trainer.total_epochs={value!r}: must be a positive integer (passes "
                          "over the training rows)")
    return [(TOTAL_EPOCHS, value)]


def _critic_path(value, ctx) -> Pairs:
    actor = ctx.get("actor_rollout_ref.model.path", ctx.get("model.path"))
    if value is None or value == actor:
        return []
    if actor is None:  # the actor's path comes from an option (--model): it must be the same
        return [("model.path", value)]
    raise ConfigError(f"critic.model.path={value!r}: the critic starts from the actor's model "
                      f"here (actor_rollout_ref.model.path={actor!r}: its weights with a value "
                      "head); a critic from another model is not offered; give the actor's path "
                      "or leave critic.model.path out")


def _filter_overlong(value, ctx) -> Pairs:
    """verl drops rows whose prompt is over ``data.max_prompt_length`` before it would cut
    them; here rows are never dropped (the data position and lineage count rows), so an
    over-long prompt either fails validation naming its row (``data.truncation=error``) or is
    cut as ``data.truncation`` says: both are that, only verl's drop-then-cut is refused."""
    if value not in (True, False):
        raise ConfigError(f"data.filter_overlong_prompts={value!r}: give True or False")
    truncation = ctx.get("data.truncation", "error")
    if value and truncation != "error":
        raise ConfigError(
            f"data.filter_overlong_prompts=True with data.truncation={truncation!r}: verl drops "
            "over-long prompts before it would cut them; rows are never dropped here. Give "
            "filter_overlong_prompts=False to cut them as data.truncation says, or keep "
            "data.truncation=error to have each named at validation")
    return []


def _save_freq(value, ctx) -> Pairs:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"trainer.save_freq={value!r}: give an interval in steps (verl's -1: "
                          "no periodic checkpoints)")
    if value > 0:
        return [("checkpoint.checkpoint_interval", value)]
    # verl: never save; here the closest a durable run gets (said in the run header), with the
    # rollback and replay schedule's interval the run's length (run_config)
    return [("checkpoint.last_step_only", True)]


def _test_freq(value, ctx) -> Pairs:
    return [("eval_every", 0 if isinstance(value, (int, float)) and value <= 0 else value)]


def _resume_mode(value, ctx) -> Pairs:
    if value == "auto":
        return [("checkpoint.resume_from_checkpoint", "auto")]
    if value == "disable":
        return [("checkpoint.resume_from_checkpoint", "none")]
    if value == "resume_path":
        path = ctx.get("trainer.resume_from_path")
        if not path:
            raise ConfigError("trainer.resume_mode='resume_path' needs trainer.resume_from_path "
                              "(a checkpoint manifest or another run store's folder here)")
        return [("checkpoint.resume_from_checkpoint", path)]
    raise ConfigError(f"trainer.resume_mode={value!r}: use auto, disable or resume_path")


def _resume_path(value, ctx) -> Pairs:
    if value is None or ctx.get("trainer.resume_mode") == "resume_path":
        return []  # taken by trainer.resume_mode
    raise ConfigError(f"trainer.resume_from_path={value!r}: verl reads it only with "
                      "trainer.resume_mode=resume_path; set that too")


def _reward_path(value, ctx) -> Pairs:
    if value is None:
        return []
    name = ctx.get("custom_reward_function.name") or "compute_score"
    return [("reward.scorer", f"{value}:{name}")]


def _reward_name(value, ctx) -> Pairs:
    if ctx.get("custom_reward_function.path") is not None or value == "compute_score":
        return []  # taken by custom_reward_function.path
    raise ConfigError(f"custom_reward_function.name={value!r}: does nothing without "
                      "custom_reward_function.path (in verl too); give the file")


def _logger(value, ctx) -> Pairs:
    """verl's loggers: ``console`` is the step log; ``wandb`` switches on the W&B tracker under
    verl's ``trainer.project_name`` (verl's default project when unset) and
    ``trainer.experiment_name`` (unset: the run's name)."""
    loggers = [value] if isinstance(value, str) else list(value or [])
    other = [x for x in loggers if x not in ("console", "wandb")]
    if other:
        raise ConfigError(f"trainer.logger={value!r}: {other} not offered here; 'console' (the "
                          "step log) and 'wandb' are; for TensorBoard or MLflow set "
                          "tracking.tensorboard_dir / tracking.mlflow_tracking_uri")
    if "wandb" not in loggers:
        return []
    project = ctx.get("trainer.project_name") or verl_defaults()["trainer.project_name"]
    pairs = [("tracking.wandb_project", str(project))]
    if ctx.get("trainer.experiment_name"):
        pairs.append(("tracking.wandb_run_name", str(ctx["trainer.experiment_name"])))
    return pairs


OVERRIDE_CONFIG = "actor_rollout_ref.model.override_config"


def _override_config(value, ctx) -> Pairs:
    """verl's ``override_config``: config.json fields of the actor's model -> our
    ``model.override_config`` (a JSON object; checked against the model's config at prepare)."""
    if not isinstance(value, dict):
        raise ConfigError(f"{OVERRIDE_CONFIG}={value!r}: a mapping of config.json fields, e.g. "
                          f"{OVERRIDE_CONFIG}.attention_dropout=0.0")
    return [("model.override_config", json.dumps(value, sort_keys=True))] if value else []


MULTI_GPU = "a multi-GPU layout"
"""The words every refusal of a GPU-only setting carries (tensor or sequence parallelism, the
SGLang engine): ``tests/verl_core/test_verl_examples.py`` tells them from other refusals."""


def _engine(value, ctx) -> Pairs:
    if value == "sglang":
        raise ConfigError(f"{R}name='sglang': SGLang serves rollouts on CUDA GPUs only "
                          f"({MULTI_GPU} engine, not offered here); use vllm (GPU, or CPU with "
                          "bash .ci/install vllm) or hf (any device)")
    return [("rollout.engine", value)]


VERL_TO_OURS: dict[str, Transform] = {
    # batch sizes: verl's mini-batch is in prompts and its per-GPU micro-batch in responses, as ours
    A + "ppo_mini_batch_size": _to("actor.ppo_mini_batch_size"),
    A + "ppo_micro_batch_size_per_gpu": _to("actor.ppo_micro_batch_size"),
    A + "ppo_micro_batch_size": _micro_global,
    A + "ppo_epochs": _to("actor.ppo_epochs"),
    # token-budget micro-batches: one switch for every forward (verl's four keys must agree)
    **{k: _to("actor.use_dynamic_bsz") for k in (
        A + "use_dynamic_bsz", R + "log_prob_use_dynamic_bsz",
        "actor_rollout_ref.ref.log_prob_use_dynamic_bsz", "critic.use_dynamic_bsz")},
    A + "ppo_max_token_len_per_gpu": _to("actor.ppo_max_token_len_per_gpu"),
    R + "log_prob_max_token_len_per_gpu": _to("actor.log_prob_max_token_len_per_gpu"),
    "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu":
        _to("actor.ref_log_prob_max_token_len_per_gpu"),
    "critic.ppo_max_token_len_per_gpu": _to("actor.critic_ppo_max_token_len_per_gpu"),
    "critic.forward_max_token_len_per_gpu": _to("actor.critic_forward_max_token_len_per_gpu"),
    "trainer.balance_batch": _to("trainer.balance_batch"),
    "trainer.device": _to("trainer.device", _verl_device),
    # no compute on padding: one switch for the actor's (ref's) and the critic's forwards
    **{k: _to("actor.use_remove_padding") for k in (
        "actor_rollout_ref.model.use_remove_padding", "critic.model.use_remove_padding")},
    A + "use_prefix_grouper": _to("actor.use_prefix_grouper"),
    A + "optim.lr": _to("optim.lr"),
    A + "optim.weight_decay": _to("optim.weight_decay"),
    A + "optim.betas": _betas,
    A + "optim.clip_grad": _to("optim.grad_clip"),
    A + "grad_clip": _to("optim.grad_clip"),
    A + "optim.lr_warmup_steps": _warmup_steps("optim.warmup_steps"),
    A + "optim.lr_warmup_steps_ratio": _warmup_ratio(A, "optim.warmup_steps",
                                                     "optim.lr_warmup_steps_ratio"),
    "critic.optim.lr_warmup_steps": _warmup_steps("optim.critic_warmup_steps"),
    "critic.optim.lr_warmup_steps_ratio": _warmup_ratio("critic.", "optim.critic_warmup_steps",
                                                        "optim.critic_lr_warmup_steps_ratio"),
    A + "optim.lr_scheduler_type": _schedule,
    A + "optim.warmup_style": _schedule,
    A + "optim.min_lr_ratio": _to("optim.min_lr_ratio"),
    "critic.optim.lr": _to("optim.critic_lr"),
    "critic.cliprange_value": _to("algorithm.cliprange_value"),
    # losses: verl's actor fields live in our algorithm section
    A + "clip_ratio": _clip_ratio,
    **{A + n: _to(f"algorithm.{n}") for n in (
        "clip_ratio_low", "clip_ratio_high", "clip_ratio_c", "loss_agg_mode", "entropy_coeff",
        "use_kl_loss", "kl_loss_coef", "kl_loss_type", "tau_pos", "tau_neg")},
    A + "loss_scale_factor": _to("algorithm.loss_scale_factor", lambda v: 0.0 if v is None else v,
                                 skip_none=False),
    A + "policy_loss.loss_mode": _to("algorithm.policy_loss"),
    **{A + f"policy_loss.{n}": _to(f"algorithm.{n}") for n in (
        "clip_cov_ratio", "clip_cov_lb", "clip_cov_ub", "kl_cov_ratio", "ppo_kl_coef")},
    "algorithm.kl_ctrl.type": _to("algorithm.kl_ctrl_type"),
    "algorithm.kl_ctrl.kl_coef": _to("algorithm.kl_coef"),
    "algorithm.kl_ctrl.horizon": _to("algorithm.kl_horizon"),
    "algorithm.kl_ctrl.target_kl": _to("algorithm.kl_target"),
    # DAPO (verl's recipe/dapo): dynamic sampling and the overlong buffer
    "algorithm.filter_groups.enable": _to("algorithm.filter_groups_enable"),
    "algorithm.filter_groups.metric": _to("algorithm.filter_groups_metric"),
    "algorithm.filter_groups.max_num_gen_batches": _to(  # verl: non-positive means no limit
        "algorithm.max_num_gen_batches", lambda v: 0 if isinstance(v, int) and v < 0 else v),
    "data.gen_batch_size": _to("data.gen_batch_size"),
    **{f"reward_model.{where}.{n}": _to(f"reward.overlong_{m}")
       for where in ("overlong_buffer", "reward_kwargs.overlong_buffer_cfg")
       for n, m in (("enable", "buffer_enable"), ("len", "buffer_len"),
                    ("penalty_factor", "penalty_factor"), ("log", "buffer_log"))},
    # the penalty counts from the response budget here: verl's recipe gives the same number
    "reward_model.reward_kwargs.max_resp_len": _to("rollout.max_new_tokens"),
    "algorithm.rollout_correction.rollout_is": _to("algorithm.rollout_is",
                                                   lambda v: v or "", skip_none=False),
    "algorithm.rollout_correction.rollout_is_threshold": _to("algorithm.rollout_is_threshold"),
    "algorithm.rollout_correction.rollout_is_batch_normalize":
        _to("algorithm.rollout_is_batch_normalize"),
    "algorithm.rollout_correction.loss_type": _to("algorithm.bypass_loss_type"),
    "algorithm.rollout_correction.bypass_mode": _bypass,
    # sampling
    **{R + n: _to(f"rollout.{n}") for n in ("n", "temperature", "top_p", "top_k",
                                             "gpu_memory_utilization", "enforce_eager",
                                             "free_cache_engine")},
    R + "name": _engine,
    OVERRIDE_CONFIG: _override_config,
    # the engines' own knobs: vLLM's, and the hf engine's generation batch
    R + "max_num_seqs": _to("rollout.max_num_seqs"),
    R + "max_model_len": _to("rollout.max_model_len"),
    R + "enable_chunked_prefill": _to("rollout.enable_chunked_prefill"),
    R + "response_length": _to("rollout.max_new_tokens"),
    R + "prompt_length": _to("data.max_prompt_length"),
    "data.max_response_length": _to("rollout.max_new_tokens"),
    "data.train_files": _to("data.train_files", _files),
    "data.val_files": _to("data.val_files", _files),
    "data.val_batch_size": _to("data.val_batch_size"),
    "data.val_max_samples": _to("data.val_max_samples"),
    "data.filter_overlong_prompts": _filter_overlong,
    **{R + f"val_kwargs.{n}": _to(f"rollout.val_{n}") for n in (
        "do_sample", "temperature", "top_p", "top_k", "n")},
    # multi-turn rollouts with tools (verl's null limits are our 0; data.tool_config_path is
    # verl's interpolation of the rollout's)
    R + "multi_turn.enable": _to("rollout.multi_turn"),
    R + "multi_turn.tool_config_path": _to("rollout.tool_config_path"),
    R + "multi_turn.interaction_config_path": _to("rollout.interaction_config_path"),
    "data.tool_config_path": _to("rollout.tool_config_path"),
    **{R + f"multi_turn.{n}": _to(f"rollout.{n}", lambda v: v or 0, skip_none=False)
       for n in ("max_assistant_turns", "max_user_turns")},
    **{R + f"multi_turn.{n}": _to(f"rollout.{n}") for n in (
        "max_parallel_calls", "max_tool_response_length", "tool_response_truncate_side")},
    # custom agent loops (agent/loops.py): verl's two built-in names follow multi_turn.enable
    R + "agent.default_agent_loop": _default_agent_loop,
    R + "agent.agent_loop_config_path": _to("rollout.agent_loop_config_path"),
    # model, reward
    "actor_rollout_ref.model.path": _to("model.path"),
    "actor_rollout_ref.model.enable_gradient_checkpointing": _to("model.gradient_checkpointing"),
    "actor_rollout_ref.model.lora_rank": _to("model.lora_rank"),
    "actor_rollout_ref.model.lora_alpha": _to("model.lora_alpha", float),
    "actor_rollout_ref.model.target_modules": _to("model.target_modules", _module_names),
    "actor_rollout_ref.model.exclude_modules": _to("model.exclude_modules", _module_names),
    "actor_rollout_ref.model.lora_adapter_path": _to("model.lora_adapter_path"),
    "custom_reward_function.path": _reward_path,
    "custom_reward_function.name": _reward_name,
    "reward_model.model.path": _to("reward_model.path"),
    "reward_model.micro_batch_size_per_gpu": _to("reward_model.micro_batch_size"),
    "reward_model.max_length": _to("reward_model.max_length", lambda v: v or 0, skip_none=False),
    # verl's code sandbox settings mean the same for the sandbox here (reward/sandbox.py)
    "reward_model.sandbox_fusion.max_concurrent": _to("reward.sandbox_max_concurrent"),
    "reward_model.sandbox_fusion.memory_limit_mb": _to("reward.sandbox_memory_mb"),
    "reward_model.sandbox_fusion.url": _to("reward.sandbox_url", lambda v: v or "",
                                           skip_none=False),
    # the run loop (verl's trainer section)
    "trainer.total_training_steps": _to("total_steps"),
    "trainer.total_epochs": _total_epochs,
    "trainer.val_before_train": _to("val_before_train"),
    "trainer.log_val_generations": _to("log_val_generations"),
    "critic.model.path": _critic_path,
    "trainer.save_freq": _save_freq,
    "trainer.test_freq": _test_freq,
    "trainer.resume_mode": _resume_mode,
    "trainer.resume_from_path": _resume_path,
    "trainer.max_actor_ckpt_to_keep": _to("checkpoint.keep_last"),
    # verl saves ahead of a capacity block's expiration by the longest step + a save + this
    "trainer.esi_redundant_time": _to("checkpoint.must_save_margin_s"),
    "trainer.logger": _logger,
}
"""verl key -> transform of its value into ``[(our key, value), ...]`` (context: all the keys
given together, for the keys verl reads in pairs)."""


# ---------------------------------------------------------------- precision (verl's fsdp_config)
# verl's PrecisionType spellings -> torch's names
_PRECISION = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp32": "float32", "float32": "float32",
              "32": "float32", "fp16": "float16", "float16": "float16", "16": "float16"}
_MP_KEYS = ("param_dtype", "reduce_dtype", "buffer_dtype")


def _precision(key: str, value) -> str:
    name = _PRECISION.get(str(value).lower())
    if name is None:
        raise ConfigError(f"{key}={value!r}: not a dtype verl knows; use bf16 or fp32")
    return name


def _compute_dtype(key: str):
    """``fsdp_config.mixed_precision.param_dtype`` / ``fsdp_config.dtype``: the dtype forwards
    compute in, i.e. ``model.dtype`` (the actor, critic and reference share it here)."""
    def t(value, ctx) -> Pairs:
        name = _precision(key, value)
        if name == "float16":
            raise ConfigError(f"{key}={value!r}: float16 compute needs loss scaling, which is not "
                              "offered; use bf16 (model.dtype=bfloat16: bf16 compute over float32 "
                              "master weights, verl's default) or fp32")
        return [("model.dtype", name)]
    t.target = "model.dtype"
    return t


def _fp32_only(key: str, what: str):
    def t(value, ctx) -> Pairs:
        if _precision(key, value) != "float32":
            raise ConfigError(f"{key}={value!r}: {what}; only fp32 is offered")
        return []
    return t


def _master_dtype(key: str):
    """``fsdp_config.model_dtype``: the dtype the trained weights are *kept* in."""
    def t(value, ctx) -> Pairs:
        if value is None or _precision(key, value) == "float32":
            return []
        raise ConfigError(f"{key}={value!r}: the trained weights and AdamW state are kept in "
                          "float32 here (pure bf16 weights lose every update under one bf16 ulp, "
                          "2^-8 of a weight: at lr 1e-6 nearly all of them); for bf16 compute "
                          "set model.dtype=bfloat16 (verl: fsdp_config.mixed_precision."
                          "param_dtype=bf16) and leave model_dtype at fp32")
    return t


def _mixed_precision(prefix: str):
    """``fsdp_config.mixed_precision`` given as one mapping (a Python override dict)."""
    def t(value, ctx) -> Pairs:
        if not isinstance(value, dict) or set(value) - set(_MP_KEYS):
            raise ConfigError(f"{prefix}mixed_precision={value!r}: a mapping of "
                              f"{', '.join(_MP_KEYS)}")
        return [p for k, v in value.items()
                for p in VERL_TO_OURS[f"{prefix}mixed_precision.{k}"](v, ctx)]
    return t


for _prefix in (A + "fsdp_config.", "actor_rollout_ref.ref.fsdp_config.",
                "critic.model.fsdp_config."):
    VERL_TO_OURS.update({
        _prefix + "dtype": _compute_dtype(_prefix + "dtype"),
        _prefix + "mixed_precision.param_dtype": _compute_dtype(_prefix + "mixed_precision."
                                                                "param_dtype"),
        _prefix + "mixed_precision.reduce_dtype": _fp32_only(
            _prefix + "mixed_precision.reduce_dtype", "gradients are reduced and kept in float32"),
        _prefix + "mixed_precision.buffer_dtype": _fp32_only(
            _prefix + "mixed_precision.buffer_dtype",
            "buffers (rotary frequencies) stay float32, as loaded"),
        _prefix + "mixed_precision": _mixed_precision(_prefix),
    })
    VERL_TO_OURS[_prefix + "model_dtype"] = _master_dtype(_prefix + "model_dtype")
# verl's CISPO example passes the model's dtype as model.torch_dtype: the compute dtype
VERL_TO_OURS["actor_rollout_ref.model.torch_dtype"] = _compute_dtype(
    "actor_rollout_ref.model.torch_dtype")
# verl's on-policy distillation (docs/algo/opd.md, verl's distillation.yaml): its single teacher
# and its PG OPD signal map (docs/rewards.md#on-policy-distillation); the rest is refused or has
# no effect, each with the reason
D, DL, DT = "distillation.", "distillation.distillation_loss.", \
    "distillation.teacher_models.teacher_model."
DISTILL_DEFAULTS = {D + "enabled": False, DL + "loss_mode": "k3", DL + "use_task_rewards": True,
                    DL + "distillation_loss_coef": 1.0, DL + "loss_max_clamp": None,
                    DL + "use_policy_gradient": False, DT + "model_path": None}
"""verl's defaults of the distillation keys that map (its generated config at 1dda039, which
the vendored defaults file predates): a key at its default changes nothing while distillation is
off, as in verl."""


def _distill(key: str, target: Transform) -> Transform:
    """``target`` when ``distillation.enabled`` is true; while it is off, verl reads none of its
    keys, so one at verl's default changes nothing and any other value is refused."""
    def t(value, ctx) -> Pairs:
        if ctx.get(D + "enabled") is True:
            return target(value, ctx)
        if _same_value(value, DISTILL_DEFAULTS[key]):
            return []
        raise ConfigError(f"{key}={value!r} does nothing while distillation.enabled is not true "
                          "(verl's switch): set distillation.enabled=true with "
                          f"{DT}model_path, or leave it out")
    t.target = getattr(target, "target", None)
    return t


def _same_value(a, b) -> bool:
    return a == b and type(a) is type(b) or a is None and b is None


def _distill_enabled(value, ctx) -> Pairs:
    """verl's switch. On, it needs the teacher and PG OPD (verl's default, GKD OPD, is not
    built: refused rather than run as another algorithm), and the estimator is verl's default
    k3 unless a key names one."""
    if value not in (True, False):
        raise ConfigError(f"distillation.enabled={value!r}: must be true or false")
    if value is False:
        return []
    if ctx.get(DT + "model_path") is None:
        raise ConfigError(f"distillation.enabled=True needs the teacher: {DT}model_path=<a local "
                          "folder of a model with the student's tokenizer>")
    if DL + "use_policy_gradient" not in ctx:
        _distill_pg(False, ctx)  # verl's default: refused, naming the key to set
    if DL + "loss_mode" in ctx or "algorithm.distill_loss_mode" in ctx:
        return []
    return [("algorithm.distill_loss_mode", DISTILL_DEFAULTS[DL + "loss_mode"])]


def _distill_loss_mode(value, ctx) -> Pairs:
    if value == "forward_kl_topk":
        raise ConfigError(f"verl key {DL}loss_mode='forward_kl_topk' cannot apply here: the "
                          "top-k forward KL (GKD OPD) needs the teacher's top-k distribution at "
                          "every position and a loss through the student's logits; only the "
                          "single-sample reverse-KL estimators of PG OPD are built (k1, kl, abs, "
                          "k2, mse, k3, low_var_kl)")
    return [("algorithm.distill_loss_mode", value)]


def _distill_pg(value, ctx) -> Pairs:
    if value is not True:
        raise ConfigError(f"verl key {DL}use_policy_gradient={value!r} (verl's default) cannot "
                          "apply here: GKD OPD (the estimator backpropagated as a supervised "
                          "loss) is not built; the signal here is PG OPD's, the negative "
                          f"reverse-KL estimate as a per-token advantage: set {DL}"
                          "use_policy_gradient=true")
    return []


VERL_TO_OURS.update({
    D + "enabled": _distill_enabled,
    DT + "model_path": _distill(DT + "model_path", _to("algorithm.distill_teacher_path")),
    DL + "loss_mode": _distill(DL + "loss_mode", _distill_loss_mode),
    DL + "use_task_rewards": _distill(DL + "use_task_rewards",
                                      _to("algorithm.distill_use_task_rewards")),
    DL + "distillation_loss_coef": _distill(DL + "distillation_loss_coef",
                                            _to("algorithm.distill_coef")),
    DL + "loss_max_clamp": _distill(DL + "loss_max_clamp", _to("algorithm.distill_loss_max_clamp")),
    DL + "use_policy_gradient": _distill(DL + "use_policy_gradient", _distill_pg),
})
_TEACHER_SERVING = ("how verl serves the teacher (its own resource pool and inference engine); "
                    "here the teacher is a plain forward on the run's workers, a full copy on "
                    "each, scoring at temperature 1 as verl's teacher does")
DISTILL_NO_EFFECT: dict[str, tuple[Callable[[object], bool], str]] = {
    D + "n_gpus_per_node": (lambda v: True, _TEACHER_SERVING),
    D + "nnodes": (lambda v: True, _TEACHER_SERVING),
    DT + "num_replicas": (lambda v: True, _TEACHER_SERVING),
    **{DT + "inference." + n: (lambda v: True, _TEACHER_SERVING) for n in (
        "name", "dtype", "gpu_memory_utilization", "enforce_eager", "cudagraph_capture_sizes",
        "free_cache_engine", "data_parallel_size", "expert_parallel_size",
        "tensor_model_parallel_size", "max_num_batched_tokens", "max_model_len",
        "max_num_seqs", "load_format", "engine_kwargs", "limit_images",
        "enable_chunked_prefill", "enable_prefix_caching", "disable_log_stats",
        "skip_tokenizer_init", "prompt_length", "response_length", "temperature", "_target_")},
    D + "teacher_key": (lambda v: True, "one teacher here (multi-teacher routing is not built): "
                                        "every row goes to it, as in verl with one teacher"),
    DT + "key": (lambda v: True, "one teacher here: every row goes to it, as in verl with one"),
    DL + "topk": (lambda v: True, "read only by the top-k forward KL (loss_mode=forward_kl_topk), "
                                  "which is not built"),
    DL + "log_prob_min_clamp": (lambda v: True, "verl applies it only in the top-k forward KL "
                                                "(not built); its single-sample estimators do "
                                                "not read it either"),
    DL + "policy_loss_mode": (lambda v: v == "vanilla",
                              "the signal joins the advantage of the one policy loss, "
                              "algorithm.policy_loss (actor_rollout_ref.actor.policy_loss."
                              "loss_mode); verl offers only vanilla here too"),
    **{DL + n: (lambda v: v == 0.2,
                "the signal is added to the advantage and clipped with the policy loss's range, "
                "algorithm.clip_ratio_low/high (actor_rollout_ref.actor.clip_ratio_low/high): "
                "set those; only verl's default 0.2 is accepted here")
       for n in ("clip_ratio", "clip_ratio_low", "clip_ratio_high")},
    **{k: (lambda v: True, "verl's dataclass path for Hydra")
       for k in (D + "_target_", DL + "_target_", DT + "_target_")},
}
"""verl's distillation keys with no effect here at the values accepted (each with its reason)."""
DISTILL_KEYS = set(DISTILL_DEFAULTS) | set(DISTILL_NO_EFFECT) | {D + "enabled"}
"""verl's distillation keys (its newer generated config; the vendored defaults file lacks them)."""
# verl's fully-async recipe (recipe/fully_async_policy): its partial-rollout switch means what
# ours does (generations in flight go on with the new weights); its other keys are refused by
# pattern, with the reason (REFUSED_PATTERNS)
VERL_TO_OURS["async_training.partial_rollout"] = _to("rollout.partial_rollout")
FULLY_ASYNC_KEYS = {"async_training.partial_rollout"}
"""The fully-async recipe's keys that map (its own config, not in verl's generated default)."""
DAPO_KEYS = {k for k in VERL_TO_OURS if k.startswith(("algorithm.filter_groups.",
                                                       "reward_model.overlong_buffer.",
                                                       "reward_model.reward_kwargs."))} | {
    "data.gen_batch_size", "algorithm.filter_groups._target_"}
"""The keys of verl's DAPO recipe config (``recipe/dapo/config/dapo_trainer.yaml``) and of
today's DAPO scripts (``+reward_model.reward_kwargs.*``, added with Hydra's ``+``), which
verl's generated default lacks."""
READ_WITH_GET = {k for k in VERL_TO_OURS if ".mixed_precision" in k} | DAPO_KEYS | \
    FULLY_ASYNC_KEYS | DISTILL_KEYS | {
    "actor_rollout_ref.model.torch_dtype"}
"""verl keys missing from its generated defaults: verl's FSDP workers read
``fsdp_config.mixed_precision`` with ``.get`` (param bf16, reduce fp32, buffers fp32 when absent),
the DAPO recipe's own keys (:data:`DAPO_KEYS`), and ``model.torch_dtype``, which verl's CISPO
example passes (verl's struct config has no such key; its evident meaning is the compute dtype)."""
VERL_TO_OURS["actor_rollout_ref.ref.fsdp_config.model_dtype"] = _fp32_only(
    "actor_rollout_ref.ref.fsdp_config.model_dtype", "the frozen reference is loaded in "
    "model.dtype (it needs no master copy): model.dtype=bfloat16 gives a bf16 reference")


def _any(v) -> bool:
    return True


def _is(*ok) -> Callable[[object], bool]:
    return lambda v: v in ok




_MEMORY = ("memory placement only: results are the same; the workers keep parameters and "
           "optimizer state on their device")
NO_EFFECT: dict[str, tuple[Callable[[object], bool], str]] = {
    "trainer.project_name": (_any, "a label for verl's loggers (the W&B project with "
                                   "trainer.logger wandb); a run here is named by its run store "
                                   "and --run-name"),
    "trainer.experiment_name": (_any, "a label for verl's loggers; see trainer.project_name"),
    "trainer.critic_warmup": (_is(0), "there is no critic warm-up phase here"),
    A + "fsdp_config.param_offload": (_is(True, False), _MEMORY),
    A + "fsdp_config.optimizer_offload": (_is(True, False), _MEMORY),
    "actor_rollout_ref.ref.fsdp_config.param_offload": (_is(True, False), _MEMORY),
    "critic.model.fsdp_config.param_offload": (_is(True, False), _MEMORY),
    "critic.model.fsdp_config.optimizer_offload": (_is(True, False), _MEMORY),
    R + "log_prob_micro_batch_size_per_gpu": (_any, "memory only; log-probs are recomputed in "
                                              "micro-batches of actor.ppo_micro_batch_size"),
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": (
        _any, "memory only; reference log-probs use micro-batches of actor.ppo_micro_batch_size"),
    "critic.ppo_micro_batch_size_per_gpu": (
        _any, "memory only; the critic trains in micro-batches of actor.ppo_micro_batch_size"),
    "critic.forward_micro_batch_size_per_gpu": (
        _any, "memory only; values are computed in micro-batches of actor.ppo_micro_batch_size"),
    R + "calculate_log_probs": (_is(True, False), "the rollout engines always return the "
                                "sampled tokens' log-probs (training/rollout_probs_diff_* is "
                                "logged every step)"),
    R + "tensor_model_parallel_size": (_is(1), f"tensor parallelism ({MULTI_GPU}) is not "
                                       "offered: the rollout engine (hf or vllm) holds the whole "
                                       "model on each worker (trainer.n_gpus_per_node); give 1"),
    "actor_rollout_ref.hybrid_engine": (_is(True), "rollout is always colocated with training"),
    A + "strategy": (_is("fsdp", "fsdp2"), "training is FSDP2"),
    "data.prompt_key": (_is("prompt"), "datasets use verl's default column names"),
    "data.reward_fn_key": (_is("data_source"), "datasets use verl's default column names"),
    "reward_model.reward_manager": (_is("naive", "dapo"), "one reward manager here (verl's "
                                    "naive: one score per response; dapo's overlong buffer is "
                                    "reward_model.overlong_buffer.*, which applies with either)"),
    "algorithm.filter_groups._target_": (_any, "verl's dataclass path for Hydra"),
    R + "max_num_batched_tokens": (_any, "vLLM's scheduler budget per engine step (throughput "
                                   "and memory only; the sampled tokens are the same)"),
    **{k: (_is(1), f"sequence parallelism ({MULTI_GPU}) is not offered: each worker holds "
                   "whole sequences; give 1")
       for k in ("actor_rollout_ref.ref.ulysses_sequence_parallel_size",
                 A + "ulysses_sequence_parallel_size", "critic.ulysses_sequence_parallel_size",
                 "reward_model.ulysses_sequence_parallel_size")},
    R + "multi_turn.format": (_is("hermes"), "tool calls are parsed in the hermes format "
                              "(<tool_call>{...}</tool_call>, what Qwen2.5/Qwen3 emit) only"),
    R + "multi_turn.tokenization_sanity_check_mode": (
        _any, "nothing is re-tokenised here to check: the sampled ids are kept as sampled and "
              "the tool responses appended as the chat template's ids"),
    R + "multi_turn.use_inference_chat_template": (
        _is(False), "the chat template is used as the model ships it, in rollout and training "
                    "alike"),
    R + "agent.num_workers": (_any, "verl's agent-loop worker count: here the tool host runs "
                              "every row's calls of a turn concurrently"),
}
"""verl keys that change nothing here while their value is accepted (else refused with the
reason)."""


def _bools(v) -> bool:
    return v is True or v is False


def _whole(lo: int) -> Callable[[object], bool]:
    return lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= lo


_FSDP = (A + "fsdp_config.", "actor_rollout_ref.ref.fsdp_config.", "critic.model.fsdp_config.",
         "reward_model.model.fsdp_config.")
_SPEED = "speed or memory only: the same numbers come out"
SPEED_ONLY: dict[str, tuple[Callable[[object], bool], str]] = {
    # how verl's engines place, gather and load weights
    **{p + "fsdp_size": (lambda v: v == -1 or _whole(1)(v),
                         f"{_SPEED} (FSDP's sharding group size, for hybrid sharding across "
                         "nodes); here every worker shards over all the workers") for p in _FSDP},
    **{p + n: (_bools, f"{_SPEED} (FSDP's {n}); FSDP2 here reshards after each forward and "
                       "wraps each decoder layer") for p in _FSDP
       for n in ("forward_prefetch", "reshard_after_forward")},
    **{p + "offload_policy": (_bools, f"{_SPEED} (FSDP2's CPU offload)") for p in _FSDP[:3]},
    **{p + "wrap_policy.min_num_params": (_whole(0), f"{_SPEED} (FSDP's wrapping); FSDP2 here "
                                          "wraps each decoder layer") for p in _FSDP},
    **{p + n: (_bools, f"{_SPEED} ({n}: entropy recomputed in the backward or in chunks; the "
                       "entropy and its gradient are the same)")
       for p in (A, "actor_rollout_ref.ref.", *_FSDP[:3])
       for n in ("entropy_checkpointing", "entropy_from_logits_with_chunking")},
    **{p + "use_torch_compile": (_bools, f"{_SPEED} (torch.compile of verl's entropy and "
                                 "log-prob kernels; the forwards here run eagerly)")
       for p in (A, "actor_rollout_ref.ref.", *_FSDP[:3])},
    "critic.model.enable_gradient_checkpointing": (
        _bools, f"{_SPEED} (activation recomputation in the critic's backward); the actor's "
                "is model.gradient_checkpointing"),
    **{p + "use_shm": (_bools, f"{_SPEED} (verl copies the model files to /dev/shm before "
                       "loading)") for p in ("actor_rollout_ref.model.", "critic.model.",
                                              "reward_model.model.", "data.")},
    A + "checkpoint.async_save": (_bools, f"{_SPEED}: a checkpoint here is whole, hashed and "
                                  "committed before the step is marked done"),
    "critic.checkpoint.async_save": (_bools, f"{_SPEED}: see {A}checkpoint.async_save"),
    "data.dataloader_num_workers": (_whole(0), f"{_SPEED} (rows are read from parquet in the "
                                    "controller; the order is the seeded sampler's)"),
    "data.filter_overlong_prompts_workers": (_whole(1), f"{_SPEED}: see "
                                             "data.filter_overlong_prompts"),
    # how verl drives vLLM/SGLang (the hf engine has none of these; vllm: the same tokens)
    R + "load_format": (lambda v: isinstance(v, str), f"{_SPEED} (how verl's rollout engine "
                        "first loads weights it then replaces); the engine here starts from "
                        "the trainer's current weights"),
    R + "layered_summon": (_bools, f"{_SPEED} (gathering LoRA/FSDP weights layer by layer for "
                           "the rollout engine)"),
    R + "multi_stage_wake_up": (_bools, f"{_SPEED} (waking vLLM's weights and KV cache in two "
                                "steps)"),
    R + "enable_prefix_caching": (_bools, f"{_SPEED} (vLLM's prefix cache; the hf engine "
                                  "prefills a shared prompt once)"),
    R + "disable_log_stats": (_bools, "vLLM's own statistics log; the step log has the "
                              "rollout's timings"),
    R + "skip_tokenizer_init": (_bools, f"{_SPEED}: vLLM here takes and returns token ids "
                                "(its tokenizer is never loaded)"),
    R + "cudagraph_capture_sizes": (lambda v: v is None or isinstance(v, list),
                                    f"{_SPEED} (CUDA graphs of vLLM; rollout.enforce_eager "
                                    "switches them on or off)"),
}
"""verl keys that only tune speed or memory (verl's engines' placement, compilation and loading):
accepted at any well-typed value, no effect here (docs/verl-keys.md, "Speed and memory only")."""
NO_EFFECT.update(SPEED_ONLY)

_RM_SERVED = ("how verl serves a reward model (a vLLM/SGLang server in its reward loop); here the "
              "reward model is a Hugging Face forward in each trainer worker, over whole "
              "sequences up to reward_model.max_length")
RM_SERVING: dict[str, tuple[Callable[[object], bool], str]] = {
    **{f"reward_model.rollout.{n}": (_any, _RM_SERVED) for n in (
        "name", "dtype", "gpu_memory_utilization", "enforce_eager", "cudagraph_capture_sizes",
        "free_cache_engine", "data_parallel_size", "expert_parallel_size",
        "max_num_batched_tokens", "max_model_len", "max_num_seqs", "load_format",
        "engine_kwargs", "limit_images", "enable_chunked_prefill", "enable_prefix_caching",
        "disable_log_stats", "skip_tokenizer_init", "prompt_length", "response_length")},
    "reward_model.rollout.tensor_model_parallel_size": (
        _is(1), f"tensor parallelism ({MULTI_GPU}) is not offered; the reward model is whole on "
                "each worker: give 1"),
    "reward_model.num_workers": (_whole(1), f"{_SPEED} (verl's reward-loop workers)"),
    "reward_model.use_reward_loop": (_bools, "which of verl's two reward paths scores (its "
                                     "reward loop or the legacy worker): one path here, the "
                                     "same scores"),
    "reward_model.model.use_remove_padding": (_bools, f"{_SPEED} (the reward model's forward)"),
    "reward_model.model.fsdp_config.param_offload": (_bools, _MEMORY),
    "trainer.use_legacy_worker_impl": (_is("auto", "enable", "disable"),
                                       "which of verl's worker classes runs; one here"),
    R + "over_sample_rate": (lambda v: isinstance(v, (int, float)) and 0 <= v < 1,
                             "verl at b178a3c reads it nowhere (an early stop of the slowest "
                             "rollouts its SGLang server once had): every response runs to its "
                             "end, there and here"),
    **{k: (_any, "profiling only (verl's nsys / torch / torch_memory profilers): not run here; "
                 "the numbers are the same (torch.profiler around a phase is the way here)")
       for k in ("global_profiler.tool", "global_profiler.steps",
                 "global_profiler.profile_continuous_steps", "global_profiler.save_path",
                 *(f"global_profiler.global_tool_config.torch_memory.{n}" for n in (
                     "trace_alloc_max_entries", "stack_depth", "context")))},
    **{p + "checkpoint.save_contents": (
        lambda v: isinstance(v, (list, tuple)) and bool(v) and
        set(v) <= {"model", "optimizer", "extra", "hf_model"},
        "a checkpoint here always holds the weights, the optimizer and the RNG state (a resume "
        "is exact) and the run's end exports a Hugging Face folder (verl's hf_model)")
       for p in (A, "critic.")},
}
"""verl keys of its reward-model server, profilers and worker choice: accepted, no effect here
(each with its reason)."""
NO_EFFECT.update(RM_SERVING)
NO_EFFECT.update(DISTILL_NO_EFFECT)

REFUSED: dict[str, str] = {
    "critic.model.lora_rank": "LoRA on the critic is not offered: the critic trains fully "
                              "(actor_rollout_ref.model.lora_rank adapts the policy)",
    R + "multi_turn.num_repeat_rollouts": "not offered: each prompt's rollout.n responses are "
                                          "sampled afresh",
    R + "agent.custom_async_server.": "a custom async rollout server is not offered: a "
                                      "custom agent loop (agent.default_agent_loop, "
                                      "rollout.agent_loop) drives the run's engine",
    "actor_rollout_ref.model.trust_remote_code": "a model folder's own Python code is never run "
                                                 "here (only architectures transformers ships "
                                                 "load; the folder is checked before loading)",
    "data.trust_remote_code": "a model folder's own Python code is never run here",
    "actor_rollout_ref.model.external_lib": "no external model libraries are imported",
    "trainer.default_local_dir": "the run store is where checkpoints go: the plain loop's "
                                 "--workdir (python -m verl_core.train takes "
                                 "trainer.default_local_dir=DIR for it), the workflow's "
                                 "store input",
}
"""verl keys (or prefixes, ending in ``.``) refused at any value other than verl's default,
each with its reason (a key with no entry gets the generic one)."""


_ROLES = r"(actor_rollout_ref\.(actor|ref|rollout)|critic|reward_model)"
PATTERN_NO_EFFECT: list[tuple[re.Pattern, Callable[[object], bool], str]] = [
    (re.compile(p), ok, why) for p, ok, why in (
        (rf"^({_ROLES}\.)?(profiler|global_profiler)\.", _any,
         "profiling only (verl's nsys / torch / npu profilers): not run here; the numbers are "
         "the same"),
        (r"\.tiled_mlp\.", _any, f"{_SPEED} (verl's tiled MLP)"),
        (r"\.enable_activation_offload$", _bools, f"{_SPEED} (activations offloaded to CPU)"),
        (r"\.(use_liger|use_fused_kernels|fused_kernel_options\.impl_backend)$", _any,
         f"{_SPEED} (fused kernels; the forwards here are the model's own)"),
        (r"fsdp_config\.(use_orig_params|strategy|forward_only)$", _any,
         f"{_SPEED} (FSDP's internals; training is FSDP2)"),
        (r"^(actor_rollout_ref\.ref|critic|reward_model)\.strategy$", _is("fsdp", "fsdp2"),
         "training is FSDP2"),
        (r"\.checkpoint\.load_contents$", _any, "a checkpoint here is always loaded whole"),
        (r"^actor_rollout_ref\.rollout\.(checkpoint_engine|trace)\.", _any,
         f"{_SPEED} (how weights reach verl's rollout server; its request tracing)"),
        (r"^actor_rollout_ref\.rollout\.scheduling_policy$", _any, f"{_SPEED} (vLLM's queue)"),
        (r"^actor_rollout_ref\.rollout\.prometheus\.", _any,
         "metrics export of verl's rollout server; the step log and trackers have the "
         "rollout's numbers"),
        (r"^ray_kwargs\.ray_init\.num_cpus$", _any,
         f"{_SPEED}: Ray is started by the workflow or the cluster (docs/cluster.md)"),
        (r"^(trainer\.ray_wait_register_center_timeout|"
         r"actor_rollout_ref\.nccl_timeout|ray_kwargs\.timeline_json_file)$", _any,
         "verl's own Ray and NCCL timeouts and traces; the guard's timeouts are guard.*"),
    )]
"""verl keys accepted by pattern at any well-typed value, no effect here, each with its reason."""

REFUSED_PATTERNS: list[tuple[re.Pattern, str]] = [
    (re.compile(p), why) for p, why in (
        (r"\.(data|expert|pipeline_model)_parallel_size$|fsdp_config\.ulysses_sequence_parallel|"
         r"^reward_model\.(n_gpus_per_node|nnodes|enable_resource_pool)$",
         f"{MULTI_GPU} (data, expert or pipeline parallel engines, a reward model on its own "
         "GPUs) is not offered: each worker holds the whole model; give 1"),
        (r"\.mtp\.", "multi-token-prediction heads are not built yet (no model family here "
                      "has them)"),
        (r"freeze_vision_tower|^data\.(image_key|video_key|image_patch_size|"
         r"return_multi_modal_inputs)$|limit_images",
         "vision-language models are not built yet: text models only"),
        (r"optim\.(optimizer|optimizer_impl|override_optimizer_config)$",
         "the optimizer is AdamW (torch's, fused where it can be); another one is not built yet"),
        (r"optim\.num_cycles$", "the cosine schedule is half a cycle (verl's 0.5), to "
                                 "optim.min_lr_ratio"),
        (r"optim\.total_training_steps$", "verl's trainer sets it from "
                                           "trainer.total_training_steps / total_epochs: give those"),
        (r"\.rollout_n$", "it is actor_rollout_ref.rollout.n (verl interpolates it): give that"),
        (r"(^|\.)(seed|data_loader_seed)$", "one seed here for the whole run (seed, --set "
                                            "seed=N): every phase's randomness derives from it"),
        (r"full_determinism$", "GPU-only: torch's deterministic CUDA kernels are not switched on "
                               "here (a CPU run is deterministic given the seed)"),
        (r"^(actor_rollout_ref\.actor|critic)\.shuffle$",
         "mini-batches are taken in the batch's seeded order (verl's default shuffle=False)"),
        (r"^critic\.(ppo_epochs|ppo_mini_batch_size|ppo_micro_batch_size|"
         r"forward_micro_batch_size|grad_clip|loss_agg_mode)$|^critic\.optim\.",
         "the critic trains with the actor's update sizes, clip and optimizer settings here "
         "(actor_rollout_ref.actor.*; its own lr is critic.optim.lr)"),
        (r"^critic\.model\.(lora_alpha|target_modules)$",
         "LoRA on the critic is not offered: the critic trains fully"),
        (r"^(reward_manager|reward_model\.(reward_loop_|sandbox_fusion|launch_reward_fn_async))",
         "verl's pluggable reward managers are not built yet: the reward is reward.scorer (a "
         "rule scorer by data_source, or your Python function)"),
        (r"^data\.(custom_cls|datagen|sampler)\.", "verl's custom dataset, generator and "
                                                    "sampler classes are not loaded: datasets "
                                                    "are parquet in verl's layout"),
        (r"^actor_rollout_ref\.rollout\.engine_kwargs\.",
         "engine arguments are set by the project (docs/vllm.md), not passed through"),
        (r"^trainer\.(default_hdfs_dir|del_local_ckpt_after_load|rollout_data_dir|"
         r"validation_data_dir|max_critic_ckpt_to_keep)$",
         "checkpoints and dumps live in the run store (checkpoint.keep_last keeps the actor's "
         "and the critic's together)"),
        (r"^transfer_queue\.", "verl's transfer queue is not built: phases hand data over "
                               "through the run store"),
        (r"^async_training\.(?!partial_rollout$)",
         "verl's fully-async recipe bounds the share of a batch sampled by older weights "
         "(staleness_threshold, a fraction of samples) and syncs weights every "
         "trigger_parameter_sync_step updates; here the bound is on the lag itself, the same "
         "for every row: rollout.max_staleness=k (step t samples the weights of step t - k, "
         "docs/async.md)"),
        (r"\.(trust_remote_code|external_lib)$", "a model folder's own Python code and external "
                                                 "model libraries are never run here"),
        (r"(tokenizer_path|hf_config_path|input_tokenizer|^data\.tokenizer)$",
         "the tokenizer and the model config are read from the model's own folder (model.path; "
         "the reward model's from reward_model.path)"),
        (r"^(critic|reward_model)\.model\.override_config(\.|$)",
         "the critic starts from the actor's model (its config.json fields are "
         "actor_rollout_ref.model.override_config's) and the reward model is loaded as its folder "
         "has it; edit a copy of the folder for another config"),
        (r"^distillation\.teacher_models\.(?!teacher_model\.)",
         "one teacher here (algorithm.distill_teacher_path, verl's "
         "distillation.teacher_models.teacher_model.*): multi-teacher distillation (routing rows "
         "by distillation.teacher_key) is not built"),
        (r"^actor_rollout_ref\.rollout\.quantization",
         "GPU-only: quantized (FP8) rollouts are not built here; the engine samples in "
         "model.dtype"),
    )]
"""verl keys refused by pattern at any value but verl's default, each with its reason."""


def _refusal(key: str) -> str | None:
    for k, why in REFUSED.items():
        if key == k or k.endswith(".") and key.startswith(k):
            return why
    return next((why for pattern, why in REFUSED_PATTERNS if pattern.search(key)), None)
