"""Ctrl-C and SIGTERM (verl_core/interrupt.py): the line names what was kept and the command that
continues; a process busy elsewhere (not polling) still exits within the grace; the plain loop's
--help and a mistyped option are answered without importing torch."""
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from verl_core import interrupt

REPO = Path(__file__).resolve().parents[2]


def test_continue_command_is_the_command_as_typed(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    prog = str(tmp_path / ".venv" / "bin" / "pyflyte")
    assert interrupt.continue_command([prog, "run", "workflows/ppo.py", "ppo", "--overrides",
                                       '{"a": 1}']) == \
        """.venv/bin/pyflyte run workflows/ppo.py ppo --overrides '{"a": 1}'"""
    train = str(REPO / "verl_core" / "train.py")
    cmd = interrupt.continue_command([train, "--steps", "3", "--set", "optim.lr=1e-4"])
    assert cmd.endswith(" -m verl_core.train --steps 3 --set optim.lr=1e-4"), cmd
    main = str(REPO / "verl_core" / "__main__.py")
    assert interrupt.continue_command([main, "train"]).endswith(" -m verl_core train")


def test_a_process_that_does_not_poll_exits_within_the_grace_with_the_line(tmp_path):
    # a phase that never looks at the stop flag (a Ray call, a store call): the grace timer ends
    # the process, and the line says where it was and what is kept
    script = textwrap.dedent("""
        import sys, time
        from verl_core import interrupt
        assert interrupt.install()
        interrupt.status(where="the rollout of step 7", kept="every finished phase",
                         store="/runs/x")
        print("ready", flush=True)
        time.sleep(600)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script, "--steps", "9"], cwd=tmp_path,
                            env={**os.environ, "PYTHONPATH": str(REPO)}, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout.readline().strip() == "ready"
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    waited = time.monotonic() - t0
    assert proc.returncode == 128 + signal.SIGTERM
    assert "[verl] interrupted (SIGTERM) during the rollout of step 7: kept every finished " \
           "phase in /runs/x; continue with: " in err, err
    # the grace, plus an interpreter's exit on a loaded machine (not a speed assertion: the
    # timer, not the work, decides the exit, and without it the process sleeps for 600 s)
    assert interrupt.GRACE_S <= waited + 0.5 and waited < 60, waited


def test_a_second_signal_exits_at_once(tmp_path):
    script = textwrap.dedent("""
        import time
        from verl_core import interrupt
        interrupt.GRACE_S = 600.0  # only the second signal can end it
        interrupt.install()
        print("ready", flush=True)
        time.sleep(600)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=tmp_path, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout.readline().strip() == "ready"
    proc.send_signal(signal.SIGINT)
    time.sleep(0.5)
    assert proc.poll() is None  # the first one only asked
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGINT and "interrupted (SIGINT)" in err


def _cli(*args):
    code = ("import sys\nfrom verl_core.train import main\n"
            "try:\n    rc = main(sys.argv[1:])\nexcept SystemExit as e:\n    rc = e.code\n"
            "heavy = [m for m in ('torch', 'transformers', 'flytekit') if m in sys.modules]\n"
            "print('HEAVY', heavy, 'RC', rc)\n")
    return subprocess.run([sys.executable, "-c", code, *args], cwd=REPO, capture_output=True,
                          text=True, timeout=120)


def test_plain_loop_help_and_option_typos_import_no_torch():
    out = _cli("--help")
    assert "HEAVY [] RC 0" in out.stdout, out.stdout + out.stderr
    assert "--run-name" in out.stdout and "--verl-config" in out.stdout
    out = _cli("--stpes", "5")
    assert "HEAVY [] RC 2" in out.stdout, out.stdout + out.stderr
    assert "unrecognized arguments: --stpes" in out.stderr and "did you mean --steps?" in out.stderr
    # a wrong config value: the config needs torch (its algorithm registries), not transformers,
    # torch.distributed.checkpoint or pyarrow (the packages import those on first use)
    out = _cli("--set", "optim.lr=-1")
    assert "HEAVY ['torch'] RC 2" in out.stdout, out.stdout + out.stderr
    assert "optim.lr=-1.0: must be > 0" in out.stderr
    out = _cli("--workdir", "w", "--run-name", "r")
    assert "HEAVY [] RC 2" in out.stdout and "not both" in out.stderr, out.stderr
