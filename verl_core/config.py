"""Run configuration: small frozen dataclasses, validated at construction.

The same dataclasses are the Flyte task inputs: a :class:`RunConfig` crosses task boundaries
inside the run spec, as canonical JSON of its non-default fields (the spec's type transformer in
``tasks/common.py``), so there is no second config system. Field names follow verl's YAML where
a verl user would look for them (``ppo_mini_batch_size``, ``clip_ratio_low``,
``norm_adv_by_std_in_grpo``, ``kl_loss_type`` …).

Every field is checked against its annotation first (type; numbers finite), then its range; every
invalid value raises :class:`ConfigError` naming ``section.field`` and what to do. Derived
values are properties, never fields filled in at runtime. Presets are plain constructors at the
bottom of this file.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import numbers
import typing
from dataclasses import dataclass, field

from verl_core.algorithms.advantages import ADVANTAGE_ESTIMATORS, EstimatorTraits
from verl_core.algorithms.policy_losses import POLICY_LOSSES as POLICY_LOSS_REGISTRY
from verl_core.algorithms.policy_losses import PolicyLossOptions


class ConfigError(ValueError):
    """A configuration value is invalid. The message names the field and the fix."""


def _fail(section: str, name: str, value, why: str) -> None:
    raise ConfigError(f"{section}.{name}={value!r}: {why}")


_KINDS = {bool: "True or False", int: "an integer", float: "a finite number", str: "a string"}


@functools.cache
def _fields_of(cls) -> dict[str, tuple[type, object]]:
    """``{name: (annotated type, default)}``; the annotations resolved, since ``from __future__
    import annotations`` leaves strings in ``dataclasses.fields``."""
    hints = typing.get_type_hints(cls)
    return {f.name: (hints[f.name], f.default) for f in dataclasses.fields(cls)}


def _coerce(kind: type, value):
    """``value`` as ``kind``, or None when it is not one. A float field takes ints (2 -> 2.0) and
    an int field integral floats (4.0 -> 4, what JSON tools and ``1e3`` give), so equal configs
    serialise, and hash, the same. bool is never a number here, though Python says it is an int."""
    if isinstance(value, bool):
        return value if kind is bool else None
    if kind is float and isinstance(value, numbers.Real):
        try:
            f = float(value)
        except OverflowError:  # an int beyond float range
            return None
        return f if math.isfinite(f) else None
    if kind is int and isinstance(value, numbers.Integral):
        return int(value)
    if kind is int and isinstance(value, numbers.Real) and math.isfinite(value) \
            and float(value).is_integer():
        return int(value)
    if kind is str and isinstance(value, str):
        return value
    if kind not in _KINDS and isinstance(value, kind):
        return value
    return None


def _checked(section: str, name: str, kind: type, default, value):
    """``value`` canonicalised for a field annotated ``kind``, or ConfigError naming the field."""
    ok = _coerce(kind, value)
    if ok is None:
        what = _KINDS.get(kind, f"a {kind.__name__}")
        got = f"not {type(value).__name__}"
        if kind is float and isinstance(value, numbers.Real) and not isinstance(value, bool):
            got = "NaN and infinity are refused"
        hint = "" if default is dataclasses.MISSING else f"; e.g. the default {default!r}"
        _fail(section, name, value, f"must be {what} ({got}){hint}")
    return ok


def _check_types(section: str, obj) -> None:
    """The type pass every section runs first, driven by the field annotations: an int field
    refuses 2.5 and True, a float field refuses "abc", NaN and infinity, a str field refuses
    numbers. Valid values are stored canonicalised (see :func:`_coerce`); the range checks of
    each section run after it, on values of the right type."""
    for name, (kind, default) in _fields_of(type(obj)).items():
        value = getattr(obj, name)
        ok = _checked(section, name, kind, default, value)
        if ok is not value:
            object.__setattr__(obj, name, ok)  # frozen: store the canonical value, once, here


def _positive(section: str, obj, *names: str) -> None:
    for n in names:
        v = getattr(obj, n)
        if v is None or v <= 0:
            _fail(section, n, v, "must be > 0")


def _non_negative(section: str, obj, *names: str) -> None:
    for n in names:
        v = getattr(obj, n)
        if v is None or v < 0:
            _fail(section, n, v, "must be >= 0")


def _one_of(section: str, name: str, value, allowed) -> None:
    if value not in allowed:
        _fail(section, name, value, f"unknown value; known: {', '.join(sorted(allowed))}")


TRAJECTORY = "trajectory"
"""Field metadata: whether the field decides the training trajectory (the state after step k for
every k; :meth:`RunConfig.trajectory_hash`): True, False, or a predicate of the
:class:`RunConfig`. Every field declares it through :func:`in_trajectory` or
:func:`not_in_trajectory` (a test walks them all), so no new field joins the trajectory, or
leaves it, silently."""


def in_trajectory(default=dataclasses.MISSING, *, factory=dataclasses.MISSING, when=None):
    """A field that decides the trajectory; with ``when``, only in the configs where
    ``when(run)`` holds."""
    return field(default=default, default_factory=factory, metadata={TRAJECTORY: when or True})


def not_in_trajectory(default=dataclasses.MISSING, *, factory=dataclasses.MISSING):
    """A field that never changes the trajectory (evaluation, checkpointing, reports, wall-clock
    limits, memory-only sizes, where the workers run): a run that changes it continues from the
    same checkpoints and lineage."""
    return field(default=default, default_factory=factory, metadata={TRAJECTORY: False})


def _lr_depends_on_run_length(run: RunConfig) -> bool:
    """``total_steps``: a cosine schedule's LR at step k depends on the run length; with a
    constant one ``--steps 300`` after 200 extends the same trajectory."""
    return run.optim.lr_schedule != "constant"


def _assets_set(run: RunConfig) -> bool:
    """``data.assets_id`` unset: the run hashes as before the field existed."""
    return bool(run.data.assets_id)


def _reward_model_on(run: RunConfig) -> bool:
    """``reward_model`` off: its other fields do nothing, and the run hashes as before the section
    existed."""
    return run.reward_model.enable


@dataclass(frozen=True)
class DataConfig:
    """Where prompts come from and how they are batched."""

    train_files: str = in_trajectory("")
    """Comma-separated parquet files/URIs in verl's row layout. Empty: generate the synthetic task."""
    val_files: str = in_trajectory("")
    """Comma-separated held-out parquet files/URIs. Empty: the synthetic task's held-out split."""
    train_batch_size: int = in_trajectory(64)
    """B: prompts per RL step (each is sampled ``rollout.n`` times). The demo's 64 (not 32)
    halves the variance of each policy-gradient step; with 32, held-out accuracy wandered by
    +-0.05 between evaluations and seed 2 ended 0.02 below its start (BENCHMARKS.md "Accuracy")."""
    val_batch_size: int = not_in_trajectory(256)
    """Prompts per greedy-evaluation forward pass (memory only; does not change results)."""
    max_prompt_length: int = in_trajectory(64)
    """Prompts longer than this many tokens fail validation (they are not silently truncated)."""
    shuffle: bool = in_trajectory(True)
    """Shuffle the training prompts each epoch (seeded by ``run.seed``)."""
    synthetic_task: str = in_trajectory("arithmetic")
    """Synthetic verifiable task generated when ``train_files`` is empty."""
    synthetic_train_size: int = in_trajectory(3000)
    """Rows in the generated training split."""
    synthetic_val_size: int = in_trajectory(500)
    """Rows in the generated held-out split (disjoint from training). 500 makes the standard
    error of one accuracy <= 0.022 (sqrt(0.25 / 500)), of a gain <= 0.032."""
    synthetic_max_operand: int = in_trajectory(50)
    """Largest operand of the generated arithmetic problems."""
    assets_id: str = in_trajectory("", when=_assets_set)
    """Empty: a run trains on the files it recorded when it first ran (a dataset or model file
    changed since is refused at resume, naming it). An asset index id (the refusal prints it):
    train on the files as they are now, as a new trajectory of the run (from step 0)."""

    def __post_init__(self):
        _check_types("data", self)
        _positive("data", self, "train_batch_size", "val_batch_size", "max_prompt_length",
                  "synthetic_train_size", "synthetic_val_size", "synthetic_max_operand")
        _one_of("data", "synthetic_task", self.synthetic_task, {"arithmetic"})
        m = self.synthetic_max_operand
        unique = (m + 1) ** 2 + (m + 1) * (m + 2) // 2  # a+b, and a-b with a >= b
        if not self.train_files and self.synthetic_train_size + self.synthetic_val_size > unique:
            _fail("data", "synthetic_train_size", self.synthetic_train_size,
                  f"+ synthetic_val_size={self.synthetic_val_size} exceeds the {unique} unique "
                  f"problems with synthetic_max_operand={m}; raise synthetic_max_operand")
        if bool(self.train_files) != bool(self.val_files) and not self.train_files:
            _fail("data", "train_files", self.train_files,
                  "val_files is set but train_files is empty; give both or neither")

    @property
    def train_file_list(self) -> list[str]:
        return [f.strip() for f in self.train_files.split(",") if f.strip()]

    @property
    def val_file_list(self) -> list[str]:
        return [f.strip() for f in self.val_files.split(",") if f.strip()]


@dataclass(frozen=True)
class ModelConfig:
    """The policy (and reference/critic initialisation)."""

    path: str = in_trajectory("")
    """A local Hugging Face folder (config.json, safetensors, tokenizer.json). Empty: build the
    tiny model and warm-start it on the synthetic task."""
    tiny_hidden_size: int = in_trajectory(64)
    """Hidden size of the tiny Llama-style model built when ``path`` is empty."""
    tiny_layers: int = in_trajectory(2)
    """Decoder layers of the tiny model."""
    tiny_heads: int = in_trajectory(2)
    """Attention heads of the tiny model: 2 gives a head size of 32 at the default hidden size,
    the smallest vLLM's CPU attention kernel runs (it takes 32, 64, 80 and up)."""
    warmup_sft_steps: int = in_trajectory(2000)
    """Most supervised warm-start steps on the synthetic task (only when ``path`` is empty)."""
    warmup_target_accuracy: float = in_trajectory(0.25)
    """The warm start stops once greedy accuracy on a slice of the *training* split reaches this,
    so RL starts from partial accuracy: not zero (no reward signal), not full (nothing to learn).
    1.0 disables the early stop. The held-out split is never looked at. The demo's 0.25 (held-out
    0.16-0.26) leaves RL room to add what the warm start did not."""
    warmup_sft_lr: float = in_trajectory(3e-3)
    """Learning rate of the supervised warm start."""
    warmup_sft_batch_size: int = in_trajectory(64)
    """Batch size of the supervised warm start."""
    dtype: str = in_trajectory("float32")
    """Compute dtype for training: float32, or bfloat16 (bf16 matmuls over float32 master weights
    and float32 AdamW state, as verl's FSDP mixed precision; the reference model and the rollout
    copy are held in bf16). A bf16 checkpoint is still loaded into float32 masters."""
    gradient_checkpointing: bool = in_trajectory(False)
    """Recompute activations in backward to save memory (large models)."""

    def __post_init__(self):
        _check_types("model", self)
        _positive("model", self, "tiny_hidden_size", "tiny_layers", "tiny_heads",
                  "warmup_sft_batch_size")
        _non_negative("model", self, "warmup_sft_steps")
        _positive("model", self, "warmup_sft_lr")
        if not 0.0 < self.warmup_target_accuracy <= 1.0:
            _fail("model", "warmup_target_accuracy", self.warmup_target_accuracy,
                  "must be in (0, 1]")
        if self.tiny_hidden_size % self.tiny_heads:
            _fail("model", "tiny_hidden_size", self.tiny_hidden_size,
                  f"must be divisible by model.tiny_heads={self.tiny_heads}")
        _one_of("model", "dtype", self.dtype, {"float32", "bfloat16"})


@dataclass(frozen=True)
class RolloutConfig:
    """Sampling of responses."""

    engine: str = in_trajectory("hf")
    """Rollout engine: ``hf`` (torch, CPU and GPU) or ``vllm`` (vLLM in the worker: on a CUDA GPU
    with ``pip install -e '.[vllm]'``, or on CPU with vLLM's CPU backend, ``bash .ci/install
    vllm``; checked when the run is prepared and when the engine is built)."""
    n: int = in_trajectory(8)
    """G: responses sampled per prompt (GRPO/RLOO need G > 1)."""
    temperature: float = in_trajectory(1.0)
    """Sampling temperature; 0 means greedy. Log-probs and the loss use the same temperature.
    1.0 is verl's default and ours for a model you bring; the built-in demo (no ``model.path``)
    samples at :data:`DEMO_TEMPERATURE` unless this is set (see :func:`grpo_preset`)."""
    top_p: float = in_trajectory(1.0)
    """Nucleus sampling mass in (0, 1]; 1 disables it."""
    top_k: int = in_trajectory(-1)
    """Keep the k most likely tokens; -1 disables it (verl's convention)."""
    max_new_tokens: int = in_trajectory(8)
    """T: most response tokens; generation stops earlier at EOS."""
    micro_batch_size: int = not_in_trajectory(512)
    """Sequences per generation forward pass (memory only; results do not depend on it)."""
    gpu_memory_utilization: float = in_trajectory(0.5)
    """vLLM on a GPU only: fraction of GPU memory for weights + KV cache. (vLLM's CPU backend
    would take this fraction of the machine's RAM; there ``cpu_kv_cache_gib`` sizes it.)"""
    cpu_kv_cache_gib: float = in_trajectory(0.5)
    """vLLM on CPU only: GiB of RAM for the KV cache (vLLM's ``kv_cache_memory_bytes``), set
    here so it never follows the machine's RAM. A token of cache takes 2 x layers x KV heads x
    head size x dtype bytes (1 KiB for the tiny model in float32: 0.5 GiB holds 512k tokens;
    56 KiB for Qwen2.5-7B in bfloat16: ~9k); vLLM refuses to start when one
    ``data.max_prompt_length + rollout.max_new_tokens`` sequence does not fit."""
    enforce_eager: bool = in_trajectory(True)
    """vLLM only: run without CUDA graphs (faster start, less memory, slower decoding)."""
    free_cache_engine: bool = in_trajectory(True)
    """vLLM only: sleep after each generation (KV cache freed, weights offloaded to CPU) so
    training gets the GPU memory back; False keeps vLLM resident."""

    def __post_init__(self):
        _check_types("rollout", self)
        _one_of("rollout", "engine", self.engine, {"hf", "vllm"})
        if self.engine == "vllm" and self.temperature > 2.0:
            _fail("rollout", "temperature", self.temperature,
                  "vLLM accepts temperatures in [0, 2]; lower it or use rollout.engine='hf'")
        _positive("rollout", self, "n", "max_new_tokens", "micro_batch_size")
        _non_negative("rollout", self, "temperature")
        if not 0.0 < self.top_p <= 1.0:
            _fail("rollout", "top_p", self.top_p, "must be in (0, 1]")
        if self.top_k == 0 or self.top_k < -1:
            _fail("rollout", "top_k", self.top_k, "must be -1 (disabled) or >= 1")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            _fail("rollout", "gpu_memory_utilization", self.gpu_memory_utilization,
                  "must be in (0, 1]")
        _positive("rollout", self, "cpu_kv_cache_gib")


@dataclass(frozen=True)
class RewardConfig:
    """How responses are scored."""

    scorer: str = in_trajectory("auto")
    """``auto`` (pick a rule scorer by each row's data_source), ``arithmetic``, ``gsm8k``, or a
    custom ``path/to/file.py:function`` / ``module:function`` with verl's signature
    ``fn(data_source, solution_str, ground_truth, extra_info) -> float | dict``."""
    timeout_s: float = in_trajectory(10.0)
    """Per-call timeout of a custom scorer (run in a worker process); a timeout scores
    ``timeout_score`` and is counted in the metrics."""
    timeout_score: float = in_trajectory(0.0)
    """Score given to a response whose custom scorer timed out."""
    # a run that completes scores the same whatever the next four are
    num_workers: int = not_in_trajectory(2)
    """Worker processes for custom scorers."""
    import_timeout_s: float = not_in_trajectory(60.0)
    """Deadline for loading a custom scorer in a worker, its import included; one that hangs or
    kills its process while loading fails the run with an error naming it."""
    max_timeout_fraction: float = not_in_trajectory(0.5)
    """A batch in which more than this fraction of custom-scorer calls time out triggers
    ``on_timeouts`` (every timeout is logged and counted in ``reward/timeouts`` anyway)."""
    on_timeouts: str = not_in_trajectory("fail")
    """``fail`` (an error naming the scorer) or ``warn`` (log it, keep the ``timeout_score``
    rewards) when a batch has more than ``max_timeout_fraction`` timed-out calls."""

    def __post_init__(self):
        _check_types("reward", self)
        if not self.scorer:
            _fail("reward", "scorer", self.scorer, "must not be empty; use 'auto'")
        _positive("reward", self, "timeout_s", "num_workers", "import_timeout_s")
        if not 0.0 <= self.max_timeout_fraction <= 1.0:
            _fail("reward", "max_timeout_fraction", self.max_timeout_fraction,
                  "must be in [0, 1] (1 never fails on timeouts)")
        _one_of("reward", "on_timeouts", self.on_timeouts, {"fail", "warn"})


REWARD_MODEL_COMBINE = ("replace", "add")
"""How a reward model's score meets the ``reward.scorer`` score (``RewardModelConfig.combine``)."""


@dataclass(frozen=True)
class RewardModelConfig:
    """A model-based reward, as verl's ``reward_model`` section: a local Hugging Face
    sequence-classification model (one label) scores prompt + response on the run's workers
    (``verl_core/reward/model.py``). What does not carry over from verl 0.9 (a serving engine and
    resource pool for the RM, a custom reward function that queries it, truncation) and why:
    docs/rewards.md."""

    enable: bool = in_trajectory(False)
    """Score responses with the reward model (verl's ``reward_model.enable``)."""
    path: str = in_trajectory("")
    """Local Hugging Face folder of an ``AutoModelForSequenceClassification`` with
    ``num_labels=1`` and its tokenizer (verl's ``reward_model.model.path``)."""
    combine: str = in_trajectory("replace")
    """``replace``: the model's score is the reward, as in verl 0.9 (``reward.scorer`` then only
    scores evaluation); ``add``: reward = ``reward.scorer``'s score + the model's score."""
    micro_batch_size: int = not_in_trajectory(64)
    """Sequences per reward-model forward pass on each worker (verl's
    ``micro_batch_size_per_gpu``; memory only: scores do not depend on it)."""
    max_length: int = not_in_trajectory(0)
    """Most tokens of one reward-model input; a longer one is an error naming the row (verl
    truncates it instead). 0: the model's ``max_position_embeddings``."""
    dtype: str = in_trajectory("float32")
    """Parameter dtype of the reward model: float32 or bfloat16."""

    def __post_init__(self):
        _check_types("reward_model", self)
        if self.enable and not self.path:
            _fail("reward_model", "path", self.path,
                  "reward_model.enable=True needs a local Hugging Face folder of a "
                  "sequence-classification model with num_labels=1; set reward_model.path")
        _one_of("reward_model", "combine", self.combine, REWARD_MODEL_COMBINE)
        _positive("reward_model", self, "micro_batch_size")
        _non_negative("reward_model", self, "max_length")
        _one_of("reward_model", "dtype", self.dtype, {"float32", "bfloat16"})


POLICY_LOSSES = ("vanilla", "gspo", "cispo", "dppo_tv", "dppo_kl", "sapo", "geo_mean", "gpg",
                 "dro", "clip_cov", "kl_cov", "bypass_mode")
KL_TYPES = ("k1", "k2", "k3", "abs", "low_var_kl", "kl", "mse",
            "k1+", "k2+", "k3+", "abs+", "low_var_kl+", "kl+", "mse+")
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean",
                  "seq-mean-token-sum-norm", "token-sum")
ROLLOUT_IS_LEVELS = ("", "token", "sequence")
BYPASS_LOSS_TYPES = ("ppo_clip", "reinforce")


@dataclass(frozen=True)
class AlgorithmConfig(PolicyLossOptions):
    """Advantage estimation, policy loss and KL regularisation (verl's ``algorithm`` +
    ``actor`` loss fields). The options only some losses read (verl's ``actor.policy_loss.*``,
    ``actor.tau_*``, ``algorithm.rollout_correction.*``) are the fields it inherits from
    :class:`~verl_core.algorithms.policy_losses.PolicyLossOptions`; their checks are here."""

    adv_estimator: str = in_trajectory("grpo")
    """Advantage estimator: a name (or alias) of ``ADVANTAGE_ESTIMATORS``
    (``verl_core/algorithms/advantages.py``), whose entry's traits say what it needs: ``gae``
    trains a critic, the group estimators need ``rollout.n >= 2``, ``remax`` a greedy rollout."""
    gamma: float = in_trajectory(1.0)
    """Discount factor (gae, reinforce_plus_plus)."""
    lam: float = in_trajectory(1.0)
    """GAE lambda."""
    norm_adv_by_std_in_grpo: bool = in_trajectory(True)
    """GRPO: divide by the group std (False gives Dr.GRPO's mean-only baseline)."""
    policy_loss: str = in_trajectory("vanilla")
    """``vanilla`` (PPO clip with clip-higher and dual-clip), ``gspo``, ``cispo``, ``dppo_tv``,
    ``dppo_kl``, ``sapo``, ``geo_mean``, ``gpg``, ``dro``, ``clip_cov``, ``kl_cov``,
    ``bypass_mode`` (see ``verl_core/algorithms/policy_losses.py``)."""
    clip_ratio_low: float = in_trajectory(0.2)
    """Lower clip: ratio >= 1 - clip_ratio_low."""
    clip_ratio_high: float = in_trajectory(0.28)
    """Upper clip: ratio <= 1 + clip_ratio_high (DAPO's clip-higher when > clip_ratio_low)."""
    clip_ratio_c: float = in_trajectory(3.0)
    """Dual-clip bound for negative advantages (must be > 1)."""
    loss_agg_mode: str = in_trajectory("token-mean")
    """How the token loss matrix is reduced: token-mean, seq-mean-token-sum, seq-mean-token-mean,
    seq-mean-token-sum-norm, token-sum."""
    entropy_coeff: float = in_trajectory(0.0)
    """Entropy bonus coefficient (loss -= entropy_coeff * entropy)."""
    use_kl_loss: bool = in_trajectory(False)
    """Add ``kl_loss_coef * KL(policy || reference)`` to the actor loss (GRPO style)."""
    kl_loss_coef: float = in_trajectory(0.001)
    """Coefficient of the KL loss term."""
    kl_loss_type: str = in_trajectory("low_var_kl")
    """KL estimator for the loss: k1, k2, k3 (= low_var_kl), abs; a ``+`` form (``k3+`` …) keeps
    the value and takes k2's gradient, an unbiased KL gradient (straight-through)."""
    use_kl_in_reward: bool = in_trajectory(False)
    """Subtract ``beta * KL`` from token rewards (PPO/InstructGPT style)."""
    kl_penalty: str = in_trajectory("kl")
    """KL estimator for the reward penalty."""
    kl_ctrl_type: str = in_trajectory("fixed")
    """Reward-KL coefficient controller: fixed or adaptive (Ziegler et al. 2019)."""
    kl_coef: float = in_trajectory(0.001)
    """Initial reward-KL coefficient beta."""
    kl_target: float = in_trajectory(0.1)
    """Adaptive controller: target KL."""
    kl_horizon: int = in_trajectory(10000)
    """Adaptive controller: horizon (in samples)."""
    cliprange_value: float = in_trajectory(0.5)
    """Critic value clipping range."""
    vf_coef: float = in_trajectory(1.0)
    """Weight of the value loss (critic has its own optimizer; kept for verl parity)."""

    loss_scale_factor: float = in_trajectory(0.0)
    """The constant C of ``seq-mean-token-sum-norm`` (Dr. GRPO: the generation budget); 0 divides
    by the batch's padded response width, as verl's null (verl's ``actor.loss_scale_factor``)."""

    def __post_init__(self):
        _check_types("algorithm", self)
        _one_of("algorithm", "adv_estimator", self.adv_estimator,
                set(ADVANTAGE_ESTIMATORS.names(include_aliases=True)))
        _one_of("algorithm", "policy_loss", self.policy_loss, set(POLICY_LOSSES))
        _one_of("algorithm", "kl_loss_type", self.kl_loss_type, set(KL_TYPES))
        _one_of("algorithm", "kl_penalty", self.kl_penalty, set(KL_TYPES))
        _one_of("algorithm", "loss_agg_mode", self.loss_agg_mode, set(LOSS_AGG_MODES))
        _one_of("algorithm", "kl_ctrl_type", self.kl_ctrl_type, {"fixed", "adaptive"})
        if not 0.0 <= self.gamma <= 1.0:
            _fail("algorithm", "gamma", self.gamma, "must be in [0, 1]")
        if not 0.0 <= self.lam <= 1.0:
            _fail("algorithm", "lam", self.lam, "must be in [0, 1]")
        _positive("algorithm", self, "clip_ratio_low", "clip_ratio_high", "cliprange_value",
                  "kl_target", "kl_horizon")
        if self.clip_ratio_low >= 1.0:
            _fail("algorithm", "clip_ratio_low", self.clip_ratio_low, "must be < 1")
        if self.clip_ratio_c <= 1.0:
            _fail("algorithm", "clip_ratio_c", self.clip_ratio_c, "must be > 1 (dual-clip bound)")
        _non_negative("algorithm", self, "entropy_coeff", "kl_loss_coef", "kl_coef", "vf_coef")
        self._check_policy_loss_options()

    def _check_policy_loss_options(self) -> None:
        _non_negative("algorithm", self, "loss_scale_factor", "ppo_kl_coef", "dro_beta",
                      "rollout_is_threshold_lower")
        _positive("algorithm", self, "tau_pos", "tau_neg", "rollout_is_threshold")
        for name in ("clip_cov_ratio", "kl_cov_ratio"):
            if not 0.0 < getattr(self, name) <= 1.0:
                _fail("algorithm", name, getattr(self, name), "must be in (0, 1]")
        if self.clip_cov_lb >= self.clip_cov_ub:
            _fail("algorithm", "clip_cov_lb", self.clip_cov_lb,
                  f"must be < clip_cov_ub={self.clip_cov_ub}")
        if self.policy_loss == "dro" and self.dro_beta <= 0:
            _fail("algorithm", "dro_beta", self.dro_beta, "must be > 0 with policy_loss=dro")
        _one_of("algorithm", "rollout_is", self.rollout_is, set(ROLLOUT_IS_LEVELS))
        if self.rollout_is_threshold_lower > self.rollout_is_threshold:
            _fail("algorithm", "rollout_is_threshold_lower", self.rollout_is_threshold_lower,
                  f"must be <= rollout_is_threshold={self.rollout_is_threshold}")
        _one_of("algorithm", "bypass_loss_type", self.bypass_loss_type, set(BYPASS_LOSS_TYPES))
        if self.old_logp_from_rollout and self.rollout_is_batch_normalize:
            _fail("algorithm", "rollout_is_batch_normalize", True,
                  "is not offered with policy_loss=bypass_mode: its weights are computed per "
                  "micro-batch, so normalising them would make the loss depend on the split")

    @property
    def estimator_traits(self) -> EstimatorTraits:
        """What the advantage estimator needs (critic, groups, greedy baseline, Σπ²), from its
        registry entry."""
        return ADVANTAGE_ESTIMATORS.traits(self.adv_estimator)

    @property
    def uses_critic(self) -> bool:
        return self.estimator_traits.needs_critic

    @property
    def uses_reference(self) -> bool:
        return self.use_kl_loss or self.use_kl_in_reward

    @property
    def old_logp_from_rollout(self) -> bool:
        """The update takes the rollout engine's log-probs as the behaviour policy instead of
        recomputing them (``bypass_mode``, verl's ``rollout_correction.bypass_mode``): the policy
        loss's registry trait."""
        return POLICY_LOSS_REGISTRY.traits(self.policy_loss).old_logp_from_rollout


@dataclass(frozen=True)
class OptimConfig:
    """AdamW + LR schedule for actor and critic."""

    lr: float = in_trajectory(5e-4)
    """Actor peak learning rate."""
    critic_lr: float = in_trajectory(1e-3)
    """Critic peak learning rate."""
    weight_decay: float = in_trajectory(0.0)
    """AdamW weight decay."""
    beta1: float = in_trajectory(0.9)
    """AdamW beta1."""
    beta2: float = in_trajectory(0.99)
    """AdamW beta2."""
    eps: float = in_trajectory(1e-8)
    """AdamW epsilon."""
    warmup_steps: int = in_trajectory(10)
    """Linear LR warmup, in optimizer steps (Adam's second moments settle before full steps)."""
    lr_schedule: str = in_trajectory("constant")
    """After warmup: constant or cosine (to ``min_lr_ratio * lr`` at the last step)."""
    min_lr_ratio: float = in_trajectory(0.1)
    """Cosine floor as a fraction of the peak LR."""
    grad_clip: float = in_trajectory(1.0)
    """Clip the global gradient norm to this value."""

    def __post_init__(self):
        _check_types("optim", self)
        _positive("optim", self, "lr", "critic_lr", "eps", "grad_clip")
        _non_negative("optim", self, "weight_decay", "warmup_steps")
        _one_of("optim", "lr_schedule", self.lr_schedule, {"constant", "cosine"})
        for n in ("beta1", "beta2"):
            if not 0.0 <= getattr(self, n) < 1.0:
                _fail("optim", n, getattr(self, n), "must be in [0, 1)")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            _fail("optim", "min_lr_ratio", self.min_lr_ratio, "must be in [0, 1]")


@dataclass(frozen=True)
class ActorConfig:
    """The PPO update: epochs, mini-batches, micro-batches (verl's ``actor_rollout_ref.actor``
    sizes; named ``actor`` because verl's ``trainer`` section is the run loop)."""

    ppo_epochs: int = in_trajectory(1)
    """Passes over each rollout batch (verl's ``actor_rollout_ref.actor.ppo_epochs``)."""
    ppo_mini_batch_size: int = in_trajectory(32)
    """Prompts per optimizer step (x ``rollout.n`` responses), as in verl: half of
    ``data.train_batch_size``, two optimizer steps per RL step."""
    ppo_micro_batch_size: int = in_trajectory(128)
    """Responses per forward/backward on one worker (gradient accumulation = a worker's rows of
    a mini-batch / this); verl's ``ppo_micro_batch_size_per_gpu``. Memory only: the loss of a
    mini-batch does not depend on it."""
    use_dynamic_bsz: bool = in_trajectory(False)
    """Micro-batches by a token budget instead of ``ppo_micro_batch_size`` rows, for every
    forward the trainer runs (verl's ``use_dynamic_bsz``, all four of its keys): each worker's
    rows sorted by length and cut into runs that fit the ``*_max_token_len_per_gpu`` budget below
    (positions run, padding included: rows x (longest prompt + longest response); a longer row
    gets a micro-batch of its own), each cut to its longest response. Memory and speed only:
    the loss weights make the update the same."""
    ppo_max_token_len_per_gpu: int = in_trajectory(16384)
    """Token budget of one micro-batch of the actor's update (verl's key)."""
    log_prob_max_token_len_per_gpu: int = in_trajectory(16384)
    """Token budget of a no-grad forward of the actor: old log-probs, Σπ² (verl's
    ``rollout.log_prob_max_token_len_per_gpu``)."""
    ref_log_prob_max_token_len_per_gpu: int = in_trajectory(16384)
    """Token budget of a reference log-prob forward (verl's ``ref.log_prob_max_token_len_per_gpu``)."""
    critic_ppo_max_token_len_per_gpu: int = in_trajectory(32768)
    """Token budget of one micro-batch of the critic's update (verl's
    ``critic.ppo_max_token_len_per_gpu``)."""
    critic_forward_max_token_len_per_gpu: int = in_trajectory(32768)
    """Token budget of a no-grad critic forward, the values (verl's
    ``critic.forward_max_token_len_per_gpu``)."""

    def __post_init__(self):
        _check_types("actor", self)
        _positive("actor", self, "ppo_epochs", "ppo_mini_batch_size", "ppo_micro_batch_size",
                  "ppo_max_token_len_per_gpu", "log_prob_max_token_len_per_gpu",
                  "ref_log_prob_max_token_len_per_gpu", "critic_ppo_max_token_len_per_gpu",
                  "critic_forward_max_token_len_per_gpu")

    def token_budget(self, name: str) -> int:
        """``name``'s token budget when ``use_dynamic_bsz``, else 0 (micro-batches of rows)."""
        return getattr(self, name) if self.use_dynamic_bsz else 0


@dataclass(frozen=True)
class TrainerConfig:
    """The worker group (verl's ``trainer.nnodes`` / ``trainer.n_gpus_per_node``)."""

    # the same trajectory on any number of workers (up to rounding)
    nnodes: int = not_in_trajectory(1)
    """Nodes of the worker group (verl's key). Workers = nnodes x n_gpus_per_node."""
    n_gpus_per_node: int = not_in_trajectory(1)
    """Workers per node (verl's key): one per GPU; on a CPU machine, worker processes. With more
    than one worker, training is FSDP2 (gloo on CPU, NCCL on CUDA) and rollout runs on the same
    workers, each on its block of the batch; the batch semantics do not change."""
    worker_timeout_s: float = not_in_trajectory(1800.0)
    """Longest wait on the worker group: one phase call, and every collective between workers.
    Past it the phase fails as transient and its retry rebuilds the group from the store."""
    balance_batch: bool = in_trajectory(True)
    """With W > 1, reorder each forward's rows so that the W workers' blocks hold nearly equal
    token counts (verl's key; Karmarkar-Karp, equal row counts). The same rows, the same result:
    only the wall time of the slowest worker changes."""

    def __post_init__(self):
        _check_types("trainer", self)
        _positive("trainer", self, "nnodes", "n_gpus_per_node", "worker_timeout_s")

    @property
    def world_size(self) -> int:
        """W: workers in the group."""
        return self.nnodes * self.n_gpus_per_node


CLUSTER_MODES = ("per_task", "attached")


@dataclass(frozen=True)
class ClusterConfig:
    """Where the worker group lives on a Flyte cluster (docs/cluster.md). Never changes
    the trajectory: both modes end with the same weights."""

    mode: str = not_in_trajectory("per_task")
    """``per_task``: every heavy phase is a Flyte Ray task with its own Ray cluster (a KubeRay
    RayJob) and rebuilds the workers from the store. ``attached``: phases are plain tasks that
    join one long-lived Ray cluster (``address``), where the workers stay warm between phases as
    detached actors in a per-run namespace."""
    address: str = not_in_trajectory("")
    """``attached``: the Ray cluster to join (``ray://<head>:10001``, ``<head-ip>:6379`` or
    ``auto``); empty: the ``RAY_ADDRESS`` environment variable."""
    idle_timeout_s: float = not_in_trajectory(1800.0)
    """``attached``: detached workers that get no call for this long remove themselves and their
    placement groups (a run that died without reaching finalize frees the cluster); 0: never."""

    def __post_init__(self):
        _check_types("cluster", self)
        _one_of("cluster", "mode", self.mode, CLUSTER_MODES)
        _non_negative("cluster", self, "idle_timeout_s")


@dataclass(frozen=True)
class CheckpointConfig:
    """When and how the durable state is saved (the names users of verl-style trainers know)."""

    checkpoint_interval: int = not_in_trajectory(10)
    """Save a verified checkpoint every k steps (the last step is always saved). Between
    checkpoints a crashed run recovers by replaying the stored batches of the finished updates."""
    checkpoint_interval_s: float = not_in_trajectory(0.0)
    """Also save when this many seconds passed since the last save (0: off)."""
    save_optimizer_state: bool = not_in_trajectory(True)
    """Include optimizer + scheduler state (needed for exact resume; off = weights only)."""
    resume_from_checkpoint: str = not_in_trajectory("auto")
    """``auto`` (newest valid checkpoint of this run store, if any), ``none``, a checkpoint
    manifest path/URI (``<store>/checkpoints/<name>.json``), or another run store's folder (its
    newest valid checkpoint). Anything else is a permanent error at prepare."""
    keep_last: int = not_in_trajectory(3)
    """Keep the newest N checkpoints (0: keep all)."""
    keep_every: int = not_in_trajectory(0)
    """Also keep every checkpoint whose step is a multiple of this (0: off)."""
    async_save: bool = not_in_trajectory(True)
    """Snapshot to CPU memory and write in the background while the next phases run."""
    gc_grace_s: float = not_in_trajectory(600.0)
    """Garbage collection (after retention deletes a checkpoint) never deletes an object younger
    than this. Safety margin only: gc never deletes what a kept checkpoint, the assets, the
    lineage or a pending phase output names, whatever its age."""
    local_dir: str = not_in_trajectory("")
    """Local-disk tier (off when empty): commit checkpoints to ``<local_dir>/<store id>`` first
    and replicate them to the run store in the background (docs/checkpoints.md; W = 1 only)."""

    def __post_init__(self):
        _check_types("checkpoint", self)
        if "://" in self.local_dir:
            _fail("checkpoint", "local_dir", self.local_dir,
                  "must be a local folder (a local SSD), not a URL; the run store is the shared tier")
        _positive("checkpoint", self, "checkpoint_interval")
        _non_negative("checkpoint", self, "checkpoint_interval_s", "keep_last", "keep_every",
                      "gc_grace_s")
        if not self.resume_from_checkpoint:
            _fail("checkpoint", "resume_from_checkpoint", self.resume_from_checkpoint,
                  "use 'auto', 'none' or a checkpoint path")

    def due(self, step: int, total_steps: int, since_save_s: float | None = None) -> bool:
        """Whether the state after ``step`` of ``total_steps`` updates is saved: every
        ``checkpoint_interval`` steps, at the last step, and with ``checkpoint_interval_s`` when
        ``since_save_s`` seconds since the last save reach it. ``since_save_s=None`` (not known
        yet, as when a workflow is planned): every step may be due, the worker decides."""
        if step % self.checkpoint_interval == 0 or step == total_steps:
            return True
        if not self.checkpoint_interval_s:
            return False
        return since_save_s is None or since_save_s >= self.checkpoint_interval_s


GUARD_POLICIES = ("warn", "skip_batch", "retry_phase", "rollback", "halt")
"""What a detector may do when it fires (docs/guard.md)."""

TIMING_DETECTORS = ("latency_spike", "throughput_drop", "gpu_util_drop")
"""Detectors on wall-clock signals: not reproducible, so they may only ``warn``, ``retry_phase``
or ``halt`` (a skip or rollback decided by a clock would make a re-run diverge)."""


@dataclass(frozen=True)
class GuardConfig:
    """The training guard: anomaly detectors over a window of recent steps and what each one does
    when it fires. Policies: ``warn`` (log the event), ``skip_batch`` (the update is not
    applied), ``retry_phase`` (the phase is retried, bounded, with backoff), ``rollback`` (to the
    newest verified checkpoint before the anomaly), ``halt`` (stop with a report). Repeated skips
    escalate to a rollback, repeated rollbacks to a halt."""

    enabled: bool = in_trajectory(True)
    """Run the detectors (off: only non-finite gradients are refused, as the optimizer must)."""
    nonfinite_policy: str = in_trajectory("skip_batch")
    """NaN/Inf in rewards, advantages, log-probs, the loss or the gradients."""
    grad_explosion_policy: str = in_trajectory("skip_batch")
    """Gradient norm far above its recent median."""
    loss_spike_policy: str = in_trajectory("warn")
    """Policy loss far from its recent median."""
    kl_spike_policy: str = in_trajectory("warn")
    """KL to the reference (or rollout) policy far above its recent median."""
    reward_collapse_policy: str = in_trajectory("rollback")
    """Mean reward fallen far below its recent median."""
    entropy_collapse_policy: str = in_trajectory("warn")
    """Policy entropy fallen far below its recent median."""
    length_anomaly_policy: str = in_trajectory("warn")
    """Mean response length collapsed or run away from its recent median."""
    # wall-clock detectors (TIMING_DETECTORS) never change the trajectory
    latency_spike_policy: str = not_in_trajectory("warn")
    """A phase took far longer than its recent median (wall clock)."""
    throughput_drop_policy: str = not_in_trajectory("warn")
    """Rollout tokens/s fell far below its recent median (wall clock)."""
    gpu_util_drop_policy: str = not_in_trajectory("warn")
    """Accelerator utilisation (NVML) fell far below its recent median; unavailable on CPU."""
    # Detector thresholds (verl_core/guard/detectors.py; docs/guard.md). A windowed detector
    # fires when the robust z-score (x - median) / (1.4826 MAD) passes its ``_z`` AND the change
    # passes its floor, so a flat series (MAD 0) never fires on noise.
    window: int = in_trajectory(32)
    """Detectors compare a signal with the median and MAD of its last this many finite values."""
    warmup_steps: int = in_trajectory(10)
    """A windowed detector fires only once its signal has this many finite values in history."""
    grad_explosion_z: float = in_trajectory(6.0)
    """Gradient norm: robust z above the median past which it counts as exploding."""
    grad_explosion_min_ratio: float = in_trajectory(10.0)
    """Gradient norm: ... and at least this many times its median."""
    loss_spike_z: float = in_trajectory(6.0)
    """Policy/value loss: robust z (either way for the policy loss, up for the value loss)."""
    loss_spike_min_change: float = in_trajectory(0.5)
    """Policy/value loss: ... and at least this far from its median (loss units)."""
    kl_spike_z: float = in_trajectory(6.0)
    """KL loss / reward KL: robust z above the median."""
    kl_spike_min_change: float = in_trajectory(0.25)
    """KL loss / reward KL: ... and at least this many nats above its median. 0.25 is about
    log(1 + clip_ratio_high) = log 1.28: the most one clipped PPO step moves a token's log-prob,
    so a healthy step raises the KL by less; a jump past it is more than one step's worth."""
    kl_spike_min_ratio: float = in_trajectory(2.0)
    """KL loss / reward KL: ... and above this many times its median. The batch KL is a mean of
    a positive, right-skewed per-token estimate, so its upper spread is wider than the MAD says;
    a spike is a jump in the KL's own scale (like the gradient norm's ratio)."""
    reward_collapse_z: float = in_trajectory(5.0)
    """Mean reward: robust z below the median."""
    reward_collapse_min_drop: float = in_trajectory(0.25)
    """Mean reward: ... and at least this far below its median (reward units; rule scorers give
    0..1)."""
    entropy_collapse_z: float = in_trajectory(6.0)
    """Policy entropy: robust z below the median."""
    entropy_collapse_min_drop: float = in_trajectory(0.5)
    """Policy entropy: ... and below (1 - this) times its median."""
    length_anomaly_z: float = in_trajectory(6.0)
    """Mean response length: robust z either way."""
    length_anomaly_min_ratio: float = in_trajectory(2.0)
    """Mean response length: ... and below median / this (collapse) or above median x this."""
    latency_spike_z: float = not_in_trajectory(6.0)
    """Phase wall time: robust z above the median."""
    latency_spike_min_ratio: float = not_in_trajectory(3.0)
    """Phase wall time: ... and at least this many times its median."""
    latency_spike_min_s: float = not_in_trajectory(60.0)
    """Phase wall time: ... and at least this many seconds above its median."""
    throughput_drop_z: float = not_in_trajectory(6.0)
    """Rollout tokens/s: robust z below the median."""
    throughput_drop_min_drop: float = not_in_trajectory(0.5)
    """Rollout tokens/s: ... and below (1 - this) times its median."""
    throughput_drop_min_lost_s: float = not_in_trajectory(60.0)
    """Rollout tokens/s: ... and the drop cost at least this many seconds of the rollout."""
    gpu_util_drop_z: float = not_in_trajectory(6.0)
    """Accelerator utilisation: robust z below the median."""
    gpu_util_drop_min_drop: float = not_in_trajectory(30.0)
    """Accelerator utilisation: ... and at least this many percentage points below its median."""
    max_consecutive_skips: int = in_trajectory(3)
    """A skip this many steps in a row escalates to a rollback."""
    max_rollbacks: int = in_trajectory(2)
    """A rollback past this many in one run escalates to a halt."""
    rollback_lr_scale: float = in_trajectory(1.0)
    """Multiply the learning rate by this at each rollback (e.g. 0.5)."""
    phase_timeout_s: float = not_in_trajectory(3600.0)
    """Deadline of every phase call on a worker; past it the call fails as transient (a hang),
    the worker is replaced and the phase is retried."""
    lease_ttl_s: float = not_in_trajectory(60.0)
    """Single-writer run lease: a dead run's lease frees after this many seconds without renewal
    (renewed every third of it); 0 = take no lease (docs/checkpoints.md)."""

    def __post_init__(self):
        _check_types("guard", self)
        for f in dataclasses.fields(self):
            if f.name.endswith("_policy"):
                value = getattr(self, f.name)
                _one_of("guard", f.name, value, GUARD_POLICIES)
                if f.name[:-len("_policy")] in TIMING_DETECTORS and value in ("skip_batch",
                                                                               "rollback"):
                    _fail("guard", f.name, value, "a wall-clock detector may only warn, "
                          "retry_phase or halt (a skip or rollback decided by a clock would not "
                          "replay identically)")
        _positive("guard", self, "max_consecutive_skips", "rollback_lr_scale", "phase_timeout_s")
        _non_negative("guard", self, "max_rollbacks", "lease_ttl_s")
        if self.rollback_lr_scale > 1:
            _fail("guard", "rollback_lr_scale", self.rollback_lr_scale, "must be in (0, 1]")
        self._check_detector_thresholds()

    def _check_detector_thresholds(self) -> None:
        names = [f.name for f in dataclasses.fields(self)]
        _positive("guard", self, "window", "loss_spike_min_change", "kl_spike_min_change",
                  "reward_collapse_min_drop", *(n for n in names if n.endswith("_z")))
        _non_negative("guard", self, "latency_spike_min_s", "throughput_drop_min_lost_s")
        if not 3 <= self.warmup_steps <= self.window:
            _fail("guard", "warmup_steps", self.warmup_steps,
                  f"must be in [3, guard.window={self.window}] (a median and MAD need a few "
                  "values, and the window holds at most `window`)")
        for n in ("grad_explosion_min_ratio", "kl_spike_min_ratio", "length_anomaly_min_ratio",
                  "latency_spike_min_ratio"):
            if getattr(self, n) <= 1:
                _fail("guard", n, getattr(self, n), "must be > 1 (a ratio to the median)")
        for n in ("entropy_collapse_min_drop", "throughput_drop_min_drop"):
            if not 0 < getattr(self, n) < 1:
                _fail("guard", n, getattr(self, n), "must be in (0, 1) (a fraction of the median)")
        if not 0 < self.gpu_util_drop_min_drop <= 100:
            _fail("guard", "gpu_util_drop_min_drop", self.gpu_util_drop_min_drop,
                  "must be in (0, 100] (percentage points)")


@dataclass(frozen=True)
class TrackingConfig:
    """Experiment trackers fed with the metrics table's scalars as each step's record is written
    (``verl_core.tracking``). Each is off while its field is empty; none changes training."""

    tensorboard_dir: str = not_in_trajectory("")
    """TensorBoard log folder (each run writes to ``<run name>-<trajectory hash>`` inside it)."""
    mlflow_tracking_uri: str = not_in_trajectory("")
    """MLflow tracking URI without a server, e.g. ``sqlite:///runs/mlflow.db`` or a folder."""
    mlflow_experiment: str = not_in_trajectory("verl-flyte")
    """MLflow experiment the run is logged under (created if missing)."""
    wandb_project: str = not_in_trajectory("")
    """Weights & Biases project (verl's ``trainer.project_name`` with ``trainer.logger`` wandb)."""
    wandb_run_name: str = not_in_trajectory("")
    """The run's name in W&B (verl's ``trainer.experiment_name``); empty: the run's name."""

    def __post_init__(self):
        _check_types("tracking", self)
        if not self.mlflow_experiment.strip():
            _fail("tracking", "mlflow_experiment", self.mlflow_experiment,
                  "must name an experiment, e.g. the default 'verl-flyte'")


VALIDATION_MODES = ("fail", "warn", "off")
"""What a failed data expectation does (``verl_core/validation.py``)."""


@dataclass(frozen=True)
class ValidationConfig:
    """Great Expectations suites over the input dataset and every stored batch (rollout, reward,
    advantage); see docs/guard.md. Never changes training, only whether a run stops."""

    mode: str = not_in_trajectory("fail")
    """``fail`` (stop the phase naming column, expectation and rows), ``warn`` (log it), ``off``."""
    sample_rows: int = not_in_trajectory(256)
    """Validate this many batch rows, drawn per (seed, step, stage); 0: all (BENCHMARKS.md)."""
    score_range: str = not_in_trajectory("auto")
    """``auto`` (a rule scorer's declared range; custom: finite only), ``any``, or ``"lo,hi"``."""
    every_steps: int = not_in_trajectory(25)
    """Validate the batches of every k-th step (0, k, 2k …; 1: every step). GX's cost is per
    expectation whatever the row count, so this, not sampling rows, bounds its share of a step:
    25 keeps it under 2% of the tiny default's CPU step (BENCHMARKS.md "Data validation");
    the guard checks every batch for non-finite values on every step anyway."""

    def __post_init__(self):
        _check_types("validation", self)
        _one_of("validation", "mode", self.mode, VALIDATION_MODES)
        _non_negative("validation", self, "sample_rows")
        _positive("validation", self, "every_steps")
        if self.score_range not in ("auto", "any"):
            lo_hi = self.score_bounds
            if lo_hi is None or not lo_hi[0] <= lo_hi[1]:
                _fail("validation", "score_range", self.score_range,
                      "use 'auto', 'any' or 'lo,hi' with finite lo <= hi, e.g. '-1,1'")

    @property
    def score_bounds(self) -> tuple[float, float] | None:
        """The explicit ``"lo,hi"`` of ``score_range`` as floats; None for auto/any/unparseable."""
        try:
            lo, hi = (float(x) for x in self.score_range.split(","))
        except ValueError:
            return None
        return (lo, hi) if math.isfinite(lo) and math.isfinite(hi) else None


@dataclass(frozen=True)
class RunConfig:
    """A whole RL run: all sections plus the loop settings."""

    data: DataConfig = in_trajectory(factory=DataConfig)
    """Prompts and batching."""
    model: ModelConfig = in_trajectory(factory=ModelConfig)
    """Policy model."""
    rollout: RolloutConfig = in_trajectory(factory=RolloutConfig)
    """Sampling."""
    reward: RewardConfig = in_trajectory(factory=RewardConfig)
    """Scoring."""
    reward_model: RewardModelConfig = in_trajectory(factory=RewardModelConfig,
                                                    when=_reward_model_on)
    """Model-based reward (off by default)."""
    algorithm: AlgorithmConfig = in_trajectory(factory=AlgorithmConfig)
    """Advantage, loss, KL."""
    optim: OptimConfig = in_trajectory(factory=OptimConfig)
    """Optimizer and schedule."""
    actor: ActorConfig = in_trajectory(factory=ActorConfig)
    """Update sizes: epochs, mini- and micro-batches."""
    trainer: TrainerConfig = in_trajectory(factory=TrainerConfig)
    """Worker group: nodes, workers per node, timeout."""
    cluster: ClusterConfig = not_in_trajectory(factory=ClusterConfig)
    """Where the workers live on a Flyte cluster (never part of the trajectory)."""
    checkpoint: CheckpointConfig = not_in_trajectory(factory=CheckpointConfig)
    """Durable state."""
    guard: GuardConfig = in_trajectory(factory=GuardConfig)
    """Anomaly detectors and recovery policies."""
    tracking: TrackingConfig = not_in_trajectory(factory=TrackingConfig)
    """TensorBoard and MLflow (never part of the trajectory)."""
    validation: ValidationConfig = not_in_trajectory(factory=ValidationConfig)
    """Data expectations on the dataset and every batch (never part of the trajectory)."""
    total_steps: int = in_trajectory(240, when=_lr_depends_on_run_length)
    """RL steps (one rollout batch each)."""
    seed: int = in_trajectory(1)
    """Run seed; every phase derives its own seed from (seed, step, phase)."""
    eval_every: int = not_in_trajectory(0)
    """Greedy held-out evaluation every k steps (0: only at start and end)."""
    val_before_train: bool = not_in_trajectory(True)
    """Evaluate before the first step (verl's ``trainer.val_before_train``); False skips it, and
    the run's gain is then not measured. Never changes the trajectory."""
    num_threads: int = not_in_trajectory(0)
    """torch intra-op threads per worker (0: this host's CPUs / the worker count). Resolved at the
    run's first prepare and recorded in its store (``compute.json``): every mode, worker, retry
    and rebuild, on any host, computes with that count; a different count on a later launch of
    the run is refused (``verl_core.threads``)."""

    def __post_init__(self):
        _check_types("run", self)
        _positive("run", self, "total_steps")
        _non_negative("run", self, "eval_every", "num_threads")
        B, mini = self.data.train_batch_size, self.actor.ppo_mini_batch_size
        if mini > B or B % mini:
            _fail("actor", "ppo_mini_batch_size", mini,
                  f"must divide data.train_batch_size={B} (otherwise the last mini-batch is "
                  "ragged or empty)")
        rows = mini * self.rollout.n
        micro = self.actor.ppo_micro_batch_size
        if micro > rows:
            _fail("actor", "ppo_micro_batch_size", micro,
                  f"is larger than a mini-batch ({mini} prompts x rollout.n={self.rollout.n} = "
                  f"{rows} rows), which gives zero gradient-accumulation steps; use <= {rows}")
        if rows % micro:
            _fail("actor", "ppo_micro_batch_size", micro,
                  f"must divide the mini-batch rows ({rows}) so every micro-batch has the same "
                  "weight in the accumulated gradient")
        W = self.trainer.world_size
        if self.checkpoint.local_dir and W > 1:
            _fail("checkpoint", "local_dir", self.checkpoint.local_dir,
                  f"is not supported with {W} workers (each node would need its own local tier); "
                  "leave it empty, or use trainer.nnodes = trainer.n_gpus_per_node = 1")
        if rows % W:
            _fail("trainer", "n_gpus_per_node", self.trainer.n_gpus_per_node,
                  f"x trainer.nnodes={self.trainer.nnodes} = {W} workers must divide the "
                  f"mini-batch rows ({mini} prompts x rollout.n={self.rollout.n} = {rows}), so "
                  "every worker gets an equal block; change the worker count or the mini-batch")
        if self.algorithm.estimator_traits.needs_groups and self.rollout.n < 2:
            _fail("rollout", "n", self.rollout.n,
                  f"algorithm.adv_estimator={self.algorithm.adv_estimator!r} compares responses "
                  "within a group; use rollout.n >= 2")
        bounds = self.validation.score_bounds  # a timed-out call scores reward.timeout_score
        if bounds and not bounds[0] <= self.reward.timeout_score <= bounds[1]:
            _fail("validation", "score_range", self.validation.score_range,
                  f"must contain reward.timeout_score={self.reward.timeout_score}")

    @property
    def grad_accum_steps(self) -> int:
        return self.actor.ppo_mini_batch_size * self.rollout.n // self.actor.ppo_micro_batch_size

    @property
    def optimizer_steps_per_rl_step(self) -> int:
        return self.actor.ppo_epochs * (self.data.train_batch_size // self.actor.ppo_mini_batch_size)

    @property
    def total_optimizer_steps(self) -> int:
        return self.total_steps * self.optimizer_steps_per_rl_step

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def non_default(self) -> dict:
        """The fields that differ from ``RunConfig()``'s, by section: what a preset and the
        user's overrides set. ``RunConfig.from_dict(c.non_default()) == c``."""
        base, out = _default_dict(), {}
        for k, v in self.to_dict().items():
            if k in SECTIONS:  # field by field (a dict-valued field is compared whole)
                v = {f: x for f, x in v.items() if x != base[k][f]}
                if v:
                    out[k] = v
            elif v != base[k]:
                out[k] = v
        return out

    def full_hash(self) -> str:
        """sha256 of the canonical JSON of every field, the trajectory's and the others' (what
        :meth:`trajectory_hash` leaves out, e.g. ``checkpoint.*``, changes it)."""
        blob = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()

    def trajectory_hash(self) -> str:
        """sha256 of the fields that decide the training trajectory (the state after step k for
        every k), as each field declares (:data:`TRAJECTORY`). Extending a run (``--steps 300``
        after 200, constant LR) or changing the checkpoint interval continues the same
        trajectory: its checkpoints and lineage stay usable. Names checkpoints, lineage and
        metrics in the run store."""
        blob = json.dumps(_trajectory_fields(self, self), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()

    @classmethod
    def from_dict(cls, d: dict) -> "RunConfig":
        kw = {}
        known = {f.name for f in dataclasses.fields(cls)}
        for k, v in d.items():
            if k not in known:
                raise ConfigError(f"unknown config key {k!r}; known: {', '.join(sorted(known))}")
            if k in SECTIONS and not isinstance(v, dict):
                raise ConfigError(f"config section {k!r}={v!r}: must be a mapping of its fields, "
                                  f"e.g. {{\"{k}\": {{...}}}}, or use dotted keys ({k}.<field>)")
            if k in SECTIONS:
                sub_known = {f.name for f in dataclasses.fields(SECTIONS[k])}
                bad = set(v) - sub_known
                for name in sorted(bad):
                    _refuse_moved(f"{k}.{name}")
                if bad:
                    raise ConfigError(f"unknown key(s) {sorted(bad)} in section {k!r}; "
                                      f"known: {', '.join(sorted(sub_known))}")
                kw[k] = SECTIONS[k](**v)
            else:
                kw[k] = v
        return cls(**kw)


def effective_line(cfg: RunConfig) -> str:
    """``cfg``'s fields that differ from the dataclass defaults as one compact ``key=value``
    list (what the preset, the model-aware defaults and the user's keys set), printed once at
    the start of a run so a default that did not apply is seen before any work."""
    items = []
    for k, v in sorted(cfg.non_default().items()):
        if isinstance(v, dict) and k in SECTIONS:
            items += [f"{k}.{f}={x!r}" if isinstance(x, str) else f"{k}.{f}={x}"
                      for f, x in sorted(v.items())]
        else:
            items.append(f"{k}={v!r}" if isinstance(v, str) else f"{k}={v}")
    return "[verl] config: " + (" ".join(items) or "the defaults")


def _trajectory_fields(run: RunConfig, obj) -> dict:
    """The fields of ``obj`` (``run`` or one of its sections) that are in ``run``'s trajectory,
    by name, sections as dicts of theirs (the values as in :meth:`RunConfig.to_dict`)."""
    out = {}
    for f in dataclasses.fields(obj):
        inside = f.metadata[TRAJECTORY]
        if inside is True or inside is not False and inside(run):
            v = getattr(obj, f.name)
            out[f.name] = _trajectory_fields(run, v) if dataclasses.is_dataclass(v) else v
    return out


@functools.lru_cache(maxsize=1)
def _default_dict() -> dict:
    return RunConfig().to_dict()


SECTIONS = {"data": DataConfig, "model": ModelConfig, "rollout": RolloutConfig,
            "reward": RewardConfig, "reward_model": RewardModelConfig,
            "algorithm": AlgorithmConfig, "optim": OptimConfig,
            "actor": ActorConfig, "trainer": TrainerConfig, "cluster": ClusterConfig,
            "checkpoint": CheckpointConfig,
            "guard": GuardConfig, "tracking": TrackingConfig, "validation": ValidationConfig}
"""The sections of :class:`RunConfig` by field name."""

MOVED_KEYS = {f"trainer.{n}": f"actor.{n}"
              for n in ("ppo_epochs", "ppo_mini_batch_size", "ppo_micro_batch_size")}
"""Keys that moved: verl's ``trainer`` section is the run loop, so the update sizes live in
``actor`` (verl's ``actor_rollout_ref.actor``). The old name is refused naming the new one."""


def _refuse_moved(key: str) -> None:
    if key in MOVED_KEYS:
        raise ConfigError(f"config key {key!r} was renamed to {MOVED_KEYS[key]!r} (verl's "
                          f"trainer.* is the run loop); use {MOVED_KEYS[key]}")


def typed_overrides(overrides: dict[str, object]) -> dict[str, object]:
    """Check the keys and value types of dotted overrides against the field annotations without
    building a config, e.g. ``{"rollout.n": 4.0}`` -> ``{"rollout.n": 4}``; for callers that
    compute with the values before :func:`with_overrides` (which checks everything again)."""
    if not isinstance(overrides, dict):
        raise ConfigError(f"overrides={overrides!r}: must be a mapping of dotted keys to values, "
                          'e.g. {"optim.lr": 1e-4}')
    out = {}
    for key, value in overrides.items():
        _refuse_moved(str(key))
        section, _, name = str(key).rpartition(".")
        fields = _fields_of(SECTIONS[section] if section in SECTIONS else RunConfig)
        if section and section not in SECTIONS or name not in fields:
            raise ConfigError(f"unknown config key {key!r}")
        kind, default = fields[name]
        out[key] = value if dataclasses.is_dataclass(kind) else \
            _checked(section or "run", name, kind, default, value)
    return out


def with_overrides(cfg: RunConfig, overrides: dict[str, object]) -> RunConfig:
    """Return ``cfg`` with dotted overrides applied, e.g. ``{"optim.lr": 1e-4, "total_steps": 5}``.
    Re-validates everything."""
    if not isinstance(overrides, dict):
        typed_overrides(overrides)  # raises, naming what was given
    d = cfg.to_dict()
    for key, value in overrides.items():
        _refuse_moved(key)
        parts = key.split(".")
        node = d
        for p in parts[:-1]:
            if p not in node or not isinstance(node[p], dict):
                raise ConfigError(f"unknown config section {p!r} in override {key!r}")
            node = node[p]
        if parts[-1] not in node:
            raise ConfigError(f"unknown config key {key!r}")
        node[parts[-1]] = value
    return RunConfig.from_dict(d)


# ---------------------------------------------------------------- presets
DEMO_TEMPERATURE = 0.6
"""Rollout temperature of the built-in demo (the tiny warm-started model, no ``model.path``).
0.6 samples near the greedy answer, so a reward moves the greedy decision that the held-out
evaluation scores; at 1.0 the tiny model's RL mostly sharpened its samples toward its greedy
accuracy and left that accuracy flat on seed 2 (BENCHMARKS.md "Accuracy"). A model you bring keeps
verl's 1.0, so a verl config that leaves the temperature at verl's default samples as in verl."""


USER_MODEL_DEFAULTS: dict[str, object] = {
    "data.max_prompt_length": 512,
    "rollout.max_new_tokens": 512,
    "optim.lr": 1e-6,
    "optim.critic_lr": 1e-5,
    "optim.weight_decay": 0.01,
    "optim.beta2": 0.999,
    "optim.warmup_steps": 0,
    "optim.min_lr_ratio": 0.0,
    "algorithm.clip_ratio_high": 0.2,
    "algorithm.lam": 1.0,
    "actor.ppo_epochs": 1,
    "model.gradient_checkpointing": True,
}
"""verl's defaults (``verl_defaults/ppo_trainer.yaml``: ``data.max_prompt_length``,
``max_response_length``, ``actor.optim.*``, ``critic.optim.lr``, ``clip_ratio``, ``lam``,
``ppo_epochs``, ``enable_gradient_checkpointing``) for the fields where the built-in demo's values
differ: they apply when ``model.path`` names a model you bring and you did not set the field.
The demo's 8 response tokens, 64 prompt tokens and lr 5e-4 fit a 3-token arithmetic answer
and a 0.1M-parameter model; on a real model they truncate every response and take 500x verl's
steps. The batch sizes stay ours (64 prompts x 8 samples, mini-batch 32; verl's 1024 x 256 are
cluster sizes): set ``data.train_batch_size``/``actor.ppo_mini_batch_size`` for your hardware."""


def _model_aware(base: RunConfig, overrides: dict) -> dict:
    """``overrides`` plus the defaults the model decides, for fields they leave unset: verl's
    (:data:`USER_MODEL_DEFAULTS`) with ``model.path``, else the demo's temperature; and the
    micro-batch fitted to the mini-batch (:func:`_fitted_micro_batch`)."""
    if overrides.get("model.path"):
        out = {**USER_MODEL_DEFAULTS, **overrides}
    elif "rollout.temperature" in overrides:
        out = dict(overrides)
    else:
        out = {"rollout.temperature": DEMO_TEMPERATURE, **overrides}
    if "actor.ppo_micro_batch_size" not in overrides:
        micro = _fitted_micro_batch(base, out)
        if micro is not None:
            out["actor.ppo_micro_batch_size"] = micro
    return out


def _fitted_micro_batch(base: RunConfig, overrides: dict) -> int | None:
    """The preset's micro-batch, halved until it divides the mini-batch rows (``mini x
    rollout.n``): a small mini-batch must not make a default the user never set fail. Memory
    only (a mini-batch's loss does not depend on it). None when a size is not a positive integer
    yet (then the config names that field)."""
    mini = _coerce(int, overrides.get("actor.ppo_mini_batch_size",
                                      base.actor.ppo_mini_batch_size))
    n = _coerce(int, overrides.get("rollout.n", base.rollout.n))
    if not mini or not n or mini < 0 or n < 0:
        return None
    rows, micro = mini * n, base.actor.ppo_micro_batch_size
    while rows % micro:
        micro //= 2
    return min(micro, rows)


def grpo_preset(**overrides) -> RunConfig:
    """Default: GRPO on the synthetic arithmetic task with the tiny warm-started model (sampled
    at :data:`DEMO_TEMPERATURE`; pass ``model.path`` here, not later, for verl's defaults:
    :data:`USER_MODEL_DEFAULTS`)."""
    base = RunConfig()
    return with_overrides(base, _model_aware(base, overrides))


def ppo_preset(**overrides) -> RunConfig:
    """PPO: GAE + critic, one sample per prompt is allowed but we keep G=4 for throughput."""
    base = RunConfig(
        algorithm=AlgorithmConfig(adv_estimator="gae", gamma=1.0, lam=0.95),
        rollout=RolloutConfig(n=4),
        data=DataConfig(train_batch_size=64),
        actor=ActorConfig(ppo_epochs=2, ppo_mini_batch_size=32, ppo_micro_batch_size=128),
    )
    return with_overrides(base, _model_aware(base, overrides))


def preset(algorithm: str, **overrides) -> RunConfig:
    """``ppo`` means GAE + critic; any other estimator name uses the GRPO-style preset."""
    if algorithm == "ppo":
        return ppo_preset(**overrides)
    if algorithm not in ADVANTAGE_ESTIMATORS:
        known = ", ".join(ADVANTAGE_ESTIMATORS.names(include_aliases=True))
        raise ConfigError(f"algorithm={algorithm!r}: unknown; known: ppo, {known}")
    return grpo_preset(**{"algorithm.adv_estimator": algorithm, **overrides})
