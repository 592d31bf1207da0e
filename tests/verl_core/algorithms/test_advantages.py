"""Advantage estimators: hand cases, verl-style naive loops, edge cases.

The naive references below are written the way verl's ``core_algos.py`` writes them (Python
dicts keyed by group id, per-row loops, ``torch.mean`` / ``torch.std``) and run on plain Python
floats; the library versions are vectorised. They are compared on valid tokens; masked positions
must be exactly 0 in the library's output.
"""

import math
from collections import defaultdict

import pytest
import torch

from verl_core.algorithms import ADVANTAGE_ESTIMATORS, get_advantage_estimator

KW = dict(gamma=1.0, lam=1.0, norm_adv_by_std_in_grpo=True)


def run(name, rewards, mask, index=None, values=None, **kw):
    index = torch.zeros(rewards.shape[0], dtype=torch.long) if index is None else index
    return get_advantage_estimator(name)(rewards, mask, index, values, **{**KW, **kw})


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


def random_batch(seed, dtype=torch.float64):
    """Rewards/mask/groups with random group sizes (incl. 1), shuffled non-contiguous ids,
    right padding, some rows with no valid token and some masks with holes."""
    g = torch.Generator().manual_seed(seed)
    sizes = torch.randint(1, 5, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g).tolist()
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
    adv, ret = run("grpo", rewards, mask)
    # mean 0.5; unbiased std sqrt(4 * 0.25 / 3) = 0.57735; (±0.5) / (0.57735 + 1e-6) = ±0.866024
    expected = 0.5 / (math.sqrt(1 / 3) + 1e-6)
    assert adv[:, 0].tolist() == pytest.approx([expected, -expected, -expected, expected], rel=1e-6)
    assert torch.equal(adv, ret) and (adv == adv[:, :1]).all()  # same value on every token


def test_dr_grpo_hand_computed():
    rewards, mask = outcome([1.0, 0.0, 0.0, 1.0])
    adv, _ = run("grpo", rewards, mask, norm_adv_by_std_in_grpo=False)
    assert adv[:, 0].tolist() == [0.5, -0.5, -0.5, 0.5]  # s - mean, no std


def test_grpo_two_groups_and_singleton():
    rewards, mask = outcome([1.0, 0.0, 3.0, 2.0])
    index = torch.tensor([7, 7, 9, 4])  # {0, 1}, {2}, {3}
    adv, _ = run("grpo", rewards, mask, index)
    # group 7: mean 0.5, std sqrt(0.5) = 0.70711 -> ±0.5 / 0.70711 = ±0.70711
    # groups of one: mean 0, std 1 -> s / (1 + 1e-6)
    assert adv[:, 0].tolist() == pytest.approx(
        [0.5 / (math.sqrt(0.5) + 1e-6), -0.5 / (math.sqrt(0.5) + 1e-6), 3 / (1 + 1e-6), 2 / (1 + 1e-6)],
        rel=1e-6)


@pytest.mark.parametrize("name", ["grpo", "rloo", "reinforce_plus_plus_baseline"])
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
    adv, _ = run(name, rewards, mask, index)
    assert (adv[:n] == 0).all()


def test_rloo_hand_computed():
    rewards, mask = outcome([1.0, 0.0, 0.0, 1.0, 5.0])
    index = torch.tensor([0, 0, 0, 0, 1])
    adv, ret = run("rloo", rewards, mask, index)
    # n = 4, mean 0.5: s * 4/3 - 0.5 * 4/3 -> 1: 2/3, 0: -2/3 (= s minus the mean of the other 3)
    # the group of one keeps its raw score 5
    assert adv[:, 0].tolist() == pytest.approx([2 / 3, -2 / 3, -2 / 3, 2 / 3, 5.0], rel=1e-6)
    assert torch.equal(adv, ret)


def test_reinforce_plus_plus_hand_computed():
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    mask = torch.ones(1, 3)
    adv, ret = run("reinforce_plus_plus", rewards, mask, gamma=0.5)
    # returns: G_2 = 1, G_1 = 0.5 * 1, G_0 = 0.25
    assert ret[0].tolist() == [0.25, 0.5, 1.0]
    # whiten: mean 7/12; deviations -1/3, -1/12, 5/12; unbiased var (1/9 + 1/144 + 25/144) / 2 = 7/48
    std = math.sqrt(7 / 48)
    assert adv[0].tolist() == pytest.approx([(-1 / 3) / std, (-1 / 12) / std, (5 / 12) / std], rel=1e-6)


def test_reinforce_plus_plus_carries_the_return_across_a_masked_span():
    # verl issue #7278: two turns with a 2-token observation span between them, reward 1 at the end
    rewards = torch.tensor([[0.0, 0.0, 0.0, 0.0, 0.0, 1.0]])
    mask = torch.tensor([[1, 1, 0, 0, 1, 1]])
    adv, ret = run("reinforce_plus_plus", rewards, mask, gamma=1.0)
    # t=5: G = 1;  t=4: G = 0 + 1·1 = 1;  t=3, t=2 masked: output 0, running stays 1;
    # t=1: G = 0 + 1·1 = 1;  t=0: G = 1. (Resetting at masked positions would give [0,0,0,0,1,1].)
    assert ret[0].tolist() == [1.0, 1.0, 0.0, 0.0, 1.0, 1.0]
    # the valid tokens' returns are those of the same turns without the observation in between
    _, compact = run("reinforce_plus_plus", torch.tensor([[0.0, 0.0, 0.0, 1.0]]),
                     torch.ones(1, 4, dtype=torch.long), gamma=1.0)
    assert torch.equal(ret[mask.bool()], compact[0])
    # whitening 4 equal returns: deviations 0, so every advantage is exactly 0
    assert (adv == 0).all()


def test_reinforce_plus_plus_discounts_per_valid_token_across_holes():
    # a hole, a 2-token span, trailing padding; rewards 7 and 3 sit on masked positions
    rewards = torch.tensor([[0.5, 7.0, 0.0, 3.0, 0.0, 1.0, 0.0]])
    mask = torch.tensor([[1, 0, 1, 0, 0, 1, 0]])
    adv, ret = run("reinforce_plus_plus", rewards, mask, gamma=0.5)
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
    adv, _ = run("reinforce_plus_plus_baseline", rewards, mask, index)
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
    adv, ret = run("gae", rewards, mask, values=values, gamma=1.0, lam=0.5)
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
    adv, ret = run("gae", rewards, mask, values=values, gamma=1.0, lam=0.5)
    assert ret[0].tolist() == pytest.approx([0.8, 0.0, 1.0])
    assert adv[0, 1] == 0 and adv[0, 0] > 0 > adv[0, 2]


def test_gae_gamma_lambda_limits():
    g = torch.Generator().manual_seed(0)
    rewards, values = torch.randn(3, 5, generator=g), torch.randn(3, 5, generator=g)
    mask = torch.ones(3, 5)
    # λ = 0: A_t = δ_t, the one-step TD error, so returns = r_t + γ V_{t+1}
    _, ret = run("gae", rewards, mask, values=values, gamma=0.9, lam=0.0)
    next_v = torch.cat([values[:, 1:], torch.zeros(3, 1)], dim=1)
    assert torch.allclose(ret, rewards + 0.9 * next_v, atol=1e-6)
    # γ = λ = 1: returns are the undiscounted reward-to-go (Monte Carlo)
    _, ret = run("gae", rewards, mask, values=values, gamma=1.0, lam=1.0)
    assert torch.allclose(ret, rewards.flip(-1).cumsum(-1).flip(-1), atol=1e-5)


# ---------------------------------------------------------------- vectorised vs naive
SEEDS = range(12)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("norm", [True, False])
def test_grpo_matches_naive(seed, norm):
    rewards, mask, index, _ = random_batch(seed)
    adv, ret = run("grpo", rewards, mask, index, norm_adv_by_std_in_grpo=norm)
    assert_on_mask(adv, naive_grpo(rewards, mask, index, norm), mask)
    assert torch.equal(adv, ret)


@pytest.mark.parametrize("seed", SEEDS)
def test_rloo_matches_naive(seed):
    rewards, mask, index, _ = random_batch(seed)
    adv, _ = run("rloo", rewards, mask, index)
    assert_on_mask(adv, naive_rloo(rewards, mask, index), mask)


@pytest.mark.parametrize("seed", SEEDS)
def test_reinforce_plus_plus_baseline_matches_naive(seed):
    rewards, mask, index, _ = random_batch(seed)
    adv, _ = run("reinforce_plus_plus_baseline", rewards, mask, index)
    assert_on_mask(adv, naive_rpp_baseline(rewards, mask, index), mask)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_reinforce_plus_plus_matches_naive(seed, gamma):
    rewards, mask, index, _ = random_batch(seed)
    adv, ret = run("reinforce_plus_plus", rewards, mask, index, gamma=gamma)
    ref_adv, ref_ret = naive_rpp(rewards, mask, gamma)
    assert_on_mask(adv, ref_adv, mask)
    assert_on_mask(ret, ref_ret, mask)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("N, T", [(1, 2), (3, 8), (8, 17), (16, 64)])
@pytest.mark.parametrize("gamma", [1.0, 0.9, 0.0])
def test_reinforce_plus_plus_with_holes_matches_naive(seed, N, T, gamma):
    rewards, mask = random_holes(seed, N, T)
    adv, ret = run("reinforce_plus_plus", rewards, mask, gamma=gamma)
    ref_adv, ref_ret = naive_rpp(rewards, mask, gamma)
    assert_on_mask(adv, ref_adv, mask)
    assert_on_mask(ret, ref_ret, mask)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("gamma, lam", [(1.0, 1.0), (1.0, 0.95), (0.99, 0.9)])
def test_gae_matches_naive(seed, gamma, lam):
    rewards, mask, index, values = random_batch(seed)
    adv, ret = run("gae", rewards, mask, index, values=values, gamma=gamma, lam=lam)
    ref_adv, ref_ret = naive_gae(rewards, values, mask, gamma, lam)
    assert_on_mask(adv, ref_adv, mask)
    assert_on_mask(ret, ref_ret, mask)


@pytest.mark.parametrize("name", ["grpo", "rloo", "reinforce_plus_plus_baseline"])
def test_group_estimators_do_not_depend_on_row_order(name):
    rewards, mask, index, values = random_batch(5)
    adv, _ = run(name, rewards, mask, index, values=values)
    perm = torch.randperm(len(index), generator=torch.Generator().manual_seed(0))
    adv_p, _ = run(name, rewards[perm], mask[perm], index[perm], values=values[perm])
    assert torch.allclose(adv_p, adv[perm], atol=1e-12)


# ---------------------------------------------------------------- contract and edge cases
def test_gae_without_values_raises():
    rewards, mask = outcome([1.0, 0.0])
    with pytest.raises(ValueError, match="needs critic values"):
        run("gae", rewards, mask)


@pytest.mark.parametrize("name", sorted(ADVANTAGE_ESTIMATORS.names()))
def test_one_signature_no_grad_and_shapes(name):
    rewards, mask, index, values = random_batch(3, dtype=torch.float32)
    values.requires_grad_(True)
    rewards.requires_grad_(True)
    fn = ADVANTAGE_ESTIMATORS.get(name)
    adv, ret = fn(rewards, mask.bool(), index, values, gamma=1.0, lam=0.95, norm_adv_by_std_in_grpo=True)
    assert adv.shape == ret.shape == rewards.shape
    assert adv.dtype == ret.dtype == torch.float32
    assert not adv.requires_grad and not ret.requires_grad
    assert torch.isfinite(adv).all() and torch.isfinite(ret).all()
    adv.add_(1.0)  # returns is not an alias of advantages
    assert not torch.equal(adv, ret)


def test_shape_errors_are_clear():
    rewards, mask = outcome([1.0, 0.0])
    with pytest.raises(ValueError, match="group_index"):
        run("grpo", rewards, mask, torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="response_mask"):
        run("grpo", rewards, mask[:, :2])
    with pytest.raises(ValueError, match="values"):
        run("gae", rewards, mask, values=torch.zeros(2, 2))


def test_gae_with_bf16_values_runs_in_float32():
    rewards, mask, index, values = random_batch(2, dtype=torch.float32)
    adv, ret = run("gae", rewards, mask, index, values=values.to(torch.bfloat16), lam=0.95)
    ref_adv, _ = run("gae", rewards, mask, index, values=values.to(torch.bfloat16).float(), lam=0.95)
    assert adv.dtype == ret.dtype == torch.float32 and torch.equal(adv, ref_adv)
