"""Loading checkpoints: verified loads into this process, the ``auto`` fallback over older
checkpoints, and collective loads in place into any sharding (DCP). Mixed into
:class:`~verl_core.checkpoint.manager.CheckpointManager`, whose resolution and manifest reads it
uses."""

from __future__ import annotations

import json
import logging
from typing import Any, Mapping, Optional, Sequence, Union

import torch

from verl_core import layout
from verl_core.checkpoint.manifest import CheckpointInfo, _group_algo, _manifest_algo
from verl_core.checkpoint.state import flatten_state, from_json, unflatten_state
from verl_core.checkpoint.tensors import load_tensors, torch_dtype
from verl_core.errors import (CheckpointDisagreementError, CheckpointNotFoundError,
                              CorruptObjectError, NoValidCheckpointError, PermanentError,
                              StoreFullError, StoreUnavailableError, TransientError,
                              UnsafeManifestError)
from verl_core.store import NotFoundError, StorePermissionError
from verl_core.training.dist import SINGLE, DataParallel

# the manager's log: its records keep the logger name they had before this module was split out
log = logging.getLogger("verl_core.checkpoint.manager")

_LOAD_ERRORS = (CorruptObjectError, UnsafeManifestError, NotFoundError, CheckpointNotFoundError)


class CheckpointLoading:
    """The load half of :class:`~verl_core.checkpoint.manager.CheckpointManager`."""

    def load(self, ref: Union[str, int] = "auto", groups: Optional[Sequence[str]] = None, *,
             out: Optional[Mapping[str, Mapping[str, torch.Tensor]]] = None,
             ) -> tuple[dict[str, Any], dict, CheckpointInfo]:
        """Load and verify a checkpoint into this process: ``(groups, meta, info)``. Any
        checkpoint loads, whatever the number of workers that wrote it.

        Args:
            ref: ``auto`` (newest valid: latest, its parents, then the rest newest first, with a
                warning naming each rejected checkpoint and why), or anything :meth:`resolve`
                accepts (no fallback then: a damaged checkpoint raises).
            groups: group names to load (default all). Unknown names raise KeyError.
            out: ``{group: {tensor: destination}}`` to load in place (a model's parameters).
        Raises :class:`CheckpointNotFoundError` when the store has no checkpoint,
        :class:`NoValidCheckpointError` when ``auto`` rejected all of them, and
        :class:`CorruptObjectError`/:class:`UnsafeManifestError` for an explicit damaged ref.
        """
        return self._with_fallback(ref, lambda name: self._load_verified(name, groups, out))

    def _with_fallback(self, ref, fn, dp: DataParallel = SINGLE):
        if ref != "auto":
            return fn(self.resolve(ref))
        rejected = []
        candidates = self._auto_candidates()
        while True:
            name = next(candidates, None)
            if dp.distributed:  # every rank tries the same candidate, or none does
                if all(n is None for n in dp.gather_objects(name)):
                    break
                name = self.agree_on(name, dp)
            elif name is None:
                break
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

    def _quarantine(self, sha: str, algo: str) -> bool:
        """Move object ``sha`` aside if its bytes do not hash to it under ``algo`` (the algorithm
        of the manifest naming it), so the next save that holds its tensors writes it again."""
        try:
            return self.store.quarantine_object(sha, algo=algo)
        except Exception as e:  # noqa: BLE001 - the load's own error is the one to report
            log.warning("could not quarantine damaged object %s: %s", sha, e)
            return False

    def _load_verified(self, name, groups, out):
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
            algo = _group_algo(m, doc)
            try:
                tensors = load_tensors(self.store, doc["tensors"], out=(out or {}).get(g),
                                       what=what, algo=algo)
            except CorruptObjectError as e:
                if e.sha:  # a damaged object must not poison later checkpoints that reuse it
                    self._quarantine(e.sha, algo)
                raise
            result[g] = unflatten_state(tensors, doc["tree"], what=what)
        self._last_name = name
        return result, meta, info

    def _read_meta(self, name: str, m: Mapping) -> dict:
        """The meta of checkpoint ``name`` (manifest ``m``) as :meth:`load` returns it: the object
        must hash to its name, have the size the manifest lists and hold a JSON object in
        ``state.to_json``'s encoding. :meth:`verify` runs this too, so the two never disagree."""
        what = f"checkpoint {name} meta"
        sha, size = m["meta"]["sha"], m["meta"]["size"]
        try:
            raw = self.store.get_bytes(sha, what=what, algo=_manifest_algo(m))
        except CorruptObjectError:
            self._quarantine(sha, _manifest_algo(m))
            raise
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

    # ---------------------------------------------------------------------- collective loads
    def agree_on(self, name: Optional[str], dp: DataParallel = SINGLE) -> str:
        """Every rank of ``dp`` passes the manifest name it is about to load (``<step>-<sha256 of
        the manifest>``, or None if it found none); returns it when all agree, else raises
        :class:`CheckpointDisagreementError` on every rank, naming each rank's step and manifest
        sha. A collective (nothing to compare with ``dp.size == 1``)."""
        names = dp.gather_objects(name) if dp.distributed else [name]
        if len(set(names)) == 1 and names[0] is not None:
            return names[0]

        def choice(n: Optional[str]) -> str:
            if n is None:
                return "none (no checkpoint found)"
            m = layout.CHECKPOINT_NAME_RE.match(n) if isinstance(n, str) else None
            return f"step {int(m.group(1))} manifest sha256 {m.group(2)}" if m else repr(n)

        if len(set(names)) == 1:
            raise CheckpointNotFoundError(f"no worker found a checkpoint to restore in "
                                          f"{self.store.uri}")
        raise CheckpointDisagreementError(
            f"workers disagree on the checkpoint to restore from {self.store.uri}: "
            + "; ".join(f"rank {r}: {choice(n)}" for r, n in enumerate(names))
            + ". Nothing was loaded. Every worker must see the same run store (the same path or "
            "bucket, no stale mount or cache) and the same `latest`; fix that, then re-run",
            {r: n for r, n in enumerate(names)})

    def load_distributed(self, ref: Union[str, int], state: Mapping[str, Any], *,
                         dp: DataParallel = SINGLE, groups: Optional[Sequence[str]] = None,
                         ) -> tuple[dict, CheckpointInfo]:
        """Load checkpoint ``ref`` in place into ``state`` on every rank of ``dp`` (a collective);
        returns ``(meta, info)``, the same on every rank.

        ``state`` is ``{group: state_dict}`` as :meth:`save_distributed` takes it (e.g. from
        ``get_model_state_dict``/``get_optimizer_state_dict``, then applied with
        ``set_model_state_dict``/``set_optimizer_state_dict``); ``groups`` limits the load to some
        of them (default: all of ``state``). Its tensors, DTensors of any sharding or plain tensors,
        are filled in place with torch.distributed.checkpoint's read plan, so a checkpoint written
        by W workers loads on any number of workers, each reading (and hash-verifying) only the
        objects holding its rows. Then each group dict is rebuilt from the checkpoint's JSON state
        tree (its non-tensor values) around those same tensor objects; a tensor of the checkpoint
        the target lacks is loaded whole into a new plain tensor. Every target tensor must be in the
        checkpoint with the same shape and dtype.

        ``ref`` is resolved on every rank, which must agree on the manifest
        (:meth:`agree_on`) before anything is read. ``auto`` falls back collectively: a checkpoint
        that fails on any rank is rejected on all of them and the next candidate is tried. Errors
        are raised on every rank.
        """
        wanted = list(state) if groups is None else list(groups)
        for g in wanted:
            if g not in state:
                raise KeyError(f"group {g!r} is not in the state passed to load_distributed")
        return self._with_fallback_collective(
            ref, dp, lambda name: self._load_dcp(name, {g: state[g] for g in wanted}, dp,
                                                 rebuild=True))

    def load_into(self, ref: Union[str, int], group: str, target: Mapping[str, Any], *,
                  dp: DataParallel = SINGLE) -> CheckpointInfo:
        """Load the tensors of ``group`` in place into ``target`` (e.g. ``model.state_dict()`` or
        ``dict(model.named_parameters())``; a subset of the group's tensors is fine) and return the
        checkpoint's info. DTensor targets (FSDP2) get their own rows: pass ``dp`` and call it on
        every rank. The target dict itself is not changed."""
        return self._with_fallback_collective(
            ref, dp, lambda name: self._load_dcp(name, {group: target}, dp, rebuild=False)[1])

    def _with_fallback_collective(self, ref, dp: DataParallel, fn):
        """:meth:`_with_fallback` for loads that every rank runs together: each candidate is agreed
        on first (:meth:`agree_on`), and rejected on every rank when it fails on any (``fn``
        raises the same error on every rank)."""
        if not dp.distributed:
            return self._with_fallback(ref, fn)
        if ref != "auto":
            try:
                name, err = self.resolve(ref), None
            except _LOAD_ERRORS as e:
                name, err = None, e
            try:
                name = self.agree_on(name, dp)
            except CheckpointNotFoundError:
                if err is not None:
                    raise err from None
                raise
            return fn(name)
        return self._with_fallback("auto", fn, dp)

    def _load_dcp(self, name: str, state: Mapping[str, Any], dp: DataParallel, *,
                  rebuild: bool) -> tuple[dict, CheckpointInfo]:
        from verl_core.checkpoint import dcp  # torch.distributed.checkpoint: ~1 s to import

        info, m = _collectively(dp, lambda: self._read_manifest(name))
        meta = _collectively(dp, lambda: self._read_meta(name, m))
        # every rank checks its targets, and all stop if any rank's do not fit: a rank that
        # skipped DCP's collectives would leave the others waiting for it
        flat, extra, tensors = _collectively(dp, lambda: _load_targets(name, m, state, rebuild))
        reader = dcp.StoreReader(self.store, {g: m["groups"][g] for g in state},
                                 keys=set(tensors), what=f"checkpoint {name}",
                                 default_algo=_manifest_algo(m), on_corrupt=self._quarantine)
        with torch.no_grad():
            dcp.load(tensors, reader, process_group=self._process_group(dp),
                     no_dist=not dp.distributed, rank=dp.rank)
        if rebuild:
            for g, sd in state.items():
                what = f"checkpoint {name} group {g!r}"
                value = unflatten_state({**flat[g], **extra[g]}, m["groups"][g]["tree"],
                                        what=what)
                if isinstance(sd, dict) and isinstance(value, dict):
                    sd.clear()
                    sd.update(value)
                else:
                    raise CorruptObjectError(f"{what}: the stored state is a "
                                             f"{type(value).__name__}; load it with load()")
        self._last_name = name
        return meta, info


def _load_targets(name: str, m: Mapping, state: Mapping[str, Any], rebuild: bool):
    """``(flat, extra, tensors)`` of a collective load of checkpoint ``name`` (manifest ``m``)
    into ``state``: each group's target tensors by name (``flat``; with ``rebuild`` the group is
    flattened like a save flattens it, else it is a ``{name: tensor}`` target), new whole tensors
    for what the checkpoint has and the target lacks (``extra``, ``rebuild`` only), and the DCP
    state dict of both (``tensors``). Every target tensor must be in the checkpoint with its
    shape (global, for DTensors) and dtype."""
    from verl_core.checkpoint import dcp

    flat: dict[str, dict] = {}
    extra: dict[str, dict] = {}
    tensors: dict[str, torch.Tensor] = {}
    for g, sd in state.items():
        if g not in m["groups"]:
            raise KeyError(f"group {g!r} is not in checkpoint {name}; it has "
                           f"{', '.join(m['groups'])}")
        index = m["groups"][g]["tensors"]
        ts = flat[g] = flatten_state(sd)[0] if rebuild else dict(sd)
        missing = sorted(set(ts) - set(index))
        if missing:
            raise KeyError(f"checkpoint {name} group {g!r} lacks {len(missing)} tensor(s) of the "
                           f"target: {', '.join(missing[:10])}")
        for n, t in ts.items():
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"target {g!r}/{n!r} is a {type(t).__name__}, not a tensor")
            e = index[n]
            if list(t.shape) != e["shape"] or t.dtype != torch_dtype(e["dtype"]):
                raise ValueError(f"checkpoint {name} group {g!r} tensor {n!r} is "
                                 f"{e['dtype']}{e['shape']}, the target is "
                                 f"{t.dtype}{list(t.shape)}")
            tensors[f"{g}{dcp.SEP}{n}"] = t
        if rebuild:  # checkpoint tensors the target lacks are loaded whole, as plain tensors
            extra[g] = {n: torch.empty(e["shape"], dtype=torch_dtype(e["dtype"]))
                        for n, e in index.items() if n not in ts}
            tensors.update({f"{g}{dcp.SEP}{n}": t for n, t in extra[g].items()})
    return flat, extra, tensors


def _collectively(dp: DataParallel, fn):
    """``fn()`` on every rank; if it raised on any, raise on every rank (this rank's own error,
    else the lowest failing rank's), so that all ranks take the same path afterwards."""
    try:
        result, err = fn(), None
    except Exception as e:  # noqa: BLE001 - re-raised below, on every rank
        result, err = None, e
    if not dp.distributed:
        if err is not None:
            raise err
        return result
    summary = None if err is None else (type(err).__name__, str(err), getattr(err, "sha", None))
    errors = dp.gather_objects(summary)  # plain strings between ranks, no exception objects
    if err is not None:
        raise err
    failed = [(r, e) for r, e in enumerate(errors) if e is not None]
    if failed:
        r, (kind, msg, sha) = failed[0]
        cls = _SHARED_ERRORS.get(kind)
        if cls is CorruptObjectError:
            raise CorruptObjectError(f"rank {r}: {msg}", sha=sha)
        raise cls(f"rank {r}: {msg}") if cls is not None else \
            PermanentError(f"rank {r}: {kind}: {msg}")
    return result


_SHARED_ERRORS = {c.__name__: c for c in (
    CorruptObjectError, UnsafeManifestError, NotFoundError, CheckpointNotFoundError,
    NoValidCheckpointError, StorePermissionError, StoreUnavailableError, StoreFullError,
    PermanentError, TransientError, KeyError, ValueError, TypeError)}
"""Errors another rank reports by name that this rank re-raises as the same class."""
