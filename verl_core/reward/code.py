"""The ``code`` rule scorer: the response's Python code run against the row's tests in a sandbox
(``reward/sandbox.py``); the score is the fraction of the tests that pass.

Ground truths it reads (``reward_model.ground_truth``):

- **assert lines** (the project's ``synthetic/code`` task, ``data/code_task.py``): one test per
  non-blank line, each a Python ``assert`` calling the function, e.g.
  ``assert add3(4) == 7``; run in the namespace the response's code defined.
- **verl's code rows** (``codecontests``, ``apps``, ``codeforces``, ``taco``; the JSON text
  verl's ``prime_code`` and ``sandbox_fusion`` read): ``{"inputs": [...], "outputs": [...]}``,
  each pair a program's stdin and expected stdout (compared line by line, trailing white space
  ignored); with ``"fn_name"``, each input a list of arguments of that function (or of that
  method of a ``Solution`` class) and each output its return value (APPS's ``[value]`` accepted
  too, as verl's ``prime_code``); or ``{"assert_case": [...]}``, assert statements
  (SandboxFusion's). Only the first 10 tests count, as verl's ``continuous=True`` score.

The score: passed / total, verl's ``continuous=True`` convention (``default_compute_score`` calls
both of its code scorers that way), so 1.0 only when every test passes.

The code: as verl's ``prime_code`` (its scorer without a SandboxFusion URL) takes it: the text
after the last ```` ```python ```` up to the next ```` ``` ````; without such a block, the
response up to its first ```` ``` ```` (the whole response when it has none).
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass

from verl_core.reward.sandbox import Sandbox

__all__ = ["DATA_SOURCE", "VERL_DATA_SOURCES", "VERL_MAX_TESTS", "CodeTests", "extract_code",
           "parse_tests", "compute_score"]

DATA_SOURCE = "synthetic/code"
"""``data_source`` of the project's coding task (``data.synthetic_task=code``)."""
VERL_DATA_SOURCES = ("codecontests", "apps", "codeforces", "taco")
"""The code sources verl's ``default_compute_score`` routes to ``prime_code``/``sandbox_fusion``."""
VERL_MAX_TESTS = 10
"""verl's continuous code score counts the first 10 tests of a row."""


@dataclass(frozen=True)
class CodeTests:
    """A row's tests, as the sandbox runs them."""

    kind: str
    """``assert`` (statements), ``stdio`` ((stdin, stdout) pairs) or ``call`` ((args, value))."""
    tests: tuple
    fn_name: str | None = None


def extract_code(response: str) -> str:
    """The code in ``response`` (verl's ``prime_code`` rule, see the module docstring)."""
    return response.split("```python")[-1].split("```")[0]


def _fail(why: str, ground_truth: str):
    raise ValueError(f"code scorer: the ground truth {ground_truth[:120]!r} {why}")


def parse_tests(ground_truth: str) -> CodeTests:
    """The tests in a code row's ground truth; a ValueError naming what is wrong and the fix
    when there are none."""
    text = str(ground_truth).strip()
    if text.startswith("{"):
        try:
            gt = json.loads(text)
        except ValueError as e:
            _fail(f"starts with '{{' but is not JSON ({e}); give verl's "
                  '{"inputs": [...], "outputs": [...]} or assert lines', ground_truth)
        if isinstance(gt.get("assert_case"), list):
            cases = [str(c) for c in gt["assert_case"] if str(c).strip()]
            if not cases:
                _fail("has an empty 'assert_case' list; give at least one assert", ground_truth)
            return CodeTests("assert", tuple(cases[:VERL_MAX_TESTS]))
        ins, outs = gt.get("inputs"), gt.get("outputs")
        if not isinstance(ins, list) or not isinstance(outs, list) or not ins:
            _fail("has no 'inputs'/'outputs' lists (verl's code rows: {\"inputs\": [...], "
                  "\"outputs\": [...], optional \"fn_name\"}) and no 'assert_case'", ground_truth)
        if len(ins) != len(outs):
            _fail(f"has {len(ins)} inputs and {len(outs)} outputs; give one output per input",
                  ground_truth)
        pairs = tuple(zip(ins, outs))[:VERL_MAX_TESTS]
        fn = gt.get("fn_name")
        if fn:
            return CodeTests("call", pairs, str(fn))
        return CodeTests("stdio", tuple((str(i), str(o)) for i, o in pairs))
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    if not lines:
        _fail("is empty: a code row's ground truth holds its tests, one Python assert per line "
              "(e.g. 'assert add3(4) == 7')", ground_truth)
    bad = [ln for ln in lines if not ln.startswith("assert ")]
    if bad:
        _fail(f"has lines that are not assert statements ({bad[0][:60]!r}): a code row's ground "
              "truth holds its tests, one Python 'assert ...' per line (or verl's JSON "
              '{"inputs": [...], "outputs": [...]})', ground_truth)
    return CodeTests("assert", tuple(lines))


_default: Sandbox | None = None
_default_lock = threading.Lock()


def default_sandbox() -> Sandbox:
    """The sandbox of calls made without one (``default_compute_score``, a custom scorer that
    calls this scorer): default limits, one call at a time."""
    global _default
    with _default_lock:
        if _default is None:
            _default = Sandbox(max_concurrent=1)
        return _default


def compute_score(solution_str: str, ground_truth: str, sandbox=None) -> float:
    """The fraction of the row's tests the response's code passes, run in ``sandbox`` (the
    run's :class:`~verl_core.reward.sandbox.Sandbox` or
    :class:`~verl_core.reward.sandbox_fusion.SandboxFusion`, passed by the reward manager; else
    :func:`default_sandbox`)."""
    return run_tests(solution_str, ground_truth, sandbox).score


def run_tests(solution_str: str, ground_truth: str, sandbox=None):
    """The :class:`~verl_core.reward.sandbox.SandboxResult` of the response against the tests."""
    tests = parse_tests(ground_truth)
    return (sandbox or default_sandbox()).run(extract_code(solution_str), tests.tests,
                                              kind=tests.kind, fn_name=tests.fn_name)
