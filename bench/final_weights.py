"""The sha256 of the final weights of four short runs through pyflyte (the default GRPO run, the
off-policy run, a LoRA run, a W = 2 run), each on the tests' TINY sizes for 3 steps: what a
refactor that claims "behaviour unchanged" must leave identical. Run from the repository root:

    .venv/bin/python bench/final_weights.py [--out FILE.json]

Prints a table (run, sha256 of model.safetensors, seconds)."""
import argparse
import hashlib
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

REPO = pathlib.Path.cwd()
sys.path.insert(0, str(REPO))
from tests.presets import TINY  # noqa: E402

LEARN = {"model.warmup_sft_steps": 40}
"""A warm start long enough that some groups' rewards differ (TINY's 5 steps leave every reward
0 and the weights unmoved)."""

RUNS = {
    "default": {},
    "off-policy": {"rollout.max_staleness": 1, "algorithm.rollout_is": "token"},
    "lora": {"model.lora_rank": 8, "model.lora_alpha": 16},
    "w2": {"trainer.n_gpus_per_node": 2},
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="")
    ap.add_argument("--only", default="")
    args = ap.parse_args()
    pyflyte = str(pathlib.Path(sys.executable).parent / "pyflyte")
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, extra in RUNS.items():
            if args.only and name not in args.only.split(","):
                continue
            env = {**os.environ, "HOME": f"{tmp}/{name}/home", "RAY_AUTH_MODE": "disabled",
                   "PYTHONPATH": str(REPO), "VERL_ASSET_CACHE": f"{tmp}/assets"}
            env.pop("RAY_ADDRESS", None)
            os.makedirs(env["HOME"])
            cmd = [pyflyte, "run", "workflows/ppo.py", "ppo", "--store", f"{tmp}/{name}/store",
                   "--run-name", "t", "--steps", "3", "--batch-size", "8", "--rollout-n", "4",
                   "--overrides", json.dumps({**TINY, **LEARN, **extra})]
            t0 = time.time()
            out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
            if out.returncode:
                sys.exit(f"{name} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
            line = [ln for ln in out.stdout.splitlines() if ln.startswith("Summary(")][-1]
            final = line.split("final_model='", 1)[1].split("'", 1)[0]
            table = line.split("metrics_table='", 1)[1].split("'", 1)[0]
            import pandas as pd
            moved = (pd.read_parquet(table)["rollout/zero_variance_frac"] < 1.0).sum()
            if not moved:
                sys.exit(f"{name}: no step had a learning signal; equal weights prove nothing")
            data = pathlib.Path(final, "model.safetensors").read_bytes()
            rows[name] = hashlib.sha256(data).hexdigest()
            print(f"| {name} | {rows[name]} | {time.time() - t0:.0f} s |", flush=True)
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
