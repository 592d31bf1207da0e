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

from verl_core.checkpoint.async_save import AsyncCheckpointer
from verl_core.checkpoint.errors import (CheckpointNotFoundError, CorruptObjectError, PermanentError,
                                        UnsafeManifestError)
from verl_core.checkpoint.hf_export import TOKENIZER_DOC, store_tokenizer
from verl_core.checkpoint.manager import CheckpointManager, open_checkpoint
from verl_core.checkpoint.store import NotFoundError, RunStore
from verl_core.config import RunConfig
from verl_core.data.batch import Batch, batch_from_parquet_bytes, batch_to_parquet_bytes
from verl_core.engine.assets import materialize_assets
from verl_core.trainer import RLTrainer

log = logging.getLogger(__name__)


class StateUnavailableError(PermanentError):
    """The state a phase asks for can be neither found nor rebuilt."""


# what makes one checkpoint unusable (not the store): the worker then tries an older one
_REJECTED = (CorruptObjectError, UnsafeManifestError, CheckpointNotFoundError, NotFoundError)


def _needed(info) -> list[str]:
    """The groups a resume reads: all but the reference model, which the assets rebuild."""
    return [g for g in info.groups if g != "reference"]


def put_batch(store: RunStore, batch: Batch) -> str:
    return store.put_bytes(batch_to_parquet_bytes(batch))


def get_batch(store: RunStore, ref: str) -> Batch:
    return batch_from_parquet_bytes(store.get_bytes(ref, what=f"batch {ref[:12]}"))


class RunWorker:
    """One run's trainer, checkpoints and lineage in one store."""

    def __init__(self, store_uri: str, config_json: str, assets_index: dict,
                 storage_options: dict | None = None):
        self.cfg = RunConfig.from_dict(json.loads(config_json))
        if self.cfg.num_threads:
            torch.set_num_threads(self.cfg.num_threads)
        self.store = RunStore(store_uri, storage_options)
        self.config_hash = self.cfg.trajectory_hash()  # names lineage and checkpoints
        self.assets = materialize_assets(self.store, assets_index)
        c = self.cfg.checkpoint
        self.ckpt = CheckpointManager(self.store, keep_last=c.keep_last or None,
                                      keep_every=c.keep_every or None)
        self.async_ckpt = AsyncCheckpointer(self.ckpt) if c.async_save else None
        self.trainer = RLTrainer(self.cfg, self.assets)
        if not self.store.has_json(TOKENIZER_DOC):  # once per run: `checkpoint export` ships it
            store_tokenizer(self.store, self.trainer.tokenizer)
        self.step = 0  # updates applied to the in-memory state
        self.base_step = 0  # step of the state the run started from
        self._live_valid = True  # False while (or after a failed attempt at) changing the state
        if self.cfg.checkpoint.resume_from_checkpoint not in ("auto", "none", ""):
            self._rebuild_base()
        self.last_save_time = time.time()
        self.replayed = 0  # updates replayed from lineage (reported in metrics and tests)

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
            self.trainer = RLTrainer(self.cfg, self.assets)
            self.step = 0
            if spec not in ("auto", "none", ""):
                mgr, ref = open_checkpoint(spec, self.store.storage_options)
                groups, meta, info = mgr.load(ref, groups=_needed(mgr.read_manifest(ref)[0]))
                self._apply(groups, meta, info.step)
                self.base_step = info.step

    def _apply(self, groups, meta, step: int) -> None:
        self.trainer.load_state(groups, meta)
        self.step = step

    def _load_checkpoint(self, max_step: int | None, min_step: int = -1) -> bool:
        """Load the newest valid checkpoint of this trajectory with min_step < step <= max_step."""
        infos = [i for i in self.ckpt.list_checkpoints()
                 if i.error is None and i.config_hash == self.config_hash
                 and (max_step is None or i.step <= max_step) and i.step > min_step]
        for info in sorted(infos, key=lambda i: i.step, reverse=True):
            try:
                # the reference model is rebuilt from the assets, so its stored copy is not read;
                # weights are read straight into the live parameters (no second copy in memory),
                # which is why a failed load leaves the state marked unknown
                with self._changing_state():
                    groups, meta, _ = self.ckpt.load(info.name, groups=_needed(info),
                                                     out=self.trainer.load_targets())
                    self._apply(groups, meta, info.step)
            except _REJECTED as e:  # a damaged checkpoint: fall back to an older one.
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
                          or not self._has_lineage(self.step, step)):
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
        ref = put_batch(self.store, batch)
        metrics["timing/rollout_s"] = time.perf_counter() - t0
        return ref, metrics

    def update(self, step: int, batch_ref: str) -> dict:
        self.ensure_state(step)
        t0 = time.perf_counter()
        batch = get_batch(self.store, batch_ref)
        with self._changing_state():
            metrics = self.trainer.update(batch, step)
            self.step = step + 1
        # record how this state was made before anyone is told it exists
        self.store.put_json(self._lineage(step), {"step": step, "batch": batch_ref})
        metrics["timing/update_s"] = time.perf_counter() - t0
        return metrics

    def should_checkpoint(self, step: int) -> bool:
        c = self.cfg.checkpoint
        return (step % c.checkpoint_interval == 0 or step == self.cfg.total_steps
                or (c.checkpoint_interval_s > 0
                    and time.time() - self.last_save_time >= c.checkpoint_interval_s))

    def checkpoint(self, step: int, force: bool = False) -> dict:
        """Save the state after ``step`` updates if the interval says so. Async saves return as
        soon as the state is snapshotted; the write finishes in the background."""
        if not (force or self.should_checkpoint(step)):
            return {"checkpoint/saved": 0.0}
        self.ensure_state(step)
        t0 = time.perf_counter()
        groups, meta = self.trainer.state(with_optimizer=self.cfg.checkpoint.save_optimizer_state)
        meta["step"] = step
        if self.async_ckpt is not None:
            self.async_ckpt.save(step, groups, meta, config_hash=self.config_hash)
        else:
            self.ckpt.save(step, groups, meta, config_hash=self.config_hash)
        self.last_save_time = time.time()
        return {"checkpoint/saved": 1.0, "checkpoint/blocked_s": time.perf_counter() - t0}

    def wait_checkpoints(self):
        if self.async_ckpt is not None:
            return self.async_ckpt.wait()
        return None

    def evaluate(self, step: int) -> dict:
        self.ensure_state(step)
        return self.trainer.evaluate()

    def export_final(self, step: int, folder: str) -> str:
        """Write the policy after ``step`` updates as a Hugging Face folder (local path)."""
        self.ensure_state(step)
        os.makedirs(folder, exist_ok=True)
        self.trainer.actor.save_pretrained(folder, safe_serialization=True)
        self.trainer.tokenizer.save_pretrained(folder)
        return folder

    def close(self):
        try:
            self.wait_checkpoints()
        finally:
            if self.async_ckpt is not None:
                self.async_ckpt.close(raise_errors=False)
            self.trainer.close()
