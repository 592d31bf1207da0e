"""The real-model recipe of docs/models.md, measured: SmolLM2-135M-Instruct on the generated word
problems (``data.synthetic_task=word_problems``), from its base accuracy to after the format warm
start and after GRPO, on the same seeded held-out subset, with standard errors and where the wall
time went (warm start, RL steps, evaluation).

1. the model: ``--model DIR``, or fetched (``python -m verl_core.models fetch``) into the per-user
   asset cache;
2. the base model's held-out accuracy by the project's own evaluator (``RLTrainer.evaluate``, the
   run's held-out rows, greedy, the same token budget);
3. the recipe as a user runs it: ``python -m verl_core.train`` with :data:`RECIPE` (the command
   docs/models.md shows), in a fresh run store and asset cache (the warm start is really run),
   ``--summary-json`` read back;
4. a table: accuracy base -> warm-started -> trained, each +- its standard error
   (sqrt(p(1-p)/n)), each gain in units of its standard error (sqrt(se1^2 + se2^2): the two
   evaluations counted as independent, which overstates the error of a difference measured on the
   same prompts), and wall seconds (warm start, RL steps, evaluations and their share of the RL
   steps' time), plus the per-step curve.

    python bench/recipe.py                       # fetch, 16 RL steps (~20 min on 2 idle cores)
    python bench/recipe.py --model DIR --steps 4 --set optim.lr=2e-5   # a variant
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

RECIPE = {
    "data.synthetic_task": "word_problems",
    "model.format_warmup_steps": 24,
    "data.train_batch_size": 8, "rollout.n": 4, "actor.ppo_mini_batch_size": 8,
    "rollout.max_new_tokens": 128, "data.max_prompt_length": 160,
    "data.val_max_samples": 128, "optim.lr": 1e-5, "model.gradient_checkpointing": False,
}
"""The recipe's settings beside ``--model`` and ``--steps`` (docs/models.md, "The recipe")."""
STEPS = 16


def _se(p: float, n: int) -> float:
    return math.sqrt(max(p * (1 - p), 0.0) / n)


def base_accuracy(model: str, workdir: str) -> tuple[float, int, float]:
    """The base model's held-out accuracy by the run's own evaluator: (accuracy, rows, seconds)."""
    from verl_core.config import grpo_preset
    from verl_core.trainer import RLTrainer
    from verl_core.assets import prepare_assets

    sets = {k: v for k, v in RECIPE.items() if not k.startswith("model.format_warmup")}
    cfg = grpo_preset(**{"model.path": model, **sets})
    assets = prepare_assets(cfg, workdir, log=lambda *_: None)
    trainer = RLTrainer(cfg, assets)
    try:
        t0 = time.perf_counter()
        acc = trainer.evaluate()["val/accuracy"]
        return acc, int(trainer.prompts.val_ids.shape[0]), time.perf_counter() - t0
    finally:
        trainer.close()


def run_recipe(model: str, steps: int, root: str) -> tuple[dict, float, list[str]]:
    """The recipe through the plain loop: (summary, warm-start seconds, output lines)."""
    cmd = [sys.executable, "-m", "verl_core.train", "--model", model, "--steps", str(steps),
           "--store", os.path.join(root, "runs"), "--run-name", "recipe",
           "--summary-json", os.path.join(root, "summary.json")]
    for k, v in RECIPE.items():
        cmd += ["--set", f"{k}={v}"]
    env = {**os.environ, "PYTHONPATH": REPO, "VERL_ASSET_CACHE": os.path.join(root, "cache")}
    proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    lines, warm = [], float("nan")
    for line in proc.stdout:
        lines.append(line.rstrip("\n"))
        m = re.match(r"warm start: \d+ format steps in ([\d.]+)s", line)
        if m:
            warm = float(m.group(1))
        if re.match(r"(warm start: step|step \d+)", line):
            print("  " + line.rstrip("\n"), flush=True)
    if proc.wait():
        sys.exit("the recipe failed:\n" + "\n".join(lines[-40:]))
    with open(os.path.join(root, "summary.json")) as f:
        return json.load(f), warm, lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="", help="a SmolLM2-135M-Instruct folder (default: fetch)")
    p.add_argument("--steps", type=int, default=STEPS)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="change one of the recipe's settings (a variant), e.g. optim.lr=2e-5")
    args = p.parse_args()
    from verl_core.train import _parse_value

    for item in args.set:
        key, _, value = item.partition("=")
        RECIPE[key] = _parse_value(value)
    model = args.model
    if not model:
        from verl_core.local_cache import cache_root
        from verl_core.models.fetch import fetch

        model = fetch("smollm2-135m-instruct",
                      os.path.join(cache_root(), "models", "smollm2-135m-instruct"))
    with tempfile.TemporaryDirectory(prefix="verl-recipe-") as root:
        t0 = time.perf_counter()
        base, n, base_s = base_accuracy(model, os.path.join(root, "base"))
        print(f"base model: held-out accuracy {base:.3f} on {n} rows ({base_s:.0f}s)", flush=True)
        summary, warm_s, _ = run_recipe(model, args.steps, root)
        total_s = time.perf_counter() - t0
    evals = {int(k): v for k, v in summary["evaluations"].items()}
    hist = summary["history"]
    rl_s = sum(h["timing/step_s"] for h in hist)
    eval_s = sum(v["timing/eval_s"] for v in evals.values())
    start, end = evals[min(evals)]["val/accuracy"], evals[max(evals)]["val/accuracy"]

    def gain(a, b):
        return (b - a) / math.sqrt(_se(a, n) ** 2 + _se(b, n) ** 2 or 1e-12)

    print(f"\n| | held-out accuracy ({n} rows) | gain over base |")
    print("|---|---|---|")
    print(f"| base SmolLM2-135M-Instruct | {base:.3f} ± {_se(base, n):.3f} | |")
    print(f"| after the format warm start ({RECIPE['model.format_warmup_steps']} steps) | "
          f"{start:.3f} ± {_se(start, n):.3f} | +{start - base:.3f} ({gain(base, start):.1f} SE) |")
    print(f"| after GRPO ({len(hist)} steps) | {end:.3f} ± {_se(end, n):.3f} | "
          f"+{end - base:.3f} ({gain(base, end):.1f} SE); over the warm start "
          f"{end - start:+.3f} ({gain(start, end):.1f} SE) |")
    print(f"\nwall: warm start {warm_s:.0f}s, RL steps {rl_s:.0f}s ({rl_s / len(hist):.1f}s/step), "
          f"evaluations {eval_s:.0f}s ({len(evals)}: {eval_s / rl_s:.0%} of the RL steps' time), "
          f"the run {summary['wall_s']:.0f}s; with the base evaluation {total_s:.0f}s")
    print("\n| step | reward | flat groups | response length | grad norm | s/step |")
    print("|---|---|---|---|---|---|")
    for h in hist:
        print(f"| {h['step']} | {h['reward/mean']:.3f} | "
              f"{h.get('rollout/zero_variance_frac', float('nan')):.2f} | "
              f"{h['response_length/mean']:.1f} | {h['actor/grad_norm']:.3f} | "
              f"{h['timing/step_s']:.1f} |")


if __name__ == "__main__":
    main()
