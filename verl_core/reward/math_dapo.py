"""Rule scorer of DAPO's math data (``data_source`` ``math_dapo``, ``math``,
``math_dapo_reasoning`` and any that starts with ``aime``), as verl's ``default_compute_score``
scores them (``verl/utils/reward_score/math_dapo.py``): the answer after the last
``Answer:`` in the response's last 300 characters, normalised as in Minerva (Lewkowycz et al.
2022, appendix D.1), against the normalised ground truth.

Held to verl's own outputs on a fixed table of cases (``tests/verl_core/reward/
verl_score_cases.json``, verl at b178a3c). Scores are +1.0 for a correct answer and -1.0
otherwise (no answer included): DAPO's reward. :func:`score_details` also gives verl's ``acc``
and ``pred``.
"""

from __future__ import annotations

import re

__all__ = ["compute_score", "score_details", "normalize_final_answer", "CLIP_CHARS"]

CLIP_CHARS = 300
"""Only this many trailing characters of a response are read (as in verl)."""

_ANSWER = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")

# Minerva's normalisation, in its order: replacements, then words and macros dropped
_REPLACE = (("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), ("\\ ", ""), (" ", ""),
            ("mbox", "text"), (",\\text{and}", ","), ("\\text{and}", ","),
            ("\\text{m}", "\\text{}"))
_DROP = ("square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units",
         "\\ldots", "sue", "points", "feet", "minutes", "digits", "cents", "degrees", "cm", "gm",
         "pounds", "meters", "meals", "edges", "students", "childrentickets", "multiples",
         "\\text{s}", "\\text{.}", "\\text{\ns}", "\\text{}^2", "\\text{}^3", "\\text{\n}",
         "\\text{}", "\\mathrm{th}", "^\\circ", "^{\\circ}", "\\;", ",\\!", "{,}", '"', "\\dots")
_REGEX = tuple((re.compile(p), r) for p, r in (
    (r"(.*?)(\$)(.*?)(\$)(.*)", r"$\3$"),  # the first $...$ only
    (r"(\\text\{)(.*?)(\})", r"\2"),
    (r"(\\textbf\{)(.*?)(\})", r"\2"),
    (r"(\\overline\{)(.*?)(\})", r"\2"),
    (r"(\\boxed\{)(.*)(\})", r"\2"),
    (r"(frac)([^{])(.)", r"frac{\2}{\3}"),  # \frac12 -> \frac{1}{2}
    (r"(sqrt)([^{])", r"sqrt{\2}"),  # \sqrt2 -> \sqrt{2}
))


def normalize_final_answer(answer: str) -> str:
    """Minerva's normalisation of a final answer (the text after its last ``=``)."""
    answer = answer.split("=")[-1]
    for old, new in _REPLACE:
        answer = answer.replace(old, new)
    for word in _DROP:
        answer = answer.replace(word, "")
    for pattern, repl in _REGEX:
        answer = pattern.sub(repl, answer)
    answer = answer.replace("$", "")
    if answer.replace(",", "").isdigit():
        answer = answer.replace(",", "")
    return answer.strip()


def score_details(solution_str: str, ground_truth: str) -> dict:
    """verl's dict: ``score`` (+1.0 / -1.0), ``acc`` (bool) and ``pred`` (the normalised answer;
    ``[INVALID]`` normalised when there is no ``Answer:``)."""
    found = _ANSWER.findall((solution_str or "")[-CLIP_CHARS:])
    pred = normalize_final_answer(found[-1] if found else "[INVALID]")
    correct = pred == normalize_final_answer(str(ground_truth))
    return {"score": 1.0 if correct else -1.0, "acc": correct, "pred": pred}


def compute_score(solution_str: str, ground_truth: str) -> float:
    """+1.0 for a correct final answer, -1.0 otherwise."""
    return score_details(solution_str, ground_truth)["score"]
