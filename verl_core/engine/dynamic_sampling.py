"""DAPO's dynamic sampling (verl's ``algorithm.filter_groups``), all inside the one rollout phase.

Followed from verl's ``recipe/dapo/dapo_ray_trainer.py`` (``RayDAPOTrainer.fit``):

1. sample a generation batch of ``data.gen_batch_size`` prompts x G responses (the next batch of
   the data loader: here the next one of the shuffled epochs, :func:`gen_batch_indices`);
2. score it (the reward phase's scoring, overlong penalty included) and read each response's
   ``filter_groups_metric`` (``acc``, ``score``, ``seq_reward``, ``seq_final_reward``);
3. keep the groups whose values are not all equal (verl: ``np.std(values) > 0``, or a group of
   one response), in order, and add them to the groups kept so far;
4. fewer than ``data.train_batch_size`` kept: sample the next generation batch, unless
   ``max_num_gen_batches`` (> 0) batches were sampled: then the step fails, as verl's raises;
5. else the batch is the first ``train_batch_size`` kept groups (verl: ``batch[:B * n]``); the
   kept groups past them are dropped, and the next step starts at the next generation batch.

Then the per-token model inputs (reference log-probs, critic values) are computed on the trained
rows only, as verl computes them after filtering (before it only with ``seq_final_reward`` under
``use_kl_in_reward``, which needs the reference log-probs).

The data position: each step's batch records which generation batches it consumed
(``meta["gen_batches_start"]``, ``meta["gen_batches_end"]``, counted from the start of the run),
and the next step starts where the previous one's stored batch ended (``RunWorker``, from the
lineage record of the step before). So a step's prompts are a function of the step and what was
sampled before, stored with the batches: a rebuild replays stored batches, a resume continues at
the recorded position, and caching and lineage replay stay exact.

Off-policy (``rollout.max_staleness`` >= 1, docs/async.md) steps 1-5 sample with the behaviour
policy (:func:`sample_and_filter`, the batch records ``meta["policy_version"]``): they read the
behaviour model, the prompts and the scorer only, and the data position of step t is known when
update t - 1 starts (its batch's ``gen_batches_end``), so they run in the background thread while
that update runs; the model inputs read the actor and the critic and stay in the rollout phase
(:func:`with_model_inputs`). Where steps 1-5 need the live state (:func:`samples_in_background`)
the rollout phase samples them in the foreground, with the same behaviour weights.

What is not here: scoring (``reward/scoring.py``), the overlong penalty
(``reward/overlong.py``), what the reward phase does with an already scored batch
(``phases.reward``: passes it on, so nothing is scored twice).
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING, Sequence

import torch

from verl_core.algorithms import apply_kl_penalty, outcome_to_token_rewards
from verl_core.config import ConfigError
from verl_core.data.batch import Batch
from verl_core.data.sampler import ResumableSampler
from verl_core.errors import PermanentError

if TYPE_CHECKING:
    from verl_core.trainer import RLTrainer

__all__ = ["FilterGroupsExhaustedError", "GroupFilter", "kept_groups", "gen_batch_indices",
           "metric_values", "concat_batches", "early_inputs", "samples_in_background",
           "sample_and_filter", "with_model_inputs"]

_TOKEN_FIELDS = ("response_ids", "response_mask", "response_attention_mask", "response_logprobs",
                 "ref_logprobs", "values", "advantages", "returns", "sum_pi_squared",
                 "teacher_logprobs")
_BASELINE_FIELDS = ("baseline_response_ids", "baseline_response_mask")


class FilterGroupsExhaustedError(PermanentError):
    """``max_num_gen_batches`` generation batches were sampled and fewer than
    ``data.train_batch_size`` groups had distinct metric values (verl raises too)."""


def kept_groups(values: Sequence[float], group: Sequence[int]) -> list[int]:
    """The group ids, in order of first appearance, that DAPO keeps: those whose ``values``
    (N,) are not all equal, and groups of a single response (verl keeps them too). verl tests
    ``np.std(values) > 0``; equality is tested here instead, which differs only where float
    rounding makes the std of equal values non-zero (three 0.1: verl keeps the group)."""
    by_group: dict[int, list[float]] = {}
    for g, v in zip(group, values):
        by_group.setdefault(int(g), []).append(float(v))
    return [g for g, vs in by_group.items() if len(vs) == 1 or min(vs) != max(vs)]


@dataclasses.dataclass
class GroupFilter:
    """The groups kept over a step's generation batches (steps 3-5 of the module docstring).
    :meth:`add` one generation batch at a time, until it returns True; :attr:`selection` is
    then the trained groups, as (generation batch, group id) in order."""

    train_batch_size: int
    """B: groups a step trains on."""
    max_num_gen_batches: int = 0
    """Most generation batches (0: no limit)."""
    kept: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    """(generation batch k, group id) of every group kept so far, in order."""
    num_gen_batches: int = 0
    """Generation batches added."""
    num_groups: int = 0
    """Groups seen (kept or not)."""

    def add(self, values: Sequence[float], group: Sequence[int]) -> bool:
        """Add generation batch :attr:`num_gen_batches` (its rows' metric ``values`` (N,) and
        ``group`` ids (N,)); True once B groups are kept. Raises
        :class:`FilterGroupsExhaustedError` when the limit is reached short of B."""
        k = self.num_gen_batches
        self.num_gen_batches += 1
        self.num_groups += len(set(int(g) for g in group))
        self.kept += [(k, g) for g in kept_groups(values, group)]
        if len(self.kept) >= self.train_batch_size:
            return True
        if 0 < self.max_num_gen_batches <= self.num_gen_batches:
            raise FilterGroupsExhaustedError(
                f"algorithm.max_num_gen_batches={self.max_num_gen_batches} generation batches "
                f"sampled and only {len(self.kept)} of data.train_batch_size="
                f"{self.train_batch_size} groups have responses whose "
                "algorithm.filter_groups_metric differs (the others are all right or all "
                "wrong): the data is too hard or too easy for the policy; raise "
                "algorithm.max_num_gen_batches (0: no limit) or data.gen_batch_size")
        return False

    @property
    def selection(self) -> list[tuple[int, int]]:
        """The first B kept groups (verl trims the batch to ``train_batch_size * n`` rows)."""
        return self.kept[:self.train_batch_size]

    def metrics(self) -> dict:
        return {"train/num_gen_batches": float(self.num_gen_batches),
                # verl's num_prompt_in_batch: groups with distinct values, before the trim
                "train/num_kept_groups": float(len(self.kept)),
                "train/num_filtered_groups": float(self.num_groups - len(self.kept))}


def gen_batch_indices(sampler: ResumableSampler, cursor: int) -> list[int]:
    """Dataset indices of generation batch ``cursor`` of the run (0, 1, ... over the shuffled
    epochs, partial tails dropped, as verl's data loader with ``drop_last``)."""
    bpe = sampler.batches_per_epoch
    sampler.load_state_dict({**sampler.state_dict(), "epoch": cursor // bpe,
                             "position": (cursor % bpe) * sampler.batch_size})
    return sampler.next_batch()


def metric_values(batch: Batch, details: dict, metric: str, algo) -> torch.Tensor:
    """(N,) each response's ``metric`` (verl's names): ``acc`` / ``score`` (the scorer's, before
    the overlong penalty; ``details`` from ``score_batch``), ``seq_reward`` (the reward, verl's
    token_level_scores summed), ``seq_final_reward`` (verl's token_level_rewards summed: minus
    the reward KL with ``use_kl_in_reward``, which needs ``batch.ref_logprobs``)."""
    if metric in ("acc", "score"):
        return details[metric]
    if metric == "seq_reward" or not algo.use_kl_in_reward:
        return batch.score
    if metric != "seq_final_reward":
        raise ValueError(f"filter_groups_metric={metric!r}: unknown")
    token_rewards = outcome_to_token_rewards(batch.score, batch.response_mask)  # (N, T)
    rewards, _ = apply_kl_penalty(token_rewards, batch.response_logprobs, batch.ref_logprobs,
                                  batch.response_mask, kl_coef=batch.meta["kl_coef"],
                                  kl_penalty=algo.kl_penalty)
    return rewards.sum(-1)  # (N,)


def concat_batches(parts: list[Batch]) -> Batch:
    """The rows of ``parts`` in order; token fields right-padded to the widest (ids with the pad
    id, everything else with 0), groups renumbered (part k's after part k-1's). Fields absent
    from any part are absent (None)."""
    first = parts[0]
    out = {}
    for f in dataclasses.fields(first):
        vals = [getattr(p, f.name) for p in parts]
        if any(v is None for v in vals):
            out[f.name] = None
        elif f.name in _TOKEN_FIELDS or f.name in _BASELINE_FIELDS:
            T = max(v.shape[1] for v in vals)
            pad = first.pad_id if f.name.endswith("_ids") else 0
            out[f.name] = torch.cat([torch.nn.functional.pad(v, (0, T - v.shape[1]), value=pad)
                                     for v in vals], 0)
        elif f.name == "group":
            shifted, base = [], 0
            for v in vals:
                shifted.append(v + base)
                base += int(v.max()) + 1 if v.numel() else 0
            out[f.name] = torch.cat(shifted, 0)
        elif isinstance(vals[0], torch.Tensor):
            out[f.name] = torch.cat(vals, 0)
        elif isinstance(vals[0], list):
            out[f.name] = [x for v in vals for x in v]
        else:
            out[f.name] = vals[0]  # pad_id, meta
    return Batch(**out)


def _trim_columns(batch: Batch) -> Batch:
    """Drop the trailing token columns that are padding in every row (as one generation of these
    rows would have returned them)."""
    changes = {}
    for fields, mask in ((_TOKEN_FIELDS, batch.response_attn),
                         (_BASELINE_FIELDS, batch.baseline_response_mask)):
        if mask is None:
            continue
        T = int(mask.sum(0).nonzero().max()) + 1 if mask.any() else 0
        changes.update({n: getattr(batch, n)[:, :T] for n in fields
                        if getattr(batch, n) is not None})
    return batch.replace(**changes)


def _merge_metrics(parts: list[tuple[int, dict]]) -> dict:
    """Metrics of the generation batches (rows, metrics): times and counts summed, the rest
    averaged by rows."""
    total = sum(n for n, _ in parts) or 1
    out: dict[str, float] = {}
    for n, m in parts:
        for k, v in m.items():
            summed = k.endswith(("_s", "/timeouts", "/engine_restarts", "/engine_timeouts"))
            out[k] = out.get(k, 0.0) + (float(v) if summed else float(v) * n / total)
    return out


def early_inputs(cfg) -> bool:
    """True when the groups are filtered on a value that needs the model inputs first:
    ``seq_final_reward`` under ``use_kl_in_reward`` reads the reference log-probs."""
    algo = cfg.algorithm
    return algo.filter_groups_metric == "seq_final_reward" and algo.use_kl_in_reward


def samples_in_background(cfg) -> bool:
    """Whether :func:`sample_and_filter` may run in the background thread of an off-policy run
    (``rollout.max_staleness`` >= 1, docs/async.md) while an update changes the actor: not when
    it reads the actor (:func:`early_inputs`: the reference log-probs before filtering) or a
    reward model (``reward_model.enable``: its scoring is a forward pass beside the update's)."""
    return not early_inputs(cfg) and not cfg.reward_model.enable


def sample_and_filter(trainer: RLTrainer, step: int, start: int, version: int | None = None,
                      kl_coef: float | None = None) -> tuple[Batch, dict]:
    """Steps 1-5 of the module docstring for ``step``: generation batches ``start``,
    ``start + 1``, ... sampled with the behaviour policy's weights of ``version`` (None: the
    next rollout's, ``Behaviour.version``), scored and filtered until B groups are kept. The
    batch is scored (``score``) and carries ``meta["gen_batches_start"/"gen_batches_end"]``
    (off-policy also ``meta["policy_version"]``), without the model inputs
    (:func:`with_model_inputs`) unless :func:`early_inputs`.

    It reads the behaviour model, the prompts and the scorer only (unless :func:`early_inputs`
    or a reward model), so an off-policy run samples it in the background thread while the
    update before runs (``RLTrainer.follow``); ``kl_coef`` (None: the actor's now) is what
    that thread passes, read when it started (the rollout phase stamps the live one).
    With W > 1 every worker calls it (sampling and scoring are collectives); rank 0's scores
    decide which groups every worker keeps."""
    cfg, dp, behaviour = trainer.cfg, trainer.dp, trainer.behaviour
    algo, G, B = cfg.algorithm, cfg.rollout.n, cfg.data.train_batch_size
    try:
        sampler = ResumableSampler(len(trainer.prompts.train_rows), cfg.data.gen_batch_prompts,
                                   cfg.seed, shuffle=cfg.data.shuffle)
    except ValueError as e:
        raise ConfigError(f"data.gen_batch_size={cfg.data.gen_batch_size}: {e}") from e
    version = behaviour.version if version is None else version
    sample_dp = dp.sampling() if behaviour.lag else dp
    kl_coef = trainer.actor.kl_ctrl.value if kl_coef is None else kl_coef
    early = early_inputs(cfg)
    keep = GroupFilter(B, algo.max_num_gen_batches)
    parts: list[Batch] = []
    rollout_metrics: list[tuple[int, dict]] = []
    reward_metrics: list[tuple[int, dict]] = []
    t0 = time.perf_counter()
    done = False
    while not done:
        k = keep.num_gen_batches
        idx = gen_batch_indices(sampler, start + k)
        batch, m = behaviour.sample(step, idx, kl_coef, phase=f"rollout-gen{start + k}",
                                    version=version)
        rollout_metrics.append((batch.num_rows, m))
        if behaviour.lag:  # as Behaviour.stamp records it (the model inputs read it)
            batch = batch.replace(meta={**batch.meta, "policy_version": version})
        if early:
            batch = trainer.model_inputs(batch)
        details: dict = {}
        batch, rm = trainer.reward(batch, details)  # rank 0 scores (a collective with a RM)
        reward_metrics.append((batch.num_rows, rm))
        values = metric_values(batch, details, algo.filter_groups_metric, algo).tolist() \
            if dp.rank == 0 else None
        # off-policy the rollout's own group (it may run in the background thread while the
        # update's collectives run on the worker's: DataParallel.sampling)
        values = sample_dp.gather_objects(values)[0] if dp.distributed else values
        parts.append(batch)
        done = keep.add(values, batch.group.tolist())
    # rows of the first B kept groups, in order (a group's G rows are adjacent)
    rows = [r for k, g in keep.selection
            for r in (sum(p.num_rows for p in parts[:k]) + g * G + j for j in range(G))]
    batch = _trim_columns(concat_batches(parts).select(torch.tensor(rows, dtype=torch.long)))
    meta = {**batch.meta, "gen_batches_start": start, "gen_batches_end": start + len(parts)}
    batch = batch.replace(group=torch.arange(B).repeat_interleave(G), meta=meta)
    metrics = _merge_metrics(rollout_metrics)
    lengths = batch.response_lengths.float()  # (N,) of the trained rows, as verl's data metrics
    metrics.update({
        "rollout/tokens_per_s": sum(float(p.response_mask.sum()) for p in parts)
        / max(metrics["rollout/time_s"], 1e-9),
        "response_length/mean": float(lengths.mean()),
        "response_length/clip_ratio": float(
            (lengths >= cfg.rollout.max_new_tokens).float().mean()),
        "timing/dynamic_sampling_s": time.perf_counter() - t0, **keep.metrics()})
    if dp.rank == 0:  # the trained rows' reward (the reward phase passes this batch on)
        metrics.update(_merge_metrics(reward_metrics))
        metrics.update({"reward/mean": float(batch.score.mean()),
                        "reward/max": float(batch.score.max()),
                        "reward/min": float(batch.score.min())})
    return batch, metrics


def with_model_inputs(trainer: RLTrainer, batch: Batch) -> Batch:
    """The batch of :func:`sample_and_filter` with the model inputs of
    :meth:`RLTrainer.model_inputs` on the trained rows only (unless :func:`early_inputs`
    computed them already). They read the actor and the critic at the live state: the
    foreground rollout phase, never the background thread (off-policy the caller stamps the
    live KL coefficient first, ``Behaviour.stamp``)."""
    return batch if early_inputs(trainer.cfg) else trainer.model_inputs(batch)

