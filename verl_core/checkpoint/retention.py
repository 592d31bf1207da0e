"""Retention and garbage collection: which checkpoints a run keeps (``keep_last``, ``keep_every``,
``best``) and which objects nothing in the run store can still ask for. Mixed into
:class:`~verl_core.checkpoint.manager.CheckpointManager`."""

from __future__ import annotations

import json
import logging
import time
from typing import Optional

from verl_core import layout
from verl_core.checkpoint.manifest import _parse_name, _shas_in
from verl_core.errors import CorruptObjectError
from verl_core.store import NotFoundError, RunStore, is_sha256

# the manager's log: its records keep the logger name they had before this module was split out
log = logging.getLogger("verl_core.checkpoint.manager")


class CheckpointRetention:
    """The retention half of :class:`~verl_core.checkpoint.manager.CheckpointManager`."""

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
            best = self.best_step()
            if best is not None:  # checkpoint.keep_best: its step's checkpoints stay
                keep |= {n for n in names if _parse_name(n)[0] == best}
            deleted = [n for n in names if n not in keep]
            for n in deleted:
                self.store.delete_json(layout.checkpoint_doc(n))
                log.info("retention: deleted checkpoint %s", n)
            if deleted:
                self.gc()
            return deleted

    def best_step(self) -> Optional[int]:
        """The step ``best.json`` names (``checkpoint.keep_best``), or None."""
        try:
            doc = self.store.get_json(layout.BEST_DOC, default=None)
        except CorruptObjectError as e:
            log.warning("best.json is unreadable (%s); ignoring it", e)
            return None
        step = doc.get("step") if isinstance(doc, dict) else None
        return step if isinstance(step, int) and not isinstance(step, bool) else None

    def gc(self, *, grace_s: Optional[float] = None) -> dict:
        """Delete objects that nothing in the run store can still ask for
        (docs/design.md#rule-6-the-run-store-is-hermetic).

        Live (never deleted): every object of a kept manifest, and every object named anywhere in
        a JSON doc under the run store's root folders (:data:`~verl_core.layout.GC_ROOT_FOLDERS`):
        the assets index (model and dataset files a fresh host materialises), the lineage log (the
        batch of every applied update, which a rebuild or an extension replays), ``pending/``
        (phase outputs not yet consumed by an update), shared groups and the tokenizer, staged
        shard records. Objects
        younger than ``grace_s`` are never deleted either. Skipped while another process has a
        save in flight (younger than ``inflight_timeout_s``). Returns counts."""
        grace = self.gc_grace_s if grace_s is None else grace_s
        now = time.time()
        with self._lock:
            for mk in self.store.list_json(layout.INFLIGHT):  # ours too: gc runs after our saves
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
                raw = self.store.get_json_raw(layout.checkpoint_doc(name))
                live.update(k for k in json.loads(raw).get("objects", {}) if is_sha256(k))
            except NotFoundError:
                continue
            except ValueError:
                log.warning("gc: manifest %s is unparseable; its objects are not kept", name)
        docs = [d for folder in layout.GC_ROOT_FOLDERS for d in _docs_under(self.store, folder)]
        for doc in self.store.map(lambda d: self.store.get_json(d, default=None), docs):
            live.update(_shas_in(doc))
        return live


def _docs_under(store: RunStore, folder: str) -> list[str]:
    """Every JSON doc under ``folder``, at any depth."""
    out = list(store.list_json(folder))
    for sub in store.list_folders(folder):
        out.extend(_docs_under(store, sub))
    return out
