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
and advantage phases are light functions of the stored batch (``phases.reward`` and
``phases.advantage``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import math
import os
import time

import torch

from verl_core.checkpoint.hf_export import store_tokenizer
from verl_core.checkpoint.local_tier import Replicator, open_local_store
from verl_core.checkpoint.manager import SHARED_GROUPS, CheckpointManager, open_checkpoint
from verl_core.store import NotFoundError, RunStore, is_sha256, sha256_hex
from verl_core.config import ConfigError, RunConfig
from verl_core.data.batch import Batch, batch_from_parquet_bytes, batch_to_parquet_bytes
from verl_core.engine.assets import materialize_assets
from verl_core.errors import (RECOVER, CheckpointNotFoundError, CorruptObjectError,
                              PermanentError, StaleBatchError, StoreUnavailableError,
                              UnsafeManifestError)
from verl_core.guard import checks, faults
from verl_core.guard.faults import maybe_inject
from verl_core.store.lease import FencedError
from verl_core.layout import (BEST_DOC, TOKENIZER_DOC, eval_samples_doc, lineage_doc,
                              pending_doc)
from verl_core.trainer import RLTrainer
from verl_core.training.advantage import compute_advantages
from verl_core.training.dist import SINGLE, DataParallel
from verl_core.validation import validate_and_record

log = logging.getLogger(__name__)


FINAL_REPLICATION_TIMEOUT_S = 300.0
"""Local tier: how long finalize waits for the final checkpoint to reach the run store."""
CLOSE_REPLICATION_TIMEOUT_S = 60.0
"""Local tier: how long closing a worker waits for unreplicated checkpoints (then reports them)."""


class StateUnavailableError(PermanentError):
    """The state a phase asks for can be neither found nor rebuilt."""


__all__ = ["RunWorker", "StateUnavailableError", "StaleBatchError", "RECOVER", "put_batch",
           "get_batch"]


# what makes one checkpoint unusable (not the store): the worker then tries an older one
_REJECTED = (CorruptObjectError, UnsafeManifestError, CheckpointNotFoundError, NotFoundError)


def _needed(info) -> list[str]:
    """The groups a resume reads: all but the frozen ones (the reference model, a LoRA
    policy's base), which the assets rebuild."""
    return [g for g in info.groups if g not in SHARED_GROUPS]


PENDING_PHASES = ("rollout", "reward", "advantage")
"""Phases whose output batch an update consumes (see :func:`pending_doc`)."""

INPUT_OF = {"reward": "rollout", "advantage": "reward"}
"""The phase whose batch each light phase reads (a rollout reads the state of its step)."""

def put_batch(store: RunStore, batch: Batch, *, pending: str | None = None) -> str:
    """Store ``batch`` as a parquet object; with ``pending`` (a :func:`pending_doc` name), also
    record it as a gc root. The root is written *before* the object, so a concurrent gc (which
    lists objects before it reads roots) can never see the object without its root."""
    data = batch_to_parquet_bytes(batch)
    sha = sha256_hex([data])
    if pending:
        store.put_json(pending, {"batch": sha})
    return store.put_parts([data], sha=sha)[0]  # hashed once


EVAL_SAMPLES = 8
"""Held-out responses (prompt, response, score) each evaluation keeps for the reports."""


def _digest(record: dict) -> str:
    """Digest of a lineage record (the weight version of the state it made)."""
    return sha256_hex([json.dumps(record, sort_keys=True).encode()])


def get_batch(store: RunStore, ref: str, *, quarantine: bool = False) -> Batch:
    """Batch object ``ref`` (hash-verified; with ``quarantine`` a damaged one is moved aside).
    Phases that read a batch another phase wrote go through :meth:`RunWorker.batch`, which
    recomputes a damaged one."""
    return batch_from_parquet_bytes(store.get_bytes(ref, what=f"batch {ref[:12]}",
                                                    quarantine=quarantine))


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
        self.trajectory_hash = self.cfg.trajectory_hash()  # names lineage and checkpoints
        self.assets = materialize_assets(self.store, assets_index)
        c = self.cfg.checkpoint
        self.ckpt = CheckpointManager(self.store, keep_last=c.keep_last or None,
                                      keep_every=c.keep_every or None, gc_grace_s=c.gc_grace_s)
        # checkpoint.local_dir: saves commit to the local tier, a Replicator copies them here
        self.local_ckpt: CheckpointManager | None = None
        self.replicator: Replicator | None = None
        self.lost_checkpoints: set[int] = set()  # local-tier steps a lost node took with it
        if c.local_dir:
            self.local_ckpt = CheckpointManager(
                open_local_store(c.local_dir, self.store), keep_last=c.keep_last or None,
                keep_every=c.keep_every or None, gc_grace_s=c.gc_grace_s)
            self.replicator = Replicator(self.local_ckpt, self.ckpt)
        self._pending_save = None  # the SaveHandle of a background checkpoint write
        self.trainer = RLTrainer(self.cfg, self.assets, dp)
        if self.leader and not self.store.has_json(TOKENIZER_DOC):  # once per run (export)
            store_tokenizer(self.store, self.assets.model_path)  # the user's files, as given
        self.step = 0  # updates applied to the in-memory state
        self.base_step = 0  # step of the state the run started from
        self._live_valid = True  # False while (or after a failed attempt at) changing the state
        if self.cfg.checkpoint.resume_from_checkpoint not in ("auto", "none", ""):
            self._rebuild_base()
        self.last_save_time = time.time()
        self.replayed = 0  # updates replayed from lineage (reported in metrics and tests)
        # The weight version: ``step`` plus the digest of the lineage record that made the state
        # (None: a checkpoint or the initial model made it). A detached worker of
        # cluster.mode=attached outlives the phases that built its state, so it checks the digest
        # against the store before trusting the state (``verify_live``).
        self.applied: str | None = None
        self.verify_live = False

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
        return lineage_doc(self.trajectory_hash, step)

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
            self.trainer.close()  # its background rollout and sampler process too
            self.trainer = RLTrainer(self.cfg, self.assets, self.dp)
            self.step = 0
            self.applied = None
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
        self.trainer.behaviour.drop_prefetch()  # it samples from the weights this load replaces
        if self.dp.distributed:
            state = self.trainer.load_targets(groups=needed)
            meta, _ = mgr.load_distributed(info.name, state, dp=self.dp, groups=list(state))
            groups = state
        else:
            groups, meta, _ = mgr.load(info.name, groups=needed,
                                       out=self.trainer.load_targets(groups=needed))
        self.trainer.load_state(groups, meta, info.step)
        self.step = info.step
        self.applied = None

    def _tiers(self) -> list[CheckpointManager]:
        """Where checkpoints are read from, preferred first: the local tier, then the run store."""
        return [m for m in (self.local_ckpt, self.ckpt) if m is not None]

    def _load_checkpoint(self, max_step: int | None, min_step: int = -1) -> bool:
        """Load the newest valid checkpoint of this trajectory with min_step < step <= max_step
        (with a local tier: its verified local copy first, else the run store's copy)."""
        tiers = self._tiers()
        infos = self._lead(sorted(
            ((i, t) for t, mgr in enumerate(tiers) for i in mgr.list_checkpoints()
             if i.error is None and i.config_hash == self.trajectory_hash
             and (max_step is None or i.step <= max_step) and i.step > min_step),
            key=lambda it: (it[0].step, -it[1]), reverse=True))
        if self.local_ckpt is not None:
            self._report_lost(infos[0][0].step if infos else self.base_step)
        for info, t in infos:
            try:
                with self._changing_state():
                    self._load_from(tiers[t], info)
            except _REJECTED as e:  # a damaged checkpoint: fall back to an older one (with W > 1
                # load_distributed raises on every worker, so they all move on together).
                # A store error (an outage, missing permissions) propagates instead: the phase is
                # retried or fails, rather than quietly replaying from an older checkpoint.
                log.warning("checkpoint %s%s rejected (%s); trying %s", info.name,
                            " (local copy)" if tiers[t] is self.local_ckpt else "", e,
                            "its run store copy or an older one" if tiers[t] is self.local_ckpt
                            else "an older one")
                continue
            return True
        return False

    def _report_lost(self, newest: int) -> list[int]:
        """Checkpoints of the interval schedule after ``newest`` (the newest one found) whose
        updates are in the lineage but which exist in no tier and are not queued for
        replication: a lost node's local checkpoints that never reached the run store. Their
        states are rebuilt by lineage replay; they are logged and counted (``checkpoint/lost``).
        Saves made only by ``checkpoint_interval_s`` cannot be inferred and are not listed."""
        k = self.cfg.checkpoint.checkpoint_interval
        have = {i.step for mgr in self._tiers() for i in mgr.list_checkpoints()
                if i.error is None and i.config_hash == self.trajectory_hash}
        have.update(self.replicator.pending() if self.replicator is not None else ())
        lost, s = [], (newest // k + 1) * k
        while self.store.has_json(self._lineage(s - 1)):
            if s not in have:
                lost.append(s)
            s += k
        if set(lost) - self.lost_checkpoints:
            log.warning("checkpoints of steps %s were committed on a local disk that is gone and "
                        "never reached %s; their states are rebuilt from older checkpoints + "
                        "lineage replay", lost, self.store.uri)
        self.lost_checkpoints.update(lost)
        return lost

    def version(self) -> dict:
        """The weight version this worker holds: ``step``, whether the state is intact, and the
        digest of the lineage record that produced it."""
        return {"step": self.step, "valid": self._live_valid, "applied": self.applied,
                "pid": os.getpid()}

    def _live_matches_store(self) -> bool:
        """The lineage record that made the live state is the store's (attached workers)."""
        if self.applied is None or self.step == 0:
            return True  # a verified checkpoint or the initial model made it
        try:
            doc = self.store.get_json(self._lineage(self.step - 1), default=None,
                                      quarantine=self.leader)
        except CorruptObjectError:  # moved aside: the live state cannot be vouched for
            doc = None
        return self._lead(doc is not None and _digest(doc) == self.applied)

    def ensure_state(self, step: int) -> None:
        """Make the in-memory state the one after ``step`` updates (see the module docstring)."""
        if step == self.step and self._live_valid:
            if not self.verify_live or self._live_matches_store():
                return
            log.warning("the state of step %d in this worker is not the one the store records "
                        "(lineage %s); rebuilding it from the store", step,
                        self._lineage(step - 1))
            self._live_valid = False
        self.trainer.behaviour.drop_prefetch()  # the state changes: a rollout of it is void
        faults.maybe_inject("restore", step)  # a VERL_FAULTS drill
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
        while self.step < step:
            s = self.step
            try:
                doc = self.store.get_json(self._lineage(s), default=None, quarantine=self.leader)
            except CorruptObjectError as e:
                # The record names the batch of update s; without it that update cannot be
                # redone (its input is known only to the cache entry of the advantage phase).
                raise StateUnavailableError(
                    f"cannot rebuild the state of step {step}: the lineage record of update {s} "
                    f"is damaged ({e}) and no checkpoint of this trajectory in {self.store.uri} "
                    f"lies between step {s + 1} and step {step}, so the states of steps "
                    f"{s + 1}..{step} cannot be rebuilt; {RECOVER}") from e
            if doc is None:
                raise StateUnavailableError(
                    f"cannot rebuild the state of step {step}: the batch of update {s} is not in "
                    f"{self.store.uri} (lineage {self._lineage(s)} missing); re-run with "
                    "--overwrite-cache to recompute those phases")
            self._replay(s, doc)
            self.replayed += 1

    def _replay(self, s: int, doc: dict) -> None:
        """Redo update ``s`` as its lineage record says it happened (:meth:`_carry_out`). The
        record, not a new decision, is replayed, so a rebuilt state is the original one whatever
        the detectors would say now."""
        self._carry_out(s, doc)

    def _carry_out(self, s: int, record: dict) -> None:
        """Make the state the one after update ``s`` as ``record`` (its lineage record) says the
        guard decided: ``update`` (applied: redone from its batch when replaying; live, it has
        just run), ``skip`` (the state before it, with the record's guard state) or ``rollback``
        (the state of the record's ``to`` step, with its guard state and LR scale). The one place
        guard actions are carried out, live (:meth:`update`) and replayed (:meth:`_replay`)."""
        action = record.get("action", "update")
        if action == "update":
            if self.step == s:  # replaying
                batch = self.batch(s, "advantage", record["batch"])
                with self._changing_state():
                    self.trainer.behaviour.push(s)  # the behaviour policy of the next rollouts
                    self.trainer.update(batch, s)
                    self.step = s + 1
        elif action == "skip":
            if not self._live_valid:  # the update may have run: rebuild the state before it
                self.ensure_state(s)
            self.trainer.guard = dict(record["guard"])
            self.trainer.behaviour.push(s)
            self.step = s + 1
        elif action == "rollback":
            self._roll_back(s, int(record["to"]), record["guard"])
        else:
            raise StateUnavailableError(f"lineage {self._lineage(s)} in {self.store.uri} has an "
                                        f"unknown action {action!r} (written by a newer version?)")
        self.applied = _digest(record)

    def _roll_back(self, s: int, to: int, guard: dict) -> None:
        """Make the state after update ``s`` the state of step ``to`` (loaded from its verified
        checkpoint, or rebuilt), with the guard state ``guard`` and its learning-rate scale."""
        self.ensure_state(to)
        with self._changing_state():
            before = float(self.trainer.guard.get("lr_scale", 1.0))
            self.trainer.guard = dict(guard)
            factor = float(guard.get("lr_scale", 1.0)) / before
            if factor != 1.0:
                self.trainer.scale_lr(factor)
            self.step = s + 1
            # off-policy: the next rollout samples the rolled-back weights (lag 0); what was
            # sampling from the discarded ones was dropped when the state was rebuilt
            self.trainer.behaviour.reset(s + 1)

    def _has_lineage(self, start: int, stop: int) -> bool:
        return all(self.store.has_json(self._lineage(s)) for s in range(start, stop))

    # ------------------------------------------------------------------ phases
    def rollout(self, step: int) -> tuple[str, dict]:
        self.ensure_state(step)
        t0 = time.perf_counter()
        batch, metrics = self._sample(step)
        self._count_engine_restarts(step, metrics)
        if not self.leader:  # the driver takes rank 0's answer
            return "", metrics
        validate_and_record(self.store, self.trajectory_hash, step, "rollout", batch, self.cfg)
        ref = put_batch(self.store, batch,
                        pending=pending_doc(self.trajectory_hash, step, "rollout"))
        metrics["timing/rollout_s"] = time.perf_counter() - t0
        return ref, metrics

    def _sample(self, step: int) -> tuple[Batch, dict]:
        """The rollout batch of ``step`` from the state after ``step`` updates: the trainer's
        rollout (from the behaviour policy: off-policy, maybe sampled in the background while
        the update before ran), or with ``algorithm.filter_groups_enable`` DAPO's dynamic
        sampling (scored already), which starts at the generation batch where the previous
        step's ended (:meth:`_gen_cursor`): off-policy taken from the background thread when
        the update before sampled it from that position (``RLTrainer.follow``), else sampled
        now, then the model inputs at the live state."""
        if not self.cfg.algorithm.filter_groups_enable:
            return self.trainer.rollout(step)
        from verl_core.engine.dynamic_sampling import sample_and_filter, with_model_inputs

        behaviour, cursor = self.trainer.behaviour, self._gen_cursor(step)
        got = behaviour.take(step) if behaviour.lag else None
        if got is not None and got[0].meta.get("gen_batches_start") != cursor:
            log.warning("the background rollout of step %d started at generation batch %s, "
                        "not %d where the batch of update %d ended; sampling it again", step,
                        got[0].meta.get("gen_batches_start"), cursor, step - 1)
            got = None
        if got is None:
            batch, metrics = sample_and_filter(self.trainer, step, cursor)
            if behaviour.lag:
                metrics["rollout/prefetched"] = 0.0
        else:
            batch, metrics = got
        # off-policy: the version and the live KL coefficient, as a plain rollout's
        batch, metrics = behaviour.stamp(step, batch, metrics, self.trainer.actor.kl_ctrl.value)
        return with_model_inputs(self.trainer, batch), metrics

    def _gen_cursor(self, step: int) -> int:
        """Generation batches (of DAPO's dynamic sampling) the steps before ``step`` consumed:
        0 at step 0, else the end the batch of update ``step - 1`` records (read through its
        lineage record, so a resumed or rebuilt run continues at the stored position)."""
        if step == 0:
            return 0
        name = self._lineage(step - 1)
        doc = self._lead(self.store.get_json(name, default=None, quarantine=self.leader)
                         if self.leader else None)
        if doc is None:
            raise StateUnavailableError(
                f"the rollout of step {step} (algorithm.filter_groups_enable) starts where the "
                f"batch of update {step - 1} ended, but {name} is not in {self.store.uri} (a run "
                "resumed from another store's checkpoint does not carry that position); start "
                "the run in the store that has its lineage, or from step 0")
        meta = self.batch(step - 1, "advantage", doc["batch"]).meta
        if "gen_batches_end" not in meta:
            raise StateUnavailableError(
                f"the batch of update {step - 1} records no data position "
                "(meta gen_batches_end): it was sampled without "
                "algorithm.filter_groups_enable, so it is another trajectory")
        return int(meta["gen_batches_end"])

    # ------------------------------------------------------------------ self-healing batches
    def batch(self, step: int, phase: str, ref: str) -> Batch:
        """Batch ``ref``, the output of ``phase`` of ``step``, for a phase that consumes it.

        A missing or damaged one (moved to ``quarantine/``) is not the end of the run: phases are
        deterministic given their inputs (docs/design.md#rule-3-phases-are-deterministic), so it is
        recomputed from that phase's own inputs (:meth:`_recompute`) and written again, but only if
        the result hashes to ``ref``, the name every cache entry and lineage record downstream of
        it holds. A cache hit that pointed at it is then true again. When it does not (the phase is
        not bit-reproducible here) or its inputs are gone too, the error names what is lost and
        :data:`RECOVER`. With W > 1 rank 0's view decides, and every worker recomputes (rollouts
        and the reward model are collectives); rank 0 writes."""
        err = None
        try:
            batch = get_batch(self.store, ref, quarantine=self.leader)
        except CorruptObjectError as e:
            batch, err = None, e
        if not self._lead(err is not None):
            if err is not None:
                raise err
            return batch
        what = f"the {phase} batch {ref[:12]} of step {step}"
        log.warning("%s is unreadable (%s); recomputing it from its inputs", what, err)
        try:
            batch = self._recompute(step, phase)
        except (CorruptObjectError, StateUnavailableError) as e:
            raise CorruptObjectError(f"{what} is unreadable ({err}) and cannot be recomputed: "
                                     f"{e}; {RECOVER}", sha=ref, path=err.path,
                                     quarantined=err.quarantined) from e
        got = ref
        if self.leader:
            data = batch_to_parquet_bytes(batch)
            got = sha256_hex([data])
            if got == ref:
                if not self.store.has_json(self._lineage(step)):  # not consumed: keep it rooted
                    self.store.put_json(pending_doc(self.trajectory_hash, step, phase),
                                        {"batch": ref})
                self.store.put_parts([data], sha=ref)  # the root first, as in put_batch
        if not self._lead(got == ref):  # (a collective: the others wait for rank 0's write)
            raise CorruptObjectError(
                f"{what} is unreadable ({err}); recomputing it from its inputs gave other bytes "
                f"({got[:12]}: this phase is not bit-reproducible on this host, or the code "
                f"changed), so it is lost and every state built on it with it; {RECOVER}",
                sha=ref, path=err.path, quarantined=err.quarantined)
        log.warning("%s recomputed bit-identical and written again", what)
        return batch if self.leader else get_batch(self.store, ref)

    def _recompute(self, step: int, phase: str) -> Batch:
        """The batch ``phase`` of ``step`` writes, computed again from its inputs: a rollout from
        the state after ``step`` updates; a reward or advantage batch from the batch before it,
        read (and itself recomputed if damaged) when its pending doc still names it, else
        recomputed from the state (the pending docs of a step go once its update is recorded).
        With W > 1 only rank 0's result is complete (as for the phases themselves)."""
        if phase == "rollout":
            self.ensure_state(step)
            return self._sample(step)[0]
        src = INPUT_OF[phase]
        ref = self._lead(self._pending_ref(step, src) if self.leader else None)
        upstream = self.batch(step, src, ref) if ref else self._recompute(step, src)
        if phase == "reward" and self.cfg.algorithm.filter_groups_enable:
            return upstream  # scored in the rollout phase (dynamic sampling), passed on as is
        if phase == "reward":
            return self.trainer.reward(upstream)[0]  # the reward phase's scoring, model or not
        return compute_advantages(upstream, self.cfg.algorithm)[0] if self.leader else upstream

    def _pending_ref(self, step: int, phase: str) -> str | None:
        """The batch the pending doc of ``phase`` of ``step`` names; None if it is gone or
        damaged (then moved to ``quarantine/``: it is rewritten when the batch is)."""
        name = pending_doc(self.trajectory_hash, step, phase)
        try:
            doc = self.store.get_json(name, default=None, quarantine=True)
        except CorruptObjectError as e:
            log.warning("%s", e)
            return None
        ref = doc.get("batch") if isinstance(doc, dict) else None
        return ref if is_sha256(ref) else None

    def restore_batch(self, step: int, phase: str, ref: str) -> str:
        """:meth:`batch` for the light phases, which run outside the workers: make batch ``ref``
        readable in the store again (or raise why it cannot be) and return it."""
        self.batch(step, phase, ref)
        return ref

    def update(self, step: int, batch_ref: str) -> dict:
        """Apply update ``step`` under the guard (docs/guard.md).

        The deterministic detectors look at the batch first (non-finite rewards, advantages or
        log-probs; reward collapse; response length), then at the update's own metrics
        (non-finite loss or gradients, gradient explosion, loss/KL/entropy trouble), each against
        the history of the steps before. The decision (``guard.policy.decide``) is carried out
        here and written into the lineage record of the step, which a rebuild replays:

        - ``skip_batch``: the state after the step is the state before it (rebuilt from the
          store, since the update may have touched the weights already);
        - ``rollback``: the state after the step is the state of the newest step of the
          checkpoint schedule before it, with the LR scaled by ``guard.rollback_lr_scale``;
        - ``retry_phase`` / ``halt``: nothing is recorded, the phase raises.
        """
        from verl_core.guard import policy

        self.ensure_state(step)
        t0 = time.perf_counter()
        batch = self.batch(step, "advantage", batch_ref)
        self.trainer.behaviour.check_lag(step, batch, batch_ref)
        # the behaviour policy follows (off-policy: it takes this state and samples the next
        # rollout in the background while the update runs). Until the update is recorded the
        # live state is then not trusted (a retry or a failure rebuilds it, with its behaviour)
        valid, self._live_valid = self._live_valid, False
        if not self.trainer.follow(step, batch.meta.get("gen_batches_end")):
            self._live_valid = valid
        # VERL_FAULTS drills: a worker hanging (or killed) mid-update (one worker: rank 0)
        maybe_inject(f"update-rank{self.dp.rank}", step)
        g, can_roll_back = self.cfg.guard, step > self.base_step
        # the guard state and history of the step being decided (the update changes both)
        before, history = dict(self.trainer.guard), list(self.trainer.history)
        decision, metrics = checks.judge_batch(step, batch, history, before, g,
                                               can_roll_back=can_roll_back), {}
        if decision.action in ("none", "warn"):
            with self._changing_state():
                metrics = self.trainer.update(batch, step)
                self.step = step + 1
            decision = checks.judge_update(step, decision, metrics, history, before, g,
                                           can_roll_back=can_roll_back)
        record = {"step": step, "batch": batch_ref}
        outcome = {"none": "", "warn": "logged"}.get(decision.action, "")
        if decision.action in ("retry_phase", "halt"):
            self._live_valid = self._live_valid and self.step == step  # touched: rebuild later
            outcome = "retrying" if decision.action == "retry_phase" else "halted"
        elif decision.action == "skip_batch":
            record.update(action="skip", guard=policy.after_skip(before, step))
            self._live_valid = False  # the update may have run: rebuild the state before it
            self._carry_out(step, record)
            outcome = "skipped"
        elif decision.action == "rollback":
            to = policy.rollback_target(
                step, checkpoint_interval=self.cfg.checkpoint.checkpoint_interval,
                base_step=self.base_step)
            record.update(action="rollback", to=to,
                          guard=policy.after_rollback(before, step, g.rollback_lr_scale))
            self._live_valid = False
            self._carry_out(step, record)
            outcome = f"rolled back to step {to}"
        if decision.fired:
            metrics.update(self._record_events(step, "update", decision, outcome))
        if decision.action == "halt":
            raise policy.GuardHaltError(policy.halt_report(decision, step, "update"))
        if decision.action == "retry_phase":
            raise policy.GuardRetryError(f"guard: retrying update of step {step}: "
                                         + "; ".join(a.message for a in decision.anomalies))
        # record how this state was made before anyone is told it exists
        if self.leader:
            self.ckpt.check_fence(f"the lineage record of update {step}")  # the launch's lease
            self.store.put_json(self._lineage(step), record)
            self._drop_pending(step)
        if decision.action in ("none", "warn"):
            self._carry_out(step, record)  # applied already: the version is this record's

        metrics["timing/update_s"] = time.perf_counter() - t0
        return metrics

    # ------------------------------------------------------------------ guard
    def _record_events(self, step: int, phase: str, decision, outcome: str) -> dict:
        from verl_core.guard.events import event_metrics, make_event, record_event

        events = [make_event(step=step, phase=phase, detector=a.detector, action=decision.action,
                             outcome=outcome + (f" (escalated: {decision.escalated})"
                                                if decision.escalated else ""),
                             signal=a.signal, value=a.value, threshold=a.threshold,
                             message=a.message)
                  for a in decision.anomalies]
        for e in events:
            log.warning("guard: step %d %s: %s -> %s (%s)", step, e["detector"], e["message"],
                        decision.action, e["outcome"])
            if self.leader:
                record_event(self.store, self.trajectory_hash, e)
        return event_metrics(events)

    def _count_engine_restarts(self, step: int, metrics: dict) -> None:
        """The rollout engine's rebuilds in the rollout of ``step`` (a dead or hung vllm engine,
        docs/vllm.md#engine-health; ``rollout/engine_restarts``, counted where it sampled, in a
        background thread or process too): added to the guard's ``engine_restarts`` (saved in
        every checkpoint) and recorded as a guard event, which the step's metrics count."""
        restarts = metrics.get("rollout/engine_restarts", 0.0)
        if not restarts:
            return
        from verl_core.guard.events import engine_restart_event, record_event

        guard = self.trainer.guard
        guard["engine_restarts"] = int(guard.get("engine_restarts", 0) + restarts)
        e = engine_restart_event(step=step, phase="rollout", restarts=restarts,
                                 timeouts=metrics.get("rollout/engine_timeouts", 0.0),
                                 max_restarts=self.cfg.rollout.engine_max_restarts)
        log.warning("guard: step %d rollout: %s", step, e["message"])
        if self.leader:
            record_event(self.store, self.trajectory_hash, e)

    def _drop_pending(self, step: int) -> None:
        """The step's phase outputs are consumed: the lineage record now keeps the batch the
        update used; the rollout and reward batches may go. Best effort: a leftover doc only keeps
        a few batches alive, while failing here would fail an update that already happened."""
        for phase in PENDING_PHASES:
            try:
                self.store.delete_json(pending_doc(self.trajectory_hash, step, phase))
            except Exception as e:  # noqa: BLE001
                log.warning("could not remove %s: %s",
                            pending_doc(self.trajectory_hash, step, phase), e)

    def checkpoint(self, step: int, force: bool = False, sync: bool = False) -> dict:
        """Save the state after ``step`` updates if one is due (or ``force``). Async saves return
        as soon as the state is snapshotted; the write finishes in the background (``sync``: wait
        for the commit)."""
        # the decision, made here once per checkpoint phase with the clock; the plan that runs
        # this phase asked the same method without it (phases.checkpoint_follows)
        due = self.cfg.checkpoint.due(step, self.cfg.total_steps,
                                      since_save_s=time.time() - self.last_save_time)
        if not self._lead(force or due):
            return {"checkpoint/saved": 0.0}
        self.ensure_state(step)
        t0 = time.perf_counter()
        # W > 1: every worker writes its own shards (DCP), rank 0 commits the manifest
        groups, meta = self.trainer.state(
            step, with_optimizer=self.cfg.checkpoint.save_optimizer_state)
        saver = self.local_ckpt or self.ckpt  # the local tier commits first when there is one
        if self.cfg.checkpoint.async_save and not sync:
            done = self._pending_save = saver.async_save_distributed(
                step, groups, meta, config_hash=self.trajectory_hash, dp=self.dp)
        else:
            self.wait_checkpoints()
            done = saver.save_distributed(step, groups, meta, config_hash=self.trajectory_hash,
                                          dp=self.dp)
        if self.replicator is not None:
            self.replicator.submit(done)
        self.last_save_time = time.time()
        out = {"checkpoint/saved": 1.0, "checkpoint/blocked_s": time.perf_counter() - t0}
        if self.replicator is not None:
            out.update(self.replicator.metrics())
        if self.leader and faults.hook("checkpoint_committed", step):  # a VERL_FAULTS drill
            self._corrupt_checkpoint(step)
        return out

    def _corrupt_checkpoint(self, step: int) -> None:
        """VERL_FAULTS ``corrupt_object`` (:func:`~verl_core.guard.faults.corrupt_checkpoint`)
        on the checkpoint of ``step``, once its write has committed."""
        self.wait_checkpoints()
        info = next(i for i in self.ckpt.list_checkpoints()
                    if i.step == step and i.config_hash == self.trajectory_hash and i.error is None)
        faults.corrupt_checkpoint(self.store, info.name, self.ckpt.read_manifest(info.name)[1])

    def scrub(self, step: int) -> dict:
        """Verify every checkpoint of this trajectory (every object re-hashed) and repair the
        damaged ones: their bad objects go to ``quarantine/``, their state is rebuilt (an older
        checkpoint + lineage replay) and saved again, which writes the missing objects back. So
        a run never ends with a committed checkpoint left corrupted. Ends at state ``step``."""
        infos = self._lead(sorted(
            (i for i in self.ckpt.list_checkpoints()
             if i.error is None and i.config_hash == self.trajectory_hash), key=lambda i: i.step))
        repaired = []
        for info in infos:
            problems = self._lead(self.ckpt.verify(info.name, repair=True) if self.leader else [])
            if not problems:
                continue
            log.warning("checkpoint %s is damaged (%s); rebuilding and saving it again",
                        info.name, "; ".join(problems)[:500])
            self.ensure_state(info.step)
            self.checkpoint(info.step, force=True, sync=True)
            repaired.append(info.step)
        if repaired:
            self.ensure_state(step)
        return {"checkpoint/repaired": float(len(repaired))}

    def wait_checkpoints(self):
        """Block until the background checkpoint write committed; its info, or None if there is
        none (re-raises its error)."""
        handle, self._pending_save = self._pending_save, None
        return handle.wait() if handle is not None else None

    def has_checkpoint(self, step: int) -> bool:
        """A committed checkpoint of this trajectory at ``step`` is in the store."""
        return any(i.error is None and i.step == step and i.config_hash == self.trajectory_hash
                   for i in self.ckpt.list_checkpoints())

    def commit_final(self, step: int) -> dict:
        """Make sure the run's last state is a committed checkpoint
        (docs/design.md#rule-7-done-means-committed).

        An async checkpoint phase returns before its write commits, so its cached result does not
        prove a checkpoint exists: the write may have died with the process or failed (a full
        disk) after the phase was cached. Intermediate checkpoints are a speed knob (lineage
        replay rebuilds any state), but the final one is what an extension resumes from and what
        ``verify latest`` promises, so it is waited for here and, if it never committed, saved
        again synchronously. A background error propagates (the phase fails, nothing is cached)."""
        self.wait_checkpoints()
        tier = self._flush_replication(step) if self.replicator is not None else {}
        if self._lead(self.leader and self.has_checkpoint(step)):
            return {"checkpoint/resaved": 0.0, **tier}
        log.warning("the checkpoint of step %d never committed in %s; saving it again", step,
                    self.store.uri)
        out = self.checkpoint(step, force=True, sync=True)
        if self.replicator is not None:
            out.update(self._flush_replication(step))
        return {"checkpoint/resaved": 1.0, **out}

    def _flush_replication(self, step: int) -> dict:
        """With the local tier, the final checkpoint must reach the run store before the run is
        done: wait for the replicator; a store that stays down fails the phase (transient, so it
        is retried). Reports the checkpoints lost with a node (``checkpoint/lost``)."""
        left = self.replicator.flush(FINAL_REPLICATION_TIMEOUT_S)
        if left:
            raise StoreUnavailableError(
                f"checkpoints of steps {left} are committed on local disk "
                f"({self.local_ckpt.store.uri}) but could not be replicated to {self.store.uri} "
                f"within {FINAL_REPLICATION_TIMEOUT_S:.0f} s ({self.replicator.last_error}); "
                "the finalize phase is retried, or fix the store and re-run")
        return {**self.replicator.metrics(), "checkpoint/lost": float(len(self.lost_checkpoints))}

    def evaluate(self, step: int) -> dict:
        """Held-out metrics of the state after ``step`` updates (greedy, or sampled as
        ``rollout.val_*`` say, seeded by ``step``); the first
        :data:`EVAL_SAMPLES` responses go to the store for the reports (:func:`eval_samples_doc`)."""
        self.ensure_state(step)
        shown = self.cfg.log_val_generations
        metrics, samples = self.trainer.evaluate_with_samples(max(EVAL_SAMPLES, shown), step)
        if self.leader:
            self.store.put_json(eval_samples_doc(self.trajectory_hash, step),
                                {"step": step, "samples": [dataclasses.asdict(s)
                                                           for s in samples[:EVAL_SAMPLES]]})
            for i, s in enumerate(samples[:shown]):  # verl's trainer.log_val_generations
                print(f"[verl] val sample {i + 1}/{shown} after step {step}: score {s.score:g}, "
                      f"ground truth {s.ground_truth!r}\n  prompt: {s.prompt!r}\n  response: "
                      f"{s.response!r}", flush=True)
            if self.cfg.checkpoint.keep_best:
                self._record_best(step, metrics)
        return metrics

    def _record_best(self, step: int, metrics: dict) -> None:
        """``checkpoint.keep_best``: name ``step`` in ``best.json`` when its metric beats the
        recorded best of this trajectory (strictly: a tie, and a replayed evaluation, keep the
        earlier step). Step 0, the model before training, has no checkpoint to keep."""
        ck = self.cfg.checkpoint
        if ck.keep_best not in metrics:
            names = ", ".join(sorted(k for k in metrics if k.startswith("val/")))
            raise ConfigError(f"checkpoint.keep_best={ck.keep_best!r}: the evaluation has no such "
                              f"metric; it has {names}")
        value = float(metrics[ck.keep_best])
        if step == 0 or not math.isfinite(value):
            return
        doc = self.store.get_json(BEST_DOC, default=None)
        if (isinstance(doc, dict) and doc.get("trajectory") == self.trajectory_hash
                and doc.get("metric") == ck.keep_best):
            old = float(doc["value"])
            if not (value > old if ck.keep_best_higher else value < old):
                return
        self.store.put_json(BEST_DOC, {
            "step": step, "metric": ck.keep_best, "value": value,
            "higher_is_better": ck.keep_best_higher, "trajectory": self.trajectory_hash})
        log.info("best checkpoint by %s: step %d (%g)", ck.keep_best, step, value)

    def export_final(self, step: int, folder: str) -> str:
        """Write the policy after ``step`` updates as a Hugging Face folder (local path)."""
        self.ensure_state(step)
        # its float32 master weights (W > 1: gathered, a collective), with the CLI export's
        # writer: the user's tokenizer files, stored dtype, ties
        self.trainer.actor.export(folder, self.assets.model_path)
        return folder

    def set_fence(self, fence) -> None:
        """Commit only under ``fence`` from now on: the launcher's hold on the run's lease (a
        :class:`~verl_core.store.lease.Fence`; None: no lease). Every checkpoint commit checks it
        (``CheckpointManager.fence``), so a worker that outlived its launcher, or whose launch
        another launch took over, commits nothing. Handed over by ``engine.workers.RunWorkers``."""
        if self._pending_save is not None and fence != getattr(self, "_fence", None):
            # a new launch adopted this worker (cluster.mode=attached): a background save the
            # previous one started can no longer commit; its refusal is not this launch's error
            try:
                self.wait_checkpoints()
            except FencedError as e:
                log.warning("a checkpoint the previous launch started was not committed: %s", e)
        self._fence = fence
        check = None if fence is None else functools.partial(fence.check, self.store)
        for mgr in self._tiers():
            mgr.fence = check

    def close(self):
        try:
            self.trainer.behaviour.stop()
            self.wait_checkpoints()
            if self.replicator is not None:  # best effort: finalize already waited for the last
                self.replicator.close(timeout_s=CLOSE_REPLICATION_TIMEOUT_S)
        finally:
            try:
                self.ckpt.close()
            except Exception as e:  # noqa: BLE001 - already reported by wait_checkpoints
                log.error("background checkpoint failed: %s", e)
            self.trainer.close()

    # ------------------------------------------------------------------ reward model
    def score_with_model(self, step: int, batch_ref: str) -> tuple[str, dict]:
        """The reward phase of ``step`` with ``reward_model.enable``: score the rollout batch
        ``batch_ref`` (``RLTrainer.reward``: every worker runs the reward model on its share of
        the rows, rank 0 gathers, runs ``reward.scorer`` and writes the scored batch). The reward
        model is frozen, so no policy state is needed (no :meth:`ensure_state`)."""
        t0 = time.perf_counter()
        batch, metrics = self.trainer.reward(self.batch(step, "rollout", batch_ref))
        if not self.leader:  # the driver takes rank 0's answer
            return "", metrics
        ref = put_batch(self.store, batch,
                        pending=pending_doc(self.trajectory_hash, step, "reward"))
        metrics["timing/reward_worker_s"] = time.perf_counter() - t0
        return ref, metrics
