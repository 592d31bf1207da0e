"""``model.dtype=bfloat16`` as verl trains: bf16 compute over float32 master weights and float32
AdamW state, on one worker (``sharding.compute_in``) and on W (FSDP2's MixedPrecisionPolicy)."""
import copy

import pytest
import torch

from tests.gloo_workers import finish, run_gloo_workers
from tests.standins import gsm8k_parquet, llama3_folder
from tests.verl_core.training.test_ppo_update import _rollout
from verl_core.config import AlgorithmConfig, ConfigError, OptimConfig, preset
from verl_core.models.loading import precision_line, stored_dtype
from verl_core.trainer import RLTrainer
from verl_core.assets import Assets
from verl_core.training import sharding
from verl_core.training.dist import SINGLE, init_process_group
from verl_core.training.forward import batched_logprobs
from verl_core.training.optim import make_optimizer, make_scheduler
from verl_core.training.ppo import UpdateOptions, ppo_update
from verl_core.verl_keys import to_ours

LR = 1e-6  # verl's actor learning rate


@pytest.fixture(scope="module")
def bf16_run(tmp_path_factory):
    """The Llama-3 stand-in (stored in bfloat16) with model.dtype=bfloat16 at lr 1e-6."""
    tmp = tmp_path_factory.mktemp("bf16")
    folder = llama3_folder(tmp / "llama3")
    train = gsm8k_parquet(tmp / "train.parquet", 8)
    val = gsm8k_parquet(tmp / "val.parquet", 2, split="test")
    cfg = preset("grpo", **{
        "model.path": str(folder), "model.dtype": "bfloat16", "optim.lr": LR,
        "optim.warmup_steps": 0, "data.train_files": str(train), "data.val_files": str(val),
        "data.max_prompt_length": 512, "rollout.max_new_tokens": 4, "data.train_batch_size": 2,
        "rollout.n": 2, "actor.ppo_mini_batch_size": 2, "actor.ppo_micro_batch_size": 4,
        "num_threads": 1, "total_steps": 1})
    assets = Assets(model_path=str(folder), train_files=[str(train)], val_files=[str(val)])
    return cfg, assets


def _batch_with_advantages(trainer):
    batch, _ = trainer.rollout(0)
    g = torch.Generator().manual_seed(0)
    adv = torch.randn(batch.num_rows, 1, generator=g) * batch.response_mask  # (N, T)
    return batch.replace(advantages=adv, returns=adv)


def test_bf16_computes_in_bf16_over_fp32_masters_and_one_update_moves_most_weights(bf16_run):
    cfg, assets = bf16_run
    trainer = RLTrainer(cfg, assets)
    actor = trainer.actor.model
    assert {p.dtype for p in actor.parameters()} == {torch.float32}  # the masters
    seen = []
    hook = actor.model.layers[0].self_attn.q_proj.register_forward_hook(
        lambda m, args, out: seen.append((m.weight.dtype, out.dtype)))
    batch = _batch_with_advantages(trainer)
    before = {n: p.detach().clone() for n, p in actor.named_parameters()}
    m = trainer.update(batch, 0)
    hook.remove()
    assert m["actor/grad_norm"] > 0
    # every forward (rollout, update) ran the matmuls on bf16 weights with bf16 outputs
    assert seen and set(seen) == {(torch.bfloat16, torch.bfloat16)}, set(seen)
    assert {p.dtype for p in actor.parameters()} == {torch.float32}
    state = trainer.actor.optimizer.state
    assert state and {t.dtype for s in state.values() for k, t in s.items()
                      if k in ("exp_avg", "exp_avg_sq")} == {torch.float32}
    # Adam's first step moves a weight with g != 0 by lr * g / (|g| + eps) ~ lr = 1e-6 (plus
    # weight decay's lr * wd * |w|); a float32 weight keeps a change above half an ulp,
    # |w| * 2^-24, i.e. every weight with |w| < 1e-6 * 2^24 ~ 17: all of them here (init std
    # 0.02). In bf16 (today's pure-bf16 parameters) half an ulp is |w| * 2^-9, so only |w| <
    # 5e-4 would move: ~2% of N(0, 0.02^2). Elements with an exactly zero gradient (embedding
    # rows of tokens not in the batch) do not move either way: count over those that got one.
    moved = total = 0
    for n, p in actor.named_parameters():
        changed = p.detach() != before[n]
        if n.endswith("embed_tokens.weight") or n.endswith("lm_head.weight"):
            continue  # rows of unseen tokens get weight decay only (~1e-14 / step)
        moved += int(changed.sum())
        total += changed.numel()
    assert moved / total > 0.9, moved / total


def test_checkpoint_state_carries_the_fp32_masters_and_loads_back(bf16_run):
    cfg, assets = bf16_run
    a = RLTrainer(cfg, assets)
    a.update(_batch_with_advantages(a), 0)
    groups, meta = a.state(1)
    assert {t.dtype for t in groups["policy"].values()} == {torch.float32}
    b = RLTrainer(cfg, assets)
    b.load_state(copy.deepcopy(groups), meta, 1)
    for (n, p), q in zip(a.actor.model.named_parameters(), b.actor.model.parameters()):
        assert q.dtype == torch.float32 and torch.equal(p, q), n
    # the frozen reference needs no master: it is bf16 (GRPO's KL loss reads it)
    if b.actor.ref is not None:
        assert {p.dtype for p in b.actor.ref.parameters()} == {torch.bfloat16}


def test_reference_in_bf16_reproduces_the_actors_logprobs_before_any_update(bf16_run):
    """compute_in casts exactly what a bf16 load holds (round to nearest of the same float32
    weights; buffers float32 in both): the same forward, bit for bit, so the KL starts at 0."""
    model, batch = _rollout()
    actor = sharding.compute_in(copy.deepcopy(model), torch.bfloat16)
    ref = copy.deepcopy(model).to(torch.bfloat16)
    for name, buf in model.named_buffers():  # a bf16 load keeps rotary buffers float32
        ref.get_buffer(name).data = buf.clone()
    a = batched_logprobs(actor, batch, 1.0, 8)
    r = batched_logprobs(ref, batch, 1.0, 8)
    f = batched_logprobs(model, batch, 1.0, 8)
    assert torch.equal(a, r)
    assert (a - f).abs().max() > 1e-4  # and it is bf16, not the float32 forward


def test_the_console_line_names_stored_and_training_dtypes(bf16_run):
    _, assets = bf16_run
    assert stored_dtype(assets.model_path) == "bfloat16"
    line = precision_line(assets.model_path, "bfloat16")
    assert "stored in bfloat16" in line and "float32 master" in line, line


# ------------------------------------------------------------------ W = 2 (gloo, 2 processes)
def _update(model, batch, dp=SINGLE):
    cfg = OptimConfig(lr=LR, warmup_steps=0)
    opt = make_optimizer(model.parameters(), cfg, cfg.lr)
    m = ppo_update(model, opt, make_scheduler(opt, cfg, 10), batch,
                   UpdateOptions(algo=AlgorithmConfig(), temperature=1.0, mini_batch_rows=16,
                                 micro_batch_rows=4, epochs=1, grad_clip=1e9),
                   seed=0, dp=dp)
    moments = {t.dtype for s in opt.state.values() for k, t in s.items() if k != "step"}
    return m, moments


def _worker(rank: int, world: int, init: str, out: str) -> None:
    torch.set_num_threads(1)
    dp = init_process_group("gloo", init, rank, world, 120.0)
    model, batch = _rollout()
    model = sharding.shard(model, torch.bfloat16)
    m, moments = _update(model, batch, dp=dp)
    full = sharding.full_model_state(model, rank0_only=True)
    if rank == 0:
        torch.save({"state": full, "grad_norm": float(m["actor/grad_norm"]),
                    "moments": [str(d) for d in moments],
                    "shards": sorted({str(p.dtype) for p in model.parameters()})}, out)
    finish()


def test_two_workers_train_as_one(tmp_path):
    out = tmp_path / "w2.pt"
    run_gloo_workers("tests.verl_core.training.test_mixed_precision", "_worker", tmp_path, out)
    w2 = torch.load(out)
    assert w2["shards"] == ["torch.float32"] and w2["moments"] == ["torch.float32"]
    model, batch = _rollout()
    w1_model = sharding.compute_in(copy.deepcopy(model), torch.bfloat16)
    m, moments = _update(w1_model, batch)
    assert moments == {torch.float32}
    # each worker's micro-batches are W = 1's (4 rows, same rows, same bf16 weights): the bf16
    # forward and backward are the same bits, only the float32 sums of the 4 micro-batch
    # gradients are in another order (a few ulp, 1e-7 relative). The norm sees that; a float32
    # forward on either side would move it by ~1e-2 relative (bf16's 2^-8 per op)
    assert w2["grad_norm"] == pytest.approx(float(m["actor/grad_norm"]), rel=1e-5)
    # Adam's first step lr * g / (|g| + eps) is lr * sign(g) up to eps / |g|: a 1e-7 relative
    # change of g moves it by ~1e-13, far under a weight's ulp, so the weights agree to an ulp
    for n, p in w1_model.state_dict().items():
        q = w2["state"][n]
        assert q.dtype == torch.float32
        torch.testing.assert_close(q, p, rtol=2 ** -22, atol=1e-12, msg=n)
    # and the update moved the masters (not a no-op comparison)
    moved = sum(int((w1_model.state_dict()[n] != t).sum()) for n, t in model.state_dict().items()
                if t.is_floating_point())
    assert moved > 0.5 * sum(t.numel() for t in model.state_dict().values()
                             if t.is_floating_point())


# ------------------------------------------------------------------ verl's keys
FSDP = "actor_rollout_ref.actor.fsdp_config."


@pytest.mark.parametrize("given", [
    {FSDP + "mixed_precision.param_dtype": "bf16", FSDP + "mixed_precision.reduce_dtype": "fp32",
     FSDP + "mixed_precision.buffer_dtype": "fp32", FSDP + "model_dtype": "fp32"},
    {FSDP + "mixed_precision": {"param_dtype": "bf16", "reduce_dtype": "fp32"}},
    {FSDP + "dtype": "bfloat16", "critic.model.fsdp_config.dtype": "bf16"},
])
def test_verl_precision_keys_map_to_model_dtype(given):
    assert to_ours(given) == {"model.dtype": "bfloat16"}


@pytest.mark.parametrize("given, words", [
    ({FSDP + "model_dtype": "bf16"}, "kept in float32"),
    ({FSDP + "mixed_precision.reduce_dtype": "bf16"}, "reduced and kept in float32"),
    ({FSDP + "mixed_precision.param_dtype": "fp16"}, "loss scaling"),
    ({FSDP + "dtype": "int8"}, "not a dtype"),
    ({FSDP + "dtype": "bf16", "critic.model.fsdp_config.dtype": "fp32"}, "both set model.dtype"),
])
def test_verl_precision_values_that_cannot_be_honoured_are_refused(given, words):
    with pytest.raises(ConfigError, match=words):
        to_ours(given)
