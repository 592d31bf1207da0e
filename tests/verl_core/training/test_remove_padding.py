"""No compute on padding (verl's ``use_remove_padding``): a micro-batch's rows packed into one
sequence with per-row position ids give the padded computation's log-probs, entropy, values and
update within bounds derived from float32 summation; with the option off nothing changes, bit
for bit, against the code before it existed."""
import copy
import functools

import pytest
import torch

import tests.verl_core.training.test_dynamic_bsz as dyn
from tests.verl_core.training.test_dynamic_bsz import (MODES, _assert_within_bound, _budget_batch,
                                                    _critic, _grads, _with_value_targets)
from tests.verl_core.training.test_ppo_update import _ragged, _rollout
from verl_core.config import AlgorithmConfig
from verl_core.training import forward
from verl_core.training.forward import critic_values, response_logprobs
from verl_core.training.packing import micro_batches, row_tokens
from verl_core.training.ppo import UpdateOptions, ppo_update

U = torch.finfo(torch.float32).eps / 2  # unit roundoff of float32


def _qwen(tmp_path):
    from transformers import AutoModelForCausalLM

    from tests.standins import qwen_folder
    return AutoModelForCausalLM.from_pretrained(qwen_folder(tmp_path / "qwen")).eval()


def _batch_for(model, batch):
    """``batch`` (ragged) with token ids drawn inside ``model``'s vocabulary."""
    g = torch.Generator().manual_seed(3)
    V = min(model.config.vocab_size, 5000)
    pid = torch.randint(1, V, batch.prompt_ids.shape, generator=g) * batch.prompt_mask.long()
    rid = torch.randint(1, V, batch.response_ids.shape, generator=g) * batch.response_mask.long()
    return batch.replace(prompt_ids=pid, response_ids=rid)


def _chain(cfg, L: int, out: int) -> int:
    """n of γ_n for one forward: the reductions one output goes through, chained. Two float32
    computations of the same sum in different orders are each within γ_n·Σ|terms| of the exact
    value (Higham §4.2, γ_n = n·u/(1 - n·u)); through a chain of reductions the relative errors
    compound, (1+γ_a)(1+γ_b) <= 1+γ_{a+b}, so n is the sum of their lengths: per layer the two
    RMSNorms' mean of squares (2H), the q/k/v, o and gate/up projections (dot products of
    length H each: 3H), the down projection (I) and the attention over at most L keys (scores'
    softmax sum and the weighted sum of values: 2L); then the final norm (H) and the head's
    output reduction (``out``: V for the log-softmax's sum, 1 for a value head)."""
    H, I = cfg.hidden_size, cfg.intermediate_size
    return cfg.num_hidden_layers * (5 * H + I + 2 * L) + H + out


def _head_magnitude(model, batch):
    """(n, T) M = max_v Σ_k |h_k|·|w_vk| and Z = max_v |z_v| at each response token's predicting
    position: the magnitudes the head's dot products sum (the Σ|terms| of the bound)."""
    from verl_core.training.forward import _inputs

    ids, attn, position, P = _inputs(batch.prompt_ids, batch.prompt_mask, batch.response_ids,
                                     batch.response_mask)
    T = batch.response_ids.shape[1]
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=attn, position_ids=position,
                    output_hidden_states=True)
        h = out.hidden_states[-1][:, P - 1:P + T - 1]  # (n, T, H) after the final norm
        w = model.get_output_embeddings().weight  # (V, H)
        M = (h.abs() @ w.abs().T).amax(-1)  # (n, T)
        Z = out.logits[:, P - 1:P + T - 1].abs().amax(-1)  # (n, T)
    return M, Z


@pytest.mark.parametrize("attention", ["boundaries", "mask"])
@pytest.mark.parametrize("which", ["tiny", "qwen2"])
def test_packed_logprobs_and_entropy_equal_padded(which, attention, tmp_path, monkeypatch):
    """Ragged rows (responses 0..12 tokens, left-padded prompts), both packed attentions.

    Bound per token, from ``_chain``'s γ_n (both runs err, hence 2γ_n): the logits z carry an
    error of at most γ_n·M (M: the head's Σ|h||w|, the largest the input errors reach after the
    final RMSNorm made them relative); logp = z_y - logsumexp(z) has gradient e_y - softmax(z),
    of l1 norm <= 2, so it moves by at most 2γ_n·M, plus its own sum's rounding, γ_n relative
    to |logp| + M (logsumexp <= |logp| + |z_y|): 2γ_n(|logp| + 3M). The entropy
    H = lse(z) - Σ p_v z_v has gradient p_v(z_v - E_p z), of l1 norm <= 2Z (Z = max|z|):
    2γ_n(|H| + Z + 2Z·M + M)."""
    monkeypatch.setattr(forward, "CPU_PACKED_ATTENTION", attention)
    model, batch = _rollout(max_new_tokens=12)
    batch = _ragged(batch)
    if which == "qwen2":
        model = _qwen(tmp_path)
        batch = _batch_for(model, batch)
    assert forward.packs(model)
    b = batch
    args = (model, b.prompt_ids, b.prompt_mask, b.response_ids, b.response_mask, 0.7, True)
    with torch.no_grad():
        logp, ent = response_logprobs(*args)
        calls = []
        hook = model.register_forward_pre_hook(
            lambda m, a, kw: calls.append(kw["input_ids"].shape), with_kwargs=True)
        p_logp, p_ent = response_logprobs(*args, packed=True)
        hook.remove()
    assert calls == [(1, int(row_tokens(b).sum()))]  # one sequence of the real tokens only
    mask = b.response_mask.bool()
    assert not p_logp[~mask].any() and not p_ent[~mask].any()
    L = b.prompt_ids.shape[1] + b.response_ids.shape[1]
    n = _chain(model.config, L, model.config.vocab_size)
    gamma = n * U / (1 - n * U)
    M, Z = _head_magnitude(model, b)
    Z = Z / 0.7  # the temperature divides the logits
    M = M / 0.7
    logp_bound = 2 * gamma * (logp.abs() + 3 * M)
    ent_bound = 2 * gamma * (ent.abs() + Z + 2 * Z * M + M)
    assert bool(((p_logp - logp).abs() <= logp_bound)[mask].all()), \
        float((p_logp - logp).abs().max())
    assert bool(((p_ent - ent).abs() <= ent_bound)[mask].all()), float((p_ent - ent).abs().max())


def test_packed_values_equal_padded():
    """The critic's values: v = w·h + b, one dot product of length H after ``_chain``'s
    reductions: 2γ_n(|v| + Σ|w||h|) per token."""
    model, batch = _rollout(max_new_tokens=12)
    b = _ragged(batch)
    critic = _critic(model)
    args = (critic, b.prompt_ids, b.prompt_mask, b.response_ids, b.response_mask)
    with torch.no_grad():
        v = critic_values(*args)
        pv = critic_values(*args, packed=True)
        from verl_core.training.forward import _inputs
        ids, attn, position, P = _inputs(*args[1:])
        T = b.response_ids.shape[1]
        h = critic.model(input_ids=ids, attention_mask=attn,
                         position_ids=position).last_hidden_state[:, P - 1:P + T - 1]
        mag = h.abs() @ critic.score.weight.abs()[0]  # (n, T)
    L = ids.shape[1]
    n = _chain(critic.config, L, 1)
    gamma = n * U / (1 - n * U)
    mask = b.response_mask.bool()
    assert not pv[~mask].any()
    assert bool(((pv - v).abs() <= 2 * gamma * (v.abs() + mag))[mask].all()), \
        float((pv - v).abs().max())


def test_a_model_that_cannot_pack_is_bucketed_by_length():
    model, batch = _rollout(max_new_tokens=12)
    batch = _ragged(batch)
    layout = forward.padding_layout
    assert layout(model, False) == "padded" and layout(model, True) == "packed"
    model.config.final_logit_softcapping = 30.0  # a soft cap: no packed attention for it
    assert layout(model, True) == "bucketed"
    rows = torch.arange(batch.num_rows)
    tokens = row_tokens(batch)
    parts = micro_batches(rows, batch, 4, layout="bucketed")
    assert [len(p) for p in parts] == [4] * (batch.num_rows // 4)
    flat = torch.cat(parts)
    assert sorted(flat.tolist()) == rows.tolist()
    assert bool((tokens[flat][1:] >= tokens[flat][:-1]).all())  # sorted by length
    # the padded chunks as before remove-padding
    assert [p.tolist() for p in micro_batches(rows, batch, 4)] == \
        [p.tolist() for p in rows.split(4)]


def test_packed_token_budget_counts_real_tokens_and_balances():
    model, batch, budget = _budget_batch()
    rows = torch.arange(batch.num_rows)
    tokens = row_tokens(batch)
    parts = micro_batches(rows, batch, 4, budget, layout="packed")
    assert sorted(torch.cat(parts).tolist()) == rows.tolist()
    sums = [int(tokens[p].sum()) for p in parts]
    assert all(s <= budget or len(p) == 1 for s, p in zip(sums, parts))
    assert len(parts) <= len(micro_batches(rows, batch, 4, budget))  # no more than padded


def _rp_grads(monkeypatch, *args, **kw):
    """test_dynamic_bsz's ``_grads`` with ``UpdateOptions(..., remove_padding=True)``."""
    monkeypatch.setattr(dyn, "UpdateOptions", functools.partial(UpdateOptions, remove_padding=True))
    try:
        return _grads(*args, **kw)
    finally:
        monkeypatch.setattr(dyn, "UpdateOptions", UpdateOptions)


@pytest.mark.parametrize("budget", [False, True])
@pytest.mark.parametrize("mode", MODES)
def test_remove_padding_update_equals_the_padded_update(mode, budget, monkeypatch):
    """One update, packed micro-batches (fixed rows, or a token budget over real tokens) against
    one padded micro-batch of all rows: within test_dynamic_bsz's ``_bound`` (2·n·u·S, the
    chained reductions of forward and backward, S from the rows' own gradients)."""
    model, batch, max_tokens = _budget_batch()
    N = batch.num_rows
    algo = AlgorithmConfig(loss_agg_mode=mode)
    [one] = _grads(copy.deepcopy(model), batch, algo, mini=N, micro=N)["actor"]
    rows = _grads(copy.deepcopy(model), batch, algo, mini=1, micro=1)["actor"]
    shapes = []
    [packed] = _rp_grads(monkeypatch, copy.deepcopy(model), batch, algo, mini=N, micro=4,
                         max_token_len=max_tokens if budget else 0, shapes=shapes)["actor"]
    # every forward with grad ran one sequence of real tokens; all rows once
    assert all(s[0] == 1 and s[1] == s[2] for s in shapes), shapes
    assert sum(s[2] for s in shapes) == int(row_tokens(batch).sum()) and len(shapes) > 1
    if budget:
        # within the budget, but the one row longer than it (alone)
        assert [s[2] for s in shapes if s[2] > max_tokens] == [int(row_tokens(batch).max())]
    _assert_within_bound(model, batch, rows, one, packed, mode)


def test_critic_update_with_remove_padding_equals_the_padded_one(monkeypatch):
    model, batch, max_tokens = _budget_batch()
    N, mode = batch.num_rows, "token-mean"
    critic, batch = _critic(model), _with_value_targets(batch)
    algo = AlgorithmConfig(loss_agg_mode=mode)
    [one] = _grads(copy.deepcopy(model), batch, algo, mini=N, micro=N,
                   critic=copy.deepcopy(critic))["critic"]
    rows = _grads(copy.deepcopy(model), batch, algo, mini=1, micro=1,
                  critic=copy.deepcopy(critic))["critic"]
    [packed] = _rp_grads(monkeypatch, copy.deepcopy(model), batch, algo, mini=N, micro=4,
                         max_token_len=max_tokens, critic=copy.deepcopy(critic))["critic"]
    _assert_within_bound(critic, batch, rows, one, packed, mode)


def test_metrics_report_micro_batches_tokens_and_padding():
    model, batch, max_tokens = _budget_batch()
    N = batch.num_rows
    out = {}
    for rp in (False, True):
        m = copy.deepcopy(model)
        opt = torch.optim.SGD(m.parameters(), lr=0.0)
        out[rp] = ppo_update(m, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0), batch,
                             UpdateOptions(algo=AlgorithmConfig(), temperature=1.0,
                                           mini_batch_rows=N, micro_batch_rows=4, epochs=1,
                                           grad_clip=1.0, remove_padding=rp),
                             seed=0)
    assert out[True]["update/padding_fraction"] == 0.0 < out[False]["update/padding_fraction"]
    for rp in (False, True):
        assert out[rp]["update/micro_batches"] == N // 4
        assert out[rp]["update/tokens_per_micro_batch"] == pytest.approx(
            float(row_tokens(batch).sum()) / (N // 4))


# ------------------------------------------------------------------ the trainer's phases
def test_trainer_packs_every_forward(tmp_path):
    """PPO with a reference (KL loss) and a critic, one RL step with remove-padding and token
    budgets: the reference's and the critic's no-grad forwards, the old log-probs and both
    updates each run one packed sequence per micro-batch (no padding), every real token once
    per pass, recorded by forward hooks on the real models."""
    from tests.presets import tiny_run
    from verl_core.trainer import RLTrainer
    from verl_core.assets import prepare_assets

    cfg = tiny_run("ppo", **{"data.train_batch_size": 4, "rollout.n": 3,
                             "actor.ppo_micro_batch_size": 12, "algorithm.use_kl_loss": True,
                             "actor.use_dynamic_bsz": True, "actor.use_remove_padding": True,
                             "actor.ppo_max_token_len_per_gpu": 40,
                             "actor.log_prob_max_token_len_per_gpu": 50,
                             "actor.ref_log_prob_max_token_len_per_gpu": 60,
                             "actor.critic_ppo_max_token_len_per_gpu": 70,
                             "actor.critic_forward_max_token_len_per_gpu": 80})
    assert cfg.trajectory_hash() != tiny_run("ppo", **{
        "data.train_batch_size": 4, "rollout.n": 3, "actor.ppo_micro_batch_size": 12,
        "algorithm.use_kl_loss": True, "actor.use_dynamic_bsz": True,
        "actor.ppo_max_token_len_per_gpu": 40, "actor.log_prob_max_token_len_per_gpu": 50,
        "actor.ref_log_prob_max_token_len_per_gpu": 60,
        "actor.critic_ppo_max_token_len_per_gpu": 70,
        "actor.critic_forward_max_token_len_per_gpu": 80}).trajectory_hash()  # on: hashed
    trainer = RLTrainer(cfg, prepare_assets(cfg, str(tmp_path), log=lambda *_: None))
    seen = {}

    def record(name):
        def hook(m, args, kw):
            if name == "critic" or torch.is_tensor(kw.get("logits_to_keep")):  # not sampling
                seen.setdefault((name, torch.is_grad_enabled()), []).append(
                    tuple(kw["input_ids"].shape))
        return hook

    models = {"actor": trainer.actor.model, "ref": trainer.actor.ref,
              "critic": trainer.critic.model}
    for name, model in models.items():
        model.register_forward_pre_hook(record(name), with_kwargs=True)
    try:
        batch, _ = trainer.rollout(step=0)
        batch, _ = trainer.reward(batch)
        batch, _ = trainer.advantage(batch)
        metrics = trainer.update(batch, step=0)
    finally:
        trainer.close()
    tokens = int(row_tokens(batch).sum())
    epochs = cfg.actor.ppo_epochs
    assert set(seen) == {("ref", False), ("critic", False), ("actor", False), ("actor", True),
                         ("critic", True)}
    for (name, grad), shapes in seen.items():
        assert all(s[0] == 1 for s in shapes), (name, grad, shapes)  # one packed sequence
        assert sum(s[1] for s in shapes) == (epochs if grad else 1) * tokens, (name, grad)
    assert metrics["update/padding_fraction"] == 0.0
