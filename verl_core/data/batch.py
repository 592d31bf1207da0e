"""The batch record that crosses phase boundaries, and its parquet form.

In memory a batch is a :class:`Batch` of padded tensors (what the math wants). Between phases it
is a parquet table with one row per sampled response and unpadded list columns (what people and
Great Expectations can read). The conversion is lossless: float32 lists stay float32, so a batch
read back gives bit-identical tensors (resume equivalence depends on it).

Columns: ``uid, group, prompt_ids, response_ids, response_logprobs, ground_truth, data_source,
extra_info`` (rollout); + ``score``, ``ref_logprobs`` (reward); + ``values`` (critic);
+ ``advantages``, ``returns`` (advantage). Only for estimators whose traits ask for them:
``baseline_response_ids`` (rollout, a greedy response per prompt) + ``baseline_score`` (reward);
``sum_pi_squared`` (rollout); with on-policy distillation ``teacher_logprobs`` (rollout).
"""

from __future__ import annotations

import dataclasses
import io
import json
from dataclasses import dataclass
from typing import Optional

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

_TOKEN_COLS = ("response_logprobs", "ref_logprobs", "values", "advantages", "returns",
               "sum_pi_squared", "teacher_logprobs")


@dataclass(frozen=True)
class Batch:
    """N sampled responses to B prompts (G each), padded."""

    prompt_ids: torch.Tensor  # (N, P) long, left-padded with pad_id
    prompt_mask: torch.Tensor  # (N, P) long, 1 on real prompt tokens
    response_ids: torch.Tensor  # (N, T) long, right-padded with pad_id
    response_mask: torch.Tensor  # (N, T) float32, 1 on generated tokens (EOS included)
    response_logprobs: torch.Tensor  # (N, T) float32, rollout log-probs, 0 on padding
    group: torch.Tensor  # (N,) long, which prompt of the batch (0..B-1) a row answers
    uid: list[str]  # (N,) stable id of the prompt (dataset index), shared by a group
    ground_truth: list[str]  # (N,)
    data_source: list[str]  # (N,)
    extra_info: list[dict]  # (N,)
    pad_id: int = 0
    meta: dict = dataclasses.field(default_factory=dict)  # JSON scalars: step, kl_coef, reward_kl
    score: Optional[torch.Tensor] = None  # (N,) float32 outcome score
    ref_logprobs: Optional[torch.Tensor] = None  # (N, T) float32
    values: Optional[torch.Tensor] = None  # (N, T) float32 critic values
    advantages: Optional[torch.Tensor] = None  # (N, T) float32
    returns: Optional[torch.Tensor] = None  # (N, T) float32
    # greedy (argmax) response to the row's prompt, the same for a prompt's G rows (ReMax)
    baseline_response_ids: Optional[torch.Tensor] = None  # (N, T_b) long, right-padded with pad_id
    baseline_response_mask: Optional[torch.Tensor] = None  # (N, T_b) float32, 1 on generated tokens
    baseline_score: Optional[torch.Tensor] = None  # (N,) float32, the greedy response's score
    sum_pi_squared: Optional[torch.Tensor] = None  # (N, T) float32, Σ_v π_v² of the rollout policy
    # algorithm.distill_teacher_path: the teacher's log-probs of the sampled tokens, 0 on padding
    teacher_logprobs: Optional[torch.Tensor] = None  # (N, T) float32
    # multi-turn rollouts (issue 25): 1 on every real response token, the sampled ones and the
    # tool responses and template tokens appended between turns (``response_mask``'s holes);
    # None when every real token was sampled (then it equals ``response_mask``)
    response_attention_mask: Optional[torch.Tensor] = None  # (N, T) float32
    # multi-turn: per row, the turns (``rollout/multi_turn.MultiTurnOutput.turns``) and the
    # tools' summed rewards, {"turns": [...], "tool_reward": float}: what replay reads instead
    # of calling a tool again
    turns: Optional[list] = None  # (N,) of dicts

    @property
    def num_rows(self) -> int:
        return self.response_ids.shape[0]

    @property
    def response_attn(self) -> torch.Tensor:
        """(N, T) float32: 1 on every real response token, the tokens the model reads (the
        attention mask's response part, verl's ``attention_mask[:, P:]``). A multi-turn row's
        loss mask (``response_mask``) has holes where this has ones."""
        return self.response_mask if self.response_attention_mask is None \
            else self.response_attention_mask

    @property
    def response_lengths(self) -> torch.Tensor:  # (N,) long: real response tokens
        return self.response_attn.sum(-1).long()

    def replace(self, **changes) -> "Batch":
        return dataclasses.replace(self, **changes)

    def to(self, device: torch.device) -> "Batch":
        """The batch with every tensor on ``device`` (itself when they are there already): the
        rows of one forward on the model's device (``verl_core/training/device.py``)."""
        moved = {f.name: v.to(device) for f in dataclasses.fields(self)
                 if isinstance(v := getattr(self, f.name), torch.Tensor) and v.device != device}
        return dataclasses.replace(self, **moved) if moved else self

    def select(self, rows: torch.Tensor) -> "Batch":
        """Rows (a 1-D long index) of every per-row field."""
        idx = rows.tolist()
        out = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, torch.Tensor):
                out[f.name] = v[rows]
            elif isinstance(v, list):
                out[f.name] = [v[i] for i in idx]
            elif isinstance(v, dict):
                out[f.name] = dict(v)
            else:
                out[f.name] = v
        return Batch(**out)


def pad_right(seqs: list[np.ndarray], pad, dtype) -> torch.Tensor:
    width = max((len(s) for s in seqs), default=0)
    out = torch.full((len(seqs), width), pad, dtype=dtype)
    for i, s in enumerate(seqs):
        if len(s):
            out[i, : len(s)] = torch.as_tensor(np.array(s), dtype=dtype)
    return out


def _pad_left(seqs: list[np.ndarray], pad, dtype) -> torch.Tensor:
    width = max((len(s) for s in seqs), default=0)
    out = torch.full((len(seqs), width), pad, dtype=dtype)
    for i, s in enumerate(seqs):
        if len(s):
            out[i, width - len(s):] = torch.as_tensor(np.array(s), dtype=dtype)
    return out


class _Kept:
    """The unmasked entries of padded (N, W) columns that share one mask: each row's kept
    values, in order, as arrow list arrays. Vectorised (one boolean gather and one offsets
    vector, no per-row Python), and the mask work is done once for all columns that share it
    (the response's token columns)."""

    def __init__(self, mask: torch.Tensor):
        self.keep = mask.bool().cpu().numpy()  # (N, W)
        offsets = np.zeros(self.keep.shape[0] + 1, np.int32)
        np.cumsum(self.keep.sum(1), out=offsets[1:])
        self.offsets = pa.array(offsets)

    def array(self, x: torch.Tensor, value_type) -> pa.Array:
        values = x.cpu().numpy()[self.keep]  # row-major: each row's kept values, in order
        return pa.ListArray.from_arrays(self.offsets, pa.array(values, value_type))


class _Slots:
    """Where the values of an arrow list column go in a padded (N, W) array (W = the longest
    row; left=True pads on the left): the inverse of :class:`_Kept`. Built once and reused by
    the columns that share the offsets (the response's token columns)."""

    def __init__(self, offsets: np.ndarray, left: bool = False):
        self.offsets = offsets = offsets.astype(np.int64) - offsets[0]
        lengths = np.diff(offsets)
        n = len(lengths)
        self.shape = (n, int(lengths.max()) if n else 0)
        self.rows = np.repeat(np.arange(n), lengths)
        pos = np.arange(offsets[-1]) - np.repeat(offsets[:-1], lengths)  # index within the row
        self.pos = pos + (self.shape[1] - lengths)[self.rows] if left else pos

    def matches(self, offsets: np.ndarray) -> bool:
        return np.array_equal(offsets - offsets[0], self.offsets)

    def padded(self, values, pad, np_dtype) -> np.ndarray:
        out = np.full(self.shape, pad, np_dtype)
        out[self.rows, self.pos] = values
        return out

    def mask(self) -> np.ndarray:
        return self.padded(True, False, bool)


def _list_parts(col) -> tuple[np.ndarray, np.ndarray]:
    """(offsets, flat values) of an arrow list column."""
    arr = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    return arr.offsets.to_numpy(), arr.flatten().to_numpy(zero_copy_only=False)


def _ids_and_mask(col, pad, mask_dtype, left: bool = False):
    """An id list column as (padded ids (N, W) long, mask (N, W) ``mask_dtype``, its slots)."""
    offsets, values = _list_parts(col)
    slots = _Slots(offsets, left=left)
    return (torch.from_numpy(slots.padded(values, pad, np.int64)),
            torch.from_numpy(slots.mask().astype(mask_dtype)), slots)


_JSON = json.JSONEncoder(sort_keys=True)
"""``json.dumps(e, sort_keys=True)`` without building an encoder per call."""


def _encode_shared(dicts: list[dict]) -> list[str]:
    """JSON of each row's dict; the G rows of a prompt share one dict, so encode each once."""
    memo: dict[int, str] = {}
    return [memo[id(e)] if id(e) in memo else memo.setdefault(id(e), _JSON.encode(e))
            for e in dicts]


def _decode_shared(texts: list[str]) -> list[dict]:
    """Inverse of :func:`_encode_shared`: equal strings decode once (rows then share a dict, as
    they did before encoding)."""
    memo: dict[str, dict] = {}
    return [memo[t] if t in memo else memo.setdefault(t, json.loads(t)) for t in texts]


def batch_to_table(batch: Batch) -> pa.Table:
    """One row per response; token columns are unpadded lists (float32 stays float32). A
    multi-turn batch keeps every real response token (``response_attn``) and its loss mask as
    a list column of its own (``response_mask``), and each row's turns as JSON."""
    resp = _Kept(batch.response_attn)
    cols = {
        "uid": pa.array(batch.uid, pa.string()),
        "group": pa.array(batch.group.numpy(), pa.int64()),
        "prompt_ids": _Kept(batch.prompt_mask).array(batch.prompt_ids, pa.int32()),
        "response_ids": resp.array(batch.response_ids, pa.int32()),
        "ground_truth": pa.array(batch.ground_truth, pa.string()),
        "data_source": pa.array(batch.data_source, pa.string()),
        "extra_info": pa.array(_encode_shared(batch.extra_info), pa.string()),
    }
    for name in _TOKEN_COLS:
        v = getattr(batch, name)
        if v is not None:
            cols[name] = resp.array(v.float(), pa.float32())
    if batch.response_attention_mask is not None:
        cols["response_mask"] = resp.array(batch.response_mask, pa.int8())
    if batch.turns is not None:
        cols["turns"] = pa.array([_JSON.encode(t) for t in batch.turns], pa.string())
    if batch.score is not None:
        cols["score"] = pa.array(batch.score.float().numpy(), pa.float32())
    if batch.baseline_response_ids is not None:  # lengths carry the mask, as for response_ids
        cols["baseline_response_ids"] = _Kept(batch.baseline_response_mask).array(
            batch.baseline_response_ids, pa.int32())
    if batch.baseline_score is not None:
        cols["baseline_score"] = pa.array(batch.baseline_score.float().numpy(), pa.float32())
    meta = {b"pad_id": str(batch.pad_id).encode(),
            b"verl_meta": json.dumps(batch.meta, sort_keys=True).encode()}
    return pa.table(cols).replace_schema_metadata(meta)


def table_to_batch(table: pa.Table) -> Batch:
    """Inverse of :func:`batch_to_table`."""
    meta = table.schema.metadata or {}
    pad_id = int(meta.get(b"pad_id", b"0"))
    batch_meta = json.loads(meta.get(b"verl_meta", b"{}"))
    d = {name: table.column(name).to_pylist() if name in ("uid", "ground_truth", "data_source",
                                                             "extra_info") else None
         for name in table.column_names}
    prompt_ids, prompt_mask, _ = _ids_and_mask(table.column("prompt_ids"), pad_id, np.int64,
                                               left=True)
    response_ids, response_mask, resp = _ids_and_mask(table.column("response_ids"), pad_id,
                                                      np.float32)
    kw = {}
    if "response_mask" in table.column_names:  # multi-turn: the loss mask has holes
        kw["response_attention_mask"] = response_mask
        offsets, values = _list_parts(table.column("response_mask"))
        response_mask = torch.from_numpy(resp.padded(values, 0, np.float32))
    if "turns" in table.column_names:
        kw["turns"] = [json.loads(t) for t in table.column("turns").to_pylist()]
    for name in _TOKEN_COLS:
        if name in table.column_names:
            offsets, values = _list_parts(table.column(name))
            slots = resp if resp.matches(offsets) else _Slots(offsets)  # ours always match
            kw[name] = torch.from_numpy(slots.padded(values, 0.0, np.float32))
    for name in ("score", "baseline_score"):
        if name in table.column_names:
            kw[name] = torch.tensor(table.column(name).to_numpy(), dtype=torch.float32)
    if "baseline_response_ids" in table.column_names:
        kw["baseline_response_ids"], kw["baseline_response_mask"], _ = _ids_and_mask(
            table.column("baseline_response_ids"), pad_id, np.float32)
    logprobs = kw.pop("response_logprobs", torch.zeros_like(response_mask))
    return Batch(
        prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=response_ids,
        response_mask=response_mask, response_logprobs=logprobs,
        group=torch.tensor(table.column("group").to_numpy(), dtype=torch.long),
        uid=d["uid"], ground_truth=d["ground_truth"], data_source=d["data_source"],
        extra_info=_decode_shared(d["extra_info"]), pad_id=pad_id, meta=batch_meta, **kw)


_DICT_COLS = ["uid", "ground_truth", "data_source", "extra_info"]
"""Columns worth dictionary encoding: strings repeated by a prompt's G rows. Token and float
list columns are not (dictionary-encoding them doubled the write time of a 6144 x 256-token
batch and made it larger)."""


def batch_to_parquet_bytes(batch: Batch) -> bytes:
    # snappy (Parquet's default codec): token ids and log-probs barely compress, and zstd cost
    # more per write of a small batch than a 7% smaller object is worth
    # (BENCHMARKS.md "Small costs")
    buf = io.BytesIO()
    pq.write_table(batch_to_table(batch), buf, compression="snappy", use_dictionary=_DICT_COLS)
    return buf.getvalue()


def batch_from_parquet_bytes(data: bytes) -> Batch:
    # one in-memory file: ParquetFile reads it directly (pq.read_table's dataset layer costs
    # more per batch); the same table either way. No reader threads: a batch is a few
    # small column chunks, and handing them to arrow's pool cost more than decoding them here
    # (BENCHMARKS.md "Small costs")
    return table_to_batch(pq.ParquetFile(pa.BufferReader(data)).read(use_threads=False))


class PromptTooLongError(ValueError):
    """A prompt exceeds ``data.max_prompt_length`` tokens."""


def prompt_add_special_tokens(tokenizer) -> bool:
    """Whether a prompt rendered by :func:`~verl_core.data.dataset.render_prompt` for this
    tokenizer is tokenised with the tokenizer's special tokens.

    A chat template writes its own (Llama-3's starts with ``{{ bos_token }}``), so a templated
    prompt is tokenised with ``add_special_tokens=False``, as verl's ``RLHFDataset`` does; adding
    them again would start every prompt with two BOS. A tokenizer without a template gets the
    joined plain text, which only has a BOS if the tokenizer adds one (``True``, the tokenizer's
    own default, as our reward model does)."""
    return not getattr(tokenizer, "chat_template", None)


def truncate_prompt(ids: list[int], max_len: int, how: str) -> list[int]:
    """``ids`` cut to ``max_len`` tokens as verl's ``RLHFDataset`` cuts them (``data.truncation``:
    ``left`` keeps the last tokens, ``right`` the first, ``middle`` the first ``max_len // 2``
    and the last ``max_len - max_len // 2``). Unchanged when it fits."""
    if len(ids) <= max_len:
        return ids
    if how == "left":
        return ids[len(ids) - max_len:]
    if how == "right":
        return ids[:max_len]
    if how == "middle":
        head = max_len // 2
        return ids[:head] + ids[len(ids) - (max_len - head):]
    raise ValueError(f"data.truncation={how!r} does not cut prompts")


def encode_prompts(tokenizer, texts: list[str], max_prompt_length: int,
                   names: list[str] | None = None,
                   truncation: str = "error") -> tuple[torch.Tensor, torch.Tensor]:
    """Tokenise rendered prompts, left-padded. Returns (prompt_ids (B, P), prompt_mask (B, P)).

    Special tokens as :func:`prompt_add_special_tokens` decides (one BOS, from the template or
    the tokenizer, never both). An over-long prompt raises naming the row (``truncation``
    ``error``: truncating the question of a verifiable task makes its ground truth wrong), or is
    cut as ``data.truncation`` says (:func:`truncate_prompt`)."""
    enc = tokenizer(texts, add_special_tokens=prompt_add_special_tokens(tokenizer))["input_ids"]
    for i, ids in enumerate(enc):
        if len(ids) > max_prompt_length and truncation == "error":
            where = names[i] if names else f"row {i}"
            raise PromptTooLongError(
                f"prompt of {where} has {len(ids)} tokens > data.max_prompt_length="
                f"{max_prompt_length}; raise data.max_prompt_length, filter the dataset, or "
                "cut long prompts with data.truncation=left (or right, middle)")
        if not ids:
            where = names[i] if names else f"row {i}"
            raise PromptTooLongError(f"prompt of {where} encodes to zero tokens")
    enc = [truncate_prompt(list(e), max_prompt_length, truncation) for e in enc]
    pad = tokenizer.pad_token_id
    ids = _pad_left([np.asarray(e, np.int64) for e in enc], pad, torch.long)
    mask = _pad_left([np.ones(len(e), np.int64) for e in enc], 0, torch.long)
    return ids, mask
