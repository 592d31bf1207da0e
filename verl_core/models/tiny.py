"""Tiny Llama-style causal LM + character tokenizer, built from scratch (no download).

The CPU default of the project: about 0.2M parameters, fast enough to train for real on two
cores. The supervised warm start that gives it partial accuracy lives in ``training/sft.py``.
"""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from verl_core.models.tokenizer import build_char_tokenizer


def build_tiny_model(*, hidden_size: int = 64, layers: int = 2, heads: int = 2,
                     max_positions: int = 128, seed: int = 0, chat_template: str | None = None):
    """Return ``(model, tokenizer)``: a randomly initialised Llama-style model (seeded) and the
    character tokenizer it was sized for (with ``chat_template``, for multi-turn tasks)."""
    tok = build_char_tokenizer(chat_template)
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=hidden_size,
        intermediate_size=4 * hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(cfg)
    model.generation_config.pad_token_id = tok.pad_token_id
    model.eval()
    return model, tok
