"""A resume never silently starts over (issue 40): a command whose trajectory settings differ from
the run's checkpoints is refused before any work, naming each changed key with its old and new
value; ``checkpoint.resume_from_checkpoint=none`` starts the new settings beside the old ones, and
later commands with them resume their own checkpoints. A checkpoint skipped on resume says why."""
import json
import logging
import re

import pytest

from tests.presets import TINY, tiny_run
from verl_core.prepare import TrajectoryChangedError, trajectory_changes
from verl_core.train import main, train

FAST = {"total_steps": 1, "checkpoint.checkpoint_interval": 1, "val_before_train": False,
        "model.lora_rank": 4, "model.lora_alpha": 8.0}


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    store = tmp_path_factory.mktemp("traj") / "store"
    train(tiny_run(**FAST), str(store), log=lambda *_: None)
    return store


@pytest.mark.parametrize("change, named", [
    ({"model.lora_rank": 8}, "model.lora_rank: 4 -> 8"),
    ({"model.lora_alpha": 16.0}, "model.lora_alpha: 8.0 -> 16.0"),
    ({"model.lora_rank": 0}, "model.lora_rank: 4 -> 0"),
    ({"optim.lr": 3e-6}, "optim.lr: 0.0005 -> 3e-06"),
])
def test_a_changed_setting_is_refused_naming_the_key(finished, change, named):
    before = sorted(p.relative_to(finished) for p in finished.rglob("*"))
    with pytest.raises(TrajectoryChangedError, match="its newest checkpoint \\(step 1\\) is of "
                       "another trajectory") as e:
        train(tiny_run(**{**FAST, "total_steps": 2, **change}), str(finished),
              log=lambda *_: None)
    assert named in str(e.value) and "=none to start them from step 0" in str(e.value)
    # before any work: no warm start, no asset record, no checkpoint, nothing else written
    after = sorted(p.relative_to(finished) for p in finished.rglob("*")
                   if "lease" not in str(p) and "runlog" not in str(p))
    assert set(after) <= set(before), set(after) - set(before)


def test_the_same_settings_resume_and_none_starts_the_new_ones_beside(finished, tmp_path):
    summary = train(tiny_run(**{**FAST, "total_steps": 2}), str(finished), log=lambda *_: None)
    assert [h["step"] for h in summary["history"]] == [2]  # step 1 resumed, not retrained
    other = {**FAST, "model.lora_rank": 8, "total_steps": 1}
    train(tiny_run(**other, **{"checkpoint.resume_from_checkpoint": "none"}), str(finished),
          log=lambda *_: None)
    # recorded now: the new settings resume their own checkpoint, the old ones theirs
    again = train(tiny_run(**{**other, "total_steps": 2}), str(finished), log=lambda *_: None)
    assert [h["step"] for h in again["history"]] == [2]


def test_the_cli_says_it_in_one_line_with_exit_2(finished, capsys):
    settings = {**TINY, **FAST, "model.lora_rank": 16}
    settings.pop("total_steps")
    capsys.readouterr()
    assert main(["--workdir", str(finished), "--steps", "3",
                 *[a for k, v in settings.items() for a in ("--set", f"{k}={json.dumps(v)}")]]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is of another trajectory" in err[0], err
    assert re.search(r"model.lora_rank: \d+ -> 16", err[0]), err


def test_trajectory_changes_lists_each_key_once():
    assert trajectory_changes({"a": 1, "s": {"b": 2, "c": 3}}, {"a": 1, "s": {"b": 5}, "d": 0}) \
        == ["d: '(not set)' -> 0", "s.b: 2 -> 5", "s.c: 3 -> '(not set)'"]


def test_a_skipped_checkpoint_says_why(finished, caplog):
    from verl_core.prepare import resume_step
    from verl_core.store import RunStore

    with caplog.at_level(logging.WARNING, logger="verl_core.prepare"):
        resume_step(RunStore(str(finished)), tiny_run(**{**FAST, "model.lora_rank": 2}))
    assert "not usable for resume: of another trajectory" in caplog.text
