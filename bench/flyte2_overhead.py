"""Local orchestration per RL step: the Flyte 2 driver (``flyte run --local
workflows/ppo_flyte2.py ppo``) vs the flytekit workflow (``pyflyte run workflows/ppo.py ppo``),
on the same configuration, each in a fresh process with its own cache and run store.

Both front doors run the same phase bodies and write the same phase log (``verl_core.runlog``:
each phase's start, just before its body, and end, just after its log record). What lies between
one phase's end and the next one's start is orchestration: the task's output conversion and cache
write, the dispatch of the next task, its cache lookup and input conversion (and, after an update,
the step's progress line, in both). Per step this script sums those gaps over the steps after
the first (the first starts Ray and the run's worker), and the phase bodies' time beside it. It
also times a second launch of the same command, where every phase is a cache hit (start-up plus
the cache lookups: what a resumed run pays before its first new phase).

    python bench/flyte2_overhead.py                 # 6 steps of the tests' tiny config
    python bench/flyte2_overhead.py --steps 10 --json bench/flyte2_overhead.json

Writes the numbers to ``--json`` (bench/cluster_cost.py reads ``flyte2_dispatch_s`` from it: the
driver's local orchestration per phase task).
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

TINY = {"model.warmup_sft_steps": 30, "model.warmup_target_accuracy": 1.0,
        "data.synthetic_train_size": 200, "data.synthetic_val_size": 32,
        "checkpoint.checkpoint_interval": 2}
"""tests/workflows/conftest.py's configuration (a step of work of ~1 s on 2 cores)."""

FRONT_DOORS = {
    "flytekit (pyflyte run workflows/ppo.py)":
        ["-c", "import sys; from flytekit.clis.sdk_in_container.pyflyte import main; "
               "sys.exit(main())", "run", "workflows/ppo.py", "ppo"],
    "Flyte 2 driver (flyte run --local workflows/ppo_flyte2.py)":
        ["-c", "import sys; from flyte.cli.main import main; sys.exit(main())",
         "run", "--local", "workflows/ppo_flyte2.py", "ppo"],
}


def launch(argv: list[str], store: str, home: str, steps: int) -> float:
    """One launch of a front door; its wall time (fails with its output if it fails)."""
    env = {**os.environ, "HOME": home, "PYTHONPATH": REPO, "RAY_AUTH_MODE": "disabled",
           "OMP_NUM_THREADS": "1", "VERL_ASSET_CACHE": os.path.join(home, "assets")}
    env.pop("RAY_ADDRESS", None)
    os.makedirs(home, exist_ok=True)
    cmd = [sys.executable, *argv, "--store", store, "--run-name", "t", "--steps", str(steps),
           "--batch-size", "8", "--rollout-n", "4", "--overrides", json.dumps(TINY)]
    t0 = time.perf_counter()
    out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if out.returncode:
        sys.exit(f"{' '.join(cmd)} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return wall


def per_step(run_store: str) -> dict:
    """Orchestration and phase work per step, from the run's phase log (steps after the first;
    the evaluation at the end and finalize are left out)."""
    from verl_core.runlog import read_phase_log

    log = sorted(read_phase_log(run_store), key=lambda r: r["started"])
    first = next(i for i, r in enumerate(log) if r["phase"] == "rollout" and r["step"] == 1)
    last = max(i for i, r in enumerate(log) if r["phase"] == "update")
    if log[last + 1:] and log[last + 1]["phase"] == "checkpoint":
        last += 1
    span = log[first:last + 1]
    steps = sum(r["phase"] == "update" for r in span)
    gaps = [b["started"] - a["time"] for a, b in zip(span, span[1:])]
    work = sum(r["time"] - r["started"] for r in span)
    # the gap before this window's first rollout belongs to it as well (after the first step)
    gaps.append(log[first]["started"] - log[first - 1]["time"])
    return {"steps": steps, "phases": len(span), "orchestration_s": sum(gaps) / steps,
            "work_s": work / steps, "per_phase_s": statistics.mean(gaps),
            "max_gap_s": max(gaps)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=2,
                    help="runs of each front door, in ABBA order (the machine's load drifts); "
                         "medians")
    ap.add_argument("--json", default=os.path.join(REPO, "bench", "flyte2_overhead.json"))
    a = ap.parse_args()
    runs: dict[str, list[dict]] = {name: [] for name in FRONT_DOORS}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(a.repeats):
            order = list(FRONT_DOORS.items())
            for i, (name, argv) in enumerate(order if r % 2 == 0 else order[::-1]):
                store, home = os.path.join(tmp, f"s{r}-{i}"), os.path.join(tmp, f"h{r}-{i}")
                cold = launch(argv, store, home, a.steps)
                cached = launch(argv, store, home, a.steps)  # the same command: all cache hits
                runs[name].append({**per_step(os.path.join(store, "t")), "launch_s": cold,
                                   "rerun_all_cached_s": cached})
    rows = {name: {k: statistics.median(x[k] for x in rs) for k in rs[0]}
            for name, rs in runs.items()}
    base, f2 = rows.values()
    print(f"## Local orchestration per RL step: Flyte 2 driver vs flytekit "
          f"(`python bench/flyte2_overhead.py --steps {a.steps}`)\n")
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {os.cpu_count()} CPUs, load "
          f"average {os.getloadavg()[0]:.1f} at the end; TINY config, batch 8 x 4, "
          f"{base['steps']:.0f} steps measured (after the first); medians of {a.repeats} runs "
          f"each, in ABBA order\n")
    print("| front door | phases / step | orchestration / step | per phase task | phase work / "
          "step | launch (cold) | re-run, all cached |\n|---|---:|---:|---:|---:|---:|---:|")
    for name, r in rows.items():
        print(f"| {name} | {r['phases'] / r['steps']:.1f} | {r['orchestration_s'] * 1e3:.0f} ms "
              f"| {r['per_phase_s'] * 1e3:.1f} ms | {r['work_s']:.2f} s | {r['launch_s']:.1f} s | "
              f"{r['rerun_all_cached_s']:.1f} s |")
    print(f"| ratio Flyte 2 / flytekit | | {f2['orchestration_s'] / base['orchestration_s']:.2f} "
          f"| {f2['per_phase_s'] / base['per_phase_s']:.2f} | "
          f"{f2['work_s'] / base['work_s']:.2f} | {f2['launch_s'] / base['launch_s']:.2f} | "
          f"{f2['rerun_all_cached_s'] / base['rerun_all_cached_s']:.2f} |")
    with open(a.json, "w") as f:
        json.dump({"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                   "load_average": os.getloadavg()[0], "steps": a.steps,
                   "flyte2_dispatch_s": f2["per_phase_s"], "flytekit_dispatch_s":
                   base["per_phase_s"], "rows": rows}, f, indent=1)
    print(f"\nsaved: {os.path.relpath(a.json, REPO)}")


if __name__ == "__main__":
    main()
