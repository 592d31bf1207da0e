"""A small character-level tokenizer built with the `tokenizers` library.

Used by the tiny-model factory so CPU runs need no download. Every printable ASCII character is
one token, which suits verifiable tasks (arithmetic) and keeps the vocabulary at ~100 tokens.
Saved as a normal ``tokenizer.json`` that ``AutoTokenizer.from_pretrained`` loads.
"""

from __future__ import annotations

import string

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)
CHARS = "".join(c for c in string.printable if c not in "\t\r\x0b\x0c")  # 96 incl. space and \n


CHAR_CHAT_TEMPLATE = (
    "{{ bos_token }}{%- for m in messages -%}"
    "{%- if m['role'] == 'assistant' -%}{{ m['content'] }}{{ eos_token }}"
    "{%- elif m['role'] == 'tool' -%}{{ '>' + m['content'] + '\\n' }}"
    "{%- else -%}{{ m['content'] }}"
    "{%- endif -%}"
    "{%- endfor -%}")
"""The tiny model's chat template for multi-turn rollouts (the calculator task): as short as a
character model needs. ``<bos>``, then: a user message is its text; an assistant turn ends with ``<eos>``; a tool
response is ``>`` + its text + a newline, after which the next turn (the answer's line)
starts. No generation prompt, no system text, and the tools' schemas are not shown (the warm
start teaches the one tool's call)."""


def build_char_tokenizer(chat_template: str | None = None) -> PreTrainedTokenizerFast:
    """Return a fast tokenizer: one token per character, <bos>/<eos>/<pad>/<unk> specials, and
    ``chat_template`` (None: no template; prompts are their messages' text).

    Prompts are left-padded (generation appends on the right)."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for c in CHARS:
        vocab[c] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    # "[\s\S]" matches any character, newline included: each becomes its own pre-token.
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    # Encoding a prompt adds <bos> like most HF causal-LM tokenizers do.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, vocab[BOS])])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )
    if chat_template:
        fast.chat_template = chat_template
    return fast
