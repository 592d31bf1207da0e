"""Configuration and preparation: validate every option, open the run store, build the assets."""

from __future__ import annotations

import json

from flytekit import task

from tasks.common import RETRIES, cache_for, store_call
from verl_core import interrupt, verl_keys
from verl_core.config import ConfigError, effective_line
from verl_core.engine import workers
from verl_core import writer
from verl_core.prepare import prepare_run, run_store_uri
from verl_core.types import STORES, RunSpec
from verl_core.checkpoint.config import schedule_line
from verl_core.training.device import device_line
from verl_core.training.optim import optimizer_steps_line


def build_config(algorithm: str, model: str, train_files: str, val_files: str, steps: int,
                 batch_size: int, rollout_n: int, overrides: str, verl_config: str = ""):
    """Options -> validated RunConfig, through the plain loop's front door
    (:func:`verl_core.verl_keys.run_config`: the same defaults, model-aware, the same micro-batch
    fit, the same epochs). 0 / "" keep the preset's value; ``algorithm`` "" is grpo, or verl's
    gae for verl-style overrides. ``overrides`` takes our dotted keys and verl's;
    ``verl_config`` is a local verl YAML file, read here (so its content, not its path, reaches
    the config and the cache key). Raises a PermanentError (ConfigError, RunInputError), never
    retried."""
    parsed = None
    if overrides:
        try:
            parsed = json.loads(overrides)
        except json.JSONDecodeError as e:
            raise ConfigError(f"--overrides is not a JSON object of dotted keys: {e}") from e
    options = verl_keys.entry_options(steps=steps or None, model=model, train_files=train_files,
                                      val_files=val_files, batch_size=batch_size,
                                      rollout_n=rollout_n)
    return verl_keys.run_config(algorithm, verl_config, parsed, options)


@task
def configure(algorithm: str, model: str, train_files: str, val_files: str, steps: int,
              batch_size: int, rollout_n: int, run_name: str, store: str,
              overrides: str, verl_config: str = "") -> RunSpec:
    """Not cached: validates the options and reads the store's incarnation id every time, so a
    deleted store is noticed. Returns a partial spec (no assets yet)."""
    return configure_spec(algorithm, model, train_files, val_files, steps, batch_size, rollout_n,
                          run_name, store, overrides, verl_config)


def configure_spec(algorithm: str, model: str, train_files: str, val_files: str, steps: int,
                   batch_size: int, rollout_n: int, run_name: str, store: str,
                   overrides: str, verl_config: str = "") -> RunSpec:
    """``configure``'s body, for both front doors (workflows/ppo.py, workflows/ppo_flyte2.py):
    the run header on the console, the partial spec, the run's lease taken."""
    interrupt.install()  # Ctrl-C: what was kept and how to continue (local runs only)
    cfg = build_config(algorithm, model, train_files, val_files, steps, batch_size, rollout_n,
                       overrides, verl_config)
    # the run header (this task is never cached, so every command prints it)
    print(f"[verl] {cfg.total_steps} RL steps, {optimizer_steps_line(cfg)}", flush=True)
    if schedule_line(cfg):
        print(schedule_line(cfg), flush=True)
    print(effective_line(cfg), flush=True)
    if cfg.rollout.engine == "vllm" and workers.runs_on_this_host():
        # the rollout will run on this machine: a missing (or wrong-platform) vLLM is said now,
        # not by a Ray worker at the first rollout after the warm start. On a cluster the workers'
        # image decides, and the worker says it.
        from verl_core.rollout.vllm import import_vllm

        import_vllm()
    if workers.runs_on_this_host():  # the workers' device, said (or refused) before any work
        print(device_line(cfg.trainer.device, cfg.trainer.deterministic), flush=True)
    uri = run_store_uri(store, run_name)
    st = store_call(f"opening the run store {uri}", lambda: STORES.open(uri))
    spec = RunSpec(store=st.uri, incarnation=store_call("the store's incarnation id",
                                                        lambda: st.incarnation_id),
                   config=cfg,
                   trajectory_hash=cfg.trajectory_hash(), assets_json="", start_step=0,
                   total_steps=cfg.total_steps)
    # one writer per run: a second launch of a live run fails here, naming the holder, even
    # when every later task would be a cache hit
    store_call("taking the run's lease", lambda: writer.hold_lease(spec))
    return spec


@task(cache=cache_for("prepare"), retries=RETRIES)
def prepare(spec: RunSpec) -> RunSpec:
    """Synthetic dataset + tiny warm-started model (or the given ones), validated and copied
    into the run store; the start step (auto-resume). Cached per store incarnation."""
    return prepare_spec(spec)


def prepare_spec(spec: RunSpec) -> RunSpec:
    """``prepare``'s body, for both front doors: the full spec, its store line printed."""
    workers.start_local_ray()  # lean local Ray (no-op on a cluster or with RAY_ADDRESS)
    interrupt.install()  # again: Ray's start may have put its own handlers in their place
    full = store_call("prepare", lambda: prepare_run(
        spec.config, spec.store.rsplit("/", 1)[0], spec.store.rsplit("/", 1)[1]))
    print(f"[verl] run store: {full.store} (start step {full.start_step})", flush=True)
    return full
