"""Rewards: rule scorers (``arithmetic``, ``gsm8k``), custom ``file.py:function`` scorers loaded and
run in worker processes under timeouts (``custom.py``, ``manager.py``), the data_source registry,
and the decoding every scorer's input goes through (``decode.py``).

Kept free of torch imports: custom-scorer worker processes import this package.
"""

from verl_core.reward.custom import ScorerLoadError, load_scorer
from verl_core.reward.decode import DecodedResponses, decode_responses
from verl_core.reward.manager import (RewardResult, RewardScorer, ScorerError, ScorerTimeoutError,
                                      score_responses)
from verl_core.reward.registry import UnknownDataSourceError, default_compute_score

__all__ = ["DecodedResponses", "RewardResult", "RewardScorer", "ScorerError", "ScorerLoadError",
           "ScorerTimeoutError", "UnknownDataSourceError", "decode_responses",
           "default_compute_score", "load_scorer", "score_responses"]
