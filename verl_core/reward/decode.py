"""Turning generated token ids into the text every scorer sees.

A response is what the policy generated up to its first EOS (any id of the model's EOS set,
:func:`stop_token_ids`: ``<|im_end|>`` or ``<|endoftext|>`` for Qwen2.5, as verl/vLLM stop there):
tokens past the response mask (padding) and from the first EOS on are dropped, and the rest is
decoded with special tokens KEPT as their text. Stripping them instead (``skip_special_tokens=True``) would let ``1<pad>12``
score as ``112``. A special token before the first EOS is flagged: rule scorers count such a
response as a wrong answer; custom scorers see the token's text (e.g. ``1<pad>12``) and decide.

A multi-turn response (issue 25: assistant turns with tool responses and template tokens
between them) is scored as verl's agent loop scores it: every real token, decoded with special
tokens skipped (the template's turn markers go, the role names and tool responses stay). It is
flagged when a special token other than an EOS lies inside a span the policy sampled.

No torch import (custom-scorer workers import this package): tensors are read with ``tolist``.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DecodedResponses", "decode_responses", "special_token_ids", "stop_token_ids"]


@dataclass(frozen=True)
class DecodedResponses:
    """N responses as scorers see them."""

    texts: list[str]
    """(N,) each response cut at its first EOS, decoded with special tokens kept as text."""
    special_token: list[bool]
    """(N,) whether a special token (pad, bos, unk, ...) comes before the first EOS."""


def stop_token_ids(tokenizer) -> tuple[int, ...]:
    """The ids that end a response: the model's EOS set that ``load_tokenizer`` resolved
    (``tokenizer.stop_token_ids``: tokenizer, generation_config and config EOS ids), else the
    tokenizer's one EOS (a tokenizer built in memory, e.g. the tiny model's)."""
    ids = getattr(tokenizer, "stop_token_ids", None)
    if ids:
        return tuple(ids)
    return () if tokenizer.eos_token_id is None else (int(tokenizer.eos_token_id),)


def special_token_ids(tokenizer) -> frozenset[int]:
    """Ids that ``skip_special_tokens=True`` would strip: the named special tokens plus every
    added token marked special."""
    ids = set(getattr(tokenizer, "all_special_ids", ()) or ())
    for i, tok in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
        if getattr(tok, "special", False):
            ids.add(int(i))
    return frozenset(ids)


def _rows(x):
    return x.tolist() if hasattr(x, "tolist") else list(x)


def decode_responses(tokenizer, response_ids, response_mask=None,
                     sampled_mask=None) -> DecodedResponses:
    """Decode N generated responses for scoring.

    ``response_ids``: (N, T) ids, right-padded (a tensor or nested lists); ``response_mask``:
    (N, T), nonzero on generated tokens (EOS included); None when every id was generated.
    ``sampled_mask`` (N, T): multi-turn responses (module docstring), ``response_mask`` then
    being nonzero on every real token and this on the sampled ones.
    """
    rows = _rows(response_ids)
    masks = _rows(response_mask) if response_mask is not None else [None] * len(rows)
    stop = frozenset(stop_token_ids(tokenizer))
    special = special_token_ids(tokenizer)
    if sampled_mask is not None:
        kept = [[int(t) for t, m in zip(ids, mask) if m] for ids, mask in zip(rows, masks)]
        flags = [any(int(t) in special and int(t) not in stop
                     for t, s in zip(ids, smask) if s)
                 for ids, smask in zip(rows, _rows(sampled_mask))]
        return DecodedResponses(texts=tokenizer.batch_decode(kept, skip_special_tokens=True),
                                special_token=flags)
    kept: list[list[int]] = []
    flags: list[bool] = []
    for ids, mask in zip(rows, masks):
        ids = [int(t) for t, m in zip(ids, mask) if m] if mask is not None else list(ids)
        first = next((i for i, t in enumerate(ids) if t in stop), None)
        if first is not None:
            ids = ids[:first]
        kept.append(ids)
        flags.append(any(t in special for t in ids))
    # the G responses to a prompt often repeat (short answers): decode each distinct one once
    distinct: dict[tuple[int, ...], int] = {}
    for ids in kept:
        distinct.setdefault(tuple(ids), len(distinct))
    decoded = tokenizer.batch_decode([list(k) for k in distinct], skip_special_tokens=False) \
        if distinct else []
    texts = [decoded[distinct[tuple(ids)]] for ids in kept]
    return DecodedResponses(texts=texts, special_token=flags)

