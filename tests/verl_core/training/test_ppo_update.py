"""The PPO update on the real tiny model: accumulation, determinism, direction of the update."""
import copy

import pytest
import torch

from verl_core.algorithms import micro_batch_weight
from verl_core.config import AlgorithmConfig, OptimConfig
from verl_core.data.batch import Batch
from verl_core.models import build_tiny_model
from verl_core.rollout import SamplingParams, make_engine
from verl_core.training.forward import batched_logprobs
from verl_core.training.optim import lr_factor, make_optimizer, make_scheduler
from verl_core.training.ppo import ppo_update


def _rollout(seed=0, n_prompts=4, G=4):
    model, tok = build_tiny_model(seed=seed)
    enc = tok([f"{i}+{i}=" for i in range(n_prompts)], return_tensors="pt", padding=True)
    ids = enc.input_ids.repeat_interleave(G, 0)
    mask = enc.attention_mask.repeat_interleave(G, 0)
    eng = make_engine("hf", model=model, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    out = eng.generate(ids, mask, SamplingParams(temperature=1.0, max_new_tokens=4, seed=seed))
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
    m = ppo_update(model, opt, sched, batch, algo or AlgorithmConfig(), temperature=1.0,
                   mini_batch_rows=16, micro_batch_rows=micro, epochs=epochs, grad_clip=1e9,
                   seed=seed)
    if sched_out is not None:
        sched_out.append(sched)
    return m


def _grads_at_each_step(model, batch, *, mini, micro, mode="token-mean"):
    """Run ``ppo_update`` and return the gradient each optimizer step received, one dict per step,
    read by a step pre-hook (after clipping, which grad_clip=1e9 makes a multiplication by 1).
    SGD at lr 0 leaves the weights as they were, so every step sees the same point."""
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    grads = []
    opt.register_step_pre_hook(lambda *_: grads.append(
        {n: p.grad.detach().clone() for n, p in model.named_parameters()}))
    ppo_update(model, opt, sched, batch, AlgorithmConfig(loss_agg_mode=mode), temperature=1.0,
               mini_batch_rows=mini, micro_batch_rows=micro, epochs=1, grad_clip=1e9, seed=0)
    return grads


def _ragged(batch):
    """The same batch with responses cut to 1..T tokens (and one row with none): micro-batches
    then hold different numbers of tokens and of non-empty rows."""
    T = batch.response_ids.shape[1]
    keep = torch.tensor([(3 * i) % (T + 1) for i in range(batch.num_rows)])  # (N,) in 0..T
    mask = batch.response_mask * (torch.arange(T)[None, :] < keep[:, None])
    return batch.replace(response_mask=mask, advantages=batch.advantages * mask)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
@pytest.mark.parametrize("ragged", [False, True])
def test_micro_batch_accumulation_matches_one_big_batch(mode, ragged):
    model, batch = _rollout()
    if ragged:
        batch = _ragged(batch)
        assert len(set(batch.response_mask.sum(-1).tolist())) > 2
    N = batch.num_rows
    [one] = _grads_at_each_step(copy.deepcopy(model), batch, mini=N, micro=N, mode=mode)
    rows = _grads_at_each_step(copy.deepcopy(model), batch, mini=1, micro=1, mode=mode)
    assert len(rows) == N  # one step per row: row i's gradient g_i of its own loss
    # row i's weight in the mini-batch loss (its share of the tokens, or of the non-empty rows)
    w = [float(micro_batch_weight(batch.response_mask[i:i + 1], batch.response_mask, mode))
         for i in range(N)]

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
        [acc] = _grads_at_each_step(copy.deepcopy(model), batch, mini=N, micro=micro, mode=mode)
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
