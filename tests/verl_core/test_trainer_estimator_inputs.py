"""The phases make the inputs an advantage estimator's traits ask for, and nothing else: the
greedy baseline rollout and its score (ReMax), Σπ² per token (optimal token baseline). Real tiny
model, real rollout/reward/advantage phases, no mocks."""
import pytest
import torch

from tests.presets import tiny_run
from verl_core.data.batch import batch_from_parquet_bytes, batch_to_parquet_bytes
from verl_core.reward.decode import decode_responses
from verl_core.rollout import SamplingParams
from verl_core.trainer import RLTrainer
from verl_core.training.advantage import compute_advantages
from verl_core.assets import prepare_assets


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    cfg = _cfg("grpo")
    return prepare_assets(cfg, str(tmp_path_factory.mktemp("work")), log=lambda *_: None)


def _cfg(name):
    return tiny_run(name, **{"data.train_batch_size": 4, "rollout.n": 3,
                             "actor.ppo_micro_batch_size": 12})


def _phases(name, assets):
    trainer = RLTrainer(_cfg(name), assets)
    try:
        batch, rollout_metrics = trainer.rollout(step=0)
        batch, reward_metrics = trainer.reward(batch)
        batch, _ = trainer.advantage(batch)
    finally:
        trainer.close()
    return trainer, batch, {**rollout_metrics, **reward_metrics}


def test_remax_rolls_out_and_scores_one_greedy_response_per_prompt(assets):
    trainer, batch, metrics = _phases("remax", assets)
    assert batch.sum_pi_squared is None and batch.values is None  # not asked for
    G, ids, mask = 3, batch.baseline_response_ids, batch.baseline_response_mask
    # the rows of a prompt share its greedy response, which is what greedy decoding gives
    for b in range(4):
        rows = slice(b * G, (b + 1) * G)
        assert (ids[rows] == ids[b * G]).all() and (mask[rows] == mask[b * G]).all()
    prompts = trainer.prompt_indices(0)
    p = trainer.prompts
    out = trainer.behaviour.engine.generate(p.train_ids[prompts], p.train_mask[prompts],
                                            SamplingParams(temperature=0.0, max_new_tokens=8))
    T = out.response_ids.shape[1]
    assert torch.equal(ids[::G, :T], out.response_ids) and not mask[::G, T:].any()
    # its score is the rule scorer's on the decoded greedy text, given to the prompt's G rows
    dec = decode_responses(trainer.tokenizer, out.response_ids, out.response_mask)
    res = trainer.scorer.score(batch.data_source[::G], dec.texts, batch.ground_truth[::G],
                               special_token=dec.special_token)
    assert batch.baseline_score.tolist() == [s for s in res.scores for _ in range(G)]
    assert metrics["reward/baseline_mean"] == pytest.approx(sum(res.scores) / 4)
    # outcome reward on the last token: A_t = score - baseline on every valid token
    expected = (batch.score - batch.baseline_score)[:, None] * batch.response_mask
    assert torch.allclose(batch.advantages, expected)
    # the columns cross the phase boundary (parquet) unchanged
    back = batch_from_parquet_bytes(batch_to_parquet_bytes(batch))
    for name in ("baseline_response_ids", "baseline_response_mask", "baseline_score"):
        assert torch.equal(getattr(back, name), getattr(batch, name)), name
    again, _ = compute_advantages(back, trainer.cfg.algorithm)
    assert torch.equal(again.advantages, batch.advantages)


@pytest.mark.parametrize("name", ["optimal_token_baseline", "tir_optimal_token_baseline"])
def test_optimal_token_baseline_gets_sum_pi_squared_from_the_rollout_policy(assets, name):
    _, batch, _ = _phases(name, assets)
    assert batch.baseline_response_ids is None and batch.baseline_score is None
    m = batch.response_mask.bool()
    sq, pi = batch.sum_pi_squared, batch.response_logprobs.exp()
    assert (sq[~m] == 0).all() and ((sq[m] > 0) & (sq[m] <= 1 + 1e-6)).all()
    # same weights and temperature as the log-probs: π_j² <= Σπ², so ||e_j - π||² >= 0
    w = 1 - 2 * pi + sq
    assert (w[m] >= -1e-4).all() and (pi[m] ** 2 <= sq[m] + 1e-4).all()
    assert torch.isfinite(batch.advantages).all() and (batch.advantages[~m] == 0).all()


def test_other_estimators_make_no_extra_inputs(assets):
    _, batch, metrics = _phases("grpo", assets)
    assert batch.baseline_response_ids is None and batch.sum_pi_squared is None
    assert "rollout/greedy_time_s" not in metrics and "reward/baseline_mean" not in metrics


def test_greedy_rollout_pads_prompts_to_the_worker_count_and_drops_the_copies(assets):
    # With W workers each generates a block of equal size: B = 4 prompts on W = 3 are padded to
    # 6 with copies of the last prompt; the kept rows and their width are those of one call.
    class ThreeWorkersInOneProcess:  # only the size is read; generation stays in this process
        size, rank, distributed = 3, 0, False

    trainer = RLTrainer(_cfg("remax"), assets)
    trainer.close()
    prompts = [5, 9, 11, 2]
    ids, mask = trainer.prompts.train_ids[prompts], trainer.prompts.train_mask[prompts]
    one = trainer.behaviour.generate_greedy(ids, mask)
    trainer.dp = ThreeWorkersInOneProcess()
    padded = trainer.behaviour.generate_greedy(ids, mask)
    assert torch.equal(padded.response_ids, one.response_ids)
    assert torch.equal(padded.response_mask, one.response_mask)
    assert one.response_mask[:, -1].any()  # trimmed: no column that is padding in every row
