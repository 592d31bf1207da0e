"""The configure task: options and ``--overrides`` JSON are type-checked before any derivation,
and a bad value is a permanent error (shown by pyflyte, never retried as transient)."""
import json

import pytest
from conftest import PYFLYTE, flyte_env, run

from tasks.prepare import build_config, configure
from verl_core.errors import TransientError
from verl_core.config import ConfigError
from verl_core.phases import with_retries


@pytest.mark.parametrize("overrides,message", [
    ('{"optim.lr": NaN}', r"optim.lr=nan: must be a finite number"),
    ('{"optim.lr": Infinity}', r"optim.lr=inf: must be a finite number"),
    ('{"algorithm.kl_coef": -Infinity}', r"algorithm.kl_coef=-inf: must be a finite number"),
    ('{"optim.lr": "abc"}', r"optim.lr='abc': must be a finite number \(not str\)"),
    ('{"rollout.n": 2.5}', r"rollout.n=2.5: must be an integer \(not float\)"),
    ('{"rollout.n": true}', r"rollout.n=True: must be an integer \(not bool\)"),
    # used in the micro-batch arithmetic before the config is built: checked before it
    ('{"actor.ppo_mini_batch_size": 0.3}', r"actor.ppo_mini_batch_size=0.3: must be an int"),
    ('{"actor.ppo_mini_batch_size": "4"}', r"actor.ppo_mini_batch_size='4': must be an int"),
    ('[1, 2]', r"must be a mapping of dotted keys"),
])
def test_bad_override_values_name_the_field(overrides, message):
    with pytest.raises(ConfigError, match=message):
        build_config("grpo", "", "", "", 0, 8, 4, overrides)


def test_json_numbers_are_stored_as_the_annotated_type():
    a = build_config("grpo", "", "", "", 0, 8, 0, json.dumps({"rollout.n": 4.0, "optim.lr": 1}))
    b = build_config("grpo", "", "", "", 0, 8, 0, json.dumps({"rollout.n": 4, "optim.lr": 1.0}))
    assert a.trajectory_hash() == b.trajectory_hash() and type(a.rollout.n) is int


def test_pyflyte_shows_the_config_error_and_does_not_retry(tmp_path):
    """NaN used to pass configure, and the run died later as a transient "lost worker"."""
    assert not issubclass(ConfigError, TransientError) and not configure.metadata.retries
    attempts = []

    def bad():
        attempts.append(1)
        raise ConfigError("x")

    with pytest.raises(ConfigError):
        with_retries(bad, what="t", sleep=lambda _: None)
    assert len(attempts) == 1

    store = tmp_path / "store"
    out = run([PYFLYTE, "run", "workflows/ppo.py", "ppo", "--store", str(store), "--run-name", "t",
               "--steps", "1", "--overrides", '{"optim.lr": NaN}'], flyte_env(tmp_path),
              timeout=300, check=False)
    text = out.stdout + out.stderr
    # one line on stderr and exit 2, as the plain loop: not pyflyte's ~60-line rich traceback
    assert out.returncode == 2, text[-3000:]
    assert ("pyflyte run: error in tasks.prepare.configure: optim.lr=nan: must be a finite "
            "number") in out.stderr.splitlines()[-1], text[-3000:]
    assert "Traceback" not in text and len(text.splitlines()) <= 3, text[-3000:]
    assert "transient" not in text.lower() and not store.exists()  # failed in configure


def test_pyflyte_refuses_a_missing_vllm_before_any_work(tmp_path):
    """rollout.engine=vllm where the workers (local Ray, this machine) have no vLLM: said by
    configure, before the store, the warm start or Ray, with the fix; not at the first rollout."""
    try:
        import vllm  # noqa: F401
        pytest.skip("vLLM is installed here")
    except ImportError:
        pass
    store = tmp_path / "store"
    out = run([PYFLYTE, "run", "workflows/ppo.py", "ppo", "--store", str(store), "--run-name", "t",
               "--steps", "1", "--overrides", '{"rollout.engine": "vllm"}'], flyte_env(tmp_path),
              timeout=300, check=False)
    text = out.stdout + out.stderr
    assert out.returncode == 2, text[-3000:]
    last = out.stderr.splitlines()[-1]
    assert "error in tasks.prepare.configure: rollout.engine='vllm' needs the vllm package" in last
    assert "set rollout.engine='hf'" in last and "Traceback" not in text, text[-3000:]
    assert not store.exists()
