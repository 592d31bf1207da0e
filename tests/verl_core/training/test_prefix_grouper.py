"""A prompt once per group (verl's ``use_prefix_grouper``): the rows of a micro-batch that share a
prompt run it once (a KV cache, with grad in the update), and the log-probs, entropy and update
equal the whole-row computation's within the float32 bounds of test_remove_padding and
test_dynamic_bsz (a different order of the same reductions); off, and where it cannot apply,
every row runs whole."""
import copy
import functools

import pytest
import torch

import tests.verl_core.training.test_dynamic_bsz as dyn
from tests.verl_core.training.test_dynamic_bsz import MODES, _assert_within_bound, _grads
from tests.verl_core.training.test_ppo_update import _ragged, _rollout
from tests.verl_core.training.test_remove_padding import U, _batch_for, _chain, _head_magnitude, _qwen
from verl_core.config import AlgorithmConfig, ConfigError, grpo_preset, with_overrides
from verl_core.training.forward import response_logprobs
from verl_core.training.ppo import UpdateOptions


def _widths(model):
    calls = []
    hook = model.register_forward_pre_hook(
        lambda _m, _a, kw: calls.append(tuple(kw["input_ids"].shape)), with_kwargs=True)
    return calls, hook


@pytest.mark.parametrize("which", ["tiny", "qwen2"])
def test_shared_prompts_give_the_whole_rows_logprobs_and_entropy(which, tmp_path):
    """4 prompts x 4 ragged responses (one empty): the prompt forward sees the 4 distinct
    prompts, the response forward every row; the bound of test_remove_padding's packed test
    (2γ_n(|logp| + 3M) and 2γ_n(|H| + Z + 2ZM + M), n the chained reductions of one forward)."""
    model, batch = _rollout(max_new_tokens=12)
    b = _ragged(batch)
    if which == "qwen2":
        model = _qwen(tmp_path)
        b = _batch_for(model, b)  # new ids per row: the group's first row's prompt for all G
        b = b.replace(prompt_ids=b.prompt_ids[torch.arange(b.num_rows) // 4 * 4])
    args = (model, b.prompt_ids, b.prompt_mask, b.response_ids, b.response_mask, 0.7, True)
    with torch.no_grad():
        logp, ent = response_logprobs(*args)
        calls, hook = _widths(model)
        s_logp, s_ent = response_logprobs(*args, shared=True)
        hook.remove()
    n, T = b.response_ids.shape
    assert [c[0] for c in calls] == [4, n] and calls[1][1] == T - 1
    mask = b.response_mask.bool()
    assert not s_logp[~mask].any() and not s_ent[~mask].any()
    L = b.prompt_ids.shape[1] + T
    k = _chain(model.config, L, model.config.vocab_size)
    gamma = k * U / (1 - k * U)
    M, Z = _head_magnitude(model, b)
    M, Z = M / 0.7, Z / 0.7  # the temperature divides the logits
    assert bool(((s_logp - logp).abs() <= 2 * gamma * (logp.abs() + 3 * M))[mask].all()), \
        float((s_logp - logp).abs().max())
    assert bool(((s_ent - ent).abs() <= 2 * gamma * (ent.abs() + Z + 2 * Z * M + M))[mask]
                .all()), float((s_ent - ent).abs().max())


@pytest.mark.parametrize("micro", [16, 5])
@pytest.mark.parametrize("mode", MODES)
def test_prefix_grouper_update_equals_the_whole_rows_update(mode, micro, monkeypatch):
    """One update with the switch on (one micro-batch of all 16 rows, or micro-batches of 5
    shuffled rows: groups split, some prompts alone) against one whole-row micro-batch of all
    rows: within test_dynamic_bsz's ``_bound``; the old log-probs' and the update's forwards both
    shared."""
    model, batch = _rollout(max_new_tokens=12)
    batch = _ragged(batch)
    N = batch.num_rows
    algo = AlgorithmConfig(loss_agg_mode=mode)
    [one] = _grads(copy.deepcopy(model), batch, algo, mini=N, micro=N)["actor"]
    rows = _grads(copy.deepcopy(model), batch, algo, mini=1, micro=1)["actor"]
    monkeypatch.setattr(dyn, "UpdateOptions", functools.partial(UpdateOptions, prefix_grouper=True))
    shared_model = copy.deepcopy(model)
    calls, hook = _widths(shared_model)
    [got] = _grads(shared_model, batch, algo, mini=N, micro=micro)["actor"]
    hook.remove()
    P, T = batch.prompt_ids.shape[1], batch.response_ids.shape[1]
    prompt_rows = sum(r for r, w in calls if w in (P, P + T))  # prompts alone, or whole rows
    answer_rows = sum(r for r, w in calls if w in (T - 1, P + T))  # responses, or whole rows
    assert answer_rows == N and prompt_rows < N, calls  # every row once, fewer prompts
    if micro == N:
        assert calls == [(4, P), (N, T - 1)]  # on-policy: no old-log-prob forward
    _assert_within_bound(model, batch, rows, one, got, mode)


def test_rows_run_whole_where_sharing_cannot_apply():
    """Every prompt distinct, or HF activation checkpointing (the layers run again in backward
    without the cache): one whole-row forward, the same numbers as with the switch off."""
    model, batch = _rollout(max_new_tokens=6)
    b = batch.select(torch.arange(0, batch.num_rows, 4))  # one row per prompt
    args = (model, b.prompt_ids, b.prompt_mask, b.response_ids, b.response_mask)
    with torch.no_grad():
        calls, hook = _widths(model)
        assert torch.equal(response_logprobs(*args, shared=True)[0],
                           response_logprobs(*args)[0])
        hook.remove()
    assert len(calls) == 2  # one each
    model.gradient_checkpointing_enable()
    model.train()
    b = batch
    args = (model, b.prompt_ids, b.prompt_mask, b.response_ids, b.response_mask)
    calls, hook = _widths(model)
    response_logprobs(*args, shared=True)
    hook.remove()
    assert [c[0] for c in calls] == [b.num_rows]


def test_the_switch_is_verls_key_hashed_only_when_on_and_refused_with_remove_padding():
    from verl_core.verl_keys import to_ours

    base = grpo_preset()
    on = with_overrides(base, {"actor.use_prefix_grouper": True})
    assert on.trajectory_hash() != base.trajectory_hash()
    assert with_overrides(base, {"actor.use_prefix_grouper": False}).trajectory_hash() == \
        base.trajectory_hash()
    assert to_ours({"actor_rollout_ref.actor.use_prefix_grouper": True}) == \
        {"actor.use_prefix_grouper": True}
    with pytest.raises(ConfigError, match="use_remove_padding"):
        with_overrides(base, {"actor.use_prefix_grouper": True, "actor.use_remove_padding": True})


def test_a_lora_policy_shares_its_prompts_and_gets_the_same_adapter_gradients():
    """A PEFT-wrapped policy (LoRA on every linear layer, B drawn nonzero so every adapter
    matters): the prompt forward runs the distinct prompts, and the adapters' gradients of
    the summed log-probs equal the whole-row ones within 2·γ_n·S, S = Σ_i |g_i| elementwise
    over the rows' own gradients and n the chained reductions of a forward and its backward
    (2 x ``_chain``), as test_dynamic_bsz's ``_bound``: the cache carries grad into the
    adapters at the prompt positions."""
    from verl_core.models.config import ModelConfig
    from verl_core.models.lora import apply_lora

    model, batch = _rollout(max_new_tokens=8)
    lora = apply_lora(model, ModelConfig(lora_rank=4, lora_alpha=8.0), seed=0)
    with torch.no_grad():
        for n, p in lora.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.02, generator=torch.Generator().manual_seed(1))
    b = _ragged(batch)
    grads = []
    for shared in (False, True):
        lora.zero_grad()
        calls, hook = _widths(lora.get_base_model())
        logp, _ = response_logprobs(lora, b.prompt_ids, b.prompt_mask, b.response_ids,
                                    b.response_mask, shared=shared)
        hook.remove()
        logp.sum().backward()
        grads.append({n: p.grad.clone() for n, p in lora.named_parameters() if p.requires_grad})
        if shared:
            assert [c[0] for c in calls] == [4, b.num_rows]
    S = {n: torch.zeros_like(g) for n, g in grads[0].items()}
    for i in range(b.num_rows):
        lora.zero_grad()
        r = slice(i, i + 1)
        logp, _ = response_logprobs(lora, b.prompt_ids[r], b.prompt_mask[r], b.response_ids[r],
                                    b.response_mask[r])
        logp.sum().backward()
        for n, p in lora.named_parameters():
            if p.requires_grad:
                S[n] += p.grad.abs()
    k = 2 * _chain(model.config, b.prompt_ids.shape[1] + b.response_ids.shape[1],
                   model.config.vocab_size)
    gamma = k * U / (1 - k * U)
    for n, g in grads[0].items():
        assert bool(((grads[1][n] - g).abs() <= 2 * gamma * S[n]).all()), \
            (n, float((grads[1][n] - g).abs().max()))
