"""The rollout-engine registry (``verl_core/rollout/registry.py``; test files need unique names,
``algorithms/test_registry.py`` has the other): the names the run's config accepts for
``rollout.engine`` are the registry's, before and after the engines register."""
import subprocess
import sys

import pytest

from verl_core.config import ConfigError, RolloutConfig
from verl_core.rollout import registry


def test_the_builtin_names_are_what_the_engine_modules_register():
    import verl_core.rollout.engines  # noqa: F401  (registers the built-ins)
    assert set(registry._ENGINES) >= set(registry.BUILTIN_ENGINES)
    assert registry.engine_names() == set(registry._ENGINES)


def test_the_config_reads_the_registry_without_importing_an_engine():
    code = ("import sys; from verl_core.rollout.config import RolloutConfig; "
            "RolloutConfig(engine='vllm'); "
            "assert 'torch' not in sys.modules, 'torch'; "
            "assert 'verl_core.rollout.base' not in sys.modules, 'base'")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr


def test_a_registered_engine_is_accepted_and_an_unknown_one_refused_naming_the_known(monkeypatch):
    monkeypatch.setattr(registry, "_ENGINES", dict(registry._ENGINES))
    with pytest.raises(ConfigError, match=r"rollout\.engine='mine'.*known: hf, vllm"):
        RolloutConfig(engine="mine")

    @registry.register_engine("mine")
    def make_mine(**kwargs):
        return "built"

    assert RolloutConfig(engine="mine").engine == "mine"
    assert registry.engine_factory("mine")() == "built"
    with pytest.raises(ValueError, match="'mine' is registered twice"):
        registry.register_engine("mine")(make_mine)
    with pytest.raises(ValueError, match="unknown rollout engine 'other'; known: .*mine"):
        registry.engine_factory("other")
