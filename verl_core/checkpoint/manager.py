"""Checkpoints: manifests over content-addressed chunks, commit protocol, verified load, retention.

What belongs here: what makes a set of objects *a checkpoint* and when it becomes visible. Bytes and
paths are ``store.py``'s business, tensor chunks ``tensors.py``'s, nested state ``state.py``'s.

Commit protocol (a reader never sees an uncommitted checkpoint; DESIGN durability rule 2):

1. an in-flight marker ``inflight/<id>.json`` is written (garbage collection never deletes objects
   while another save is in flight);
2. every object (tensor chunks, the meta JSON) is written; existing ones are skipped (incremental);
3. the manifest is written to ``checkpoints/<step:012d>-<sha256 of the manifest>.json``, after all
   of its objects; its name carries its own hash, so a damaged manifest is detected too;
4. the manifest is read back and verified (hash, and every object present with its size);
5. only then ``latest.json`` moves (an atomic single-file write) and a record is appended to the
   ``checkpoints`` log;
6. retention deletes manifests outside ``keep_last``/``keep_every`` and collects unreferenced
   objects.

A process killed anywhere in 1-4 leaves the previous checkpoint as ``latest``; leftovers are
unreferenced objects that a later garbage collection removes.

Loading verifies every object it reads (size, sha256, and a chunk header that must describe exactly
the dtype/shape the manifest promises). ``load("auto")`` tries ``latest``, then its parent chain,
then every other checkpoint newest first, and logs each rejection with the object and the reason.

Manifest (JSON, ``format = verl-checkpoint/1``)::

    step, created, created_iso, config_hash, package_version, incarnation_id,
    parent          name of the checkpoint this one continues (or null)
    meta            {"sha", "size"} of a JSON object with the caller's meta
    groups          {group: {"shared": bool, "tree": <state tree>, "tensors": <tensor index>}}
    shards          [{"shard_id", "num_shards", "record_sha"}] (one entry for unsharded saves)
    objects         {sha: size} of every object the checkpoint needs
"""

from __future__ import annotations

import json
import logging
import re
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Iterator, Mapping, Optional, Sequence, Union

import torch

import verl_core
from verl_core.checkpoint.errors import (
    CheckpointNotFoundError,
    CheckpointSaveError,
    CorruptObjectError,
    IncompleteCheckpointError,
    NoValidCheckpointError,
    PermanentError,
    UnsafeManifestError,
)
from verl_core.checkpoint.state import (
    check_state_tree,
    flatten_state,
    from_json,
    to_json,
    unflatten_state,
)
from verl_core.checkpoint.store import (
    NotFoundError,
    RunStore,
    StorePermissionError,
    canonical_json,
    check_sha256,
    is_sha256,
    sha256_hex,
)
from verl_core.checkpoint.tensors import (
    DEFAULT_CHUNK_BYTES,
    as_row_shard,
    check_object,
    index_dtypes,
    index_objects,
    load_tensors,
    merge_indexes,
    save_tensors,
    validate_index,
)

log = logging.getLogger(__name__)

__all__ = ["CheckpointManager", "CheckpointInfo", "open_checkpoint", "MANIFEST_FORMAT"]

MANIFEST_FORMAT = "verl-checkpoint/1"
SHARD_FORMAT = "verl-checkpoint-shard/1"
_NAME_RE = re.compile(r"^(\d{12})-([0-9a-f]{64})$")
_GROUP_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]{0,99}$")
_LOAD_ERRORS = (CorruptObjectError, UnsafeManifestError, NotFoundError, CheckpointNotFoundError)


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
    """``RunConfig.config_hash()`` of the run that wrote it."""
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
    m = _NAME_RE.match(name) if isinstance(name, str) else None
    if not m:
        raise UnsafeManifestError(f"checkpoint name {name!r} is not <12-digit step>-<sha256>")
    return int(m.group(1)), m.group(2)


def _check_group(name: Any) -> str:
    if not isinstance(name, str) or not _GROUP_RE.match(name):
        raise UnsafeManifestError(f"group name {name!r} is not allowed (letters, digits, _ . -)")
    return name


def open_checkpoint(uri: str, storage_options: Optional[dict] = None,
                    **manager_kwargs: Any) -> tuple["CheckpointManager", str]:
    """``resume_from_checkpoint``-style reference (a path or URI) -> ``(manager, name)``.

    * a manifest, ``<run store>/checkpoints/<step:012d>-<sha>.json``: that checkpoint;
    * a run store (a folder holding ``store.json``, as :class:`RunStore` creates it): its newest
      valid checkpoint, the one ``load("auto")`` would take, verified here (hashes included) and
      returned by name, so that the caller's ``verify``, ``read_manifest`` and ``load`` all name
      that same checkpoint. A store without checkpoints raises :class:`CheckpointNotFoundError`,
      one whose every checkpoint fails :class:`NoValidCheckpointError`;
    * anything else (a missing path, a file that is not a manifest, a folder that is not a run
      store): :class:`CheckpointNotFoundError`, a permanent error.

    Nothing is created: a typo must not become an empty run store."""
    u = uri.rstrip("/") if isinstance(uri, str) else ""
    m = _MANIFEST_PATH_RE.match(u)
    if m:
        root = "." if m.group(1) is None else (m.group(1) or "/")
        store = _existing_store(root, storage_options)
        if store is not None and store.has_json(f"checkpoints/{m.group(2)}"):
            return CheckpointManager(store, **manager_kwargs), m.group(2)
    elif u:
        store = _existing_store(u, storage_options)
        if store is not None:
            mgr = CheckpointManager(store, **manager_kwargs)
            return mgr, mgr._newest_valid()
    raise CheckpointNotFoundError(
        f"not a checkpoint manifest or run store: {uri}; pass a run store (the run's folder, "
        "which holds store.json) to take its newest valid checkpoint, or one of its manifests, "
        "<run store>/checkpoints/<step>-<sha>.json (`python -m verl_core.checkpoint list "
        "<run store>` lists them)")


_MANIFEST_PATH_RE = re.compile(r"^(?:(.*)/)?checkpoints/(\d{12}-[0-9a-f]{64})\.json$")


def _existing_store(root: str, storage_options: Optional[dict]) -> Optional[RunStore]:
    """The run store at ``root``, or None when there is none (no ``store.json``, or ``root`` is a
    file). Unreachable stores and permission problems raise as usual."""
    store = RunStore(root, storage_options, create=False)
    try:
        store.incarnation_id  # reads store.json
    except (StorePermissionError, CorruptObjectError):
        raise
    except PermanentError:  # NotFoundError, or a path through a file (NotADirectoryError)
        return None
    return store


class CheckpointManager:
    """Save, verify, load and retire checkpoints in one :class:`RunStore`.

    Args:
        store: the run store (or a root URI/path to open one).
        keep_last: keep the newest N checkpoints (None: keep all).
        keep_every: additionally keep every checkpoint whose step is a multiple of this.
        chunk_bytes: target size of tensor chunks (dedupe/resharding granularity).
        verify_on_save: ``"size"`` (re-read the manifest, check every object exists with its size),
            ``"hash"`` (also re-hash every object), or ``"none"``.
        gc_grace_s: never garbage-collect an object younger than this (guards against races with
            writers in other processes that have not announced themselves yet).
        inflight_timeout_s: an in-flight marker older than this belongs to a dead writer.
    """

    def __init__(self, store: Union[RunStore, str], *, keep_last: Optional[int] = None,
                 keep_every: Optional[int] = None, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 verify_on_save: str = "size", gc_grace_s: float = 600.0,
                 inflight_timeout_s: float = 3600.0):
        self.store = RunStore(store) if isinstance(store, str) else store
        if keep_last is not None and keep_last < 1:
            raise ValueError(f"keep_last={keep_last}: must be >= 1 or None")
        if keep_every is not None and keep_every < 1:
            raise ValueError(f"keep_every={keep_every}: must be >= 1 or None")
        if verify_on_save not in ("size", "hash", "none"):
            raise ValueError(f"verify_on_save={verify_on_save!r}: use size, hash or none")
        self.keep_last, self.keep_every = keep_last, keep_every
        self.chunk_bytes = chunk_bytes
        self.verify_on_save = verify_on_save
        self.gc_grace_s, self.inflight_timeout_s = gc_grace_s, inflight_timeout_s
        self._lock = threading.RLock()
        self._last_name: Optional[str] = None
        self._parents: dict[str, Optional[str]] = {}

    def __repr__(self) -> str:
        return f"CheckpointManager({self.store.uri!r}, keep_last={self.keep_last}, " \
               f"keep_every={self.keep_every})"

    # ====================================================================== saving
    def save(self, step: int, groups: Mapping[str, Any], meta: Optional[Mapping] = None, *,
             config_hash: str = "",
             shared_groups: Sequence[str] = ("reference",)) -> CheckpointInfo:
        """Save one checkpoint and make it ``latest`` once verified.

        Args:
            step: training step (>= 0).
            groups: ``{name: state}``; each state is a flat ``{str: Tensor}`` (e.g.
                ``model.state_dict()``) or any nested state ``flatten_state`` accepts (optimizer,
                scheduler, ``capture_rng_state()``, sampler, guard, metrics history).
            meta: small JSON-able dict (``hf_config``, counters …); NaN/tuples are fine.
            config_hash: ``RunConfig.config_hash()``, recorded in the manifest.
            shared_groups: groups stored once per run (the reference model): pass them on the first
                save (or whenever they change); later saves that omit them link the stored copy.
        Returns the committed :class:`CheckpointInfo`.
        """
        _check_step(step)
        with self._lock:
            marker = self._begin("save", step)
            try:
                flat = _flatten_groups(groups)  # refuse bad state before writing anything
                meta_tree = _encode_meta(meta)
                group_docs = {g: self._save_group(g, t, tree, g in shared_groups)
                              for g, (t, tree) in flat.items()}
                group_docs.update(self._inherit_shared(shared_groups, group_docs))
                info = self._commit(step, group_docs, meta_tree, config_hash,
                                    shards=[{"shard_id": 0, "num_shards": 1, "record_sha": None}])
            finally:
                self._end(marker)
            self._retain()
            return info

    def _save_group(self, gname: str, tensors: Mapping[str, Any], tree: Any, shared: bool) -> dict:
        index = save_tensors(self.store, tensors, chunk_bytes=self.chunk_bytes)
        doc = {"shared": shared, "tree": tree, "tensors": index}
        if shared:
            self.store.put_json(f"shared/groups/{gname}",
                                {"group": doc, "objects": index_objects(index)})
        return doc

    def _inherit_shared(self, shared_groups: Sequence[str], have: Mapping[str, dict]) -> dict:
        out = {}
        for g in shared_groups:
            if g in have:
                continue
            _check_group(g)
            doc = self.store.get_json(f"shared/groups/{g}", default=None)
            if doc is None:
                continue
            group = doc.get("group") if isinstance(doc, dict) else None
            if not isinstance(group, dict):
                raise CorruptObjectError(f"shared/groups/{g}.json in {self.store.uri} is malformed")
            validate_index(group.get("tensors"), f"shared group {g!r}")
            out[g] = group
        return out

    def _begin(self, kind: str, step: int) -> str:
        mid = f"inflight/{uuid.uuid4().hex}"
        self.store.put_json(mid, {"kind": kind, "step": step, "time": time.time(),
                                  "host": socket.gethostname()})
        return mid

    def _end(self, marker: str) -> None:
        try:
            self.store.delete_json(marker)
        except Exception as e:  # noqa: BLE001 - a stale marker only delays GC
            log.warning("could not remove in-flight marker %s: %s", marker, e)

    def _commit(self, step: int, group_docs: Mapping[str, dict], meta_tree: Any,
                config_hash: str, shards: list) -> CheckpointInfo:
        meta_bytes = canonical_json(meta_tree)
        meta_sha = self.store.put_bytes(meta_bytes)
        objects: dict[str, int] = {meta_sha: len(meta_bytes)}
        for doc in group_docs.values():
            objects.update(index_objects(doc["tensors"]))
        parent = self._last_name or self._latest_name()
        now = time.time()
        manifest = {
            "format": MANIFEST_FORMAT,
            "step": step,
            "created": now,
            "created_iso": datetime.fromtimestamp(now, timezone.utc).isoformat(),
            "config_hash": config_hash,
            "package_version": verl_core.__version__,
            "incarnation_id": self.store.incarnation_id,
            "parent": parent,
            "meta": {"sha": meta_sha, "size": len(meta_bytes)},
            "groups": dict(group_docs),
            "shards": shards,
            "objects": objects,
        }
        raw = canonical_json(manifest)
        sha = sha256_hex([raw])
        name = f"{step:012d}-{sha}"
        self.store.put_json_raw(f"checkpoints/{name}", raw)
        if self.verify_on_save != "none":
            problems = self.verify(name, hashes=self.verify_on_save == "hash")
            if problems:
                raise CorruptObjectError(f"checkpoint {name} failed verification right after it "
                                         f"was written, not committing it: {'; '.join(problems)}")
        self.store.put_json("latest", {"name": name, "step": step, "sha": sha})
        self._last_name = name
        info = self._info(name, manifest)
        try:
            self.store.append_log("checkpoints", {"event": "commit", "name": name, "step": step,
                                                  "time": now, "nbytes": info.nbytes})
        except Exception as e:  # noqa: BLE001 - the log is informational
            log.warning("could not append to the checkpoints log: %s", e)
        log.info("checkpoint %s committed (step %d, %.1f MB referenced)", name, step,
                 info.nbytes / 1e6)
        return info

    # ---------------------------------------------------------------------- sharded saves
    def save_shard(self, step: int, shard_id: int, num_shards: int, groups: Mapping[str, Any], *,
                   save_id: str = "default", shared_groups: Sequence[str] = ("reference",)) -> str:
        """Write one worker's part of a checkpoint (no manifest yet); returns the record's sha256.

        DTensors sharded on dim 0 (FSDP2) contribute only their local rows; plain tensors are
        written by every worker that passes them and deduplicated by content. ``save_id``
        separates attempts of the same step (pass e.g. the Flyte attempt id when retrying)."""
        _check_step(step)
        if not 0 <= shard_id < num_shards:
            raise ValueError(f"shard_id={shard_id} must be in [0, num_shards={num_shards})")
        key = self._staging_key(step, save_id)
        marker = self._begin("shard", step)
        try:
            group_docs = {}
            for g, (tensors, tree) in _flatten_groups(groups).items():
                index = save_tensors(self.store, tensors, chunk_bytes=self.chunk_bytes)
                group_docs[g] = {"shared": g in shared_groups, "tree": tree, "tensors": index}
            record = {"format": SHARD_FORMAT, "step": step, "shard_id": shard_id,
                      "num_shards": num_shards, "save_id": save_id, "groups": group_docs,
                      "objects": {s: n for d in group_docs.values()
                                  for s, n in index_objects(d["tensors"]).items()},
                      "created": time.time(), "host": socket.gethostname()}
            raw = canonical_json(record)
            self.store.put_json_raw(f"{key}/shard-{shard_id:05d}-of-{num_shards:05d}", raw)
            return sha256_hex([raw])
        finally:
            self._end(marker)

    def commit(self, step: int, num_shards: int, meta: Optional[Mapping] = None, *,
               config_hash: str = "", save_id: str = "default",
               shared_groups: Sequence[str] = ("reference",), wait_s: float = 0.0,
               poll_s: float = 0.1) -> CheckpointInfo:
        """Collect every shard record of ``step`` into one manifest and commit it.

        Waits up to ``wait_s`` for missing shards, then raises :class:`IncompleteCheckpointError`
        naming them (transient: the phase can be retried). Workers must disagree on nothing: the
        same tensors, shapes and state trees, and identical bytes wherever their rows overlap."""
        _check_step(step)
        meta_tree = _encode_meta(meta)
        key = self._staging_key(step, save_id)
        want = {f"{key}/shard-{i:05d}-of-{num_shards:05d}" for i in range(num_shards)}
        deadline = time.monotonic() + wait_s
        while True:
            have = set(self.store.list_json(key))
            missing = sorted(want - have)
            if not missing:
                break
            if time.monotonic() >= deadline:
                raise IncompleteCheckpointError(
                    f"checkpoint step {step} (save_id {save_id!r}) cannot commit: shard records "
                    f"missing: {', '.join(m.rsplit('/', 1)[-1] for m in missing)}")
            time.sleep(poll_s)
        with self._lock:
            records, shards = [], []
            for i, name in enumerate(sorted(want)):
                raw = self.store.get_json_raw(name)
                try:
                    rec = json.loads(raw)
                except ValueError as e:
                    raise CorruptObjectError(f"shard record {name}.json is not JSON ({e})") from e
                if (not isinstance(rec, dict) or rec.get("format") != SHARD_FORMAT
                        or rec.get("step") != step or rec.get("shard_id") != i
                        or rec.get("num_shards") != num_shards
                        or not isinstance(rec.get("groups"), dict)):
                    raise CorruptObjectError(f"shard record {name}.json does not belong to step "
                                             f"{step} shard {i}/{num_shards}")
                records.append(rec)
                shards.append({"shard_id": i, "num_shards": num_shards,
                               "record_sha": sha256_hex([raw])})
            group_docs = {}
            for g in sorted({g for r in records for g in r["groups"]}):
                _check_group(g)
                parts = [r["groups"][g] for r in records if g in r["groups"]]
                trees = [json.dumps(p.get("tree"), sort_keys=True) for p in parts]
                if len(set(trees)) != 1:
                    raise CorruptObjectError(f"step {step}: workers saved different structures "
                                             f"for group {g!r}; cannot merge them")
                index = merge_indexes([p["tensors"] for p in parts], f"group {g!r}")
                group_docs[g] = {"shared": bool(parts[0].get("shared")), "tree": parts[0]["tree"],
                                 "tensors": index}
                if g in shared_groups:
                    self.store.put_json(f"shared/groups/{g}",
                                        {"group": group_docs[g], "objects": index_objects(index)})
            group_docs.update(self._inherit_shared(shared_groups, group_docs))
            marker = self._begin("commit", step)
            try:
                info = self._commit(step, group_docs, meta_tree, config_hash, shards=shards)
            finally:
                self._end(marker)
            for name in want:
                try:
                    self.store.delete_json(name)
                except Exception as e:  # noqa: BLE001 - leftovers are harmless
                    log.warning("could not remove shard record %s: %s", name, e)
            self._retain()
            return info

    @staticmethod
    def _staging_key(step: int, save_id: str) -> str:
        if not re.match(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]{0,99}$", save_id or ""):
            raise ValueError(f"save_id={save_id!r}: use letters, digits, _ . -")
        return f"staging/{step:012d}-{save_id}"

    # ====================================================================== reading
    def _latest_name(self) -> Optional[str]:
        try:
            doc = self.store.get_json("latest", default=None)
        except CorruptObjectError as e:
            log.warning("latest.json is unreadable (%s); ignoring it", e)
            return None
        if doc is None:
            return None
        name = doc.get("name") if isinstance(doc, dict) else None
        try:
            _parse_name(name)
        except UnsafeManifestError as e:
            log.warning("latest.json names an invalid checkpoint (%s); ignoring it", e)
            return None
        return name

    def _names(self) -> list[str]:
        """Every manifest name in the index, oldest step first."""
        out = []
        for doc in self.store.list_json("checkpoints"):
            base = doc.rsplit("/", 1)[-1]
            if _NAME_RE.match(base):
                out.append(base)
        return sorted(out)

    def read_manifest(self, ref: str = "latest") -> tuple[CheckpointInfo, dict]:
        """Resolve ``ref`` and return ``(info, manifest)`` after checking the manifest's own hash
        and structure (not yet its objects)."""
        name = self.resolve(ref)
        return self._read_manifest(name)

    def _read_manifest(self, name: str) -> tuple[CheckpointInfo, dict]:
        step, sha = _parse_name(name)
        try:
            raw = self.store.get_json_raw(f"checkpoints/{name}")
        except NotFoundError as e:
            raise CheckpointNotFoundError(f"manifest of checkpoint {name} is missing from "
                                     f"{self.store.uri}/checkpoints/") from e
        got = sha256_hex([raw])
        if got != sha:
            raise CorruptObjectError(f"manifest checkpoints/{name}.json is corrupted (its bytes "
                                     f"hash to {got})", sha=sha)
        try:
            manifest = json.loads(raw)
        except (ValueError, RecursionError) as e:
            raise CorruptObjectError(f"manifest checkpoints/{name}.json is not JSON ({e})") from e
        _validate_manifest(manifest, name, step)
        self._parents[name] = manifest.get("parent")
        return self._info(name, manifest), manifest

    def _info(self, name: str, m: Mapping) -> CheckpointInfo:
        return CheckpointInfo(
            name=name, step=m["step"], sha=_parse_name(name)[1], created=float(m["created"]),
            parent=m.get("parent"), config_hash=m.get("config_hash", ""),
            package_version=m.get("package_version", ""),
            nbytes=sum(m["objects"].values()), groups=tuple(m["groups"]),
            uri=f"{self.store.uri}/checkpoints/{name}.json")

    def resolve(self, ref: Union[str, int] = "latest") -> str:
        """A reference -> a checkpoint name. Accepted: ``latest``; a name
        ``<step:012d>-<sha>``; a sha256 or unique hex prefix (>= 8 chars) of the manifest; a step
        number (the newest checkpoint of that step); ``…/checkpoints/<name>.json`` inside this
        store. (``auto`` is resolved by :meth:`load`.)"""
        if isinstance(ref, int) and not isinstance(ref, bool):
            return self._by_step(ref)
        if not isinstance(ref, str) or not ref:
            raise CheckpointNotFoundError(f"checkpoint reference {ref!r} is empty or not a string")
        if ref == "latest":
            name = self._latest_name()
            if name is None:
                raise CheckpointNotFoundError(f"no latest checkpoint in {self.store.uri}")
            return name
        if ref.endswith(".json"):
            base = ref.rstrip("/").rsplit("/", 1)[-1][:-5]
            prefix = ref[: -len(base) - 5].rstrip("/")
            if not prefix.endswith("checkpoints"):
                raise UnsafeManifestError(f"{ref!r} is not a manifest path "
                                          "(…/checkpoints/<name>.json)")
            store_root = prefix[: -len("checkpoints")].rstrip("/")
            if store_root and store_root not in (self.store.uri, self.store.root):
                raise UnsafeManifestError(f"{ref!r} is outside this store ({self.store.uri}); open "
                                          "its own store with open_checkpoint()")
            _parse_name(base)
            return base
        if ref.startswith("checkpoints/"):
            ref = ref[len("checkpoints/"):]
        if _NAME_RE.match(ref):
            return ref
        if ref.isdigit() and len(ref) < 12:
            return self._by_step(int(ref))
        if re.match(r"^[0-9a-f]{8,64}$", ref):
            hits = [n for n in self._names() if n.split("-", 1)[1].startswith(ref)]
            if len(hits) == 1:
                return hits[0]
            raise CheckpointNotFoundError(f"checkpoint sha prefix {ref!r} matches {len(hits)} "
                                          f"checkpoints in {self.store.uri}")
        raise CheckpointNotFoundError(f"cannot resolve checkpoint reference {ref!r}; use latest, "
                                      "auto, a step, a name <step>-<sha>, a sha prefix or a path")

    def _by_step(self, step: int) -> str:
        names = [n for n in self._names() if _parse_name(n)[0] == step]
        if not names:
            raise CheckpointNotFoundError(f"no checkpoint for step {step} in {self.store.uri}")
        if len(names) > 1:  # several saves of one step (e.g. after a rollback): newest wins
            names.sort(key=lambda n: self.store.json_mtime(f"checkpoints/{n}") or 0.0)
        return names[-1]

    def _auto_candidates(self):
        """Yield names to try for ``auto``: latest, then the parent of each rejected checkpoint
        whose manifest was readable, then every other checkpoint newest step first."""
        names = self._names()
        tried: set[str] = set()
        nxt = self._latest_name()
        while True:
            if nxt is None or nxt in tried:
                nxt = next((n for n in reversed(names) if n not in tried), None)
                if nxt is None:
                    return
            tried.add(nxt)
            yield nxt
            nxt = self._parents.get(nxt)

    def list_checkpoints(self) -> list[CheckpointInfo]:
        """Every checkpoint in the store, oldest step first. Damaged manifests are listed with
        ``error`` set (their objects are not checked here; use :meth:`verify`)."""
        out = []
        for name in self._names():
            try:
                info, _ = self._read_manifest(name)
            except _LOAD_ERRORS as e:
                step, sha = _parse_name(name)
                info = CheckpointInfo(name=name, step=step, sha=sha, error=str(e),
                                      uri=f"{self.store.uri}/checkpoints/{name}.json")
            out.append(info)
        return out

    def verify(self, ref: Union[str, int] = "latest", *, hashes: bool = True,
               repair: bool = False) -> list[str]:
        """Problems of checkpoint ``ref`` (empty list: valid). Checks the manifest's hash and
        structure, decodes its meta object and state trees exactly as :meth:`load` does (so a
        checkpoint that verifies is one load accepts), and checks every object's presence and
        size; with ``hashes`` also re-reads and re-hashes every object and checks each chunk's
        header. ``repair`` moves damaged objects to the store's ``quarantine/`` so the next save
        that holds their tensors writes them again."""
        try:
            name = self.resolve(ref)
            info, m = self._read_manifest(name)  # the state trees are decoded here
        except _LOAD_ERRORS as e:
            return [str(e)]
        problems = []
        try:
            self._read_meta(name, m)  # read, hash-checked and decoded: not re-read below
        except _LOAD_ERRORS as e:
            problems.append(str(e))
        owners = _object_owners(m)
        refs: dict[str, list] = {}  # sha -> [(entry, chunk, label)]: each object read once
        for g, doc in m["groups"].items():
            for tname, e in doc["tensors"].items():
                for c in e["chunks"]:
                    refs.setdefault(c["sha"], []).append(
                        (e, c, f"checkpoint {name} group {g!r} tensor {tname!r} rows "
                               f"{c['rows'][0]}:{c['rows'][1]}"))

        def check(item):
            sha, size = item
            where = owners.get(sha, "")
            try:
                if hashes and sha in refs:
                    try:
                        check_object(self.store, sha, size, refs[sha])
                    except CorruptObjectError as e:
                        if repair and self._quarantine(sha):
                            return f"{e} (moved to quarantine/)"
                        raise
                    return None
                if hashes:
                    actual = len(self.store.get_bytes(sha, verify=True, what=where))
                else:
                    actual = self.store.object_size(sha)
                    if actual is None:
                        return f"object {sha} ({where}) is missing"
                if actual != size:
                    return f"object {sha} ({where}) has {actual} bytes, the manifest says {size}"
            except CorruptObjectError as e:
                return str(e)
            return None

        objects = sorted((sha, n) for sha, n in m["objects"].items()
                         if sha != m["meta"]["sha"] or sha in refs)
        return problems + [p for p in self.store.map(check, objects) if p]

    def load(self, ref: Union[str, int] = "auto", groups: Optional[Sequence[str]] = None, *,
             row_slices: Optional[Mapping[str, Mapping[str, tuple[int, int]]]] = None,
             out: Optional[Mapping[str, Mapping[str, torch.Tensor]]] = None,
             ) -> tuple[dict[str, Any], dict, CheckpointInfo]:
        """Load and verify a checkpoint: ``(groups, meta, info)``.

        Args:
            ref: ``auto`` (newest valid: latest, its parents, then the rest newest first, with a
                warning naming each rejected checkpoint and why), or anything :meth:`resolve`
                accepts (no fallback then: a damaged checkpoint raises).
            groups: group names to load (default all). Unknown names raise KeyError.
            row_slices: ``{group: {tensor: (start, stop)}}`` rows to read (resharding): only the
                chunks overlapping each slice are read and verified.
            out: ``{group: {tensor: destination}}`` to load in place (a model's parameters).
        Raises :class:`CheckpointNotFoundError` when the store has no checkpoint,
        :class:`NoValidCheckpointError` when ``auto`` rejected all of them, and
        :class:`CorruptObjectError`/:class:`UnsafeManifestError` for an explicit damaged ref.
        """
        return self._with_fallback(ref, lambda name: self._load(name, groups, row_slices, out))

    def _with_fallback(self, ref, fn):
        if ref != "auto":
            return fn(self.resolve(ref))
        rejected = []
        for name in self._auto_candidates():
            try:
                result = fn(name)
            except _LOAD_ERRORS as e:
                rejected.append(f"{name}: {e}")
                log.warning("checkpoint %s rejected: %s; falling back to an older one", name, e)
                continue
            if rejected:
                log.warning("resumed from %s after rejecting %d newer checkpoint(s)", name,
                            len(rejected))
            return result
        if not rejected:
            raise CheckpointNotFoundError(f"no checkpoints in {self.store.uri}")
        raise NoValidCheckpointError(
            f"every checkpoint in {self.store.uri} failed verification; nothing to resume from "
            "(start fresh with resume_from_checkpoint='none' or restore the objects named here): "
            + " | ".join(rejected))

    def _load(self, name, groups, row_slices, out):
        try:
            return self._load_verified(name, groups, row_slices, out)
        except CorruptObjectError as e:
            if e.sha:  # a damaged object must not poison later checkpoints that reuse it
                self._quarantine(e.sha)
            raise

    def _quarantine(self, sha: str) -> bool:
        try:
            return self.store.quarantine_object(sha)
        except Exception as e:  # noqa: BLE001 - the load's own error is the one to report
            log.warning("could not quarantine damaged object %s: %s", sha, e)
            return False

    def _load_verified(self, name, groups, row_slices, out):
        info, m = self._read_manifest(name)
        wanted = list(m["groups"]) if groups is None else list(groups)
        for g in wanted:
            if g not in m["groups"]:
                raise KeyError(f"group {g!r} is not in checkpoint {name}; it has "
                               f"{', '.join(m['groups'])}")
        meta = self._read_meta(name, m)
        result = {}
        for g in wanted:
            doc = m["groups"][g]
            what = f"checkpoint {name} group {g!r}"
            tensors = load_tensors(self.store, doc["tensors"], row_slice=(row_slices or {}).get(g),
                                   out=(out or {}).get(g), what=what)
            result[g] = unflatten_state(tensors, doc["tree"], what=what)
        self._last_name = name
        return result, meta, info

    def _read_meta(self, name: str, m: Mapping) -> dict:
        """The meta of checkpoint ``name`` (manifest ``m``) as :meth:`load` returns it: the object
        must hash to its name, have the size the manifest lists and hold a JSON object in
        ``state.to_json``'s encoding. :meth:`verify` runs this too, so the two never disagree."""
        what = f"checkpoint {name} meta"
        sha, size = m["meta"]["sha"], m["meta"]["size"]
        raw = self.store.get_bytes(sha, what=what)
        if len(raw) != size:
            raise CorruptObjectError(f"{what}: object {sha} has {len(raw)} bytes, the manifest "
                                     f"says {size}")
        try:
            tree = json.loads(raw)
        except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
            raise CorruptObjectError(f"{what} is not JSON ({e})") from e
        meta = from_json(tree, what=what)
        if not isinstance(meta, dict):
            raise CorruptObjectError(f"{what} is a JSON {type(meta).__name__}, not an object")
        return meta

    def _newest_valid(self) -> str:
        """Name of the checkpoint ``load("auto")`` would take: the first of its candidates that
        verifies (hashes included). Rejections are logged as ``load("auto")`` logs them."""
        def verified(name: str) -> str:
            problems = self.verify(name)
            if problems:
                raise CorruptObjectError("; ".join(problems))
            return name

        return self._with_fallback("auto", verified)

    def resume(self, resume_from_checkpoint: str = "auto", groups: Optional[Sequence[str]] = None):
        """``resume_from_checkpoint`` semantics: ``none`` -> None; ``auto`` -> newest valid
        checkpoint or None when the store has none; anything else -> that checkpoint (raises if it
        is damaged). Returns ``(groups, meta, info)`` or None."""
        if resume_from_checkpoint in (None, "", "none"):
            return None
        if resume_from_checkpoint == "auto":
            try:
                return self.load("auto", groups)
            except CheckpointNotFoundError:
                return None
        return self.load(resume_from_checkpoint, groups)

    def load_into(self, ref: Union[str, int], group: str,
                  target: Mapping[str, Any]) -> CheckpointInfo:
        """Load ``group`` in place into ``target`` (e.g. ``model.state_dict()``): plain tensors get
        the whole tensor, DTensors sharded on dim 0 (FSDP2) only their local rows, so a checkpoint
        written by W workers loads into W' workers reading each chunk only where it is needed."""
        return self._with_fallback(ref, lambda name: self._load_into(name, group, target))

    def _load_into(self, name: str, group: str, target: Mapping[str, Any]) -> CheckpointInfo:
        info, m = self._read_manifest(name)
        if group not in m["groups"]:
            raise KeyError(f"group {group!r} is not in checkpoint {name}")
        index = m["groups"][group]["tensors"]
        missing = sorted(set(target) - set(index))
        if missing:
            raise KeyError(f"checkpoint {name} group {group!r} lacks {missing[:10]}")
        slices, dests = {}, {}
        for k, v in target.items():
            rs = as_row_shard(v, k)
            if list(rs.global_shape) != index[k]["shape"]:
                raise ValueError(f"{k}: checkpoint shape {index[k]['shape']} != target "
                                 f"{list(rs.global_shape)}")
            if rs.local.dim():
                slices[k] = (rs.row_offset, rs.row_offset + rs.local.shape[0])
            dests[k] = rs.local
        with torch.no_grad():
            load_tensors(self.store, index, names=list(target), row_slice=slices, out=dests,
                         what=f"checkpoint {name} group {group!r}")
        return info

    # ====================================================================== retention + GC
    def _retain(self) -> None:
        if self.keep_last is None and self.keep_every is None:
            return
        try:
            self.apply_retention()
        except Exception as e:  # noqa: BLE001 - a failed cleanup never fails a committed save
            log.warning("retention/garbage collection failed (will retry next save): %s", e)

    def apply_retention(self) -> list[str]:
        """Delete manifests outside ``keep_last``/``keep_every`` (never ``latest``), then collect
        garbage. Returns the deleted checkpoint names."""
        with self._lock:
            names = self._names()  # sorted by step
            keep = set(names[-self.keep_last:]) if self.keep_last else set(names)
            if self.keep_every:
                keep |= {n for n in names if _parse_name(n)[0] % self.keep_every == 0}
            latest = self._latest_name()
            if latest:
                keep.add(latest)
            deleted = [n for n in names if n not in keep]
            for n in deleted:
                self.store.delete_json(f"checkpoints/{n}")
                log.info("retention: deleted checkpoint %s", n)
            if deleted:
                self.gc()
            return deleted

    def gc(self, *, grace_s: Optional[float] = None) -> dict:
        """Delete objects that nothing in the run store can still ask for (DESIGN rule 6).

        Live (never deleted): every object of a kept manifest, and every object named anywhere in
        a JSON doc under the run store's root folders (:data:`GC_ROOT_FOLDERS`): the assets index
        (model and dataset files a fresh host materialises), the lineage log (the batch of every
        applied update, which a rebuild or an extension replays), ``pending/`` (phase outputs not
        yet consumed by an update), shared groups and the tokenizer, staged shard records. Objects
        younger than ``grace_s`` are never deleted either. Skipped while another process has a
        save in flight (younger than ``inflight_timeout_s``). Returns counts."""
        grace = self.gc_grace_s if grace_s is None else grace_s
        now = time.time()
        with self._lock:
            for mk in self.store.list_json("inflight"):  # ours included: GC runs after our saves end
                doc = self.store.get_json(mk, default=None)
                t = doc.get("time", 0) if isinstance(doc, dict) else 0
                if now - float(t or 0) < self.inflight_timeout_s:
                    log.info("gc skipped: another save is in flight (%s)", mk)
                    return {"deleted": 0, "skipped": "in-flight save"}
                log.warning("removing stale in-flight marker %s", mk)
                self.store.delete_json(mk)
            # List the objects *before* reading the roots: an object written after the listing is
            # not a candidate, and one whose root (manifest, lineage record …) is written before
            # the roots are read is kept. Writers always write an object before its root.
            candidates = [(s, n) for s, n, mt in self.store.iter_objects() if now - mt >= grace]
            live = self.live_objects()
            dead = [(s, n) for s, n in candidates if s not in live]
            self.store.map(lambda sn: self.store.delete_object(sn[0]), dead)
            for path, mt in self.store.iter_temp_files():
                if now - mt >= self.inflight_timeout_s:
                    self.store.delete_path(path)
            freed = sum(n for _, n in dead)
            if dead:
                log.info("gc: deleted %d unreferenced objects (%.1f MB)", len(dead), freed / 1e6)
            return {"deleted": len(dead), "bytes": freed, "live": len(live)}

    def live_objects(self) -> set[str]:
        """Every object sha that a kept manifest or a root doc (see :meth:`gc`) names.

        Raises (and so stops a gc) when a root doc cannot be read: deleting on a partial view of
        the roots could delete what a resume needs."""
        live: set[str] = set()
        for name in self._names():
            try:
                raw = self.store.get_json_raw(f"checkpoints/{name}")
                live.update(k for k in json.loads(raw).get("objects", {}) if is_sha256(k))
            except NotFoundError:
                continue
            except ValueError:
                log.warning("gc: manifest %s is unparseable; its objects are not kept", name)
        docs = [d for folder in GC_ROOT_FOLDERS for d in _docs_under(self.store, folder)]
        for doc in self.store.map(lambda d: self.store.get_json(d, default=None), docs):
            live.update(_shas_in(doc))
        return live


GC_ROOT_FOLDERS = ("assets", "lineage", "pending", "shared", "staging")
"""Folders of JSON docs whose every sha256-looking string names a live object (see
:meth:`CheckpointManager.gc`). A new kind of doc that names objects goes under one of them, so gc
keeps its objects without knowing its format."""


def _docs_under(store: RunStore, folder: str) -> list[str]:
    """Every JSON doc under ``folder``, at any depth."""
    out = list(store.list_json(folder))
    for sub in store.list_folders(folder):
        out.extend(_docs_under(store, sub))
    return out


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


# ------------------------------------------------------------------------------ helpers
def _encode_meta(meta: Optional[Mapping]) -> Any:
    try:
        return to_json(dict(meta or {}))
    except CheckpointSaveError as e:
        raise CheckpointSaveError(f"meta: {e}") from e


def _flatten_groups(groups: Mapping[str, Any]) -> dict[str, tuple[dict, Any]]:
    out = {}
    for g, v in groups.items():
        if v is None:
            continue
        _check_group(g)
        try:
            out[g] = flatten_state(v)
        except CheckpointSaveError as e:
            raise CheckpointSaveError(f"group {g!r}: {e}") from e
    return out


def _check_step(step: Any) -> None:
    if not isinstance(step, int) or isinstance(step, bool) or not 0 <= step < 10 ** 12:
        raise CheckpointSaveError(f"step={step!r} must be an int in [0, 1e12)")


def _validate_manifest(m: Any, name: str, step: int) -> None:
    """Structure checks before any name in the manifest is used as a path or a size, and the
    decoding of every group's state tree (against its index, no tensor data needed): whatever
    reads a manifest (load, verify, list) rejects the same ones."""
    w = f"manifest checkpoints/{name}.json"
    if not isinstance(m, dict) or m.get("format") != MANIFEST_FORMAT:
        raise UnsafeManifestError(f"{w}: not a {MANIFEST_FORMAT} manifest")
    if m.get("step") != step:
        raise UnsafeManifestError(f"{w}: step {m.get('step')!r} does not match its name")
    for key, typ in (("created", (int, float)), ("groups", dict), ("objects", dict),
                     ("meta", dict), ("shards", list)):
        if not isinstance(m.get(key), typ):
            raise UnsafeManifestError(f"{w}: field {key!r} missing or of the wrong type")
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
        validate_index(doc["tensors"], f"{w} group {g!r}")
        check_state_tree(doc["tree"], index_dtypes(doc["tensors"]), what=f"{w} group {g!r}")
        for tname, e in doc["tensors"].items():
            for c in e["chunks"]:
                if objects.get(c["sha"]) != c["size"]:
                    raise UnsafeManifestError(f"{w}: group {g!r} tensor {tname!r} chunk {c['sha']} "
                                              "is not listed in objects with its size")


def _object_owners(m: Mapping) -> dict[str, str]:
    owners = {m["meta"]["sha"]: "meta"}
    for g, doc in m["groups"].items():
        for tname, e in doc["tensors"].items():
            for c in e["chunks"]:
                owners.setdefault(c["sha"], f"group {g!r} tensor {tname!r} rows "
                                            f"{c['rows'][0]}:{c['rows'][1]}")
    return owners
