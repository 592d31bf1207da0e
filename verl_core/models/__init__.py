"""Hugging Face model/tokenizer loading and the tiny-model factory for CPU runs."""

from verl_core.models.loading import (ModelLoadError, check_model_folder, load_causal_lm,
                                      load_critic, load_tokenizer)
from verl_core.models.tiny import build_tiny_model

__all__ = ["ModelLoadError", "check_model_folder", "load_causal_lm", "load_critic",
           "load_tokenizer", "build_tiny_model"]
