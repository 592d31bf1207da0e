"""What scorers see: responses cut at the first EOS, special tokens kept, and a special token
before the EOS never earns reward. Crafted token ids through the project's character tokenizer."""

import textwrap

import pytest
import torch

from verl_core.data.batch import Batch
from verl_core.models.tokenizer import build_char_tokenizer
from verl_core.reward.decode import decode_responses, special_token_ids
from verl_core.reward.manager import RewardScorer
from verl_core.reward.scoring import score_batch


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def ids(tok, *parts) -> list[int]:
    """Token ids of ``parts``: plain strings are spelled one character per token, special token
    names (``"<pad>"``) are that one special token."""
    out = []
    for p in parts:
        out += [tok.convert_tokens_to_ids(p)] if p in tok.all_special_tokens else \
            tok.convert_tokens_to_ids(list(p))
    return out


def padded(tok, rows: list[list[int]], generated: list[int] | None = None):
    """(N, T) ids right-padded with <pad> and the (N, T) mask: the first ``generated[i]`` tokens
    of row i were generated (default: all of the row's tokens)."""
    T = max(len(r) for r in rows)
    resp = torch.full((len(rows), T), tok.pad_token_id, dtype=torch.long)
    mask = torch.zeros(len(rows), T)
    for i, r in enumerate(rows):
        resp[i, :len(r)] = torch.tensor(r)
        mask[i, :len(r) if generated is None else generated[i]] = 1.0
    return resp, mask


def test_char_tokenizer_specials(tok):
    assert special_token_ids(tok) == {tok.pad_token_id, tok.bos_token_id, tok.eos_token_id,
                                      tok.unk_token_id}


def test_cut_at_first_eos_and_keep_special_tokens(tok):
    rows = [ids(tok, "1", "<pad>", "12", "<eos>"),    # pad inside the answer
            ids(tok, "11", "<bos>", "7"),             # bos inside, no EOS (hit max tokens)
            ids(tok, "19", "<eos>"),                  # clean
            ids(tok, "19", "<eos>", "5", "<bos>"),    # whatever follows the EOS is not scored
            ids(tok, "7"),                            # no EOS, then padding (mask 0)
            ids(tok, "<eos>")]                        # empty answer
    resp, mask = padded(tok, rows)
    dec = decode_responses(tok, resp, mask)
    assert dec.texts == ["1<pad>12", "11<bos>7", "19", "19", "7", ""]
    assert dec.special_token == [True, True, False, False, False, False]
    # what the old decode (skip_special_tokens=True) made of the first two: rewarded answers
    assert tok.batch_decode(resp[:2], skip_special_tokens=True) == ["112", "117"]


def test_padding_beyond_the_mask_is_not_part_of_the_response(tok):
    # a generated <pad> is a special token in the answer; the batch's right-padding is not
    resp, mask = padded(tok, [ids(tok, "7", "<pad>", "<pad>")] * 2, generated=[2, 1])
    dec = decode_responses(tok, resp, mask)
    assert dec.texts == ["7<pad>", "7"] and dec.special_token == [True, False]
    assert decode_responses(tok, [ids(tok, "8", "<eos>")]).texts == ["8"]  # lists, no mask


# ---------------------------------------------------------------- through the reward phase
def _batch(tok, responses: list[list[int]], ground_truths: list[str], data_source: str) -> Batch:
    n = len(responses)
    resp, mask = padded(tok, responses)
    return Batch(prompt_ids=torch.full((n, 2), tok.bos_token_id), prompt_mask=torch.ones(n, 2),
                 response_ids=resp, response_mask=mask, response_logprobs=torch.zeros(mask.shape),
                 group=torch.arange(n), uid=[str(i) for i in range(n)],
                 ground_truth=list(ground_truths), data_source=[data_source] * n,
                 extra_info=[{}] * n, pad_id=tok.pad_token_id)


@pytest.mark.parametrize("scorer", ["auto", "arithmetic"])
def test_special_token_inside_an_arithmetic_answer_is_wrong(tok, scorer):
    batch = _batch(tok, [ids(tok, "1", "<pad>", "12", "<eos>"),  # decoded as "112" before
                         ids(tok, "11", "<bos>", "7"),           # "117" before
                         ids(tok, "1", "<unk>", "9", "<eos>"),
                         ids(tok, "112", "<eos>", "<pad>"),      # right answers still score
                         ids(tok, "19")],
                   ["112", "117", "19", "112", "19"], "synthetic/arithmetic")
    with RewardScorer(scorer) as rs:
        out, metrics = score_batch(batch, rs, tok)
    assert out.score.tolist() == [0.0, 0.0, 0.0, 1.0, 1.0]
    assert metrics["reward/special_token_fraction"] == pytest.approx(3 / 5)


@pytest.mark.parametrize("scorer", ["auto", "gsm8k"])
def test_special_token_anywhere_before_eos_fails_gsm8k(tok, scorer):
    batch = _batch(tok, [ids(tok, "so #### 1", "<pad>", "12", "<eos>"),   # "#### 112" before
                         ids(tok, "7 apples", "<bos>", " #### 7", "<eos>"),
                         ids(tok, "so #### 7", "<eos>", "<pad>")],
                   ["112", "7", "7"], "openai/gsm8k")
    with RewardScorer(scorer) as rs:
        out, _ = score_batch(batch, rs, tok)
    assert out.score.tolist() == [0.0, 0.0, 1.0]


def test_custom_scorers_get_the_same_text(tok, tmp_path):
    (tmp_path / "echo.py").write_text(textwrap.dedent('''
        def exact(data_source, solution_str, ground_truth, extra_info):
            return {"score": float(solution_str == ground_truth), "seen": solution_str}
    '''))
    batch = _batch(tok, [ids(tok, "1", "<pad>", "12", "<eos>"), ids(tok, "11", "<bos>", "7"),
                         ids(tok, "19", "<eos>", "<pad>")],
                   ["112", "117", "19"], "custom/task")
    with RewardScorer(f"{tmp_path / 'echo.py'}:exact") as rs:
        out, metrics = score_batch(batch, rs, tok)
        dec = decode_responses(tok, batch.response_ids, batch.response_mask)
        seen = rs.score(batch.data_source, dec.texts, batch.ground_truth,
                        special_token=dec.special_token).extras["seen"]
    assert out.score.tolist() == [0.0, 0.0, 1.0]
    assert seen == ["1<pad>12", "11<bos>7", "19"]
    assert metrics["reward/timeouts"] == 0.0 and metrics["reward/timeout_fraction"] == 0.0


def test_reward_phase_reports_timeouts(tok, tmp_path):
    (tmp_path / "slow.py").write_text(textwrap.dedent('''
        import time

        def compute_score(data_source, solution_str, ground_truth, extra_info):
            if solution_str == "9":
                time.sleep(3600)
            return 1.0
    '''))
    batch = _batch(tok, [ids(tok, "9", "<eos>"), ids(tok, "1", "<eos>"), ids(tok, "2", "<eos>"),
                         ids(tok, "3", "<eos>")], ["1"] * 4, "custom/task")
    with RewardScorer(str(tmp_path / "slow.py"), timeout_s=0.3, timeout_score=-1.0) as rs:
        out, metrics = score_batch(batch, rs, tok)
    assert out.score.tolist() == [-1.0, 1.0, 1.0, 1.0]
    assert metrics["reward/timeouts"] == 1.0 and metrics["reward/timeout_fraction"] == 0.25
