"""Rule scorer for GSM8K (``data_source = "openai/gsm8k"`` or ``"gsm8k"``).

Follows verl's ``verl/utils/reward_score/gsm8k.py`` as of 2025 (the version that only examines
the last 300 characters), itself after ReFT (Trung et al., ACL 2024):

- Only the last 300 characters of the response are searched (answers come last, and regexes
  over very long responses are slow).
- ``strict``: the answer is the number after the LAST ``"#### "``; commas and ``$`` are removed.
- ``flexible``: the answer is the last number-like token (``-?[0-9.,]+``) that is not just
  ``"."`` (only dots: the first of them, where verl's loop ends); as in verl, it is compared
  as found (commas and a trailing period are NOT removed,
  so "1,000" or "18." do not match "1000"/"18").
- Score: ``score`` if the extracted text equals ``ground_truth`` (string equality), else
  ``format_score`` when an answer was found, else 0.
"""

from __future__ import annotations

import re

__all__ = ["compute_score", "extract_solution", "CLIP_CHARS"]

CLIP_CHARS = 300
"""Only this many trailing characters of a response are searched (as in verl)."""

_STRICT = re.compile(r"#### (-?[0-9.,]+)")
_NUMBER = re.compile(r"-?[0-9.,]+")


def extract_solution(solution_str: str, method: str = "strict") -> str | None:
    """The final answer text, or None when there is none (see the module docstring)."""
    if method not in ("strict", "flexible"):
        raise ValueError(f"gsm8k: method={method!r}; known: strict, flexible")
    tail = solution_str[-CLIP_CHARS:]
    if method == "strict":
        found = _STRICT.findall(tail)
        return found[-1].replace(",", "").replace("$", "") if found else None
    found = _NUMBER.findall(tail)
    for candidate in reversed(found):
        if candidate not in ("", "."):
            return candidate
    return found[0] if found else None  # only dots: verl's loop ends on the first one


def compute_score(solution_str: str, ground_truth: str, method: str = "strict",
                  format_score: float = 0.0, score: float = 1.0) -> float:
    """``score`` for a correct final answer, ``format_score`` for a wrong one, 0 for none."""
    answer = extract_solution(solution_str or "", method=method)
    if answer is None:
        return 0.0
    return float(score) if answer == ground_truth else float(format_score)
