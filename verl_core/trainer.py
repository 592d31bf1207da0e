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

import dataclasses
import functools
import os
import random
import time
from dataclasses import dataclass
from typing import Sequence

import torch
from transformers.utils import logging as hf_logging

from verl_core.agent.tools import ToolConfigError, ToolHost, tool_entries
from verl_core.agent.turns import observation_ids
from verl_core.algorithms import (apply_kl_penalty, get_advantage_estimator,
                                  outcome_to_token_rewards)
from verl_core.algorithms.utils import masked_mean
from verl_core.checkpoint.state import capture_rng_state, restore_rng_state
from verl_core.config import RunConfig
from verl_core.data.batch import Batch, encode_prompts
from verl_core.data.prompts import load_prompts
from verl_core.seeds import derive_seed
from verl_core.data.dataset import PromptRow, load_prompt_rows, render_prompt
from verl_core.data.sampler import ResumableSampler
from verl_core.data.synthetic import write_arithmetic_dataset, write_calculator_dataset
from verl_core.data.word_problems import write_word_problem_dataset
from verl_core.evaluation import EvalSample, evaluate
from verl_core.models import build_tiny_model, load_tokenizer
from verl_core.models.loading import precision_line, write_overridden_folder
from verl_core.models.tokenizer import CHAR_CHAT_TEMPLATE, build_char_tokenizer
from verl_core.reward.decode import decode_responses, stop_token_ids
from verl_core.reward.manager import RewardScorer
from verl_core.reward.model import RewardModel, check_reward_model
from verl_core.reward.overlong import OverlongBuffer
from verl_core.rollout import SamplingParams, make_engine
from verl_core.models.lora import check_lora, meta_model
from verl_core.rollout.multi_turn import generate_turns, turn_limits
from verl_core.training.forward import batched_logprobs, batched_sum_pi_squared, batched_values
from verl_core.training.device import make_deterministic, resolve_device
from verl_core.training.dist import SINGLE, DataParallel
from verl_core.training.packing import in_row_order, row_tokens, worker_order
from verl_core.training.sft import supervised_warm_start
from verl_core.threads import intra_op_threads
from verl_core.validation import validate_dataset_files
from verl_core.warmstart import WarmStart, warm_start_key
from verl_core.format_warmup import format_answers, format_warm_start
from verl_core.guard import checks, faults
from verl_core.guard.policy import GUARD_DEFAULTS
from verl_core.parts import Actor, Behaviour, Critic


hf_logging.disable_progress_bar()  # per-phase "Loading weights" bars would bury the step lines


HISTORY_STEPS = 256


def _poison_gradients(model) -> None:
    """VERL_FAULTS ``nan_grad``: the first parameter with a gradient gets a NaN one."""
    for p in model.parameters():
        if p.grad is not None:
            p.grad.fill_(float("nan"))
            return


@dataclass(frozen=True)
class Assets:
    """What a run starts from: a model folder and the train/val parquet files."""

    model_path: str
    train_files: list[str]
    val_files: list[str]
    reward_model_path: str = ""
    """The reward model's folder ("" without ``reward_model.enable``)."""
    model_source_path: str = ""
    """The folder you brought when ``model_path`` is a copy made from it (its format warm start,
    ``model.format_warmup_steps``, or its config.json with ``model.override_config``); ""
    otherwise."""


def prepare_assets(cfg: RunConfig, workdir: str, log=print, *, build_model: bool = True,
                   store=None) -> Assets:
    """Materialise the embedded defaults: the synthetic dataset when no files are given, the tiny
    warm-started model when no model path is given. Deterministic in ``cfg.seed``.
    ``build_model=False``: no warm start (``model_path`` stays empty when none is given): a
    trajectory that ran before takes its model from its record (``prepare_run``). ``store``
    (the run store): the warm start saves its progress there and resumes from it, and a
    finished one with the same inputs is reused (``verl_core/warmstart.py``)."""
    rm = cfg.reward_model
    if rm.enable:  # not a one-label sequence classifier: fail before the data and the warm start
        check_reward_model(rm.path, rm.max_length)
    calculator = not cfg.data.train_files and cfg.data.synthetic_task == "calculator"
    if cfg.data.train_files:
        train_files, val_files = cfg.data.train_file_list, cfg.data.val_file_list
    elif cfg.data.synthetic_task == "word_problems":
        train, val = write_word_problem_dataset(
            os.path.join(workdir, "data"), train_size=cfg.data.synthetic_train_size,
            val_size=cfg.data.synthetic_val_size, seed=cfg.seed)
        train_files, val_files = [train], [val]
    elif calculator:
        train, val = write_calculator_dataset(
            os.path.join(workdir, "data"), train_size=cfg.data.synthetic_train_size,
            val_size=cfg.data.synthetic_val_size, seed=cfg.seed)
        train_files, val_files = [train], [val]
    else:
        train, val = write_arithmetic_dataset(
            os.path.join(workdir, "data"), train_size=cfg.data.synthetic_train_size,
            val_size=cfg.data.synthetic_val_size, max_operand=cfg.data.synthetic_max_operand,
            seed=cfg.seed)
        train_files, val_files = [train], [val]
    # Every file is checked (rows, columns, prompt lengths) before any model work: a bad row must
    # not cost a warm start first.
    # the tiny model's tokenizer is the character one (with a chat template for tool turns)
    template = CHAR_CHAT_TEMPLATE if calculator else None
    tok = load_tokenizer(cfg.model.path) if cfg.model.path else build_char_tokenizer(template)
    schemas = check_tools(cfg, tok)
    rows = load_checked_rows(tok, train_files, cfg.data.max_prompt_length, cfg.data.truncation,
                             schemas)
    load_checked_rows(tok, val_files, cfg.data.max_prompt_length, cfg.data.truncation, schemas)
    # the GX suite, every row; without the tokenizer: the prompt lengths were checked just above
    validate_dataset_files([*train_files, *val_files], cfg)
    if cfg.model.path and cfg.model.format_warmup_steps:
        check_lora(cfg.model, meta_model(cfg.model.path))  # model.lora_*: before any work
        format_answers(rows, train_files)  # every row has its solution: before any work
        model_path = ""
        if build_model:  # else a trajectory that ran before takes it from its record
            model_path = os.path.join(workdir, "model")
            format_warm_start(cfg, tok, rows, train_files, model_path, store, log,
                              seed=derive_seed(cfg.seed, 0, "format-warmup"))
            if cfg.model.override_config:  # RL trains the warm-started weights with them
                write_overridden_folder(model_path, model_path + "-config",
                                        cfg.model.config_overrides)
                model_path += "-config"
            log(precision_line(model_path, cfg.model.dtype))
        return Assets(model_path=model_path, train_files=train_files, val_files=val_files,
                      reward_model_path=rm.path if rm.enable else "",
                      model_source_path=cfg.model.path)
    if cfg.model.path:
        check_lora(cfg.model, meta_model(cfg.model.path))  # model.lora_*: before any work
        model_path = cfg.model.path
        if cfg.model.override_config:  # the run's copy, config.json changed, weights linked
            model_path = write_overridden_folder(cfg.model.path, os.path.join(workdir, "model"),
                                                 cfg.model.config_overrides)
            log(precision_line(model_path, cfg.model.dtype))
            return Assets(model_path=model_path, train_files=train_files,
                          val_files=val_files, reward_model_path=rm.path if rm.enable else "",
                          model_source_path=cfg.model.path)
    elif not build_model:
        return Assets(model_path="", train_files=train_files, val_files=val_files,
                      reward_model_path=rm.path if rm.enable else "")
    else:
        model_path = os.path.join(workdir, "model")
        model, tok = build_tiny_model(hidden_size=cfg.model.tiny_hidden_size,
                                      layers=cfg.model.tiny_layers, heads=cfg.model.tiny_heads,
                                      seed=cfg.seed, chat_template=template)
        check_lora(cfg.model, model)  # model.lora_*: before the warm start
        ws = WarmStart(store, warm_start_key(cfg, train_files, template), log,
                       total_steps=cfg.model.warmup_sft_steps
                       + (cfg.model.warmup_mixed_steps if calculator else 0),
                       target=cfg.model.warmup_target_accuracy)
        if not ws.reuse(model_path):
            _warm_start(cfg, model, tok, rows, schemas, calculator, ws, log)
            model.save_pretrained(model_path, safe_serialization=True)
            tok.save_pretrained(model_path)
            ws.finish(model_path, ws.steps_done, ws.accuracy)
    log(precision_line(model_path, cfg.model.dtype))
    return Assets(model_path=model_path, train_files=train_files, val_files=val_files,
                  reward_model_path=rm.path if rm.enable else "")


def _warm_start(cfg: RunConfig, model, tok, rows, schemas, calculator: bool, ws: WarmStart,
                log) -> None:
    """The tiny model's supervised warm start (``training/sft.py``), in its parts, resumed from
    and saved through ``ws``; sets ``ws.steps_done`` and ``ws.accuracy``."""
    m = cfg.model
    prompts = [render_prompt(r, tok, schemas) for r in rows]
    host = ToolHost(tool_entries(cfg.rollout.tool_config_path),
                    timeout_s=cfg.rollout.tool_timeout_s) if schemas else None
    try:
        probe = _AccuracyProbe(model, tok, rows[:256], prompts[:256], cfg, host, schemas)
        t0 = time.perf_counter()
        # the calculator task: every transcript calls the tool, then a mixed part in which
        # most answer at once (model.warmup_mixed_steps)
        parts = [(m.warmup_sft_steps, 1.0, "sft"), (m.warmup_mixed_steps,
                                                    m.warmup_tool_fraction, "sft-mixed")] \
            if calculator else [(m.warmup_sft_steps, None, "sft")]
        saved = ws.resume_point()
        if saved is not None:
            model.load_state_dict(saved["model"])
            probe.last = saved["probe_last"]
        losses = list(saved["prior_losses"]) if saved is not None else []
        first_part = saved["part"] if saved is not None else 0
        for i, (steps, fraction, phase) in enumerate(parts):
            if i < first_part:
                continue
            targets = {"answers": [r.ground_truth for r in rows]} if fraction is None else \
                {"responses": calculator_transcripts(
                    tok, rows, schemas, derive_seed(cfg.seed, 0, phase + "-tools"), fraction)}
            prior = list(losses)

            def on_step(part_losses, snapshot, i=i, prior=prior):
                ws.after_step(len(prior) + len(part_losses), part_losses[-20:], probe.last,
                              lambda: {"part": i, "prior_losses": prior, "inner": snapshot(),
                                       "model": model.state_dict(), "probe_last": probe.last})

            losses += supervised_warm_start(
                model, tok, prompts, **targets,
                steps=steps, batch_size=m.warmup_sft_batch_size,
                lr=m.warmup_sft_lr, seed=derive_seed(cfg.seed, 0, phase),
                max_prompt_length=cfg.data.max_prompt_length,
                truncation=cfg.data.truncation,
                stop_fn=(lambda: probe() >= m.warmup_target_accuracy)
                if m.warmup_target_accuracy < 1.0 else None,
                resume=saved["inner"] if saved is not None and i == first_part else None,
                on_step=on_step)
    finally:
        if host is not None:
            host.close()
    ws.steps_done, ws.accuracy = len(losses), probe.last
    if losses:
        acc = "" if probe.last != probe.last else f", train-slice accuracy {probe.last:.3f}"
        log(f"warm start: {len(losses)} SFT steps in {time.perf_counter() - t0:.1f}s, "
            f"loss {losses[0]:.3f} -> {losses[-1]:.3f}{acc}")


def decoded(tokenizer, batch: Batch):
    """The batch's responses as scorers see them (``reward/decode.py``; a multi-turn row's whole
    transcript)."""
    multi = batch.response_attention_mask is not None
    return decode_responses(tokenizer, batch.response_ids, batch.response_attn,
                            sampled_mask=batch.response_mask if multi else None)


def check_tools(cfg: RunConfig, tokenizer) -> list[dict] | None:
    """``rollout.multi_turn``: the tools' schemas (what prompts show the model), after building
    every tool once in a tool host, so a class that cannot be imported or built is refused
    before any work, naming it; None without multi-turn rollouts."""
    rc = cfg.rollout
    if not rc.multi_turn:
        return None
    if not getattr(tokenizer, "chat_template", None):
        raise ToolConfigError("rollout.multi_turn=True needs a model whose tokenizer has a chat "
                              "template (it renders the tool calls' responses between turns); "
                              "this one has none: set model.path to a chat model")
    entries = tool_entries(rc.tool_config_path)
    with ToolHost(entries, timeout_s=rc.tool_timeout_s):
        pass
    return [e.schema for e in entries]


def score_batch(batch: Batch, scorer: RewardScorer, tokenizer, *,
                model_scores: Sequence[float] | None = None,
                baseline_model_scores: Sequence[float] | None = None,
                combine: str = "replace", overlong: OverlongBuffer | None = None,
                details: dict | None = None) -> tuple[Batch, dict]:
    """Reward phase: decode the responses (each cut at its first EOS, special tokens kept, see
    ``reward/decode.py``) and score them. Adds ``score`` (N,). With ``overlong`` (DAPO's overlong
    buffer, ``reward/overlong.py``) the scorer's score gets its length penalty added, as verl's
    DAPO reward manager (a reward model's score replaces it unpenalised). ``details`` (a dict):
    filled with ``score`` (N,), the score before that penalty, and ``acc`` (N,), the scorer's
    ``acc`` where it returns one, else that score (what DAPO's group filter may read). A batch
    that carries greedy
    baseline responses (ReMax) also gets ``baseline_score`` (N,): each prompt's greedy response
    is scored once, by the same scorer, and its score given to the prompt's G rows.

    With a reward model (``reward_model.enable``): ``model_scores`` (N,) are its scores of the
    rows and ``baseline_model_scores`` (B,) of the greedy responses, one per group in the order of
    :func:`group_first_rows` (both from :meth:`RLTrainer.model_scores`). ``combine="replace"``:
    the model's score is the score and the scorer is not called (verl 0.9 without a custom reward
    function); ``"add"``: score = scorer's + model's. Adds ``reward/model_mean`` (and
    ``reward/rule_mean`` when added)."""
    dec = decoded(tokenizer, batch)
    rule, timeouts = None, 0
    if model_scores is None or combine == "add":
        res = scorer.score(batch.data_source, dec.texts, batch.ground_truth, batch.extra_info,
                           special_token=dec.special_token)
        rule, timeouts = torch.tensor(res.scores, dtype=torch.float32), res.num_timeouts  # (N,)
    score = _combine(rule, model_scores, combine)  # (N,)
    overlong_metrics = {}
    if details is not None:
        details.update(score=score, acc=_acc(res.extras, score) if rule is not None else score)
    if overlong is not None and rule is not None:
        penalty, overlong_metrics = overlong.penalty(batch.response_attn)  # (N,)
        score = score + penalty
    n = max(1, batch.num_rows)
    metrics = {"reward/mean": float(score.mean()), "reward/max": float(score.max()),
               "reward/min": float(score.min()), "reward/timeouts": float(timeouts),
               "reward/timeout_fraction": timeouts / n,
               "reward/special_token_fraction": sum(dec.special_token) / n}
    metrics.update(overlong_metrics)
    # groups whose G scores are all equal (zero advantage): the guard's no_signal counts them
    metrics.update(checks.zero_variance_groups(score, batch.group))
    if model_scores is not None:
        metrics["reward/model_mean"] = float(_combine(None, model_scores, "replace").mean())
        if rule is not None:
            metrics["reward/rule_mean"] = float(rule.mean())
    changes = {"score": score}
    if batch.baseline_response_ids is not None:
        if model_scores is not None and baseline_model_scores is None:
            raise ValueError("score_batch: this batch has greedy baseline responses; pass "
                             "baseline_model_scores with model_scores")
        changes["baseline_score"], baseline_metrics = _score_baseline(
            batch, scorer, tokenizer, baseline_model_scores, combine, overlong)
        metrics.update(baseline_metrics)
    return batch.replace(**changes), metrics


def _acc(extras: dict, score: torch.Tensor) -> torch.Tensor:
    """(N,) the scorer's ``acc`` (verl's DAPO reward manager: a dict scorer's ``acc``, a number
    scorer's score), ``score`` (N,) where a row has none."""
    acc = extras.get("acc")
    if acc is None:
        return score
    return torch.tensor([float(s) if a is None else float(a) for a, s in zip(acc, score.tolist())],
                        dtype=torch.float32)


def _combine(rule: torch.Tensor | None, model: Sequence[float] | None,
             combine: str) -> torch.Tensor:
    """The score (n,) float32 from the scorer's (n,) and the reward model's (n,) scores."""
    if model is None:
        return rule
    m = torch.tensor(list(model), dtype=torch.float32)  # (n,)
    if combine == "replace":
        return m
    if combine == "add":
        return rule + m
    raise ValueError(f"combine={combine!r}: known: replace, add")


def group_first_rows(group: torch.Tensor) -> list[int]:
    """(B,) the first row of each group, in order of first appearance: the rows whose greedy
    baseline response is scored (a group's rows share the prompt, hence that response)."""
    first: dict[int, int] = {}  # group id -> its first row
    for i, g in enumerate(group.tolist()):
        first.setdefault(g, i)
    return list(first.values())


def _score_baseline(batch: Batch, scorer: RewardScorer, tokenizer,
                    model_scores: Sequence[float] | None = None,
                    combine: str = "replace",
                    overlong: OverlongBuffer | None = None) -> tuple[torch.Tensor, dict]:
    """``baseline_score`` (N,): the score of each row's greedy baseline response, computed once
    per group; ``model_scores`` (B,) combine with it as in :func:`score_batch`."""
    rows = group_first_rows(batch.group)  # (B,)
    idx = torch.tensor(rows, dtype=torch.long)
    rule, timeouts = None, 0
    if model_scores is None or combine == "add":
        dec = decode_responses(tokenizer, batch.baseline_response_ids[idx],
                               batch.baseline_response_mask[idx])
        res = scorer.score([batch.data_source[i] for i in rows], dec.texts,
                           [batch.ground_truth[i] for i in rows],
                           [batch.extra_info[i] for i in rows], special_token=dec.special_token)
        rule, timeouts = torch.tensor(res.scores, dtype=torch.float32), res.num_timeouts  # (B,)
        if overlong is not None:  # verl's REMAX baseline is scored by the same reward manager
            rule = rule + overlong.penalty(batch.baseline_response_mask[idx])[0]
    per_prompt = _combine(rule, model_scores, combine)  # (B,)
    per_group = dict(zip(batch.group[idx].tolist(), per_prompt.tolist()))
    baseline = torch.tensor([per_group[g] for g in batch.group.tolist()], dtype=torch.float32)
    values = res.scores if model_scores is None else per_prompt.tolist()
    return baseline, {"reward/baseline_mean": sum(values) / max(1, len(rows)),
                      "reward/baseline_timeouts": float(timeouts)}


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
    # every estimator takes every optional input; the batch has those its traits asked for
    # (rollout / reward phases), the rest are None. The rollout log-probs are the behaviour
    # policy's, as for the reward KL above.
    adv, ret = get_advantage_estimator(algo.adv_estimator)(
        token_rewards, mask, batch.group, batch.values, gamma=algo.gamma, lam=algo.lam,
        norm_adv_by_std_in_grpo=algo.norm_adv_by_std_in_grpo, baseline_score=batch.baseline_score,
        old_logprobs=batch.response_logprobs, sum_pi_squared=batch.sum_pi_squared)
    metrics["advantages/mean"] = float(masked_mean(adv, mask))
    metrics["advantages/abs_max"] = float((adv.abs() * mask).max()) if mask.any() else 0.0
    if batch.values is not None:
        metrics["critic/values_mean"] = float(masked_mean(batch.values, mask))
    return batch.replace(advantages=adv, returns=ret, meta=meta), metrics


CALCULATOR_CALL = '<tool_call>{{"name":"calculator","arguments":{{"expression":"{}"}}}}</tool_call>'
"""The call the calculator task's warm start teaches (hermes, compact JSON)."""


def calculator_transcripts(tok, rows: list[PromptRow], tools: list[dict] | None,
                           seed: int, tool_fraction: float) -> list[tuple[list[int], list[float]]]:
    """The calculator task's warm-start responses, (ids, loss mask) per row, built as a
    rollout builds them (``rollout/multi_turn.py``): a call turn, the tool's response as the
    chat template's ids (mask 0), the answer turn; or, for the rows a seeded draw leaves out
    (``model.warmup_tool_fraction``), the answer alone."""
    rng, eos = random.Random(seed), tok.eos_token_id
    out = []
    for r in rows:
        answer = tok(r.ground_truth, add_special_tokens=False)["input_ids"] + [eos]
        if rng.random() >= tool_fraction:
            out.append((answer, [1.0] * len(answer)))
            continue
        e = r.extra_info
        call = tok(CALCULATOR_CALL.format(f"{e['a']}{e['op']}{e['b']}"),
                   add_special_tokens=False)["input_ids"] + [eos]
        obs = observation_ids(tok, [{"role": "tool", "content": r.ground_truth}],
                              end_of_turn=tok.eos_token, tools=tools)
        out.append((call + obs + answer, [1.0] * len(call) + [0.0] * len(obs)
                    + [1.0] * len(answer)))
    return out


class _AccuracyProbe:
    """Greedy accuracy of ``model`` on a fixed slice of training prompts (rule scorer); with a
    tool ``host``, of multi-turn rollouts."""

    def __init__(self, model, tok, rows, prompts, cfg: RunConfig, host=None, tools=None):
        self.ids, self.mask = encode_prompts(tok, prompts, cfg.data.max_prompt_length,
                                             truncation=cfg.data.truncation)
        self.rows, self.tok, self.model, self.host, self.tools = rows, tok, model, host, tools
        self.rc = cfg.rollout
        self.engine = make_engine("hf", model=model, eos_token_ids=stop_token_ids(tok),
                                  pad_token_id=tok.pad_token_id)
        self.params = SamplingParams(temperature=0.0, max_new_tokens=cfg.rollout.max_new_tokens)
        self.scorer = RewardScorer.from_config(cfg.reward)
        self.last = float("nan")

    def __call__(self) -> float:
        if self.host is not None:
            out = generate_turns(
                self.engine, self.tok,
                [i[m.bool()].tolist() for i, m in zip(self.ids, self.mask)], self.params,
                host=self.host, tools=self.tools, **turn_limits(self.rc), instance_prefix="probe")
            dec = decode_responses(self.tok, out.response_ids, out.attention_mask,
                                   sampled_mask=out.response_mask)
        else:
            out = self.engine.generate(self.ids, self.mask, self.params)
            dec = decode_responses(self.tok, out.response_ids, out.response_mask)
        res = self.scorer.score([r.data_source for r in self.rows], dec.texts,
                                [r.ground_truth for r in self.rows],
                                special_token=dec.special_token)
        self.last = sum(res.scores) / len(res.scores)
        return self.last


def load_checked_rows(tokenizer, files: list[str], max_len: int,
                      truncation: str = "error", tools: list[dict] | None = None) -> list[PromptRow]:
    """:func:`load_prompt_rows` (same rows, same indices) plus the prompt-length check, file by
    file so that an over-long prompt is named by its file and 0-based row (with ``truncation``
    ``error``; otherwise such a prompt is cut when it is encoded)."""
    rows: list[PromptRow] = []
    for path in files:
        part = load_prompt_rows([path])  # indices 0.. within this file
        encode_prompts(tokenizer, [render_prompt(r, tokenizer, tools) for r in part], max_len,
                       names=[f"{path}: row {r.index} (0-based), column 'prompt'" for r in part],
                       truncation=truncation)
        start = len(rows)
        rows.extend(dataclasses.replace(r, index=start + r.index) for r in part)
    return rows


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
            self.reward_model = RewardModel.load(
                assets.reward_model_path, dtype=cfg.reward_model.dtype,
                max_length=cfg.reward_model.max_length, device=self.device)

    @property
    def parts(self) -> list:
        """The parts whose state a checkpoint holds, in the order their groups are stored."""
        return [p for p in (self.actor, self.behaviour, self.critic) if p is not None]

    def close(self):
        self.behaviour.close()
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
            g, m = part.state_dict() if part is self.behaviour \
                else part.state_dict(with_optimizer=with_optimizer)
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

    def follow(self, step: int) -> bool:
        """Update ``step`` starts: the behaviour policy follows (``Behaviour.follow``: off-policy
        it takes this state and samples step + 1 in the background). True when it did."""
        last = step + 1 >= self.cfg.total_steps
        return self.behaviour.follow(step, None if last else functools.partial(
            self.prompt_indices, step + 1, keep_position=True))

    def model_inputs(self, batch: Batch) -> Batch:
        """``batch`` with the per-token inputs the later phases need from a model: reference
        log-probs (KL), critic values (GAE) and Σ_v π_v² per token (``needs_sum_pi_squared``)."""
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
        if self.critic is not None:
            batch = batch.replace(values=gathered(batched_values(
                self.critic.model, part, micro, dp=self.dp,
                max_token_len=actor_cfg.token_budget("critic_forward_max_token_len_per_gpu"),
                remove_padding=actor_cfg.use_remove_padding)))
        if traits.needs_sum_pi_squared:
            # the behaviour model: the weights (and temperature) that sampled the responses,
            # whose log-probs are the estimator's old_logprobs (with W > 1 a full copy)
            batch = batch.replace(sum_pi_squared=gathered(batched_sum_pi_squared(
                self.behaviour.model, part, temperature, micro,
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
        scores = self.model_scores(uids, texts)  # (N,)
        baseline = None
        if batch.baseline_response_ids is not None:
            rows = group_first_rows(batch.group)  # (B,)
            idx = torch.tensor(rows, dtype=torch.long)
            greedy = decode_responses(self.tokenizer, batch.baseline_response_ids[idx],
                                      batch.baseline_response_mask[idx]).texts
            baseline = self.model_scores([uids[i] for i in rows], greedy)  # (B,)
        dt = time.perf_counter() - t0
        if self.dp.rank != 0:
            return batch, {}
        out, metrics = score_batch(batch, self.scorer, self.tokenizer, model_scores=scores,
                                   baseline_model_scores=baseline,
                                   combine=self.cfg.reward_model.combine, overlong=overlong,
                                   details=details)
        metrics["reward/model_time_s"] = dt
        return out, metrics

    def model_scores(self, uids: Sequence[str], responses: Sequence[str]) -> list[float]:
        """(n,) the reward model's score of each (training prompt ``uids[i]``, response text
        ``responses[i]``), the prompt found by its uid (the training row's index); with W > 1
        each worker scores its share (``RewardModel.score_rows``, a collective)."""
        return self.reward_model.score_rows(
            [self.prompts.train_rows[int(u)] for u in uids], responses, self.tokenizer, self.dp,
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


GROUP_ORDER = ("policy", "base", "rng", "optimizer", "reference", "behaviour", "critic",
               "critic_optimizer")
META_ORDER = ("kl_ctrl", "sampler", "hf_config", "guard", "metrics_history", "lora", "scheduler",
              "critic_scheduler", "step", "behaviour_step")
"""The order a checkpoint stores its groups and meta in (a manifest's bytes, hence its hash,
follow it): the order from before the parts, kept."""


def _ordered(d: dict, order: Sequence[str]) -> dict:
    return {k: d[k] for k in sorted(d, key=order.index)}
