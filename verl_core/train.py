"""The plain-Python RL loop: ``python -m verl_core.train [--algorithm grpo] [--steps N] …
[key=value …]`` (verl's overrides, or ours; docs/verl-keys.md).

A thin driver of the run's phases (:mod:`verl_core.phases`) in this one process, in the order the
Flyte workflow runs them (``workflows/ppo.py``): prepare, evaluate the start state, then per step
rollout -> reward -> advantage -> update (-> checkpoint where one is due), evaluate every
``eval_every`` steps and at the end, finalize. Each phase goes through
:func:`~verl_core.phases.run_phase` (deadline, lease, local retries, phase log), and the run's
worker is an in-process ``RunWorker``. The workdir is the run store: batches, lineage and
checkpoints go there (``<--store>/<--run-name>``: ``./runs/default`` unless told otherwise, the
workflow's defaults), so the same command resumes from its newest checkpoint, and the guard's
skips and rollbacks act as in the workflow. It is the library's own
entry point and the baseline the Flyte workflow is measured against (``bench/orchestration.py``).
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import sys
import time
from collections.abc import Sequence
from functools import partial

# Only the standard library at import time: ``--help`` and a mistyped option are answered without
# torch, transformers or flytekit (seconds each); the run imports them when it starts (``_lib``).


USER_ERROR_CLASSES = (
    ("verl_core.config_fields", "ConfigError"), ("verl_core.data.dataset", "DatasetError"),
    ("verl_core.data.batch", "PromptTooLongError"), ("verl_core.models.loading", "ModelLoadError"),
    ("verl_core.store.lease", "LeaseHeldError"), ("verl_core.validation", "DataValidationError"),
    ("verl_core.validation", "RunInputError"), ("verl_core.guard.faults", "FaultSpecError"),
    ("verl_core.rollout.vllm", "VLLMUnavailableError"),
    ("verl_core.prepare", "TrajectoryChangedError"), ("verl_core.engine.assets", "AssetsChangedError"),
    ("verl_core.models.lora", "LoRAConfigError"), ("verl_core.agent.tools", "ToolConfigError"),
    ("verl_core.agent.loops", "AgentLoopError"),
    ("verl_core.agent.turns", "TemplateError"), ("verl_core.algorithms.registry", "UnknownNameError"),
    ("verl_core.engine.cluster", "AttachError"), ("verl_core.reward.custom", "ScorerLoadError"),
    ("verl_core.reward.registry", "UnknownDataSourceError"),
    ("verl_core.store", "StorePermissionError"), ("verl_core.local_cache", "AssetCacheError"),
    ("verl_core.training.device", "DeviceError"), ("verl_core.reward.judge", "JudgeError"),
    ("verl_core.agent.openai_server", "AgentFunctionError"))
"""Wrong input (options, data files, model folder, a store another loop is writing), by module
and class name: the CLI prints the message, which names the field or file and the fix, and exits
2; a traceback would only bury it."""


def user_errors() -> tuple[type, ...]:
    """:data:`USER_ERROR_CLASSES` as classes (imports their modules: torch, transformers)."""
    import importlib

    return tuple(getattr(importlib.import_module(m), c) for m, c in USER_ERROR_CLASSES)


def is_user_error(e: BaseException) -> bool:
    """Whether ``e`` is one of :data:`USER_ERROR_CLASSES`, importing nothing: a class whose
    module was never imported cannot have raised (a bad ``--set`` answers before transformers
    is loaded)."""
    for module, name in USER_ERROR_CLASSES:
        mod = sys.modules.get(module)
        if mod is not None and isinstance(e, getattr(mod, name)):
            return True
    return False


def __getattr__(name: str):
    if name == "USER_ERRORS":  # the tuple, built on first use (it imports torch)
        return user_errors()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _say(*args) -> None:
    print(*args, flush=True)  # a piped console sees each line when it is written


def train(cfg, workdir: str = "", log=_say, *, store: str = "", run_name: str = "default"
          ) -> dict:
    """Run ``cfg`` (a :class:`~verl_core.config.RunConfig`) end to end in this process, in the run
    store ``<store>/<run_name>`` (``store`` "": ``$VERL_STORE``, else ``./runs``), or in the
    folder ``workdir`` as the run store when given; resumed from its newest checkpoint of this
    trajectory if it has one. Returns a summary: the held-out accuracy at the start and the end
    of this invocation, the run's first and last training reward, the final model's folder, and
    the metrics of each step this invocation ran."""
    import torch

    from verl_core import runlog, tracking
    from verl_core.config import ConfigError, effective_line
    from verl_core.engine.workers import WORKERS
    from verl_core.writer import LEASES, release_lease
    from verl_core.prepare import prepare_run, run_store_uri
    from verl_core.threads import intra_op_threads
    from verl_core.checkpoint.config import schedule_line
    from verl_core.training.device import device_line
    from verl_core.training.optim import optimizer_steps_line

    if cfg.trainer.world_size > 1:
        raise ConfigError(
            f"trainer.nnodes x trainer.n_gpus_per_node = {cfg.trainer.world_size}: the plain loop "
            "trains in this one process; run a worker group through the workflow: pyflyte run "
            "workflows/ppo.py ppo --overrides '{\"trainer.n_gpus_per_node\": "
            f"{cfg.trainer.n_gpus_per_node}}}'")
    if cfg.rollout.engine == "vllm":
        # the engine runs in this process: a missing (or wrong-platform) vLLM is said before
        # any work, not at the first rollout after the warm start
        from verl_core.rollout.vllm import import_vllm

        import_vllm()
    t_start = time.perf_counter()
    torch.set_num_threads(intra_op_threads(cfg))  # 0: this host's CPUs (verl_core.threads)
    root, name = _run_store(workdir) if workdir else (store, run_name)
    uri = run_store_uri(root, name)  # the run-name rule, before any work
    if workdir:
        os.makedirs(workdir, exist_ok=True)
    log(f"[verl] {cfg.total_steps} RL steps, {optimizer_steps_line(cfg)}")
    if schedule_line(cfg):
        log(schedule_line(cfg))
    log(effective_line(cfg))  # what differs from the defaults, once
    # the trainer runs in this process: trainer.device=cuda without a GPU is said now
    log(device_line(cfg.trainer.device, cfg.trainer.deterministic))
    try:
        # the workdir's single-writer lease first (a second loop on it fails here), then every
        # permanent check, the warm start, the assets into the store, the start step
        spec = prepare_run(cfg, root, name, log_fn=log)
    except BaseException:
        # a failed prepare gives the lease up too (if it took it): its renewal thread would
        # keep another loop off the workdir for as long as this process lives
        lease = LEASES.pop(uri, cfg.guard.lease_ttl_s)
        if lease is not None:
            lease.release()
        raise
    try:
        history, evals, out = _run(spec, log)
    finally:
        try:
            WORKERS.release(spec)  # the in-process worker: pending checkpoint writes end
        finally:
            runlog.TRACKERS.reset()  # the trackers flush and close
            release_lease(spec)  # already released by finalize, unless the run failed
    total = spec.total_steps
    end, start = evals[total], evals.get(spec.start_step)  # start: None w/o val_before_train
    summary = {
        "algorithm": spec.config.algorithm.adv_estimator,
        "start_accuracy": start["val/accuracy"] if start else None,
        "end_accuracy": end["val/accuracy"],
        "accuracy_gain": end["val/accuracy"] - start["val/accuracy"] if start else None,
        "first_reward": out["first_reward"],  # of the run's metrics table: its first step
        "last_reward": out["last_reward"],
        "final_model": out["final_model"],  # the export in the store: a local folder
        "wall_s": time.perf_counter() - t_start,
        "history": history,
        "evaluations": {str(k): v for k, v in sorted(evals.items())},
    }
    accuracy = (f"{summary['start_accuracy']:.3f} -> {summary['end_accuracy']:.3f} "
                f"(+{summary['accuracy_gain']:.3f})" if start else
                f"{summary['end_accuracy']:.3f} (no evaluation before training)")
    log(f"done: accuracy {accuracy}, reward {summary['first_reward']:.3f} -> "
        f"{summary['last_reward']:.3f}, {summary['wall_s']:.0f}s; final model: "
        f"{out['final_model']}; metrics: {out['metrics_table']}"
        f"{tracking.where(spec.config.tracking)}; run store: {spec.store} (the same command "
        "with more --steps continues it)")
    return summary


def _run(spec, log) -> tuple[list[dict], dict[int, dict], dict]:
    """The phases of ``workflows/ppo.py``'s ``rl_run`` and ``train_chunk``, in their order.
    Returns the metrics of each step run (``timing/step_s``, ``step`` and, at an evaluation, its
    ``val/*`` added), the evaluations by step, and finalize's answer."""
    from verl_core import phases, runlog
    from verl_core.phases import run_phase
    from verl_core.types import StepState
    from verl_core.validation import clipped_responses_warning

    cfg, total = spec.config, spec.total_steps
    state, history, evals = StepState(step=spec.start_step), [], {}
    # SIGTERM (a preemption) and checkpoint.must_save_by: save the newest state, then stop
    stop = _Stopper(spec, log)
    if cfg.val_before_train:  # verl's trainer.val_before_train=False skips it
        evals[state.step] = ev = _evaluate(spec, state, log)
        log(f"step {state.step}: val/accuracy={ev['val/accuracy']:.3f}")
        stop.if_asked(state.step)
    end_step = partial(phases.end_step, spec)
    for k in range(spec.start_step, total):
        t0 = time.perf_counter()
        sampled = run_phase(spec, "rollout", k, phases.rollout, spec, state)
        stop.if_asked(k)
        scored = run_phase(spec, "reward", k, phases.reward, spec, sampled)
        stop.if_asked(k)
        advantaged = run_phase(spec, "advantage", k, phases.advantage, spec, scored)
        stop.if_asked(k)
        # the plan of the step, asked once: the update ends the step unless a checkpoint phase
        # follows (which ends it, and whose worker decides with the clock)
        checkpoint = phases.checkpoint_follows(spec, k + 1)
        state = run_phase(spec, "update", k, phases.update, spec, advantaged,
                          then=None if checkpoint else end_step)
        metrics = dict(state.metrics)
        if checkpoint:
            t = time.perf_counter()
            state = run_phase(spec, "checkpoint", k + 1, phases.checkpoint, spec, state)
            metrics = {**state.metrics, "timing/checkpoint_s": time.perf_counter() - t}
            stop.saved(k + 1, metrics["timing/checkpoint_s"])
        stop.if_asked(k + 1)
        metrics["timing/step_s"] = time.perf_counter() - t0
        for e in runlog.step_events(spec, k):  # the guard's decisions on this step
            log(f"guard: step {k} {e['detector']}: {e['message']} -> {e['action']}"
                + (f" ({e['outcome']})" if e.get("outcome") else ""))
        if k + 1 == total or (cfg.eval_every and (k + 1) % cfg.eval_every == 0):
            evals[k + 1] = ev = _evaluate(spec, state, log)
            # the phase's metrics, as the trackers have them (not the wall time beside them)
            metrics.update({key: v for key, v in ev.items() if key != EVAL_WALL})
        metrics["step"] = k + 1
        warning = clipped_responses_warning(metrics, cfg, k + 1)
        if warning:
            log(warning)
        history.append(metrics)
        log(format_step(metrics, total, [h["timing/step_s"] for h in history]))
        stop.if_asked(k + 1)  # an evaluation ran since the last look
        if k + 1 < total:
            stop.before_deadline(k + 1, metrics["timing/step_s"])
    if total not in evals:  # a run that was complete already: its end state, evaluated
        evals[total] = _evaluate(spec, state, log)
    out = run_phase(spec, "finalize", state.step, phases.finalize, spec, state)
    return history, evals, out


PROCESS_START = time.time()
"""When this process started (this module is imported as it starts): what a
``checkpoint.must_save_by`` duration counts from."""


class StoppedBeforeDeadline(Exception):
    """The plain loop saved and stopped before ``checkpoint.must_save_by``: not an error (the
    CLI exits 0), and the same command continues."""


class _Stopper:
    """The plain loop's two early stops, each saving the newest state before the process goes:
    a SIGTERM (``checkpoint.preempt_grace_s``: :meth:`if_asked`, between phases) and the
    deadline (``checkpoint.must_save_by``: :meth:`before_deadline`, between steps)."""

    def __init__(self, spec, log):
        from verl_core import interrupt
        from verl_core.checkpoint.deadline import deadline

        self.spec, self.log, self.interrupt = spec, log, interrupt
        self.saved_step = spec.start_step  # resumed from (or step 0: the assets rebuild it)
        self.step_s: list[float] = []
        self.save_s: list[float] = []
        ck = spec.config.checkpoint
        self.until = deadline(ck.must_save_by, PROCESS_START)
        self.margin_s = ck.must_save_margin_s
        interrupt.on_preemption(ck.preempt_grace_s)

    def saved(self, step: int, seconds: float) -> None:
        self.saved_step = max(self.saved_step, step)
        self.save_s.append(seconds)

    def _save(self, step: int) -> None:
        """The state after ``step`` updates committed (waited for, replicated) in the store."""
        from verl_core.engine.workers import RunWorkers

        if step > self.saved_step:
            t = time.perf_counter()
            RunWorkers(self.spec).commit_final(step)
            self.saved(step, time.perf_counter() - t)
        else:  # saved by the schedule: only its write (async) must have committed
            RunWorkers(self.spec).commit_final(step)

    def if_asked(self, step: int) -> None:
        """Between phases: on Ctrl-C exit now; on SIGTERM save the state after ``step`` updates
        first (the grace timer still ends the process if the save outlasts it)."""
        if not self.interrupt.requested():
            return
        if self.interrupt.preempted():
            self.interrupt.status(where=f"the preemption save of step {step}")
            self._save(step)
            self.interrupt.status(kept=f"every finished phase and the checkpoint of step {step}")
        self.interrupt.exit_now()

    def before_deadline(self, step: int, step_s: float) -> None:
        """Between steps: save and stop when another step and a save would end past the
        deadline."""
        from verl_core.checkpoint.deadline import must_stop

        self.step_s.append(step_s)
        stop, needed = must_stop(time.time(), self.until, self.step_s, self.save_s, self.margin_s)
        if not stop:
            return
        self._save(step)
        left = max(self.until - time.time(), 0.0)
        named = self.spec.config.checkpoint.must_save_by or "a capacity block's expiration"
        raise StoppedBeforeDeadline(
            f"stopped after step {step}: {left:.0f} s are left before checkpoint.must_save_by "
            f"({named}), less than a step and a save ({needed:.0f} s); the checkpoint of step "
            f"{step} is committed in {self.spec.store}; the same command continues it")


EVAL_WALL = "timing/eval_s"
"""An evaluation's wall seconds: in the summary's ``evaluations``, not in the step's history
(evaluation is not part of ``timing/step_s``, and the trackers record the phase's metrics)."""


def _evaluate(spec, state, log) -> dict:
    """The held-out metrics of ``state`` (with :data:`EVAL_WALL`, its wall time); prints the
    first held-out row as verl's reward manager does (``[prompt]`` … ``[score]``, special tokens
    visible), so a doubled BOS or a missing EOS is seen at the first evaluation."""
    from verl_core import phases, runlog
    from verl_core.phases import run_phase
    from verl_core.report import sample_lines

    t0 = time.perf_counter()
    metrics = run_phase(spec, "evaluate", state.step, phases.evaluate, spec, state)
    metrics = {**metrics, EVAL_WALL: time.perf_counter() - t0}
    samples = runlog.eval_samples(spec, state.step)
    if samples:
        log(sample_lines(samples[0]))
    return metrics


def _run_store(workdir: str) -> tuple[str, str]:
    """(store root, run name) that make ``workdir`` itself the run store: its folder name is
    the run's name (what the trackers show), so it is held to the run-name rule."""
    from verl_core.config import ConfigError
    from verl_core.prepare import run_store_uri

    path = os.path.abspath(workdir)
    root, name = os.path.split(path)
    try:
        run_store_uri(root, name)
    except ConfigError:
        raise ConfigError(
            f"--workdir {workdir!r}: its folder name {name!r} names the run (trackers, workers); "
            "use a plain name: letters, digits, - _ . (ASCII, at most 200 characters, starting "
            "with a letter, a digit or _, no '..')") from None
    return root, name


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
    if "rollout/zero_variance_frac" in m:  # the share of groups with equal rewards: no signal
        parts.append(f"flat={m['rollout/zero_variance_frac']:.2f}")
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
    """A ``--set`` value read as verl's positional overrides are (``1e-4``, ``True``, YAML's
    ``false``/``null``, ``[a,b]``; else the text): one reader for both spellings."""
    from verl_core.verl_keys import parse_value  # not at module level: --help stays light

    return parse_value(text)


LOCAL_DIR = "trainer.default_local_dir"
"""verl's checkpoint folder: here the run store, so the plain loop takes it as ``--workdir``."""


def _workdir(workdir: str, local_dir) -> str:
    """``--workdir``, or verl's ``trainer.default_local_dir`` in its place (they name one
    folder: the run store, where checkpoints go); both, naming different folders: refused."""
    from verl_core.config import ConfigError

    if local_dir is None:
        return workdir
    if not isinstance(local_dir, str) or not local_dir or "${" in local_dir:
        raise ConfigError(f"{LOCAL_DIR}={local_dir!r}: give a folder (interpolations are not "
                          "resolved here)")
    if workdir and os.path.abspath(workdir) != os.path.abspath(local_dir):
        raise ConfigError(f"--workdir {workdir!r} and {LOCAL_DIR}={local_dir!r} both name the "
                          "run store (where checkpoints go); give one of them")
    return local_dir


class _Parser(argparse.ArgumentParser):
    """argparse with a "did you mean" for a mistyped option (Python 3.11's has none)."""

    def error(self, message):
        if message.startswith("unrecognized arguments:"):
            known = [o for o in self._option_string_actions if o.startswith("--")]
            for word in message.split(":", 1)[1].split():
                if word.startswith("--"):
                    near = difflib.get_close_matches(word.split("=", 1)[0], known, n=1)
                    if near:
                        message += f" (did you mean {near[0]}?)"
                        break
        super().error(message)


def build_parser() -> argparse.ArgumentParser:
    """The plain loop's options (the workflow's, under the same names, plus verl's overrides)."""
    p = _Parser(prog="python -m verl_core.train", description=__doc__.splitlines()[0],
                epilog="Interrupt with Ctrl-C at any time: the same command continues.")
    p.add_argument("--algorithm", default="",
                   help="grpo (default; verl's gae, i.e. ppo, for a verl-style command that "
                        "names no algorithm.adv_estimator), ppo (GAE + critic), or any advantage "
                        "estimator registered in verl_core/algorithms (rloo, reinforce_plus_plus, "
                        "remax, gpg, ...; docs/algorithms.md lists them all)")
    p.add_argument("--steps", type=int, default=None, help="RL steps (default: the preset's)")
    p.add_argument("--model", default="",
                   help="a local Hugging Face folder (default: the tiny model, warm-started on "
                        "the synthetic task)")
    p.add_argument("--train-files", default="",
                   help="comma-separated parquet files in verl's row layout (default: the "
                        "synthetic task)")
    p.add_argument("--val-files", default="",
                   help="comma-separated parquet files (default: the synthetic task's held-out "
                        "split)")
    p.add_argument("--run-name", default="default",
                   help="the same name continues the same run (default: %(default)s)")
    p.add_argument("--store", default="",
                   help="run store root: a local folder, an NFS mount or s3://bucket/prefix "
                        "(default: $VERL_STORE, else ./runs); the run lives in STORE/RUN_NAME")
    p.add_argument("--workdir", default="",
                   help="instead of --store/--run-name: this folder is the run store (its "
                        "name is the run's name); the same folder resumes the run")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="dotted config override, e.g. --set optim.lr=1e-4 (repeatable)")
    p.add_argument("--summary-json", default="", help="write the summary (with history) here")
    p.add_argument("--verl-config", "--config", dest="verl_config", default="",
                   metavar="VERL_YAML",
                   help="a verl YAML config file (docs/verl-keys.md); the overrides win over it")
    p.add_argument("--config-path", "-cp", dest="config_path", default="",
                   help="Hydra's (verl's): the folder of --config-name; with it, the config is "
                        "DIR/NAME.yaml, its defaults list composed by Hydra (docs/verl-keys.md)")
    p.add_argument("--config-name", "-cn", dest="config_name", default="",
                   help="Hydra's (verl's): a config in --config-path, e.g. gsm8k_multiturn_grpo")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                   help="verl-style overrides, ours or verl's, e.g. trainer.test_freq=5 "
                        "actor_rollout_ref.actor.optim.lr=1e-6 (docs/verl-keys.md)")
    return p


def main(argv=None, *, handle_signals: bool | None = None) -> int:
    """The command line. ``handle_signals`` (default: when ``argv`` is None, i.e. run as a
    program): SIGINT/SIGTERM print what was kept and the continue command, and exit."""
    p = build_parser()
    args = p.parse_intermixed_args(argv)
    given = {}
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep:
            p.error(f"--set {item!r}: expected KEY=VALUE")
        given[key] = _parse_value(value)
    if args.config_name or args.config_path:
        if args.verl_config or not (args.config_name and args.config_path):
            p.error("--config-path DIR --config-name NAME (Hydra's pair, as verl takes them) "
                    "name the config DIR/NAME.yaml; give both, or --config FILE, not both")
        name = args.config_name
        args.verl_config = os.path.join(args.config_path,
                                        name if name.endswith((".yaml", ".yml")) else name + ".yaml")
    if args.workdir and (args.store or args.run_name != "default"):
        p.error("--workdir names the run store itself: give it, or --store/--run-name, not both")
    from verl_core import interrupt, verl_keys

    # Ctrl-C / SIGTERM: one line saying what was kept and how to continue, an exit within
    # seconds (verl_core/interrupt.py); not for a caller's process that passed its own argv
    if argv is None if handle_signals is None else handle_signals:
        interrupt.install()
    options = verl_keys.entry_options(steps=args.steps, model=args.model,
                                      train_files=args.train_files, val_files=args.val_files)
    try:
        given = {**verl_keys.parse_cli(args.overrides), **given}
        workdir = _workdir(args.workdir, given.pop(LOCAL_DIR, None))
        # the workflow's configure builds its config through the same door
        cfg = verl_keys.run_config(args.algorithm, args.verl_config, given, options)
        summary = train(cfg, workdir, store=args.store, run_name=args.run_name)
    except StoppedBeforeDeadline as e:  # saved and stopped as asked: not an error
        print(f"[verl] {e}", file=sys.stderr)
        return 0
    except Exception as e:  # noqa: BLE001 - ours are answered in one line, the rest re-raised
        if not is_user_error(e):
            raise
        print(f"{p.prog}: error: {e}", file=sys.stderr)
        return 2
    if args.summary_json:
        with open(args.summary_json, "w") as f:
            json.dump(summary, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
