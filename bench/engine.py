"""Warm workers against a rebuild (issue 11): ``cluster.mode=attached`` vs ``per_task``.

On a real long-lived Ray cluster started here (``ray start --head``), with the default model
(the tiny warm-started Llama of the default config) and a run of ``--steps`` steps made in
``attached`` mode, this prints in one run:

1. the time for a phase to start work: from a new task process's call until the worker holds the
   state the phase names (``RunWorker.ensure_state``), on the run's warm detached worker (adopt +
   weight-version check) against a rebuild (a new worker: model build, checkpoint read, lineage
   replay; what every heavy phase of ``per_task`` mode pays). Target: warm <= 5% of cold.
2. the per-phase fixed overhead of a fresh task process (a new Python process, as each Flyte task
   pod is) in each mode, up to the worker holding the state: ``per_task`` starts its own Ray
   instance (a RayJob's cluster, here a local ``ray.init()``) and rebuilds; ``attached`` joins the
   long-lived cluster and adopts the warm worker.

    python bench/engine.py                 # --steps 2 --repeats 5
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from tests.ray_nodes import RayNodes  # noqa: E402  (the tests' real `ray start` cluster)
from verl_core.config import preset, with_overrides  # noqa: E402
from verl_core import phases  # noqa: E402
from verl_core.engine import cluster  # noqa: E402
from verl_core.engine.workers import WORKERS, RunWorkers  # noqa: E402
from verl_core.prepare import prepare_run  # noqa: E402
from verl_core.types import PhaseOut  # noqa: E402

# A fresh task process: connect the way the mode does, get the worker, make it hold the state.
PROBE = r"""
import json, sys, time
t0 = time.perf_counter()
import ray
from verl_core.config import RunConfig
from verl_core.engine import workers
from verl_core.engine.workers import WORKERS, RunWorkers
from verl_core.types import RunSpec
d = json.loads(sys.argv[1])
spec = RunSpec(**{**d, "config": RunConfig.from_dict(d["config"])})
mode = spec.config.cluster.mode
if mode == "per_task":
    workers.start_local_ray()          # the RayJob's own cluster (locally: a new Ray instance)
else:
    from verl_core.engine import cluster
    cluster.connect(spec.config.cluster)
RunWorkers(spec).ensure_state(spec.total_steps)
print(json.dumps({"seconds": time.perf_counter() - t0}))
if mode == "per_task":
    WORKERS.release_all()
"""


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def _probe(spec, env) -> float:
    out = subprocess.run([sys.executable, "-c", PROBE, json.dumps(dataclasses.asdict(spec))],
                         env=env,
                         cwd=REPO, capture_output=True, text=True, timeout=900)
    if out.returncode:
        raise SystemExit(f"probe failed:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])["seconds"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    import ray

    work = tempfile.mkdtemp(prefix="verl-bench-engine-")
    os.environ.setdefault("VERL_ASSET_CACHE", os.path.join(work, "assets"))
    os.environ["RAY_AUTH_MODE"] = "disabled"
    nodes = RayNodes(os.path.join(work, "ray"), num_cpus=2)
    try:
        deadline = time.time() + 120
        while True:
            try:
                ray.init(address=nodes.address, include_dashboard=False, configure_logging=False,
                         log_to_driver=False)
                break
            except ConnectionError:
                if time.time() > deadline:
                    raise
                time.sleep(0.5)
        # the default model and config, checkpointed at the last step (so a rebuild reads one
        # checkpoint and replays nothing: the cheapest rebuild there is)
        cfg = preset("grpo", **{"total_steps": args.steps, "cluster.mode": "attached",
                                "cluster.address": nodes.address,
                                "checkpoint.checkpoint_interval": args.steps})
        spec = prepare_run(cfg, os.path.join(work, "store"), "bench",
                                   log_fn=lambda *_: None)
        for s in range(args.steps):
            ref, _ = RunWorkers(spec).rollout(s)
            ref = phases.reward(spec, PhaseOut(s, ref)).batch
            ref = phases.advantage(spec, PhaseOut(s, ref)).batch
            RunWorkers(spec).update(s, ref)
            RunWorkers(spec).checkpoint(s + 1)
        RunWorkers(spec).wait_checkpoints()
        step = args.steps

        def start_phase():
            WORKERS.reset()  # a new task process has no handle on the workers
            RunWorkers(spec).ensure_state(step)

        warm = [_timed(start_phase) for _ in range(args.repeats)]
        cold = []
        for _ in range(max(2, args.repeats // 2)):
            cluster.teardown(spec.incarnation)
            cold.append(_timed(start_phase))

        # fresh task processes, one per phase, in each mode (the per_task one on its own Ray)
        env = {**os.environ, "PYTHONPATH": REPO}
        env.pop("RAY_ADDRESS", None)
        per_task = dataclasses.replace(spec, config=with_overrides(
            spec.config, {"cluster.mode": "per_task"}))
        p_attached = [_probe(spec, env) for _ in range(max(2, args.repeats // 2))]
        p_per_task = [_probe(per_task, env) for _ in range(max(2, args.repeats // 2))]
        WORKERS.release(spec)
    finally:
        ray.shutdown()
        nodes.stop()

    med = statistics.median
    print(f"\nphase start on the default model ({args.steps} steps trained; median of "
          f"{len(warm)} warm, {len(cold)} cold)\n")
    print("| phase start | seconds | x cold |")
    print("|---|---|---|")
    print(f"| rebuild (new worker: model, checkpoint) | {med(cold):.3f} | 1.00 |")
    print(f"| warm detached worker (adopt + version check) | {med(warm):.4f} | "
          f"{med(warm) / med(cold):.3f} |")
    print(f"\ntarget warm <= 5% of cold: {'met' if med(warm) <= 0.05 * med(cold) else 'NOT met'}")
    print("\n| fresh task process, up to the worker holding the state | seconds | x per_task |")
    print("|---|---|---|")
    print(f"| per_task (own Ray instance + rebuild) | {med(p_per_task):.2f} | 1.00 |")
    print(f"| attached (join cluster + adopt warm worker) | {med(p_attached):.2f} | "
          f"{med(p_attached) / med(p_per_task):.2f} |")


if __name__ == "__main__":
    main()
