"""What a run starts from (:class:`Assets`): its train/val parquet files and its model folder,
made by :func:`prepare_assets` when the config names none (the synthetic dataset; the tiny model
and its warm start, ``tiny_warmup.py``; a brought model's format warm start,
``format_warmup.py``), every dataset file checked before any model work.

What does not belong here: storing the assets in the run store and materialising them on a
worker (``engine/assets.py``), what the run records as its assets (``prepare.py``).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from verl_core.agent.openai_server import load_agent
from verl_core.agent.loops import check_agent_loops
from verl_core.agent.tools import ToolConfigError, ToolHost, tool_entries
from verl_core.config import RunConfig
from verl_core.data.code_task import write_code_dataset
from verl_core.data.dataset import DatasetError, load_prompt_rows
from verl_core.data.prompts import load_checked_rows
from verl_core.data.synthetic import (write_arithmetic_dataset, write_calculator_dataset,
                                      write_guess_dataset)
from verl_core.data.word_problems import write_word_problem_dataset
from verl_core.format_warmup import format_answers, format_warm_start
from verl_core.models import build_tiny_model, load_tokenizer
from verl_core.models.lora import check_lora, meta_model
from verl_core.models.loading import precision_line, write_overridden_folder
from verl_core.models.tokenizer import CHAR_CHAT_TEMPLATE, build_char_tokenizer
from verl_core.reward.judge import check_judge
from verl_core.reward.model import check_reward_model
from verl_core.seeds import derive_seed
from verl_core.tiny_warmup import tiny_warm_start
from verl_core.validation import validate_dataset_files
from verl_core.warmstart import WarmStart, warm_start_key


@dataclass(frozen=True)
class Assets:
    """What a run starts from: a model folder and the train/val parquet files."""

    model_path: str
    train_files: list[str]
    val_files: list[str]
    reward_model_path: str = ""
    """The reward model's folder ("" without ``reward_model.enable``)."""
    judge_template_path: str = ""
    """A generative judge's prompt template file (``reward_model.prompt_template``; "" for the
    built-in one)."""
    model_source_path: str = ""
    """The folder you brought when ``model_path`` is a copy made from it (its format warm start,
    ``model.format_warmup_steps``, or its config.json with ``model.override_config``); ""
    otherwise."""
    teacher_path: str = ""
    """On-policy distillation's teacher folder ("" without ``algorithm.distill_teacher_path``)."""


def prepare_assets(cfg: RunConfig, workdir: str, log=print, *, build_model: bool = True,
                   store=None) -> Assets:
    """:func:`_prepare_assets`, with the teacher of ``algorithm.distill_teacher_path`` checked
    first (its folder, and its tokenizer against the student's: before the data and the warm
    start) and named in the assets."""
    teacher = cfg.algorithm.distill_teacher_path
    if teacher:
        check_teacher(cfg, teacher)
    assets = _prepare_assets(cfg, workdir, log, build_model=build_model, store=store)
    return dataclasses.replace(assets, teacher_path=teacher) if teacher else assets


def check_teacher(cfg: RunConfig, teacher: str) -> None:
    """The teacher folder loads as a model folder and its tokenizer is the student's (the
    ``model.path`` folder's, or the tiny model's character tokenizer), else an error naming
    both."""
    from verl_core.models import check_model_folder
    from verl_core.parts.teacher import check_same_tokenizer

    check_model_folder(teacher, "algorithm.distill_teacher_path")
    if cfg.model.path:
        student, name = load_tokenizer(cfg.model.path), f"model.path={cfg.model.path!r}"
    else:
        calculator = cfg.data.synthetic_task in ("calculator", "guess") \
            and not cfg.data.train_files
        student = build_char_tokenizer(CHAR_CHAT_TEMPLATE if calculator else None)
        name = "the tiny model's character tokenizer"
    check_same_tokenizer(student, load_tokenizer(teacher), name, teacher)


def _prepare_assets(cfg: RunConfig, workdir: str, log=print, *, build_model: bool = True,
                    store=None) -> Assets:
    """Materialise the embedded defaults: the synthetic dataset when no files are given, the tiny
    warm-started model when no model path is given. Deterministic in ``cfg.seed``.
    ``build_model=False``: no warm start (``model_path`` stays empty when none is given): a
    trajectory that ran before takes its model from its record (``prepare_run``). ``store``
    (the run store): the warm start saves its progress there and resumes from it, and a
    finished one with the same inputs is reused (``verl_core/warmstart.py``)."""
    rm = cfg.reward_model
    judge = rm.enable and rm.style == "generative"
    if judge:  # not a causal LM, or a template that cannot be filled: before any work
        check_judge(rm.path, rm.prompt_template)
    elif rm.enable:  # not a one-label sequence classifier: fail before the data and the warm start
        check_reward_model(rm.path, rm.max_length)
    given = {"reward_model_path": rm.path if rm.enable else "",
             "judge_template_path": rm.prompt_template if judge else ""}
    calculator = not cfg.data.train_files and cfg.data.synthetic_task == "calculator"
    guess = not cfg.data.train_files and cfg.data.synthetic_task == "guess"
    if cfg.data.train_files:
        train_files, val_files = cfg.data.train_file_list, cfg.data.val_file_list
    elif cfg.data.synthetic_task == "word_problems":
        train, val = write_word_problem_dataset(
            os.path.join(workdir, "data"), train_size=cfg.data.synthetic_train_size,
            val_size=cfg.data.synthetic_val_size, seed=cfg.seed)
        train_files, val_files = [train], [val]
    elif cfg.data.synthetic_task == "code":
        train, val = write_code_dataset(
            os.path.join(workdir, "data"), train_size=cfg.data.synthetic_train_size,
            val_size=cfg.data.synthetic_val_size, seed=cfg.seed)
        train_files, val_files = [train], [val]
    elif guess:
        train, val = write_guess_dataset(
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
    template = CHAR_CHAT_TEMPLATE if calculator or guess else None
    tok = load_tokenizer(cfg.model.path) if cfg.model.path else build_char_tokenizer(template)
    schemas = check_tools(cfg, tok)
    check_interactions(cfg, [*train_files, *val_files])
    if cfg.rollout.openai_agent:  # the agent function is loaded once before any work
        load_agent(cfg.rollout.openai_agent)
    rows = load_checked_rows(tok, train_files, cfg.data.max_prompt_length, cfg.data.truncation,
                             schemas)
    val_rows = load_checked_rows(tok, val_files, cfg.data.max_prompt_length,
                                 cfg.data.truncation, schemas)
    check_agent_loops(cfg, [*rows, *val_rows])  # every loop the rows name: before any work
    check_ground_truths(cfg.reward.scorer, [*train_files, *val_files])
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
                      **given,
                      model_source_path=cfg.model.path)
    if cfg.model.path:
        check_lora(cfg.model, meta_model(cfg.model.path))  # model.lora_*: before any work
        model_path = cfg.model.path
        if cfg.model.override_config:  # the run's copy, config.json changed, weights linked
            model_path = write_overridden_folder(cfg.model.path, os.path.join(workdir, "model"),
                                                 cfg.model.config_overrides)
            log(precision_line(model_path, cfg.model.dtype))
            return Assets(model_path=model_path, train_files=train_files,
                          val_files=val_files, **given,
                          model_source_path=cfg.model.path)
    elif not build_model:
        return Assets(model_path="", train_files=train_files, val_files=val_files,
                      **given)
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
            tiny_warm_start(cfg, model, tok, rows, schemas, calculator, ws, log, guess=guess)
            model.save_pretrained(model_path, safe_serialization=True)
            tok.save_pretrained(model_path)
            ws.finish(model_path, ws.steps_done, ws.accuracy)
    log(precision_line(model_path, cfg.model.dtype))
    return Assets(model_path=model_path, train_files=train_files, val_files=val_files,
                  **given)


def check_ground_truths(scorer: str, files: list[str]) -> None:
    """Every row whose scorer checks its ground truths (``registry.GROUND_TRUTH_CHECKS``: a code
    row without tests) is usable, or a DatasetError naming the file, the row and the fix, before
    any model work."""
    from verl_core.reward.registry import GROUND_TRUTH_CHECKS, scorer_for

    if not GROUND_TRUTH_CHECKS or (scorer != "auto" and scorer not in GROUND_TRUTH_CHECKS):
        return
    for path in files:
        for r in load_prompt_rows([path]):
            check = GROUND_TRUTH_CHECKS.get(scorer if scorer != "auto" else
                                            scorer_for(r.data_source))
            if check is None:
                continue
            try:
                check(r.ground_truth)
            except ValueError as e:
                raise DatasetError(f"{path}: row {r.index} (0-based), column "
                                   f"'reward_model.ground_truth' (data_source "
                                   f"{r.data_source!r}): {e}") from None


def check_interactions(cfg: RunConfig, files: list[str]) -> None:
    """``rollout.interaction_config_path``: every row names one of its interactions, and every
    class is imported and built once in a host process, so a wrong config, row or class is
    refused before any work, naming it."""
    rc = cfg.rollout
    if not (rc.multi_turn and rc.interaction_config_path):
        return
    from verl_core.data.prompts import interaction_host

    for path in files:  # each file's rows checked on their own: an error names the file
        try:
            host = interaction_host(rc, load_prompt_rows([path]))
        except ToolConfigError as e:
            raise ToolConfigError(f"{path}: {e}") from None
    with host:  # builds every class once
        pass


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
    if not rc.tool_config_path:  # simulated users only (rollout.interaction_config_path)
        return None
    entries = tool_entries(rc.tool_config_path)
    with ToolHost(entries, timeout_s=rc.tool_timeout_s):
        pass
    return [e.schema for e in entries]
