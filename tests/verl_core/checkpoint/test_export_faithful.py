"""A faithful Hugging Face export (issue 23 item 5), on the Qwen2.5 (float32, tied, pad token) and
Llama-3.1 (bfloat16 shards, untied, no pad token, three EOS ids) stand-ins.

The export writes the user's ``generation_config.json`` and tokenizer files byte for byte, keeps
tied weights tied, and writes the folder's stored dtype unless ``--dtype`` says otherwise. Round
trip: a perturbed float32 "trained" state -> checkpoint -> CLI export -> ``from_pretrained``. The
only rounding on the way is the cast to the export dtype: the exported tensors are
``state.to(dtype)`` bit for bit, so the loaded model's logits equal those of the state cast to that
dtype exactly (tolerance 0, same weights and the same kernels on this machine), and each weight is
within bfloat16's unit roundoff 2^-8 (8-bit significand counting the implicit bit, round to
nearest: u = 2^(1-8) / 2) of the state's, relative.
"""
from __future__ import annotations

import json
import os

import pytest
import torch

from tests.standins import folder_eos_ids, llama3_folder, qwen_folder
from verl_core.checkpoint import CheckpointManager, RunStore, store_tokenizer
from verl_core.checkpoint.__main__ import main as cli
from verl_core.checkpoint.hf_export import export_trained, model_folder_files
from verl_core.models import load_causal_lm

STANDINS = {"qwen": (qwen_folder, torch.float32), "llama3": (llama3_folder, torch.bfloat16)}
IDS = torch.tensor([[5, 17, 42, 99, 7, 250, 3, 64]])


@pytest.fixture(scope="module", params=sorted(STANDINS))
def run(request, tmp_path_factory):
    """(name, source folder, store, trained model): a checkpoint of a perturbed state in a store
    that recorded the source folder as the worker does."""
    tmp = tmp_path_factory.mktemp(request.param)
    build, _ = STANDINS[request.param]
    src = build(tmp / "src", **({"shards": 3} if request.param == "llama3" else {}))
    store = RunStore(str(tmp / "store"))
    store_tokenizer(store, str(src))  # what the leader worker records once per run
    model = load_causal_lm(str(src), "float32")  # the float32 master weights training updates
    with torch.no_grad():  # a trained state: differs from the folder's weights
        g = torch.Generator().manual_seed(1)
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.02)
    CheckpointManager(store, gc_grace_s=0.0).save(
        3, {"policy": model.state_dict()}, {"hf_config": model.config.to_dict()})
    return request.param, src, store, model


def _weights(folder) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            out.update(load_file(os.path.join(folder, name)))
    return out


def _weight_bytes(folder) -> int:
    return sum(os.path.getsize(os.path.join(folder, n)) for n in os.listdir(folder)
               if n.endswith(".safetensors"))


def _logits(model):
    with torch.no_grad():
        return model.eval()(IDS).logits


def _state_in(src, model, dtype):
    """The trained state cast to ``dtype`` in a model built as ``from_pretrained`` builds one in
    ``dtype`` (its rotary buffers stay float32, as a plain ``.to(dtype)`` would not keep them)."""
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(str(src), dtype=dtype)
    ref.load_state_dict({k: v.to(dtype) for k, v in model.state_dict().items()})
    return ref


def test_cli_export_is_faithful_to_the_users_folder(run, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    name, src, store, model = run
    stored = STANDINS[name][1]
    out = tmp_path / "hf"
    assert cli(["export", store.root, "latest", str(out)]) == 0
    # generation config and tokenizer files: the user's bytes (the EOS list, no added pad token)
    given = model_folder_files(str(src))
    assert {"generation_config.json", "tokenizer.json", "tokenizer_config.json"} <= set(given)
    for f, data in given.items():
        assert (out / f).read_bytes() == data, f
    assert folder_eos_ids(out) == folder_eos_ids(src)
    tok = AutoTokenizer.from_pretrained(str(out))
    assert tok.pad_token == ({"qwen": "<|endoftext|>", "llama3": None}[name])
    # tied weights stay tied: the embedding once (Qwen); untied Llama keeps its own LM head
    weights = _weights(out)
    assert ("lm_head.weight" in weights) == (name == "llama3")
    # the folder's stored dtype, in the weights and in config.json
    assert {w.dtype for w in weights.values()} == {stored}
    assert json.loads((out / "config.json").read_text())["dtype"] == str(stored)[6:]
    state = model.state_dict()
    for k, w in weights.items():
        assert torch.equal(w, state[k].to(stored)), k  # the cast is the only change
        if stored == torch.bfloat16:  # round to nearest, 8-bit significand: |err| <= 2^-8 |x|
            assert ((w.float() - state[k]).abs() <= state[k].abs() * 2.0 ** -8).all(), k
    loaded = AutoModelForCausalLM.from_pretrained(str(out))  # dtype="auto": the stored one
    assert loaded.dtype == stored
    assert torch.equal(_logits(loaded), _logits(_state_in(src, model, stored)))


def test_dtype_flag_and_sizes(run, tmp_path):
    from transformers import AutoModelForCausalLM

    name, _, store, model = run
    sizes = {}
    for dtype in ("float32", "bfloat16"):
        out = tmp_path / dtype
        assert cli(["export", store.root, "latest", str(out), "--dtype", dtype]) == 0
        sizes[dtype] = _weight_bytes(out)
        loaded = AutoModelForCausalLM.from_pretrained(str(out))
        assert loaded.dtype == getattr(torch, dtype)
        if dtype == "float32":  # the float32 master weights, exactly
            assert torch.equal(_logits(loaded), _logits(model))
    # every tensor is floating: half the bytes, up to the safetensors headers (a few KB)
    assert abs(sizes["bfloat16"] / sizes["float32"] - 0.5) < 0.01, sizes
    # no second copy of a tied embedding: Qwen's weights are those of its distinct parameters
    distinct = sum(p.numel() for p in model.parameters())  # parameters() yields a tied one once
    assert sizes["float32"] < distinct * 4 * 1.01


def test_final_model_and_finalize_write_the_same_folder(run, tmp_path):
    """``export_trained`` (the plain loop's final_model and the workflow's finalize) and the CLI
    export of the same state write the same files."""
    _, src, store, model = run
    export_trained(model, str(tmp_path / "final"), str(src))
    assert cli(["export", store.root, "latest", str(tmp_path / "cli")]) == 0
    final, cli_out = sorted(os.listdir(tmp_path / "final")), sorted(os.listdir(tmp_path / "cli"))
    assert final == [f for f in cli_out if f not in ("verl_checkpoint.json", "verl_export.json")]
    for f in final:
        assert (tmp_path / "final" / f).read_bytes() == (tmp_path / "cli" / f).read_bytes(), f
