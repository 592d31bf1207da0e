"""Data validation with Great Expectations 1.x: the input dataset and every stored batch.

What belongs here: the expectation suites (built from the config: ``data.max_prompt_length``,
``rollout.max_new_tokens``, the scorer's declared score range, the columns the algorithm needs),
running them, the :class:`ValidationReport` (a JSON-able dict for the run store, an HTML table for
a Deck) and the failure policy ``validation.mode``. What does not: parsing the verl row layout
(``data/dataset.py`` refuses rows it cannot read before anything here runs), the training guard's
NaN policies (``guard/``), Decks (``tasks/``).

Suites, cumulative per stage (a stored batch of stage s passes every check of the stages before)::

    dataset    columns present, rows present, non-empty prompts, ground truth present,
               prompt_length <= data.max_prompt_length (data.truncation=error)
    rollout    columns present, prompt_length <= data.max_prompt_length,
               response_length <= rollout.max_new_tokens, every log-prob finite (rollout, ref),
               critic values / sum_pi_squared finite when the algorithm makes them
    reward     + score (and baseline_score) finite and within the declared score range
    advantage  + advantages and returns finite

A list column (one value per token) is checked through a per-row column derived from it
(``response_logprobs_nonfinite``: how many of the row's values are not finite), because
expectations are per row. A suite whose checks all pass on their column aggregates (max, min,
the columns present, the row count), computed in pandas, is reported without GX
(:func:`_passing`: the outcomes GX gives, tested equal): GX's import alone costs ~3.7 s of CPU in
every process, and every resumed run, pyflyte task and Ray worker is a new process. Anything else
runs in two passes, both Great Expectations: an aggregate expectation per column
(``expect_column_max_to_be_between``: one metric) decides; only a column that fails it is checked
row by row (``expect_column_values_to_be_between``, which names the offending rows, about twice
the cost). GX's cost is per check whatever the row count (its own per-expectation bookkeeping),
so ``validation.sample_rows`` helps only large batches (BENCHMARKS.md "Data validation").

GX is imported on first use only and its ephemeral context, pandas data source and batch
definition are made once per process (:func:`_gx`).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import html
import math
import os
import reprlib
import time
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np
import pandas as pd

from verl_core.errors import PermanentError
from verl_core.layout import report_doc

if TYPE_CHECKING:
    from verl_core.store import RunStore
    from verl_core.config import RunConfig
    from verl_core.data.batch import Batch

__all__ = ["STAGES", "DataValidationError", "DataValidationWarning", "ExpectationOutcome",
           "ValidationReport", "declared_score_range", "validate_dataset",
           "validate_dataset_files", "validate_batch", "validate_and_record",
           "read_reports", "report_html"]

STAGES = ("rollout", "reward", "advantage")
"""Batch stages, in order; each stage's suite contains the previous stages' checks."""
SAMPLE = 5
"""Offending rows named in a message and kept in a report, per failed expectation."""

_short = reprlib.Repr()
_short.maxstring = _short.maxother = 60


class DataValidationError(PermanentError, ValueError):
    """A data expectation failed with ``validation.mode="fail"``. The message names the column,
    the expectation and up to five offending rows; ``report`` holds the whole result."""

    def __init__(self, message: str, report: "ValidationReport"):
        super().__init__(message)
        self.report = report


class DataValidationWarning(UserWarning):
    """A data expectation failed with ``validation.mode="warn"``: the run goes on."""


# ---------------------------------------------------------------------- records
@dataclass(frozen=True)
class ExpectationOutcome:
    """One check of a suite, as run."""

    expectation: str
    """The GX expectation type that decided, e.g. ``expect_column_max_to_be_between``."""
    column: str
    """The dataset/batch column the check is about ("" for table-level checks)."""
    checked: str
    """The frame column GX checked (a per-row column derived from ``column``, or itself)."""
    description: str
    """What is expected, with the config field that sets the limit."""
    success: bool
    """Whether the expectation held."""
    observed: str
    """What GX observed (the column's max/min, the columns present), as text."""
    row_expectation: str = ""
    """On failure: the row-level GX expectation that named the offending rows."""
    unexpected: int = 0
    """On failure: how many of the checked rows violate it."""
    sample: tuple[str, ...] = ()
    """On failure: up to five offending rows, each described (row number, id, value)."""


@dataclass(frozen=True)
class ValidationReport:
    """The result of one suite on one dataset file or batch."""

    what: str
    """What was validated, e.g. ``reward batch of step 3`` or ``dataset /data/train.parquet``."""
    stage: str
    """``dataset``, ``rollout``, ``reward`` or ``advantage``."""
    step: int
    """The RL step of a batch; -1 for a dataset."""
    mode: str
    """``validation.mode`` it ran under (``fail`` or ``warn``)."""
    success: bool
    """Every expectation held."""
    rows: int
    """Rows in the dataset/batch."""
    rows_checked: int
    """Rows validated (< rows when ``validation.sample_rows`` drew a sample)."""
    seconds: float
    """Wall time of the validation (frame building + GX)."""
    results: tuple[ExpectationOutcome, ...]
    """One outcome per expectation, in suite order."""

    @property
    def failures(self) -> list[ExpectationOutcome]:
        return [r for r in self.results if not r.success]

    def to_dict(self) -> dict:
        """Plain JSON types only (no NaN: values are text), for ``RunStore.put_json``."""
        d = dataclasses.asdict(self)
        d["results"] = [{**r, "sample": list(r["sample"])} for r in d["results"]]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "ValidationReport":
        results = tuple(ExpectationOutcome(**{**r, "sample": tuple(r["sample"])})
                        for r in d["results"])
        return cls(**{**d, "results": results})

    def message(self) -> str:
        """The failures, one line each: column, expectation, offending rows."""
        lines = [f"{self.what}: {len(self.failures)} of {len(self.results)} data expectations "
                 f"failed ({self.rows_checked} of {self.rows} rows checked):"]
        for r in self.failures:
            where = f"column '{r.column}'" if r.column else "table"
            if r.checked and r.checked != r.column:
                where += f" (checked as {r.checked})"
            line = f"  - {where}: {r.row_expectation or r.expectation} ({r.description})"
            if r.row_expectation:
                line += f" failed on {r.unexpected} of {self.rows_checked} rows, e.g. "
                line += "; ".join(r.sample)
            else:
                line += f" failed: observed {r.observed}"
            lines.append(line)
        return "\n".join(lines)


@dataclass(frozen=True)
class _Check:
    """One check: ``min_value <= frame[checked] <= max_value`` on every row (a bound may be
    None), or, with ``columns``, the table has those columns."""

    column: str
    checked: str
    description: str
    min_value: float | None = None
    max_value: float | None = None
    columns: tuple[str, ...] = ()
    min_rows: int = 0


# ---------------------------------------------------------------------- GX, once per process
@functools.cache
def _gx():
    """(gx module, pandas batch definition), made once per process: the import takes seconds, the
    context and data source tens of milliseconds."""
    os.environ.setdefault("GX_ANALYTICS_ENABLED", "false")
    import great_expectations as gx
    from great_expectations.data_context.types.base import ProgressBarsConfig

    context = gx.get_context(mode="ephemeral")
    context.variables.progress_bars = ProgressBarsConfig(globally=False)  # no bar per validate
    asset = context.data_sources.add_pandas("verl_core").add_dataframe_asset("frame")
    return gx, asset.add_batch_definition_whole_dataframe("whole")


@functools.lru_cache(maxsize=64)
def _suites(checks: tuple[_Check, ...]):
    """The aggregate suite of ``checks`` (cached: suites are pure functions of the config and
    the columns present)."""
    gx, _ = _gx()
    E = gx.expectations
    name = hashlib.blake2b(repr(checks).encode(), digest_size=8).hexdigest()
    suite = gx.ExpectationSuite(name=f"verl-{name}")
    for c in checks:
        if c.columns:
            suite.add_expectation(E.ExpectTableColumnsToMatchSet(
                column_set=list(c.columns), exact_match=False, description=c.description))
            continue
        if c.min_rows:
            suite.add_expectation(E.ExpectTableRowCountToBeBetween(
                min_value=c.min_rows, description=c.description))
            continue
        if c.max_value is not None:
            suite.add_expectation(E.ExpectColumnMaxToBeBetween(
                column=c.checked, max_value=c.max_value, description=c.description))
        if c.min_value is not None:
            suite.add_expectation(E.ExpectColumnMinToBeBetween(
                column=c.checked, min_value=c.min_value, description=c.description))
    return suite


def _validate(frame: pd.DataFrame, suite, result_format: dict):
    _, batch_definition = _gx()
    batch = batch_definition.get_batch(batch_parameters={"dataframe": frame})
    return batch.validate(suite, result_format=result_format)


_MAX, _MIN = "expect_column_max_to_be_between", "expect_column_min_to_be_between"


def _passing(frame: pd.DataFrame, checks: tuple[_Check, ...]
             ) -> tuple[ExpectationOutcome, ...] | None:
    """The outcomes GX's aggregate pass gives ``checks`` when every one of them holds, computed
    with pandas; None when any fails or cannot be judged this way (an empty frame, a missing
    or non-numeric column, a NaN), and GX decides.

    Written by hand, beside GX, for the passing case only, because GX's import costs ~3.7 s of
    CPU in every process (a run resumed in a new process, each pyflyte task, each Ray worker
    pays it again) and its per-expectation bookkeeping ~2.5 ms a check (BENCHMARKS.md "Data
    validation"), against ~0.1 ms here. Every failure, and every report naming offending rows,
    is still GX's (:func:`_run`); ``tests/verl_core/test_validation.py`` checks that both give
    the same outcomes on passing frames."""
    if frame.empty:
        return None
    outcomes = []
    for c in checks:
        if c.columns:
            if not set(c.columns) <= set(frame.columns):
                return None
            outcomes.append(ExpectationOutcome("expect_table_columns_to_match_set", c.column,
                                               c.checked, c.description, True,
                                               str(sorted(frame.columns))))
            continue
        if c.min_rows:
            if len(frame) < c.min_rows:
                return None
            outcomes.append(ExpectationOutcome("expect_table_row_count_to_be_between",
                                               c.column, c.checked, c.description, True,
                                               str(len(frame))))
            continue
        values = frame.get(c.checked)
        if values is None or values.dtype.kind not in "iuf" or values.isna().any():
            return None
        kinds, observed = [], []
        for kind, bound, agg in ((_MAX, c.max_value, values.max), (_MIN, c.min_value, values.min)):
            if bound is None:
                continue
            v = agg()
            if not (v <= bound if kind == _MAX else v >= bound):
                return None
            kinds.append(kind)
            observed.append(str(v))
        outcomes.append(ExpectationOutcome(", ".join(kinds), c.column, c.checked, c.description,
                                           True, "; ".join(observed)))
    return tuple(outcomes)


def _run(frame: pd.DataFrame, checks: tuple[_Check, ...], describe: Callable[[str, int], str]
         ) -> tuple[ExpectationOutcome, ...]:
    """Run ``checks`` on ``frame``: all passing by their aggregates in pandas (:func:`_passing`),
    or else GX: aggregates first, row level only for what failed."""
    passing = _passing(frame, checks)
    return passing if passing is not None else _judge(frame, checks, describe)


def _judge(frame: pd.DataFrame, checks: tuple[_Check, ...], describe: Callable[[str, int], str]
           ) -> tuple[ExpectationOutcome, ...]:
    """``checks`` on ``frame`` in GX: aggregates first, row level only for what failed."""
    suite = _suites(checks)
    result = _validate(frame, suite, {"result_format": "BASIC", "partial_unexpected_count": 0})
    by_key = {}
    for r in result.results:
        cfg = r.expectation_config
        by_key.setdefault(cfg.kwargs.get("column", ""), []).append(r)
    outcomes = []
    for c in checks:
        mine = by_key.get("" if (c.columns or c.min_rows) else c.checked, [])
        if c.columns:
            mine = [r for r in mine if r.expectation_config.type.startswith("expect_table_col")]
        elif c.min_rows:
            mine = [r for r in mine if r.expectation_config.type.startswith("expect_table_row")]
        ok = all(r.success for r in mine) and bool(mine)
        observed = "; ".join(_observed(r) for r in mine)
        kind = ", ".join(r.expectation_config.type for r in mine)
        if ok or c.columns or c.min_rows:
            if not ok and c.columns:
                present = set(frame.columns)
                observed = f"missing {[x for x in c.columns if x not in present]}"
            outcomes.append(ExpectationOutcome(kind, c.column, c.checked, c.description, ok,
                                               observed))
            continue
        detail = _row_level(frame, c, describe)
        outcomes.append(ExpectationOutcome(kind, c.column, c.checked, c.description, False,
                                           observed, **detail))
    return tuple(outcomes)


def _observed(r) -> str:
    info = r.exception_info or {}
    if info.get("raised_exception"):
        return f"error: {info.get('exception_message')}"
    v = (r.result or {}).get("observed_value")
    return str(v)


def _row_level(frame: pd.DataFrame, c: _Check, describe) -> dict:
    """The row-level expectation on a failed column: how many rows, and the first few named."""
    gx, _ = _gx()
    suite = gx.ExpectationSuite(name="verl-row-level")
    suite.add_expectation(gx.expectations.ExpectColumnValuesToBeBetween(
        column=c.checked, min_value=c.min_value, max_value=c.max_value,
        description=c.description))
    checked = c.checked
    r = _validate(frame, suite, {"result_format": "SUMMARY",
                                 "partial_unexpected_count": SAMPLE}).results[0]
    res = r.result or {}
    rows = list(res.get("partial_unexpected_index_list") or [])[:SAMPLE]
    unexpected = int(res.get("unexpected_count") or 0)
    values = frame[checked]
    if not rows:  # NaN counts as missing for GX's between; show those rows instead
        rows = list(frame.index[values.isna()][:SAMPLE])
        unexpected = int(values.isna().sum()) + unexpected
    return {"row_expectation": r.expectation_config.type, "unexpected": unexpected,
            "sample": tuple(describe(checked, int(i)) for i in rows)}


def _finish(what: str, stage: str, step: int, cfg: "RunConfig", rows: int, checked_rows: int,
            t0: float, outcomes: tuple[ExpectationOutcome, ...]) -> ValidationReport:
    report = ValidationReport(what=what, stage=stage, step=step, mode=cfg.validation.mode,
                              success=all(o.success for o in outcomes), rows=rows,
                              rows_checked=checked_rows, seconds=time.perf_counter() - t0,
                              results=outcomes)
    if not report.success:
        text = report.message()
        failed = [o for o in outcomes if not o.success]
        if stage != "dataset" and cfg.guard.enabled and all(
                o.checked.endswith("_nonfinite") for o in failed):
            # Non-finite values in a batch are the training guard's: the update's `nonfinite`
            # detector skips, rolls back or halts by guard.nonfinite_policy before anything
            # reaches the weights, and logs the event. Stopping the phase here would pre-empt it.
            warnings.warn(f"{text}\n(left to the training guard: guard.nonfinite_policy="
                          f"{cfg.guard.nonfinite_policy!r})", DataValidationWarning, stacklevel=3)
            return report
        if cfg.validation.mode == "fail":
            raise DataValidationError(
                f"{text}\nFix whatever produced these rows, or set validation.mode='warn' to "
                "log failed expectations and go on.", report)
        warnings.warn(f"{text}\n(validation.mode='warn': continuing)", DataValidationWarning,
                      stacklevel=3)
    return report


# ---------------------------------------------------------------------- score range
def declared_score_range(cfg: "RunConfig", data_sources=None) -> tuple[float, float] | None:
    """The range every score must lie in, or None (finite only): ``validation.score_range``
    ``"lo,hi"`` if given; with ``auto``, the range the rule scorer(s) declare when registered
    (``reward/registry.py``; for ``reward.scorer=auto`` the union over the scorers
    ``data_sources`` route to, a batch's, else over all of them), and None for a custom scorer
    or a reward model (an unbounded logit), which declare none."""
    from verl_core.reward.registry import RULE_SCORE_RANGES, scorer_for

    v = cfg.validation
    if v.score_range == "any":
        return None
    if v.score_range != "auto":
        return v.score_bounds
    if cfg.reward_model.enable:  # a reward model's score (a logit) declares no range
        return None
    scorer = cfg.reward.scorer
    if scorer == "auto":
        routed = {scorer_for(ds) for ds in set(data_sources or ())} - {None}
        ranges = [RULE_SCORE_RANGES[n] for n in routed] if routed else \
            list(RULE_SCORE_RANGES.values())
        lo_hi = (min(lo for lo, _ in ranges), max(hi for _, hi in ranges)) if ranges else None
    else:
        lo_hi = RULE_SCORE_RANGES.get(scorer)
    if lo_hi is not None and cfg.reward.overlong_buffer_enable:  # DAPO's length penalty, >= -f
        lo_hi = (lo_hi[0] - cfg.reward.overlong_penalty_factor, lo_hi[1])
    return lo_hi


# ---------------------------------------------------------------------- dataset
def _ground_truths(df: pd.DataFrame) -> tuple[str, list]:
    """(the column the ground truth is named by, one value per row: None where absent)."""
    from verl_core.data.dataset import ground_truth_column, ground_truth_of

    column = ground_truth_column(df.columns)
    source = "ground_truth" if column == "ground_truth" else "reward_model"
    if source not in df.columns:
        return column, [None] * len(df)
    return column, [ground_truth_of(cell, column) for cell in df[source]]


def _gt_text(gt) -> str:
    if gt is None or (isinstance(gt, float) and not math.isfinite(gt)):
        return ""
    return str(gt).strip()


def dataset_frame(df: pd.DataFrame, tokenizer=None) -> tuple[pd.DataFrame, str]:
    """The frame the dataset suite checks: the file's columns plus ``prompt_chars`` (characters
    of the prompt's contents, stripped), ``ground_truth_chars`` and, with a tokenizer,
    ``prompt_length`` (tokens of the rendered prompt, as training encodes it). Also returns the
    name of the ground-truth column."""
    from verl_core.data.dataset import chat_of, prompt_text, render_prompt

    frame = df.copy()
    prompts = list(df["prompt"]) if "prompt" in df.columns else [None] * len(df)
    frame["prompt_chars"] = [len(prompt_text(p).strip()) for p in prompts]
    gt_column, gts = _ground_truths(df)
    frame["ground_truth_chars"] = [len(_gt_text(g)) for g in gts]
    if tokenizer is not None:
        texts = []
        for p in prompts:
            chat = chat_of(p)
            texts.append(render_prompt(chat, tokenizer) if chat else prompt_text(p))
        from verl_core.data.batch import prompt_add_special_tokens

        special = prompt_add_special_tokens(tokenizer)  # as encode_prompts: one BOS, not two
        enc = tokenizer(texts, add_special_tokens=special)["input_ids"] if texts else []
        frame["prompt_length"] = [len(ids) for ids in enc]
    return frame, gt_column


def _dataset_checks(cfg: "RunConfig", gt_column: str, has_lengths: bool,
                    flat_gt: bool) -> tuple[_Check, ...]:
    required = ("data_source", "prompt", "ground_truth" if flat_gt else "reward_model")
    checks = [
        _Check("", "", f"columns {list(required)} present (verl's row layout)",
               columns=required),
        _Check("", "", "at least one row", min_rows=1),
        _Check("prompt", "prompt_chars", "prompt has non-blank message content", min_value=1),
        _Check(gt_column, "ground_truth_chars", "ground truth present and non-empty",
               min_value=1),
    ]
    if has_lengths and cfg.data.truncation == "error":  # otherwise long prompts are cut
        checks.append(_Check("prompt", "prompt_length",
                             f"prompt tokens <= data.max_prompt_length="
                             f"{cfg.data.max_prompt_length}",
                             max_value=cfg.data.max_prompt_length))
    return tuple(checks)


def validate_dataset(df: pd.DataFrame, cfg: "RunConfig", *, tokenizer=None,
                     name: str = "dataset") -> ValidationReport | None:
    """Run the dataset suite on ``df`` (one parquet file in verl's row layout, as pandas).

    Prompt lengths are checked when a ``tokenizer`` is given. ``validation.mode``: ``fail``
    raises :class:`DataValidationError`, ``warn`` warns (:class:`DataValidationWarning`) and
    returns the report, ``off`` returns None without importing anything."""
    if cfg.validation.mode == "off":
        return None
    from verl_core.data.dataset import prompt_text

    t0 = time.perf_counter()
    frame, gt_column = dataset_frame(df, tokenizer)
    checks = _dataset_checks(cfg, gt_column, tokenizer is not None, gt_column == "ground_truth")
    gts = _ground_truths(df)[1]

    def describe(checked: str, i: int) -> str:
        pos = df.index.get_loc(i)
        if checked == "ground_truth_chars":
            return f"row {i} (0-based): {gt_column}={_short.repr(gts[pos])}"
        prompt = df["prompt"].iloc[pos] if "prompt" in df.columns else None
        text = _short.repr(prompt_text(prompt))
        if checked == "prompt_length":
            return f"row {i} (0-based): {int(frame[checked].iloc[pos])} tokens, prompt {text}"
        return f"row {i} (0-based): prompt {text}"

    outcomes = _run(frame, checks, describe)
    return _finish(name, "dataset", -1, cfg, len(df), len(df), t0, outcomes)


def validate_dataset_files(files: Sequence[str], cfg: "RunConfig", tokenizer=None,
                           storage_options: dict | None = None) -> list[ValidationReport]:
    """:func:`validate_dataset` on each parquet file (local paths or fsspec URIs), naming the
    file; for prepare, after ``load_checked_rows`` parsed them and checked their prompt lengths
    (so prepare passes no ``tokenizer``), before any model work."""
    if cfg.validation.mode == "off":
        return []
    import fsspec
    import pyarrow.parquet as pq

    from verl_core.store import resolve_storage_options

    reports = []
    for path in files:
        with fsspec.open(path, "rb", **resolve_storage_options(path, storage_options)) as f:
            df = pq.read_table(f).to_pandas()
        reports.append(validate_dataset(df, cfg, tokenizer=tokenizer, name=f"dataset {path}"))
    return reports


# ---------------------------------------------------------------------- batches
_TOKEN_FIELDS = ("response_logprobs", "ref_logprobs", "values", "sum_pi_squared", "advantages",
                 "returns", "teacher_logprobs")
_SCALAR_FIELDS = ("score", "baseline_score")


def _stage_columns(cfg: "RunConfig", stage: str) -> tuple[str, ...]:
    """The Batch fields a batch of ``stage`` must carry under ``cfg`` (beyond the always-present
    ids, masks and log-probs)."""
    algo = cfg.algorithm
    traits = algo.estimator_traits
    need = []
    if algo.uses_reference:
        need.append("ref_logprobs")
    if algo.uses_critic:
        need.append("values")
    if traits.needs_greedy_baseline:
        need.append("baseline_response_ids")
    if traits.needs_sum_pi_squared:
        need.append("sum_pi_squared")
    if algo.distills:
        need.append("teacher_logprobs")
    if stage in ("reward", "advantage"):
        need.append("score")
        if traits.needs_greedy_baseline:
            need.append("baseline_score")
    if stage == "advantage":
        need += ["advantages", "returns"]
    return tuple(need)


def sample_rows(n: int, cfg: "RunConfig", step: int, stage: str) -> np.ndarray:
    """Row numbers to validate: all ``n``, or ``validation.sample_rows`` of them drawn without
    replacement from a generator seeded by (run seed, step, stage), sorted. Deterministic, so a
    re-run validates the same rows."""
    k = cfg.validation.sample_rows
    if not k or k >= n:
        return np.arange(n)
    digest = hashlib.blake2b(f"{cfg.seed}:{step}:validate-{stage}".encode(), digest_size=8)
    rng = np.random.default_rng(int.from_bytes(digest.digest(), "little"))
    return np.sort(rng.choice(n, size=k, replace=False))


def batch_frame(batch: "Batch", rows: np.ndarray) -> pd.DataFrame:
    """One row per response (index: the row number in the batch): ``uid``, ``prompt_length``,
    ``response_length``, ``<field>_nonfinite`` (non-finite values among the row's tokens) for
    every token field present, and each scalar field present with its ``<field>_nonfinite``.
    Built from the tensors (vectorised), not from the parquet lists."""
    import torch

    idx = torch.as_tensor(rows, dtype=torch.long)
    mask = batch.response_attn[idx] > 0  # (n, T): every real token (multi-turn: tools' too)
    cols: dict[str, Any] = {
        "uid": [batch.uid[i] for i in rows.tolist()],
        "prompt_length": batch.prompt_mask[idx].sum(-1).numpy(),
        "response_length": mask.sum(-1).numpy(),
    }
    if batch.baseline_response_mask is not None:
        cols["baseline_response_length"] = (batch.baseline_response_mask[idx] > 0).sum(-1).numpy()
    for name in _TOKEN_FIELDS:
        v = getattr(batch, name)
        if v is not None:
            cols[f"{name}_nonfinite"] = (~torch.isfinite(v[idx]) & mask).sum(-1).numpy()
    for name in _SCALAR_FIELDS:
        v = getattr(batch, name)
        if v is not None:
            x = v[idx].double().numpy()
            cols[name] = x
            cols[f"{name}_nonfinite"] = (~np.isfinite(x)).astype(np.int64)
    # unnamed: GX then lists offending rows by index label (a named index gives dicts)
    return pd.DataFrame(cols, index=pd.Index(rows))


def _batch_checks(cfg: "RunConfig", stage: str, frame_columns: set[str],
                  data_sources=()) -> tuple[_Check, ...]:
    need = _stage_columns(cfg, stage)
    as_frame = {"baseline_response_ids": "baseline_response_length"}
    required = tuple(as_frame.get(n, f"{n}_nonfinite" if n in _TOKEN_FIELDS else n) for n in need)
    checks = [_Check("", "", f"columns {list(need)} present ({stage} batch under this config)",
                     columns=("uid", "prompt_length", "response_length",
                              "response_logprobs_nonfinite") + required)]
    P, T = cfg.data.max_prompt_length, cfg.rollout.max_new_tokens
    checks.append(_Check("prompt_ids", "prompt_length",
                         f"prompt tokens <= data.max_prompt_length={P}", max_value=P))
    checks.append(_Check("response_ids", "response_length",
                         f"response tokens <= rollout.max_new_tokens={T}", max_value=T))
    if "baseline_response_length" in frame_columns:
        checks.append(_Check("baseline_response_ids", "baseline_response_length",
                             f"greedy baseline tokens <= rollout.max_new_tokens={T}", max_value=T))
    stage_fields = {"rollout": ("response_logprobs", "ref_logprobs", "values", "sum_pi_squared",
                                "teacher_logprobs"),
                    "reward": ("score", "baseline_score"), "advantage": ("advantages", "returns")}
    lo_hi = declared_score_range(cfg, data_sources)
    for s in STAGES[:STAGES.index(stage) + 1]:
        for name in stage_fields[s]:
            if f"{name}_nonfinite" not in frame_columns:
                continue
            what = "token value" if name in _TOKEN_FIELDS else "value"
            checks.append(_Check(name, f"{name}_nonfinite", f"every {what} finite (count of "
                                 "non-finite per row is 0)", max_value=0))
            if name in _SCALAR_FIELDS and lo_hi is not None:
                checks.append(_Check(name, name, f"within the declared score range "
                                     f"[{lo_hi[0]:g}, {lo_hi[1]:g}] (validation.score_range="
                                     f"{cfg.validation.score_range!r}, reward.scorer="
                                     f"{cfg.reward.scorer!r})",
                                     min_value=lo_hi[0], max_value=lo_hi[1]))
    return tuple(checks)


def validate_batch(batch: "Batch", stage: str, cfg: "RunConfig", *,
                   step: int | None = None) -> ValidationReport | None:
    """Run ``stage``'s suite (``rollout``, ``reward`` or ``advantage``) on ``batch``, on every
    row or on ``validation.sample_rows`` rows drawn per (run seed, step, stage).

    ``fail`` raises :class:`DataValidationError` naming column, expectation and rows; ``warn``
    warns and returns the report; ``off`` returns None without importing anything."""
    if stage not in STAGES:
        raise ValueError(f"stage={stage!r}: unknown; known: {', '.join(STAGES)}")
    if cfg.validation.mode == "off":
        return None
    step = int(batch.meta.get("step", -1)) if step is None else step
    if step >= 0 and step % cfg.validation.every_steps:
        return None  # validation.every_steps: this step's batches are not validated
    t0 = time.perf_counter()
    rows = sample_rows(batch.num_rows, cfg, step, stage)
    frame = batch_frame(batch, rows)
    checks = _batch_checks(cfg, stage, set(frame.columns), tuple(sorted(set(batch.data_source))))

    def describe(checked: str, i: int) -> str:
        head = f"row {i} (uid {batch.uid[i]!r})"
        field = checked[:-len("_nonfinite")] if checked.endswith("_nonfinite") else ""
        if field in _TOKEN_FIELDS:
            v = getattr(batch, field)[i]
            m = batch.response_attn[i] > 0
            bad = (~v.isfinite() & m).nonzero().flatten().tolist()
            return f"{head}: {v[bad[0]].item()} at token {bad[0]}" + \
                (f" (+{len(bad) - 1} more)" if len(bad) > 1 else "")
        if field in _SCALAR_FIELDS:
            return f"{head}: {field}={getattr(batch, field)[i].item()}"
        return f"{head}: {checked}={frame.at[i, checked]}"

    outcomes = _run(frame, checks, describe)
    return _finish(f"{stage} batch of step {step}", stage, step, cfg, batch.num_rows, len(rows),
                   t0, outcomes)


# ---------------------------------------------------------------------- the run store
def validate_and_record(store: "RunStore", config_hash: str, step: int, stage: str,
                        batch: "Batch", cfg: "RunConfig") -> ValidationReport | None:
    """:func:`validate_batch`, with the report written to the run store (:func:`report_doc`),
    a failed one too, before the error propagates, so a Deck can show what failed."""
    try:
        report = validate_batch(batch, stage, cfg, step=step)
    except DataValidationError as e:
        store.put_json(report_doc(config_hash, step, stage), e.report.to_dict())
        raise
    if report is not None:
        store.put_json(report_doc(config_hash, step, stage), report.to_dict())
    return report


def read_reports(store: "RunStore", config_hash: str, step: int) -> list[dict]:
    """The stored reports of ``step``, in stage order (absent ones skipped)."""
    docs = (store.get_json(report_doc(config_hash, step, s), default=None) for s in STAGES)
    return [d for d in docs if d is not None]


# ---------------------------------------------------------------------- Deck
def report_html(report: ValidationReport | dict) -> str:
    """A small self-contained HTML table of a report (or its dict) for a Flyte Deck."""
    r = report if isinstance(report, ValidationReport) else ValidationReport.from_dict(report)
    e = html.escape
    status = "passed" if r.success else "FAILED"
    head = (f"<h4>{e(r.what)}: {status}</h4><p>{len(r.results)} expectations, "
            f"{r.rows_checked} of {r.rows} rows checked, {r.seconds * 1000:.1f} ms, "
            f"mode {e(r.mode)}</p>")
    rows = []
    for o in r.results:
        color = "#e6ffe6" if o.success else "#ffe6e6"
        found = e(o.observed) if o.success or not o.row_expectation else \
            f"{o.unexpected} rows: " + "<br>".join(e(s) for s in o.sample)
        rows.append(f'<tr style="background:{color}"><td>{"ok" if o.success else "FAIL"}</td>'
                    f"<td>{e(o.column or '(table)')}</td><td>{e(o.description)}</td>"
                    f"<td><code>{e(o.row_expectation or o.expectation)}</code></td>"
                    f"<td>{found}</td></tr>")
    return (head + '<table border="1" cellpadding="3" style="border-collapse:collapse">'
            "<tr><th></th><th>column</th><th>expected</th><th>expectation</th>"
            "<th>observed</th></tr>" + "".join(rows) + "</table>")


# ---------------------------------------------------------------------- prepare checks
class RunInputError(PermanentError, ValueError):
    """A run's inputs cannot work together (a batch larger than the dataset, a data_source no
    scorer knows): found at prepare, before the warm start, naming the file and the fix."""


def check_run_inputs(cfg: "RunConfig", storage_options: dict | None = None) -> None:
    """Every permanent check that needs no model and no rollout, before any work (prepare):
    ``VERL_FAULTS``, the model and reward-model folders (headers only, nothing unpickled),
    ``data.train_batch_size`` against the training rows, and with ``reward.scorer=auto`` every
    data_source against the rule-scorer registry. Each used to surface in a worker, after the
    warm start, where a transient-looking failure was retried. Reads parquet footers and the
    ``data_source`` column only. Raises a :class:`~verl_core.errors.PermanentError`."""
    from verl_core.guard.faults import check_faults
    from verl_core.models import check_model_folder

    check_faults()
    if cfg.model.path:
        check_model_folder(cfg.model.path, "model.path")
        check_sequence_fits(cfg)
        if cfg.model.override_config:
            from verl_core.models.loading import check_config_overrides

            check_config_overrides(cfg.model.path, cfg.model.config_overrides)
    if cfg.rollout.engine == "vllm":
        check_vllm_head_size(cfg)
    if cfg.reward_model.enable:
        check_model_folder(cfg.reward_model.path, "reward_model.path")
        if cfg.reward_model.style == "generative":  # a causal LM, a template that fills
            from verl_core.reward.judge import check_judge

            check_judge(cfg.reward_model.path, cfg.reward_model.prompt_template)
    train, val = _train_val_sources(cfg, storage_options)
    batches_per_epoch(cfg, train)
    if cfg.reward.scorer == "auto":
        rm = cfg.reward_model
        scored = {**(train if not (rm.enable and rm.combine == "replace") else {}), **val}
        _check_data_sources(scored)


def _train_val_sources(cfg: "RunConfig", storage_options: dict | None = None
                       ) -> tuple[dict[str, tuple], dict[str, tuple]]:
    """``{file: (rows, data_source values)}`` of the training and held-out files; the synthetic
    task's are known without generating it."""
    if cfg.data.train_files:
        return (_data_sources(cfg.data.train_file_list, storage_options),
                _data_sources(cfg.data.val_file_list, storage_options))
    from verl_core.data.synthetic import DATA_SOURCE

    task = {"the synthetic task": (cfg.data.synthetic_train_size, {DATA_SOURCE})}
    return task, task


def batches_per_epoch(cfg: "RunConfig", train: dict[str, tuple] | None = None,
                      storage_options: dict | None = None) -> int:
    """Full batches of ``data.train_batch_size`` prompts in one pass over the training rows
    (the last partial batch is dropped, as verl's train dataloader does): what verl's
    ``trainer.total_epochs`` multiplies. The one check of the batch against the dataset's size,
    for both front doors: RunInputError when not one batch fits. Reads parquet footers only
    (``train``: the sources already read)."""
    if train is None:
        train, _ = _train_val_sources(cfg, storage_options)
    rows = sum(n for n, _ in train.values())
    if cfg.data.train_files:
        what = f"the {rows} rows of data.train_files"
    else:
        what = f"the synthetic task's {rows} training rows (data.synthetic_train_size)"
    if cfg.data.train_batch_size > rows:
        raise RunInputError(
            f"data.train_batch_size={cfg.data.train_batch_size} is larger than {what}: every "
            "batch would be dropped; use a smaller --batch-size (data.train_batch_size) or more "
            "prompts")
    return rows // cfg.data.train_batch_size


def check_sequence_fits(cfg: "RunConfig") -> None:
    """A prompt of ``data.max_prompt_length`` tokens plus ``rollout.max_new_tokens`` must fit the
    model's ``max_position_embeddings`` (config.json): vLLM refuses a longer ``max_model_len``
    (as in verl, which sets it to prompt + response length), and the hf engine would run past
    the positions the model was trained on. Refused at prepare, naming both fields."""
    import json
    import types

    from verl_core.reward.model import max_positions

    with open(os.path.join(cfg.model.path, "config.json")) as f:  # parsed by check_model_folder
        limit = max_positions(types.SimpleNamespace(**json.load(f)))
    need = cfg.data.max_prompt_length + cfg.rollout.max_new_tokens
    if limit is not None and need > limit:
        raise RunInputError(
            f"data.max_prompt_length={cfg.data.max_prompt_length} + rollout.max_new_tokens="
            f"{cfg.rollout.max_new_tokens} = {need} tokens do not fit model.path="
            f"{cfg.model.path!r}: its max_position_embeddings is {limit} (config.json); lower "
            "one of them (verl's data.max_prompt_length / data.max_response_length)")


def check_vllm_head_size(cfg: "RunConfig") -> None:
    """With ``rollout.engine=vllm`` on vLLM's CPU backend, refuse a model whose attention head
    size its kernel cannot run (it takes 32, 64, 80 and up; vLLM itself would fail only once
    the engine is built, in a worker, after the warm start), naming the ``model.*`` keys and the
    sizes that work. Nothing to check where vLLM is not installed (the engine, when built,
    names the install) or where it is vLLM's CUDA build (its backend is chosen per GPU)."""
    from verl_core.rollout.vllm import head_size, supported_head_sizes

    sizes = supported_head_sizes()
    if sizes is None:
        return
    m = cfg.model
    if m.path:
        import transformers

        size = head_size(transformers.AutoConfig.from_pretrained(m.path))
        if size in sizes:
            return
        raise RunInputError(
            f"model.path={m.path!r} has attention head size {size} (config.json head_dim, or "
            f"hidden_size / num_attention_heads), which vLLM's CPU attention kernel cannot run "
            f"(it runs {', '.join(map(str, sizes))}); use rollout.engine='hf' for this model, or "
            "a model with one of those head sizes")
    size = m.tiny_hidden_size // m.tiny_heads
    if size in sizes:
        return
    heads = [m.tiny_hidden_size // s for s in sizes if m.tiny_hidden_size % s == 0]
    fix = (f"set model.tiny_heads to {' or '.join(map(str, heads))}" if heads else
           "set model.tiny_hidden_size to a multiple of one of those sizes")
    raise RunInputError(
        f"the tiny model's attention head size is {size} (model.tiny_hidden_size="
        f"{m.tiny_hidden_size} / model.tiny_heads={m.tiny_heads}), which vLLM's CPU attention "
        f"kernel cannot run (it runs {', '.join(map(str, sizes))}); {fix}, or use "
        "rollout.engine='hf'")


def _data_sources(files: Sequence[str], storage_options: dict | None) -> dict[str, tuple]:
    """``{file: (rows, data_source values)}`` from each parquet file's footer and its
    data_source column (a file without one is left to the dataset suite)."""
    import fsspec
    import pyarrow.parquet as pq

    from verl_core.data.dataset import check_columns
    from verl_core.store import resolve_storage_options

    out = {}
    for path in files:
        with fsspec.open(path, "rb", **resolve_storage_options(path, storage_options)) as f:
            pf = pq.ParquetFile(f)
            # a file that is not in verl's layout is named for its columns, not for its size
            check_columns(pf.schema_arrow.names, path)
            sources: set = set()
            if "data_source" in pf.schema_arrow.names:
                sources = set(pf.read(columns=["data_source"]).column(0).unique().to_pylist())
            out[path] = (pf.metadata.num_rows, sources)
    return out


def _check_data_sources(files: dict[str, tuple]) -> None:
    from verl_core.reward.registry import known_data_sources, scorer_for, why_not_scored

    for path, (_, sources) in files.items():
        unknown = sorted(str(s) for s in sources if scorer_for(s) is None)
        if unknown:
            raise RunInputError(
                f"{path}: data_source {', '.join(map(why_not_scored, unknown[:5]))} has no "
                "rule scorer "
                f"(reward.scorer=auto knows {known_data_sources()}); set "
                "reward.scorer to a rule scorer's name or to a custom 'path/to/file.py:function' "
                "with the signature fn(data_source, solution_str, ground_truth, extra_info)")


CLIPPED_WARN_FRACTION = 0.5
"""A step where more than this share of responses hit ``rollout.max_new_tokens`` warns."""


def clipped_responses_warning(metrics: dict, cfg: "RunConfig", step: int) -> str | None:
    """The warning for a step whose responses mostly hit the length limit (verl's
    ``response_length/clip_ratio``), or None: cut responses lose their final answer, so every
    such reward is 0 and nothing trains, which the reward alone does not say."""
    ratio = metrics.get("response_length/clip_ratio")
    if ratio is None or ratio <= CLIPPED_WARN_FRACTION:
        return None
    return (f"warning: step {step}: {ratio:.0%} of the responses hit rollout.max_new_tokens="
            f"{cfg.rollout.max_new_tokens} (response_length/clip_ratio); they are cut before "
            "their answer: raise rollout.max_new_tokens (verl's data.max_response_length)")
