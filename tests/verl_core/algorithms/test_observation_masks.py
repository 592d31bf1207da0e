"""Issue 25's first done-when test: the loss of a multi-turn response (a response mask with holes
where tool responses and template tokens were appended) does not see the logits at the holes.
Perturbing them leaves every registered policy loss, under every aggregation mode, with the
entropy bonus and the KL loss, bit for bit unchanged, and their gradients w.r.t. the logits are
exactly zero there (the forward's ``logp * response_mask`` and the masked aggregation)."""
import pytest
import torch

from verl_core.algorithms import (LOSS_AGG_MODES, POLICY_LOSSES, PolicyLossOptions, agg_loss,
                                  get_policy_loss, kl_loss)
from verl_core.algorithms.utils import entropy_from_logits, logprobs_from_logits

N, T, V = 4, 12, 11


def _mask_with_holes() -> torch.Tensor:
    m = torch.ones(N, T)
    m[0, 3:7] = 0  # one tool response in the middle
    m[1, 2:4] = 0
    m[1, 8:10] = 0  # two turns with tools
    m[2, 10:] = 0  # right padding
    m[3, 5:] = 0
    m[3, 7:9] = 1  # a last short turn after a tool response that ran to the budget
    return m


def _loss(logits, labels, mask, old, ref, adv, name, mode):
    flat = logits.reshape(N * T, V)
    logp = logprobs_from_logits(flat, labels.reshape(-1)).reshape(N, T) * mask
    ent = entropy_from_logits(flat).reshape(N, T) * mask
    pg, _ = get_policy_loss(name)(old, logp, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.28,
                                  clip_ratio_c=3.0, loss_agg_mode=mode, loss_scale_factor=float(T),
                                  rollout_is_weights=None, options=PolicyLossOptions(dro_beta=0.5),
                                  generator=torch.Generator().manual_seed(0))
    # the scale ppo_update passes every term (seq-mean-token-sum-norm's C: the padded width)
    return (pg - 0.01 * agg_loss(ent, mask, mode, loss_scale_factor=float(T)) +
            0.1 * kl_loss(logp, ref, mask, kl_loss_type="low_var_kl", loss_agg_mode=mode,
                          loss_scale_factor=float(T)))


@pytest.mark.parametrize("mode", LOSS_AGG_MODES.names())
@pytest.mark.parametrize("name", POLICY_LOSSES.names())
def test_logits_at_observation_tokens_change_nothing(name, mode):
    g = torch.Generator().manual_seed(1)
    mask = _mask_with_holes()
    labels = torch.randint(0, V, (N, T), generator=g)
    logits = torch.randn(N, T, V, generator=g, dtype=torch.float64)
    with torch.no_grad():
        base = logprobs_from_logits(logits.reshape(-1, V), labels.reshape(-1)).reshape(N, T)
    old = (base + 0.05 * torch.randn(N, T, generator=g, dtype=torch.float64)) * mask
    ref = (base + 0.05 * torch.randn(N, T, generator=g, dtype=torch.float64)) * mask
    adv = torch.randn(N, T, generator=g, dtype=torch.float64) * mask
    noise = 30 * torch.randn(N, T, V, generator=g, dtype=torch.float64)
    noise[mask.bool()] = 0  # only the holes (and the padding) move

    results = []
    for x in (logits, logits + noise):
        leaf = x.clone().requires_grad_(True)
        loss = _loss(leaf, labels, mask, old, ref, adv, name, mode)
        loss.backward()
        results.append((loss.detach(), leaf.grad))
    (l0, g0), (l1, g1) = results
    assert torch.isfinite(l0) and torch.equal(l0, l1)
    assert torch.equal(g0, g1)
    assert not g0[~mask.bool()].any()  # no gradient reaches a logit at a hole
