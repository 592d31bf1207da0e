"""Registry behaviour, and that every name the config accepts resolves to a function."""

import pytest

from verl_core import config
from verl_core.algorithms import (
    ADVANTAGE_ESTIMATORS,
    KL_ESTIMATORS,
    LOSS_AGG_MODES,
    POLICY_LOSSES,
    Registry,
    UnknownNameError,
    get_advantage_estimator,
    get_policy_loss,
    register_advantage,
    register_policy_loss,
)


def _proto(x, y, *, k):
    raise NotImplementedError


def test_register_get_names_and_aliases():
    reg = Registry("thing")

    @reg.register("a", "alpha", "first")
    def a(x):
        return x + 1

    @reg.register("b")
    def b(x):
        return x * 2

    assert reg.get("a") is a and reg.get("alpha") is a and reg.get("first") is a
    assert reg.get("b")(3) == 6
    assert reg.names() == ("a", "b")
    assert reg.names(include_aliases=True) == ("a", "alpha", "b", "first")
    assert "alpha" in reg and "zzz" not in reg and 3 not in reg
    assert len(reg) == 2 and list(reg) == ["a", "b"]


def test_double_registration_raises():
    reg = Registry("thing")

    @reg.register("a", "alias")
    def a():
        pass

    with pytest.raises(ValueError, match="already registered"):
        reg.register("a")  # same name
    with pytest.raises(ValueError, match="already registered"):
        reg.register("alias")  # a new name that collides with an alias
    with pytest.raises(ValueError, match="already registered"):
        reg.register("new", "a")  # an alias that collides with a name
    with pytest.raises(ValueError, match="repeated"):
        reg.register("x", "x")
    with pytest.raises(ValueError):
        reg.register("")
    # Registering the very same function again is still an error (verl tolerates it; we don't).
    with pytest.raises(ValueError):
        reg.register("a")(a)


def test_unknown_name_lists_known_names_and_is_key_and_value_error():
    reg = Registry("widget")
    reg.register("left", "l")(lambda: None)
    reg.register("right")(lambda: None)
    with pytest.raises(UnknownNameError) as e:
        reg.get("middle")
    msg = str(e.value)
    assert msg == "unknown widget 'middle'; known: l, left, right"
    assert isinstance(e.value, KeyError) and isinstance(e.value, ValueError)


def test_prototype_enforces_one_signature():
    reg = Registry("thing", prototype=_proto)

    @reg.register("ok")
    def ok(x, y, *, k):
        return x

    with pytest.raises(TypeError, match="every thing must take exactly"):
        @reg.register("missing_kw")
        def bad1(x, y):
            pass

    with pytest.raises(TypeError):
        @reg.register("renamed")
        def bad2(x, z, *, k):
            pass

    with pytest.raises(TypeError):
        @reg.register("positional_k")  # k must be keyword-only
        def bad3(x, y, k):
            pass

    assert reg.names() == ("ok",)  # failed registrations leave nothing behind


def test_real_registries_reject_duplicates_and_wrong_signatures():
    with pytest.raises(ValueError):
        register_advantage("grpo")
    with pytest.raises(ValueError):
        register_policy_loss("vanilla")
    with pytest.raises(TypeError):
        register_advantage("not_a_real_estimator")(lambda token_level_rewards, response_mask: None)
    assert "not_a_real_estimator" not in ADVANTAGE_ESTIMATORS
    with pytest.raises(KeyError, match="known: gae, gdpo, gpg, grpo, grpo_passk, grpo_vectorized, "):
        get_advantage_estimator("ppo")
    with pytest.raises(ValueError, match="known: bypass_mode, cispo, clip_cov, .*, vanilla"):
        get_policy_loss("ppo_clip")


@pytest.mark.parametrize("registry, names", [  # advantage estimators: the config asks the registry
    (POLICY_LOSSES, config.POLICY_LOSSES),
    (KL_ESTIMATORS, config.KL_TYPES),
    (LOSS_AGG_MODES, config.LOSS_AGG_MODES),
])
def test_every_config_name_resolves(registry, names):
    for name in names:
        assert callable(registry.get(name)), name
    # and nothing registered is unreachable from the config
    assert set(registry.names(include_aliases=True)) <= set(names)


def test_config_accepts_every_estimator_and_asks_the_registry_for_its_traits():
    for name in ADVANTAGE_ESTIMATORS.names(include_aliases=True):
        algo = config.AlgorithmConfig(adv_estimator=name)
        assert algo.estimator_traits is ADVANTAGE_ESTIMATORS.traits(name)
        assert algo.uses_critic == ADVANTAGE_ESTIMATORS.traits(name).needs_critic
    assert config.AlgorithmConfig(adv_estimator="gae").uses_critic


def test_traits_are_typed_and_checked_at_registration():
    from dataclasses import dataclass

    @dataclass(frozen=True)
    class Traits:
        needs_x: bool = False

    reg = Registry("thing", traits=Traits)
    reg.register("a", "alias", needs_x=True)(lambda: 1)
    reg.register("b")(lambda: 2)
    assert reg.traits("a") == Traits(needs_x=True) and reg.traits("alias") is reg.traits("a")
    assert reg.traits("b") == Traits()
    with pytest.raises(TypeError, match="bad traits"):
        reg.register("c", needs_y=True)
    with pytest.raises(UnknownNameError):
        reg.traits("zzz")
    with pytest.raises(TypeError, match="no traits"):
        Registry("plain").register("a", needs_x=True)
    assert Registry("plain").register("a")(lambda: 0)() == 0


def test_two_pending_decorators_for_one_name_cannot_both_register():
    reg = Registry("thing")
    first, second = reg.register("x"), reg.register("x")  # both created before either applies
    first(lambda: 1)
    with pytest.raises(ValueError, match="already registered"):
        second(lambda: 2)
    assert reg.get("x")() == 1


def test_an_estimator_of_the_old_keyword_signature_is_refused_at_registration():
    # the 11-parameter signature estimators had before EstimatorInputs: refused at import time,
    # the message naming the one record an estimator takes
    with pytest.raises(TypeError, match=r"must take exactly \(inp\)"):
        @register_advantage("old_style")
        def old_style(token_level_rewards, response_mask, group_index, values, *, gamma, lam,
                      norm_adv_by_std_in_grpo, baseline_score=None, old_logprobs=None,
                      sum_pi_squared=None, reward_components=None):
            pass
    assert "old_style" not in ADVANTAGE_ESTIMATORS
