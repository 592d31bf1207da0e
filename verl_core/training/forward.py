"""Teacher-forced forward passes over (prompt, response) rows: log-probs, entropy, values.

A row is a left-padded prompt followed by a right-padded response; positions are counted over
real tokens only, so left padding never shifts them (the same convention the rollout uses).
"""

from __future__ import annotations

import torch

from verl_core.algorithms.utils import entropy_from_logits, logprobs_from_logits


def _inputs(prompt_ids, prompt_mask, response_ids, response_mask):
    keep = prompt_mask.sum(0) > 0  # drop prompt columns that are padding in every row
    prompt_ids, prompt_mask = prompt_ids[:, keep], prompt_mask[:, keep]
    ids = torch.cat([prompt_ids, response_ids], dim=1)  # (n, P + T)
    attn = torch.cat([prompt_mask.long(), response_mask.long()], dim=1)  # (n, P + T)
    position = (attn.cumsum(-1) - 1).clamp(min=0)  # (n, P + T)
    return ids, attn, position, prompt_ids.shape[1]


def response_logits(model, prompt_ids, prompt_mask, response_ids, response_mask,
                    temperature: float = 1.0) -> torch.Tensor:
    """Logits that predict each response token: (n, T, V), divided by ``temperature``."""
    ids, attn, position, P = _inputs(prompt_ids, prompt_mask, response_ids, response_mask)
    logits = model(input_ids=ids, attention_mask=attn, position_ids=position).logits
    logits = logits[:, P - 1:-1].float()  # (n, T, V): position P-1+t predicts response token t
    if temperature not in (0.0, 1.0):
        logits = logits / temperature
    return logits


def response_logprobs(model, prompt_ids, prompt_mask, response_ids, response_mask,
                      temperature: float = 1.0, with_entropy: bool = False):
    """Returns (logp (n, T), entropy (n, T) or None); padding positions are zeroed."""
    logits = response_logits(model, prompt_ids, prompt_mask, response_ids, response_mask,
                             temperature)
    logp = logprobs_from_logits(logits, response_ids) * response_mask
    ent = entropy_from_logits(logits) * response_mask if with_entropy else None
    return logp, ent


def critic_values(critic, prompt_ids, prompt_mask, response_ids, response_mask) -> torch.Tensor:
    """Value of the state before each response token: (n, T) (a token-classification head with
    one label, as verl's critic)."""
    ids, attn, position, P = _inputs(prompt_ids, prompt_mask, response_ids, response_mask)
    values = critic(input_ids=ids, attention_mask=attn, position_ids=position).logits[..., 0]
    return values[:, P - 1:-1].float() * response_mask  # (n, T)


@torch.no_grad()
def batched_logprobs(model, batch, temperature: float, micro_batch_size: int) -> torch.Tensor:
    """No-grad log-probs of every row of a :class:`~verl_core.data.batch.Batch`: (N, T)."""
    was_training = model.training
    model.eval()
    out = []
    for s in range(0, batch.num_rows, micro_batch_size):
        sl = slice(s, s + micro_batch_size)
        lp, _ = response_logprobs(model, batch.prompt_ids[sl], batch.prompt_mask[sl],
                                  batch.response_ids[sl], batch.response_mask[sl], temperature)
        out.append(lp)
    model.train(was_training)
    return torch.cat(out, 0)


@torch.no_grad()
def batched_sum_pi_squared(model, batch, temperature: float, micro_batch_size: int) -> torch.Tensor:
    """No-grad Σ_v π_v² of the (temperature-scaled) policy at every response position: (N, T),
    0 on padding. The optimal-token-baseline estimators read it (verl's ``sum_pi_squared``)."""
    was_training = model.training
    model.eval()
    out = []
    for s in range(0, batch.num_rows, micro_batch_size):
        sl = slice(s, s + micro_batch_size)
        logits = response_logits(model, batch.prompt_ids[sl], batch.prompt_mask[sl],
                                 batch.response_ids[sl], batch.response_mask[sl], temperature)
        # Σ_v π_v² = exp(logsumexp(2z) - 2 logsumexp(z)), without forming the probabilities
        sq = torch.exp(torch.logsumexp(2 * logits, -1) - 2 * torch.logsumexp(logits, -1))
        out.append(sq * batch.response_mask[sl])
    model.train(was_training)
    return torch.cat(out, 0)


@torch.no_grad()
def batched_values(critic, batch, micro_batch_size: int) -> torch.Tensor:
    """No-grad critic values of every row: (N, T)."""
    was_training = critic.training
    critic.eval()
    out = [critic_values(critic, batch.prompt_ids[s:s + micro_batch_size],
                         batch.prompt_mask[s:s + micro_batch_size],
                         batch.response_ids[s:s + micro_batch_size],
                         batch.response_mask[s:s + micro_batch_size])
           for s in range(0, batch.num_rows, micro_batch_size)]
    critic.train(was_training)
    return torch.cat(out, 0)
