"""The built-in rollout engines, registered: ``verl_core.rollout.make_engine`` is this module's, so
the first engine built imports them (``hf``: torch and transformers; ``vllm``: the vllm package
only when its engine is built), while reading the run's config (``rollout/config.py``) imports
neither. The modules imported here are ``registry.BUILTIN_ENGINES``, the names the config accepts
before any engine is registered."""

from verl_core.rollout import hf as _hf  # noqa: F401  (registers "hf")
from verl_core.rollout import vllm as _vllm  # noqa: F401  (registers "vllm")
from verl_core.rollout.base import make_engine

__all__ = ["make_engine"]
