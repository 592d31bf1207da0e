"""Rule scorers by name and by data_source, with verl's ``default_compute_score`` signature.

Every entry takes ``(solution_str, ground_truth)`` and returns a float. ``reward.scorer=auto``
dispatches on each row's ``data_source``; ``reward.scorer=arithmetic`` / ``gsm8k`` applies one
scorer to every row. Anything else is a custom scorer (``custom.py``, run by ``manager.py``).
"""

from __future__ import annotations

from typing import Callable

from verl_core.reward import arithmetic, calculator, gsm8k

__all__ = ["RULE_SCORERS", "DATA_SOURCE_SCORERS", "RULE_SCORE_RANGES", "register_rule_scorer",
           "default_compute_score", "UnknownDataSourceError"]

RuleScorer = Callable[[str, str], float]  # (solution_str, ground_truth) -> score

RULE_SCORERS: dict[str, RuleScorer] = {}
"""Scorer name (a value of ``reward.scorer``) -> rule scorer."""
DATA_SOURCE_SCORERS: dict[str, str] = {}
"""data_source -> scorer name, used by ``auto``."""
RULE_SCORE_RANGES: dict[str, tuple[float, float]] = {}
"""Scorer name -> the closed range ``(lo, hi)`` its scores lie in (checked by data validation)."""


class UnknownDataSourceError(ValueError):
    """``auto`` scoring met a data_source with no rule scorer."""


def register_rule_scorer(name: str, fn: RuleScorer, data_sources: tuple[str, ...] = (),
                         score_range: tuple[float, float] | None = None) -> None:
    """Register ``fn`` under ``name`` and route ``data_sources`` to it. Names are unique, and
    every rule scorer declares the ``score_range`` (lo, hi) its scores lie in."""
    if name in RULE_SCORERS or name == "auto":
        raise ValueError(f"rule scorer {name!r} is already registered")
    taken = [ds for ds in data_sources if ds in DATA_SOURCE_SCORERS]
    if taken:
        raise ValueError(f"data_source(s) {taken} already routed to "
                         f"{[DATA_SOURCE_SCORERS[d] for d in taken]}")
    if score_range is None or not score_range[0] <= score_range[1]:
        raise ValueError(f"rule scorer {name!r}: declare score_range=(lo, hi), lo <= hi, the "
                         f"range its scores lie in (got {score_range!r})")
    RULE_SCORE_RANGES[name] = (float(score_range[0]), float(score_range[1]))
    RULE_SCORERS[name] = fn
    for ds in data_sources:
        DATA_SOURCE_SCORERS[ds] = name


register_rule_scorer("arithmetic", arithmetic.compute_score, ("synthetic/arithmetic",),
                     score_range=(0.0, 1.0))  # 1 for the exact answer, else 0
register_rule_scorer("calculator", calculator.compute_score, ("synthetic/calculator",),
                     score_range=(0.0, 1.0))  # 1 for the exact last line, else 0
register_rule_scorer("gsm8k", gsm8k.compute_score, ("openai/gsm8k", "gsm8k"),
                     score_range=(0.0, 1.0))  # registered with score=1, format_score=0


def default_compute_score(data_source: str, solution_str: str, ground_truth: str,
                          extra_info: dict | None = None) -> float:
    """Score one response with the rule scorer registered for its ``data_source``."""
    try:
        name = DATA_SOURCE_SCORERS[data_source]
    except KeyError:
        raise UnknownDataSourceError(
            f"no rule scorer for data_source={data_source!r}; known data sources: "
            f"{', '.join(sorted(DATA_SOURCE_SCORERS))}. For other tasks set reward.scorer to a "
            "custom 'path/to/file.py:function' or 'package.module:function' with the signature "
            "fn(data_source, solution_str, ground_truth, extra_info) -> float | dict") from None
    return float(RULE_SCORERS[name](solution_str, ground_truth))
