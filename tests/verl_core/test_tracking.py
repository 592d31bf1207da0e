"""TensorBoard and MLflow hold the same scalars as the metrics table, read back with each
library's own reader: from the workflow's phases (the shared real run, tests/verl_core/conftest.py)
and from the plain loop. A tracker that cannot be opened names the field and the fix."""
import math
import sys

import numpy as np
import pytest

from verl_core.config import ConfigError, RunConfig, TrackingConfig, preset, with_overrides
from verl_core.engine import runtime
from verl_core.tracking import NOT_SCALARS, Trackers, TrackerError

EXPERIMENT = TrackingConfig().mlflow_experiment


def _table_values(table) -> dict[str, dict[int, float]]:
    """{column: {step: value}} of the metrics table. A NaN cell is either a step that did not
    record the column or a recorded NaN (a skipped update's gradient norm): both are kept."""
    return {col: {int(s): float(v) for s, v in zip(table["step"], table[col])}
            for col in table.columns if col not in NOT_SCALARS}


def _tensorboard(logdir: str) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(logdir, size_guidance={"scalars": 0})  # 0: keep every event
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def _mlflow(uri: str, run_id: str, keys) -> dict[str, dict[int, float]]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    return {k: {m.step: m.value for m in client.get_metric_history(run_id, k)} for k in keys}


def _only_run(uri: str):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name(EXPERIMENT)
    runs = client.search_runs([exp.experiment_id])
    assert len(runs) == 1, [r.info.run_name for r in runs]
    return runs[0]


def _same(expected: dict, got: dict, *, as_float32: bool) -> None:
    """The tracker holds every recorded value of ``expected`` and nothing else: a number exactly
    (TensorBoard stores float32 ``simple_value``s, so the exact expectation is the value rounded
    to float32; MLflow stores the float64 itself); a NaN cell matches a NaN or no entry."""
    assert set(got) <= set(expected), set(got) - set(expected)
    for key, by_step in expected.items():
        want = {s: float(np.float32(v)) if as_float32 else v for s, v in by_step.items()}
        have = got.get(key, {})
        assert set(have) <= set(want), (key, set(have) - set(want))
        for s, v in want.items():
            if math.isnan(v):
                assert s not in have or math.isnan(have[s]), (key, s, have[s])
            else:
                assert have.get(s) == v, (key, s, have.get(s), v)


@pytest.mark.slow
def test_tensorboard_event_files_hold_the_metrics_table(tracked_run):
    spec = tracked_run.spec
    logdir = f"{tracked_run.tensorboard_dir}/tracked-{spec.config_hash[:8]}"
    _same(_table_values(tracked_run.table), _tensorboard(logdir), as_float32=True)


@pytest.mark.slow
def test_mlflow_run_holds_the_metrics_table_and_the_config(tracked_run):
    spec, uri = tracked_run.spec, tracked_run.mlflow_uri
    run = _only_run(uri)
    assert run.info.run_name == "tracked"
    assert run.data.tags["verl.config_hash"] == spec.config_hash
    assert run.data.params["optim.lr"] == str(spec.config.optim.lr)
    assert run.data.params["algorithm.adv_estimator"] == "grpo"
    expected = _table_values(tracked_run.table)
    assert set(run.data.metrics) == set(expected)
    _same(expected, _mlflow(uri, run.info.run_id, expected), as_float32=False)
    # the skipped update (guard) reported a NaN gradient norm: the trackers hold it as such
    skipped = tracked_run.nan_grad_step + 1
    grad_norm = _mlflow(uri, run.info.run_id, ["actor/grad_norm"])["actor/grad_norm"]
    assert math.isnan(grad_norm[skipped])


@pytest.mark.slow
def test_a_new_phase_process_appends_to_the_same_mlflow_run(tracked_run):
    """Every Flyte task is a fresh process on a cluster: its trackers find the run again."""
    run = _only_run(tracked_run.mlflow_uri)
    runtime.release_workers()  # forget this process's open trackers, as a new process would
    try:
        fresh = runtime.trackers_for(tracked_run.spec)
        [mlflow_sink] = [s for s in fresh.sinks if hasattr(s, "run_id")]
        assert mlflow_sink.run_id == run.info.run_id
    finally:
        runtime.release_workers()
    assert _only_run(tracked_run.mlflow_uri).info.run_id == run.info.run_id


@pytest.mark.slow
def test_plain_loop_writes_its_history_to_both_trackers(tmp_path, monkeypatch):
    from verl_core.train import train

    monkeypatch.setenv("VERL_ASSET_CACHE", str(tmp_path / "assets"))
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cfg = preset("rloo", **{
        "total_steps": 2, "model.warmup_sft_steps": 5, "model.warmup_target_accuracy": 1.0,
        "data.synthetic_train_size": 64, "data.synthetic_val_size": 8,
        "data.train_batch_size": 8, "rollout.n": 4, "actor.ppo_mini_batch_size": 8,
        "actor.ppo_micro_batch_size": 32, "num_threads": 1,
        "tracking.tensorboard_dir": str(tmp_path / "tb"), "tracking.mlflow_tracking_uri": uri})
    summary = train(cfg, str(tmp_path / "work"), log=lambda *_: None)
    # the records: the start evaluation at step 0, then each step's metrics (end eval merged)
    expected: dict[str, dict[int, float]] = {}
    records = [(0, {"val/accuracy": summary["start_accuracy"]})] + \
        [(int(h["step"]), h) for h in summary["history"]]
    for step, rec in records:
        for k, v in rec.items():
            if k not in NOT_SCALARS and isinstance(v, float):
                expected.setdefault(k, {})[step] = v
    tb = _tensorboard(f"{tmp_path / 'tb'}/work-{cfg.trajectory_hash()[:8]}")
    # the summary keeps only the start accuracy of the step-0 evaluation: its response length is
    # checked for presence, everything else value by value
    assert set(tb.pop("val/response_length")) == {0, 2}
    expected.pop("val/response_length")
    _same(expected, tb, as_float32=True)
    run = _only_run(uri)
    assert run.info.run_name == "work"
    got = _mlflow(uri, run.info.run_id, set(expected) | {"val/response_length"})
    assert set(got.pop("val/response_length")) == {0, 2}
    _same(expected, got, as_float32=False)


def test_unusable_mlflow_uri_names_the_field_and_a_store_that_works(tmp_path):
    cfg = TrackingConfig(mlflow_tracking_uri="nosuchscheme://x")
    with pytest.raises(TrackerError, match=r"tracking.mlflow_tracking_uri='nosuchscheme://x': "
                                           r"MLflow cannot use it .*'sqlite:///<folder>/mlflow"):
        Trackers(cfg, run_name="r", config_hash="0" * 64, run_key="k")


@pytest.mark.parametrize("module,field", [("mlflow", "mlflow_tracking_uri"),
                                          ("torch.utils.tensorboard", "tensorboard_dir")])
def test_missing_package_names_the_extra(tmp_path, monkeypatch, module, field):
    for name in [m for m in sys.modules if m.startswith(f"{module}.")] + [module]:
        monkeypatch.setitem(sys.modules, name, None)  # what `import` sees when it is missing
    cfg = TrackingConfig(**{field: f"sqlite:///{tmp_path}/m.db" if "mlflow" in field
                            else str(tmp_path / "tb")})
    with pytest.raises(TrackerError, match=rf"tracking.{field}=.* is set but .* not installed "
                                           r".*pip install 'verl-flyte\[tracking\]'"):
        Trackers(cfg, run_name="r", config_hash="0" * 64, run_key="k")
    assert isinstance(TrackerError("x"), ConfigError)  # the CLI reports it and exits 2


def test_trackers_never_change_the_trajectory():
    on = with_overrides(RunConfig(), {"tracking.tensorboard_dir": "/tmp/tb",
                                      "tracking.mlflow_tracking_uri": "sqlite:///m.db"})
    assert on.trajectory_hash() == RunConfig().trajectory_hash()  # same checkpoints, lineage
    assert on.config_hash() != RunConfig().config_hash()
    with pytest.raises(ConfigError, match=r"tracking.mlflow_experiment='': must name"):
        TrackingConfig(mlflow_experiment="")


def test_tensorboard_on_s3_must_use_the_runs_endpoint(monkeypatch):
    """TensorBoard's own S3 client reads S3_ENDPOINT, not VERL_S3_ENDPOINT: with only the
    README's variable set its events would go to AWS, so the tracker refuses to open."""
    monkeypatch.setenv("VERL_S3_ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    monkeypatch.delenv("S3_ENDPOINT", raising=False)
    cfg = TrackingConfig(tensorboard_dir="s3://bkt/tb")
    with pytest.raises(TrackerError, match=r"tracking.tensorboard_dir='s3://bkt/tb/r-0+': .*"
                                           r"S3_ENDPOINT \(unset: AWS\).* is http://127.0.0.1:9 "
                                           r".*set S3_ENDPOINT=http://127.0.0.1:9 too"):
        Trackers(cfg, run_name="r", config_hash="0" * 64, run_key="k")
    monkeypatch.setenv("S3_ENDPOINT", "http://127.0.0.1:10")
    with pytest.raises(TrackerError, match=r"reads S3_ENDPOINT \(http://127.0.0.1:10\)"):
        Trackers(cfg, run_name="r", config_hash="0" * 64, run_key="k")
