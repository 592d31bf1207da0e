"""Teacher-forced forward passes over (prompt, response) rows: log-probs, entropy, values.

A row is a left-padded prompt followed by a right-padded response; positions are counted over
real tokens only, so left padding never shifts them (the same convention the rollout uses).

Remove-padding (verl's ``use_remove_padding``, ``packed=True``): the real tokens of a
micro-batch's rows go into one sequence (1, S), S = their real tokens, each row with its own
position ids 0..len-1, and attention stays inside each row:

- CPU (and CUDA without flash attention): SDPA per row, on the row boundaries (``cu_seq_lens``)
  by our attention function (``_packed_sdpa``, registered with transformers'
  ``AttentionInterface`` and switched on for the call only). Measured against SDPA over the whole
  sequence with a block-diagonal mask (transformers builds one from the per-row position ids):
  the boundaries win, as the mask still runs S^2 scores (``bench/dynamic_bsz.py``,
  BENCHMARKS.md). Under HF gradient checkpointing the decoder layers run again in backward, after
  the switch is undone, so there the block-diagonal mask (an argument the recomputation keeps) is
  used instead.
- CUDA with ``flash_attention_2``/``_3``: flash-attention's varlen kernel on the same
  boundaries (transformers' own path for ``cu_seq_lens_q``/position ids). Not run here (no GPU).

A model whose attention does not take these (no ``_supports_attention_backend``, a soft cap, no
``logits_to_keep``) is not packed: :func:`padding_layout` then buckets its rows by length.
"""

from __future__ import annotations

import contextlib
import inspect

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint
from transformers import AttentionInterface

from verl_core.algorithms.utils import entropy_from_logits, logprobs_from_logits
from verl_core.training.device import model_device
from verl_core.training.dist import SINGLE, DataParallel
from verl_core.training.packing import micro_batches, narrow

# Elements of a (rows, V) chunk of response logits per checkpointed call: each chunk's logits,
# softmax and products (~64 MiB of float32 each) exist one chunk at a time, in forward and again
# in backward (recomputed), so they stay bounded whatever n * T * V is.
_CHUNK_ELEMENTS = 1 << 24

# Model classes whose forward turned out to post-process the LM head's output (a soft cap, a
# logit scale): they take the full-logits path (see ``_rows_through_head``).
_HEAD_NOT_LAST: set[type] = set()


def _inputs(prompt_ids, prompt_mask, response_ids, response_mask):
    keep = prompt_mask.sum(0) > 0  # drop prompt columns that are padding in every row
    prompt_ids, prompt_mask = prompt_ids[:, keep], prompt_mask[:, keep]
    ids = torch.cat([prompt_ids, response_ids], dim=1)  # (n, P + T)
    attn = torch.cat([prompt_mask.long(), response_mask.long()], dim=1)  # (n, P + T)
    position = (attn.cumsum(-1) - 1).clamp(min=0)  # (n, P + T)
    return ids, attn, position, prompt_ids.shape[1]


_PACKED_SDPA = "verl_packed_sdpa"

CPU_PACKED_ATTENTION = "boundaries"
"""How a packed sequence attends without flash attention: ``boundaries`` (SDPA per row,
``_packed_sdpa``) or ``mask`` (one SDPA call over the sequence with transformers' block-diagonal
causal mask). Boundaries measured faster (module docstring); ``bench/dynamic_bsz.py`` sets this
to measure both."""


def _packed_sdpa(module, query, key, value, attention_mask, scaling=None, dropout=0.0, *,
                 cu_seq_lens_q=None, sliding_window=None, **kwargs):
    """Causal SDPA of each row of a packed sequence on its own: query (1, h, S, d), key and
    value (1, h_kv, S, d), ``cu_seq_lens_q`` (rows + 1,) the rows' boundaries; returns
    (1, S, h, d) as transformers' attention functions do. ``attention_mask`` is not read (the
    rows are the mask); ``sliding_window`` (Qwen2/Mistral sliding layers) bands a longer row."""
    if kwargs.get("softcap") is not None:
        raise ValueError("packed attention has no logit soft cap: this model is bucketed")
    bounds = cu_seq_lens_q.tolist()
    gqa = query.shape[1] != key.shape[1]
    p = dropout if module.training else 0.0
    outs = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        q, k, v = query[:, :, a:b], key[:, :, a:b], value[:, :, a:b]  # (1, h, len, d)
        if sliding_window is not None and b - a > sliding_window:
            i = torch.arange(b - a, device=q.device)
            band = (i[:, None] >= i[None, :]) & (i[:, None] - i[None, :] < sliding_window)
            outs.append(F.scaled_dot_product_attention(q, k, v, attn_mask=band, dropout_p=p,
                                                       scale=scaling, enable_gqa=gqa))
        else:
            outs.append(F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=p,
                                                       scale=scaling, enable_gqa=gqa))
    return torch.cat(outs, 2).transpose(1, 2).contiguous(), None  # (1, S, h, d)


AttentionInterface.register(_PACKED_SDPA, _packed_sdpa)


def packs(model) -> bool:
    """Whether ``model`` runs packed rows (module docstring): a transformers model whose attention
    goes through its attention interface (``_supports_attention_backend``: Llama, Qwen2, Mistral,
    ...) with SDPA, eager or flash attention, no logit soft cap, and ``logits_to_keep``."""
    cfg = getattr(model, "config", None)
    impl = getattr(cfg, "_attn_implementation", None) or ""
    return (getattr(model, "_supports_attention_backend", False)
            and (impl in ("sdpa", "eager") or impl.startswith("flash_attention"))
            and not getattr(cfg, "attn_logit_softcapping", None)
            and not getattr(cfg, "final_logit_softcapping", None)
            and "position_ids" in inspect.signature(model.forward).parameters)


def padding_layout(model, remove_padding: bool) -> str:
    """How ``model``'s micro-batches are laid out (:func:`~verl_core.training.packing.micro_batches`):
    ``padded`` (remove-padding off: as before it existed), ``packed`` (rows in one sequence) or,
    for a model that cannot be packed (:func:`packs`), ``bucketed`` (rows sorted by length)."""
    if not remove_padding:
        return "padded"
    return "packed" if packs(model) else "bucketed"


def _packed_inputs(prompt_ids, prompt_mask, response_ids, response_mask):
    """The rows' real tokens in one sequence. Returns the model's keyword arguments
    (input_ids (1, S), position_ids (1, S), cu_seq_lens (rows + 1,), ...), ``keep`` (R,): the
    packed position that predicts each real response token (R = response_mask.sum()), and
    ``where`` = (row, column) (R,) each of those tokens in the (n, T) response."""
    ids, attn, position, P = _inputs(prompt_ids, prompt_mask, response_ids, response_mask)
    real = attn.bool()  # (n, L)
    lengths = real.sum(-1)  # (n,)
    # packed index of every real cell of the padded (n, L) layout, row after row
    index = real.flatten().long().cumsum(0).view(real.shape) - 1  # (n, L)
    rows, cols = response_mask.bool().nonzero(as_tuple=True)  # (R,), (R,)
    keep = index[rows, P - 1 + cols]  # column P-1+t predicts response token t
    cu = torch.cat([lengths.new_zeros(1), lengths[lengths > 0].cumsum(0)]).to(torch.int32)
    longest = int(lengths.max()) if lengths.numel() else 0
    kwargs = dict(input_ids=ids[real][None], position_ids=position[real][None], use_cache=False,
                  cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=longest,
                  max_length_k=longest)
    return kwargs, keep, (rows, cols)


def _recomputes_layers(model) -> bool:
    """Whether HF activation (gradient) checkpointing is on: the decoder layers run again in
    backward (transformers 5 names it ``is_activation_checkpointing``, 4 ``is_gradient_...``)."""
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        if hasattr(type(model), name):
            return bool(getattr(model, name))
    return False


@contextlib.contextmanager
def _packed_call(model, kwargs: dict):
    """Yields the model's keyword arguments for a packed forward (module docstring): flash
    attention's varlen path (CUDA), our per-row SDPA for the call, or (HF gradient checkpointing,
    or ``CPU_PACKED_ATTENTION = "mask"``) SDPA with transformers' block-diagonal mask, which it
    builds from the per-row position ids when no attention mask is given."""
    cfg = model.config
    impl = cfg._attn_implementation
    if impl.startswith("flash_attention"):
        yield kwargs  # varlen from cu_seq_lens_q/k, max_length_q/k
        return
    mask_path = {k: v for k, v in kwargs.items() if not k.startswith(("cu_seq", "max_length"))}
    if CPU_PACKED_ATTENTION == "mask" or _recomputes_layers(model):
        yield mask_path
        return
    # a 2-D mask of ones: transformers finds a plain causal mask and builds none (no S x S)
    ones = torch.ones_like(kwargs["input_ids"])
    cfg._attn_implementation = _PACKED_SDPA
    try:
        yield {**kwargs, "attention_mask": ones}
    finally:
        cfg._attn_implementation = impl


def _scatter(values: torch.Tensor, where, shape) -> torch.Tensor:
    """(R,) values of the real response tokens at their (row, column) ``where``: (n, T), zeros
    elsewhere."""
    out = values.new_zeros(shape)
    out[where] = values
    return out


def takes_logits_to_keep(model) -> bool:
    """transformers' causal LMs (Llama, Qwen2, ...) accept ``logits_to_keep`` and then run the LM
    head only on those positions; a model without it gets the full logits, sliced here. A PEFT
    model (LoRA) passes its keyword arguments on to the model it wraps: that one's."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    return "logits_to_keep" in inspect.signature(inner.forward).parameters


def cache_kwarg(model) -> str:
    """transformers >= 5.3x renamed ``past_key_values`` to ``cache``; accept both (a PEFT
    model's: the wrapped model's)."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    params = inspect.signature(inner.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def distinct_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """rows: (n, L). Returns (first (u,), inverse (n,)): the index of the first occurrence of
    each distinct row, in order of appearance, and for each row the position of its row in
    ``first`` (``rows[first][inverse] == rows``)."""
    _, inv = torch.unique(rows, dim=0, return_inverse=True)  # (n,) ids in sorted-row order
    seen: dict[int, int] = {}
    for i, k in enumerate(inv.tolist()):
        seen.setdefault(k, i)
    first = torch.tensor(list(seen.values()), dtype=torch.long)
    slot = {k: j for j, k in enumerate(seen)}
    return first, torch.tensor([slot[k] for k in inv.tolist()], dtype=torch.long)


def response_logits(model, prompt_ids, prompt_mask, response_ids, response_mask,
                    temperature: float = 1.0) -> torch.Tensor:
    """Logits that predict each response token: (n, T, V), float32, divided by ``temperature``.

    The full-logits path, for a model whose LM head cannot be chunked (``_rows_through_head``):
    only the T positions that predict response tokens go through the head when the model takes
    ``logits_to_keep``; the prompt positions' logits are never formed."""
    ids, attn, position, P = _inputs(prompt_ids, prompt_mask, response_ids, response_mask)
    T = response_ids.shape[1]
    if takes_logits_to_keep(model):
        # position P-1+t predicts response token t: positions P-1 .. P+T-2
        keep = torch.arange(P - 1, P + T - 1, device=ids.device)
        logits = model(input_ids=ids, attention_mask=attn, position_ids=position,
                       logits_to_keep=keep).logits  # (n, T, V)
    else:
        logits = model(input_ids=ids, attention_mask=attn, position_ids=position).logits
        logits = logits[:, P - 1:-1]  # (n, T, V)
    logits = logits.float()
    if temperature not in (0.0, 1.0):
        logits = logits / temperature
    return logits


def _by_chunks(fn, x: torch.Tensor, labels: torch.Tensor, vocab: int, head=None):
    """``fn`` over chunks of rows: x (rows, H) hidden states when ``head`` is given (the LM head
    runs per chunk), else (rows, V) logits; labels (rows,). ``fn(logits (r, V) float32, labels
    (r,))`` returns a tuple of (r,) tensors; returns their (rows,) concatenations. With grad each
    chunk is checkpointed: backward recomputes its logits (the head's gemm included) instead of
    keeping them, so no (rows, V) tensor outlives its chunk."""
    def piece(xc, lc):
        return fn((xc if head is None else head(xc)).float(), lc)

    step = max(1, _CHUNK_ELEMENTS // max(vocab, 1))
    grad = torch.is_grad_enabled() and (x.requires_grad or head is not None)
    parts = [checkpoint(piece, xc, lc, use_reentrant=False) if grad else piece(xc, lc)
             for xc, lc in zip(x.split(step), labels.split(step))]  # one SplitBackward for all
    return tuple(torch.cat(p) for p in zip(*parts))


def _rows_through_head(model, prompt_ids, prompt_mask, response_ids, response_mask, fn,
                       packed: bool = False, shared: bool = False):
    """``fn`` (see ``_by_chunks``) at every response position: a tuple of (n, T) tensors
    (``packed``: the rows' real tokens in one sequence, :func:`_packed_inputs`; padding positions
    are then 0; ``shared``: rows with the same prompt run it once, :func:`_shared_prefix`).

    The decoder runs once to the T response positions' hidden states (``logits_to_keep``); the LM
    head then runs chunk by chunk *inside the model's own forward*: its ``forward`` is replaced
    for the call by the chunked computation, whose small (n, T, k) result the model returns as its
    "logits". So the head's weights are used between the root module's forward hooks, where FSDP2
    has them unsharded (tied embeddings included), and backward's recomputation runs after the
    root's pre-backward unshard. No [n, T, V] tensor exists, forward or backward.

    A model without ``logits_to_keep`` or an output embedding, or whose forward changes the head's
    output (Gemma's soft cap, Cohere's logit scale: the returned logits are then not the head's
    result), takes the full-logits path (``response_logits``) with the same chunked ``fn``."""
    n, T = response_ids.shape
    if shared and not packed:
        outs = _shared_prefix(model, prompt_ids, prompt_mask, response_ids, response_mask, fn)
        if outs is not None:
            return outs
    if packed:
        kwargs, keep, where = _packed_inputs(prompt_ids, prompt_mask, response_ids,
                                             response_mask)
        labels = response_ids[where]  # (R,)

        def shaped(o):  # (R,) -> (n, T)
            return _scatter(o, where, (n, T))
    else:
        labels = response_ids.reshape(n * T)  # (n*T,)

        def shaped(o):  # (n*T,) -> (n, T)
            return o.reshape(n, T)
    m = labels.numel()
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if (type(model) not in _HEAD_NOT_LAST and isinstance(head, torch.nn.Module)
            and takes_logits_to_keep(model)):
        vocab = getattr(head, "out_features", None) or head.weight.shape[0]
        linear = head.forward  # the head's own forward, called per chunk
        result = []

        def chunked_head(h):  # h: (n, T, H) or packed (1, R, H), the LM head's input
            outs = _by_chunks(fn, h.reshape(m, -1), labels, vocab, head=linear)
            # (n, T, k) / (1, R, k), a tensor of its own: FSDP2 warns about a view returned by
            # the root
            result.append(torch.stack([shaped(o) if not packed else o.reshape(1, m)
                                       for o in outs], -1))
            return result[-1]

        own = head.__dict__.get("forward")  # an instance-level forward someone else set
        head.forward = chunked_head
        try:
            if packed:
                with _packed_call(model, kwargs) as kw:
                    out = model(**kw, logits_to_keep=keep).logits  # (1, R, k)
            else:
                ids, attn, position, P = _inputs(prompt_ids, prompt_mask, response_ids,
                                                 response_mask)
                keep = torch.arange(P - 1, P + T - 1, device=ids.device)  # predict responses
                out = model(input_ids=ids, attention_mask=attn, position_ids=position,
                            logits_to_keep=keep).logits  # (n, T, k)
        finally:
            if own is None:
                del head.forward  # the class's forward again
            else:
                head.forward = own
        if len(result) == 1 and out is result[0]:
            return tuple(shaped(o) for o in out[0].unbind(-1)) if packed else out.unbind(-1)
        _HEAD_NOT_LAST.add(type(model))
    if packed:
        with _packed_call(model, kwargs) as kw:
            if takes_logits_to_keep(model):
                logits = model(**kw, logits_to_keep=keep).logits[0]  # (R, V)
            else:
                logits = model(**kw).logits[0, keep]  # (S, V) -> (R, V)
        V = logits.shape[-1]
        return tuple(shaped(o) for o in _by_chunks(fn, logits.float(), labels, V))
    logits = response_logits(model, prompt_ids, prompt_mask, response_ids, response_mask)
    V = logits.shape[-1]
    outs = _by_chunks(fn, logits.reshape(n * T, V), labels, V)  # logits: (n*T, V)
    return tuple(o.reshape(n, T) for o in outs)


def _shared_prefix(model, prompt_ids, prompt_mask, response_ids, response_mask, fn):
    """``_rows_through_head``'s result with each distinct prompt of the rows run once (verl's
    ``use_prefix_grouper``: a GRPO group's G rows share their prompt), or None where it does not
    apply (every prompt distinct, a model without ``logits_to_keep`` or an output embedding, HF
    activation checkpointing, an FSDP2-sharded model): the caller then runs every row whole.

    Two forwards of the model, both through its own head (as ``_rows_through_head``): the
    distinct prompts with a KV cache, whose last position predicts each row's first response
    token; then every row's response tokens 0..T-2 attending to its prompt's keys and values
    (the cache, indexed to the rows) and to its own earlier tokens, predicting tokens 1..T-1.
    The positions, masks and attended keys are those of the whole-row forward, so the numbers
    are the same up to float rounding; with grad, backward sums the G rows' gradients into
    their prompt's one forward (the index's backward). Prompt compute: distinct prompts, not
    rows (a G-th of it for GRPO)."""
    from torch.distributed.fsdp import FSDPModule
    from transformers import DynamicCache

    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if (type(model) in _HEAD_NOT_LAST or not isinstance(head, torch.nn.Module)
            or not takes_logits_to_keep(model) or _recomputes_layers(model)
            or isinstance(model, FSDPModule)):
        return None
    keep = prompt_mask.sum(0) > 0  # drop prompt columns that are padding in every row
    prompt_ids, prompt_mask = prompt_ids[:, keep], prompt_mask[:, keep].long()
    device = prompt_ids.device
    first, inverse = (i.to(device) for i in
                      distinct_rows(torch.cat([prompt_ids, prompt_mask], 1).cpu()))
    n, T = response_ids.shape
    if len(first) == n:
        return None
    vocab = getattr(head, "out_features", None) or head.weight.shape[0]
    linear, result = head.forward, []

    def head_on(labels, rows=None):
        def chunked(h):  # (u or n, t, H) -> (n, t, k)
            h = h if rows is None else h[rows]
            t = h.shape[1]
            outs = _by_chunks(fn, h.reshape(n * t, -1), labels.reshape(n * t), vocab,
                              head=linear)
            result.append(torch.stack([o.reshape(n, t) for o in outs], -1))
            return result[-1]
        return chunked

    cache = DynamicCache()
    position = (prompt_mask.cumsum(-1) - 1).clamp(min=0)  # (n, P)
    own = head.__dict__.get("forward")
    try:
        head.forward = head_on(response_ids[:, :1], inverse)  # the prompt's last position
        outs = [model(input_ids=prompt_ids[first], attention_mask=prompt_mask[first],
                      position_ids=position[first], use_cache=True, logits_to_keep=1,
                      **{cache_kwarg(model): cache}).logits]
        if T > 1:
            cache.batch_select_indices(inverse)  # each row its prompt's keys and values
            resp = response_mask.long()
            head.forward = head_on(response_ids[:, 1:])
            outs.append(model(input_ids=response_ids[:, :-1],
                  attention_mask=torch.cat([prompt_mask, resp[:, :-1]], 1),
                  position_ids=(prompt_mask.sum(-1, keepdim=True)
                                + (resp.cumsum(-1) - 1).clamp(min=0))[:, :-1],
                  use_cache=True, logits_to_keep=0, **{cache_kwarg(model): cache}).logits)
    finally:
        if own is None:
            del head.forward  # the class's forward again
        else:
            head.forward = own
    if len(result) != len(outs) or any(o is not r for o, r in zip(outs, result)):
        _HEAD_NOT_LAST.add(type(model))  # its forward changed the head's output (module notes)
        return None
    return torch.cat(result, 1).unbind(-1)  # k tensors (n, T)


def _logp_entropy(temperature: float, with_entropy: bool):
    """``fn`` for ``_rows_through_head``: (logp,) or (logp, entropy) under
    softmax(logits / temperature)."""
    def fn(logits, labels):  # (rows, V), (rows,)
        if temperature not in (0.0, 1.0):
            logits = logits / temperature
        logp = logprobs_from_logits(logits, labels)
        return (logp, entropy_from_logits(logits)) if with_entropy else (logp,)
    return fn


def response_logprobs(model, prompt_ids, prompt_mask, response_ids, response_mask,
                      temperature: float = 1.0, with_entropy: bool = False,
                      packed: bool = False, shared: bool = False):
    """Returns (logp (n, T), entropy (n, T) or None); padding positions are zeroed.

    The LM head, log-softmax and entropy run over checkpointed chunks of rows
    (``_rows_through_head``): memory for the logits is one chunk's, whatever n * T * V is.
    ``packed``: the rows' real tokens run as one sequence (module docstring; :func:`packs`).
    ``shared``: rows with the same prompt run it once (:func:`_shared_prefix`)."""
    outs = _rows_through_head(model, prompt_ids, prompt_mask, response_ids, response_mask,
                              _logp_entropy(temperature, with_entropy), packed, shared)
    logp = outs[0] * response_mask
    return logp, outs[1] * response_mask if with_entropy else None


def critic_values(critic, prompt_ids, prompt_mask, response_ids, response_mask,
                  packed: bool = False) -> torch.Tensor:
    """Value of the state before each response token: (n, T) (a token-classification head with
    one label, as verl's critic); ``packed`` as :func:`response_logprobs`."""
    if packed:
        kwargs, keep, where = _packed_inputs(prompt_ids, prompt_mask, response_ids,
                                             response_mask)
        with _packed_call(critic, kwargs) as kw:
            values = critic(**kw).logits[0, :, 0]  # (S,)
        return _scatter(values[keep].float(), where, response_ids.shape)  # (n, T)
    ids, attn, position, P = _inputs(prompt_ids, prompt_mask, response_ids, response_mask)
    values = critic(input_ids=ids, attention_mask=attn, position_ids=position).logits[..., 0]
    return values[:, P - 1:-1].float() * response_mask  # (n, T)


def _by_micro_batch(fn, batch, micro_batch_size: int, max_token_len: int,
                    dp: DataParallel, layout: str = "padded",
                    device: torch.device | None = None) -> torch.Tensor:
    """(N, T) on the host: ``fn(mb)`` (n, t) of each micro-batch ``mb`` of ``batch``, moved to
    ``device`` (the model's), written at its rows:
    chunks of ``micro_batch_size`` rows, or with ``max_token_len`` > 0 rows packed to that token
    budget, cut to their longest response (:mod:`verl_core.training.packing`; ``dp``: the
    workers agree on the number of forwards; ``layout``: :func:`padding_layout`)."""
    N, T = batch.response_ids.shape
    out = torch.zeros(N, T)  # on the host, as every stored batch field (training/device.py)
    for rows in micro_batches(torch.arange(N), batch, micro_batch_size,
                              max_token_len, dp, layout):
        mb = batch.select(rows)
        mb = narrow(mb) if max_token_len or layout != "padded" else mb
        part = fn(mb if device is None else mb.to(device))  # (n, t), t <= T
        out[rows, :part.shape[1]] = part.float().cpu()
    return out


@torch.no_grad()
def batched_logprobs(model, batch, temperature: float, micro_batch_size: int, *,
                     max_token_len: int = 0, dp: DataParallel = SINGLE,
                     remove_padding: bool = False, prefix_grouper: bool = False
                     ) -> torch.Tensor:
    """No-grad log-probs of every row of a :class:`~verl_core.data.batch.Batch`: (N, T); micro-
    batches of ``micro_batch_size`` rows or of ``max_token_len`` tokens (``_by_micro_batch``);
    ``remove_padding``: verl's ``use_remove_padding`` (:func:`padding_layout`);
    ``prefix_grouper``: verl's ``use_prefix_grouper`` (:func:`_shared_prefix`)."""
    was_training = model.training
    model.eval()
    layout = padding_layout(model, remove_padding)
    out = _by_micro_batch(lambda mb: response_logprobs(
        model, mb.prompt_ids, mb.prompt_mask, mb.response_ids, mb.response_attn,
        temperature, packed=layout == "packed", shared=prefix_grouper)[0], batch,
        micro_batch_size, max_token_len, dp, layout, model_device(model))
    model.train(was_training)
    return out


@torch.no_grad()
def batched_sum_pi_squared(model, batch, temperature: float, micro_batch_size: int, *,
                           max_token_len: int = 0, dp: DataParallel = SINGLE,
                           remove_padding: bool = False) -> torch.Tensor:
    """No-grad Σ_v π_v² of the (temperature-scaled) policy at every response position: (N, T),
    0 on padding. The optimal-token-baseline estimators read it (verl's ``sum_pi_squared``)."""
    def sum_pi_sq(logits, labels):  # (rows, V), (rows,) -> ((rows,),)
        if temperature not in (0.0, 1.0):
            logits = logits / temperature
        # Σ_v π_v² = exp(logsumexp(2z) - 2 logsumexp(z)), without forming the probabilities
        return (torch.exp(torch.logsumexp(2 * logits, -1) - 2 * torch.logsumexp(logits, -1)),)

    layout = padding_layout(model, remove_padding)

    def one(mb):
        (sq,) = _rows_through_head(model, mb.prompt_ids, mb.prompt_mask, mb.response_ids,
                                   mb.response_attn, sum_pi_sq, layout == "packed")
        return sq * mb.response_attn

    was_training = model.training
    model.eval()
    out = _by_micro_batch(one, batch, micro_batch_size, max_token_len, dp, layout,
                          model_device(model))
    model.train(was_training)
    return out


@torch.no_grad()
def batched_values(critic, batch, micro_batch_size: int, *, max_token_len: int = 0,
                   dp: DataParallel = SINGLE, remove_padding: bool = False) -> torch.Tensor:
    """No-grad critic values of every row: (N, T) (micro-batches as ``batched_logprobs``)."""
    was_training = critic.training
    critic.eval()
    layout = padding_layout(critic, remove_padding)
    out = _by_micro_batch(lambda mb: critic_values(critic, mb.prompt_ids, mb.prompt_mask,
                                                   mb.response_ids, mb.response_attn,
                                                   layout == "packed"),
                          batch, micro_batch_size, max_token_len, dp, layout,
                          model_device(critic))
    critic.train(was_training)
    return out
