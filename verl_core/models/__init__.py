"""Hugging Face model/tokenizer loading and the tiny-model factory for CPU runs.

The names below are imported on first use (``verl_core/lazy.py``): the run's config reads
``models/config.py`` without paying for transformers."""

from verl_core.lazy import exports

__all__, __getattr__ = exports(__name__, {
    "verl_core.models.loading": ("ModelLoadError", "check_model_folder", "load_causal_lm",
                                 "load_critic", "load_tokenizer"),
    "verl_core.models.tiny": ("build_tiny_model",),
})
