"""The PPO update on the real tiny model: accumulation, determinism, direction of the update."""
import copy
import dataclasses
import math

import pytest
import torch

from verl_core.algorithms import POLICY_LOSSES, PolicyLossOptions, micro_batch_weight
from verl_core.config import AlgorithmConfig, OptimConfig
from verl_core.data.batch import Batch
from verl_core.models import build_tiny_model
from verl_core.rollout import SamplingParams, make_engine
from verl_core.training.forward import batched_logprobs
from verl_core.training.optim import lr_factor, make_optimizer, make_scheduler
from verl_core.training import ppo as ppo_module
from verl_core.training.ppo import UpdateOptions, loss_options, ppo_update


def _rollout(seed=0, n_prompts=4, G=4, max_new_tokens=4):
    model, tok = build_tiny_model(seed=seed)
    enc = tok([f"{i}+{i}=" for i in range(n_prompts)], return_tensors="pt", padding=True)
    ids = enc.input_ids.repeat_interleave(G, 0)
    mask = enc.attention_mask.repeat_interleave(G, 0)
    eng = make_engine("hf", model=model, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    out = eng.generate(ids, mask, SamplingParams(temperature=1.0, max_new_tokens=max_new_tokens,
                                                  seed=seed))
    N = ids.shape[0]
    g = torch.Generator().manual_seed(seed)
    adv = torch.randn(N, 1, generator=g).expand(N, out.response_ids.shape[1]) * out.response_mask
    batch = Batch(prompt_ids=ids, prompt_mask=mask, response_ids=out.response_ids,
                  response_mask=out.response_mask, response_logprobs=out.logprobs,
                  group=torch.arange(n_prompts).repeat_interleave(G), uid=[str(i) for i in range(N)],
                  ground_truth=["0"] * N, data_source=["s"] * N, extra_info=[{}] * N,
                  advantages=adv.contiguous())
    return model, batch


def _run(model, batch, micro, seed=0, epochs=1, algo=None, sched_out=None):
    cfg = OptimConfig(lr=1e-2, warmup_steps=0)
    opt = make_optimizer(model.parameters(), cfg, cfg.lr)
    sched = make_scheduler(opt, cfg, 10)
    m = ppo_update(model, opt, sched, batch,
                   UpdateOptions(algo=algo or AlgorithmConfig(), temperature=1.0,
                                 mini_batch_rows=16, micro_batch_rows=micro, epochs=epochs,
                                 grad_clip=1e9),
                   seed=seed)
    if sched_out is not None:
        sched_out.append(sched)
    return m


def _grads_at_each_step(model, batch, *, mini, micro, mode="token-mean", algo=None,
                        metrics_out=None):
    """Run ``ppo_update`` and return the gradient each optimizer step received, one dict per step,
    read by a step pre-hook (after clipping, which grad_clip=1e9 makes a multiplication by 1).
    SGD at lr 0 leaves the weights as they were, so every step sees the same point."""
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    grads = []
    opt.register_step_pre_hook(lambda *_: grads.append(
        {n: p.grad.detach().clone() for n, p in model.named_parameters()}))
    m = ppo_update(model, opt, sched, batch,
                   UpdateOptions(algo=algo or AlgorithmConfig(loss_agg_mode=mode), temperature=1.0,
                                 mini_batch_rows=mini, micro_batch_rows=micro, epochs=1,
                                 grad_clip=1e9),
                   seed=0)
    if metrics_out is not None:
        metrics_out.append(m)
    return grads


def _ragged(batch):
    """The same batch with responses cut to 1..T tokens (and one row with none): micro-batches
    then hold different numbers of tokens and of non-empty rows."""
    T = batch.response_ids.shape[1]
    keep = torch.tensor([(3 * i) % (T + 1) for i in range(batch.num_rows)])  # (N,) in 0..T
    mask = batch.response_mask * (torch.arange(T)[None, :] < keep[:, None])
    return batch.replace(response_mask=mask, advantages=batch.advantages * mask)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                                  "seq-mean-token-sum-norm", "token-sum"])
@pytest.mark.parametrize("ragged", [False, True])
def test_micro_batch_accumulation_matches_one_big_batch(mode, ragged):
    model, batch = _rollout()
    if ragged:
        batch = _ragged(batch)
        assert len(set(batch.response_mask.sum(-1).tolist())) > 2
    _assert_split_invariant(model, batch, AlgorithmConfig(loss_agg_mode=mode))


def _off_policy(batch, seed=0):
    """The batch with its rollout log-probs moved off the trainer's (noise on valid tokens), so
    rollout IS weights and bypass mode see a real mismatch."""
    g = torch.Generator().manual_seed(seed)
    noise = 0.3 * torch.randn(batch.response_logprobs.shape, generator=g)
    return batch.replace(response_logprobs=batch.response_logprobs + noise * batch.response_mask)


@pytest.mark.parametrize("algo_kw", [
    dict(policy_loss="gspo"), dict(policy_loss="cispo"), dict(policy_loss="dppo_tv"),
    dict(policy_loss="dppo_kl"), dict(policy_loss="sapo"), dict(policy_loss="geo_mean"),
    dict(policy_loss="gpg"), dict(policy_loss="dro", dro_beta=0.1),
    dict(policy_loss="bypass_mode"),
    dict(policy_loss="bypass_mode", bypass_loss_type="reinforce", rollout_is="token"),
    dict(policy_loss="vanilla", rollout_is="token", rollout_is_threshold=1.2),
    dict(policy_loss="vanilla", rollout_is="sequence", rollout_is_threshold_lower=0.5,
         rollout_is_batch_normalize=True),
], ids=lambda kw: "-".join(str(v) for v in kw.values()))
def test_new_losses_and_rollout_weights_do_not_depend_on_the_split(algo_kw):
    # geo_mean, sapo and gspo honour loss_agg_mode (verl fixes their aggregation), which is what
    # keeps them split-invariant under the mode's micro-batch weights; the rollout IS weights are
    # computed once for the whole batch. (clip_cov and kl_cov select tokens per micro-batch, as
    # verl does, and are not split-invariant by design.)
    model, batch = _rollout()
    batch = _off_policy(_ragged(batch))
    _assert_split_invariant(model, batch, AlgorithmConfig(loss_agg_mode="token-mean", **algo_kw))


def _assert_split_invariant(model, batch, algo):
    mode = algo.loss_agg_mode
    N = batch.num_rows
    [one] = _grads_at_each_step(copy.deepcopy(model), batch, mini=N, micro=N, algo=algo)
    rows = _grads_at_each_step(copy.deepcopy(model), batch, mini=1, micro=1, algo=algo)
    assert len(rows) == N  # one step per row: step k is row order[k]'s gradient of its own loss
    # ppo_update visits the rows in the epoch's shuffled order (torch.randperm from seed=0)
    order = torch.randperm(N, generator=torch.Generator().manual_seed(0)).tolist()
    # step k's row weight in the mini-batch loss (its share of the tokens, or of the non-empty rows)
    w = [float(micro_batch_weight(batch.response_mask[i:i + 1], batch.response_mask, mode))
         for i in order]

    # The tolerance comes from the arithmetic, not from what passed on one CPU. Both runs compute
    # g = Σ_i w_i·g_i, the rows' contributions weighted by their share of the loss's denominator,
    # grouped differently: one backward over N rows, or N/micro backwards summed into .grad. The
    # kernels also see other batch shapes, so the reductions inside them may run in other orders.
    # A float32 sum of n terms in any order is within γ_{n-1}·Σ|x| ≈ n·u·Σ|x| of the exact sum,
    # u = 2^-24 (Higham, Accuracy and Stability of Numerical Algorithms, 2nd ed., §4.2), so two
    # orders differ by at most 2·n·u·Σ|x|. n: the longest reduction producing g, i.e. the sum over
    # the N·L token positions in a weight gradient or a dot product over the hidden, intermediate
    # or vocabulary size. Σ|x|, not |Σx|, sets the scale: where rows of opposite advantage cancel,
    # g is near zero but its rounding error is not. (The old test compared weights after one AdamW
    # step, ≈ lr·sign(g), which turned a last-bit difference in a near-zero g into one of order
    # lr.) Σ|x| is taken elementwise at the level the runs regroup: S = Σ_i w_i·|g_i|, from the
    # rows' gradients measured one at a time. The bound does not follow rounding inside a row's
    # forward and backward through the layers; the margin covers it (on the CPU this was written
    # on, the largest difference was ~26·u·S, against 2·n·u·S = 512·u·S). The micro-batch weights
    # themselves (ratios of integer counts) add one rounding per term, within the same bound.
    u = torch.finfo(torch.float32).eps / 2
    cfg = model.config
    L = batch.prompt_ids.shape[1] + batch.response_ids.shape[1]
    n = max(N * L, cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size)
    for micro in (1, 4):
        [acc] = _grads_at_each_step(copy.deepcopy(model), batch, mini=N, micro=micro, algo=algo)
        for name, g in one.items():
            S = sum(wi * r[name].abs() for wi, r in zip(w, rows))
            diff = (acc[name] - g).abs()
            assert bool((diff <= 2 * n * u * S).all()), (micro, name, float(diff.max()))


def test_update_is_deterministic_given_seed():
    model, batch = _rollout()
    a, b = copy.deepcopy(model), copy.deepcopy(model)
    ma = _run(a, batch, micro=8, epochs=2)
    mb = _run(b, batch, micro=8, epochs=2)
    assert ma == mb
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)


def test_update_raises_logprob_of_positive_advantage_responses():
    model, batch = _rollout()
    before = batched_logprobs(model, batch, 1.0, 16).sum(-1)
    _run(model, batch, micro=16)
    after = batched_logprobs(model, batch, 1.0, 16).sum(-1)
    adv = batch.advantages[:, 0]
    # the policy gradient moves sequence log-probs in the direction of their advantage
    corr = torch.corrcoef(torch.stack([after - before, adv]))[0, 1]
    assert corr > 0.5


def test_metrics_are_reported():
    model, batch = _rollout()
    m = _run(model, batch, micro=8, algo=AlgorithmConfig(entropy_coeff=0.01))
    for k in ("actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/entropy",
              "actor/grad_norm", "actor/lr"):
        assert k in m and m[k] == m[k]  # present and not NaN
    # on-policy first mini-batch: ratio is 1 so nothing is clipped before the first step
    assert m["actor/ppo_kl"] < 1e-2


def test_nonfinite_gradient_skips_the_step():
    model, batch = _rollout()
    bad = batch.replace(advantages=batch.advantages * float("nan"))
    before = [p.detach().clone() for p in model.parameters()]
    scheds = []
    m = _run(model, bad, micro=16, sched_out=scheds)
    assert m["update/skipped_nonfinite_steps"] == 1.0
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert scheds[0].last_epoch == 0  # the LR schedule counts applied steps only


@pytest.mark.parametrize("schedule", ["constant", "cosine"])
def test_lr_schedule_warmup_then_schedule(schedule):
    f = [lr_factor(s, warmup_steps=4, total_steps=20, schedule=schedule, min_lr_ratio=0.1)
         for s in range(21)]
    assert f[:4] == [0.25, 0.5, 0.75, 1.0]  # linear warmup (s + 1) / 4
    if schedule == "constant":
        assert set(f[4:]) == {1.0}
    else:
        assert f[4] == pytest.approx(1.0) and f[20] == pytest.approx(0.1)
        assert all(x >= y for x, y in zip(f[4:], f[5:]))


@pytest.mark.parametrize("schedule", ["constant", "cosine"])
def test_lr_schedule_in_rl_steps_holds_within_an_rl_step(schedule):
    # verl steps its scheduler once per RL step: with 3 optimizer steps per RL step, the LR of
    # optimizer step s is the optimizer-step schedule's at RL step s // 3
    cfg = OptimConfig(lr=1.0, warmup_steps=2, lr_schedule=schedule, min_lr_ratio=0.1,
                      lr_schedule_unit="rl_step")
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=cfg.lr)
    sched = make_scheduler(opt, cfg, 5 * 3, per_rl_step=3)
    lrs = []
    for _ in range(15):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    want = [lr_factor(s // 3, warmup_steps=2, total_steps=5, schedule=schedule, min_lr_ratio=0.1)
            for s in range(15)]
    assert lrs == pytest.approx(want, rel=0, abs=1e-15)
    assert lrs[:6] == pytest.approx([0.5] * 3 + [1.0] * 3)  # two RL steps of warmup


# ---------------------------------------------------------------- policy-loss options plumbing
def test_loss_options_carry_every_config_field_with_verls_defaults():
    algo = AlgorithmConfig()
    assert loss_options(algo) == PolicyLossOptions()  # the config's defaults are the losses'
    names = [f.name for f in dataclasses.fields(PolicyLossOptions)]
    changed = AlgorithmConfig(policy_loss="dro", dro_beta=0.2, tau_neg=2.0, clip_cov_ratio=0.5,
                              rollout_is="sequence", bypass_loss_type="reinforce")
    opts = loss_options(changed)
    for n in names:
        assert getattr(opts, n) == getattr(changed, n), n


def test_rollout_is_weights_scale_the_gradient():
    # rollout log-probs = the trainer's - log 2 on every valid token: w = exp(log 2) = 2 (under a
    # threshold of 10), so the vanilla gradient doubles; the metrics report the weights.
    model, batch = _rollout()
    N = batch.num_rows
    old = batched_logprobs(model, batch, 1.0, N)
    halved = batch.replace(response_logprobs=(old - math.log(2.0)) * batch.response_mask)
    [base] = _grads_at_each_step(copy.deepcopy(model), halved, mini=N, micro=N)
    metrics = []
    algo = AlgorithmConfig(rollout_is="token", rollout_is_threshold=10.0)
    [weighted] = _grads_at_each_step(copy.deepcopy(model), halved, mini=N, micro=N, algo=algo,
                                     metrics_out=metrics)
    for name, g in base.items():
        assert torch.allclose(weighted[name], 2.0 * g, rtol=1e-4, atol=1e-7), name
    assert metrics[0]["rollout_corr/rollout_is_mean"] == pytest.approx(2.0, rel=1e-5)
    assert metrics[0]["rollout_corr/kl"] == pytest.approx(-math.log(2.0), rel=1e-5)
    assert metrics[0]["rollout_corr/rollout_is_ratio_fraction_high"] == 0.0
    # truncated at 1.5: the gradient is 1.5 times the base one
    algo = AlgorithmConfig(rollout_is="token", rollout_is_threshold=1.5)
    [truncated] = _grads_at_each_step(copy.deepcopy(model), halved, mini=N, micro=N, algo=algo)
    for name, g in base.items():
        assert torch.allclose(truncated[name], 1.5 * g, rtol=1e-4, atol=1e-7), name


def test_bypass_mode_takes_the_rollout_logprobs_without_recomputing(monkeypatch):
    model, batch = _rollout()
    N = batch.num_rows
    # with rollout log-probs equal to the trainer's, bypass (ppo_clip) is vanilla bit for bit
    same = batch.replace(response_logprobs=batched_logprobs(model, batch, 1.0, N))
    [vanilla] = _grads_at_each_step(copy.deepcopy(model), same, mini=N, micro=N)

    def no_recompute(*args, **kwargs):
        raise AssertionError("bypass_mode must not recompute the old log-probs")

    monkeypatch.setattr(ppo_module, "batched_logprobs", no_recompute)
    bypass = AlgorithmConfig(policy_loss="bypass_mode")
    [got] = _grads_at_each_step(copy.deepcopy(model), same, mini=N, micro=N, algo=bypass)
    assert all(torch.equal(got[n], g) for n, g in vanilla.items())
    # and it follows the rollout log-probs when they differ
    [moved] = _grads_at_each_step(copy.deepcopy(model), _off_policy(same), mini=N, micro=N,
                                  algo=bypass)
    assert any(not torch.equal(moved[n], g) for n, g in vanilla.items())


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES.names()))
def test_every_policy_loss_trains_deterministically(name):
    model, batch = _rollout()
    batch = _off_policy(batch)
    algo = AlgorithmConfig(policy_loss=name, dro_beta=0.1, clip_cov_ratio=0.2, clip_cov_lb=-1e3,
                           clip_cov_ub=1e3, kl_cov_ratio=0.2, loss_agg_mode="seq-mean-token-sum-norm",
                           loss_scale_factor=4.0, use_kl_loss=True, kl_loss_type="k3+",
                           entropy_coeff=0.01)
    batch = batch.replace(ref_logprobs=batch.response_logprobs)
    a, b = copy.deepcopy(model), copy.deepcopy(model)
    ma = _run(a, batch, micro=4, epochs=2, algo=algo)
    mb = _run(b, batch, micro=4, epochs=2, algo=algo)
    assert ma == mb and all(v == v for v in ma.values())  # equal (clip_cov's draws seeded), no NaN
    assert ma["update/skipped_nonfinite_steps"] == 0.0
    assert all(torch.equal(pa, pb) for pa, pb in zip(a.parameters(), b.parameters()))
    assert any(not torch.equal(pa, p0) for pa, p0 in zip(a.parameters(), model.parameters()))


# ---------------------------------------------------------------- exactly on-policy: one forward
def test_on_policy_update_skips_the_old_logp_forward_and_matches_the_recomputed_one(monkeypatch):
    model, batch = _rollout()
    N, T = batch.response_ids.shape
    algo, seed, lr = AlgorithmConfig(), 0, 1e-2  # vanilla PPO-clip, token-mean

    def update(m, shortcut):
        # SGD: the weights move by lr * g, so a gradient difference shows up unamplified
        # (one AdamW step is lr * g / (|g| + eps): a last-bit change of a near-zero g moves a
        # weight by up to lr)
        opt = torch.optim.SGD(m.parameters(), lr=lr)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
        ppo_update(m, opt, sched, batch,
                   UpdateOptions(algo=algo, temperature=1.0, mini_batch_rows=N, micro_batch_rows=N,
                                 epochs=1, grad_clip=1e9, on_policy_shortcut=shortcut),
                   seed=seed)
        return m

    recomputed = update(copy.deepcopy(model), False)
    forwards = []
    monkeypatch.setattr(ppo_module, "batched_logprobs",
                        lambda *a, **k: forwards.append(1) or batched_logprobs(*a, **k))
    short = update(copy.deepcopy(model), True)
    assert forwards == []  # the old-log-prob forward was skipped

    # Both runs do the same forward, backward and step on the same rows in the same order; they
    # differ only in old_logp. The shortcut's ratio is exp(logp - logp.detach()) = exp(0) = 1
    # exactly; the recomputed path's is r = exp(e), e = logp - old_logp the difference between
    # the update's forward and the eval-mode forward over another batch shape (zero where the
    # kernels round the same). At r near 1 PPO-clip's loss is -A·r (no clip is active), so each
    # token's gradient term c = -(1/n_tok)·A·∇logp is scaled by r: |Δg| <= max|r - 1|·S with
    # S = Σ_tok |c| elementwise, plus the rounding of two sums of n terms in the same order but
    # with different terms (<= 2·n·u·S, Higham §4.2, as above). SGD's weights differ by lr·|Δg|
    # plus one rounding each of θ - lr·g (2·u·|θ'|).
    m = copy.deepcopy(model)
    old = batched_logprobs(m, batch, 1.0, N)
    order = torch.randperm(N, generator=torch.Generator().manual_seed(seed))  # ppo_update's
    mb = batch.select(order)
    m.train()
    logp, _ = ppo_module.response_logprobs(m, mb.prompt_ids, mb.prompt_mask, mb.response_ids,
                                           mb.response_mask, 1.0)
    r_dev = float((torch.exp((logp - old[order]).detach()) - 1).abs().max())
    if r_dev == 0.0:  # the forwards agree bit for bit: the two updates are the same arithmetic
        for (name, a), b in zip(short.named_parameters(), recomputed.parameters()):
            assert torch.equal(a, b), name
        return
    mask = mb.response_mask
    n_tok = float(mask.sum())
    params = [p for p in m.parameters()]
    S = [torch.zeros_like(p) for p in params]
    for i, t in mask.nonzero().tolist():
        grads = torch.autograd.grad(logp[i, t], params, retain_graph=True)
        for s_, g in zip(S, grads):
            s_ += abs(float(mb.advantages[i, t])) / n_tok * g.abs()
    u = torch.finfo(torch.float32).eps / 2
    cfg = model.config
    n = max(N * (batch.prompt_ids.shape[1] + T), cfg.hidden_size, cfg.intermediate_size,
            cfg.vocab_size)
    for (name, a), b, s_ in zip(short.named_parameters(), recomputed.parameters(), S):
        bound = lr * (r_dev + 2 * n * u) * s_ + 2 * u * a.abs()
        assert bool(((a - b).abs() <= bound).all()), name


@pytest.mark.parametrize("kw, on_policy", [
    (dict(), True),
    (dict(epochs=2), False),                         # epoch 2 runs after a step
    (dict(mini_batch_rows=8), False),                # mini-batch 2 runs after a step
    (dict(algo=AlgorithmConfig(rollout_is="token")), False),  # IS weights need old_logp first
    (dict(dropout=0.1), False),                      # train-mode forward is noisy
])
def test_old_logp_forward_is_skipped_only_when_exactly_on_policy(monkeypatch, kw, on_policy):
    model, batch = _rollout()
    if "dropout" in kw:
        model.config.attention_dropout = kw["dropout"]
    forwards = []
    monkeypatch.setattr(ppo_module, "batched_logprobs",
                        lambda *a, **k: forwards.append(1) or batched_logprobs(*a, **k))
    cfg = OptimConfig(lr=1e-2, warmup_steps=0)
    opt = make_optimizer(model.parameters(), cfg, cfg.lr)
    ppo_update(model, opt, make_scheduler(opt, cfg, 10), batch,
               UpdateOptions(algo=kw.get("algo", AlgorithmConfig()), temperature=1.0,
                             mini_batch_rows=kw.get("mini_batch_rows", batch.num_rows),
                             micro_batch_rows=4, epochs=kw.get("epochs", 1), grad_clip=1e9),
               seed=0)
    assert (forwards == []) == on_policy


def test_optimizer_is_fused_adamw_and_loads_a_for_loop_adamw_state():
    model, batch = _rollout()
    cfg = OptimConfig(lr=1e-2, warmup_steps=0)
    opt = make_optimizer(model.parameters(), cfg, cfg.lr)
    assert all(g["fused"] is True for g in opt.param_groups)  # CPU has torch's fused kernel
    # a checkpoint written by the for-loop AdamW (before the fused one) resumes to the same step
    a, b = copy.deepcopy(model), copy.deepcopy(model)
    plain = torch.optim.AdamW(a.parameters(), lr=1e-2, betas=(0.9, 0.99), foreach=False)
    for p in a.parameters():
        p.grad = torch.ones_like(p)
    plain.step()
    fused = make_optimizer(b.parameters(), cfg, cfg.lr)
    fused.load_state_dict(plain.state_dict())
    assert all(g["fused"] is True for g in fused.param_groups)  # still the fused kernel
    got, want = fused.state_dict()["state"], plain.state_dict()["state"]
    assert got.keys() == want.keys()
    for k in want:
        assert all(torch.equal(got[k][n], want[k][n]) for n in ("step", "exp_avg", "exp_avg_sq"))


def test_run_header_counts_the_optimizer_steps_of_an_rl_step():
    from verl_core.config import grpo_preset
    from verl_core.training.optim import optimizer_steps_line
    # 64 prompts / mini-batches of 32 prompts x 1 epoch = 2 steps (the defaults)
    assert optimizer_steps_line(grpo_preset()) == (
        "2 optimizer steps per RL step (data.train_batch_size 64 / actor.ppo_mini_batch_size 32 "
        "x actor.ppo_epochs 1)")
    one = grpo_preset(**{"data.train_batch_size": 32, "actor.ppo_mini_batch_size": 32})
    assert optimizer_steps_line(one).startswith("1 optimizer step per RL step")
