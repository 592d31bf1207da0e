"""Rule scorers by name and by data_source, with verl's ``default_compute_score`` signature.

Every entry takes ``(solution_str, ground_truth)`` and returns a float. A scorer registered with
``runs_code=True`` (``code``) runs the response in a sandbox process: it also takes
``sandbox=`` (the run's :class:`~verl_core.reward.sandbox.Sandbox`, its limits and pool), and the
reward manager runs its calls concurrently, at most ``reward.sandbox_max_concurrent`` at once.
``reward.scorer=auto`` dispatches on each row's ``data_source``; ``reward.scorer=arithmetic`` /
``gsm8k`` applies one scorer to every row. Anything else is a custom scorer (``custom.py``, run
by ``manager.py``).
"""

from __future__ import annotations

from typing import Callable

from verl_core.reward import (arithmetic, calculator, code, gsm8k, guess, math_answer,
                              math_dapo, prime_math, qa_em)

__all__ = ["RULE_SCORERS", "DATA_SOURCE_SCORERS", "DATA_SOURCE_PREFIXES", "RULE_SCORE_RANGES",
           "RUNS_CODE", "GROUND_TRUTH_CHECKS", "READS_EXTRA_INFO", "call_rule_scorer",
           "register_rule_scorer", "scorer_for", "known_data_sources", "default_compute_score",
           "UnknownDataSourceError", "NOT_SCORED_HERE", "why_not_scored"]

RuleScorer = Callable[[str, str], float]  # (solution_str, ground_truth) -> score

RULE_SCORERS: dict[str, RuleScorer] = {}
"""Scorer name (a value of ``reward.scorer``) -> rule scorer."""
DATA_SOURCE_SCORERS: dict[str, str] = {}
"""data_source -> scorer name, used by ``auto``."""
DATA_SOURCE_PREFIXES: dict[str, str] = {}
"""data_source prefix -> scorer name, for sources not named exactly (verl routes every
``aime*`` source to math_dapo)."""
RULE_SCORE_RANGES: dict[str, tuple[float, float]] = {}
"""Scorer name -> the closed range ``(lo, hi)`` its scores lie in (checked by data validation)."""
RUNS_CODE: set[str] = set()
"""Scorers whose calls run the response in a sandbox process (``sandbox=`` keyword, called
concurrently by the reward manager)."""
READS_EXTRA_INFO: set[str] = set()
"""Scorers called with the row's ``extra_info`` as a third argument (a multi-turn row's
``turn_scores``, ``tool_rewards``: the guessing game's scorer)."""
GROUND_TRUTH_CHECKS: dict[str, Callable[[str], object]] = {}
"""Scorer name -> a check that raises ValueError (naming the fix) on a ground truth the scorer
cannot use; run on every row when the run is prepared, before any work."""


class UnknownDataSourceError(ValueError):
    """``auto`` scoring met a data_source with no rule scorer."""


def register_rule_scorer(name: str, fn: RuleScorer, data_sources: tuple[str, ...] = (),
                         score_range: tuple[float, float] | None = None,
                         data_source_prefixes: tuple[str, ...] = (),
                         runs_code: bool = False,
                         check_ground_truth: Callable[[str], object] | None = None,
                         reads_extra_info: bool = False) -> None:
    """Register ``fn`` under ``name`` and route ``data_sources`` (and every source starting with
    one of ``data_source_prefixes``) to it. Names are unique, and every rule scorer declares the
    ``score_range`` (lo, hi) its scores lie in. ``runs_code``: see the module docstring;
    ``check_ground_truth``: :data:`GROUND_TRUTH_CHECKS`."""
    if name in RULE_SCORERS or name == "auto":
        raise ValueError(f"rule scorer {name!r} is already registered")
    taken = [ds for ds in data_sources if ds in DATA_SOURCE_SCORERS] + \
        [p + "*" for p in data_source_prefixes if p in DATA_SOURCE_PREFIXES]
    if taken:
        raise ValueError(f"data_source(s) {taken} already routed to "
                         f"{[DATA_SOURCE_SCORERS[d] for d in taken]}")
    if score_range is None or not score_range[0] <= score_range[1]:
        raise ValueError(f"rule scorer {name!r}: declare score_range=(lo, hi), lo <= hi, the "
                         f"range its scores lie in (got {score_range!r})")
    RULE_SCORE_RANGES[name] = (float(score_range[0]), float(score_range[1]))
    RULE_SCORERS[name] = fn
    if runs_code:
        RUNS_CODE.add(name)
    if reads_extra_info:
        READS_EXTRA_INFO.add(name)
    if check_ground_truth is not None:
        GROUND_TRUTH_CHECKS[name] = check_ground_truth
    for ds in data_sources:
        DATA_SOURCE_SCORERS[ds] = name
    for p in data_source_prefixes:
        DATA_SOURCE_PREFIXES[p] = name


def scorer_for(data_source: str) -> str | None:
    """The rule scorer ``auto`` gives ``data_source``: its exact entry, else its prefix's."""
    name = DATA_SOURCE_SCORERS.get(data_source)
    if name is None:
        name = next((n for p, n in DATA_SOURCE_PREFIXES.items()
                     if str(data_source).startswith(p)), None)
    return name


NOT_SCORED_HERE: dict[str, str] = {
    "hiyouga/geometry3k": "a vision-language task (its prompts carry images); this project "
                          "trains text-only models",
}
"""data_source -> why ``auto`` does not score it, for the sources verl's
``default_compute_score`` routes (at b178a3c) that have no scorer here."""


def why_not_scored(data_source: str) -> str:
    """One line for a data source ``auto`` cannot score: verl's reason where verl routes it."""
    reason = NOT_SCORED_HERE.get(str(data_source))
    return f"{data_source!r}: {reason}" if reason else repr(data_source)


def known_data_sources() -> str:
    """The data sources ``auto`` scores, for messages (prefixes as ``aime*``)."""
    return ", ".join(sorted(DATA_SOURCE_SCORERS) + sorted(p + "*" for p in DATA_SOURCE_PREFIXES))


register_rule_scorer("arithmetic", arithmetic.compute_score, ("synthetic/arithmetic",),
                     score_range=(0.0, 1.0))  # 1 for the exact answer, else 0
register_rule_scorer("calculator", calculator.compute_score, ("synthetic/calculator",),
                     score_range=(0.0, 1.0))  # 1 for the exact last line, else 0
register_rule_scorer("guess", guess.compute_score, ("synthetic/guess",),
                     score_range=(0.0, 1.0), reads_extra_info=True)  # 1 when the user said so
register_rule_scorer("gsm8k", gsm8k.compute_score, ("openai/gsm8k", "gsm8k"),
                     score_range=(0.0, 1.0))  # registered with score=1, format_score=0
# verl's default_compute_score routes (verl/utils/reward_score/__init__.py at b178a3c)
register_rule_scorer("math", math_answer.compute_score,
                     ("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval",
                      "HuggingFaceH4/MATH-500"), score_range=(0.0, 1.0))
register_rule_scorer("math_dapo", math_dapo.compute_score,
                     ("math_dapo", "math", "math_dapo_reasoning"), score_range=(-1.0, 1.0),
                     data_source_prefixes=("aime",))  # +1 correct, -1 otherwise
register_rule_scorer("prime_math", prime_math.compute_score, prime_math.DATA_SOURCES,
                     score_range=(0.0, 1.0))  # PRIME's NuminaMath sources: 1 correct, else 0
register_rule_scorer("qa_em", qa_em.compute_score,
                     tuple(f"searchR1_{s}" for s in ("nq", "triviaqa", "popqa", "hotpotqa",
                                                      "2wikimultihopqa", "musique", "bamboogle")),
                     score_range=(0.0, 1.0))  # 1 exact match (0.25 with answer-tag spam), else 0
# verl's code sources (prime_code / sandbox_fusion, continuous=True) and the project's code task
register_rule_scorer("code", code.compute_score, (code.DATA_SOURCE, *code.VERL_DATA_SOURCES),
                     score_range=(0.0, 1.0), runs_code=True,  # the fraction of tests passed
                     check_ground_truth=code.parse_tests)


def default_compute_score(data_source: str, solution_str: str, ground_truth: str,
                          extra_info: dict | None = None) -> float:
    """Score one response with the rule scorer registered for its ``data_source``."""
    name = scorer_for(data_source)
    if name is None:
        raise UnknownDataSourceError(
            f"no rule scorer for data_source={why_not_scored(data_source)}; known data sources: "
            f"{known_data_sources()}. For other tasks set reward.scorer to a "
            "custom 'path/to/file.py:function' or 'package.module:function' with the signature "
            "fn(data_source, solution_str, ground_truth, extra_info) -> float | dict")
    return call_rule_scorer(name, solution_str, ground_truth, extra_info)


def call_rule_scorer(name: str, solution_str: str, ground_truth: str,
                     extra_info: dict | None = None) -> float:
    """The rule scorer ``name``'s score (with ``extra_info`` for those that read it)."""
    if name in READS_EXTRA_INFO:
        return float(RULE_SCORERS[name](solution_str, ground_truth, extra_info or {}))
    return float(RULE_SCORERS[name](solution_str, ground_truth))
