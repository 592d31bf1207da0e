"""HF export: the exported folder loads with from_pretrained and gives identical logits."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from verl_core.checkpoint import export_hf, store_tokenizer
from verl_core.checkpoint.__main__ import main as cli


def _save(manager, model, step=1):
    return manager.save(step, {"policy": model.state_dict()},
                        {"hf_config": model.config.to_dict()})


@pytest.mark.slow
def test_cli_export_gives_identical_logits(manager, store, tiny_llama, word_tokenizer,
                                           tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = tiny_llama(seed=3)
    with torch.no_grad():  # make it differ from any fresh init
        for p in model.parameters():
            p.mul_(1.5)
    tok = word_tokenizer()
    store_tokenizer(store, tok)
    info = _save(manager, model)
    out = tmp_path / "hf"
    env = {**os.environ, "PYTHONPATH": os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", "")}
    r = subprocess.run([sys.executable, "-m", "verl_core.checkpoint", "export", store.root,
                        "latest", str(out)], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    assert {"config.json", "model.safetensors", "tokenizer.json",
            "verl_checkpoint.json"} <= set(os.listdir(out))
    assert json.loads((out / "verl_checkpoint.json").read_text())["checkpoint"] == info.name

    loaded = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    ids = torch.randint(0, 128, (3, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)
    tok2 = AutoTokenizer.from_pretrained(str(out))
    assert tok2("1 2 3")["input_ids"] == tok("1 2 3")["input_ids"]


def test_export_tied_embeddings_sharded_and_cli(manager, store, tiny_llama, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    model = tiny_llama(seed=4, tie=True)
    info = _save(manager, model, step=7)
    out = tmp_path / "hf"
    export_hf(manager, "auto", str(out), max_shard_bytes=20_000)  # forces several shards
    assert (out / "model.safetensors.index.json").exists()
    loaded = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    ids = torch.arange(20).reshape(2, 10)
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)
    with pytest.raises(FileExistsError):
        export_hf(manager, "latest", str(out))

    assert cli(["list", store.root]) == 0
    assert info.name in capsys.readouterr().out
    assert cli(["verify", store.root]) == 0
    _, m = manager.read_manifest(info.name)
    sha = next(iter(m["groups"]["policy"]["tensors"].values()))["chunks"][0]["sha"]
    os.unlink(store.object_path(sha))
    assert cli(["verify", store.root, info.name]) == 1
    assert sha in capsys.readouterr().out
    assert cli(["export", store.root, "latest", str(tmp_path / "x")]) == 2  # refused, named
    assert sha in capsys.readouterr().err


def test_export_without_hf_config_is_refused(manager, tmp_path):
    manager.save(1, {"policy": {"w": torch.zeros(2)}}, {})
    with pytest.raises(Exception, match="hf_config"):
        export_hf(manager, "latest", str(tmp_path / "o"))
    assert not (tmp_path / "o").exists()
