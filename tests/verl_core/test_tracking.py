"""TensorBoard, MLflow and W&B hold the same scalars as the metrics table, read back with each
library's own reader (W&B offline: its run file, as `wandb sync` reads it): from the workflow's
phases (the shared real run, tests/verl_core/conftest.py) and from the plain loop. A tracker that
cannot be opened names the field and the fix."""
import glob
import json
import math
import os
import struct
import sys

import numpy as np
import pytest

from tests.presets import tiny_run
from verl_core.config import ConfigError, RunConfig, TrackingConfig, with_overrides
from verl_core import runlog
from verl_core.tracking import NOT_SCALARS, Trackers, TrackerError
from verl_core.verl_keys import to_ours

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


def _wandb_records(wandb_dir: str):
    """Every record of the offline W&B runs under ``wandb_dir``, oldest run first. A run file is
    a LevelDB-style log (wandb's datastore): a 7-byte header (``:W&B``, magic, version), then
    32 KiB blocks of chunks, each ``crc32 (4) | length (2) | type (1)`` + data, a record split
    over FIRST (2) / MIDDLE (3) / LAST (4) chunks or whole in one FULL (1) chunk; a block's
    tail shorter than a chunk header is zero padding. Each record is a ``wandb_internal`` proto."""
    from wandb.proto import wandb_internal_pb2 as pb

    files = sorted(glob.glob(os.path.join(wandb_dir, "wandb", "offline-run-*", "run-*.wandb")))
    assert files, f"no offline W&B run under {wandb_dir}"
    for path in files:
        data = open(path, "rb").read()
        assert data[:4] == b":W&B", path
        pos, parts = 7, b""
        while pos + 7 <= len(data):
            left = 32768 - pos % 32768
            _, n, kind = struct.unpack("<IHB", data[pos:pos + 7]) if left >= 7 else (0, 0, 0)
            if kind == 0:  # padding to the block's end
                pos += left
                continue
            parts += data[pos + 7:pos + 7 + n]
            pos += 7 + n
            if kind in (1, 4):
                record = pb.Record()
                record.ParseFromString(parts)
                parts = b""
                yield record


def _wandb(wandb_dir: str) -> tuple[list, dict[str, dict[int, float]]]:
    """(the run records, {metric: {step: value}} of every history row, x-axis ``step``)."""
    runs, got = [], {}
    for r in _wandb_records(wandb_dir):
        kind = r.WhichOneof("record_type")
        if kind == "run":
            runs.append(r.run)
        elif kind == "history":
            # wandb writes a flat key as a one-element nested_key
            row = {i.key or ".".join(i.nested_key): json.loads(i.value_json)
                   for i in r.history.item}
            for k, v in row.items():
                if not k.startswith("_") and k != "step":
                    got.setdefault(k, {})[int(row["step"])] = float(v)
    return runs, got


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
    logdir = f"{tracked_run.tensorboard_dir}/tracked-{spec.trajectory_hash[:8]}"
    _same(_table_values(tracked_run.table), _tensorboard(logdir), as_float32=True)


@pytest.mark.slow
def test_mlflow_run_holds_the_metrics_table_and_the_config(tracked_run):
    spec, uri = tracked_run.spec, tracked_run.mlflow_uri
    run = _only_run(uri)
    assert run.info.run_name == "tracked"
    assert run.data.tags["verl.config_hash"] == spec.trajectory_hash
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
def test_wandb_run_holds_the_metrics_table_and_the_config(tracked_run):
    spec = tracked_run.spec
    runs, got = _wandb(tracked_run.wandb_dir)
    run = runs[0]
    assert (run.project, run.display_name) == ("verl-tests", "tracked")
    config = {i.key or ".".join(i.nested_key): json.loads(i.value_json)
              for i in run.config.update}
    assert config["optim.lr"] == str(spec.config.optim.lr)  # logged once, as MLflow's params
    assert config["verl.config_hash"] == spec.trajectory_hash
    expected = _table_values(tracked_run.table)
    assert set(got) == set(expected)
    _same(expected, got, as_float32=False)  # JSON keeps the float64 itself
    assert math.isnan(got["actor/grad_norm"][tracked_run.nan_grad_step + 1])  # the skipped update


@pytest.mark.slow
def test_a_new_phase_process_appends_to_the_same_tracker_runs(tracked_run, monkeypatch):
    """Every Flyte task is a fresh process on a cluster: its trackers find the run again (MLflow
    by its tag, W&B by its id, resumed)."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", tracked_run.wandb_dir)
    run = _only_run(tracked_run.mlflow_uri)
    [first] = {r.run_id for r in _wandb(tracked_run.wandb_dir)[0]}
    runlog.TRACKERS.reset()  # forget this process's open trackers, as a new process would
    try:
        fresh = runlog.TRACKERS.of(tracked_run.spec)
        [mlflow_sink] = [s for s in fresh.sinks if hasattr(s, "run_id")]
        assert mlflow_sink.run_id == run.info.run_id
        [wandb_sink] = [s for s in fresh.sinks if type(s).__name__ == "_Wandb"]
        assert wandb_sink.run.id == first
    finally:
        runlog.TRACKERS.reset()
    assert _only_run(tracked_run.mlflow_uri).info.run_id == run.info.run_id
    assert {r.run_id for r in _wandb(tracked_run.wandb_dir)[0]} == {first}


@pytest.mark.slow
def test_plain_loop_writes_its_history_to_every_tracker(tmp_path, monkeypatch):
    from verl_core.train import train

    monkeypatch.setenv("VERL_ASSET_CACHE", str(tmp_path / "assets"))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cfg = tiny_run("rloo", **{
        "total_steps": 2, "actor.ppo_mini_batch_size": 8, "actor.ppo_micro_batch_size": 32,
        "tracking.tensorboard_dir": str(tmp_path / "tb"), "tracking.mlflow_tracking_uri": uri,
        **to_ours({"trainer.logger": ["console", "wandb"], "trainer.project_name": "p",
                   "trainer.experiment_name": "e"})})
    logs: list[str] = []
    summary = train(cfg, str(tmp_path / "work"), log=logs.append)
    # the last line names where to look, each tracker included
    assert f"; TensorBoard: {tmp_path / 'tb'}; MLflow: {uri}; W&B project: p; run store: " \
        in logs[-1], logs[-1]
    # the records: the start evaluation at step 0, then each step's metrics (end eval merged),
    # as the phases record them (the workflow's records); the step's own wall time and its
    # checkpoint phase's are the driver's timing, in its history only
    expected: dict[str, dict[int, float]] = {}
    records = [(0, {"val/accuracy": summary["start_accuracy"]})] + \
        [(int(h["step"]), h) for h in summary["history"]]
    for step, rec in records:
        for k, v in rec.items():
            if k not in (*NOT_SCALARS, "timing/step_s", "timing/checkpoint_s") and \
                    isinstance(v, float):
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
    runs, got = _wandb(str(tmp_path))
    assert [(r.project, r.display_name) for r in runs] == [("p", "e")]  # verl's names
    assert set(got.pop("val/response_length")) == {0, 2}
    assert set(got) == set(expected)
    _same(expected, got, as_float32=False)


def test_unusable_mlflow_uri_names_the_field_and_a_store_that_works(tmp_path):
    cfg = TrackingConfig(mlflow_tracking_uri="nosuchscheme://x")
    with pytest.raises(TrackerError, match=r"tracking.mlflow_tracking_uri='nosuchscheme://x': "
                                           r"MLflow cannot use it .*'sqlite:///<folder>/mlflow"):
        Trackers(cfg, run_name="r", config_hash="0" * 64, run_key="k")


@pytest.mark.parametrize("module,field", [("mlflow", "mlflow_tracking_uri"),
                                          ("torch.utils.tensorboard", "tensorboard_dir"),
                                          ("wandb", "wandb_project")])
def test_missing_package_names_the_extra(tmp_path, monkeypatch, module, field):
    for name in [m for m in sys.modules if m.startswith(f"{module}.")] + [module]:
        monkeypatch.setitem(sys.modules, name, None)  # what `import` sees when it is missing
    cfg = TrackingConfig(**{field: f"sqlite:///{tmp_path}/m.db" if "mlflow" in field
                            else "p" if "wandb" in field else str(tmp_path / "tb")})
    with pytest.raises(TrackerError, match=rf"tracking.{field}=.* is set but .* not installed "
                                           r".*pip install 'verl-flyte\[tracking\]'"):
        Trackers(cfg, run_name="r", config_hash="0" * 64, run_key="k")
    assert isinstance(TrackerError("x"), ConfigError)  # the CLI reports it and exits 2


def test_trackers_never_change_the_trajectory():
    on = with_overrides(RunConfig(), {"tracking.tensorboard_dir": "/tmp/tb",
                                      "tracking.mlflow_tracking_uri": "sqlite:///m.db",
                                      "tracking.wandb_project": "p"})
    assert on.trajectory_hash() == RunConfig().trajectory_hash()  # same checkpoints, lineage
    assert on.full_hash() != RunConfig().full_hash()
    with pytest.raises(ConfigError, match=r"tracking.mlflow_experiment='': must name"):
        TrackingConfig(mlflow_experiment="")


def test_tensorboard_on_s3_must_use_the_runs_endpoint(monkeypatch):
    """TensorBoard's own S3 client reads S3_ENDPOINT, not VERL_S3_ENDPOINT: with only the
    variable of docs/cluster.md set its events would go to AWS, so the tracker refuses to open."""
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


def test_verl_logger_wandb_names_the_project_and_run():
    """verl's ``trainer.logger=['console','wandb']`` switches W&B on under verl's names."""
    got = to_ours({"trainer.logger": ["console", "wandb"], "trainer.project_name": "gsm8k-rl",
                   "trainer.experiment_name": "qwen-grpo"})
    assert got == {"tracking.wandb_project": "gsm8k-rl", "tracking.wandb_run_name": "qwen-grpo"}
    # verl's default project when none is given; the run's own name when no experiment is
    assert to_ours({"trainer.logger": "wandb"}) == {"tracking.wandb_project": "verl_examples"}
    assert to_ours({"trainer.logger": ["console"]}) == {}
    with pytest.raises(ConfigError, match=r"trainer.logger=\['console', 'swanlab'\]: "
                                          r"\['swanlab'\] not offered here"):
        to_ours({"trainer.logger": ["console", "swanlab"]})


def test_wandb_without_a_login_says_how_to_log_in_or_go_offline(tmp_path, monkeypatch):
    for k in ("WANDB_MODE", "WANDB_API_KEY"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc: nobody is logged in
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    import wandb

    wandb.teardown()  # wandb keeps the settings of its first run in a process (offline, above)
    with pytest.raises(TrackerError, match=r"tracking.wandb_project='p': wandb cannot open a run "
                                           r"\(UsageError: No API key.*WANDB_MODE=offline"):
        Trackers(TrackingConfig(wandb_project="p"), run_name="r", config_hash="0" * 64,
                 run_key="k")
