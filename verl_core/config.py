"""Run configuration: small frozen dataclasses, validated at construction.

The same dataclasses are the Flyte task inputs: a :class:`RunConfig` crosses task boundaries
inside the run spec, as canonical JSON of its non-default fields (the spec's type transformer in
``tasks/common.py``), so there is no second config system. Field names follow verl's YAML where
a verl user would look for them (``ppo_mini_batch_size``, ``clip_ratio_low``,
``norm_adv_by_std_in_grpo``, ``kl_loss_type`` …).

Each section lives beside the component it configures: ``data/config.py``, ``models/config.py``,
``rollout/config.py``, ``reward/config.py`` (``reward``, ``reward_model``), ``training/config.py``
(``optim``, ``actor``), ``checkpoint/config.py`` and ``guard/config.py``. Here: the sections no
one component owns (``algorithm``, ``trainer``, ``cluster``, ``tracking``, ``validation``), the
:class:`RunConfig` that composes them all (its cross-section checks and hashes), overrides and
presets. Every name is re-exported here (``__all__``): callers import from ``verl_core.config``.
The field machinery all of them share is ``verl_core/config_fields.py``.

Every field is checked against its annotation first (type; numbers finite), then its range; every
invalid value raises :class:`ConfigError` naming ``section.field`` and what to do. Derived
values are properties, never fields filled in at runtime. Presets are plain constructors at the
bottom of this file.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import hashlib
import json
import math
from dataclasses import dataclass

from verl_core.algorithms.advantages import ADVANTAGE_ESTIMATORS, EstimatorTraits
from verl_core.algorithms.distill import DISTILL_LOSS_MODES
from verl_core.algorithms.policy_losses import POLICY_LOSSES as POLICY_LOSS_REGISTRY
from verl_core.algorithms.policy_losses import PolicyLossOptions
from verl_core.checkpoint.config import CheckpointConfig
from verl_core.config_fields import (TRAJECTORY, ConfigError, _check_types, _checked, _coerce,
                                     _fail, _fields_of, _non_negative, _one_of, _positive,
                                     in_trajectory, not_in_trajectory)
from verl_core.data.config import DataConfig
from verl_core.guard.config import GUARD_POLICIES, TIMING_DETECTORS, GuardConfig
from verl_core.models.config import ModelConfig
from verl_core.reward.config import REWARD_MODEL_COMBINE, RewardConfig, RewardModelConfig
from verl_core.rollout.config import RolloutConfig
from verl_core.training.config import ActorConfig, OptimConfig

__all__ = [
    # the field machinery (config_fields.py)
    "ConfigError", "TRAJECTORY", "in_trajectory", "not_in_trajectory",
    # the sections, beside their components and here
    "DataConfig", "ModelConfig", "RolloutConfig", "RewardConfig", "RewardModelConfig",
    "REWARD_MODEL_COMBINE", "AlgorithmConfig", "POLICY_LOSSES", "KL_TYPES", "LOSS_AGG_MODES",
    "ROLLOUT_IS_LEVELS", "BYPASS_LOSS_TYPES", "FILTER_GROUPS_METRICS", "OptimConfig",
    "ActorConfig", "TrainerConfig",
    "ClusterConfig", "CLUSTER_MODES", "CheckpointConfig", "GuardConfig", "GUARD_POLICIES",
    "TIMING_DETECTORS", "TrackingConfig", "ValidationConfig", "VALIDATION_MODES",
    # the run, overrides, presets
    "RunConfig", "SECTIONS", "MOVED_KEYS", "effective_line", "typed_overrides", "with_overrides",
    "dotted_keys", "did_you_mean",
    "CALCULATOR_DEFAULTS", "CODE_DEFAULTS", "DEMO_TEMPERATURE", "USER_MODEL_DEFAULTS",
    "USER_MODEL_EVAL",
    "grpo_preset",
    "ppo_preset", "preset",
]


def _lr_depends_on_run_length(run: RunConfig) -> bool:
    """``total_steps``: a cosine schedule's LR at step k depends on the run length; with a
    constant one ``--steps 300`` after 200 extends the same trajectory."""
    return run.optim.lr_schedule != "constant"


def _filter_groups_on(run: RunConfig) -> bool:
    """``algorithm.filter_groups_enable`` off: DAPO's dynamic sampling fields (and
    ``data.gen_batch_size``) do nothing, and the run hashes as before they existed."""
    return run.algorithm.filter_groups_enable


FILTER_GROUPS_METRICS = ("acc", "score", "seq_reward", "seq_final_reward")
"""What ``algorithm.filter_groups_metric`` may name (verl's DAPO trainer's metrics)."""


def _reward_model_on(run: RunConfig) -> bool:
    """``reward_model`` off: its other fields do nothing, and the run hashes as before the section
    existed."""
    return run.reward_model.enable


def _distill_on(run: RunConfig) -> bool:
    """``algorithm.distill_teacher_path`` empty: on-policy distillation is off, its other fields
    do nothing, and the run hashes as before they existed."""
    return run.algorithm.distills


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
    """Lower clip: ratio >= 1 - clip_ratio_low; 1 or more: no lower clip (a ratio is positive),
    as verl's CISPO example sets it (``clip_ratio_low=10``)."""
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
    filter_groups_enable: bool = in_trajectory(False, when=_filter_groups_on)
    """DAPO's dynamic sampling (verl's ``algorithm.filter_groups.enable``): the rollout phase
    samples generation batches of ``data.gen_batch_size`` prompts, scores them, drops every group
    whose ``filter_groups_metric`` values are all equal (no learning signal), and keeps sampling
    until ``data.train_batch_size`` groups remain (the first ones kept, in order)."""
    filter_groups_metric: str = in_trajectory("acc", when=_filter_groups_on)
    """The per-response value groups are filtered on (verl's ``filter_groups.metric``): ``acc``
    (the scorer's ``acc``, else its score), ``score`` (the score before the overlong penalty),
    ``seq_reward`` (the reward, penalty included), ``seq_final_reward`` (the reward minus the
    reward KL with ``use_kl_in_reward``)."""
    max_num_gen_batches: int = in_trajectory(0, when=_filter_groups_on)
    """Most generation batches one step may sample (verl's ``filter_groups.max_num_gen_batches``);
    a step still short of ``data.train_batch_size`` groups then fails, as verl's. 0: no limit."""
    distill_teacher_path: str = in_trajectory("", when=_distill_on)
    """On-policy distillation (docs/rewards.md#on-policy-distillation; verl's
    ``distillation.teacher_models.teacher_model.model_path``): a local Hugging Face folder of a
    teacher whose tokenizer is the student's; the rollout phase stores its log-probs of the
    sampled tokens with the batch, and each token's advantage gains ``distill_coef`` x (log
    teacher - log student). Pinned with the run's assets. Empty: off."""
    distill_coef: float = in_trajectory(1.0, when=_distill_on)
    """Weight of the per-token distillation signal added to the outcome advantage (verl's
    ``distillation_loss_coef``; like verl's, it applies only with ``distill_use_task_rewards``:
    the signal alone has weight 1, and another value is refused)."""
    distill_use_task_rewards: bool = in_trajectory(True, when=_distill_on)
    """Keep the verifiable reward's advantage and add the signal to it (verl's
    ``use_task_rewards``); False: the advantage is the distillation signal alone."""
    distill_loss_mode: str = in_trajectory("k1", when=_distill_on)
    """The reverse-KL estimator of the signal (verl's ``distillation_loss.loss_mode``): k1 (= kl,
    log student - log teacher: PG OPD's), abs, k2 (= mse), k3 (= low_var_kl)."""
    distill_loss_max_clamp: float = in_trajectory(0.0, when=_distill_on)
    """Clamp each token's estimate to [-c, c] before it becomes the signal (verl's
    ``loss_max_clamp``); 0: no clamp."""

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
        if self.clip_ratio_c <= 1.0:
            _fail("algorithm", "clip_ratio_c", self.clip_ratio_c, "must be > 1 (dual-clip bound)")
        _non_negative("algorithm", self, "entropy_coeff", "kl_loss_coef", "kl_coef", "vf_coef")
        _one_of("algorithm", "filter_groups_metric", self.filter_groups_metric,
                set(FILTER_GROUPS_METRICS))
        _non_negative("algorithm", self, "max_num_gen_batches")
        self._check_policy_loss_options()
        self._check_distill()

    def _check_distill(self) -> None:
        _one_of("algorithm", "distill_loss_mode", self.distill_loss_mode,
                set(DISTILL_LOSS_MODES))
        _non_negative("algorithm", self, "distill_loss_max_clamp")
        if not self.distills:
            for name, default in (("distill_coef", 1.0), ("distill_use_task_rewards", True),
                                  ("distill_loss_mode", "k1"), ("distill_loss_max_clamp", 0.0)):
                if getattr(self, name) != default:
                    _fail("algorithm", name, getattr(self, name),
                          "does nothing without algorithm.distill_teacher_path (the teacher's "
                          "folder): set it, or leave this key out")
            return
        if self.distill_coef <= 0:
            _fail("algorithm", "distill_coef", self.distill_coef,
                  "must be > 0 (0 distils nothing: leave algorithm.distill_teacher_path empty "
                  "to turn distillation off)")
        if not self.distill_use_task_rewards and self.distill_coef != 1.0:
            _fail("algorithm", "distill_coef", self.distill_coef,
                  "does nothing with algorithm.distill_use_task_rewards=False (the signal alone is "
                  "the advantage, as verl's distillation_loss_coef applies only with task "
                  "rewards): leave it at 1 and scale the step with optim.lr")
        if not self.distill_use_task_rewards and self.uses_critic:
            _fail("algorithm", "distill_use_task_rewards", False,
                  f"with algorithm.adv_estimator={self.adv_estimator!r} would train a critic on "
                  "returns no advantage uses; keep the task rewards or use a group estimator "
                  "(grpo, rloo, ...)")

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
    def distills(self) -> bool:
        """On-policy distillation is on (``distill_teacher_path`` names a teacher)."""
        return bool(self.distill_teacher_path)

    @property
    def old_logp_from_rollout(self) -> bool:
        """The update takes the rollout engine's log-probs as the behaviour policy instead of
        recomputing them (``bypass_mode``, verl's ``rollout_correction.bypass_mode``): the policy
        loss's registry trait."""
        return POLICY_LOSS_REGISTRY.traits(self.policy_loss).old_logp_from_rollout


TRAINER_DEVICES = ("auto", "cuda", "cpu")
"""``trainer.device``'s values (``verl_core/training/device.py``)."""


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
    # where, not what: a run may be continued on the other kind of machine (the same math, not
    # the same rounding), so neither is in the trajectory
    device: str = not_in_trajectory("auto")
    """Where each worker trains and samples: ``auto`` (its GPU when it sees one, else the CPU),
    ``cuda`` (a GPU, or an error naming what is missing), ``cpu`` (verl's key; verl's ``cuda``
    means ``auto`` here). Models stay there; batches stay on the host (training/device.py)."""
    deterministic: bool = not_in_trajectory(True)
    """On CUDA: deterministic kernels (``torch.use_deterministic_algorithms``, cuBLAS's fixed
    workspace), so a resumed run ends with the uninterrupted run's exact weights on the same GPU
    type. False: CUDA's default kernels, faster, a resume then equal only up to rounding. The
    CPU is deterministic either way."""

    def __post_init__(self):
        _check_types("trainer", self)
        _positive("trainer", self, "nnodes", "n_gpus_per_node", "worker_timeout_s")
        _one_of("trainer", "device", self.device, TRAINER_DEVICES)

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
    """Held-out evaluation (greedy unless ``rollout.val_do_sample``) every k steps (0: only at
    start and end)."""
    val_before_train: bool = not_in_trajectory(True)
    """Evaluate before the first step (verl's ``trainer.val_before_train``); False skips it, and
    the run's gain is then not measured. Never changes the trajectory."""
    log_val_generations: int = not_in_trajectory(0)
    """Print this many held-out samples (prompt, response, ground truth, score) at each
    evaluation (verl's ``trainer.log_val_generations``); the first ones of the seeded subset, so
    the same prompts each time. 0: none (the reports still get their samples)."""
    num_threads: int = not_in_trajectory(0)
    """torch intra-op threads per worker (0: this host's CPUs / the worker count). Resolved at the
    run's first prepare and recorded in its store (``compute.json``): every mode, worker, retry
    and rebuild, on any host, computes with that count; a different count on a later launch of
    the run is refused (``verl_core.threads``)."""

    def __post_init__(self):
        _check_types("run", self)
        _positive("run", self, "total_steps")
        _non_negative("run", self, "eval_every", "num_threads", "log_val_generations")
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
        ck = self.checkpoint
        if ck.keep_best and not ck.last_step_only and (
                not self.eval_every or self.eval_every % ck.checkpoint_interval):
            _fail("checkpoint", "keep_best", ck.keep_best,
                  f"needs a checkpoint at every evaluated step: set eval_every to a multiple of "
                  f"checkpoint.checkpoint_interval={ck.checkpoint_interval} (it is "
                  f"{self.eval_every}{': evaluations at the start and end only' if not self.eval_every else ''})")
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
        need = self.data.max_prompt_length + self.rollout.max_new_tokens
        if self.rollout.max_model_len and self.rollout.max_model_len < need:
            _fail("rollout", "max_model_len", self.rollout.max_model_len,
                  f"is shorter than data.max_prompt_length + rollout.max_new_tokens = {need}: "
                  "vLLM would refuse or cut the run's sequences; give at least that, or 0")
        traits = self.algorithm.estimator_traits
        if traits.needs_groups and not traits.one_response_ok and self.rollout.n < 2:
            _fail("rollout", "n", self.rollout.n,
                  f"algorithm.adv_estimator={self.algorithm.adv_estimator!r} compares responses "
                  "within a group (a group of one gets advantage 0); use rollout.n >= 2")
        self._check_dapo()
        self._check_staleness()
        if (not self.data.train_files and self.data.synthetic_task == "calculator"
                and not self.rollout.multi_turn):
            _fail("data", "synthetic_task", "calculator",
                  "is answered with the calculator tool: set rollout.multi_turn=True and "
                  "rollout.tool_config_path=builtin:calculator (the presets set them with "
                  "data.synthetic_task=calculator)")
        if (not self.data.train_files and self.data.synthetic_task == "word_problems"
                and not self.model.path):
            _fail("data", "synthetic_task", "word_problems",
                  "is a task for a real pretrained model (the tiny model reads characters, and a "
                  "word problem is longer than its context): give --model, e.g. a folder made by "
                  "python -m verl_core.models fetch smollm2-135m-instruct DIR")
        if (not self.data.train_files and self.data.synthetic_task == "guess"
                and not self.rollout.interaction_config_path):
            _fail("data", "synthetic_task", "guess",
                  "is played against a simulated user: set rollout.multi_turn=True and "
                  "rollout.interaction_config_path=builtin:guess (the presets set them with "
                  "data.synthetic_task=guess)")
        if self.rollout.openai_agent and (self.algorithm.estimator_traits.needs_greedy_baseline
                                          or self.rollout.partial_rollout):
            _fail("rollout", "openai_agent", self.rollout.openai_agent,
                  "an agent's episodes are not offered with a greedy single-turn baseline "
                  "(remax) or rollout.partial_rollout; use grpo, rloo or gae, without "
                  "partial_rollout")
        if self.rollout.multi_turn and self.algorithm.estimator_traits.needs_greedy_baseline:
            _fail("algorithm", "adv_estimator", self.algorithm.adv_estimator,
                  "its greedy baseline response is single-turn and cannot score a multi-turn "
                  "rollout (rollout.multi_turn=True); use grpo, rloo, gae or another estimator")
        if ((self.rollout.agent_loop or self.rollout.agent_loop_config_path)
                and self.algorithm.estimator_traits.needs_greedy_baseline):
            _fail("algorithm", "adv_estimator", self.algorithm.adv_estimator,
                  "its greedy baseline response is plain sampling and cannot score an agent "
                  "loop's episode (rollout.agent_loop); use grpo, rloo, gae or another estimator")
        if (self.rollout.agent_loop or self.rollout.agent_loop_config_path) \
                and self.rollout.partial_rollout:
            _fail("rollout", "partial_rollout", True,
                  "is not offered with agent loops (rollout.agent_loop): a tick serves rows at "
                  "different request indices in one engine call; drop one of them")
        bounds = self.validation.score_bounds  # a timed-out call scores reward.timeout_score
        if bounds and not bounds[0] <= self.reward.timeout_score <= bounds[1]:
            _fail("validation", "score_range", self.validation.score_range,
                  f"must contain reward.timeout_score={self.reward.timeout_score}")

    def _check_staleness(self) -> None:
        """``rollout.max_staleness`` > 0 (off-policy) and ``rollout.partial_rollout`` against the
        other sections."""
        s = self.rollout.max_staleness
        self._check_partial_rollout()
        if not s:
            return
        algo = self.algorithm
        if not algo.rollout_is and not algo.old_logp_from_rollout:
            _fail("rollout", "max_staleness", s,
                  "samples with weights one update older than the ones the update starts from; "
                  "the update must correct for that behaviour policy: set "
                  "algorithm.rollout_is=token (truncated importance sampling, verl's "
                  "rollout_correction.rollout_is) or algorithm.policy_loss=bypass_mode")
        if self.trainer.world_size > 1 and self.rollout.async_mode == "process":
            _fail("rollout", "async_mode", self.rollout.async_mode,
                  "runs the background rollout in a sampler process per worker, and those "
                  "processes share no process group for gathering their blocks of rows "
                  f"(trainer.nnodes x n_gpus_per_node = {self.trainer.world_size}): use "
                  "rollout.async_mode=thread with several workers")

    def _check_partial_rollout(self) -> None:
        rc, p = self.rollout, self.rollout.partial_rollout
        if not p:
            return
        if rc.max_staleness < 2:
            _fail("rollout", "partial_rollout", p,
                  f"needs rollout.max_staleness >= 2 (it is {rc.max_staleness}): the rollout of "
                  "step t samples with the versions t - k .. t - 1, so with k <= 1 there is no "
                  "newer version to go on with")
        why = None
        if rc.async_mode == "process":
            why = ("with rollout.async_mode=process: the sampler process samples whole "
                   "rollouts; use rollout.async_mode=thread")
        elif self.trainer.world_size > 1:
            why = "with several workers (not built yet): give one worker"
        elif self.algorithm.filter_groups_enable:
            why = "with DAPO's dynamic sampling (algorithm.filter_groups_enable): not built yet"
        elif self.algorithm.estimator_traits.needs_sum_pi_squared:
            why = (f"with algorithm.adv_estimator={self.algorithm.adv_estimator!r}: its "
                   "per-token sum of squared probabilities is taken from one behaviour model, "
                   "and a partial rollout's tokens come from several")
        elif self.algorithm.estimator_traits.needs_greedy_baseline:
            why = (f"with algorithm.adv_estimator={self.algorithm.adv_estimator!r}: its greedy "
                   "baseline is one generation of one version")
        if why:
            _fail("rollout", "partial_rollout", p, why)

    def _check_dapo(self) -> None:
        """DAPO's dynamic sampling and overlong buffer against the other sections."""
        gen, B = self.data.gen_batch_size, self.data.train_batch_size
        if gen and gen != B and not self.algorithm.filter_groups_enable:
            _fail("data", "gen_batch_size", gen,
                  f"differs from data.train_batch_size={B} but only applies with "
                  "algorithm.filter_groups_enable=True (DAPO's dynamic sampling); set it, or "
                  "leave data.gen_batch_size at 0")
        if self.algorithm.filter_groups_enable and self.algorithm.estimator_traits.needs_critic:
            _fail("algorithm", "filter_groups_enable", True,
                  f"filters groups of responses; algorithm.adv_estimator="
                  f"{self.algorithm.adv_estimator!r} has none: use a group estimator (grpo, "
                  "rloo, ...) as DAPO does")
        if self.algorithm.filter_groups_enable and self.rollout.n < 2:
            _fail("rollout", "n", self.rollout.n,
                  "algorithm.filter_groups_enable keeps groups whose responses differ; use "
                  "rollout.n >= 2")
        r, T = self.reward, self.rollout.max_new_tokens
        if r.overlong_buffer_enable and r.overlong_buffer_len > T:
            _fail("reward", "overlong_buffer_len", r.overlong_buffer_len,
                  f"must be <= rollout.max_new_tokens={T} (the buffer is the last "
                  "overlong_buffer_len tokens of the response budget)")

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
        blob = json.dumps(self.trajectory_fields(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()

    def trajectory_fields(self) -> dict:
        """What :meth:`trajectory_hash` hashes: the trajectory's fields, sections as dicts."""
        return _trajectory_fields(self, self)

    @classmethod
    def from_dict(cls, d: dict) -> "RunConfig":
        kw = {}
        known = {f.name for f in dataclasses.fields(cls)}
        for k, v in d.items():
            if k not in known:
                raise ConfigError(f"unknown config key {k!r}; known: {', '.join(sorted(known))}"
                                  f"{did_you_mean(str(k), known)}")
            if k in SECTIONS and not isinstance(v, dict):
                raise ConfigError(f"config section {k!r}={v!r}: must be a mapping of its fields, "
                                  f"e.g. {{\"{k}\": {{...}}}}, or use dotted keys ({k}.<field>)")
            if k in SECTIONS:
                sub_known = {f.name for f in dataclasses.fields(SECTIONS[k])}
                bad = set(v) - sub_known
                for name in sorted(bad):
                    _refuse_moved(f"{k}.{name}")
                if bad:
                    near = "".join(did_you_mean(f"{k}.{name}", dotted_keys())
                                   for name in sorted(bad))
                    raise ConfigError(f"unknown key(s) {sorted(bad)} in section {k!r}; "
                                      f"known: {', '.join(sorted(sub_known))}{near}")
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


@functools.cache
def dotted_keys() -> frozenset[str]:
    """Every key :func:`with_overrides` takes: ``total_steps``, ``optim.lr`` …"""
    return frozenset([n for n in _fields_of(RunConfig) if n not in SECTIONS] +
                     [f"{s}.{n}" for s, c in SECTIONS.items() for n in _fields_of(c)])


KEY_SYNONYMS = {"learning_rate": "lr", "max_steps": "total_steps", "num_generations": "n",
                "max_completion_length": "max_new_tokens"}
"""Field names other trainers (Hugging Face Trainer, trl) use for ours, which no string distance
reaches (``learning_rate`` is nearer to ``min_lr_ratio`` than to ``lr``)."""


def did_you_mean(key: str, known) -> str:
    """``"; did you mean optim.lr?"`` for the key of ``known`` nearest to the unknown ``key``, or
    "" when none is near. A key in a known section is matched against that section's fields
    only: over whole keys, a long shared prefix (``trainer.`` of ``trainer.lr`` and
    ``trainer.logger``) makes unrelated fields look near. A key in no known section is matched
    whole (a misspelled section: ``optm.lr``)."""
    parent, _, leaf = key.rpartition(".")
    prefix = f"{parent}." if parent else ""
    siblings = [k[len(prefix):] for k in known
                if k.startswith(prefix) and "." not in k[len(prefix):]]
    if siblings:
        near = [KEY_SYNONYMS[leaf]] if KEY_SYNONYMS.get(leaf) in siblings else \
            difflib.get_close_matches(leaf, siblings, n=1, cutoff=0.6)
        near = [prefix + n for n in near]
    else:
        near = difflib.get_close_matches(key, known, n=1, cutoff=0.8)
    return f"; did you mean {near[0]}?" if near else ""


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
            raise ConfigError(f"unknown config key {key!r}{did_you_mean(str(key), dotted_keys())}")
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
                raise ConfigError(f"unknown config section {p!r} in override {key!r}"
                                  f"{did_you_mean(key, dotted_keys())}")
            node = node[p]
        if parts[-1] not in node:
            raise ConfigError(f"unknown config key {key!r}{did_you_mean(key, dotted_keys())}")
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


CALCULATOR_DEFAULTS: dict[str, object] = {
    "rollout.multi_turn": True,
    "rollout.tool_config_path": "builtin:calculator",
    "rollout.max_assistant_turns": 2,
    "rollout.max_new_tokens": 112,
    "data.max_prompt_length": 16,
    "model.warmup_sft_steps": 800,
    "model.warmup_target_accuracy": 1.0,
}
"""The calculator task's settings (``data.synthetic_task=calculator`` with the tiny model), for
fields the overrides leave unset: multi-turn rollouts with the built-in calculator; a call turn
and an answer turn (the warm start's call ``<tool_call>{"name":"calculator","arguments":
{"expression":"4321*5678"}}</tool_call><eos>`` is 84 tokens, the tool's response 10, the answer
9: 103, and 112 leaves room); prompts of ``<bos>`` + ``4321*5678=`` (prompt and response fit the
tiny model's 128 positions); the two-part warm start of ``model.warmup_mixed_steps``, without the
early stop (the warm-started model answers without the tool when greedy, by design)."""


GUESS_DEFAULTS: dict[str, object] = {
    "rollout.multi_turn": True,
    "rollout.interaction_config_path": "builtin:guess",
    "rollout.max_assistant_turns": 4,
    "rollout.max_new_tokens": 32,
    "data.max_prompt_length": 8,
    "model.warmup_sft_steps": 300,
    "model.warmup_target_accuracy": 1.0,
}
"""The guessing game's settings (``data.synthetic_task=guess`` with the tiny model), for fields
the overrides leave unset: multi-turn rollouts against the built-in scripted user
(``agent/interactions.GuessInteraction``); four assistant turns, three of them answered (as in
verl, the turn at ``max_assistant_turns`` gets no answer: interval halving finds any number of
1..7 in three answered guesses); 32 response tokens (a guess is a digit and ``<eos>``, the
user's answer at most 7 characters); prompts of ``<bos>1-7?``; a warm start on random legal guesses
(``tiny_warmup.guess_transcripts``), without the early stop."""


CODE_DEFAULTS: dict[str, object] = {
    "rollout.max_new_tokens": 64,
    "model.warmup_sft_steps": 0,
}
"""The code task's settings with the tiny model (``data.synthetic_task=code``, no
``model.path``), for fields the overrides leave unset: a prompt (at most 63 characters and
``<bos>``) and 64 response tokens fill its 128 positions; no warm start (its targets are the
rows' ground truths, here tests, not answers): the untrained model's code fails the tests, so
rewards are about 0. A model you bring gets verl's sizes (:data:`USER_MODEL_DEFAULTS`)."""


USER_MODEL_EVAL: dict[str, object] = {"data.val_max_samples": 64}
"""Where a model you bring departs from verl's defaults: verl evaluates every held-out row
(``val_max_samples: -1``); a full GSM8K test split (1,319 prompts) at verl's 512-token responses
costs more CPU time than the training it measures, so such a run evaluates on a seeded subset of
64 unless you set the key (``data.val_max_samples=-1``: every row, as verl)."""


def _model_aware(base: RunConfig, overrides: dict) -> dict:
    """``overrides`` plus the defaults the model decides, for fields they leave unset: verl's
    (:data:`USER_MODEL_DEFAULTS`) with ``model.path``, else the demo's temperature; the
    calculator task's (:data:`CALCULATOR_DEFAULTS`); and the micro-batch fitted to the
    mini-batch (:func:`_fitted_micro_batch`)."""
    if overrides.get("data.synthetic_task") == "calculator":
        overrides = {**CALCULATOR_DEFAULTS, **overrides}
    if overrides.get("data.synthetic_task") == "guess":
        overrides = {**GUESS_DEFAULTS, **overrides}
    if overrides.get("data.synthetic_task") == "code" and not overrides.get("model.path"):
        overrides = {**CODE_DEFAULTS, **overrides}
    if overrides.get("model.path"):
        out = {**USER_MODEL_DEFAULTS, **USER_MODEL_EVAL, **overrides}
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
