"""ResumableSampler: exact batches, dropped tails, and bit-for-bit resume across epochs."""

import json

import pytest

from verl_core.data.sampler import ResumableSampler


def test_epochs_cover_distinct_indices_and_drop_the_tail():
    # 10 items, batch 3 -> 3 batches per epoch, 1 index per epoch dropped
    s = ResumableSampler(10, 3, seed=0)
    assert s.batches_per_epoch == 3
    epochs = [[s.next_batch() for _ in range(3)] for _ in range(4)]
    for batches in epochs:
        flat = [i for b in batches for i in b]
        assert all(len(b) == 3 for b in batches)
        assert len(set(flat)) == 9 and set(flat) <= set(range(10))
    assert len({tuple(tuple(b) for b in e) for e in epochs}) == 4  # each epoch reshuffled
    assert s.state_dict()["epoch"] == 3


def test_no_shuffle_is_sequential():
    s = ResumableSampler(5, 2, seed=3, shuffle=False)
    assert [s.next_batch() for _ in range(4)] == [[0, 1], [2, 3], [0, 1], [2, 3]]


def test_seed_determines_batches():
    def draw(seed):
        s = ResumableSampler(50, 8, seed=seed)
        return [s.next_batch() for _ in range(20)]

    assert draw(1) == draw(1)
    assert draw(1) != draw(2)


@pytest.mark.parametrize("seed", [0, 1, 12345])
@pytest.mark.parametrize("num_items,batch_size,crash_at", [(10, 3, 4), (10, 3, 3), (64, 8, 13),
                                                           (7, 7, 2)])
def test_resume_equivalence(seed, num_items, batch_size, crash_at):
    total = 3 * (num_items // batch_size) + 2  # runs over several epoch boundaries
    straight = ResumableSampler(num_items, batch_size, seed)
    expected = [straight.next_batch() for _ in range(total)]

    first = ResumableSampler(num_items, batch_size, seed)
    got = [first.next_batch() for _ in range(crash_at)]
    state = json.loads(json.dumps(first.state_dict()))  # survives a JSON checkpoint
    assert all(type(v) is int for v in state.values())
    del first  # crash

    resumed = ResumableSampler(num_items, batch_size, seed=999)  # saved seed wins
    resumed.load_state_dict(state)
    got += [resumed.next_batch() for _ in range(total - crash_at)]
    assert got == expected


def test_bad_state_raises_naming_both_values():
    state = ResumableSampler(10, 3, 0).state_dict()
    with pytest.raises(ValueError, match=r"num_items=10 but this sampler has num_items=11"):
        ResumableSampler(11, 3, 0).load_state_dict(state)
    with pytest.raises(ValueError, match=r"batch_size=3 but this sampler has batch_size=2"):
        ResumableSampler(10, 2, 0).load_state_dict(state)
    with pytest.raises(ValueError, match=r"missing key\(s\) \['position'\]"):
        ResumableSampler(10, 3, 0).load_state_dict({k: v for k, v in state.items()
                                                     if k != "position"})
    with pytest.raises(ValueError, match="position=4"):
        ResumableSampler(10, 3, 0).load_state_dict({**state, "position": 4})
    with pytest.raises(ValueError, match="must be an int"):
        ResumableSampler(10, 3, 0).load_state_dict({**state, "epoch": 1.0})


def test_bad_construction():
    with pytest.raises(ValueError, match="batch_size=11 is larger than the dataset"):
        ResumableSampler(10, 11, 0)
    with pytest.raises(ValueError, match="num_items"):
        ResumableSampler(0, 1, 0)
