"""How a (N, T) per-token loss matrix becomes the scalar that is differentiated.

The choice changes how much each token and each response weighs (DAPO, Yu et al. 2025,
arXiv:2503.14476 sec. 3.3; Dr. GRPO, Liu et al. 2025, arXiv:2503.20783):

* ``token-mean``: every valid token in the batch weighs the same (DAPO's token-level loss);
* ``seq-mean-token-mean``: every response weighs the same, its tokens share that weight (GRPO as
  published, hence a bias towards short correct / long wrong answers);
* ``seq-mean-token-sum``: every response weighs the same and longer responses count more.

Definitions follow verl's ``agg_loss`` in ``verl/trainer/ppo/core_algos.py`` in its single-process
form (no global token / sequence count across data-parallel ranks): rows with no valid token are
left out of the sequence means. Every entry: ``fn(loss_mat (N, T), mask (N, T)) -> scalar``.
"""

from __future__ import annotations

from torch import Tensor

from verl_core.algorithms.registry import Registry
from verl_core.algorithms.utils import masked_mean, masked_sum


def _agg_prototype(loss_mat: Tensor, mask: Tensor) -> Tensor:  # the one signature
    raise NotImplementedError


LOSS_AGG_MODES = Registry("loss aggregation mode", prototype=_agg_prototype)


@LOSS_AGG_MODES.register("token-mean")
def token_mean(loss_mat: Tensor, mask: Tensor) -> Tensor:
    """sum_{i,t} m_it * l_it / sum_{i,t} m_it over the whole batch (a scalar)."""
    return masked_mean(loss_mat, mask)


@LOSS_AGG_MODES.register("seq-mean-token-sum")
def seq_mean_token_sum(loss_mat: Tensor, mask: Tensor) -> Tensor:
    """mean over responses with >= 1 token of sum_t m_it * l_it (a scalar)."""
    seq_losses = masked_sum(loss_mat, mask, dim=-1)  # (N,) sum_t m_it * l_it
    has_tokens = (mask.sum(dim=-1) > 0).to(seq_losses.dtype)  # (N,) drop fully masked rows
    return masked_mean(seq_losses, has_tokens)


@LOSS_AGG_MODES.register("seq-mean-token-mean")
def seq_mean_token_mean(loss_mat: Tensor, mask: Tensor) -> Tensor:
    """mean over responses with >= 1 token of (sum_t m_it * l_it / sum_t m_it) (a scalar)."""
    seq_losses = masked_mean(loss_mat, mask, dim=-1)  # (N,) per-response token mean
    has_tokens = (mask.sum(dim=-1) > 0).to(seq_losses.dtype)  # (N,) drop fully masked rows
    return masked_mean(seq_losses, has_tokens)


def agg_loss(loss_mat: Tensor, mask: Tensor, mode: str) -> Tensor:
    """Reduce ``loss_mat`` (N, T) over ``mask`` (N, T) with the registered ``mode``; a scalar.
    An unknown mode raises listing the known ones."""
    return LOSS_AGG_MODES.get(mode)(loss_mat, mask)
