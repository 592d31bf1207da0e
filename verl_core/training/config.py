"""The ``optim`` and ``actor`` sections of :class:`~verl_core.config.RunConfig`: AdamW and its LR
schedule, and the sizes of the PPO update (epochs, mini- and micro-batches, token budgets),
beside the update. Composed into the run, checked against the other sections (a mini-batch must
divide the batch, ...) and hashed in ``verl_core/config.py``. The loss settings (the
``algorithm`` section) stay there: the advantage, reward and update phases all read them, and
``verl_core.algorithms``, whose registries they name, imports nothing but itself.
"""

from __future__ import annotations

from dataclasses import dataclass

from verl_core.config_fields import (_check_types, _fail, _non_negative, _one_of, _positive,
                                     in_trajectory)


def _rl_step_unit(run) -> bool:
    """``optim.lr_schedule_unit`` at its default: the run hashes as before the field existed."""
    return run.optim.lr_schedule_unit != "optimizer_step"


def _own_critic_warmup(run) -> bool:
    """``optim.critic_warmup_steps`` -1 (the actor's): the run hashes as before the field."""
    return run.optim.critic_warmup_steps >= 0


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
    critic_warmup_steps: int = in_trajectory(-1, when=_own_critic_warmup)
    """The critic's linear LR warmup (verl's ``critic.optim.lr_warmup_steps``); -1: the actor's
    ``warmup_steps``."""
    lr_schedule: str = in_trajectory("constant")
    """After warmup: constant or cosine (to ``min_lr_ratio * lr`` at the last step)."""
    lr_schedule_unit: str = in_trajectory("optimizer_step", when=_rl_step_unit)
    """What ``warmup_steps`` and the cosine count: ``optimizer_step`` (the LR moves at every
    mini-batch's step) or ``rl_step`` (it moves once per RL step, as verl's scheduler does: its
    ``lr_warmup_steps`` are RL steps; a verl schedule key sets this)."""
    min_lr_ratio: float = in_trajectory(0.1)
    """Cosine floor as a fraction of the peak LR."""
    grad_clip: float = in_trajectory(1.0)
    """Clip the global gradient norm to this value."""

    def __post_init__(self):
        _check_types("optim", self)
        _positive("optim", self, "lr", "critic_lr", "eps", "grad_clip")
        _non_negative("optim", self, "weight_decay", "warmup_steps")
        if self.critic_warmup_steps < -1:
            _fail("optim", "critic_warmup_steps", self.critic_warmup_steps,
                  "must be >= 0, or -1 for the actor's warmup_steps")
        _one_of("optim", "lr_schedule", self.lr_schedule, {"constant", "cosine"})
        _one_of("optim", "lr_schedule_unit", self.lr_schedule_unit, {"optimizer_step", "rl_step"})
        for n in ("beta1", "beta2"):
            if not 0.0 <= getattr(self, n) < 1.0:
                _fail("optim", n, getattr(self, n), "must be in [0, 1)")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            _fail("optim", "min_lr_ratio", self.min_lr_ratio, "must be in [0, 1]")


def _remove_padding_on(run) -> bool:
    """``actor.use_remove_padding`` off: the field does nothing, and the run hashes as before it
    existed."""
    return run.actor.use_remove_padding


def _prefix_grouper_on(run) -> bool:
    """``actor.use_prefix_grouper`` off: the run hashes as before the field existed."""
    return run.actor.use_prefix_grouper


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
    use_remove_padding: bool = in_trajectory(False, when=_remove_padding_on)
    """No compute on padding, for every forward the trainer runs (verl's
    ``actor_rollout_ref.model.use_remove_padding`` and ``critic.model.use_remove_padding``):
    each micro-batch's rows run as one sequence of their real tokens with per-row position ids
    (per-row SDPA on CPU, flash-attention varlen on CUDA), and the token budgets above count
    real tokens (Karmarkar-Karp-balanced micro-batches); a model whose attention cannot take
    packed rows has its rows bucketed by length instead. Speed and memory only: the same
    log-probs, values and update up to float summation order."""
    use_prefix_grouper: bool = in_trajectory(False, when=_prefix_grouper_on)
    """Each distinct prompt of a micro-batch runs once in the trainer's log-prob forwards
    (reference, old log-probs, the update's forward and backward), not once per response
    (verl's ``actor_rollout_ref.actor.use_prefix_grouper``; GRPO's G responses share their
    prompt): the prompt's keys and values are computed once and every response attends to them
    (``training/forward.py``, ``_shared_prefix``), any Hugging Face causal LM, no modified model.
    The same log-probs and gradients up to float rounding; prompt compute / G. Not with
    ``use_remove_padding`` (packed rows), as in verl; a micro-batch whose prompts are all
    distinct, a model under activation checkpointing or sharded over workers runs rows whole.
    (The rollout's prefill shares a prompt across its samples always.)"""

    def __post_init__(self):
        _check_types("actor", self)
        _positive("actor", self, "ppo_epochs", "ppo_mini_batch_size", "ppo_micro_batch_size",
                  "ppo_max_token_len_per_gpu", "log_prob_max_token_len_per_gpu",
                  "ref_log_prob_max_token_len_per_gpu", "critic_ppo_max_token_len_per_gpu",
                  "critic_forward_max_token_len_per_gpu")
        if self.use_prefix_grouper and self.use_remove_padding:
            _fail("actor", "use_prefix_grouper", True,
                  "cannot be combined with actor.use_remove_padding=true (packed rows have no "
                  "per-row prompt to share; verl refuses the pair too): set one of them false")

    def token_budget(self, name: str) -> int:
        """``name``'s token budget when ``use_dynamic_bsz``, else 0 (micro-batches of rows)."""
        return getattr(self, name) if self.use_dynamic_bsz else 0
