"""Loss aggregation modes: hand cases, a naive loop reference, masking, micro-batch weights."""

import math

import pytest
import torch

from verl_core.algorithms import LOSS_AGG_MODES, agg_loss, micro_batch_weight

MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm",
         "token-sum")


def naive_agg(loss_mat, mask, mode, scale=None):
    """verl agg_loss written as Python loops over rows and tokens."""
    rows = []
    all_tokens = []
    for row_l, row_m in zip(loss_mat.tolist(), mask.tolist()):
        vals = [l for l, m in zip(row_l, row_m) if m]
        all_tokens += vals
        if vals:  # rows without a valid token are left out of the sequence mean
            rows.append(sum(vals) / len(vals) if mode == "seq-mean-token-mean" else sum(vals))
    if mode == "token-mean":
        return sum(all_tokens) / len(all_tokens) if all_tokens else 0.0
    if mode == "token-sum":
        return sum(all_tokens)
    seq_mean = sum(rows) / len(rows) if rows else 0.0
    if mode == "seq-mean-token-sum-norm":  # divided by the constant, default the padded width T
        return seq_mean / (loss_mat.shape[-1] if scale is None else scale)
    return seq_mean


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
    # token-sum: 1 + 2 + 3 + 4 = 10, no denominator
    assert agg_loss(loss, mask, "token-sum").item() == pytest.approx(10.0)
    # seq-mean-token-sum-norm: seq-mean-token-sum 5 / T = 3 columns -> 5/3; with C = 10 -> 0.5
    assert agg_loss(loss, mask, "seq-mean-token-sum-norm").item() == pytest.approx(5.0 / 3)
    assert agg_loss(loss, mask, "seq-mean-token-sum-norm",
                    loss_scale_factor=10.0).item() == pytest.approx(0.5)
    # the other modes ignore the factor
    for mode in ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "token-sum"):
        assert agg_loss(loss, mask, mode, loss_scale_factor=10.0) == agg_loss(loss, mask, mode)


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


def random_case(seed):
    g = torch.Generator().manual_seed(seed)
    N, T = int(torch.randint(1, 9, (1,), generator=g)), int(torch.randint(1, 12, (1,), generator=g))
    loss = torch.randn(N, T, generator=g, dtype=torch.float64)
    lengths = torch.randint(0, T + 1, (N,), generator=g)  # includes empty rows
    lengths[0] = max(int(lengths[0]), 1)
    mask = (torch.arange(T)[None, :] < lengths[:, None]).long()
    holes = torch.rand(N, T, generator=g) < 0.2  # and holes inside responses
    return loss, mask * ~holes


@pytest.mark.parametrize("scale", [None, 7.0])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("seed", range(5))
def test_matches_naive_loop(mode, seed, scale):
    loss, mask = random_case(seed)
    got = agg_loss(loss, mask, mode, loss_scale_factor=scale).item()
    assert got == pytest.approx(naive_agg(loss, mask, mode, scale), rel=1e-12, abs=1e-12)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("seed", range(6))
def test_micro_batch_weights_make_any_split_give_the_batch_loss(mode, seed):
    # sum_k w_k · agg(L_k) == agg(L) for a random split into contiguous micro-batches (rows with
    # no token and micro-batches with no token included); the weights need only the masks.
    loss, mask = random_case(seed)
    N = loss.shape[0]
    g = torch.Generator().manual_seed(100 + seed)
    cuts = sorted(set(torch.randint(1, N, (3,), generator=g).tolist())) if N > 1 else []
    bounds = [0, *cuts, N]
    terms = [micro_batch_weight(mask[a:b], mask, mode).item()
             * agg_loss(loss[a:b], mask[a:b], mode, loss_scale_factor=3.0).item()
             for a, b in zip(bounds, bounds[1:])]
    # the weights are float32 ratios of counts: one rounding (2^-24 relative) per term
    tol = 2 * 2.0 ** -24 * sum(abs(t) for t in terms) + 1e-15
    assert abs(sum(terms) - agg_loss(loss, mask, mode, loss_scale_factor=3.0).item()) <= tol


def test_micro_batch_weight_hand_computed_and_unknown_mode():
    mini = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0], [1, 1, 0]])
    micro = mini[:2]  # 4 of the 6 tokens, 2 of the 3 non-empty rows
    assert micro_batch_weight(micro, mini, "token-mean").item() == pytest.approx(4 / 6)
    for mode in ("seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
        assert micro_batch_weight(micro, mini, mode).item() == pytest.approx(2 / 3)
    assert micro_batch_weight(micro, mini, "token-sum").item() == 1.0  # sums add up
    with pytest.raises(KeyError, match="known: seq-mean-token-mean"):
        micro_batch_weight(micro, mini, "token-median")


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
        agg_loss(torch.zeros(1, 1), torch.ones(1, 1), "token-median")
    for m in MODES:
        assert m in str(e.value)
    assert set(LOSS_AGG_MODES.names()) == set(MODES)
    assert not math.isnan(agg_loss(torch.ones(1, 1), torch.ones(1, 1), "token-mean").item())
