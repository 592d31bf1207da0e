"""The LM head only where it is needed (issue 23 item 2): training's log-probs and entropy from
the response positions' logits in checkpointed chunks, and the rollout prefill's last position,
equal the old full-logits computation up to float32 rounding, and stay deterministic.

Tolerance. Old and new compute each logit as the same float32 dot product h . w over H terms,
possibly summed in another order (a gemm over P + T positions vs over T). Each is within
gamma_H * sum_i |h_i| |w_i| of the exact value (Higham, Accuracy and Stability of Numerical
Algorithms, 3.1; gamma_H = H u / (1 - H u), u = 2^-24), so two of them differ by at most
delta = 2 gamma_H max_{pos, v} (|h| . |w_v|) / temperature. logp = x_y - logsumexp(x) moves by at
most 2 delta through its inputs; entropy H = lse(x) - sum_v p_v x_v has d H / d x_v =
-p_v (x_v - E_p[x]), so it moves by at most delta * 2 max|x|. Each side's own rounding of the
log-softmax over V terms adds at most gamma_V (max|x| + |lse|) per side.
"""

from __future__ import annotations

import torch
from torch import nn

import verl_core.training.forward as forward
from verl_core.algorithms.utils import entropy_from_logits, logprobs_from_logits
from verl_core.rollout.base import SamplingParams
from verl_core.rollout.hf import generate_with_cache

U = 2.0 ** -24
TEMPERATURE = 0.7


def gamma(n: int) -> float:
    return n * U / (1 - n * U)


def tiny_qwen2(vocab=512, seed=0):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=vocab, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=64, tie_word_embeddings=False, pad_token_id=0)
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(cfg).float()


class NoLogitsToKeep(nn.Module):
    """The same model behind a forward without ``logits_to_keep``: the old full-logits path."""

    def __init__(self, model):
        super().__init__()
        self.m = model

    def forward(self, input_ids, attention_mask, position_ids, **kw):
        return self.m(input_ids=input_ids, attention_mask=attention_mask,
                      position_ids=position_ids, **kw)


def rows(vocab=512, n=5, P=6, T=7, seed=1):
    """Left-padded prompts and right-padded responses of different lengths."""
    g = torch.Generator().manual_seed(seed)
    p_ids = torch.randint(1, vocab, (n, P), generator=g)
    r_ids = torch.randint(1, vocab, (n, T), generator=g)
    p_len = torch.tensor([P, 3, 1, P - 1, 2][:n])
    r_len = torch.tensor([T, 1, 4, T - 2, 3][:n])
    p_mask = (torch.arange(P) >= P - p_len[:, None]).long()
    r_mask = (torch.arange(T) < r_len[:, None]).float()
    return p_ids * p_mask, p_mask, r_ids * r_mask.long(), r_mask


def old_computation(model, p_ids, p_mask, r_ids, r_mask, temperature):
    """The pre-fix code: logits over every position, sliced, divided, log-softmax + entropy."""
    ids, attn, position, P = forward._inputs(p_ids, p_mask, r_ids, r_mask)
    out = model(input_ids=ids, attention_mask=attn, position_ids=position,
                output_hidden_states=True)
    logits = out.logits[:, P - 1:-1].float() / temperature  # (n, T, V)
    logp = logprobs_from_logits(logits, r_ids) * r_mask
    ent = entropy_from_logits(logits) * r_mask
    h = out.hidden_states[-1][:, P - 1:-1]  # (n, T, H): the LM head's input
    w = model.get_output_embeddings().weight  # (V, H)
    delta = 2 * gamma(h.shape[-1]) * (h.abs() @ w.abs().T).max() / temperature
    lse = torch.logsumexp(logits, -1).abs().max()
    return logp, ent, float(delta), float(logits.abs().max()), float(lse)


def tolerances(delta, xmax, lse, V):
    own = 2 * gamma(V) * (xmax + lse)  # each side's log-softmax rounding
    return 2 * delta + own, 2 * delta * xmax + own


def test_logprobs_and_entropy_equal_the_full_logits_computation(monkeypatch):
    model = tiny_qwen2()
    batch = rows()
    with torch.no_grad():
        logp0, ent0, delta, xmax, lse = old_computation(model, *batch, TEMPERATURE)
    tol_logp, tol_ent = tolerances(delta, xmax, lse, 512)
    # 35 positions in chunks of 8 rows: several chunks and a short last one
    monkeypatch.setattr(forward, "_CHUNK_ELEMENTS", 8 * 512)
    for grad in (False, True):
        with torch.set_grad_enabled(grad):
            logp, ent = forward.response_logprobs(model, *batch, TEMPERATURE, with_entropy=True)
        assert (logp - logp0).abs().max() <= tol_logp
        assert (ent - ent0).abs().max() <= tol_ent
        assert logp[batch[3] == 0].eq(0).all() and ent[batch[3] == 0].eq(0).all()
    # the model without logits_to_keep takes the full-logits path and agrees too
    with torch.no_grad():
        logp, ent = forward.response_logprobs(NoLogitsToKeep(model), *batch, TEMPERATURE, True)
    assert (logp - logp0).abs().max() <= tol_logp and (ent - ent0).abs().max() <= tol_ent


def test_checkpointed_chunks_give_the_gradients_of_the_unchunked_loss(monkeypatch):
    """Backward through the checkpointed chunks recomputes each chunk's softmax: the gradient is
    the one of the same loss computed in one piece (same ops on the same logits, so bit-equal
    up to the chunk-wise reduction order of the head's own input gradient; both are float32
    gemms over n*T rows, compared within gamma_{nT} relative to the summed magnitudes)."""
    model = tiny_qwen2()
    batch = rows()
    r_mask = batch[3]

    def grads(chunk_elements):
        monkeypatch.setattr(forward, "_CHUNK_ELEMENTS", chunk_elements)
        model.zero_grad()
        logp, ent = forward.response_logprobs(model, *batch, TEMPERATURE, with_entropy=True)
        ((logp * r_mask).sum() + 0.1 * (ent * r_mask).sum()).backward()
        return {k: p.grad.clone() for k, p in model.named_parameters()}

    whole, chunked = grads(1 << 30), grads(8 * 512)
    nT = int(r_mask.numel())
    for k in whole:
        scale = whole[k].abs().max() + chunked[k].abs().max()
        assert (whole[k] - chunked[k]).abs().max() <= 4 * gamma(nT * 64) * scale + 1e-30, k


def test_training_forward_is_deterministic(monkeypatch):
    monkeypatch.setattr(forward, "_CHUNK_ELEMENTS", 8 * 512)
    outs = []
    for _ in range(2):
        model = tiny_qwen2()
        batch = rows()
        logp, ent = forward.response_logprobs(model, *batch, TEMPERATURE, with_entropy=True)
        (logp.sum() + ent.sum()).backward()
        outs.append([logp.detach(), ent.detach()] + [p.grad for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*outs))


def test_rollout_prefill_on_the_last_position_samples_what_full_logits_sample():
    model = tiny_qwen2().eval()
    p_ids, p_mask, _, _ = rows()
    params = SamplingParams(temperature=TEMPERATURE, max_new_tokens=6, seed=0)
    u = torch.rand((p_ids.shape[0], 6), generator=torch.Generator().manual_seed(3))
    kw = dict(eos_token_id=511, pad_token_id=0)
    new = generate_with_cache(model, p_ids, p_mask, u, params, **kw)
    old = generate_with_cache(NoLogitsToKeep(model), p_ids, p_mask, u, params, **kw)
    assert torch.equal(new.response_ids, old.response_ids)
    assert torch.equal(new.response_mask, old.response_mask)
    # each sampled log-prob is one log-softmax of logits that differ by at most delta
    with torch.no_grad():
        _, _, delta, xmax, lse = old_computation(model, p_ids, p_mask, new.response_ids,
                                                 new.response_mask, TEMPERATURE)
    assert (new.logprobs - old.logprobs).abs().max() <= tolerances(delta, xmax, lse, 512)[0]
