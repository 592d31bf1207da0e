"""Run names follow the rule their error states: a plain ASCII name (letters, digits, - _ .)."""
import pytest

from verl_core.config import ConfigError, RunConfig
from verl_core.prepare import prepare_run, run_store_uri

RULE = r"use a plain name \(letters, digits, - _ \.\)"


@pytest.mark.parametrize("name", ["exp1", "a.b-c_d", "_x", "Run.2026-12-01", "x" * 200])
def test_plain_names_are_accepted(name, tmp_path):
    assert run_store_uri(str(tmp_path), name) == f"{tmp_path}/{name}"


@pytest.mark.parametrize("name", [
    "my run", "a\\b", "a\nb", "run\n", "run\t", "r\U0001F642", "\u00e9t\u00e9",  # issue 21 item 9
    "..", ".hidden", "a/b", "/abs", "", "-x", "a..b", "x" * 201, "a:b", "a*b",
])
def test_other_names_are_refused_with_the_rule(name, tmp_path):
    with pytest.raises(ConfigError, match=RULE):
        run_store_uri(str(tmp_path), name)


def test_prepare_refuses_a_bad_name_before_creating_anything(tmp_path):
    with pytest.raises(ConfigError, match=RULE):
        prepare_run(RunConfig(), str(tmp_path / "store"), "my run")
    assert not (tmp_path / "store").exists()
