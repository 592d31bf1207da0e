"""One BOS per prompt (issue 23 item 1), on an offline Llama-3-style stand-in.

The stand-in is what a Llama-3 folder gives ``AutoTokenizer``: a byte-level BPE (trained here on a
few lines with ``tokenizers``), a post-processor that prepends ``<|begin_of_text|>``, and a chat
template that starts with ``{{ bos_token }}``. Tokenising the rendered template with the
tokenizer's special tokens would put two BOS in front of every prompt; verl's ``RLHFDataset``
tokenises it with ``add_special_tokens=False``.
"""

from __future__ import annotations

import pandas as pd
import pytest

from verl_core.data.batch import encode_prompts
from verl_core.data.dataset import render_prompt
from verl_core.validation import dataset_frame

BOS, EOT, PAD = "<|begin_of_text|>", "<|eot_id|>", "<|end_of_text|>"
LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    " + message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% endif %}")
LINES = ["Natalia sold clips to 48 of her friends in April.",
         "How many clips did Natalia sell altogether in April and May?",
         "Let's think step by step and output the final answer after ####.",
         "Weng earns $12 an hour for babysitting. #### 72"]


def build_llama3_style_tokenizer(chat_template: str | None = LLAMA3_TEMPLATE):
    """A ``PreTrainedTokenizerFast`` shaped like Llama-3's (see the module docstring); pad is
    ``<|end_of_text|>`` because padding the batch needs one."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials = [BOS, PAD, "<|start_header_id|>", "<|end_header_id|>", EOT]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(LINES, trainers.BpeTrainer(
        vocab_size=400, special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, tok.token_to_id(BOS))])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOT,
                                   pad_token=PAD)
    fast.chat_template = chat_template
    return fast


@pytest.fixture(scope="module")
def llama3_tok():
    return build_llama3_style_tokenizer()


CHATS = [[{"role": "user", "content": LINES[1]}],
         [{"role": "system", "content": LINES[2]}, {"role": "user", "content": LINES[0]}],
         [{"role": "user", "content": "48"}]]


def _bos_counts(ids, mask, bos_id):
    """(number of BOS, first real token) of each left-padded row."""
    out = []
    for row, m in zip(ids.tolist(), mask.tolist()):
        real = [t for t, k in zip(row, m) if k]
        out.append((real.count(bos_id), real[0]))
    return out


def test_stand_in_adds_a_bos_itself(llama3_tok):
    # the premise: both the template and the post-processor write a BOS
    bos = llama3_tok.bos_token_id
    assert llama3_tok("hi")["input_ids"][0] == bos
    assert render_prompt(CHATS[0], llama3_tok).startswith(BOS)


def test_chat_templated_prompts_start_with_exactly_one_bos(llama3_tok):
    texts = [render_prompt(c, llama3_tok) for c in CHATS]
    ids, mask = encode_prompts(llama3_tok, texts, max_prompt_length=128)
    bos = llama3_tok.bos_token_id
    assert _bos_counts(ids, mask, bos) == [(1, bos)] * len(CHATS)
    # and the tokens are the template's text exactly (verl: add_special_tokens=False)
    first = ids[0][mask[0].bool()].tolist()
    assert first == llama3_tok(texts[0], add_special_tokens=False)["input_ids"]


def test_plain_prompts_of_a_tokenizer_without_template_keep_its_bos():
    # no template: the joined message text has no BOS of its own, the tokenizer adds its one
    tok = build_llama3_style_tokenizer(chat_template=None)
    texts = [render_prompt(c, tok) for c in CHATS]
    assert not any(t.startswith(BOS) for t in texts)
    ids, mask = encode_prompts(tok, texts, max_prompt_length=128)
    assert _bos_counts(ids, mask, tok.bos_token_id) == [(1, tok.bos_token_id)] * len(CHATS)


@pytest.mark.parametrize("template", [LLAMA3_TEMPLATE, None])
def test_validation_length_check_counts_the_tokens_training_encodes(template):
    # the GX check's prompt_length is each row's real-token count in encode_prompts, BOS once
    tok = build_llama3_style_tokenizer(chat_template=template)
    df = pd.DataFrame({"data_source": ["gsm8k"] * len(CHATS), "prompt": CHATS,
                       "reward_model": [{"style": "rule", "ground_truth": "72"}] * len(CHATS)})
    frame, _ = dataset_frame(df, tok)
    _, mask = encode_prompts(tok, [render_prompt(c, tok) for c in CHATS], max_prompt_length=128)
    assert frame["prompt_length"].tolist() == mask.sum(1).tolist()
    # one BOS more than the template's text without specials would be the double-BOS bug
    if template:
        no_specials = [len(tok(render_prompt(c, tok), add_special_tokens=False)["input_ids"])
                       for c in CHATS]
        assert frame["prompt_length"].tolist() == no_specials
