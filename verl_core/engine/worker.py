"""The run worker: a warm :class:`RLTrainer` behind step-addressed phase calls.

Phases name the state they need by *step* (the number of updates applied). The worker keeps that
state in memory between phases (like verl's resident hybrid engine); when it does not have it (a
fresh process after a crash, a cache hit that skipped phases, another pod) it rebuilds it exactly:

    newest verified checkpoint at or before the step (or the initial model)
    + replay of the finished updates after it, each from its stored batch (the lineage log).

Updates are deterministic (seeds derived from (seed, step, phase)), so a replayed state is
bit-identical to the original. That is what makes ``checkpoint_interval`` a speed knob, not a
correctness one, and lets an async checkpoint write die without losing anything.

Heavy work (generation, reference log-probs, critic values, the update) happens here; the reward
and advantage phases are light functions of the stored batch (see ``verl_core.engine.phases``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time

import torch

from verl_core.checkpoint.errors import (CheckpointNotFoundError, CorruptObjectError, PermanentError,
                                        UnsafeManifestError)
from verl_core.checkpoint.hf_export import TOKENIZER_DOC, store_tokenizer
from verl_core.checkpoint.manager import CheckpointManager, open_checkpoint
from verl_core.checkpoint.store import NotFoundError, RunStore, sha256_hex
from verl_core.config import RunConfig
from verl_core.data.batch import Batch, batch_from_parquet_bytes, batch_to_parquet_bytes
from verl_core.engine.assets import materialize_assets
from verl_core.guard.faults import maybe_inject
from verl_core.trainer import RLTrainer
from verl_core.training.dist import SINGLE, DataParallel

log = logging.getLogger(__name__)


class StateUnavailableError(PermanentError):
    """The state a phase asks for can be neither found nor rebuilt."""


# what makes one checkpoint unusable (not the store): the worker then tries an older one
_REJECTED = (CorruptObjectError, UnsafeManifestError, CheckpointNotFoundError, NotFoundError)


def _needed(info) -> list[str]:
    """The groups a resume reads: all but the reference model, which the assets rebuild."""
    return [g for g in info.groups if g != "reference"]


PENDING_PHASES = ("rollout", "reward", "advantage")
"""Phases whose output batch an update consumes (see :func:`pending_doc`)."""


def pending_doc(config_hash: str, step: int, phase: str) -> str:
    """Name of the doc that keeps a phase's output batch alive until the update of ``step`` has
    consumed it: a re-run whose earlier phases were cache hits reads those batches, so garbage
    collection must not delete them (``pending/`` is a gc root folder)."""
    return f"pending/{config_hash[:16]}/{step:09d}-{phase}"


def put_batch(store: RunStore, batch: Batch, *, pending: str | None = None) -> str:
    """Store ``batch`` as a parquet object; with ``pending`` (a :func:`pending_doc` name), also
    record it as a gc root. The root is written *before* the object, so a concurrent gc (which
    lists objects before it reads roots) can never see the object without its root."""
    data = batch_to_parquet_bytes(batch)
    sha = sha256_hex([data])
    if pending:
        store.put_json(pending, {"batch": sha})
    return store.put_parts([data], sha=sha)[0]  # hashed once


def get_batch(store: RunStore, ref: str) -> Batch:
    return batch_from_parquet_bytes(store.get_bytes(ref, what=f"batch {ref[:12]}"))


class RunWorker:
    """One run's trainer, checkpoints and lineage in one store."""

    def __init__(self, store_uri: str, config_json: str, assets_index: dict,
                 storage_options: dict | None = None, dp: DataParallel = SINGLE):
        self.cfg = RunConfig.from_dict(json.loads(config_json))
        # W > 1: one of W workers run in lock-step by ``engine.group``. Every worker keeps the
        # whole state machine below; decisions that depend on the store's view (which checkpoint,
        # whether lineage exists, the time-based interval) are rank 0's, and only rank 0 writes.
        self.dp = dp
        if self.cfg.num_threads:
            torch.set_num_threads(self.cfg.num_threads)
        self.store = RunStore(store_uri, storage_options)
        self.config_hash = self.cfg.trajectory_hash()  # names lineage and checkpoints
        self.assets = materialize_assets(self.store, assets_index)
        c = self.cfg.checkpoint
        self.ckpt = CheckpointManager(self.store, keep_last=c.keep_last or None,
                                      keep_every=c.keep_every or None, gc_grace_s=c.gc_grace_s)
        self._pending_save = None  # the SaveHandle of a background checkpoint write
        self.trainer = RLTrainer(self.cfg, self.assets, dp)
        if self.leader and not self.store.has_json(TOKENIZER_DOC):  # once per run (export)
            store_tokenizer(self.store, self.trainer.tokenizer)
        self.step = 0  # updates applied to the in-memory state
        self.base_step = 0  # step of the state the run started from
        self._live_valid = True  # False while (or after a failed attempt at) changing the state
        if self.cfg.checkpoint.resume_from_checkpoint not in ("auto", "none", ""):
            self._rebuild_base()
        self.last_save_time = time.time()
        self.replayed = 0  # updates replayed from lineage (reported in metrics and tests)

    # ------------------------------------------------------------------ workers
    @property
    def leader(self) -> bool:
        """Rank 0: the one worker that writes to the store."""
        return self.dp.rank == 0

    def _lead(self, value):
        """Rank 0's ``value`` on every worker (a collective; the value itself when W = 1)."""
        return self.dp.gather_objects(value)[0] if self.dp.distributed else value

    # ------------------------------------------------------------------ state
    def _lineage(self, step: int) -> str:
        return f"lineage/{self.config_hash[:16]}/{step:09d}"

    @contextlib.contextmanager
    def _changing_state(self):
        """Mark the in-memory state as unknown while it changes. If the change fails half-way (an
        error in the middle of an update, a store outage while a checkpoint is read into the live
        weights), the next :meth:`ensure_state` rebuilds the state instead of trusting it."""
        self._live_valid = False
        yield
        self._live_valid = True

    def _rebuild_base(self) -> None:
        """The state the run started from: an explicit ``resume_from_checkpoint`` (any store) or
        the initial model of the assets (step 0)."""
        spec = self.cfg.checkpoint.resume_from_checkpoint
        with self._changing_state():
            self.trainer.close()
            self.trainer = RLTrainer(self.cfg, self.assets, self.dp)
            self.step = 0
            if spec not in ("auto", "none", ""):
                mgr, ref = open_checkpoint(spec, self.store.storage_options)
                self._load_from(mgr, mgr.read_manifest(ref)[0])
                self.base_step = self.step

    def _load_from(self, mgr: CheckpointManager, info) -> None:
        """Read checkpoint ``info`` of ``mgr`` into the live state and take its step.

        The reference model is rebuilt from the assets, so its stored copy is not read; weights
        are read straight into the live parameters (no second copy in memory), which is why the
        caller marks the state unknown while this runs. With W > 1 every worker reads only its
        shards' rows (DCP resharding, whatever W wrote them), after the workers agreed on the
        manifest (``load_distributed`` compares every worker's choice and refuses to restore if
        they differ, naming each worker and manifest hash)."""
        needed = _needed(info)
        if self.dp.distributed:
            state = self.trainer.load_targets(groups=needed)
            meta, _ = mgr.load_distributed(info.name, state, dp=self.dp, groups=list(state))
            groups = state
        else:
            groups, meta, _ = mgr.load(info.name, groups=needed,
                                       out=self.trainer.load_targets(groups=needed))
        self.trainer.load_state(groups, meta)
        self.step = info.step

    def _load_checkpoint(self, max_step: int | None, min_step: int = -1) -> bool:
        """Load the newest valid checkpoint of this trajectory with min_step < step <= max_step."""
        infos = self._lead(sorted(
            (i for i in self.ckpt.list_checkpoints()
             if i.error is None and i.config_hash == self.config_hash
             and (max_step is None or i.step <= max_step) and i.step > min_step),
            key=lambda i: i.step, reverse=True))
        for info in infos:
            try:
                with self._changing_state():
                    self._load_from(self.ckpt, info)
            except _REJECTED as e:  # a damaged checkpoint: fall back to an older one (with W > 1
                # load_distributed raises on every worker, so they all move on together).
                # A store error (an outage, missing permissions) propagates instead: the phase is
                # retried or fails, rather than quietly replaying from an older checkpoint.
                log.warning("checkpoint %s rejected (%s); trying an older one", info.name, e)
                continue
            return True
        return False

    def ensure_state(self, step: int) -> None:
        """Make the in-memory state the one after ``step`` updates (see the module docstring)."""
        if step == self.step and self._live_valid:
            return
        # Going forward, a checkpoint past the in-memory state saves replaying up to it.
        ahead = (self._live_valid and step > self.step
                 and self._load_checkpoint(max_step=step, min_step=self.step))
        if not ahead and (not self._live_valid or step < self.step
                          or not self._lead(self._has_lineage(self.step, step))):
            if not self._load_checkpoint(max_step=step):
                self._rebuild_base()
                if self.step > step:
                    raise StateUnavailableError(
                        f"state of step {step} is gone: no checkpoint at or before it in "
                        f"{self.store.uri} and the run started from step {self.step}; re-run with "
                        "--overwrite-cache to recompute, or resume from a checkpoint")
        for s in range(self.step, step):
            doc = self.store.get_json(self._lineage(s), default=None)
            if doc is None:
                raise StateUnavailableError(
                    f"cannot rebuild the state of step {step}: the batch of update {s} is not in "
                    f"{self.store.uri} (lineage {self._lineage(s)} missing); re-run with "
                    "--overwrite-cache to recompute those phases")
            batch = get_batch(self.store, doc["batch"])
            with self._changing_state():
                self.trainer.update(batch, s)
                self.step = s + 1
            self.replayed += 1

    def _has_lineage(self, start: int, stop: int) -> bool:
        return all(self.store.has_json(self._lineage(s)) for s in range(start, stop))

    # ------------------------------------------------------------------ phases
    def rollout(self, step: int) -> tuple[str, dict]:
        self.ensure_state(step)
        t0 = time.perf_counter()
        batch, metrics = self.trainer.rollout(step)
        if not self.leader:  # the driver takes rank 0's answer
            return "", metrics
        ref = put_batch(self.store, batch,
                        pending=pending_doc(self.config_hash, step, "rollout"))
        metrics["timing/rollout_s"] = time.perf_counter() - t0
        return ref, metrics

    def update(self, step: int, batch_ref: str) -> dict:
        self.ensure_state(step)
        t0 = time.perf_counter()
        batch = get_batch(self.store, batch_ref)
        if self.dp.distributed:  # VERL_FAULTS drills: a worker hanging (or killed) mid-update
            maybe_inject(f"update-rank{self.dp.rank}", step)
        with self._changing_state():
            metrics = self.trainer.update(batch, step)
            self.step = step + 1
        # record how this state was made before anyone is told it exists
        if self.leader:
            self.store.put_json(self._lineage(step), {"step": step, "batch": batch_ref})
            self._drop_pending(step)
        metrics["timing/update_s"] = time.perf_counter() - t0
        return metrics

    def _drop_pending(self, step: int) -> None:
        """The step's phase outputs are consumed: the lineage record now keeps the batch the
        update used; the rollout and reward batches may go. Best effort: a leftover doc only keeps
        a few batches alive, while failing here would fail an update that already happened."""
        for phase in PENDING_PHASES:
            try:
                self.store.delete_json(pending_doc(self.config_hash, step, phase))
            except Exception as e:  # noqa: BLE001
                log.warning("could not remove %s: %s", pending_doc(self.config_hash, step, phase), e)

    def should_checkpoint(self, step: int) -> bool:
        c = self.cfg.checkpoint
        return (step % c.checkpoint_interval == 0 or step == self.cfg.total_steps
                or (c.checkpoint_interval_s > 0
                    and time.time() - self.last_save_time >= c.checkpoint_interval_s))

    def checkpoint(self, step: int, force: bool = False, sync: bool = False) -> dict:
        """Save the state after ``step`` updates if the interval says so. Async saves return as
        soon as the state is snapshotted; the write finishes in the background (``sync``: wait
        for the commit)."""
        if not self._lead(force or self.should_checkpoint(step)):
            return {"checkpoint/saved": 0.0}
        self.ensure_state(step)
        t0 = time.perf_counter()
        # W > 1: gathered from the shards onto rank 0 (a collective); rank 0 writes
        # W > 1: every worker writes its own shards (DCP), rank 0 commits the manifest
        groups, meta = self.trainer.state(with_optimizer=self.cfg.checkpoint.save_optimizer_state)
        meta["step"] = step
        if self.cfg.checkpoint.async_save and not sync:
            self._pending_save = self.ckpt.async_save_distributed(
                step, groups, meta, config_hash=self.config_hash, dp=self.dp)
        else:
            self.wait_checkpoints()
            self.ckpt.save_distributed(step, groups, meta, config_hash=self.config_hash,
                                       dp=self.dp)
        self.last_save_time = time.time()
        return {"checkpoint/saved": 1.0, "checkpoint/blocked_s": time.perf_counter() - t0}

    def wait_checkpoints(self):
        """Block until the background checkpoint write committed; its info, or None if there is
        none (re-raises its error)."""
        handle, self._pending_save = self._pending_save, None
        return handle.wait() if handle is not None else None

    def has_checkpoint(self, step: int) -> bool:
        """A committed checkpoint of this trajectory at ``step`` is in the store."""
        return any(i.error is None and i.step == step and i.config_hash == self.config_hash
                   for i in self.ckpt.list_checkpoints())

    def commit_final(self, step: int) -> dict:
        """Make sure the run's last state is a committed checkpoint (DESIGN rule 7).

        An async checkpoint phase returns before its write commits, so its cached result does not
        prove a checkpoint exists: the write may have died with the process or failed (a full
        disk) after the phase was cached. Intermediate checkpoints are a speed knob (lineage
        replay rebuilds any state), but the final one is what an extension resumes from and what
        ``verify latest`` promises, so it is waited for here and, if it never committed, saved
        again synchronously. A background error propagates (the phase fails, nothing is cached)."""
        self.wait_checkpoints()
        if self._lead(self.leader and self.has_checkpoint(step)):
            return {"checkpoint/resaved": 0.0}
        log.warning("the checkpoint of step %d never committed in %s; saving it again", step,
                    self.store.uri)
        out = self.checkpoint(step, force=True, sync=True)
        return {"checkpoint/resaved": 1.0, **out}

    def evaluate(self, step: int) -> dict:
        self.ensure_state(step)
        return self.trainer.evaluate()

    def export_final(self, step: int, folder: str) -> str:
        """Write the policy after ``step`` updates as a Hugging Face folder (local path)."""
        self.ensure_state(step)
        self.trainer._sync_rollout_weights()  # W > 1: the full weights, gathered from the shards
        if self.leader:
            os.makedirs(folder, exist_ok=True)
            self.trainer.rollout_model.save_pretrained(folder, safe_serialization=True)
            self.trainer.tokenizer.save_pretrained(folder)
        return folder

    def close(self):
        try:
            self.wait_checkpoints()
        finally:
            try:
                self.ckpt.close()
            except Exception as e:  # noqa: BLE001 - already reported by wait_checkpoints
                log.error("background checkpoint failed: %s", e)
            self.trainer.close()
