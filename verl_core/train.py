"""The plain-Python RL loop: ``python -m verl_core.train [--algorithm grpo] [--steps N] …
[key=value …]`` (verl's overrides, or ours; docs/verl-keys.md).

rollout -> reward -> advantage -> update for N steps, with greedy held-out evaluation at the start
and the end (and every ``eval_every`` steps). It is the library's own entry point and the baseline
the Flyte workflow is measured against (``bench/orchestration.py``).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import os
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence

import torch

from verl_core import verl_keys
from verl_core.algorithms import ADVANTAGE_ESTIMATORS
from verl_core.config import ConfigError, RunConfig, effective_line
from verl_core.checkpoint.hf_export import export_trained
from verl_core.data.batch import PromptTooLongError
from verl_core.report import sample_lines
from verl_core.data.dataset import DatasetError
from verl_core.store import RunStore
from verl_core.threads import intra_op_threads
from verl_core.guard import checks, policy
from verl_core.guard.faults import FaultSpecError
from verl_core.guard.lease import LeaseHeldError, RunLease
from verl_core.models import ModelLoadError
from verl_core.tracking import Trackers, default_run_name, flat_params
from verl_core.trainer import RLTrainer, prepare_assets
from verl_core.training.optim import optimizer_steps_line
from verl_core.validation import (DataValidationError, RunInputError, check_run_inputs,
                                  clipped_responses_warning, validate_batch)

PHASES = ("rollout", "reward", "advantage", "update")
USER_ERRORS = (ConfigError, DatasetError, PromptTooLongError, ModelLoadError, LeaseHeldError,
               DataValidationError, RunInputError, FaultSpecError)
"""Wrong input (options, data files, model folder, a workdir another loop is writing): the CLI
prints the message, which names the field or file and the fix, and exits 2; a traceback would
only bury it."""


def train(cfg: RunConfig, workdir: str, log=print) -> dict:
    """Run ``cfg`` end to end in this process. Returns a summary with per-step metrics."""
    if cfg.trainer.world_size > 1:
        raise ConfigError(
            f"trainer.nnodes x trainer.n_gpus_per_node = {cfg.trainer.world_size}: the plain loop "
            "trains in this one process; run a worker group through the workflow: pyflyte run "
            "workflows/ppo.py ppo --overrides '{\"trainer.n_gpus_per_node\": "
            f"{cfg.trainer.n_gpus_per_node}}}'")
    t_start = time.perf_counter()
    torch.set_num_threads(intra_op_threads(cfg))  # 0: this host's CPUs (verl_core.threads)
    # opened before the warm start, so a misconfigured tracker fails in seconds, not after it
    trackers = Trackers(cfg.tracking, run_name=default_run_name(workdir),
                        config_hash=cfg.trajectory_hash(), run_key=uuid.uuid4().hex,
                        params=flat_params(cfg.to_dict()))
    lease = None
    try:
        lease = _workdir_lease(cfg, workdir)  # a second loop writing this workdir fails here
        log(f"[verl] {cfg.total_steps} RL steps, {optimizer_steps_line(cfg)}")
        log(effective_line(cfg))  # what differs from the defaults, once
        check_run_inputs(cfg)  # every permanent check, before the warm start
        assets = prepare_assets(cfg, workdir, log=log)
        trainer = RLTrainer(cfg, assets)
    except BaseException:
        trackers.close()
        if lease is not None:
            lease.release()
        raise
    history = []
    try:
        evals = {}
        if cfg.val_before_train:  # verl's trainer.val_before_train=False skips it
            evals[0] = start = _evaluate(trainer, log)
            trackers.log(0, start)  # the same records as the workflow's metrics table
            log(f"step 0: val/accuracy={start['val/accuracy']:.3f}")
        for step in range(cfg.total_steps):
            t0 = time.perf_counter()
            timing = {}
            batch, metrics = trainer.rollout(step)
            validate_batch(batch, "rollout", cfg, step=step)
            timing["rollout"] = time.perf_counter() - t0
            for phase in PHASES[1:]:
                t = time.perf_counter()
                if phase == "update":
                    m = _guarded_update(trainer, batch, step, log)
                else:
                    batch, m = getattr(trainer, phase)(batch)
                    validate_batch(batch, phase, cfg, step=step)
                metrics.update(m)
                timing[phase] = time.perf_counter() - t
            metrics.update({f"timing/{k}_s": v for k, v in timing.items()})
            metrics["timing/step_s"] = time.perf_counter() - t0
            last = step + 1 == cfg.total_steps
            if last or (cfg.eval_every and (step + 1) % cfg.eval_every == 0):
                evals[step + 1] = ev = _evaluate(trainer, log)
                metrics.update(ev)
            metrics["step"] = step + 1
            warning = clipped_responses_warning(metrics, cfg, step + 1)
            if warning:
                log(warning)
            history.append(metrics)
            trackers.log(step + 1, metrics)
            log(format_step(metrics, cfg.total_steps, [h["timing/step_s"] for h in history]))
        final_path = os.path.join(workdir, "final_model")
        # as the workflow's finalize and the CLI export write it (the user's tokenizer files and
        # generation config as given, the folder's stored dtype, tied weights once)
        export_trained(trainer.actor, final_path, assets.model_path)
    finally:
        trainer.close()
        trackers.close()
        if lease is not None:
            lease.release()
    end = evals[cfg.total_steps]
    start = evals.get(0)  # None with val_before_train=False: no gain is measured
    summary = {
        "algorithm": cfg.algorithm.adv_estimator,
        "start_accuracy": start["val/accuracy"] if start else None,
        "end_accuracy": end["val/accuracy"],
        "accuracy_gain": end["val/accuracy"] - start["val/accuracy"] if start else None,
        "first_reward": history[0]["reward/mean"],
        "last_reward": history[-1]["reward/mean"],
        "final_model": final_path,
        "wall_s": time.perf_counter() - t_start,
        "history": history,
    }
    accuracy = (f"{summary['start_accuracy']:.3f} -> {summary['end_accuracy']:.3f} "
                f"(+{summary['accuracy_gain']:.3f})" if start else
                f"{summary['end_accuracy']:.3f} (no evaluation before training)")
    log(f"done: accuracy {accuracy}, reward {summary['first_reward']:.3f} -> "
        f"{summary['last_reward']:.3f}, {summary['wall_s']:.0f}s, model: {final_path}")
    return summary


def _workdir_lease(cfg: RunConfig, workdir: str) -> RunLease | None:
    """The plain loop's single-writer lease on its workdir (made a run store holding the lease):
    two loops writing one workdir would overwrite each other's data and model. None with
    ``guard.lease_ttl_s=0``."""
    if not cfg.guard.lease_ttl_s:
        return None
    lease = RunLease(RunStore(workdir), cfg.guard.lease_ttl_s)
    lease.acquire()
    return lease


def _guarded_update(trainer: RLTrainer, batch, step: int, log) -> dict:
    """The update of the plain loop under the guard (:func:`~verl_core.guard.checks.guarded_update`,
    as the workflow's). It has no run store, so no lineage to replay and no checkpoints to return
    to: a ``skip_batch`` decided on the batch is honoured (the update is not run), a ``rollback``
    halts (use the workflow for rollbacks), and a skip decided after the update only warns."""
    decision, metrics = checks.guarded_update(
        step, batch, list(trainer.history), trainer.guard, trainer.cfg.guard,
        lambda: trainer.update(batch, step), can_roll_back=False, can_undo_update=False)
    if decision.action == "skip_batch":
        trainer.guard = policy.after_skip(trainer.guard, step)
    for a in decision.anomalies:
        log(f"guard: step {step} {a.detector}: {a.message} -> {decision.action}"
            + (f" ({decision.escalated})" if decision.escalated else ""))
    if decision.action in ("halt", "rollback", "retry_phase"):
        raise policy.GuardHaltError(policy.halt_report(decision, step, "update"))
    if decision.fired:
        metrics["guard/anomalies"] = float(len(decision.anomalies))
        metrics[f"guard/{decision.action}"] = float(len(decision.anomalies))
    return metrics


def _evaluate(trainer: RLTrainer, log) -> dict:
    """The held-out metrics; prints the first held-out row as verl's reward manager does
    (``[prompt]`` … ``[score]``, special tokens visible), so a doubled BOS or a missing EOS is
    seen at the first evaluation."""
    metrics, [sample] = trainer.evaluate_with_samples(1)
    log(sample_lines(dataclasses.asdict(sample)))
    return metrics


def eta_s(step_seconds: Sequence[float], remaining: int) -> float:
    """Seconds left for ``remaining`` steps at the mean of the steps' own times so far: the
    evaluations (the start one can take longer than several steps) are not steps and never
    enter it, so a line's ETA is not the first evaluation spread over the run."""
    return sum(step_seconds) / max(1, len(step_seconds)) * remaining


def format_step(m: dict, total: int, step_seconds: Sequence[float]) -> str:
    """One console line per step, for both front doors; ``m``: the step's metrics with ``step``
    (the updates done); ``step_seconds``: the time of each step so far (this one included),
    evaluations excluded (:func:`eta_s`). ``timing/step_s``, where the step was timed as one
    (the plain loop), adds the step's own time."""
    step = int(m["step"])
    eta = eta_s(step_seconds, total - step)
    parts = [f"step {step}/{total}", f"reward={m.get('reward/mean', 0.0):.3f}"]
    if "response_length/mean" in m:
        parts.append(f"len={m['response_length/mean']:.1f}")
    for k, name in (("actor/pg_clipfrac", "clip"), ("actor/entropy", "ent"),
                    ("actor/grad_norm", "gnorm"), ("critic/vf_loss", "vf"),
                    ("val/accuracy", "val_acc")):
        if k in m:
            parts.append(f"{name}={m[k]:.3f}")
    if "timing/step_s" in m:
        parts.append(f"{m['timing/step_s']:.2f}s/step")
    parts.append(f"ETA {eta:.0f}s")
    return " ".join(parts)


def _parse_value(text: str):
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m verl_core.train", description=__doc__.splitlines()[0])
    p.add_argument("--algorithm", default="",
                   help="grpo (default; verl's gae, i.e. ppo, for a verl-style command that "
                        "names no algorithm.adv_estimator), ppo (GAE + critic), or an advantage "
                        "estimator: " + ", ".join(ADVANTAGE_ESTIMATORS.names(include_aliases=True)))
    p.add_argument("--steps", type=int, default=None, help="RL steps (default: the preset's)")
    p.add_argument("--model", default="", help="local HF model folder (default: tiny model)")
    p.add_argument("--train-files", default="", help="comma-separated parquet files")
    p.add_argument("--val-files", default="", help="comma-separated parquet files")
    p.add_argument("--workdir", default="", help="where assets and the final model go")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="dotted config override, e.g. --set optim.lr=1e-4 (repeatable)")
    p.add_argument("--summary-json", default="", help="write the summary (with history) here")
    p.add_argument("--config", default="", metavar="VERL_YAML",
                   help="a verl YAML config file (docs/verl-keys.md); the overrides win over it")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                   help="verl-style overrides, ours or verl's, e.g. trainer.test_freq=5 "
                        "actor_rollout_ref.actor.optim.lr=1e-6 (docs/verl-keys.md)")
    args = p.parse_intermixed_args(argv)
    given = {}
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep:
            p.error(f"--set {item!r}: expected KEY=VALUE")
        given[key] = _parse_value(value)
    options = verl_keys.entry_options(steps=args.steps, model=args.model,
                                      train_files=args.train_files, val_files=args.val_files)
    try:
        given = {**verl_keys.parse_cli(args.overrides), **given}
        # the workflow's configure builds its config through the same door
        cfg = verl_keys.run_config(args.algorithm, args.config, given, options)
        workdir = args.workdir or tempfile.mkdtemp(prefix="verl-train-")
        os.makedirs(workdir, exist_ok=True)
        summary = train(cfg, workdir)
    except USER_ERRORS as e:
        print(f"{p.prog}: error: {e}", file=sys.stderr)
        return 2
    if args.summary_json:
        with open(args.summary_json, "w") as f:
            json.dump(summary, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
