"""Rollout engines: one interface (:class:`RolloutEngine`), ``hf`` (torch) and ``vllm`` (GPU).

The names below are imported on first use (``verl_core/lazy.py``), and the built-in engines
register when :func:`make_engine` is first called: the run's config reads ``rollout/config.py``
without paying for transformers."""

from verl_core.lazy import exports

__all__, __getattr__ = exports(__name__, {
    "verl_core.rollout.base": ("GenerationOutput", "RolloutEngine", "SamplingParams"),
    "verl_core.rollout.registry": ("register_engine",),
    "verl_core.rollout.engines": ("make_engine",),
})
