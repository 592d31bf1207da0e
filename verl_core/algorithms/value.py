"""The critic's clipped value loss and the policy's entropy term.

Definitions follow verl ``compute_value_loss`` and ``compute_entropy_loss`` in
``verl/trainer/ppo/core_algos.py``. What does not belong here: the policy-gradient loss
(``policy_losses.py``), the critic model.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from verl_core.algorithms.aggregation import agg_loss
from verl_core.algorithms.utils import entropy_from_logits, masked_mean


def value_loss(vpreds: Tensor, values: Tensor, returns: Tensor, response_mask: Tensor, *,
               cliprange_value: float, loss_agg_mode: str,
               loss_scale_factor: Optional[float] = None) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped value loss, as in OpenAI baselines' PPO2 and verl ``compute_value_loss`` (the PPO
    paper, Schulman et al. 2017, arXiv:1707.06347, uses the plain squared error):

        V^clip = V_old + clip(V - V_old, -ε_v, ε_v)
        L_t    = max((V - R)^2, (V^clip - R)^2)
        loss   = ½ · agg(L, mask, loss_agg_mode)

    vpreds V (N, T) with the gradient, values V_old (N, T) from the rollout, returns R (N, T),
    response_mask (N, T): note the order, verl's is (vpreds, returns, values). ``vf_clipfrac`` is
    the token fraction where the clipped term was the larger.
    """
    vpred_clipped = torch.clamp(vpreds, values - cliprange_value, values + cliprange_value)  # V^clip
    vf_losses1 = (vpreds - returns) ** 2  # (V - R)^2
    vf_losses2 = (vpred_clipped - returns) ** 2  # (V^clip - R)^2
    loss = 0.5 * agg_loss(torch.maximum(vf_losses1, vf_losses2), response_mask, loss_agg_mode,
                          loss_scale_factor=loss_scale_factor)
    vf_clipfrac = masked_mean(torch.gt(vf_losses2, vf_losses1).to(vpreds.dtype), response_mask)
    return loss, {"vf_clipfrac": vf_clipfrac.detach()}


def entropy_loss(logits: Tensor, response_mask: Tensor, loss_agg_mode: str, *,
                 loss_scale_factor: Optional[float] = None) -> Tensor:
    """Aggregated token entropy of the policy, a scalar (the caller subtracts
    ``entropy_coeff`` times it from the actor loss).

    Args:
        logits: (N, T, V) policy logits at the response positions.
        response_mask: (N, T). loss_agg_mode: a ``LOSS_AGG_MODES`` name; loss_scale_factor: its
        C (see ``agg_loss``).
    """
    return agg_loss(entropy_from_logits(logits), response_mask, loss_agg_mode,
                    loss_scale_factor=loss_scale_factor)
