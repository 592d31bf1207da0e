"""Policy losses: hand cases for the clip / clip-higher / dual-clip branches, a naive per-token
reference for every loss on random inputs (masks with holes, empty rows, ties), gradient checks
where a loss is defined by its gradient, and the identities that relate the losses."""

import dataclasses
import inspect
import math

import pytest
import torch

from tests.verl_core.algorithms.inputs import LOSS_OPTIONS as OPTS
from tests.verl_core.algorithms.inputs import LossInputs
from verl_core.algorithms import POLICY_LOSSES, PolicyLossOptions, agg_loss
from verl_core.config import AlgorithmConfig

MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm",
         "token-sum")


def one_token(log_ratio, adv, **clip):
    """A single token with the given log-ratio and advantage; returns loss, metrics, d loss/d logp."""
    new = torch.tensor([[log_ratio]], dtype=torch.float64, requires_grad=True)
    old = torch.zeros(1, 1, dtype=torch.float64)
    adv = torch.tensor([[adv]], dtype=torch.float64)
    loss, metrics = LossInputs(old, new, adv, **clip).call("vanilla")
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


def random_inputs(seed, scale=0.4, per_seq_adv=False, holes=False):
    g = torch.Generator().manual_seed(seed)
    N, T = int(torch.randint(1, 7, (1,), generator=g)), int(torch.randint(1, 9, (1,), generator=g))
    old = -torch.rand(N, T, generator=g, dtype=torch.float64) * 3
    new = old + scale * torch.randn(N, T, generator=g, dtype=torch.float64)
    adv = torch.randn(N, 1 if per_seq_adv else T, generator=g, dtype=torch.float64).expand(N, T).clone()
    lengths = torch.randint(0, T + 1, (N,), generator=g)
    lengths[0] = max(int(lengths[0]), 1)
    mask = (torch.arange(T)[None] < lengths[:, None]).to(torch.float64)
    if holes:  # masked tokens inside responses too (the first token of row 0 stays valid)
        hole = torch.rand(N, T, generator=g) < 0.25
        hole[0, 0] = False
        mask = mask * ~hole
    return old, new, adv, mask


# ---------------------------------------------------------------- vanilla: hand cases
def test_on_policy_is_minus_mean_advantage():
    adv = torch.tensor([[1.0, -2.0, 0.5]])
    logp = torch.tensor([[-1.0, -0.5, -2.0]], requires_grad=True)
    loss, m = LossInputs(logp.detach(), logp, adv).call("vanilla")
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
    loss, m = LossInputs(old, new, adv, mask, mode, clip_ratio_low=lo, clip_ratio_high=hi,
                         clip_ratio_c=c).call("vanilla")
    L, C, D = naive_vanilla_tokens(old, new, adv, lo, hi, c)
    assert loss.item() == pytest.approx(agg_loss(L, mask, mode).item(), rel=1e-9, abs=1e-12)
    valid = mask.bool()
    assert m["pg_clipfrac"].item() == pytest.approx(C[valid].mean().item(), abs=1e-7)
    assert m["pg_clipfrac_lower"].item() == pytest.approx(D[valid].mean().item(), abs=1e-7)
    assert m["ppo_kl"].item() == pytest.approx((old - new)[valid].mean().item(), rel=1e-6, abs=1e-9)


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES.names()))
def test_padding_does_not_change_the_loss(name):
    old, new, adv, mask = random_inputs(3, holes=True)
    mask[:, -1] = 0
    opts = dataclasses.replace(OPTS, clip_cov_ratio=0.3, clip_cov_lb=-10.0, kl_cov_ratio=0.3)
    case = LossInputs(old, new, adv, mask, options=opts)
    base, _ = case.call(name)
    new2, old2, adv2 = new.clone(), old.clone(), adv.clone()
    pad = ~mask.bool()
    new2[pad], old2[pad], adv2[pad] = 50.0, -50.0, 1e6  # garbage where masked
    other, _ = dataclasses.replace(case, old_logp=old2, logp=new2, advantages=adv2).call(name)
    assert other.item() == pytest.approx(base.item(), rel=1e-12)


# ---------------------------------------------------------------- gspo
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("seed", range(6))
def test_gspo_matches_naive(mode, seed):
    old, new, adv, mask = random_inputs(seed, scale=0.3)
    loss, m = LossInputs(old, new, adv, mask, mode).call("gspo")
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
    case = LossInputs(old, new, adv, mask, mode)
    lv, mv = case.call("vanilla")
    lg, mg = case.call("gspo")
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
    case = LossInputs(old, new, adv)
    lg, mg = case.call("gspo")
    lv, mv = case.call("vanilla")
    assert lg.item() == pytest.approx(-1.0)  # s = exp(mean(0.5, -0.5)) = 1: nothing clipped
    # vanilla: token 0 clipped at 1.28, token 1 unclipped e^-0.5 = 0.6065 -> -(1.28 + 0.6065) / 2
    assert lv.item() == pytest.approx(-(1.28 + math.exp(-0.5)) / 2)
    assert mg["pg_clipfrac"].item() == 0.0 and mv["pg_clipfrac"].item() == 0.5


@pytest.mark.parametrize("seed", range(4))
def test_gspo_loss_depends_only_on_sequence_mean_log_ratio(seed):
    old, new, adv, mask = random_inputs(seed, scale=0.3, per_seq_adv=True)
    case = LossInputs(old, new, adv, mask, "seq-mean-token-mean")
    base, _ = case.call("gspo")
    # move log-prob mass between valid tokens of each response, keeping the per-response sum
    g = torch.Generator().manual_seed(100 + seed)
    shift = torch.randn(new.shape, generator=g, dtype=torch.float64) * mask
    shift = shift - mask * (shift.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1))
    moved, _ = dataclasses.replace(case, logp=new + shift).call("gspo")
    assert moved.item() == pytest.approx(base.item(), rel=1e-10, abs=1e-12)


@pytest.mark.parametrize("seed", range(4))
def test_gspo_token_gradient_equals_sequence_level_gspo_gradient(seed):
    # With one advantage per response and seq-mean-token-mean, the GSPO-token straight-through
    # form has the same gradient as the paper's sequence objective
    #     J = mean_i max(-A_i s_i, -A_i clip(s_i)),  s_i = exp(mean_t(logp_it - old_it)).
    old, new, adv, mask = random_inputs(seed, scale=0.3, per_seq_adv=True)
    new.requires_grad_(True)
    lo, hi = 0.2, 0.28
    loss, _ = LossInputs(old, new, adv, mask, "seq-mean-token-mean", clip_ratio_low=lo,
                         clip_ratio_high=hi).call("gspo")
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
    case = LossInputs(old, new, adv, mask, clip_ratio_c=3.0)
    a, _ = case.call("gspo")
    b, _ = dataclasses.replace(case, clip_ratio_c=1.0).call("gspo")  # would raise for vanilla
    assert a.item() == b.item()
    # log s = 15 -> clamped at 10; A = -1 (not clipped from above for A < 0): loss = e^10
    loss, _ = LossInputs(torch.zeros(1, 1), torch.full((1, 1), 15.0),
                         -torch.ones(1, 1)).call("gspo")
    assert loss.item() == pytest.approx(math.exp(10.0), rel=1e-6)


# ---------------------------------------------------------------- contract
@pytest.mark.parametrize("name", sorted(POLICY_LOSSES.names()))
def test_same_outputs_for_every_loss(name):
    old, new, adv, mask = random_inputs(2)
    new.requires_grad_(True)
    loss, metrics = LossInputs(old, new, adv, mask).call(name)
    assert loss.dim() == 0 and loss.requires_grad
    assert set(metrics) == {"pg_clipfrac", "pg_clipfrac_lower", "ppo_kl"}
    for v in metrics.values():
        assert isinstance(v, torch.Tensor) and v.dim() == 0 and not v.requires_grad
    with pytest.raises(ValueError, match="shape"):
        LossInputs(old[:, :1], new, adv, mask).call(name)


def test_the_inputs_record_is_the_one_signature():
    # every entry has the prototype's signature (the registry checks it at registration); the
    # record holds a seed where the signature takes a generator, and a fresh one is made per call
    params = inspect.signature(POLICY_LOSSES.get("vanilla")).parameters
    assert {f.name for f in dataclasses.fields(LossInputs)} == set(params) - {"generator"} | {"seed"}
    defaults = {f.name: f.default for f in dataclasses.fields(LossInputs)}
    assert all(defaults[n] == p.default for n, p in params.items()
               if p.default is not p.empty and n not in ("options", "generator"))


# ---------------------------------------------------------------- naive references, new losses
def _rows(*xs):
    return zip(*(x.tolist() for x in xs))


def _tensor(rows):
    return torch.tensor(rows, dtype=torch.float64)


def naive_cispo_tokens(old, new, adv, lo, hi):
    """verl compute_policy_loss_cispo per token -> (losses, clip indicator)."""
    L, C = [], []
    for o_row, n_row, a_row in _rows(old, new, adv):
        lr, cr = [], []
        for o, n, a in zip(o_row, n_row, a_row):
            ratio = math.exp(min(max(n - o, -20.0), 20.0))
            clipped = min(max(ratio, 1 - lo), 1 + hi)
            lr.append(-clipped * a * n)
            cr.append(float(ratio != clipped))
        L.append(lr), C.append(cr)
    return _tensor(L), _tensor(C)


def naive_dppo_tokens(kind, old, new, adv, lo, hi, c):
    """verl compute_policy_loss_dppo_{tv,kl} per token -> (losses, outside, lower)."""
    L, O, D = [], [], []
    for o_row, n_row, a_row in _rows(old, new, adv):
        lr, orow, drow = [], [], []
        for o, n, a in zip(o_row, n_row, a_row):
            ratio = math.exp(min(max(n - o, -20.0), 20.0))
            p, po = math.exp(n), math.exp(o)
            if kind == "tv":
                valid = (p - po <= hi) if a > 0 else (p - po >= -lo)
            else:
                bkl = po * (o - n) + (1 - po) * math.log((1 - po + 1e-8) / (1 - p + 1e-8))
                valid = (bkl <= hi or p <= po) if a > 0 else (bkl <= lo or p >= po)
            lr.append(-a * min(ratio, c) * n * float(valid))
            orow.append(1.0 - float(valid))
            drow.append(float(ratio > c and valid))
        L.append(lr), O.append(orow), D.append(drow)
    return _tensor(L), _tensor(O), _tensor(D)


def naive_sapo_tokens(old, new, adv, tau_pos, tau_neg):
    L = []
    for o_row, n_row, a_row in _rows(old, new, adv):
        row = []
        for o, n, a in zip(o_row, n_row, a_row):
            ratio = math.exp(min(max(n - o, -20.0), 20.0))
            tau = tau_pos if a > 0 else tau_neg
            gate = 4.0 / tau / (1.0 + math.exp(-tau * (ratio - 1.0)))  # σ(τ(ρ - 1)) 4/τ
            row.append(-gate * a)
        L.append(row)
    return _tensor(L)


def naive_geo_mean(old, new, adv, mask, lo, hi, weights=None):
    """verl compute_policy_loss_geo_mean per response -> (L_i per row, clipped > 0, clipped < 0)."""
    seq, hi_c, lo_c = [], [], []
    weights = torch.ones_like(new) if weights is None else weights
    for o_row, n_row, a_row, m_row, w_row in _rows(old, new, adv, mask, weights):
        idx = [t for t, m in enumerate(m_row) if m]
        n_tok = max(len(idx), 1)
        total, hc, lc = 0.0, [], []
        for t in range(len(m_row)):
            l = n_row[t] - o_row[t]
            l_clip = min(max(l, -lo), hi)
            a = a_row[t]
            sgn = (a > 0) - (a < 0)
            if t in idx:
                total += sgn * min(sgn * l, sgn * l_clip)
            hc.append(float(l != l_clip and a > 0))
            lc.append(float(l != l_clip and a < 0))
        ratio = math.exp(total / n_tok)
        adv_i = sum(a_row[t] for t in idx) / n_tok
        w_i = math.exp(sum(math.log(w_row[t] + 1e-10) for t in idx) / n_tok)
        seq.append(-adv_i * ratio * w_i)
        hi_c.append(hc), lo_c.append(lc)
    return seq, _tensor(hi_c), _tensor(lo_c)


def _covariances(adv, new, mask):
    """C_t = (A_t - mean A)(logp_t - mean logp) over the valid tokens, on Python floats."""
    valid = [(i, t) for i, m_row in enumerate(mask.tolist()) for t, m in enumerate(m_row) if m]
    A, P = adv.tolist(), new.tolist()
    mean_a = sum(A[i][t] for i, t in valid) / len(valid)
    mean_p = sum(P[i][t] for i, t in valid) / len(valid)
    return valid, {(i, t): (A[i][t] - mean_a) * (P[i][t] - mean_p) for i, t in valid}


def naive_clip_cov(old, new, adv, mask, lo, hi, ratio_cov, lb, ub, keys):
    """verl compute_policy_loss_clip_cov with the random subset given by ``keys`` (the candidates
    with the smallest keys) -> (losses, selected)."""
    N, T = new.shape
    valid, cov = _covariances(adv, new, mask)
    L, cand = [[0.0] * T for _ in range(N)], []
    for i in range(N):
        for t in range(T):
            o, n, a = old[i, t].item(), new[i, t].item(), adv[i, t].item()
            ratio = math.exp(n - o)
            pg1, pg2 = -a * ratio, -a * min(max(ratio, 1 - lo), 1 + hi)
            L[i][t] = max(pg1, pg2)
            if (i, t) in cov and not pg2 > pg1 and lb < cov[(i, t)] < ub:
                cand.append((keys[i, t].item(), i * T + t, i, t))
    clip_num = max(int(ratio_cov * len(valid)), 1)
    selected = [[0.0] * T for _ in range(N)]
    for _, _, i, t in sorted(cand)[:clip_num]:
        selected[i][t], L[i][t] = 1.0, 0.0
    return _tensor(L), _tensor(selected), len(cand)


def naive_kl_cov(old, new, adv, mask, k, beta):
    """verl compute_policy_loss_kl_cov, ties broken by row-major position -> (losses, selected)."""
    N, T = new.shape
    valid, cov = _covariances(adv, new, mask)
    top = sorted(valid, key=lambda it: (-cov[it], it[0] * T + it[1]))[:max(1, int(len(valid) * k))]
    L, S = [[0.0] * T for _ in range(N)], [[0.0] * T for _ in range(N)]
    for i in range(N):
        for t in range(T):
            lr = new[i, t].item() - old[i, t].item()
            L[i][t] = -adv[i, t].item() * math.exp(lr)
            if (i, t) in top:
                L[i][t] += beta * abs(lr)
                S[i][t] = 1.0
    return _tensor(L), _tensor(S)


def _valid_mean(x, mask):
    return x[mask.bool()].mean().item()


# ---------------------------------------------------------------- new losses vs naive
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("seed", range(6))
def test_cispo_matches_naive(mode, seed):
    old, new, adv, mask = random_inputs(seed, scale=1.0, holes=True)
    loss, m = LossInputs(old, new, adv, mask, mode, loss_scale_factor=5.0).call("cispo")
    L, C = naive_cispo_tokens(old, new, adv, 0.2, 0.28)
    assert loss.item() == pytest.approx(agg_loss(L, mask, mode, loss_scale_factor=5.0).item(),
                                        rel=1e-9, abs=1e-12)
    assert m["pg_clipfrac"].item() == pytest.approx(_valid_mean(C, mask), abs=1e-12)
    assert m["pg_clipfrac_lower"].item() == 0.0


def test_cispo_keeps_the_gradient_of_clipped_tokens():
    # ρ = 2 with A = 1 is clipped at 1.28: PPO's gradient is 0, CISPO's is -clip(ρ) A = -1.28
    old, new = torch.zeros(1, 1, dtype=torch.float64), torch.full((1, 1), math.log(2.0),
                                                                  dtype=torch.float64)
    new.requires_grad_(True)
    adv = torch.ones(1, 1, dtype=torch.float64)
    for name, expected in (("vanilla", 0.0), ("cispo", -1.28)):
        loss, _ = LossInputs(old, new, adv).call(name)
        (grad,) = torch.autograd.grad(loss, new)
        assert grad.item() == pytest.approx(expected)


def test_cispo_with_verls_large_clip_ratio_low_has_no_lower_clip():
    # verl's CISPO example sets clip_ratio_low=10: 1 - 10 < 0 < any ratio, so a ratio of 0.25
    # (A = 1) keeps its weight 0.25 where 0.2 would clip it to 0.8; the config takes it
    old, new = torch.zeros(1, 1, dtype=torch.float64), torch.full((1, 1), math.log(0.25),
                                                                  dtype=torch.float64)
    new.requires_grad_(True)
    adv = torch.ones(1, 1, dtype=torch.float64)
    for low, weight in ((10.0, 0.25), (0.2, 0.8)):
        loss, _ = LossInputs(old, new, adv, clip_ratio_low=low).call("cispo")
        (grad,) = torch.autograd.grad(loss, new)
        assert grad.item() == pytest.approx(-weight)
    cfg = AlgorithmConfig(policy_loss="cispo", clip_ratio_low=10.0)
    assert cfg.clip_ratio_low == 10.0


@pytest.mark.parametrize("kind", ["tv", "kl"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("seed", range(6))
def test_dppo_matches_naive(kind, mode, seed):
    old, new, adv, mask = random_inputs(seed, scale=0.8, holes=True)
    new = new.clamp(max=-1e-3)  # DPPO works on probabilities: log-probs must be < 0
    lo, hi, c = (0.15, 0.15, 1.5) if kind == "tv" else (0.05, 0.05, 1.5)
    loss, m = LossInputs(old, new, adv, mask, mode, clip_ratio_low=lo,
                         clip_ratio_high=hi, clip_ratio_c=c).call(f"dppo_{kind}")
    L, O, D = naive_dppo_tokens(kind, old, new, adv, lo, hi, c)
    assert loss.item() == pytest.approx(agg_loss(L, mask, mode).item(), rel=1e-9, abs=1e-12)
    assert m["pg_clipfrac"].item() == pytest.approx(_valid_mean(O, mask), abs=1e-12)
    assert m["pg_clipfrac_lower"].item() == pytest.approx(_valid_mean(D, mask), abs=1e-12)


def test_dppo_tv_bounds_probability_change_not_ratio():
    # A rare token (p_old = 0.01) may triple (ρ = 3, far outside PPO's clip) and stay inside a
    # TV region of 0.15 (Δp = 0.02); a likely token (p_old = 0.5) moving to 0.7 (ρ = 1.4) leaves
    # it (Δp = 0.2). Gradient: -A sg[min(ρ, c)] inside, 0 outside.
    old = torch.log(torch.tensor([[0.01, 0.5]], dtype=torch.float64))
    new = torch.log(torch.tensor([[0.03, 0.7]], dtype=torch.float64)).requires_grad_(True)
    adv = torch.ones(1, 2, dtype=torch.float64)
    loss, m = LossInputs(old, new, adv, clip_ratio_low=0.15, clip_ratio_high=0.15,
                         clip_ratio_c=10.0).call("dppo_tv")
    (grad,) = torch.autograd.grad(loss, new)
    assert grad[0, 0].item() == pytest.approx(-3.0 / 2)  # token-mean over 2 tokens
    assert grad[0, 1].item() == 0.0
    assert m["pg_clipfrac"].item() == 0.5
    _, mv = LossInputs(old, new.detach(), adv).call("vanilla")
    assert mv["pg_clipfrac"].item() == 1.0  # PPO clips both (ρ = 3 and 1.4 > 1.28)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("seed", range(6))
def test_sapo_matches_naive(mode, seed):
    old, new, adv, mask = random_inputs(seed, scale=0.8, holes=True)
    opts = dataclasses.replace(OPTS, tau_pos=1.3, tau_neg=2.1)
    loss, m = LossInputs(old, new, adv, mask, mode, options=opts).call("sapo")
    L = naive_sapo_tokens(old, new, adv, 1.3, 2.1)
    assert loss.item() == pytest.approx(agg_loss(L, mask, mode).item(), rel=1e-9, abs=1e-12)
    assert m["pg_clipfrac"].item() == 0.0 and m["pg_clipfrac_lower"].item() == 0.0


def test_sapo_gate_gradient_is_one_on_policy_and_decays():
    # ∂L/∂logp = -A f'(ρ) ρ with f'(ρ) = 4 σ(τ(ρ-1)) (1 - σ(τ(ρ-1))): on-policy -A; f' decays
    # to 0 away from ρ = 1 (τ = τ_pos = 1 for A > 0)
    adv = torch.ones(1, 1, dtype=torch.float64)
    slopes = []
    for log_ratio in (0.0, 1.0, 3.0):  # ρ = 1, e, e^3 ≈ 20
        new = torch.full((1, 1), log_ratio, dtype=torch.float64, requires_grad=True)
        loss, _ = LossInputs(torch.zeros(1, 1, dtype=torch.float64), new, adv).call("sapo")
        (grad,) = torch.autograd.grad(loss, new)
        slopes.append(-grad.item() / math.exp(log_ratio))  # f'(ρ)
        sig = 1.0 / (1.0 + math.exp(-(math.exp(log_ratio) - 1.0)))
        assert slopes[-1] == pytest.approx(4 * sig * (1 - sig), rel=1e-12)
    assert slopes[0] == pytest.approx(1.0)
    assert slopes[0] > slopes[1] > slopes[2] > 0 and slopes[2] < 1e-6


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("seed", range(6))
def test_gpg_and_dro_match_naive(mode, seed):
    old, new, adv, mask = random_inputs(seed, scale=0.8, holes=True)
    loss, m = LossInputs(old, new, adv, mask, mode).call("gpg")
    assert loss.item() == pytest.approx(agg_loss(-adv * new, mask, mode).item(), rel=1e-12, abs=1e-12)
    assert m["ppo_kl"].item() == pytest.approx(_valid_mean(old - new, mask), rel=1e-9, abs=1e-12)
    beta = 0.3
    loss, _ = LossInputs(old, new, adv, mask, mode,
                         options=dataclasses.replace(OPTS, dro_beta=beta)).call("dro")
    L = _tensor([[-(n * a - 0.5 * beta * (n - o) ** 2) for o, n, a in zip(*row)]
                 for row in _rows(old, new, adv)])
    assert loss.item() == pytest.approx(agg_loss(L, mask, mode).item(), rel=1e-9, abs=1e-12)


def test_dro_gradient_and_refuses_unset_beta():
    # ∇L = -(A - β log ρ) ∇logp: A = 1, log ρ = 0.5, β = 0.4 -> -(1 - 0.2) = -0.8
    new = torch.full((1, 1), 0.5, dtype=torch.float64, requires_grad=True)
    loss, _ = LossInputs(torch.zeros(1, 1, dtype=torch.float64), new,
                         torch.ones(1, 1, dtype=torch.float64),
                         options=dataclasses.replace(OPTS, dro_beta=0.4)).call("dro")
    (grad,) = torch.autograd.grad(loss, new)
    assert grad.item() == pytest.approx(-0.8)
    with pytest.raises(ValueError, match="dro_beta"):
        LossInputs(new.detach(), new.detach(), torch.ones(1, 1),
                   options=PolicyLossOptions()).call("dro")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("seed", range(6))
def test_geo_mean_matches_naive(mode, seed):
    old, new, adv, mask = random_inputs(seed, scale=0.5, per_seq_adv=seed % 2 == 0, holes=True)
    lo, hi = 0.4, 0.4
    g = torch.Generator().manual_seed(seed)
    w = torch.rand(new.shape, generator=g, dtype=torch.float64) * 2
    for weights in (None, w):
        loss, m = LossInputs(old, new, adv, mask, mode, rollout_is_weights=weights,
                             clip_ratio_low=lo, clip_ratio_high=hi).call("geo_mean")
        seq, HC, LC = naive_geo_mean(old, new, adv, mask, lo, hi, weights)
        L = _tensor([[s] * new.shape[1] for s in seq])  # L_i on every token of response i
        assert loss.item() == pytest.approx(agg_loss(L, mask, mode).item(), rel=1e-9, abs=1e-12)
        if mode == "seq-mean-token-mean":  # GMPO's mean over responses (the non-empty ones)
            nonempty = [s for s, m_row in zip(seq, mask.tolist()) if any(m_row)]
            assert loss.item() == pytest.approx(sum(nonempty) / len(nonempty), rel=1e-9, abs=1e-12)
    assert m["pg_clipfrac"].item() == pytest.approx(_valid_mean(HC, mask), abs=1e-12)
    assert m["pg_clipfrac_lower"].item() == pytest.approx(_valid_mean(LC, mask), abs=1e-12)


def test_geo_mean_is_robust_to_one_outlier_token_where_the_arithmetic_mean_is_not():
    # GMPO's motivation: one token with a huge ratio moves the geometric mean by its log-ratio /
    # |y|, clipped in log space; here log ρ = 3 is clipped to 0.4 -> ρ̄ = exp(0.4 / 4)
    old = torch.zeros(1, 4, dtype=torch.float64)
    new = torch.tensor([[3.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    adv = torch.ones(1, 4, dtype=torch.float64)
    loss, m = LossInputs(old, new, adv, loss_agg_mode="seq-mean-token-mean", clip_ratio_low=0.4,
                         clip_ratio_high=0.4).call("geo_mean")
    assert loss.item() == pytest.approx(-math.exp(0.1))
    assert m["pg_clipfrac"].item() == 0.25


# ---------------------------------------------------------------- clip_cov / kl_cov
COV_OPTS = dataclasses.replace(OPTS, clip_cov_ratio=0.25, clip_cov_lb=-0.5, clip_cov_ub=0.8,
                               kl_cov_ratio=0.2, ppo_kl_coef=0.7)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("seed", range(8))
def test_clip_cov_matches_naive_values_and_gradients(mode, seed):
    old, new, adv, mask = random_inputs(seed, scale=0.5, holes=True)
    new.requires_grad_(True)
    loss, m = LossInputs(old, new, adv, mask, mode, options=COV_OPTS, seed=seed).call("clip_cov")
    keys = torch.rand(new.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    L, S, _ = naive_clip_cov(old, new.detach(), adv, mask, 0.2, 0.28, 0.25, -0.5, 0.8, keys)
    assert loss.item() == pytest.approx(agg_loss(L, mask, mode).item(), rel=1e-9, abs=1e-12)
    assert m["pg_clipfrac"].item() == pytest.approx(_valid_mean(S, mask), abs=1e-12)
    # gradient: a selected token has none; every other token PPO's (no dual-clip)
    (grad,) = torch.autograd.grad(loss, new)
    ratio = torch.exp(new - old)
    ppo = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.28))
    (expected,) = torch.autograd.grad(agg_loss(ppo * (1 - S), mask, mode), new)
    assert torch.allclose(grad, expected, rtol=1e-10, atol=1e-14)
    assert (grad[S.bool()] == 0).all()


def test_clip_cov_selects_a_uniform_random_subset_of_the_candidates():
    old, new, adv, mask = random_inputs(5, scale=0.3)
    opts = dataclasses.replace(OPTS, clip_cov_ratio=0.1, clip_cov_lb=-1e9, clip_cov_ub=1e9)
    keys = torch.rand(new.shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    _, _, n_cand = naive_clip_cov(old, new, adv, mask, 0.2, 0.28, 0.1, -1e9, 1e9, keys)
    n_valid = int(mask.sum())
    clip_num = max(int(0.1 * n_valid), 1)
    assert 1 <= clip_num < n_cand
    counts = torch.zeros_like(new)
    draws = 400
    for s in range(draws):
        loss, m = LossInputs(old, new, adv, mask, options=opts, seed=s).call("clip_cov")
        assert m["pg_clipfrac"].item() * n_valid == pytest.approx(clip_num)  # exactly clip_num
        keys = torch.rand(new.shape, generator=torch.Generator().manual_seed(s), dtype=torch.float64)
        L, S, _ = naive_clip_cov(old, new, adv, mask, 0.2, 0.28, 0.1, -1e9, 1e9, keys)
        assert loss.item() == pytest.approx(agg_loss(L, mask, "token-mean").item(), rel=1e-9)
        counts += S
    freq = counts[counts > 0] / draws
    p = clip_num / n_cand  # each candidate's chance
    assert (counts > 0).sum().item() == n_cand  # every candidate gets picked sometimes
    assert (freq - p).abs().max().item() < 5 * math.sqrt(p * (1 - p) / draws)


def test_clip_cov_never_selects_ppo_clipped_or_out_of_bounds_tokens():
    # token 0: ρ = 2, A = 1 -> PPO-clipped; the others on-policy. Covariances (A centred, logp
    # centred) decide the rest; with bounds (lb, ub) excluding all of them nothing is selected.
    old = torch.zeros(1, 4, dtype=torch.float64)
    new = torch.tensor([[math.log(2.0), -1.0, -2.0, -3.0]], dtype=torch.float64)
    old[0, 1:] = new[0, 1:]
    adv = torch.tensor([[1.0, 2.0, -1.0, 0.5]], dtype=torch.float64)
    opts = dataclasses.replace(OPTS, clip_cov_ratio=1.0, clip_cov_lb=-1e9, clip_cov_ub=1e9)
    case = LossInputs(old, new, adv, options=opts)
    _, m = case.call("clip_cov")
    assert m["pg_clipfrac"].item() == 0.75  # all but the clipped token
    opts = dataclasses.replace(opts, clip_cov_lb=1e8)
    _, m = dataclasses.replace(case, options=opts).call("clip_cov")
    assert m["pg_clipfrac"].item() == 0.0


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("seed", range(8))
def test_kl_cov_matches_naive_values_and_gradients(mode, seed):
    old, new, adv, mask = random_inputs(seed, scale=0.5, holes=True)
    new.requires_grad_(True)
    loss, m = LossInputs(old, new, adv, mask, mode, options=COV_OPTS).call("kl_cov")
    L, S = naive_kl_cov(old, new.detach(), adv, mask, 0.2, 0.7)
    assert loss.item() == pytest.approx(agg_loss(L, mask, mode).item(), rel=1e-9, abs=1e-12)
    assert m["pg_clipfrac"].item() == 0.0
    # gradient: -A ρ on every token, plus β sign(log ρ) on the selected ones
    (grad,) = torch.autograd.grad(loss, new)
    log_ratio = new - old
    (expected,) = torch.autograd.grad(
        agg_loss(-adv * torch.exp(log_ratio) + 0.7 * log_ratio.abs() * S, mask, mode), new)
    assert torch.allclose(grad, expected, rtol=1e-10, atol=1e-14)


def test_kl_cov_breaks_ties_by_position():
    # Every valid token has the same covariance: A = ±1 alternating by row with logp = ∓1, so
    # C_t = 1 for all. k = 0.4 of 5 valid tokens = 2: the first two valid tokens in row-major
    # order (the hole at (0, 1) is skipped) get the penalty.
    adv = torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]], dtype=torch.float64)
    new = torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 0.0, 1.0], [1.0, 1.0, 1.0]])
    old = new - 0.5  # log ρ = 0.5 everywhere
    opts = dataclasses.replace(OPTS, kl_cov_ratio=0.4, ppo_kl_coef=1.0)
    loss, _ = LossInputs(old, new, adv, mask, "token-sum", options=opts).call("kl_cov")
    L, S = naive_kl_cov(old, new, adv, mask, 0.4, 1.0)
    assert S.tolist() == [[1.0, 0.0, 1.0], [0.0, 0.0, 0.0]]
    # token-sum: Σ -A ρ over 5 tokens (2 with A = 1, 3 with A = -1) + 2 · 0.5
    assert loss.item() == pytest.approx(-2 * math.exp(0.5) + 3 * math.exp(0.5) + 1.0)
    assert loss.item() == pytest.approx(agg_loss(L, mask, "token-sum").item())


def test_cov_losses_select_at_least_one_token_and_none_without_tokens():
    old, new, adv, mask = random_inputs(1, scale=0.5)
    # ratio 1e-6 of a handful of tokens floors to 0, raised to 1
    opts = dataclasses.replace(OPTS, kl_cov_ratio=1e-6, clip_cov_ratio=1e-6, clip_cov_lb=-1e9,
                               clip_cov_ub=1e9)
    L, S = naive_kl_cov(old, new, adv, mask, 1e-6, 0.1)
    assert S.sum().item() == 1.0
    loss, _ = LossInputs(old, new, adv, mask, "token-sum",
                         options=dataclasses.replace(opts, ppo_kl_coef=0.1)).call("kl_cov")
    assert loss.item() == pytest.approx(agg_loss(L, mask, "token-sum").item(), rel=1e-12)
    _, m = LossInputs(old, new, adv, mask, options=opts).call("clip_cov")
    assert m["pg_clipfrac"].item() * mask.sum().item() == pytest.approx(1.0)
    empty = torch.zeros_like(mask)
    for name in ("clip_cov", "kl_cov"):
        loss, m = LossInputs(old, new, adv, empty, options=opts).call(name)
        assert loss.item() == 0.0 and m["pg_clipfrac"].item() == 0.0


# ---------------------------------------------------------------- bypass_mode
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("seed", range(4))
def test_bypass_ppo_clip_is_vanilla_against_the_rollout_logprobs(mode, seed):
    rollout, new, adv, mask = random_inputs(seed, scale=1.0, holes=True)
    new.requires_grad_(True)
    w = torch.rand(new.shape, dtype=torch.float64)  # ignored by bypass_mode
    case = LossInputs(rollout, new, adv, mask, mode)
    lb, mb = dataclasses.replace(case, rollout_is_weights=w).call("bypass_mode")
    lv, mv = case.call("vanilla")
    assert lb.item() == lv.item() and {k: v.item() for k, v in mb.items()} == \
        {k: v.item() for k, v in mv.items()}
    assert torch.equal(torch.autograd.grad(lb, new)[0], torch.autograd.grad(lv, new)[0])
    assert POLICY_LOSSES.traits("bypass_mode").old_logp_from_rollout
    assert not any(POLICY_LOSSES.traits(n).old_logp_from_rollout
                   for n in POLICY_LOSSES.names() if n != "bypass_mode")


@pytest.mark.parametrize("level", ["", "token", "sequence"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("seed", range(4))
def test_bypass_reinforce_matches_naive(level, mode, seed):
    rollout, new, adv, mask = random_inputs(seed, scale=0.4, holes=True)
    new.requires_grad_(True)
    opts = dataclasses.replace(OPTS, bypass_loss_type="reinforce", rollout_is=level,
                               rollout_is_threshold=1.3)
    loss, m = LossInputs(rollout, new, adv, mask, mode, options=opts).call("bypass_mode")
    # naive: w = min(exp(log ρ), 1.3) per token, or per response with log ρ summed; detached
    W = []
    for r_row, n_row, m_row in _rows(rollout, new.detach(), mask):
        seq = sum((n - r) * m for n, r, m in zip(n_row, r_row, m_row))
        W.append([0.0 if not m else 1.0 if not level else
                  min(math.exp(n - r if level == "token" else seq), 1.3)
                  for n, r, m in zip(n_row, r_row, m_row)])
    W = _tensor(W)
    L = -adv * new.detach() * (W if level else 1.0)
    assert loss.item() == pytest.approx(agg_loss(L, mask, mode).item(), rel=1e-9, abs=1e-12)
    (grad,) = torch.autograd.grad(loss, new)
    (expected,) = torch.autograd.grad(agg_loss(-adv * new * (W if level else 1.0), mask, mode), new)
    assert torch.allclose(grad, expected, rtol=1e-10, atol=1e-14)  # the weights carry no gradient
    assert m["ppo_kl"].item() == pytest.approx(_valid_mean(rollout - new.detach(), mask), rel=1e-9)
    with pytest.raises(ValueError, match="bypass_loss_type"):
        LossInputs(rollout, new, adv, mask,
                   options=dataclasses.replace(opts, bypass_loss_type="dpo")).call("bypass_mode")


# ---------------------------------------------------------------- options every loss honours
TOKEN_LEVEL = sorted(set(POLICY_LOSSES.names()) - {"geo_mean", "bypass_mode"})


@pytest.mark.parametrize("name", TOKEN_LEVEL)
@pytest.mark.parametrize("mode", MODES)
def test_rollout_is_weights_multiply_each_token_loss(name, mode):
    # L_t read back one token at a time (token-sum with a one-hot weight), then the weighted loss
    # must be agg(L · w). The covariance selections do not depend on the weights.
    old, new, adv, mask = random_inputs(7, scale=0.5, holes=True)
    opts = COV_OPTS
    N, T = new.shape
    L = torch.zeros(N, T, dtype=torch.float64)
    case = LossInputs(old, new, adv, mask, mode, options=opts)
    token_sum = dataclasses.replace(case, loss_agg_mode="token-sum")
    for i in range(N):
        for t in range(T):
            e = torch.zeros(N, T, dtype=torch.float64)
            e[i, t] = 1.0
            L[i, t] = dataclasses.replace(token_sum, rollout_is_weights=e).call(name)[0]
    w = torch.rand(N, T, generator=torch.Generator().manual_seed(1), dtype=torch.float64) * 2
    loss, _ = dataclasses.replace(case, rollout_is_weights=w).call(name)
    assert loss.item() == pytest.approx(agg_loss(L * w, mask, mode).item(), rel=1e-9, abs=1e-12)
    unweighted, _ = case.call(name)
    assert unweighted.item() == pytest.approx(agg_loss(L, mask, mode).item(), rel=1e-9, abs=1e-12)
    with pytest.raises(ValueError, match="rollout_is_weights"):
        dataclasses.replace(case, rollout_is_weights=w[:, :1]).call(name)


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES.names()))
def test_loss_scale_factor_divides_seq_mean_token_sum(name):
    old, new, adv, mask = random_inputs(4, scale=0.5, holes=True)
    case = LossInputs(old, new, adv, mask, "seq-mean-token-sum", options=COV_OPTS)
    base, _ = case.call(name)
    for scale, divisor in ((None, new.shape[1]), (6.5, 6.5)):
        normed, _ = dataclasses.replace(case, loss_agg_mode="seq-mean-token-sum-norm",
                                        loss_scale_factor=scale).call(name)
        assert normed.item() == pytest.approx(base.item() / divisor, rel=1e-12, abs=1e-15)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("seed", range(3))
def test_on_policy_every_loss_has_the_reinforce_gradient(mode, seed):
    # At ρ = 1 (logp = old_logp), with one advantage per response, every loss's gradient is the
    # policy gradient -A ∇logp aggregated by the mode: PPO, GSPO, CISPO, DPPO (inside the region),
    # SAPO (f'(1) = 1), GPG, DRO (log ρ = 0), GMPO (ρ̄ = 1, Ā = A), Clip-Cov with no candidate,
    # KL-Cov (|log ρ|'s gradient at 0 is 0), bypass (w = 1).
    _, new, adv, mask = random_inputs(seed, per_seq_adv=True, holes=True)
    new.requires_grad_(True)
    old = new.detach().clone()
    (reinforce,) = torch.autograd.grad(agg_loss(-adv * new, mask, mode), new)
    opts = dataclasses.replace(COV_OPTS, clip_cov_lb=1e8, clip_cov_ub=1e9)
    for name in sorted(POLICY_LOSSES.names()):
        for bypass in ("ppo_clip", "reinforce"):
            o = dataclasses.replace(opts, bypass_loss_type=bypass, rollout_is="token")
            loss, m = LossInputs(old, new, adv, mask, mode, options=o).call(name)
            (grad,) = torch.autograd.grad(loss, new)
            assert torch.allclose(grad, reinforce, rtol=1e-10, atol=1e-14), (name, bypass)
            assert m["ppo_kl"].item() == 0.0
