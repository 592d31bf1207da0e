"""prepare_assets: every dataset file is checked before the warm start (no model work first)."""
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from verl_core.config import preset
from verl_core.data.batch import PromptTooLongError
from verl_core.data.dataset import DatasetError, load_prompt_rows
from verl_core.prepare import prepare_run
from verl_core.models.tokenizer import build_char_tokenizer
from verl_core.train import main
from verl_core.assets import prepare_assets
from verl_core.data.prompts import load_checked_rows


def _row(content="12+7=", gt="19"):
    return {"data_source": "synthetic/arithmetic",
            "prompt": [{"role": "user", "content": content}],
            "reward_model": {"style": "rule", "ground_truth": gt}}


def _write(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), str(path))
    return str(path)


def _bad_file(tmp_path, kind):
    """A file whose row 2 (0-based) is bad in the way ``kind`` says, or which lacks a column."""
    good = [_row(f"{a}+1=", str(a + 1)) for a in range(2)]
    if kind == "bad_row":
        return _write(tmp_path / "bad.parquet", good + [_row(content="")]), "row 2", "'prompt'"
    if kind == "missing_column":
        rows = [{k: v for k, v in r.items() if k != "reward_model"} for r in good]
        return _write(tmp_path / "bad.parquet", rows), "missing column", "reward_model"
    assert kind == "long_prompt"
    return _write(tmp_path / "bad.parquet", good + [_row("9" * 200, "1")]), "row 2", "'prompt'"


# (A train file's bad row or missing column was already refused before the warm start, which
# reads the train rows; the val files and prompt lengths were checked only after it.)
@pytest.mark.parametrize("kind,which", [("bad_row", "val"), ("missing_column", "val"),
                                        ("long_prompt", "train"), ("long_prompt", "val")])
def test_bad_dataset_file_is_refused_before_the_warm_start(tmp_path, kind, which):
    bad, where, column = _bad_file(tmp_path, kind)
    good = _write(tmp_path / "good.parquet", [_row(f"{a}+2=", str(a + 2)) for a in range(64)])
    files = {"train": good, "val": good, which: bad}
    # Enough warm-start steps that running them first would be slow; the check needs no model.
    cfg = preset("grpo", **{"data.train_files": files["train"], "data.val_files": files["val"],
                            "model.warmup_sft_steps": 2000, "model.warmup_target_accuracy": 1.0})
    logs = []
    t0 = time.perf_counter()
    with pytest.raises((DatasetError, PromptTooLongError)) as e:
        prepare_assets(cfg, str(tmp_path / "work"), log=logs.append)
    assert time.perf_counter() - t0 < 5
    msg = str(e.value)
    assert bad in msg and where in msg and column in msg, msg
    assert not logs and not (tmp_path / "work" / "model").exists()  # no warm start, no model


def test_prepare_run_refuses_a_bad_val_file_before_publishing(tmp_path):
    bad, _, _ = _bad_file(tmp_path, "long_prompt")
    good = _write(tmp_path / "good.parquet", [_row()] * 64)  # a full batch (64 prompts)
    cfg = preset("grpo", **{"data.train_files": good, "data.val_files": bad,
                            "model.warmup_sft_steps": 2000, "model.warmup_target_accuracy": 1.0})
    logs = []
    with pytest.raises(PromptTooLongError, match=rf"{bad}: row 2 \(0-based\), column 'prompt' "
                                                 r"has 201 tokens > data.max_prompt_length=64"):
        prepare_run(cfg, str(tmp_path / "store"), "r", log_fn=logs.append)
    assert not logs


def test_cli_names_the_bad_file_and_exits_2(tmp_path, capsys):
    bad, _, _ = _bad_file(tmp_path, "bad_row")
    good = _write(tmp_path / "good.parquet", [_row()] * 64)  # a full batch (64 prompts)
    rc = main(["--train-files", good, "--val-files", bad, "--workdir", str(tmp_path / "w"),
               "--set", "model.warmup_target_accuracy=1.0"])
    out = capsys.readouterr()
    assert rc == 2 and bad in out.err and "row 2" in out.err, out.err
    assert "warm start" not in out.out


def test_checked_rows_are_the_loaded_rows(tmp_path):
    a = _write(tmp_path / "a.parquet", [_row("1+1=", "2"), _row("2+3=", "5")])
    b = _write(tmp_path / "b.parquet", [_row("7-4=", "3")])
    assert load_checked_rows(build_char_tokenizer(), [a, b], 64) == load_prompt_rows([a, b])


def test_long_prompts_are_cut_as_data_truncation_says(tmp_path):
    """verl's data.truncation=left: the dataset suite and the prompt check let the long row
    through, and the trainer encodes its last data.max_prompt_length tokens (the question's end
    and the chat's assistant header, where the model answers from)."""
    from verl_core.data.dataset import render_prompt
    from verl_core.trainer import RLTrainer

    long_row = _row("9" * 200 + "+1=", "1")
    f = _write(tmp_path / "long.parquet", [_row(f"{a}+1=", str(a + 1)) for a in range(15)] +
               [long_row])
    cfg = preset("grpo", **{"data.train_files": f, "data.val_files": f,
                            "data.max_prompt_length": 32, "data.truncation": "left",
                            "data.train_batch_size": 4, "actor.ppo_mini_batch_size": 4,
                            "model.warmup_sft_steps": 2, "model.warmup_target_accuracy": 1.0,
                            "num_threads": 1})
    assets = prepare_assets(cfg, str(tmp_path / "work"), log=lambda *_: None)
    trainer = RLTrainer(cfg, assets)
    try:
        tok = trainer.tokenizer
        [row] = [r for r in trainer.prompts.train_rows if r.index == 15]
        want = tok(render_prompt(row, tok))["input_ids"][-32:]
        ids, mask = trainer.prompts.train_ids[15], trainer.prompts.train_mask[15]
        assert ids.shape[0] == 32 and ids[mask.bool()].tolist() == want
    finally:
        trainer.close()
    with pytest.raises(PromptTooLongError, match="data.truncation=left"):  # the default refuses
        prepare_assets(preset("grpo", **{"data.train_files": f, "data.val_files": f,
                                         "data.max_prompt_length": 32}), str(tmp_path / "w2"))
