"""The RL trainer: one object that runs the phases rollout -> reward -> advantage -> update.

Each phase is a method that takes and returns a :class:`~verl_core.data.batch.Batch` (plus a dict
of float metrics), so the plain-Python loop (``verl_core.train``) and the Flyte tasks call the
same code. Every phase is deterministic given the trainer state and its inputs: random draws come
from seeds derived from ``(run seed, step, phase)``, never from global RNG.

What is not here: the algorithms' math (``verl_core.algorithms``), the update loop
(``training/ppo.py``), persistence (``checkpoint/``).
"""

from __future__ import annotations

import hashlib
import os
import time
from dataclasses import dataclass

import torch
from transformers.utils import logging as hf_logging

from verl_core.algorithms import (apply_kl_penalty, get_advantage_estimator, make_kl_controller,
                                  outcome_to_token_rewards)
from verl_core.algorithms.utils import masked_mean
from verl_core.checkpoint.state import capture_rng_state, restore_rng_state
from verl_core.config import RunConfig
from verl_core.data.batch import Batch, encode_prompts
from verl_core.data.dataset import PromptRow, load_prompt_rows, render_prompt
from verl_core.data.sampler import ResumableSampler
from verl_core.data.synthetic import write_arithmetic_dataset
from verl_core.models import build_tiny_model, load_causal_lm, load_critic, load_tokenizer
from verl_core.reward.manager import RewardScorer
from verl_core.rollout import SamplingParams, make_engine
from verl_core.training.forward import batched_logprobs, batched_values
from verl_core.training.optim import make_optimizer, make_scheduler
from verl_core.training.ppo import ppo_update
from verl_core.training.sft import supervised_warm_start


hf_logging.disable_progress_bar()  # per-phase "Loading weights" bars would bury the step lines


def derive_seed(seed: int, step: int, phase: str) -> int:
    """A 63-bit seed for one phase of one step (DESIGN rule 3)."""
    digest = hashlib.blake2b(f"{seed}:{step}:{phase}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


HISTORY_STEPS = 256
GUARD_DEFAULTS = {"skipped_nonfinite_steps": 0, "last_skipped_step": None}


@dataclass(frozen=True)
class Assets:
    """What a run starts from: a model folder and the train/val parquet files."""

    model_path: str
    train_files: list[str]
    val_files: list[str]


def prepare_assets(cfg: RunConfig, workdir: str, log=print) -> Assets:
    """Materialise the embedded defaults: the synthetic dataset when no files are given, the tiny
    warm-started model when no model path is given. Deterministic in ``cfg.seed``."""
    if cfg.data.train_files:
        train_files, val_files = cfg.data.train_file_list, cfg.data.val_file_list
    else:
        train, val = write_arithmetic_dataset(
            os.path.join(workdir, "data"), train_size=cfg.data.synthetic_train_size,
            val_size=cfg.data.synthetic_val_size, max_operand=cfg.data.synthetic_max_operand,
            seed=cfg.seed)
        train_files, val_files = [train], [val]
    if cfg.model.path:
        model_path = cfg.model.path
        load_tokenizer(model_path)  # fail fast with a clear message
    else:
        model_path = os.path.join(workdir, "model")
        m = cfg.model
        model, tok = build_tiny_model(hidden_size=m.tiny_hidden_size, layers=m.tiny_layers,
                                      heads=m.tiny_heads, seed=cfg.seed)
        rows = load_prompt_rows(train_files)
        prompts = [render_prompt(r, tok) for r in rows]
        probe = _AccuracyProbe(model, tok, rows[:256], prompts[:256], cfg)
        t0 = time.perf_counter()
        losses = supervised_warm_start(
            model, tok, prompts, [r.ground_truth for r in rows],
            steps=m.warmup_sft_steps, batch_size=m.warmup_sft_batch_size, lr=m.warmup_sft_lr,
            seed=derive_seed(cfg.seed, 0, "sft"), max_prompt_length=cfg.data.max_prompt_length,
            stop_fn=(lambda: probe() >= m.warmup_target_accuracy)
            if m.warmup_target_accuracy < 1.0 else None)
        if losses:
            acc = "" if probe.last != probe.last else f", train-slice accuracy {probe.last:.3f}"
            log(f"warm start: {len(losses)} SFT steps in {time.perf_counter() - t0:.1f}s, "
                f"loss {losses[0]:.3f} -> {losses[-1]:.3f}{acc}")
        model.save_pretrained(model_path, safe_serialization=True)
        tok.save_pretrained(model_path)
    return Assets(model_path=model_path, train_files=train_files, val_files=val_files)


def score_batch(batch: Batch, scorer: RewardScorer, tokenizer) -> tuple[Batch, dict]:
    """Reward phase: decode the responses and score them. Adds ``score`` (N,)."""
    texts = tokenizer.batch_decode(batch.response_ids, skip_special_tokens=True)
    res = scorer.score(batch.data_source, texts, batch.ground_truth, batch.extra_info)
    score = torch.tensor(res.scores, dtype=torch.float32)  # (N,)
    metrics = {"reward/mean": float(score.mean()), "reward/max": float(score.max()),
               "reward/min": float(score.min()), "reward/timeouts": float(res.num_timeouts)}
    return batch.replace(score=score), metrics


def compute_advantages(batch: Batch, algo) -> tuple[Batch, dict]:
    """Advantage phase: token rewards (the outcome score on the last response token, minus
    ``kl_coef * KL`` when ``use_kl_in_reward``), then the configured estimator. Adds
    ``advantages``/``returns`` (N, T); records the reward KL in ``meta["reward_kl"]``."""
    mask = batch.response_mask
    token_rewards = outcome_to_token_rewards(batch.score, mask)  # (N, T)
    metrics = {}
    meta = dict(batch.meta)
    if algo.use_kl_in_reward:
        # The rollout log-probs stand in for the actor's: the hf engine computes them with the
        # same weights and forward (within float rounding).
        token_rewards, kl_m = apply_kl_penalty(
            token_rewards, batch.response_logprobs, batch.ref_logprobs, mask,
            kl_coef=meta["kl_coef"], kl_penalty=algo.kl_penalty)
        meta["reward_kl"] = float(kl_m["kl"])
        metrics["actor/reward_kl"] = meta["reward_kl"]
    adv, ret = get_advantage_estimator(algo.adv_estimator)(
        token_rewards, mask, batch.group, batch.values, gamma=algo.gamma, lam=algo.lam,
        norm_adv_by_std_in_grpo=algo.norm_adv_by_std_in_grpo)
    metrics["advantages/mean"] = float(masked_mean(adv, mask))
    metrics["advantages/abs_max"] = float((adv.abs() * mask).max()) if mask.any() else 0.0
    if batch.values is not None:
        metrics["critic/values_mean"] = float(masked_mean(batch.values, mask))
    return batch.replace(advantages=adv, returns=ret, meta=meta), metrics


class _AccuracyProbe:
    """Greedy accuracy of ``model`` on a fixed slice of training prompts (rule scorer)."""

    def __init__(self, model, tok, rows, prompts, cfg: RunConfig):
        self.ids, self.mask = encode_prompts(tok, prompts, cfg.data.max_prompt_length)
        self.rows, self.tok = rows, tok
        self.engine = make_engine("hf", model=model, eos_token_id=tok.eos_token_id,
                                  pad_token_id=tok.pad_token_id)
        self.params = SamplingParams(temperature=0.0, max_new_tokens=cfg.rollout.max_new_tokens)
        self.scorer = RewardScorer(cfg.reward.scorer)
        self.last = float("nan")

    def __call__(self) -> float:
        out = self.engine.generate(self.ids, self.mask, self.params)
        texts = self.tok.batch_decode(out.response_ids, skip_special_tokens=True)
        res = self.scorer.score([r.data_source for r in self.rows], texts,
                                [r.ground_truth for r in self.rows])
        self.last = sum(res.scores) / len(res.scores)
        return self.last


def encode_rows(tokenizer, rows: list[PromptRow], max_len: int):
    texts = [render_prompt(r, tokenizer) for r in rows]
    return encode_prompts(tokenizer, texts, max_len, names=[f"dataset row {r.index}" for r in rows])


class RLTrainer:
    """Holds the models, optimizers and data of a run; its methods are the RL phases."""

    def __init__(self, cfg: RunConfig, assets: Assets):
        self.cfg = cfg
        if cfg.num_threads:
            torch.set_num_threads(cfg.num_threads)
        self.tokenizer = tok = load_tokenizer(assets.model_path)
        self.train_rows = load_prompt_rows(assets.train_files)
        self.val_rows = load_prompt_rows(assets.val_files)
        self.train_prompt_ids, self.train_prompt_mask = encode_rows(
            tok, self.train_rows, cfg.data.max_prompt_length)
        self.val_prompt_ids, self.val_prompt_mask = encode_rows(
            tok, self.val_rows, cfg.data.max_prompt_length)
        self.sampler = ResumableSampler(len(self.train_rows), cfg.data.train_batch_size, cfg.seed,
                                        shuffle=cfg.data.shuffle)
        algo = cfg.algorithm
        self.actor = load_causal_lm(assets.model_path, cfg.model.dtype)
        if cfg.model.gradient_checkpointing:
            self.actor.gradient_checkpointing_enable()
        self.ref = None
        if algo.uses_reference:
            self.ref = load_causal_lm(assets.model_path, cfg.model.dtype).requires_grad_(False)
        total = cfg.total_optimizer_steps
        self.actor_optimizer = make_optimizer(self.actor.parameters(), cfg.optim, cfg.optim.lr)
        self.actor_scheduler = make_scheduler(self.actor_optimizer, cfg.optim, total)
        self.critic = self.critic_optimizer = self.critic_scheduler = None
        if algo.uses_critic:
            # the value head is freshly initialised: seed it, so every worker builds the same one
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(derive_seed(cfg.seed, 0, "critic-init"))
                self.critic = load_critic(assets.model_path, cfg.model.dtype)
            self.critic_optimizer = make_optimizer(self.critic.parameters(), cfg.optim,
                                                   cfg.optim.critic_lr)
            self.critic_scheduler = make_scheduler(self.critic_optimizer, cfg.optim, total)
        # guard state: what the update has had to refuse so far (non-finite gradients skip the
        # optimizer step); saved in every checkpoint so counters survive a resume
        self.guard = dict(GUARD_DEFAULTS)
        # the last HISTORY_STEPS updates' scalar metrics (detectors compare against them)
        self.history: list[dict] = []
        self.kl_ctrl = make_kl_controller(algo.kl_ctrl_type, kl_coef=algo.kl_coef,
                                          target_kl=algo.kl_target, horizon=algo.kl_horizon)
        self.engine = make_engine(cfg.rollout.engine, model=self.actor, model_path=assets.model_path,
                                  eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                                  micro_batch_size=cfg.rollout.micro_batch_size)
        self.scorer = RewardScorer(cfg.reward.scorer, timeout_s=cfg.reward.timeout_s,
                                   timeout_score=cfg.reward.timeout_score,
                                   num_workers=cfg.reward.num_workers)

    def close(self):
        self.scorer.close()

    # ------------------------------------------------------------------ state
    def state(self, *, with_optimizer: bool = True) -> tuple[dict, dict]:
        """Everything an exact resume needs, as checkpoint ``(groups, meta)``. The data position
        and every phase's randomness are functions of (seed, step), so the step is enough for
        them; global RNG states are saved anyway for code that uses them."""
        groups = {"policy": self.actor.state_dict(), "rng": capture_rng_state()}
        meta = {"kl_ctrl": self.kl_ctrl.state_dict(), "sampler": self.sampler.state_dict(),
                "hf_config": self.actor.config.to_dict(), "guard": dict(self.guard),
                "metrics_history": [dict(h) for h in self.history]}
        if with_optimizer:
            groups["optimizer"] = self.actor_optimizer.state_dict()
            meta["scheduler"] = self.actor_scheduler.state_dict()
        if self.ref is not None:  # a "shared" group: stored once per run, linked by later saves
            groups["reference"] = self.ref.state_dict()
        if self.critic is not None:
            groups["critic"] = self.critic.state_dict()
            if with_optimizer:
                groups["critic_optimizer"] = self.critic_optimizer.state_dict()
                meta["critic_scheduler"] = self.critic_scheduler.state_dict()
        return groups, meta

    def load_targets(self) -> dict:
        """``{group: {tensor: destination}}`` for ``CheckpointManager.load(out=...)``: the live
        weights, so a resume reads into them instead of allocating a second copy. After a failed
        load they may hold a partial mix: the caller loads another checkpoint or rebuilds."""
        out = {"policy": self.actor.state_dict()}
        if self.critic is not None:
            out["critic"] = self.critic.state_dict()
        return out

    def load_state(self, groups: dict, meta: dict) -> None:
        """Inverse of :meth:`state` (a checkpoint without optimizer state restarts the moments)."""
        self.actor.load_state_dict(groups["policy"])
        if "optimizer" in groups:
            self.actor_optimizer.load_state_dict(groups["optimizer"])
            self.actor_scheduler.load_state_dict(meta["scheduler"])
        else:  # no stale moments from whatever this trainer held before
            self.actor_optimizer.state.clear()
        if self.critic is not None:
            if "critic" not in groups:
                raise ValueError("checkpoint has no critic but this run trains one "
                                 f"(algorithm.adv_estimator={self.cfg.algorithm.adv_estimator!r})")
            self.critic.load_state_dict(groups["critic"])
            if "critic_optimizer" in groups:
                self.critic_optimizer.load_state_dict(groups["critic_optimizer"])
                self.critic_scheduler.load_state_dict(meta["critic_scheduler"])
            else:
                self.critic_optimizer.state.clear()
        self.kl_ctrl.load_state_dict(meta["kl_ctrl"])
        self.sampler.load_state_dict(meta["sampler"])
        # checkpoints from before guard/history were saved start them empty
        self.guard = {**GUARD_DEFAULTS, **meta.get("guard", {})}
        self.history = [dict(h) for h in meta.get("metrics_history", [])][-HISTORY_STEPS:]
        if "rng" in groups:
            restore_rng_state(groups["rng"])

    # ------------------------------------------------------------------ phases
    def prompt_indices(self, step: int) -> list[int]:
        """Dataset indices of step ``step``'s prompts: a pure function of (seed, step)."""
        bpe = self.sampler.batches_per_epoch
        B = self.cfg.data.train_batch_size
        self.sampler.load_state_dict({**self.sampler.state_dict(), "epoch": step // bpe,
                                      "position": (step % bpe) * B})
        return self.sampler.next_batch()

    def rollout(self, step: int) -> tuple[Batch, dict]:
        """Sample G responses for each of the B prompts of ``step``, then the per-token inputs
        the later phases need from a model: reference log-probs (KL) and critic values (GAE).
        Everything that needs model weights happens here or in :meth:`update`, so the reward and
        advantage phases are light functions of the batch."""
        rc, G = self.cfg.rollout, self.cfg.rollout.n
        idx = self.prompt_indices(step)
        rows_idx = torch.tensor(idx).repeat_interleave(G)  # (N,): prompt b's G samples adjacent
        params = SamplingParams(temperature=rc.temperature, top_p=rc.top_p, top_k=rc.top_k,
                                max_new_tokens=rc.max_new_tokens,
                                seed=derive_seed(self.cfg.seed, step, "rollout"))
        t0 = time.perf_counter()
        out = self.engine.generate(self.train_prompt_ids[rows_idx],
                                   self.train_prompt_mask[rows_idx], params)
        dt = time.perf_counter() - t0
        rows = [self.train_rows[i] for i in rows_idx.tolist()]
        batch = Batch(
            prompt_ids=self.train_prompt_ids[rows_idx], prompt_mask=self.train_prompt_mask[rows_idx],
            response_ids=out.response_ids, response_mask=out.response_mask,
            response_logprobs=out.logprobs,
            group=torch.arange(len(idx)).repeat_interleave(G),
            uid=[str(r.index) for r in rows], ground_truth=[r.ground_truth for r in rows],
            data_source=[r.data_source for r in rows], extra_info=[r.extra_info for r in rows],
            pad_id=self.tokenizer.pad_token_id,
            meta={"step": step, "kl_coef": self.kl_ctrl.value})
        micro = self.cfg.trainer.ppo_micro_batch_size
        if self.ref is not None:
            batch = batch.replace(ref_logprobs=batched_logprobs(
                self.ref, batch, self.cfg.rollout.temperature or 1.0, micro))
        if self.critic is not None:
            batch = batch.replace(values=batched_values(self.critic, batch, micro))
        tokens = float(out.response_mask.sum())
        return batch, {"rollout/time_s": dt, "rollout/tokens_per_s": tokens / max(dt, 1e-9),
                       "response_length/mean": tokens / batch.num_rows}

    def reward(self, batch: Batch) -> tuple[Batch, dict]:
        return score_batch(batch, self.scorer, self.tokenizer)

    def advantage(self, batch: Batch) -> tuple[Batch, dict]:
        return compute_advantages(batch, self.cfg.algorithm)

    def update(self, batch: Batch, step: int) -> dict:
        c = self.cfg
        metrics = {}
        if c.algorithm.use_kl_in_reward:
            # the controller moves here, not in the advantage phase, so the state it belongs to
            # changes in exactly one phase (the one that also changes the weights)
            self.kl_ctrl.update(batch.meta["reward_kl"], batch.num_rows)
            metrics["actor/kl_coef"] = self.kl_ctrl.value
        # any stochastic layer (dropout in a user's model) draws from global RNG: pin it to the
        # step, so the update stays a pure function of (state, batch, step)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(derive_seed(c.seed, step, "update-global"))
            metrics.update(self._ppo_update(batch, step))
        self._remember(step, batch, metrics)
        return metrics

    def _remember(self, step: int, batch: Batch, metrics: dict) -> None:
        """Update the guard counters and the bounded metrics history after update ``step``."""
        skipped = int(metrics.get("update/skipped_nonfinite_steps", 0))
        if skipped:
            self.guard["skipped_nonfinite_steps"] += skipped
            self.guard["last_skipped_step"] = step
        entry = {"step": step, **{k: float(v) for k, v in metrics.items()
                                  if isinstance(v, (int, float))}}
        if batch.score is not None:  # the reward phase reports it; kept here for the history
            entry["reward/mean"] = float(batch.score.float().mean())
        self.history.append(entry)
        del self.history[:-HISTORY_STEPS]

    def _ppo_update(self, batch: Batch, step: int) -> dict:
        c, G = self.cfg, self.cfg.rollout.n
        return ppo_update(
            self.actor, self.actor_optimizer, self.actor_scheduler, batch, c.algorithm,
            temperature=c.rollout.temperature, mini_batch_rows=c.trainer.ppo_mini_batch_size * G,
            micro_batch_rows=c.trainer.ppo_micro_batch_size, epochs=c.trainer.ppo_epochs,
            grad_clip=c.optim.grad_clip, seed=derive_seed(c.seed, step, "update"),
            critic=self.critic, critic_optimizer=self.critic_optimizer,
            critic_scheduler=self.critic_scheduler)

    @torch.no_grad()
    def evaluate(self) -> dict:
        """Greedy decoding on the held-out split: accuracy = mean score."""
        params = SamplingParams(temperature=0.0, max_new_tokens=self.cfg.rollout.max_new_tokens)
        texts, lengths = [], []
        step = self.cfg.data.val_batch_size
        for s in range(0, self.val_prompt_ids.shape[0], step):
            out = self.engine.generate(self.val_prompt_ids[s:s + step],
                                       self.val_prompt_mask[s:s + step], params)
            texts += self.tokenizer.batch_decode(out.response_ids, skip_special_tokens=True)
            lengths += out.response_mask.sum(-1).tolist()
        res = self.scorer.score([r.data_source for r in self.val_rows], texts,
                                [r.ground_truth for r in self.val_rows],
                                [r.extra_info for r in self.val_rows])
        return {"val/accuracy": sum(res.scores) / max(1, len(res.scores)),
                "val/response_length": sum(lengths) / max(1, len(lengths))}
