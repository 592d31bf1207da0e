"""Data validation cost: Great Expectations per stage vs the step time of the same configuration.

One process: GX's first use (import + ephemeral context, once per process) is timed first; then
the default configuration's model and data are prepared and real steps are run with validation
off (their median wall time is the step time). After each step, each stage's suite runs on that
step's real batches (the first time: the suite is built), for every row and for row samples, and
with the report written to a local run store, and for every row with GX deciding every check (the
pandas pre-pass for passing batches turned off: the cost before it); medians over the steps after
the first. The large
configuration (B=768 x G=8, the orchestration bench's) gets the same with its own step time. The
verdict applies the issue's rule: validate a sample when the full batch costs > 2% of a step.

    python bench/validation.py                     # default + large
    python bench/validation.py --configs default --steps 6 --keep /tmp/vb  # reuse the warm start
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

T_START = time.perf_counter()
from verl_core import validation  # noqa: E402  (GX itself is not imported yet)

T_GX = time.perf_counter()
validation._gx()  # the first use: import great_expectations + ephemeral context + data source
FIRST_GX_S = time.perf_counter() - T_GX

from verl_core.store import RunStore  # noqa: E402
from verl_core.config import grpo_preset, with_overrides  # noqa: E402
from verl_core.models import load_tokenizer  # noqa: E402
from verl_core.trainer import RLTrainer  # noqa: E402
from verl_core.assets import Assets, prepare_assets  # noqa: E402

CONFIGS = {
    "default": {},  # B=32 prompts x G=8 = 256 rows
    "large": {"data.train_batch_size": 768, "actor.ppo_mini_batch_size": 384,
              "actor.ppo_micro_batch_size": 768},  # 6144 rows, as bench/orchestration.py
}
STAGES = validation.STAGES


def _median_s(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _gx_only(batch, stage: str, cfg):
    """``validate_batch`` with every check decided by GX: the pandas pre-pass for passing
    batches (``validation._passing``) turned off, as before it existed."""
    passing = validation._passing
    validation._passing = lambda *_: None
    try:
        return validation.validate_batch(batch, stage, cfg)
    finally:
        validation._passing = passing


def bench(name: str, assets, steps: int, repeat: int, work: str) -> dict:
    """Real steps with validation off, each followed by the validations of its three batches
    (interleaved, so a busy machine slows both alike); medians over the steps after the first."""
    base = {"model.path": assets.model_path, "data.train_files": assets.train_files[0],
            "data.val_files": assets.val_files[0], "total_steps": steps}
    off = with_overrides(grpo_preset(), {**CONFIGS[name], **base, "validation.mode": "off"})
    # every_steps=1: every step's batches are validated (the default, 25, skips steps 1-24)
    on = with_overrides(off, {"validation.mode": "fail", "validation.sample_rows": 0,
                              "validation.every_steps": 1})
    store = RunStore(os.path.join(work, f"store-{name}"))
    h = on.trajectory_hash()
    rows = off.data.train_batch_size * off.rollout.n
    samples = [k for k in ((0, 256, 64, 16) if name == "default" else (0, 1024, 256, 64))
               if k < rows]
    cfgs = {k: with_overrides(on, {"validation.sample_rows": k}) for k in samples}
    step_times, first, n_expect = [], {}, {}
    cost = {(stage, k): [] for stage in STAGES for k in [*samples, "store", "gx"]}
    trainer = RLTrainer(off, assets)
    try:
        for step in range(steps):
            t0 = time.perf_counter()
            batches = {}
            batches["rollout"], _ = trainer.rollout(step)
            batches["reward"], _ = trainer.reward(batches["rollout"])
            batches["advantage"], _ = trainer.advantage(batches["reward"])
            trainer.update(batches["advantage"], step)
            step_times.append(time.perf_counter() - t0)
            for stage in STAGES:
                b = batches[stage]
                if step == 0:  # the first call builds the suite
                    t = time.perf_counter()
                    n_expect[stage] = len(validation.validate_batch(b, stage, on).results)
                    first[stage] = time.perf_counter() - t
                for k in samples:
                    cost[stage, k].append(_median_s(
                        lambda: validation.validate_batch(b, stage, cfgs[k]), repeat))
                cost[stage, "gx"].append(_median_s(lambda: _gx_only(b, stage, on), repeat))
                cost[stage, "store"].append(_median_s(
                    lambda: validation.validate_and_record(store, h, step, stage, b, on), repeat))
    finally:
        trainer.close()
    steady = slice(1, None) if steps > 2 else slice(None)
    med = {key: statistics.median(v[steady]) for key, v in cost.items()}
    return {"name": name, "rows": rows, "step_s": statistics.median(step_times[steady]),
            "stages": {s: {"expectations": n_expect[s], "first_s": first[s],
                           "by_sample": {k: med[s, k] for k in samples},
                           "recorded_s": med[s, "store"], "gx_s": med[s, "gx"]}
                       for s in STAGES}}


def report(r: dict) -> None:
    step = r["step_s"]
    print(f"\n### {r['name']}: {r['rows']} rows per batch, step {step * 1000:.0f} ms "
          f"(median, validation off)\n")
    samples = list(r["stages"]["rollout"]["by_sample"])  # 0 (all rows) first, then smaller
    head = " | ".join("all rows" if k == 0 else f"{k} rows" for k in samples)
    print(f"| stage | expectations | first call ms | {head} | all rows + store doc | "
          "all rows, GX only | x GX only |")
    print("|---|---:|---:|" + "---:|" * len(samples) + "---:|---:|---:|")
    totals = {k: 0.0 for k in samples}
    total_rec = 0.0
    for stage, s in r["stages"].items():
        cells = " | ".join(f"{s['by_sample'][k] * 1000:.1f}" for k in samples)
        print(f"| {stage} | {s['expectations']} | {s['first_s'] * 1000:.1f} | {cells} | "
              f"{s['recorded_s'] * 1000:.1f} | {s['gx_s'] * 1000:.1f} | "
              f"{s['by_sample'][0] / s['gx_s']:.3f} |")
        for k in samples:
            totals[k] += s["by_sample"][k]
        total_rec += s["recorded_s"]
    cells = " | ".join(f"**{totals[k] * 1000:.1f}**" for k in samples)
    print(f"| per step (3 stages) | | | {cells} | **{total_rec * 1000:.1f}** |")
    ratios = " | ".join(f"**{totals[k] / step:.1%}**" for k in samples)
    print(f"| share of a step | | | {ratios} | **{total_rec / step:.1%}** |")
    full = totals[0] / step
    verdict = "within" if full <= 0.02 else "over"
    best = min(samples, key=lambda k: totals[k])
    print(f"\nFull batch: {full:.1%} of a step ({verdict} 2%); cheapest sample "
          f"({'all rows' if best == 0 else f'{best} rows'}): {totals[best] / step:.1%}.")
    # GX's cost is per expectation, not per row: what bounds its share is how often it runs
    from verl_core.config import ValidationConfig

    k = ValidationConfig().every_steps
    need = max(1, math.ceil(total_rec / (0.02 * step)))
    print(f"Amortised over validation.every_steps={k} (the default): "
          f"{total_rec / step / k:.2%} of a step; every_steps >= {need} keeps it within 2%.")


def prepared(work: str, keep: str):
    """The default configuration's warm-started model and data; with ``--keep DIR`` prepared once
    there and reused by later invocations (the warm start is most of this bench's time)."""
    cfg = grpo_preset(**{"validation.mode": "off"})
    folder = os.path.join(keep or work, "assets")
    index = os.path.join(folder, "assets.json")
    if keep and os.path.exists(index):
        with open(index) as f:
            return Assets(**json.load(f))
    assets = prepare_assets(cfg, folder, log=lambda *_: None)
    with open(index, "w") as f:
        json.dump(dataclasses.asdict(assets), f)
    return assets


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default="default,large")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=3, help="validations per batch (median)")
    ap.add_argument("--keep", default="", help="folder to keep the prepared model/data in")
    args = ap.parse_args()
    print(f"first use of GX in a process (import + ephemeral context): {FIRST_GX_S:.2f} s")
    with tempfile.TemporaryDirectory(prefix="verl-bench-validation-") as work:
        assets = prepared(work, args.keep)
        on = grpo_preset(**{"validation.mode": "fail"})
        files = [*assets.train_files, *assets.val_files]
        tok = load_tokenizer(assets.model_path)
        t = time.perf_counter()
        validation.validate_dataset_files(files, on, tok)
        first = time.perf_counter() - t
        again = _median_s(lambda: validation.validate_dataset_files(files, on, tok), 3)
        print(f"dataset suite at prepare ({on.data.synthetic_train_size} + "
              f"{on.data.synthetic_val_size} rows, 2 files): first {first * 1000:.0f} ms, "
              f"then {again * 1000:.0f} ms")
        for name in args.configs.split(","):
            report(bench(name, assets, args.steps, args.repeat, work))


if __name__ == "__main__":
    main()
