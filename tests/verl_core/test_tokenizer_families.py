"""The tokenizer families of issue 23 that the other stand-in runs do not reach, one RL step each
through the plain loop: a tokenizer without a chat template (Qwen-style, no BOS; Llama-3-style,
whose post-processor adds the BOS) and one without a pad token (the Llama-3 stand-in: the loader
pads with its EOS ``<|eot_id|>``, so a padded position looks like a stop token). The templated
Llama-3 run with no pad token is test_watching's; the templated Qwen run is test_quickstart's."""
from __future__ import annotations

import pytest

from tests.standins import gsm8k_parquet, gsm8k_rows, llama3_folder, qwen_folder
from tests.verl_core.test_watching import _printed_samples
from verl_core.config import preset
from verl_core.models.loading import load_tokenizer
from verl_core.train import train

FAMILIES = {  # name: (folder builder, the BOS the tokenizer itself adds to a plain prompt)
    "qwen-no-template": (lambda p: qwen_folder(p, chat_template=None), ""),
    "llama3-no-template-no-pad": (lambda p: llama3_folder(p, chat_template=None, shards=2),
                                  "<|begin_of_text|>"),
}


@pytest.mark.parametrize("family", FAMILIES)
def test_one_step_through_the_plain_loop(family, tmp_path, monkeypatch):
    monkeypatch.setenv("VERL_ASSET_CACHE", str(tmp_path / "assets"))
    build, bos = FAMILIES[family]
    model = build(tmp_path / family)
    tok = load_tokenizer(str(model))
    assert not tok.chat_template
    cfg = preset("grpo", **{
        "model.path": str(model), "data.train_files": str(gsm8k_parquet(tmp_path / "t.parquet", 4)),
        "data.val_files": str(gsm8k_parquet(tmp_path / "v.parquet", 2, split="test", seed=2)),
        "total_steps": 1, "data.train_batch_size": 2, "rollout.n": 2,
        "actor.ppo_mini_batch_size": 2, "rollout.max_new_tokens": 6,
        "data.max_prompt_length": 128, "num_threads": 1})
    lines: list[str] = []
    summary = train(cfg, str(tmp_path / "work"), log=lines.append)
    assert [h["step"] for h in summary["history"]] == [1]
    assert 0.0 <= summary["history"][0]["reward/mean"] <= 1.0
    samples = _printed_samples(lines)
    assert len(samples) == 2  # before step 1 and after it
    rows = gsm8k_rows(2, split="test", seed=2)
    first, second = (r["prompt"][0]["content"] for r in rows)
    # the printed row is the shorter prompt of its batch: it was left-padded with the pad id
    # (without a pad token: the EOS), and the padding must not show as part of the prompt
    assert len(tok(first)["input_ids"]) < len(tok(second)["input_ids"])
    for s in samples:
        # no template: the message content as it is, with only the tokenizer's own BOS (if any)
        assert s["prompt"] == bos + first, s["prompt"][:120]
        assert s["ground_truth"] == rows[0]["reward_model"]["ground_truth"]
