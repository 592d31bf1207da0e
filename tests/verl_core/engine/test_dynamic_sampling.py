"""DAPO's group filter (verl_core/engine/dynamic_sampling.py) on hand-made scores: which groups
are kept, in which order, the trim to data.train_batch_size, and max_num_gen_batches, as verl's
recipe/dapo/dapo_ray_trainer.py does them."""
import pytest
import torch

from verl_core.config import ConfigError, preset
from verl_core.data.batch import Batch
from verl_core.data.sampler import ResumableSampler
from verl_core.engine.dynamic_sampling import (FilterGroupsExhaustedError, GroupFilter,
                                               concat_batches, gen_batch_indices, kept_groups)

G = 4


def _groups(*scores):
    """values (N,) and group ids (N,) of groups of G responses with the given scores."""
    values = [v for s in scores for v in s]
    group = [g for g, s in enumerate(scores) for _ in s]
    return values, group


def test_all_equal_groups_are_dropped_and_the_order_kept():
    values, group = _groups([1, 1, 1, 1],  # 0: all right -> dropped
                            [0, 1, 0, 0],  # 1: kept
                            [0, 0, 0, 0],  # 2: all wrong -> dropped
                            [0.5, 0.5, 0.5, 0.25],  # 3: kept (one differs)
                            [-0.25, -0.25, -0.25, -0.25])  # 4: equal non-0/1 values -> dropped
    assert kept_groups(values, group) == [1, 3]
    # order of first appearance, not of id
    assert kept_groups([0, 1, 1, 0, 1, 1], [7, 7, 2, 2, 5, 5]) == [7, 2]
    # a group of one response is kept (verl: ``len(values) == 1``)
    assert kept_groups([1.0, 0.0, 0.0], [0, 1, 1]) == [0]


def test_batches_are_added_until_train_batch_size_groups_then_trimmed():
    f = GroupFilter(train_batch_size=3, max_num_gen_batches=0)
    # generation batch 0: groups 1 and 2 kept (2 < 3: sample again)
    assert f.add(*_groups([0, 0, 0, 0], [1, 0, 0, 0], [1, 1, 0, 1])) is False
    # generation batch 1: groups 0, 2 and 3 kept -> 5 kept >= 3
    assert f.add(*_groups([0, 1, 1, 1], [1, 1, 1, 1], [0, 0, 1, 0], [1, 0, 1, 0])) is True
    assert f.kept == [(0, 1), (0, 2), (1, 0), (1, 2), (1, 3)]
    # verl's batch[:train_batch_size * n]: the first three kept groups, the rest dropped
    assert f.selection == [(0, 1), (0, 2), (1, 0)]
    assert f.metrics() == {"train/num_gen_batches": 2.0, "train/num_kept_groups": 5.0,
                           "train/num_filtered_groups": 2.0}  # 7 groups seen, 5 kept


def test_max_num_gen_batches_fails_the_step_short_of_the_batch():
    f = GroupFilter(train_batch_size=2, max_num_gen_batches=2)
    assert f.add(*_groups([1, 1, 1, 1], [0, 1, 0, 0])) is False  # 1 kept, 1 of 2 batches
    with pytest.raises(FilterGroupsExhaustedError,
                       match=r"max_num_gen_batches=2 .* only 1 of data.train_batch_size=2"):
        f.add(*_groups([0, 0, 0, 0], [1, 1, 1, 1]))  # 2 of 2 batches, still 1 kept
    # filled by the last allowed batch: no error
    f = GroupFilter(train_batch_size=2, max_num_gen_batches=2)
    f.add(*_groups([1, 1, 1, 1], [0, 1, 0, 0]))
    assert f.add(*_groups([0, 1, 1, 1])) is True
    # 0: no limit (verl: non-positive)
    f = GroupFilter(train_batch_size=1, max_num_gen_batches=0)
    for _ in range(50):
        assert f.add(*_groups([0, 0, 0, 0])) is False
    assert f.add(*_groups([0, 1, 0, 0])) is True and f.num_gen_batches == 51


def test_generation_batches_walk_the_shuffled_epochs_in_order():
    s = ResumableSampler(10, 3, seed=7)  # 3 full batches per epoch, the tail of 1 dropped
    seq = [s.next_batch() for _ in range(7)]
    fresh = ResumableSampler(10, 3, seed=7)
    assert [gen_batch_indices(fresh, c) for c in range(7)] == seq
    assert gen_batch_indices(fresh, 4) == seq[4]  # any position, in any order


def _batch(T, widths, group):
    n = len(widths)
    mask = torch.zeros(n, T)
    for i, w in enumerate(widths):
        mask[i, :w] = 1
    return Batch(prompt_ids=torch.ones(n, 2, dtype=torch.long),
                 prompt_mask=torch.ones(n, 2, dtype=torch.long),
                 response_ids=torch.where(mask > 0, 5, 0).long(), response_mask=mask,
                 response_logprobs=-mask, group=torch.tensor(group),
                 uid=[str(g) for g in group], ground_truth=["1"] * n, data_source=["x"] * n,
                 extra_info=[{}] * n, score=torch.arange(n, dtype=torch.float32))


def test_concat_pads_to_the_widest_and_renumbers_groups():
    a, b = _batch(2, [1, 2], [0, 0]), _batch(4, [4, 3], [0, 0])
    c = concat_batches([a, b])
    assert c.response_ids.shape == (4, 4) and c.group.tolist() == [0, 0, 1, 1]
    assert c.response_mask.sum(-1).tolist() == [1, 2, 4, 3]
    assert c.response_ids[0].tolist() == [5, 0, 0, 0]  # right-padded with the pad id
    assert c.score.tolist() == [0, 1, 0, 1] and c.ref_logprobs is None


def test_config_names_the_key_and_the_fix():
    ok = preset("grpo", **{"algorithm.filter_groups_enable": True, "data.gen_batch_size": 96})
    assert ok.data.gen_batch_prompts == 96
    assert preset("grpo", **{"algorithm.filter_groups_enable": True}).data.gen_batch_prompts == 64
    with pytest.raises(ConfigError, match=r"data.gen_batch_size=96: .*filter_groups_enable=True"):
        preset("grpo", **{"data.gen_batch_size": 96})
    with pytest.raises(ConfigError, match=r"algorithm.filter_groups_metric='accuracy': unknown "
                                          r"value; known: acc, score, seq_final_reward"):
        preset("grpo", **{"algorithm.filter_groups_metric": "accuracy"})
    with pytest.raises(ConfigError, match=r"algorithm.max_num_gen_batches=-1: must be >= 0"):
        preset("grpo", **{"algorithm.max_num_gen_batches": -1})
    with pytest.raises(ConfigError, match=r"algorithm.filter_groups_enable=True: .*group "
                                          r"estimator"):
        preset("ppo", **{"algorithm.filter_groups_enable": True})
