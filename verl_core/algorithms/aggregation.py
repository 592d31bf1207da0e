"""How a (N, T) per-token loss matrix becomes the scalar that is differentiated.

The choice changes how much each token and each response weighs (DAPO, Yu et al. 2025,
arXiv:2503.14476 sec. 3.3; Dr. GRPO, Liu et al. 2025, arXiv:2503.20783):

* ``token-mean``: every valid token in the batch weighs the same (DAPO's token-level loss);
* ``seq-mean-token-mean``: every response weighs the same, its tokens share that weight (GRPO as
  published, hence a bias towards short correct / long wrong answers);
* ``seq-mean-token-sum``: every response weighs the same and longer responses count more.

Definitions follow verl's ``agg_loss`` in ``verl/trainer/ppo/core_algos.py``: rows with no valid
token are left out of the sequence means. Every entry: ``fn(loss_mat (N, T), mask (N, T)) ->
scalar``. A mini-batch split into micro-batches (or across data-parallel workers) weighs each
part by :func:`micro_batch_weight`, so the split never changes the loss.
"""

from __future__ import annotations

import torch
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


def micro_batch_weight(micro_mask: Tensor, mini_mask: Tensor, mode: str) -> Tensor:
    """Weight of one micro-batch's ``agg_loss`` in its mini-batch's loss (a scalar).

    Gradient accumulation (and data-parallel workers, each holding part of a mini-batch) must
    differentiate the loss of the *whole* mini-batch, whatever the split. Each mode is a sum over
    the micro-batches of their own aggregate times the micro-batch's share of the mode's
    denominator (the "global-batch denominator" verl passes to its losses):

        token-mean:      L = sum_k L_k * tokens_k / tokens     (tokens: valid tokens)
        seq-mean-*:      L = sum_k L_k * seqs_k / seqs         (seqs: rows with >= 1 token)

    Exact in real arithmetic for any split (ragged lengths included), so the result no longer
    depends on the micro-batch size or the worker count; with one micro-batch the weight is 1.0.

    Args:
        micro_mask: (n, T) response mask of the micro-batch.
        mini_mask: (M, T) response mask of its whole mini-batch.
    """
    if mode == "token-mean":
        num, den = micro_mask.sum(), mini_mask.sum()
    else:
        num, den = (micro_mask.sum(-1) > 0).sum(), (mini_mask.sum(-1) > 0).sum()
    return num.float() / den.float().clamp(min=1.0)


def agg_loss(loss_mat: Tensor, mask: Tensor, mode: str) -> Tensor:
    """Reduce ``loss_mat`` (N, T) over ``mask`` (N, T) with the registered ``mode``; a scalar.
    An unknown mode raises listing the known ones."""
    return LOSS_AGG_MODES.get(mode)(loss_mat, mask)
