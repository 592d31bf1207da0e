"""How a (N, T) per-token loss matrix becomes the scalar that is differentiated.

The choice changes how much each token and each response weighs (DAPO, Yu et al. 2025,
arXiv:2503.14476 sec. 3.3; Dr. GRPO, Liu et al. 2025, arXiv:2503.20783):

* ``token-mean``: every valid token in the batch weighs the same (DAPO's token-level loss);
* ``seq-mean-token-mean``: every response weighs the same, its tokens share that weight (GRPO as
  published, hence a bias towards short correct / long wrong answers);
* ``seq-mean-token-sum``: every response weighs the same and longer responses count more;
* ``seq-mean-token-sum-norm``: ``seq-mean-token-sum`` divided by a constant C (Dr. GRPO's
  "divide by the generation budget", which removes the length bias without a per-response mean);
* ``token-sum``: the plain sum over valid tokens, no denominator at all.

Definitions follow verl's ``agg_loss`` in ``verl/trainer/ppo/core_algos.py``: rows with no valid
token are left out of the sequence means. Every entry: ``fn(loss_mat (N, T), mask (N, T), *,
loss_scale_factor) -> scalar``; ``loss_scale_factor`` is C for ``seq-mean-token-sum-norm`` (None:
the padded width T, as verl's ``null``) and ignored by the other modes. A mini-batch split into
micro-batches (or across data-parallel workers) weighs each part by :func:`micro_batch_weight`,
so the split never changes the loss.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from verl_core.algorithms.registry import Registry
from verl_core.algorithms.utils import masked_mean, masked_sum


def _agg_prototype(loss_mat: Tensor, mask: Tensor, *,
                   loss_scale_factor: Optional[float] = None) -> Tensor:  # the one signature
    raise NotImplementedError


LOSS_AGG_MODES = Registry("loss aggregation mode", prototype=_agg_prototype)


@LOSS_AGG_MODES.register("token-mean")
def token_mean(loss_mat: Tensor, mask: Tensor, *,
               loss_scale_factor: Optional[float] = None) -> Tensor:
    """sum_{i,t} m_it * l_it / sum_{i,t} m_it over the whole batch (a scalar)."""
    return masked_mean(loss_mat, mask)


@LOSS_AGG_MODES.register("seq-mean-token-sum")
def seq_mean_token_sum(loss_mat: Tensor, mask: Tensor, *,
                       loss_scale_factor: Optional[float] = None) -> Tensor:
    """mean over responses with >= 1 token of sum_t m_it * l_it (a scalar)."""
    seq_losses = masked_sum(loss_mat, mask, dim=-1)  # (N,) sum_t m_it * l_it
    has_tokens = (mask.sum(dim=-1) > 0).to(seq_losses.dtype)  # (N,) drop fully masked rows
    return masked_mean(seq_losses, has_tokens)


@LOSS_AGG_MODES.register("seq-mean-token-mean")
def seq_mean_token_mean(loss_mat: Tensor, mask: Tensor, *,
                        loss_scale_factor: Optional[float] = None) -> Tensor:
    """mean over responses with >= 1 token of (sum_t m_it * l_it / sum_t m_it) (a scalar)."""
    seq_losses = masked_mean(loss_mat, mask, dim=-1)  # (N,) per-response token mean
    has_tokens = (mask.sum(dim=-1) > 0).to(seq_losses.dtype)  # (N,) drop fully masked rows
    return masked_mean(seq_losses, has_tokens)


@LOSS_AGG_MODES.register("seq-mean-token-sum-norm")
def seq_mean_token_sum_norm(loss_mat: Tensor, mask: Tensor, *,
                            loss_scale_factor: Optional[float] = None) -> Tensor:
    """``seq-mean-token-sum`` / C, C = ``loss_scale_factor`` or the padded width T (a scalar).

    Dr. GRPO, Liu et al. 2025, "Understanding R1-Zero-Like Training: A Critical Perspective",
    arXiv:2503.20783 (the per-response 1/|o_i| dropped, a constant in its place):

        L = (1 / |{i : Σ_t m_it > 0}|) Σ_i Σ_t m_it l_it / C

    With C = None the divisor is T = ``mask.shape[-1]``, as in verl; T is the batch's padded
    response width, which changes from step to step when rollouts are padded to the longest
    response, so set C (e.g. to the generation budget ``max_new_tokens``) for a true constant.
    (A batch with no response token at all has T = 0; it divides by 1 instead.)
    """
    scale = max(mask.shape[-1], 1) if loss_scale_factor is None else loss_scale_factor  # C
    return seq_mean_token_sum(loss_mat, mask) / scale


@LOSS_AGG_MODES.register("token-sum")
def token_sum(loss_mat: Tensor, mask: Tensor, *,
              loss_scale_factor: Optional[float] = None) -> Tensor:
    """sum_{i,t} m_it * l_it, no denominator (a scalar): the loss grows with the batch."""
    return masked_sum(loss_mat, mask)


def _tokens(mask: Tensor) -> Tensor:
    return mask.sum()  # valid tokens


def _seqs(mask: Tensor) -> Tensor:
    return (mask.sum(-1) > 0).sum()  # rows with >= 1 valid token


# The count each mode divides by (None: no denominator). A new mode adds its entry here; a mode
# without one raises in micro_batch_weight rather than being weighted wrongly.
_DENOMINATOR = {
    "token-mean": _tokens,
    "seq-mean-token-sum": _seqs,
    "seq-mean-token-mean": _seqs,
    "seq-mean-token-sum-norm": _seqs,  # the constant C is the same in every micro-batch
    "token-sum": None,
}


def micro_batch_weight(micro_mask: Tensor, mini_mask: Tensor, mode: str) -> Tensor:
    """Weight of one micro-batch's ``agg_loss`` in its mini-batch's loss (a scalar).

    Gradient accumulation (and data-parallel workers, each holding part of a mini-batch) must
    differentiate the loss of the *whole* mini-batch, whatever the split. Each mode is a sum over
    the micro-batches of their own aggregate times the micro-batch's share of the mode's
    denominator (the "global-batch denominator" verl passes to its losses):

        token-mean:      L = sum_k L_k * tokens_k / tokens     (tokens: valid tokens)
        seq-mean-*:      L = sum_k L_k * seqs_k / seqs         (seqs: rows with >= 1 token)
        token-sum:       L = sum_k L_k                         (no denominator: weight 1)

    (``seq-mean-token-sum-norm`` also divides by its constant C, the same in every micro-batch:
    they share the padded width T, or C is given.) Exact in real arithmetic for any split (ragged
    lengths included), so the result no longer depends on the micro-batch size or the worker
    count; with one micro-batch the weight is 1.0.

    verl's denominators differ in one respect: its ``global_batch_size`` is the mini-batch's row
    count, fully masked rows included, where here (and in verl's single-batch ``agg_loss``) they
    are left out. verl multiplies ``token-sum`` by the data-parallel size to undo DDP's gradient
    mean; here the workers' gradients are summed, so the weight is 1. ``micro_mask`` (n, T) and
    ``mini_mask`` (M, T) are the response masks of the micro-batch and of its mini-batch.
    """
    LOSS_AGG_MODES.get(mode)  # an unknown mode raises listing the known ones
    count = _DENOMINATOR[mode]
    if count is None:
        return torch.ones((), dtype=torch.float32, device=micro_mask.device)
    num, den = count(micro_mask), count(mini_mask)
    return num.float() / den.float().clamp(min=1.0)


def agg_loss(loss_mat: Tensor, mask: Tensor, mode: str, *,
             loss_scale_factor: Optional[float] = None) -> Tensor:
    """Reduce ``loss_mat`` (N, T) over ``mask`` (N, T) with the registered ``mode``; a scalar.
    ``loss_scale_factor``: C of ``seq-mean-token-sum-norm`` (ignored by the other modes). An
    unknown mode raises listing the known ones."""
    return LOSS_AGG_MODES.get(mode)(loss_mat, mask, loss_scale_factor=loss_scale_factor)
