"""The RunSpec literal (``tasks/common.py``'s TypeTransformer): one canonical JSON string that
holds the config as its non-default fields; every task gets back an equal spec, and a change of
any field, default or not, changes the literal (hence every cache key)."""
import dataclasses
import json

import pytest
from flytekit.core.context_manager import FlyteContextManager
from flytekit.core.type_engine import TypeEngine

import tasks.common  # noqa: F401 - registers the transformer
from verl_core.config import ADVANTAGE_ESTIMATORS, RunConfig, preset, with_overrides
from verl_core.engine.runtime import RunSpec


def _spec(cfg: RunConfig) -> RunSpec:
    return RunSpec(store="/runs/t", incarnation="a" * 32, config=cfg,
                   config_hash=cfg.trajectory_hash(), assets_json='{"model": {}}',
                   start_step=3, total_steps=cfg.total_steps)


def _roundtrip(spec: RunSpec) -> tuple[RunSpec, str]:
    ctx = FlyteContextManager.current_context()
    lit = TypeEngine.to_literal(ctx, spec, RunSpec, TypeEngine.to_literal_type(RunSpec))
    return TypeEngine.to_python_value(ctx, lit, RunSpec), lit.scalar.primitive.string_value


@pytest.mark.parametrize("algorithm", ["ppo", *ADVANTAGE_ESTIMATORS.names(include_aliases=True)])
def test_every_preset_crosses_tasks_unchanged(algorithm):
    spec = _spec(preset(algorithm, **{"optim.lr": 1e-4, "reward.timeout_s": 2.5,
                                      "tracking.tensorboard_dir": "/tb"}))
    back, text = _roundtrip(spec)
    assert back == spec and back.config.to_dict() == spec.config.to_dict()
    assert back.to_json() == text == spec.to_json()  # canonical: the same text every time
    assert json.loads(text)["config"]["optim"] == {"lr": 1e-4}  # only what differs


def test_the_literal_changes_with_any_field_and_not_otherwise():
    base = _spec(preset("grpo"))
    assert base.to_json() == _spec(preset("grpo")).to_json()
    assert json.loads(base.to_json())["config"] == preset("grpo").non_default()
    changed = set()
    # trajectory fields and others (left out of config_hash), each moved off its default
    for key in ("rollout.temperature", "validation.every_steps", "cluster.idle_timeout_s",
                "guard.phase_timeout_s"):
        section, name = key.split(".")
        value = getattr(getattr(base.config, section), name)
        other = dataclasses.replace(base, config=with_overrides(base.config, {key: value * 2}))
        assert json.loads(other.to_json())["config"][section] == {name: value * 2}
        changed.add(other.to_json())
    assert len(changed) == 4 and base.to_json() not in changed
