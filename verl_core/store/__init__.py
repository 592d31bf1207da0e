"""The run store: immutable content-addressed objects plus small named JSON docs, over fsspec.

What belongs here: bytes in, bytes out, hashing, atomic writes, name validation and the mapping of
I/O failures to :class:`StoreUnavailableError`. What does not: tensors (``tensors.py``), manifests
and retention (``verl_core.checkpoint``).

Modules: ``hashing`` (object and doc names, hashes, canonical JSON), ``io`` (I/O errors mapped to
the project's, storage options), ``run_store`` (:class:`RunStore`), ``lease`` (the single-writer
run lease and the fencing of commits; not imported here, so the store alone stays light).

Layout under the store root (a local folder, NFS, ``s3://bucket/prefix`` or any fsspec URL)::

    store.json                    {"format", "incarnation_id", "created"}: written once
    objects/<sha[:2]>/<sha>       immutable blobs named by the 64-hex hash of their bytes (sha256,
                                  or BLAKE3 for checkpoint data: the manifest names the algorithm)
    <doc>.json                    small named JSON docs (manifests, pointers, shared indexes)
    logs/<name>.jsonl             local append-only JSON-lines log (one O_APPEND write per record)
    logs/<name>/<ns>-<uuid>.json  the same log on object stores (S3 cannot append)
    quarantine/<sha>-<ns>         damaged objects moved aside by loads, writes of the same content
                                  and ``verify --repair``
    quarantine/<doc>-<ns>.json    damaged docs moved aside by their readers ('/' written as '__')
    <doc>.cas/<n>.json            compare-and-swap docs (the run lease), local: generation n
    <doc>.json                    the same on S3, replaced by conditional PUTs (see ``put_if``)

Hash algorithms (:data:`HASH_ALGOS`): an object's name is the hex digest of its bytes under one of
them; the name does not say which, the doc that references it does (a checkpoint manifest's
``"hash"``). Every read and every quarantine check is made with that algorithm, so a store can
hold objects of both (the same bytes under two algorithms are two objects; nothing else changes).
Objects outside checkpoints (assets, lineage batches, the tokenizer) are sha256, the default of
every method here. Both digests are 64 hex characters, so gc's scan for live names sees both.

Why content addressing: writing an object that already exists is skipped, which is what makes
checkpoints incremental (frozen layers, the reference model and unchanged chunks cost nothing),
and a re-hash on read detects any flipped byte, truncation or substitution
(docs/design.md#rule-2-immutable-objects-verified-manifests and
docs/design.md#rule-5-a-cache-hit-never-uses-missing-data).

Atomicity: locally every file is written to a temporary name in the same folder, optionally fsynced,
then ``os.replace``-d into place, so a reader (or a process restarted after SIGKILL) sees either the
whole file or nothing. On S3 a single PUT is atomic by itself.
"""

from verl_core.store.hashing import (HASH_ALGOS, canonical_json, check_doc_name, check_hash_algo,
                                     check_sha256, hash_hex, is_sha256, new_hasher, sha256_hex)
from verl_core.store.io import (NotFoundError, StorePermissionError, before_io,
                                resolve_storage_options)
from verl_core.store.run_store import RunStore, StoreStats

__all__ = ["RunStore", "StoreStats", "NotFoundError", "StorePermissionError", "is_sha256",
           "check_sha256", "check_doc_name", "sha256_hex", "hash_hex", "new_hasher",
           "check_hash_algo", "HASH_ALGOS", "canonical_json", "resolve_storage_options",
           "before_io"]
