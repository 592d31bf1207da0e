"""Fixtures shared by the checkpoint tests: stores, managers and a tiny Llama factory."""

from __future__ import annotations

import pytest
import torch

from verl_core.checkpoint import CheckpointManager, RunStore


@pytest.fixture
def store(tmp_path) -> RunStore:
    return RunStore(str(tmp_path / "store"))


@pytest.fixture
def manager(store) -> CheckpointManager:
    return CheckpointManager(store, gc_grace_s=0.0, chunk_bytes=64 << 10)


@pytest.fixture(scope="session")
def tiny_llama():
    """``make(seed=0, layers=2) -> LlamaForCausalLM``: random init, no download."""
    from transformers import LlamaConfig, LlamaForCausalLM

    def make(seed: int = 0, layers: int = 2, hidden: int = 32, vocab: int = 128,
             tie: bool = False):
        cfg = LlamaConfig(hidden_size=hidden, intermediate_size=2 * hidden,
                          num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                          vocab_size=vocab, max_position_embeddings=64, tie_word_embeddings=tie)
        torch.manual_seed(seed)
        return LlamaForCausalLM(cfg).eval()

    return make


@pytest.fixture(scope="session")
def word_tokenizer():
    """``make(vocab=128) -> PreTrainedTokenizerFast``: words "0" … "123" plus 4 specials."""
    def make(vocab: int = 128):
        from tokenizers import Tokenizer, models, pre_tokenizers
        from transformers import PreTrainedTokenizerFast

        words = ["[UNK]", "[PAD]", "<s>", "</s>"] + [str(i) for i in range(vocab - 4)]
        tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
        return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]",
                                       bos_token="<s>", eos_token="</s>")

    return make


# ------------------------------------------------------------------ resume equivalence helpers
def _make_trainer(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.GELU(), torch.nn.Dropout(0.3),
                                torch.nn.Linear(16, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + s))
    return model, opt, sched


def _train_step(model, opt, sched):
    import random

    import numpy as np

    x = torch.randn(8, 6)  # torch RNG
    scale = float(np.random.rand())  # numpy RNG
    target = random.randrange(3)  # python RNG
    loss = (model(x)[:, target] * scale).pow(2).mean()  # dropout: torch RNG again
    loss.backward()
    opt.step()
    sched.step()
    opt.zero_grad()


def _seed_all(seed: int):
    import random

    import numpy as np

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


@pytest.fixture
def resume_equivalence():
    """``check(manager, n=6, k=3)``: weights after every step of an uninterrupted run equal, bit
    for bit, those of a run checkpointed at step k, rebuilt from nothing and resumed."""
    from verl_core.checkpoint import capture_rng_state, restore_rng_state

    def check(manager, n: int = 6, k: int = 3):
        _seed_all(0)
        model, opt, sched = _make_trainer(0)
        straight = []
        for _ in range(n):
            _train_step(model, opt, sched)
            straight.append({k_: v.clone() for k_, v in model.state_dict().items()})

        _seed_all(0)
        model, opt, sched = _make_trainer(0)
        for _ in range(k):
            _train_step(model, opt, sched)
        manager.save(k, {"policy": model.state_dict(), "optimizer": opt.state_dict(),
                         "scheduler": sched.state_dict(), "rng": capture_rng_state()},
                     {"step": k})
        del model, opt, sched
        _seed_all(12345)  # the resumed process starts from different RNG and weights
        model, opt, sched = _make_trainer(7)
        groups, meta, info = manager.load("auto")
        assert meta["step"] == k and info.step == k
        model.load_state_dict(groups["policy"])
        opt.load_state_dict(groups["optimizer"])
        sched.load_state_dict(groups["scheduler"])
        restore_rng_state(groups["rng"])
        for i in range(k, n):
            _train_step(model, opt, sched)
            for name, v in model.state_dict().items():
                assert torch.equal(v, straight[i][name]), f"step {i + 1} {name} differs"

    return check
