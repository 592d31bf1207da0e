"""Teacher-forced forward passes over (prompt, response) rows: log-probs, entropy, values.

A row is a left-padded prompt followed by a right-padded response; positions are counted over
real tokens only, so left padding never shifts them (the same convention the rollout uses).
"""

from __future__ import annotations

import inspect

import torch
from torch.utils.checkpoint import checkpoint

from verl_core.algorithms.utils import entropy_from_logits, logprobs_from_logits

# Elements of a (rows, V) chunk of response logits per checkpointed log-prob/entropy call: the
# backward recomputes one chunk's softmax and products at a time (~64 MiB of float32 each), so
# those temporaries stay bounded whatever n * T * V is.
_CHUNK_ELEMENTS = 1 << 24


def _inputs(prompt_ids, prompt_mask, response_ids, response_mask):
    keep = prompt_mask.sum(0) > 0  # drop prompt columns that are padding in every row
    prompt_ids, prompt_mask = prompt_ids[:, keep], prompt_mask[:, keep]
    ids = torch.cat([prompt_ids, response_ids], dim=1)  # (n, P + T)
    attn = torch.cat([prompt_mask.long(), response_mask.long()], dim=1)  # (n, P + T)
    position = (attn.cumsum(-1) - 1).clamp(min=0)  # (n, P + T)
    return ids, attn, position, prompt_ids.shape[1]


def takes_logits_to_keep(model) -> bool:
    """transformers' causal LMs (Llama, Qwen2, ...) accept ``logits_to_keep`` and then run the LM
    head only on those positions; a model without it gets the full logits, sliced here."""
    return "logits_to_keep" in inspect.signature(model.forward).parameters


def response_logits(model, prompt_ids, prompt_mask, response_ids, response_mask,
                    temperature: float = 1.0) -> torch.Tensor:
    """Logits that predict each response token: (n, T, V), divided by ``temperature``.

    Only the T positions that predict response tokens go through the LM head (``logits_to_keep``
    inside the model's own forward, so an FSDP2-sharded head is unsharded as usual): the prompt
    positions' logits, ~P/(P+T) of a full [n, P+T, V] tensor, are never formed."""
    ids, attn, position, P = _inputs(prompt_ids, prompt_mask, response_ids, response_mask)
    T = response_ids.shape[1]
    if takes_logits_to_keep(model):
        # position P-1+t predicts response token t: positions P-1 .. P+T-2
        keep = torch.arange(P - 1, P + T - 1, device=ids.device)
        logits = model(input_ids=ids, attention_mask=attn, position_ids=position,
                       logits_to_keep=keep).logits  # (n, T, V)
    else:
        logits = model(input_ids=ids, attention_mask=attn, position_ids=position).logits
        logits = logits[:, P - 1:-1]  # (n, T, V)
    logits = logits.float()
    if temperature not in (0.0, 1.0):
        logits = logits / temperature
    return logits


def _logp_entropy(logits: torch.Tensor, labels: torch.Tensor, temperature: float,
                  with_entropy: bool):
    """logits: (rows, V) raw, labels: (rows,). Returns (logp (rows,), entropy (rows,) or an empty
    tensor) under softmax(logits / temperature)."""
    if temperature not in (0.0, 1.0):
        logits = logits / temperature
    logp = logprobs_from_logits(logits, labels)
    ent = entropy_from_logits(logits) if with_entropy else logp.new_empty(0)
    return logp, ent


def response_logprobs(model, prompt_ids, prompt_mask, response_ids, response_mask,
                      temperature: float = 1.0, with_entropy: bool = False):
    """Returns (logp (n, T), entropy (n, T) or None); padding positions are zeroed.

    The log-softmax and entropy run over chunks of (rows, V); with grad each chunk is
    checkpointed (its temperature-scaled logits, softmax and products are recomputed in backward
    instead of kept), so the raw response logits are the only [n, T, V] tensor the graph holds."""
    logits = response_logits(model, prompt_ids, prompt_mask, response_ids, response_mask)
    n, T, V = logits.shape
    flat, labels = logits.reshape(n * T, V), response_ids.reshape(n * T)  # (n*T, V), (n*T,)
    step = max(1, _CHUNK_ELEMENTS // max(V, 1))
    grad = torch.is_grad_enabled() and flat.requires_grad
    parts = []
    for lg, lb in zip(flat.split(step), labels.split(step)):  # one SplitBackward for all chunks
        if grad:
            parts.append(checkpoint(_logp_entropy, lg, lb, temperature, with_entropy,
                                    use_reentrant=False))
        else:
            parts.append(_logp_entropy(lg, lb, temperature, with_entropy))
    logp = torch.cat([p[0] for p in parts]).reshape(n, T) * response_mask
    ent = torch.cat([p[1] for p in parts]).reshape(n, T) * response_mask if with_entropy else None
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
