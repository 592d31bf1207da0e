"""Rule scorers by name and by data_source, with verl's ``default_compute_score`` signature.

Every entry takes ``(solution_str, ground_truth)`` and returns a float. ``reward.scorer=auto``
dispatches on each row's ``data_source``; ``reward.scorer=arithmetic`` / ``gsm8k`` applies one
scorer to every row. Anything else is a custom scorer (``custom.py``, run by ``manager.py``).
"""

from __future__ import annotations

from typing import Callable

from verl_core.reward import arithmetic, gsm8k

__all__ = ["RULE_SCORERS", "DATA_SOURCE_SCORERS", "register_rule_scorer", "default_compute_score",
           "UnknownDataSourceError"]

RuleScorer = Callable[[str, str], float]  # (solution_str, ground_truth) -> score

RULE_SCORERS: dict[str, RuleScorer] = {}
"""Scorer name (a value of ``reward.scorer``) -> rule scorer."""
DATA_SOURCE_SCORERS: dict[str, str] = {}
"""data_source -> scorer name, used by ``auto``."""


class UnknownDataSourceError(ValueError):
    """``auto`` scoring met a data_source with no rule scorer."""


def register_rule_scorer(name: str, fn: RuleScorer, data_sources: tuple[str, ...] = ()) -> None:
    """Register ``fn`` under ``name`` and route ``data_sources`` to it. Names are unique."""
    if name in RULE_SCORERS or name == "auto":
        raise ValueError(f"rule scorer {name!r} is already registered")
    taken = [ds for ds in data_sources if ds in DATA_SOURCE_SCORERS]
    if taken:
        raise ValueError(f"data_source(s) {taken} already routed to "
                         f"{[DATA_SOURCE_SCORERS[d] for d in taken]}")
    RULE_SCORERS[name] = fn
    for ds in data_sources:
        DATA_SOURCE_SCORERS[ds] = name


register_rule_scorer("arithmetic", arithmetic.compute_score, ("synthetic/arithmetic",))
register_rule_scorer("gsm8k", gsm8k.compute_score, ("openai/gsm8k", "gsm8k"))


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
