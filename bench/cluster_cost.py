"""A cost model of orchestration on a cluster (issue 43, item 2): per RL step, the seconds spent
outside the phases' own work and the bytes moved, for three ways of running a run on a Flyte
cluster:

- ``per_task`` (``cluster.mode=per_task``, the default): every task a pod; every heavy phase
  (rollout, update, checkpoint and evaluate when due) its own KubeRay RayJob (``tasks/common.py``
  ``RAY_CONFIG``: a head node per task), whose fresh workers rebuild the run's state from the store;
- ``attached`` (``cluster.mode=attached``): every task still a pod, but the heavy phases drive the
  warm detached workers of one long-lived Ray cluster (no state read);
- ``flyte2_driver`` (built: ``workflows/ppo_flyte2.py``): one driver task per run whose step loop
  calls each phase as a cached Flyte 2 task on the warm cluster: one driver pod and one state
  build per run; per phase a task action (its dispatch as measured locally by
  ``bench/flyte2_overhead.py``, plus one store request for its record) in a pod of its own, or,
  as ``flyte2_reusable`` (``VERL_FLYTE2_REUSE``), in a warm reusable container where the backend
  offers them;
- ``flyte2_traced``: the same loop with each phase a ``@flyte.trace``d call inside the driver's
  pod (a trace record per phase); a design, not built (a local run does not replay traces, so it
  could not be tested here).

Inputs: the project's own local costs, measured by this script with small real runs of the
default config (a fresh process's start and ``import workflows.ppo``; opening the run store; a
state load through ``RunWorker.ensure_state`` from a checkpoint; the step's batches through
``put_batch``/``get_batch``; their stored sizes), saved to ``--measured`` and reused unless
``--measure``; and documented cluster latencies, each a command-line option whose help names its
source. Every assumption is printed with its source.

    python bench/cluster_cost.py                # measures once (~1-3 min), then reuses the file
    python bench/cluster_cost.py --measure      # measure again
    python bench/cluster_cost.py --step-7b-s 300 --store-gb-s 2    # other assumptions

What the model leaves out (each makes ``per_task`` look better than it is): the updates a
``per_task`` rebuild replays when the newest checkpoint is older than the phase's step (up to
``checkpoint_interval`` - 1 updates per heavy phase); vLLM's engine start and CUDA graph capture
in each fresh RayJob; image pulls on a node that has not cached the image.
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

GB = 1e9

# --------------------------------------------------------------------------- the model (pure)


@dataclasses.dataclass(frozen=True)
class Cluster:
    """Documented cluster latencies (the options' help texts give the sources)."""

    pod_start_s: float = 30.0
    """Cold start of a task's pod (schedule, pull a cached image, start the container)."""
    tasks_per_min: float = 150.0
    """Flyte 1 propeller's task executions per minute: a serial chain pays 60/rate per task."""
    rayjob_start_s: float = 60.0
    """A RayJob from creation to its head node ready and the job submitted (KubeRay)."""
    reusable_start_s: float = 1.0
    """A task routed to a warm reusable container (Union): replaces pod start and imports."""
    store_gb_s: float = 10.0
    """Store throughput of one node, GB/s (S3 with parallel ranged requests; NFS: its link)."""
    store_request_s: float = 0.1
    """Latency of one small store request (a batch object's first byte, a trace record)."""


@dataclasses.dataclass(frozen=True)
class Workload:
    """One run's per-step shape and its per-phase fixed costs."""

    name: str
    step_s: float
    """The step's own work (rollout, reward, advantage, update), no orchestration."""
    total_steps: int
    checkpoint_interval: int
    evals_per_run: int
    """Evaluate phases in a run (the defaults: at the start and at the end)."""
    state_bytes: float
    """Bytes a fresh worker reads before it can work (weights, optimizer, reference)."""
    state_build_s: float
    """A fresh worker's state build beyond reading ``state_bytes`` (model construction, ...)."""
    warm_check_s: float
    """A warm worker's check that it holds the phase's state (weight version)."""
    process_s: float
    """A fresh task process up to its first line of work: interpreter, imports, store open."""
    batch_bytes: tuple[float, float, float]
    """Stored bytes of the step's rollout, scored and advantaged batches."""
    batch_codec_s: float = 0.0
    """The step's batches encoded and decoded (``put_batch``/``get_batch`` on a local store)."""
    dispatch_s: float = 0.0
    """The Flyte 2 driver's own orchestration per phase task, measured locally (output and
    input conversion, cache lookup and write, dispatch: ``bench/flyte2_overhead.py``)."""

    @property
    def heavy_per_step(self) -> float:
        """Heavy (Ray) phase executions per step: rollout, update, a checkpoint every
        ``checkpoint_interval`` steps, the run's evaluations spread over its steps."""
        return 2 + 1 / self.checkpoint_interval + self.evals_per_run / self.total_steps

    light_per_step: int = 2
    """Light phase executions per step: reward, advantage."""

    @property
    def batch_bytes_per_step(self) -> float:
        """rollout writes its batch; reward reads it and writes the scored one; advantage reads
        that and writes the advantaged one; update reads it: each batch written once, read once."""
        return 2 * sum(self.batch_bytes)

    batch_requests_per_step: int = 6
    """The store requests of those six transfers."""


SETUPS = ("per_task", "attached", "flyte2_driver", "flyte2_reusable", "flyte2_traced",
          "attached_reusable")
"""``attached_reusable``: ``attached`` with every task routed to a warm reusable container, where
a backend offers them (Union); a variant, beside the three setups of issue 43."""
BUILT = ("per_task", "attached", "flyte2_driver", "flyte2_reusable")
"""The setups this project runs today (``cluster.mode``; the Flyte 2 front door, with its phase
environment's reusable containers where the backend offers them)."""


@dataclasses.dataclass(frozen=True)
class Cost:
    """Per-step orchestration of one setup: seconds by kind, bytes moved by orchestration."""

    setup: str
    scheduling_s: float
    pod_start_s: float
    state_load_s: float
    batch_io_s: float
    state_bytes: float
    batch_bytes: float

    @property
    def total_s(self) -> float:
        return self.scheduling_s + self.pod_start_s + self.state_load_s + self.batch_io_s

    @property
    def bytes(self) -> float:
        return self.state_bytes + self.batch_bytes

    def share(self, step_s: float) -> float:
        """Share of the step's wall time spent on orchestration: total / (work + total)."""
        return self.total_s / (step_s + self.total_s)


def batch_io_s(w: Workload, c: Cluster) -> float:
    """The step's batches through the store: bytes at the node's throughput plus a request
    latency per transfer. The same in every setup: the store stays the source of truth."""
    return (w.batch_codec_s + w.batch_bytes_per_step / (c.store_gb_s * GB)
            + w.batch_requests_per_step * c.store_request_s)


def cost(setup: str, w: Workload, c: Cluster) -> Cost:
    """Per-step orchestration cost of ``setup`` for workload ``w`` on cluster ``c``."""
    tasks = w.heavy_per_step + w.light_per_step
    rebuild_s = w.state_bytes / (c.store_gb_s * GB) + w.state_build_s
    io = batch_io_s(w, c)
    sched = tasks * 60.0 / c.tasks_per_min  # Flyte 1: every phase a task execution
    if setup == "per_task":
        # light tasks: a pod each; heavy tasks: a RayJob each (its head pod's start included in
        # the RayJob figure); every task a fresh process; every heavy phase a rebuild
        return Cost(setup, sched,
                    w.light_per_step * c.pod_start_s + w.heavy_per_step * c.rayjob_start_s
                    + tasks * w.process_s,
                    w.heavy_per_step * rebuild_s, io,
                    w.heavy_per_step * w.state_bytes, w.batch_bytes_per_step)
    if setup == "attached":
        # every task a pod and a fresh process; the heavy ones find the workers warm
        return Cost(setup, sched, tasks * (c.pod_start_s + w.process_s),
                    w.heavy_per_step * w.warm_check_s, io, 0.0, w.batch_bytes_per_step)
    if setup == "attached_reusable":
        # attached, with every task routed to a warm reusable container (a Union backend)
        return Cost(setup, sched, tasks * c.reusable_start_s,
                    w.heavy_per_step * w.warm_check_s, io, 0.0, w.batch_bytes_per_step)
    if setup in ("flyte2_driver", "flyte2_reusable"):
        # one driver pod, one process and one state build per run, spread over its steps; per
        # phase a cached task action: the driver's measured dispatch and a store request for its
        # record, then a pod and a process of its own (or a warm reusable container) whose work
        # goes to the warm workers
        per_run = (c.pod_start_s + w.process_s) / w.total_steps
        start = c.reusable_start_s if setup == "flyte2_reusable" else c.pod_start_s + w.process_s
        return Cost(setup, tasks * (w.dispatch_s + c.store_request_s), per_run + tasks * start,
                    w.heavy_per_step * w.warm_check_s + rebuild_s / w.total_steps, io,
                    w.state_bytes / w.total_steps, w.batch_bytes_per_step)
    if setup == "flyte2_traced":
        # one driver pod, one process and one state build per run, spread over its steps; per
        # phase a trace record (one small store write) instead of a task execution
        per_run = c.pod_start_s + w.process_s
        return Cost(setup, tasks * c.store_request_s, per_run / w.total_steps,
                    w.heavy_per_step * w.warm_check_s + rebuild_s / w.total_steps, io,
                    w.state_bytes / w.total_steps, w.batch_bytes_per_step)
    raise ValueError(f"setup={setup!r}: use one of {SETUPS}")


# --------------------------------------------------------------------------- measurement

# A fresh task process: imports, store open, a state load from the checkpoint, the warm check,
# the batches through the store. Times in seconds from the process's first line.
PROBE = r"""
import json, sys, time
t0 = time.perf_counter()
import workflows.ppo  # noqa: F401  (what a task pod imports: flytekit, the tasks, verl_core)
t1 = time.perf_counter()
from verl_core.engine.worker import RunWorker, get_batch, put_batch
from verl_core.store.run_store import RunStore
d = json.loads(sys.argv[1])
store = RunStore(d["store"])
store.incarnation_id  # reads store.json
t2 = time.perf_counter()
w = RunWorker(d["store"], d["config_json"], d["assets"])
w.ensure_state(d["step"])
t3 = time.perf_counter()
w.ensure_state(d["step"])
t4 = time.perf_counter()
for ref in d["refs"]:
    put_batch(store, get_batch(store, ref))
t5 = time.perf_counter()
print(json.dumps({"imports_s": t1 - t0, "store_open_s": t2 - t1, "state_load_s": t3 - t2,
                  "warm_check_s": t4 - t3, "batch_io_s": t5 - t4}))
"""


def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def measure(repeats: int = 3) -> dict:
    """Small real runs of the default config on this machine: one step (its checkpoint saved)
    in this process, then ``repeats`` fresh probe processes. Returns medians and sizes."""
    from verl_core import phases
    from verl_core.config import preset
    from verl_core.engine.worker import get_batch
    from verl_core.engine.workers import RunWorkers
    from verl_core.prepare import prepare_run
    from verl_core.store.run_store import RunStore
    from verl_core.types import PhaseOut

    work = tempfile.mkdtemp(prefix="verl-bench-cluster-cost-")
    # the default config at its sizes; only the warm start is cut to 5 supervised steps (the
    # default's can take many minutes on a busy 2-core machine, and no cost here depends on it)
    cfg = preset("grpo", **{"total_steps": 2, "checkpoint.checkpoint_interval": 2,
                            "model.warmup_sft_steps": 5, "model.warmup_target_accuracy": 1.0})
    spec = prepare_run(cfg, os.path.join(work, "store"), "cost", log_fn=lambda *_: None)
    step_s = []
    for s in range(2):  # the second step's time: the first carries one-off warm-ups
        t = time.perf_counter()
        r_ref, _ = RunWorkers(spec).rollout(s)
        s_ref = phases.reward(spec, PhaseOut(s, r_ref)).batch
        a_ref = phases.advantage(spec, PhaseOut(s, s_ref)).batch
        RunWorkers(spec).update(s, a_ref)
        step_s.append(time.perf_counter() - t)
    local = spec.store[len("file://"):] if spec.store.startswith("file://") else spec.store
    before = _dir_bytes(local)
    RunWorkers(spec).checkpoint(2)
    RunWorkers(spec).wait_checkpoints()
    ckpt_bytes = _dir_bytes(local) - before
    store = RunStore(spec.store)
    refs = [r_ref, s_ref, a_ref]
    b = get_batch(store, r_ref)
    slots = b.prompt_ids.shape[0] * (b.prompt_ids.shape[1] + b.response_ids.shape[1])  # N·(P+T)
    arg = json.dumps({"store": spec.store, "config_json": spec.config_json,
                      "assets": json.loads(spec.assets_json), "step": 2, "refs": refs})
    env = {**os.environ, "PYTHONPATH": REPO}
    env.pop("RAY_ADDRESS", None)
    probes, walls = [], []
    for _ in range(repeats):
        t = time.perf_counter()
        out = subprocess.run([sys.executable, "-c", PROBE, arg], env=env, cwd=REPO,
                             capture_output=True, text=True, timeout=600)
        walls.append(time.perf_counter() - t)
        if out.returncode:
            raise SystemExit(f"probe failed:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")
        probes.append(json.loads(out.stdout.strip().splitlines()[-1]))
    med = {k: statistics.median(p[k] for p in probes) for k in probes[0]}
    inside = statistics.median(sum(p.values()) for p in probes)
    return {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the end",
        "config": ("preset('grpo') defaults (64 prompts x 8 samples) with a 5-step warm start, "
                   "a checkpoint at step 2"),
        "repeats": repeats,
        "interpreter_s": max(0.0, statistics.median(walls) - inside),  # start + exit
        **med,
        "step_s": step_s[1],
        "first_step_s": step_s[0],
        "batch_bytes": [store.object_size(r) for r in refs],
        "batch_token_slots": slots,
        "checkpoint_bytes": ckpt_bytes,
        "total_steps": preset("grpo").total_steps,
        "checkpoint_interval": preset("grpo").checkpoint.checkpoint_interval,
    }


# --------------------------------------------------------------------------- the report


def workloads(m: dict, a: argparse.Namespace) -> list[Workload]:
    """The default run (measured) and a 7B GRPO step (the measured fixed costs, the 7B state and
    batch sizes of docs/cluster.md, the assumed step time)."""
    from verl_core.engine.cluster import bytes_read_per_phase

    process_s = m["interpreter_s"] + m["imports_s"] + m["store_open_s"]
    local_read_s = m["checkpoint_bytes"] / (a.local_read_gb_s * GB)
    build_s = max(0.0, m["state_load_s"] - local_read_s)  # the tiny rebuild less its read
    default = Workload(
        "default run (tiny model, 64 x 8)", step_s=a.default_step_s,
        total_steps=m["total_steps"], checkpoint_interval=m["checkpoint_interval"],
        evals_per_run=2, state_bytes=m["checkpoint_bytes"], state_build_s=build_s,
        warm_check_s=m["warm_check_s"], process_s=process_s,
        batch_bytes=tuple(float(x) for x in m["batch_bytes"]), batch_codec_s=m["batch_io_s"],
        dispatch_s=m.get("flyte2_dispatch_s", 0.0))
    # the rollout batch at docs/cluster.md's ~24 B per token (token ids, masks, fp32 log-probs,
    # incompressible at 7B, unlike the tiny run's padded batches); the scored and advantaged
    # ones larger by the ratios measured here
    ratio = [x / m["batch_bytes"][0] for x in m["batch_bytes"]]
    state_7b = bytes_read_per_phase(a.params_7b, mode="per_task")["rollout"]  # 98 GB at 7e9
    big = Workload(
        f"7B GRPO step ({a.params_7b / 1e9:.0f}B params, {a.rows_7b} rows x {a.tokens_7b} tokens,"
        f" {a.step_7b_s:.0f} s of work)", step_s=a.step_7b_s, total_steps=a.steps_7b,
        checkpoint_interval=m["checkpoint_interval"], evals_per_run=2, state_bytes=state_7b,
        state_build_s=build_s, warm_check_s=m["warm_check_s"], process_s=process_s,
        batch_bytes=tuple(r * a.bytes_per_token_7b * a.rows_7b * a.tokens_7b for r in ratio),
        batch_codec_s=m["batch_io_s"], dispatch_s=m.get("flyte2_dispatch_s", 0.0))
    return [default, big]


def _fmt_bytes(x: float) -> str:
    return f"{x / GB:.2f} GB" if x >= 0.01 * GB else f"{x / 1e6:.2f} MB"


def table(w: Workload, c: Cluster) -> str:
    rows = [f"### {w.name}", "",
            f"Work per step {w.step_s:.2f} s; heavy phases per step {w.heavy_per_step:.3f}, light "
            f"{w.light_per_step}; state read by a rebuild {_fmt_bytes(w.state_bytes)}; batches "
            f"{' / '.join(_fmt_bytes(x) for x in w.batch_bytes)} (rollout / scored / advantaged).",
            "",
            "| setup | scheduling s | pod + process start s | state load s | batch I/O s "
            "| orchestration s | bytes moved | share of step | 5% needs a step of |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for s in SETUPS:
        k = cost(s, w, c)
        rows.append(f"| {s} | {k.scheduling_s:.2f} | {k.pod_start_s:.2f} | {k.state_load_s:.2f} "
                    f"| {k.batch_io_s:.2f} | {k.total_s:.2f} | {_fmt_bytes(k.bytes)} "
                    f"| {100 * k.share(w.step_s):.1f}% | {k.total_s * 19:.0f} s |")
    return "\n".join(rows)


SOURCES = {
    "pod_start_s": "Flyte: ~30 s cold start per task (the figure issue 43 quotes from Flyte's "
                   "side; the page that states it was not found here); every task execution "
                   "runs in a fresh container (https://www.union.ai/docs/v2/flyte/user-guide/"
                   "task-configuration/reusable-containers); a task's overhead is 2u + 2d + e + "
                   "t, t the container's creation (https://www.union.ai/docs/v2/byoc/user-guide/"
                   "run-scaling/scale-your-workflows)",
    "tasks_per_min": "Flyte 1 propeller ~150 task executions per minute (issue 43's figure; "
                     "propeller's event loop: https://docs.flyte.org/en/latest/deployment/"
                     "configuration/performance.html); a throughput, used as a serial chain's "
                     "latency",
    "rayjob_start_s": "KubeRay: a RayJob creates a RayCluster and submits when it is ready "
                      "(https://docs.ray.io/en/latest/cluster/kubernetes/getting-started/"
                      "rayjob-quick-start.html); the RayCluster quickstart shows the cluster "
                      "'ready' at AGE 55s (https://docs.ray.io/en/latest/cluster/kubernetes/"
                      "getting-started/raycluster-quick-start.html); a fresh cloud node can take "
                      "far longer ('more than 20 minutes', https://github.com/ray-project/kuberay/"
                      "issues/2398). Assumed: nodes up, image cached",
    "reusable_start_s": "Union reusable containers / actors: under 1 s (issue 43; "
                        "https://union.ai/blog-post/build-faster-ai-pipelines-with-union-ai-"
                        "actors-reuse-containers-skip-cold-starts); a Union backend only",
    "store_gb_s": "S3: 5 Gb/s per connection, more with parallel ranged requests up to the "
                  "instance's network (up to 200 Gb/s) "
                  "(https://repost.aws/articles/AR1Jqz-WmjRzCgVGa-uVSdLQ/maximizing-amazon-s3-"
                  "transfer-throughput-to-amazon-ec2-instances); 10 GB/s = 80 Gb/s assumed for an "
                  "8-GPU node; an NFS mount: its link's rate (10-25 Gb/s typical: --store-gb-s 2)",
    "store_request_s": "S3 small-request latency 100-200 ms "
                       "(https://notes.aslamcodes.in/aws/s3/s3-performance, citing AWS's "
                       "performance guidelines); also a Flyte 2 trace record's cost (traces for "
                       "lightweight checkpointed steps: https://www.union.ai/docs/v2/byoc/"
                       "user-guide/run-scaling/scale-your-workflows)",
}


def main() -> None:
    c0 = Cluster()
    ap = argparse.ArgumentParser(description="A cost model of orchestration per RL step on a "
                                 "cluster (issue 43, item 2); see the module docstring.")
    ap.add_argument("--measured", default=os.path.join(REPO, "bench", "cluster_cost_measured.json"),
                    help="where the local measurement is saved and read from")
    ap.add_argument("--measure", action="store_true", help="measure again even if saved")
    ap.add_argument("--flyte2-measured",
                    default=os.path.join(REPO, "bench", "flyte2_overhead.json"),
                    help="bench/flyte2_overhead.py's saved measurement: the Flyte 2 driver's "
                         "local orchestration per phase task (flyte2_dispatch_s)")
    ap.add_argument("--repeats", type=int, default=3, help="fresh probe processes")
    for f in dataclasses.fields(Cluster):
        ap.add_argument("--" + f.name.replace("_", "-"), type=float,
                        default=getattr(c0, f.name), help=SOURCES.get(f.name, ""))
    ap.add_argument("--step-7b-s", type=float, default=120.0,
                    help="a 7B GRPO step's work on 8 GPUs (assumption: no verl-published step "
                         "time was found here; verl's GSM8K-scale GRPO, 1024 x 2048-token rows)")
    ap.add_argument("--default-step-s", type=float, default=0.75,
                    help="the default run's step of work: BENCHMARKS.md, 'Orchestration: plain "
                         "Python loop vs pyflyte run' (0.71-0.79 s medians of the plain loop, "
                         "busy 2-core machine; 0.355 s idle). The steps measured here ran on a "
                         "machine shared with other jobs and took longer")
    ap.add_argument("--params-7b", type=float, default=7e9)
    ap.add_argument("--rows-7b", type=int, default=1024)
    ap.add_argument("--tokens-7b", type=int, default=2048)
    ap.add_argument("--bytes-per-token-7b", type=float, default=24.0,
                    help="stored bytes per token of a 7B rollout batch (docs/cluster.md)")
    ap.add_argument("--steps-7b", type=int, default=500, help="steps of the 7B run")
    ap.add_argument("--local-read-gb-s", type=float, default=1.0,
                    help="this machine's read rate, to split the tiny rebuild into read and build")
    a = ap.parse_args()
    if a.measure or not os.path.exists(a.measured):
        m = measure(a.repeats)
        with open(a.measured, "w") as f:
            json.dump(m, f, indent=1)
    else:
        with open(a.measured) as f:
            m = json.load(f)
    c = Cluster(**{f.name: getattr(a, f.name) for f in dataclasses.fields(Cluster)})
    if os.path.exists(a.flyte2_measured):
        with open(a.flyte2_measured) as f:
            f2 = json.load(f)
        m = {**m, "flyte2_dispatch_s": f2["flyte2_dispatch_s"]}

    print(f"## Orchestration per RL step on a cluster (`python bench/cluster_cost.py`)\n")
    print(f"Measured here ({m['date']}, {m['machine']}; {m['config']}; medians of {m['repeats']} "
          f"fresh processes; saved in {os.path.relpath(a.measured, REPO)}):\n")
    print("| local cost | value |\n|---|---:|")
    for k, label in [("interpreter_s", "interpreter start + exit"),
                     ("imports_s", "`import workflows.ppo` (flytekit, tasks, verl_core)"),
                     ("store_open_s", "run store open"),
                     ("state_load_s",
                      "state load: `RunWorker` + `ensure_state` from the checkpoint"),
                     ("warm_check_s", "warm check: `ensure_state` on a worker holding the state"),
                     ("batch_io_s", "the step's 3 batches: `get_batch` + `put_batch` each"),
                     ("first_step_s", "the first step's work (rollout, reward, advantage, update)"),
                     ("step_s", "the second step's work (the default run's step below)"),
                     ("flyte2_dispatch_s", "Flyte 2 driver: orchestration per phase task "
                      "(bench/flyte2_overhead.py, local)")]:
        if k not in m:
            continue
        print(f"| {label} | {m[k]:.3f} s |")
    print(f"| stored batches (rollout / scored / advantaged) | "
          f"{' / '.join(f'{x / 1e3:.0f} kB' for x in m['batch_bytes'])} |")
    print(f"| checkpoint (weights + optimizer) | {m['checkpoint_bytes'] / 1e6:.1f} MB |\n")
    ws = workloads(m, a)
    for w in ws:
        print(table(w, c) + "\n")
    print("Assumptions and sources:\n")
    for f in dataclasses.fields(Cluster):
        print(f"- `--{f.name.replace('_', '-')} {getattr(c, f.name)}`: {SOURCES[f.name]}")
    print(f"- 7B: `--step-7b-s {a.step_7b_s:.0f}`: an assumed step of work on 8 GPUs (not a "
          f"published verl figure); the last column gives the step time each setup needs to meet "
          f"the 5% goal, so the conclusion can be read for any step time")
    print("- 7B state read by a rebuild: `verl_core.engine.cluster.bytes_read_per_phase` (fp32 "
          "weights, AdamW moments, bf16 reference: 98 GB at 7e9 parameters, docs/cluster.md); "
          f"7B rollout batch: {a.bytes_per_token_7b:.0f} B/token x {a.rows_7b} rows x "
          f"{a.tokens_7b} tokens (docs/cluster.md), the scored and advantaged batches larger by "
          "the ratios measured on the default run's")
    print("- batch I/O = the measured local put/get of the step's batches (encode, decode, hash) "
          "+ their bytes at `--store-gb-s` + one `--store-request-s` per transfer (6 a step)")
    print("- process start, store open, the state build beyond its read, the warm check: "
          "measured here on the tiny model, used for both workloads (lower bounds for 7B: the GPU "
          "image imports vLLM too, and a 7B build starts vLLM on 8 GPUs)")
    print("- per_task's rebuild assumes the newest checkpoint is the phase's step: the updates it "
          "would replay otherwise (up to checkpoint_interval - 1) are not counted")
    print(f"- the default run's step of work: `--default-step-s {a.default_step_s}` (the "
          "plain loop's measured medians, BENCHMARKS.md 'Orchestration: plain Python loop vs "
          "pyflyte run'), not the steps measured above, which shared the machine with other jobs "
          "(see its load average)")
    print("- share of step = orchestration / (work + orchestration); a setup meets the goal when "
          "it is <= 5%")
    big = ws[-1]
    costs = {s: cost(s, big, c) for s in SETUPS}
    ok = [s for s in SETUPS if costs[s].share(big.step_s) <= 0.05]
    best = min(SETUPS, key=lambda s: costs[s].total_s)
    built = min(BUILT, key=lambda s: costs[s].total_s)
    print(f"\nOn the 7B step, within 5%: {', '.join(ok) if ok else 'none'}. Cheapest: {best} "
          f"({100 * costs[best].share(big.step_s):.1f}%"
          f"{'' if best in BUILT else ', a design: not built in this project'}). Recommended "
          f"(the cheapest built here): {built} at {100 * costs[built].share(big.step_s):.1f}%: "
          f"{'it meets' if built in ok else 'it does not meet'} the goal.")

if __name__ == "__main__":
    main()
