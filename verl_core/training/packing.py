"""Which rows go through one forward together: token-budget micro-batches (verl's
``use_dynamic_bsz``) and token-balanced worker blocks (verl's ``trainer.balance_batch``).

What belongs here: pure functions of row lengths (ties broken by row index, so the packing, and
with it a resumed run, is the same bits every time), the one agreement between workers that
FSDP2 needs (every worker runs the same number of forwards), and cutting a micro-batch to its
longest response. The losses' weights are not here: each micro-batch's loss is weighted by its
share of the mini-batch's denominator (:func:`~verl_core.algorithms.micro_batch_weight`), which
is what makes the result independent of the packing.

Micro-batches are cut by their *padded* size: a micro-batch runs rows x (its longest prompt + its
longest response) positions, and that, not the real-token count, is what its activations and its
compute scale with here (no remove-padding yet). So rows are sorted by length and cut into
consecutive runs whose padded size fits the budget: each micro-batch holds rows of similar length
(little padding), and no micro-batch runs more positions than the budget allows. verl balances
micro-batches with Karmarkar-Karp on real tokens, which is right when padding is removed; on padded
rows it mixes long and short rows and pays the long row's width for all of them (measured:
``bench/dynamic_bsz.py``). Worker blocks (``balance_batch``) are balanced with Karmarkar-Karp.

With remove-padding (verl's ``use_remove_padding``; the layouts of :func:`micro_batches`) a
packed micro-batch runs its real tokens only, so there the budget counts real tokens and the
micro-batches are Karmarkar-Karp-balanced, as verl's (:func:`packed_micro_batches`); a model
that cannot be packed has its fixed-size micro-batches bucketed by length instead.

The partitioner is hand-written (as verl's ``seqlen_balancing.py`` is): the libraries that offer
number partitioning (``numberpartitioning``, ``prtpy``) do not take the equal-count constraint the
worker blocks need, nor promise a tie order, and the algorithm is 40 lines.
"""

from __future__ import annotations

import heapq

import torch

from verl_core.data.batch import _TOKEN_COLS, Batch
from verl_core.training.dist import SINGLE, DataParallel


def row_tokens(batch: Batch) -> torch.Tensor:
    """(N,) long: real tokens of each row, prompt + response, the count verl's token budget
    measures (its ``attention_mask.sum``)."""
    return (batch.prompt_mask.sum(-1) + batch.response_attn.sum(-1)).long()


def karmarkar_karp(lengths: list[int], k: int, equal_size: bool = False) -> list[list[int]]:
    """Positions 0..n-1 of ``lengths`` in ``k`` parts of nearly equal sums (Karmarkar & Karp's
    largest differencing method, k-way, as verl's ``get_seqlen_balanced_partitions``); each part
    sorted ascending, parts ordered by their first position.

    ``equal_size``: every part gets n / k positions (n must be a multiple of k): the sorted
    lengths are dealt in runs of k, one to each part, before the differencing starts.

    A state is k partial parts; the two states of largest spread (max sum - min sum) are merged
    by joining the heaviest part of one with the lightest of the other, and so on, which cancels
    the spreads against each other. Ties in the heap are broken by creation order, and the first
    states are created in (length, position) order: a pure function of ``lengths``."""
    n = len(lengths)
    if not 1 <= k <= max(n, 1):
        raise ValueError(f"cannot cut {n} rows into {k} non-empty parts")
    if equal_size and n % k:
        raise ValueError(f"{n} rows cannot be cut into {k} parts of equal size")
    order = sorted(range(n), key=lambda i: (lengths[i], i))
    heap: list = []
    made = 0

    def push(parts):  # parts: list of (sum, positions), heaviest first
        nonlocal made
        parts.sort(key=lambda p: (-p[0], p[1][0] if p[1] else n))
        heapq.heappush(heap, (-(parts[0][0] - parts[-1][0]), made, parts))
        made += 1

    if equal_size:
        for s in range(0, n, k):
            push([(lengths[i], [i]) for i in order[s:s + k]])
    else:
        for i in order:
            push([(lengths[i], [i])] + [(0, []) for _ in range(k - 1)])
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        # a heaviest-first, b reversed lightest-first: the big parts of one meet the small of b
        push([(sa + sb, pa + pb) for (sa, pa), (sb, pb) in zip(a, reversed(b))])
    parts = [sorted(p) for _, p in heap[0][2]]
    return sorted(parts, key=lambda p: p[0] if p else n)


def padded_size(prompt: list[int], response: list[int], part: list[int]) -> int:
    """Positions a micro-batch of rows ``part`` runs: rows x (longest prompt + longest response)
    (``prompt``, ``response``: every row's real lengths)."""
    return len(part) * (max(prompt[i] for i in part) + max(response[i] for i in part))


def _packed(prompt: list[int], response: list[int], max_tokens: int,
            k: int) -> list[list[int]]:
    """Positions 0..n-1 in at least ``k`` (and at most n) runs of the (length, position) order,
    each of padded size <= ``max_tokens`` unless it is one row: first greedily (a run grows while
    it fits), then the run of largest padded size (ties: the earlier) halved until there are
    ``k`` (halving never makes a run larger)."""
    n = len(prompt)
    order = sorted(range(n), key=lambda i: (prompt[i] + response[i], i))
    parts: list[list[int]] = []
    width = (0, 0)  # the last run's longest prompt and response
    for i in order:
        grown = (max(width[0], prompt[i]), max(width[1], response[i]))
        if parts and (len(parts[-1]) + 1) * sum(grown) <= max_tokens:
            parts[-1].append(i)
            width = grown
        else:
            parts.append([i])
            width = (prompt[i], response[i])
    while len(parts) < min(k, n):
        j = max(range(len(parts)), key=lambda j: (len(parts[j]) > 1,
                                                  padded_size(prompt, response, parts[j]), -j))
        run = parts[j]
        parts[j:j + 1] = [run[:len(run) // 2], run[len(run) // 2:]]
    return parts


def token_micro_batches(rows: torch.Tensor, batch: Batch, max_tokens: int,
                        dp: DataParallel = SINGLE) -> list[torch.Tensor]:
    """``rows`` (n,) of ``batch`` cut into micro-batches that each run at most ``max_tokens``
    positions, padding included (:func:`padded_size`; their real tokens are fewer); a row longer
    than the budget gets a micro-batch of its own. Returns 1-D long index tensors (subsets of
    ``rows``), rows of similar length together.

    With W > 1 every worker cuts its own rows into the same number of micro-batches (the
    largest any worker needs), since under FSDP2 each forward is a collective; each worker's rows
    are equally many, so that number is always reachable."""
    prompt = batch.prompt_mask[rows].sum(-1).long().tolist()
    response = batch.response_attn[rows].sum(-1).long().tolist()
    parts = _packed(prompt, response, max_tokens, 1)
    if dp.distributed:  # every worker sees the same counts and decides alike
        parts = _packed(prompt, response, max_tokens, max(dp.gather_objects(len(parts))))
    return [rows[torch.tensor(p, dtype=torch.long)] for p in parts]


def _fits(tokens: list[int], k: int, max_tokens: int) -> list[list[int]] | None:
    """The Karmarkar-Karp cut of ``tokens`` into ``k`` parts if every part of several rows
    holds at most ``max_tokens`` real tokens, else None."""
    parts = karmarkar_karp(tokens, k)
    ok = all(len(p) == 1 or sum(tokens[i] for i in p) <= max_tokens for p in parts)
    return parts if ok else None


def packed_micro_batches(rows: torch.Tensor, batch: Batch, max_tokens: int,
                         dp: DataParallel = SINGLE) -> list[torch.Tensor]:
    """``rows`` (n,) cut into micro-batches of at most ``max_tokens`` *real* tokens (what a
    packed micro-batch runs; a longer row alone), Karmarkar-Karp-balanced (verl's
    ``rearrange_micro_batches``): the fewest parts k >= ceil(tokens / budget) whose cut fits.
    With W > 1 every worker sees every worker's lengths (one gather) and all take the smallest
    k that fits on each of them: the same number of forwards everywhere."""
    tokens = row_tokens(batch)[rows].tolist()
    everyone = dp.gather_objects(tokens) if dp.distributed else [tokens]
    k = max(-(-sum(t) // max_tokens) for t in everyone)
    k = max(1, min(k, min(len(t) for t in everyone)))
    while any(_fits(t, k, max_tokens) is None for t in everyone):
        k += 1  # k = n fits: every row alone
    return [rows[torch.tensor(p, dtype=torch.long)] for p in _fits(tokens, k, max_tokens)]


def micro_batches(rows: torch.Tensor, batch: Batch, micro_batch_rows: int,
                  max_tokens: int = 0, dp: DataParallel = SINGLE,
                  layout: str = "padded") -> list[torch.Tensor]:
    """``rows`` in consecutive chunks of ``micro_batch_rows`` (``max_tokens`` 0), or packed to
    the token budget ``max_tokens`` (:func:`token_micro_batches`).

    ``layout`` (remove-padding, :func:`~verl_core.training.forward.padding_layout`): ``packed``
    (the model runs each micro-batch's real tokens as one sequence): a token budget counts real
    tokens (:func:`packed_micro_batches`); ``bucketed`` (padded rows, remove-padding asked for
    a model that cannot pack): fixed-size chunks of the rows sorted by length (ties by
    position), so each chunk is cut to little padding; ``padded``: as without remove-padding."""
    if max_tokens:
        if layout == "packed":
            return packed_micro_batches(rows, batch, max_tokens, dp)
        return token_micro_batches(rows, batch, max_tokens, dp)
    if layout == "bucketed":
        tokens = row_tokens(batch)[rows].tolist()
        rows = rows[torch.tensor(sorted(range(len(tokens)), key=lambda i: (tokens[i], i)),
                                 dtype=torch.long)]
    return [rows[s:s + micro_batch_rows] for s in range(0, rows.numel(), micro_batch_rows)]


def narrow(mb: Batch) -> Batch:
    """``mb`` with its response columns cut to its longest response (at least one column):
    rows packed by tokens pay for their own padding only, not the batch's longest response.
    A right-padded position never enters a real position's causal attention, so nothing else
    changes (``seq-mean-token-sum-norm`` must then be given the full width as its C)."""
    width = max(int(mb.response_lengths.max()) if mb.num_rows else 0, 1)
    if width >= mb.response_ids.shape[1]:
        return mb
    cut = {name: getattr(mb, name)[:, :width] for name in ("response_ids", "response_mask",
                                                           "response_attention_mask",
                                                           *_TOKEN_COLS)
           if getattr(mb, name) is not None}
    return mb.replace(**cut)


def balanced_order(rows: torch.Tensor, tokens: torch.Tensor, world: int) -> torch.Tensor:
    """``rows`` (n,) reordered so that its W contiguous blocks (what :meth:`DataParallel.block`
    hands each worker) hold nearly equal token counts (verl's ``trainer.balance_batch``): the
    same rows, so a mini-batch's loss, a sum weighted by each row's share, does not change."""
    if world <= 1:
        return rows
    parts = karmarkar_karp(tokens[rows].tolist(), world, equal_size=True)
    return rows[torch.tensor([i for p in parts for i in p], dtype=torch.long)]


def worker_order(tokens: torch.Tensor, world: int, balance: bool) -> torch.Tensor:
    """(N,) every row, in the order whose W contiguous blocks the workers take for a no-grad
    forward: token-balanced (:func:`balanced_order`) with ``balance``, else 0..N-1."""
    rows = torch.arange(tokens.numel())
    return balanced_order(rows, tokens, world) if balance else rows


def in_row_order(order: torch.Tensor, gathered: torch.Tensor) -> torch.Tensor:
    """Rows gathered in ``order`` (N, ...) put back at their own places (row i at i)."""
    if torch.equal(order, torch.arange(order.numel())):
        return gathered
    out = torch.empty_like(gathered)
    out[order.to(gathered.device)] = gathered
    return out
