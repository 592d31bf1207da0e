"""Watching a run (issue 23): each evaluation prints its first held-out row as verl's reward
manager does (``[prompt]``, ``[response]``, ``[ground_truth]``, ``[score]``), decoded with the
special tokens visible, so a doubled BOS or a missing EOS is seen at the first evaluation; and the
console stays quiet otherwise (the ETA counts steps, not evaluations; no Ray banner).
The Deck side of the sample is in test_report.py."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.standins import gsm8k_parquet, gsm8k_rows, llama3_folder
from verl_core import report
from verl_core.config import preset
from verl_core.train import eta_s, format_step, train

FIELDS = ("[prompt] ", "[response] ", "[ground_truth] ", "[score] ")


def _printed_samples(lines: list[str]) -> list[dict]:
    """The samples in a run's log: each is one logged string, its four fields in order."""
    out = []
    for text in lines:
        if not text.startswith(FIELDS[0]):
            continue
        # the prompt may span lines (a chat template); each later field starts its own line
        rest, fields = text, {}
        for name, nxt in zip(FIELDS, (*FIELDS[1:], None)):
            assert rest.startswith(name), (name, text)
            cut = rest.index("\n" + nxt) if nxt else len(rest)
            fields[name.strip("[] ")], rest = rest[len(name):cut], rest[cut + 1:]
        out.append(fields)
    return out


def test_plain_loop_prints_the_first_held_out_row_with_one_bos(tmp_path, monkeypatch):
    """A Llama-3-style folder (the template writes ``{{ bos_token }}``, the tokenizer's
    post-processor would add another): the printed prompt starts with exactly one BOS."""
    monkeypatch.setenv("VERL_ASSET_CACHE", str(tmp_path / "assets"))
    model = llama3_folder(tmp_path / "llama", shards=2)
    train_file = gsm8k_parquet(tmp_path / "train.parquet", 4)
    val_file = gsm8k_parquet(tmp_path / "val.parquet", 2, split="test", seed=1)
    cfg = preset("grpo", **{
        "model.path": str(model), "data.train_files": str(train_file),
        "data.val_files": str(val_file), "total_steps": 1, "data.train_batch_size": 2,
        "rollout.n": 2, "actor.ppo_mini_batch_size": 2, "actor.ppo_micro_batch_size": 4,
        "rollout.max_new_tokens": 4, "data.max_prompt_length": 256, "optim.lr": 1e-6,
        "num_threads": 1})
    lines: list[str] = []
    train(cfg, str(tmp_path / "work"), log=lines.append)
    samples = _printed_samples(lines)
    assert len(samples) == 2  # the evaluation before step 1 and the one after it
    first_val = gsm8k_rows(2, split="test", seed=1)[0]
    for s in samples:
        assert s["prompt"].startswith("<|begin_of_text|>"), s["prompt"][:80]
        assert s["prompt"].count("<|begin_of_text|>") == 1, s["prompt"][:80]
        # the chat template's own tokens are shown, not just the message contents
        assert "<|start_header_id|>user<|end_header_id|>" in s["prompt"]
        assert first_val["prompt"][0]["content"] in s["prompt"]
        assert s["ground_truth"] == first_val["reward_model"]["ground_truth"]
        assert float(s["score"]) in (0.0, 1.0)


def test_eta_counts_step_times_not_the_first_evaluation():
    # the issue's run: a 56-s start evaluation, then 15-s steps. Before, step 1's ETA was the
    # time since the start (56 + 15 = 71 s) per step done, times the steps left
    assert eta_s([15.0], 1) == 15.0
    assert eta_s([15.0], 9) == 135.0  # not 71 x 9 = 639
    assert eta_s([10.0, 20.0], 3) == 45.0  # the mean step time x the steps left
    assert eta_s([], 3) == 0.0
    m = {"step": 2, "reward/mean": 0.5, "response_length/mean": 3.0, "timing/step_s": 20.0}
    assert format_step(m, 5, [10.0, 20.0]).endswith("20.00s/step ETA 45s")


def test_one_of_our_errors_is_one_line_under_pyflyte():
    """What pyflyte prints for a task's PermanentError (or an input error): the task and our
    message, with flytekit's prefix and its line wrapping gone (the real run: test_configure)."""
    from verl_core.config import ConfigError
    from verl_core.errors import PermanentError
    from workflows._cli import one_line

    e = ConfigError("Error encountered while executing 'ppo':\n  Error encountered while "
                    "executing 'tasks.prepare.configure':\n  optim.lr=nan: must be a finite\n"
                    "number")
    assert one_line(e) == " in tasks.prepare.configure: optim.lr=nan: must be a finite number"
    assert one_line(PermanentError("checkpoint 4 is corrupt")) == ": checkpoint 4 is corrupt"
    assert one_line(RuntimeError("a bug")) is None  # keeps flytekit's traceback


@pytest.mark.slow  # starts a local Ray instance (~5-10 s)
def test_local_ray_starts_without_the_token_auth_banner(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_AUTH_MODE", "RAY_ADDRESS")}
    env["HOME"] = str(tmp_path)  # Ray's token goes to ~/.ray/auth_token
    code = ("import os, ray\nfrom verl_core.engine import workers\nworkers.start_local_ray()\n"
            "print('auth mode', os.environ.get('RAY_AUTH_MODE'))\nray.shutdown()\n")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=180, cwd=os.path.dirname(os.path.dirname(os.path.dirname(
                             os.path.abspath(__file__)))))
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-3000:]
    assert "auth mode token" in out.stdout  # Ray's default for a new local instance stands
    assert "Token authentication" not in text, text[-3000:]


def test_sample_lines_are_verls_four_fields():
    s = {"step": 3, "prompt": "<bos>12+7=", "response": "19<eos>", "ground_truth": "19",
         "score": 1.0}
    assert report.sample_lines(s) == "[prompt] <bos>12+7=\n[response] 19<eos>\n" \
                                     "[ground_truth] 19\n[score] 1.0"
    assert report.watched_sample([{**s, "step": 0}, s, {**s, "step": 3, "prompt": "x"}]) == s
