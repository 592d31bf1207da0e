"""Rule scorer for PRIME's NuminaMath sources (``numina_aops_forum``, ``numina_synthetic_math``,
``numina_amc_aime``, ``numina_synthetic_amc``, ``numina_cn_k12``, ``numina_olympiads``), as verl's
``default_compute_score`` scores them (``verl/utils/reward_score/prime_math/`` at b178a3c).

Written from that behaviour, not copied, and held to verl's own outputs on a fixed table of cases
(``tests/verl_core/reward/prime_math_cases.json``). In order:

1. **The answer** (:func:`extract_answer`): the text after the last ``answer:`` / ``answer is`` /
   ``answers are``, before a later ``is answer`` / ``is the answer`` ..., then the last
   ``\\boxed{}``/``\\fbox{}``'s inside, then cut before the last ``". "`` and after the last
   ``be ``, ``is ``, ``=``, ``: `` or ``get ``.
2. **Grading** (:func:`grade_answer`): equal after MATH's normalisation (Hendrycks' ``is_equiv``,
   :mod:`math_answer`); else equal after PRIME's normalisation (units, ``\\text{}``, ``$``, ``%``,
   ``million``, LaTeX to text with ``pylatexenc``, lower case); else element by element (tuples
   and intervals keep their brackets): two fractions must match as written (unreduced is wrong),
   an integer only equals an integer, anything else is equal when sympy simplifies the difference
   to 0.
3. **Fallback** (:func:`math_equal`): numbers within a relative 1e-4, the answer also read as a
   percentage (``0.5`` = ``50`` = ``5000``); ``\\pi`` as 3.14159... or 3.14; ``1010_2`` as 1010;
   intervals and tuples element by element; a column vector as a list.

Score 1.0 or 0.0. Where verl runs model text through Python's ``eval`` (``\\pi`` answers, a list
answer against a ``pmatrix``), this module evaluates numbers and arithmetic only
(:func:`_arithmetic`, :func:`ast.literal_eval`): a response is never executed. sympy parses only
text that passes verl's own gate (at most two unknown letters, no ``^{``, ``^(`` or long powers)
and this module's (digits, letters, arithmetic, parentheses, commas and dots only; ``**`` checked
as ``^``; 200 characters at most), which keeps ``sympy.simplify`` to short expressions; verl also runs it in a child process
with a 10 s limit, which a scorer inside the reward phase cannot (the phase's own deadline
applies). verl's symbolic fallback (``grader.symbolic_equal``) never decides at b178a3c (its
timeout guard is used as a context manager and raises), so it is not reproduced.
"""

from __future__ import annotations

import ast
import math
import operator
import re

from verl_core.reward import math_answer

__all__ = ["compute_score", "extract_answer", "grade_answer", "math_equal", "DATA_SOURCES"]

DATA_SOURCES = ("numina_aops_forum", "numina_synthetic_math", "numina_amc_aime",
                "numina_synthetic_amc", "numina_cn_k12", "numina_olympiads")

_UNITS = ("degree", "cm", "centimeter", "meter", "mile", "second", "minute", "hour", "day", "week",
          "month", "year", "foot", "feet", "inch", "yard", "liter")
_SYMPY_MAX_CHARS = 200


# ------------------------------------------------------------------ extraction
def _last_braced(text: str) -> str | None:
    """The stripped inside of the last ``\\boxed``'s (else ``\\fbox``'s) first brace pair."""
    start = text.rfind("\\boxed")
    if start < 0:
        start = text.rfind("\\fbox")
        if start < 0:
            return None
    depth, left = 0, None
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
            left = i if left is None else left
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[left + 1:i].strip() if left is not None else None
    return None


def _after_last(text: str, markers, *, keep_after: bool) -> tuple[bool, str]:
    found = False
    for marker in markers:
        at = text.lower().rfind(marker)
        if at != -1:
            found = True
            text = text[at + len(marker):].strip() if keep_after else text[:at].strip()
            if text.endswith("\n"):  # never true after strip(); kept as verl has it
                text = text[:-2]
    return found, text


def extract_answer(response: str) -> tuple[bool, str]:
    """``(matched, answer)``: the answer read from ``response`` (see the module's step 1);
    ``matched`` is False when no marker was found or the answer has no digit."""
    m1, text = _after_last(response, ("answer:", "answer is", "answers are"), keep_after=True)
    m2, text = _after_last(text, ("is answer", "is the answer", "are answers", "are the answers"),
                           keep_after=False)
    boxed = _last_braced(text)
    if boxed:
        text = boxed
    if ". " in text:
        text = text[:text.lower().rfind(". ")].strip()
    m3, text = _after_last(text, ("be ", "is ", "are ", "=", ": ", "get ", "be\n", "is\n",
                                  "are\n", ":\n", "get\n"), keep_after=True)
    matched = (m1 or m2 or bool(boxed) or m3) and any(c.isdigit() for c in text)
    return matched, text


# ------------------------------------------------------------------ grading
def _mathd(answer: str) -> str:
    """MATH's normalisation of one answer (``math_normalize.normalize_answer``)."""
    answer = answer.strip()
    m = re.search(r"^\\text\{(?P<text>.+?)\}$", answer)
    if m is not None:
        answer = m.group("text").strip()
    try:
        return math_answer.normalize(answer)
    except (ValueError, IndexError):
        return answer


def _float(s: str) -> float | None:
    try:
        return float(s)
    except (ValueError, OverflowError):
        return None


def _is_int(x: float) -> bool:
    try:
        return abs(x - int(round(x))) <= 1e-7
    except (ValueError, OverflowError):
        return False


def _strip_thousands(expr: str) -> str:
    """``1,000,000`` -> ``1000000``, leaving tuple commas (``1,2``) alone."""
    pattern = re.compile(r"(\d)(,)(\d\d\d)($|\D)")
    while True:
        nxt = pattern.sub(r"\1\3\4", expr)
        if nxt == expr:
            return nxt
        expr = nxt


def _str_is_int(s: str) -> bool:
    x = _float(_strip_thousands(s))
    return x is not None and _is_int(x)


def _is_frac(expr: str) -> bool:
    return bool(re.search(r"^-?[0-9]+.?/0*[1-9][0-9]*.?$", expr))


def _latex_to_text(expr: str) -> str:
    from pylatexenc import latex2text  # verl's converter: the same text reaches sympy

    expr = expr.replace("\\tfrac", "\\frac").replace("\\dfrac", "\\frac")
    expr = expr.replace("\\frac", " \\frac")  # mixed numbers: 7\frac{3}{4} -> "7 3/4"
    expr = latex2text.LatexNodes2Text().latex_to_text(expr)
    for old, new in (("√", "sqrt"), ("π", "pi"), ("∞", "inf"), ("∪", "U"), ("·", "*"),
                     ("×", "*")):
        expr = expr.replace(old, new)
    return expr.strip()


def _prime_normalize(expr: str) -> str:
    """PRIME's normalisation (``prime_math._normalize``)."""
    m = re.search(r"^\\text\{(?P<text>.+?)\}$", expr)
    if m is not None:
        expr = m.group("text")
    for old, new in (("\\%", "%"), ("\\$", "$"), ("$", ""), ("%", ""), (" or ", " , "),
                     (" and ", " , "), ("million", "*10^6"), ("billion", "*10^9"),
                     ("trillion", "*10^12")):
        expr = expr.replace(old, new)
    for unit in _UNITS:
        expr = re.sub(f"{unit}(es)?(s)? *(\\^[0-9]+)?", "", expr)
    expr = re.sub(r"\^ *\\circ", "", expr)
    if expr and expr[0] == "{" and expr[-1] == "}":
        expr = expr[1:-1]
    expr = re.sub(",\\\\! *", "", expr)
    x = _float(expr)
    if x is not None and _is_int(x):
        expr = str(int(round(x)))
    if "\\" in expr:
        try:
            expr = _latex_to_text(expr)
        except Exception:  # pylatexenc on malformed LaTeX: keep the text, as verl does
            pass
    expr = re.sub("- *", "-", expr)
    expr = re.sub(r"([0-9]) +([0-9])", r"\1+\2", expr)  # 7 3/4 -> 7+3/4
    expr = expr.lower()
    if _str_is_int(expr):
        expr = str(int(float(expr.replace(",", ""))))
    return expr


def _split_tuple(expr: str) -> list[str]:
    expr = _strip_thousands(expr)
    if not expr:
        return []
    if (len(expr) > 2 and expr[0] in "()[]" and expr[-1] in "()[]"
            and not any(ch in expr[1:-1] for ch in "()[]")):
        return [e.strip() for e in expr[1:-1].split(",")]
    return [expr]


_SAFE_FOR_SYMPY = re.compile(r"[0-9a-z+\-*/^()., ]*")


def _sympy_may_parse(expr: str) -> bool:
    """verl's gate (``should_allow_eval``) plus this module's: plain arithmetic characters only
    (sympy's ``parse_expr`` runs ``eval`` on its input), ``**`` read as ``^`` by the power
    checks (verl's gate lets ``9**9**9**9`` through to its child process's 10 s limit), and
    short."""
    if len(expr) > _SYMPY_MAX_CHARS or _SAFE_FOR_SYMPY.fullmatch(expr) is None:
        return False
    expr = re.sub(r"\*\*", "^", expr.replace(" ", ""))  # spaces hide no power from the checks
    letters = {c for c in expr.replace("sqrt", "").replace("frac", "") if c.isalpha()}
    if len(letters) > 2 or "^{" in expr or "^(" in expr:
        return False
    if re.search(r"\^[0-9]+\^", expr) or re.search(r"\^[0-9][0-9]+", expr):
        return False
    return True


def _equal_under_sympy(ground_truth: str, given: str) -> bool:
    expr = f"({ground_truth})-({given})"
    if not _sympy_may_parse(expr):
        return False
    import sympy
    from sympy.parsing import sympy_parser

    try:
        diff = sympy_parser.parse_expr(
            expr.replace("^", "**"),
            transformations=(sympy_parser.standard_transformations
                             + (sympy_parser.implicit_multiplication_application,)))
        return bool(sympy.simplify(diff) == 0)
    except Exception:  # anything sympy cannot read or simplify is not equal, as in verl
        return False


def grade_answer(given: str | None, ground_truth: str) -> bool:
    """verl's ``prime_math.grade_answer`` (the module's step 2)."""
    if given is None:
        return False
    if _mathd(ground_truth) == _mathd(given):
        return True
    truth, answer = _prime_normalize(ground_truth), _prime_normalize(given)
    if truth == answer:
        return True
    if not answer:
        return False
    truth_elems, answer_elems = _split_tuple(truth), _split_tuple(answer)
    if len(truth_elems) != len(answer_elems) or (
            len(truth_elems) > 1 and (truth[0] != answer[0] or truth[-1] != answer[-1])):
        return False
    for t, a in zip(truth_elems, answer_elems):
        if _is_frac(t) and _is_frac(a):
            ok = t == a  # an unreduced fraction is wrong: no simplifying
        elif _str_is_int(t) != _str_is_int(a):
            ok = False  # an integer answer must match exactly
        else:
            ok = _equal_under_sympy(t, a)
        if not ok:
            return False
    return True


# ------------------------------------------------------------------ fallback
_ARITH = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
          ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
          ast.BitXor: operator.xor, ast.Pow: operator.pow}


def _arithmetic(text: str):
    """What Python's ``eval`` gives for ``text`` when it is numbers and arithmetic only (``^`` is
    XOR, as in Python), else ``text`` unchanged. verl ``eval``\\ s the answer here; this never
    runs anything but arithmetic on numbers."""
    def ev(node):
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            v = ev(node.operand)
            return -v if isinstance(node.op, ast.USub) else +v
        if isinstance(node, ast.BinOp) and type(node.op) in _ARITH:
            left, right = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > 64:
                raise ValueError("power too large")
            return _ARITH[type(node.op)](left, right)
        raise ValueError("not arithmetic")

    try:
        return ev(ast.parse(text, mode="eval"))
    except Exception:  # eval would raise too (or this refuses a huge power): keep the text
        return text


def _with_pi(text: str, pi: float) -> str:
    at = text.find("\\pi")
    while at != -1:
        factor = "*" if at > 0 and text[at - 1].isdigit() else "1*"
        text = text[:at] + f"{factor}{pi}" + text[at + 3:]
        at = text.find("\\pi", at + 1)
    return _arithmetic(text)


def _fallback_normalize(answer, pi: float):
    if isinstance(answer, str) and re.match(r"\$\d+(\.\d+)?", answer):
        return answer[1:]
    if isinstance(answer, str) and (re.match(r"^\d+(\.\d+)?%$", answer)
                                    or re.match(r"^\d+(\.\d+)?\\%$", answer)):
        return answer.replace("\\%", "").replace("%", "")
    if isinstance(answer, str) and "_" in answer:  # a base: 1010_2 -> 1010
        return int(float(answer.split("_")[0]))
    if isinstance(answer, str) and "\\pi" in answer:
        return _with_pi(answer, pi)
    return answer


def _number(s) -> float | None:
    text = str(s)
    return _float(text.replace("{,}", "") if "{,}" in text else text.replace(",", ""))


def _intervals(text: str) -> str:
    for head, left, right in (("Interval(", "[", "]"), ("Interval.Ropen(", "[", ")"),
                              ("Interval.Lopen(", "(", "]"), ("Interval.open(", "(", ")")):
        m = re.match(rf"^{re.escape(head)}(.*)\)$", text)
        if m:
            return f"{left}{m.group(1)}{right}"
    return text


def math_equal(prediction, reference, include_percentage: bool = True,
               tolerance: float = 1e-4, pi: float = math.pi) -> bool:
    """verl's ``grader.math_equal`` less its symbolic step (the module's step 3)."""
    prediction = _fallback_normalize(prediction, pi)
    reference = _fallback_normalize(reference, pi)
    if isinstance(prediction, str) and len(prediction) > 1000:
        prediction = prediction[:1000]
    if isinstance(prediction, str) and isinstance(reference, str):
        if prediction.strip().lower() == reference.strip().lower():
            return True
        if prediction.replace(" ", "") == reference.replace(" ", ""):
            return True
    p, r = _number(prediction), _number(reference)
    if p is not None and r is not None:
        candidates = [r / 100, r, r * 100] if include_percentage else [r]
        return any(math.isclose(c, p, rel_tol=tolerance) for c in candidates)
    if not prediction and prediction not in (0, False):
        return False
    reference, prediction = str(reference).strip(), _intervals(str(prediction).strip())
    pred_s, ref_s = prediction, reference
    if ((prediction.startswith("[") and prediction.endswith("]") and not reference.startswith("("))
            or (prediction.startswith("(") and prediction.endswith(")")
                and not reference.startswith("["))):
        pred_s, ref_s = pred_s.strip("[]()"), ref_s.strip("[]()")
    for ch in "{}()":
        pred_s, ref_s = pred_s.replace(ch, ""), ref_s.replace(ch, "")
    if pred_s == ref_s:
        return True

    def each(ps, rs, strict=True) -> bool:
        return (not strict or len(ps) == len(rs)) and all(
            math_equal(a, b, include_percentage, tolerance) for a, b in zip(ps, rs))

    if (prediction and reference and prediction[0] in "([" and prediction[-1] in ")]"
            and prediction[0] == reference[0] and prediction[-1] == reference[-1]
            and each(prediction[1:-1].split(","), reference[1:-1].split(","))):
        return True
    if "," in prediction and "," in reference:
        ps = [x.strip() for x in prediction.split(",")]
        rs = [x.strip() for x in reference.split(",")]
        if len(ps) == len(rs):
            return each(ps, rs)
    if prediction.startswith("Point") and reference[0] == "(" and reference[-1] == ")":
        ps = prediction[prediction.find("(") + 1:-1].split(",")
        if len(ps) == len(reference[1:-1].split(",")) and each(ps, reference[1:-1].split(",")):
            return True
    if r"\begin{pmatrix}" in reference and prediction.startswith("[") and prediction.endswith("]"):
        rows = ast.literal_eval(prediction)  # raises where verl's eval raises on a non-literal
        if isinstance(rows, list):
            ref_rows = (reference.removeprefix(r"\\begin{pmatrix}").removeprefix(r"\begin{pmatrix}")
                        .removesuffix(r"\\end{pmatrix}").removesuffix(r"\end{pmatrix}"))
            ref_rows = [row.split("&") if "&" in row else row for row in ref_rows.split("\\")]
            try:
                if len(rows) == len(ref_rows) and each(rows, ref_rows, strict=False):
                    return True
            except Exception:
                pass
    # verl's "Matrix(...)" answers go through sympy's parse_expr (eval) here: not read, unequal
    return False


def compute_score(solution_str: str, ground_truth: str) -> float:
    """1.0 when the answer read from ``solution_str`` equals ``ground_truth`` (module doc)."""
    _, answer = extract_answer(str(solution_str))
    ground_truth = str(ground_truth)
    if grade_answer(answer, ground_truth):
        return 1.0
    try:
        if "\\pi" in answer or "\\pi" in ground_truth:
            ok = any(math_equal(answer, ground_truth, pi=pi) for pi in (math.pi, 3.14))
        else:
            ok = math_equal(answer, ground_truth)
    except Exception:  # as verl: whatever the fallback cannot read is wrong
        ok = False
    return 1.0 if ok else 0.0
