"""What a newcomer waits for: seconds to the first console line and to the first RL step line of
README command 1 (``pyflyte run workflows/ppo.py ppo`` on its defaults), the same for the plain
loop, a second run that reuses the finished warm start, ``--help`` of both front doors and the plain
loop's answer to a mistyped option and to a wrong config value.

Each command runs from the repository, in a fresh HOME (flytekit's local cache), a fresh run
store and a fresh asset cache (so the warm start is really run), and is stopped with SIGINT once
its first step line is printed (SIGKILL of its process group where the code measured predates
the interrupt line). With ``--baseline DIR`` (a checkout of an earlier commit, e.g.
``git worktree add /tmp/base 0aeb96c``) every command is also timed there, in the same
invocation, and the table gives the ratio new / baseline.

    python bench/first_run.py                               # this checkout only
    python bench/first_run.py --baseline /tmp/base --repeat 3
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEP_LINE = re.compile(r"(^|\] )step 1/\d+ ")


def _env(home: str, repo: str) -> dict:
    env = dict(os.environ)
    env.update({"HOME": home, "PYTHONPATH": repo, "RAY_AUTH_MODE": "disabled",
                "VERL_ASSET_CACHE": os.path.join(home, "assets")})
    env.pop("RAY_ADDRESS", None)
    return env


def timed_run(cmd: list[str], repo: str, home: str, until_step: bool) -> dict:
    """Wall seconds to the first line, to the first step line (``until_step``), and to the exit."""
    os.makedirs(home, exist_ok=True)
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=repo, env=_env(home, repo), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    first = step = None
    tail = []
    for line in proc.stdout:
        now = time.perf_counter() - t0
        tail = (tail + [line])[-30:]
        if first is None and line.strip():
            first = now
        if until_step and STEP_LINE.search(line):
            step = now
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:  # code without the interrupt line
                os.killpg(proc.pid, signal.SIGKILL)
            break
    proc.wait()
    if until_step and step is None:
        sys.exit(f"{' '.join(cmd)} ended without a step line:\n{''.join(tail)}")
    try:  # whatever the process left in its group (Ray)
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    return {"first_line_s": first, "first_step_s": step, "exit_s": time.perf_counter() - t0}


def commands(repo: str) -> dict[str, tuple[list[str], bool]]:
    py = sys.executable
    pyflyte = os.path.join(os.path.dirname(py), "pyflyte")
    return {
        "pyflyte run workflows/ppo.py ppo --help": (
            [pyflyte, "run", "workflows/ppo.py", "ppo", "--help"], False),
        "python -m verl_core.train --help": ([py, "-m", "verl_core.train", "--help"], False),
        "python -m verl_core.train --stpes 5 (a mistyped option)": (
            [py, "-m", "verl_core.train", "--stpes", "5"], False),
        "python -m verl_core.train --set optim.lr=-1 (a wrong value)": (
            [py, "-m", "verl_core.train", "--set", "optim.lr=-1"], False),
        "README command 1 (pyflyte, defaults)": (
            [pyflyte, "run", "workflows/ppo.py", "ppo", "--store", "STORE"], True),
        "the plain loop (defaults)": (
            [py, "-m", "verl_core.train", "--workdir", "STORE/default"], True),
    }


def measure(repo: str, repeat: int, work: str, only: str = "") -> dict[str, dict]:
    out = {}
    for name, (cmd, until_step) in commands(repo).items():
        if only not in name:
            continue
        runs = []
        for i in range(repeat):
            tmp = tempfile.mkdtemp(dir=work)
            argv = [a.replace("STORE", os.path.join(tmp, "store")) for a in cmd]
            runs.append(timed_run(argv, repo, os.path.join(tmp, "home"), until_step))
            if until_step and name.startswith("README"):
                # a second run name with the same warm-start inputs, same HOME and asset cache
                argv2 = argv + ["--run-name", "second"]
                runs[-1]["reuse_step_s"] = timed_run(argv2, repo, os.path.join(tmp, "home"),
                                                     True)["first_step_s"]
        out[name] = {k: statistics.median(r[k] for r in runs) for k in runs[0]
                     if runs[0][k] is not None}
        print(f"  {os.path.basename(repo) or repo}: {name}: {out[name]}", file=sys.stderr)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--baseline", default="", help="a checkout of an earlier commit to compare")
    p.add_argument("--repeat", type=int, default=1, help="runs per command (the median is shown)")
    p.add_argument("--only", default="", help="only the commands whose name contains this")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-first-run-") as work:
        new = measure(REPO, args.repeat, work, args.only)
        base = measure(args.baseline, args.repeat, work, args.only) if args.baseline else {}
    cols = [("first_line_s", "first line"), ("first_step_s", "first step line"),
            ("reuse_step_s", "first step, warm start reused"), ("exit_s", "exit")]
    print(f"| command | measure | {'baseline s | ' if base else ''}now s"
          f"{' | now / baseline' if base else ''} |")
    print(f"|---|---|{'---|' if base else ''}---|{'---|' if base else ''}")
    for name, m in new.items():
        for key, label in cols:
            if key not in m or (key == "exit_s" and "first_step_s" in m):
                continue
            b = base.get(name, {}).get(key)
            row = f"| {name} | {label} | "
            if base:
                row += f"{b:.1f} | " if b is not None else "- | "
            row += f"{m[key]:.1f} |"
            if base:
                row += f" {m[key] / b:.2f} |" if b else " - |"
            print(row)


if __name__ == "__main__":
    main()
