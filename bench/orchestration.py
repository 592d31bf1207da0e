"""Orchestration cost: the same RL configuration through the plain-Python loop and `pyflyte run`.

Both runs start from the same prepared model and dataset (the plain run prepares them; the Flyte
run is pointed at them with --model/--train-files), with the same seed, in one invocation. For
each step it prints the wall time of the step in each, and per phase the mean time each adds up
to and the difference (what orchestration costs: task dispatch, cache bookkeeping, literal
(de)serialisation, the Ray actor call). Both run the same phase functions on a run store (the plain
loop's is its workdir), so the batches' parquet to and from the store is in both. The Flyte step
time is measured from the phase execution log (end of one step's checkpoint phase to the next);
its first step (Ray start-up) is reported separately.

    python bench/orchestration.py                 # both configurations
    python bench/orchestration.py --configs large --steps 6
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from verl_core.config import with_overrides, grpo_preset  # noqa: E402
from verl_core.runlog import read_phase_log  # noqa: E402
from verl_core.train import train  # noqa: E402
from verl_core.assets import prepare_assets  # noqa: E402

CONFIGS = {
    # the default configuration (B=32 prompts x G=8)
    "default": {},
    # a rollout batch large enough that a plain step takes >= 2 s on 2 cores (B=768 x G=8)
    "large": {"data.train_batch_size": 768, "actor.ppo_mini_batch_size": 384,
              "actor.ppo_micro_batch_size": 768},
}
PHASES = ("rollout", "reward", "advantage", "update", "checkpoint")


def bench(name: str, over: dict, steps: int, work: str, assets) -> dict:
    over = {**over, "total_steps": steps, "checkpoint.checkpoint_interval": 10,
            "model.path": assets.model_path, "data.train_files": assets.train_files[0],
            "data.val_files": assets.val_files[0]}
    cfg = with_overrides(grpo_preset(), over)
    plain_dir = os.path.join(work, f"plain-{name}")
    t0 = time.perf_counter()
    summary = train(cfg, plain_dir, log=lambda *_: None)
    plain_total = time.perf_counter() - t0
    plain = [{p: h.get(f"timing/{p}_s", 0.0) for p in PHASES} | {"step": h["timing/step_s"]}
             for h in summary["history"]]

    # The Flyte run starts from the same prepared assets (same bytes, same seed).
    flyte_over = {k: v for k, v in over.items() if k != "total_steps"}
    flyte, flyte_total, _ = run_flyte(name, flyte_over, steps, work)
    return {"name": name, "plain": plain, "flyte": flyte, "plain_total": plain_total,
            "flyte_total": flyte_total, "rows": cfg.data.train_batch_size * cfg.rollout.n}


def run_flyte(name: str, flyte_over: dict, steps: int, work: str):
    """``pyflyte run workflows/ppo.py ppo`` in a subprocess (its own HOME, so its local cache
    starts empty). Returns (per-step phase times from the phase log, the command's wall time,
    the run store folder)."""
    store = os.path.join(work, f"store-{name}")
    env = dict(os.environ, HOME=os.path.join(work, f"home-{name}"), RAY_AUTH_MODE="disabled",
               PYTHONPATH=REPO)
    os.makedirs(env["HOME"], exist_ok=True)
    cmd = [os.path.join(os.path.dirname(sys.executable), "pyflyte"), "run", "workflows/ppo.py",
           "ppo", "--steps", str(steps), "--store", store, "--run-name", "bench",
           "--overrides", json.dumps(flyte_over)]
    t0 = time.perf_counter()
    res = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    flyte_total = time.perf_counter() - t0
    if res.returncode:
        raise SystemExit(f"pyflyte run failed:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}")
    log = [r for r in read_phase_log(os.path.join(store, "bench")) if r["phase"] in PHASES]
    ends = {(r["phase"], r["step"]): r["time"] for r in log}

    def end_of(p, k):  # the checkpoint phase of step k saves state k + 1; it may be left out
        return ends.get(("checkpoint", k + 1)) if p == "checkpoint" else ends[(p, k)]

    flyte = []
    first = [r for r in log if (r["phase"], r["step"]) == ("rollout", 0)][0]
    prev = first["started"]  # the first rollout has no preceding phase end in the log
    for k in range(steps):
        # phase p of step k "adds up to" the time from the previous phase's end to its own end
        row, last = {}, prev
        for p in PHASES:
            e = end_of(p, k)
            row[p] = 0.0 if e is None else e - last
            last = last if e is None else e
        row["step"] = last - prev
        flyte.append(row)
        prev = last
    return flyte, flyte_total, os.path.join(store, "bench")


def report(r: dict) -> None:
    print(f"\n## {r['name']}: {r['rows']} responses per step; whole command: plain "
          f"{r['plain_total']:.1f}s, pyflyte {r['flyte_total']:.1f}s "
          "(incl. start-up, Ray, asset copy)")
    print("| step | plain s | flyte s | flyte/plain |")
    print("|---:|---:|---:|---:|")
    for k, (p, f) in enumerate(zip(r["plain"], r["flyte"])):
        print(f"| {k + 1} | {p['step']:.3f} | {f['step']:.3f} | {f['step'] / p['step']:.2f} |")
    steady = range(1, len(r["plain"]))  # step 1 carries the Ray actor start-up
    # medians: on a 2-core machine single steps swing by +-20% (other processes, Ray's own)
    ps = statistics.median(r["plain"][k]["step"] for k in steady)
    fs = statistics.median(r["flyte"][k]["step"] for k in steady)
    print(f"| steps 2+ median | {ps:.3f} | {fs:.3f} | **{fs / ps:.2f}** |")
    print("\n| phase (steps 2+, median) | plain s | flyte s | orchestration s |")
    print("|---|---:|---:|---:|")
    for p in PHASES:
        pm = statistics.median(r["plain"][k][p] for k in steady)
        fm = statistics.median(r["flyte"][k][p] for k in steady)
        print(f"| {p} | {pm:.3f} | {fm:.3f} | {fm - pm:+.3f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default="default,large")
    ap.add_argument("--steps", type=int, default=12)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="verl-bench-orch-") as work:
        # the default warm-started model and synthetic data, prepared once for every run
        assets = prepare_assets(grpo_preset(), os.path.join(work, "assets"), log=lambda *_: None)
        for name in args.configs.split(","):
            report(bench(name, CONFIGS[name], args.steps, work, assets))


if __name__ == "__main__":
    main()
