"""The literals tasks exchange (``tasks/common.py``'s TypeTransformers). RunSpec: one canonical
JSON string that holds the config as its non-default fields; every task gets back an equal spec,
and a change of any field, default or not, changes the literal (hence every cache key). PhaseOut
and StepState: flytekit's own dataclass literals, converted without its generic walk."""
import dataclasses
import hashlib
import json
import random

import pytest
from flytekit.core.context_manager import FlyteContextManager
from flytekit.core.type_engine import DataclassTransformer, TypeEngine

import tasks.common  # noqa: F401 - registers the transformer
from verl_core.config import ADVANTAGE_ESTIMATORS, RunConfig, preset, with_overrides
from verl_core.types import PhaseOut, RunSpec, StepState


def _spec(cfg: RunConfig) -> RunSpec:
    return RunSpec(store="/runs/t", incarnation="a" * 32, config=cfg,
                   trajectory_hash=cfg.trajectory_hash(), assets_json='{"model": {}}',
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
    # trajectory fields and others (left out of trajectory_hash), each moved off its default
    for key in ("rollout.temperature", "validation.every_steps", "cluster.idle_timeout_s",
                "guard.phase_timeout_s"):
        section, name = key.split(".")
        value = getattr(getattr(base.config, section), name)
        other = dataclasses.replace(base, config=with_overrides(base.config, {key: value * 2}))
        assert json.loads(other.to_json())["config"][section] == {name: value * 2}
        changed.add(other.to_json())
    assert len(changed) == 4 and base.to_json() not in changed


def test_the_literal_is_as_before_the_trajectory_hash_rename():
    """RunSpec.trajectory_hash crosses as ``config_hash``: the literal text (so every cache
    key) of a fixed spec is the one it had before the field was renamed (at 79f3ce0)."""
    cfg = preset("grpo", **{"optim.lr": 1e-4})
    text = _spec(cfg).to_json()
    assert json.loads(text)["config_hash"] == cfg.trajectory_hash()
    assert hashlib.sha256(text.encode()).hexdigest() == \
        "b4c57f6b94b807a585638cbf8c9045f3146ed9f95c8d05e9a6f9386a8226dca9"
    assert RunSpec.from_json(text) == _spec(cfg)


def test_a_spec_converts_its_config_once():
    spec = _spec(preset("grpo"))
    assert spec.to_json() is spec.to_json()  # cached on the (frozen) spec
    moved = dataclasses.replace(spec, start_step=4)
    assert json.loads(moved.to_json())["start_step"] == 4  # a new spec, a new literal


def _phase_results(seed: int):
    """PhaseOut and StepState values with metric maps of every size and awkward floats."""
    rng = random.Random(seed)
    odd = [0.0, -0.0, 1e-310, 1.0, float("inf"), float("-inf"), 2.0 ** 60]
    for _ in range(50):
        metrics = {f"m{j}/{rng.random()}": rng.choice([rng.gauss(0, 1e3), *odd])
                   for j in range(rng.randint(0, 40))}
        yield PhaseOut(step=rng.randint(0, 10 ** 6), batch=f"{rng.getrandbits(256):064x}",
                       metrics=metrics)
        yield StepState(step=rng.randint(0, 10 ** 6), metrics=metrics)


def test_phase_results_are_flytekits_own_dataclass_literals():
    """tasks/common.py converts PhaseOut/StepState without flytekit's generic walk; the literal
    type and the value bytes must stay exactly flytekit's (cache keys, cluster type checks)."""
    ctx = FlyteContextManager.current_context()
    flytekits = DataclassTransformer()
    for value in _phase_results(0):
        t = type(value)
        assert type(TypeEngine.get_transformer(t)) is not DataclassTransformer
        lt = TypeEngine.to_literal_type(t)
        assert lt == flytekits.get_literal_type(t)
        lit = TypeEngine.to_literal(ctx, value, t, lt)
        assert lit == flytekits.to_literal(ctx, value, t, lt)
        back = TypeEngine.to_python_value(ctx, lit, t)
        assert type(back) is t and back == value
        assert flytekits.to_python_value(ctx, lit, t) == value


def test_phase_results_in_the_old_json_format_still_convert(monkeypatch):
    monkeypatch.setenv("FLYTE_USE_OLD_DC_FORMAT", "true")
    ctx = FlyteContextManager.current_context()
    value = PhaseOut(step=3, batch="b" * 64, metrics={"reward/mean": 0.25})
    lit = TypeEngine.to_literal(ctx, value, PhaseOut, TypeEngine.to_literal_type(PhaseOut))
    assert lit.scalar.generic is not None and lit.scalar.binary is None
    assert TypeEngine.to_python_value(ctx, lit, PhaseOut) == value
