"""Rule scorer for open-domain QA by exact match, as verl's ``default_compute_score`` scores the
Search-R1 data sources (``searchR1_nq``, ``_triviaqa``, ``_popqa``, ``_hotpotqa``,
``_2wikimultihopqa``, ``_musique``, ``_bamboogle``; verl's
``verl/utils/reward_score/search_r1_like_qa_em.py``, after Search-R1's ``qa_em.py``).

Held to verl's own outputs on a fixed table of cases (``tests/verl_core/reward/
search_r1_cases.json``, verl at b178a3c):

- Answer: the text inside the last ``<answer>...</answer>`` (across lines), stripped; none: 0.
- Equal when it matches one of the golden answers after SQuAD's normalisation (lower case,
  punctuation dropped, the articles a/an/the dropped as words, whitespace collapsed).
- Score 1.0 for a match, a quarter of it when the response holds more than 10 opening or closing
  answer tags (verl's guard against tag spam), else 0.0.

The ground truth is verl's mapping ``{"target": [answers]}`` (a list, an array from parquet, or
one string), or the answers themselves, or either as JSON text (how a dataset row's structured
ground truth reaches the scorers here).
"""

from __future__ import annotations

import json
import re
import string

__all__ = ["compute_score", "extract_answer", "normalize_answer"]

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation)
TAG_SPAM = 10
"""More answer tags than this (opening or closing) quarter a correct answer's score."""


def normalize_answer(text: str) -> str:
    """SQuAD's answer normalisation: lower case, no punctuation, no articles, single spaces."""
    return " ".join(_ARTICLES.sub(" ", text.lower().translate(_PUNCTUATION)).split())


def extract_answer(response: str) -> str | None:
    """The stripped text of the last ``<answer>...</answer>``, or None."""
    found = _ANSWER.findall(response)
    return found[-1].strip() if found else None


def _golden(ground_truth) -> list[str]:
    if isinstance(ground_truth, str) and ground_truth[:1] in "{[":
        try:  # a structured ground truth travels as its JSON text (data/dataset.py)
            ground_truth = json.loads(ground_truth)
        except json.JSONDecodeError:
            pass
    target = ground_truth.get("target") if isinstance(ground_truth, dict) else ground_truth
    if isinstance(target, str):
        return [target]
    return [str(t) for t in (target if target is not None else [])]


def compute_score(solution_str: str, ground_truth) -> float:
    """1.0 when the last ``<answer>`` matches a golden answer (0.25 with more than
    :data:`TAG_SPAM` answer tags), else 0.0."""
    text = solution_str or ""
    answer = extract_answer(text)
    if answer is None:
        return 0.0
    predicted = normalize_answer(answer)
    if not any(normalize_answer(g) == predicted for g in _golden(ground_truth)):
        return 0.0
    spam = max(text.count("<answer>"), text.count("</answer>")) > TAG_SPAM
    return 0.25 if spam else 1.0
