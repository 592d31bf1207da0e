"""The format warm start of a model you bring: supervised steps on the training rows' worked
solutions before RL (``model.format_warmup_steps``).

Why it exists: a small instruct model (SmolLM2-135M-Instruct) reasons in its own words and never
ends with ``#### N``, so verl's strict ``gsm8k`` scorer gives every sampled response 0, every
GRPO group has equal rewards, every advantage is 0 and nothing is learnt (the project's
``no_signal`` guard says so). A few dozen supervised steps on the task's own solutions
(``extra_info.answer``, which verl's gsm8k preprocessing keeps and ``word_problems`` writes)
teach the format; RL then has groups with right and wrong answers to learn from. The held-out
split is never read.

Durable like the tiny model's warm start (``verl_core/warmstart.py``): progress lines, its state
saved in the run store (the previous save deleted: a real model's weights and AdamW moments are
gigabytes) and on Ctrl-C, resumed bit for bit, the finished folder reused by any run with the same
inputs (the source folder's files, the rows, the seed and the ``format_warmup_*`` fields).

What does not belong here: the supervised loop (``training/sft.py``), what the run records as its
assets (``prepare.py``).
"""

from __future__ import annotations

import os
import shutil
import time

import torch

from verl_core.data.dataset import DatasetError, PromptRow, render_prompt
from verl_core.models.loading import load_causal_lm, resolve_eos_token_ids, stored_dtype
from verl_core.training.sft import supervised_warm_start
from verl_core.warmstart import WarmStart, warm_start_key

ANSWER_FIELD = "answer"
"""The ``extra_info`` field that holds a row's worked solution (verl's gsm8k layout)."""


def format_answers(rows: list[PromptRow], files: list[str]) -> list[str]:
    """Each training row's worked solution; a row without one is refused, naming it and the
    fix, before any model work."""
    missing = [r.index for r in rows
               if not isinstance(r.extra_info.get(ANSWER_FIELD), str)
               or not r.extra_info[ANSWER_FIELD].strip()]
    if missing:
        where = ", ".join(files)
        shown = ", ".join(map(str, missing[:5])) + (f" and {len(missing) - 5} more"
                                                   if len(missing) > 5 else "")
        raise DatasetError(
            f"model.format_warmup_steps: {len(missing)} of {len(rows)} training rows of {where} "
            f"have no worked solution in extra_info.{ANSWER_FIELD} (rows {shown}); the format warm "
            "start learns from it (verl's gsm8k preprocessing keeps it; "
            "data.synthetic_task=word_problems writes it). Add it to every row, or set "
            "model.format_warmup_steps=0")
    return [r.extra_info[ANSWER_FIELD] for r in rows]


def format_warm_start(cfg, tok, rows: list[PromptRow], train_files: list[str], model_path: str,
                      store, log, seed: int) -> None:
    """Write the warm-started copy of ``cfg.model.path`` to ``model_path`` (an empty folder):
    from the run store or the private cache when one with the same inputs finished, else trained
    here (resumed from its saved state when one was interrupted)."""
    m = cfg.model
    answers = format_answers(rows, train_files)
    ws = WarmStart(store, warm_start_key(cfg, train_files, None), log,
                   total_steps=m.format_warmup_steps, target=1.0,
                   what=f"{os.path.basename(os.path.normpath(m.path))} on the rows' worked "
                        f"solutions (model.format_warmup_steps)")
    if ws.reuse(model_path):
        return
    t0 = time.perf_counter()
    model = load_causal_lm(m.path)  # float32 masters, whatever the folder stores
    saved = ws.resume_point()
    if saved is not None:
        model.load_state_dict(saved["model"])

    def on_step(losses, snapshot):
        ws.after_step(len(losses), losses[-20:], float("nan"),
                      lambda: {"inner": snapshot(), "model": model.state_dict()})

    # the response ends with the token the rollout stops at (generation_config's EOS), which is
    # what the model must learn to emit: for a chat model the end-of-turn token
    eos = resolve_eos_token_ids(m.path, tok)[0]
    losses = supervised_warm_start(
        model, tok, [render_prompt(r, tok) for r in rows], answers,
        steps=m.format_warmup_steps, batch_size=m.format_warmup_batch_size,
        lr=m.format_warmup_lr, seed=seed, max_prompt_length=cfg.data.max_prompt_length,
        truncation=cfg.data.truncation, resume=saved["inner"] if saved is not None else None,
        on_step=on_step, eos_token_id=eos)
    _save_like(model, tok, m.path, model_path)
    ws.finish(model_path, len(losses), float("nan"))
    log(f"warm start: {len(losses)} format steps in {time.perf_counter() - t0:.1f}s, "
        f"loss {losses[0]:.3f} -> {losses[-1]:.3f}" if losses else "warm start: 0 steps")


def _save_like(model, tok, source: str, out: str) -> None:
    """``model`` saved as a folder like ``source``: its stored dtype (a bf16 folder stays bf16),
    its tokenizer, and its own generation and chat-template files copied as they are (the EOS
    set and the template the run reads must not change with the weights)."""
    if stored_dtype(source) == "bfloat16":
        model = model.to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    for name in ("generation_config.json", "chat_template.jinja", "chat_template.json"):
        src = os.path.join(source, name)
        if os.path.isfile(src):
            shutil.copyfile(src, os.path.join(out, name))
