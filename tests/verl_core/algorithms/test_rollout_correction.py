"""Rollout importance weights: a hand case, a naive per-token reference, the options."""

import math

import pytest
import torch

from verl_core.algorithms import rollout_is_weights


def naive_weights(train, rollout, mask, level, upper, lower, normalize):
    """verl compute_rollout_correction_weights on Python floats -> (weights, metrics)."""
    N, T = len(mask), len(mask[0])
    raw = [[0.0] * T for _ in range(N)]
    for i in range(N):
        seq = sum(train[i][t] - rollout[i][t] for t in range(T) if mask[i][t])
        for t in range(T):
            if mask[i][t]:
                log_w = (train[i][t] - rollout[i][t]) if level == "token" else seq
                raw[i][t] = math.exp(min(max(log_w, -20.0), 20.0))
    if lower > 0:  # IcePop
        w = [[x if lower <= x <= upper else 0.0 for x in row] for row in raw]
    else:  # TIS
        w = [[min(x, upper) for x in row] for row in raw]
    valid = [(i, t) for i in range(N) for t in range(T) if mask[i][t]]
    rows = [i for i in range(N) if any(mask[i])]

    def frac(pred):
        if level == "token":
            return sum(pred(raw[i][t]) for i, t in valid) / len(valid)
        first = {i: next(t for t in range(T) if mask[i][t]) for i in rows}
        return sum(pred(raw[i][first[i]]) for i in rows) / len(rows)

    metrics = {
        "rollout_is_mean": sum(w[i][t] for i, t in valid) / len(valid),
        "rollout_is_ratio_fraction_high": frac(lambda x: x > upper),
        "rollout_is_ratio_fraction_low": frac(lambda x: x < lower),
        "kl": sum(rollout[i][t] - train[i][t] for i, t in valid) / len(valid),
    }
    if normalize:
        if level == "token":
            mean = metrics["rollout_is_mean"]
        else:  # the mean over non-empty responses of each response's (constant) weight
            mean = sum(sum(w[i][t] for t in range(T) if mask[i][t]) / sum(mask[i]) for i in rows) / len(rows)
        if mean > 1e-8:
            w = [[x / mean for x in row] for row in w]
    return w, metrics


def random_case(seed, scale=0.6):
    g = torch.Generator().manual_seed(seed)
    N, T = int(torch.randint(1, 7, (1,), generator=g)), int(torch.randint(1, 9, (1,), generator=g))
    rollout = -torch.rand(N, T, generator=g, dtype=torch.float64) * 3
    train = rollout + scale * torch.randn(N, T, generator=g, dtype=torch.float64)
    lengths = torch.randint(0, T + 1, (N,), generator=g)
    lengths[0] = max(int(lengths[0]), 1)
    mask = (torch.arange(T)[None] < lengths[:, None]) & (torch.rand(N, T, generator=g) > 0.2)
    mask[0, 0] = True  # at least one valid token
    return train, rollout, mask.to(torch.float64)


def test_hand_computed_token_tis():
    rollout = torch.log(torch.tensor([[0.5, 0.2, 0.4]], dtype=torch.float64))
    train = torch.log(torch.tensor([[0.25, 0.6, 0.4]], dtype=torch.float64))
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    w, m = rollout_is_weights(train, rollout, mask, level="token", threshold=2.0)
    # ρ = 0.25/0.5 = 0.5, 0.6/0.2 = 3 -> truncated at 2; the padded token is 0
    assert torch.allclose(w, torch.tensor([[0.5, 2.0, 0.0]], dtype=torch.float64))
    assert m["rollout_is_mean"].item() == pytest.approx(1.25)
    assert m["rollout_is_ratio_fraction_high"].item() == 0.5
    # sequence level: ρ = 0.5 · 3 = 1.5 on both valid tokens
    w, _ = rollout_is_weights(train, rollout, mask, level="sequence", threshold=2.0)
    assert torch.allclose(w, torch.tensor([[1.5, 1.5, 0.0]], dtype=torch.float64))
    # IcePop [0.6, 2]: 0.5 and 3 are both outside -> 0
    w, m = rollout_is_weights(train, rollout, mask, level="token", threshold=2.0, threshold_lower=0.6)
    assert torch.equal(w, torch.zeros(1, 3, dtype=torch.float64))
    assert m["rollout_is_ratio_fraction_low"].item() == 0.5


@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("lower", [0.0, 0.7])
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("seed", range(5))
def test_matches_naive(seed, level, lower, normalize):
    train, rollout, mask = random_case(seed)
    upper = 1.6
    w, m = rollout_is_weights(train, rollout, mask, level=level, threshold=upper,
                              threshold_lower=lower, batch_normalize=normalize)
    ref_w, ref_m = naive_weights(train.tolist(), rollout.tolist(), mask.tolist(), level, upper,
                                 lower, normalize)
    assert torch.allclose(w, torch.tensor(ref_w, dtype=torch.float64), rtol=1e-12, atol=1e-15)
    for k, v in ref_m.items():
        assert m[k].item() == pytest.approx(v, rel=1e-12, abs=1e-15), k


def test_weights_are_detached_and_bounded():
    train, rollout, mask = random_case(3, scale=30.0)  # log-ratios far beyond ±20
    train.requires_grad_(True)
    w, m = rollout_is_weights(train, rollout, mask, level="token", threshold=5.0)
    assert not w.requires_grad and all(not v.requires_grad for v in m.values())
    assert (w <= 5.0).all() and (w >= 0).all() and torch.isfinite(w).all()
    assert (w[~mask.bool()] == 0).all()


def test_rejects_bad_options():
    train, rollout, mask = random_case(0)
    with pytest.raises(ValueError, match="known: token, sequence"):
        rollout_is_weights(train, rollout, mask, level="geometric", threshold=2.0)
    with pytest.raises(ValueError, match="threshold"):
        rollout_is_weights(train, rollout, mask, level="token", threshold=0.0)
    with pytest.raises(ValueError, match="threshold_lower"):
        rollout_is_weights(train, rollout, mask, level="token", threshold=2.0, threshold_lower=3.0)
    with pytest.raises(ValueError, match="shape"):
        rollout_is_weights(train, rollout[:, :1], mask, level="token", threshold=2.0)
