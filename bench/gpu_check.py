"""GPU check, one short script for a machine with CUDA (about 8 minutes at most):

1. installs the ``vllm`` extra (``.ci/constraints-gpu.txt``) into this Python if vllm is
   missing (bounded by ``--install-timeout``; a failed install is reported and the vLLM tests
   then skip, saying so);
2. runs the tests that need a GPU: ``pytest -m "vllm or gpu" -q``;
3. times the ``hf`` and ``vllm`` engines generating the same batch on the same weights.

    python bench/gpu_check.py                       # all three
    python bench/gpu_check.py --skip-install --skip-tests

Exit status: pytest's (or 1 when the timing fails), so a wrapper can tell a pass.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parents[1]


def step(title: str) -> None:
    print(f"\n=== {title} ===", flush=True)


def install(timeout_s: int) -> None:
    if importlib.util.find_spec("vllm") is not None:
        print("vllm already installed")
        return
    cmd = [sys.executable, "-m", "pip", "install", "-q", "-c",
           str(REPO / ".ci/constraints-gpu.txt"), "-e", f"{REPO}[vllm,dev]"]
    print(" ".join(cmd), flush=True)
    try:
        rc = subprocess.run(cmd, timeout=timeout_s).returncode
    except subprocess.TimeoutExpired:
        rc = "timeout"
    if rc != 0:
        print(f"vllm install failed ({rc}): the vllm tests will skip; install it by hand "
              "(pip install -e '.[vllm]') and rerun", flush=True)


def run_tests(timeout_s: int) -> int:
    cmd = [sys.executable, "-m", "pytest", "-m", "vllm or gpu", "-q", "-p", "no:cacheprovider",
           "-rs", "tests"]
    print(" ".join(cmd), flush=True)
    try:
        return subprocess.run(cmd, cwd=REPO, timeout=timeout_s).returncode
    except subprocess.TimeoutExpired:
        print(f"pytest ran past {timeout_s}s", flush=True)
        return 124


def timing(batch: int, new_tokens: int, repeats: int) -> None:
    import torch

    from verl_core.models import build_tiny_model
    from verl_core.rollout import SamplingParams, make_engine

    model, tok = build_tiny_model(hidden_size=256, heads=4, layers=4, max_positions=256, seed=0)
    folder = tempfile.mkdtemp(prefix="gpu-check-model-")
    model.save_pretrained(folder, safe_serialization=True)
    tok.save_pretrained(folder)
    model = model.cuda()
    g = torch.Generator().manual_seed(0)
    a = torch.randint(0, 51, (batch, 2), generator=g).tolist()
    enc = tok([f"{x}+{y}=" for x, y in a], return_tensors="pt", padding=True)
    kw = dict(model=model, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    t0 = time.perf_counter()
    engines = {"hf": make_engine("hf", micro_batch_size=batch, **kw)}
    try:
        engines["vllm"] = make_engine("vllm", model_path=folder, dtype="float32",
                                      gpu_memory_utilization=0.3, enforce_eager=True,
                                      free_cache_engine=False, **kw)
        print(f"vllm engine built in {time.perf_counter() - t0:.1f}s")
    except Exception as e:  # noqa: BLE001  (report, time the hf engine alone)
        print(f"vllm engine unavailable: {e}")
    params = [SamplingParams(temperature=1.0, max_new_tokens=new_tokens, seed=s)
              for s in range(repeats + 1)]
    rates = {name: [] for name in engines}
    for name, eng in engines.items():
        eng.generate(enc.input_ids, enc.attention_mask, params[0])  # warm up
    for p in params[1:]:
        for name, eng in engines.items():
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = eng.generate(enc.input_ids, enc.attention_mask, p)
            torch.cuda.synchronize()
            rates[name].append(float(out.response_mask.sum()) / (time.perf_counter() - t0))
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: Llama hidden=256 layers=4 ({n_params / 1e6:.2f}M params, float32), "
          f"batch={batch}, max_new_tokens={new_tokens}, temperature 1, "
          f"{repeats} repeats (median)")
    print(f"| {'engine':<8} | {'tokens/s':>10} |")
    print(f"|{'-' * 10}|{'-' * 12}|")
    for name, xs in rates.items():
        print(f"| {name:<8} | {statistics.median(xs):>10.0f} |")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--skip-install", action="store_true")
    p.add_argument("--skip-tests", action="store_true")
    p.add_argument("--skip-timing", action="store_true")
    p.add_argument("--install-timeout", type=int, default=180)
    p.add_argument("--tests-timeout", type=int, default=240)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    os.chdir(REPO)
    sys.path.insert(0, str(REPO))
    step("machine")
    try:
        subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                        "--format=csv"], check=False, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        print(f"nvidia-smi: {e}")
    if not args.skip_install:
        step("install the vllm extra")
        install(args.install_timeout)
    rc = 0
    if not args.skip_tests:
        step('pytest -m "vllm or gpu"')
        rc = run_tests(args.tests_timeout)
    if not args.skip_timing:
        step("hf vs vllm generation timing")
        try:
            timing(args.batch, args.max_new_tokens, args.repeats)
        except Exception as e:  # noqa: BLE001
            print(f"timing failed: {type(e).__name__}: {e}")
            rc = rc or 1
    return rc


if __name__ == "__main__":
    sys.exit(main())
