"""GPU check: one short script for a machine with CUDA (about 5 minutes on one H200).

1. the ``gpu`` tests of ``tests/verl_core/training/test_device.py``: the tiny model's rollout,
   log-probs and update gradients on the GPU against the CPU's, bitwise-repeatable updates with
   ``trainer.deterministic`` (float32 and bf16 compute), and a plain-loop run SIGKILLed inside an
   update and started again ending with an uninterrupted run's exported weights;
2. RL step times (the sum of a step's phases: rollout, reward, advantage, update; not the
   evaluations or checkpoints) of the plain loop on the GPU against this machine's CPUs (all its cores), in
   the same run: the tiny default, and a model of SmolLM2-135M-Instruct's shape and tokenizer
   (random weights: the config and tokenizer travel with the command, the 538 MB of weights do
   not) in bf16 with fp32 masters on the generated word problems, 8 prompts x 4 responses of
   128 tokens (a random model writes no EOS: every response is 128 tokens, the same work on
   both devices).

    python bench/gpu_check.py --shape-dir DIR     # DIR: SmolLM2's config.json + tokenizer files
    python bench/gpu_check.py --skip-tests        # the timings only

It needs the project's runtime dependencies for the plain loop (torch, transformers, safetensors,
pandas, pyarrow, fsspec, blake3, pebble; not Ray, Flyte or Great Expectations: the runs set
``validation.mode='off'``). vLLM is not part of it: a GPU image with vLLM (the Dockerfile's
``gpu`` target) runs ``pytest -m vllm`` for that. Prints a table and writes ``gpu_check.json``
to ``--out`` (default: ``$OUT`` or the current folder). Exit status: 1 when a test or a run
failed.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
NO_GX = ["--set", "validation.mode='off'"]  # Great Expectations is not needed for a timing
SHAPE_RUN = ["--set", "data.synthetic_task=word_problems", "--set", "data.train_batch_size=8",
             "--set", "rollout.n=4", "--set", "actor.ppo_mini_batch_size=8",
             "--set", "rollout.max_new_tokens=128", "--set", "data.max_prompt_length=160",
             "--set", "model.dtype=bfloat16", "--set", "model.gradient_checkpointing=false",
             "--set", "data.val_max_samples=16"]
"""The real model's recipe step (docs/models.md) at 8 prompts x 4, bf16 compute."""


def step(title: str) -> None:
    print(f"\n=== {title} ===", flush=True)


def run_tests(timeout_s: int) -> int:
    # --noconftest: the suite's conftest loads the S3 fixtures (moto), which a bare GPU image
    # lacks; these tests need none of them
    cmd = [sys.executable, "-m", "pytest", "--noconftest", "-p", "no:cacheprovider", "-q", "-rs",
           "-m", "gpu", "tests/verl_core/training/test_device.py"]
    print(" ".join(cmd), flush=True)
    try:
        return subprocess.run(cmd, cwd=REPO, timeout=timeout_s).returncode
    except subprocess.TimeoutExpired:
        print(f"pytest ran past {timeout_s}s", flush=True)
        return 124


def shaped_model(shape_dir: pathlib.Path, out: pathlib.Path) -> pathlib.Path:
    """A randomly initialised float32 model of ``shape_dir``'s config, with its tokenizer."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(shape_dir)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    for f in shape_dir.iterdir():
        if f.name != "config.json" and f.is_file() and not f.name.endswith(".safetensors"):
            shutil.copy(f, out / f.name)
    n = sum(p.numel() for p in model.parameters())
    print(f"model of {shape_dir.name}'s shape: {n / 1e6:.1f}M parameters (random weights)")
    return out


def timed_run(name: str, args: list[str], workdir: pathlib.Path, timeout_s: int) -> dict:
    """One plain-loop run; its steps' wall seconds (``timing/step_s``) from the metrics file."""
    cmd = [sys.executable, "-m", "verl_core.train", *args, *NO_GX, "--workdir", str(workdir)]
    print(f"[{name}] {' '.join(cmd[1:])}", flush=True)
    t0 = time.perf_counter()
    try:
        r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        print(f"[{name}] ran past {timeout_s}s", flush=True)
        return {"name": name, "ok": False, "why": f"timeout {timeout_s}s"}
    wall = time.perf_counter() - t0
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith(("[verl] device", "step ", "done"))]
    print("\n".join(f"[{name}] {ln}" for ln in lines[-6:]), flush=True)
    if r.returncode != 0:
        print(f"[{name}] exit {r.returncode}\n{r.stderr[-4000:]}", flush=True)
        return {"name": name, "ok": False, "why": f"exit {r.returncode}", "wall_s": wall}
    import pandas as pd

    m = pd.read_parquet(next(workdir.glob("metrics/*.parquet")))
    phases = [c for c in m.columns if c.startswith("timing/") and c.endswith("_s")]
    # an RL step's phases (rollout, reward, advantage, update): not the evaluations or saves
    steps = [float(x) for x in m[phases].dropna(how="all").fillna(0.0).sum(axis=1)]
    later = steps[1:] or steps  # the first step carries one-off costs (allocator, kernels)
    out = {"name": name, "ok": True, "wall_s": wall, "step_s": steps,
           "median_step_s": statistics.median(later),
           "phases_s": {c: statistics.median([float(x) for x in m[c].dropna()][1:]
                                             or [float(x) for x in m[c].dropna()])
                        for c in phases if m[c].notna().any()}}
    print(f"[{name}] phases, median s: " + ", ".join(
        f"{k.removeprefix('timing/')}={v:.3f}" for k, v in out["phases_s"].items()), flush=True)
    for k in ("perf/max_memory_allocated_gb", "response_length/mean"):
        if k in m:
            out[k] = float(m[k].dropna().max())
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--skip-tests", action="store_true")
    p.add_argument("--skip-timing", action="store_true")
    p.add_argument("--tests-timeout", type=int, default=240)
    p.add_argument("--shape-dir", default="",
                   help="a folder with SmolLM2-135M-Instruct's config.json and tokenizer files "
                        "(python -m verl_core.models fetch smollm2-135m-instruct DIR, then drop "
                        "model.safetensors); without it, the tiny model only")
    p.add_argument("--tiny-steps", type=int, default=6)
    p.add_argument("--skip-tiny", action="store_true", help="time the shaped model only")
    p.add_argument("--shape-steps", type=int, default=4)
    p.add_argument("--cpu-shape-steps", type=int, default=2)
    p.add_argument("--run-timeout", type=int, default=150)
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args()
    os.chdir(REPO)
    sys.path.insert(0, str(REPO))
    import torch

    step("machine")
    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, "
          f"GPU: {torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'none'}, "
          f"{os.cpu_count()} CPUs", flush=True)
    failed = False
    report: dict = {"torch": torch.__version__, "cpus": os.cpu_count(),
                    "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}
    if not args.skip_tests:
        step("pytest -m gpu tests/verl_core/training/test_device.py")
        rc = run_tests(args.tests_timeout)
        report["tests_rc"] = rc
        failed |= rc != 0
    if not args.skip_timing:
        step("RL step times: GPU against this machine's CPUs")
        tmp = pathlib.Path(tempfile.mkdtemp(prefix="gpu-check-"))
        runs = [] if args.skip_tiny else [
            ("tiny, cuda", ["--steps", str(args.tiny_steps), "--set", "trainer.device=cuda"]),
            ("tiny, cpu", ["--steps", str(args.tiny_steps), "--set", "trainer.device=cpu"])]
        if args.shape_dir:
            folder = shaped_model(pathlib.Path(args.shape_dir), tmp / "shaped")
            model = ["--model", str(folder), *SHAPE_RUN]
            runs += [("SmolLM2-135M shape bf16, cuda",
                      [*model, "--steps", str(args.shape_steps), "--set", "trainer.device=cuda"]),
                     ("SmolLM2-135M shape bf16, cuda, trainer.deterministic=False",
                      [*model, "--steps", str(args.shape_steps), "--set", "trainer.device=cuda",
                       "--set", "trainer.deterministic=False"]),
                     ("SmolLM2-135M shape bf16, cpu",
                      [*model, "--steps", str(args.cpu_shape_steps),
                       "--set", "trainer.device=cpu"])]
        results = []
        for i, (name, a) in enumerate(runs):
            results.append(timed_run(name, a, tmp / f"run{i}", args.run_timeout))
        report["runs"] = results
        failed |= not all(r["ok"] for r in results)
        print("\n| run | s/step (phases, median of steps 2+) | x the CPU's | peak GPU GiB |")
        print("|---|---|---|---|")
        by = {r["name"]: r for r in results}
        for r in results:
            if not r["ok"]:
                print(f"| {r['name']} | failed: {r['why']} | | |")
                continue
            cpu = by.get(r["name"].split(", cuda")[0] + ", cpu", {})
            ratio = (f"{r['median_step_s'] / cpu['median_step_s']:.3f}"
                     if cpu.get("ok") and "cuda" in r["name"] else "")
            mem = r.get("perf/max_memory_allocated_gb")
            print(f"| {r['name']} | {r['median_step_s']:.3f} | {ratio} | "
                  f"{'' if mem is None else f'{mem:.2f}'} |")
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.json").write_text(json.dumps(report, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
