"""Prompt rows for a tokenizer: loaded and length-checked file by file (:func:`load_checked_rows`,
what run preparation refuses a dataset with), rendered and encoded (:func:`encode_rows`), and the
held-out subset an evaluation reads (:func:`val_subset`).

What does not belong here: reading and validating the parquet rows (``dataset.py``), the
padding itself (``batch.py``'s :func:`~verl_core.data.batch.encode_prompts`).
"""

from __future__ import annotations

import dataclasses
import random

from verl_core.data.batch import encode_prompts
from verl_core.data.dataset import PromptRow, load_prompt_rows, render_prompt
from verl_core.seeds import derive_seed


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
