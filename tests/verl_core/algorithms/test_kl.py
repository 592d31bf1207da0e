"""KL estimators, controllers, the reward penalty and the KL loss."""

import json
import math

import pytest
import torch

from verl_core.algorithms import (
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    agg_loss,
    apply_kl_penalty,
    kl_loss,
    make_kl_controller,
)


def est(name, logp, ref_logp):
    return KL_ESTIMATORS.get(name)(torch.as_tensor(logp, dtype=torch.float64),
                                   torch.as_tensor(ref_logp, dtype=torch.float64))


def test_hand_computed():
    # logp = -1, ref = -2: log π - log π_ref = 1
    assert est("k1", [-1.0], [-2.0]).item() == 1.0
    assert est("abs", [-1.0], [-2.0]).item() == 1.0
    assert est("k2", [-1.0], [-2.0]).item() == 0.5  # ½ · 1²
    # k3: log r = ref - logp = -1 -> e^-1 - (-1) - 1 = e^-1 = 0.36788
    assert est("k3", [-1.0], [-2.0]).item() == pytest.approx(math.exp(-1))
    # the other direction: log π - log π_ref = -1
    assert est("k1", [-2.0], [-1.0]).item() == -1.0  # k1 can be negative
    assert est("abs", [-2.0], [-1.0]).item() == 1.0
    assert est("k2", [-2.0], [-1.0]).item() == 0.5
    assert est("k3", [-2.0], [-1.0]).item() == pytest.approx(math.e - 2)  # e - 1 - 1 = 0.71828


def test_aliases_are_the_same_functions():
    for alias, name in (("kl", "k1"), ("mse", "k2"), ("low_var_kl", "k3")):
        assert KL_ESTIMATORS.get(alias) is KL_ESTIMATORS.get(name)


def test_k3_non_negative_zero_at_equality_and_clamped():
    g = torch.Generator().manual_seed(0)
    logp = torch.randn(2000, dtype=torch.float64, generator=g) * 10
    ref = torch.randn(2000, dtype=torch.float64, generator=g) * 10
    k3 = est("k3", logp, ref)
    assert (k3 >= 0).all() and (k3 <= 10).all()  # e^x >= 1 + x; clamp at 10
    assert (est("k2", logp, ref) >= 0).all()
    assert (est("k3", logp, logp) == 0).all()
    # far apart: log r = 30 is clamped to 20 before exp and the result to 10
    assert est("k3", [0.0], [30.0]).item() == 10.0
    x = torch.tensor([0.0], requires_grad=True)
    KL_ESTIMATORS.get("k3")(x, torch.tensor([30.0])).sum().backward()
    assert x.grad.item() == 0.0  # a clamped penalty has no gradient


def test_k1_and_k3_are_unbiased_estimates_of_kl():
    # Sample tokens from π; the sample means of k1 and k3 approach KL(π || π_ref).
    g = torch.Generator().manual_seed(0)
    logits, ref_logits = torch.randn(6, generator=g, dtype=torch.float64), torch.randn(6, generator=g,
                                                                                        dtype=torch.float64)
    logp_all, ref_all = logits.log_softmax(-1), ref_logits.log_softmax(-1)
    true_kl = (logp_all.exp() * (logp_all - ref_all)).sum().item()
    tokens = torch.multinomial(logp_all.exp(), 200_000, replacement=True, generator=g)
    logp, ref = logp_all[tokens], ref_all[tokens]
    for name in ("k1", "k3"):
        assert est(name, logp, ref).mean().item() == pytest.approx(true_kl, rel=0.03)
    # k3 has lower variance than k1 when the distributions are close-ish
    assert est("k3", logp, ref).var() < est("k1", logp, ref).var()


def test_apply_kl_penalty_hand_computed():
    scores = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0], [0.0, 0.0, 0.0]])
    logp = torch.tensor([[-1.0, -1.0, -1.0], [-1.0, -2.0, -9.0], [-1.0, -1.0, -1.0]])
    ref = torch.tensor([[-2.0, -1.0, -1.5], [-1.0, -1.0, 0.0], [0.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [0, 0, 0]])
    rewards, metrics = apply_kl_penalty(scores, logp, ref, mask, kl_coef=0.1, kl_penalty="kl")
    # k1 on valid tokens: row 0: [1, 0, 0.5]; row 1: [0, -1, (masked)]; row 2: all masked
    # rewards = scores - 0.1 * k1
    expected = torch.tensor([[-0.1, 0.0, 0.95], [0.0, 2.1, 0.0], [0.0, 0.0, 0.0]])
    assert torch.allclose(rewards, expected)
    # per-response mean KL: 1.5/3 = 0.5, -1/2 = -0.5, empty = 0 -> batch mean 0 / 3 = 0
    assert metrics["kl"].item() == pytest.approx(0.0, abs=1e-7)
    _, metrics = apply_kl_penalty(scores, logp, ref, mask, kl_coef=0.1, kl_penalty="abs")
    assert metrics["kl"].item() == pytest.approx((0.5 + 0.5 + 0.0) / 3)


@pytest.mark.parametrize("name", ["k1", "abs", "k2", "k3"])
@pytest.mark.parametrize("seed", range(3))
def test_apply_kl_penalty_matches_naive(name, seed):
    g = torch.Generator().manual_seed(seed)
    N, T = 5, 6
    scores = torch.randn(N, T, generator=g, dtype=torch.float64)
    logp = -torch.rand(N, T, generator=g, dtype=torch.float64) * 4
    ref = -torch.rand(N, T, generator=g, dtype=torch.float64) * 4
    lengths = torch.randint(0, T + 1, (N,), generator=g)
    mask = (torch.arange(T)[None] < lengths[:, None]).long()
    beta = 0.05
    rewards, metrics = apply_kl_penalty(scores, logp, ref, mask, kl_coef=beta, kl_penalty=name)
    kld = est(name, logp, ref)
    per_seq = []
    for i in range(N):
        row = []
        for t in range(T):
            m = int(mask[i, t])
            assert rewards[i, t].item() == pytest.approx(scores[i, t].item() - beta * kld[i, t].item() * m)
            if m:
                row.append(kld[i, t].item())
        per_seq.append(sum(row) / len(row) if row else 0.0)
    assert metrics["kl"].item() == pytest.approx(sum(per_seq) / N, rel=1e-9, abs=1e-12)
    assert metrics["kl"].dim() == 0 and not metrics["kl"].requires_grad


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_kl_loss_is_aggregated_estimator(mode):
    g = torch.Generator().manual_seed(0)
    logp = torch.randn(3, 4, generator=g, requires_grad=True)
    ref = torch.randn(3, 4, generator=g)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]])
    loss = kl_loss(logp, ref, mask, kl_loss_type="low_var_kl", loss_agg_mode=mode)
    assert torch.allclose(loss, agg_loss(KL_ESTIMATORS.get("k3")(logp, ref), mask, mode))
    loss.backward()  # gradient flows into the policy log-probs, not into masked positions
    assert (logp.grad[~mask.bool()] == 0).all() and logp.grad[mask.bool()].abs().sum() > 0
    with pytest.raises(KeyError, match=r"known: abs, abs\+, k1, k1\+, k2, k2\+, k3, k3\+, kl"):
        kl_loss(logp, ref, mask, kl_loss_type="k4", loss_agg_mode=mode)


# ---------------------------------------------------------------- controllers
def test_fixed_controller():
    c = FixedKLController(0.05)
    c.update(current_kl=100.0, n_steps=1000)
    assert c.value == 0.05


def test_adaptive_controller_hand_computed():
    c = AdaptiveKLController(init_kl_coef=0.1, target_kl=0.1, horizon=100)
    c.update(current_kl=0.15, n_steps=10)
    # e = clip(0.15 / 0.1 - 1, ±0.2) = clip(0.5) = 0.2; β = 0.1 · (1 + 0.2 · 10 / 100) = 0.102
    assert c.value == pytest.approx(0.102)
    c.update(current_kl=0.09, n_steps=10)
    # e = 0.9 - 1 = -0.1; β = 0.102 · (1 - 0.1 · 0.1) = 0.10098
    assert c.value == pytest.approx(0.10098)
    c.update(current_kl=0.0, n_steps=10)
    # e = clip(-1) = -0.2; β · (1 - 0.02)
    assert c.value == pytest.approx(0.10098 * 0.98)


def test_adaptive_controller_moves_kl_towards_target():
    # A toy policy whose KL falls as β rises: KL(β) = 0.002 / β. The fixed point is β* = 0.02.
    target = 0.1
    c = AdaptiveKLController(init_kl_coef=0.001, target_kl=target, horizon=1000)
    gaps = []
    for _ in range(400):
        kl = 0.002 / c.value
        gaps.append(abs(kl - target))
        c.update(kl, n_steps=64)
    assert gaps[-1] < 0.01 * gaps[0]
    assert all(b <= a + 1e-12 for a, b in zip(gaps, gaps[1:]))  # monotone approach, no overshoot
    assert c.value == pytest.approx(0.02, rel=0.02)


def test_controller_state_round_trip():
    a = AdaptiveKLController(0.05, target_kl=0.2, horizon=500)
    for kl in (0.5, 0.1, 0.3):
        a.update(kl, n_steps=32)
    state = a.state_dict()
    assert all(type(v) is float for v in state.values())
    state = json.loads(json.dumps(state))  # plain floats survive any checkpoint format
    b = AdaptiveKLController(1.0, target_kl=1.0, horizon=1)
    b.load_state_dict(state)
    for kl in (0.25, 0.05):
        a.update(kl, n_steps=32)
        b.update(kl, n_steps=32)
        assert a.value == b.value  # bit for bit
    f = FixedKLController(0.3)
    g = FixedKLController(0.0)
    g.load_state_dict(f.state_dict())
    assert g.value == 0.3 and f.state_dict() == {"value": 0.3}


def test_make_kl_controller():
    assert isinstance(make_kl_controller("fixed", kl_coef=0.1, target_kl=0.1, horizon=10), FixedKLController)
    c = make_kl_controller("adaptive", kl_coef=0.1, target_kl=0.2, horizon=10)
    assert isinstance(c, AdaptiveKLController) and c.value == 0.1 and c.target_kl == 0.2
    with pytest.raises(ValueError, match="known: adaptive, fixed"):
        make_kl_controller("pid", kl_coef=0.1, target_kl=0.1, horizon=10)
    with pytest.raises(ValueError):
        AdaptiveKLController(0.1, target_kl=0.1, horizon=0)


# ---------------------------------------------------------------- straight-through "+" forms
PLUS = {"k1+": "k1", "abs+": "abs", "k2+": "k2", "k3+": "k3"}


def naive_estimate(name, lp, rp):
    """verl kl_penalty_forward on one pair of Python floats."""
    d = lp - rp
    if name == "k1":
        return d
    if name == "abs":
        return abs(d)
    if name == "k2":
        return 0.5 * d * d
    log_r = min(max(rp - lp, -20.0), 20.0)
    return min(max(math.exp(log_r) - log_r - 1.0, -10.0), 10.0)


def test_plus_aliases_are_the_same_functions():
    for alias, name in (("kl+", "k1+"), ("mse+", "k2+"), ("low_var_kl+", "k3+")):
        assert KL_ESTIMATORS.get(alias) is KL_ESTIMATORS.get(name)


@pytest.mark.parametrize("plus, base", sorted(PLUS.items()))
@pytest.mark.parametrize("seed", range(4))
def test_plus_forms_match_naive_value_and_k2_gradient(plus, base, seed):
    # value: the base estimator, bit for bit; gradient: k2's, d/dlogp ½(logp - ref)^2 = logp - ref,
    # whatever the base (also where k3's clamps bind and its own gradient is 0)
    g = torch.Generator().manual_seed(seed)
    logp = (torch.randn(4, 6, generator=g, dtype=torch.float64) * 8).requires_grad_(True)
    ref = torch.randn(4, 6, generator=g, dtype=torch.float64) * 8
    out = KL_ESTIMATORS.get(plus)(logp, ref)
    assert torch.equal(out.detach(), KL_ESTIMATORS.get(base)(logp, ref).detach())
    weights = torch.rand(4, 6, generator=g, dtype=torch.float64)  # tells the elements apart
    (grad,) = torch.autograd.grad((out * weights).sum(), logp)
    for i in range(4):
        for t in range(6):
            lp, rp = logp[i, t].item(), ref[i, t].item()
            assert out[i, t].item() == naive_estimate(base, lp, rp) or \
                out[i, t].item() == pytest.approx(naive_estimate(base, lp, rp), rel=1e-12)
            assert grad[i, t].item() == pytest.approx(weights[i, t].item() * (lp - rp), rel=1e-12)
    # towards ref_logp too the gradient is k2's, -(logp - ref) (verl's formula; the reference
    # is frozen in practice)
    ref2 = ref.clone().requires_grad_(True)
    (g_ref,) = torch.autograd.grad(KL_ESTIMATORS.get(plus)(logp, ref2).sum(), ref2)
    assert torch.allclose(g_ref, -(logp - ref).detach(), rtol=1e-12, atol=0)


def test_plus_forms_in_kl_loss_and_reward_penalty():
    g = torch.Generator().manual_seed(0)
    logp = torch.randn(3, 5, generator=g, requires_grad=True)
    ref = torch.randn(3, 5, generator=g)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 0, 1, 0, 0], [0, 0, 0, 0, 0]])
    for mode in ("token-mean", "seq-mean-token-sum-norm"):
        plus = kl_loss(logp, ref, mask, kl_loss_type="k3+", loss_agg_mode=mode, loss_scale_factor=4.0)
        base = kl_loss(logp, ref, mask, kl_loss_type="k3", loss_agg_mode=mode, loss_scale_factor=4.0)
        k2 = kl_loss(logp, ref, mask, kl_loss_type="k2", loss_agg_mode=mode, loss_scale_factor=4.0)
        assert plus.item() == base.item()
        (g_plus,) = torch.autograd.grad(plus, logp)
        (g_k2,) = torch.autograd.grad(k2, logp)
        assert torch.allclose(g_plus, g_k2, rtol=1e-6, atol=1e-8)
    scores = torch.randn(3, 5, generator=g)
    r_plus, m_plus = apply_kl_penalty(scores, logp.detach(), ref, mask, kl_coef=0.1, kl_penalty="low_var_kl+")
    r_base, m_base = apply_kl_penalty(scores, logp.detach(), ref, mask, kl_coef=0.1, kl_penalty="low_var_kl")
    assert torch.equal(r_plus, r_base) and m_plus["kl"] == m_base["kl"]


def test_plus_gradient_is_an_unbiased_kl_gradient_where_k3_is_not():
    # π = softmax(θ) over 6 tokens; tokens sampled from π. The sample mean of ∇_θ k3+(token)
    # approaches ∇_θ KL(π_θ || π_ref) (computed exactly); the mean of ∇_θ k3 approaches the
    # gradient of the other direction, KL(π_ref || π_θ), and the mean of ∇_θ k1 approaches 0.
    g = torch.Generator().manual_seed(1)
    theta = torch.randn(6, generator=g, dtype=torch.float64, requires_grad=True)
    ref_all = torch.randn(6, generator=g, dtype=torch.float64).log_softmax(-1)
    logp_all = theta.log_softmax(-1)
    (true_grad,) = torch.autograd.grad((logp_all.exp() * (logp_all - ref_all)).sum(), theta)
    (reverse_grad,) = torch.autograd.grad((ref_all.exp() * (ref_all - theta.log_softmax(-1))).sum(),
                                          theta)
    tokens = torch.multinomial(logp_all.detach().exp(), 400_000, replacement=True, generator=g)

    def mean_grad(name):
        lp = theta.log_softmax(-1)[tokens]
        (grad,) = torch.autograd.grad(KL_ESTIMATORS.get(name)(lp, ref_all[tokens]).mean(), theta)
        return grad

    scale = true_grad.abs().max()
    for name in ("k3+", "k1+", "abs+", "k2"):
        assert (mean_grad(name) - true_grad).abs().max() < 0.05 * scale, name
    assert (mean_grad("k3") - reverse_grad).abs().max() < 0.05 * scale
    assert (mean_grad("k3") - true_grad).abs().max() > 0.2 * scale  # k3's gradient is the wrong one
    assert mean_grad("k1").abs().max() < 0.05 * scale
