"""Held-out evaluation sampled as verl's ``rollout.val_kwargs`` say (the DAPO recipe's
``do_sample=True``, ``temperature``, ``top_p``, ``n``): seeded by the run's seed and the step, so
an evaluation phase replayed after a crash gives the same numbers, and independent of how the
held-out rows are split into forward passes (``data.val_batch_size``; the workers' shares take
their draws by the same row offsets)."""
import pytest

from tests.presets import tiny_run
from verl_core.config import with_overrides
from verl_core.trainer import RLTrainer, prepare_assets

SAMPLED = {"rollout.val_do_sample": True, "rollout.val_temperature": 1.0,
           "rollout.val_top_p": 0.7, "rollout.val_n": 3}


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return prepare_assets(tiny_run(), str(tmp_path_factory.mktemp("work")), log=lambda *_: None)


def _evaluate(assets, step, **over):
    trainer = RLTrainer(with_overrides(tiny_run(), over), assets)
    try:
        return trainer.evaluate_with_samples(100, step)
    finally:
        trainer.close()


def test_sampled_evaluation_is_seeded_by_the_step_and_not_by_the_split(assets):
    m, samples = _evaluate(assets, 2, **SAMPLED)
    assert len(samples) == 8 * 3  # 8 held-out prompts x val_n, each prompt's 3 adjacent
    assert [s.prompt for s in samples[:3]] == [samples[0].prompt] * 3
    assert 0.0 <= m["val/accuracy"] <= m["val/best@3"] <= 1.0
    # other forward passes (3 prompts each, so a pass ends inside no prompt's group but the row
    # offsets all move): the same responses, the same numbers
    m3, samples3 = _evaluate(assets, 2, **SAMPLED, **{"data.val_batch_size": 3})
    assert (m3, [s.response for s in samples3]) == (m, [s.response for s in samples])
    # another step draws other responses
    _, other = _evaluate(assets, 3, **SAMPLED)
    assert [s.response for s in other] != [s.response for s in samples]


def test_greedy_evaluation_is_the_default_and_ignores_the_step(assets):
    m1, s1 = _evaluate(assets, 1)
    m2, s2 = _evaluate(assets, 5)
    assert (m1, [s.response for s in s1]) == (m2, [s.response for s in s2])
    assert set(m1) == {"val/accuracy", "val/response_length"} and len(s1) == 8
    # do_sample at temperature 0 is greedy, as in verl
    m0, s0 = _evaluate(assets, 1, **{"rollout.val_do_sample": True})
    assert (m0, [s.response for s in s0]) == (m1, [s.response for s in s1])


def test_several_greedy_responses_are_refused():
    from verl_core.config import ConfigError

    with pytest.raises(ConfigError, match=r"rollout.val_n.*val_do_sample=True"):
        tiny_run(**{"rollout.val_n": 4})


def test_val_max_samples_is_the_same_seeded_subset_every_time(assets):
    from verl_core.data.prompts import val_subset

    rows = list(range(10))
    a = val_subset(rows, 4, seed=1)
    assert a == val_subset(rows, 4, seed=1) and a == sorted(a) and len(set(a)) == 4
    assert val_subset(rows, 4, seed=2) != a  # another run seed, another subset (here)
    assert val_subset(rows, -1, seed=1) == rows and val_subset(rows, 10, seed=1) == rows
    # through an evaluation: 3 of the 8 held-out prompts, the same 3 at every step
    m, samples = _evaluate(assets, 1, **{"data.val_max_samples": 3})
    _, again = _evaluate(assets, 4, **{"data.val_max_samples": 3})
    assert len(samples) == 3 and [s.prompt for s in samples] == [s.prompt for s in again]


def test_a_model_you_bring_evaluates_on_a_bounded_subset(tmp_path):
    from verl_core.config import ConfigError, preset

    assert preset("grpo").data.val_max_samples == -1  # the demo: every held-out row
    assert preset("grpo", **{"model.path": str(tmp_path)}).data.val_max_samples == 64
    assert preset("grpo", **{"model.path": str(tmp_path),
                             "data.val_max_samples": -1}).data.val_max_samples == -1
    with pytest.raises(ConfigError, match="val_max_samples"):
        preset("grpo", **{"data.val_max_samples": 0})
