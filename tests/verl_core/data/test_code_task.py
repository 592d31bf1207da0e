"""The coding task (``data/code_task.py``): verl's row layout, seeded files, tests that the
reference solution passes, prompts that fit the tiny model, and its preset."""

import pyarrow.parquet as pq

from verl_core.config import CODE_DEFAULTS, preset
from verl_core.data.code_task import DATA_SOURCE, NUM_TESTS, code_problems, write_code_dataset
from verl_core.data.dataset import load_prompt_rows
from verl_core.reward.code import parse_tests
from verl_core.reward.manager import RewardScorer


def test_rows_are_verl_rows_and_seeded(tmp_path):
    a = write_code_dataset(str(tmp_path / "a"), train_size=40, val_size=8, seed=3)
    b = write_code_dataset(str(tmp_path / "b"), train_size=20, val_size=8, seed=3)
    assert open(a[1], "rb").read() == open(b[1], "rb").read()  # held-out: train size aside
    rows = load_prompt_rows([a[0]])
    assert len(rows) == 40 and {r.data_source for r in rows} == {DATA_SOURCE}
    row = pq.read_table(a[0]).to_pylist()[0]
    assert row["reward_model"]["style"] == "rule" and row["ability"] == "code"
    assert row["prompt"][0]["role"] == "user"
    tests = parse_tests(row["reward_model"]["ground_truth"])
    assert tests.kind == "assert" and len(tests.tests) == NUM_TESTS
    assert all(t.startswith(f"assert {row['extra_info']['fn_name']}(") for t in tests.tests)


def test_the_reference_solutions_pass_their_tests():
    problems = code_problems(24, seed=0)
    assert max(len(p.prompt) for p in code_problems(2000, seed=1)) <= 63  # + <bos> <= 64
    with RewardScorer("auto", sandbox_max_concurrent=2) as rs:
        res = rs.score([DATA_SOURCE] * 24, [p.solution for p in problems],
                       ["\n".join(p.tests) for p in problems])
    assert res.scores == [1.0] * 24


def test_the_preset_fits_the_tiny_model():
    cfg = preset("grpo", **{"data.synthetic_task": "code"})
    assert cfg.rollout.max_new_tokens == CODE_DEFAULTS["rollout.max_new_tokens"]
    assert cfg.data.max_prompt_length + cfg.rollout.max_new_tokens <= 128
    assert cfg.model.warmup_sft_steps == 0
    # a model you bring gets verl's sizes instead
    assert preset("grpo", **{"data.synthetic_task": "code",
                             "model.path": "/m"}).rollout.max_new_tokens == 512
