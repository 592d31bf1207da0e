"""``pyflyte run workflows/ppo.py ppo``'s command line (workflows/_cli.py and the ``ppo``
docstring): every option says what it does and what its "" or 0 default means, the command's help
is the summary without the ``Args:`` block, and a misspelled option names the near one
(issue 38)."""
import os
import pathlib
import re
import subprocess
import sys

from verl_core.config import preset
from workflows._cli import description
from workflows.ppo import ppo

REPO = pathlib.Path(__file__).resolve().parents[2]
PYFLYTE = str(pathlib.Path(sys.executable).with_name("pyflyte"))
# an option's row of rich-click's table: name(s), type (none for a flag), help; wide enough that
# no help wraps onto a second row
ROW = re.compile(r"^│ (--[\w-]+)(?:,--[\w-]+)*\s{2,}(?:[A-Z]+\s{2,})?(.*?)\s*│$")


def _pyflyte(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "400", "NO_COLOR": "1", "PYTHONPATH": str(REPO)}
    return subprocess.run([PYFLYTE, "run", "workflows/ppo.py", "ppo", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)


def test_every_option_of_ppo_says_what_it_does_and_what_its_default_means():
    r = _pyflyte("--help")
    assert r.returncode == 0, r.stderr
    helps = {m.group(1): m.group(2) for m in map(ROW.match, r.stdout.splitlines()) if m}
    inputs = list(ppo.python_interface.inputs)
    assert set(helps) >= {f"--{name}" for name in inputs}
    for opt, text in helps.items():
        own = opt.lstrip("-")
        assert re.sub(r"\s*\[default: .*\]$", "", text) not in ("", own), (opt, text)
    assert "./runs under the current folder" in helps["--store"]
    # the numbers the help gives for 0 are the presets'
    grpo, ppo_ = preset("grpo"), preset("ppo")
    assert f"the preset's ({grpo.total_steps})" in helps["--steps"]
    assert ppo_.total_steps == grpo.total_steps
    assert f"the preset's ({grpo.data.train_batch_size})" in helps["--batch_size"]
    assert ppo_.data.train_batch_size == grpo.data.train_batch_size
    assert f"grpo {grpo.rollout.n}, ppo {ppo_.rollout.n}" in helps["--rollout_n"]
    # the command's help: the summary, a paragraph apart, and no Args: block repeating the options
    summary = r.stdout.split("╭─ Options")[0]
    assert "Args:" not in summary and "verl-keys.md" in summary
    assert re.search(r"phases\.\s*\n\s*Re-running", summary)


def test_description_drops_the_sections_and_keeps_the_paragraphs_apart():
    doc = """Train.

    More about it,
    on two lines.

    Args:
        steps: RL steps
    """
    assert description(doc) == "Train.\n\nMore about it,\non two lines."


def test_a_misspelled_option_names_the_near_one():
    r = _pyflyte("--stpes", "5")
    assert r.returncode == 2
    assert "No such option '--stpes'" in r.stderr and "Did you mean" in r.stderr
    assert "'--steps'" in r.stderr
