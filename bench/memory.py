"""Peak memory per phase: does it grow with the vocabulary?

A Qwen2-shaped model (hidden 512, 8 layers, 8 heads of 64, 2 KV heads, intermediate 1408, tied
embeddings; random init, seeded) at V = 16,384 (~30.9M parameters) and at Qwen's V = 151,936,
float32 on CPU. 8 prompts x 4 samples = 32 rows, prompts of 31 random ids, 128-token responses
(the stop id is an ordinary token a random model draws with probability ~1/V a step, so nearly
every row runs the full 128 tokens). Phases, each in its own fresh subprocess:

- ``model``: interpreter + torch + the model's weights, nothing run (the floor the others sit on);
- ``rollout``: the ``hf`` engine samples the 32 rows (one micro-batch: prefill + 128 cached steps);
- ``old_logprob``: ``batched_logprobs`` over the 32 rows (no grad; what the trainer computes for
  the old and reference log-probs), one micro-batch;
- ``update``: one PPO micro-batch of the 32 rows as ``ppo_update`` runs it (log-probs and entropy
  with grad, a loss, backward, an AdamW step);
- ``update_gc``: the same with ``model.gradient_checkpointing=true`` (verl's
  ``enable_gradient_checkpointing``, on in its quickstart): the decoder layers' activations are
  recomputed in backward instead of kept;
- ``update_micro``: the same 32 rows as 4 accumulated micro-batches of 8
  (``actor.ppo_micro_batch_size_per_gpu=8``): the activations kept are one micro-batch's.

The update phases also report "saved for backward": the bytes of the distinct tensors autograd
keeps between a micro-batch's forward and its backward (``saved_tensors_hooks``, weights left
out), i.e. the activations; with the LM head in chunks no logits are among them.

"peak RSS" is the child's peak resident set size from ``os.wait4`` (the kernel's ru_maxrss).
"logits" is what one full ``[rows, P + T, V]`` float32 tensor of the pre-fix computation would take,
for scale (the training forward now forms ~64 MiB chunks of ``[rows, V]`` only).

    python bench/memory.py              # both vocabularies, every phase
    python bench/memory.py --vocab 16384
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import torch

PHASES = ("model", "rollout", "old_logprob", "update", "update_gc", "update_micro")
VOCABS = (16384, 151936)
B, G, P, T = 8, 4, 31, 128
MICRO_ROWS = 8  # update_micro's micro-batch (verl's quickstart: ppo_micro_batch_size_per_gpu=4)


def build(vocab: int):
    """``(model, prompt_ids (N, P), prompt_mask (N, P), eos_id)``."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=vocab, hidden_size=512, intermediate_size=1408,
                      num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2,
                      max_position_embeddings=256, tie_word_embeddings=True,
                      bos_token_id=None, eos_token_id=vocab - 1, pad_token_id=0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(cfg)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, vocab - 1, (B, P), generator=g).repeat_interleave(G, 0)  # (N, P)
    return model, ids, torch.ones_like(ids), cfg.eos_token_id


def child(phase: str, vocab: int) -> None:
    from verl_core.data.batch import Batch
    from verl_core.rollout.base import SamplingParams
    from verl_core.rollout.hf import HFEngine
    from verl_core.training.forward import batched_logprobs, response_logprobs

    model, ids, mask, eos = build(vocab)
    n = ids.shape[0]
    if phase == "model":
        print(json.dumps({"params": sum(p.numel() for p in model.parameters())}))
        return
    params = SamplingParams(temperature=1.0, top_p=1.0, top_k=-1, max_new_tokens=T, seed=0)
    if phase == "rollout":
        out = HFEngine(model, eos_token_id=eos, pad_token_id=0, micro_batch_size=n).generate(
            ids, mask, params)
        print(json.dumps({"tokens": int(out.response_mask.sum())}))
        return
    # a response of T random ids per row (what the rollout would hand over), all valid
    g = torch.Generator().manual_seed(1)
    resp = torch.randint(1, vocab - 1, (n, T), generator=g)
    resp_mask = torch.ones(n, T)
    if phase == "old_logprob":
        batch = Batch(prompt_ids=ids, prompt_mask=mask, response_ids=resp,
                      response_mask=resp_mask, response_logprobs=torch.zeros(n, T),
                      group=torch.arange(n) // G, uid=[str(i // G) for i in range(n)],
                      ground_truth=[""] * n, data_source=[""] * n, extra_info=[{}] * n)
        lp = batched_logprobs(model, batch, 1.0, n)
        print(json.dumps({"mean_logp": float(lp.mean())}))
        return
    if phase == "update_gc":
        # as the trainer does for model.gradient_checkpointing (renamed in transformers 5.x)
        (getattr(model, "activation_checkpointing_enable", None)
         or model.gradient_checkpointing_enable)()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    model.train()
    micro = MICRO_ROWS if phase == "update_micro" else n
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}  # storage -> bytes, of what autograd keeps for backward
    saved_gb = 0.0  # the most one micro-batch kept

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in weights:
            saved[ptr] = t.untyped_storage().nbytes()
        return t

    total = 0.0
    for s in range(0, n, micro):  # gradient accumulation over micro-batches, as ppo_update
        sl = slice(s, s + micro)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            logp, ent = response_logprobs(model, ids[sl], mask[sl], resp[sl], resp_mask[sl], 1.0,
                                          with_entropy=True)
        loss = (-(logp * resp_mask[sl]).mean() - 1e-3 * (ent * resp_mask[sl]).mean()) * micro / n
        saved_gb = max(saved_gb, sum(saved.values()) / 1e9)
        saved.clear()
        loss.backward()
        total += float(loss.detach())
    opt.step()
    print(json.dumps({"loss": total, "saved_gb": saved_gb}))


def measure(phase: str, vocab: int) -> dict:
    proc = subprocess.Popen([sys.executable, __file__, "--child", phase, "--vocab", str(vocab)],
                            stdout=subprocess.PIPE, text=True)
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    if status != 0:
        raise SystemExit(f"{phase} at V={vocab} failed (status {status})")
    return {"phase": phase, "vocab": vocab, "peak_rss_gb": usage.ru_maxrss * 1024 / 1e9,
            **json.loads(out.strip().splitlines()[-1])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocab", type=int, action="append", help="default: 16384 and 151936")
    ap.add_argument("--phase", action="append", choices=PHASES, help="default: all")
    ap.add_argument("--child", choices=PHASES, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child, args.vocab[0])
        return
    print(f"Qwen2-shaped, hidden 512, 8 layers; {B} prompts x {G} samples, P={P}, T={T}; "
          f"torch threads {torch.get_num_threads()}")
    print(f"{'V':>8} {'params':>8} {'logits':>8}  " + "  ".join(f"{p:>11}" for p in PHASES))
    for vocab in args.vocab or VOCABS:
        rows = {p: measure(p, vocab) for p in args.phase or PHASES}
        params = measure("model", vocab)["params"] if "model" not in rows else rows["model"]["params"]
        logits_gb = B * G * (P + T) * vocab * 4 / 1e9
        print(f"{vocab:>8} {params / 1e6:>7.1f}M {logits_gb:>7.2f}G  " + "  ".join(
            f"{rows[p]['peak_rss_gb']:>10.2f}G" if p in rows else f"{'-':>11}" for p in PHASES),
            flush=True)
        print(f"{'':>8} saved for backward: " + ", ".join(
            f"{p} {rows[p]['saved_gb']:.2f}G" for p in PHASES if "saved_gb" in rows.get(p, {})),
            flush=True)


if __name__ == "__main__":
    main()
