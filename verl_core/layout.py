"""Where everything a run keeps lives in its run store: every doc, log and path name, in one place.

What belongs here: name builders (pure string functions) and the names themselves; the short-hash
rule; the gc roots. What does not: reading or writing (``verl_core.store`` does the bytes, its own
``objects/``, ``quarantine/``, ``logs/`` and ``store.json``), doc formats (their owners).
Importing nothing from ``verl_core``, any layer may use it. A stored run stays readable only if
these names never change (``tests/verl_core/test_layout.py`` pins them).

Names are doc names (``<name>.json`` under the store root) unless said otherwise; ``<h>`` is the
trajectory hash shortened by :func:`short_hash`::

    store.json, lease.json, latest.json, compute.json   the store, writer lease, newest checkpoint,
                                                        thread count
    best.json                                           the best evaluated step (keep_best)
    checkpoints/<step:012d>-<sha>                       checkpoint manifests (``sha``: of the meta)
    inflight/<uuid>                                     a checkpoint write in progress
    shared/groups/<group>, shared/tokenizer             trees shared by checkpoints, the tokenizer
    lineage/<h>/<step:09d>                              the update of each step (batch, weights)
    pending/<h>/<step:09d>-<phase>                      a phase's batch until the update consumes it
    eval-samples/<h>/<step:09d>                         held-out samples of an evaluation
    validation/<h>/<step:09d>-<stage>                   batch validation reports
    events/<h>/<step:09d>-<phase>-<detector>[-<signal>] guard events
    assets/<index id>, assets/trajectories/<hash>       asset indexes, the one a trajectory pinned
    assets/warmstart/<key>                              the tiny model's warm start (in progress
                                                        or finished), by the key of its inputs
    logs: phases, checkpoints, metrics-<h>              phase log, checkpoint events, step metrics
    paths: exports/<h12>-step<step:06d>/, metrics/<h12>.parquet   final export and metrics table
"""

from __future__ import annotations

import re

NAME_CHARS = 16
"""Hex characters of the trajectory hash in the names of one trajectory's docs and logs."""
LABEL_CHARS = 12
"""Hex characters of the trajectory hash in what people read: the final export's folder, the
metrics table's file, tracker tags, report titles."""


def short_hash(trajectory: str, chars: int = NAME_CHARS) -> str:
    """The trajectory hash as names carry it: its first ``chars`` hex characters."""
    return trajectory[:chars]


# ---------------------------------------------------------------------- store-wide docs
LEASE_DOC = "lease"
"""The run's single-writer lease (compare-and-swap doc, ``store/lease.py``)."""
LATEST_DOC = "latest"
"""Pointer to the newest committed checkpoint: ``{"name", "step", "sha"}``."""
BEST_DOC = "best"
"""The best evaluated step by ``checkpoint.keep_best``: ``{"step", "metric", "value",
"higher_is_better", "trajectory"}``; retention keeps its checkpoint (``checkpoint/retention.py``)."""
COMPUTE_DOC = "compute"
"""``{"num_threads": n, ...}`` written at a run's first prepare (``threads.py``)."""
TOKENIZER_DOC = "shared/tokenizer"
"""The run's tokenizer files, stored once per run (``checkpoint/hf_export.py``)."""
PHASE_LOG = "phases"
"""Log of every executed phase (a cache hit writes nothing)."""
CHECKPOINT_LOG = "checkpoints"
"""Log of checkpoint commits and replications."""


# ---------------------------------------------------------------------- checkpoints
CHECKPOINTS = "checkpoints"
"""Folder of the checkpoint manifests."""
CHECKPOINT_NAME_RE = re.compile(r"^(\d{12})-([0-9a-f]{64})$")
"""A checkpoint name (:func:`checkpoint_name`); groups: the step, the meta sha."""
INFLIGHT = "inflight"
"""Folder of the markers of checkpoint writes in progress (gc keeps their objects)."""


def checkpoint_name(step: int, meta_sha: str) -> str:
    """A checkpoint's name: its step and the hash of its meta tree, so names sort by step."""
    return f"{step:012d}-{meta_sha}"


def checkpoint_doc(name: str) -> str:
    """The manifest doc of checkpoint ``name``."""
    return f"{CHECKPOINTS}/{name}"


def inflight_doc(write_id: str) -> str:
    """The marker of one checkpoint write in progress (its kind, step and start time)."""
    return f"{INFLIGHT}/{write_id}"


def group_doc(group: str) -> str:
    """The shared tree of parameter group ``group`` (frozen layers, the reference model)."""
    return f"shared/groups/{group}"


# ---------------------------------------------------------------------- per trajectory
def lineage_doc(trajectory: str, step: int) -> str:
    """The record of the update of ``step``: the batch it consumed and the state it made."""
    return f"lineage/{short_hash(trajectory)}/{step:09d}"


def pending_doc(trajectory: str, step: int, phase: str) -> str:
    """Name of the doc that keeps a phase's output batch alive until the update of ``step`` has
    consumed it: a re-run whose earlier phases were cache hits reads those batches, so garbage
    collection must not delete them (``pending/`` is a gc root folder)."""
    return f"pending/{short_hash(trajectory)}/{step:09d}-{phase}"


def eval_samples_doc(trajectory: str, step: int) -> str:
    """Name of the doc with the evaluation samples of the state after ``step`` updates."""
    return f"eval-samples/{short_hash(trajectory)}/{step:09d}"


def validation_folder(trajectory: str) -> str:
    """Where the trajectory's batch validation reports are (:func:`report_doc`)."""
    return f"validation/{short_hash(trajectory)}"


def report_doc(trajectory: str, step: int, stage: str) -> str:
    """Run-store doc name of a batch's validation report."""
    return f"{validation_folder(trajectory)}/{step:09d}-{stage}"


def event_folder(trajectory: str) -> str:
    """Where the trajectory's guard events are, one doc each (``guard/events.py`` names them)."""
    return f"events/{short_hash(trajectory)}"


def metrics_log(trajectory: str) -> str:
    """The log of the trajectory's per-step metrics (the metrics table's source)."""
    return f"metrics-{short_hash(trajectory)}"


def export_path(trajectory: str, step: int) -> str:
    """Path (not a doc) of the final policy's Hugging Face folder, relative to the store root."""
    return f"exports/{short_hash(trajectory, LABEL_CHARS)}-step{step:06d}"


def metrics_table_path(trajectory: str) -> str:
    """Path (not a doc) of the final per-step metrics table, relative to the store root."""
    return f"metrics/{short_hash(trajectory, LABEL_CHARS)}.parquet"


def asset_index_doc(index_id: str) -> str:
    """An asset index (model and dataset files by hash), named by its own id."""
    return f"assets/{index_id}"


def asset_record_doc(trajectory: str) -> str:
    """The asset index a trajectory pinned when it first ran (the full hash, not the short)."""
    return f"assets/trajectories/{trajectory}"


def warm_start_doc(key: str) -> str:
    """The warm start with inputs ``key`` (``warmstart.py``): its saved state while it runs, its
    model folder once finished. Under ``assets/``, a gc root: what it names is kept."""
    return f"assets/warmstart/{key}"


# ---------------------------------------------------------------------- garbage collection
GC_ROOT_FOLDERS = ("assets", "lineage", "pending", "shared", "staging")
"""Folders of JSON docs whose every sha256-looking string names a live object (see
:meth:`~verl_core.checkpoint.manager.CheckpointManager.gc`, which also keeps what the kept
manifests and ``inflight/`` writes name). A new kind of doc that names objects goes under one of
them, so gc keeps its objects without knowing its format."""
