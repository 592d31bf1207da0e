"""LoRA (rank 8, all-linear, PEFT) against full fine-tuning on the Qwen2-shaped ~30.9M model of
``bench/memory.py`` (V = 16,384), float32 on CPU, KL loss on (so full fine-tuning holds a
reference copy and LoRA uses the base with its adapters off), in one run.

Each configuration in a fresh subprocess (its peak RSS its own): the model, the reference (full:
a second model; LoRA: none), AdamW over what trains; the batch of ``bench/dynamic_bsz.py`` (32
rows, prompts of 31 ids, ragged responses of 4..256 tokens, budget + remove-padding); then
``UPDATES`` rounds of reference log-probs + one ``ppo_update`` (timed: the step's model work),
and two checkpoints into a content-addressed store (``CheckpointManager``: after the first and
after the second update) as the trainer writes them: full: ``policy`` + ``optimizer`` (+ the
reference, a shared group); LoRA: ``policy`` = the adapters, ``base`` (shared, frozen) +
``optimizer``. Reported: the update's mean wall time, peak RSS, the first checkpoint's bytes,
and the *new* bytes the second checkpoint wrote (what every later checkpoint costs).

    python bench/lora.py
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

UPDATES = 3
CONFIGS = ("full", "lora r=8")


def _store_bytes(root: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(root) for f in fs)


def one(config: str) -> dict:
    from dynamic_bsz import BUDGET, N, ragged_batch
    from memory import build
    from verl_core.checkpoint.manager import CheckpointManager
    from verl_core.config import AlgorithmConfig, OptimConfig
    from verl_core.models.config import ModelConfig
    from verl_core.models.lora import apply_lora, split_state
    from verl_core.training.forward import batched_logprobs
    from verl_core.training.optim import make_optimizer, make_scheduler
    from verl_core.training.ppo import UpdateOptions, ppo_update

    model, ids, mask, _ = build(16384)
    params_total = sum(p.numel() for p in model.parameters())
    lora = config.startswith("lora")
    if lora:
        model = apply_lora(model, ModelConfig(lora_rank=8, lora_alpha=16.0), seed=0)
        ref = model
    else:
        ref, _, _, _ = build(16384)  # the frozen copy full fine-tuning keeps
        ref.requires_grad_(False)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    batch = ragged_batch(16384, ids[:N], mask[:N])
    algo = AlgorithmConfig(use_kl_loss=True, kl_loss_coef=0.01)
    cfg = OptimConfig(lr=1e-4, warmup_steps=0)
    opt = make_optimizer(model.parameters(), cfg, cfg.lr)
    sched = make_scheduler(opt, cfg, 10)
    walls, saves = [], []
    with tempfile.TemporaryDirectory() as root:
        mgr = CheckpointManager(root)
        for k in range(UPDATES):
            t0 = time.perf_counter()
            with ref.disable_adapter() if lora else contextlib.nullcontext():
                refs = batched_logprobs(ref, batch, 1.0, 8, max_token_len=BUDGET,
                                        remove_padding=True)
            ppo_update(model, opt, sched, batch.replace(ref_logprobs=refs),
                       UpdateOptions(algo=algo, temperature=1.0, mini_batch_rows=N,
                                     micro_batch_rows=8, epochs=1, grad_clip=1.0,
                                     max_token_len=BUDGET, log_prob_max_token_len=BUDGET,
                                     remove_padding=True),
                       seed=k)
            walls.append(time.perf_counter() - t0)
            if k < 2:  # the checkpoints after the first and the second update
                state = model.state_dict()
                groups = {"optimizer": opt.state_dict()}
                if lora:
                    groups["policy"], groups["base"] = split_state(model, state)
                else:
                    groups["policy"], groups["reference"] = state, ref.state_dict()
                before = _store_bytes(os.path.join(root, "objects"))
                mgr.save(k + 1, groups)
                saves.append(_store_bytes(os.path.join(root, "objects")) - before)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"update_s": sum(walls[1:]) / (len(walls) - 1), "peak_gb": peak / 1e9,
            "first_mb": saves[0] / 1e6, "new_mb": saves[1] / 1e6,
            "trainable": trainable, "params": params_total}


def main() -> None:
    if sys.argv[1:2] == ["--one"]:
        print(json.dumps(one(sys.argv[2])))
        return
    print(f"Qwen2-shaped ~30.9M model, float32, {torch.get_num_threads()} threads; "
          f"mean of updates 2..{UPDATES}\n")
    print("| configuration | trainable params | update s | x full | peak RSS GB | "
          "1st checkpoint MB | each later checkpoint: new MB | x full |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    base = None
    for config in CONFIGS:
        out = subprocess.run([sys.executable, __file__, "--one", config], capture_output=True,
                             text=True, check=True)
        r = json.loads(out.stdout.strip().splitlines()[-1])
        base = base or r
        share = r["trainable"] / r["params"]
        print(f"| {config} | {r['trainable']:,} ({share:.2%}) | {r['update_s']:.2f} | "
              f"{r['update_s'] / base['update_s']:.2f} | {r['peak_gb']:.2f} | "
              f"{r['first_mb']:.1f} | {r['new_mb']:.2f} | {r['new_mb'] / base['new_mb']:.3f} |",
              flush=True)


if __name__ == "__main__":
    main()
