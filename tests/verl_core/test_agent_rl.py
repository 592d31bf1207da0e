"""Multi-turn RL with tool calls end to end (issue 25), on the calculator task: the tiny model,
warm-started briefly on call transcripts, its real multi-turn rollouts through the real tool
host, the trainer's forward and the store (the plain loop SIGKILLed in a tool call:
test_resume_table.py's multi-turn chain). Nothing is mocked: what the
model samples is whatever it samples, and the checks hold for any sample (every row's spans are
checked against the chat template's ids of the observations the batch stores)."""
import dataclasses
import json

import pytest
import torch
import yaml

from tests.gloo_workers import finish, run_gloo_workers
from tests.presets import TINY, tiny_run
from verl_core.agent.tools import ToolConfigError
from verl_core.agent.turns import observation_ids
from verl_core.data.batch import batch_from_parquet_bytes, batch_to_parquet_bytes
from verl_core.store import sha256_hex
from verl_core.trainer import RLTrainer
from verl_core.assets import prepare_assets
from verl_core.training.dist import init_process_group
from verl_core.training.forward import batched_logprobs


# the calculator task at the tiny run's sizes; 100 warm-start steps on 64 transcripts that all
# call the tool teach the call's format (the model then calls in most rows, sampled or greedy)
CALC = {**TINY, "data.synthetic_task": "calculator", "model.warmup_sft_steps": 100,
        "model.warmup_mixed_steps": 0}


@pytest.fixture(scope="module")
def calc(tmp_path_factory):
    """(config, assets) of the calculator task, prepared once for the module."""
    cfg = tiny_run(**CALC)
    return cfg, prepare_assets(cfg, str(tmp_path_factory.mktemp("calc")), log=lambda *_: None)


@pytest.fixture(scope="module")
def rolled(calc):
    """A trainer and its step-1 rollout batch (reference log-probs and all)."""
    cfg, assets = calc
    trainer = RLTrainer(cfg, assets)
    try:
        batch, metrics = trainer.rollout(1)
        yield trainer, batch, metrics
    finally:
        trainer.close()


def test_the_batch_is_the_sampled_ids_and_the_templates_ids_of_each_observation(rolled):
    _assert_spans(*rolled)


def _assert_spans(trainer, batch, metrics):
    """Every row: sampled spans and the chat template's ids of each stored observation, back to
    back; the loss mask 1 exactly on the sampled spans; log-probs on sampled tokens only."""
    tok = trainer.tokenizer
    assert batch.turns is not None and batch.response_attention_mask is not None
    calls = 0
    for i, row in enumerate(batch.turns):
        real = int(batch.response_attention_mask[i].sum())
        ids = batch.response_ids[i, :real].tolist()
        assert not batch.response_attention_mask[i, real:].any()  # right-padded
        expected_mask = [0.0] * real
        pos = 0
        for turn in row["turns"]:
            s, e = turn["sampled"]
            assert s == pos  # turns follow each other with nothing in between
            expected_mask[s:e] = [1.0] * (e - s)
            pos = e
            if "appended" in turn:
                a, b = turn["appended"]
                assert a == e
                obs = observation_ids(tok, [{"role": "tool", "content": r["observation"]}
                                            for r in turn["results"]],
                                      end_of_turn=tok.eos_token, tools=trainer.prompts.tool_schemas)
                assert ids[a:b] == obs[:b - a]  # the template's ids, cut only at the budget
                calls += len(turn["results"])
                pos = b
        assert pos == real
        assert batch.response_mask[i, :real].tolist() == expected_mask
        # rollout log-probs exist for sampled tokens only
        assert not batch.response_logprobs[i][batch.response_mask[i] == 0].any()
    assert calls > 0  # the warm start taught the call: some rows made one
    assert metrics["num_turns/mean"] > 1 and metrics["tool_calls/mean"] == calls / batch.num_rows
    assert metrics["response/observation_fraction"] > 0


def test_the_same_rollout_again_stores_the_same_batch(rolled):
    """Issue 40: a multi-turn batch stores nothing measured (the calls' latencies are metrics),
    so the step's rollout run again is stored under the same content hash."""
    trainer, batch, metrics = rolled
    again, again_metrics = trainer.rollout(1)
    stored = [sha256_hex([batch_to_parquet_bytes(b)]) for b in (batch, again)]
    assert stored[0] == stored[1]
    assert "tool_calls/latency_s_mean" in again_metrics


def test_the_trainers_log_probs_equal_the_rollouts_on_sampled_tokens(rolled):
    _assert_trainer_agrees(*rolled[:2])


def _assert_trainer_agrees(trainer, batch):
    logp = batched_logprobs(trainer.actor.model, batch, trainer.cfg.rollout.temperature, 8)
    sampled = batch.response_mask.bool()
    bound = _rounding_bound(trainer, batch)
    diff = (logp - batch.response_logprobs)[sampled].abs().max().item()
    assert diff <= bound, (diff, bound)
    # and the trainer reads the observations: without them the sampled tokens after a tool's
    # response are predicted from another context
    blind = batched_logprobs(trainer.actor.model, batch.replace(response_attention_mask=None),
                             trainer.cfg.rollout.temperature, 8)
    after = sampled & (batch.response_mask.cumsum(-1) < torch.arange(
        1, batch.response_mask.shape[1] + 1))  # sampled tokens that follow a hole
    assert after.any()
    assert (blind - batch.response_logprobs)[after].abs().max().item() > 1000 * bound


def _rounding_bound(trainer, batch) -> float:
    """Same float32 weights and kernels, other shapes (the sampler decodes against a KV cache,
    prefilling each turn's context, a worker a block of rows; the trainer runs whole sequences):
    each logit differs by the rounding of its dot products, at most n·u·|terms| with u = 2^-24
    and n the chained terms, 2 x layers x (hidden + intermediate) = 1280 for the tiny model,
    relative to the largest logit magnitude; |Δ log-softmax| <= 2 max|Δ logit|."""
    from verl_core.training.forward import response_logits
    cfg = trainer.actor.model.config
    n = 2 * cfg.num_hidden_layers * (cfg.hidden_size + cfg.intermediate_size)
    with torch.no_grad():
        biggest = float(response_logits(trainer.actor.model, batch.prompt_ids, batch.prompt_mask,
                                        batch.response_ids, batch.response_attn).abs().max())
    return 2 * n * 2.0 ** -24 * biggest / trainer.cfg.rollout.temperature


def test_a_multi_turn_batch_round_trips_through_parquet(rolled):
    _, batch, _ = rolled
    back = batch_from_parquet_bytes(batch_to_parquet_bytes(batch))
    T = back.response_ids.shape[1]
    assert T == int(batch.response_attention_mask.sum(-1).max())
    for name in ("response_ids", "response_mask", "response_attention_mask",
                 "response_logprobs", "ref_logprobs"):
        a, b = getattr(batch, name), getattr(back, name)
        if a is not None:
            assert torch.equal(a[:, :T], b), name
    assert back.turns == batch.turns and back.extra_info == batch.extra_info


def test_an_update_on_a_multi_turn_batch_scores_the_transcripts_last_line(rolled):
    trainer, batch, _ = rolled
    scored, metrics = trainer.reward(batch)
    from verl_core.reward.calculator import compute_score
    from verl_core.reward.scoring import decoded
    texts = decoded(trainer.tokenizer, batch).texts
    assert scored.score.tolist() == [compute_score(t, g) for t, g in
                                     zip(texts, batch.ground_truth)]
    # the scorer saw verl's extra fields of a multi-turn row
    assert all(set(e) >= {"num_turns", "tool_rewards"} for e in scored.extra_info)


def test_the_evaluation_scores_multi_turn_transcripts_with_verls_extra_fields(rolled):
    trainer, _, _ = rolled
    seen, score = [], trainer.scorer.score

    def recording(sources, texts, truths, infos=None, **kw):  # the real scorer, its inputs kept
        seen.extend(infos or [])
        return score(sources, texts, truths, infos, **kw)

    trainer.scorer.score = recording
    try:
        metrics, samples = trainer.evaluate_with_samples(2, step=1)
    finally:
        trainer.scorer.score = score
    assert len(seen) == len(trainer.prompts.val_rows)
    assert all(e["num_turns"] >= 1 and isinstance(e["tool_rewards"], list) for e in seen)
    assert 0.0 <= metrics["val/accuracy"] <= 1.0 and len(samples) == 2


def test_a_tool_class_that_cannot_be_built_is_refused_before_any_work(tmp_path):
    bad = tmp_path / "broken_tool.py"
    bad.write_text("raise ImportError('no such backend')\n")
    conf = tmp_path / "tools.yaml"
    conf.write_text(yaml.safe_dump({"tools": [{
        "class_name": f"{bad}:Broken", "config": {},
        "tool_schema": {"type": "function", "function": {
            "name": "broken", "description": "d", "parameters": {"type": "object"}}}}]}))
    cfg = tiny_run(**{**CALC, "rollout.tool_config_path": str(conf)})
    work = tmp_path / "work"
    with pytest.raises(ToolConfigError, match=r"broken_tool\.py.*no such backend"):
        prepare_assets(cfg, str(work), log=lambda *_: None)
    assert not (work / "model").exists()  # no warm start was paid for


# ------------------------------------------------------------------ W = 2 equals W = 1
def _worker(rank: int, world: int, init: str, cfg_json: str, assets_json: str, out: str):
    torch.set_num_threads(1)
    from verl_core.config import RunConfig
    from verl_core.assets import Assets
    dp = init_process_group("gloo", init, rank, world, 120.0)
    cfg = RunConfig.from_dict(json.loads(cfg_json))
    trainer = RLTrainer(cfg, Assets(**json.loads(assets_json)), dp)
    batch, metrics = trainer.rollout(1)
    trainer.close()
    if rank == 0:
        torch.save({"batch": batch_to_parquet_bytes(batch), "metrics": metrics}, out)
    finish()


def test_two_workers_roll_out_the_batch_of_one(calc, rolled, tmp_path):
    _assert_two_workers_roll_out_the_batch_of_one(calc[0], calc[1], *rolled, tmp_path)


def _assert_two_workers_roll_out_the_batch_of_one(cfg, assets, trainer, batch, metrics, tmp_path):
    out = tmp_path / "w2.pt"
    run_gloo_workers("tests.verl_core.test_agent_rl", "_worker", tmp_path,
                     json.dumps(cfg.to_dict()), json.dumps(dataclasses.asdict(assets)), out)
    got = torch.load(out, weights_only=False)
    w2 = batch_from_parquet_bytes(got["batch"])
    w1 = batch_from_parquet_bytes(batch_to_parquet_bytes(batch))
    # each worker samples its block of rows with the draws the whole batch gives those rows, and
    # runs their tool calls: the same tokens, turns and calls
    assert torch.equal(w2.response_ids, w1.response_ids)
    assert torch.equal(w2.response_mask, w1.response_mask)
    assert torch.equal(w2.response_attention_mask, w1.response_attention_mask)
    assert w2.turns == w1.turns
    # log-probs of a block of 16 rows, not 32: float32 rounding of other GEMM shapes only
    diff = (w2.response_logprobs - w1.response_logprobs).abs().max().item()
    assert diff <= _rounding_bound(trainer, batch), diff
    assert got["metrics"]["tool_calls/mean"] == metrics["tool_calls/mean"]


# ------------------------------------------------------------------ the vllm engine
@pytest.fixture(scope="module")
def rolled_vllm(calc):
    """The same trainer and rollout with ``rollout.engine=vllm`` (vLLM's CPU backend in
    .venv-vllm, or CUDA), on the same warm-started model."""
    cfg, assets = calc
    cfg = tiny_run(**CALC, **{"rollout.engine": "vllm"})
    trainer = RLTrainer(cfg, assets)
    try:
        batch, metrics = trainer.rollout(1)
        yield cfg, trainer, batch, metrics
    finally:
        trainer.close()


@pytest.mark.vllm
def test_on_vllm_the_batch_is_the_sampled_ids_and_the_templates_ids_and_the_trainer_agrees(
        rolled_vllm):
    _, trainer, batch, metrics = rolled_vllm
    assert type(trainer.behaviour.engine).__name__ == "VLLMEngine"
    _assert_spans(trainer, batch, metrics)
    _assert_trainer_agrees(trainer, batch)


@pytest.mark.vllm
def test_on_vllm_two_workers_roll_out_the_batch_of_one(calc, rolled_vllm, tmp_path):
    cfg, trainer, batch, metrics = rolled_vllm
    _assert_two_workers_roll_out_the_batch_of_one(cfg, calc[1], trainer, batch, metrics,
                                                  tmp_path)


def test_a_multi_turn_partial_rollout_goes_on_by_turns_and_is_sampled_again_the_same(calc,
                                                                                    tmp_path):
    # rollout.partial_rollout on the calculator task (issue 42): turn 0 of step 2 samples with
    # the weights of step 0, the turns after with those of step 1 (the background rollout waits
    # between turns for update 1 to begin); a fresh worker that rebuilds the queue samples the
    # same transcripts and log-probs, byte for byte
    from tests.verl_core.engine.test_worker_async import _step, _worker
    from verl_core.engine.assets import publish_assets
    from verl_core.store import RunStore

    cfg = tiny_run(**{**CALC, "rollout.max_staleness": 2, "rollout.partial_rollout": True,
                      "algorithm.rollout_is": "token", "total_steps": 3,
                      "checkpoint.checkpoint_interval": 2, "checkpoint.async_save": False})
    uri = str(tmp_path / "store")
    index = publish_assets(RunStore(uri), calc[1])
    w = _worker(uri, cfg, index)
    try:
        got = [_step(w, s) for s in range(3)]
    finally:
        w.close()
    from verl_core.engine.worker import get_batch

    batch = get_batch(RunStore(uri), got[2][0])
    assert batch.meta["partial_unit"] == "turn" and batch.meta["policy_version"] == 0
    turns = max(len(row["turns"]) for row in batch.turns)
    assert turns >= 2  # some row called the tool and went on
    assert batch.meta["partial_versions"] == [0] + [1] * (turns - 1)
    assert got[2][1]["rollout/prefetched"] == 1.0
    fresh = _worker(uri, cfg, index)
    try:
        assert fresh.rollout(2)[0] == got[2][0]
    finally:
        fresh.close()
