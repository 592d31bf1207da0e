"""``checkpoint.keep_best`` (issue 40): the checkpoint of the best evaluated step by a named
held-out metric is recorded in ``best.json``, kept through retention and gc, and exported by the
CLI as ``best``. A real run of the plain loop."""
import json
import os

import pytest

from tests.presets import tiny_run
from verl_core.checkpoint.__main__ import main as checkpoint_cli
from verl_core.checkpoint.manager import CheckpointManager
from verl_core.config import ConfigError
from verl_core.store import RunStore
from verl_core.train import train

BEST = {"total_steps": 4, "eval_every": 1, "checkpoint.checkpoint_interval": 1,
        "checkpoint.keep_last": 1, "checkpoint.gc_grace_s": 0.0, "val_before_train": False,
        "checkpoint.keep_best": "val/accuracy", "checkpoint.keep_best_higher": False}


def test_keep_best_needs_a_checkpoint_at_every_evaluation():
    with pytest.raises(ConfigError, match=r"checkpoint.keep_best='val/accuracy': needs a "
                       r"checkpoint at every evaluated step: set eval_every to a multiple of "
                       r"checkpoint.checkpoint_interval=2 \(it is 3\)"):
        tiny_run(**{**BEST, "eval_every": 3, "checkpoint.checkpoint_interval": 2})
    with pytest.raises(ConfigError, match="name a held-out metric"):
        tiny_run(**{**BEST, "checkpoint.keep_best": "accuracy"})


@pytest.mark.slow
def test_the_best_step_is_kept_through_retention_and_exported(tmp_path):
    store = tmp_path / "store"
    # lower is better here, so the best is early while retention (keep_last=1) moves on
    summary = train(tiny_run(**BEST), str(store), log=lambda *_: None)
    values = {int(k): v["val/accuracy"] for k, v in summary["evaluations"].items()}
    best_step = min(values, key=lambda k: (values[k], k))  # a tie keeps the earlier step
    doc = json.loads((store / "best.json").read_text())
    assert (doc["step"], doc["metric"], doc["value"]) == (best_step, "val/accuracy",
                                                          values[best_step])
    kept = sorted(i.step for i in CheckpointManager(RunStore(str(store))).list_checkpoints())
    assert kept == sorted({best_step, 4}), (kept, values)
    out = tmp_path / "best-export"
    assert checkpoint_cli(["export", str(store), "best", str(out)]) == 0
    assert os.path.isfile(out / "model.safetensors")
