"""The ``code`` rule scorer (``reward/code.py``): the code taken from a response as verl's
prime_code takes it, the ground-truth layouts (assert lines, verl's stdin/stdout, fn_name and
assert_case rows), the fraction-of-tests score, and its calls run concurrently by the reward
manager."""

import json

import pytest

from verl_core.reward.code import compute_score, extract_code, parse_tests, run_tests
from verl_core.reward.manager import RewardScorer, ScorerError
from verl_core.reward.registry import RULE_SCORE_RANGES, RUNS_CODE, scorer_for
from verl_core.reward.sandbox import Sandbox, SandboxLimits

ASSERTS = "assert add3(1) == 4\nassert add3(-3) == 0\nassert add3(10) == 13"


@pytest.fixture(scope="module")
def sandbox():
    return Sandbox(SandboxLimits(timeout_s=8.0, cpu_s=1), max_concurrent=2)


@pytest.mark.parametrize("response,code", [
    ("def f(): pass", "def f(): pass"),                                   # no block: all of it
    ("Here:\n```python\ndef f(): pass\n```\nDone.", "\ndef f(): pass\n"),  # the block
    ("```python\nx = 1\n```\nbetter:\n```python\nx = 2\n```", "\nx = 2\n"),  # the last block
    ("text ```\nx = 1\n```", "text "),       # a plain ``` block: text before it (prime_code)
])
def test_code_is_taken_as_verls_prime_code_takes_it(response, code):
    assert extract_code(response) == code


def test_score_is_the_fraction_of_tests_passed(sandbox):
    # 3 tests: a right answer passes 3 of 3, an off-by-one-at-0 answer 2 of 3 (add3(-3) != 0)
    assert compute_score("```python\ndef add3(x):\n    return x + 3\n```", ASSERTS,
                         sandbox) == 1.0
    assert compute_score("def add3(x):\n    return x + 3 if x else 3\n", ASSERTS,
                         sandbox) == pytest.approx(1.0)
    assert compute_score("def add3(x):\n    return x + 3 if x != -3 else 1\n", ASSERTS,
                         sandbox) == pytest.approx(2 / 3)
    assert compute_score("I don't know.", ASSERTS, sandbox) == 0.0


def test_verls_code_rows(sandbox):
    stdio = json.dumps({"inputs": ["1 2\n", "5 5\n", "0 0\n"], "outputs": ["3\n", "10", "1\n"]})
    program = "a, b = map(int, input().split())\nprint(a + b)\n"
    assert compute_score(program, stdio, sandbox) == pytest.approx(2 / 3)  # 0 0 -> 0, not 1
    call = json.dumps({"fn_name": "twice", "inputs": [[1], [4]], "outputs": [[2], 8]})
    assert compute_score("def twice(x):\n    return 2 * x\n", call, sandbox) == 1.0
    assert compute_score("class Solution:\n    def twice(self, x):\n        return x + x\n",
                         call, sandbox) == 1.0  # LeetCode's form, as verl's wrapper finds it
    cases = json.dumps({"assert_case": ["assert g() == 1", "assert g() == 2"]})
    assert compute_score("def g():\n    return 1\n", cases, sandbox) == 0.5
    # only the first 10 tests count, as verl's continuous score
    many = json.dumps({"inputs": ["\n"] * 12, "outputs": ["x"] * 10 + ["y"] * 2})
    assert compute_score("print('x')", many, sandbox) == 1.0


@pytest.mark.parametrize("gt,match", [
    ("", "is empty"),
    ("add3(1) == 4", "not assert statements"),
    ("assert add3(1) == 4\nprint('x')", "not assert statements"),
    ('{"inputs": [1, 2], "outputs": [1]}', "2 inputs and 1 outputs"),
    ('{"tests": []}', "no 'inputs'/'outputs'"),
    ("{not json", "not JSON"),
])
def test_a_ground_truth_without_tests_is_an_error_naming_it(gt, match):
    with pytest.raises(ValueError, match=match):
        parse_tests(gt)


def test_routes_and_registry():
    for ds in ("synthetic/code", "codecontests", "apps", "codeforces", "taco"):
        assert scorer_for(ds) == "code"
    assert "code" in RUNS_CODE and RULE_SCORE_RANGES["code"] == (0.0, 1.0)


def test_the_manager_runs_code_rows_concurrently_in_order():
    """Code rows beside arithmetic rows, ``auto``: each scored by its scorer, in input order;
    a bad code row is a ScorerError naming the row and the fix."""
    good, bad = "def add3(x):\n    return x + 3\n", "def add3(x):\n    return x\n"
    sources = ["synthetic/code", "synthetic/arithmetic", "synthetic/code", "synthetic/code"]
    texts = [good, "19", bad, "```python\n" + good + "```"]
    truths = [ASSERTS, "19", ASSERTS, ASSERTS]
    with RewardScorer("auto", sandbox_max_concurrent=3,
                      sandbox_limits=SandboxLimits(timeout_s=5.0)) as rs:
        res = rs.score(sources, texts, truths, special_token=[False, False, False, True])
        assert res.scores == [1.0, 1.0, 0.0, 0.0]  # the last: a special token, never run
        assert rs.sandbox().max_concurrent == 3
        with pytest.raises(ScorerError, match=r"sample 1 .*synthetic/code.*assert"):
            rs.score(["synthetic/code"] * 2, [good, good], [ASSERTS, "return 4"])


def test_run_tests_reports_why(sandbox):
    r = run_tests("def add3(x):\n    while True:\n        pass\n", ASSERTS, sandbox)
    assert (r.passed, r.total, r.limit) == (0, 3, "cpu")


def test_verls_sandbox_fusion_keys_map():
    from verl_core.config import ConfigError, preset
    from verl_core.verl_keys import to_ours

    assert to_ours({"reward_model.sandbox_fusion.max_concurrent": 8,
                    "reward_model.sandbox_fusion.memory_limit_mb": 512,
                    "reward_model.sandbox_fusion.url": "http://sandbox:8080/run_code"}) == {
        "reward.sandbox_max_concurrent": 8, "reward.sandbox_memory_mb": 512,
        "reward.sandbox_url": "http://sandbox:8080/run_code"}
    assert to_ours({"reward_model.sandbox_fusion.url": None}) == {"reward.sandbox_url": ""}
    with pytest.raises(ConfigError, match="sandbox_url='sandbox:8080': must be empty"):
        preset("grpo", **{"reward.sandbox_url": "sandbox:8080"})


def test_a_code_row_without_tests_is_refused_before_any_work(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from verl_core.assets import prepare_assets
    from verl_core.config import preset
    from verl_core.data.dataset import DatasetError

    rows = [{"data_source": "synthetic/code", "prompt": [{"role": "user", "content": "add3"}],
             "reward_model": {"style": "rule", "ground_truth": gt}}
            for gt in (ASSERTS, "add3(1) == 4")]
    path = str(tmp_path / "code.parquet")
    pq.write_table(pa.Table.from_pylist(rows), path)
    cfg = preset("grpo", **{"data.train_files": path, "data.val_files": path})
    with pytest.raises(DatasetError, match=r"code.parquet: row 1 .*ground_truth.*not assert "
                                           r"statements.*one Python 'assert"):
        prepare_assets(cfg, str(tmp_path / "work"), log=lambda *_: None)
    assert not (tmp_path / "work" / "model").exists()  # before the warm start
