"""``python -m verl_core.checkpoint``: ``verify|export <store> latest`` when ``latest.json`` is
missing or garbage is the newest checkpoint that verifies, named on stderr (issue 21 item 9), never
"no latest checkpoint" while valid ones exist; every option says what it does and an empty store
says it is empty (issue 38)."""

from __future__ import annotations

import argparse
import json
import os

import pytest
import torch

from verl_core.checkpoint import CheckpointNotFoundError
from verl_core.checkpoint.__main__ import main as cli, parser


def _save(manager, model, step):
    with torch.no_grad():  # each step's weights differ, so no object is shared with another step
        for p in model.parameters():
            p.add_(1.0)
    return manager.save(step, {"policy": model.state_dict()},
                        {"hf_config": model.config.to_dict()})


def _damage_latest(store, how):
    path = store.doc_path("latest")
    if how == "missing":
        os.unlink(path)
    else:  # a torn or hand-edited pointer
        open(path, "wb").write(b'{"name": "0000000' if how == "torn" else b"\x00garbage\xff")


@pytest.mark.parametrize("how", ["missing", "torn", "garbage"])
def test_verify_and_export_latest_fall_back_to_the_newest_valid_checkpoint(
        manager, store, tiny_llama, tmp_path, capsys, how):
    model = tiny_llama(seed=5)
    _, second, third = (_save(manager, model, s) for s in (1, 2, 3))
    _, m = manager.read_manifest(third.name)
    sha = next(iter(m["groups"]["policy"]["tensors"].values()))["chunks"][0]["sha"]
    os.unlink(store.object_path(sha))  # step 3 no longer verifies: step 2 is the newest valid
    _damage_latest(store, how)

    assert cli(["verify", store.root, "latest"]) == 0
    out = capsys.readouterr()
    assert out.out.split() == ["OK", second.name]
    assert f"using the newest valid checkpoint {second.name} (step 2)" in out.err

    dest = tmp_path / "hf"
    assert cli(["export", store.root, "latest", str(dest)]) == 0
    out = capsys.readouterr()
    assert f"exported {second.name} (step 2)" in out.out and second.name in out.err
    assert json.loads((dest / "verl_checkpoint.json").read_text())["checkpoint"] == second.name
    assert manager.resolve("latest") == second.name  # the library's latest means the same


def test_a_good_pointer_is_followed_even_to_a_damaged_checkpoint(manager, store, tiny_llama,
                                                                 capsys):
    model = tiny_llama(seed=6)
    _save(manager, model, 1)
    newest = _save(manager, model, 2)
    _, m = manager.read_manifest(newest.name)
    sha = next(iter(m["groups"]["policy"]["tensors"].values()))["chunks"][0]["sha"]
    os.unlink(store.object_path(sha))
    assert cli(["verify", store.root, "latest"]) == 1  # its problems are the news
    out = capsys.readouterr()
    assert f"FAIL {newest.name}" in out.out and sha in out.out and "note:" not in out.err


def test_no_checkpoint_to_fall_back_to_says_why(manager, store, tiny_llama, capsys):
    store.put_json("latest", {"name": "x"})
    with pytest.raises(CheckpointNotFoundError, match="names no checkpoint, and it has no "
                                                      "checkpoints"):
        manager.resolve("latest")
    _save(manager, tiny_llama(seed=7), 1)
    _, m = manager.read_manifest("1")
    for sha in m["objects"]:
        os.unlink(store.object_path(sha))
    _damage_latest(store, "missing")
    assert cli(["verify", store.root, "latest"]) == 2
    err = capsys.readouterr().err
    assert "latest.json is missing" in err and "none of its 1 checkpoint(s) verifies" in err


def test_every_argument_of_every_subcommand_has_a_help_text():
    # the parser objects, not the --help text: argparse prints an option without help too
    subs = next(a for a in parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert set(subs.choices) == {"list", "verify", "export", "gc", "lease"}
    missing = [f"{name} {a.option_strings[0] if a.option_strings else a.dest}"
               for name, sp in subs.choices.items() for a in sp._actions
               if not isinstance(a, argparse._HelpAction) and not (a.help or "").strip()]
    assert missing == []
    for name, sp in subs.choices.items():
        sp.format_help()  # a "%" in a help text would only fail here


def test_list_and_verify_of_an_empty_store_say_it_is_empty(store, capsys):
    store.incarnation_id  # a run store (store.json written) that holds no checkpoint yet
    assert cli(["list", store.root]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and f"no checkpoints in {store.root} " in out
    assert "checkpoint.checkpoint_interval" in out  # where the next one will come from
    assert cli(["verify", store.root]) == 0
    assert capsys.readouterr().out == f"no checkpoints in {store.root} to verify\n"
