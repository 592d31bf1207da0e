"""A GSM8K-style verifiable task the project generates: short word problems of 1-3 arithmetic
steps, in verl's GSM8K row layout, scored by verl's ``gsm8k`` rule scorer.

A real pretrained model (SmolLM2-135M-Instruct, ``python -m verl_core.models fetch``) can read
these and sometimes solves them, where GSM8K itself is mostly beyond a 135M model: RL then has
groups with some right and some wrong answers, the signal GRPO learns from. One row::

    data_source   "openai/gsm8k"                  (verl's scorer: the number after "#### ")
    prompt        [{"role": "user", "content": "<question> Let's think step by step and output
                    the final answer after \\"####\\"."}]     (verl's gsm8k preprocessing)
    ability       "math"
    reward_model  {"style": "rule", "ground_truth": "23"}
    extra_info    {"split", "index", "question", "answer": "<steps>\\n#### 23", "steps": 2}

``extra_info.answer`` is a worked solution in GSM8K's own form (one line per step, ``<<a+b=c>>``
annotations left out), what a supervised format warm start can learn the ``#### N`` ending from.

What belongs here: the templates and the files. Seeded: the same arguments give byte-identical
files, and the held-out split never changes when only the training size does.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq

from verl_core.store import resolve_storage_options

DATA_SOURCE = "openai/gsm8k"
"""Routed to verl's ``gsm8k`` scorer by ``reward.scorer=auto``."""
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
"""verl's ``examples/data_preprocess/gsm8k.py`` appends this to each question."""

NAMES = ("Ana", "Ben", "Carla", "Dev", "Emma", "Farid", "Grace", "Hugo", "Ines", "Jon", "Kira",
         "Liam", "Maya", "Noah", "Olga", "Pablo", "Rosa", "Sam", "Tara", "Umar")
THINGS = ("apples", "books", "stickers", "marbles", "pencils", "cookies", "shells", "coins",
          "cards", "flowers", "eggs", "toy cars")


@dataclass(frozen=True)
class WordProblem:
    question: str
    steps: list[str]  # one line per arithmetic step, each ending in its result
    answer: int

    @property
    def solution(self) -> str:
        return "\n".join(self.steps) + f"\n#### {self.answer}"


def _one_step(rng: random.Random) -> WordProblem:
    who, what = rng.choice(NAMES), rng.choice(THINGS)
    a, b = rng.randint(2, 40), rng.randint(2, 30)
    kind = rng.choice(("more", "less", "times"))
    if kind == "more":
        q = f"{who} has {a} {what}. {who} gets {b} more. How many {what} does {who} have now?"
        return WordProblem(q, [f"{who} has {a} + {b} = {a + b} {what}."], a + b)
    if kind == "less":
        a = a + b  # never negative
        q = f"{who} has {a} {what} and gives away {b}. How many {what} are left?"
        return WordProblem(q, [f"{who} has {a} - {b} = {a - b} {what} left."], a - b)
    a, b = rng.randint(2, 9), rng.randint(2, 12)
    q = f"{who} buys {a} bags with {b} {what} in each bag. How many {what} does {who} buy?"
    return WordProblem(q, [f"{who} buys {a} * {b} = {a * b} {what}."], a * b)


def _two_step(rng: random.Random) -> WordProblem:
    who, other, what = *rng.sample(NAMES, 2), rng.choice(THINGS)
    a, b, c = rng.randint(3, 30), rng.randint(2, 20), rng.randint(2, 9)
    kind = rng.choice(("more_then_less", "times_then_more", "share"))
    if kind == "more_then_less":
        c = rng.randint(1, a + b - 1)
        q = (f"{who} has {a} {what}. {other} gives {who} {b} more, then {who} uses {c} of them. "
             f"How many {what} does {who} have left?")
        return WordProblem(q, [f"After the gift {who} has {a} + {b} = {a + b} {what}.",
                               f"After using some, {a + b} - {c} = {a + b - c} are left."],
                           a + b - c)
    if kind == "times_then_more":
        a = rng.randint(2, 9)
        q = (f"{who} has {a} boxes of {c} {what} and {b} loose {what}. How many {what} does "
             f"{who} have in all?")
        return WordProblem(q, [f"The boxes hold {a} * {c} = {a * c} {what}.",
                               f"In all {a * c} + {b} = {a * c + b} {what}."], a * c + b)
    total = c * rng.randint(2, 9)
    each = total // c
    q = (f"{who} shares {total} {what} equally among {c} friends and keeps none. {other} gives "
         f"each friend {b} more. How many {what} does each friend have?")
    return WordProblem(q, [f"Each friend first gets {total} / {c} = {each} {what}.",
                           f"Then each has {each} + {b} = {each + b} {what}."], each + b)


def _three_step(rng: random.Random) -> WordProblem:
    who, what = rng.choice(NAMES), rng.choice(THINGS)
    a, b, c, d = rng.randint(2, 6), rng.randint(2, 10), rng.randint(2, 20), rng.randint(1, 10)
    total = a * b + c
    d = min(d, total - 1)
    q = (f"{who} buys {a} packs of {b} {what} and finds {c} more. Then {who} gives {d} to a "
         f"friend. How many {what} does {who} have?")
    return WordProblem(q, [f"The packs hold {a} * {b} = {a * b} {what}.",
                           f"With the ones found, {a * b} + {c} = {total} {what}.",
                           f"After giving some away, {total} - {d} = {total - d} {what}."],
                       total - d)


STEP_MAKERS = {1: _one_step, 2: _two_step, 3: _three_step}


def word_problems(count: int, seed: int, steps: tuple[int, ...] = (1, 2, 3)) -> list[WordProblem]:
    """``count`` distinct problems, their step counts drawn evenly from ``steps``."""
    bad = [s for s in steps if s not in STEP_MAKERS]
    if bad or not steps:
        raise ValueError(f"steps={steps!r}: each must be one of {sorted(STEP_MAKERS)}")
    rng, seen, out = random.Random(seed), set(), []
    tries = 0
    while len(out) < count:
        tries += 1
        if tries > 50 * count + 1000:
            raise ValueError(f"could not draw {count} distinct word problems; ask for fewer")
        p = STEP_MAKERS[steps[len(out) % len(steps)]](rng)
        if p.question not in seen:
            seen.add(p.question)
            out.append(p)
    return out


_SCHEMA = pa.schema([
    ("data_source", pa.string()),
    ("prompt", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
    ("ability", pa.string()),
    ("reward_model", pa.struct([("style", pa.string()), ("ground_truth", pa.string())])),
    ("extra_info", pa.struct([("split", pa.string()), ("index", pa.int64()),
                              ("question", pa.string()), ("answer", pa.string()),
                              ("steps", pa.int64())])),
])


def rows(problems: list[WordProblem], split: str) -> list[dict]:
    """verl-layout rows (its GSM8K preprocessing's) for ``problems``."""
    return [{"data_source": DATA_SOURCE,
             "prompt": [{"role": "user", "content": f"{p.question} {INSTRUCTION}"}],
             "ability": "math",
             "reward_model": {"style": "rule", "ground_truth": str(p.answer)},
             "extra_info": {"split": split, "index": i, "question": p.question,
                            "answer": p.solution, "steps": len(p.steps)}}
            for i, p in enumerate(problems)]


def write_word_problem_dataset(out_dir: str, *, train_size: int, val_size: int, seed: int,
                               storage_options: dict | None = None) -> tuple[str, str]:
    """``train.parquet`` and ``val.parquet`` under ``out_dir``: the first ``val_size`` problems
    held out, the next ``train_size`` for training (disjoint). Returns ``(train, val)``."""
    if train_size <= 0 or val_size < 0:
        raise ValueError(f"train_size={train_size}, val_size={val_size}: need train_size > 0 "
                         "and val_size >= 0")
    held = word_problems(val_size, seed)
    # the training problems from their own stream, minus any that repeat a held-out question
    seen = {p.question for p in held}
    extra = word_problems(train_size + val_size, seed + 1)
    train = [p for p in extra if p.question not in seen][:train_size]
    if len(train) < train_size:
        raise ValueError(f"train_size={train_size}: not enough distinct problems")
    fs, root = fsspec.core.url_to_fs(out_dir, **resolve_storage_options(out_dir, storage_options))
    fs.makedirs(root, exist_ok=True)
    paths = []
    for split, probs in (("train", train), ("val", held)):
        path = f"{root.rstrip('/')}/{split}.parquet"
        with fs.open(path, "wb") as f:
            pq.write_table(pa.Table.from_pylist(rows(probs, split), schema=_SCHEMA), f)
        paths.append(f"{out_dir.rstrip('/')}/{split}.parquet" if "://" in out_dir else path)
    return paths[0], paths[1]
