"""Token-budget micro-batches (verl's ``use_dynamic_bsz``) and token-balanced worker blocks
(``trainer.balance_batch``): the packing as a pure function of lengths, and the update on the
real tiny model equal to the fixed-micro-batch one."""
import copy
import random

from types import SimpleNamespace

import pytest
import torch

from tests.gloo_workers import finish, run_gloo_workers
from tests.presets import tiny_run
from tests.verl_core.training.test_ppo_update import _ragged, _rollout
from verl_core.algorithms import micro_batch_weight
from verl_core.config import AlgorithmConfig, ConfigError, preset
from verl_core.training import sharding
from verl_core.training.dist import SINGLE, init_process_group
from verl_core.training.packing import (balanced_order, karmarkar_karp, narrow, row_tokens,
                                        token_micro_batches)
from verl_core.training.ppo import UpdateOptions, ppo_update
from verl_core.verl_keys import parse_cli, to_ours

MODES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm",
         "token-sum"]


# ------------------------------------------------------------------ packing: pure functions
def _lengths(n=64, seed=0):
    rng = random.Random(seed)
    return [rng.randint(4, 256) for _ in range(n)]  # ragged responses, 4..256 tokens


def _masks(prompt, response):
    """What the packing reads of a batch: its prompt mask and its real response tokens, from
    lengths."""
    def mask(lengths):
        return (torch.arange(max(lengths))[None, :] < torch.tensor(lengths)[:, None]).float()
    return SimpleNamespace(prompt_mask=mask(prompt), response_attn=mask(response))


def test_every_micro_batch_fits_the_budget_and_an_overlong_row_is_alone():
    response = _lengths() + [900]  # one row longer than the budget
    prompt = [5 + i % 7 for i in range(65)]
    budget = 1200
    mbs = token_micro_batches(torch.arange(65), _masks(prompt, response), budget)
    assert sorted(torch.cat(mbs).tolist()) == list(range(65))  # each row once
    [k] = [j for j, m in enumerate(mbs) if 64 in m.tolist()]
    assert mbs[k].tolist() == [64]
    padded = [len(m) * (max(prompt[i] for i in m.tolist()) + max(response[i] for i in m.tolist()))
              for m in mbs]
    assert all(p <= budget for p, m in zip(padded, mbs) if m.numel() > 1)
    real = sum(prompt[i] + response[i] for i in range(64))
    # rows of similar length together: the padding is a small share of what runs
    assert sum(padded) - padded[k] < 1.3 * real


def test_packing_is_a_pure_function_of_the_lengths_with_ties_by_index():
    lengths = [5, 3, 5, 3, 8, 5, 1, 5]  # ties everywhere
    a = karmarkar_karp(lengths, 3)
    assert a == karmarkar_karp(list(lengths), 3)
    assert sorted(i for p in a for i in p) == list(range(8))
    # 35 tokens in 3 parts: differencing leaves a spread of 2 here (the best is 1); it never
    # exceeds the longest row
    sums = sorted(sum(lengths[i] for i in p) for p in a)
    assert sums == [11, 11, 13] and sums[-1] - sums[0] <= max(lengths)
    spreads = [max(s) - min(s) for s in (
        [sum(L[i] for i in p) for p in karmarkar_karp(L, k)] for L, k in
        ((_lengths(64, seed), k) for seed in range(5) for k in (2, 3, 5)))]
    assert max(spreads) <= 256


def test_balanced_blocks_hold_equal_tokens_within_ten_percent():
    lengths = _lengths(64, seed=3)
    tokens = torch.tensor(lengths)
    for W in (2, 4, 8):
        order = balanced_order(torch.arange(64), tokens, W)
        assert sorted(order.tolist()) == list(range(64))  # the same rows
        blocks = [int(tokens[b].sum()) for b in order.view(W, -1)]  # equal row counts
        assert max(blocks) <= 1.1 * min(blocks), (W, blocks)
    naive = [int(tokens[b].sum()) for b in torch.arange(64).view(8, -1)]
    assert max(naive) > 1.1 * min(naive)  # the lengths are ragged enough to need it


def test_a_micro_batch_is_cut_to_its_longest_response():
    _, batch = _rollout()
    batch = _ragged(batch)
    lengths = batch.response_lengths
    rows = torch.nonzero(lengths < lengths.max()).flatten()[:3]
    cut = narrow(batch.select(rows))
    width = int(lengths[rows].max())
    assert cut.response_ids.shape == cut.advantages.shape == (3, width)
    assert torch.equal(cut.response_mask, batch.response_mask[rows, :width])
    assert cut.response_mask.sum() == batch.response_mask[rows].sum()  # only padding dropped


# ------------------------------------------------------------------ the update
def _grads(model, batch, algo, *, mini, micro, max_token_len=0, critic=None, shapes=None,
           dp=SINGLE):
    """The gradient each actor optimizer step (and, with ``critic``, each critic step)
    received: SGD at lr 0, read by a step pre-hook (``grad_clip`` 1e9: clipping is a
    multiplication by 1). ``shapes`` collects (rows, width, real tokens) of every actor
    forward with grad."""
    out = {"actor": [], "critic": []}

    def sgd(name, m):
        opt = torch.optim.SGD(m.parameters(), lr=0.0)
        opt.register_step_pre_hook(lambda *_: out[name].append(
            {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
             for n, p in m.named_parameters()}))
        return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)

    if shapes is not None:
        model.register_forward_pre_hook(lambda m, a, kw: shapes.append(
            (*kw["input_ids"].shape, int(kw["attention_mask"].sum()))) if torch.is_grad_enabled()
            else None, with_kwargs=True)
    opt, sched = sgd("actor", model)
    kw = {}
    if critic is not None:
        c_opt, c_sched = sgd("critic", critic)
        kw = dict(critic=critic, critic_optimizer=c_opt, critic_scheduler=c_sched)
    ppo_update(model, opt, sched, batch,
               UpdateOptions(algo=algo, temperature=1.0, mini_batch_rows=mini,
                             micro_batch_rows=micro, epochs=1, grad_clip=1e9,
                             max_token_len=max_token_len, log_prob_max_token_len=max_token_len,
                             critic_max_token_len=max_token_len if critic is not None else 0,
                             balance_batch=True),
               seed=0, dp=dp, **kw)
    return out


def _bound(model, batch, rows, name, mode):
    """2·n·u·S, the float32 bound of test_ppo_update's ``_assert_split_invariant`` widened to
    the forward: a float32 sum of n terms in any order is within γ_n ≈ n·u of the exact one
    (Higham §4.2), so two runs differ by at most 2·n·u·Σ|x|, S = Σ_i w_i·|g_i| taken elementwise
    from the rows' gradients measured one at a time (``rows``: one optimizer step per row, in
    the update's shuffled order, seed 0). Packed micro-batches also change every kernel's
    shapes (rows, the narrowed width, the attention's key count), so each row's own forward and
    backward round differently too: along one gradient the reductions chain, and chained
    roundings add (1+γ_a)(1+γ_b) <= 1+γ_{a+b}: the sum over the token positions (N·L), the head
    (V), and per layer, forward and backward, the q/k/v, o and gate/up projections (3H), the
    down projection (I) and the attention over L keys."""
    u = torch.finfo(torch.float32).eps / 2
    cfg = model.config
    N, L = batch.num_rows, batch.prompt_ids.shape[1] + batch.response_ids.shape[1]
    n = (N * L + cfg.vocab_size + 2 * cfg.num_hidden_layers *
         (3 * cfg.hidden_size + cfg.intermediate_size + L))
    order = torch.randperm(N, generator=torch.Generator().manual_seed(0))  # rows[k]: row order[k]
    w = [float(micro_batch_weight(batch.response_mask[i:i + 1], batch.response_mask, mode))
         for i in order.tolist()]
    return 2 * n * u * sum(wi * r[name].abs() for wi, r in zip(w, rows))


def _budget_batch():
    """The tiny model's rollout with ragged responses; the budget: the second-longest row's
    tokens, so the longest row is over it (a micro-batch of its own) and the rest pack."""
    model, batch = _rollout(max_new_tokens=12)  # prompt 5 + response 0..12 tokens
    batch = _ragged(batch)
    tokens = sorted(row_tokens(batch).tolist())
    assert tokens[-1] > tokens[-2]
    return model, batch, tokens[-2]


@pytest.mark.parametrize("mode", MODES)
def test_token_budget_update_equals_the_fixed_micro_batch_update(mode):
    model, batch, budget = _budget_batch()
    N = batch.num_rows
    algo = AlgorithmConfig(loss_agg_mode=mode)
    [one] = _grads(copy.deepcopy(model), batch, algo, mini=N, micro=N)["actor"]
    rows = _grads(copy.deepcopy(model), batch, algo, mini=1, micro=1)["actor"]
    shapes = []  # (rows, positions per row, real tokens) of each forward with grad
    [packed] = _grads(copy.deepcopy(model), batch, algo, mini=N, micro=4, max_token_len=budget,
                      shapes=shapes)["actor"]
    # the update ran packed micro-batches: several, within the budget but the over-long row
    assert 2 < len(shapes) < N and sum(s[0] for s in shapes) == N
    assert all(n * width <= budget or n == 1 for n, width, _ in shapes)  # padding included
    _assert_within_bound(model, batch, rows, one, packed, mode)


def _critic(model):
    """A value-head model on ``model``'s config, as ``load_critic`` builds it."""
    from transformers import LlamaForTokenClassification

    cfg = copy.deepcopy(model.config)
    cfg.num_labels, cfg.classifier_dropout = 1, 0.0
    torch.manual_seed(0)
    return LlamaForTokenClassification(cfg).eval()


def _with_value_targets(batch):
    """``batch`` with random values and returns on its response tokens (a critic's inputs)."""
    g = torch.Generator().manual_seed(1)
    m = batch.response_mask
    return batch.replace(values=torch.randn(m.shape, generator=g) * m,
                         returns=torch.randn(m.shape, generator=g) * m)


def _assert_within_bound(model, batch, rows, one, got, mode, *what) -> None:
    """Every gradient of ``got`` within :func:`_bound` of the one-micro-batch ``one``."""
    for name, g in one.items():
        diff = (got[name] - g).abs()
        assert bool((diff <= _bound(model, batch, rows, name, mode)).all()), \
            (*what, name, float(diff.max()))


def test_critic_update_with_a_token_budget_equals_the_fixed_one():
    model, batch, budget = _budget_batch()
    N, mode = batch.num_rows, "token-mean"
    critic, batch = _critic(model), _with_value_targets(batch)
    algo = AlgorithmConfig(loss_agg_mode=mode)
    [one] = _grads(copy.deepcopy(model), batch, algo, mini=N, micro=N,
                   critic=copy.deepcopy(critic))["critic"]
    rows = _grads(copy.deepcopy(model), batch, algo, mini=1, micro=1,
                  critic=copy.deepcopy(critic))["critic"]
    [packed] = _grads(copy.deepcopy(model), batch, algo, mini=N, micro=4, max_token_len=budget,
                      critic=copy.deepcopy(critic))["critic"]
    _assert_within_bound(critic, batch, rows, one, packed, mode)


# ------------------------------------------------------------------ W = 2 (FSDP2 over gloo)
def _worker(rank: int, world: int, init: str, out: str) -> None:
    """Each worker packs its block of the ragged batch to the token budget (the blocks need
    different numbers of micro-batches: the workers agree on the larger), balanced or not, and
    balanced with remove-padding (each worker's micro-batches packed into one sequence, the
    row lengths gathered under FSDP2); rank 0 writes the full gradients of the three runs."""
    torch.set_num_threads(1)
    dp = init_process_group("gloo", init, rank, world, 120.0)
    model, batch, budget = _budget_batch()
    # the blocks of the (one) mini-batch as ppo_update draws it, unbalanced: micro-batches each
    # would need alone
    order = torch.randperm(batch.num_rows, generator=torch.Generator().manual_seed(0))
    res = {"alone": [len(token_micro_batches(b, batch, budget)) for b in order.view(world, -1)]}
    for balance, rp in ((False, False), (True, False), (True, True)):
        m = sharding.shard(copy.deepcopy(model))
        opt = torch.optim.SGD(m.parameters(), lr=0.0)
        grads = []
        opt.register_step_pre_hook(lambda *_: grads.append(
            {n: p.grad.full_tensor().clone() for n, p in m.named_parameters()}))
        ppo_update(m, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0), batch,
                   UpdateOptions(algo=AlgorithmConfig(), temperature=1.0,
                                 mini_batch_rows=batch.num_rows, micro_batch_rows=4, epochs=1,
                                 grad_clip=1e9, max_token_len=budget, log_prob_max_token_len=budget,
                                 balance_batch=balance, remove_padding=rp),
                   seed=0, dp=dp)
        res[balance, rp] = grads[0]
    if rank == 0:
        torch.save(res, out)
    finish()


@pytest.mark.slow  # ~25 s on 2 cores: two FSDP2 processes, then the W = 1 references
def test_two_workers_with_token_budgets_balancing_and_remove_padding_train_as_one(tmp_path):
    out = tmp_path / "w2.pt"
    run_gloo_workers("tests.verl_core.training.test_dynamic_bsz", "_worker", tmp_path, out)
    w2 = torch.load(out)
    alone = w2.pop("alone")
    assert len(set(alone)) > 1, alone  # the workers had to agree on a count
    model, batch, budget = _budget_batch()
    N, algo = batch.num_rows, AlgorithmConfig()
    [one] = _grads(copy.deepcopy(model), batch, algo, mini=N, micro=N)["actor"]
    rows = _grads(copy.deepcopy(model), batch, algo, mini=1, micro=1)["actor"]
    assert len(w2) == 3
    for how, got in w2.items():
        _assert_within_bound(model, batch, rows, one, got, "token-mean", how)


# ------------------------------------------------------------------ config
def test_verl_keys_map_to_the_budgets():
    A, R = "actor_rollout_ref.actor.", "actor_rollout_ref.rollout."
    over = to_ours(parse_cli([
        f"{A}use_dynamic_bsz=True", f"{R}log_prob_use_dynamic_bsz=True",
        "actor_rollout_ref.ref.log_prob_use_dynamic_bsz=True", f"{A}ppo_max_token_len_per_gpu=300",
        f"{R}log_prob_max_token_len_per_gpu=900",
        "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=800",
        "critic.ppo_max_token_len_per_gpu=700", "critic.forward_max_token_len_per_gpu=600",
        "trainer.balance_batch=False"]))
    cfg = preset("grpo", **over)
    a = cfg.actor
    assert (a.token_budget("ppo_max_token_len_per_gpu"),
            a.token_budget("log_prob_max_token_len_per_gpu"),
            a.token_budget("ref_log_prob_max_token_len_per_gpu"),
            a.token_budget("critic_ppo_max_token_len_per_gpu"),
            a.token_budget("critic_forward_max_token_len_per_gpu")) == (300, 900, 800, 700, 600)
    assert cfg.trainer.balance_batch is False
    assert preset("grpo").actor.token_budget("ppo_max_token_len_per_gpu") == 0  # off: rows
    with pytest.raises(ConfigError, match=r"actor.ppo_max_token_len_per_gpu.*must be > 0"):
        preset("grpo", **{"actor.ppo_max_token_len_per_gpu": 0})


# ------------------------------------------------------------------ the trainer's phases
def test_trainer_packs_every_forward_to_its_budget(tmp_path):
    """PPO with a reference (KL loss) and a critic, one RL step with token budgets: the
    reference's and the critic's no-grad forwards, the old log-probs, and both updates run in
    micro-batches within their own budgets (a longer row alone), recorded by forward hooks on
    the real models."""
    from verl_core.trainer import RLTrainer
    from verl_core.assets import prepare_assets

    budgets = {"ppo_max_token_len_per_gpu": 40, "log_prob_max_token_len_per_gpu": 50,
               "ref_log_prob_max_token_len_per_gpu": 60, "critic_ppo_max_token_len_per_gpu": 70,
               "critic_forward_max_token_len_per_gpu": 80}
    cfg = tiny_run("ppo", **{"data.train_batch_size": 4, "rollout.n": 3,
                             "actor.ppo_micro_batch_size": 12, "algorithm.use_kl_loss": True,
                             "actor.use_dynamic_bsz": True,
                             **{f"actor.{k}": v for k, v in budgets.items()}})
    trainer = RLTrainer(cfg, prepare_assets(cfg, str(tmp_path), log=lambda *_: None))
    seen = {}

    def record(name):
        def hook(m, args, kw):
            if name == "critic" or torch.is_tensor(kw.get("logits_to_keep")):  # not sampling
                seen.setdefault((name, torch.is_grad_enabled()), []).append(
                    int(kw["attention_mask"].sum()))
        return hook

    models = {"actor": trainer.actor.model, "ref": trainer.actor.ref,
              "critic": trainer.critic.model}
    for name, model in models.items():
        model.register_forward_pre_hook(record(name), with_kwargs=True)
    try:
        batch, _ = trainer.rollout(step=0)
        batch, _ = trainer.reward(batch)
        batch, _ = trainer.advantage(batch)
        trainer.update(batch, step=0)
    finally:
        trainer.close()
    tokens = row_tokens(batch)
    assert int(tokens.max()) < 40 // 2  # every budget holds two rows: packing, not one each
    epochs = cfg.actor.ppo_epochs
    for key, budget in {("ref", False): 60, ("critic", False): 80, ("actor", False): 50,
                        ("actor", True): 40, ("critic", True): 70}.items():
        real = seen[key]
        passes = epochs if key[1] else 1
        assert sum(real) == passes * int(tokens.sum()), key  # every row once per pass
        assert all(r <= budget for r in real), key
        assert passes * -(-int(tokens.sum()) // budget) <= len(real) < passes * batch.num_rows, key
