"""Custom scorers under deadlines: loading only in workers (import that kills or hangs its
process), cheap per-call timeouts, the too-many-timeouts policy, and non-finite scores.

Real scorer modules written to tmp files and run in real worker processes; no mocks. Deadlines
are fractions of a second so every test stays within a few seconds.
"""

import logging
import subprocess
import sys
import textwrap
import time

import pytest

from verl_core.config import RewardConfig
from verl_core.errors import PermanentError
from verl_core.reward.custom import ScorerLoadError
from verl_core.reward.manager import (RewardScorer, ScorerError, ScorerTimeoutError,
                                      score_responses)

SCORER_SRC = textwrap.dedent('''
    import os
    import time

    def always_hangs(data_source, solution_str, ground_truth, extra_info):
        time.sleep(3600)

    def pid_or_hang(data_source, solution_str, ground_truth, extra_info):
        if solution_str == "hang":
            time.sleep(3600)
        return {"score": 1.0, "pid": os.getpid()}

    def swallows_exceptions(data_source, solution_str, ground_truth, extra_info):
        try:
            time.sleep(3600)
        except Exception:  # a scorer's own error handling must not eat the deadline
            return 1.0

    def ignores_every_deadline(data_source, solution_str, ground_truth, extra_info):
        while True:
            try:
                time.sleep(3600)
            except BaseException:
                pass

    def huge(data_source, solution_str, ground_truth, extra_info):
        return 10 ** 400

    def huge_in_dict(data_source, solution_str, ground_truth, extra_info):
        return {"score": float("inf") if solution_str == "inf" else 1.0}

    def text(data_source, solution_str, ground_truth, extra_info):
        return "0.5"
''')


@pytest.fixture
def scorer_file(tmp_path):
    path = tmp_path / "deadline_scorer.py"
    path.write_text(SCORER_SRC)
    return str(path)


def _inputs(responses, data_source="custom/task", gt="42"):
    n = len(responses)
    return [data_source] * n, list(responses), [gt] * n, [None] * n


def _isolated(code: str, timeout: float = 30.0) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter: before the fix these scorers took down (or hung) the
    process that created the RewardScorer, which must not be the test runner."""
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=timeout)


# ---------------------------------------------------------------- loading
def test_scorer_that_exits_at_import_is_a_clear_permanent_error(tmp_path):
    bad = tmp_path / "exits_at_import.py"
    bad.write_text("import os\nos._exit(3)\n\ndef compute_score(*a):\n    return 1.0\n")
    out = _isolated(f'''
        from verl_core.errors import PermanentError
        from verl_core.reward.custom import ScorerLoadError
        from verl_core.reward.manager import score_responses
        try:
            score_responses({str(bad)!r}, ["d"], ["1"], ["1"], import_timeout_s=5)
        except ScorerLoadError as e:
            assert isinstance(e, PermanentError)
            print("ERROR:", e)
    ''')
    assert out.returncode == 0, (out.returncode, out.stdout, out.stderr)  # was 3, no output
    assert repr(str(bad)) in out.stdout
    assert "importing it killed its worker process (exit code 3)" in out.stdout


def test_scorer_that_hangs_at_import_hits_the_import_deadline(tmp_path):
    bad = tmp_path / "hangs_at_import.py"
    bad.write_text("import time\ntime.sleep(3600)\n\ndef compute_score(*a):\n    return 1.0\n")
    out = _isolated(f'''
        import time
        from verl_core.reward.custom import ScorerLoadError
        from verl_core.reward.manager import RewardScorer
        t = time.perf_counter()
        rs = RewardScorer({str(bad)!r}, import_timeout_s=0.5)
        try:
            rs.start()
        except ScorerLoadError as e:
            print("ERROR:", e)
        print(f"elapsed {{time.perf_counter() - t:.1f}}")
        assert rs._pool is None  # the failed pool was stopped
    ''', timeout=30)  # before the fix: hung until this timeout
    assert out.returncode == 0, (out.returncode, out.stdout, out.stderr)
    assert repr(str(bad)) in out.stdout
    assert "did not finish within reward.import_timeout_s=0.5s" in out.stdout
    assert float(out.stdout.rsplit("elapsed", 1)[1]) < 10


def test_the_trainer_process_never_imports_a_custom_scorer(tmp_path, monkeypatch):
    (tmp_path / "never_in_parent_xyz.py").write_text(
        "def compute_score(ds, sol, gt, extra_info=None):\n    return float(sol == gt)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    res = score_responses("never_in_parent_xyz", *_inputs(["42", "7"]))
    assert res.scores == [1.0, 0.0]
    assert "never_in_parent_xyz" not in sys.modules


def test_load_errors_come_back_from_the_worker_as_permanent_errors(tmp_path):
    (tmp_path / "raises.py").write_text("raise RuntimeError('no GPU here')\n")
    with pytest.raises(ScorerLoadError, match="executing .*raises.py' failed: RuntimeError: "
                                              "no GPU here") as e:
        score_responses(str(tmp_path / "raises.py"), *_inputs(["1"]))
    assert isinstance(e.value, PermanentError)
    (tmp_path / "exits.py").write_text("import sys\nsys.exit(4)\n")
    with pytest.raises(ScorerLoadError, match="importing it raised SystemExit: 4"):
        score_responses(str(tmp_path / "exits.py"), *_inputs(["1"]))


# ---------------------------------------------------------------- timeouts
def test_a_timeout_does_not_cost_a_worker_respawn(scorer_file):
    # one worker: the call after a timeout runs in the same process (before: a killed and
    # respawned worker, ~0.3 s under pytest and ~2-10 s under the trainer's __main__ each)
    with RewardScorer(f"{scorer_file}:pid_or_hang", timeout_s=0.3, num_workers=1,
                      on_timeouts="warn") as rs:
        before = rs.score(*_inputs(["1"])).extras["pid"]
        hung = rs.score(*_inputs(["hang", "1"]))
        after = rs.score(*_inputs(["1"])).extras["pid"]
    assert hung.timed_out == [True, False] and hung.scores == [0.0, 1.0]
    assert before == after == [hung.extras["pid"][1]]


def test_a_batch_of_timeouts_takes_the_timeouts_only(scorer_file):
    with RewardScorer(f"{scorer_file}:always_hangs", timeout_s=0.3, num_workers=2,
                      on_timeouts="warn") as rs:
        rs.start()
        t = time.perf_counter()
        res = rs.score(*_inputs(["1"] * 8))
        elapsed = time.perf_counter() - t
    assert res.num_timeouts == 8 and res.scores == [0.0] * 8
    assert elapsed < 1.2 + 1.5, elapsed  # 8 calls x 0.3 s / 2 workers, plus scheduling


def test_catching_exception_does_not_escape_the_deadline(scorer_file):
    res = score_responses(f"{scorer_file}:swallows_exceptions", *_inputs(["1"]), timeout_s=0.3,
                          on_timeouts="warn")
    assert res.timed_out == [True]


def test_a_call_that_ignores_its_deadline_is_killed(scorer_file):
    # the backstop: pebble kills the worker import_timeout_s + 2 s after the call's deadline
    t = time.perf_counter()
    res = score_responses(f"{scorer_file}:ignores_every_deadline", *_inputs(["1"]),
                          timeout_s=0.2, import_timeout_s=0.3, on_timeouts="warn")
    assert res.timed_out == [True] and res.scores == [0.0]
    assert time.perf_counter() - t < 0.5 + 2.0 + 3.0


def test_mostly_timeouts_fail_naming_the_scorer(scorer_file, caplog):
    spec = f"{scorer_file}:pid_or_hang"
    with RewardScorer(spec, timeout_s=0.3, num_workers=2) as rs:
        with pytest.raises(ScorerTimeoutError) as e:  # 3 of 4 > max_timeout_fraction=0.5
            rs.score(*_inputs(["hang", "hang", "1", "hang"]))
        msg = str(e.value)
        assert repr(spec) in msg and "3 of 4 calls timed out" in msg
        assert "reward.timeout_s" in msg and "reward.on_timeouts='warn'" in msg
        assert isinstance(e.value, PermanentError)
        with caplog.at_level(logging.WARNING, logger="verl_core.reward.manager"):
            res = rs.score(*_inputs(["hang", "1"]))  # 1 of 2: not more than half, a warning
    assert res.num_timeouts == 1 and res.scores == [0.0, 1.0]
    assert any("1 of 2 calls timed out" in r.getMessage() and spec in r.getMessage()
               for r in caplog.records)


def test_on_timeouts_warn_keeps_training(scorer_file, caplog):
    with caplog.at_level(logging.WARNING, logger="verl_core.reward.manager"):
        res = score_responses(f"{scorer_file}:always_hangs", *_inputs(["1", "2"]),
                              timeout_s=0.2, timeout_score=-1.0, on_timeouts="warn")
    assert res.scores == [-1.0, -1.0] and res.num_timeouts == 2
    assert any("2 of 2 calls timed out" in r.getMessage() for r in caplog.records)


# ---------------------------------------------------------------- values
@pytest.mark.parametrize("fn,response,match", [
    ("huge", "1", r"non-finite score 1000.*0000 \(int beyond float range\) for sample 0 "
                  r"\(data_source='custom/task', ground_truth='42'\)"),
    ("huge_in_dict", "inf", r"non-finite score inf for sample 1 \(data_source='custom/task', "
                            r"ground_truth='42'\)"),
    ("text", "1", r"returned '0.5' \(str\) for sample 0 \(data_source='custom/task', "
                  r"ground_truth='42'\)"),
])
def test_bad_values_name_scorer_row_and_value(scorer_file, fn, response, match):
    spec = f"{scorer_file}:{fn}"
    responses = ["1", response] if fn == "huge_in_dict" else [response]
    with pytest.raises(ScorerError, match=match) as e:  # was a bare OverflowError for 10**400
        score_responses(spec, *_inputs(responses))
    assert repr(spec) in str(e.value) and isinstance(e.value, PermanentError)
    assert len(str(e.value)) < 600  # 10**400 is abbreviated, not printed in full


# ---------------------------------------------------------------- config
def test_from_config_carries_the_timeout_policy():
    cfg = RewardConfig(scorer="x.py:f", timeout_s=2.0, import_timeout_s=5.0,
                       max_timeout_fraction=0.25, on_timeouts="warn")
    rs = RewardScorer.from_config(cfg)  # starts nothing until the first score
    assert (rs.timeout_s, rs.import_timeout_s, rs.max_timeout_fraction, rs.on_timeouts) == \
        (2.0, 5.0, 0.25, "warn") and rs._pool is None
