"""Checks of the rollout-engine contract (``verl_core.rollout.base.RolloutEngine``) that every
engine must pass; each engine's test file runs them on its own engine."""
import torch

from verl_core.rollout import SamplingParams


def assert_rows_draw_from_their_own_seeds_and_limits(eng, ids, mask, pad_id: int) -> None:
    """``row_seeds``: a row's sample depends on its seed and prompt only (generated alone, or in
    another order, it is the same); ``row_limits``: each row stops at its own limit, and a
    limited row is the prefix of the unlimited one (the same draws)."""
    n, T = ids.shape[0], 6
    p = SamplingParams(temperature=1.0, max_new_tokens=T, seed=0)
    seeds = [1000 + 7 * i for i in range(n)]
    whole = eng.generate(ids, mask, p, row_seeds=seeds)
    for i in (0, n - 1):
        alone = eng.generate(ids[i:i + 1], mask[i:i + 1], p, row_seeds=[seeds[i]])
        k = alone.response_ids.shape[1]
        assert torch.equal(alone.response_ids[0], whole.response_ids[i, :k])
        assert not whole.response_mask[i, k:].any()
    flipped = eng.generate(ids.flip(0), mask.flip(0), p, row_seeds=seeds[::-1])
    assert torch.equal(_trim(flipped, pad_id).flip(0), _trim(whole, pad_id))
    reseeded = eng.generate(ids, mask, p, row_seeds=[s + 1 for s in seeds])
    assert not torch.equal(reseeded.response_ids, whole.response_ids)

    limits = [1 + i % T for i in range(n)]
    cut = eng.generate(ids, mask, p, row_seeds=seeds, row_limits=limits)
    lengths = cut.response_mask.sum(-1)
    assert (lengths <= torch.tensor(limits)).all()
    for i in range(n):
        k = int(lengths[i])
        assert torch.equal(cut.response_ids[i, :k], whole.response_ids[i, :k])
        assert k == min(limits[i], int(whole.response_mask[i].sum()))
        assert not cut.logprobs[i, k:].any()


def _trim(out, pad_id: int) -> torch.Tensor:
    """The response ids, padding columns beyond the longest row dropped."""
    T = int(out.response_mask.sum(-1).max())
    return out.response_ids[:, :T]
