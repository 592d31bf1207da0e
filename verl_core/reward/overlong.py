"""DAPO's overlong reward shaping, as verl's DAPO reward manager applies it
(``verl/workers/reward_manager/dapo.py``; Yu et al. 2025, arXiv:2503.14476 sec. 3.4, "soft
overlong punishment").

A response of L tokens (its valid length, the EOS included, as verl's attention mask counts it)
with a budget of ``max_resp_len`` tokens (``rollout.max_new_tokens``) and a buffer of the last
``buffer_len`` of them gets, added to its score::

    expected_len = max_resp_len - buffer_len
    exceed_len   = L - expected_len
    overlong     = min(-exceed_len / buffer_len * penalty_factor, 0)

so 0 up to ``expected_len`` tokens, then linearly down to ``-penalty_factor`` at the whole budget.
What belongs here: the formula and its config view. Where it is applied (the reward phase's
scoring, ``reward/scoring.py``): to the scorer's score, not to a reward model's (verl's manager
returns the reward model's scores as they are).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from verl_core.config import RunConfig

__all__ = ["OverlongBuffer", "overlong_penalty"]


def overlong_penalty(lengths: torch.Tensor, *, max_resp_len: int, buffer_len: int,
                     penalty_factor: float) -> torch.Tensor:
    """(N,) float32 penalty (<= 0) of responses of ``lengths`` (N,) valid tokens (verl's
    formula above)."""
    expected_len = max_resp_len - buffer_len
    exceed_len = lengths.long() - expected_len  # (N,) integer, as verl's
    # min(-exceed_len / buffer_len * penalty_factor, 0) in verl's float32 and order of operations
    return torch.clamp(-exceed_len / buffer_len * penalty_factor, max=0.0)  # (N,) float32


@dataclass(frozen=True)
class OverlongBuffer:
    """The overlong buffer of a run (``reward.overlong_buffer_*`` and the response budget)."""

    max_resp_len: int
    """The response budget in tokens (``rollout.max_new_tokens``, verl's
    ``data.max_response_length``)."""
    buffer_len: int
    """``reward.overlong_buffer_len``."""
    penalty_factor: float
    """``reward.overlong_penalty_factor``."""
    log: bool = False
    """``reward.overlong_buffer_log``: add the penalty's metrics."""

    @classmethod
    def of(cls, cfg: RunConfig) -> OverlongBuffer | None:
        """The run's buffer; None with ``reward.overlong_buffer_enable`` off."""
        r = cfg.reward
        if not r.overlong_buffer_enable:
            return None
        return cls(max_resp_len=cfg.rollout.max_new_tokens, buffer_len=r.overlong_buffer_len,
                   penalty_factor=r.overlong_penalty_factor, log=r.overlong_buffer_log)

    def penalty(self, response_mask: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """(N,) penalty of the responses of ``response_mask`` (N, T), and its metrics when
        ``log`` (verl's per-response ``overlong_reward`` and ``overlong``, as batch means)."""
        p = overlong_penalty(response_mask.sum(-1), max_resp_len=self.max_resp_len,
                             buffer_len=self.buffer_len, penalty_factor=self.penalty_factor)
        metrics = {}
        if self.log and p.numel():
            metrics = {"reward/overlong_reward_mean": float(p.mean()),
                       "reward/overlong_fraction": float((p < 0).float().mean())}
        return p, metrics
