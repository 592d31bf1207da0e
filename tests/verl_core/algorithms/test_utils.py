"""Masked reductions, logit helpers and outcome-reward placement."""

import math

import pytest
import torch
import torch.nn.functional as F

from verl_core.algorithms import utils
from verl_core.algorithms.utils import (
    entropy_from_logits,
    logprobs_from_logits,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
    outcome_to_token_rewards,
)


def naive_masked_stats(x, mask):
    vals = [v for v, m in zip(x.flatten().tolist(), mask.flatten().tolist()) if m]
    n = len(vals)
    mean = sum(vals) / n
    var_biased = sum((v - mean) ** 2 for v in vals) / n
    return mean, var_biased, var_biased * n / (n - 1)


def test_masked_reductions_hand_computed():
    x = torch.tensor([[1.0, 2.0, 100.0], [3.0, 6.0, -50.0]])
    m = torch.tensor([[1, 1, 0], [1, 1, 0]])
    assert masked_sum(x, m).item() == 12.0  # 1 + 2 + 3 + 6
    assert masked_mean(x, m).item() == pytest.approx(3.0)  # 12 / 4
    assert masked_mean(x, m, dim=-1).tolist() == pytest.approx([1.5, 4.5])
    assert masked_sum(x, m, dim=0).tolist() == [4.0, 8.0, 0.0]
    # values 1, 2, 3, 6: mean 3, squared deviations 4, 1, 0, 9 -> biased 14/4 = 3.5, unbiased 14/3
    assert masked_var(x, m, unbiased=False).item() == pytest.approx(3.5)
    assert masked_var(x, m).item() == pytest.approx(14 / 3)
    w = masked_whiten(x, m)
    # (x - 3) / sqrt(14/3 + 1e-8)
    assert w[m.bool()].tolist() == pytest.approx([(v - 3) / math.sqrt(14 / 3) for v in (1, 2, 3, 6)],
                                                 rel=1e-6)
    w2 = masked_whiten(x, m, shift_mean=False)
    assert torch.allclose(w2, w + 3.0)


@pytest.mark.parametrize("seed", range(4))
def test_masked_stats_match_naive(seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(5, 7, generator=g, dtype=torch.float64)
    m = torch.rand(5, 7, generator=g) < 0.6
    m[0, :2] = True
    mean, var_b, var_u = naive_masked_stats(x, m)
    assert masked_mean(x, m).item() == pytest.approx(mean, rel=1e-7)
    assert masked_var(x, m, unbiased=False).item() == pytest.approx(var_b, rel=1e-7)
    assert masked_var(x, m).item() == pytest.approx(var_u, rel=1e-7)
    # float mask and bool mask agree
    assert torch.allclose(masked_whiten(x, m), masked_whiten(x, m.double()))


def test_masked_sum_ignores_non_finite_values_outside_mask():
    x = torch.tensor([1.0, float("nan"), float("inf")])
    m = torch.tensor([1, 0, 0])
    assert masked_sum(x, m).item() == 1.0
    assert masked_mean(x, m).item() == pytest.approx(1.0)


def test_degenerate_masks_do_not_produce_nan():
    x = torch.tensor([[5.0, 7.0]])
    assert masked_mean(x, torch.zeros(1, 2)).item() == 0.0
    assert masked_var(x, torch.zeros(1, 2)).item() == 0.0  # verl raises here; we return 0
    assert masked_var(x, torch.tensor([[1, 0]])).item() == 0.0  # one element: 0, not 0/0
    assert torch.isfinite(masked_whiten(x, torch.tensor([[1, 0]]))).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_logprobs_match_log_softmax_gather(dtype):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 11, generator=g, dtype=dtype) * 4
    labels = torch.randint(0, 11, (3, 5), generator=g)
    ref = F.log_softmax(logits, dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    out = logprobs_from_logits(logits, labels)
    assert out.shape == (3, 5) and out.dtype == dtype
    assert torch.allclose(out, ref, atol=1e-6)


def test_logit_helpers_chunk_and_keep_gradients(monkeypatch):
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 6, 13, generator=g, requires_grad=True)
    labels = torch.randint(0, 13, (4, 6), generator=g)
    whole_lp = logprobs_from_logits(logits, labels)
    whole_h = entropy_from_logits(logits)
    (g_lp,) = torch.autograd.grad(whole_lp.sum(), logits)
    monkeypatch.setattr(utils, "_LOGIT_CHUNK_ELEMENTS", 13 * 5)  # 5 rows per chunk, 24 rows
    chunk_lp = logprobs_from_logits(logits, labels)
    chunk_h = entropy_from_logits(logits)
    (g_lp2,) = torch.autograd.grad(chunk_lp.sum(), logits)
    assert torch.allclose(whole_lp, chunk_lp) and torch.allclose(whole_h, chunk_h)
    assert torch.allclose(g_lp, g_lp2)


def test_bf16_logits_are_computed_in_float32():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(2, 3, 50, generator=g).to(torch.bfloat16)
    labels = torch.randint(0, 50, (2, 3), generator=g)
    out = logprobs_from_logits(logits, labels)
    ref = F.log_softmax(logits.float(), -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    assert out.dtype == torch.float32 and torch.allclose(out, ref, atol=1e-6)
    assert entropy_from_logits(logits).dtype == torch.float32


def test_entropy_hand_cases_and_naive():
    V = 8
    uniform = torch.zeros(1, 1, V)
    assert entropy_from_logits(uniform).item() == pytest.approx(math.log(V), rel=1e-6)  # H(uniform) = log V
    peaked = torch.full((1, 1, V), -1e4)
    peaked[..., 3] = 0.0
    assert entropy_from_logits(peaked).item() == pytest.approx(0.0, abs=1e-6)  # one-hot: 0
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 4, V, generator=g, dtype=torch.float64)
    p = torch.softmax(logits, -1)
    naive = -(p * torch.log(p)).sum(-1)  # -Σ p log p
    assert torch.allclose(entropy_from_logits(logits), naive)


def test_outcome_to_token_rewards_hand_cases():
    scores = torch.tensor([1.0, 0.5, 2.0, 3.0])
    mask = torch.tensor([[1, 1, 0, 0],   # length 2: score on token 1 (verl: valid_length - 1)
                         [1, 1, 1, 1],   # full length: last token
                         [0, 0, 0, 0],   # no tokens: no reward anywhere
                         [1, 0, 1, 0]])  # a hole (multi-turn): the last set position, 2
    out = outcome_to_token_rewards(scores, mask)
    expected = torch.tensor([[0, 1.0, 0, 0],
                             [0, 0, 0, 0.5],
                             [0, 0, 0, 0],
                             [0, 0, 3.0, 0]])
    assert torch.equal(out, expected)
    assert out.sum(-1).tolist() == [1.0, 0.5, 0.0, 3.0]


@pytest.mark.parametrize("seed", range(3))
def test_outcome_to_token_rewards_matches_verl_for_right_padding(seed):
    g = torch.Generator().manual_seed(seed)
    N, T = 6, 5
    lengths = torch.randint(1, T + 1, (N,), generator=g)
    mask = (torch.arange(T)[None] < lengths[:, None]).long()
    scores = torch.randn(N, generator=g)
    expected = torch.zeros(N, T)
    for i in range(N):  # verl: reward_tensor[i, valid_response_length - 1] = score
        expected[i, int(lengths[i]) - 1] = scores[i]
    assert torch.equal(outcome_to_token_rewards(scores, mask), expected)


def test_outcome_to_token_rewards_int_scores_and_bad_shape():
    out = outcome_to_token_rewards(torch.tensor([1, 0]), torch.ones(2, 3))
    assert out.dtype == torch.float32 and out[:, -1].tolist() == [1.0, 0.0]
    with pytest.raises(ValueError, match=r"\(N,\)"):
        outcome_to_token_rewards(torch.ones(3), torch.ones(2, 3))
