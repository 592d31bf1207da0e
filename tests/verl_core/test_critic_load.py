"""The critic loads from a causal-LM folder quietly, and a folder missing backbone weights is
refused (the value head is the only thing allowed to be missing)."""

from __future__ import annotations

import pytest
from safetensors.torch import load_file, save_file

from standins import qwen_folder
from verl_core.models.loading import ModelLoadError, load_critic


def test_critic_loads_without_transformers_load_report(tmp_path, capfd):
    model = load_critic(str(qwen_folder(tmp_path / "qwen")))
    assert model.score.weight.shape[0] == 1
    out = capfd.readouterr()
    assert "LOAD REPORT" not in out.out + out.err


def test_a_missing_backbone_weight_is_refused_naming_it(tmp_path):
    folder = qwen_folder(tmp_path / "qwen")
    tensors = load_file(folder / "model.safetensors")
    gone = "model.layers.1.mlp.up_proj.weight"
    del tensors[gone]
    save_file({k: v.contiguous() for k, v in tensors.items()}, folder / "model.safetensors",
              metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"up_proj.*random noise"):
        load_critic(str(folder))


def test_the_policy_refuses_a_missing_weight_too(tmp_path):
    from verl_core.models.loading import load_causal_lm

    folder = qwen_folder(tmp_path / "qwen")
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.norm.weight"]
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"model\.norm\.weight.*random noise"):
        load_causal_lm(str(folder))
