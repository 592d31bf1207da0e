"""Rule scorer for the guessing game (``data_source = "synthetic/guess"``,
``data.synthetic_task=guess``, issue 45).

The reward is the simulated user's: the built-in scripted user (``agent/interactions.py``,
``GuessInteraction``) gives a turn score of 1.0 when the model names the hidden number, and the
rollout stores the turn scores (``extra_info["turn_scores"]``, verl's ``turn_scores``). The
score is their sum, capped at 1: 1.0 when the number was found within the turn limit, else 0.
The transcript is not read (a model that writes "correct" itself scores nothing).
"""

from __future__ import annotations

__all__ = ["compute_score"]


def compute_score(solution_str: str, ground_truth: str, extra_info: dict) -> float:
    """min(1, the sum of the row's turn scores); 0.0 without any (a single-turn rollout)."""
    return min(1.0, max(0.0, float(sum(extra_info.get("turn_scores") or ()))))
