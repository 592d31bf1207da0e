"""The teacher of on-policy distillation (``algorithm.distill_teacher_path``): a frozen model
whose log-probs of the student's sampled tokens the rollout phase stores with the batch.

It owns no trained state, so a checkpoint holds nothing of it: like the reference model it is
rebuilt from the run's assets, where its folder is pinned by content hash
(``engine/assets.py``), so a resume, a rebuild on another host or a recomputed batch reads the
same teacher. Its tokenizer must be the student's (:func:`check_same_tokenizer`, at prepare,
before any work): the teacher scores the student's token ids as they are.

What is not here: the signal made of its log-probs (``algorithms/distill.py``) and where it
joins the advantage (``training/advantage.py``)."""

from __future__ import annotations

import torch

from verl_core.models import load_causal_lm
from verl_core.models.loading import ModelLoadError
from verl_core.training.forward import batched_logprobs

TEACHER_TEMPERATURE = 1.0
"""The teacher scores at temperature 1, as verl forces it (``docs/algo/opd.md``: "Temperature is
always forced to 1.0" for the teacher's ``prompt_logprobs``); the student's log-probs are the
rollout's, at ``rollout.temperature``, as verl's actor computes them."""


class TeacherTokenizerError(ModelLoadError):
    """The teacher's tokenizer is not the student's: its log-probs would score other tokens (a
    user error, as a model folder that cannot load: the CLI prints it and exits 2)."""


class Teacher:
    """A frozen causal LM in ``dtype`` on ``device``: a full copy on every worker (not
    sharded: each worker scores its block of rows), as the reward model."""

    def __init__(self, path: str, dtype: str, device: torch.device):
        self.model = load_causal_lm(path, dtype).requires_grad_(False)
        self.model.to(device)

    def logprobs(self, batch, micro_batch_size: int, *, max_token_len: int = 0,
                 remove_padding: bool = False) -> torch.Tensor:
        """(N, T) the teacher's log-probs of ``batch``'s response tokens given their prompt and
        the tokens before, 0 on padding (no grad; micro-batches as the reference's)."""
        return batched_logprobs(self.model, batch, TEACHER_TEMPERATURE, micro_batch_size,
                                max_token_len=max_token_len, remove_padding=remove_padding)


def _special(tok) -> dict:
    """The tokenizer's special tokens by role, with their ids."""
    out = {}
    for role in ("bos_token", "eos_token", "pad_token", "unk_token"):
        t = getattr(tok, role, None)
        out[role] = (t, tok.convert_tokens_to_ids(t)) if t is not None else None
    out["additional"] = sorted(map(str, getattr(tok, "additional_special_tokens", None) or []))
    return out


def check_same_tokenizer(student, teacher, student_name: str, teacher_name: str) -> None:
    """Refuse a teacher whose tokenizer differs from the student's in its vocabulary (every
    token and its id) or its special tokens, naming both folders and the first difference."""
    sv, tv = student.get_vocab(), teacher.get_vocab()
    why = None
    if sv != tv:
        only_s = sorted(set(sv) - set(tv))[:3]
        only_t = sorted(set(tv) - set(sv))[:3]
        moved = sorted(t for t in set(sv) & set(tv) if sv[t] != tv[t])[:3]
        why = (f"vocabularies differ ({len(sv)} vs {len(tv)} tokens; only the student's: "
               f"{only_s}, only the teacher's: {only_t}, other ids: {moved})")
    elif _special(student) != _special(teacher):
        why = f"special tokens differ ({_special(student)} vs {_special(teacher)})"
    if why:
        raise TeacherTokenizerError(
            f"algorithm.distill_teacher_path={teacher_name!r}: the teacher's tokenizer is not the "
            f"student's ({student_name}): {why}. On-policy distillation scores the student's "
            "token ids with the teacher, so both must share one tokenizer: pick a teacher of "
            "the student's family (e.g. a larger model of it), or another student")
