"""A generative judge's throughput on CPU (``reward_model.style=generative``): rows judged per
second by a real chat model (SmolLM2-135M-Instruct, fetched offline by
``python -m verl_core.models fetch``), greedy, through the project's rollout engine, at several
micro-batch sizes, against one row at a time measured in the same run. The rows are the
arithmetic task's (a question and a right or wrong answer), the template the yes/no one of
docs/rewards.md; the table also gives how many answers the ``yes_no`` parser read, and how often
the verdict agreed with the truth (a 135M judge is a poor grader: the figure is what it is).

    python bench/judge.py                                    # hf engine, 64 rows
    python bench/judge.py --model /path/to/folder --rows 128 --batches 1,16,64
    .venv-vllm/bin/python bench/judge.py --engine vllm       # vLLM's CPU backend
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import torch  # noqa: E402

from verl_core.reward.config import RewardModelConfig  # noqa: E402
from verl_core.reward.judge import Judge  # noqa: E402

TEMPLATE = ("Question: {problem}\nProposed answer: {solution}\nIs the proposed answer correct? "
            "Answer only \"yes\" or \"no\".")


class Row:
    """The fields of a dataset row the judge reads."""

    def __init__(self, question: str, truth: str):
        self.chat, self.ground_truth, self.index = (
            [{"role": "user", "content": question}], truth, 0)


def workload(n: int, seed: int = 0) -> tuple[list[Row], list[str], list[bool]]:
    """n arithmetic questions, half answered right."""
    rng = random.Random(seed)
    rows, answers, right = [], [], []
    for i in range(n):
        a, b = rng.randint(2, 60), rng.randint(2, 60)
        ok = i % 2 == 0
        rows.append(Row(f"What is {a}+{b}?", str(a + b)))
        answers.append(str(a + b if ok else a + b + rng.randint(1, 9)))
        right.append(ok)
    return rows, answers, right


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="", help="judge folder (default: fetch SmolLM2-135M)")
    ap.add_argument("--engine", default="hf", choices=("hf", "vllm"))
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--batches", default="1,8,32,64", help="micro-batch sizes; the first is "
                    "the baseline")
    ap.add_argument("--max-new-tokens", type=int, default=12)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = args.model
    work = tempfile.mkdtemp(prefix="judge-bench-")
    if not model:
        from verl_core.models.fetch import fetch

        model = fetch("smollm2-135m-instruct", os.path.join(work, "model"), log=lambda *_: None)
    template = os.path.join(work, "yes_no.txt")
    with open(template, "w") as f:
        f.write(TEMPLATE)
    rows, answers, right = workload(args.rows)
    seeds = list(range(len(rows)))
    table = []
    base = None
    sizes = [int(x) for x in args.batches.split(",")]
    # one judge (vLLM builds one engine per process cleanly), its calls split as each size says
    cfg = RewardModelConfig(enable=True, path=model, style="generative", parser="yes_no",
                            engine=args.engine, max_new_tokens=args.max_new_tokens,
                            micro_batch_size=max(sizes))
    judge = Judge.load(model, cfg, template_path=template)
    judge.judge_rows(rows[:2], answers[:2], seeds=seeds[:2])  # warm-up (first call)
    for mb in sizes:
        judge.micro_batch_size = mb
        t0 = time.perf_counter()
        got = judge.judge_rows(rows, answers, seeds=seeds)
        dt = time.perf_counter() - t0
        rate = len(rows) / dt
        base = base or rate
        agree = sum((s >= 0.5) == ok for s, ok in zip(got.scores, right))
        table.append((mb, dt, rate, rate / base, len(rows) - got.unparsed - got.failed,
                      got.failed, agree))
    judge.close()
    print(f"\njudge {os.path.basename(model.rstrip('/'))} on {args.engine}, {args.rows} rows, "
          f"greedy, <= {args.max_new_tokens} new tokens, {args.threads} threads")
    print("| micro-batch | seconds | rows/s | x one row | answers parsed | failed | "
          "verdict = truth |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for mb, dt, rate, ratio, parsed, failed, agree in table:
        print(f"| {mb} | {dt:.2f} | {rate:.2f} | {ratio:.2f} | {parsed}/{args.rows} | {failed} | "
              f"{agree}/{args.rows} |")


if __name__ == "__main__":
    main()
