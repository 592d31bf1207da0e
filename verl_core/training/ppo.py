"""The PPO update: epochs over shuffled mini-batches, micro-batch gradient accumulation.

Used for every estimator (GRPO, RLOO, REINFORCE++ … differ only in the advantages they feed in).
The losses come from the registries in ``verl_core.algorithms``; this module owns the loop, the
optimizer steps and the metrics. It is deterministic given (weights, optimizer state, batch,
seed): the mini-batch order comes from a generator seeded per step, never from global RNG.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from verl_core.algorithms import (
    PolicyLossOptions,
    agg_loss,
    get_policy_loss,
    kl_loss,
    micro_batch_weight,
    rollout_is_weights,
    rollout_probs_diff,
    value_loss,
)
from verl_core.config import AlgorithmConfig, RunConfig
from verl_core.data.batch import Batch
from verl_core.training.device import model_device
from verl_core.training.dist import SINGLE, DataParallel
from verl_core.training.forward import (batched_logprobs, critic_values, padding_layout,
                                        response_logprobs)
from verl_core.training.packing import (balanced_order, in_row_order, micro_batches, narrow,
                                        row_tokens, worker_order)


def _chunks(idx: torch.Tensor, size: int):
    return [idx[s:s + size] for s in range(0, idx.numel(), size)]


def _pad_to(x: torch.Tensor, width: int) -> torch.Tensor:
    """(n, t) -> (n, width), zeros on the right (a narrowed micro-batch's per-token values)."""
    return torch.nn.functional.pad(x, (0, width - x.shape[1])) if x.shape[1] < width else x


def _optimizer_step(model, optimizer, scheduler, grad_clip: float) -> tuple[torch.Tensor, bool]:
    """Clip, then step unless the gradient is not finite (the step is skipped, grads dropped).
    The LR schedule counts applied steps: a skipped step does not move it (as HF Trainer does
    when its grad scaler skips one)."""
    params = [p for p in model.parameters() if p.requires_grad]
    grad_norm = torch.nn.utils.clip_grad_norm_(params, grad_clip)
    if hasattr(grad_norm, "full_tensor"):  # FSDP2: a replicated DTensor holding the global norm
        grad_norm = grad_norm.full_tensor()
    finite = bool(torch.isfinite(grad_norm))  # the same on every worker: they step together
    if finite:
        optimizer.step()
        scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm.detach(), finite


def loss_options(algo: AlgorithmConfig) -> PolicyLossOptions:
    """The config's policy-loss hyper-parameters as the losses' record (same field names)."""
    return PolicyLossOptions(**{f.name: getattr(algo, f.name)
                                for f in dataclasses.fields(PolicyLossOptions)})


def _dropout_active(model) -> bool:
    """Whether a training-mode forward of ``model`` draws dropout noise: an ``nn.Dropout`` with
    p > 0, or a Hugging Face config ``*dropout*`` rate > 0 (Llama-style attention applies its
    ``attention_dropout`` functionally, with no module to find)."""
    config = getattr(model, "config", None)
    rates = [v for k, v in (vars(config).items() if config is not None else ())
             if "dropout" in k and isinstance(v, (int, float)) and not isinstance(v, bool)]
    return any(r > 0 for r in rates) or any(
        isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.p > 0 for m in model.modules())


def exactly_on_policy(actor, algo: AlgorithmConfig, *, num_rows: int, mini_batch_rows: int,
                      epochs: int) -> bool:
    """True when the update's own forward may stand in for the old log-probs: every loss is
    computed before any optimizer step (one epoch, one mini-batch of all rows), nothing reads
    old log-probs before that forward (no ``old_logp_from_rollout``, no ``rollout_is``), and the
    forward is deterministic (no dropout: a training-mode forward is noisy, the eval-mode
    recomputation is not)."""
    return (epochs == 1 and mini_batch_rows >= num_rows and not algo.old_logp_from_rollout
            and not algo.rollout_is and not _dropout_active(actor))


@dataclass(frozen=True, kw_only=True)
class UpdateOptions:
    """How :func:`ppo_update` runs: the run's settings, the same every step. Build it from a run
    config with :meth:`from_config`; a test or a benchmark names the fields it sets."""

    algo: AlgorithmConfig
    """The losses and their hyper-parameters (policy loss, KL, entropy bonus, rollout IS …)."""
    temperature: float
    """The rollout's sampling temperature: log-probs are of logits / temperature (0: greedy
    rollouts, scored under the plain softmax)."""
    mini_batch_rows: int
    """Rows per optimizer step (``actor.ppo_mini_batch_size`` x ``rollout.n``)."""
    micro_batch_rows: int
    """Rows per forward/backward (gradient accumulation), without a token budget."""
    epochs: int = 1
    """Passes over the batch (``actor.ppo_epochs``)."""
    grad_clip: float
    """Clip of the global gradient norm before each optimizer step."""
    max_token_len: int = 0
    """Token budget per actor micro-batch (verl's ``ppo_max_token_len_per_gpu``); 0: rows."""
    critic_max_token_len: int = 0
    """Token budget per critic micro-batch; 0: rows."""
    log_prob_max_token_len: int = 0
    """Token budget per micro-batch of the no-grad old log-probs; 0: rows."""
    balance_batch: bool = False
    """Reorder each mini-batch's rows so the W workers' blocks hold nearly equal tokens."""
    remove_padding: bool = False
    """Run each micro-batch's rows packed into one sequence (verl's ``use_remove_padding``)."""
    prefix_grouper: bool = False
    """Run each distinct prompt of a micro-batch once (verl's ``use_prefix_grouper``)."""
    on_policy_shortcut: bool = True
    """Exactly on-policy, take the update's own forward for the old log-probs (False: always
    recompute them)."""

    @classmethod
    def from_config(cls, c: RunConfig) -> "UpdateOptions":
        """The options a run's config sets (what ``RLTrainer.update`` passes every step)."""
        return cls(
            algo=c.algorithm, temperature=c.rollout.temperature,
            mini_batch_rows=c.actor.ppo_mini_batch_size * c.rollout.n,
            micro_batch_rows=c.actor.ppo_micro_batch_size, epochs=c.actor.ppo_epochs,
            grad_clip=c.optim.grad_clip,
            max_token_len=c.actor.token_budget("ppo_max_token_len_per_gpu"),
            critic_max_token_len=c.actor.token_budget("critic_ppo_max_token_len_per_gpu"),
            log_prob_max_token_len=c.actor.token_budget("log_prob_max_token_len_per_gpu"),
            balance_batch=c.trainer.balance_batch, remove_padding=c.actor.use_remove_padding,
            prefix_grouper=c.actor.use_prefix_grouper)


def ppo_update(actor, actor_optimizer, actor_scheduler, batch: Batch, opts: UpdateOptions, *,
               seed: int, critic=None, critic_optimizer=None, critic_scheduler=None,
               dp: DataParallel = SINGLE, after_backward=None) -> dict[str, float]:
    """One RL step's update of the actor (and critic when ``critic`` is given).

    ``opts`` (:class:`UpdateOptions`) is how the update runs, the same every step of a run; the
    arguments are what a step passes: the models with their optimizers and schedulers, the
    ``batch``, the step's ``seed``. batch must carry ``advantages`` (N, T); ``ref_logprobs`` when
    ``algo.use_kl_loss``; ``values`` and ``returns`` when a critic is trained. Returns mean
    metrics over micro-batches. Below, option names are fields of ``opts``.

    The behaviour policy's log-probs are recomputed with the trainer's forward, except for a
    policy loss with the ``old_logp_from_rollout`` trait (``bypass_mode``), which takes the
    rollout engine's ``response_logprobs``. With ``algo.rollout_is`` set, every policy loss is
    weighted by the truncated importance ratio of the recomputed to the rollout log-probs
    (:func:`~verl_core.algorithms.rollout_is_weights`, once for the whole batch, as verl does
    before its update), and ``rollout_corr/*`` metrics are reported.

    Exactly on-policy (:func:`exactly_on_policy`: one epoch, one mini-batch, no rollout IS, no
    dropout) the recomputation is skipped, as TRL's GRPOTrainer does: the update's own forward is
    the first one after the rollout, with the same weights and the same (deterministic) mode, so
    ``old_logp = logp.detach()`` is the value the extra forward would give, up to the kernels'
    rounding for another batch shape. ``on_policy_shortcut=False`` always recomputes.

    Each micro-batch's loss is weighted by its share of the mini-batch's denominator
    (:func:`~verl_core.algorithms.micro_batch_weight`), so the gradient of an optimizer step is
    the gradient of the whole mini-batch's loss, however it is cut into micro-batches and
    however many workers share it. With ``dp`` (W > 1, FSDP2 models whose gradient divide factor
    is 1), worker r takes the r-th block of every mini-batch and the reduce-scatter sums the
    parts: the batch semantics do not depend on W.

    Token budgets (verl's ``use_dynamic_bsz``): ``max_token_len`` > 0 packs each worker's rows of
    a mini-batch into micro-batches of at most that many tokens for the actor
    (:func:`~verl_core.training.packing.token_micro_batches`: runs of rows of similar length,
    padding counted; a longer row alone), each cut to its longest response;
    ``critic_max_token_len`` likewise for the critic and ``log_prob_max_token_len`` for the
    no-grad old log-probs (0: rows of ``micro_batch_rows``). The weights above make the step's
    gradient the same, up to float summation order. ``balance_batch`` (verl's ``trainer.balance_batch``, W > 1) reorders each
    mini-batch's rows so that the W blocks hold nearly equal token counts: the same rows, the
    same loss.

    ``remove_padding`` (verl's ``use_remove_padding``): every forward here (old log-probs,
    actor, critic) runs each micro-batch's rows packed into one sequence, no compute on padding
    (:func:`~verl_core.training.forward.padding_layout`: a model that cannot be packed has its
    rows bucketed by length instead); the token budgets then count real tokens. The same loss,
    up to float summation order.

    ``prefix_grouper`` (verl's ``use_prefix_grouper``): the old log-probs' and the actor's
    forwards run each distinct prompt of a micro-batch once
    (:func:`~verl_core.training.forward.response_logprobs`, ``shared``); the same loss and
    gradients up to float rounding.

    ``update/micro_batches``, ``update/tokens_per_micro_batch`` and ``update/padding_fraction``
    report the actor's forwards with grad on this worker: micro-batches per optimizer step, real
    tokens per micro-batch, and the share of the positions run that were padding (0 packed).

    ``after_backward(actor)``, if given, runs once after the first micro-batch's backward (fault
    drills use it to poison the gradients).

    The rollout/trainer mismatch is reported every step, for every engine, as verl logs it:
    ``training/rollout_probs_diff_{max,mean,std}``
    (:func:`~verl_core.algorithms.rollout_probs_diff`) of the trainer's log-probs of the sampled
    tokens, with the rollout's weights, against the engine's, from a forward the update already
    runs: the recomputed ``old_logp`` (all rows); exactly on-policy, the update's own forward (all rows, all before the one optimizer step);
    with ``old_logp_from_rollout``, the update's forward of the first mini-batch of the first
    epoch only (the later ones run after a step has moved the weights), so there the statistics
    cover those rows (and, in a model with dropout, include its noise: a training-mode
    forward). With W > 1 the rows are gathered first: the numbers are those of all rows, not a
    mean of the workers'.
    """
    algo = opts.algo
    if batch.advantages is None:
        raise ValueError("ppo_update needs batch.advantages: run the advantage phase first")
    if algo.use_kl_loss and batch.ref_logprobs is None:
        raise ValueError("algorithm.use_kl_loss needs batch.ref_logprobs from the reference model")
    N = batch.num_rows
    opts = dataclasses.replace(opts, temperature=opts.temperature or 1.0)  # greedy: plain softmax
    # the batch stays on the host; each micro-batch's rows and the per-row tensors the losses
    # read go to the models' device (training/device.py)
    device = model_device(actor)
    critic_layout = (padding_layout(critic, opts.remove_padding) if critic is not None
                     else "padded")
    sums: dict[str, list[torch.Tensor]] = defaultdict(list)
    tokens = row_tokens(batch)  # (N,) what the token budgets and the balancing count
    old_logp, is_weights, mismatch = _behaviour_logprobs(actor, batch, opts, tokens, dp, sums)
    loss = _ActorLoss(opts, policy_loss=get_policy_loss(algo.policy_loss),
                      options=loss_options(algo), scale=_loss_scale(batch, opts),
                      layout=padding_layout(actor, opts.remove_padding),
                      old_logp=None if old_logp is None else old_logp.to(device),
                      is_weights=is_weights,
                      # clip_cov's random draws: a stream of their own (seed + 1), so the
                      # mini-batch order drawn from `gen` is the same whatever the loss
                      generator=torch.Generator().manual_seed(seed + 1))
    gen = torch.Generator().manual_seed(seed)
    lr_used = actor_optimizer.param_groups[0]["lr"]
    critic_lr_used = critic_optimizer.param_groups[0]["lr"] if critic is not None else 0.0
    skipped = 0
    shapes = []  # (real tokens, positions run) of each actor forward with grad
    after_backward = _once(after_backward)
    actor.train()
    if critic is not None:
        critic.train()
    for _ in range(opts.epochs):
        order = torch.randperm(N, generator=gen)
        for mini in _chunks(order, opts.mini_batch_rows):
            if opts.balance_batch:
                mini = balanced_order(mini, tokens, dp.size)  # (M,) the same rows, reordered
            mini_mask = batch.response_mask[mini].to(device)  # (M, T): the denominators' batch
            # before the first optimizer step, the update's forward measures the mismatch
            measured = _actor_backward(actor, batch, mini, mini_mask, loss, dp, sums, shapes,
                                       after_backward, record=mismatch is None)
            if mismatch is None:
                mismatch = measured
            grad_norm, ok = _optimizer_step(actor, actor_optimizer, actor_scheduler,
                                            opts.grad_clip)
            sums["actor/grad_norm"].append(grad_norm)
            skipped += not ok
            if critic is not None:
                skipped += not _critic_step(critic, critic_optimizer, critic_scheduler, batch,
                                            mini, mini_mask, opts, critic_layout, loss.scale,
                                            dp, sums)
    metrics = _update_metrics(sums, shapes, mismatch, dp)
    metrics["actor/lr"] = lr_used  # LR of this step's first optimizer step
    metrics["update/skipped_nonfinite_steps"] = float(skipped)
    if critic is not None:
        metrics["critic/lr"] = critic_lr_used
    actor.eval()
    if critic is not None:
        critic.eval()
    return metrics


@dataclass(frozen=True)
class _ActorLoss:
    """What every actor micro-batch's loss reads, fixed for the whole update."""

    opts: UpdateOptions
    policy_loss: Callable
    options: PolicyLossOptions
    scale: Optional[float]  # seq-mean-token-sum-norm's C; None: the width T
    layout: str  # padding_layout of the actor
    old_logp: Optional[torch.Tensor]  # (N, T) on the device; None: each micro-batch's own
    is_weights: Optional[torch.Tensor]  # (N, T) rollout importance weights, or None
    generator: torch.Generator  # the losses' random draws (clip_cov)


def _once(fn):
    """``fn`` on its first call, nothing after (None stays None)."""
    if fn is None:
        return None
    pending = [fn]

    def call(*args):
        if pending:
            pending.pop()(*args)
    return call


def _loss_scale(batch: Batch, opts: UpdateOptions) -> Optional[float]:
    """seq-mean-token-sum-norm's C: ``loss_scale_factor``, else None (the micro-batch's width T),
    but T of the batch when micro-batches are narrowed (token budgets, packed rows)."""
    scale = opts.algo.loss_scale_factor or None
    if scale is None and (opts.max_token_len or opts.critic_max_token_len or opts.remove_padding):
        scale = float(max(batch.response_ids.shape[1], 1))  # narrowed micro-batches: still T
    return scale


def _behaviour_logprobs(actor, batch: Batch, opts: UpdateOptions, tokens: torch.Tensor,
                        dp: DataParallel, sums: dict):
    """(old_logp (N, T) or None, rollout IS weights (N, T) on the actor's device or None, the
    rollout_probs_diff metrics or None when not measured yet): the behaviour policy's log-probs
    as :func:`ppo_update` documents (rollout's, none when exactly on-policy, else recomputed)."""
    algo = opts.algo
    reuse_logp = opts.on_policy_shortcut and exactly_on_policy(
        actor, algo, num_rows=batch.num_rows, mini_batch_rows=opts.mini_batch_rows,
        epochs=opts.epochs)
    if algo.old_logp_from_rollout:
        return batch.response_logprobs, None, None  # bypass: the rollout engine's own log-probs
    if reuse_logp:
        return None, None, None  # each micro-batch takes logp.detach(): ratio = exp(0) = 1
    # Recompute the behaviour policy's log-probs with the trainer's own forward (as verl
    # does): rollout engines (vLLM, bf16 kernels) can differ from it numerically.
    # each worker computes its block of rows, then every worker gets all of them: (N, T)
    order = worker_order(tokens, dp.size, opts.balance_batch and dp.distributed)
    mine = dp.block(order)
    old_logp = in_row_order(order, dp.gather_rows(batched_logprobs(
        actor, batch.select(mine) if dp.distributed else batch, opts.temperature,
        opts.micro_batch_rows, max_token_len=opts.log_prob_max_token_len, dp=dp,
        remove_padding=opts.remove_padding, prefix_grouper=opts.prefix_grouper)))
    mismatch = rollout_probs_diff(old_logp, batch.response_logprobs.to(old_logp.device),
                                  batch.response_mask.to(old_logp.device))
    is_weights = None
    if algo.rollout_is:
        is_weights, is_metrics = rollout_is_weights(
            old_logp, batch.response_logprobs.to(old_logp.device), batch.response_mask,
            level=algo.rollout_is, threshold=algo.rollout_is_threshold,
            threshold_lower=algo.rollout_is_threshold_lower,
            batch_normalize=algo.rollout_is_batch_normalize)
        is_weights = is_weights.to(model_device(actor))
        for k, v in is_metrics.items():
            sums[f"rollout_corr/{k}"].append(v)
    return old_logp, is_weights, mismatch


def _actor_backward(actor, batch: Batch, mini: torch.Tensor, mini_mask: torch.Tensor,
                    loss: _ActorLoss, dp: DataParallel, sums: dict, shapes: list,
                    after_backward, *, record: bool):
    """Forward and backward of this worker's micro-batches of mini-batch ``mini`` (M,), each
    loss weighted by its share of the mini-batch's denominator (``mini_mask`` (M, T)). With
    ``record``, the rollout_probs_diff metrics of these forwards (every worker's rows gathered),
    else None."""
    opts, algo = loss.opts, loss.opts.algo
    device = model_device(actor)
    T = batch.response_ids.shape[1]
    pre_step, pre_rows = [], []  # this worker's update-forward logp (m, T) and its rows
    micros = micro_batches(dp.block(mini), batch, opts.micro_batch_rows, opts.max_token_len, dp,
                           loss.layout)
    sums["update/micro_batches"].append(torch.tensor(float(len(micros))))
    for micro in micros:
        mb = (narrow(batch.select(micro)) if opts.max_token_len or loss.layout != "padded"
              else batch.select(micro))
        real = int(row_tokens(mb).sum())
        # positions run: packed, the real tokens; padded, rows x (prompt columns that
        # hold a token in some row + the response width)
        shapes.append((real, real if loss.layout == "packed" else mb.num_rows * (
            int((mb.prompt_mask.sum(0) > 0).sum()) + mb.response_mask.shape[1])))
        mb = mb.to(device)
        mask = mb.response_mask
        width = mask.shape[1]  # the micro-batch's response columns (narrowed: <= T)
        weight = micro_batch_weight(mask, mini_mask, algo.loss_agg_mode)
        need_entropy = algo.entropy_coeff > 0
        # the forward reads every real token (a multi-turn row's tool responses too);
        # the losses read the sampled ones (``mask``)
        logp, entropy = response_logprobs(actor, mb.prompt_ids, mb.prompt_mask,
                                          mb.response_ids, mb.response_attn, opts.temperature,
                                          with_entropy=need_entropy,
                                          packed=loss.layout == "packed",
                                          shared=opts.prefix_grouper)
        pg_loss, pg_metrics = loss.policy_loss(
            logp.detach() if loss.old_logp is None else loss.old_logp[micro, :width], logp,
            mb.advantages, mask,
            clip_ratio_low=algo.clip_ratio_low, clip_ratio_high=algo.clip_ratio_high,
            clip_ratio_c=algo.clip_ratio_c, loss_agg_mode=algo.loss_agg_mode,
            loss_scale_factor=loss.scale,
            rollout_is_weights=None if loss.is_weights is None else loss.is_weights[micro, :width],
            options=loss.options, generator=loss.generator)
        total = pg_loss
        if need_entropy:
            ent = agg_loss(entropy, mask, algo.loss_agg_mode, loss_scale_factor=loss.scale)
            total = total - algo.entropy_coeff * ent  # entropy bonus
            sums["actor/entropy"].append(ent.detach())
        if algo.use_kl_loss:
            kl = kl_loss(logp, mb.ref_logprobs, mask, kl_loss_type=algo.kl_loss_type,
                         loss_agg_mode=algo.loss_agg_mode, loss_scale_factor=loss.scale)
            total = total + algo.kl_loss_coef * kl
            sums["actor/kl_loss"].append(kl.detach())
        if record:  # no step yet: logp is the trainer's at the rollout weights
            pre_step.append(_pad_to(logp.detach(), T))
            pre_rows.append(micro)
        (total * weight).backward()
        if after_backward is not None:
            after_backward(actor)
        sums["actor/pg_loss"].append(pg_loss.detach())
        for k, v in pg_metrics.items():
            sums[f"actor/{k}"].append(v.detach())
    if not record:
        return None
    # the first mini-batch's rows, every worker's block: (M, T)
    train_logp = dp.gather_rows(torch.cat(pre_step, 0))
    seen = dp.gather_rows(torch.cat(pre_rows))  # (M,) their rows, in that order
    return rollout_probs_diff(train_logp, batch.response_logprobs[seen].to(train_logp.device),
                              batch.response_mask[seen].to(train_logp.device))


def _critic_step(critic, optimizer, scheduler, batch: Batch, mini: torch.Tensor,
                 mini_mask: torch.Tensor, opts: UpdateOptions, layout: str,
                 scale: Optional[float], dp: DataParallel, sums: dict) -> bool:
    """One critic optimizer step on this worker's micro-batches of mini-batch ``mini``; whether
    it was applied (a non-finite gradient skips it)."""
    algo = opts.algo
    for micro in micro_batches(dp.block(mini), batch, opts.micro_batch_rows,
                               opts.critic_max_token_len, dp, layout):
        mb = (narrow(batch.select(micro)) if opts.critic_max_token_len or layout != "padded"
              else batch.select(micro)).to(model_device(critic))
        weight = micro_batch_weight(mb.response_mask, mini_mask.to(mb.response_mask.device),
                                    algo.loss_agg_mode)
        vpreds = critic_values(critic, mb.prompt_ids, mb.prompt_mask, mb.response_ids,
                               mb.response_attn, packed=layout == "packed")
        vf_loss, vf_metrics = value_loss(
            vpreds, mb.values, mb.returns, mb.response_mask,
            cliprange_value=algo.cliprange_value, loss_agg_mode=algo.loss_agg_mode,
            loss_scale_factor=scale)
        (algo.vf_coef * vf_loss * weight).backward()
        sums["critic/vf_loss"].append(vf_loss.detach())
        for k, v in vf_metrics.items():
            sums[f"critic/{k}"].append(v.detach())
    c_norm, c_ok = _optimizer_step(critic, optimizer, scheduler, opts.grad_clip)
    sums["critic/grad_norm"].append(c_norm)
    return c_ok


def _update_metrics(sums: dict, shapes: list, mismatch: Optional[dict],
                    dp: DataParallel) -> dict[str, float]:
    """The update's float metrics: means over micro-batches (and workers), the mismatch, the
    largest gradient norm."""
    real, run = (sum(x) for x in zip(*shapes)) if shapes else (0, 0)
    sums["update/tokens_per_micro_batch"].append(torch.tensor(real / max(len(shapes), 1)))
    sums["update/padding_fraction"].append(torch.tensor(1.0 - real / run if run else 0.0))
    metrics = dp.mean_metrics({k: float(torch.stack([t.float() for t in v]).mean())
                               for k, v in sums.items()})
    # the same on every worker (computed from gathered rows): not averaged, a max is no mean
    metrics.update({f"training/{k}": float(v) for k, v in (mismatch or {}).items()})
    if sums["actor/grad_norm"]:  # the largest pre-clip norm (the guard's explosion signal)
        metrics["actor/grad_norm_max"] = float(torch.stack(sums["actor/grad_norm"]).max())
    return metrics
