"""The phases of a run, one typed function each: what its Flyte task calls (``tasks/`` adds only
caching, retries, the phase log and Decks), and what tests and benchmarks call directly.

    rollout(spec, state)        -> PhaseOut   sample on the run's worker(s): the batch
    reward(spec, sampled)       -> PhaseOut   score it (rule/custom scorers here; a reward model on
                                              the workers)
    advantage(spec, scored)     -> PhaseOut   token rewards, KL penalty, the advantage estimator
    update(spec, advantaged)    -> StepState  PPO epochs on the worker(s), under the guard
    checkpoint(spec, state)     -> StepState  save if one is due (the worker asks
                                              ``CheckpointConfig.due``), then end_step; it runs
                                              where ``checkpoint_follows``, and on the other steps
                                              the update calls end_step (the step's metrics)
    evaluate(spec, state)       -> Metrics    greedy held-out accuracy of a state
    finalize(spec, state)       -> dict       final checkpoint committed, export, metrics table

Everything crossing a phase boundary is typed (:mod:`verl_core.types`). The heavy phases call
the run's worker(s) through :class:`~verl_core.engine.workers.RunWorkers` (where the work runs:
this process, a Ray actor, a worker group, an attached cluster); reward and advantage run here,
on the stored batch. Also :func:`with_retries`, the local retry policy of a phase.
"""

from __future__ import annotations

import json
import logging
import random
import tempfile
import time
from typing import Callable, TypeVar

from verl_core import beat, interrupt
from verl_core.errors import CorruptObjectError, TransientError
from verl_core.checkpoint.hf_export import publish_export
from verl_core.engine.assets import materialize_assets
from verl_core.engine.worker import get_batch, put_batch
from verl_core.engine.workers import WORKERS, PhaseTimeoutError, RunWorkers, deadline
from verl_core.guard import faults
from verl_core.writer import commit_fence, hold_lease, release_lease
from verl_core.layout import export_path, metrics_table_path, pending_doc
from verl_core.models import load_tokenizer
from verl_core.reward.manager import RewardScorer
from verl_core.reward.overlong import OverlongBuffer
from verl_core.reward.scoring import score_batch
from verl_core.runlog import log_phase, metrics_table, record_step_metrics, watch_phase
from verl_core.threads import intra_op_threads
from verl_core.training.advantage import compute_advantages
from verl_core.types import Metrics, PhaseOut, RunSpec, StepState
from verl_core.validation import validate_and_record

log = logging.getLogger(__name__)
T = TypeVar("T")


def merged(before: Metrics, new: dict) -> Metrics:
    """``before`` updated with ``new`` as floats, keys sorted (a Flyte literal of a dict keeps
    its order, so a stable order keeps cache keys stable)."""
    out = {**before, **{k: float(v) for k, v in new.items()}}
    return dict(sorted(out.items()))


def rollout(spec: RunSpec, state: StepState) -> PhaseOut:
    """Sample ``rollout.n`` responses per prompt of the step's batch from the state after
    ``state.step`` updates (with reference log-probs and critic values when the algorithm needs
    them); the batch is validated and stored."""
    ref, metrics = RunWorkers(spec).rollout(state.step)
    return PhaseOut(step=state.step, batch=ref, metrics=merged({}, metrics))


class LightParts:
    """What the light phases (reward, advantage) of a run need in this process, built once per
    run (:attr:`RunSpec.key`): the tokenizer and the reward scorer."""

    def __init__(self) -> None:
        self._built: dict[tuple, tuple] = {}

    def of(self, spec: RunSpec) -> tuple:
        if spec.key not in self._built:
            # the reward and advantage math of this process (batch-wide sums) with the run's count
            import torch

            torch.set_num_threads(intra_op_threads(spec.config))
            assets = materialize_assets(spec.open_store(), json.loads(spec.assets_json))
            self._built[spec.key] = (load_tokenizer(assets.model_path),
                                     RewardScorer.from_config(spec.config.reward))
        return self._built[spec.key]

    def reset(self) -> None:
        self._built.clear()


LIGHT = LightParts()


def _input_batch(spec: RunSpec, step: int, phase: str, ref: str):
    """The batch ``ref`` that ``phase`` of ``step`` wrote, read by a light phase; a damaged or
    missing one is recomputed by the run's worker (``RunWorker.batch``: bit-identical or a
    clear error), since a cache hit upstream may point at it."""
    st = spec.open_store()
    try:
        return get_batch(st, ref)
    except CorruptObjectError as e:
        log.warning("%s; asking the run's worker to recompute it", e)
        RunWorkers(spec).restore_batch(step, phase, ref)
        return get_batch(st, ref)


def reward(spec: RunSpec, sampled: PhaseOut) -> PhaseOut:
    """Score the sampled batch. Rule and custom scorers run here (light); with
    ``reward_model.enable`` the run's worker(s) score it (``RunWorker.score_with_model``), where
    the reward model lives next to the policy, and write the batch. With
    ``algorithm.filter_groups_enable`` the rollout phase scored it already (DAPO's dynamic
    sampling filters on the scores): it is passed on. ``reward.overlong_buffer_*``: DAPO's length
    penalty is added to the scorer's score (``reward/overlong.py``)."""
    t0 = time.perf_counter()
    st, step = spec.open_store(), sampled.step
    batch = ref = None
    if spec.config.algorithm.filter_groups_enable:
        # DAPO's dynamic sampling scored the batch in the rollout phase (it filters on the
        # scores), and its reward metrics came with it: passed on, never scored twice
        batch, metrics = _input_batch(spec, step, "rollout", sampled.batch), {}
    elif spec.config.reward_model.enable:
        ref, metrics = RunWorkers(spec).score_with_model(step, sampled.batch)
    else:
        tok, scorer = LIGHT.of(spec)
        batch, metrics = score_batch(_input_batch(spec, step, "rollout", sampled.batch), scorer,
                                     tok, overlong=OverlongBuffer.of(spec.config))
    if faults.hook("reward_scored", step):  # a VERL_FAULTS drill (nan_reward); None otherwise
        batch = get_batch(st, ref) if batch is None else batch
        score = batch.score.clone()
        score[0] = float("nan")
        batch, ref = batch.replace(score=score), None
    validate_and_record(st, spec.trajectory_hash, step, "reward", batch or get_batch(st, ref),
                        spec.config)
    if ref is None:
        ref = put_batch(st, batch, pending=pending_doc(spec.trajectory_hash, step, "reward"))
    metrics["timing/reward_s"] = time.perf_counter() - t0
    return PhaseOut(step=step, batch=ref, metrics=merged(sampled.metrics, metrics))


def advantage(spec: RunSpec, scored: PhaseOut) -> PhaseOut:
    """Token rewards (KL penalty when configured) and the advantage estimator."""
    t0 = time.perf_counter()
    LIGHT.of(spec)  # the run's thread count for the math
    st, step = spec.open_store(), scored.step
    batch, metrics = compute_advantages(_input_batch(spec, step, "reward", scored.batch),
                                        spec.config.algorithm)
    validate_and_record(st, spec.trajectory_hash, step, "advantage", batch, spec.config)
    ref = put_batch(st, batch, pending=pending_doc(spec.trajectory_hash, step, "advantage"))
    metrics["timing/advantage_s"] = time.perf_counter() - t0
    return PhaseOut(step=step, batch=ref, metrics=merged(scored.metrics, metrics))


def update(spec: RunSpec, advantaged: PhaseOut) -> StepState:
    """Apply the update of step ``advantaged.step`` under the guard; the state after it is
    recorded in the lineage before anyone is told it exists."""
    metrics = RunWorkers(spec).update(advantaged.step, advantaged.batch)
    return StepState(step=advantaged.step + 1, metrics=merged(advantaged.metrics, metrics))


def checkpoint_follows(spec: RunSpec, step: int) -> bool:
    """Whether a checkpoint phase follows the update that ends at ``step``: the run's plan, asked
    once per step by whoever lays the step out (the workflow's ``train_chunk``, the plain loop of
    ``train.py``, the update task ending its step), before the clock can be read. It is
    ``CheckpointConfig.due`` with the elapsed time not known yet: the schedule and the last step,
    or every step when ``checkpoint_interval_s`` is set. The worker makes the decision itself, with
    the clock (``RunWorker.checkpoint``): the one question, asked of the one method."""
    return spec.config.checkpoint.due(step, spec.config.total_steps)


def checkpoint(spec: RunSpec, state: StepState) -> StepState:
    """Save the state if one is due (committed, or its write queued and awaited later;
    ``RunWorker.checkpoint`` decides, with the clock), then end the step (:func:`end_step`).
    Called only where :func:`checkpoint_follows`; on the other steps the update ends the step
    (on a Flyte cluster every node is a pod, so there is no node that only answers "not now")."""
    return end_step(spec, state, RunWorkers(spec).checkpoint(state.step))


def end_step_unless_checkpoint(spec: RunSpec, state: StepState) -> StepState:
    """After the update: the step ends here (:func:`end_step`) unless a checkpoint phase follows
    (:func:`checkpoint_follows`), which ends it. What the update task passes :func:`run_phase`
    as ``then``."""
    return state if checkpoint_follows(spec, state.step) else end_step(spec, state)


def end_step(spec: RunSpec, state: StepState, checkpoint_metrics: dict | None = None
             ) -> StepState:
    """Record the finished step's metrics (store table, trackers; the guard's event counts of
    the step join them). The checkpoint phase ends the steps where one is due; on the others the
    update task calls this after the update's wall-clock detectors ran (so their events count),
    with the ``checkpoint/saved=0`` the checkpoint phase would have added."""
    extra = {"checkpoint/saved": 0.0} if checkpoint_metrics is None else checkpoint_metrics
    done = StepState(step=state.step, metrics=merged(state.metrics, extra))
    record_step_metrics(spec, done.step, done.metrics)
    return done


def evaluate(spec: RunSpec, state: StepState) -> Metrics:
    """Held-out accuracy of the state after ``state.step`` updates (greedy unless
    ``rollout.val_do_sample``; recorded)."""
    metrics = merged({}, RunWorkers(spec).evaluate(state.step))
    record_step_metrics(spec, state.step, metrics)
    return metrics


def finalize(spec: RunSpec, state: StepState) -> dict:
    """The final checkpoint committed, every checkpoint verified (damaged ones rebuilt), the
    final policy exported as a Hugging Face folder into the store, the metrics table written
    next to it; the run's lease (and, attached, its workers) released."""
    import fsspec

    step, workers = state.step, RunWorkers(spec)
    workers.commit_final(step)  # the final checkpoint is committed, or we fail here
    # every checkpoint of the run verified (re-hashed); a damaged one is rebuilt and saved again
    scrubbed = workers.scrub(step)
    st = spec.open_store()
    with tempfile.TemporaryDirectory(prefix="verl-export-") as tmp:
        workers.export_final(step, tmp)
        final_uri = f"{st.uri}/{export_path(spec.trajectory_hash, step)}"
        fs, path = fsspec.core.url_to_fs(final_uri, **st.storage_options)
        # renamed into place (local) or config.json + marker last (S3), under the run's lease
        publish_export(tmp, fs, path, fence=commit_fence(spec))
    df = metrics_table(spec)
    table_uri = f"{st.uri}/{metrics_table_path(spec.trajectory_hash)}"
    fs, path = fsspec.core.url_to_fs(table_uri, **st.storage_options)
    fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
    with fs.open(path, "wb") as f:
        df.to_parquet(f, index=False)
    rewards = df["reward/mean"].dropna().tolist() if "reward/mean" in df else []
    rewards = rewards or [float("nan")]
    if spec.config.cluster.mode == "attached":
        WORKERS.release(spec)  # the run's detached actors and placement groups go now
    release_lease(spec)  # the run is complete: a relaunch (or another run) may write now
    return {"final_model": final_uri, "metrics_table": table_uri,
            "first_reward": float(rewards[0]), "last_reward": float(rewards[-1]), **scrubbed}


ATTEMPTS = 3
"""Attempts of a phase before a transient fault is given up on: locally :func:`run_phase` makes
them; on a Flyte cluster the tasks' ``retries=`` (the same number) does."""


def run_phase(spec: RunSpec, phase: str, step: int, body: Callable[..., T], *args,
              then: Callable[[T], T] | None = None,
              give_up: Callable[[str], Exception] | None = None) -> T:
    """Run a phase body, ``body(*args)``: within the phase deadline and the run's lease, with the
    local retry policy (:func:`with_retries`'s, attempt by attempt here, so the body is called
    from this frame), then log it in the run's phase log. ``then`` runs on the body's result
    after the wall-clock detectors, within the same attempt (the update ends a step there when
    no checkpoint phase follows: :func:`end_step_unless_checkpoint`).

    The phase log append is a store call like the body's, under the same policy, but retried
    on its own: a log write that fails does not redo the body. A transient fault that outlived
    the attempts is raised as ``give_up(message)`` when given (the task layer passes Flyte's
    recoverable exception, so a cluster retries only this phase), else as itself. Permanent
    faults propagate unchanged: they fail fast."""
    t0 = time.time()
    what = f"{phase} of step {step}"
    interrupt.status(where=f"the {what}", kept="every finished phase and checkpoint",
                     store=spec.store)
    beat()  # a phase started (the probe fails if none starts or ends for too long)
    for attempt in range(1, ATTEMPTS + 1):
        t = time.perf_counter()
        # phase_timeout_s, plus restore_timeout_s while the run's worker is new (a retry after a
        # hang gets a new one: it restores again)
        timeout = WORKERS.deadline_s(spec)
        try:
            try:
                with deadline(timeout, what):
                    hold_lease(spec)  # one writer per run: renewed (or taken) per phase
                    # VERL_FAULTS (tests, chaos drills); a no-op otherwise
                    faults.maybe_inject(phase, step, deadline_s=timeout)
                    out = body(*args)
            except PhaseTimeoutError:
                WORKERS.forget(spec)  # hung: its state and queue are unknown
                raise
            metrics = getattr(out, "metrics", out)  # PhaseOut, StepState or a metrics dict
            watch_phase(spec, phase, step, time.perf_counter() - t,
                        metrics if isinstance(metrics, dict) else {})
            out = out if then is None else then(out)
            break
        except TransientError as e:
            if attempt == ATTEMPTS:
                if give_up is None:
                    raise
                raise give_up(f"{what}: {e}") from e
            retry_after(e, what=what, attempt=attempt, attempts=ATTEMPTS)
    store_call(f"phase log of {phase} step {step}", lambda: log_phase(spec, phase, step, started=t0),
               give_up=give_up)
    beat()  # the liveness probe's heartbeat (VERL_HEARTBEAT_FILE), at the end too
    return out


def store_call(what: str, fn: Callable[[], T], *,
               give_up: Callable[[str], Exception] | None = None) -> T:
    """``fn()`` under a phase's retry policy (:func:`with_retries`), a transient fault that
    outlived it raised as ``give_up(message)`` when given. For every store call around a phase
    body: the phase log, a progress line's guard events, a report's reads, prepare. Permanent
    faults propagate unchanged."""
    try:
        return with_retries(fn, what=what, attempts=ATTEMPTS)
    except TransientError as e:
        if give_up is None:
            raise
        raise give_up(f"{what}: {e}") from e


def with_retries(fn: Callable[[], T], *, what: str, attempts: int = 3, backoff_s: float = 1.0,
                 sleep=time.sleep) -> T:
    """Run ``fn``; retry :class:`TransientError` (storage I/O, a dead worker) up to ``attempts``
    times with exponential backoff and jitter, then re-raise. Anything else fails at once.

    Flyte applies ``retries=`` only on a cluster; this is the same policy for local runs."""
    for attempt in range(1, attempts + 1):
        try:
            return fn()
        except TransientError as e:
            if attempt == attempts:
                raise
            retry_after(e, what=what, attempt=attempt, attempts=attempts, backoff_s=backoff_s,
                        sleep=sleep)
    raise AssertionError("unreachable")


def retry_after(e: Exception, *, what: str, attempt: int, attempts: int, backoff_s: float = 1.0,
                sleep=time.sleep) -> None:
    """Wait before retry ``attempt + 1`` of ``attempts`` after the transient error ``e``:
    exponential backoff with jitter (``backoff_s`` x 2^(attempt-1) x 1-1.25)."""
    delay = backoff_s * 2 ** (attempt - 1) * (1 + 0.25 * random.random())
    log.warning("%s: transient failure (%s), attempt %d/%d, retrying in %.1fs",
                what, e, attempt, attempts, delay)
    sleep(delay)
