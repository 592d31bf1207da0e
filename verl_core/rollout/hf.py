"""``hf`` rollout engine: batched sampling with a KV cache in plain torch (CPU and GPU).

Why not ``model.generate``: it runs a stack of logits processors and stopping criteria per token
(Python overhead that dominates for small models), and its random draws depend on how a batch is
split. Here each row's token at step t is drawn by inverse-CDF sampling from a uniform
``u[row, t]`` drawn up front from a seeded generator, so a row's sample does not depend on the
micro-batch it lands in, and the whole rollout is reproducible under ``params.seed``.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from transformers import DynamicCache

from verl_core.rollout.base import (GenerationOutput, RolloutEngine, SamplingParams, check_rows,
                                    concat_outputs, cut_to_limits, resolve_stop_ids)
from verl_core.rollout.registry import register_engine
from verl_core.training.forward import cache_kwarg, distinct_rows, takes_logits_to_keep


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """logits: (n, V) already temperature-scaled. Returns logits with tokens outside the top-k
    and outside the smallest nucleus of mass >= top_p set to -inf (at least one token kept)."""
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]  # (n, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # mass strictly before each token; a token is dropped once that mass already covers top_p
        mass_before = probs.cumsum(-1) - probs
        drop_sorted = mass_before >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample_tokens(logits: torch.Tensor, u: torch.Tensor, params: SamplingParams):
    """logits: (n, V) raw; u: (n,) uniforms in [0, 1). Returns (tokens (n,), logp (n,)) where logp
    is log p(token) under softmax(logits / temperature) (greedy: under softmax(logits))."""
    logits = logits.float()
    if params.temperature == 0:
        tokens = logits.argmax(-1)
        logp = torch.log_softmax(logits, -1).gather(-1, tokens[:, None]).squeeze(-1)
        return tokens, logp
    scaled = logits / params.temperature
    logp_all = torch.log_softmax(scaled, -1)  # (n, V)
    probs = torch.softmax(filter_logits(scaled, params.top_k, params.top_p), -1)
    cdf = probs.cumsum(-1)  # (n, V)
    # inverse CDF: first token whose cumulative mass exceeds u * total
    tokens = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(-1), right=True).squeeze(-1)
    tokens = tokens.clamp_(max=logits.shape[-1] - 1)
    # a zero-probability token can only be hit through rounding at the top of the CDF
    tokens = torch.where(probs.gather(-1, tokens[:, None]).squeeze(-1) > 0, tokens,
                         probs.argmax(-1))
    return tokens, logp_all.gather(-1, tokens[:, None]).squeeze(-1)


@torch.no_grad()
def generate_with_cache(model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                        uniforms: torch.Tensor, params: SamplingParams, *,
                        eos_token_ids=None, pad_token_id: int,
                        eos_token_id: int | None = None) -> GenerationOutput:
    """prompt_ids/prompt_mask: (n, P) left-padded; uniforms: (n, T). One prefill, then one
    cached forward per new token; a row stops after the first of ``eos_token_ids`` (any EOS of
    the model), the loop when every row has."""
    n, T = prompt_ids.shape[0], params.max_new_tokens
    device = prompt_ids.device
    stop = torch.tensor(resolve_stop_ids(eos_token_ids, eos_token_id), device=device)  # (S,)
    attn = prompt_mask.long()
    position = (attn.cumsum(-1) - 1).clamp_(min=0)  # (n, P): left padding does not shift positions
    cache_kw = {cache_kwarg(model): DynamicCache()}  # mutated in place by every forward
    # the LM head on the last prompt position only: a full (n, P, V) prefill logits tensor would
    # grow with vocabulary x prompt length (~3 GB for 32 rows x 159 tokens at V = 151,936)
    head_kw = {"logits_to_keep": 1} if takes_logits_to_keep(model) else {}
    # a prompt's G samples share its prefill: each distinct (ids, mask) row is run once and every
    # row takes its prompt's keys, values and last logits (the same numbers a row-by-row
    # prefill of that batch of distinct prompts gives); G x less prefill compute
    first, inverse = (i.to(device) for i in
                      distinct_rows(torch.cat([prompt_ids, attn], 1).cpu()))
    out = model(input_ids=prompt_ids[first], attention_mask=attn[first],
                position_ids=position[first], use_cache=True, **cache_kw, **head_kw)
    logits = out.logits[:, -1][inverse]  # (n, V)
    if len(first) < n:
        cache_kw[cache_kwarg(model)].batch_select_indices(inverse)
    next_pos = position[:, -1:] + 1  # (n, 1)
    tokens = torch.full((n, T), pad_token_id, dtype=torch.long, device=device)
    logps = torch.zeros((n, T), dtype=torch.float32, device=device)
    mask = torch.zeros((n, T), dtype=torch.float32, device=device)
    done = torch.zeros(n, dtype=torch.bool, device=device)
    for t in range(T):
        tok, lp = sample_tokens(logits, uniforms[:, t], params)
        alive = ~done
        tokens[:, t] = torch.where(alive, tok, pad_token_id)
        logps[:, t] = torch.where(alive, lp, 0.0)
        mask[:, t] = alive.float()
        done = done | torch.isin(tok, stop)
        if t == T - 1 or bool(done.all()):
            break
        attn = torch.cat([attn, torch.ones((n, 1), dtype=attn.dtype, device=device)], dim=1)
        out = model(input_ids=tokens[:, t:t + 1], attention_mask=attn, position_ids=next_pos,
                    use_cache=True, **cache_kw)
        logits = out.logits[:, -1]
        next_pos = next_pos + 1
    return GenerationOutput(response_ids=tokens, response_mask=mask, logprobs=logps)


class HFEngine(RolloutEngine):
    """Samples from a (CPU or GPU) transformers causal LM it holds in memory."""

    def __init__(self, model, *, eos_token_ids=None, pad_token_id: int,
                 micro_batch_size: int = 512, eos_token_id: int | None = None):
        self.model = model
        self.eos_token_ids = resolve_stop_ids(eos_token_ids, eos_token_id)
        self.pad_token_id = pad_token_id
        self.micro_batch_size = micro_batch_size

    def load_weights(self, state_dict):
        self.model.load_state_dict(state_dict)

    def generate(self, prompt_ids, prompt_mask, params: SamplingParams, *, first_row: int = 0,
                 total_rows: int | None = None, row_seeds=None,
                 row_limits=None) -> GenerationOutput:
        n = prompt_ids.shape[0]
        check_rows(n, params, first_row, total_rows, row_seeds, row_limits)
        if row_limits is not None:  # sample to the longest limit, cut each row at its own
            params = replace(params, max_new_tokens=max(row_limits, default=1))
        if row_seeds is not None:  # each row its own draws
            uniforms = torch.stack([
                torch.rand(params.max_new_tokens, generator=torch.Generator().manual_seed(s))
                for s in row_seeds]) if n else torch.zeros((0, params.max_new_tokens))
        else:
            g = torch.Generator().manual_seed(params.seed)
            # (total, T) draws of the whole batch; these rows use theirs: (n, T)
            uniforms = torch.rand((total_rows or n, params.max_new_tokens), generator=g)
            uniforms = uniforms[first_row:first_row + n]
        was_training = self.model.training
        self.model.eval()
        device = next(self.model.parameters()).device
        outs = []
        for s in range(0, prompt_ids.shape[0], self.micro_batch_size):
            sl = slice(s, s + self.micro_batch_size)
            ids, m = prompt_ids[sl], prompt_mask[sl]
            keep = m.sum(0) > 0  # drop prompt columns that are padding for every row of the slice
            outs.append(generate_with_cache(
                self.model, ids[:, keep].to(device), m[:, keep].to(device),
                uniforms[sl].to(device), params, eos_token_ids=self.eos_token_ids,
                pad_token_id=self.pad_token_id))
        self.model.train(was_training)
        out = concat_outputs(outs, self.pad_token_id)
        return out if row_limits is None else cut_to_limits(out, row_limits, self.pad_token_id)


@register_engine("hf")
def _make_hf(model, pad_token_id: int, eos_token_ids=None, eos_token_id: int | None = None,
             micro_batch_size: int = 512, **_):
    return HFEngine(model, eos_token_ids=eos_token_ids, eos_token_id=eos_token_id,
                    pad_token_id=pad_token_id, micro_batch_size=micro_batch_size)
