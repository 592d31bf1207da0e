"""Synthetic verifiable tasks, written as parquet in verl's row layout.

The arithmetic task: ``12+7=`` -> ``19``. Small enough that a tiny model learns it on CPU, and
exactly verifiable by :mod:`verl_core.reward.arithmetic`. One row::

    data_source   "synthetic/arithmetic"
    prompt        [{"role": "user", "content": "12+7="}]
    ability       "math"
    reward_model  {"style": "rule", "ground_truth": "19"}
    extra_info    {"split": "train", "index": 0, "a": 12, "b": 7, "op": "+"}

The calculator task (``data.synthetic_task=calculator``, issue 25): the same rows for products of
two 4-digit numbers with an 8-digit result (``4321*5678=`` -> ``24534638``, ``data_source
"synthetic/calculator"``), too large for the tiny model to compute in its head; with the
built-in calculator tool (``rollout.multi_turn``) it can look them up. Every prompt, call, tool
response and answer then has one length, so the tiny model's warm start learns to copy at fixed
offsets in a few hundred steps (with 3-8 digit results it had not after 2,000).

What belongs here: enumerating problems and writing the files. Reading and validation live in
``dataset.py``. Run ``python -m verl_core.data.synthetic OUT_DIR`` to write the default splits.
"""

from __future__ import annotations

import argparse
import random
from typing import Callable

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq

from verl_core.store import resolve_storage_options

__all__ = ["DATA_SOURCE", "CALCULATOR_DATA_SOURCE", "OPS", "arithmetic_problems",
           "arithmetic_rows", "calculator_problems", "write_arithmetic_dataset",
           "write_calculator_dataset", "write_guess_dataset", "GUESS_DATA_SOURCE"]

DATA_SOURCE = "synthetic/arithmetic"
"""``data_source`` of every generated row (``reward.scorer=auto`` routes it to arithmetic)."""
CALCULATOR_DATA_SOURCE = "synthetic/calculator"
"""``data_source`` of the calculator task's rows (``reward.scorer=auto``: the calculator
scorer, which reads the response's last line)."""

OPS: dict[str, Callable[[int, int], int]] = {
    "+": lambda a, b: a + b,
    "-": lambda a, b: a - b,
    "*": lambda a, b: a * b,
}
"""Supported operators. Subtraction is generated only for a >= b, so answers are >= 0."""

Problem = tuple[int, str, int, int]  # (a, op, b, answer)

def row_schema(extra_info: list[tuple[str, pa.DataType]]) -> pa.Schema:
    """verl's row layout with ``extra_info`` holding ``split``, ``index`` and these fields."""
    return pa.schema([
        ("data_source", pa.string()),
        ("prompt", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
        ("ability", pa.string()),
        ("reward_model", pa.struct([("style", pa.string()), ("ground_truth", pa.string())])),
        ("extra_info", pa.struct([("split", pa.string()), ("index", pa.int64()),
                                  *extra_info])),
    ])


_SCHEMA = row_schema([("a", pa.int64()), ("b", pa.int64()), ("op", pa.string())])


def arithmetic_problems(max_operand: int, ops: str = "+-") -> list[Problem]:
    """Every problem ``a op b`` with ``0 <= a, b <= max_operand``, in a fixed order (op, a, b).

    Subtraction only where ``a >= b``. E.g. ``max_operand=1, ops="+-"`` gives
    (0+0, 0+1, 1+0, 1+1, 0-0, 1-0, 1-1): 4 sums + 3 differences.
    """
    if isinstance(max_operand, bool) or not isinstance(max_operand, int) or max_operand < 0:
        raise ValueError(f"max_operand={max_operand!r}: must be an int >= 0")
    bad = [o for o in ops if o not in OPS]
    if bad or not ops or len(set(ops)) != len(ops):
        raise ValueError(f"ops={ops!r}: must be distinct characters from {''.join(OPS)!r}")
    out = []
    for op in ops:
        for a in range(max_operand + 1):
            for b in range(max_operand + 1):
                if op == "-" and a < b:
                    continue
                out.append((a, op, b, OPS[op](a, b)))
    return out


CALCULATOR_OPERANDS = (3163, 9999)
"""The calculator task's operand range: 3163 x 3163 is the smallest product with 8 digits."""


def calculator_problems(count: int, seed: int) -> list[Problem]:
    """``count`` distinct products ``a*b`` of operands in :data:`CALCULATOR_OPERANDS` (8-digit
    results), drawn with ``random.Random(seed)``, in draw order."""
    rng, seen, out = random.Random(seed), set(), []
    lo, hi = CALCULATOR_OPERANDS
    while len(out) < count:
        p = (rng.randint(lo, hi), "*", rng.randint(lo, hi))
        if p not in seen:
            seen.add(p)
            out.append((p[0], p[1], p[2], OPS[p[1]](p[0], p[2])))
    return out


def arithmetic_rows(problems: list[Problem], split: str,
                    data_source: str = DATA_SOURCE) -> list[dict]:
    """verl-layout rows for ``problems``; ``extra_info.index`` is the row's position."""
    return [
        {
            "data_source": data_source,
            "prompt": [{"role": "user", "content": f"{a}{op}{b}="}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(ans)},
            "extra_info": {"split": split, "index": i, "a": a, "b": b, "op": op},
        }
        for i, (a, op, b, ans) in enumerate(problems)
    ]


def write_arithmetic_dataset(out_dir: str, *, train_size: int, val_size: int, max_operand: int,
                             seed: int, ops: str = "+-",
                             storage_options: dict | None = None) -> tuple[str, str]:
    """Write ``train.parquet`` and ``val.parquet`` under ``out_dir`` (a path or fsspec URI).

    The problems are shuffled with ``random.Random(seed)``; the first ``val_size`` become the
    held-out split and the next ``train_size`` the training split, so the splits are disjoint
    and the held-out split does not change when only ``train_size`` changes. Same arguments ->
    byte-identical files. Returns ``(train_path, val_path)``.
    """
    if train_size <= 0 or val_size < 0:
        raise ValueError(f"train_size={train_size}, val_size={val_size}: need train_size > 0 "
                         "and val_size >= 0")
    problems = arithmetic_problems(max_operand, ops)
    if train_size + val_size > len(problems):
        raise ValueError(
            f"train_size={train_size} + val_size={val_size} = {train_size + val_size} exceeds the "
            f"{len(problems)} unique problems with max_operand={max_operand}, ops={ops!r}; "
            "raise data.synthetic_max_operand or lower the split sizes")
    order = list(range(len(problems)))
    random.Random(seed).shuffle(order)
    val = [problems[j] for j in order[:val_size]]
    train = [problems[j] for j in order[val_size:val_size + train_size]]
    return _write_splits(out_dir, train, val, DATA_SOURCE, storage_options)


def write_calculator_dataset(out_dir: str, *, train_size: int, val_size: int, seed: int,
                             storage_options: dict | None = None) -> tuple[str, str]:
    """The calculator task's ``train.parquet`` and ``val.parquet`` under ``out_dir``: the first
    ``val_size`` of :func:`calculator_problems` held out, the next ``train_size`` for training
    (disjoint). Returns ``(train_path, val_path)``."""
    if train_size <= 0 or val_size < 0:
        raise ValueError(f"train_size={train_size}, val_size={val_size}: need train_size > 0 "
                         "and val_size >= 0")
    problems = calculator_problems(train_size + val_size, seed)
    return _write_splits(out_dir, problems[val_size:], problems[:val_size],
                         CALCULATOR_DATA_SOURCE, storage_options)


GUESS_DATA_SOURCE = "synthetic/guess"
"""``data_source`` of the guessing game's rows (``reward.scorer=auto``: the guess scorer, the
simulated user's turn scores)."""

_GUESS_SCHEMA = row_schema([("interaction_kwargs", pa.struct([
    ("name", pa.string()), ("target", pa.int64()), ("low", pa.int64()), ("high", pa.int64())]))])


def guess_rows(count: int, seed: int, split: str, low: int, high: int) -> list[dict]:
    """``count`` rows of the guessing game: the prompt ``low-high?`` and a hidden integer in
    ``low``..``high`` (``random.Random(seed)``), given to the scripted user as verl's
    ``extra_info.interaction_kwargs`` (``name: guess``, ``target``, ``low``, ``high``)."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        t = rng.randint(low, high)
        out.append({"data_source": GUESS_DATA_SOURCE,
                    "prompt": [{"role": "user", "content": f"{low}-{high}?"}],
                    "ability": "game",
                    "reward_model": {"style": "rule", "ground_truth": str(t)},
                    "extra_info": {"split": split, "index": i,
                                   "interaction_kwargs": {"name": "guess", "target": t,
                                                          "low": low, "high": high}}})
    return out


def write_guess_dataset(out_dir: str, *, train_size: int, val_size: int, seed: int,
                        low: int = 1, high: int = 7,
                        storage_options: dict | None = None) -> tuple[str, str]:
    """The guessing game's ``train.parquet`` and ``val.parquet`` under ``out_dir`` (hidden
    numbers drawn with two seeds derived from ``seed``). Returns ``(train_path, val_path)``."""
    if train_size <= 0 or val_size < 0:
        raise ValueError(f"train_size={train_size}, val_size={val_size}: need train_size > 0 "
                         "and val_size >= 0")
    return write_row_splits(out_dir, guess_rows(train_size, seed * 2 + 1, "train", low, high),
                            guess_rows(val_size, seed * 2, "val", low, high), _GUESS_SCHEMA,
                            storage_options)


def _write_splits(out_dir: str, train: list[Problem], val: list[Problem], data_source: str,
                  storage_options: dict | None) -> tuple[str, str]:
    return write_row_splits(out_dir, arithmetic_rows(train, "train", data_source),
                            arithmetic_rows(val, "val", data_source), _SCHEMA, storage_options)


def write_row_splits(out_dir: str, train: list[dict], val: list[dict], schema: pa.Schema,
                     storage_options: dict | None) -> tuple[str, str]:
    """Write the rows as ``train.parquet`` and ``val.parquet`` under ``out_dir`` (a path or
    fsspec URI) -> ``(train_path, val_path)``."""
    fs, root = fsspec.core.url_to_fs(out_dir,
                                     **resolve_storage_options(out_dir, storage_options))
    fs.makedirs(root, exist_ok=True)
    paths = []
    for split, rows in (("train", train), ("val", val)):
        path = f"{root.rstrip('/')}/{split}.parquet"
        with fs.open(path, "wb") as f:
            pq.write_table(pa.Table.from_pylist(rows, schema=schema), f)
        # return the caller's spelling (a URI stays a URI; a local path stays a path)
        paths.append(f"{out_dir.rstrip('/')}/{split}.parquet" if "://" in out_dir else path)
    return paths[0], paths[1]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out_dir")
    p.add_argument("--train-size", type=int, default=4000)
    p.add_argument("--val-size", type=int, default=300)
    p.add_argument("--max-operand", type=int, default=30)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--ops", default="+-")
    a = p.parse_args(argv)
    train, val = write_arithmetic_dataset(a.out_dir, train_size=a.train_size, val_size=a.val_size,
                                          max_operand=a.max_operand, seed=a.seed, ops=a.ops)
    print(train)
    print(val)


if __name__ == "__main__":
    main()
