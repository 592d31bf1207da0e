"""Checkpoints: manifests over content-addressed chunks, commit protocol, verified load, retention.

What belongs here: what makes a set of objects *a checkpoint* and when it becomes visible. Bytes
and paths are ``verl_core.store``'s business, tensor chunks ``tensors.py``'s, nested state
``state.py``'s, and torch.distributed.checkpoint's storage layer ``dcp.py``'s. Beside it: the
manifest's format and checks (``manifest.py``), a save's job and handle (``save_job.py``), loads
(``loading.py``) and retention with garbage collection (``retention.py``), the last two mixed
into :class:`CheckpointManager`.

Every save goes through torch.distributed.checkpoint (DCP), one process (``dp=SINGLE``) or a
data-parallel group (:meth:`CheckpointManager.save_distributed`): the state is split into tensors
(to DCP, which plans which rank writes what; FSDP2 shards are written by their owners, replicated
tensors by one rank) and a JSON state tree (the non-tensor leaves, to the manifest; nothing is
pickled). Commit protocol (a reader never sees an uncommitted checkpoint; DESIGN durability rule 2):

1. rank 0 writes an in-flight marker ``inflight/<id>.json`` (garbage collection never deletes
   objects while another save is in flight; DCP's planning collective orders every rank's writes
   after it);
2. every rank writes its objects (tensor chunks); existing ones are skipped (incremental);
3. DCP's finish step, on rank 0 once every rank has reported its objects written: the meta JSON
   object, then the manifest ``checkpoints/<step:012d>-<sha256 of the manifest>.json``; its name
   carries its own hash, so a damaged manifest is detected too;
4. the manifest is read back and verified (hash, and every object of every rank present with its
   size; with ``verify_on_save="hash"`` re-hashed);
5. only then ``latest.json`` moves (an atomic single-file write) and a record is appended to the
   ``checkpoints`` log; every rank returns the same :class:`CheckpointInfo`;
6. retention (rank 0) deletes manifests outside ``keep_last``/``keep_every`` and collects
   unreferenced objects.

A process killed anywhere in 1-4 leaves the previous checkpoint as ``latest``; leftovers are
unreferenced objects that a later garbage collection removes.

Fenced commits: with :attr:`CheckpointManager.fence` set (the run's workers get the launcher's
:class:`~verl_core.store.lease.Fence`), the save checks it before step 1, before the manifest
(3) and before ``latest`` (5), so a writer that outlived its launcher, or whose launch another
launch took over, commits nothing (``FencedError``); an async save checks the fence it was
started under, not a later one.

Loading verifies every object it reads (size, hash, and a chunk header that must describe exactly
the dtype/shape the manifest promises). ``load("auto")`` tries ``latest``, then its parent chain,
then every other checkpoint newest first, and logs each rejection with the object and the reason.
:meth:`~CheckpointManager.load_distributed` loads in place into any sharding (DCP reshards: a
checkpoint written by W workers loads on W' workers or one process), after every worker has agreed
on the manifest (:meth:`~CheckpointManager.agree_on`).

Manifest (JSON, ``format = verl-checkpoint/2``)::

    hash            algorithm naming this checkpoint's new objects: "blake3" or "sha256"
    step, created, created_iso, config_hash, package_version, incarnation_id,
    parent          name of the checkpoint this one continues (or null)
    meta            {"sha", "size"} of a JSON object with the caller's meta (named by ``hash``)
    groups          {group: {"shared": bool, "hash": algorithm of its objects,
                             "tree": <state tree>, "tensors": <tensor index>}}
    world_size      data-parallel workers that wrote it (any count loads it)
    objects         {sha: size} of every object the checkpoint needs

``verl-checkpoint/1`` manifests (sha256 objects, ``shards`` instead of ``world_size``, groups
without ``hash``) still load, verify and export; a shared group stored by them keeps its sha256
name when a ``/2`` checkpoint links it (its group doc says so).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import socket
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import verl_core
from verl_core import layout
from verl_core.checkpoint.loading import _LOAD_ERRORS, CheckpointLoading
from verl_core.checkpoint.manifest import (DEFAULT_HASH, MANIFEST_FORMAT, SHARED_GROUPS,
                                           CheckpointInfo, _check_group, _check_step,
                                           _manifest_algo, _object_algos, _object_owners,
                                           _parse_name, _validate_manifest)
from verl_core.checkpoint.retention import CheckpointRetention
from verl_core.checkpoint.save_job import (SaveHandle, _check, _encode_meta, _flatten_groups,
                                           _SaveJob)
from verl_core.checkpoint.state import check_state_tree
from verl_core.checkpoint.tensors import (DEFAULT_CHUNK_BYTES, check_object, index_dtypes,
                                          index_objects, validate_index)
from verl_core.errors import (CheckpointNotFoundError, CheckpointSaveError, CorruptObjectError,
                              PermanentError, UnsafeManifestError, VerlError)
from verl_core.store import (NotFoundError, RunStore, StorePermissionError, canonical_json,
                             check_hash_algo, sha256_hex)
from verl_core.training.dist import SINGLE, DataParallel

log = logging.getLogger(__name__)

__all__ = ["CheckpointManager", "CheckpointInfo", "SaveHandle", "open_checkpoint",
           "MANIFEST_FORMAT", "DEFAULT_HASH"]


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
        if store is not None and store.has_json(layout.checkpoint_doc(m.group(2))):
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


_MANIFEST_PATH_RE = re.compile(rf"^(?:(.*)/)?{layout.CHECKPOINTS}/(\d{{12}}-[0-9a-f]{{64}})\.json$")


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


class CheckpointManager(CheckpointLoading, CheckpointRetention):
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
        hash_algo: ``"blake3"`` or ``"sha256"``: names the objects new checkpoints write (and is
            recorded in their manifests; checkpoints of either kind load).
    """

    def __init__(self, store: Union[RunStore, str], *, keep_last: Optional[int] = None,
                 keep_every: Optional[int] = None, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 verify_on_save: str = "size", gc_grace_s: float = 600.0,
                 inflight_timeout_s: float = 3600.0, hash_algo: str = DEFAULT_HASH):
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
        self.hash_algo = check_hash_algo(hash_algo, "hash_algo")
        self._lock = threading.RLock()
        self._last_name: Optional[str] = None
        self._parents: dict[str, Optional[str]] = {}
        self._executor: Optional[ThreadPoolExecutor] = None
        self._pending: Optional[SaveHandle] = None
        self._snapshot_pool: dict = {}
        self._async_groups: dict = {}
        self.fence: Optional[Callable[[str], None]] = None
        """None, or the check every commit of this manager is made under: called with what is
        about to be committed before a save starts, before its manifest and before ``latest``,
        and raises to refuse (the run's workers set ``functools.partial(Fence.check,
        run_store)`` of the launcher's :class:`~verl_core.store.lease.Fence`)."""

    def __repr__(self) -> str:
        return f"CheckpointManager({self.store.uri!r}, keep_last={self.keep_last}, " \
               f"keep_every={self.keep_every})"

    # ====================================================================== saving
    def save(self, step: int, groups: Mapping[str, Any], meta: Optional[Mapping] = None, *,
             config_hash: str = "",
             shared_groups: Sequence[str] = SHARED_GROUPS) -> CheckpointInfo:
        """Save one checkpoint from this process and make it ``latest`` once verified
        (:meth:`save_distributed` with ``dp=SINGLE``).

        Args:
            step: training step (>= 0).
            groups: ``{name: state}``; each state is a flat ``{str: Tensor}`` (e.g.
                ``model.state_dict()``) or any nested state ``flatten_state`` accepts (optimizer,
                scheduler, ``capture_rng_state()``, sampler, guard, metrics history).
            meta: small JSON-able dict (``hf_config``, counters …); NaN/tuples are fine.
            config_hash: ``RunConfig.trajectory_hash()``, recorded in the manifest.
            shared_groups: groups stored once per run (the reference model): pass them on the first
                save (or whenever they change); later saves that omit them link the stored copy.
        Returns the committed :class:`CheckpointInfo`.
        """
        return self.save_distributed(step, groups, meta, config_hash=config_hash,
                                     shared_groups=shared_groups)

    def save_distributed(self, step: int, state: Mapping[str, Any],
                         meta: Optional[Mapping] = None, *, config_hash: str = "",
                         dp: DataParallel = SINGLE,
                         shared_groups: Sequence[str] = SHARED_GROUPS) -> CheckpointInfo:
        """Save one checkpoint from every worker of ``dp`` (a collective: every rank calls it with
        the same step) and return the committed :class:`CheckpointInfo`, the same on every rank.

        ``state`` is ``{group: state_dict}``, e.g. ``{"policy": get_model_state_dict(model),
        "optimizer": get_optimizer_state_dict(model, optim)}``: tensors may be DTensors sharded by
        FSDP2 (each rank writes its own rows) or plain tensors (written once, by one rank). The
        non-tensor leaves (param_groups, counters …) go to the manifest's JSON state tree, never
        pickled; a group's tree (keys and non-tensor values) must be the same on every rank that
        passes the group, and a group may be passed by some ranks only (e.g. rank 0's RNG).
        ``meta`` is taken from rank 0. Rank 0 commits (manifest, verify, ``latest``) once every
        rank's objects are written; a failure on any rank raises on every rank and leaves the
        previous ``latest``. ``shared_groups``: see :meth:`save`.
        """
        job = self._prepare_save(step, state, meta, dp)
        return self._write(job, config_hash, tuple(shared_groups), dp, self._process_group(dp))

    def async_save_distributed(self, step: int, state: Mapping[str, Any],
                               meta: Optional[Mapping] = None, *, config_hash: str = "",
                               dp: DataParallel = SINGLE,
                               shared_groups: Sequence[str] = SHARED_GROUPS) -> SaveHandle:
        """:meth:`save_distributed` in the background: returns once every tensor is copied to CPU
        memory (buffers reused from one save to the next), so training may change the state right
        away; ``handle.wait()`` returns the :class:`CheckpointInfo` or raises the save's error.

        At most one save is pending: this first waits for the previous one (and raises its error if
        nobody collected it). Collective like :meth:`save_distributed`; with ``dp.size > 1`` the
        background writes coordinate over a dedicated gloo group, created (collectively, over the
        default process group) on the first call, so they never interleave with training's
        collectives."""
        from verl_core.checkpoint import dcp  # torch.distributed.checkpoint: ~1 s to import

        if self._pending is not None:
            prev, self._pending = self._pending, None
            try:
                prev._future.result()
            except BaseException:
                if not prev._seen:
                    raise
        job = self._prepare_save(step, state, meta, dp)
        job.tensors = {k: dcp.snapshot_state(v, self._snapshot_pool, (k,))
                       for k, v in job.tensors.items()}
        dcp.sync_device()  # non_blocking device->host copies must land before we return
        pg = self._async_group(dp)
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="async-checkpoint")
        handle = SaveHandle(self._executor.submit(self._write, job, config_hash,
                                                  tuple(shared_groups), dp, pg), step)
        self._pending = handle
        return handle

    def close(self) -> None:
        """Wait for a pending background save (its error is raised if nobody collected it) and
        stop the background thread."""
        try:
            if self._pending is not None and not self._pending._seen:
                self._pending.wait()
        finally:
            self._pending = None
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._executor = None

    def check_fence(self, what: str) -> None:
        """Raise (``FencedError``) if :attr:`fence` refuses ``what``; a no-op without a fence.
        Called right before each commit write (a save checks the fence it started with)."""
        _check(self.fence, what)

    @staticmethod
    def _process_group(dp: DataParallel) -> Any:
        return dp.cpu_group if dp.cpu_group is not None else dp.group

    def _async_group(self, dp: DataParallel) -> Any:
        if not dp.distributed:
            return None
        import torch.distributed as dist

        key = id(self._process_group(dp))
        if key not in self._async_groups:
            ranks = None if self._process_group(dp) is None else \
                dist.get_process_group_ranks(self._process_group(dp))
            self._async_groups[key] = dist.new_group(ranks=ranks, backend="gloo")
        return self._async_groups[key]

    def _prepare_save(self, step: int, state: Mapping[str, Any], meta: Optional[Mapping],
                      dp: DataParallel) -> _SaveJob:
        """Flatten every group into tensors + JSON tree and check, across ranks, that the trees
        agree (a collective with ``dp.size > 1``). Refusals are raised on every rank, before
        anything is written."""
        from verl_core.checkpoint import dcp

        _check_step(step)
        err: Optional[Exception] = None
        flat: dict = {}
        meta_tree: Any = None
        fence = self.fence
        try:
            flat = _flatten_groups(state)
            meta_tree = _encode_meta(meta)
            if dp.rank == 0:  # the committer: a fenced-out writer starts writing nothing
                _check(fence, f"the checkpoint of step {step}")
        except VerlError as e:  # a refusal, or the fence's read failing: raised on every rank
            err = e
        trees = {g: tree for g, (_, tree) in flat.items()}
        if dp.distributed:
            digests = {g: hashlib.sha256(canonical_json(t)).hexdigest() for g, t in trees.items()}
            everyone = dp.gather_objects((digests, None if err is None else str(err)))
            failed = [f"rank {r}: {msg}" for r, (_, msg) in enumerate(everyone) if msg]
            if failed:
                raise err or CheckpointSaveError(f"checkpoint of step {step} refused: "
                                                 + "; ".join(failed))
            owners: dict[str, dict[str, list[int]]] = {}  # group -> digest -> ranks
            for r, (d, _) in enumerate(everyone):
                for g, h in d.items():
                    owners.setdefault(g, {}).setdefault(h, []).append(r)
            differ = {g: by for g, by in owners.items() if len(by) > 1}
            if differ:
                raise CheckpointSaveError(
                    f"checkpoint of step {step}: workers passed different non-tensor state "
                    "(keys or values) for " + "; ".join(
                        f"group {g!r} (" + ", ".join(f"ranks {rs} -> tree {h[:12]}"
                                                     for h, rs in by.items()) + ")"
                        for g, by in sorted(differ.items()))
                    + "; the JSON part of a group must be identical on every worker that passes "
                    "it (save per-worker state under per-worker group names)")
            # rank 0 writes the manifest: it needs the trees of groups only other ranks passed
            missing = {g: min(r for rs in by.values() for r in rs)
                       for g, by in owners.items() if g not in everyone[0][0]}
            if missing:
                got = dp.gather_objects({g: trees[g] for g, r in missing.items()
                                         if r == dp.rank})
                for part in got:
                    trees.update(part)
        elif err is not None:
            raise err
        tensors = {f"{g}{dcp.SEP}{n}": t for g, (ts, _) in flat.items() for n, t in ts.items()}
        return _SaveJob(step, tensors, trees, meta_tree, fence)

    def _write(self, job: _SaveJob, config_hash: str, shared_groups: tuple,
               dp: DataParallel, pg: Any) -> CheckpointInfo:
        from verl_core.checkpoint import dcp

        with self._lock:
            marker = self._begin("save", job.step) if dp.rank == 0 else None
            try:
                writer = dcp.StoreWriter(
                    self.store, chunk_bytes=self.chunk_bytes, algo=self.hash_algo,
                    finish=lambda index: self._commit_index(job, index, config_hash,
                                                            shared_groups, dp.size))
                info = dcp.save(job.tensors, writer, process_group=pg,
                                no_dist=not dp.distributed, rank=dp.rank)
            finally:
                if marker is not None:
                    self._end(marker)
            self._last_name = info.name
        if dp.rank == 0:
            self._retain()
        return info

    def _commit_index(self, job: _SaveJob, index: Mapping[str, dict], config_hash: str,
                      shared_groups: tuple, world_size: int) -> CheckpointInfo:
        """DCP's finish step (rank 0): every rank's objects are written; build the group docs
        from their joined chunk lists and the trees, and commit."""
        from verl_core.checkpoint import dcp

        group_docs = {g: {"shared": g in shared_groups, "hash": self.hash_algo, "tree": tree,
                          "tensors": {}} for g, tree in job.trees.items()}
        for key, entry in index.items():
            g, name = key.split(dcp.SEP, 1)
            group_docs[g]["tensors"][name] = entry
        for g, doc in group_docs.items():
            what = f"checkpoint of step {job.step} group {g!r}"
            validate_index(doc["tensors"], what)  # every rank's rows are there, exactly once
            check_state_tree(doc["tree"], index_dtypes(doc["tensors"]), what=what)
            if doc["shared"]:
                self.store.put_json(layout.group_doc(g),
                                    {"group": doc, "objects": index_objects(doc["tensors"])})
        group_docs.update(self._inherit_shared(shared_groups, group_docs))
        return self._commit(job.step, group_docs, job.meta_tree, config_hash, world_size,
                            fence=job.fence)

    def _inherit_shared(self, shared_groups: Sequence[str], have: Mapping[str, dict]) -> dict:
        out = {}
        for g in shared_groups:
            if g in have:
                continue
            _check_group(g)
            doc = self.store.get_json(layout.group_doc(g), default=None)
            if doc is None:
                continue
            group = doc.get("group") if isinstance(doc, dict) else None
            if not isinstance(group, dict):
                raise CorruptObjectError(f"{layout.group_doc(g)}.json in {self.store.uri} is "
                                         "malformed")
            validate_index(group.get("tensors"), f"shared group {g!r}")
            out[g] = {**group, "hash": group.get("hash", "sha256")}  # written by /1: sha256
        return out

    def _begin(self, kind: str, step: int) -> str:
        mid = layout.inflight_doc(uuid.uuid4().hex)
        self.store.put_json(mid, {"kind": kind, "step": step, "time": time.time(),
                                  "host": socket.gethostname(), "pid": os.getpid()})
        return mid

    def _end(self, marker: str) -> None:
        try:
            self.store.delete_json(marker)
        except Exception as e:  # noqa: BLE001 - a stale marker only delays GC
            log.warning("could not remove in-flight marker %s: %s", marker, e)

    def _commit(self, step: int, group_docs: Mapping[str, dict], meta_tree: Any,
                config_hash: str, world_size: int,
                fence: Optional[Callable[[str], None]] = None) -> CheckpointInfo:
        meta_bytes = canonical_json(meta_tree)
        meta_sha = self.store.put_bytes(meta_bytes, algo=self.hash_algo)
        objects: dict[str, int] = {meta_sha: len(meta_bytes)}
        for doc in group_docs.values():
            objects.update(index_objects(doc["tensors"]))
        parent = self._last_name or self._latest_name()
        now = time.time()
        manifest = {
            "format": MANIFEST_FORMAT,
            "hash": self.hash_algo,
            "step": step,
            "created": now,
            "created_iso": datetime.fromtimestamp(now, timezone.utc).isoformat(),
            "config_hash": config_hash,
            "package_version": verl_core.__version__,
            "incarnation_id": self.store.incarnation_id,
            "parent": parent,
            "meta": {"sha": meta_sha, "size": len(meta_bytes)},
            "groups": dict(group_docs),
            "world_size": world_size,
            "objects": objects,
        }
        raw = canonical_json(manifest)
        sha = sha256_hex([raw])
        name = layout.checkpoint_name(step, sha)
        _check(fence, f"the manifest of checkpoint {name}")
        self.store.put_json_raw(layout.checkpoint_doc(name), raw)
        if self.verify_on_save != "none":
            problems = self.verify(name, hashes=self.verify_on_save == "hash")
            if problems:
                raise CorruptObjectError(f"checkpoint {name} failed verification right after it "
                                         f"was written, not committing it: {'; '.join(problems)}")
        _check(fence, f"moving latest to checkpoint {name}")
        self.store.put_json(layout.LATEST_DOC, {"name": name, "step": step, "sha": sha})
        self._last_name = name
        info = self._info(name, manifest)
        try:
            self.store.append_log(layout.CHECKPOINT_LOG, {"event": "commit", "name": name,
                                                          "step": step, "time": now,
                                                          "nbytes": info.nbytes})
        except Exception as e:  # noqa: BLE001 - the log is informational
            log.warning("could not append to the checkpoints log: %s", e)
        log.info("checkpoint %s committed (step %d, %.1f MB referenced)", name, step,
                 info.nbytes / 1e6)
        return info

    # ====================================================================== reading
    def _latest_name(self) -> Optional[str]:
        try:
            doc = self.store.get_json(layout.LATEST_DOC, default=None)
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
        for doc in self.store.list_json(layout.CHECKPOINTS):
            base = doc.rsplit("/", 1)[-1]
            if layout.CHECKPOINT_NAME_RE.match(base):
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
            raw = self.store.get_json_raw(layout.checkpoint_doc(name))
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
            name, why = self.resolve_latest()
            if why:
                log.warning("%s", why)
            return name
        if ref == "best":
            step = self.best_step()
            if step is None:
                raise CheckpointNotFoundError(
                    f"no best checkpoint in {self.store.uri}: best.json is written when a run "
                    "with checkpoint.keep_best=<val metric> evaluates")
            return self._by_step(step)
        if ref.endswith(".json"):
            base = ref.rstrip("/").rsplit("/", 1)[-1][:-5]
            prefix = ref[: -len(base) - 5].rstrip("/")
            if not prefix.endswith(layout.CHECKPOINTS):
                raise UnsafeManifestError(f"{ref!r} is not a manifest path "
                                          "(…/checkpoints/<name>.json)")
            store_root = prefix[: -len(layout.CHECKPOINTS)].rstrip("/")
            if store_root and store_root not in (self.store.uri, self.store.root):
                raise UnsafeManifestError(f"{ref!r} is outside this store ({self.store.uri}); open "
                                          "its own store with open_checkpoint()")
            _parse_name(base)
            return base
        if ref.startswith(f"{layout.CHECKPOINTS}/"):
            ref = ref[len(layout.CHECKPOINTS) + 1:]
        if layout.CHECKPOINT_NAME_RE.match(ref):
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

    def resolve_latest(self) -> tuple[str, Optional[str]]:
        """``latest`` -> ``(name, why)``: the checkpoint ``latest.json`` names (``why`` None), or,
        when that pointer is missing, not JSON or names no valid checkpoint name (a crash or a
        hand edit; every manifest is still there), the newest checkpoint that verifies, with
        ``why`` saying so and naming it. A pointer that names a damaged checkpoint is kept: that
        checkpoint's problems are the news. Raises :class:`CheckpointNotFoundError` when there
        is no checkpoint to fall back to."""
        name = self._latest_name()
        if name is not None:
            return name, None
        pointer = ("latest.json is missing" if not self.store.has_json(layout.LATEST_DOC)
                   else "latest.json is unreadable or names no checkpoint")
        names = self._names()
        newest_first = sorted(  # several saves of one step: the newest first, as _by_step
            names, key=lambda n: (_parse_name(n)[0],
                                  self.store.json_mtime(layout.checkpoint_doc(n)) or 0.0),
            reverse=True)
        for cand in newest_first:
            if not self.verify(cand):
                return cand, (f"{pointer} in {self.store.uri}; using the newest valid checkpoint "
                              f"{cand} (step {_parse_name(cand)[0]})")
        raise CheckpointNotFoundError(
            f"no latest checkpoint in {self.store.uri}: {pointer}, and "
            + (f"none of its {len(names)} checkpoint(s) verifies (python -m verl_core.checkpoint "
               f"verify {self.store.uri} lists the problems)" if names else "it has no checkpoints"))

    def _by_step(self, step: int) -> str:
        names = [n for n in self._names() if _parse_name(n)[0] == step]
        if not names:
            raise CheckpointNotFoundError(f"no checkpoint for step {step} in {self.store.uri}")
        if len(names) > 1:  # several saves of one step (e.g. after a rollback): newest wins
            names.sort(key=lambda n: self.store.json_mtime(layout.checkpoint_doc(n)) or 0.0)
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
        size; with ``hashes`` also re-reads and re-hashes every object (with the algorithm its
        manifest names) and checks each chunk's header. ``repair`` moves damaged objects to the
        store's ``quarantine/`` so the next save that holds their tensors writes them again."""
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
        algos = _object_algos(m)
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
            algo = algos.get(sha, _manifest_algo(m))
            try:
                if hashes and sha in refs:
                    try:
                        check_object(self.store, sha, size, refs[sha], algo)
                    except CorruptObjectError as e:
                        if repair and self._quarantine(sha, algo):
                            return f"{e} (moved to quarantine/)"
                        raise
                    return None
                if hashes:
                    actual = len(self.store.get_bytes(sha, verify=True, what=where, algo=algo))
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
