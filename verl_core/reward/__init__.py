"""Rewards: rule scorers (``arithmetic``, ``gsm8k``), custom ``file.py:function`` scorers run in
worker processes with a timeout (``custom.py``, ``manager.py``), and the data_source registry.

Kept free of torch imports: custom-scorer worker processes import this package.
"""

from verl_core.reward.custom import ScorerLoadError, load_scorer
from verl_core.reward.manager import RewardResult, RewardScorer, ScorerError, score_responses
from verl_core.reward.registry import UnknownDataSourceError, default_compute_score

__all__ = ["RewardResult", "RewardScorer", "ScorerError", "ScorerLoadError",
           "UnknownDataSourceError", "default_compute_score", "load_scorer", "score_responses"]
