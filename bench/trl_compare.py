"""Step time against TRL's GRPOTrainer on the same work (issue 9, item 6).

The same tiny Llama with the same start weights (the warm-started model of ``prepare_assets``,
an HF folder), the same synthetic arithmetic prompts, B=32 prompts x G=8 samples, 4 new tokens,
one optimizer step per batch (one epoch, one mini-batch), no KL (TRL ``beta=0``), the same
AdamW and LR schedule (lr 3e-4, betas 0.9/0.99, eps 1e-8, 2 warm-up steps then constant, grad
norm 1.0), the same loss (token-mean PPO-clip, TRL's ``dapo``), group-normalised advantages and
the same rule scorer. Runs N steps of each, one after the other in this process (the Flyte
workflow as ``pyflyte run`` in a subprocess), ``--repeats`` rounds of TRL, plain loop, workflow and
TRL again, and prints each round's median step time (steps 1 to ``--warmup`` excluded) and its
ratio to the mean of the round's two TRL runs, the median ratio over the rounds, and the held-out
accuracy before and after, all scored by our greedy evaluator. Every run's step is timed the same
way, from the end of the step before to its own end (all a step costs: fetching its prompts,
logging its metrics, and for the workflow its tasks).

    pip install -e '.[bench]' -c .ci/constraints-cpu.txt
    python bench/trl_compare.py                        # 3 rounds of 12 steps each
    python bench/trl_compare.py --steps 20 --repeats 1 --skip flyte
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
# (not bench/trl.py: the script's folder is first on sys.path, so it would shadow `import trl`)

import torch  # noqa: E402

from verl_core.config import grpo_preset, with_overrides  # noqa: E402
from verl_core.data.dataset import render_prompt  # noqa: E402
from verl_core.models import load_tokenizer  # noqa: E402
from verl_core.reward.arithmetic import compute_score  # noqa: E402
from verl_core.train import train  # noqa: E402
from verl_core.trainer import RLTrainer  # noqa: E402
from verl_core.assets import Assets, prepare_assets  # noqa: E402
from verl_core.data.prompts import load_checked_rows  # noqa: E402

B, G, NEW_TOKENS = 32, 8, 4
WORK = {  # the shared work, as our config's overrides
    "data.train_batch_size": B, "rollout.n": G, "rollout.max_new_tokens": NEW_TOKENS,
    "actor.ppo_mini_batch_size": B, "actor.ppo_epochs": 1,  # one optimizer step per batch
    "actor.ppo_micro_batch_size": B * G,  # one forward/backward, as TRL's 256-row batch
    "algorithm.use_kl_loss": False, "algorithm.loss_agg_mode": "token-mean",
    "checkpoint.checkpoint_interval": 1000,
}


def accuracy(cfg, model_path: str) -> float:
    """Held-out greedy accuracy of the model folder, by our evaluator (same rows, same scorer)."""
    c = with_overrides(cfg, {"model.path": model_path})
    trainer = RLTrainer(c, Assets(model_path=model_path, train_files=c.data.train_file_list,
                                  val_files=c.data.val_file_list, reward_model_path=""))
    try:
        return trainer.evaluate()["val/accuracy"]
    finally:
        trainer.close()


def workflow_overrides(cfg, over: dict, steps: int) -> dict:
    """``over`` plus each field on which the workflow's config would differ from ``cfg``, the
    config TRL and the plain loop run. The workflow builds its config through
    ``verl_keys.run_config``, whose defaults for a model you bring are verl's (lr 1e-6, prompts of
    512 tokens ...), where ``cfg`` is our preset with ``over``: without these the workflow would
    train with other settings than the two runs it is compared with."""
    import dataclasses

    from verl_core import verl_keys

    def flat(c) -> dict:
        out = {}
        for f in dataclasses.fields(c):
            v = getattr(c, f.name)
            if dataclasses.is_dataclass(v):
                out.update({f"{f.name}.{g.name}": getattr(v, g.name) for g in dataclasses.fields(v)})
            else:
                out[f.name] = v
        return out

    def workflow_config(o):
        return verl_keys.run_config("", "", o, {"total_steps": steps})

    want, got = flat(cfg), flat(workflow_config(over))
    res = {**over, **{k: v for k, v in want.items() if got[k] != v and k != "total_steps"}}
    if workflow_config(res) != cfg:
        raise SystemExit("the workflow's config differs from the plain loop's and TRL's")
    return res


def intervals(start: float, ends: list[float]) -> list[float]:
    """Step times from when the first step started and the moments steps ended: the wall time
    from one step's end to the next (what a run's throughput is made of)."""
    return [b - a for a, b in zip([start, *ends], ends)]


def run_trl(cfg, steps: int, out: str) -> tuple[list[float], str]:
    """TRL GRPOTrainer on the same model folder, prompts, batch and optimizer settings. Returns
    the per-step wall times and the final model folder. A step is timed from the end of the one
    before (a TrainerCallback's ``on_step_end``), as the workflow's are from the phase log: the
    Trainer fetches the step's prompts before ``on_step_begin`` and logs its metrics after
    ``on_step_end``, and both are part of a step's cost."""
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    tok = load_tokenizer(cfg.model.path)
    rows = load_checked_rows(tok, cfg.data.train_file_list, cfg.data.max_prompt_length)
    data = Dataset.from_dict({"prompt": [render_prompt(r, tok) for r in rows],
                              "ground_truth": [r.ground_truth for r in rows]})

    def arithmetic_reward(prompts, completions, ground_truth, **_):
        # TRL passes the dataset's other columns as keyword lists, one entry per completion
        return [compute_score(c, gt) for c, gt in zip(completions, ground_truth)]

    o = cfg.optim
    args = GRPOConfig(
        output_dir=out, use_cpu=True, bf16=False, report_to="none", save_strategy="no",
        logging_steps=1, seed=cfg.seed, max_steps=steps, disable_tqdm=True,
        per_device_train_batch_size=B * G, gradient_accumulation_steps=1, num_generations=G,
        steps_per_generation=1, num_iterations=1,  # on-policy: TRL skips the old-logp forward
        max_completion_length=NEW_TOKENS, temperature=cfg.rollout.temperature, top_p=1.0,
        top_k=0, beta=0.0, epsilon=cfg.algorithm.clip_ratio_low,
        epsilon_high=cfg.algorithm.clip_ratio_high, loss_type="dapo", scale_rewards="group",
        learning_rate=o.lr, adam_beta1=o.beta1, adam_beta2=o.beta2, adam_epsilon=o.eps,
        weight_decay=o.weight_decay, max_grad_norm=o.grad_clip,
        lr_scheduler_type="constant_with_warmup", warmup_steps=o.warmup_steps,
        dataloader_num_workers=0)
    starts: list[float] = []
    ends: list[float] = []

    class StepTimer(TrainerCallback):
        def on_step_begin(self, *a, **k):
            starts.append(time.perf_counter())

        def on_step_end(self, *a, **k):
            ends.append(time.perf_counter())

    trainer = GRPOTrainer(model=cfg.model.path, reward_funcs=arithmetic_reward, args=args,
                          train_dataset=data, processing_class=tok, callbacks=[StepTimer()])
    trainer.train()
    times = intervals(starts[0], ends)
    final = os.path.join(out, "final_model")
    trainer.model.save_pretrained(final, safe_serialization=True)
    tok.save_pretrained(final)
    return times, final


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=2, help="first steps left out of the median")
    ap.add_argument("--repeats", type=int, default=3,
                    help="rounds of TRL, plain loop, workflow, TRL again, back to back; each "
                         "round's ratios are to the mean of its two TRL runs")
    ap.add_argument("--skip", default="", help="comma list of runs to leave out: plain,flyte")
    args = ap.parse_args()
    if args.steps <= args.warmup:
        raise SystemExit(f"--steps {args.steps} must exceed --warmup {args.warmup}")
    if args.repeats < 1:
        raise SystemExit(f"--repeats {args.repeats} must be at least 1")
    skip = set(filter(None, args.skip.split(",")))
    torch.set_num_threads(os.cpu_count() or 1)
    rounds: list[dict] = []  # per round: run name -> (median step s, start acc, end acc)
    with tempfile.TemporaryDirectory(prefix="verl-bench-trl-") as work:
        assets = prepare_assets(grpo_preset(), os.path.join(work, "assets"), log=lambda *_: None)
        over = {**WORK, "model.path": assets.model_path, "data.train_files":
                assets.train_files[0], "data.val_files": assets.val_files[0]}
        cfg = with_overrides(grpo_preset(), {**over, "total_steps": args.steps})
        flyte_over = workflow_overrides(cfg, over, args.steps)  # the same work: the same config
        print(f"same work: {B} prompts x {G} samples, {NEW_TOKENS} new tokens, "
              f"{cfg.optimizer_steps_per_rl_step} optimizer step per RL step, no KL, "
              f"{torch.get_num_threads()} threads", flush=True)
        start = accuracy(cfg, assets.model_path)

        def med(times):
            return statistics.median(times[args.warmup:])

        for r in range(args.repeats):
            # the machine's speed drifts (a shared 2-core VM: +-30% within a minute), so each
            # round runs TRL, ours, TRL back to back and is compared within itself
            res = {}
            out = os.path.join(work, f"r{r}")
            trl_times, trl_final = run_trl(cfg, args.steps, os.path.join(out, "trl"))
            res["TRL GRPOTrainer"] = (med(trl_times), start, accuracy(cfg, trl_final))
            if "plain" not in skip:
                ends = []  # the loop logs one "step k/N ..." line as each step ends

                def stamp(line):
                    if re.match(r"step \d+/\d+ ", line):
                        ends.append(time.perf_counter())

                s = train(cfg, os.path.join(out, "plain"), log=stamp)
                times = intervals(ends[0] - s["history"][0]["timing/step_s"], ends)
                res["plain loop"] = (med(times), s["start_accuracy"], s["end_accuracy"])
            if "flyte" not in skip:
                from orchestration import run_flyte
                from verl_core.store import RunStore
                flyte, total, run_dir = run_flyte(f"trl{r}", flyte_over, args.steps, out)
                st = RunStore(run_dir)
                [name] = [f[:-len(".jsonl")] for f in os.listdir(os.path.join(run_dir, "logs"))
                          if f.startswith("metrics-") and f.endswith(".jsonl")]
                acc = {row["step"]: row["val/accuracy"] for row in st.read_log(name)
                       if row.get("val/accuracy") is not None}
                res["Flyte workflow"] = (med([row["step"] for row in flyte]), acc[0],
                                         acc[args.steps])
                from orchestration import PHASES
                print(f"(round {r + 1}: pyflyte run {total:.1f}s for the whole command; "
                      "workflow phases, median s: " +
                      ", ".join(f"{p} {med([row[p] for row in flyte]):.3f}" for p in PHASES) + ")")
            ref = res["TRL GRPOTrainer"][0]
            # TRL again at the end of the round: the reference is the mean of the two, so a
            # drift of the machine's speed during the round cancels to first order
            trl_b, _ = run_trl(cfg, args.steps, os.path.join(out, "trl-b"))
            ref = (ref + med(trl_b)) / 2
            res["TRL GRPOTrainer"] = (ref, *res["TRL GRPOTrainer"][1:])
            print(f"round {r + 1}: " + ", ".join(f"{n} {v[0]:.3f}s ({v[0] / ref:.2f}x)"
                                                 for n, v in res.items()), flush=True)
            rounds.append(res)
    print(f"\n| run | step s (median of steps {args.warmup + 1}-{args.steps}; per round) | "
          f"x TRL (per round) | x TRL, median of {args.repeats} | "
          "held-out accuracy start -> end (round 1) |")
    print("|---|---:|---:|---:|---|")
    for name in rounds[0]:
        secs = [rd[name][0] for rd in rounds]
        ratios = [rd[name][0] / rd["TRL GRPOTrainer"][0] for rd in rounds]
        _, a0, a1 = rounds[0][name]
        print(f"| {name} | {' / '.join(f'{x:.3f}' for x in secs)} | "
              f"{' / '.join(f'{x:.2f}' for x in ratios)} | **{statistics.median(ratios):.2f}** | "
              f"{a0:.3f} -> {a1:.3f} |")
    if {"plain loop", "Flyte workflow"} <= set(rounds[0]):
        # within a round, and untouched by how TRL's own speed drifts: what the orchestration
        # (tasks, Ray calls, committed batches) costs over the same work in one process
        over = [rd["Flyte workflow"][0] / rd["plain loop"][0] for rd in rounds]
        print(f"\nFlyte workflow / plain loop per round: {' / '.join(f'{x:.2f}' for x in over)}"
              f" (median {statistics.median(over):.2f})")


if __name__ == "__main__":
    main()
