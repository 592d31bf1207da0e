"""The synthetic arithmetic task: complete enumeration, correct answers, disjoint deterministic
splits, and files that load through the verl-layout reader."""

import pytest

from verl_core.data.dataset import load_prompt_rows
from verl_core.data.synthetic import DATA_SOURCE, arithmetic_problems, write_arithmetic_dataset


def test_enumeration_hand_count():
    # max_operand=1: sums 0+0, 0+1, 1+0, 1+1 (4); differences with a >= b: 0-0, 1-0, 1-1 (3)
    assert arithmetic_problems(1, "+-") == [
        (0, "+", 0, 0), (0, "+", 1, 1), (1, "+", 0, 1), (1, "+", 1, 2),
        (0, "-", 0, 0), (1, "-", 0, 1), (1, "-", 1, 0),
    ]
    # max_operand=30: 31*31 sums + 31*32/2 differences = 961 + 496
    assert len(arithmetic_problems(30)) == 1457
    assert len(arithmetic_problems(3, "*")) == 16


def test_answers_correct_unique_and_non_negative():
    probs = arithmetic_problems(12, "+-*")
    assert len({(a, op, b) for a, op, b, _ in probs}) == len(probs)
    for a, op, b, ans in probs:
        assert ans == {"+": a + b, "-": a - b, "*": a * b}[op] and ans >= 0


@pytest.mark.parametrize("kw,match", [
    ({"max_operand": -1}, "max_operand"),
    ({"max_operand": 3, "ops": "/"}, "ops"),
    ({"max_operand": 3, "ops": "++"}, "ops"),
])
def test_bad_arguments(kw, match):
    with pytest.raises(ValueError, match=match):
        arithmetic_problems(**kw)


def test_splits_disjoint_deterministic_and_loadable(tmp_path):
    kw = dict(train_size=300, val_size=100, max_operand=20, seed=7)  # 672 problems
    train, val = write_arithmetic_dataset(str(tmp_path / "a"), **kw)
    train2, val2 = write_arithmetic_dataset(str(tmp_path / "b"), **kw)
    with open(train, "rb") as f1, open(train2, "rb") as f2:
        assert f1.read() == f2.read()  # same seed -> byte-identical files
    with open(val, "rb") as f1, open(val2, "rb") as f2:
        assert f1.read() == f2.read()

    tr, va = load_prompt_rows(train), load_prompt_rows(val)
    assert (len(tr), len(va)) == (300, 100)
    prompts_tr, prompts_va = {r.messages for r in tr}, {r.messages for r in va}
    assert len(prompts_tr) == 300 and len(prompts_va) == 100 and not prompts_tr & prompts_va
    for split, rows in (("train", tr), ("val", va)):
        for i, r in enumerate(rows):
            x = r.extra_info
            assert r.data_source == DATA_SOURCE and r.ability == "math"
            assert x["split"] == split and x["index"] == i
            assert r.messages == (("user", f"{x['a']}{x['op']}{x['b']}="),)
            assert r.ground_truth == str(x["a"] + x["b"] if x["op"] == "+" else x["a"] - x["b"])


def test_seed_changes_order_and_val_is_stable_across_train_sizes(tmp_path):
    def val_prompts(d, seed, train_size):
        _, val = write_arithmetic_dataset(str(tmp_path / d), train_size=train_size, val_size=50,
                                          max_operand=10, seed=seed)
        return [r.messages for r in load_prompt_rows(val)]

    assert val_prompts("s1", 1, 20) == val_prompts("s1b", 1, 60)
    assert val_prompts("s1", 1, 20) != val_prompts("s2", 2, 20)


def test_too_many_rows_is_a_clear_error(tmp_path):
    # max_operand=3: 16 sums + 10 differences = 26 unique problems
    with pytest.raises(ValueError, match=r"= 27 exceeds the 26 unique problems"):
        write_arithmetic_dataset(str(tmp_path), train_size=20, val_size=7, max_operand=3, seed=0)


def test_fsspec_out_dir():
    train, val = write_arithmetic_dataset("memory://synthetic/run1", train_size=10, val_size=5,
                                          max_operand=5, seed=0)
    assert train == "memory://synthetic/run1/train.parquet"
    assert len(load_prompt_rows([train, val])) == 15


def test_cli(tmp_path, capsys):
    from verl_core.data.synthetic import main

    main([str(tmp_path), "--train-size", "10", "--val-size", "5", "--max-operand", "4"])
    train, val = capsys.readouterr().out.split()
    assert len(load_prompt_rows(train)) == 10 and len(load_prompt_rows(val)) == 5
