"""A step on the real model against TRL's GRPOTrainer (issue 37, item 5): CPU seconds and wall
seconds per RL step and peak memory, for the plain loop, the Flyte workflow, bf16 (fp32 masters)
and LoRA, and for TRL 1.16 (full and LoRA), on SmolLM2-135M-Instruct with the same work, at 1 and
2 torch threads.

The same work:
- the same model folder, except that the benchmark's copy ends a response at a token the model
  does not write (``<empty_output>``, in the tokenizer, ``generation_config.json`` and
  ``config.json``), so every response of every run is exactly ``--tokens`` long: both frameworks
  generate and train on the same number of tokens (an RL step's cost grows with its response
  lengths, and a sampled length differs from run to run). Each run's mean response length is
  printed as the check;
- the same prompts (``data.synthetic_task=word_problems``'s parquet, chat template rendered once),
  4 prompts x 4 samples per step, sampled at temperature 1 (top-p 1, no top-k);
- verl's GRPO loss as TRL computes it: token-mean PPO-clip (TRL ``loss_type="dapo"``), group-
  normalised advantages, the low-variance KL estimator against a reference model at coefficient
  0.001 (TRL ``beta=0.001``: both keep a reference), one optimizer step per RL step over one
  16-row forward/backward, AdamW at the same settings, gradient clipping 1.0, no gradient
  checkpointing; the same verl ``gsm8k`` scorer as the reward;
- no evaluation during the steps, no checkpoint but the plain loop's own (the interval is past
  the run's end).

Each run is its own process (``python -m verl_core.train``, ``pyflyte run workflows/ppo.py ppo``,
or this script's TRL child), started with ``OMP_NUM_THREADS`` and the framework's thread count
set to the row's; this process only watches it (it imports neither torch nor transformers, so it
shares no pages with it): every ``--poll`` seconds the CPU seconds (user + system) and the RSS of
every process in the run's tree (Ray's included, for the workflow), summed. A step's CPU seconds
are the tree's CPU time between the end of the step before and its own end (interpolated at the
step-end times: stdout lines for the plain loop and TRL, the run store's metrics log for the
workflow), its wall seconds the same interval; each row reports the median over steps
``--warmup`` + 1 to ``--steps`` - 1 (the first steps carry one-off costs: allocator growth, Ray's
actors, TRL's first generation; the last one the plain loop's end evaluation). Peak memory is the
largest summed RSS of the tree at any poll during the measured steps, and over the whole command
(start-up, end evaluation and export included).

    pip install -e '.[bench]' -c .ci/constraints-cpu.txt
    python bench/real_model.py                         # fetch the model, every run, 1 and 2 threads
    python bench/real_model.py --model DIR --threads 2 --only plain,trl --steps 4
    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libjemalloc.so.2 python bench/real_model.py ...

The allocator is the process's: every run (ours and TRL's) inherits ``LD_PRELOAD``, and the
table's header names it (jemalloc is what the Docker images preload: glibc's heap keeps the
update's freed buffers resident, which hides LoRA's saving in the RSS; docs/lora.md).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PROMPTS, SAMPLES = 4, 4
STOP_TOKEN = "<empty_output>"  # a SmolLM2 special token (code data) no answer here contains
RUNS = ("plain", "whole-rows", "flyte", "bf16", "lora", "trl", "trl-lora")
LORA = {"model.lora_rank": 16, "model.lora_alpha": 32}  # verl's target_modules: all-linear


def work(tokens: int, lr: float) -> dict:
    """The shared work as the project's config keys (TRL's arguments are derived from these)."""
    return {
        "data.train_batch_size": PROMPTS, "rollout.n": SAMPLES, "rollout.max_new_tokens": tokens,
        "data.max_prompt_length": 160, "rollout.temperature": 1.0, "rollout.top_p": 1.0,
        "rollout.top_k": -1, "actor.ppo_mini_batch_size": PROMPTS, "actor.ppo_epochs": 1,
        "actor.ppo_micro_batch_size": PROMPTS * SAMPLES, "algorithm.adv_estimator": "grpo",
        "algorithm.loss_agg_mode": "token-mean", "algorithm.use_kl_loss": True,
        "algorithm.kl_loss_coef": 0.001, "algorithm.kl_loss_type": "low_var_kl",
        "algorithm.use_kl_in_reward": False, "optim.lr": lr, "optim.warmup_steps": 0,
        "optim.weight_decay": 0.01, "optim.beta1": 0.9, "optim.beta2": 0.999, "optim.grad_clip": 1.0, "model.gradient_checkpointing": False,
        "eval_every": 0, "val_before_train": False,
        "checkpoint.checkpoint_interval": 10_000,
        # ours only (TRL has no such switch): a GRPO group's prompt runs once in the reference
        # and update forwards (verl's key; the "whole-rows" run leaves it off)
        "actor.use_prefix_grouper": True,
    }


# ---------------------------------------------------------------------------------- the watcher
class TreeWatch:
    """Polls a process and its descendants: summed CPU seconds over time and the peak summed RSS.
    A process's CPU time is kept at its last-seen value after it exits (at most one poll lost)."""

    def __init__(self, pid: int, poll: float):
        import psutil

        self._root, self._poll = psutil.Process(pid), poll
        self.samples: list[tuple[float, float]] = []  # (time.time(), summed CPU s)
        self.rss: list[tuple[float, int]] = []  # (time.time(), summed RSS bytes)
        self.peak_rss = 0
        self._cpu: dict[tuple[int, float], float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import psutil

        while not self._stop.is_set():
            try:
                procs = [self._root, *self._root.children(recursive=True)]
            except psutil.NoSuchProcess:
                break
            rss = 0
            for p in procs:
                try:
                    with p.oneshot():
                        t = p.cpu_times()
                        self._cpu[(p.pid, p.create_time())] = t.user + t.system
                        rss += p.memory_info().rss
                except (psutil.NoSuchProcess, psutil.AccessDenied):
                    continue
            self.peak_rss = max(self.peak_rss, rss)
            now = time.time()
            self.samples.append((now, sum(self._cpu.values())))
            self.rss.append((now, rss))
            self._stop.wait(self._poll)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def peak_between(self, start: float, end: float) -> int:
        """The largest summed RSS polled between ``start`` and ``end``."""
        return max((r for t, r in self.rss if start <= t <= end), default=0)

    def cpu_at(self, when: float) -> float:
        """Summed CPU seconds at ``when``, linearly between the two polls around it."""
        s = self.samples
        for (t0, c0), (t1, c1) in zip(s, s[1:]):
            if t0 <= when <= t1:
                return c0 + (c1 - c0) * (when - t0) / ((t1 - t0) or 1e-9)
        raise SystemExit(f"no CPU sample around t={when:.3f} (polls {s[0][0]:.3f}-{s[-1][0]:.3f})")


def run_watched(cmd: list[str], env: dict, poll: float, step_line: str, log: str
                ) -> tuple[TreeWatch, list[float], list[str]]:
    """``cmd`` with its tree watched. Returns the watch, the times at which a stdout line
    starting with ``step_line`` arrived (the child flushes each line: PYTHONUNBUFFERED), and the
    output."""
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
        watch = TreeWatch(proc.pid, poll)
        stamps, lines = [], []
        for line in proc.stdout:
            now = time.time()
            out.write(line)
            lines.append(line.rstrip("\n"))
            if step_line and line.startswith(step_line):
                stamps.append(now)
        rc = proc.wait()
    watch.stop()
    if rc:
        sys.exit(f"{' '.join(cmd[:4])} ... failed (rc {rc}); its output: {log}\n" +
                 "\n".join(lines[-30:]))
    return watch, stamps, lines


def per_step(watch: TreeWatch, start: float, ends: list[float], warmup: int
             ) -> tuple[float, float]:
    """Median CPU seconds and wall seconds per step over the steps after ``warmup``, the last
    step left out (the plain loop's ends with its end evaluation, TRL's with its wrap-up)."""
    bounds = [start, *ends]
    cpu = [watch.cpu_at(b) - watch.cpu_at(a) for a, b in zip(bounds, bounds[1:])][warmup:-1]
    wall = [b - a for a, b in zip(bounds, bounds[1:])][warmup:-1]
    return statistics.median(cpu), statistics.median(wall)


# ------------------------------------------------------------------------------------ the runs
def bench_folder(model: str, out: str) -> str:
    """A copy of ``model`` whose EOS is :data:`STOP_TOKEN` (weights linked, not copied)."""
    from tokenizers import Tokenizer

    os.makedirs(out, exist_ok=True)
    stop = Tokenizer.from_file(os.path.join(model, "tokenizer.json")).token_to_id(STOP_TOKEN)
    if stop is None:
        sys.exit(f"{model}: its tokenizer has no {STOP_TOKEN!r}: not SmolLM2's? (--model)")
    for name in os.listdir(model):
        src, dst = os.path.join(model, name), os.path.join(out, name)
        if name.endswith(".safetensors"):
            os.symlink(src, dst)
            continue
        if name not in ("config.json", "generation_config.json", "tokenizer_config.json"):
            shutil.copy(src, dst)
            continue
        with open(src) as f:
            d = json.load(f)
        if name == "tokenizer_config.json":
            d["eos_token"] = STOP_TOKEN
        else:
            d["eos_token_id"] = stop
        with open(dst, "w") as f:
            json.dump(d, f, indent=2)
    return out


def child_env(threads: int, home: str) -> dict:
    os.makedirs(home, exist_ok=True)
    return {**os.environ, "PYTHONPATH": REPO, "PYTHONUNBUFFERED": "1", "HOME": home,
            "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
            "RAY_AUTH_MODE": "disabled", "VERL_ASSET_CACHE": os.path.join(home, "cache"),
            "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}


def run_ours(kind: str, over: dict, steps: int, threads: int, root: str, poll: float) -> dict:
    """The plain loop as a user runs it (``python -m verl_core.train``)."""
    over = {**over, "num_threads": threads}
    if kind == "whole-rows":
        over["actor.use_prefix_grouper"] = False
    if kind == "bf16":
        over["model.dtype"] = "bfloat16"
    if kind == "lora":
        over.update(LORA)
    cmd = [sys.executable, "-m", "verl_core.train", "--steps", str(steps),
           "--store", os.path.join(root, "runs"), "--run-name", kind]
    for k, v in over.items():
        cmd += ["--set", f"{k}={v}"]
    watch, ends, lines = run_watched(cmd, child_env(threads, os.path.join(root, "home")), poll,
                                     "step ", os.path.join(root, "out.log"))
    ends = [t for t, line in zip(ends, [x for x in lines if x.startswith("step ")])
            if "/" in line.split()[1]]  # "step k/N ..." ends a step ("step 0: val/..." does not)
    steps_at = [float(x.split(" len=")[1].split()[0]) for x in lines
                if x.startswith("step ") and " len=" in x]
    return {"watch": watch, "start": watch.samples[0][0], "ends": ends, "lengths": steps_at}


def run_flyte(over: dict, steps: int, threads: int, root: str, poll: float) -> dict:
    """``pyflyte run workflows/ppo.py ppo`` on the same config (the workflow's step-end times
    from the run store's metrics log)."""
    over = {**over, "num_threads": threads}
    store = os.path.join(root, "store")
    cmd = [os.path.join(os.path.dirname(sys.executable), "pyflyte"), "run", "workflows/ppo.py",
           "ppo", "--steps", str(steps), "--store", store, "--run-name", "bench",
           "--overrides", json.dumps(over)]
    watch, _, _ = run_watched(cmd, child_env(threads, os.path.join(root, "home")), poll, "",
                              os.path.join(root, "out.log"))
    logs = os.path.join(store, "bench", "logs")
    [name] = [f for f in os.listdir(logs) if f.startswith("metrics-") and f.endswith(".jsonl")]
    rows = {}
    with open(os.path.join(logs, name)) as f:
        for line in f:
            r = json.loads(line)
            if "timing/update_s" in r:  # written as the step's update ends (not an eval's)
                rows[r["step"]] = r  # a re-run phase appends again: the last one wins
    ends = [rows[k]["time"] for k in sorted(rows)]
    lengths = [rows[k].get("response_length/mean", float("nan")) for k in sorted(rows)]
    # the first step starts when the first rollout phase does (the phase log's "started")
    with open(os.path.join(store, "bench", "logs", "phases.jsonl")) as f:
        phases = [json.loads(x) for x in f]
    start = min(p["started"] for p in phases if p["phase"] == "rollout" and p["step"] == 0)
    return {"watch": watch, "start": start, "ends": ends, "lengths": lengths}


def run_trl(kind: str, over: dict, steps: int, threads: int, root: str, poll: float) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--trl-child", json.dumps(
        {"over": {k: v for k, v in over.items() if k != "actor.use_prefix_grouper"},
         "steps": steps, "threads": threads, "lora": kind == "trl-lora",
         "out": os.path.join(root, "trl")})]
    watch, ends, lines = run_watched(cmd, child_env(threads, os.path.join(root, "home")), poll,
                                     "[bench] step-end", os.path.join(root, "out.log"))
    lengths = [float(x.split()[-1]) for x in lines if x.startswith("[bench] length")]
    start = float([x for x in lines if x.startswith("[bench] step-begin")][0].split()[-1])
    return {"watch": watch, "start": start, "ends": ends, "lengths": lengths}


def trl_child(spec: dict) -> None:
    """TRL's GRPOTrainer on the work of ``spec["over"]`` (this script run with --trl-child)."""
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    sys.path.insert(0, REPO)
    from verl_core.data.dataset import render_prompt
    from verl_core.models import load_tokenizer
    from verl_core.reward.gsm8k import compute_score
    from verl_core.data.prompts import load_checked_rows

    torch.set_num_threads(spec["threads"])
    o = spec["over"]
    tok = load_tokenizer(o["model.path"])
    rows = load_checked_rows(tok, [o["data.train_files"]], o["data.max_prompt_length"])
    data = Dataset.from_dict({"prompt": [render_prompt(r, tok) for r in rows],
                              "ground_truth": [r.ground_truth for r in rows]})

    def gsm8k_reward(prompts, completions, ground_truth, **_):
        return [compute_score(c, gt) for c, gt in zip(completions, ground_truth)]

    peft = None
    if spec["lora"]:
        from peft import LoraConfig
        peft = LoraConfig(r=LORA["model.lora_rank"], lora_alpha=LORA["model.lora_alpha"],
                          target_modules="all-linear", lora_dropout=0.0, task_type="CAUSAL_LM")
    args = GRPOConfig(
        output_dir=spec["out"], use_cpu=True, bf16=False, report_to="none", save_strategy="no",
        logging_steps=1, seed=1, max_steps=spec["steps"], disable_tqdm=True,
        per_device_train_batch_size=PROMPTS * SAMPLES, gradient_accumulation_steps=1,
        num_generations=SAMPLES, steps_per_generation=1, num_iterations=1,
        max_completion_length=o["rollout.max_new_tokens"], temperature=1.0, top_p=1.0, top_k=0,
        beta=o["algorithm.kl_loss_coef"], epsilon=0.2, epsilon_high=0.2, loss_type="dapo",
        scale_rewards="group", learning_rate=o["optim.lr"], adam_beta1=o["optim.beta1"], adam_beta2=o["optim.beta2"],
        adam_epsilon=1e-8, weight_decay=o["optim.weight_decay"], max_grad_norm=o["optim.grad_clip"],
        lr_scheduler_type="constant", gradient_checkpointing=False, dataloader_num_workers=0,
        model_init_kwargs={"dtype": torch.float32})

    class StepTimer(TrainerCallback):
        def on_step_begin(self, *a, **k):
            print(f"[bench] step-begin {time.time()}", flush=True)

        def on_step_end(self, *a, **k):
            print(f"[bench] step-end {time.time()}", flush=True)

        def on_log(self, _args, _state, _control, logs=None, **k):
            if logs and "completions/mean_length" in logs:
                print(f"[bench] length {logs['completions/mean_length']}", flush=True)

    trainer = GRPOTrainer(model=o["model.path"], reward_funcs=gsm8k_reward, args=args,
                          train_dataset=data, processing_class=tok, callbacks=[StepTimer()],
                          peft_config=peft)
    trainer.train()


def prepare(model: str, root: str) -> dict:
    """The benchmark's model folder and the word problems' parquet (in a child: this process
    keeps torch out)."""
    folder = bench_folder(model, os.path.join(root, "model"))
    code = ("import sys, json; from verl_core.data.word_problems import "
            "write_word_problem_dataset as w; print(json.dumps(w(sys.argv[1], train_size=2000, "
            "val_size=8, seed=1)))")
    out = subprocess.run([sys.executable, "-c", code, os.path.join(root, "data")], cwd=REPO,
                         env={**os.environ, "PYTHONPATH": REPO}, capture_output=True, text=True,
                         check=True).stdout
    train, val = json.loads(out.strip().splitlines()[-1])
    return {"model.path": folder, "data.train_files": train, "data.val_files": val}


def fetch_model() -> str:
    code = ("import os; from verl_core.local_cache import cache_root; from verl_core.models.fetch "
            "import fetch; print(fetch('smollm2-135m-instruct', os.path.join(cache_root(), "
            "'models', 'smollm2-135m-instruct')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, text=True,
                         env={**os.environ, "PYTHONPATH": REPO}, capture_output=True).stdout
    return out.strip().splitlines()[-1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="", help="a SmolLM2-135M-Instruct folder (default: fetch)")
    ap.add_argument("--steps", type=int, default=4,
                    help="steps per run; the first --warmup and the last are not measured")
    ap.add_argument("--warmup", type=int, default=1, help="first steps left out of the median")
    ap.add_argument("--tokens", type=int, default=64, help="response tokens (every response)")
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--threads", default="1,2", help="comma list of torch thread counts")
    ap.add_argument("--only", default=",".join(RUNS), help=f"comma list of {', '.join(RUNS)}")
    ap.add_argument("--poll", type=float, default=0.1, help="seconds between the watcher's polls")
    ap.add_argument("--keep", default="", help="keep the runs' folders and logs here")
    ap.add_argument("--trl-child", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.trl_child:
        return trl_child(json.loads(args.trl_child))
    runs = [r for r in args.only.split(",") if r]
    if bad := [r for r in runs if r not in RUNS]:
        ap.error(f"--only {','.join(bad)}: not one of {', '.join(RUNS)}")
    if args.steps < args.warmup + 2:
        ap.error(f"--steps {args.steps}: need at least --warmup + 2 (the first --warmup steps "
                 "and the last are not measured)")
    threads = [int(t) for t in args.threads.split(",")]
    model = args.model or fetch_model()
    root = args.keep or tempfile.mkdtemp(prefix="verl-bench-real-")
    over = {**work(args.tokens, args.lr), **prepare(model, root)}
    print(f"same work: SmolLM2-135M-Instruct, {PROMPTS} prompts x {SAMPLES} samples, "
          f"{args.tokens} tokens per response, KL to a reference, one optimizer step per RL "
          f"step; steps {args.warmup + 1}-{args.steps - 1} of {args.steps} (median)", flush=True)
    results: dict[tuple[str, int], dict] = {}
    for n in threads:
        for kind in runs:
            where = os.path.join(root, f"{kind}-t{n}")
            os.makedirs(where, exist_ok=True)
            if kind == "flyte":
                r = run_flyte(over, args.steps, n, where, args.poll)
            elif kind.startswith("trl"):
                r = run_trl(kind, over, args.steps, n, where, args.poll)
            else:
                r = run_ours(kind, over, args.steps, n, where, args.poll)
            if len(r["ends"]) != args.steps:
                sys.exit(f"{kind}: {len(r['ends'])} step ends seen, not {args.steps} "
                         f"(output in {where})")
            cpu, wall = per_step(r["watch"], r["start"], r["ends"], args.warmup)
            lengths = [x for x in r["lengths"] if x == x]
            # the measured steps' peak (the steps the CPU and wall medians are taken over: not
            # the first, which holds the plain loop's start-up, nor the last, its end
            # evaluation and export); and the whole command's
            bounds = [r["start"], *r["ends"]]
            steps_rss = r["watch"].peak_between(bounds[args.warmup], bounds[-2]) / 2**30
            results[(kind, n)] = {"cpu": cpu, "wall": wall, "rss": steps_rss,
                                  "rss_all": r["watch"].peak_rss / 2**30,
                                  "len": statistics.mean(lengths) if lengths else float("nan")}
            x = results[(kind, n)]
            print(f"  {kind:8s} {n} thread(s): {x['cpu']:.2f} CPU s/step, {x['wall']:.2f} s/step,"
                  f" peak RSS {x['rss']:.2f} GiB in the steps, {x['rss_all']:.2f} GiB in all, "
                  f"mean response length {x['len']:.1f}", flush=True)
    names = {"plain": "ours, plain loop", "whole-rows": "ours, plain loop, whole rows", "flyte": "ours, Flyte workflow", "bf16": "ours, bf16",
             "lora": "ours, LoRA r16", "trl": "TRL GRPOTrainer", "trl-lora": "TRL, LoRA r16"}
    print(f"\nallocator: {os.environ.get('LD_PRELOAD') or 'glibc malloc'} (every run)")
    print("\n| run | threads | CPU s / step | x TRL | wall s / step | x TRL | peak RSS GiB, "
          "steps | x TRL | peak RSS GiB, whole command | response length |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for (kind, n), x in results.items():
        ref = results.get(("trl-lora" if kind == "lora" and ("trl-lora", n) in results
                           else "trl", n))

        def ratio(key):
            return f"{x[key] / ref[key]:.2f}" if ref else "-"
        print(f"| {names[kind]} | {n} | {x['cpu']:.2f} | {ratio('cpu')} | {x['wall']:.2f} | "
              f"{ratio('wall')} | {x['rss']:.2f} | {ratio('rss')} | {x['rss_all']:.2f} | "
              f"{x['len']:.1f} |")
    for n in threads:
        if ("lora", n) in results and ("plain", n) in results:
            full, lora = results[("plain", n)]["rss"], results[("lora", n)]["rss"]
            print(f"\n{n} thread(s): LoRA's peak in the steps {lora:.2f} GiB, full "
                  f"fine-tuning's {full:.2f} GiB: {full - lora:.2f} GiB less (the base weights' "
                  "gradients and AdamW moments in fp32: 3 x 134.5M x 4 B = 1.50 GiB)")
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
