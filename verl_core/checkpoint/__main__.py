"""Command line: ``python -m verl_core.checkpoint {list,verify,export,gc,lease} …``.

    list   <store>                         every checkpoint (step, name, size, groups, problems)
    verify <store> [ref …] [--repair]      re-hash every object (default: every checkpoint);
                                           exit status 1 on any problem; --repair moves damaged
                                           objects to quarantine/ so the next save rewrites them
    export <store> <ref> <out_folder>      Hugging Face folder of the checkpoint's policy, with
                                           the run's model folder's tokenizer files and
                                           generation_config.json as given, in its stored
                                           dtype (--dtype float32|bfloat16 to change)
    export <manifest-uri> <out_folder>     same, naming the checkpoint by its manifest path (a
                                           store instead: its newest valid checkpoint)
    gc     <store> [--grace-s S]           delete objects nothing can ask for again (kept
                                           checkpoints, the assets index, the lineage of
                                           applied updates and pending phase outputs are kept)
    lease  <store> [--break]               who holds the run's single-writer lease; --break
                                           frees it now (for a holder that is dead: a live one
                                           stops at its next renewal with "lost the lease")

``ref`` is ``latest``, ``auto`` (newest valid), ``best`` (``checkpoint.keep_best``'s), a step,
``<step>-<sha>``, or a sha prefix.
``latest`` with a missing or damaged ``latest.json`` is the newest checkpoint that verifies, named
on stderr. S3 stores read their endpoint from ``$VERL_S3_ENDPOINT``/``$AWS_ENDPOINT_URL``.
"""

from __future__ import annotations

import argparse
import logging
import sys
from datetime import datetime, timezone

from verl_core.errors import VerlError
from verl_core.checkpoint.manager import CheckpointManager, open_checkpoint
from verl_core.store import RunStore


def _manager(root: str) -> CheckpointManager:
    store = RunStore(root, create=False)
    store.incarnation_id  # raises NotFoundError when root is not a run store
    return CheckpointManager(store)


def _resolve(m: CheckpointManager, ref: str) -> str:
    """``ref``, with ``latest`` replaced by the name it stands for; a fallback (no usable
    ``latest.json``) is named on stderr, so what was verified or exported is never a guess."""
    if ref != "latest":
        return ref
    name, why = m.resolve_latest()
    if why:
        print(f"note: {why}", file=sys.stderr)
    return name


def parser() -> argparse.ArgumentParser:
    """The command line's parser; every option and positional carries a help text (the tests
    walk these objects to keep it so)."""
    p = argparse.ArgumentParser(prog="python -m verl_core.checkpoint", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    store_help = "run store: a folder or s3://bucket/prefix"
    sp = sub.add_parser("list", help="list checkpoints")
    sp.add_argument("store", help=store_help)
    sp = sub.add_parser("verify", help="verify checkpoints (re-hash every object)")
    sp.add_argument("store", help=store_help)
    sp.add_argument("refs", nargs="*", metavar="ref",
                    help="latest, auto, best, a step, <step>-<sha> or a sha prefix (default: every "
                         "checkpoint)")
    sp.add_argument("--sizes-only", action="store_true", help="check presence and size only")
    sp.add_argument("--repair", action="store_true",
                    help="move damaged objects to quarantine/ so the next save writes them again")
    sp = sub.add_parser("export", help="export a checkpoint as a Hugging Face folder")
    sp.add_argument("args", nargs="+", metavar="ARG",
                    help="<store> <ref> <out> or <manifest> <out>")
    sp.add_argument("--group", default="policy",
                    help="checkpoint group to export, one that list shows (default: policy, "
                         "the trained model)")
    sp.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                    help="weights' dtype (default: the dtype the run's model folder stores)")
    sp.add_argument("--overwrite", action="store_true",
                    help="replace a non-empty output folder (default: refuse)")
    sp.add_argument("--merge", action="store_true",
                    help="a LoRA checkpoint: write the merged full model (W + s B A), not the "
                         "PEFT adapter folder")
    sp = sub.add_parser("gc", help="delete objects no checkpoint, asset, lineage or pending "
                                   "phase output names")
    sp.add_argument("store", help=store_help)
    sp.add_argument("--grace-s", type=float, default=600.0, metavar="S",
                    help="never delete an object younger than S seconds, so a writer that is "
                         "still saving keeps its new objects (default: 600)")
    sp = sub.add_parser("lease", help="show (or --break) the run's single-writer lease")
    sp.add_argument("store", help=store_help)
    sp.add_argument("--break", dest="break_", action="store_true",
                    help="free the lease now, whoever holds it")
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    try:
        if a.cmd == "list":
            m = _manager(a.store)
            latest = m._latest_name()
            infos = m.list_checkpoints()
            if not infos:  # silence would read as "the command did nothing"
                print(f"no checkpoints in {m.store.uri} (a run writes one every "
                      "checkpoint.checkpoint_interval steps and at its last step)")
            for info in infos:
                when = (datetime.fromtimestamp(info.created, timezone.utc)
                        .strftime("%Y-%m-%d %H:%M:%S") if info.created else "?")
                flag = "*" if info.name == latest else " "
                extra = f"ERROR {info.error}" if info.error else ",".join(info.groups)
                print(f"{flag} step {info.step:>8}  {info.name}  {info.nbytes / 1e6:10.1f} MB  "
                      f"{when}  {extra}")
            return 0
        if a.cmd == "verify":
            m = _manager(a.store)
            refs = a.refs or [i.name for i in m.list_checkpoints()]
            if not refs:
                print(f"no checkpoints in {m.store.uri} to verify")
            bad = 0
            for ref in refs:
                ref = _resolve(m, ref)
                problems = m.verify(ref, hashes=not a.sizes_only, repair=a.repair)
                print(f"{'OK  ' if not problems else 'FAIL'} {ref}")
                for pr in problems:
                    print(f"     {pr}")
                bad += bool(problems)
            return 1 if bad else 0
        if a.cmd == "export":
            from verl_core.checkpoint.hf_export import export_hf
            import torch

            if len(a.args) == 3:
                m, ref, out = _manager(a.args[0]), a.args[1], a.args[2]
            elif len(a.args) == 2:
                (m, ref), out = open_checkpoint(a.args[0]), a.args[1]
            else:
                p.error("export takes <store> <ref> <out> or <manifest-uri> <out>")
            ref = _resolve(m, ref)
            dtype = getattr(torch, a.dtype) if a.dtype else None
            info = export_hf(m, ref, out, group=a.group, dtype=dtype, overwrite=a.overwrite,
                             merge=a.merge)
            print(f"exported {info.name} (step {info.step}) to {out}")
            return 0
        if a.cmd == "lease":
            from verl_core.store.lease import break_lease, read_lease

            store = RunStore(a.store, create=False)
            store.incarnation_id  # raises NotFoundError when the path is not a run store
            if a.break_:
                old = break_lease(store)
                print(f"lease of {store.uri} broken" + (f"; it was held by {old.describe()}"
                                                        if old and not old.released else
                                                        " (it was free)"))
                return 0
            h = read_lease(store)
            if h is None or h.released:
                print(f"lease of {store.uri}: free")
            else:
                now = datetime.now(timezone.utc).timestamp()
                state = "expired" if h.expires <= now else "held"
                print(f"lease of {store.uri}: {state} by {h.describe()}; expires "
                      f"{datetime.fromtimestamp(h.expires, timezone.utc):%Y-%m-%dT%H:%M:%SZ}")
            return 0
        if a.cmd == "gc":
            m = _manager(a.store)
            print(m.gc(grace_s=a.grace_s))
            return 0
    except (VerlError, FileExistsError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
