"""Great Expectations suites (verl_core/validation.py) on real data: a real step 0 of a short PPO
run through the phase functions the Flyte tasks call (``verl_core.phases``) gives the rollout,
reward and advantage batches; every expectation is then broken in a copy of them (or of the real
synthetic dataset) and must fail naming the column, the expectation and the offending rows."""
import dataclasses
import json
import warnings

import pyarrow.parquet as pq
import pytest

from tests.presets import TINY, tiny_run
from verl_core import phases
from verl_core.store import canonical_json
from verl_core.config import ConfigError, with_overrides
from verl_core.engine.workers import WORKERS, RunWorkers
from verl_core.prepare import prepare_run
from verl_core.engine.worker import get_batch, put_batch
from verl_core.layout import pending_doc, report_doc
from verl_core.models import load_tokenizer
from verl_core.train import main
from verl_core.types import PhaseOut
from verl_core.validation import (DataValidationError, DataValidationWarning, ValidationReport,
                                  declared_score_range, read_reports, report_html,
                                  sample_rows, validate_batch, validate_dataset)

ROLLOUT_ROW = 5  # the row a crafted fault goes into


def _cfg(**over):
    return tiny_run("ppo", **{
        "total_steps": 2, "model.warmup_sft_steps": 20, "data.synthetic_val_size": 12,
        "actor.ppo_micro_batch_size": 16, "checkpoint.async_save": False,
        "algorithm.use_kl_loss": True, "validation.every_steps": 1, **over})


class Step0:
    """Step 0 of a real run: its spec and the three stored batches."""

    def __init__(self, spec, refs):
        self.spec, self.refs = spec, refs
        self.cfg = spec.config
        st = spec.open_store()
        self.batches = {stage: get_batch(st, ref) for stage, ref in refs.items()}


@pytest.fixture(scope="module")
def step0(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("validation")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VERL_ASSET_CACHE", str(tmp / "assets"))
        spec = prepare_run(_cfg(), str(tmp / "store"), "v", log_fn=lambda *_: None)
        try:
            ref, _ = RunWorkers(spec).rollout(0)
            refs = {"rollout": ref}
            refs["reward"] = phases.reward(spec, PhaseOut(0, ref)).batch
            refs["advantage"] = phases.advantage(spec, PhaseOut(0, refs["reward"])).batch
            yield Step0(spec, refs)
        finally:
            WORKERS.release_all()


@pytest.fixture(scope="module")
def dataset(step0):
    """The run's real training file (the synthetic task's parquet, as published) and tokenizer."""
    from verl_core.engine.assets import materialize_assets

    assets = materialize_assets(step0.spec.open_store(), json.loads(step0.spec.assets_json))
    with open(assets.train_files[0], "rb") as f:
        df = pq.read_table(f).to_pandas()
    return df, load_tokenizer(assets.model_path)


# ---------------------------------------------------------------------- real data passes
def test_the_real_step_passes_and_its_reports_are_in_the_run_store(step0):
    st, h = step0.spec.open_store(), step0.spec.trajectory_hash
    docs = read_reports(st, h, 0)
    assert [d["stage"] for d in docs] == ["rollout", "reward", "advantage"]
    for stage, doc in zip(("rollout", "reward", "advantage"), docs):
        assert doc["success"] and doc["rows"] == doc["rows_checked"] == 32, doc
        report = ValidationReport.from_dict(doc)
        assert report.to_dict() == doc and canonical_json(doc)  # strict JSON (no NaN)
        checked = {r.checked for r in report.results}
        # PPO with a KL loss: ref log-probs and critic values are checked from the rollout on
        assert {"prompt_length", "response_length", "response_logprobs_nonfinite",
                "ref_logprobs_nonfinite", "values_nonfinite"} <= checked
        assert ("score" in checked) == (stage != "rollout")  # the [0, 1] range of rule scorers
        assert ("advantages_nonfinite" in checked) == (stage == "advantage")
        # the same suite, run again here on the stored batch, gives the same outcome
        again = validate_batch(step0.batches[stage], stage, step0.cfg, step=0)
        assert [(r.expectation, r.success, r.observed) for r in again.results] == \
               [(r.expectation, r.success, r.observed) for r in report.results]
    html = report_html(docs[2])
    assert "advantage batch of step 0: passed" in html and html.count("<tr") == \
        1 + len(docs[2]["results"])


def test_the_real_dataset_passes(dataset, step0):
    df, tok = dataset
    report = validate_dataset(df, step0.cfg, tokenizer=tok, name="train")
    assert report.success and report.rows == len(df) == 64
    assert [r.column for r in report.results] == ["", "", "prompt", "reward_model.ground_truth",
                                                  "prompt"]


# ---------------------------------------------------------------------- each expectation fails
def _poke(batch, field, row, value, token=0):
    """``batch`` with one value of ``field`` replaced (token 0: every response has one)."""
    t = getattr(batch, field).clone()
    if t.dim() == 2:
        t[row, token] = value
    else:
        t[row] = value
    return batch.replace(**{field: t})


def _fails(fn, *args, column, expectation, rows, **kw):
    """``fn`` raises DataValidationError naming ``column``, ``expectation`` and ``rows``."""
    with pytest.raises(DataValidationError) as e:
        fn(*args, **kw)
    msg = str(e.value)
    line = next((ln for ln in msg.splitlines() if f"'{column}'" in ln), None)
    assert line is not None, msg
    assert expectation in line, msg
    for r in rows:
        assert f"row {r} " in line, msg
    assert "validation.mode='warn'" in msg
    return e.value


@pytest.mark.parametrize("stage,field,value", [
    ("rollout", "response_logprobs", float("nan")),
    ("rollout", "response_logprobs", float("-inf")),
    ("rollout", "ref_logprobs", float("nan")),
    ("rollout", "values", float("inf")),
    ("reward", "score", float("nan")),
    ("advantage", "advantages", float("nan")),
    ("advantage", "returns", float("inf")),
])
def test_a_non_finite_value_fails_naming_column_expectation_and_row(step0, stage, field, value):
    bad = _poke(step0.batches[stage], field, ROLLOUT_ROW, value)
    unguarded = with_overrides(step0.cfg, {"guard.enabled": False})
    err = _fails(validate_batch, bad, stage, unguarded, step=0, column=field,
                 expectation="expect_column_values_to_be_between", rows=[ROLLOUT_ROW])
    (failed,) = err.report.failures
    assert failed.unexpected == 1 and failed.checked == f"{field}_nonfinite"
    if field != "score":
        assert f"{value} at token 0" in failed.sample[0]
    # with the training guard on, non-finite values are its to handle (skip/rollback/halt by
    # guard.nonfinite_policy, logged as an event): recorded and warned about, not raised
    with pytest.warns(DataValidationWarning, match="left to the training guard"):
        report = validate_batch(bad, stage, step0.cfg, step=0)
    assert [f.checked for f in report.failures] == [f"{field}_nonfinite"]


def test_a_score_outside_the_rule_scorers_range_fails(step0):
    # reward.scorer=auto: the ranges of the scorers the batch's data sources route to (all of
    # them, math_dapo's -1 included, when none are known)
    sources = step0.batches["reward"].data_source
    assert declared_score_range(step0.cfg, sources) == (0.0, 1.0)
    assert declared_score_range(step0.cfg) == (-1.0, 1.0)
    bad = _poke(_poke(step0.batches["reward"], "score", 2, 1.5), "score", 7, -0.5)
    err = _fails(validate_batch, bad, "reward", step0.cfg, step=0, column="score",
                 expectation="expect_column_values_to_be_between", rows=[2, 7])
    (failed,) = err.report.failures
    assert failed.unexpected == 2 and "[0, 1]" in failed.description


def test_a_custom_scorer_declares_its_range_in_the_config(step0):
    bad = _poke(step0.batches["reward"], "score", 3, 5.0)
    custom = with_overrides(step0.cfg, {"reward.scorer": "my_pkg.rewards:score"})
    assert declared_score_range(custom) is None  # a custom scorer declares none: finite only
    rm = with_overrides(step0.cfg, {"reward_model.enable": True, "reward_model.path": "/rm"})
    assert declared_score_range(rm) is None  # nor does a reward model (its logit)
    assert validate_batch(bad, "reward", custom, step=0).success
    ranged = with_overrides(custom, {"validation.score_range": "-1,1"})
    _fails(validate_batch, bad, "reward", ranged, step=0, column="score",
           expectation="expect_column_values_to_be_between", rows=[3])
    with pytest.raises(ConfigError, match=r"validation.score_range='2,3': must contain "
                                          r"reward.timeout_score=0.0"):
        with_overrides(custom, {"validation.score_range": "2,3"})
    with pytest.raises(ConfigError, match=r"validation.score_range='1,x': use 'auto', 'any'"):
        with_overrides(custom, {"validation.score_range": "1,x"})


def test_lengths_beyond_the_config_limits_fail(step0):
    batch = step0.batches["rollout"]
    lengths = batch.response_mask.sum(-1).long()
    T = int(lengths.max())
    assert T > 1
    long_rows = (lengths > T - 1).nonzero().flatten().tolist()
    short = with_overrides(step0.cfg, {"rollout.max_new_tokens": T - 1})
    err = _fails(validate_batch, batch, "rollout", short, step=0, column="response_ids",
                 expectation="expect_column_values_to_be_between", rows=long_rows[:5])
    assert err.report.failures[0].unexpected == len(long_rows)
    assert "rollout.max_new_tokens" in err.report.failures[0].description

    P = batch.prompt_mask.sum(-1)
    tight = with_overrides(step0.cfg, {"data.max_prompt_length": int(P.max()) - 1})
    rows = (P == P.max()).nonzero().flatten().tolist()[:5]
    _fails(validate_batch, batch, "rollout", tight, step=0, column="prompt_ids",
           expectation="expect_column_values_to_be_between", rows=rows)


def test_a_batch_without_the_stage_columns_fails(step0):
    # the rollout batch stored as if scored: no score column
    with pytest.raises(DataValidationError, match=r"table: expect_table_columns_to_match_set .*"
                                                  r"observed missing \['score'\]"):
        validate_batch(step0.batches["rollout"], "reward", step0.cfg, step=0)


def test_each_dataset_expectation_fails_on_a_crafted_file(dataset, step0):
    df, tok = dataset
    cfg = step0.cfg

    def bad(**rows):  # r3=(column, value): row 3's cell replaced
        out = df.copy()
        for i, (col, value) in rows.items():
            cells = list(out[col])
            cells[int(i[1:])] = value
            out[col] = cells
        return out

    _fails(validate_dataset, df.drop(columns=["reward_model"]), cfg, tokenizer=tok,
           column="reward_model.ground_truth", expectation="expect_column_values_to_be_between",
           rows=[0, 1, 2])
    with pytest.raises(DataValidationError, match=r"observed missing \['reward_model'\]"):
        validate_dataset(df.drop(columns=["reward_model"]), cfg, tokenizer=tok)
    _fails(validate_dataset, bad(r3=("prompt", [{"role": "user", "content": "  "}])), cfg,
           tokenizer=tok, column="prompt", expectation="expect_column_values_to_be_between",
           rows=[3])
    _fails(validate_dataset,
           bad(r4=("reward_model", {"style": "rule", "ground_truth": ""}),
               r9=("reward_model", {"style": "rule", "ground_truth": None})),
           cfg, tokenizer=tok, column="reward_model.ground_truth",
           expectation="expect_column_values_to_be_between", rows=[4, 9])
    err = _fails(validate_dataset, bad(r6=("prompt", [{"role": "user", "content": "9" * 80}])),
                 cfg, tokenizer=tok, column="prompt",
                 expectation="expect_column_values_to_be_between", rows=[6])
    assert "data.max_prompt_length=64" in str(err) and "81 tokens" in str(err)
    with pytest.raises(DataValidationError, match="at least one row"):
        validate_dataset(df.iloc[:0], cfg, tokenizer=tok)


# ---------------------------------------------------------------------- modes and sampling
def test_warn_mode_warns_and_returns_the_failed_report(step0):
    cfg = with_overrides(step0.cfg, {"validation.mode": "warn", "guard.enabled": False})
    bad = _poke(step0.batches["advantage"], "advantages", 1, float("nan"))
    with pytest.warns(DataValidationWarning, match=r"(?s)column 'advantages'.*row 1 .*continuing"):
        report = validate_batch(bad, "advantage", cfg, step=0)
    assert not report.success and report.mode == "warn"
    assert [f.column for f in report.failures] == ["advantages"]


def test_off_mode_skips(step0, dataset):
    cfg = with_overrides(step0.cfg, {"validation.mode": "off"})
    bad = _poke(step0.batches["rollout"], "response_logprobs", 0, float("nan"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert validate_batch(bad, "rollout", cfg, step=0) is None
        assert validate_dataset(dataset[0].drop(columns=["prompt"]), cfg) is None


def test_sampling_is_deterministic_per_seed_step_and_stage(step0):
    cfg = with_overrides(step0.cfg, {"validation.sample_rows": 6, "guard.enabled": False})
    rows = sample_rows(32, cfg, 3, "reward")
    assert len(rows) == 6 and list(rows) == sorted(set(rows.tolist()))
    assert (sample_rows(32, cfg, 3, "reward") == rows).all()
    others = [sample_rows(32, cfg, s, st).tolist() for s, st in ((4, "reward"), (3, "rollout"))]
    assert all(o != rows.tolist() for o in others)
    assert len(sample_rows(4, cfg, 3, "reward")) == 4  # fewer rows than the sample: all

    sampled = sample_rows(32, cfg, 0, "advantage")
    inside, outside = int(sampled[0]), next(i for i in range(32) if i not in sampled)
    batch = step0.batches["advantage"]
    ok = validate_batch(_poke(batch, "advantages", outside, float("nan")), "advantage", cfg,
                        step=0)
    assert ok.success and ok.rows == 32 and ok.rows_checked == 6  # not drawn: not seen
    _fails(validate_batch, _poke(batch, "advantages", inside, float("nan")), "advantage", cfg,
           step=0, column="advantages", expectation="expect_column_values_to_be_between",
           rows=[inside])


# ---------------------------------------------------------------------- a phase stops
def test_a_nan_log_prob_in_a_stored_batch_stops_the_reward_phase(step0):
    # the guard off (with it on, the update's `nonfinite` detector handles non-finite values)
    cfg = with_overrides(step0.cfg, {"guard.enabled": False})
    spec = dataclasses.replace(step0.spec, config=cfg)
    st = spec.open_store()
    bad = _poke(step0.batches["rollout"], "response_logprobs", ROLLOUT_ROW, float("nan"))
    bad_ref = put_batch(st, bad)
    step = 1  # a step this run has not scored yet
    with pytest.raises(DataValidationError, match=rf"(?s)reward batch of step {step}: .*"
                                                  rf"'response_logprobs'.*row {ROLLOUT_ROW} "):
        phases.reward(spec, PhaseOut(step, bad_ref))
    assert not st.has_json(pending_doc(spec.trajectory_hash, step, "reward"))  # nothing was stored
    doc = st.get_json(report_doc(spec.trajectory_hash, step, "reward"))  # but the report was
    assert not doc["success"] and doc["results"]
    assert "FAILED" in report_html(doc) and "nan at token 0" in report_html(doc)


def test_the_plain_loop_stops_at_the_reward_stage_naming_the_scorer_range(tmp_path, capsys):
    # a custom scorer whose scores (>= 1) lie outside the range declared for it
    scorer = tmp_path / "long.py"
    scorer.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info):\n"
                      "    return 1.0 + len(solution_str)\n")
    sets = {**TINY, "reward.scorer": f"'{scorer}:compute_score'",
            "validation.score_range": "'0,0.5'", "model.warmup_sft_steps": 20,
            "data.synthetic_val_size": 12, "actor.ppo_micro_batch_size": 16}
    argv = ["--steps", "2", "--workdir", str(tmp_path / "w")]
    for k, v in sets.items():
        argv += ["--set", f"{k}={v}"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "reward batch of step 0" in err and "column 'score'" in err, err
    assert "failed on 32 of 32 rows" in err and "[0, 0.5]" in err and "Traceback" not in err


def test_every_rule_scorer_declares_its_range():
    from verl_core.reward.registry import RULE_SCORE_RANGES, RULE_SCORERS, register_rule_scorer

    assert set(RULE_SCORE_RANGES) == set(RULE_SCORERS)
    assert RULE_SCORE_RANGES["arithmetic"] == RULE_SCORE_RANGES["gsm8k"] == (0.0, 1.0)
    with pytest.raises(ValueError, match="declare score_range"):
        register_rule_scorer("undeclared", lambda s, g: 0.0)
    assert "undeclared" not in RULE_SCORERS


def test_only_every_kth_steps_batches_are_validated(step0):
    cfg = with_overrides(step0.cfg, {"validation.every_steps": 3, "guard.enabled": False})
    bad = _poke(step0.batches["advantage"], "advantages", 1, float("nan"))
    assert validate_batch(bad, "advantage", cfg, step=4) is None  # not a multiple of 3
    _fails(validate_batch, bad, "advantage", cfg, step=6, column="advantages",
           expectation="expect_column_values_to_be_between", rows=[1])
    with pytest.raises(ConfigError, match="every_steps"):
        with_overrides(cfg, {"validation.every_steps": 0})


# ---------------------------------------------------------------------- pandas beside GX
def _both(frame, checks):
    """(the pandas pre-pass's outcomes, GX's) for ``checks`` on ``frame``."""
    from verl_core import validation as v

    return v._passing(frame, checks), v._judge(frame, checks, lambda c, i: f"row {i}")


def test_passing_data_gets_gxs_outcomes_without_gx(step0, dataset):
    """A passing frame is reported by the pandas pre-pass (GX not imported: its import is ~3.7 s
    of CPU in every process), with exactly the outcomes GX gives it: the real step's three
    stages, the real dataset, and each dtype and bound shape (a bound met exactly holds)."""
    import numpy as np
    import pandas as pd
    from verl_core import validation as v

    cfg = step0.cfg
    for stage, batch in step0.batches.items():
        frame = v.batch_frame(batch, np.arange(batch.num_rows))
        checks = v._batch_checks(cfg, stage, set(frame.columns),
                                 tuple(sorted(set(batch.data_source))))
        fast, gx = _both(frame, checks)
        assert fast is not None and fast == gx, stage
    df, tok = dataset
    frame, gt = v.dataset_frame(df, tok)
    checks = v._dataset_checks(cfg, gt, True, gt == "ground_truth")
    fast, gx = _both(frame, checks)
    assert fast is not None and fast == gx
    frame = pd.DataFrame({"i64": np.array([3, 7, 5]), "i32": np.array([-1, 0, 2], np.int32),
                          "u8": np.array([0, 9, 4], np.uint8),
                          "f32": np.array([0.1, 0.25, 1 / 3], np.float32),
                          "f64": np.array([-2.5, 1e-9, 0.75]), "s": ["a", "b", "c"]})
    checks = (v._Check("", "", "columns", columns=("i64", "s")),
              v._Check("", "", "rows", min_rows=3),
              v._Check("i64", "i64", "max met exactly", max_value=7),
              v._Check("i32", "i32", "both", min_value=-1, max_value=2.5),
              v._Check("u8", "u8", "min", min_value=0),
              v._Check("f32", "f32", "float32 max", max_value=0.5),
              v._Check("f64", "f64", "float64 both", min_value=-2.5, max_value=1.0))
    fast, gx = _both(frame, checks)
    assert fast is not None and fast == gx


@pytest.mark.parametrize("column,values,check", [
    ("x", [1.0, 2.0, 9.0], dict(max_value=5.0)),  # a bound broken
    ("x", [1.0, float("nan"), 2.0], dict(max_value=5.0)),  # NaN: GX's verdict, not pandas'
    ("x", [1.0, float("inf"), 2.0], dict(max_value=5.0)),
    ("x", [], dict(min_value=0)),  # an empty frame
    ("x", ["a", "b", "c"], dict(min_value=0)),  # not numeric
    ("y", [1, 2, 3], dict(min_value=0)),  # the checked column is missing
])
def test_anything_but_a_clear_pass_is_left_to_gx(column, values, check):
    """The pre-pass answers only for a frame that passes every check on numbers it can compare;
    a failure, a NaN, an empty or non-numeric column, a missing column: GX decides, and names
    the offending rows."""
    import pandas as pd
    from verl_core import validation as v

    frame = pd.DataFrame({"x": pd.Series(values, dtype=None if values else float)})
    checks = (v._Check(column, column, "bounded", **check),)
    assert v._passing(frame, checks) is None
    assert v._passing(frame, (v._Check("", "", "cols", columns=("x", "z")),)) is None
    assert v._passing(frame.iloc[:0], (v._Check("", "", "rows", min_rows=1),)) is None
