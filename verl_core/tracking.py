"""Experiment trackers users already watch: TensorBoard event files, MLflow and Weights & Biases.

Each is switched on by its field in ``tracking`` (:class:`~verl_core.config.TrackingConfig`) and is
fed the same scalars as the run's metrics table, at the same moment: when a step's record is
written (``runlog.record_step_metrics`` in the workflow, ``train.train`` in the plain
loop). The packages are optional (``pip install 'verl-flyte[tracking]'``) and imported only when
a tracker is switched on.

What belongs here: opening the trackers and writing scalars. What does not: deciding what is a
metric (the phases do) or anything that could change training.

Failure policy: a tracker that cannot be opened (package missing, an unusable URI) raises
:class:`TrackerError` naming the field and the fix, so a misconfigured run stops before it
trains. A write that fails later (a full disk, a database locked for too long) is logged and
skipped: the run store's metrics table stays the record, and a tracker hiccup never costs a run.
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Mapping

from verl_core.config import ConfigError, TrackingConfig

log = logging.getLogger(__name__)

NOT_SCALARS = ("step", "time")
"""Columns of the metrics table that index a record rather than measure something."""

INSTALL = "pip install 'verl-flyte[tracking]'"


def where(cfg: TrackingConfig) -> str:
    """``"; TensorBoard: <dir>; MLflow: <uri>; W&B: project <p>"`` for the trackers switched on
    ("" for none): what the run's last console line names beside the final model."""
    parts = [(label, value) for label, value in (
        ("TensorBoard", cfg.tensorboard_dir), ("MLflow", cfg.mlflow_tracking_uri),
        ("W&B project", cfg.wandb_project)) if value]
    return "".join(f"; {label}: {value}" for label, value in parts)


class TrackerError(ConfigError):
    """A switched-on tracker cannot be opened; the message names the field and the fix."""


def scalars(metrics: Mapping[str, object]) -> dict[str, float]:
    """The scalars of one metrics record: every numeric value except the index columns."""
    out = {}
    for k, v in metrics.items():
        if k in NOT_SCALARS or isinstance(v, bool) or not isinstance(v, (int, float)):
            continue
        out[k] = float(v)
    return out


def flat_params(config: Mapping, prefix: str = "") -> dict[str, str]:
    """``RunConfig.to_dict()`` as dotted keys (``optim.lr``), values as text (MLflow params)."""
    out = {}
    for k, v in config.items():
        if isinstance(v, Mapping):
            out.update(flat_params(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = str(v)
    return out


def _check_tensorboard_s3_endpoint(logdir: str) -> None:
    """TensorBoard writes ``s3://`` through its own boto3 client, which reads ``S3_ENDPOINT``
    (not fsspec, not ``VERL_S3_ENDPOINT``): refuse a logdir whose events would go to another S3
    service than the run's store (:func:`verl_core.store.resolve_storage_options`)."""
    from verl_core.store import resolve_storage_options

    want = (resolve_storage_options(logdir).get("client_kwargs") or {}).get("endpoint_url")
    have = os.environ.get("S3_ENDPOINT") or None
    if want != have:
        raise TrackerError(
            f"tracking.tensorboard_dir={logdir!r}: TensorBoard writes s3:// through its own "
            f"client, which reads S3_ENDPOINT ({have or 'unset: AWS'}), while the run's S3 "
            f"endpoint is {want or 'AWS'} (VERL_S3_ENDPOINT); set S3_ENDPOINT="
            f"{want or '(unset)'} too, or set tracking.tensorboard_dir to a local folder")


class _TensorBoard:
    """One event-file writer per process (TensorBoard merges the files of a log folder)."""

    def __init__(self, logdir: str):
        if logdir.startswith(("s3://", "s3a://")):
            _check_tensorboard_s3_endpoint(logdir)
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:  # torch's writer needs the tensorboard package
            raise TrackerError(f"tracking.tensorboard_dir={logdir!r} is set but the tensorboard "
                               f"package is not installed ({e}): {INSTALL}, or set "
                               "tracking.tensorboard_dir to ''") from e
        try:
            self.writer = SummaryWriter(log_dir=logdir)
        except OSError as e:
            raise TrackerError(f"tracking.tensorboard_dir: cannot write to {logdir!r} ({e}); "
                               "use a writable folder") from e
        self.logdir = logdir

    def log(self, step: int, values: dict[str, float], walltime: float) -> None:
        for k, v in values.items():
            self.writer.add_scalar(k, v, global_step=step, walltime=walltime)
        self.writer.flush()  # readers (tensorboard, other processes) see each step as it ends

    def close(self) -> None:
        self.writer.close()


class _MLflow:
    """One MLflow run per training run, found again by its ``verl.run_key`` tag, so every phase
    process (a Flyte task, a re-run after a crash) appends to the same run."""

    BATCH = 100  # MLflow's per-request limit on params (metrics: 1000)

    def __init__(self, uri: str, experiment: str, *, run_name: str, run_key: str,
                 params: Mapping[str, str], tags: Mapping[str, str]):
        try:
            from mlflow.entities import Param
            from mlflow.exceptions import MlflowException
            from mlflow.tracking import MlflowClient
        except ImportError as e:
            raise TrackerError(f"tracking.mlflow_tracking_uri={uri!r} is set but mlflow is not "
                               f"installed ({e}): {INSTALL}, or set tracking.mlflow_tracking_uri "
                               "to ''") from e
        try:
            self.client = MlflowClient(tracking_uri=uri)
            exp = self.client.get_experiment_by_name(experiment)
            exp_id = exp.experiment_id if exp else self._create_experiment(experiment)
            found = self.client.search_runs([exp_id], f"tags.`verl.run_key` = '{run_key}'",
                                            max_results=1)
            if found:
                self.run_id = found[0].info.run_id
            else:
                run = self.client.create_run(exp_id, run_name=run_name,
                                             tags={"verl.run_key": run_key, **tags})
                self.run_id = run.info.run_id
                items = [Param(k, v[:6000]) for k, v in params.items()]  # MLflow's value limit
                for i in range(0, len(items), self.BATCH):
                    self.client.log_batch(self.run_id, params=items[i:i + self.BATCH])
        except (MlflowException, ImportError, OSError) as e:  # ImportError: e.g. sqlalchemy
            raise TrackerError(
                f"tracking.mlflow_tracking_uri={uri!r}: MLflow cannot use it ({e}). Use a local "
                "store that needs no server, e.g. 'sqlite:///<folder>/mlflow.db' (needs "
                f"sqlalchemy: {INSTALL}), or an http(s):// server URI") from e
        self.uri = uri

    def _create_experiment(self, name: str) -> str:
        from mlflow.exceptions import MlflowException

        try:
            return self.client.create_experiment(name)
        except MlflowException:  # another process created it since we looked
            exp = self.client.get_experiment_by_name(name)
            if exp is None:
                raise
            return exp.experiment_id

    def log(self, step: int, values: dict[str, float], walltime: float) -> None:
        from mlflow.entities import Metric

        ms = int(walltime * 1000)
        items = [Metric(k, v, ms, step) for k, v in values.items()]
        for i in range(0, len(items), 1000):
            self.client.log_batch(self.run_id, metrics=items[i:i + 1000])

    def close(self) -> None:
        pass  # the run stays open: later phases (or a resumed run) append to it


class _Wandb:
    """One Weights & Biases run per training run: its id is the run's key, opened with
    ``resume="allow"``, so every phase process (a Flyte task, a re-run after a crash) appends to
    the same run. ``WANDB_MODE=offline`` needs no server (``wandb sync`` uploads later);
    ``WANDB_API_KEY``, ``WANDB_ENTITY`` and ``WANDB_DIR`` are wandb's own.

    The x-axis is the metric ``step`` (updates applied), not wandb's internal ``_step``: a
    resumed process (every phase on a cluster) restarts ``_step`` from the server's last row and
    would drop a record of a step it already has, e.g. the evaluation of step k logged after the
    update task logged step k."""

    def __init__(self, project: str, run_name: str, *, run_key: str, params: Mapping[str, str],
                 tags: Mapping[str, str]):
        try:
            import wandb
        except ImportError as e:
            raise TrackerError(f"tracking.wandb_project={project!r} is set but wandb is not "
                               f"installed ({e}): {INSTALL}, or set tracking.wandb_project to "
                               "'' (verl: leave 'wandb' out of trainer.logger)") from e
        # wandb's summary table at the end of every phase process would bury the step lines;
        # WANDB_QUIET / WANDB_SILENT, when set, decide instead
        quiet = not ({"WANDB_QUIET", "WANDB_SILENT"} & set(os.environ))
        try:
            self.run = wandb.init(
                project=project, name=run_name, id=re.sub(r"[^A-Za-z0-9_-]", "-", run_key)[:64],
                resume="allow", config={**params, **tags}, reinit="create_new",
                # wandb reads its environment once per process; a run opened later in the same
                # process (a second run of a notebook, a test) follows the environment of now
                mode=os.environ.get("WANDB_MODE") or None, dir=os.environ.get("WANDB_DIR") or None,
                settings=wandb.Settings(quiet=True) if quiet else None)
        except Exception as e:  # noqa: BLE001 - wandb raises its own types (no login, network)
            raise TrackerError(
                f"tracking.wandb_project={project!r}: wandb cannot open a run ({type(e).__name__}: "
                f"{e}). Log in (wandb login, or WANDB_API_KEY), or set WANDB_MODE=offline to "
                "write the run locally and upload it later with wandb sync") from e
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")

    def log(self, step: int, values: dict[str, float], walltime: float) -> None:
        self.run.log({**values, "step": step})

    def close(self) -> None:
        self.run.finish()  # flushes; a later process resumes the run by its id


class Trackers:
    """The switched-on trackers of one run. ``log`` writes one metrics record to each."""

    def __init__(self, cfg: TrackingConfig, *, run_name: str, config_hash: str, run_key: str,
                 params: Mapping[str, str] | None = None):
        self.sinks: list = []
        try:
            if cfg.tensorboard_dir:
                # one sub-folder per run: `tensorboard --logdir <tensorboard_dir>` lists each run
                logdir = f"{cfg.tensorboard_dir.rstrip('/')}/{run_name}-{config_hash[:8]}"
                self.sinks.append(_TensorBoard(logdir))
            if cfg.mlflow_tracking_uri:
                self.sinks.append(_MLflow(
                    cfg.mlflow_tracking_uri, cfg.mlflow_experiment, run_name=run_name,
                    run_key=run_key, params=params or {},
                    tags={"verl.config_hash": config_hash}))
            if cfg.wandb_project:
                self.sinks.append(_Wandb(cfg.wandb_project, cfg.wandb_run_name or run_name,
                                         run_key=run_key, params=params or {},
                                         tags={"verl.config_hash": config_hash}))
        except BaseException:
            self.close()
            raise

    @property
    def enabled(self) -> bool:
        return bool(self.sinks)

    def log(self, step: int, metrics: Mapping[str, object], walltime: float | None = None) -> None:
        """Write the scalars of one record (``step`` is the number of updates applied)."""
        values = scalars(metrics)
        if not values:
            return
        walltime = time.time() if walltime is None else walltime
        for sink in self.sinks:
            try:
                sink.log(step, values, walltime)
            except Exception as e:  # noqa: BLE001 - see the module docstring's failure policy
                log.warning("%s: writing step %d failed (%s: %s); the run store's metrics table "
                            "still has it", type(sink).__name__.strip("_"), step,
                            type(e).__name__, e)

    def close(self) -> None:
        for sink in self.sinks:
            try:
                sink.close()
            except Exception as e:  # noqa: BLE001
                log.warning("closing %s failed: %s", type(sink).__name__.strip("_"), e)
        self.sinks = []


def default_run_name(path: str) -> str:
    """The last segment of a store URI or work folder: what trackers show as the run's name."""
    return os.path.basename(path.rstrip("/")) or "run"
