"""Model-based reward: a Hugging Face sequence-classification model (``num_labels=1``) scores each
prompt + response (verl's ``reward_model.enable``, a discriminative reward model).

What belongs here: checking a reward-model folder (:func:`check_reward_model`, at prepare time,
before any work), loading it (:meth:`RewardModel.load`), building its input text, tokenising and
scoring in micro-batches, each worker its share of the rows (:meth:`RewardModel.score_rows`).
What does not: how its score meets the ``reward.scorer`` score (``reward/scoring.py``). Not
imported by ``verl_core.reward`` (that package stays torch-free for
the custom-scorer processes).

Input text (as verl builds it):

- the reward model's tokenizer has a chat template: the prompt's chat messages plus
  ``{"role": "assistant", "content": response}`` rendered with it (``add_generation_prompt=False``)
  and tokenised with ``add_special_tokens=False`` (the template writes its own BOS; verl strips a
  duplicated one for the same reason);
- it has none: the prompt text exactly as the policy saw it (``render_prompt`` with the policy's
  tokenizer) followed by the response, tokenised with the tokenizer's own special tokens (a BOS
  for most models), since a template-less model was trained on plain text.

The response is what every scorer sees (``reward/decode.py``): cut at its first EOS, special
tokens kept as text; the reward model reads them and decides.

Scores are the model's own pooled logit: ``AutoModelForSequenceClassification`` takes the logit at
the rightmost token that is not its ``pad_token_id``, so a row scores the same alone as in a
batch. Rows are right-padded to one width for the whole batch (the caller passes it), so neither
the micro-batch size nor the worker count changes any row's shapes: with right padding and causal
attention, padding never reaches a real token. Deterministic (``eval()``, ``torch.no_grad``).
"""

from __future__ import annotations

import math
import os
from typing import Sequence

import torch

from verl_core.errors import PermanentError
from verl_core.models.loading import ModelLoadError

__all__ = ["RewardModel", "RewardModelError", "RewardModelLoadError", "check_finite",
           "check_reward_model", "max_positions"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class RewardModelLoadError(ModelLoadError):
    """``reward_model.path`` is not a usable reward model (no folder, not a sequence-classification
    model with one label, no tokenizer, missing head weights). Raised at prepare time."""


class RewardModelError(PermanentError, RuntimeError):
    """A row cannot be scored: its input is longer than ``reward_model.max_length``, or the model
    returned a non-finite score. The message names the row and the fix."""


def max_positions(config) -> int | None:
    """The longest input the model's position embeddings allow (None: no such limit known)."""
    for name in ("max_position_embeddings", "n_positions"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def check_reward_model(path: str, max_length: int = 0) -> int:
    """Check a reward-model folder without loading its weights; returns the effective
    ``max_length`` (``max_length``, or the model's own limit when 0). Raises
    :class:`RewardModelLoadError` naming the folder and the fix."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import \
        MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES as SEQ_CLS

    where = f"reward_model.path={path!r}"
    if not path or not os.path.isdir(path):
        raise RewardModelLoadError(f"{where}: no such folder; point it at a local Hugging Face "
                                   "folder saved by save_pretrained (config.json, weights, "
                                   "tokenizer)")
    if not os.path.exists(os.path.join(path, "config.json")):
        raise RewardModelLoadError(f"{where}: no config.json; is it a Hugging Face model folder "
                                   "(save_pretrained output)?")
    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
    except Exception as e:  # noqa: BLE001 - re-raised with the folder named
        raise RewardModelLoadError(f"{where}: cannot read its config.json: {e}") from e
    want = SEQ_CLS.get(config.model_type)
    archs = list(getattr(config, "architectures", None) or [])
    if want is None or want not in archs:
        # AutoModelForSequenceClassification would load a causal LM too, with a freshly
        # initialised (random) head: a reward of noise. Refuse anything not saved as one.
        raise RewardModelLoadError(
            f"{where}: not a sequence-classification model (architectures={archs}, "
            f"model_type={config.model_type!r}); a reward model is a folder saved from "
            f"{want or 'an AutoModelForSequenceClassification'} with num_labels=1")
    if config.num_labels != 1:
        raise RewardModelLoadError(
            f"{where}: has num_labels={config.num_labels}; a reward model outputs one score "
            "per sequence (num_labels=1)")
    limit = max_positions(config)
    if max_length == 0 and limit is None:
        raise RewardModelLoadError(f"{where}: its config names no max_position_embeddings; set "
                                   "reward_model.max_length to the longest input it takes")
    if max_length and limit is not None and max_length > limit:
        raise RewardModelLoadError(
            f"reward_model.max_length={max_length}: exceeds the reward model's "
            f"max_position_embeddings={limit} ({path}); use <= {limit} (or 0 for that limit)")
    _load_tokenizer(path)
    return max_length or limit


def _load_tokenizer(path: str):
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as e:  # noqa: BLE001
        raise RewardModelLoadError(f"reward_model.path={path!r}: cannot load its tokenizer: {e}; "
                                   "save the tokenizer into the folder (tokenizer.save_pretrained)"
                                   ) from e
    return tok


class RewardModel:
    """A loaded reward model and its tokenizer. Build with :meth:`load`."""

    def __init__(self, model, tokenizer, *, max_length: int, pad_id: int, path: str = ""):
        self.model = model
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.pad_id = pad_id
        self.path = path

    @classmethod
    def load(cls, path: str, *, dtype: str = "float32", max_length: int = 0,
             device: str | torch.device = "cpu") -> "RewardModel":
        """Check ``path`` (:func:`check_reward_model`), then load the model in eval mode. A
        checkpoint without the classification head's weights is refused (the head would be
        random)."""
        from transformers import AutoModelForSequenceClassification

        max_length = check_reward_model(path, max_length)
        tok = _load_tokenizer(path)
        try:
            model, info = AutoModelForSequenceClassification.from_pretrained(
                path, local_files_only=True, dtype=_DTYPES[dtype], output_loading_info=True)
        except Exception as e:  # noqa: BLE001
            raise RewardModelLoadError(f"reward_model.path={path!r}: cannot load it as a "
                                       f"sequence-classification model: {e}") from e
        missing = list(info.get("missing_keys") or [])
        if missing:
            raise RewardModelLoadError(
                f"reward_model.path={path!r}: the checkpoint lacks {missing[:4]}; those weights "
                "would be random. Save the trained reward model with save_pretrained")
        # the pooling treats config.pad_token_id as padding; batches need one (HF refuses a
        # batch > 1 without), and we pad with the same id so padding is what it skips
        pad = model.config.pad_token_id
        if pad is None:
            pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
            if pad is None:
                raise RewardModelLoadError(f"reward_model.path={path!r}: neither the model nor "
                                           "its tokenizer names a pad or eos token to pad with")
            model.config.pad_token_id = pad
        model.to(device).eval()
        return cls(model, tok, max_length=max_length, pad_id=int(pad), path=path)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    def render(self, chat: Sequence[dict], prompt_text: str, response: str) -> str:
        """The reward model's input text for one row (see the module docstring): ``chat`` is the
        prompt's messages ``[{"role", "content"}]``, ``prompt_text`` the prompt as the policy
        saw it, ``response`` the decoded response."""
        if self.has_chat_template:
            return self.tokenizer.apply_chat_template(
                [*chat, {"role": "assistant", "content": response}], tokenize=False,
                add_generation_prompt=False)
        return prompt_text + response

    def encode(self, texts: Sequence[str], names: Sequence[str] | None = None) -> list[list[int]]:
        """Token ids of each text; one longer than ``max_length`` (or empty) is an error naming
        ``names[i]`` (e.g. "row 3 (data_source ...)")."""
        ids = self.tokenizer(list(texts), add_special_tokens=not self.has_chat_template)["input_ids"]
        for i, row in enumerate(ids):
            what = names[i] if names is not None else f"row {i}"
            if len(row) > self.max_length:
                raise RewardModelError(
                    f"reward model input of {what} has {len(row)} tokens, more than "
                    f"reward_model.max_length={self.max_length}; raise reward_model.max_length "
                    "(up to the model's max_position_embeddings), or shorten prompts "
                    "(data.max_prompt_length) and responses (rollout.max_new_tokens)")
            if not row:
                raise RewardModelError(f"reward model input of {what} is empty")
        return [list(r) for r in ids]

    @torch.no_grad()
    def score_ids(self, ids: Sequence[Sequence[int]], *, width: int,
                  micro_batch_size: int) -> list[float]:
        """One raw score per row of ``ids`` (n lists of token ids), in order. Every micro-batch is
        right-padded to ``width`` (>= every row's length; the caller's width for the whole
        batch), so a row's result depends neither on the micro-batch size nor on its
        neighbours. Finiteness is the caller's check (:func:`check_finite`)."""
        device = next(self.model.parameters()).device
        out: list[float] = []
        for s in range(0, len(ids), micro_batch_size):
            part = ids[s:s + micro_batch_size]
            input_ids = torch.full((len(part), width), self.pad_id, dtype=torch.long)  # (b, L)
            mask = torch.zeros((len(part), width), dtype=torch.long)  # (b, L)
            for i, row in enumerate(part):
                input_ids[i, :len(row)] = torch.as_tensor(row, dtype=torch.long)
                mask[i, :len(row)] = 1
            logits = self.model(input_ids=input_ids.to(device),
                                attention_mask=mask.to(device)).logits  # (b, 1), pooled
            out.extend(logits[:, 0].double().cpu().tolist())  # exact for any dtype
        return out

    def score(self, texts: Sequence[str], *, micro_batch_size: int,
              names: Sequence[str] | None = None) -> list[float]:
        """Score n input texts in one process: encode, score at the batch's width, check."""
        ids = self.encode(texts, names)
        width = max((len(r) for r in ids), default=0)
        return check_finite(self.score_ids(ids, width=width, micro_batch_size=micro_batch_size),
                            names)


    def score_rows(self, rows: Sequence, responses: Sequence[str], tokenizer, dp, *,
                   micro_batch_size: int) -> list[float]:
        """(n,) the score of each (dataset row ``rows[i]``, response text ``responses[i]``).

        With W > 1 worker ``r`` of ``dp`` scores the ``r``-th contiguous share of the rows and
        the shares are gathered (a collective: every worker calls it). Every worker tokenises all
        n rows to find the one padded width, so neither W nor ``micro_batch_size`` changes a row's
        input shapes. A row too long for ``max_length``, or a non-finite score, raises
        :class:`RewardModelError` naming it, on every worker."""
        from verl_core.data.dataset import render_prompt

        texts = [self.render(r.chat, render_prompt(r, tokenizer), resp)
                 for r, resp in zip(rows, responses)]
        names = [f"row {i} (dataset row {r.index}, data_source {r.data_source!r})"
                 for i, r in enumerate(rows)]
        ids = self.encode(texts, names)
        width = max((len(x) for x in ids), default=0)
        n, W, k = len(ids), dp.size, dp.rank
        lo, hi = n * k // W, n * (k + 1) // W  # no collectives in the forward: shares may differ
        local = self.score_ids(ids[lo:hi], width=width, micro_batch_size=micro_batch_size)
        return check_finite([s for part in dp.gather_objects(local) for s in part], names)


def check_finite(scores: list[float], names: Sequence[str] | None = None) -> list[float]:
    """``scores`` unchanged, or :class:`RewardModelError` naming the first non-finite row."""
    for i, s in enumerate(scores):
        if not math.isfinite(s):
            what = names[i] if names is not None else f"row {i}"
            raise RewardModelError(
                f"the reward model returned a non-finite score ({s}) for {what}; rewards must be "
                "finite: check the model's weights (NaN/Inf) and reward_model.dtype (bfloat16 "
                "can overflow where float32 does not)")
    return scores
