"""A real short run, shared by the report and tracker tests: the workflow's phases called in
process through ``engine.runtime`` (the functions the Flyte tasks call), on the tiny model, with
TensorBoard and MLflow switched on and a real guard event (NaN gradients injected into one
update: VERL_FAULTS ``nan_grad``, which the guard skips)."""
import json
from dataclasses import dataclass

import pytest

from verl_core.config import preset
from verl_core.engine import runtime

TRACKED_STEPS = 3
NAN_GRAD_STEP = 1
"""The update whose gradients are poisoned: the guard skips it and records an event."""


@dataclass
class TrackedRun:
    spec: runtime.RunSpec
    steps: int
    nan_grad_step: int
    tensorboard_dir: str
    mlflow_uri: str
    table: object  # pandas DataFrame: runtime.metrics_table after the run


def _evaluate(spec, step):
    runtime.record_step_metrics(spec, step, runtime.call_worker(spec, "evaluate", step))


@pytest.fixture(scope="session")
def tracked_run(tmp_path_factory) -> TrackedRun:
    tmp = tmp_path_factory.mktemp("tracked-run")
    cfg = preset("grpo", **{
        "total_steps": TRACKED_STEPS, "model.warmup_sft_steps": 5,
        "model.warmup_target_accuracy": 1.0, "data.synthetic_train_size": 64,
        "data.synthetic_val_size": 12, "data.train_batch_size": 8, "rollout.n": 4,
        "actor.ppo_mini_batch_size": 4, "actor.ppo_micro_batch_size": 16,
        "checkpoint.checkpoint_interval": 2, "checkpoint.async_save": False, "num_threads": 1,
        "algorithm.entropy_coeff": 0.001,  # so the entropy is computed (and plotted)
        "tracking.tensorboard_dir": str(tmp / "tb"),
        "tracking.mlflow_tracking_uri": f"sqlite:///{tmp / 'mlflow.db'}"})
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VERL_ASSET_CACHE", str(tmp / "assets"))
        mp.setenv("VERL_FAULTS_DIR", str(tmp / "faults"))
        mp.setenv("VERL_FAULTS", json.dumps([{"kind": "nan_grad", "phase": "update",
                                              "step": NAN_GRAD_STEP}]))
        spec = runtime.prepare_run(cfg, str(tmp / "store"), "tracked", log_fn=lambda *_: None)
        try:
            _evaluate(spec, 0)  # what workflows/ppo.py's rl_run does, phase by phase
            for s in range(TRACKED_STEPS):
                ref, m = runtime.call_worker(spec, "rollout", s)
                ref, m2 = runtime.reward_phase(spec, s, ref)
                ref, m3 = runtime.advantage_phase(spec, s, ref)
                m4 = runtime.call_worker(spec, "update", s, ref)
                m5 = runtime.checkpoint_phase(spec, s + 1)
                runtime.record_step_metrics(spec, s + 1, {**m, **m2, **m3, **m4, **m5})
            _evaluate(spec, TRACKED_STEPS)
            runtime.finalize_run(spec, TRACKED_STEPS)
        finally:
            runtime.release_workers()  # closes the trackers too
    return TrackedRun(spec=spec, steps=TRACKED_STEPS, nan_grad_step=NAN_GRAD_STEP,
                      tensorboard_dir=str(tmp / "tb"),
                      mlflow_uri=f"sqlite:///{tmp / 'mlflow.db'}",
                      table=runtime.metrics_table(spec))
