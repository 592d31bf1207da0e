"""The local-disk checkpoint tier: commit to local disk first, replicate to the run store behind.

What belongs here: the local store of a run (:func:`open_local_store`) and the background
:class:`Replicator` that copies committed local checkpoints to the run store. What a checkpoint is
(manifest, objects, verification) stays ``manager.py``'s and ``manifest.py``'s: the local tier
is a second :class:`RunStore` with the same layout, so saving, verifying and loading are the same
code.

Durability (docs/design.md#rule-2-immutable-objects-verified-manifests, extended to two tiers): a
checkpoint is *committed locally* once its manifest is verified in the local store, and
*replicated* once the run store shows it. Replication copies every object first, then the manifest
(so the run store never lists a manifest whose objects are missing), verifies it there, and only
then moves the run store's ``latest``. A store outage delays replication (retried with backoff) but
never a training step; a lost node loses the checkpoints not yet replicated, which any state can do
without (an older checkpoint + lineage replay rebuilds it), except the final one, which finalize
waits for (:meth:`Replicator.flush`).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from typing import Optional, Union

from verl_core import layout
from verl_core.checkpoint.manager import CheckpointManager
from verl_core.checkpoint.manifest import (CheckpointInfo, _manifest_algo, _object_algos,
                                           _parse_name)
from verl_core.checkpoint.save_job import SaveHandle
from verl_core.errors import CheckpointNotFoundError, CorruptObjectError, UnsafeManifestError
from verl_core.store import NotFoundError, RunStore

log = logging.getLogger(__name__)

__all__ = ["open_local_store", "Replicator"]

# what makes a local copy unreplicable for good (not the run store): it is dropped with a warning
_LOCAL_GONE = (CorruptObjectError, UnsafeManifestError, CheckpointNotFoundError, NotFoundError)


def open_local_store(local_dir: str, store: RunStore) -> RunStore:
    """The local tier of run store ``store``: ``<local_dir>/<incarnation id of store>``.

    Its ``store.json`` is the run store's own, so manifests written locally carry the run store's
    incarnation id and are byte-identical (same name) once replicated; a run folder deleted and
    started again gets a new incarnation id and so a fresh local folder instead of stale copies."""
    if not isinstance(local_dir, str) or "://" in local_dir:
        raise ValueError(f"checkpoint.local_dir={local_dir!r} must be a local folder path "
                         "(a local SSD), not a URL; the run store is the shared tier")
    root = os.path.join(os.path.abspath(local_dir), store.incarnation_id)
    os.makedirs(root, exist_ok=True)
    meta = os.path.join(root, "store.json")
    if not os.path.exists(meta):  # seeded atomically, so a reader never sees half of it
        tmp = f"{meta}.{os.getpid()}.tmp"
        with open(tmp, "wb") as f:
            f.write(store.get_json_raw("store"))
        os.replace(tmp, meta)
    return RunStore(root)


class Replicator:
    """Copies committed checkpoints of ``local`` to ``remote`` in one background thread, in order.

    :meth:`submit` takes a :class:`CheckpointInfo` (a sync save) or a :class:`SaveHandle` (an
    async one, replicated once its local write commits; its error is left to whoever waits on the
    handle). The queue is bounded (``max_queue``): a caller that outruns a slow store waits in
    :meth:`submit` rather than piling up local checkpoints. Any failure to write the run store is
    retried with exponential backoff (``backoff_s`` to ``max_backoff_s``) until it succeeds or
    :meth:`close`; a local copy that is gone or damaged is dropped with a warning (retention may
    delete an old unreplicated one while the store is down: a newer one supersedes it)."""

    def __init__(self, local: CheckpointManager, remote: CheckpointManager, *, max_queue: int = 4,
                 backoff_s: float = 0.2, max_backoff_s: float = 10.0):
        self.local, self.remote = local, remote
        self.max_queue = max_queue
        self.backoff_s, self.max_backoff_s = backoff_s, max_backoff_s
        self._queue: deque = deque()  # [item, committed_at or None]; the head is in progress
        self._cv = threading.Condition()
        self._stop = False
        self.replicated: list[str] = []
        self.dropped: list[str] = []
        self.last_error: Optional[str] = None
        self._thread = threading.Thread(target=self._run, name="checkpoint-replicator",
                                        daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ caller side
    def submit(self, item: Union[CheckpointInfo, SaveHandle]) -> None:
        with self._cv:
            while len(self._queue) >= self.max_queue and not self._stop:
                self._cv.wait()
            self._queue.append([item, time.time() if isinstance(item, CheckpointInfo) else None])
            self._cv.notify_all()

    def pending(self) -> list[int]:
        """Steps of the checkpoints not yet replicated (queued, or being copied)."""
        with self._cv:
            return [e[0].step for e in self._queue]

    def flush(self, timeout_s: float) -> list[int]:
        """Wait up to ``timeout_s`` for every submitted checkpoint to be replicated (or dropped);
        returns the steps still unreplicated (empty: done)."""
        deadline = time.monotonic() + timeout_s
        with self._cv:
            while self._queue and not self._stop and time.monotonic() < deadline:
                self._cv.wait(min(0.5, max(0.0, deadline - time.monotonic())))
            return [e[0].step for e in self._queue]

    def metrics(self) -> dict:
        """``checkpoint/unreplicated`` (queued or in progress) and ``checkpoint/replication_lag_s``
        (age of the oldest locally committed checkpoint the run store does not show yet)."""
        now = time.time()
        with self._cv:
            ages = [now - e[1] for e in self._queue if e[1] is not None]
            return {"checkpoint/unreplicated": float(len(self._queue)),
                    "checkpoint/replication_lag_s": max(ages, default=0.0)}

    def close(self, timeout_s: float = 0.0) -> list[int]:
        """Flush for up to ``timeout_s``, then stop the thread; returns the steps left
        unreplicated (logged: they exist only on this node's disk)."""
        if self._stop:
            return self.pending()
        left = self.flush(timeout_s) if timeout_s > 0 else self.pending()
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        self._thread.join(timeout=30)
        if left:
            log.warning("checkpoint replication stopped with steps %s only on local disk (%s); "
                        "they are lost if this node is", left, self.local.store.uri)
        return left

    # ------------------------------------------------------------------ thread
    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._stop:
                    self._cv.wait()
                if self._stop:
                    return
                entry = self._queue[0]
            info = self._committed(entry)
            if info is not None:
                self._replicate_with_retry(info)
            with self._cv:
                self._queue.popleft()
                self._cv.notify_all()

    def _committed(self, entry: list) -> Optional[CheckpointInfo]:
        item = entry[0]
        if isinstance(item, CheckpointInfo):
            return item
        info, err = item.outcome()
        if err is not None:  # the save's own error reaches the worker through the handle
            log.warning("checkpoint of step %d failed locally (%s); nothing to replicate",
                        item.step, err)
            return None
        with self._cv:
            entry[1] = time.time()
        return info

    def _replicate_with_retry(self, info: CheckpointInfo) -> None:
        delay = self.backoff_s
        while True:
            try:
                self.replicate(info.name)
                self.replicated.append(info.name)
                self.last_error = None
                return
            except _LOCAL_GONE as e:
                if getattr(e, "where", "") != "remote":
                    log.warning("local copy of checkpoint %s cannot be replicated (%s); dropping "
                                "it (an older checkpoint + lineage replay still rebuild its state)",
                                info.name, e)
                    self.dropped.append(info.name)
                    return
                self.last_error = str(e)
            except Exception as e:  # noqa: BLE001 - outage, permissions, full disk: retried
                self.last_error = f"{type(e).__name__}: {e}"
            log.warning("replicating checkpoint %s to %s failed (%s); retrying in %.1f s",
                        info.name, self.remote.store.uri, self.last_error, delay)
            with self._cv:
                if self._cv.wait_for(lambda: self._stop, timeout=delay):
                    return
            delay = min(delay * 2, self.max_backoff_s)

    def replicate(self, name: str) -> None:
        """Copy checkpoint ``name`` from the local store to the run store: objects (each verified
        against its hash as it is read), then the manifest, verified there; then ``latest`` moves
        (never backwards) and retention runs. Idempotent: objects present with their size are
        skipped, so a retry after an outage copies only what is missing."""
        step, _ = _parse_name(name)
        _, m = self.local._read_manifest(name)
        raw = self.local.store.get_json_raw(layout.checkpoint_doc(name))
        algos, default = _object_algos(m), _manifest_algo(m)
        src, dst = self.local.store, self.remote.store

        def copy(item):
            sha, size = item
            if dst.object_size(sha) == size:
                return
            data = src.get_bytes(sha, verify=True, algo=algos.get(sha, default),
                                 what=f"local copy of checkpoint {name}")
            dst.put_parts([data], sha=sha)

        with self.remote._lock:
            marker = self.remote._begin("replicate", step)  # gc keeps our objects meanwhile
            try:
                dst.map(copy, sorted(m["objects"].items()))
                self.remote.check_fence(f"the manifest of checkpoint {name} (replicated)")
                dst.put_json_raw(layout.checkpoint_doc(name), raw)  # manifest last
                problems = self.remote.verify(name, hashes=False)
                if problems:
                    err = CorruptObjectError(f"checkpoint {name} failed verification in "
                                             f"{dst.uri} after replication: {'; '.join(problems)}")
                    err.where = "remote"  # retried: the local copy is fine
                    raise err
                cur = self.remote._latest_name()
                if cur is None or _parse_name(cur)[0] <= step:
                    self.remote.check_fence(f"moving latest to checkpoint {name} (replicated)")
                    dst.put_json(layout.LATEST_DOC, {"name": name, "step": step, "sha": name[13:]})
            finally:
                self.remote._end(marker)
        try:
            dst.append_log(layout.CHECKPOINT_LOG, {"event": "replicated", "name": name,
                                                   "step": step, "time": time.time(),
                                                   "nbytes": sum(m["objects"].values())})
        except Exception as e:  # noqa: BLE001 - the log is informational
            log.warning("could not append to the checkpoints log: %s", e)
        log.info("checkpoint %s replicated to %s", name, dst.uri)
        self.remote._retain()

