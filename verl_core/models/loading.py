"""Load any Hugging Face causal LM, its tokenizer, and a critic initialised from it.

Only local folders are loaded (``local_files_only=True``): a training job must never reach out to
a hub at run time. Store URIs are materialised into a local folder by the caller first.
"""

from __future__ import annotations

import os

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification, AutoTokenizer


class ModelLoadError(ValueError):
    """The model folder is missing or incomplete; the message names the folder and the fix."""


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _check_folder(path: str) -> None:
    if not path or not os.path.isdir(path):
        raise ModelLoadError(
            f"model folder {path!r} does not exist; pass a local Hugging Face folder "
            "(config.json + *.safetensors + tokenizer files) or leave model.path empty to build "
            "the tiny model")
    if not os.path.exists(os.path.join(path, "config.json")):
        raise ModelLoadError(f"model folder {path!r} has no config.json; is it a Hugging Face "
                             "model folder (save_pretrained output)?")


def load_tokenizer(path: str):
    """Tokenizer from a local folder, left-padded (generation appends on the right)."""
    _check_folder(path)
    try:
        tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as e:  # noqa: BLE001 - re-raised with the folder named
        raise ModelLoadError(f"cannot load a tokenizer from {path!r}: {e}") from e
    tok.padding_side = "left"
    if tok.pad_token_id is None:
        if tok.eos_token_id is None:
            raise ModelLoadError(f"tokenizer in {path!r} has neither a pad nor an eos token")
        tok.pad_token = tok.eos_token
    if tok.eos_token_id is None:
        raise ModelLoadError(f"tokenizer in {path!r} has no eos token: generation could not stop")
    return tok


def load_causal_lm(path: str, dtype: str = "float32") -> torch.nn.Module:
    """``AutoModelForCausalLM`` from a local folder, in training mode off (eval)."""
    _check_folder(path)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            path, local_files_only=True, dtype=_DTYPES[dtype])
    except Exception as e:  # noqa: BLE001
        raise ModelLoadError(f"cannot load a causal LM from {path!r}: {e}") from e
    model.eval()
    return model


def load_critic(path: str, dtype: str = "float32") -> torch.nn.Module:
    """A value model: the policy's backbone + a fresh scalar head per token (verl's critic is
    ``AutoModelForTokenClassification(num_labels=1)`` initialised from the actor)."""
    _check_folder(path)
    try:
        # classifier_dropout=0: a value head should regress, not be regularised by noise (and
        # dropout would make the update depend on global RNG)
        config = AutoConfig.from_pretrained(path, num_labels=1, local_files_only=True)
        config.classifier_dropout = 0.0
        model = AutoModelForTokenClassification.from_pretrained(
            path, config=config, local_files_only=True, dtype=_DTYPES[dtype])
    except Exception as e:  # noqa: BLE001
        raise ModelLoadError(f"cannot build a critic from {path!r}: {e}") from e
    model.eval()
    return model
