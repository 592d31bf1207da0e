"""The checkpoint manifest: its formats, a checkpoint's name and groups, the structure checks
every reader runs before a name in it becomes a path, and the hash algorithm of each object.
The manifest's fields are in :mod:`verl_core.checkpoint.manager`'s docstring."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Iterator, Mapping, Optional

from verl_core import layout
from verl_core.checkpoint.state import check_state_tree
from verl_core.checkpoint.tensors import index_dtypes, validate_index
from verl_core.errors import CheckpointSaveError, UnsafeManifestError
from verl_core.store import check_hash_algo, check_sha256, is_sha256

MANIFEST_FORMAT = "verl-checkpoint/2"
MANIFEST_FORMATS = ("verl-checkpoint/1", MANIFEST_FORMAT)
"""Formats :meth:`CheckpointManager.load` reads; saves write the last one."""
SHARED_GROUPS = ("reference", "base")
"""Groups stored once per run and linked by later saves: the frozen reference model, and a
LoRA policy's frozen base weights (``models/lora.py``)."""
DEFAULT_HASH = "blake3"
"""Algorithm that names a new checkpoint's objects (``CheckpointManager(hash_algo=...)``):
BLAKE3 hashes ~2.5x faster than sha256 with SHA-NI on these CPUs, which took verified loads from
below to above torch.load's speed (BENCHMARKS.md, issue 10)."""
_GROUP_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]{0,99}$")


@dataclass(frozen=True)
class CheckpointInfo:
    """One committed checkpoint, as listed or returned by save/load."""

    name: str
    """``<step:012d>-<manifest sha256>``: the stable reference (``load(name)``)."""
    step: int
    """Training step the checkpoint was taken at."""
    sha: str
    """sha256 of the manifest bytes."""
    created: float = 0.0
    """Wall time of the commit (unix seconds)."""
    parent: Optional[str] = None
    """Name of the checkpoint this one continues."""
    config_hash: str = ""
    """``RunConfig.trajectory_hash()`` of the run that wrote it (the manifest's key keeps its
    old name)."""
    package_version: str = ""
    """``verl_core.__version__`` that wrote it."""
    nbytes: int = 0
    """Total bytes of every object it references (tensor data + headers + meta)."""
    groups: tuple[str, ...] = ()
    """Group names (``policy``, ``optimizer``, ``rng`` …)."""
    uri: str = ""
    """Full URI of the manifest (usable as ``resume_from_checkpoint``)."""
    error: Optional[str] = None
    """Set by ``list_checkpoints`` when the manifest itself cannot be read or is damaged."""


def _parse_name(name: str) -> tuple[int, str]:
    m = layout.CHECKPOINT_NAME_RE.match(name) if isinstance(name, str) else None
    if not m:
        raise UnsafeManifestError(f"checkpoint name {name!r} is not <12-digit step>-<sha256>")
    return int(m.group(1)), m.group(2)


def _check_group(name: Any) -> str:
    if not isinstance(name, str) or not _GROUP_RE.match(name):
        raise UnsafeManifestError(f"group name {name!r} is not allowed (letters, digits, _ . -)")
    return name


def _check_step(step: Any) -> None:
    if not isinstance(step, int) or isinstance(step, bool) or not 0 <= step < 10 ** 12:
        raise CheckpointSaveError(f"step={step!r} must be an int in [0, 1e12)")




def _validate_manifest(m: Any, name: str, step: int) -> None:
    """Structure checks before any name in the manifest is used as a path or a size, and the
    decoding of every group's state tree (against its index, no tensor data needed): whatever
    reads a manifest (load, verify, list) rejects the same ones."""
    w = f"manifest checkpoints/{name}.json"
    if not isinstance(m, dict) or m.get("format") not in MANIFEST_FORMATS:
        raise UnsafeManifestError(f"{w}: not a {' or '.join(MANIFEST_FORMATS)} manifest")
    if m.get("step") != step:
        raise UnsafeManifestError(f"{w}: step {m.get('step')!r} does not match its name")
    v1 = m["format"] == MANIFEST_FORMATS[0]
    for key, typ in (("created", (int, float)), ("groups", dict), ("objects", dict),
                     ("meta", dict)) + ((("shards", list),) if v1 else (("world_size", int),)):
        if not isinstance(m.get(key), typ):
            raise UnsafeManifestError(f"{w}: field {key!r} missing or of the wrong type")
    if v1:
        if "hash" in m or any(isinstance(d, dict) and "hash" in d for d in m["groups"].values()):
            raise UnsafeManifestError(f"{w}: a {MANIFEST_FORMATS[0]} manifest names no hash "
                                      "algorithm (its objects are sha256)")
    else:
        check_hash_algo(m.get("hash"), f"{w} hash")
    if m.get("parent") is not None:
        _parse_name(m["parent"])
    objects = m["objects"]
    for sha, size in objects.items():
        check_sha256(sha, f"{w} object")
        if type(size) is not int or size < 0:
            raise UnsafeManifestError(f"{w}: object {sha} has invalid size {size!r}")
    check_sha256(m["meta"].get("sha"), f"{w} meta")
    if objects.get(m["meta"]["sha"]) != m["meta"].get("size"):
        raise UnsafeManifestError(f"{w}: meta object is not listed in objects")
    for g, doc in m["groups"].items():
        _check_group(g)
        if not isinstance(doc, dict) or not isinstance(doc.get("tensors"), dict) \
                or "tree" not in doc:
            raise UnsafeManifestError(f"{w}: group {g!r} is malformed")
        if not v1:
            check_hash_algo(doc.get("hash"), f"{w} group {g!r} hash")
        validate_index(doc["tensors"], f"{w} group {g!r}")
        check_state_tree(doc["tree"], index_dtypes(doc["tensors"]), what=f"{w} group {g!r}")
        for tname, e in doc["tensors"].items():
            for c in e["chunks"]:
                if objects.get(c["sha"]) != c["size"]:
                    raise UnsafeManifestError(f"{w}: group {g!r} tensor {tname!r} chunk {c['sha']} "
                                              "is not listed in objects with its size")
    algos: dict[str, str] = {m["meta"]["sha"]: _manifest_algo(m)}
    for g, doc in m["groups"].items():  # one name, one algorithm: else verify cannot judge it
        for e in doc["tensors"].values():
            for c in e["chunks"]:
                if algos.setdefault(c["sha"], _group_algo(m, doc)) != _group_algo(m, doc):
                    raise UnsafeManifestError(f"{w}: object {c['sha']} is named under two hash "
                                              "algorithms")


def _object_owners(m: Mapping) -> dict[str, str]:
    owners = {m["meta"]["sha"]: "meta"}
    for g, doc in m["groups"].items():
        for tname, e in doc["tensors"].items():
            for c in e["chunks"]:
                owners.setdefault(c["sha"], f"group {g!r} tensor {tname!r} rows "
                                            f"{c['rows'][0]}:{c['rows'][1]}")
    return owners


def _manifest_algo(m: Mapping) -> str:
    """Hash algorithm of a (validated) manifest's own new objects, the meta included."""
    return m.get("hash", "sha256")


def _group_algo(m: Mapping, doc: Mapping) -> str:
    """Hash algorithm naming the objects of one group of manifest ``m``."""
    return doc.get("hash", _manifest_algo(m))


def _object_algos(m: Mapping) -> dict[str, str]:
    """``{sha: hash algorithm}`` of every object a (validated) manifest names."""
    algos = {m["meta"]["sha"]: _manifest_algo(m)}
    for doc in m["groups"].values():
        algo = _group_algo(m, doc)
        for e in doc["tensors"].values():
            for c in e["chunks"]:
                algos[c["sha"]] = algo
    return algos


def _shas_in(doc: Any) -> Iterator[str]:
    """Every sha256 hex string among the keys and values of a JSON doc, at any depth."""
    stack = [doc]
    while stack:
        x = stack.pop()
        if isinstance(x, str):
            if is_sha256(x):
                yield x
        elif isinstance(x, dict):
            stack.extend(x.keys())
            stack.extend(x.values())
        elif isinstance(x, list):
            stack.extend(x)
