"""Ctrl-C through `pyflyte run` (no mocked phases): SIGINT during the warm start prints what was kept
and the continue command and exits; the same command resumes the warm start where it stopped
(its bit-identical resume is tested through the plain loop, tests/verl_core/test_warmstart.py)."""
import json
import re
import shlex
import signal
import subprocess

import pytest

from conftest import REPO, flyte_env, ppo_cmd

pytestmark = pytest.mark.slow

# a warm start long enough to be interrupted inside it on any machine
LONG_WARM_START = {"model.warmup_sft_steps": 3000}


def _start(cmd, env):
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _read_until(proc, pattern: str, timeout_s: float = 600) -> tuple[str, re.Match]:
    seen = []
    for line in proc.stdout:  # ends when the process does
        seen.append(line)
        m = re.search(pattern, line)
        if m:
            return "".join(seen), m
    proc.wait(timeout=timeout_s)
    pytest.fail(f"never printed {pattern!r} (rc {proc.returncode}):\n" + "".join(seen)[-4000:])


def test_sigint_in_the_warm_start_then_the_same_command_resumes_it(tmp_path):
    env = flyte_env(tmp_path)
    cmd = ppo_cmd(tmp_path / "store", steps=2, overrides=LONG_WARM_START)
    proc = _start(cmd, env)
    # the first progress line: the warm start is a few seconds in
    _read_until(proc, r"^warm start: step \d+/3000")
    proc.send_signal(signal.SIGINT)
    rest = proc.communicate(timeout=120)[0]
    assert proc.returncode == 128 + signal.SIGINT, rest
    m = re.search(r"\[verl\] interrupted \(SIGINT\) during the warm start \(step (\d+) of at most "
                  r"3000\): kept the warm start's progress up to step (\d+) in (\S+); continue "
                  r"with: (.+)$", rest, re.M)
    assert m, rest
    assert m.group(1) == m.group(2) and m.group(3) == str(tmp_path / "store" / "t")
    assert shlex.split(m.group(4))[1:] == cmd[1:], m.group(4)  # the same command, shell-quoted
    assert "Traceback" not in rest
    [doc] = (tmp_path / "store" / "t" / "assets" / "warmstart").glob("*.json")
    assert json.loads(doc.read_text())["step"] == int(m.group(1))

    # the same command: the warm start resumes from the saved step; then SIGTERM ends it there
    again = _start(cmd, env)
    _read_until(again, rf"^warm start: resuming from step {m.group(1)} ")
    again.send_signal(signal.SIGTERM)
    rest = again.communicate(timeout=120)[0]
    assert again.returncode == 128 + signal.SIGTERM, rest
    assert "[verl] interrupted (SIGTERM) during the warm start" in rest, rest
