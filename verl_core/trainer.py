"""The RL trainer: a container of a run's parts whose methods are the phases rollout -> reward ->
advantage -> update (and the evaluation).

Each phase takes and returns a :class:`~verl_core.data.batch.Batch` (plus a dict of float
metrics), so the plain-Python loop (``verl_core.train``) and the Flyte tasks call the same code.
Every phase is deterministic given the trainer state and its inputs: random draws come from seeds
derived from ``(run seed, step, phase)`` (``verl_core/seeds.py``), never from global RNG.

What is not here: the parts and their state (``verl_core/parts/``: the actor, the behaviour
policy, the critic; the trainer's :meth:`RLTrainer.state` is one loop over them, and
``checkpoint/`` stores it), the algorithms' math (``verl_core.algorithms``), the update loop
(``training/ppo.py``), the evaluation (``verl_core/evaluation.py``).
"""

from __future__ import annotations

import time
from typing import Sequence

import torch
from transformers.utils import logging as hf_logging

from verl_core.assets import Assets
from verl_core.checkpoint.state import capture_rng_state, restore_rng_state
from verl_core.config import RunConfig
from verl_core.data.batch import Batch
from verl_core.data.prompts import load_prompts
from verl_core.data.sampler import ResumableSampler
from verl_core.evaluation import evaluate
from verl_core.guard import checks, faults
from verl_core.guard.policy import GUARD_DEFAULTS
from verl_core.parts import Actor, Behaviour, Critic, Teacher
from verl_core.report import EvalSample
from verl_core.reward.decode import decode_responses
from verl_core.reward.manager import RewardScorer
from verl_core.reward.judge import Judge
from verl_core.reward.model import RewardModel
from verl_core.reward.overlong import OverlongBuffer
from verl_core.reward.scoring import decoded, group_first_rows, score_batch
from verl_core.seeds import derive_seed
from verl_core.training.advantage import compute_advantages
from verl_core.threads import intra_op_threads
from verl_core.training.device import make_deterministic, resolve_device
from verl_core.training.dist import SINGLE, DataParallel
from verl_core.training.forward import batched_logprobs, batched_sum_pi_squared, batched_values
from verl_core.training.packing import in_row_order, row_tokens, worker_order


hf_logging.disable_progress_bar()  # per-phase "Loading weights" bars would bury the step lines


HISTORY_STEPS = 256


def _poison_gradients(model) -> None:
    """VERL_FAULTS ``nan_grad``: the first parameter with a gradient gets a NaN one."""
    for p in model.parameters():
        if p.grad is not None:
            p.grad.fill_(float("nan"))
            return


class RLTrainer:
    """A run's parts (:class:`~verl_core.parts.Actor`, :class:`~verl_core.parts.Behaviour`,
    :class:`~verl_core.parts.Critic`), its prompts and data sampler, scorer and reward model;
    its methods are the RL phases. The parts own their state: a checkpoint is one loop over them
    (:meth:`state`, :meth:`load_targets`, :meth:`load_state`)."""

    def __init__(self, cfg: RunConfig, assets: Assets, dp: DataParallel = SINGLE):
        self.cfg = cfg
        self.dp = dp  # W > 1: FSDP2-sharded models, each worker rolls out its block of rows
        # the run's recorded count (verl_core.threads): never the host's or Ray's default, which
        # differ between modes and pods and change the float sums
        torch.set_num_threads(intra_op_threads(cfg))
        # trainer.device: every model lives there (its GPU, or the CPU); batches stay on the host
        self.device = resolve_device(cfg.trainer.device)
        make_deterministic(self.device, cfg.trainer.deterministic)
        self.prompts = load_prompts(cfg, assets)
        self.tokenizer = self.prompts.tokenizer
        self.sampler = ResumableSampler(len(self.prompts.train_rows), cfg.data.train_batch_size,
                                        cfg.seed, shuffle=cfg.data.shuffle)
        self.actor = Actor(cfg, assets.model_path, dp, self.device,
                           seed=derive_seed(cfg.seed, 0, "lora-init"))
        self.behaviour = Behaviour(cfg, assets, self.actor, self.prompts, dp, self.device)
        self.actor.build()
        self.critic = None
        if cfg.algorithm.uses_critic:
            self.critic = Critic(cfg, assets.model_path, dp, self.device,
                                 seed=derive_seed(cfg.seed, 0, "critic-init"))
        # guard state: what the update has had to refuse so far (non-finite gradients skip the
        # optimizer step); saved in every checkpoint so counters survive a resume
        self.guard = dict(GUARD_DEFAULTS)
        # the last HISTORY_STEPS updates' scalar metrics (detectors compare against them)
        self.history: list[dict] = []
        self.scorer = RewardScorer.from_config(cfg.reward)
        # reward_model.enable: a frozen scorer next to the policy, a full copy on every worker
        # (not FSDP-sharded: each worker scores its share of the rows on its own)
        self.reward_model = None
        if cfg.reward_model.enable:
            if not assets.reward_model_path:
                raise ValueError("reward_model.enable=True but the run's assets hold no reward "
                                 "model; prepare the run again with this config")
            if cfg.reward_model.style == "generative":  # a judge, served by a rollout engine
                self.reward_model = Judge.load(
                    assets.reward_model_path, cfg.reward_model,
                    template_path=assets.judge_template_path, device=self.device,
                    rollout_cfg=cfg.rollout)
            else:
                self.reward_model = RewardModel.load(
                    assets.reward_model_path, dtype=cfg.reward_model.dtype,
                    max_length=cfg.reward_model.max_length, device=self.device)
        # algorithm.distill_teacher_path: the frozen teacher, a full copy on every worker
        self.teacher = None
        if cfg.algorithm.distills:
            if not assets.teacher_path:
                raise ValueError("algorithm.distill_teacher_path is set but the run's assets "
                                 "hold no teacher; prepare the run again with this config")
            self.teacher = Teacher(assets.teacher_path, cfg.model.dtype, self.device)

    @property
    def parts(self) -> list:
        """The parts whose state a checkpoint holds, in the order their groups are stored."""
        return [p for p in (self.actor, self.behaviour, self.critic) if p is not None]

    def close(self):
        self.behaviour.close()
        if isinstance(self.reward_model, Judge):
            self.reward_model.close()
        self.scorer.close()
        self.prompts.close()

    # ------------------------------------------------------------------ state
    def state(self, step: int, *, with_optimizer: bool = True) -> tuple[dict, dict]:
        """Everything an exact resume needs after ``step`` updates, as checkpoint
        ``(groups, meta)`` for ``CheckpointManager.save_distributed`` (every worker calls it; no
        communication): each part's groups, the data position, the guard's state and history.
        The data position and every phase's randomness are functions of (seed, step), so the
        step is enough for them; rank 0's global RNG state is saved anyway for code that uses
        it."""
        groups, meta = {}, {}
        for part in self.parts:
            g, m = part.state_dict(with_optimizer=with_optimizer)
            groups.update(g)
            meta.update(m)
        if self.dp.rank == 0:
            groups["rng"] = capture_rng_state()
        meta.update(sampler=self.sampler.state_dict(), guard=dict(self.guard),
                    metrics_history=[dict(h) for h in self.history], step=step)
        return _ordered(groups, GROUP_ORDER), _ordered(meta, META_ORDER)

    def load_targets(self, groups=("policy", "critic")) -> dict:
        """``{group: state_dict}`` views of the live state for a load to fill in place
        (``CheckpointManager.load(out=...)`` with W = 1, ``load_distributed`` with W > 1: shards),
        so a resume never holds a second copy. After a failed load they may hold a partial mix:
        the caller loads another checkpoint or rebuilds."""
        out = {}
        for part in self.parts:
            out.update(part.load_targets())
        return {g: v for g, v in _ordered(out, GROUP_ORDER).items() if g in groups}

    def load_state(self, groups: dict, meta: dict, step: int) -> None:
        """Inverse of :meth:`state`: the state after ``step`` updates."""
        self.actor.load_state_dict(groups, meta)
        if self.critic is not None:
            self.critic.load_state_dict(groups, meta)
        self.behaviour.load_state_dict(groups, meta, step)
        self.sampler.load_state_dict(meta["sampler"])
        # checkpoints from before guard/history were saved start them empty
        self.guard = {**GUARD_DEFAULTS, **meta.get("guard", {})}
        self.history = [dict(h) for h in meta.get("metrics_history", [])][-HISTORY_STEPS:]
        if "rng" in groups:
            restore_rng_state(groups["rng"])

    def scale_lr(self, factor: float) -> None:
        """Multiply every learning rate (actor and critic) by ``factor`` from now on."""
        for part in (self.actor, self.critic):
            if part is not None:
                part.scale_lr(factor)

    # ------------------------------------------------------------------ phases
    def prompt_indices(self, step: int, *, keep_position: bool = False) -> list[int]:
        """Dataset indices of step ``step``'s prompts: a pure function of (seed, step). The
        sampler is left after them (what a checkpoint records), unless ``keep_position`` (the
        background rollout of the next step: the state stays the current step's)."""
        bpe = self.sampler.batches_per_epoch
        B = self.cfg.data.train_batch_size
        before = self.sampler.state_dict()
        self.sampler.load_state_dict({**before, "epoch": step // bpe,
                                      "position": (step % bpe) * B})
        idx = self.sampler.next_batch()
        if keep_position:
            self.sampler.load_state_dict(before)
        return idx

    def rollout(self, step: int) -> tuple[Batch, dict]:
        """The rollout of ``step`` from the behaviour policy (``Behaviour.rollout``), then the
        per-token inputs the later phases need from a model (:meth:`model_inputs`). Everything
        that needs model weights happens here or in :meth:`update`, so the reward and advantage
        phases are light functions of the batch. (DAPO's dynamic sampling calls the parts
        itself: ``engine/dynamic_sampling.py``.)"""
        batch, metrics = self.behaviour.rollout(step, self.prompt_indices(step),
                                                self.actor.kl_ctrl.value)
        return self.model_inputs(batch), metrics

    def sample(self, step: int, idx: list[int], phase: str = "rollout") -> tuple[Batch, dict]:
        """G responses for each prompt of dataset indices ``idx`` from the behaviour policy
        (``Behaviour.sample``), seeded by (seed, step, ``phase``)."""
        return self.behaviour.sample(step, idx, self.actor.kl_ctrl.value, phase)

    def follow(self, step: int, cursor: int | None = None) -> bool:
        """Update ``step`` starts: the behaviour policy follows (``Behaviour.follow``: off-policy
        it takes this state and samples the steps its weights serve in the background, up to
        step + ``rollout.max_staleness``). ``cursor``: with ``algorithm.filter_groups_enable``
        the generation batch where the batch of this update ended (its
        ``meta["gen_batches_end"]``), where DAPO's dynamic sampling of step + 1 starts
        (``engine/dynamic_sampling.py``): only that step samples in the background (a later
        step's position is known when the update before it starts, whose follow starts it),
        and none without ``cursor`` or whose sampling needs the live state
        (``samples_in_background``): they sample in the foreground. True when off-policy."""
        from verl_core.engine.dynamic_sampling import sample_and_filter, samples_in_background

        total, dapo = self.cfg.total_steps, self.cfg.algorithm.filter_groups_enable

        def job_for(t: int):
            if t >= total:
                return None
            if not dapo:
                return self.behaviour.rollout_job(t, self.prompt_indices(t, keep_position=True))
            if t != step + 1 or cursor is None or not samples_in_background(self.cfg):
                return None
            # a callable of the plan, as rollout_job's (one version: a partial rollout is not
            # offered with DAPO); the KL coefficient read now, not while the update changes it
            # (the rollout phase stamps the live one)
            kl_coef, start = self.actor.kl_ctrl.value, int(cursor)
            return lambda plan: sample_and_filter(self, t, start, plan[0], kl_coef=kl_coef)

        return self.behaviour.follow(step, job_for)

    def model_inputs(self, batch: Batch) -> Batch:
        """``batch`` with the per-token inputs the later phases need from a model: reference
        log-probs (KL), critic values (GAE), Σ_v π_v² per token (``needs_sum_pi_squared``) and
        the teacher's log-probs (on-policy distillation)."""
        traits = self.cfg.algorithm.estimator_traits
        micro, actor_cfg = self.cfg.actor.ppo_micro_batch_size, self.cfg.actor
        temperature = self.cfg.rollout.temperature or 1.0
        # with W > 1 each worker runs its block of rows through the sharded model (token-
        # balanced with trainer.balance_batch), then the rows are put back in order: (N, T)
        order = worker_order(row_tokens(batch), self.dp.size,
                             self.cfg.trainer.balance_batch and self.dp.distributed)
        part = batch.select(self.dp.block(order)) if self.dp.distributed else batch

        def gathered(local):
            return in_row_order(order, self.dp.gather_rows(local))

        if self.cfg.algorithm.uses_reference:
            with self.actor.reference() as ref:  # LoRA: the policy with its adapters off
                ref_lp = batched_logprobs(
                    ref, part, temperature, micro, dp=self.dp,
                    max_token_len=actor_cfg.token_budget("ref_log_prob_max_token_len_per_gpu"),
                    remove_padding=actor_cfg.use_remove_padding,
                    prefix_grouper=actor_cfg.use_prefix_grouper)
            batch = batch.replace(ref_logprobs=gathered(ref_lp))
        if self.teacher is not None:  # stored with the batch: a resume never asks it again
            batch = batch.replace(teacher_logprobs=gathered(self.teacher.logprobs(
                part, micro,
                max_token_len=actor_cfg.token_budget("ref_log_prob_max_token_len_per_gpu"),
                remove_padding=actor_cfg.use_remove_padding)))
        if self.critic is not None:
            batch = batch.replace(values=gathered(batched_values(
                self.critic.model, part, micro, dp=self.dp,
                max_token_len=actor_cfg.token_budget("critic_forward_max_token_len_per_gpu"),
                remove_padding=actor_cfg.use_remove_padding)))
        if traits.needs_sum_pi_squared:
            # the behaviour model: the weights (and temperature) that sampled the responses,
            # whose log-probs are the estimator's old_logprobs (with W > 1 a full copy)
            version = int(batch.meta.get("policy_version", 0))
            with self.behaviour.holding(version) as behaviour:
                batch = batch.replace(sum_pi_squared=gathered(batched_sum_pi_squared(
                    behaviour, part, temperature, micro,
                    max_token_len=actor_cfg.token_budget("log_prob_max_token_len_per_gpu"),
                    dp=self.dp, remove_padding=actor_cfg.use_remove_padding)))
        return batch

    def reward(self, batch: Batch, details: dict | None = None) -> tuple[Batch, dict]:
        """Score ``batch`` (:func:`score_batch`). With ``reward_model.enable`` the reward model
        scores the rows (and ReMax's greedy responses) first, every worker its share (a
        collective: with W > 1 every worker calls this); then only rank 0 runs ``reward.scorer``
        and returns the scored batch, the others return the batch unscored with no metrics (the
        driver keeps rank 0's result, as for the rollout). ``details``: as :func:`score_batch`'s
        (rank 0)."""
        rm, overlong = self.reward_model, OverlongBuffer.of(self.cfg)
        if rm is None:
            return score_batch(batch, self.scorer, self.tokenizer, overlong=overlong,
                               details=details)
        t0 = time.perf_counter()
        uids, texts = batch.uid, decoded(self.tokenizer, batch).texts
        judged: dict = {}  # a generative judge's answers and counts, by kind of row
        step = int(batch.meta.get("step", 0))
        scores = self.model_scores(uids, texts, step=step, kind="row", judged=judged)  # (N,)
        baseline = None
        if batch.baseline_response_ids is not None:
            rows = group_first_rows(batch.group)  # (B,)
            idx = torch.tensor(rows, dtype=torch.long)
            greedy = decode_responses(self.tokenizer, batch.baseline_response_ids[idx],
                                      batch.baseline_response_mask[idx]).texts
            baseline = self.model_scores([uids[i] for i in rows], greedy, step=step,
                                         kind="baseline", judged=judged)  # (B,)
        dt = time.perf_counter() - t0
        if self.dp.rank != 0:
            return batch, {}
        out, metrics = score_batch(batch, self.scorer, self.tokenizer, model_scores=scores,
                                   baseline_model_scores=baseline,
                                   combine=self.cfg.reward_model.combine, overlong=overlong,
                                   details=details)
        metrics["reward/model_time_s"] = dt
        if judged:  # stored with the batch: what the judge said, beside the score it gave
            out = out.replace(meta={**out.meta, **{f"judge_{k}_outputs": r.outputs
                                                   for k, r in judged.items()}})
            asked = sum(len(r.outputs) for r in judged.values())
            metrics["reward/judge_failed"] = float(sum(r.failed for r in judged.values()))
            metrics["reward/judge_unparsed"] = float(sum(r.unparsed for r in judged.values()))
            metrics["reward/judge_rows_per_s"] = asked / max(dt, 1e-9)
        return out, metrics

    def model_scores(self, uids: Sequence[str], responses: Sequence[str], *, step: int = 0,
                     kind: str = "row", judged: dict | None = None) -> list[float]:
        """(n,) the reward model's score of each (training prompt ``uids[i]``, response text
        ``responses[i]``), the prompt found by its uid (the training row's index); with W > 1
        each worker scores its share (``RewardModel.score_rows``, ``Judge.judge_rows``: a
        collective). A generative judge (``reward_model.style=generative``) samples row i of
        ``step`` from ``derive_seed(seed, step, f"judge-{kind}-{i}")`` and puts its
        :class:`~verl_core.reward.judge.JudgeResult` in ``judged[kind]``."""
        rows = [self.prompts.train_rows[int(u)] for u in uids]
        if isinstance(self.reward_model, Judge):
            seeds = [derive_seed(self.cfg.seed, step, f"judge-{kind}-{i}")
                     for i in range(len(rows))]
            result = self.reward_model.judge_rows(rows, responses, seeds=seeds, dp=self.dp)
            if judged is not None:
                judged[kind] = result
            return result.scores
        return self.reward_model.score_rows(
            rows, responses, self.tokenizer, self.dp,
            micro_batch_size=self.cfg.reward_model.micro_batch_size)

    def advantage(self, batch: Batch) -> tuple[Batch, dict]:
        return compute_advantages(batch, self.cfg.algorithm)

    def update(self, batch: Batch, step: int) -> dict:
        """Update ``step`` on the advantaged ``batch`` (``Actor.update``, with the critic),
        seeded by the step; the guard's history remembers the step's metrics."""
        c = self.cfg
        # a VERL_FAULTS drill (nan_grad): NaN gradients after the first backward; else None
        poison = _poison_gradients if faults.hook("after_backward", step) else None
        # any stochastic layer (dropout in a user's model) draws from global RNG: pin it to the
        # step, so the update stays a pure function of (state, batch, step)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(derive_seed(c.seed, step, "update-global"))
            metrics = self.actor.update(batch, seed=derive_seed(c.seed, step, "update"),
                                        critic=self.critic, after_backward=poison)
        if self.device.type == "cuda":  # verl's perf/* memory metrics: the step's peak
            metrics["perf/max_memory_allocated_gb"] = \
                torch.cuda.max_memory_allocated(self.device) / 2**30
            metrics["perf/max_memory_reserved_gb"] = \
                torch.cuda.max_memory_reserved(self.device) / 2**30
            torch.cuda.reset_peak_memory_stats(self.device)
        self.behaviour.actor_changed()
        self._remember(step, batch, metrics)
        return metrics

    def _remember(self, step: int, batch: Batch, metrics: dict) -> None:
        """Update the guard counters and the bounded metrics history after update ``step``."""
        skipped = int(metrics.get("update/skipped_nonfinite_steps", 0))
        self.guard["consecutive_skips"] = 0  # an applied update ends a run of skipped ones
        if skipped:
            self.guard["skipped_nonfinite_steps"] += skipped
            self.guard["last_skipped_step"] = step
        entry = {"step": step, **{k: float(v) for k, v in metrics.items()
                                  if isinstance(v, (int, float))}}
        # what the batch says about the step (reward, length, advantages): the signals the
        # guard's batch detectors compare against this history
        entry.update(checks.batch_signals(batch))
        self.history.append(entry)
        del self.history[:-HISTORY_STEPS]

    @torch.no_grad()
    def evaluate(self, step: int = 0) -> dict:
        """The held-out metrics (``verl_core/evaluation.py``) of the policy after ``step``."""
        return self.evaluate_with_samples(0, step)[0]

    @torch.no_grad()
    def evaluate_with_samples(self, n_samples: int, step: int = 0) -> tuple[dict, list[EvalSample]]:
        """:meth:`evaluate`, plus the first ``n_samples`` held-out responses as decoded (for the
        reports; with W > 1, from this worker's share)."""
        return evaluate(self.cfg, self.behaviour, self.prompts, self.scorer, self.dp, n_samples,
                        step, seed=derive_seed(self.cfg.seed, step, "val"))


GROUP_ORDER = ("policy", "base", "rng", "optimizer", "reference", "behaviour", "behaviour_1",
               "behaviour_2", "behaviour_3", "critic", "critic_optimizer")
META_ORDER = ("kl_ctrl", "sampler", "hf_config", "guard", "metrics_history", "lora", "scheduler",
              "critic_scheduler", "step", "behaviour_step", "behaviour_versions")
"""The order a checkpoint stores its groups and meta in (a manifest's bytes, hence its hash,
follow it): the order from before the parts, kept; the behaviour's versions past the first
(``rollout.max_staleness`` > 1) after it."""


def _ordered(d: dict, order: Sequence[str]) -> dict:
    return {k: d[k] for k in sorted(d, key=order.index)}
