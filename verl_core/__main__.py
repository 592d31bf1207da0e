"""``python -m verl_core <command> [options]``: one entry point for the library's command lines.

    health      liveness probe (same as ``python -m verl_core.health``)
    train       the plain training loop (``python -m verl_core.train``)
    checkpoint  list / verify / export / gc a run store (``python -m verl_core.checkpoint``)
    models      fetch / list real pretrained models (``python -m verl_core.models``)
"""

from __future__ import annotations

import sys

COMMANDS = ("health", "train", "checkpoint", "models")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["-h"], ["--help"]):
        print(__doc__)
        return 0
    if not argv or argv[0] not in COMMANDS:
        given = f"unknown command {argv[0]!r}; " if argv else ""
        print(f"python -m verl_core: error: {given}use one of: {', '.join(COMMANDS)}",
              file=sys.stderr)
        return 2
    cmd, rest = argv[0], argv[1:]
    if cmd == "health":  # imported per command: a probe must not pay for the trainer's imports
        from verl_core.health import main as run
    elif cmd == "train":
        from verl_core.train import main as run
    elif cmd == "models":
        from verl_core.models.__main__ import main as run
    else:
        from verl_core.checkpoint.__main__ import main as run
    if cmd == "health":
        return run(rest, prog="python -m verl_core health")
    if cmd == "train":  # a program: Ctrl-C says what was kept (verl_core/interrupt.py)
        return run(rest, handle_signals=True)
    return run(rest)


if __name__ == "__main__":
    sys.exit(main())
