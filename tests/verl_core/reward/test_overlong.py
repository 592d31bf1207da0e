"""DAPO's overlong reward shaping (verl_core/reward/overlong.py) against verl's formula
(verl/workers/reward_manager/dapo.py) on hand-computed values, and where it applies."""
import pytest
import torch

from verl_core.config import ConfigError, preset
from verl_core.data.batch import Batch
from verl_core.models.tokenizer import build_char_tokenizer
from verl_core.reward.manager import RewardScorer
from verl_core.reward.overlong import OverlongBuffer, overlong_penalty
from verl_core.reward.scoring import score_batch
from verl_core.validation import declared_score_range


def test_penalty_matches_verls_formula_by_hand():
    # max_resp_len 20, buffer 4: expected_len = 16; penalty = min(-(L - 16) / 4 * 0.5, 0)
    lengths = torch.tensor([0, 10, 16, 17, 18, 19, 20])
    got = overlong_penalty(lengths, max_resp_len=20, buffer_len=4, penalty_factor=0.5)
    #      L<=16: 0    17: -1/4*.5  18: -2/4*.5  19: -3/4*.5  20: -4/4*.5 (the whole budget)
    assert got.tolist() == [0.0, 0.0, 0.0, -0.125, -0.25, -0.375, -0.5]
    assert got.dtype == torch.float32


def _verl(valid_response_length: int, max_resp_len: int, buffer_len: int, factor: float):
    """verl's lines, verbatim but for the names (a 0-d int tensor, as verl's mask sum)."""
    valid_response_length = torch.tensor(valid_response_length)
    expected_len = max_resp_len - buffer_len
    exceed_len = valid_response_length - expected_len
    overlong_reward = min(-exceed_len / buffer_len * factor, 0)
    return float(overlong_reward)


@pytest.mark.parametrize("max_len,buf,factor", [(20, 4, 1.0), (10, 3, 0.7), (8, 8, 2.5)])
def test_penalty_is_verls_bit_for_bit(max_len, buf, factor):
    lengths = torch.arange(0, max_len + 1)
    got = overlong_penalty(lengths, max_resp_len=max_len, buffer_len=buf, penalty_factor=factor)
    assert got.tolist() == [_verl(int(n), max_len, buf, factor) for n in lengths]


def _batch(tok, texts, T):
    ids = [tok.encode(t, add_special_tokens=False) + [tok.eos_token_id] for t in texts]
    n = len(ids)
    response = torch.full((n, T), tok.pad_token_id, dtype=torch.long)
    mask = torch.zeros(n, T)
    for i, x in enumerate(ids):
        response[i, :len(x)] = torch.tensor(x)
        mask[i, :len(x)] = 1
    return Batch(prompt_ids=torch.ones(n, 1, dtype=torch.long),
                 prompt_mask=torch.ones(n, 1, dtype=torch.long), response_ids=response,
                 response_mask=mask, response_logprobs=torch.zeros(n, T),
                 group=torch.zeros(n, dtype=torch.long), uid=["0"] * n,
                 ground_truth=["12"] * n, data_source=["synthetic/arithmetic"] * n, extra_info=[{}] * n)


def test_the_reward_phase_adds_it_to_the_score():
    tok = build_char_tokenizer()
    # responses "12" (right, 3 tokens with EOS), "12   " (right, 6), "9" (wrong, 2)
    batch = _batch(tok, ["12", "12   ", "9"], T=6)
    cfg = preset("grpo", **{"rollout.max_new_tokens": 6, "reward.overlong_buffer_enable": True,
                            "reward.overlong_buffer_len": 2, "reward.overlong_penalty_factor": 1.0,
                            "reward.overlong_buffer_log": True})
    over = OverlongBuffer.of(cfg)
    assert over == OverlongBuffer(max_resp_len=6, buffer_len=2, penalty_factor=1.0, log=True)
    with RewardScorer.from_config(cfg.reward) as scorer:
        plain, _ = score_batch(batch, scorer, tok)
        details: dict = {}
        shaped, m = score_batch(batch, scorer, tok, overlong=over, details=details)
    # expected_len 4: lengths 3, 6, 2 -> penalties 0, -(6-4)/2*1 = -1, 0
    assert plain.score.tolist() == [1.0, 1.0, 0.0]
    assert shaped.score.tolist() == [1.0, 0.0, 0.0]
    assert details["score"].tolist() == details["acc"].tolist() == [1.0, 1.0, 0.0]
    assert m["reward/overlong_fraction"] == pytest.approx(1 / 3)
    assert m["reward/overlong_reward_mean"] == pytest.approx(-1 / 3)
    # the validated score range makes room for it
    assert declared_score_range(cfg) == (declared_score_range(preset("grpo"))[0] - 1.0,
                                         declared_score_range(preset("grpo"))[1])
    assert OverlongBuffer.of(preset("grpo")) is None


def test_config_names_the_key_and_the_fix():
    with pytest.raises(ConfigError, match=r"reward.overlong_buffer_len=0: must be >= 1"):
        preset("grpo", **{"reward.overlong_buffer_enable": True})
    with pytest.raises(ConfigError, match=r"reward.overlong_buffer_len=9: must be <= "
                                          r"rollout.max_new_tokens=8"):
        preset("grpo", **{"reward.overlong_buffer_enable": True, "reward.overlong_buffer_len": 9,
                          "rollout.max_new_tokens": 8})
