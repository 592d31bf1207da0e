"""Names and hashes of the run store: object names (64-hex digests under sha256 or BLAKE3), doc
name validation and the canonical JSON bytes equal docs hash equal by."""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any, Iterable

from verl_core.errors import PermanentError, UnsafeManifestError

_SHA_RE = re.compile(r"^[0-9a-f]{64}$")
# A doc name is one or more '/'-separated segments; each starts with an alphanumeric or '_' so
# '.', '..', hidden files and absolute paths are impossible.
_SEGMENT_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]{0,199}\Z")  # \Z: "$" admits a final "\n"


def is_sha256(s: object) -> bool:
    return isinstance(s, str) and bool(_SHA_RE.match(s))


def check_sha256(s: object, what: str = "object name") -> str:
    """Return ``s`` if it is a lowercase 64-hex sha256, else raise :class:`UnsafeManifestError`.
    Every object name read from a manifest passes through here before it becomes a path."""
    if not is_sha256(s):
        raise UnsafeManifestError(f"{what} {s!r} is not a 64-character lowercase hex sha256; "
                                  "refusing to use it as a store path")
    return s  # type: ignore[return-value]


def check_doc_name(name: object) -> str:
    """Validate a doc name like ``checkpoints/000000000005-<sha>``: relative, no ``..``."""
    if not isinstance(name, str) or not name:
        raise UnsafeManifestError(f"doc name {name!r} must be a non-empty string")
    for seg in name.split("/"):
        if not _SEGMENT_RE.match(seg) or ".." in seg:
            raise UnsafeManifestError(
                f"doc name {name!r} has an unsafe segment {seg!r} (allowed: letters, digits, "
                "'_', '-', '.', no leading '.', no '..', no absolute paths)")
    return name


HASH_ALGOS = ("sha256", "blake3")
"""Object-name hash algorithms a manifest may name. Both give 64 hex characters."""


def check_hash_algo(algo: object, what: str = "hash algorithm") -> str:
    """Return ``algo`` if it is one of :data:`HASH_ALGOS`, else raise :class:`UnsafeManifestError`
    (a manifest naming an unknown algorithm cannot be verified, so nothing it names is read)."""
    if algo not in HASH_ALGOS:
        raise UnsafeManifestError(f"{what} {algo!r} is not one of {', '.join(HASH_ALGOS)}")
    return algo  # type: ignore[return-value]


def new_hasher(algo: str = "sha256"):
    """A fresh hashlib-style object (``update``, ``hexdigest``) for ``algo``. BLAKE3 runs single
    threaded per object: the store's I/O pool already hashes several objects at once, and both
    implementations release the GIL on large inputs."""
    if algo == "sha256":
        return hashlib.sha256()
    if algo == "blake3":
        try:
            from blake3 import blake3
        except ImportError as e:  # a dependency since issue 10; an old environment may lack it
            raise PermanentError("this checkpoint's objects are named by BLAKE3 hashes; install "
                                 "the `blake3` package (pip install blake3) to read or write "
                                 "them") from e
        return blake3()
    raise UnsafeManifestError(f"hash algorithm {algo!r} is not one of {', '.join(HASH_ALGOS)}")


def hash_hex(parts: Iterable[Any], algo: str = "sha256") -> str:
    """Hex digest of the concatenation of ``parts`` (bytes-like) under ``algo``."""
    h = new_hasher(algo)
    for p in parts:
        h.update(p)
    return h.hexdigest()


def sha256_hex(parts: Iterable[Any]) -> str:
    return hash_hex(parts, "sha256")


def canonical_json(doc: Any, sort_keys: bool = False) -> bytes:
    """Deterministic JSON bytes (no whitespace, NaN refused) so equal docs hash equal. Key order is
    kept by default (a state dict's order is part of it); ``sort_keys`` for order-free docs."""
    return json.dumps(doc, sort_keys=sort_keys, separators=(",", ":"), allow_nan=False,
                      ensure_ascii=False).encode("utf-8")


