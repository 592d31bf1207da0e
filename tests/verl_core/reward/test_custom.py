"""Custom scorers: loading by spec, running in worker processes with a timeout, and errors that
name the scorer and the sample."""

import textwrap
import time

import pytest

from verl_core.reward.custom import ScorerLoadError, load_scorer, parse_spec
from verl_core.reward.manager import RewardScorer, ScorerError, score_responses

SCORER_SRC = textwrap.dedent('''
    import time

    NOT_A_FUNCTION = 3

    def exact(data_source, solution_str, ground_truth, extra_info):
        return float(solution_str.strip() == ground_truth)

    def with_extras(data_source, solution_str, ground_truth, extra_info):
        out = {"score": float(solution_str == ground_truth), "length": len(solution_str)}
        if extra_info and extra_info.get("tag"):
            out["tag"] = extra_info["tag"]
        return out

    def sometimes_hangs(data_source, solution_str, ground_truth, extra_info):
        if solution_str == "hang":
            time.sleep(3600)
        return 1.0

    def sometimes_raises(data_source, solution_str, ground_truth, extra_info):
        if solution_str == "boom":
            raise ZeroDivisionError("scorer bug")
        return 1.0

    def returns_text(data_source, solution_str, ground_truth, extra_info):
        return "1.0"

    def returns_nan(data_source, solution_str, ground_truth, extra_info):
        return float("nan")

    def dict_without_score(data_source, solution_str, ground_truth, extra_info):
        return {"value": 1.0}

    def exits(data_source, solution_str, ground_truth, extra_info):
        import os, sys
        if solution_str == "exit":
            sys.exit(3)
        if solution_str == "crash":
            os._exit(3)
        if solution_str == "unpicklable":
            return lambda: None
        return 1.0

    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        return 0.5
''')


@pytest.fixture
def scorer_file(tmp_path):
    path = tmp_path / "my_scorer.py"
    path.write_text(SCORER_SRC)
    return str(path)


def _inputs(responses, gts=None):
    n = len(responses)
    return ["custom/task"] * n, list(responses), list(gts or ["1"] * n), [None] * n


def test_parse_spec():
    assert parse_spec("a/b.py:fn") == ("a/b.py", "fn")
    assert parse_spec("pkg.mod:fn") == ("pkg.mod", "fn")
    assert parse_spec("a/b.py") == ("a/b.py", "compute_score")  # verl's default name
    assert parse_spec(r"C:\x\b.py:fn") == (r"C:\x\b.py", "fn")
    with pytest.raises(ScorerLoadError, match="empty"):
        parse_spec("")
    with pytest.raises(ScorerLoadError, match="identifier"):
        parse_spec("a.py:not-a-name")


def test_load_file_and_module_scorers(scorer_file, tmp_path, monkeypatch):
    assert load_scorer(f"{scorer_file}:exact")("d", "1 ", "1", None) == 1.0
    assert load_scorer(scorer_file)("d", "x", "1", None) == 0.5
    monkeypatch.syspath_prepend(str(tmp_path))
    assert load_scorer("my_scorer:exact")("d", "2", "1", None) == 0.0


@pytest.mark.parametrize("spec_fmt,match", [
    ("{dir}/missing.py:fn", "not found"),
    ("no_such_module_xyz:fn", "module 'no_such_module_xyz' is not importable"),
    ("{file}:missing_fn", "has no attribute 'missing_fn'.*'exact'"),
    ("{file}:NOT_A_FUNCTION", "'NOT_A_FUNCTION' is a int, not a function"),
    ("{dir}/broken.py:fn", "executing .*broken.py' failed: SyntaxError"),
])
def test_bad_specs_name_the_spec(scorer_file, tmp_path, spec_fmt, match):
    (tmp_path / "broken.py").write_text("def fn(:\n")
    spec = spec_fmt.format(dir=tmp_path, file=scorer_file)
    with pytest.raises(ScorerLoadError, match=match) as e:
        load_scorer(spec)
    assert repr(spec) in str(e.value)
    # the manager reports the same error, found by loading in a worker (never in the caller)
    with pytest.raises(ScorerLoadError):
        score_responses(spec, *_inputs(["1"]))


def test_file_scorer_in_workers_keeps_input_order(scorer_file):
    responses = [str(i % 7) for i in range(40)]
    gts = [str(i % 5) for i in range(40)]
    res = score_responses(f"{scorer_file}:exact", *_inputs(responses, gts))
    assert res.scores == [float(r == g) for r, g in zip(responses, gts)]
    assert res.num_timeouts == 0 and res.timed_out == [False] * 40 and res.extras == {}


def test_module_scorer_in_workers(tmp_path, monkeypatch):
    # workers inherit the parent's sys.path, so an importable module works there too
    (tmp_path / "mod_scorer_pkg.py").write_text(SCORER_SRC)
    monkeypatch.syspath_prepend(str(tmp_path))
    res = score_responses("mod_scorer_pkg:exact", *_inputs(["1", "2"]))
    assert res.scores == [1.0, 0.0]


def test_dict_return_with_extras(scorer_file):
    ds, sols, gts, _ = _inputs(["1", "22", "1"])
    extras = [{"tag": "a"}, None, {"tag": "c"}]
    res = score_responses(f"{scorer_file}:with_extras", ds, sols, gts, extras)
    assert res.scores == [1.0, 0.0, 1.0]
    assert res.extras == {"length": [1, 2, 1], "tag": ["a", None, "c"]}


def test_hanging_call_times_out_and_the_batch_completes(scorer_file):
    t = time.perf_counter()
    res = score_responses(f"{scorer_file}:sometimes_hangs", *_inputs(["1", "hang", "1", "1"]),
                          timeout_s=0.5, timeout_score=-1.0)
    elapsed = time.perf_counter() - t
    assert res.scores == [1.0, -1.0, 1.0, 1.0]
    assert res.timed_out == [False, True, False, False] and res.num_timeouts == 1
    assert elapsed < 5.0, elapsed


def test_raising_scorer_names_spec_and_index(scorer_file):
    spec = f"{scorer_file}:sometimes_raises"
    with pytest.raises(ScorerError) as e:
        score_responses(spec, *_inputs(["1", "1", "boom", "1"]))
    msg = str(e.value)
    assert repr(spec) in msg and "sample 2" in msg and "ZeroDivisionError: scorer bug" in msg
    assert "worker traceback" in msg and "sometimes_raises" in msg


@pytest.mark.parametrize("fn,match", [
    ("returns_text", r"returned '1.0' \(str\) for sample 0"),
    ("returns_nan", "non-finite score nan for sample 0"),
    ("dict_without_score", "dict without a 'score' key for sample 0"),
])
def test_non_numeric_returns_are_errors(scorer_file, fn, match):
    with pytest.raises(ScorerError, match=match):
        score_responses(f"{scorer_file}:{fn}", *_inputs(["1"]))


@pytest.mark.parametrize("response,match", [
    ("exit", "failed on sample 1 .*SystemExit: 3"),
    ("crash", "worker process died while scoring sample 1"),
    ("unpicklable", "failed on sample 1 .*returned function that cannot be sent back"),
])
def test_scorer_that_exits_crashes_or_returns_unpicklable(scorer_file, response, match):
    with pytest.raises(ScorerError, match=match):
        score_responses(f"{scorer_file}:exits", *_inputs(["ok", response]))


def test_reward_scorer_reuses_its_pool(scorer_file):
    with RewardScorer(f"{scorer_file}:sometimes_hangs", timeout_s=0.5, num_workers=2) as rs:
        first = rs.score(*_inputs(["hang", "1"]))
        pool = rs._pool
        second = rs.score(*_inputs(["1", "1", "1"]))
        assert rs._pool is pool
    assert rs._pool is None
    assert first.timed_out == [True, False] and second.scores == [1.0, 1.0, 1.0]


def test_pool_start_is_cheap(scorer_file):
    t = time.perf_counter()
    score_responses(f"{scorer_file}:exact", *_inputs(["1"]))
    assert time.perf_counter() - t < 2.0


def test_builtin_scorers_run_in_process():
    res = score_responses("auto", ["synthetic/arithmetic", "openai/gsm8k"], ["19", "#### 7"],
                          ["19", "8"], [None, None])
    assert res.scores == [1.0, 0.0] and res.num_timeouts == 0
    assert score_responses("arithmetic", ["anything"], ["3"], ["3"], [None]).scores == [1.0]
    assert score_responses("gsm8k", ["anything"], ["#### 3"], ["3"], [None]).scores == [1.0]
    with RewardScorer("auto") as rs:
        assert not rs.is_custom and rs._pool is None
    # an unknown data_source is a config problem: its own error, with the fix, not a ScorerError
    from verl_core.reward.registry import UnknownDataSourceError

    with pytest.raises(UnknownDataSourceError, match="reward.scorer"):
        score_responses("auto", ["my/task"], ["1"], ["1"], [None])


def test_rule_scorer_failure_names_the_sample():
    with pytest.raises(ScorerError, match=r"'arithmetic' failed on sample 1 .*not an integer"):
        score_responses("arithmetic", ["a", "a"], ["1", "1"], ["1", "x"], [None, None])


def test_length_mismatch():
    with pytest.raises(ValueError, match="differ in length"):
        score_responses("auto", ["a"], ["1", "2"], ["1", "2"], [None, None])
