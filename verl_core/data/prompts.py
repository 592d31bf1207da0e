"""A run's prompts as the models read them (:class:`Prompts`, built by :func:`load_prompts`: the
tokenizer, the training and held-out rows, their encoded prompts, the tools every prompt shows);
prompt rows loaded and length-checked file by file (:func:`load_checked_rows`, what run
preparation refuses a dataset with), rendered and encoded (:func:`encode_rows`), and the held-out
subset an evaluation reads (:func:`val_subset`).

What does not belong here: reading and validating the parquet rows (``dataset.py``), the
padding itself (``batch.py``'s :func:`~verl_core.data.batch.encode_prompts`).
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass
from typing import Any

import torch

from verl_core.agent.interactions import interaction_entries, llm_user_config, row_interaction
from verl_core.agent.tools import ToolHost, tool_entries
from verl_core.data.batch import encode_prompts
from verl_core.data.dataset import PromptRow, load_prompt_rows, render_prompt
from verl_core.models import load_tokenizer
from verl_core.seeds import derive_seed


@dataclass
class Prompts:
    tokenizer: Any
    train_rows: list[PromptRow]
    val_rows: list[PromptRow]
    """The held-out rows an evaluation scores (``data.val_max_samples`` of them)."""
    train_ids: torch.Tensor
    """(R, P) every training row's prompt, left-padded; ``train_mask`` (R, P) its real tokens."""
    train_mask: torch.Tensor
    val_ids: torch.Tensor
    val_mask: torch.Tensor
    tool_schemas: list[dict] | None = None
    tool_host: Any = None
    interaction_host: Any = None
    """``rollout.interaction_config_path``: the ``ToolHost`` serving the simulated users
    (``agent/interactions.py``); None otherwise."""
    """``rollout.multi_turn``: the ``ToolHost`` (a process) the calls run in; None otherwise."""

    def close(self) -> None:
        for host in (self.tool_host, self.interaction_host):
            if host is not None:
                host.close()


def load_prompts(cfg, assets) -> Prompts:
    """The run's prompts: tokenizer, rows, encoded prompts and, with ``rollout.multi_turn``, the
    tools (their schemas in every prompt) in a host process."""
    tok = load_tokenizer(assets.model_path)
    train_rows = load_prompt_rows(assets.train_files)
    val_rows = val_subset(load_prompt_rows(assets.val_files), cfg.data.val_max_samples, cfg.seed)
    schemas = host = users = None
    if cfg.rollout.multi_turn and cfg.rollout.tool_config_path:
        entries = tool_entries(cfg.rollout.tool_config_path)
        schemas = [e.schema for e in entries]
        host = ToolHost(entries, timeout_s=cfg.rollout.tool_timeout_s)
    if cfg.rollout.multi_turn and cfg.rollout.interaction_config_path:
        users = interaction_host(cfg.rollout, [*train_rows, *val_rows])
    d = cfg.data
    train_ids, train_mask = encode_rows(tok, train_rows, d.max_prompt_length, d.truncation, schemas)
    val_ids, val_mask = encode_rows(tok, val_rows, d.max_prompt_length, d.truncation, schemas)
    return Prompts(tokenizer=tok, train_rows=train_rows, val_rows=val_rows, train_ids=train_ids,
                   train_mask=train_mask, val_ids=val_ids, val_mask=val_mask,
                   tool_schemas=schemas, tool_host=host, interaction_host=users)


class UserHost(ToolHost):
    """The simulated users of a run: the interaction classes in a host process (a
    :class:`ToolHost`, started only when there are any) and ``llm``, the LLM users' settings by
    name (they run on the rollout engine, ``rollout/multi_turn.py``)."""

    def __init__(self, entries, llm: dict[str, dict], timeout_s: float):
        self.llm = llm
        self.hosted = bool(entries)
        if entries:
            super().__init__(entries, timeout_s=timeout_s)

    def start(self) -> None:
        if self.hosted:
            super().start()

    def close(self) -> None:
        if self.hosted:
            super().close()


def interaction_host(rc, rows: list[PromptRow]) -> UserHost:
    """The simulated users of ``rollout.interaction_config_path`` (:class:`UserHost`), every
    row's ``extra_info.interaction_kwargs`` checked against them first (a row without one, or
    naming no interaction of the config, is refused naming the row, as verl refuses it)."""
    entries = interaction_entries(rc.interaction_config_path)
    names = [e.name for e in entries]
    for r in rows:
        row_interaction((r.extra_info or {}).get("interaction_kwargs"), names, r.index)
    llm = {e.name: llm_user_config(e) for e in entries if llm_user_config(e) is not None}
    return UserHost([e.tool_entry() for e in entries if e.name not in llm], llm,
                    rc.tool_timeout_s)


def val_subset(rows: list[PromptRow], cap: int, seed: int) -> list[PromptRow]:
    """At most ``cap`` of the held-out ``rows`` (-1: all): a seeded draw without replacement, in
    file order, the same for every evaluation of a run (``data.val_max_samples``)."""
    if cap < 0 or len(rows) <= cap:
        return rows
    keep = sorted(random.Random(derive_seed(seed, 0, "val-subset")).sample(range(len(rows)), cap))
    return [rows[i] for i in keep]


def encode_rows(tokenizer, rows: list[PromptRow], max_len: int, truncation: str = "error",
                tools: list[dict] | None = None):
    """The rows' prompts rendered (``tools``: their schemas in every prompt) and encoded:
    (prompt_ids (n, P), prompt_mask (n, P)), an over-long one named by its row index."""
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
