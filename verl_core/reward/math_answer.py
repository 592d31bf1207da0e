"""Rule scorer for MATH (Hendrycks et al. 2021): the last ``\\boxed{...}`` of a response against
the ground truth, both normalised, as verl's ``default_compute_score`` scores the data sources
``lighteval/MATH``, ``DigitalLearningGmbH/MATH-lighteval`` and ``HuggingFaceH4/MATH-500``
(verl's ``verl/utils/reward_score/math_reward.py``, itself after the MATH repository's
``is_equiv``).

Written from that behaviour, and held to verl's own outputs on a fixed table of cases
(``tests/verl_core/reward/verl_score_cases.json``, recorded from verl at b178a3c): the
normalisation keeps verl's quirks (``5.0`` is not ``5``, ``0.50`` is not ``\\frac{1}{2}``) so a
run here scores what a verl run scores.

- Answer: the last ``\\boxed{...}`` (braces balanced), else the last ``\\fbox{...}`` (which,
  as in verl, then scores 0: only a ``\\boxed{`` wrapper is unwrapped). ``\\boxed 5`` (a space, no
  braces) anywhere in the response wins, read up to the next ``$``. The whole response is read.
- Equal when the normalised strings are equal (:func:`normalize`); when normalising one of them
  fails (a malformed ``\\sqrt`` or ``\\frac``, two unit texts), the raw strings are compared.
- Score 1.0 or 0.0.
"""

from __future__ import annotations

__all__ = ["compute_score", "last_boxed", "unbox", "normalize"]

_BOXED_SPACE = "\\boxed "


def last_boxed(text: str) -> str | None:
    """The response's last boxed expression with its wrapper (``\\boxed{..}``, ``\\fbox{..}``
    or ``\\boxed x``), or None."""
    if _BOXED_SPACE in text:
        return _BOXED_SPACE + text.split(_BOXED_SPACE)[-1].split("$")[0]
    start = text.rfind("\\boxed")
    if start < 0:
        start = text.rfind("\\fbox")
        if start < 0:
            return None
    depth = 0
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[start:i + 1]
    return None  # unbalanced braces


def unbox(boxed: str) -> str | None:
    """The inside of ``\\boxed{...}`` / ``\\boxed x``; None for any other wrapper."""
    if boxed.startswith(_BOXED_SPACE):
        return boxed[len(_BOXED_SPACE):]
    if boxed.startswith("\\boxed{") and boxed.endswith("}"):
        return boxed[len("\\boxed{"):-1]
    return None


def _sqrt_braces(s: str) -> str:
    """``\\sqrt2`` -> ``\\sqrt{2}`` (one character); IndexError for a bare trailing ``\\sqrt``."""
    head, *rest = s.split("\\sqrt")
    return head + "".join("\\sqrt" + p if p[0] == "{" else "\\sqrt{" + p[0] + "}" + p[1:]
                          for p in rest)


def _frac_braces(s: str) -> str:
    """``\\frac12`` -> ``\\frac{1}{2}``, ``\\frac1{2}`` -> ``\\frac{1}{2}``; a ``\\frac`` followed
    by fewer than two characters leaves ``s`` unchanged; IndexError for a bare trailing one."""
    head, *rest = s.split("\\frac")
    out = [head]
    for p in rest:
        if p[0] == "{":
            out.append("\\frac" + p)
        elif len(p) < 2:
            return s
        elif p[1] != "{":
            out.append("\\frac{" + p[0] + "}{" + p[1] + "}" + p[2:])
        else:
            out.append("\\frac{" + p[0] + "}" + p[1:])
    return "".join(out)


def _slash_fraction(s: str) -> str:
    """``3/4`` (two plain integers, nothing else) -> ``\\frac{3}{4}``."""
    parts = s.split("/")
    if len(parts) != 2:
        return s
    try:
        a, b = int(parts[0]), int(parts[1])
    except ValueError:
        return s
    return f"\\frac{{{a}}}{{{b}}}" if s == f"{a}/{b}" else s


def normalize(s: str) -> str:
    """MATH's answer normalisation, in its order; raises (ValueError, IndexError) where the
    original raises, so the caller falls back to the raw strings as verl does."""
    for old, new in (("\n", ""), ("\\!", ""), ("\\\\", "\\"), ("tfrac", "frac"),
                     ("dfrac", "frac"), ("\\left", ""), ("\\right", ""), ("^{\\circ}", ""),
                     ("^\\circ", ""), ("\\$", "")):
        s = s.replace(old, new)
    if "\\text{ " in s:  # a unit after the number: keep what is before it
        parts = s.split("\\text{ ")
        if len(parts) != 2:
            raise ValueError(f"two unit texts in {s!r}")
        s = parts[0]
    s = s.replace("\\%", "").replace(" .", " 0.").replace("{.", "{0.")
    if not s:
        return s
    if s[0] == ".":
        s = "0" + s
    sides = s.split("=")
    if len(sides) == 2 and len(sides[0]) <= 2:  # "x = 5" -> " 5"
        s = sides[1]
    if "\\sqrt" in s:
        s = _sqrt_braces(s)
    s = s.replace(" ", "")
    if "\\frac" in s:
        s = _frac_braces(s)
    if s == "0.5":
        s = "\\frac{1}{2}"
    return _slash_fraction(s)


def _equal(answer: str, ground_truth: str) -> bool:
    try:
        return normalize(answer) == normalize(ground_truth)
    except (ValueError, IndexError):
        return answer == ground_truth


def compute_score(solution_str: str, ground_truth: str) -> float:
    """1.0 when the response's last boxed answer equals ``ground_truth`` after normalisation,
    else 0.0 (also with no boxed answer)."""
    boxed = last_boxed(solution_str or "")
    answer = unbox(boxed) if boxed is not None else None
    return 1.0 if answer is not None and _equal(answer, str(ground_truth)) else 0.0
