"""The RL trainer: one object that runs the phases rollout -> reward -> advantage -> update.

Each phase is a method that takes and returns a :class:`~verl_core.data.batch.Batch` (plus a dict
of float metrics), so the plain-Python loop (``verl_core.train``) and the Flyte tasks call the
same code. Every phase is deterministic given the trainer state and its inputs: random draws come
from seeds derived from ``(run seed, step, phase)``, never from global RNG.

What is not here: the algorithms' math (``verl_core.algorithms``), the update loop
(``training/ppo.py``), and where state is kept: the trainer hands out and takes back its state as
state dicts (:meth:`RLTrainer.state`, :meth:`RLTrainer.load_state`); ``checkpoint/`` stores them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import os
import random
import time
from dataclasses import dataclass
from typing import Sequence

import torch
from transformers.utils import logging as hf_logging

from verl_core import report
from verl_core.agent.tools import ToolConfigError, ToolHost, tool_entries
from verl_core.agent.turns import observation_ids
from verl_core.algorithms import make_kl_controller
from verl_core.checkpoint.state import capture_rng_state, restore_rng_state
from verl_core.config import RunConfig
from verl_core.data.batch import Batch, encode_prompts
from verl_core.data.dataset import PromptRow, load_prompt_rows, render_prompt
from verl_core.data.sampler import ResumableSampler
from verl_core.data.synthetic import write_arithmetic_dataset, write_calculator_dataset
from verl_core.data.word_problems import write_word_problem_dataset
from verl_core.models import build_tiny_model, load_causal_lm, load_critic, load_tokenizer
from verl_core.models.loading import precision_line, write_overridden_folder
from verl_core.models.tokenizer import CHAR_CHAT_TEMPLATE, build_char_tokenizer
from verl_core.reward.decode import decode_responses, stop_token_ids
from verl_core.reward.manager import RewardScorer
from verl_core.reward.model import RewardModel, check_finite, check_reward_model
from verl_core.reward.overlong import OverlongBuffer
from verl_core.rollout import SamplingParams, make_engine
from verl_core.rollout.base import GenerationOutput, concat_outputs
from verl_core.models.lora import (apply_lora, check_lora, lora_meta, meta_model, model_state,
                                   reference_of, split_state)
from verl_core.rollout.multi_turn import (MultiTurnOutput, concat_turn_outputs, generate_turns,
                                          turn_metrics)
from verl_core.training.advantage import compute_advantages
from verl_core.training.forward import batched_logprobs, batched_sum_pi_squared, batched_values
from verl_core.training.device import make_deterministic, resolve_device
from verl_core.training.dist import SINGLE, DataParallel
from verl_core.training.optim import make_optimizer, make_scheduler
from verl_core.training.packing import in_row_order, row_tokens, worker_order
from verl_core.training.ppo import UpdateOptions, ppo_update
from verl_core.training import sharding
from verl_core.training.sft import supervised_warm_start
from verl_core.threads import intra_op_threads
from verl_core.validation import validate_dataset_files
from verl_core.warmstart import WarmStart, warm_start_key
from verl_core.format_warmup import format_answers, format_warm_start
from verl_core.guard import checks, faults
from verl_core.guard.policy import GUARD_DEFAULTS


hf_logging.disable_progress_bar()  # per-phase "Loading weights" bars would bury the step lines


def derive_seed(seed: int, step: int, phase: str) -> int:
    """A 63-bit seed for one phase of one step (docs/design.md#rule-3-phases-are-deterministic)."""
    digest = hashlib.blake2b(f"{seed}:{step}:{phase}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


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


@dataclass(frozen=True)
class EvalSample:
    """One greedy held-out response as scored (what the reports show)."""

    prompt: str
    """The prompt's tokens as the policy read them (chat template, BOS; padding stripped)."""
    response: str
    """The generated tokens, EOS included, special tokens visible (scored: cut at the EOS)."""
    ground_truth: str
    """The row's reference answer."""
    score: float
    """The scorer's score of the response."""


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


def turn_extra_info(infos: list[dict], turns: list[dict]) -> list[dict]:
    """Each multi-turn row's ``extra_info`` as verl's reward managers give it to a scorer: the
    row's own, plus ``num_turns`` (assistant turns) and ``tool_rewards`` (each call's step
    reward, then each tool's ``calc_reward``)."""
    return [{**(info or {}), "num_turns": len(t["turns"]), "tool_rewards": list(t["tool_rewards"])}
            for info, t in zip(infos, turns)]


def turn_limits(rc) -> dict:
    """:func:`generate_turns`' limits from the ``rollout`` section (one place for the rollout
    phase, the evaluation and the warm start's probe)."""
    return dict(max_assistant_turns=rc.max_assistant_turns, max_user_turns=rc.max_user_turns,
                max_parallel_calls=rc.max_parallel_calls,
                max_tool_response_length=rc.max_tool_response_length,
                truncate_side=rc.tool_response_truncate_side, budget_s=rc.tool_budget_s)


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


def val_subset(rows: list[PromptRow], cap: int, seed: int) -> list[PromptRow]:
    """At most ``cap`` of the held-out ``rows`` (-1: all): a seeded draw without replacement, in
    file order, the same for every evaluation of a run (``data.val_max_samples``)."""
    if cap < 0 or len(rows) <= cap:
        return rows
    keep = sorted(random.Random(derive_seed(seed, 0, "val-subset")).sample(range(len(rows)), cap))
    return [rows[i] for i in keep]


def encode_rows(tokenizer, rows: list[PromptRow], max_len: int, truncation: str = "error",
                tools: list[dict] | None = None):
    texts = [render_prompt(r, tokenizer, tools) for r in rows]
    return encode_prompts(tokenizer, texts, max_len, names=[f"dataset row {r.index}" for r in rows],
                          truncation=truncation)


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
    """Holds the models, optimizers and data of a run; its methods are the RL phases."""

    def __init__(self, cfg: RunConfig, assets: Assets, dp: DataParallel = SINGLE):
        self.cfg = cfg
        self.dp = dp  # W > 1: FSDP2-sharded models, each worker rolls out its block of rows
        # the run's recorded count (verl_core.threads): never the host's or Ray's default, which
        # differ between modes and pods and change the float sums
        torch.set_num_threads(intra_op_threads(cfg))
        # trainer.device: every model lives there (its GPU, or the CPU); batches stay on the host
        self.device = resolve_device(cfg.trainer.device)
        make_deterministic(self.device, cfg.trainer.deterministic)
        self.tokenizer = tok = load_tokenizer(assets.model_path)
        self.train_rows = load_prompt_rows(assets.train_files)
        self.val_rows = val_subset(load_prompt_rows(assets.val_files), cfg.data.val_max_samples,
                                   cfg.seed)
        # rollout.multi_turn: the tools (their schemas in every prompt), in a host process
        self.tool_schemas = self.tool_host = None
        if cfg.rollout.multi_turn:
            entries = tool_entries(cfg.rollout.tool_config_path)
            self.tool_schemas = [e.schema for e in entries]
            self.tool_host = ToolHost(entries, timeout_s=cfg.rollout.tool_timeout_s)
        self.train_prompt_ids, self.train_prompt_mask = encode_rows(
            tok, self.train_rows, cfg.data.max_prompt_length, cfg.data.truncation,
            self.tool_schemas)
        self.val_prompt_ids, self.val_prompt_mask = encode_rows(
            tok, self.val_rows, cfg.data.max_prompt_length, cfg.data.truncation,
            self.tool_schemas)
        self.sampler = ResumableSampler(len(self.train_rows), cfg.data.train_batch_size, cfg.seed,
                                        shuffle=cfg.data.shuffle)
        algo = cfg.algorithm
        # model.dtype=bfloat16: float32 master weights and optimizer state, bf16 compute (FSDP2's
        # MixedPrecisionPolicy with W > 1, sharding.compute_in on one worker); the frozen
        # reference and the rollout copy need no master: they are loaded in model.dtype
        compute = sharding.COMPUTE_DTYPES[cfg.model.dtype]
        self.actor = load_causal_lm(assets.model_path, "float32")
        if cfg.model.gradient_checkpointing:  # renamed in transformers 5.x; the old name warns
            enable = getattr(self.actor, "activation_checkpointing_enable", None)
            (enable or self.actor.gradient_checkpointing_enable)()
        # model.lora_rank: PEFT adapters on the float32 policy, the base frozen; the reference
        # is then the policy with its adapters off (no second copy), models/lora.py
        self.lora = cfg.model.lora_rank > 0
        if self.lora:
            self.actor = apply_lora(self.actor, cfg.model, derive_seed(cfg.seed, 0, "lora-init"))
        self.actor.to(self.device)
        # with W > 1 workers the actor is sharded (FSDP2) and rollout runs on a full copy of it,
        # refreshed from the shards after every change (verl's hybrid engine, colocated)
        self.rollout_model = self.actor
        # rollout.max_staleness > 0: rollout samples from its own copy, the behaviour policy,
        # which takes the actor's weights only when told (snapshot_behaviour), so it can sample
        # step t + 1 with the weights of step t while update t changes the actor
        self.max_staleness = cfg.rollout.max_staleness
        if dp.distributed or self.max_staleness:
            self.rollout_model = load_causal_lm(assets.model_path, cfg.model.dtype).to(self.device)
        sharding.train_in(self.actor, compute, distributed=dp.distributed)
        self._rollout_stale = False
        self._engine_stale = False  # max_staleness: the engine's own copy (vllm) is not current
        self._actor_engine = None  # max_staleness with hf: evaluation samples the actor itself
        self.ref = None
        if algo.uses_reference and not self.lora:
            self.ref = load_causal_lm(assets.model_path, cfg.model.dtype).requires_grad_(False)
            self.ref.to(self.device)
            if dp.distributed:
                sharding.shard(self.ref)
        total = cfg.total_optimizer_steps
        self.actor_optimizer = make_optimizer(self.actor.parameters(), cfg.optim, cfg.optim.lr)
        self.actor_scheduler = make_scheduler(self.actor_optimizer, cfg.optim, total,
                                              cfg.optimizer_steps_per_rl_step)
        self.critic = self.critic_optimizer = self.critic_scheduler = None
        if algo.uses_critic:
            # the value head is freshly initialised: seed it, so every worker builds the same one
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(derive_seed(cfg.seed, 0, "critic-init"))
                self.critic = load_critic(assets.model_path, "float32").to(self.device)
            sharding.train_in(self.critic, compute, distributed=dp.distributed)
            self.critic_optimizer = make_optimizer(self.critic.parameters(), cfg.optim,
                                                   cfg.optim.critic_lr)
            own = cfg.optim.critic_warmup_steps
            self.critic_scheduler = make_scheduler(self.critic_optimizer, cfg.optim, total,
                                                   cfg.optimizer_steps_per_rl_step,
                                                   warmup_steps=own if own >= 0 else None)
        # guard state: what the update has had to refuse so far (non-finite gradients skip the
        # optimizer step); saved in every checkpoint so counters survive a resume
        self.guard = dict(GUARD_DEFAULTS)
        # the last HISTORY_STEPS updates' scalar metrics (detectors compare against them)
        self.history: list[dict] = []
        self.kl_ctrl = make_kl_controller(algo.kl_ctrl_type, kl_coef=algo.kl_coef,
                                          target_kl=algo.kl_target, horizon=algo.kl_horizon)
        self.engine = make_engine(cfg.rollout.engine, model=self.rollout_model,
                                  model_path=assets.model_path,
                                  eos_token_ids=stop_token_ids(tok),  # the model's EOS set
                                  pad_token_id=tok.pad_token_id,
                                  micro_batch_size=cfg.rollout.generation_batch,
                                  max_num_seqs=cfg.rollout.max_num_seqs,
                                  enable_chunked_prefill=cfg.rollout.enable_chunked_prefill,
                                  # read by vllm only (hf ignores them)
                                  gpu_memory_utilization=cfg.rollout.gpu_memory_utilization,
                                  enforce_eager=cfg.rollout.enforce_eager,
                                  free_cache_engine=cfg.rollout.free_cache_engine,
                                  cpu_kv_cache_gib=cfg.rollout.cpu_kv_cache_gib,
                                  engine_own_process=cfg.rollout.engine_own_process,
                                  engine_timeout_s=cfg.rollout.engine_timeout_s,
                                  engine_max_restarts=cfg.rollout.engine_max_restarts,
                                  # the longest sequence a run asks for (not the model's
                                  # context, whose KV cache may not fit cpu_kv_cache_gib)
                                  max_model_len=cfg.rollout.max_model_len or
                                  cfg.data.max_prompt_length + cfg.rollout.max_new_tokens,
                                  dtype=cfg.model.dtype, seed=cfg.seed)
        if self.max_staleness:
            self.snapshot_behaviour()  # a LoRA policy's merged weights, else the same copy
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
                max_length=cfg.reward_model.max_length,
                device=next(self.rollout_model.parameters()).device)

    def close(self):
        self.engine.close()  # a vllm engine's processes (rollout.engine_own_process)
        self.scorer.close()
        if self.tool_host is not None:
            self.tool_host.close()

    # ------------------------------------------------------------------ state
    def state(self, *, with_optimizer: bool = True) -> tuple[dict, dict]:
        """Everything an exact resume needs, as checkpoint ``(groups, meta)`` for
        ``CheckpointManager.save_distributed`` (every worker calls it; no communication).

        Models and optimizers are in torch.distributed.checkpoint's layout (``get_model_state_dict``
        / ``get_optimizer_state_dict``: parameters by name), DTensor shards when W > 1, so a
        checkpoint holds the same groups whatever W wrote it and loads on any W. The data position
        and every phase's randomness are functions of (seed, step), so the step is enough for
        them; rank 0's global RNG state is saved anyway for code that uses it."""
        groups = self._policy_groups()
        if self.dp.rank == 0:
            groups["rng"] = capture_rng_state()
        meta = {"kl_ctrl": self.kl_ctrl.state_dict(), "sampler": self.sampler.state_dict(),
                "hf_config": self.actor.config.to_dict(), "guard": dict(self.guard),
                "metrics_history": [dict(h) for h in self.history]}
        if self.lora:  # what an export rebuilds the adapters with
            meta["lora"] = lora_meta(self.actor)
        # an optimizer that never stepped has no state to save (and asking torch for its state
        # dict would create one: a zero-gradient step); a resume then starts it fresh too
        if with_optimizer and self.actor_optimizer.state:
            groups["optimizer"] = self._optim_state(self.actor, self.actor_optimizer)
            meta["scheduler"] = self.actor_scheduler.state_dict()
        if self.ref is not None:  # a "shared" group: stored once per run, linked by later saves
            groups["reference"] = self._model_state(self.ref)
        if self.max_staleness:  # the weights the next rollout samples with (one update older)
            groups["behaviour"] = self._model_state(self.rollout_model)
        if self.critic is not None:
            groups["critic"] = self._model_state(self.critic)
            if with_optimizer and self.critic_optimizer.state:
                groups["critic_optimizer"] = self._optim_state(self.critic, self.critic_optimizer)
                meta["critic_scheduler"] = self.critic_scheduler.state_dict()
        return groups, meta

    @staticmethod
    def _model_state(model) -> dict:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return get_model_state_dict(model)

    def _policy_groups(self) -> dict:
        """``{"policy": the actor's state}``; a LoRA actor's is its adapters, and its frozen
        base goes to ``base``, a shared group (stored once per run, linked by later saves)."""
        state = self._model_state(self.actor)
        if not self.lora:
            return {"policy": state}
        adapters, base = split_state(self.actor, state)
        return {"policy": adapters, "base": base}

    @staticmethod
    def _optim_state(model, optimizer) -> dict:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return get_optimizer_state_dict(model, optimizer)

    def load_targets(self, groups=("policy", "critic")) -> dict:
        """``{group: state_dict}`` views of the live state for a load to fill in place
        (``CheckpointManager.load(out=...)`` with W = 1, ``load_distributed`` with W > 1: shards),
        so a resume never holds a second copy. After a failed load they may hold a partial mix:
        the caller loads another checkpoint or rebuilds. Optimizer views (W > 1 only) give the
        optimizer zero-initialised moments first (torch's way); the load overwrites them."""
        out = {"policy": self._policy_groups()["policy"]}
        if self.max_staleness:
            out["behaviour"] = self._model_state(self.rollout_model)
        if self.critic is not None:
            out["critic"] = self._model_state(self.critic)
        if self.dp.distributed:
            out["optimizer"] = self._optim_state(self.actor, self.actor_optimizer)
            if self.critic is not None:
                out["critic_optimizer"] = self._optim_state(self.critic, self.critic_optimizer)
        return {g: v for g, v in out.items() if g in groups}

    def load_state(self, groups: dict, meta: dict) -> None:
        """Inverse of :meth:`state` (a checkpoint without optimizer state restarts the moments).
        Optimizer state may be by parameter name (torch.distributed.checkpoint's layout, what
        :meth:`state` saves) or by index (``Optimizer.state_dict()``, checkpoints written before)."""
        self._load_model(self.actor, self.actor_optimizer, groups["policy"],
                         groups.get("optimizer"))
        if "optimizer" in groups:
            self.actor_scheduler.load_state_dict(meta["scheduler"])
        if self.critic is not None:
            if "critic" not in groups:
                raise ValueError("checkpoint has no critic but this run trains one "
                                 f"(algorithm.adv_estimator={self.cfg.algorithm.adv_estimator!r})")
            self._load_model(self.critic, self.critic_optimizer, groups["critic"],
                             groups.get("critic_optimizer"))
            if "critic_optimizer" in groups:
                self.critic_scheduler.load_state_dict(meta["critic_scheduler"])
        if self.max_staleness:
            if "behaviour" in groups:
                from torch.distributed.checkpoint.state_dict import set_model_state_dict

                set_model_state_dict(self.rollout_model, groups["behaviour"])
                self.behaviour_changed()
            else:  # an on-policy run's checkpoint: the first rollout samples its own state
                self.snapshot_behaviour()
        self._rollout_stale = True
        self.kl_ctrl.load_state_dict(meta["kl_ctrl"])
        self.sampler.load_state_dict(meta["sampler"])
        # checkpoints from before guard/history were saved start them empty
        self.guard = {**GUARD_DEFAULTS, **meta.get("guard", {})}
        self.history = [dict(h) for h in meta.get("metrics_history", [])][-HISTORY_STEPS:]
        if "rng" in groups:
            restore_rng_state(groups["rng"])

    def _load_model(self, model, optimizer, weights: dict, optim_state) -> None:
        from torch.distributed.checkpoint.state_dict import (set_model_state_dict,
                                                             set_optimizer_state_dict)

        if model is self.actor and self.lora:  # the adapters; the base is the assets' own
            from torch.distributed.checkpoint.state_dict import StateDictOptions

            got = set_model_state_dict(model, weights, options=StateDictOptions(strict=False))
            # everything but the adapters (tied weights appear once as parameters, under every
            # name in the state dict)
            frozen = set(model.state_dict()) - {n for n, p in model.named_parameters()
                                                if p.requires_grad}
            wrong = sorted(set(got.missing_keys) - frozen) + sorted(got.unexpected_keys)
            if wrong:
                raise ValueError(f"this checkpoint's policy is not this run's LoRA adapters "
                                 f"(missing or unexpected: {wrong[:5]}); resume it with the "
                                 "model.lora_* settings that wrote it")
        else:
            set_model_state_dict(model, weights)  # W > 1: the loaded shards (in place already)
        if optim_state is None:  # no stale moments from whatever this trainer held before
            optimizer.state.clear()
        elif all(isinstance(k, int) for k in optim_state.get("state", {})):
            if self.dp.distributed:
                raise ValueError("this checkpoint stores the optimizer by parameter index (written "
                                 "before worker groups); resume it with one worker first")
            optimizer.load_state_dict(optim_state)
        else:
            set_optimizer_state_dict(model, optimizer, optim_state)

    def scale_lr(self, factor: float) -> None:
        """Multiply every learning rate (actor and critic) by ``factor`` from now on: the current
        LR and the schedule's base, so the warmup/cosine shape is kept. The base LRs are part of
        the scheduler's state, so checkpoints carry the scaled schedule."""
        for opt, sched in ((self.actor_optimizer, self.actor_scheduler),
                           (self.critic_optimizer, self.critic_scheduler)):
            if opt is None:
                continue
            for g in opt.param_groups:
                g["lr"] *= factor
                if "initial_lr" in g:
                    g["initial_lr"] *= factor
            sched.base_lrs = [b * factor for b in sched.base_lrs]

    def snapshot_behaviour(self) -> None:
        """``rollout.max_staleness``: the rollout model (the behaviour policy) takes the actor's
        current weights (a LoRA policy's merged), and so does an engine with its own copy. The
        worker calls it at the state the next rollout samples from (``RunWorker._snap``)."""
        self.rollout_model.load_state_dict(model_state(self.actor))
        self.behaviour_changed()

    def behaviour_changed(self) -> None:
        """The rollout model's weights changed (a snapshot, a load, or another process's
        snapshot of the shared weights: ``engine/sampler_process.py``): an engine with its own
        copy (vllm) takes them before it samples next."""
        self._engine_stale = True

    def _sync_rollout_weights(self) -> None:
        """W > 1: copy the current weights from the FSDP shards into the rollout model (an
        all-gather, no round trip through the store). A collective: every worker calls it.
        An engine with its own copy of the weights (vllm) then gets them from the rollout
        model. With ``rollout.max_staleness`` the rollout model changes only by
        :meth:`snapshot_behaviour` (or a load): the engine follows it."""
        if self.max_staleness:
            if self._engine_stale and self.engine.owns_weights:
                self.engine.load_weights(model_state(self.rollout_model))
            self._engine_stale = False
            return
        if self._rollout_stale:
            if self.dp.distributed:  # a LoRA policy's merged (W + s B A) into the plain copy
                self.rollout_model.load_state_dict(model_state(
                    self.actor, sharding.full_model_state(self.actor, rank0_only=False)))
            if self.engine.owns_weights:
                self.engine.load_weights(model_state(self.rollout_model))
        self._rollout_stale = False

    def _generate(self, prompt_ids, prompt_mask, params: SamplingParams):
        """Generate for all N rows; with W > 1 each worker samples its block (with the random
        draws the whole batch would use for those rows) and the blocks are gathered."""
        self._sync_rollout_weights()
        if not self.dp.distributed:
            return self.engine.generate(prompt_ids, prompt_mask, params)
        n = prompt_ids.shape[0]
        mine = self.dp.block(torch.arange(n))
        out = self.engine.generate(prompt_ids[mine], prompt_mask[mine], params,
                                   first_row=int(mine[0]), total_rows=n)
        return concat_outputs(self.dp.gather_objects(out), self.tokenizer.pad_token_id)

    @contextlib.contextmanager
    def _policy_engine(self):
        """The engine that samples the current policy (the evaluation's): the rollout engine,
        except with ``rollout.max_staleness``, where that one holds the behaviour policy: then an
        ``hf`` engine over the actor, or the rollout engine (vllm) given the actor's weights
        until the next rollout gives it the behaviour policy's back."""
        if not self.max_staleness:
            self._sync_rollout_weights()
            yield self.engine
        elif self.engine.owns_weights:
            self.engine.load_weights(model_state(self.actor))
            self._engine_stale = True
            yield self.engine
        else:
            if self._actor_engine is None:
                self._actor_engine = make_engine(
                    "hf", model=self.actor, eos_token_ids=stop_token_ids(self.tokenizer),
                    pad_token_id=self.tokenizer.pad_token_id,
                    micro_batch_size=self.cfg.rollout.generation_batch)
            yield self._actor_engine

    def _generate_turns(self, prompt_ids, prompt_mask, params: SamplingParams,
                        rows: list[int], rows_data: list[PromptRow], phase: str,
                        split: bool = True, engine=None) -> MultiTurnOutput:
        """Multi-turn rollouts (``rollout.multi_turn``, :func:`generate_turns`) of the N
        prompts; ``rows`` (N,): each one's row index in the phase's whole batch (its random
        draws), ``rows_data`` (N,) the dataset rows (verl's ``extra_info.tools_kwargs``). With
        W > 1 and ``split`` each worker runs its block and the blocks are gathered (a
        collective); ``split=False``: this worker runs all N. ``engine``: another engine than
        the rollout's (the evaluation's, :meth:`_policy_engine`)."""
        if engine is None:
            self._sync_rollout_weights()
        rc, n = self.cfg.rollout, prompt_ids.shape[0]
        split = split and self.dp.distributed
        mine = self.dp.block(torch.arange(n)).tolist() if split else list(range(n))
        out = generate_turns(
            engine or self.engine, self.tokenizer,
            [prompt_ids[i][prompt_mask[i].bool()].tolist() for i in mine], params,
            host=self.tool_host, tools=self.tool_schemas, rows=[rows[i] for i in mine],
            tools_kwargs=[(rows_data[i].extra_info or {}).get("tools_kwargs") for i in mine],
            **turn_limits(rc), instance_prefix=f"{phase}:{params.seed}")
        if split:
            out = concat_turn_outputs(self.dp.gather_objects(out), self.tokenizer.pad_token_id)
        return out

    def _generate_greedy(self, prompt_ids, prompt_mask) -> GenerationOutput:
        """One greedy (argmax) response per prompt row: (B, T_b). With W > 1 the rows are padded
        to a multiple of W with copies of the last one (greedy decoding draws nothing, so the
        copies change no other row) and the copies dropped after."""
        B = prompt_ids.shape[0]
        pad = -B % self.dp.size
        if pad:
            prompt_ids = torch.cat([prompt_ids, prompt_ids[-1:].expand(pad, -1)])
            prompt_mask = torch.cat([prompt_mask, prompt_mask[-1:].expand(pad, -1)])
        params = SamplingParams(temperature=0.0, max_new_tokens=self.cfg.rollout.max_new_tokens)
        out = self._generate(prompt_ids, prompt_mask, params)
        mask = out.response_mask[:B]
        T = int(mask.sum(0).nonzero().max()) + 1 if mask.any() else 0  # drop the copies' columns
        return GenerationOutput(response_ids=out.response_ids[:B, :T], response_mask=mask[:, :T],
                                logprobs=out.logprobs[:B, :T])

    # ------------------------------------------------------------------ phases
    def prompt_indices(self, step: int, *, keep_position: bool = False) -> list[int]:
        """Dataset indices of step ``step``'s prompts: a pure function of (seed, step). The
        sampler is left after them (what a checkpoint records), unless ``keep_position`` (the
        background rollout of the next step, ``RunWorker``: the state stays the current step's)."""
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
        """Sample G responses for each of the B prompts of ``step`` (:meth:`sample`), then the
        per-token inputs the later phases need from a model (:meth:`model_inputs`). Everything
        that needs model weights happens here or in :meth:`update`, so the reward and advantage
        phases are light functions of the batch. (DAPO's dynamic sampling calls the two parts
        itself: ``engine/dynamic_sampling.py``.)"""
        batch, metrics = self.sample(step, self.prompt_indices(step))
        return self.model_inputs(batch), metrics

    def sample(self, step: int, idx: list[int], phase: str = "rollout") -> tuple[Batch, dict]:
        """G responses for each prompt of dataset indices ``idx`` (B,) from the current policy,
        seeded by (seed, step, ``phase``), with one greedy response per prompt when the
        estimator asks for it (``needs_greedy_baseline``, ReMax): the batch (groups 0..B-1 in
        the order of ``idx``) and the rollout metrics."""
        rc, G = self.cfg.rollout, self.cfg.rollout.n
        rows_idx = torch.tensor(idx).repeat_interleave(G)  # (N,): prompt b's G samples adjacent
        params = SamplingParams(temperature=rc.temperature, top_p=rc.top_p, top_k=rc.top_k,
                                max_new_tokens=rc.max_new_tokens,
                                seed=derive_seed(self.cfg.seed, step, phase))
        rows = [self.train_rows[i] for i in rows_idx.tolist()]
        t0 = time.perf_counter()
        restarts, timeouts = self.engine.restarts, self.engine.timeouts
        faults.engine_drill(self.engine, step)  # a VERL_FAULTS drill (engine_kill/_hang)
        extra, metrics, infos = {}, {}, [r.extra_info for r in rows]
        if rc.multi_turn:
            # VERL_FAULTS' tool_call point: in this step's calls, once sent (a no-op without it)
            self.tool_host.on_calls_sent = functools.partial(faults.maybe_inject, "tool_call", step)
            try:
                out = self._generate_turns(self.train_prompt_ids[rows_idx],
                                           self.train_prompt_mask[rows_idx], params,
                                           list(range(len(rows))), rows, phase)
            finally:
                self.tool_host.on_calls_sent = None
            extra = {"response_attention_mask": out.attention_mask,
                     "turns": out.stored_turns()}
            metrics.update(turn_metrics(out))
            infos = turn_extra_info(infos, extra["turns"])
        else:
            out = self._generate(self.train_prompt_ids[rows_idx],
                                 self.train_prompt_mask[rows_idx], params)
        dt = time.perf_counter() - t0
        traits = self.cfg.algorithm.estimator_traits
        if traits.needs_greedy_baseline:
            t1 = time.perf_counter()
            greedy = self._generate_greedy(self.train_prompt_ids[idx], self.train_prompt_mask[idx])
            prompt_of_row = torch.arange(len(idx)).repeat_interleave(G)  # (N,) row -> prompt b
            extra.update({"baseline_response_ids": greedy.response_ids[prompt_of_row],  # (N, T_b)
                          "baseline_response_mask": greedy.response_mask[prompt_of_row]})
            metrics["rollout/greedy_time_s"] = time.perf_counter() - t1
            metrics["rollout/greedy_length_mean"] = float(greedy.response_mask.sum()) / len(idx)
        batch = Batch(
            prompt_ids=self.train_prompt_ids[rows_idx], prompt_mask=self.train_prompt_mask[rows_idx],
            response_ids=out.response_ids, response_mask=out.response_mask,
            response_logprobs=out.logprobs,
            group=torch.arange(len(idx)).repeat_interleave(G),
            uid=[str(r.index) for r in rows], ground_truth=[r.ground_truth for r in rows],
            data_source=[r.data_source for r in rows], extra_info=infos,
            pad_id=self.tokenizer.pad_token_id,
            meta={"step": step, "kl_coef": self.kl_ctrl.value}, **extra)
        tokens = float(out.response_mask.sum())  # sampled
        lengths = batch.response_lengths  # (N,) every real token (multi-turn: tools' too)
        return batch, {"rollout/time_s": dt, "rollout/tokens_per_s": tokens / max(dt, 1e-9),
                       "response_length/mean": float(lengths.sum()) / batch.num_rows,
                       # verl's: the share of responses cut at rollout.max_new_tokens
                       "response_length/clip_ratio": float(
                           (lengths >= rc.max_new_tokens).float().mean()),
                       # 1: the engine gave its memory back for the update (vLLM's sleep mode)
                       "rollout/memory_released": float(self.engine.releases_memory),
                       # rebuilds of a dead or hung engine (vllm in its own process)
                       "rollout/engine_restarts": float(self.engine.restarts - restarts),
                       "rollout/engine_timeouts": float(self.engine.timeouts - timeouts),
                       **metrics}

    def model_inputs(self, batch: Batch) -> Batch:
        """``batch`` with the per-token inputs the later phases need from a model: reference
        log-probs (KL), critic values (GAE) and Σ_v π_v² per token (``needs_sum_pi_squared``)."""
        traits = self.cfg.algorithm.estimator_traits
        micro, actor_cfg = self.cfg.actor.ppo_micro_batch_size, self.cfg.actor
        # with W > 1 each worker runs its block of rows through the sharded model (token-
        # balanced with trainer.balance_batch), then the rows are put back in order: (N, T)
        order = worker_order(row_tokens(batch), self.dp.size,
                             self.cfg.trainer.balance_batch and self.dp.distributed)
        mine = self.dp.block(order)
        part = batch.select(mine) if self.dp.distributed else batch

        def gathered(local):
            return in_row_order(order, self.dp.gather_rows(local))

        if self.cfg.algorithm.uses_reference:
            ref = self.ref if self.ref is not None else self.actor
            with reference_of(ref):  # LoRA: the policy with its adapters off
                ref_lp = batched_logprobs(
                    ref, part, self.cfg.rollout.temperature or 1.0, micro, dp=self.dp,
                    max_token_len=actor_cfg.token_budget("ref_log_prob_max_token_len_per_gpu"),
                    remove_padding=actor_cfg.use_remove_padding,
                    prefix_grouper=actor_cfg.use_prefix_grouper)
            batch = batch.replace(ref_logprobs=gathered(ref_lp))
        if self.critic is not None:
            batch = batch.replace(values=gathered(batched_values(
                self.critic, part, micro, dp=self.dp,
                max_token_len=actor_cfg.token_budget("critic_forward_max_token_len_per_gpu"),
                remove_padding=actor_cfg.use_remove_padding)))
        if traits.needs_sum_pi_squared:
            # the rollout model: the weights (and temperature) that sampled the responses, whose
            # log-probs are the estimator's old_logprobs (with W > 1 a full, unsharded copy)
            batch = batch.replace(sum_pi_squared=gathered(batched_sum_pi_squared(
                self.rollout_model, part, self.cfg.rollout.temperature or 1.0, micro,
                max_token_len=actor_cfg.token_budget("log_prob_max_token_len_per_gpu"),
                dp=self.dp, remove_padding=actor_cfg.use_remove_padding)))
        return batch

    def reward(self, batch: Batch, details: dict | None = None) -> tuple[Batch, dict]:
        """Score ``batch`` (:func:`score_batch`). With ``reward_model.enable`` the reward model
        scores the rows (and ReMax's greedy responses) first, every worker its share
        (:meth:`model_scores`, a collective: with W > 1 every worker calls this); then only
        rank 0 runs ``reward.scorer`` and returns the scored batch, the others return the batch
        unscored with no metrics (the driver keeps rank 0's result, as for the rollout).
        ``details``: as :func:`score_batch`'s (rank 0)."""
        rm, overlong = self.reward_model, OverlongBuffer.of(self.cfg)
        if rm is None:
            return score_batch(batch, self.scorer, self.tokenizer, overlong=overlong,
                               details=details)
        t0 = time.perf_counter()
        texts = decoded(self.tokenizer, batch).texts
        scores = self.model_scores(batch.uid, texts)  # (N,)
        baseline = None
        if batch.baseline_response_ids is not None:
            rows = group_first_rows(batch.group)  # (B,)
            idx = torch.tensor(rows, dtype=torch.long)
            greedy = decode_responses(self.tokenizer, batch.baseline_response_ids[idx],
                                      batch.baseline_response_mask[idx]).texts
            baseline = self.model_scores([batch.uid[i] for i in rows], greedy)  # (B,)
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
        ``responses[i]``); the prompt is found by its uid (the training row's index).

        With W > 1 worker ``r`` scores the ``r``-th contiguous share of the rows and the shares
        are gathered (a collective: every worker calls it). Every worker tokenises all n rows to
        find the one padded width, so neither W nor ``reward_model.micro_batch_size`` changes a
        row's input shapes. A row too long for ``reward_model.max_length``, or a non-finite score,
        raises :class:`~verl_core.reward.model.RewardModelError` naming it, on every worker."""
        rm = self.reward_model
        rows = [self.train_rows[int(u)] for u in uids]
        texts = [rm.render(r.chat, render_prompt(r, self.tokenizer), resp)
                 for r, resp in zip(rows, responses)]
        names = [f"row {i} (dataset row {r.index}, data_source {r.data_source!r})"
                 for i, r in enumerate(rows)]
        ids = rm.encode(texts, names)
        width = max((len(x) for x in ids), default=0)
        n, W, k = len(ids), self.dp.size, self.dp.rank
        lo, hi = n * k // W, n * (k + 1) // W  # no collectives in the forward: shares may differ
        local = rm.score_ids(ids[lo:hi], width=width,
                             micro_batch_size=self.cfg.reward_model.micro_batch_size)
        return check_finite([s for part in self.dp.gather_objects(local) for s in part], names)

    def advantage(self, batch: Batch) -> tuple[Batch, dict]:
        return compute_advantages(batch, self.cfg.algorithm)

    def update(self, batch: Batch, step: int) -> dict:
        """Update ``step`` on the advantaged ``batch``: the KL controller, then the PPO epochs
        (:func:`~verl_core.training.ppo.ppo_update`) seeded by the step; the guard's history
        remembers the step's metrics."""
        c = self.cfg
        metrics = {}
        if c.algorithm.use_kl_in_reward:
            # the controller moves here, not in the advantage phase, so the state it belongs to
            # changes in exactly one phase (the one that also changes the weights)
            self.kl_ctrl.update(batch.meta["reward_kl"], batch.num_rows)
            metrics["actor/kl_coef"] = self.kl_ctrl.value
        # a VERL_FAULTS drill (nan_grad): NaN gradients after the first backward; else None
        poison = _poison_gradients if faults.hook("after_backward", step) else None
        # any stochastic layer (dropout in a user's model) draws from global RNG: pin it to the
        # step, so the update stays a pure function of (state, batch, step)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(derive_seed(c.seed, step, "update-global"))
            metrics.update(ppo_update(
                self.actor, self.actor_optimizer, self.actor_scheduler, batch,
                UpdateOptions.from_config(c), seed=derive_seed(c.seed, step, "update"),
                critic=self.critic, critic_optimizer=self.critic_optimizer,
                critic_scheduler=self.critic_scheduler, dp=self.dp, after_backward=poison))
        if self.device.type == "cuda":  # verl's perf/* memory metrics: the step's peak
            metrics["perf/max_memory_allocated_gb"] = \
                torch.cuda.max_memory_allocated(self.device) / 2**30
            metrics["perf/max_memory_reserved_gb"] = \
                torch.cuda.max_memory_reserved(self.device) / 2**30
            torch.cuda.reset_peak_memory_stats(self.device)
        self._rollout_stale = True
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
        """The held-out metrics: ``val/accuracy`` = mean score, greedy unless
        ``rollout.val_do_sample`` (then seeded by the run's seed and ``step``). With W > 1 each
        worker decodes a contiguous share of the rows and the scores are gathered."""
        return self.evaluate_with_samples(0, step)[0]

    @torch.no_grad()
    def evaluate_with_samples(self, n_samples: int, step: int = 0) -> tuple[dict, list[EvalSample]]:
        """:meth:`evaluate`, plus the first ``n_samples`` held-out responses as decoded (for the
        reports; with W > 1, from this worker's share)."""
        with self._policy_engine() as engine:
            return self._evaluate_with(engine, n_samples, step)

    def _evaluate_with(self, engine, n_samples: int, step: int) -> tuple[dict, list[EvalSample]]:
        rc = self.cfg.rollout
        sampled = rc.val_do_sample and rc.val_temperature > 0  # verl: do_sample at 0 is greedy
        k = rc.val_n if sampled else 1  # responses per prompt, adjacent (as rollout.n's)
        params = SamplingParams(temperature=rc.val_temperature if sampled else 0.0,
                                top_p=rc.val_top_p, top_k=rc.val_top_k,
                                max_new_tokens=rc.max_new_tokens,
                                seed=derive_seed(self.cfg.seed, step, "val"))
        n, W, r = self.val_prompt_ids.shape[0], self.dp.size, self.dp.rank
        lo, hi = n * r // W, n * (r + 1) // W  # no collectives in decoding: shares may differ
        texts, special, lengths, shown, infos = [], [], [], [], []
        step_rows = self.cfg.data.val_batch_size
        for s in range(lo, hi, step_rows):
            e = min(s + step_rows, hi)
            ids = self.val_prompt_ids[s:e].repeat_interleave(k, 0)
            mask = self.val_prompt_mask[s:e].repeat_interleave(k, 0)
            # each response draws what it would in one call over all n x k rows: the numbers
            # do not depend on the worker count or val_batch_size
            sampled_mask = None
            chunk = [row for row in self.val_rows[s:e] for _ in range(k)]
            if rc.multi_turn:
                out = self._generate_turns(ids, mask, params, list(range(s * k, e * k)), chunk,
                                           "val", split=False, engine=engine)
                # the scorer sees verl's num_turns and tool_rewards, as in the rollout phase
                infos += turn_extra_info([row.extra_info for row in chunk], out.stored_turns())
                real = out.attention_mask  # (n, T) every real token, tools' responses too
                sampled_mask = out.response_mask
                dec = decode_responses(self.tokenizer, out.response_ids, real,
                                       sampled_mask=out.response_mask)
            else:
                out = engine.generate(ids, mask, params, first_row=s * k, total_rows=n * k) \
                    if sampled else engine.generate(ids, mask, params)
                real = out.response_mask
                dec = decode_responses(self.tokenizer, out.response_ids, out.response_mask)
                infos += [row.extra_info for row in chunk]
            for i in range(min(len(ids), n_samples - len(shown))):  # as the model saw them
                shown.append((report.visible_text(self.tokenizer, ids[i], mask[i]),
                              report.visible_text(self.tokenizer, out.response_ids[i], real[i],
                                                  None if sampled_mask is None
                                                  else sampled_mask[i])))
            texts += dec.texts
            special += dec.special_token
            lengths += real.sum(-1).tolist()
        rows = [row for row in self.val_rows[lo:hi] for _ in range(k)]
        res = self.scorer.score([r.data_source for r in rows], texts,
                                [r.ground_truth for r in rows], infos, special_token=special)
        scores = [s for part in self.dp.gather_objects(list(res.scores)) for s in part]
        lengths = [x for part in self.dp.gather_objects(lengths) for x in part]
        samples = [EvalSample(prompt=prompt, response=response, ground_truth=row.ground_truth,
                              score=float(score))
                   for row, (prompt, response), score in zip(rows, shown, res.scores)]
        metrics = {"val/accuracy": sum(scores) / max(1, len(scores)),
                   "val/response_length": sum(lengths) / max(1, len(lengths))}
        if k > 1:  # verl's best@n: each prompt's best of its k responses, averaged
            best = [max(scores[i:i + k]) for i in range(0, len(scores), k)]
            metrics[f"val/best@{k}"] = sum(best) / max(1, len(best))
        return metrics, samples
