"""Clipped value loss and entropy loss."""

import math

import pytest
import torch

from verl_core.algorithms import agg_loss, entropy_from_logits, entropy_loss, value_loss

MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")


def test_value_loss_hand_computed():
    vpreds = torch.tensor([[1.0, 0.2]], requires_grad=True)
    values = torch.tensor([[0.0, 0.0]])
    returns = torch.tensor([[2.0, 1.0]])
    loss, m = value_loss(vpreds, values, returns, torch.ones(1, 2), cliprange_value=0.5,
                         loss_agg_mode="token-mean")
    # token 0: V^clip = 0 + clip(1, ±0.5) = 0.5; (1 - 2)^2 = 1 < (0.5 - 2)^2 = 2.25 -> 2.25, clipped
    # token 1: V^clip = 0.2 (inside the range); (0.2 - 1)^2 = 0.64 both -> 0.64, not clipped
    # loss = ½ · (2.25 + 0.64) / 2 = 0.7225
    assert loss.item() == pytest.approx(0.7225)
    assert m["vf_clipfrac"].item() == pytest.approx(0.5)
    loss.backward()
    # token 0 takes the clipped branch (no gradient); token 1: ½ · 2 (0.2 - 1) / 2 = -0.4
    assert vpreds.grad[0].tolist() == pytest.approx([0.0, -0.4])


def test_value_clipping_only_bites_when_it_increases_the_loss():
    # moving away from old value but towards the return: the unclipped (smaller-error) term loses
    # the max, so the clipped error is used -> the update is bounded
    vpreds = torch.tensor([[3.0]])
    loss, m = value_loss(vpreds, torch.zeros(1, 1), torch.tensor([[3.0]]), torch.ones(1, 1),
                         cliprange_value=0.5, loss_agg_mode="token-mean")
    assert loss.item() == pytest.approx(0.5 * (0.5 - 3.0) ** 2) and m["vf_clipfrac"].item() == 1.0
    # overshooting the return beyond the clip: the unclipped error is larger and is used
    loss, m = value_loss(torch.tensor([[3.0]]), torch.zeros(1, 1), torch.tensor([[0.2]]), torch.ones(1, 1),
                         cliprange_value=0.5, loss_agg_mode="token-mean")
    assert loss.item() == pytest.approx(0.5 * (3.0 - 0.2) ** 2) and m["vf_clipfrac"].item() == 0.0


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("seed", range(4))
def test_value_loss_matches_naive(mode, seed):
    g = torch.Generator().manual_seed(seed)
    N, T = 4, 5
    vpreds = torch.randn(N, T, generator=g, dtype=torch.float64)
    values = torch.randn(N, T, generator=g, dtype=torch.float64)
    returns = torch.randn(N, T, generator=g, dtype=torch.float64)
    mask = (torch.arange(T)[None] < torch.randint(1, T + 1, (N, 1), generator=g)).long()
    eps = 0.3
    loss, m = value_loss(vpreds, values, returns, mask, cliprange_value=eps, loss_agg_mode=mode)
    L, C = torch.zeros(N, T, dtype=torch.float64), []
    for i in range(N):
        for t in range(T):
            v, old, r = vpreds[i, t].item(), values[i, t].item(), returns[i, t].item()
            clipped = min(max(v, old - eps), old + eps)
            l1, l2 = (v - r) ** 2, (clipped - r) ** 2
            L[i, t] = max(l1, l2)
            if mask[i, t]:
                C.append(float(l2 > l1))
    assert loss.item() == pytest.approx(0.5 * agg_loss(L, mask, mode).item(), rel=1e-12)
    assert m["vf_clipfrac"].item() == pytest.approx(sum(C) / len(C))


@pytest.mark.parametrize("mode", MODES)
def test_entropy_loss(mode):
    V = 16
    logits = torch.zeros(2, 3, V)  # uniform: H = log V at every token
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    out = entropy_loss(logits, mask, mode)
    per_token = math.log(V)
    expected = {"token-mean": per_token, "seq-mean-token-mean": per_token,
                "seq-mean-token-sum": (3 * per_token + per_token) / 2}[mode]
    assert out.item() == pytest.approx(expected, rel=1e-6)
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, V, generator=g, requires_grad=True)
    out = entropy_loss(logits, mask, loss_agg_mode=mode)
    assert torch.allclose(out, agg_loss(entropy_from_logits(logits), mask, mode))
    out.backward()
    assert (logits.grad[~mask.bool()] == 0).all()
