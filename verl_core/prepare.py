"""Run preparation: the run's store URI (:func:`run_store_uri`), its checks, assets and start
step (:func:`prepare_run`, what the ``prepare`` phase and the tests call), and the step a resume
starts at (:func:`resume_step`, also what the scheduled launch plans ask).
"""

from __future__ import annotations

import json
import logging
import os
import tempfile

from verl_core import interrupt
from verl_core.assets import prepare_assets
from verl_core.checkpoint.manager import CheckpointManager, open_checkpoint
from verl_core.config import ConfigError, RunConfig
from verl_core.engine import cluster
from verl_core.engine.assets import (GIVEN_KINDS, SOURCE_MODEL, check_pinned, has_record,
                                     index_assets, publish_assets, record_assets,
                                     recorded_fields, source_files, unpublish_assets)
from verl_core.errors import PermanentError, UnsafeManifestError
from verl_core.writer import LEASES
from verl_core.layout import asset_index_doc
from verl_core.store import RunStore, check_doc_name
from verl_core.threads import pin_num_threads
from verl_core.types import STORES, RunSpec
from verl_core.validation import check_run_inputs

log = logging.getLogger(__name__)


def run_store_uri(store: str, run_name: str) -> str:
    """``<store>/<run_name>``. The name becomes a path segment on every store and in Ray actor
    names, so it is held to the rule its error states (the store's doc-segment rule): a space,
    ``\\``, a newline, non-ASCII or ``..`` would each mean something else to some filesystem."""
    try:
        ok = isinstance(run_name, str) and "/" not in run_name and bool(check_doc_name(run_name))
    except UnsafeManifestError:
        ok = False
    if not ok:
        raise ConfigError(f"--run-name {run_name!r}: use a plain name (letters, digits, - _ .): "
                          "ASCII only, at most 200 characters, starting with a letter, a digit "
                          "or _, no '..'")
    base = store or os.environ.get("VERL_STORE") or os.path.join(os.getcwd(), "runs")
    return f"{base.rstrip('/')}/{run_name}"


def _say(*args) -> None:
    """``print`` that reaches a piped console at once (the warm start's progress lines)."""
    print(*args, flush=True)


def prepare_run(cfg: RunConfig, store: str, run_name: str, log_fn=_say) -> RunSpec:
    """Validate data and model, publish the assets into the run store, pick the start step.

    Every permanent check runs first, before the warm start and before anything is copied
    (:func:`~verl_core.validation.check_run_inputs`). A trajectory that ran before trains on the
    assets it recorded then: a file the user gave that changed since is refused
    (:func:`~verl_core.engine.assets.check_pinned`), and generated assets come from the record,
    so the reference model is always the one the run started from."""
    uri = run_store_uri(store, run_name)
    interrupt.status(where="the run's preparation", kept="nothing yet", store=uri)
    if cfg.cluster.mode == "attached":
        cluster.address(cfg.cluster)  # no cluster to attach to: refused before any work
    st = STORES.open(uri)
    LEASES.hold(st, cfg.guard.lease_ttl_s)  # a second launch of this run fails here, first
    check_run_inputs(cfg)
    # the thread count every worker of the run computes with, recorded at its first prepare
    cfg = pin_num_threads(st, cfg)
    h = cfg.trajectory_hash()
    # a trajectory that ran before takes its generated model from its record: no warm start
    # only to be thrown away (a relaunch of the plain loop, or of a workflow whose prepare ran
    # again)
    recorded = has_record(st, h)
    if not recorded:
        check_same_trajectory(st, cfg)  # before the warm start: a changed command is refused
    with tempfile.TemporaryDirectory(prefix="verl-prepare-") as work:
        # checks every dataset file (rows, columns, prompt lengths) before the warm start
        assets = prepare_assets(cfg, work, log=log_fn, build_model=not recorded, store=st)
        indexed = index_assets(assets)
        index, _, sources = indexed
        given = tuple(k for k, on in zip(GIVEN_KINDS, (
            cfg.model.path and not assets.model_source_path, cfg.data.train_files,
            cfg.data.train_files, cfg.reward_model.enable, assets.judge_template_path,
            cfg.algorithm.distills))
            if on)
        if assets.model_source_path:
            # the model was made from your folder (the format warm start): that folder is what
            # must not change under a recorded trajectory
            sources[SOURCE_MODEL] = source_files(assets.model_source_path)
            given += (SOURCE_MODEL,)
        pinned = check_pinned(st, h, given, sources, index, cfg.data.assets_id)
        if pinned is None and not assets.model_path:
            raise RuntimeError(f"{uri}: the asset record of trajectory {h[:12]} was there and "
                               "is gone (deleted while this prepare ran?); run again")
        # only an index this prepare created is undone on failure (another trajectory of the
        # run may share it)
        published = pinned is None and not st.has_json(asset_index_doc(index["id"]))
        index = pinned or publish_assets(st, assets, indexed=indexed)
    try:
        start = resume_step(st, cfg)
        if pinned is None:
            record_assets(st, h, index, sources, cfg.trajectory_fields())
    except BaseException:
        if published:
            unpublish_assets(st, index)  # a failed prepare keeps nothing alive
        raise
    if start:
        log_fn(f"resuming from the checkpoint of step {start} in {uri}")
    return RunSpec(store=st.uri, incarnation=st.incarnation_id, config=cfg,
                   trajectory_hash=h,
                   assets_json=json.dumps(index, sort_keys=True),
                   start_step=min(start, cfg.total_steps), total_steps=cfg.total_steps)


class TrajectoryChangedError(PermanentError, ValueError):
    """A command whose trajectory settings differ from the run's under the same run name: it
    would start over from step 0 beside the run's checkpoints instead of resuming them."""


def _flat(fields: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in fields.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def trajectory_changes(old: dict, new: dict, new_all: dict | None = None) -> list[str]:
    """``key: old -> new`` for every trajectory field that differs. A field in one trajectory
    only (``model.lora_alpha`` is in it only with LoRA on) shows its value in ``new_all`` (the
    whole new config) where it has one, else ``(not set)``."""
    a, b, every = _flat(old), _flat(new), _flat(new_all or {})
    missing = "(not set)"
    return [f"{k}: {a.get(k, missing)!r} -> {b.get(k, every.get(k, missing))!r}"
            for k in sorted(set(a) | set(b)) if a.get(k, missing) != b.get(k, missing)]


def check_same_trajectory(st: RunStore, cfg: RunConfig) -> None:
    """Refuse a command whose trajectory has no checkpoint or record in ``st`` while another
    trajectory's checkpoints are there (``resume_from_checkpoint=auto`` only): it would train
    from step 0 beside them, where the user meant to resume. Names each field that differs,
    with its old and new value, and the two ways on."""
    if cfg.checkpoint.resume_from_checkpoint != "auto":
        return
    h = cfg.trajectory_hash()
    others = [i for i in CheckpointManager(st).list_checkpoints()
              if i.error is None and i.config_hash and i.config_hash != h]
    if not others:
        return
    newest = max(others, key=lambda i: (i.step, i.created))
    old = recorded_fields(st, newest.config_hash)
    if old is None:
        what = ("its settings were not recorded (written by an older version), so the fields "
                "that differ cannot be named")
    else:
        changes = trajectory_changes(old, cfg.trajectory_fields(), cfg.to_dict())
        more = f" and {len(changes) - 8} more" if len(changes) > 8 else ""
        what = f"this command changes {'; '.join(changes[:8])}{more}"
    raise TrajectoryChangedError(
        f"{st.uri}: its newest checkpoint (step {newest.step}) is of another trajectory "
        f"({newest.config_hash[:12]}, this command's is {h[:12]}): {what}. Resuming cannot "
        "continue it with other settings, and training would start over at step 0. Run the "
        "command as before to resume it; or give the new settings a new run (--run-name, or "
        "--workdir for python -m verl_core.train); or set checkpoint.resume_from_checkpoint="
        f"{st.uri} to start them from that checkpoint, or =none to start them from step 0 here "
        "(the other trajectory's checkpoints are kept; later commands with these settings "
        "resume their own)")


def resume_step(st: RunStore, cfg: RunConfig) -> int:
    """``resume_from_checkpoint=auto``: the step of the newest checkpoint of this config that
    verifies (hash check); 0 when there is none or resume is ``none``."""
    spec = cfg.checkpoint.resume_from_checkpoint
    if spec in ("none", ""):
        return 0
    if spec != "auto":  # an explicit checkpoint: it must exist and verify, or we fail now
        mgr, ref = open_checkpoint(spec, st.storage_options)
        problems = mgr.verify(ref)
        if problems:
            raise ValueError(f"checkpoint.resume_from_checkpoint={spec!r} does not verify: "
                             + "; ".join(problems[:5]))
        return mgr.read_manifest(ref)[0].step
    mgr = CheckpointManager(st)
    h = cfg.trajectory_hash()
    for info in sorted(mgr.list_checkpoints(), key=lambda i: i.step, reverse=True):
        if info.error is not None:
            why = info.error
        elif info.config_hash != h:
            why = f"of another trajectory ({info.config_hash[:12]}; this run's is {h[:12]})"
        else:
            problems = mgr.verify(info.name)
            if not problems:
                return info.step
            why = "does not verify: " + "; ".join(problems[:3])
        log.warning("checkpoint %s not usable for resume: %s", info.name, why)
    return 0
