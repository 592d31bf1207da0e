"""Offline stand-ins for the Hugging Face folders our users bring (no hub here).

Each builder writes a real model folder (``config.json``, safetensors, ``generation_config.json``,
tokenizer files) that ``AutoTokenizer``/``AutoModelForCausalLM.from_pretrained`` load as they load
the real thing; only the sizes are small (random, seeded weights; a byte-level BPE trained here
with ``tokenizers`` on a few lines). The shapes of the families are kept, because they are what
breaks a trainer written against one tokenizer:

- ``qwen_folder``: Qwen2.5-Instruct-style. ``Qwen2ForCausalLM``, tied embeddings, the vocabulary
  padded past the tokenizer (Qwen's 151,936 rows for 151,665 tokens), ChatML with Qwen2.5's tool
  template, no BOS, ``eos_token=<|im_end|>``, ``pad_token=<|endoftext|>`` and
  ``generation_config.eos_token_id = [<|im_end|>, <|endoftext|>]``; float32 (``dtype=`` to change).
- ``llama3_folder``: Llama-3.1-Instruct-style. ``LlamaForCausalLM`` saved in bfloat16 as several
  safetensors shards, untied embeddings, a template that starts with ``{{ bos_token }}`` and a BOS
  post-processor, **no pad token**, ``eos_token=<|eot_id|>`` and three EOS ids in
  ``generation_config``.
- ``chat_template=None`` on either gives the "tokenizer without a chat template" family.
- ``gsm8k_rows``: rows exactly as verl's ``examples/data_preprocess/gsm8k.py`` writes them.
- ``scripted_chat``/``ScriptedLM``: chat prompts and a policy whose samples are scripted, per
  row and turn, for multi-turn rollouts (the tests' and ``bench/agent.py``'s).

Heads are 2 of 32 so vLLM's CPU attention kernel accepts them (it has head sizes 32, 64, 80, ...).
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import torch

# A few lines for the BPE to learn merges from: GSM8K-like text, digits and the answer marker
CORPUS = [
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May.",
    "How many clips did Natalia sell altogether in April and May?",
    "Let's think step by step and output the final answer after \"####\".",
    "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting.",
    "Natalia sold 48/2 = <<48/2=24>>24 clips in May. #### 72",
    "0 1 2 3 4 5 6 7 8 9 10 11 12 + - * / = #### The answer is",
    "You are a helpful assistant. Call a tool when it helps: <tool_call> </tool_call>",
]

QWEN_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
# Qwen2.5's chat template (tools, tool calls in hermes format, tool responses), written out here
QWEN25_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}"
    "{%- else %}{{- '" + QWEN_SYSTEM + "' }}{%- endif %}"
    "{{- \"\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query."
    "\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>\" }}"
    "{%- for tool in tools %}{{- \"\\n\" }}{{- tool | tojson }}{%- endfor %}"
    "{{- \"\\n</tools>\\n\\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": "
    "<function-name>, \\\"arguments\\\": <args-json-object>}\\n</tool_call><|im_end|>\\n\" }}"
    "{%- else %}{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\n" + QWEN_SYSTEM + "<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first) or "
    "(message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- elif message.role == 'assistant' %}{{- '<|im_start|>' + message.role }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' }}{{- tool_call.name }}{{- '\", \"arguments\": ' }}"
    "{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != 'tool') %}"
    "{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response>' }}"
    "{%- if loop.last or (messages[loop.index0 + 1].role != 'tool') %}{{- '<|im_end|>\\n' }}"
    "{%- endif %}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")

LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    " + message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% endif %}")

QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>",
                 "<tool_response>", "</tool_response>"]
LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                   "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>"]


def _bpe(specials: list[str], vocab_size: int, bos: str | None):
    """A byte-level BPE ``tokenizers.Tokenizer`` (GPT-2/Qwen/Llama-3 style) trained on CORPUS;
    with ``bos`` a post-processor that prepends it, as Llama-3's does."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    if bos is not None:
        bid = tok.token_to_id(bos)
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bid)])
    return tok


def qwen_tokenizer(chat_template: str | None = QWEN25_TEMPLATE):
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(tokenizer_object=_bpe(QWEN_SPECIALS, 600, None),
                                   eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = chat_template
    return fast


def llama3_tokenizer(chat_template: str | None = LLAMA3_TEMPLATE):
    """No pad token, as Llama-3's own tokenizer has none."""
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(tokenizer_object=_bpe(LLAMA3_SPECIALS, 600, "<|begin_of_text|>"),
                                   bos_token="<|begin_of_text|>", eos_token="<|eot_id|>")
    fast.chat_template = chat_template
    return fast


def _save(model, tok, folder: Path, eos_ids: list[int], **save_kwargs) -> Path:
    from transformers import GenerationConfig

    folder.mkdir(parents=True, exist_ok=True)
    model.generation_config = GenerationConfig(
        bos_token_id=model.config.bos_token_id, eos_token_id=eos_ids,
        **({"pad_token_id": model.config.pad_token_id}
           if model.config.pad_token_id is not None else {}),
        do_sample=True, temperature=0.7, top_p=0.8)
    model.save_pretrained(folder, safe_serialization=True, **save_kwargs)
    tok.save_pretrained(folder)
    return folder


def qwen_folder(folder, *, hidden: int = 64, layers: int = 2, dtype: torch.dtype = torch.float32,
                chat_template: str | None = QWEN25_TEMPLATE, seed: int = 0) -> Path:
    """A Qwen2.5-Instruct-shaped folder (see the module docstring); returns its path."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tok = qwen_tokenizer(chat_template)
    ids = tok.convert_tokens_to_ids
    cfg = Qwen2Config(vocab_size=(len(tok) + 63) // 64 * 64 + 64,  # padded past the tokenizer
                      hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
                      tie_word_embeddings=True, bos_token_id=None,
                      eos_token_id=ids("<|im_end|>"), pad_token_id=ids("<|endoftext|>"))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(cfg).to(dtype)
    return _save(model, tok, Path(folder), [ids("<|im_end|>"), ids("<|endoftext|>")])


def llama3_folder(folder, *, hidden: int = 64, layers: int = 2, shards: int = 10,
                  chat_template: str | None = LLAMA3_TEMPLATE, seed: int = 0) -> Path:
    """A Llama-3.1-Instruct-shaped folder in bfloat16, ``shards`` safetensors files, no pad."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = llama3_tokenizer(chat_template)
    ids = tok.convert_tokens_to_ids
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=hidden, intermediate_size=3 * hidden,
                      num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1,
                      max_position_embeddings=512, tie_word_embeddings=False,
                      bos_token_id=ids("<|begin_of_text|>"),
                      eos_token_id=[ids("<|end_of_text|>"), ids("<|eom_id|>"), ids("<|eot_id|>")],
                      pad_token_id=None)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    return _save(model, tok, Path(folder), list(cfg.eos_token_id),
                 max_shard_size=max(total // shards, 1))


GSM8K_INSTRUCTION = "Let's think step by step and output the final answer after \"####\"."


def gsm8k_rows(n: int, *, split: str = "train", seed: int = 0) -> list[dict]:
    """``n`` GSM8K-style rows laid out as verl's ``examples/data_preprocess/gsm8k.py`` writes
    them (``data_source``, chat ``prompt``, ``ability``, ``reward_model.ground_truth``,
    ``extra_info``); the questions are generated sums so the answers are known."""
    import random

    rng = random.Random(seed)
    rows = []
    for i in range(n):
        a, b = rng.randint(1, 50), rng.randint(1, 50)
        question = f"Natalia sold {a} clips in April and {b} clips in May. How many clips in all?"
        solution = f"Natalia sold {a}+{b} = <<{a}+{b}={a + b}>>{a + b} clips. #### {a + b}"
        rows.append({
            "data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": question + " " + GSM8K_INSTRUCTION}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(a + b)},
            "extra_info": {"split": split, "index": i, "answer": solution, "question": question},
        })
    return rows


def gsm8k_parquet(path, n: int, **kwargs) -> Path:
    """``gsm8k_rows`` written as a parquet file (verl's ``train.parquet``/``test.parquet``)."""
    import pandas as pd

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(gsm8k_rows(n, **kwargs)).to_parquet(path)
    return path


def folder_eos_ids(folder) -> list[int]:
    """The EOS list of a folder's ``generation_config.json`` (what verl/vLLM stop at)."""
    eos = json.loads((Path(folder) / "generation_config.json").read_text())["eos_token_id"]
    return eos if isinstance(eos, list) else [eos]


class ScriptedLM(torch.nn.Module):
    """A causal LM whose samples are known, for multi-turn rollouts: row r's turn k (the number
    of assistant headers in its context, less the prompt's) is ``scripts[r][k]``, and the model
    puts probability ~1 on that script's next token, so sampling at any temperature draws it
    (log-prob ~0); past a script's end it repeats its last token. It keeps each row's context
    itself, as a KV cache would: the prefill (the left-padded contexts) finds each row and its
    headers, a decode step appends one token."""

    def __init__(self, tok, scripts: dict[int, list[list[int]]], prompts: list[list[int]]):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.V, self.scripts, self.prompts = len(tok), scripts, prompts
        self.header = tok("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
        self.ctx: list[list[int]] = []
        self.rows: list[int] = []  # per context: its row (the prompt it starts with)
        self.starts: list[list[int]] = []  # per context: where its assistant headers start

    def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=True,
                past_key_values=None, **_):
        h = len(self.header)
        if input_ids.shape[1] > 1:  # prefill: the left-padded contexts
            self.ctx = [row[m.bool()].tolist() for row, m in zip(input_ids, attention_mask)]
            self.rows = [next(r for r, p in enumerate(self.prompts) if c[:len(p)] == p)
                         for c in self.ctx]
            self.starts = [[p for p in range(len(c) - h + 1) if c[p:p + h] == self.header]
                           for c in self.ctx]
        else:
            for c, s, t in zip(self.ctx, self.starts, input_ids[:, 0].tolist()):
                c.append(t)
                if c[-h:] == self.header:
                    s.append(len(c) - h)
        logits = torch.full((len(self.ctx), 1, self.V), -1e4)
        for i, (c, row, s) in enumerate(zip(self.ctx, self.rows, self.starts)):
            script = self.scripts[row][len(s) - 1]
            offset = len(c) - (s[-1] + h)
            logits[i, 0, script[min(offset, len(script) - 1)]] = 1e4
        return SimpleNamespace(logits=logits + 0 * self.w)


def hf_engine(model, tok):
    """The ``hf`` rollout engine sampling ``model``, stopping on ``tok``'s EOS."""
    from verl_core.rollout import make_engine
    return make_engine("hf", model=model, eos_token_ids=[tok.eos_token_id],
                       pad_token_id=tok.pad_token_id)


def scripted_chat(tok, turns_of_rows: list[list[str]], tools: list[dict],
                  question: str = "What is 1234 * 5678?"):
    """``(prompts, model, scripts)`` for multi-turn rollouts on ``tok``'s chat template (the
    Qwen2.5 stand-in's): row r's prompt is a system turn ``row r`` (so the rows differ) and the
    user's ``question``, rendered with ``tools`` and the generation prompt; the model
    (:class:`ScriptedLM`) writes ``turns_of_rows[r][k]`` then ``<|im_end|>`` as its turn k."""
    eot = tok("<|im_end|>", add_special_tokens=False)["input_ids"]
    prompts, scripts = [], {}
    for r, turns in enumerate(turns_of_rows):
        chat = [{"role": "system", "content": f"row {r}"}, {"role": "user", "content": question}]
        p = tok(tok.apply_chat_template(chat, tools=tools, tokenize=False,
                                        add_generation_prompt=True),
                add_special_tokens=False)["input_ids"]
        prompts.append(p)
        scripts[r] = [tok(t, add_special_tokens=False)["input_ids"] + eot for t in turns]
    return prompts, ScriptedLM(tok, scripts, prompts), scripts
