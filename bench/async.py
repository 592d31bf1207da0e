"""Step time with ``rollout.max_staleness`` 0 (on-policy), 1 (one-step off-policy: the worker
samples step t + 1 in the background while update t runs) and 2 (the background rollouts of
steps t + 1 and t + 2 run one after another while update t and the phases after it run), in a
thread of the worker or in a sampler process of its own (``rollout.async_mode``), in one run
(issues 27 and 42).

Tasks, each on the tiny model warm-started once (the same assets for both stalenesses):

- ``arithmetic``: the default task (single-turn, no I/O);
- ``calculator 100 ms``: the calculator tool task (multi-turn), the tool answering after a
  100 ms wait (an I/O-bound tool: a search, a sandbox): verl's ``BaseTool`` contract, a class
  written to a temp folder that wraps the built-in calculator and sleeps first;
- ``long responses``: the default task on the tiny model before any warm start, whose
  responses run to ~70 of ``max_new_tokens`` 96 (EOS is one character of its alphabet):
  single-turn generation-bound rollouts, where staleness 2 runs with ``rollout.partial_rollout``
  off and on (thread mode: the sampler process samples whole rollouts).

Each (task, staleness) runs ``--steps`` steps through the run worker's phases as the workflow
calls them (``RunWorker.rollout``, the light reward and advantage phases, ``RunWorker.update``,
``RunWorker.checkpoint`` every 2 steps), on a fresh store, with ``num_threads`` intra-op threads
per phase (``--threads``; 1: the rollout thread and the update can each have one of this
machine's 2 cores, the colocated CPU analogue of a rollout GPU beside a training GPU). The step
time is the median wall time of steps 2.. (step 0 has no update before it to overlap, and step 1
of the process mode waits for its sampler process to start). Then the phase timeline of one step
of the I/O task, every way: the overlap is visible. The two background modes sample the same
tokens with the same log-probs (asserted).

    python bench/async.py                  # 7 steps each, 1 thread
    python bench/async.py --steps 8 --threads 2
    python bench/async.py --tasks "calculator 100 ms" --modes "staleness 2, process;staleness 2, process x2"
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import yaml

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from verl_core.agent.tools import CalculatorTool  # noqa: E402
from verl_core.config import preset  # noqa: E402
from verl_core.engine.assets import publish_assets  # noqa: E402
from verl_core.engine.worker import RunWorker, get_batch, put_batch  # noqa: E402
from verl_core.store import RunStore  # noqa: E402
from verl_core.training.advantage import compute_advantages  # noqa: E402
from verl_core.assets import prepare_assets  # noqa: E402
from verl_core.reward.scoring import score_batch  # noqa: E402

DELAY_S = 0.1
TOOL_FILE = '''
import asyncio

from verl_core.agent.tools import CalculatorTool


class SlowCalculator(CalculatorTool):
    """The built-in calculator, answering after ``config["delay_s"]`` (an I/O-bound tool)."""

    async def execute(self, instance_id, parameters, **kwargs):
        await asyncio.sleep(float(self.config["delay_s"]))
        return await super().execute(instance_id, parameters, **kwargs)
'''
SIZES = {"data.train_batch_size": 16, "rollout.n": 4, "actor.ppo_mini_batch_size": 8,
         "data.synthetic_train_size": 512}
"""The calculator task's batch (16 prompts x 4; its responses are ~100 tokens); the default task
runs at the preset's sizes (64 prompts x 8, 8 tokens)."""


def task_overrides(task: str, folder: str) -> dict:
    if task == "arithmetic":
        return {"model.warmup_sft_steps": 200, "model.warmup_target_accuracy": 1.0}
    if task == "long":
        return {"model.warmup_sft_steps": 0, "rollout.max_new_tokens": 96}
    tool = os.path.join(folder, "slow_calculator.py")
    with open(tool, "w") as f:
        f.write(TOOL_FILE)
    path = os.path.join(folder, "slow_calculator.yaml")
    with open(path, "w") as f:
        yaml.safe_dump({"tools": [{"class_name": f"{tool}:SlowCalculator",
                                   "config": {"delay_s": DELAY_S},
                                   "tool_schema": CalculatorTool.SCHEMA}]}, f)
    # every warm-start transcript calls the tool, so the rollouts do
    return {"data.synthetic_task": "calculator", "rollout.tool_config_path": path,
            "model.warmup_sft_steps": 400, "model.warmup_mixed_steps": 0}


MODES = {"staleness 0": {"rollout.max_staleness": 0},
         **{f"staleness {k}, {mode}": {"rollout.max_staleness": k, "rollout.async_mode": mode}
            for k in (1, 2) for mode in ("thread", "process")},
         # the background rollouts of steps t + 1 and t + 2 at once, a sampler process each
         "staleness 2, process x2": {"rollout.max_staleness": 2, "rollout.async_mode": "process",
                                     "rollout.async_samplers": 2}}
LONG_MODES = {"staleness 0": {"rollout.max_staleness": 0},
              "staleness 2, thread": {"rollout.max_staleness": 2},
              "staleness 2, thread, partial": {"rollout.max_staleness": 2,
                                               "rollout.partial_rollout": True}}


def run_one(cfg, assets, steps: int, uri: str) -> tuple[list[float], dict, list[str]]:
    """``steps`` steps of ``cfg`` on a fresh store: each step's wall time, the phase timeline
    of step 3 (seconds from the start of update 2), and the rollout batches."""
    index = publish_assets(RunStore(uri), assets)
    w = RunWorker(uri, json.dumps(cfg.to_dict()), index)
    walls, spans, background, background4, refs = [], {}, None, None, []
    try:
        for s in range(steps):
            t0 = time.perf_counter()
            a = time.perf_counter()
            ref, _ = w.rollout(s)
            refs.append(get_batch(w.store, ref))
            spans[("rollout", s)] = (a, time.perf_counter())
            a = time.perf_counter()
            batch = get_batch(w.store, ref)
            batch, _ = score_batch(batch, w.trainer.scorer, w.trainer.tokenizer)
            batch, _ = compute_advantages(batch, cfg.algorithm)
            adv = put_batch(w.store, batch)
            spans[("reward + advantage", s)] = (a, time.perf_counter())
            a = time.perf_counter()
            w.update(s, adv)
            spans[("update", s)] = (a, time.perf_counter())
            # the rollout of step 3, sampling in the background (from update 2 on, or from
            # update 1 on with staleness 2)
            background = w.trainer.behaviour._prefetch.get(3, background)
            background4 = w.trainer.behaviour._prefetch.get(4, background4)
            a = time.perf_counter()
            w.checkpoint(s + 1)
            spans[("checkpoint", s + 1)] = (a, time.perf_counter())
            walls.append(time.perf_counter() - t0)
    finally:
        w.close()
    origin = spans[("update", 2)][0]
    timeline = {"update 2": spans[("update", 2)], "checkpoint 3": spans[("checkpoint", 3)]}
    if background is not None:
        timeline["rollout 3 sampling (background)"] = background.box["span"]
    if background4 is not None and "span" in background4.box:  # at once with two samplers
        timeline["rollout 4 sampling (background)"] = background4.box["span"]
    timeline["rollout 3 phase"] = spans[("rollout", 3)]
    timeline["reward + advantage 3"] = spans[("reward + advantage", 3)]
    timeline["update 3"] = spans[("update", 3)]
    return walls, {k: (max(0.0, a - origin), b - origin) for k, (a, b) in timeline.items()}, refs


def bars(timeline: dict, width: int = 60) -> list[str]:
    end = max(b for _, b in timeline.values())
    out = []
    for name, (a, b) in timeline.items():
        i, j = round(a / end * width), max(round(b / end * width), round(a / end * width) + 1)
        if b <= 0:  # a background rollout that ended before the origin
            out.append(f"  {name:<34} |{' ' * width}| ended {-b * 1000:.0f} ms before")
            continue
        out.append(f"  {name:<34} |{' ' * i}{'#' * (j - i)}{' ' * (width - j)}| "
                   f"{a * 1000:6.0f} - {b * 1000:6.0f} ms")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tasks", default="arithmetic,calculator 100 ms,long responses")
    ap.add_argument("--modes", default="", help="only these modes, ';'-separated (e.g. "
                    "'staleness 0;staleness 2, process x2'); staleness 0 always runs")
    args = ap.parse_args()
    rows, timelines = [], {}
    with tempfile.TemporaryDirectory(prefix="verl-bench-async-") as root:
        for task in args.tasks.split(","):
            name = task.split()[0]
            over = {**(SIZES if name != "arithmetic" else {}),
                    **task_overrides(name, root), "data.synthetic_val_size": 16,
                    "val_before_train": False, "total_steps": args.steps,
                    "num_threads": args.threads, "checkpoint.checkpoint_interval": 2,
                    "algorithm.rollout_is": "token"}
            t0 = time.perf_counter()
            assets = prepare_assets(preset("grpo", **over), os.path.join(root, name),
                                    log=lambda *_: None)
            print(f"[{task}] warm start {time.perf_counter() - t0:.0f} s", file=sys.stderr)
            step_s, batches = {}, {}
            modes = LONG_MODES if name == "long" else MODES
            if args.modes:
                keep = {"staleness 0", *args.modes.split(";")}
                modes = {m: v for m, v in modes.items() if m in keep}
            for k, (mode, extra) in enumerate(modes.items()):
                cfg = preset("grpo", **{**over, **extra})
                walls, timelines[(task, mode)], batches[mode] = run_one(
                    cfg, assets, args.steps, os.path.join(root, f"{name}-store-{k}"))
                step_s[mode] = statistics.median(walls[2:])
                tokens = statistics.mean(float(b.response_mask.sum()) / b.num_rows
                                         for b in batches[mode])
                print(f"[{task}] {mode}: steps {[round(x, 2) for x in walls]}, "
                      f"{tokens:.1f} sampled tokens a response", file=sys.stderr)
            # the background rollouts sampled the same tokens with the same log-probs (a
            # multi-turn batch also stores each tool call's measured latency: not compared)
            for k, other in [(1, "process"), (2, "process"), (2, "process x2")] \
                    if name != "long" else ():
                if f"staleness {k}, thread" not in batches or \
                        f"staleness {k}, {other}" not in batches:
                    continue
                thread, proc = batches[f"staleness {k}, thread"], batches[f"staleness {k}, {other}"]
                assert all(torch.equal(a.response_ids, b.response_ids)
                           and torch.equal(a.response_logprobs, b.response_logprobs)
                           for a, b in zip(thread, proc)), "the modes sampled different batches"
            rows.append((task, step_s))
    print(f"\n{args.threads} intra-op thread(s) per phase; median step time of steps "
          f"2..{args.steps - 1}\n")
    print("| task | staleness | async_mode | step s | / staleness 0 |")
    print("|---|---:|---|---:|---:|")
    for task, t in rows:
        base = t["staleness 0"]
        for m in t:
            k, _, mode = m.removeprefix("staleness ").partition(", ")
            print(f"| {task} | {k} | {mode or '-'} | {t[m]:.2f} | {t[m] / base:.2f} |")
    for (task, mode), timeline in timelines.items():
        if not task.startswith("calculator"):
            continue
        print(f"\nphase timeline, {task}, {mode} (from the start of update 2):")
        print("\n".join(bars(timeline)))


if __name__ == "__main__":
    main()
