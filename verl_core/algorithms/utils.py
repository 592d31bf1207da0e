"""Masked reductions and logit helpers shared by every algorithm module.

Definitions follow verl's ``verl/utils/torch_functional.py`` (``masked_sum``, ``masked_mean``,
``masked_var``, ``masked_whiten``, ``logprobs_from_logits``, ``entropy_from_logits``) and verl's
reward managers (``outcome_to_token_rewards``). Shapes use the symbols of ``verl_core``'s
docstring: N rows, T response tokens, V vocabulary.

Nothing here reads a value back to the host (only shapes steer Python control flow), so none of it
stalls the GPU. What does not belong here: anything that knows about an algorithm, a config or a
model.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import Tensor

# Elements of a (rows, V) logits chunk handled at once by the logit helpers. Bounds the peak
# temporary (softmax / exp) at ~256 MiB of float32 however large N*T*V is.
_LOGIT_CHUNK_ELEMENTS = 1 << 26


def masked_sum(x: Tensor, mask: Tensor, dim: Optional[int] = None) -> Tensor:
    """Sum of ``x`` (any shape, e.g. (N, T)) where ``mask`` (the same shape; bool or 0/1) is
    set, over ``dim`` or everything. Positions outside the mask are replaced by 0 before multiplying, so a NaN/inf there does not
    leak into the sum (as in verl's current ``masked_sum``).
    """
    valid = torch.where(mask.bool(), x, torch.zeros((), dtype=x.dtype, device=x.device))
    return (valid * mask).sum() if dim is None else (valid * mask).sum(dim=dim)


def masked_mean(x: Tensor, mask: Tensor, dim: Optional[int] = None) -> Tensor:
    """Mean of ``x`` over the positions where ``mask`` is set; 0 (not NaN) where the mask is empty.

    mean = sum(x * m) / sum(m). verl divides by ``sum(m) + 1e-8`` to avoid 0/0, which also makes
    every mean ~1e-8 relative too small (a clip fraction of one token reads 0.99999999); dividing
    by 1 where the count is 0 gives the same safety and exact means.
    """
    count = mask.sum() if dim is None else mask.sum(dim=dim)
    count = torch.where(count > 0, count, torch.ones_like(count))  # empty -> sum 0 / 1 = 0
    return masked_sum(x, mask, dim) / count


def masked_var(x: Tensor, mask: Tensor, unbiased: bool = True) -> Tensor:
    """Variance of ``x`` over all masked positions (a scalar).

    var = mean_m((x - mean_m(x))^2) * n / (n - 1) with n = sum(m) when ``unbiased`` (Bessel).

    verl raises when n is 0 or 1; that check needs the count on the host, so here the Bessel
    denominator is clamped to >= 1 instead: an empty or single-element mask gives variance 0.
    """
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    if unbiased:
        n = mask.sum().to(var.dtype)
        var = var * (n / (n - 1).clamp(min=1.0))  # Bessel correction n / (n - 1)
    return var


def masked_whiten(x: Tensor, mask: Tensor, shift_mean: bool = True) -> Tensor:
    """Standardise ``x`` with the mean and unbiased variance of its masked positions.

    whitened = (x - mean) / sqrt(var + 1e-8); with ``shift_mean=False`` the mean is added back
    (only the scale changes). Applied to every position, masked or not, as in verl.
    """
    mean, var = masked_mean(x, mask), masked_var(x, mask)
    whitened = (x - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        whitened = whitened + mean
    return whitened


def _chunked_over_rows(fn: Callable[[Tensor, Optional[Tensor]], Tensor], logits: Tensor,
                       labels: Optional[Tensor]) -> Tensor:
    """Apply ``fn`` to (rows, V) chunks of ``logits`` (..., V) and return (...)."""
    lead, V = logits.shape[:-1], logits.shape[-1]
    flat = logits.reshape(-1, V)  # (N*T, V)
    flat_labels = labels.reshape(-1) if labels is not None else None  # (N*T,)
    step = max(1, _LOGIT_CHUNK_ELEMENTS // max(V, 1))
    if flat.shape[0] <= step:
        out = fn(flat, flat_labels)
    else:
        out = torch.cat([fn(flat[i:i + step],
                            flat_labels[i:i + step] if flat_labels is not None else None)
                         for i in range(0, flat.shape[0], step)])
    return out.reshape(lead)  # (N, T)


def _compute_dtype(logits: Tensor) -> torch.dtype:
    # bf16/fp16 log-softmax loses ~3 significant digits, which is the same size as the PPO clip
    # range; compute those in float32 (verl keeps the input dtype there).
    return logits.dtype if logits.dtype in (torch.float32, torch.float64) else torch.float32


def logprobs_from_logits(logits: Tensor, labels: Tensor) -> Tensor:
    """log p(label) under softmax(logits), for every position.

    Args:
        logits: (N, T, V) unnormalised scores (any leading shape works).
        labels: (N, T) long token ids in [0, V).
    Returns:
        (N, T) log-probabilities, float32 for bf16/fp16 logits, else the logits' dtype.

    log_softmax(x)_y = x_y - logsumexp(x) (verl ``logprobs_from_logits_v2``), computed in chunks
    of rows so the (rows, V) temporaries stay bounded; differentiable.
    """
    dtype = _compute_dtype(logits)

    def chunk(lg: Tensor, lb: Optional[Tensor]) -> Tensor:
        lg = lg.to(dtype)  # (rows, V)
        picked = lg.gather(-1, lb.unsqueeze(-1)).squeeze(-1)  # (rows,)
        return picked - torch.logsumexp(lg, dim=-1)  # x_y - logsumexp(x)

    return _chunked_over_rows(chunk, logits, labels)


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of softmax(logits) at every position.

    Args:
        logits: (N, T, V) (any leading shape works).
    Returns:
        (N, T) entropies in nats, float32 for bf16/fp16 logits, else the logits' dtype.

    H = logsumexp(x) - sum_v softmax(x)_v * x_v (verl ``entropy_from_logits``), chunked over rows;
    differentiable.
    """
    dtype = _compute_dtype(logits)

    def chunk(lg: Tensor, _unused: Optional[Tensor]) -> Tensor:
        lg = lg.to(dtype)  # (rows, V)
        p = torch.softmax(lg, dim=-1)
        return torch.logsumexp(lg, dim=-1) - (p * lg).sum(dim=-1)  # H = lse(x) - E_p[x]

    return _chunked_over_rows(chunk, logits, None)


def outcome_to_token_rewards(scores: Tensor, response_mask: Tensor) -> Tensor:
    """Place one outcome score per response on its last valid token.

    Args:
        scores: (N,) one scalar reward per response.
        response_mask: (N, T) 1 on response tokens, 0 on padding.
    Returns:
        (N, T) token rewards: ``scores[i]`` at the last position where ``response_mask[i]`` is set,
        0 elsewhere; a row with no valid token gets no reward at all. Float32 unless ``scores`` is
        already floating point.

    verl's reward managers write ``reward_tensor[i, valid_response_length - 1] = score``, which is
    the same position for right-padded contiguous masks; for a mask with holes (multi-turn) this
    uses the last set position, which is what "the end of the response" means there.
    """
    N, T = response_mask.shape
    if scores.shape != (N,):
        raise ValueError(f"scores must have shape (N,)=({N},), got {tuple(scores.shape)}")
    dtype = scores.dtype if scores.is_floating_point() else torch.float32
    positions = torch.arange(T, device=response_mask.device).expand(N, T)  # (N, T)
    last = torch.where(response_mask.bool(), positions, -1).amax(dim=-1)  # (N,), -1: no token
    has_token = last >= 0  # (N,)
    rewards = torch.zeros(N, T, dtype=dtype, device=scores.device)
    value = torch.where(has_token, scores.to(dtype), torch.zeros((), dtype=dtype, device=scores.device))
    rewards.scatter_(1, last.clamp(min=0).unsqueeze(1), value.unsqueeze(1))  # r[i, last_i] = s_i
    return rewards
