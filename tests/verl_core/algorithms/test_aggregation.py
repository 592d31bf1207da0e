"""Loss aggregation modes: hand cases, a naive loop reference, masking."""

import math

import pytest
import torch

from verl_core.algorithms import LOSS_AGG_MODES, agg_loss

MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")


def naive_agg(loss_mat, mask, mode):
    """verl agg_loss written as Python loops over rows and tokens."""
    rows = []
    all_tokens = []
    for row_l, row_m in zip(loss_mat.tolist(), mask.tolist()):
        vals = [l for l, m in zip(row_l, row_m) if m]
        all_tokens += vals
        if vals:  # rows without a valid token are left out of the sequence mean
            rows.append(sum(vals) if mode == "seq-mean-token-sum" else sum(vals) / len(vals))
    if mode == "token-mean":
        return sum(all_tokens) / len(all_tokens) if all_tokens else 0.0
    return sum(rows) / len(rows) if rows else 0.0


def test_hand_computed():
    loss = torch.tensor([[1.0, 2.0, 3.0],
                         [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1],
                         [1, 0, 0]])
    # token-mean: (1 + 2 + 3 + 4) / 4 tokens = 2.5
    assert agg_loss(loss, mask, "token-mean").item() == pytest.approx(2.5)
    # seq-mean-token-sum: rows sum to 6 and 4 -> (6 + 4) / 2 = 5
    assert agg_loss(loss, mask, "seq-mean-token-sum").item() == pytest.approx(5.0)
    # seq-mean-token-mean: row means 2 and 4 -> (2 + 4) / 2 = 3
    assert agg_loss(loss, mask, "seq-mean-token-mean").item() == pytest.approx(3.0)


@pytest.mark.parametrize("mode", MODES)
def test_fully_masked_rows_and_padding_garbage_are_ignored(mode):
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    expected = agg_loss(loss, mask, mode)
    # A fully masked row and non-finite values at masked positions change nothing.
    loss2 = torch.tensor([[1.0, 2.0, 3.0], [4.0, float("nan"), float("inf")], [9.0, 9.0, -float("inf")]])
    mask2 = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]])
    assert torch.equal(agg_loss(loss2, mask2, mode), expected)


@pytest.mark.parametrize("mode", MODES)
def test_all_masked_is_zero_not_nan(mode):
    out = agg_loss(torch.randn(3, 4), torch.zeros(3, 4), mode)
    assert out.item() == 0.0


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("seed", range(5))
def test_matches_naive_loop(mode, seed):
    g = torch.Generator().manual_seed(seed)
    N, T = int(torch.randint(1, 9, (1,), generator=g)), int(torch.randint(1, 12, (1,), generator=g))
    loss = torch.randn(N, T, generator=g, dtype=torch.float64)
    lengths = torch.randint(0, T + 1, (N,), generator=g)  # includes empty rows
    lengths[0] = max(int(lengths[0]), 1)
    mask = (torch.arange(T)[None, :] < lengths[:, None]).long()
    got = agg_loss(loss, mask, mode).item()
    assert got == pytest.approx(naive_agg(loss, mask, mode), rel=1e-12, abs=1e-12)


def test_token_mean_gradient_is_uniform_over_valid_tokens():
    loss = torch.randn(2, 3, requires_grad=True)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    agg_loss(loss, mask, "token-mean").backward()
    # d/dl_it of sum(m l) / sum(m) = m_it / 3
    assert torch.allclose(loss.grad, mask / 3.0)


def test_seq_mean_token_mean_weighs_responses_equally():
    loss = torch.randn(2, 4, requires_grad=True)
    mask = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0]])
    agg_loss(loss, mask, "seq-mean-token-mean").backward()
    # row 0: 1/2 * 1/4 per token; row 1: 1/2 * 1 on its only token
    expected = torch.tensor([[0.125] * 4, [0.5, 0.0, 0.0, 0.0]])
    assert torch.allclose(loss.grad, expected)


def test_unknown_mode_lists_known_ones():
    with pytest.raises(KeyError) as e:
        agg_loss(torch.zeros(1, 1), torch.ones(1, 1), "token-sum")
    for m in MODES:
        assert m in str(e.value)
    assert set(LOSS_AGG_MODES.names()) == set(MODES)
    assert not math.isnan(agg_loss(torch.ones(1, 1), torch.ones(1, 1), "token-mean").item())
