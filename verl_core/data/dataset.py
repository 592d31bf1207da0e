"""Prompt datasets in verl's parquet row layout.

One parquet row is one prompt::

    data_source   str                 which task the row belongs to (picks the rule scorer)
    prompt        list[{role, content}] chat messages; rendered with the tokenizer's chat template
    ability       str, optional       free-form tag ("math", ...)
    reward_model  {style, ground_truth} ground_truth is what the scorer compares against
    extra_info    dict, optional      passed through to the scorer untouched

A flat ``ground_truth`` column is accepted when there is no ``reward_model`` column.

What belongs here: reading and validating such files into :class:`PromptRow` records, and
turning messages into prompt text. What does not: tokenisation and padding (``models/``,
``rollout/``), batching (``sampler.py``), per-response batch frames (``batch.py``).

Bad data fails fast with a :class:`DatasetError` that names the file, the 0-based row and the
column, and says what to do; nothing is silently dropped or truncated.
"""

from __future__ import annotations

import json
import math
import numbers
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq

from verl_core.store import resolve_storage_options

__all__ = ["PromptRow", "DatasetError", "load_prompt_rows", "render_prompt", "REQUIRED_COLUMNS",
           "check_columns", "ground_truth_column", "ground_truth_of", "chat_of", "prompt_text"]

REQUIRED_COLUMNS = ("data_source", "prompt")
"""Columns every file must have, plus ``reward_model`` (or a flat ``ground_truth``)."""

_LAYOUT_HINT = (
    "verl's layout is: data_source (str), prompt (list of {role, content} messages), "
    "reward_model ({style, ground_truth}), optional ability (str) and extra_info (dict)"
)


class DatasetError(ValueError):
    """A dataset file is missing, unreadable or malformed. The message names the file, the
    0-based row and the column where it applies, and what to do."""


Message = tuple[str, str]  # (role, content)


@dataclass(frozen=True)
class PromptRow:
    """One validated prompt."""

    index: int
    """Position in the list returned by :func:`load_prompt_rows` (what the sampler yields)."""
    data_source: str
    """Task name; selects the rule scorer when ``reward.scorer`` is ``auto``."""
    messages: tuple[Message, ...]
    """Chat messages as ``(role, content)`` pairs, in order; never empty."""
    ground_truth: str
    """Reference answer as text (numbers in the file are converted: 19 -> "19")."""
    ability: str = ""
    """The row's ``ability`` tag, "" when absent."""
    extra_info: dict = field(default_factory=dict)
    """The row's ``extra_info`` ({} when absent), passed to the scorer as is."""

    @property
    def chat(self) -> list[dict[str, str]]:
        """The messages as ``[{"role": ..., "content": ...}]`` (what chat templates take)."""
        return [{"role": r, "content": c} for r, c in self.messages]


# ---------------------------------------------------------------- loading
def load_prompt_rows(files: Sequence[str] | str,
                     storage_options: Mapping[str, Any] | None = None) -> list[PromptRow]:
    """Read and validate parquet files (local paths or fsspec URIs such as ``s3://b/k.parquet``).

    Rows keep file order, then row order; ``PromptRow.index`` numbers them 0..n-1 across all
    files. ``storage_options`` go to the fsspec filesystem (e.g. ``{"client_kwargs":
    {"endpoint_url": ...}}`` for S3).
    """
    if isinstance(files, str):
        files = [files]
    files = list(files)
    if not files:
        raise DatasetError("no dataset files given; set data.train_files / data.val_files to "
                           "comma-separated parquet paths, or leave both empty for the "
                           "synthetic task")
    rows: list[PromptRow] = []
    for path in files:
        table = _read_table(path, dict(storage_options or {}))
        rows.extend(_rows_from_table(table, path, start_index=len(rows)))
    return rows


def _read_table(path: str, storage_options: dict) -> pa.Table:
    try:
        with fsspec.open(path, "rb", **resolve_storage_options(path, storage_options)) as f:
            return pq.read_table(f)
    except FileNotFoundError as e:
        raise DatasetError(f"{path}: file not found ({e}); check the path in data.train_files / "
                           "data.val_files (and the store credentials for remote URIs)") from e
    except Exception as e:  # unreadable: not parquet, permission denied, bad credentials, ...
        raise DatasetError(f"{path}: cannot read it as parquet ({type(e).__name__}: {e}); the "
                           f"file must be a parquet table in verl's layout. {_LAYOUT_HINT}") from e


def check_columns(present: list[str], path: str) -> None:
    """Raise :class:`DatasetError` naming ``path`` when its columns ``present`` lack one that
    verl's row layout needs (prepare checks this from the parquet footer, before anything else
    of the file is judged)."""
    missing = [c for c in REQUIRED_COLUMNS if c not in present]
    if "reward_model" not in present and "ground_truth" not in present:
        missing.append("reward_model")
    if missing:
        raise DatasetError(f"{path}: missing column(s) {missing}; columns present: {present}. "
                           f"{_LAYOUT_HINT}")


def _rows_from_table(table: pa.Table, path: str, start_index: int) -> list[PromptRow]:
    present = table.column_names
    check_columns(present, path)
    n = table.num_rows
    if n == 0:
        raise DatasetError(f"{path}: the file has no rows; remove it from the file list or "
                           "regenerate it")

    def col(name):  # plain Python values, one per row (linear; no per-row table access)
        return table.column(name).to_pylist() if name in present else [None] * n

    data_sources, prompts = col("data_source"), col("prompt")
    abilities, extras = col("ability"), col("extra_info")
    agents = col("agent_name")  # verl's per-row agent loop: kept in extra_info["agent_name"]
    gt_column = ground_truth_column(present)
    has_rm = gt_column != "ground_truth"
    gts = col("reward_model") if has_rm else col("ground_truth")

    out = []
    for i in range(n):
        where = f"{path}: row {i} (0-based)"
        ds = data_sources[i]
        if not isinstance(ds, str) or not ds:
            raise DatasetError(f"{where}, column 'data_source': is {ds!r}; every row needs a "
                               "non-empty task name such as 'openai/gsm8k' (it selects the scorer)")
        ability = abilities[i]
        if ability is not None and not isinstance(ability, str):
            raise DatasetError(f"{where}, column 'ability': is {ability!r}; use a string or null")
        out.append(PromptRow(
            index=start_index + i,
            data_source=ds,
            messages=_messages_of(prompts[i], where),
            ground_truth=_ground_truth_text(
                ground_truth_of(_checked_reward_model(gts[i], where) if has_rm else gts[i],
                                gt_column), where, gt_column),
            ability=ability or "",
            extra_info=_with_agent_name(_extra_info_of(extras[i], where), agents[i], where),
        ))
    return out


def _with_agent_name(extra_info: dict, agent_name, where: str) -> dict:
    """The row's ``extra_info`` with its ``agent_name`` cell (verl's column naming the row's
    agent loop, ``agent/loops.py``), when there is one."""
    if agent_name is None or agent_name == "":
        return extra_info
    if not isinstance(agent_name, str):
        raise DatasetError(f"{where}, column 'agent_name': is {agent_name!r}; give the agent "
                           "loop's name (a string) or null")
    return {**extra_info, "agent_name": agent_name}


def _checked_reward_model(reward_model, where: str):
    """The row's ``reward_model`` cell, refused unless it is a struct/dict."""
    if reward_model is None:
        raise DatasetError(f"{where}, column 'reward_model': is null; every row "
                           "needs reward_model = {'style': 'rule', 'ground_truth': ...}")
    reward_model = _mapping(reward_model)
    if not isinstance(reward_model, dict):
        raise DatasetError(f"{where}, column 'reward_model': is "
                           f"{type(reward_model).__name__}, expected a struct/dict with "
                           "'ground_truth'")
    return reward_model


def _plain(value):
    """A parquet cell's value as JSON-able Python (numpy arrays from list columns as lists)."""
    if hasattr(value, "tolist"):
        value = value.tolist()
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _ground_truth_text(gt, where: str, column: str) -> str:
    """The ground truth as the text every scorer gets: a string as it is, a number as its
    shortest form, and a structured one (verl's Search-R1 rows hold ``{"target": [answers]}``)
    as its canonical JSON text, which the scorers that take structure parse (``reward/qa_em.py``;
    a custom scorer gets the text: ``json.loads`` it)."""
    if isinstance(gt, str):
        return gt
    if isinstance(gt, bool) or gt is None:
        pass
    elif isinstance(gt, numbers.Integral):
        return str(int(gt))
    elif isinstance(gt, numbers.Real) and math.isfinite(gt):
        return str(int(gt)) if float(gt).is_integer() else repr(float(gt))
    elif isinstance(gt, (dict, list, tuple)) or hasattr(gt, "tolist"):
        plain = _plain(gt)
        try:
            text = json.dumps(plain, sort_keys=True, ensure_ascii=False, allow_nan=False)
        except (TypeError, ValueError):
            pass
        else:
            if plain not in ({}, []):
                return text
    raise DatasetError(f"{where}, column '{column}': is {gt!r}; the ground truth must be a "
                       "non-null string, number, or a non-empty list/mapping of them (e.g. "
                       "{'target': ['Paris']})")


def _messages_of(prompt, where: str) -> tuple[Message, ...]:
    fix = ("the prompt must be a non-empty list of {'role': str, 'content': str} messages, "
           "e.g. [{'role': 'user', 'content': '12+7='}]")
    if isinstance(prompt, str):
        raise DatasetError(f"{where}, column 'prompt': is a plain string; {fix}")
    if hasattr(prompt, "tolist"):  # pandas reads a list column as numpy arrays
        prompt = prompt.tolist()
    if not isinstance(prompt, (list, tuple)) or not prompt:
        raise DatasetError(f"{where}, column 'prompt': is {_short(prompt)}; {fix}")
    messages = []
    for k, m in enumerate(prompt):
        m = _mapping(m)  # map-typed message
        role = m.get("role") if isinstance(m, dict) else None
        content = m.get("content") if isinstance(m, dict) else None
        if not isinstance(role, str) or not role or not isinstance(content, str):
            raise DatasetError(f"{where}, column 'prompt': message {k} is {_short(m)}; {fix}")
        messages.append((role, content))
    if not any(c.strip() for _, c in messages):
        raise DatasetError(f"{where}, column 'prompt': every message content is empty; {fix}")
    return tuple(messages)


def _extra_info_of(extra, where: str) -> dict:
    if extra is None:
        return {}
    extra = _mapping(extra)  # map-typed column
    if not isinstance(extra, dict):
        raise DatasetError(f"{where}, column 'extra_info': is {_short(extra)}; use a struct/dict "
                           "or null")
    return extra


def _mapping(cell):
    """A parquet map cell reads back as (key, value) pairs: the dict they make; any other cell as
    it is."""
    if isinstance(cell, (list, tuple)):
        try:
            return dict(cell)
        except (TypeError, ValueError):
            pass
    return cell


def _short(v, limit: int = 80) -> str:
    s = repr(v)
    return s if len(s) <= limit else s[:limit] + "..."


# ---------------------------------------------------------------- reading cells as they are
# For the dataset suite (``validation.py``), which judges rows the loader would refuse, so it
# reads every cell without raising: what a cell lacks comes back empty.
def ground_truth_column(present: Sequence[str]) -> str:
    """The column a file's ground truth is named by: ``reward_model.ground_truth``, or the flat
    ``ground_truth`` column of a file without a ``reward_model`` column."""
    return ("ground_truth" if "reward_model" not in present and "ground_truth" in present
            else "reward_model.ground_truth")


def ground_truth_of(cell, column: str):
    """The ground truth a row's cell holds, as stored (``column`` from
    :func:`ground_truth_column`); None where a ``reward_model`` cell holds none."""
    if column == "ground_truth":
        return cell
    cell = _mapping(cell)
    return cell.get("ground_truth") if isinstance(cell, dict) else None


def chat_of(prompt) -> list[dict[str, str]] | None:
    """A ``prompt`` cell's messages as ``[{"role": ..., "content": ...}]``, as the loader reads
    them; None for a cell the loader refuses."""
    try:
        return [{"role": r, "content": c} for r, c in _messages_of(prompt, "")]
    except DatasetError:
        return None


def prompt_text(prompt) -> str:
    """The contents of a ``prompt`` cell's messages joined by newlines (what :func:`render_prompt`
    gives without a chat template), from every message that has a string content; "" when none
    has."""
    if isinstance(prompt, str):
        return prompt
    if hasattr(prompt, "tolist"):
        prompt = prompt.tolist()
    if not isinstance(prompt, (list, tuple)):
        return ""
    messages = (_mapping(m) for m in prompt)
    return "\n".join(m["content"] for m in messages
                     if isinstance(m, dict) and isinstance(m.get("content"), str))


# ---------------------------------------------------------------- rendering
def render_prompt(messages: Iterable[Mapping[str, str]] | Iterable[Message] | PromptRow,
                  tokenizer=None, tools: list[dict] | None = None) -> str:
    """Prompt text for the policy.

    With a tokenizer that has a chat template: ``apply_chat_template(..., tokenize=False,
    add_generation_prompt=True)``, showing the ``tools`` (their schemas: multi-turn rollouts)
    when given. Otherwise the message contents joined by newlines (the tiny model has no
    template, so ``[{"role": "user", "content": "12+7="}]`` renders as ``12+7=``).
    """
    if isinstance(messages, PromptRow):
        messages = messages.messages
    chat = [m if isinstance(m, Mapping) else {"role": m[0], "content": m[1]} for m in messages]
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        if tools:
            return tokenizer.apply_chat_template(chat, tools=tools, tokenize=False,
                                                 add_generation_prompt=True)
        return tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    return "\n".join(m["content"] for m in chat)
