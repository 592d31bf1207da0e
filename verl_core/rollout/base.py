"""The one rollout-engine interface. Callers never branch on the engine name.

An engine turns N left-padded prompts into N sampled responses plus the per-token log-probs of the
sampled tokens under the temperature-scaled policy (the distribution before top-k/top-p
filtering, so with top_p=1/top_k=-1 they equal what the trainer recomputes).
"""

from __future__ import annotations

import abc
import contextlib
from dataclasses import dataclass
from typing import Iterable, Sequence

import torch

from verl_core.rollout.registry import engine_factory


@dataclass(frozen=True)
class SamplingParams:
    """How to sample (mirrors ``RolloutConfig``; plain values so engines need no config)."""

    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 8
    seed: int = 0


@dataclass(frozen=True)
class GenerationOutput:
    response_ids: torch.Tensor  # (N, T) long, right-padded with pad_id after EOS
    response_mask: torch.Tensor  # (N, T) float32, 1 on generated tokens (EOS included)
    logprobs: torch.Tensor  # (N, T) float32, log p(token) of each sampled token, 0 on padding


def concat_outputs(parts: list[GenerationOutput], pad_id: int) -> GenerationOutput:
    """Concatenate outputs of row blocks (micro-batches, or workers' blocks) in order,
    right-padding each to the longest and trimming trailing columns that are padding in every
    row: what one call over all the rows returns."""
    T = max(p.response_ids.shape[1] for p in parts)

    def cat(name: str, pad) -> torch.Tensor:
        return torch.cat([torch.nn.functional.pad(getattr(p, name).cpu(),
                                                  (0, T - getattr(p, name).shape[1]), value=pad)
                          for p in parts], 0)

    ids, mask, logp = cat("response_ids", pad_id), cat("response_mask", 0.0), cat("logprobs", 0.0)
    T = int(mask.sum(0).nonzero().max()) + 1 if mask.any() else 0  # every row stopped early
    return GenerationOutput(response_ids=ids[:, :T], response_mask=mask[:, :T],
                            logprobs=logp[:, :T])


def cut_to_limits(out: GenerationOutput, limits: Sequence[int], pad_id: int) -> GenerationOutput:
    """``out`` with row i cut after its first ``limits[i]`` tokens (ids padded, mask and
    log-probs 0 beyond), trailing all-padding columns trimmed: what sampling each row with its
    own ``max_new_tokens`` gives (a row's tokens depend on its own draws only)."""
    T = out.response_ids.shape[1]
    keep = torch.arange(T)[None, :] < torch.tensor(list(limits))[:, None]  # (N, T)
    mask = out.response_mask * keep
    return concat_outputs([GenerationOutput(
        response_ids=torch.where(keep, out.response_ids, torch.full_like(out.response_ids, pad_id)),
        response_mask=mask, logprobs=out.logprobs * keep)], pad_id)


def check_rows(n: int, params: SamplingParams, first_row: int, total_rows: int | None,
               row_seeds: Sequence[int] | None, row_limits: Sequence[int] | None) -> None:
    """The row arguments of :meth:`RolloutEngine.generate`, refused when they do not fit the
    ``n`` prompts."""
    if total_rows is not None and first_row + n > total_rows:
        raise ValueError(f"rows {first_row}..{first_row + n - 1} are outside a batch of "
                         f"{total_rows}")
    for name, got in (("row_seeds", row_seeds), ("row_limits", row_limits)):
        if got is not None and len(got) != n:
            raise ValueError(f"{name} has {len(got)} entries for {n} prompts")
    if row_limits is not None and not all(0 < k <= params.max_new_tokens for k in row_limits):
        raise ValueError(f"row_limits must be in [1, max_new_tokens={params.max_new_tokens}]: "
                         f"{list(row_limits)}")


def resolve_stop_ids(eos_token_ids: Iterable[int] | None = None,
                     eos_token_id: int | None = None) -> tuple[int, ...]:
    """The ids that end a response (sorted, distinct): ``eos_token_ids`` (the model's resolved
    EOS set, ``verl_core.models.loading.resolve_eos_token_ids``), else the one ``eos_token_id``
    (the older keyword, kept for callers with a single EOS). Raises when neither is given: an
    engine that cannot stop would fill every response to ``max_new_tokens``."""
    ids = set(eos_token_ids) if eos_token_ids is not None else set()
    if not ids and eos_token_id is not None:
        ids = {eos_token_id}
    if not ids:
        raise ValueError("a rollout engine needs eos_token_ids (the model's EOS set) or "
                         "eos_token_id; pass make_engine(..., eos_token_ids=...)")
    return tuple(sorted(int(i) for i in ids))


class RolloutEngine(abc.ABC):
    """Generates responses for left-padded prompts."""

    owns_weights: bool = False
    """True when the engine holds its own copy of the policy weights (``vllm``): the caller
    refreshes it with :meth:`load_weights` after every change. False (``hf``): the engine
    samples from the torch model it was given, so changes to that model are seen directly."""

    releases_memory: bool = False
    """True when the engine frees its memory after each :meth:`generate` (vLLM's sleep mode,
    where the platform has it), so the update gets it back."""

    restarts: int = 0
    """Times the engine was rebuilt after it died or hung (``vllm`` in a process of its own:
    ``rollout.engine_own_process``); the rollout's ``rollout/engine_restarts`` counts them."""
    timeouts: int = 0
    """Those of :attr:`restarts` whose cause was the deadline (``rollout.engine_timeout_s``)."""

    @abc.abstractmethod
    def generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                 params: SamplingParams, *, first_row: int = 0,
                 total_rows: int | None = None, row_seeds: Sequence[int] | None = None,
                 row_limits: Sequence[int] | None = None) -> GenerationOutput:
        """prompt_ids, prompt_mask: (n, P) left-padded. Deterministic for a given params.seed.

        ``first_row``/``total_rows``: these n rows are rows ``first_row..`` of a batch of
        ``total_rows`` (default: the whole batch); each row's sample is the one a single call
        over the whole batch would draw, so W workers each generating a block sample what one
        worker would (up to float rounding).

        ``row_seeds`` (n,): each row draws from its own seed instead (``params.seed`` and the
        row offsets are then unused): a row's sample depends on its seed and prompt only, which
        is what multi-turn rollouts need, their rows at different turns generating together.
        ``row_limits`` (n,): each row's own ``max_new_tokens`` (each at most
        ``params.max_new_tokens``)."""

    @contextlib.contextmanager
    def held(self):
        """Several :meth:`generate` calls in a row (the turns of multi-turn rollouts): an engine
        that releases its memory after each call (:attr:`releases_memory`) keeps it until the
        block ends instead."""
        yield self

    @abc.abstractmethod
    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Replace the policy weights (after an update)."""

    def close(self) -> None:
        """Free what the engine holds beyond this process's memory (its processes)."""


def make_engine(name: str, **kwargs) -> RolloutEngine:  # the built-ins: rollout/engines.py
    """The engine ``name`` built from the keywords its factory reads (each ignores the rest):
    ``hf`` needs ``model``; ``vllm`` needs ``model_path`` (the Hugging Face folder) and takes the
    vLLM settings; both need ``pad_token_id`` and ``eos_token_ids`` (or one ``eos_token_id``), the
    model's whole EOS set (:func:`verl_core.reward.decode.stop_token_ids`): a response stops after,
    and keeps, the first of them. ``vllm`` without CUDA or the package raises
    ``VLLMUnavailableError``."""
    return engine_factory(name)(**kwargs)

