"""Code rewards: the sandbox's cost per call, and the reward phase's time for 256 code responses
with calls in parallel.

(a) One call (``Sandbox.run``: a process started, isolated, limited, run against the row's 4
assert tests, killed, its scratch directory removed), ``--repeats`` times each, median and p90,
for a passing response (the reference solution), a failing one (a wrong return value) and a
timing-out one (a busy loop, stopped by RLIMIT_CPU at half the 5 s wall clock: 3 s), with the
default limits, in the isolation this machine gives (``namespaces`` as root) and without it
(``rlimits``).

(b) ``RewardScorer("auto").score`` of 256 responses to the code task (``data.synthetic_task=code``
rows; half the reference solutions, half wrong ones, none timing out), with
``reward.sandbox_max_concurrent`` 1, 2 and 4; the ratio is the serial time over each.

    python bench/code_reward.py               # ~1 min on 2 cores
    python bench/code_reward.py --repeats 5   # quicker
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from verl_core.data.code_task import DATA_SOURCE, code_problems
from verl_core.reward.manager import RewardScorer
from verl_core.reward.sandbox import Sandbox, SandboxLimits, isolation_available


def _p90(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(0.9 * (len(xs) - 1)))]


def per_call(isolation: str, repeats: int) -> list[tuple]:
    p = code_problems(1, seed=0)[0]
    sb = Sandbox(SandboxLimits(), isolation=isolation)
    code = p.solution.split("```python\n")[1].split("```")[0]
    wrong = code.replace("return ", "return 1 + ")
    rows = []
    for label, c, n in (("passing", code, repeats), ("failing", wrong, repeats),
                        ("timing out (busy loop)", "while True:\n    pass\n",
                         max(2, repeats // 5))):
        times, results = [], []
        for _ in range(n):
            r = sb.run(c, list(p.tests))
            times.append(r.seconds)
            results.append((r.score, r.limit))
        rows.append((sb.mode, label, n, statistics.median(times), _p90(times), results[0]))
    return rows


def batch(n: int, concurrency: tuple[int, ...]) -> list[tuple]:
    problems = code_problems(n, seed=1)
    texts = [p.solution if i % 2 == 0 else p.solution.replace("return ", "return 1 + ")
             for i, p in enumerate(problems)]
    truths = ["\n".join(p.tests) for p in problems]
    out = []
    for k in concurrency:
        with RewardScorer("auto", sandbox_max_concurrent=k) as rs:
            t0 = time.perf_counter()
            res = rs.score([DATA_SOURCE] * n, texts, truths)
            out.append((k, time.perf_counter() - t0, sum(res.scores) / n))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--rows", type=int, default=256)
    a = ap.parse_args()
    why = isolation_available()
    print(f"cores: {os.cpu_count()}; namespaces: {'available' if why is None else why}")
    print("\n(a) one sandboxed call, default limits (timeout_s 5, CPU 3 s, 1024 MB)")
    print(f"{'isolation':<11} {'response':<24} {'calls':>5} {'median s':>9} {'p90 s':>8}  "
          "score, limit")
    modes = ["namespaces", "rlimits"] if why is None else ["rlimits"]
    for mode in modes:
        for m, label, n, med, p90, res in per_call(mode, a.repeats):
            print(f"{m:<11} {label:<24} {n:>5} {med:>9.3f} {p90:>8.3f}  {res}")
    print(f"\n(b) reward scoring of {a.rows} code responses (half right), "
          f"isolation {modes[0]}")
    print(f"{'max_concurrent':>14} {'seconds':>8} {'ms/row':>7} {'vs serial':>9}  mean score")
    rows = batch(a.rows, (1, 2, 4))
    serial = rows[0][1]
    for k, s, mean in rows:
        print(f"{k:>14} {s:>8.2f} {1000 * s / a.rows:>7.1f} {serial / s:>8.2f}x  {mean:.3f}")


if __name__ == "__main__":
    main()
