import pytest
import torch

from verl_core.models import build_tiny_model
from verl_core.rollout import SamplingParams, make_engine
from verl_core.rollout.hf import filter_logits, sample_tokens
from verl_core.training.forward import response_logprobs


@pytest.fixture(scope="module")
def setup():
    model, tok = build_tiny_model(seed=0)
    enc = tok(["12+7=", "3-1=", "29+30=", "1+1="] * 3, return_tensors="pt", padding=True)
    eng = make_engine("hf", model=model, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id)
    return model, tok, enc.input_ids, enc.attention_mask, eng


def test_greedy_matches_transformers_generate(setup):
    model, tok, ids, mask, eng = setup
    out = eng.generate(ids, mask, SamplingParams(temperature=0, max_new_tokens=6))
    ref = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                         pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    ref = ref[:, ids.shape[1]:]
    T = out.response_ids.shape[1]
    assert torch.equal(out.response_ids, ref[:, :T])


def test_logprobs_match_a_full_forward(setup):
    model, tok, ids, mask, eng = setup
    out = eng.generate(ids, mask, SamplingParams(temperature=0.7, max_new_tokens=6, seed=3))
    lp, _ = response_logprobs(model, ids, mask, out.response_ids, out.response_mask, 0.7)
    assert torch.allclose(lp, out.logprobs, atol=1e-5)
    assert torch.all(out.logprobs[out.response_mask == 0] == 0)


def test_reproducible_under_seed_and_independent_of_micro_batch(setup):
    model, tok, ids, mask, eng = setup
    p = SamplingParams(temperature=1.0, max_new_tokens=6, seed=11)
    a = eng.generate(ids, mask, p)
    b = eng.generate(ids, mask, p)
    small = make_engine("hf", model=model, eos_token_id=tok.eos_token_id,
                        pad_token_id=tok.pad_token_id, micro_batch_size=5)
    c = small.generate(ids, mask, p)
    d = eng.generate(ids, mask, SamplingParams(temperature=1.0, max_new_tokens=6, seed=12))
    assert torch.equal(a.response_ids, b.response_ids)
    assert torch.equal(a.response_ids, c.response_ids)
    assert not torch.equal(a.response_ids, d.response_ids)


def test_greedy_sampling_picks_argmax_and_reports_its_logprob():
    logits = torch.tensor([[0.0, 1.0, 5.0, 2.0]])
    tok_, lp = sample_tokens(logits, torch.tensor([0.5]), SamplingParams(temperature=0))
    assert tok_.item() == 2 and torch.allclose(lp, torch.log_softmax(logits, -1)[:, 2])


def test_generation_stops_at_eos_and_pads_after_it():
    model, tok = build_tiny_model(seed=0)
    eos = tok.eos_token_id
    V, H = model.config.vocab_size, model.config.hidden_size
    head = torch.nn.Linear(H, V, bias=True)  # a head whose argmax is always <eos>
    with torch.no_grad():
        head.weight.zero_()
        head.bias.fill_(-30.0)
        head.bias[eos] = 30.0
    model.lm_head = head
    eng = make_engine("hf", model=model, eos_token_id=eos, pad_token_id=tok.pad_token_id)
    enc = tok(["1+1=", "22+3="], return_tensors="pt", padding=True)
    out = eng.generate(enc.input_ids, enc.attention_mask,
                       SamplingParams(temperature=1.0, max_new_tokens=8, seed=0))
    # every row emits <eos> first, so generation stops after one token
    assert out.response_ids.tolist() == [[eos], [eos]]
    assert out.response_mask.tolist() == [[1.0], [1.0]]
    # without EOS, rows run to max_new_tokens
    with torch.no_grad():
        head.bias[eos] = -30.0
        head.bias[tok.convert_tokens_to_ids("7")] = 30.0
    out = eng.generate(enc.input_ids, enc.attention_mask,
                       SamplingParams(temperature=1.0, max_new_tokens=5, seed=0))
    assert out.response_mask.sum().item() == 10 and tok.decode(out.response_ids[0]) == "77777"


def test_top_k_and_top_p_filtering():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    # top-k 2 keeps the two most likely tokens
    assert torch.isfinite(filter_logits(logits, 2, 1.0)).tolist() == [[True, True, False, False]]
    # top-p 0.7: 0.5 < 0.7 so the second token (mass before it 0.5) is kept, the third (0.8) not
    assert torch.isfinite(filter_logits(logits, -1, 0.7)).tolist() == [[True, True, False, False]]
    # top-p tiny keeps only the argmax
    assert torch.isfinite(filter_logits(logits, -1, 0.01)).tolist() == [[True, False, False, False]]
    # sampling never returns a filtered token, whatever the uniform
    u = torch.linspace(0, 0.999, 50)
    toks, _ = sample_tokens(logits.expand(50, 4), u, SamplingParams(temperature=1.0, top_k=2))
    assert set(toks.tolist()) == {0, 1}


def test_rows_draw_from_their_own_seeds_and_stop_at_their_own_limits(setup):
    from tests.engine_contract import assert_rows_draw_from_their_own_seeds_and_limits
    model, tok, ids, mask, eng = setup
    assert_rows_draw_from_their_own_seeds_and_limits(eng, ids, mask, tok.pad_token_id)


def test_distinct_rows_indexes_first_occurrences_in_order():
    from verl_core.training.forward import distinct_rows

    rows = torch.tensor([[3, 1], [0, 2], [3, 1], [0, 2], [5, 5]])
    first, inverse = distinct_rows(rows)
    assert first.tolist() == [0, 1, 4]
    assert inverse.tolist() == [0, 1, 0, 1, 2]
    assert torch.equal(rows[first][inverse], rows)


def test_a_prompts_samples_share_one_prefill(setup):
    """12 rows of 4 distinct prompts: the prefill forward sees 4 rows, every later one 12, and
    each row's samples match the same row generated alone (no sharing possible there)."""
    model, tok, ids, mask, eng = setup
    widths = []
    hook = model.register_forward_pre_hook(
        lambda _m, args, kw: widths.append(kw["input_ids"].shape[0]), with_kwargs=True)
    try:
        p = SamplingParams(temperature=1.0, max_new_tokens=5, seed=4)
        out = eng.generate(ids, mask, p)
    finally:
        hook.remove()
    assert widths[0] == 4 and set(widths[1:]) == {12}
    for r in (0, 5, 11):  # alone: the same draws (first_row), its own prefill
        one = eng.generate(ids[r:r + 1], mask[r:r + 1], p, first_row=r, total_rows=12)
        n = int(one.response_mask.sum())
        assert torch.equal(one.response_ids[0, :n], out.response_ids[r, :n])
        assert torch.allclose(one.logprobs[0], out.logprobs[r, :one.logprobs.shape[1]], atol=1e-5)
