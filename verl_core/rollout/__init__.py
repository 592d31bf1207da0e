"""Rollout engines: one interface (:class:`RolloutEngine`), ``hf`` (torch) and ``vllm`` (GPU)."""

from verl_core.rollout.base import (GenerationOutput, RolloutEngine, SamplingParams, make_engine,
                                    register_engine)
from verl_core.rollout import hf as _hf  # noqa: F401  (registers "hf")
from verl_core.rollout import vllm as _vllm  # noqa: F401  (registers "vllm"; imports vllm lazily)

__all__ = ["GenerationOutput", "RolloutEngine", "SamplingParams", "make_engine", "register_engine"]
