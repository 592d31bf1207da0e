"""guard/checks.py: the batch's signals, and the no-signal count a step line and the guard read."""
import torch

from verl_core.guard.checks import zero_variance_groups


def test_zero_variance_groups_by_hand():
    # 3 groups of 2 rows (rows out of order): group 0 (1, 1) flat, group 1 (0, 1) not,
    # group 2 (0.5, 0.5) flat -> 2 of 3
    score = torch.tensor([1.0, 0.0, 0.5, 1.0, 1.0, 0.5])
    group = torch.tensor([0, 1, 2, 1, 0, 2])
    assert zero_variance_groups(score, group) == {"rollout/zero_variance_groups": 2.0,
                                                  "rollout/zero_variance_frac": 2 / 3}
    assert zero_variance_groups(torch.zeros(4), torch.tensor([0, 0, 1, 1])) == \
        {"rollout/zero_variance_groups": 2.0, "rollout/zero_variance_frac": 1.0}


def test_zero_variance_groups_matches_a_loop():
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        b, g = int(torch.randint(1, 9, (1,), generator=gen)), int(torch.randint(1, 5, (1,),
                                                                                  generator=gen))
        group = torch.arange(b).repeat_interleave(g)[torch.randperm(b * g, generator=gen)]
        score = torch.randint(0, 2, (b * g,), generator=gen).float()
        flat = sum(len(set(score[group == k].tolist())) == 1 for k in range(b))
        got = zero_variance_groups(score, group)
        if g == 1:  # groups of one: nothing to compare, no entry
            assert got == {}
        else:
            assert got == {"rollout/zero_variance_groups": flat,
                           "rollout/zero_variance_frac": flat / b}


def test_groups_of_one_are_not_counted_as_without_signal():
    # PPO (G = 1) or verl's GRPO with n = 1: a group of one has an advantage (a value baseline,
    # or its raw score), so it is neither flat nor a no-signal step
    assert zero_variance_groups(torch.zeros(3), torch.tensor([0, 1, 2])) == {}
    # a singleton beside two flat pairs: the share is over the pairs
    got = zero_variance_groups(torch.tensor([1.0, 1.0, 0.0, 0.0, 5.0]),
                               torch.tensor([0, 0, 1, 1, 2]))
    assert got == {"rollout/zero_variance_groups": 2.0, "rollout/zero_variance_frac": 1.0}
