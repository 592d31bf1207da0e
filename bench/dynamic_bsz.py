"""Update time: fixed micro-batches against token-budget ones (``actor.use_dynamic_bsz``).

The Qwen2-shaped ~30.9M model of ``bench/memory.py`` (V = 16,384, float32 on CPU), 32 rows:
prompts of 31 random ids, ragged responses of 4..256 random tokens (seeded, uniform). One
``ppo_update`` (one epoch, one mini-batch of all 32 rows, AdamW) each way, same weights:

- ``fixed``: micro-batches of 8 rows, every one padded to the batch's longest response (256);
- ``budget``: ``max_token_len`` = 8 x (31 + 256) tokens, the fixed micro-batch's padded size,
  so no micro-batch holds more tokens than a fixed one (peak activations: at most a fixed
  micro-batch's); rows of similar length grouped (runs of the rows sorted by length, cut where
  the next row would pass the budget, counting padded positions) and each micro-batch cut to its
  longest response.

Reported: wall time of each update, the ratio, micro-batches, and the padded tokens (rows x
(prompt + response width)) the forwards ran: the compute the budget saves on padding.

    python bench/dynamic_bsz.py
"""

from __future__ import annotations

import copy
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from memory import build  # noqa: E402  (the same model as the memory bench)

N, P, T_MAX, MICRO_ROWS = 32, 31, 256, 8


def ragged_batch(vocab: int, prompt_ids, prompt_mask):
    from verl_core.data.batch import Batch

    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(4, T_MAX + 1, (N,), generator=g)
    lengths[0] = T_MAX  # the batch's padded width is the longest response, 256
    response_ids = torch.randint(1, vocab - 1, (N, T_MAX), generator=g)
    mask = (torch.arange(T_MAX)[None, :] < lengths[:, None]).float()  # (N, T)
    adv = torch.randn(N, 1, generator=g) * mask  # (N, T)
    return Batch(prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=response_ids * mask.long(),
                 response_mask=mask, response_logprobs=torch.zeros(N, T_MAX),
                 group=torch.arange(N) // 4, uid=[str(i) for i in range(N)],
                 ground_truth=[""] * N, data_source=["bench"] * N, extra_info=[{}] * N,
                 advantages=adv)


def one_update(model, batch, max_token_len: int) -> tuple[float, int, int]:
    from verl_core.config import AlgorithmConfig, OptimConfig
    from verl_core.training.optim import make_optimizer, make_scheduler
    from verl_core.training.ppo import ppo_update

    padded, forwards = [0], [0]

    def count(m, args, kw):
        if torch.is_grad_enabled():
            padded[0] += kw["input_ids"].numel()
            forwards[0] += 1

    hook = model.register_forward_pre_hook(count, with_kwargs=True)
    cfg = OptimConfig(lr=1e-6, warmup_steps=0)
    opt = make_optimizer(model.parameters(), cfg, cfg.lr)
    t0 = time.perf_counter()
    ppo_update(model, opt, make_scheduler(opt, cfg, 10), batch, AlgorithmConfig(),
               temperature=1.0, mini_batch_rows=N, micro_batch_rows=MICRO_ROWS, epochs=1,
               grad_clip=1.0, seed=0, max_token_len=max_token_len,
               log_prob_max_token_len=max_token_len)
    dt = time.perf_counter() - t0
    hook.remove()
    return dt, forwards[0], padded[0]


def main() -> None:
    vocab = 16384
    model, prompt_ids, prompt_mask, _ = build(vocab)
    prompt_ids, prompt_mask = prompt_ids[:N], prompt_mask[:N]
    batch = ragged_batch(vocab, prompt_ids, prompt_mask)
    budget = MICRO_ROWS * (P + T_MAX)
    rows = {}
    for name, tokens in (("fixed", 0), ("budget", budget)):
        rows[name] = one_update(copy.deepcopy(model), batch, tokens)
    print(f"| update ({N} rows, responses 4..{T_MAX}, ~30.9M Qwen2-shaped, fp32 CPU) | wall s | "
          "micro-batches | padded tokens |")
    print("|---|---|---|---|")
    for name, (dt, k, padded) in rows.items():
        label = (f"fixed: {MICRO_ROWS} rows" if name == "fixed" else
                 f"token budget {budget} (use_dynamic_bsz)")
        print(f"| {label} | {dt:.2f} | {k} | {padded} |")
    print(f"ratio budget / fixed: {rows['budget'][0] / rows['fixed'][0]:.2f}")


if __name__ == "__main__":
    main()
