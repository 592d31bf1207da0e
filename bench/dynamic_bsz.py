"""Update time and peak memory: fixed micro-batches, token-budget ones (``actor.use_dynamic_bsz``)
and token budget + remove-padding (``actor.use_remove_padding``), in one run.

Two models, float32 on CPU: the tiny Llama-style demo model (``verl_core/models/tiny.py``) and
the Qwen2-shaped ~30.9M model of ``bench/memory.py`` (V = 16,384). 32 rows: prompts of 31 random
ids, ragged responses of 4..256 random tokens (seeded, uniform; one row at 256). One
``ppo_update`` (one epoch, one mini-batch of all 32 rows, AdamW) per configuration, same weights,
each configuration in a fresh subprocess (so its peak RSS is its own):

- ``fixed``: micro-batches of 8 rows, every one padded to the batch's longest response (256);
- ``budget``: ``max_token_len`` = 8 x (31 + 256), the fixed micro-batch's padded size: rows of
  similar length grouped, padding counted, each micro-batch cut to its longest response;
- ``budget+rmpad``: the same budget, counting real tokens (a packed micro-batch runs no
  padding), Karmarkar-Karp-balanced micro-batches, each run as one sequence with per-row
  attention (per-row SDPA, the CPU choice);
- ``budget+rmpad (mask)`` (30.9M only): the same with SDPA over the packed sequence under a
  block-diagonal mask (``forward.CPU_PACKED_ATTENTION = "mask"``): the measurement behind the
  CPU choice.

Reported: wall time of the update, its ratio to ``fixed``, the child's peak RSS (``ru_maxrss``)
and its growth during the update (the activations and optimizer state; the weights, batch and
interpreter came before), micro-batches, and the positions the forwards ran (padding included).

    python bench/dynamic_bsz.py            # both models, every configuration
    python bench/dynamic_bsz.py --quick    # the tiny model only
"""

from __future__ import annotations

import copy
import json
import os
import resource
import subprocess
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

N, P, T_MAX, MICRO_ROWS = 32, 31, 256, 8
BUDGET = MICRO_ROWS * (P + T_MAX)
CONFIGS = {"fixed": (0, False, "boundaries"), "budget": (BUDGET, False, "boundaries"),
           "budget+rmpad": (BUDGET, True, "boundaries"),
           "budget+rmpad (mask)": (BUDGET, True, "mask")}


def model_and_prompts(which: str):
    """``(model, prompt_ids (N, P), prompt_mask (N, P), vocab)``."""
    g = torch.Generator().manual_seed(0)
    if which == "qwen2-30.9M":
        from memory import build
        model, prompt_ids, prompt_mask, _ = build(16384)
        return model, prompt_ids[:N], prompt_mask[:N], 16384
    from verl_core.models.tiny import build_tiny_model
    model, tok = build_tiny_model()
    V = model.config.vocab_size
    return model, torch.randint(1, V, (N, P), generator=g), torch.ones(N, P, dtype=torch.long), V


def ragged_batch(vocab: int, prompt_ids, prompt_mask):
    from verl_core.data.batch import Batch

    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(4, T_MAX + 1, (N,), generator=g)
    lengths[0] = T_MAX  # the batch's padded width is the longest response, 256
    response_ids = torch.randint(1, vocab - 1, (N, T_MAX), generator=g)
    mask = (torch.arange(T_MAX)[None, :] < lengths[:, None]).float()  # (N, T)
    adv = torch.randn(N, 1, generator=g) * mask  # (N, T)
    return Batch(prompt_ids=prompt_ids, prompt_mask=prompt_mask,
                 response_ids=response_ids * mask.long(), response_mask=mask,
                 response_logprobs=torch.zeros(N, T_MAX), group=torch.arange(N) // 4,
                 uid=[str(i) for i in range(N)], ground_truth=[""] * N,
                 data_source=["bench"] * N, extra_info=[{}] * N, advantages=adv)


def one(which: str, config: str) -> dict:
    """One configuration's update, in this process."""
    from verl_core.config import AlgorithmConfig, OptimConfig
    from verl_core.training import forward
    from verl_core.training.optim import make_optimizer, make_scheduler
    from verl_core.training.ppo import UpdateOptions, ppo_update

    max_token_len, rmpad, attention = CONFIGS[config]
    forward.CPU_PACKED_ATTENTION = attention
    model, prompt_ids, prompt_mask, vocab = model_and_prompts(which)
    batch = ragged_batch(vocab, prompt_ids, prompt_mask)
    positions = [0]

    def count(m, args, kw):
        if torch.is_grad_enabled():
            positions[0] += kw["input_ids"].numel()

    model.register_forward_pre_hook(count, with_kwargs=True)
    cfg = OptimConfig(lr=1e-6, warmup_steps=0)
    opt = make_optimizer(model.parameters(), cfg, cfg.lr)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    t0 = time.perf_counter()
    metrics = ppo_update(model, opt, make_scheduler(opt, cfg, 10), batch,
                         UpdateOptions(algo=AlgorithmConfig(), temperature=1.0, mini_batch_rows=N,
                                       micro_batch_rows=MICRO_ROWS, epochs=1, grad_clip=1.0,
                                       max_token_len=max_token_len,
                                       log_prob_max_token_len=max_token_len, remove_padding=rmpad),
                         seed=0)
    dt = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"wall_s": dt, "peak_gb": peak / 1e9, "growth_gb": (peak - before) / 1e9,
            "micro_batches": metrics["update/micro_batches"], "positions": positions[0],
            "padding_fraction": metrics["update/padding_fraction"],
            "real_tokens": int(batch.prompt_mask.sum() + batch.response_mask.sum())}


def main() -> None:
    if sys.argv[1:2] == ["--one"]:
        print(json.dumps(one(sys.argv[2], sys.argv[3])))
        return
    models = ["tiny"] if "--quick" in sys.argv else ["tiny", "qwen2-30.9M"]
    print(f"{N} rows, prompts {P}, responses 4..{T_MAX}; fixed = {MICRO_ROWS} rows, "
          f"budget = {BUDGET} tokens; float32, {torch.get_num_threads()} threads\n")
    print("| model | configuration | update s | x fixed | peak RSS GB | RSS growth GB | "
          "micro-batches | positions run | padding |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for which in models:
        base = None
        for config in CONFIGS:
            if config.endswith("(mask)") and which == "tiny":
                continue
            out = subprocess.run([sys.executable, __file__, "--one", which, config],
                                 capture_output=True, text=True, check=True)
            r = json.loads(out.stdout.strip().splitlines()[-1])
            base = base or r["wall_s"]
            print(f"| {which} | {config} | {r['wall_s']:.2f} | {r['wall_s'] / base:.2f} | "
                  f"{r['peak_gb']:.2f} | {r['growth_gb']:.2f} | {r['micro_batches']:.0f} | "
                  f"{r['positions']:,} | {r['padding_fraction']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
