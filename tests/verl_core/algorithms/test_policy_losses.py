"""Policy losses: hand cases for the clip / clip-higher / dual-clip branches, a naive per-token
reference, and the identities that relate GSPO to token-level PPO."""

import math

import pytest
import torch

from verl_core.algorithms import POLICY_LOSSES, agg_loss, get_policy_loss

MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")
CLIP = dict(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0)


def loss_of(name, old, new, adv, mask=None, mode="token-mean", **clip):
    mask = torch.ones_like(new) if mask is None else mask
    return get_policy_loss(name)(old, new, adv, mask, **{**CLIP, **clip}, loss_agg_mode=mode)


def one_token(log_ratio, adv, **clip):
    """A single token with the given log-ratio and advantage; returns loss, metrics, d loss/d logp."""
    new = torch.tensor([[log_ratio]], dtype=torch.float64, requires_grad=True)
    old = torch.zeros(1, 1, dtype=torch.float64)
    loss, metrics = loss_of("vanilla", old, new, torch.tensor([[adv]], dtype=torch.float64), **clip)
    (grad,) = torch.autograd.grad(loss, new)
    return loss.item(), {k: v.item() for k, v in metrics.items()}, grad.item()


# ---------------------------------------------------------------- naive references
def naive_vanilla_tokens(old, new, adv, lo, hi, c):
    """verl compute_policy_loss_vanilla per token on Python floats -> (losses, clipped, lower)."""
    L, C, D = [], [], []
    for o_row, n_row, a_row in zip(old.tolist(), new.tolist(), adv.tolist()):
        lr, cr, dr = [], [], []
        for o, n, a in zip(o_row, n_row, a_row):
            ratio = math.exp(min(max(n - o, -20.0), 20.0))
            l1 = -a * ratio
            l2 = -a * min(max(ratio, 1 - lo), 1 + hi)
            clipped = max(l1, l2)
            l3 = -a * c
            lr.append(min(l3, clipped) if a < 0 else clipped)
            cr.append(float(l2 > l1))
            dr.append(float(clipped > l3 and a < 0))
        L.append(lr), C.append(cr), D.append(dr)
    return [torch.tensor(x, dtype=torch.float64) for x in (L, C, D)]


def naive_gspo_tokens(old, new, adv, mask, lo, hi):
    """verl compute_policy_loss_gspo forward values per token on Python floats."""
    L, C = [], []
    for o_row, n_row, a_row, m_row in zip(old.tolist(), new.tolist(), adv.tolist(), mask.tolist()):
        n_valid = max(sum(m_row), 1)
        seq_log = sum((n - o) * m for n, o, m in zip(n_row, o_row, m_row)) / n_valid
        s = math.exp(min(seq_log, 10.0))
        lr, cr = [], []
        for a in a_row:
            l1, l2 = -a * s, -a * min(max(s, 1 - lo), 1 + hi)
            lr.append(max(l1, l2))
            cr.append(float(l2 > l1))
        L.append(lr), C.append(cr)
    return [torch.tensor(x, dtype=torch.float64) for x in (L, C)]


def random_inputs(seed, scale=0.4, per_seq_adv=False):
    g = torch.Generator().manual_seed(seed)
    N, T = int(torch.randint(1, 7, (1,), generator=g)), int(torch.randint(1, 9, (1,), generator=g))
    old = -torch.rand(N, T, generator=g, dtype=torch.float64) * 3
    new = old + scale * torch.randn(N, T, generator=g, dtype=torch.float64)
    adv = torch.randn(N, 1 if per_seq_adv else T, generator=g, dtype=torch.float64).expand(N, T).clone()
    lengths = torch.randint(0, T + 1, (N,), generator=g)
    lengths[0] = max(int(lengths[0]), 1)
    mask = (torch.arange(T)[None] < lengths[:, None]).to(torch.float64)
    return old, new, adv, mask


# ---------------------------------------------------------------- vanilla: hand cases
def test_on_policy_is_minus_mean_advantage():
    adv = torch.tensor([[1.0, -2.0, 0.5]])
    logp = torch.tensor([[-1.0, -0.5, -2.0]], requires_grad=True)
    loss, m = loss_of("vanilla", logp.detach(), logp, adv)
    # ρ = 1 everywhere: loss = -(1 - 2 + 0.5) / 3 = 0.1667; nothing clipped; KL 0
    assert loss.item() == pytest.approx(0.5 / 3)
    assert m["pg_clipfrac"].item() == 0 and m["pg_clipfrac_lower"].item() == 0 and m["ppo_kl"].item() == 0
    loss.backward()
    assert torch.allclose(logp.grad, -adv / 3)  # ∇ = -A ρ / n_tokens: the REINFORCE gradient


def test_clip_higher_is_asymmetric():
    up = math.log(1.25)  # ρ = 1.25
    # symmetric ε = 0.2: A > 0 and ρ = 1.25 > 1.2 -> clipped: loss -1.2, no gradient
    loss, m, grad = one_token(up, 1.0, clip_ratio_low=0.2, clip_ratio_high=0.2)
    assert loss == pytest.approx(-1.2) and m["pg_clipfrac"] == 1.0 and grad == 0.0
    # clip-higher ε_high = 0.28: 1.25 < 1.28 -> not clipped: loss -1.25, gradient -A ρ = -1.25
    loss, m, grad = one_token(up, 1.0, clip_ratio_low=0.2, clip_ratio_high=0.28)
    assert loss == pytest.approx(-1.25) and m["pg_clipfrac"] == 0.0 and grad == pytest.approx(-1.25)
    # ... but ρ = 1.3 is clipped at 1.28
    loss, m, grad = one_token(math.log(1.3), 1.0, clip_ratio_low=0.2, clip_ratio_high=0.28)
    assert loss == pytest.approx(-1.28) and m["pg_clipfrac"] == 1.0 and grad == 0.0
    # the low side is untouched by ε_high: A < 0, ρ = 0.75 < 0.8 -> max(0.75, 0.8) = 0.8, clipped
    loss, m, grad = one_token(math.log(0.75), -1.0, clip_ratio_low=0.2, clip_ratio_high=0.28)
    assert loss == pytest.approx(0.8) and m["pg_clipfrac"] == 1.0 and grad == 0.0
    # A > 0 with ρ < 1 - ε_low is not clipped (the pessimistic bound is the unclipped term)
    loss, m, grad = one_token(math.log(0.5), 1.0)
    assert loss == pytest.approx(-0.5) and m["pg_clipfrac"] == 0.0 and grad == pytest.approx(-0.5)


def test_dual_clip_bounds_negative_advantage_loss():
    # A = -1, ρ = 5 > c = 3: max(5, 1.28) = 5, then min(5, -A c = 3) = 3; gradient 0
    loss, m, grad = one_token(math.log(5.0), -1.0, clip_ratio_c=3.0)
    assert loss == pytest.approx(3.0) and m["pg_clipfrac_lower"] == 1.0 and m["pg_clipfrac"] == 0.0
    assert grad == 0.0
    # A = -1, ρ = 2 < c: the ordinary unclipped loss 2, gradient -A ρ = 2
    loss, m, grad = one_token(math.log(2.0), -1.0, clip_ratio_c=3.0)
    assert loss == pytest.approx(2.0) and m["pg_clipfrac_lower"] == 0.0 and grad == pytest.approx(2.0)
    # A = +1, ρ = 5: dual-clip does not apply; upper clip: -1.28
    loss, m, _ = one_token(math.log(5.0), 1.0, clip_ratio_c=3.0)
    assert loss == pytest.approx(-1.28) and m["pg_clipfrac_lower"] == 0.0 and m["pg_clipfrac"] == 1.0


def test_log_ratio_is_clamped_to_20():
    loss, m, _ = one_token(30.0, -1.0, clip_ratio_c=1e12)
    assert loss == pytest.approx(math.exp(20.0))  # ρ = e^20, not e^30
    assert m["ppo_kl"] == pytest.approx(-20.0)


def test_vanilla_rejects_clip_ratio_c_not_above_one():
    with pytest.raises(ValueError, match="clip_ratio_c"):
        one_token(0.0, 1.0, clip_ratio_c=1.0)


# ---------------------------------------------------------------- vanilla vs naive
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("seed", range(8))
def test_vanilla_matches_naive(mode, seed):
    old, new, adv, mask = random_inputs(seed, scale=1.5)  # large enough to hit every branch
    lo, hi, c = 0.2, 0.28, 3.0
    loss, m = loss_of("vanilla", old, new, adv, mask, mode, clip_ratio_low=lo, clip_ratio_high=hi,
                      clip_ratio_c=c)
    L, C, D = naive_vanilla_tokens(old, new, adv, lo, hi, c)
    assert loss.item() == pytest.approx(agg_loss(L, mask, mode).item(), rel=1e-9, abs=1e-12)
    valid = mask.bool()
    assert m["pg_clipfrac"].item() == pytest.approx(C[valid].mean().item(), abs=1e-7)
    assert m["pg_clipfrac_lower"].item() == pytest.approx(D[valid].mean().item(), abs=1e-7)
    assert m["ppo_kl"].item() == pytest.approx((old - new)[valid].mean().item(), rel=1e-6, abs=1e-9)


@pytest.mark.parametrize("name", ["vanilla", "gspo"])
def test_padding_does_not_change_the_loss(name):
    old, new, adv, mask = random_inputs(3)
    mask[:, -1] = 0
    base, _ = loss_of(name, old, new, adv, mask)
    new2, old2, adv2 = new.clone(), old.clone(), adv.clone()
    pad = ~mask.bool()
    new2[pad], old2[pad], adv2[pad] = 50.0, -50.0, 1e6  # garbage where masked
    other, _ = loss_of(name, old2, new2, adv2, mask)
    assert other.item() == pytest.approx(base.item(), rel=1e-12)


# ---------------------------------------------------------------- gspo
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("seed", range(6))
def test_gspo_matches_naive(mode, seed):
    old, new, adv, mask = random_inputs(seed, scale=0.3)
    loss, m = loss_of("gspo", old, new, adv, mask, mode)
    L, C = naive_gspo_tokens(old, new, adv, mask, 0.2, 0.28)
    assert loss.item() == pytest.approx(agg_loss(L, mask, mode).item(), rel=1e-9, abs=1e-12)
    assert m["pg_clipfrac"].item() == pytest.approx(C[mask.bool()].mean().item(), abs=1e-7)
    assert m["pg_clipfrac_lower"].item() == 0.0


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("seed", range(6))
def test_gspo_equals_vanilla_when_ratio_is_constant_within_each_sequence(mode, seed):
    # If every token of response i has the same log-ratio, the sequence ratio s_i equals each token
    # ratio, so values AND gradients agree (the gspo gradient through token t is s_i ∇logp_t, the
    # vanilla one ρ_t ∇logp_t). It needs ρ < c so that vanilla's dual-clip stays inactive, which
    # gspo does not have. Advantages may vary per token.
    g = torch.Generator().manual_seed(seed)
    N, T = 4, 5
    old = -torch.rand(N, T, generator=g, dtype=torch.float64) * 3
    per_seq = 0.3 * torch.randn(N, 1, generator=g, dtype=torch.float64)  # |log ρ| small: ρ < 3
    new = (old + per_seq).requires_grad_(True)
    adv = torch.randn(N, T, generator=g, dtype=torch.float64)
    mask = (torch.arange(T)[None] < torch.tensor([[5], [3], [1], [4]])).to(torch.float64)
    lv, mv = loss_of("vanilla", old, new, adv, mask, mode)
    lg, mg = loss_of("gspo", old, new, adv, mask, mode)
    (gv,) = torch.autograd.grad(lv, new)
    (gg,) = torch.autograd.grad(lg, new)
    assert lg.item() == pytest.approx(lv.item(), rel=1e-12)
    assert torch.allclose(gg, gv, rtol=1e-12, atol=1e-15)
    assert mg["pg_clipfrac"].item() == mv["pg_clipfrac"].item()
    assert mg["ppo_kl"].item() == pytest.approx(mv["ppo_kl"].item(), rel=1e-12)


def test_gspo_and_vanilla_differ_when_ratios_vary_within_a_sequence():
    old = torch.zeros(1, 2, dtype=torch.float64)
    new = torch.tensor([[0.5, -0.5]], dtype=torch.float64)  # token ratios e^±0.5, sequence ratio 1
    adv = torch.ones(1, 2, dtype=torch.float64)
    lg, mg = loss_of("gspo", old, new, adv)
    lv, mv = loss_of("vanilla", old, new, adv)
    assert lg.item() == pytest.approx(-1.0)  # s = exp(mean(0.5, -0.5)) = 1: nothing clipped
    # vanilla: token 0 clipped at 1.28, token 1 unclipped e^-0.5 = 0.6065 -> -(1.28 + 0.6065) / 2
    assert lv.item() == pytest.approx(-(1.28 + math.exp(-0.5)) / 2)
    assert mg["pg_clipfrac"].item() == 0.0 and mv["pg_clipfrac"].item() == 0.5


@pytest.mark.parametrize("seed", range(4))
def test_gspo_loss_depends_only_on_sequence_mean_log_ratio(seed):
    old, new, adv, mask = random_inputs(seed, scale=0.3, per_seq_adv=True)
    base, _ = loss_of("gspo", old, new, adv, mask, "seq-mean-token-mean")
    # move log-prob mass between valid tokens of each response, keeping the per-response sum
    g = torch.Generator().manual_seed(100 + seed)
    shift = torch.randn(new.shape, generator=g, dtype=torch.float64) * mask
    shift = shift - mask * (shift.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1))
    moved, _ = loss_of("gspo", old, new + shift, adv, mask, "seq-mean-token-mean")
    assert moved.item() == pytest.approx(base.item(), rel=1e-10, abs=1e-12)


@pytest.mark.parametrize("seed", range(4))
def test_gspo_token_gradient_equals_sequence_level_gspo_gradient(seed):
    # With one advantage per response and seq-mean-token-mean, the GSPO-token straight-through
    # form has the same gradient as the paper's sequence objective
    #     J = mean_i max(-A_i s_i, -A_i clip(s_i)),  s_i = exp(mean_t(logp_it - old_it)).
    old, new, adv, mask = random_inputs(seed, scale=0.3, per_seq_adv=True)
    new.requires_grad_(True)
    lo, hi = 0.2, 0.28
    loss, _ = loss_of("gspo", old, new, adv, mask, "seq-mean-token-mean", clip_ratio_low=lo,
                      clip_ratio_high=hi)
    (g_token,) = torch.autograd.grad(loss, new)
    n = mask.sum(-1)
    s = torch.exp(((new - old) * mask).sum(-1) / n.clamp(min=1))  # (N,)
    A = adv[:, 0]
    per_seq = torch.maximum(-A * s, -A * s.clamp(1 - lo, 1 + hi))
    has = (n > 0).to(per_seq.dtype)
    J = (per_seq * has).sum() / has.sum()
    (g_seq,) = torch.autograd.grad(J, new)
    assert torch.allclose(g_token, g_seq, rtol=1e-10, atol=1e-14)


def test_gspo_ignores_clip_ratio_c_and_clamps_log_ratio_at_10():
    old, new, adv, mask = random_inputs(1)
    a, _ = loss_of("gspo", old, new, adv, mask, clip_ratio_c=3.0)
    b, _ = loss_of("gspo", old, new, adv, mask, clip_ratio_c=1.0)  # would raise for vanilla
    assert a.item() == b.item()
    # log s = 15 -> clamped at 10; A = -1 (not clipped from above for A < 0): loss = e^10
    loss, _ = loss_of("gspo", torch.zeros(1, 1), torch.full((1, 1), 15.0), -torch.ones(1, 1))
    assert loss.item() == pytest.approx(math.exp(10.0), rel=1e-6)


# ---------------------------------------------------------------- contract
@pytest.mark.parametrize("name", sorted(POLICY_LOSSES.names()))
def test_same_outputs_for_every_loss(name):
    old, new, adv, mask = random_inputs(2)
    new.requires_grad_(True)
    loss, metrics = loss_of(name, old, new, adv, mask)
    assert loss.dim() == 0 and loss.requires_grad
    assert set(metrics) == {"pg_clipfrac", "pg_clipfrac_lower", "ppo_kl"}
    for v in metrics.values():
        assert isinstance(v, torch.Tensor) and v.dim() == 0 and not v.requires_grad
    with pytest.raises(ValueError, match="shape"):
        loss_of(name, old[:, :1], new, adv, mask)
