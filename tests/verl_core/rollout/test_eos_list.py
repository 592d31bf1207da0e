"""Every EOS of a model stops a response (issue 23 item 3), as verl/vLLM stop there.

A Qwen2.5-style folder ends a turn with ``<|im_end|>`` or ``<|endoftext|>``
(``generation_config.eos_token_id`` lists both; the tokenizer names one). The model here is the
Qwen stand-in's folder (its tokenizer, generation config and architecture, untied as Qwen2.5-7B
is) with weights set so that it is a bigram model: every attention and MLP output projection is
zero, so the last hidden state is the current token's embedding, a basis vector, and the LM head
maps it to the scripted next token (logit sqrt(hidden) = 8, every other logit 0). Greedy
decoding then follows two scripts that run on past their first stop token:

- row A (the chat prompt, last token ``\n``): ``#### 72<|endoftext|> 5<|im_end|>``
- row B (raw text ending `` is``): ``The<|im_end|>x<|endoftext|>``

so an engine that stops at one EOS only returns a longer response, and ``#### 72`` scores 0.
The vLLM engine (``-m vllm``, in .venv-vllm) returns the same tokens as the hf engine.
"""
from __future__ import annotations

import json

import pytest
import torch

from tests.standins import folder_eos_ids, gsm8k_rows, llama3_folder, qwen_folder
from verl_core.models import load_causal_lm, load_tokenizer
from verl_core.models.loading import ModelLoadError
from verl_core.reward import RewardScorer, decode_responses
from verl_core.reward.decode import stop_token_ids
from verl_core.rollout import SamplingParams, make_engine

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=8)
SCRIPT_A = ["####", "\u0120" + "72", "<|endoftext|>", "\u0120" + "5", "<|im_end|>"]
SCRIPT_B = ["The", "<|im_end|>", "x", "<|endoftext|>"]


def _bigram_folder(folder, tok, chains: list[list[int]]):
    """Overwrite the weights in the Qwen stand-in ``folder`` with the bigram model of the module
    docstring: each chain ``[u0, u1, ...]`` makes ``u(i+1)`` the greedy successor of ``ui``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    gen = (folder / "generation_config.json").read_bytes()  # the folder's own EOS list
    cfg = AutoConfig.from_pretrained(str(folder))
    cfg.tie_word_embeddings = False
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    tokens = sorted({t for c in chains for t in c})
    assert len(tokens) <= cfg.hidden_size
    basis = {t: i for i, t in enumerate(tokens)}  # token -> its embedding's hidden dimension
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.norm.weight.fill_(1.0)
        emb, head = model.model.embed_tokens.weight, model.lm_head.weight
        head.zero_()
        for t, d in basis.items():
            emb[t].zero_()
            emb[t, d] = 1.0  # rmsnorm makes it sqrt(hidden) in dimension d
        for c in chains:
            for u, v in zip(c, c[1:]):
                head[v, basis[u]] = 1.0
    model.save_pretrained(str(folder), safe_serialization=True)
    (folder / "generation_config.json").write_bytes(gen)


@pytest.fixture(scope="module")
def taught(tmp_path_factory):
    folder = qwen_folder(tmp_path_factory.mktemp("qwen-bigram") / "m")
    tok = load_tokenizer(str(folder))
    row = gsm8k_rows(1)[0]
    prompts = [tok.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=False),
               "The answer is"]
    last = [tok(p, add_special_tokens=False).input_ids[-1] for p in prompts]
    responses = [tok.convert_tokens_to_ids(SCRIPT_A), tok.convert_tokens_to_ids(SCRIPT_B)]
    assert [tok.convert_ids_to_tokens(r) for r in responses] == [SCRIPT_A, SCRIPT_B]  # in vocab
    _bigram_folder(folder, tok, [[last[0], *responses[0]], [last[1], *responses[1]]])
    enc = tok(prompts, add_special_tokens=False, padding=True, return_tensors="pt")
    return folder, tok, enc.input_ids, enc.attention_mask, responses


def _hf(folder, tok, eos_ids):
    return make_engine("hf", model=load_causal_lm(str(folder)), eos_token_ids=eos_ids,
                       pad_token_id=tok.pad_token_id)


def test_the_eos_set_is_tokenizer_generation_config_and_config_together(tmp_path):
    q = qwen_folder(tmp_path / "q")
    tok = load_tokenizer(str(q))
    want = tuple(sorted(tok.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])))
    assert tok.eos_token_id == tok.convert_tokens_to_ids("<|im_end|>")  # the tokenizer's one
    assert stop_token_ids(tok) == want == tuple(sorted(folder_eos_ids(q)))
    l3 = llama3_folder(tmp_path / "l", shards=1)
    tok = load_tokenizer(str(l3))
    assert len(stop_token_ids(tok)) == 3 and tok.eos_token_id in stop_token_ids(tok)
    assert stop_token_ids(tok) == tuple(sorted(folder_eos_ids(l3)))
    # a single int in generation_config.json and one more id in config.json: the union
    gen = json.loads((q / "generation_config.json").read_text())
    (q / "generation_config.json").write_text(json.dumps({**gen, "eos_token_id": 5}))
    cfg = json.loads((q / "config.json").read_text())
    (q / "config.json").write_text(json.dumps({**cfg, "eos_token_id": [7]}))
    assert stop_token_ids(load_tokenizer(str(q))) == tuple(sorted({5, 7, want[-1]}))
    # an EOS that is not a token id is named with its file, before anything is loaded
    (q / "generation_config.json").write_text(json.dumps({**gen, "eos_token_id": ["</s>"]}))
    with pytest.raises(ModelLoadError, match=r"generation_config\.json: eos_token_id"):
        load_tokenizer(str(q))


def test_hf_engine_stops_at_every_eos_and_the_stopped_response_scores_1(taught):
    folder, tok, ids, mask, responses = taught
    out = _hf(folder, tok, stop_token_ids(tok)).generate(ids, mask, GREEDY)
    # A stops at <|endoftext|>, B at <|im_end|>; the stop token is kept with mask 1, then padding
    for i, k in enumerate([3, 2]):
        assert out.response_ids[i, :k].tolist() == responses[i][:k]
        assert out.response_mask[i].tolist() == [1.0] * k + [0.0] * (out.response_mask.shape[1] - k)
        assert out.response_ids[i, k:].eq(tok.pad_token_id).all()
    assert out.response_ids.shape[1] == 3  # nothing generated after every row stopped
    dec = decode_responses(tok, out.response_ids, out.response_mask)
    assert dec.texts == ["#### 72", "The"] and dec.special_token == [False, False]
    res = RewardScorer("auto").score(["openai/gsm8k"], dec.texts[:1], ["72"],
                                     special_token=dec.special_token[:1])
    assert res.scores == [1.0]  # as verl scores it


def test_with_the_tokenizers_one_eos_the_response_runs_on_and_scores_0(taught):
    """What happened before: only <|im_end|> stops, so A runs on past <|endoftext|>."""
    folder, tok, ids, mask, responses = taught
    one = _hf(folder, tok, (tok.eos_token_id,)).generate(ids, mask, GREEDY)
    assert one.response_ids[0].tolist() == responses[0]  # on to its <|im_end|>
    assert one.response_ids[1].tolist() == responses[1][:2] + [tok.pad_token_id] * 3
    text = tok.decode(responses[0][:-1], skip_special_tokens=False)
    assert text == "#### 72<|endoftext|> 5"  # scored with the old cut at <|im_end|> only:
    assert RewardScorer("auto").score(["openai/gsm8k"], [text], ["72"],
                                      special_token=[True]).scores == [0.0]
    # the old single-EOS keyword still works (callers with one EOS)
    a = make_engine("hf", model=load_causal_lm(str(folder)), eos_token_id=tok.eos_token_id,
                    pad_token_id=tok.pad_token_id).generate(ids, mask, GREEDY)
    assert torch.equal(a.response_ids, one.response_ids)
    with pytest.raises(ValueError, match="eos_token_ids"):
        make_engine("hf", model=None, pad_token_id=0)


@pytest.mark.vllm
def test_vllm_engine_stops_where_the_hf_engine_stops(taught):
    folder, tok, ids, mask, _ = taught
    want = _hf(folder, tok, stop_token_ids(tok)).generate(ids, mask, GREEDY)
    eng = make_engine("vllm", model_path=str(folder), eos_token_ids=stop_token_ids(tok),
                      pad_token_id=tok.pad_token_id, dtype="float32", gpu_memory_utilization=0.3,
                      cpu_kv_cache_gib=0.25, enforce_eager=True, free_cache_engine=False,
                      max_model_len=256, seed=0)
    got = eng.generate(ids, mask, GREEDY)
    assert torch.equal(got.response_ids, want.response_ids)
    assert torch.equal(got.response_mask, want.response_mask)
