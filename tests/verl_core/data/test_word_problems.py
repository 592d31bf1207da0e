"""The GSM8K-style word problems (verl_core/data/word_problems.py): verl's row layout, answers the
gsm8k scorer accepts, seeded and disjoint splits."""
import re

import pytest

from verl_core.data.dataset import load_prompt_rows
from verl_core.data.word_problems import INSTRUCTION, word_problems, write_word_problem_dataset
from verl_core.reward.gsm8k import compute_score


def test_every_solution_is_right_by_its_own_arithmetic_and_scores_1():
    for p in word_problems(300, seed=3):
        for line in p.steps:  # each step's arithmetic, recomputed: "a op b = c"
            a, op, b, c = re.search(r"(\d+) ([-+*/]) (\d+) = (\d+)", line).groups()
            assert eval(f"{a}{op}{b}") == int(c), line  # noqa: S307 - digits and one operator
        assert p.steps[-1].split(" = ")[1].split()[0].rstrip(".") == str(p.answer)
        assert p.answer >= 0
        assert compute_score(p.solution, str(p.answer)) == 1.0
        assert compute_score(p.solution, str(p.answer + 1)) == 0.0


def test_step_counts_are_even_and_problems_distinct():
    ps = word_problems(90, seed=1)
    assert [len(p.steps) for p in ps].count(1) == [len(p.steps) for p in ps].count(3) == 30
    assert len({p.question for p in ps}) == 90
    with pytest.raises(ValueError, match="steps"):
        word_problems(3, seed=1, steps=(4,))


def test_dataset_in_verls_layout_seeded_and_disjoint(tmp_path):
    train, val = write_word_problem_dataset(str(tmp_path / "a"), train_size=40, val_size=20,
                                            seed=7)
    again = write_word_problem_dataset(str(tmp_path / "b"), train_size=80, val_size=20, seed=7)
    assert open(val, "rb").read() == open(again[1], "rb").read()  # held-out split unchanged
    tr, va = load_prompt_rows([train]), load_prompt_rows([val])
    assert len(tr) == 40 and len(va) == 20
    assert not {r.messages[0][1] for r in tr} & {r.messages[0][1] for r in va}
    row = va[0]
    assert row.data_source == "openai/gsm8k" and row.messages[0][1].endswith(INSTRUCTION)
    assert row.extra_info["answer"].endswith(f"#### {row.ground_truth}")


def test_the_task_is_for_a_model_you_bring(tmp_path):
    from verl_core.config import ConfigError, preset

    with pytest.raises(ConfigError, match="word_problems.*give --model"):
        preset("grpo", **{"data.synthetic_task": "word_problems"})
    cfg = preset("grpo", **{"data.synthetic_task": "word_problems", "model.path": str(tmp_path)})
    assert cfg.data.synthetic_task == "word_problems"
