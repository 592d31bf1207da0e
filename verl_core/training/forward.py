"""Teacher-forced forward passes over (prompt, response) rows: log-probs, entropy, values.

A row is a left-padded prompt followed by a right-padded response; positions are counted over
real tokens only, so left padding never shifts them (the same convention the rollout uses).
"""

from __future__ import annotations

import inspect

import torch
from torch.utils.checkpoint import checkpoint

from verl_core.algorithms.utils import entropy_from_logits, logprobs_from_logits
from verl_core.training.dist import SINGLE, DataParallel
from verl_core.training.packing import micro_batches, narrow

# Elements of a (rows, V) chunk of response logits per checkpointed call: each chunk's logits,
# softmax and products (~64 MiB of float32 each) exist one chunk at a time, in forward and again
# in backward (recomputed), so they stay bounded whatever n * T * V is.
_CHUNK_ELEMENTS = 1 << 24

# Model classes whose forward turned out to post-process the LM head's output (a soft cap, a
# logit scale): they take the full-logits path (see ``_rows_through_head``).
_HEAD_NOT_LAST: set[type] = set()


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
    """Logits that predict each response token: (n, T, V), float32, divided by ``temperature``.

    The full-logits path, for a model whose LM head cannot be chunked (``_rows_through_head``):
    only the T positions that predict response tokens go through the head when the model takes
    ``logits_to_keep``; the prompt positions' logits are never formed."""
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


def _by_chunks(fn, x: torch.Tensor, labels: torch.Tensor, vocab: int, head=None):
    """``fn`` over chunks of rows: x (rows, H) hidden states when ``head`` is given (the LM head
    runs per chunk), else (rows, V) logits; labels (rows,). ``fn(logits (r, V) float32, labels
    (r,))`` returns a tuple of (r,) tensors; returns their (rows,) concatenations. With grad each
    chunk is checkpointed: backward recomputes its logits (the head's gemm included) instead of
    keeping them, so no (rows, V) tensor outlives its chunk."""
    def piece(xc, lc):
        return fn((xc if head is None else head(xc)).float(), lc)

    step = max(1, _CHUNK_ELEMENTS // max(vocab, 1))
    grad = torch.is_grad_enabled() and (x.requires_grad or head is not None)
    parts = [checkpoint(piece, xc, lc, use_reentrant=False) if grad else piece(xc, lc)
             for xc, lc in zip(x.split(step), labels.split(step))]  # one SplitBackward for all
    return tuple(torch.cat(p) for p in zip(*parts))


def _rows_through_head(model, prompt_ids, prompt_mask, response_ids, response_mask, fn):
    """``fn`` (see ``_by_chunks``) at every response position: a tuple of (n, T) tensors.

    The decoder runs once to the T response positions' hidden states (``logits_to_keep``); the LM
    head then runs chunk by chunk *inside the model's own forward*: its ``forward`` is replaced
    for the call by the chunked computation, whose small (n, T, k) result the model returns as its
    "logits". So the head's weights are used between the root module's forward hooks, where FSDP2
    has them unsharded (tied embeddings included), and backward's recomputation runs after the
    root's pre-backward unshard. No [n, T, V] tensor exists, forward or backward.

    A model without ``logits_to_keep`` or an output embedding, or whose forward changes the head's
    output (Gemma's soft cap, Cohere's logit scale: the returned logits are then not the head's
    result), takes the full-logits path (``response_logits``) with the same chunked ``fn``."""
    n, T = response_ids.shape
    labels = response_ids.reshape(n * T)  # (n*T,)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if (type(model) not in _HEAD_NOT_LAST and isinstance(head, torch.nn.Module)
            and takes_logits_to_keep(model)):
        vocab = getattr(head, "out_features", None) or head.weight.shape[0]
        linear = head.forward  # the head's own forward, called per chunk
        result = []

        def chunked_head(h):  # h: (n, T, H), the LM head's input
            outs = _by_chunks(fn, h.reshape(n * T, -1), labels, vocab, head=linear)
            # (n, T, k), a tensor of its own: FSDP2 warns about a view returned by the root
            result.append(torch.stack([o.reshape(n, T) for o in outs], -1))
            return result[-1]

        ids, attn, position, P = _inputs(prompt_ids, prompt_mask, response_ids, response_mask)
        keep = torch.arange(P - 1, P + T - 1, device=ids.device)  # predict response tokens
        own = head.__dict__.get("forward")  # an instance-level forward someone else set
        head.forward = chunked_head
        try:
            out = model(input_ids=ids, attention_mask=attn, position_ids=position,
                        logits_to_keep=keep).logits  # (n, T, k)
        finally:
            if own is None:
                del head.forward  # the class's forward again
            else:
                head.forward = own
        if len(result) == 1 and out is result[0]:
            return out.unbind(-1)
        _HEAD_NOT_LAST.add(type(model))
    logits = response_logits(model, prompt_ids, prompt_mask, response_ids, response_mask)
    V = logits.shape[-1]
    outs = _by_chunks(fn, logits.reshape(n * T, V), labels, V)  # logits: (n*T, V)
    return tuple(o.reshape(n, T) for o in outs)


def _logp_entropy(temperature: float, with_entropy: bool):
    """``fn`` for ``_rows_through_head``: (logp,) or (logp, entropy) under
    softmax(logits / temperature)."""
    def fn(logits, labels):  # (rows, V), (rows,)
        if temperature not in (0.0, 1.0):
            logits = logits / temperature
        logp = logprobs_from_logits(logits, labels)
        return (logp, entropy_from_logits(logits)) if with_entropy else (logp,)
    return fn


def response_logprobs(model, prompt_ids, prompt_mask, response_ids, response_mask,
                      temperature: float = 1.0, with_entropy: bool = False):
    """Returns (logp (n, T), entropy (n, T) or None); padding positions are zeroed.

    The LM head, log-softmax and entropy run over checkpointed chunks of rows
    (``_rows_through_head``): memory for the logits is one chunk's, whatever n * T * V is."""
    outs = _rows_through_head(model, prompt_ids, prompt_mask, response_ids, response_mask,
                              _logp_entropy(temperature, with_entropy))
    logp = outs[0] * response_mask
    return logp, outs[1] * response_mask if with_entropy else None


def critic_values(critic, prompt_ids, prompt_mask, response_ids, response_mask) -> torch.Tensor:
    """Value of the state before each response token: (n, T) (a token-classification head with
    one label, as verl's critic)."""
    ids, attn, position, P = _inputs(prompt_ids, prompt_mask, response_ids, response_mask)
    values = critic(input_ids=ids, attention_mask=attn, position_ids=position).logits[..., 0]
    return values[:, P - 1:-1].float() * response_mask  # (n, T)


def _by_micro_batch(fn, batch, micro_batch_size: int, max_token_len: int,
                    dp: DataParallel) -> torch.Tensor:
    """(N, T): ``fn(mb)`` (n, t) of each micro-batch ``mb`` of ``batch`` written at its rows:
    chunks of ``micro_batch_size`` rows, or with ``max_token_len`` > 0 rows packed to that token
    budget and cut to their longest response (:mod:`verl_core.training.packing`; ``dp``: the
    workers agree on the number of forwards)."""
    N, T = batch.response_ids.shape
    out = None
    for rows in micro_batches(torch.arange(N), batch, micro_batch_size,
                              max_token_len, dp):
        mb = batch.select(rows)
        part = fn(narrow(mb) if max_token_len else mb)  # (n, t), t <= T
        if out is None:
            out = part.new_zeros(N, T)
        out[rows.to(part.device), :part.shape[1]] = part
    return out if out is not None else torch.zeros(N, T)


@torch.no_grad()
def batched_logprobs(model, batch, temperature: float, micro_batch_size: int, *,
                     max_token_len: int = 0, dp: DataParallel = SINGLE) -> torch.Tensor:
    """No-grad log-probs of every row of a :class:`~verl_core.data.batch.Batch`: (N, T); micro-
    batches of ``micro_batch_size`` rows or of ``max_token_len`` tokens (``_by_micro_batch``)."""
    was_training = model.training
    model.eval()
    out = _by_micro_batch(lambda mb: response_logprobs(
        model, mb.prompt_ids, mb.prompt_mask, mb.response_ids, mb.response_mask,
        temperature)[0], batch, micro_batch_size, max_token_len, dp)
    model.train(was_training)
    return out


@torch.no_grad()
def batched_sum_pi_squared(model, batch, temperature: float, micro_batch_size: int, *,
                           max_token_len: int = 0, dp: DataParallel = SINGLE) -> torch.Tensor:
    """No-grad Σ_v π_v² of the (temperature-scaled) policy at every response position: (N, T),
    0 on padding. The optimal-token-baseline estimators read it (verl's ``sum_pi_squared``)."""
    def sum_pi_sq(logits, labels):  # (rows, V), (rows,) -> ((rows,),)
        if temperature not in (0.0, 1.0):
            logits = logits / temperature
        # Σ_v π_v² = exp(logsumexp(2z) - 2 logsumexp(z)), without forming the probabilities
        return (torch.exp(torch.logsumexp(2 * logits, -1) - 2 * torch.logsumexp(logits, -1)),)

    def one(mb):
        (sq,) = _rows_through_head(model, mb.prompt_ids, mb.prompt_mask, mb.response_ids,
                                   mb.response_mask, sum_pi_sq)
        return sq * mb.response_mask

    was_training = model.training
    model.eval()
    out = _by_micro_batch(one, batch, micro_batch_size, max_token_len, dp)
    model.train(was_training)
    return out


@torch.no_grad()
def batched_values(critic, batch, micro_batch_size: int, *, max_token_len: int = 0,
                   dp: DataParallel = SINGLE) -> torch.Tensor:
    """No-grad critic values of every row: (N, T) (micro-batches as ``batched_logprobs``)."""
    was_training = critic.training
    critic.eval()
    out = _by_micro_batch(lambda mb: critic_values(critic, mb.prompt_ids, mb.prompt_mask,
                                                   mb.response_ids, mb.response_mask),
                          batch, micro_batch_size, max_token_len, dp)
    critic.train(was_training)
    return out
