"""The training guard's cost per step: the same run with the guard on and off, measured together.

Two run workers on the default config (256 responses per step, the tiny CPU model warm-started
briefly: the guard's cost does not depend on the model's skill), each in its own run store,
execute the same steps in alternation, so drift of the machine hits both alike: rollout, reward,
advantage and the update through the phase functions the workflow calls, with the per-phase
wall-clock watch (``runlog.watch_phase``) and the step's event listing (what the console line
reads). Two numbers per step:

- the guard's own time, every guard call timed directly (batch and update detectors, the
  wall-clock watch, the event listing), against the guarded step's time: the cost itself;
- the median step time with the guard on against off: the end-to-end check (within noise).

Target (issue 12): guard cost <= 2% of the step time.

    python bench/guard.py                 # 16 steps
    python bench/guard.py --steps 30
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

from verl_core.store import RunStore
from verl_core.config import preset
from verl_core import runlog
from verl_core.types import RunSpec
from verl_core.engine.assets import publish_assets
from verl_core.engine.worker import RunWorker, get_batch, put_batch
from verl_core.guard import checks
from verl_core.training.advantage import compute_advantages
from verl_core.assets import prepare_assets
from verl_core.reward.scoring import score_batch

GUARD_TIME = [0.0]
PARTS: dict[str, list[float]] = {}


def _timed(fn):
    def wrapper(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            dt = time.perf_counter() - t
            GUARD_TIME[0] += dt
            PARTS.setdefault(fn.__name__, []).append(dt)
    return wrapper


# time every guard entry point directly (the worker and the task layer look them up at call time)
checks.batch_anomalies = _timed(checks.batch_anomalies)
checks.update_anomalies = _timed(checks.update_anomalies)
runlog.watch_phase = _timed(runlog.watch_phase)
runlog.step_events = _timed(runlog.step_events)


def _spec(uri: str, cfg, index: dict) -> RunSpec:
    return RunSpec(store=uri, incarnation=RunStore(uri).incarnation_id,
                           config=cfg,
                           trajectory_hash=cfg.trajectory_hash(), assets_json=json.dumps(index),
                           start_step=0, total_steps=cfg.total_steps)


def _step(w: RunWorker, spec, step: int) -> float:
    t0 = time.perf_counter()
    for phase in ("rollout", "reward", "advantage", "update"):
        t = time.perf_counter()
        if phase == "rollout":
            ref, m = w.rollout(step)
        elif phase == "reward":
            batch, m = score_batch(get_batch(w.store, ref), w.trainer.scorer, w.trainer.tokenizer)
            ref = put_batch(w.store, batch)
        elif phase == "advantage":
            batch, m = compute_advantages(get_batch(w.store, ref), w.cfg.algorithm)
            ref = put_batch(w.store, batch)
        else:
            m = w.update(step, ref)
        runlog.watch_phase(spec, phase, step, time.perf_counter() - t, m)
    w.checkpoint(step + 1)
    runlog.step_events(spec, step)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    base = {"total_steps": args.steps, "model.warmup_sft_steps": 100,
            "model.warmup_target_accuracy": 1.0, "num_threads": args.threads,
            "checkpoint.async_save": False}
    on, off = preset("grpo", **base), preset("grpo", **base, **{"guard.enabled": False})
    with tempfile.TemporaryDirectory() as tmp:
        assets = prepare_assets(on, os.path.join(tmp, "assets"), log=lambda *_: None)
        runs = {}
        for name, cfg in (("on", on), ("off", off)):
            uri = os.path.join(tmp, name)
            index = publish_assets(RunStore(uri), assets)
            runs[name] = (RunWorker(uri, json.dumps(cfg.to_dict()), index), _spec(uri, cfg, index))
        times = {"on": [], "off": []}
        guard = []
        for s in range(args.steps):
            for name in ("off", "on") if s % 2 else ("on", "off"):
                GUARD_TIME[0] = 0.0
                dt = _step(*runs[name], s)
                times[name].append(dt)
                if name == "on":
                    guard.append(GUARD_TIME[0])
        for w, _ in runs.values():
            w.close()
    skip = 2  # the first steps pay one-off costs (imports, the detectors' first calls)
    t_on, t_off = statistics.median(times["on"][skip:]), statistics.median(times["off"][skip:])
    g = statistics.median(guard[skip:])
    print(f"guard cost per step, default config ({on.data.train_batch_size} prompts x "
          f"{on.rollout.n} samples), {args.steps} steps, median of steps {skip}..")
    print(f"{'':28}{'seconds':>10}{'ratio':>10}")
    print(f"{'step, guard off':28}{t_off:>10.4f}{1.0:>10.3f}")
    print(f"{'step, guard on':28}{t_on:>10.4f}{t_on / t_off:>10.3f}")
    print(f"{'guard calls (timed)':28}{g:>10.4f}{g / t_on:>10.4f}   target <= 0.02")
    print(f"{'guard calls, max':28}{max(guard[skip:]):>10.4f}")
    for name, ts in sorted(PARTS.items()):  # per call, over every call of the run
        print(f"  {name:26}{statistics.median(ts):>10.5f}  per call, {len(ts)} calls")


if __name__ == "__main__":
    main()
