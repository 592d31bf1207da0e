"""Supervised warm start: teach the tiny model the answer format so RL starts from partial skill.

RL needs a policy that is sometimes right (otherwise every GRPO group scores all-zero and the
advantages vanish) and sometimes wrong (otherwise there is nothing to learn). A few hundred
supervised steps on the synthetic task's answers reach that regime in seconds on a CPU.
"""

from __future__ import annotations

import torch

from verl_core.data.batch import encode_prompts, pad_right
from verl_core.training.forward import response_logprobs
from verl_core.training.optim import make_optimizer, make_scheduler
from verl_core.training.config import OptimConfig

import numpy as np


def encode_responses(tokenizer, answers: list[str], eos_token_id: int | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Answers + EOS (``eos_token_id``, else the tokenizer's), right-padded: (ids (n, T), mask
    (n, T) float32)."""
    eos = tokenizer.eos_token_id if eos_token_id is None else eos_token_id
    enc = tokenizer(answers, add_special_tokens=False)["input_ids"]
    seqs = [np.asarray(e + [eos], np.int64) for e in enc]
    ids = pad_right(seqs, tokenizer.pad_token_id, torch.long)
    mask = pad_right([np.ones(len(s), np.float32) for s in seqs], 0.0, torch.float32)
    return ids, mask


def encode_transcripts(responses: list[tuple[list[int], list[float]]],
                       pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Multi-turn responses as (ids, loss mask) pairs, right-padded: (ids (n, T), real-token
    mask (n, T), loss mask (n, T)), both masks float32."""
    ids = pad_right([np.asarray(i, np.int64) for i, _ in responses], pad_id, torch.long)
    real = pad_right([np.ones(len(i), np.float32) for i, _ in responses], 0.0, torch.float32)
    loss = pad_right([np.asarray(m, np.float32) for _, m in responses], 0.0, torch.float32)
    return ids, real, loss


def supervised_warm_start(model, tokenizer, prompts: list[str], answers: list[str] | None = None,
                          *, steps: int, batch_size: int, lr: float, seed: int,
                          max_prompt_length: int = 64, truncation: str = "error",
                          stop_fn=None, check_every: int = 20,
                          responses: list[tuple[list[int], list[float]]] | None = None,
                          resume: dict | None = None, on_step=None,
                          eos_token_id: int | None = None) -> list[float]:
    """Train ``model`` in place on (prompt -> answer EOS) for at most ``steps`` AdamW steps
    (constant LR after a short warmup). If ``stop_fn`` is given it is called every
    ``check_every`` steps and training stops once it returns True (used to stop at partial
    accuracy). Returns the loss per step (token-mean NLL of the answer tokens).

    ``responses`` instead of ``answers``: multi-turn transcripts, each (ids, loss mask): the
    model reads every id and learns the mask-1 ones (its own turns, not the tools'
    responses).

    Resumable (``verl_core/warmstart.py`` checkpoints it): ``on_step(losses, snapshot)`` is
    called after every step that did not end the run (its stop check included), ``snapshot()``
    giving the loop's state beside the model's weights (optimizer, schedule, sampling generator,
    the losses so far); ``resume``, such a snapshot, continues from it, the model holding the
    weights saved with it. Resumed, the steps that follow are the uninterrupted run's, bit for
    bit: every random draw comes from the restored generator. ``eos_token_id``: the token each
    answer ends with (default: the tokenizer's EOS)."""
    if steps == 0:
        return []
    prompt_ids, prompt_mask = encode_prompts(tokenizer, prompts, max_prompt_length,
                                             truncation=truncation)
    if responses is None:
        resp_ids, resp_mask = encode_responses(tokenizer, answers, eos_token_id)
        loss_mask = resp_mask
    else:
        resp_ids, resp_mask, loss_mask = encode_transcripts(responses, tokenizer.pad_token_id)
    cfg = OptimConfig(lr=lr, warmup_steps=min(10, steps), lr_schedule="constant",
                      weight_decay=0.0)
    opt = make_optimizer(model.parameters(), cfg, lr)
    sched = make_scheduler(opt, cfg, steps)
    gen = torch.Generator().manual_seed(seed)
    n = prompt_ids.shape[0]
    losses = []
    if resume is not None:
        opt.load_state_dict(resume["optimizer"])
        sched.load_state_dict(resume["scheduler"])
        gen.set_state(resume["generator"])
        losses = list(resume["losses"])

    def snapshot() -> dict:
        return {"optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
                "generator": gen.get_state(), "losses": list(losses)}

    model.train()
    for _ in range(len(losses), steps):
        rows = torch.randint(0, n, (batch_size,), generator=gen)
        mask = loss_mask[rows]
        logp, _ = response_logprobs(model, prompt_ids[rows], prompt_mask[rows], resp_ids[rows],
                                    resp_mask[rows])
        loss = -(logp * mask).sum() / mask.sum()  # token-mean NLL
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
        if stop_fn is not None and len(losses) % check_every == 0:
            model.eval()
            if stop_fn():
                break
            model.train()
        if on_step is not None:
            on_step(losses, snapshot)
    model.eval()
    return losses
