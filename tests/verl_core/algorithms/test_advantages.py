"""Advantage estimators: hand cases, verl-style naive loops, edge cases.

The naive references below are written the way verl's ``core_algos.py`` writes them (Python
dicts keyed by group id, per-row loops, ``torch.mean`` / ``torch.std``) and run on plain Python
floats; the library versions are vectorised. They are compared on valid tokens; masked positions
must be exactly 0 in the library's output.
"""

import dataclasses
import inspect
import math
from collections import defaultdict

import pytest
import torch

from tests.verl_core.algorithms.inputs import EstimatorInputs
from verl_core import algorithms
from verl_core.algorithms import ADVANTAGE_ESTIMATORS


def outcome(scores, T=3):
    """Scores on the last token of full-length responses: (N,) -> rewards (N, T), mask (N, T)."""
    scores = torch.as_tensor(scores, dtype=torch.float32)
    rewards = torch.zeros(len(scores), T)
    rewards[:, -1] = scores
    return rewards, torch.ones(len(scores), T, dtype=torch.long)


# ---------------------------------------------------------------- naive references (verl-style)
def naive_whiten(x, mask):
    """verl masked_whiten on nested lists: (x - mean) / sqrt(unbiased var + 1e-8), all positions."""
    vals = [v for row, mrow in zip(x, mask) for v, m in zip(row, mrow) if m]
    n = len(vals)
    mean = sum(vals) / n
    var = sum((v - mean) ** 2 for v in vals) / n * n / (n - 1)
    return [[(v - mean) / math.sqrt(var + 1e-8) for v in row] for row in x]


def naive_group(scores, index):
    groups = defaultdict(list)
    for s, g in zip(scores, index):
        groups[g].append(s)
    return groups


def naive_grpo(rewards, mask, index, norm_by_std):
    scores = [sum(r) for r in rewards.tolist()]
    groups = naive_group(scores, index.tolist())
    out = []
    for s, g in zip(scores, index.tolist()):
        vals = groups[g]
        if len(vals) == 1:
            mean, std = 0.0, 1.0
        else:
            mean = sum(vals) / len(vals)
            std = math.sqrt(sum((v - mean) ** 2 for v in vals) / (len(vals) - 1))  # torch.std
        out.append((s - mean) / (std + 1e-6) if norm_by_std else s - mean)
    return [[a * m for m in mrow] for a, mrow in zip(out, mask.tolist())]


def naive_rloo(rewards, mask, index):
    scores = [sum(r) for r in rewards.tolist()]
    groups = naive_group(scores, index.tolist())
    out = []
    for s, g in zip(scores, index.tolist()):
        n = len(groups[g])
        mean = sum(groups[g]) / n
        out.append(s * n / (n - 1) - mean * n / (n - 1) if n > 1 else s)
    return [[a * m for m in mrow] for a, mrow in zip(out, mask.tolist())]


def naive_rloo_vectorized(rewards, mask, index):
    """verl's vectorized RLOO: (n s - sum) / max(n - 1, 1) * [n > 1], so a group of one gets 0."""
    scores = [sum(r) for r in rewards.tolist()]
    groups = naive_group(scores, index.tolist())
    out = [(len(groups[g]) * s - sum(groups[g])) / max(len(groups[g]) - 1, 1)
           * (len(groups[g]) > 1) for s, g in zip(scores, index.tolist())]
    return [[a * m for m in mrow] for a, mrow in zip(out, mask.tolist())]


def naive_rpp_baseline(rewards, mask, index):
    scores = [sum(r) for r in rewards.tolist()]
    groups = naive_group(scores, index.tolist())
    centred = [s - (sum(groups[g]) / len(groups[g]) if len(groups[g]) > 1 else 0.0)
               for s, g in zip(scores, index.tolist())]
    tiled = [[c * m for m in mrow] for c, mrow in zip(centred, mask.tolist())]
    return naive_whiten(tiled, mask.tolist())


def naive_rpp(rewards, mask, gamma):
    R, M = rewards.tolist(), mask.tolist()
    returns = []
    for r, m in zip(R, M):
        row, running = [0.0] * len(r), 0.0
        for t in reversed(range(len(r))):
            if m[t]:  # only valid tokens move the running return (verl #7278)
                running = r[t] + gamma * running  # G_t = r_t + γ G of the next valid token
                row[t] = running
            # masked: row[t] stays 0, running passes through unchanged (r_t is not added)
        returns.append(row)
    return naive_whiten(returns, M), returns


def naive_gae(rewards, values, mask, gamma, lam):
    """verl compute_gae_advantage_return (recent, mask-skipping) per row and token."""
    R, V, M = rewards.tolist(), values.tolist(), mask.tolist()
    adv = []
    for r, v, m in zip(R, V, M):
        row, next_v, last = [0.0] * len(r), 0.0, 0.0
        for t in reversed(range(len(r))):
            delta = r[t] + gamma * next_v - v[t]
            a = delta + gamma * lam * last
            if m[t]:  # only valid tokens move the carried state
                next_v, last = v[t], a
            row[t] = last
        adv.append(row)
    returns = [[a + vv for a, vv in zip(ar, vr)] for ar, vr in zip(adv, V)]
    return naive_whiten(adv, M), returns


def random_batch(seed, dtype=torch.float64, min_group=1):
    """Rewards/mask/groups with random group sizes (incl. 1 unless ``min_group`` > 1), shuffled
    non-contiguous ids, right padding, some rows with no valid token and some masks with holes;
    every third seed has 0/1 scores (ties)."""
    g = torch.Generator().manual_seed(seed)
    sizes = torch.randint(min_group, 5, (int(torch.randint(2, 6, (1,), generator=g)),),
                          generator=g).tolist()
    ids = [1000 + 7 * k for k in range(len(sizes))]  # arbitrary, sparse group ids
    index = torch.tensor([i for i, n in zip(ids, sizes) for _ in range(n)])
    index = index[torch.randperm(len(index), generator=g)]
    N, T = len(index), int(torch.randint(1, 7, (1,), generator=g))
    lengths = torch.randint(0, T + 1, (N,), generator=g)
    lengths[0] = T  # at least two valid tokens overall for the whitening estimators
    lengths[-1] = max(int(lengths[-1]), 1)
    mask = (torch.arange(T)[None] < lengths[:, None]).long()
    if seed % 2 and T > 2:  # holes, as observation tokens in a multi-turn response
        mask[0, 1] = 0
    scores = torch.randint(0, 2, (N,), generator=g).to(dtype) if seed % 3 == 0 \
        else torch.randn(N, generator=g, dtype=dtype)
    rewards = torch.zeros(N, T, dtype=dtype)
    for i in range(N):  # outcome reward on the last valid token, plus a little per-token shaping
        valid = mask[i].nonzero().flatten()
        if len(valid):
            rewards[i, valid[-1]] = scores[i]
            if seed % 4 == 1:
                rewards[i, valid] += 0.1 * torch.randn(len(valid), generator=g, dtype=dtype)
    values = torch.randn(N, T, generator=g, dtype=dtype)
    return rewards, mask, index, values


def random_holes(seed, N, T):
    """Rewards (N, T) float64 on every position (masked ones too) and a mask with random holes
    and spans (Bernoulli per token) inside each row's length (trailing padding after it); at
    least two valid tokens in the batch, for the whitening."""
    g = torch.Generator().manual_seed(seed)
    p_valid = 0.3 + 0.6 * torch.rand(1, generator=g).item()
    lengths = torch.randint(0, T + 1, (N,), generator=g)
    mask = (torch.rand(N, T, generator=g) < p_valid) & (torch.arange(T)[None] < lengths[:, None])
    mask[0, :2] = True
    rewards = torch.randn(N, T, generator=g, dtype=torch.float64)
    return rewards, mask.long()


def assert_on_mask(out, ref, mask, tol=1e-6):
    ref = torch.tensor(ref, dtype=out.dtype)
    m = mask.bool()
    assert torch.allclose(out[m], ref[m], atol=tol, rtol=tol), (out, ref)
    assert (out[~m] == 0).all()


# ---------------------------------------------------------------- hand-computed cases
def test_grpo_hand_computed():
    rewards, mask = outcome([1.0, 0.0, 0.0, 1.0])
    adv, ret = EstimatorInputs(rewards, mask).call("grpo")
    # mean 0.5; unbiased std sqrt(4 * 0.25 / 3) = 0.57735; (±0.5) / (0.57735 + 1e-6) = ±0.866024
    expected = 0.5 / (math.sqrt(1 / 3) + 1e-6)
    assert adv[:, 0].tolist() == pytest.approx([expected, -expected, -expected, expected], rel=1e-6)
    assert torch.equal(adv, ret) and (adv == adv[:, :1]).all()  # same value on every token


def test_dr_grpo_hand_computed():
    rewards, mask = outcome([1.0, 0.0, 0.0, 1.0])
    adv, _ = EstimatorInputs(rewards, mask, norm_adv_by_std_in_grpo=False).call("grpo")
    assert adv[:, 0].tolist() == [0.5, -0.5, -0.5, 0.5]  # s - mean, no std


def test_grpo_two_groups_and_singleton():
    rewards, mask = outcome([1.0, 0.0, 3.0, 2.0])
    index = torch.tensor([7, 7, 9, 4])  # {0, 1}, {2}, {3}
    adv, _ = EstimatorInputs(rewards, mask, index).call("grpo")
    # group 7: mean 0.5, std sqrt(0.5) = 0.70711 -> ±0.5 / 0.70711 = ±0.70711
    # groups of one: mean 0, std 1 -> s / (1 + 1e-6)
    assert adv[:, 0].tolist() == pytest.approx(
        [0.5 / (math.sqrt(0.5) + 1e-6), -0.5 / (math.sqrt(0.5) + 1e-6), 3 / (1 + 1e-6), 2 / (1 + 1e-6)],
        rel=1e-6)


@pytest.mark.parametrize("name", ["grpo", "rloo", "reinforce_plus_plus_baseline", "opo", "gpg",
                                  "grpo_passk"])
@pytest.mark.parametrize("value, n", [(1.0, 3), (0.7, 8), (0.1, 16), (0.3, 8)])
def test_all_equal_group_gives_exactly_zero(name, value, n):
    # (s - mean) / (std + 1e-6) with s == mean must be 0: no signal, no NaN. In float32 the mean
    # of eight 0.7s is one ulp off and verl's GRPO turns that into advantages of ±0.056; the
    # group statistics here are float64, so the result is exactly 0.
    rewards, mask = outcome([value] * n)
    index = torch.zeros(n, dtype=torch.long)
    if name == "reinforce_plus_plus_baseline":  # whitening needs a second group with signal
        rewards = torch.cat([rewards, torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.0, 0.0]])])
        mask = torch.ones(n + 2, 3)
        index = torch.cat([index, torch.tensor([1, 1])])
    adv, _ = EstimatorInputs(rewards, mask, index).call(name)
    assert (adv[:n] == 0).all()


def test_rloo_hand_computed():
    rewards, mask = outcome([1.0, 0.0, 0.0, 1.0, 5.0])
    index = torch.tensor([0, 0, 0, 0, 1])
    case = EstimatorInputs(rewards, mask, index)
    adv, ret = case.call("rloo")
    # n = 4, mean 0.5: s * 4/3 - 0.5 * 4/3 -> 1: 2/3, 0: -2/3 (= s minus the mean of the other 3)
    # the group of one keeps its raw score 5
    assert adv[:, 0].tolist() == pytest.approx([2 / 3, -2 / 3, -2 / 3, 2 / 3, 5.0], rel=1e-6)
    assert torch.equal(adv, ret)
    # verl's vectorized RLOO: the same group of four, (4 s - 2) / 3; the group of one gets 0
    adv, ret = case.call("rloo_vectorized")
    assert adv[:, 0].tolist() == pytest.approx([2 / 3, -2 / 3, -2 / 3, 2 / 3, 0.0], rel=1e-6)
    assert torch.equal(adv, ret)


def test_reinforce_plus_plus_hand_computed():
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    mask = torch.ones(1, 3)
    adv, ret = EstimatorInputs(rewards, mask, gamma=0.5).call("reinforce_plus_plus")
    # returns: G_2 = 1, G_1 = 0.5 * 1, G_0 = 0.25
    assert ret[0].tolist() == [0.25, 0.5, 1.0]
    # whiten: mean 7/12; deviations -1/3, -1/12, 5/12; unbiased var (1/9 + 1/144 + 25/144) / 2 = 7/48
    std = math.sqrt(7 / 48)
    assert adv[0].tolist() == pytest.approx([(-1 / 3) / std, (-1 / 12) / std, (5 / 12) / std], rel=1e-6)


def test_reinforce_plus_plus_carries_the_return_across_a_masked_span():
    # verl issue #7278: two turns with a 2-token observation span between them, reward 1 at the end
    rewards = torch.tensor([[0.0, 0.0, 0.0, 0.0, 0.0, 1.0]])
    mask = torch.tensor([[1, 1, 0, 0, 1, 1]])
    adv, ret = EstimatorInputs(rewards, mask, gamma=1.0).call("reinforce_plus_plus")
    # t=5: G = 1;  t=4: G = 0 + 1·1 = 1;  t=3, t=2 masked: output 0, running stays 1;
    # t=1: G = 0 + 1·1 = 1;  t=0: G = 1. (Resetting at masked positions would give [0,0,0,0,1,1].)
    assert ret[0].tolist() == [1.0, 1.0, 0.0, 0.0, 1.0, 1.0]
    # the valid tokens' returns are those of the same turns without the observation in between
    no_span = EstimatorInputs(torch.tensor([[0.0, 0.0, 0.0, 1.0]]),
                              torch.ones(1, 4, dtype=torch.long), gamma=1.0)
    _, compact = no_span.call("reinforce_plus_plus")
    assert torch.equal(ret[mask.bool()], compact[0])
    # whitening 4 equal returns: deviations 0, so every advantage is exactly 0
    assert (adv == 0).all()


def test_reinforce_plus_plus_discounts_per_valid_token_across_holes():
    # a hole, a 2-token span, trailing padding; rewards 7 and 3 sit on masked positions
    rewards = torch.tensor([[0.5, 7.0, 0.0, 3.0, 0.0, 1.0, 0.0]])
    mask = torch.tensor([[1, 0, 1, 0, 0, 1, 0]])
    adv, ret = EstimatorInputs(rewards, mask, gamma=0.5).call("reinforce_plus_plus")
    # t=6 padding: output 0, running 0;  t=5: G = 1 + 0.5·0 = 1
    # t=4, t=3 masked: output 0, running stays 1 (no γ per masked token, the 3 is not added)
    # t=2: G = 0 + 0.5·1 = 0.5;  t=1 masked: output 0, running stays 0.5 (the 7 is not added)
    # t=0: G = 0.5 + 0.5·0.5 = 0.75   (one γ per step between valid tokens)
    assert ret[0].tolist() == [0.75, 0.0, 0.5, 0.0, 0.0, 1.0, 0.0]
    # whiten over the valid 0.75, 0.5, 1: mean 0.75, deviations 0, -0.25, 0.25,
    # unbiased var (0 + 1/16 + 1/16) / 2 = 1/16
    std = math.sqrt(1 / 16 + 1e-8)
    assert adv[0].tolist() == pytest.approx([0.0, 0.0, -0.25 / std, 0.0, 0.0, 0.25 / std, 0.0],
                                            rel=1e-6)


def test_reinforce_plus_plus_baseline_hand_computed():
    rewards, mask = outcome([1.0, 0.0, 3.0], T=2)
    index = torch.tensor([0, 0, 1])
    adv, _ = EstimatorInputs(rewards, mask, index).call("reinforce_plus_plus_baseline")
    # group 0: mean 0.5 -> 0.5, -0.5; the group of one keeps 3. Tiled: [.5, .5, -.5, -.5, 3, 3]
    # batch mean 6/6 = 1; deviations -0.5, -1.5, 2 (each twice) -> sum sq = 2 * (0.25 + 2.25 + 4) = 13
    # unbiased var 13 / 5 = 2.6
    std = math.sqrt(2.6 + 1e-8)
    assert adv[:, 0].tolist() == pytest.approx([-0.5 / std, -1.5 / std, 2 / std], rel=1e-6)
    assert torch.equal(adv[:, 0], adv[:, 1])


def test_gae_hand_computed():
    rewards = torch.tensor([[0.0, 1.0]])
    values = torch.tensor([[0.2, 0.6]])
    mask = torch.ones(1, 2)
    adv, ret = EstimatorInputs(rewards, mask, values=values, gamma=1.0, lam=0.5).call("gae")
    # t=1: δ = 1 + 0 - 0.6 = 0.4, A_1 = 0.4
    # t=0: δ = 0 + 0.6 - 0.2 = 0.4, A_0 = 0.4 + 1 * 0.5 * 0.4 = 0.6
    # returns = A + V = [0.8, 1.0]; whitened A: mean 0.5, unbiased std sqrt(0.02) -> ±0.7071
    assert ret[0].tolist() == pytest.approx([0.8, 1.0])
    assert adv[0].tolist() == pytest.approx([0.1 / math.sqrt(0.02 + 1e-8), -0.1 / math.sqrt(0.02 + 1e-8)],
                                            rel=1e-5)


def test_gae_skips_masked_positions():
    # A masked middle token (value 9, reward 5) must be invisible: same as the 2-token case above.
    rewards = torch.tensor([[0.0, 5.0, 1.0]])
    values = torch.tensor([[0.2, 9.0, 0.6]])
    mask = torch.tensor([[1, 0, 1]])
    adv, ret = EstimatorInputs(rewards, mask, values=values, gamma=1.0, lam=0.5).call("gae")
    assert ret[0].tolist() == pytest.approx([0.8, 0.0, 1.0])
    assert adv[0, 1] == 0 and adv[0, 0] > 0 > adv[0, 2]


def test_gae_gamma_lambda_limits():
    g = torch.Generator().manual_seed(0)
    rewards, values = torch.randn(3, 5, generator=g), torch.randn(3, 5, generator=g)
    mask = torch.ones(3, 5)
    # λ = 0: A_t = δ_t, the one-step TD error, so returns = r_t + γ V_{t+1}
    _, ret = EstimatorInputs(rewards, mask, values=values, gamma=0.9, lam=0.0).call("gae")
    next_v = torch.cat([values[:, 1:], torch.zeros(3, 1)], dim=1)
    assert torch.allclose(ret, rewards + 0.9 * next_v, atol=1e-6)
    # γ = λ = 1: returns are the undiscounted reward-to-go (Monte Carlo)
    _, ret = EstimatorInputs(rewards, mask, values=values, gamma=1.0, lam=1.0).call("gae")
    assert torch.allclose(ret, rewards.flip(-1).cumsum(-1).flip(-1), atol=1e-5)


# ---------------------------------------------------------------- vectorised vs naive
SEEDS = range(12)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("norm", [True, False])
def test_grpo_matches_naive(seed, norm):
    rewards, mask, index, _ = random_batch(seed)
    adv, ret = EstimatorInputs(rewards, mask, index, norm_adv_by_std_in_grpo=norm).call("grpo")
    assert_on_mask(adv, naive_grpo(rewards, mask, index, norm), mask)
    assert torch.equal(adv, ret)


@pytest.mark.parametrize("seed", SEEDS)
def test_rloo_matches_naive(seed):
    rewards, mask, index, _ = random_batch(seed)
    case = EstimatorInputs(rewards, mask, index)
    adv, _ = case.call("rloo")
    assert_on_mask(adv, naive_rloo(rewards, mask, index), mask)
    adv, _ = case.call("rloo_vectorized")
    assert_on_mask(adv, naive_rloo_vectorized(rewards, mask, index), mask)


@pytest.mark.parametrize("seed", SEEDS)
def test_reinforce_plus_plus_baseline_matches_naive(seed):
    rewards, mask, index, _ = random_batch(seed)
    adv, _ = EstimatorInputs(rewards, mask, index).call("reinforce_plus_plus_baseline")
    assert_on_mask(adv, naive_rpp_baseline(rewards, mask, index), mask)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_reinforce_plus_plus_matches_naive(seed, gamma):
    rewards, mask, index, _ = random_batch(seed)
    adv, ret = EstimatorInputs(rewards, mask, index, gamma=gamma).call("reinforce_plus_plus")
    ref_adv, ref_ret = naive_rpp(rewards, mask, gamma)
    assert_on_mask(adv, ref_adv, mask)
    assert_on_mask(ret, ref_ret, mask)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("N, T", [(1, 2), (3, 8), (8, 17), (16, 64)])
@pytest.mark.parametrize("gamma", [1.0, 0.9, 0.0])
def test_reinforce_plus_plus_with_holes_matches_naive(seed, N, T, gamma):
    rewards, mask = random_holes(seed, N, T)
    adv, ret = EstimatorInputs(rewards, mask, gamma=gamma).call("reinforce_plus_plus")
    ref_adv, ref_ret = naive_rpp(rewards, mask, gamma)
    assert_on_mask(adv, ref_adv, mask)
    assert_on_mask(ret, ref_ret, mask)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("gamma, lam", [(1.0, 1.0), (1.0, 0.95), (0.99, 0.9)])
def test_gae_matches_naive(seed, gamma, lam):
    rewards, mask, index, values = random_batch(seed)
    adv, ret = EstimatorInputs(rewards, mask, index, values=values, gamma=gamma, lam=lam).call("gae")
    ref_adv, ref_ret = naive_gae(rewards, values, mask, gamma, lam)
    assert_on_mask(adv, ref_adv, mask)
    assert_on_mask(ret, ref_ret, mask)


GROUP_ESTIMATORS = sorted(n for n in ADVANTAGE_ESTIMATORS.names()
                          if ADVANTAGE_ESTIMATORS.traits(n).needs_groups)


@pytest.mark.parametrize("name", GROUP_ESTIMATORS)
def test_group_estimators_do_not_depend_on_row_order(name):
    rewards, mask, index, values = random_batch(5, min_group=2)
    extras = random_extras(5, mask)
    case = EstimatorInputs(rewards, mask, index, values=values, **extras)
    adv, _ = case.call(name)
    perm = torch.randperm(len(index), generator=torch.Generator().manual_seed(0))
    adv_p, _ = case.rows(perm).call(name)
    assert torch.allclose(adv_p, adv[perm], atol=1e-12)


# ---------------------------------------------------------------- contract and edge cases
def test_gae_without_values_raises():
    rewards, mask = outcome([1.0, 0.0])
    with pytest.raises(ValueError, match="needs critic values"):
        EstimatorInputs(rewards, mask).call("gae")


@pytest.mark.parametrize("name", sorted(ADVANTAGE_ESTIMATORS.names()))
def test_one_signature_no_grad_and_shapes(name):
    rewards, mask, index, values = random_batch(3, dtype=torch.float32, min_group=2)
    values.requires_grad_(True)
    rewards.requires_grad_(True)
    extras = {k: v.float() for k, v in random_extras(3, mask).items()}  # every estimator takes all
    adv, ret = EstimatorInputs(rewards, mask.bool(), index, values, gamma=1.0, lam=0.95,
                               norm_adv_by_std_in_grpo=True, **extras).call(name)
    assert adv.shape == ret.shape == rewards.shape
    assert adv.dtype == ret.dtype == torch.float32
    assert not adv.requires_grad and not ret.requires_grad
    assert torch.isfinite(adv).all() and torch.isfinite(ret).all()
    adv.add_(1.0)  # returns is not an alias of advantages
    assert not torch.equal(adv, ret)


def test_the_inputs_record_is_the_one_signature():
    # every entry takes one EstimatorInputs (the registry checks it at registration), and the
    # tests' record has the library record's fields, with the same defaults where it has them
    for name in ADVANTAGE_ESTIMATORS.names():
        assert list(inspect.signature(ADVANTAGE_ESTIMATORS.get(name)).parameters) == ["inp"], name
    library = {f.name: f.default for f in dataclasses.fields(algorithms.EstimatorInputs)}
    tests = {f.name: f.default for f in dataclasses.fields(EstimatorInputs)}
    assert set(tests) == set(library)
    assert all(tests[n] == d for n, d in library.items() if d is not dataclasses.MISSING)


def test_shape_errors_are_clear():
    rewards, mask = outcome([1.0, 0.0])
    with pytest.raises(ValueError, match="group_index"):
        EstimatorInputs(rewards, mask, torch.zeros(3, dtype=torch.long)).call("grpo")
    with pytest.raises(ValueError, match="response_mask"):
        EstimatorInputs(rewards, mask[:, :2]).call("grpo")
    with pytest.raises(ValueError, match="values"):
        EstimatorInputs(rewards, mask, values=torch.zeros(2, 2)).call("gae")


def test_gae_with_bf16_values_runs_in_float32():
    rewards, mask, index, values = random_batch(2, dtype=torch.float32)
    case = EstimatorInputs(rewards, mask, index, values=values.to(torch.bfloat16), lam=0.95)
    adv, ret = case.call("gae")
    ref_adv, _ = dataclasses.replace(case, values=case.values.float()).call("gae")
    assert adv.dtype == ret.dtype == torch.float32 and torch.equal(adv, ref_adv)


# ================================================================ verl 0.9's other estimators
def random_extras(seed, mask, K=3):
    """The optional inputs for a batch with ``mask`` (N, T), float64: ``baseline_score`` (N,) and
    ``reward_components`` (N, K) with ties (0/1 values every other seed), and a consistent
    ``old_logprobs`` / ``sum_pi_squared`` pair: each position has a random distribution p over 5
    tokens, the sampled token's log p and Σ p², so 1 - 2π + Σπ² = ||e - p||² > 0 as for a model."""
    g = torch.Generator().manual_seed(10_000 + seed)
    N, T = mask.shape
    if seed % 2:
        baseline = torch.randint(0, 2, (N,), generator=g).double()
        comps = torch.randint(0, 2, (N, K), generator=g).double()
    else:
        baseline = torch.randn(N, generator=g, dtype=torch.float64)
        comps = torch.randn(N, K, generator=g, dtype=torch.float64)
    p = torch.softmax(2 * torch.randn(N, T, 5, generator=g, dtype=torch.float64), -1)
    tok = torch.randint(0, 5, (N, T, 1), generator=g)
    m = mask.double()
    return dict(baseline_score=baseline, reward_components=comps,
                old_logprobs=p.gather(-1, tok)[..., 0].log() * m, sum_pi_squared=(p ** 2).sum(-1) * m)


def naive_reward_to_go(rewards, mask):
    out = []
    for r, m in zip(rewards.tolist(), mask.tolist()):
        row, running = [0.0] * len(r), 0.0
        for t in reversed(range(len(r))):
            running += r[t] * m[t]  # verl: (r * mask).flip(-1).cumsum(-1).flip(-1)
            row[t] = running
        out.append(row)
    return out


def naive_remax(rewards, mask, baseline):
    G = naive_reward_to_go(rewards, mask)
    return [[gt - b for gt in row] for row, b in zip(G, baseline.tolist())], G


def naive_opo(rewards, mask, index):
    scores = [sum(r) for r in rewards.tolist()]
    lengths = [sum(m) for m in mask.tolist()]
    groups = naive_group(list(zip(scores, lengths)), index.tolist())
    out = []
    for s, g in zip(scores, index.tolist()):
        members = groups[g]
        total = sum(length for _, length in members)
        if len(members) == 1 or total == 0:
            b = 0.0
        else:
            b = sum(length * v for v, length in members) / total  # length-weighted mean
        out.append(s - b)
    return [[a * m for m in mrow] for a, mrow in zip(out, mask.tolist())]


def naive_gpg(rewards, mask, index):
    scores = [sum(r) for r in rewards.tolist()]
    alpha = len(scores) / max(1, sum(1 for s in scores if s != 0))
    groups = naive_group(scores, index.tolist())
    out = []
    for s, g in zip(scores, index.tolist()):
        mean = sum(groups[g]) / len(groups[g]) if len(groups[g]) > 1 else 0.0
        out.append(alpha * (s - mean) / 1.0)
    return [[a * m for m in mrow] for a, mrow in zip(out, mask.tolist())]


def naive_passk(rewards, mask, index, norm_by_std):
    scores = [sum(r) for r in rewards.tolist()]
    rows = defaultdict(list)
    for i, g in enumerate(index.tolist()):
        rows[g].append(i)
    out = [0.0] * len(scores)
    for members in rows.values():
        vals = [scores[i] for i in members]
        order = sorted(range(len(vals)), key=lambda j: -vals[j])
        r1, r2 = vals[order[0]], vals[order[1]]
        adv = r1 - r2  # 0 on a tie at the top, whichever row gets it
        if norm_by_std:
            mean = sum(vals) / len(vals)
            adv /= math.sqrt(sum((v - mean) ** 2 for v in vals) / (len(vals) - 1)) + 1e-6
        out[members[order[0]]] = adv
    return [[a * m for m in mrow] for a, mrow in zip(out, mask.tolist())]


def naive_grpo_scores(scores, index, norm_by_std):
    groups = naive_group(scores, index)
    out = []
    for s, g in zip(scores, index):
        vals = groups[g]
        if len(vals) == 1:
            mean, std = 0.0, 1.0
        else:
            mean = sum(vals) / len(vals)
            std = math.sqrt(sum((v - mean) ** 2 for v in vals) / (len(vals) - 1))
        out.append((s - mean) / (std + 1e-6) if norm_by_std else s - mean)
    return out


def naive_gdpo(components, mask, index, norm_by_std):
    """verl compute_gdpo_outcome_advantage: GRPO per dimension, summed, whitened over the batch."""
    K = len(components[0])
    total = [0.0] * len(components)
    for k in range(K):
        adv_k = naive_grpo_scores([c[k] for c in components], index.tolist(), norm_by_std)
        total = [a + b for a, b in zip(total, adv_k)]
    tiled = [[a * m for m in mrow] for a, mrow in zip(total, mask.tolist())]
    return naive_whiten(tiled, mask.tolist())


def naive_energy(old_logprobs, sum_pi_squared, mask):
    out = []
    for lp, sq, m in zip(old_logprobs.tolist(), sum_pi_squared.tolist(), mask.tolist()):
        row, running = [], 0.0
        for a, b, mm in zip(lp, sq, m):
            running += (1 - 2 * math.exp(a) + b) * mm  # W_t = Σ_{j<=t} (1 - 2π_j + Σπ²) m_j
            row.append(running)
        out.append(row)
    return out


def naive_zero_tail(baseline_rows, lengths):
    """verl handle_zero_tail on one group: {row: baseline list}, {row: length}."""
    ordered = sorted(lengths.values())
    longest, second = ordered[-1], ordered[-2]
    at_max = [i for i, n in lengths.items() if n == longest]
    if len(at_max) == 1 and longest > second:
        row = baseline_rows[at_max[0]]
        for t in range(second, len(row)):
            row[t] = 0.0


def naive_otb(rewards, mask, index, old_logprobs, sum_pi_squared):
    """verl compute_optimal_token_baseline_advantage, loops over groups and columns."""
    G = naive_reward_to_go(rewards, mask)
    W = naive_energy(old_logprobs, sum_pi_squared, mask)
    M = mask.tolist()
    N, T = len(G), len(G[0])
    B = [[0.0] * T for _ in range(N)]
    groups = defaultdict(list)
    for i, g in enumerate(index.tolist()):
        groups[g].append(i)
    for members in groups.values():
        if len(members) == 1:
            continue
        for t in range(T):
            num = sum(G[i][t] * W[i][t] * M[i][t] for i in members)
            den = sum(W[i][t] * M[i][t] for i in members) + 1e-8
            for i in members:
                B[i][t] = num / den
        naive_zero_tail({i: B[i] for i in members}, {i: int(sum(M[i])) for i in members})
    adv = [[(G[i][t] - B[i][t]) * M[i][t] for t in range(T)] for i in range(N)]
    return adv, G


def naive_tir_otb(rewards, mask, index, old_logprobs, sum_pi_squared):
    """verl compute_multi_turn_optimal_token_baseline_advantage: valid tokens packed per row,
    empty rows left out of their group, the baseline per valid-token index."""
    G = naive_reward_to_go(rewards, mask)
    W = naive_energy(old_logprobs, sum_pi_squared, mask)
    M = mask.tolist()
    N, T = len(G), len(G[0])
    cols = [[t for t in range(T) if M[i][t]] for i in range(N)]
    Gp = [[G[i][t] for t in cols[i]] + [0.0] * (T - len(cols[i])) for i in range(N)]
    Wp = [[W[i][t] for t in cols[i]] + [0.0] * (T - len(cols[i])) for i in range(N)]
    B = [[0.0] * T for _ in range(N)]
    groups = defaultdict(list)
    for i, g in enumerate(index.tolist()):
        if cols[i]:
            groups[g].append(i)
    for members in groups.values():
        if len(members) == 1:
            continue
        for k in range(T):
            num = sum(Gp[i][k] * Wp[i][k] for i in members)
            den = sum(Wp[i][k] for i in members) + 1e-8
            for i in members:
                B[i][k] = num / den
        naive_zero_tail({i: B[i] for i in members}, {i: len(cols[i]) for i in members})
    adv = [[0.0] * T for _ in range(N)]
    for i in range(N):
        for k, t in enumerate(cols[i]):
            adv[i][t] = Gp[i][k] - B[i][k]
    return adv, G


# ---------------------------------------------------------------- hand-computed cases
def test_remax_hand_computed():
    rewards = torch.tensor([[0.0, 0.5, 1.0], [0.0, 2.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    adv, ret = EstimatorInputs(rewards, mask, baseline_score=torch.tensor([1.0, 3.0])).call("remax")
    # row 0: reward-to-go G = [1.5, 1.5, 1.0]; minus the greedy baseline 1 -> [0.5, 0.5, 0]
    # row 1: G = [2, 2, (masked)]; minus 3 -> [-1, -1, 0]
    assert ret.tolist() == [[1.5, 1.5, 1.0], [2.0, 2.0, 0.0]]
    assert adv.tolist() == [[0.5, 0.5, 0.0], [-1.0, -1.0, 0.0]]


def test_opo_hand_computed():
    rewards = torch.tensor([[0.0, 1.0], [0.0, 0.0], [1.0, 0.0], [2.0, 0.0]])
    mask = torch.tensor([[1, 1], [1, 1], [1, 0], [1, 0]])
    index = torch.tensor([0, 0, 0, 5])
    adv, _ = EstimatorInputs(rewards, mask, index).call("opo")
    # group 0: scores 1, 0, 1 with lengths 2, 2, 1 -> b = (2·1 + 2·0 + 1·1) / 5 = 0.6
    # (the plain mean would be 2/3); group 5 is a group of one: b = 0
    assert adv[:, 0].tolist() == pytest.approx([0.4, -0.6, 0.4, 2.0], abs=1e-7)
    assert adv[2:, 1].tolist() == [0.0, 0.0]  # masked


def test_gpg_hand_computed():
    rewards, mask = outcome([1.0, 0.0, 0.0, 0.0, 1.0, 1.0])
    index = torch.tensor([0, 0, 0, 0, 1, 1])
    adv, _ = EstimatorInputs(rewards, mask, index).call("gpg")
    # α = 6 rows / 3 non-zero scores = 2; group 0 mean 0.25 -> 2·0.75, 2·(-0.25);
    # group 1 is all ones: mean 1, advantage 0 (it still counts in α)
    assert adv[:, 0].tolist() == pytest.approx([1.5, -0.5, -0.5, -0.5, 0.0, 0.0])


def test_grpo_passk_hand_computed():
    rewards, mask = outcome([0.2, 0.9, 0.5, 1.0, 1.0, 0.0])
    index = torch.tensor([0, 0, 0, 1, 1, 1])
    case = EstimatorInputs(rewards, mask, index)
    adv, _ = dataclasses.replace(case, norm_adv_by_std_in_grpo=False).call("grpo_passk")
    # group 0: best 0.9, runner-up 0.5 -> only the best gets 0.4
    # group 1: a tie at the top (1.0, 1.0) -> 0 for all
    assert adv[:, 0].tolist() == pytest.approx([0.0, 0.4, 0.0, 0.0, 0.0, 0.0])
    adv, _ = case.call("grpo_passk")
    # with the std: group 0 mean 8/15, unbiased std sqrt(((1/3)² + (11/30)² + (1/30)²) / 2) ≈ 0.35119
    std = math.sqrt(((0.2 - 1.6 / 3) ** 2 + (0.9 - 1.6 / 3) ** 2 + (0.5 - 1.6 / 3) ** 2) / 2)
    assert adv[1, 0].item() == pytest.approx(0.4 / (std + 1e-6))


def test_gdpo_decouples_reward_dimensions():
    # GDPO's motivating case: two binary rewards, two responses. (1, 0) vs (0, 1) sum to the same
    # total, so GRPO on the sum gives both 0; per-dimension normalisation does too (±0.707 each,
    # summed to 0). (1, 1) vs (0, 0) and (1, 1) vs (1, 0) differ in the sum and in GDPO.
    comps = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [0.0, 0.0], [1.0, 1.0], [1.0, 0.0]])
    index = torch.tensor([0, 0, 1, 1, 2, 2])
    rewards, mask = outcome([0.0] * 6, T=2)
    adv, ret = EstimatorInputs(rewards, mask, index, reward_components=comps,
                               norm_adv_by_std_in_grpo=False).call("gdpo")
    # Dr. GRPO per dimension: group 0: (0.5, -0.5) and (-0.5, 0.5) -> sums 0, 0;
    # group 1: (0.5, 0.5), (-0.5, -0.5) -> 1, -1; group 2: (0, 0.5), (0, -0.5) -> 0.5, -0.5.
    # Whitened over 12 tokens: mean 0, unbiased var = 2·(0 + 0 + 1 + 1 + 0.25 + 0.25) / 11 = 5/11
    std = math.sqrt(5 / 11 + 1e-8)
    assert adv[:, 0].tolist() == pytest.approx([0, 0, 1 / std, -1 / std, 0.5 / std, -0.5 / std])
    assert torch.equal(adv, ret)


def test_gdpo_without_components_is_whitened_grpo():
    rewards, mask, index, _ = random_batch(4)
    case = EstimatorInputs(rewards, mask, index)
    adv, _ = case.call("gdpo")
    grpo_adv, _ = case.call("grpo")
    assert_on_mask(adv, naive_whiten(grpo_adv.tolist(), mask.tolist()), mask)


def test_optimal_token_baseline_hand_computed():
    rewards = torch.tensor([[0.0, 1.0], [0.0, 0.0]])
    mask = torch.ones(2, 2)
    # w = 1 - 2π + Σπ²: row 0 [0.5, 0.5] -> W = [0.5, 1.0]; row 1 [0.5, 1.125] -> W = [0.5, 1.625]
    logp = torch.tensor([[0.5, 0.5], [0.5, 0.25]]).log()
    sq = torch.tensor([[0.5, 0.5], [0.5, 0.625]])
    adv, ret = EstimatorInputs(rewards, mask, old_logprobs=logp,
                               sum_pi_squared=sq).call("optimal_token_baseline")
    # G = [[1, 1], [0, 0]]; B_0 = (1·0.5 + 0·0.5) / (0.5 + 0.5) = 0.5; B_1 = 1·1 / (1 + 1.625)
    b1 = 1 / 2.625
    assert ret.tolist() == [[1.0, 1.0], [0.0, 0.0]]
    assert adv.flatten().tolist() == pytest.approx([0.5, 1 - b1, -0.5, -b1], rel=1e-6)


def test_optimal_token_baseline_zero_tail():
    # lengths 1 and 3 in one group: past t = 1 the longest response is alone, its baseline is 0
    rewards = torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, 2.0]])
    mask = torch.tensor([[1, 0, 0], [1, 1, 1]])
    logp = torch.full((2, 3), math.log(0.5)) * mask
    sq = torch.full((2, 3), 0.5) * mask  # w = 0.5 on every valid token
    adv, ret = EstimatorInputs(rewards, mask, old_logprobs=logp,
                               sum_pi_squared=sq).call("optimal_token_baseline")
    # t = 0: G = 1 and 2, W = 0.5 each -> B_0 = 1.5; t >= 1 on row 1: B = 0 -> A = G = 2
    assert adv.flatten().tolist() == pytest.approx([-0.5, 0.0, 0.0, 0.5, 2.0, 2.0], rel=1e-6)


def test_tir_optimal_token_baseline_aligns_valid_tokens():
    # Row 1 has a 2-token observation span; packed, both rows are 2-token responses. TIR gives the
    # valid tokens what OTB gives the packed rows; OTB itself compares columns and differs.
    rewards = torch.tensor([[0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0, 0], [1, 0, 0, 1]])
    logp = torch.tensor([[0.5, 0.5, 1.0, 1.0], [0.5, 1.0, 1.0, 0.25]]).log() * mask
    sq = torch.tensor([[0.5, 0.5, 0.0, 0.0], [0.5, 0.0, 0.0, 0.625]]) * mask
    case = EstimatorInputs(rewards, mask, old_logprobs=logp, sum_pi_squared=sq)
    adv, ret = case.call("tir_optimal_token_baseline")
    b1 = 1 / 2.625  # as in test_optimal_token_baseline_hand_computed
    assert adv.flatten().tolist() == pytest.approx([0.5, 1 - b1, 0, 0, -0.5, 0, 0, -b1], rel=1e-6)
    otb, _ = case.call("optimal_token_baseline")
    assert not torch.allclose(otb, adv)


# ---------------------------------------------------------------- vectorised vs naive
@pytest.mark.parametrize("seed", SEEDS)
def test_remax_matches_naive(seed):
    rewards, mask, index, _ = random_batch(seed)
    b = random_extras(seed, mask)["baseline_score"]
    adv, ret = EstimatorInputs(rewards, mask, index, baseline_score=b).call("remax")
    ref_adv, ref_ret = naive_remax(rewards, mask, b)
    assert_on_mask(adv, ref_adv, mask)
    assert_on_mask(ret, ref_ret, mask)


@pytest.mark.parametrize("seed", SEEDS)
def test_opo_matches_naive(seed):
    rewards, mask, index, _ = random_batch(seed)
    adv, ret = EstimatorInputs(rewards, mask, index).call("opo")
    assert_on_mask(adv, naive_opo(rewards, mask, index), mask)
    assert torch.equal(adv, ret)


@pytest.mark.parametrize("seed", SEEDS)
def test_gpg_matches_naive(seed):
    rewards, mask, index, _ = random_batch(seed)
    adv, _ = EstimatorInputs(rewards, mask, index).call("gpg")
    assert_on_mask(adv, naive_gpg(rewards, mask, index), mask)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("norm", [True, False])
def test_grpo_passk_matches_naive(seed, norm):
    rewards, mask, index, _ = random_batch(seed, min_group=2)
    adv, _ = EstimatorInputs(rewards, mask, index, norm_adv_by_std_in_grpo=norm).call("grpo_passk")
    assert_on_mask(adv, naive_passk(rewards, mask, index, norm), mask)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("norm", [True, False])
def test_gdpo_matches_naive(seed, norm):
    rewards, mask, index, _ = random_batch(seed)
    comps = random_extras(seed, mask)["reward_components"]
    adv, _ = EstimatorInputs(rewards, mask, index, reward_components=comps,
                             norm_adv_by_std_in_grpo=norm).call("gdpo")
    assert_on_mask(adv, naive_gdpo(comps.tolist(), mask, index, norm), mask)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("name, naive", [("optimal_token_baseline", naive_otb),
                                         ("tir_optimal_token_baseline", naive_tir_otb)])
def test_optimal_token_baselines_match_naive(seed, name, naive):
    rewards, mask, index, _ = random_batch(seed)
    x = random_extras(seed, mask)
    adv, ret = EstimatorInputs(rewards, mask, index, old_logprobs=x["old_logprobs"],
                               sum_pi_squared=x["sum_pi_squared"]).call(name)
    ref_adv, ref_ret = naive(rewards, mask, index, x["old_logprobs"], x["sum_pi_squared"])
    assert_on_mask(adv, ref_adv, mask)
    assert_on_mask(ret, ref_ret, mask)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("N, T", [(2, 3), (8, 17), (16, 40)])
@pytest.mark.parametrize("name, naive", [("optimal_token_baseline", naive_otb),
                                         ("tir_optimal_token_baseline", naive_tir_otb)])
def test_optimal_token_baselines_with_holes_match_naive(seed, N, T, name, naive):
    rewards, mask = random_holes(seed, N, T)
    index = torch.randint(0, max(1, N // 3), (N,), generator=torch.Generator().manual_seed(seed))
    x = random_extras(seed, mask)
    adv, ret = EstimatorInputs(rewards, mask, index, old_logprobs=x["old_logprobs"],
                               sum_pi_squared=x["sum_pi_squared"]).call(name)
    ref_adv, ref_ret = naive(rewards, mask, index, x["old_logprobs"], x["sum_pi_squared"])
    assert_on_mask(adv, ref_adv, mask)
    assert_on_mask(ret, ref_ret, mask)


# ---------------------------------------------------------------- names, traits, edge cases
def test_verl_0_9_names_are_all_registered():
    verl = {"gae", "grpo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax", "rloo",
            "opo", "grpo_passk", "gpg", "rloo_vectorized", "grpo_vectorized",
            "optimal_token_baseline", "tir_optimal_token_baseline", "gdpo"}  # AdvantageEstimator
    assert set(ADVANTAGE_ESTIMATORS.names(include_aliases=True)) == verl


def test_vectorized_names_follow_their_own_verl_function():
    # verl's two GRPO functions agree everywhere (singletons included): one entry, two names
    assert ADVANTAGE_ESTIMATORS.get("grpo_vectorized") is ADVANTAGE_ESTIMATORS.get("grpo")
    # verl's two RLOO functions differ on a group of one (issue 21 item 9): the loop version
    # keeps its raw score, the vectorized one multiplies by [n > 1]; each name follows its own
    rewards, mask = outcome([1.0, 0.0, 5.0])
    index = torch.tensor([0, 0, 1])
    case = EstimatorInputs(rewards, mask, index)
    assert case.call("rloo")[0][:, 0].tolist() == [1.0, -1.0, 5.0]
    assert case.call("rloo_vectorized")[0][:, 0].tolist() == [1.0, -1.0, 0.0]


def test_traits_live_on_the_registry_entries():
    t = ADVANTAGE_ESTIMATORS.traits
    assert t("gae").needs_critic and not any(t(n).needs_critic for n in ADVANTAGE_ESTIMATORS
                                             if n != "gae")
    assert set(GROUP_ESTIMATORS) == {"grpo", "rloo", "rloo_vectorized",
                                     "reinforce_plus_plus_baseline", "opo", "gpg",
                                     "grpo_passk", "gdpo", "optimal_token_baseline",
                                     "tir_optimal_token_baseline"}
    assert t("grpo_vectorized") is t("grpo")
    assert [n for n in ADVANTAGE_ESTIMATORS if t(n).needs_greedy_baseline] == ["remax"]
    assert [n for n in ADVANTAGE_ESTIMATORS if t(n).needs_sum_pi_squared] == [
        "optimal_token_baseline", "tir_optimal_token_baseline"]


@pytest.mark.parametrize("name, missing", [("remax", "baseline_score"),
                                           ("optimal_token_baseline", "old_logprobs"),
                                           ("optimal_token_baseline", "sum_pi_squared"),
                                           ("tir_optimal_token_baseline", "sum_pi_squared")])
def test_missing_inputs_raise_naming_them(name, missing):
    rewards, mask = outcome([1.0, 0.0])
    extras = {k: v for k, v in random_extras(0, mask).items() if k != missing}
    with pytest.raises(ValueError, match=f"{name}.*needs {missing}"):
        EstimatorInputs(rewards, mask, **extras).call(name)
    extras[missing] = torch.zeros(3)  # the wrong shape
    with pytest.raises(ValueError, match=f"{missing} must have shape"):
        EstimatorInputs(rewards, mask, **extras).call(name)


def test_grpo_passk_refuses_a_group_of_one():
    rewards, mask = outcome([1.0, 0.0, 1.0])
    with pytest.raises(ValueError, match="at least 2 responses per group; 1 group"):
        EstimatorInputs(rewards, mask, torch.tensor([0, 0, 1])).call("grpo_passk")
