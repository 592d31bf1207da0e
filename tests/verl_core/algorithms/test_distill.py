"""On-policy distillation's per-token signal (``verl_core/algorithms/distill.py``) on
hand-computed cases: r_t = -D_t with D_t a reverse-KL estimate from the sampled token (k1:
log student - log teacher), 0 off the response mask, clamped as verl's ``loss_max_clamp``."""
import math

import pytest
import torch

from verl_core.algorithms.distill import DISTILL_LOSS_MODES, distill_signal


def test_k1_signal_is_log_teacher_minus_log_student_on_sampled_tokens():
    # two rows of three tokens; the second row's last token is padding
    student = torch.tensor([[-0.5, -1.0, -2.0],
                            [-0.125, -3.0, 0.0]])
    teacher = torch.tensor([[-0.5, -0.25, -4.0],
                            [-2.125, -1.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0],
                         [1.0, 1.0, 0.0]])
    r, m = distill_signal(student, teacher, mask)
    # r = teacher - student: row 0: 0, 0.75, -2; row 1: -2, 2, (padding) 0
    assert r.tolist() == [[0.0, 0.75, -2.0], [-2.0, 2.0, 0.0]]
    # D = student - teacher = -r on the 5 sampled tokens: 0, -0.75, 2, 2, -2 -> mean 1.25 / 5
    assert m["loss"].item() == pytest.approx(0.25)
    assert m["abs_loss"].item() == pytest.approx((0 + 0.75 + 2 + 2 + 2) / 5)
    # "kl" is k1's alias (verl's loss_mode names)
    assert torch.equal(distill_signal(student, teacher, mask, loss_mode="kl")[0], r)


def test_the_same_model_as_teacher_gives_zero_signal():
    lp = torch.tensor([[-0.3, -1.7]])
    for mode in DISTILL_LOSS_MODES:
        r, _ = distill_signal(lp, lp.clone(), torch.ones(1, 2), loss_mode=mode)
        assert torch.equal(r, torch.zeros(1, 2)), mode


def test_other_estimators_and_the_clamp():
    student, teacher, mask = torch.tensor([[-1.0, -2.0]]), torch.tensor([[-2.0, -1.0]]), \
        torch.ones(1, 2)
    # k3 with log r = teacher - student = -1 then +1: r - log r - 1 = e^-1, e - 2
    r, _ = distill_signal(student, teacher, mask, loss_mode="k3")
    assert r[0].tolist() == pytest.approx([-math.exp(-1), -(math.e - 2)])
    # k2 = ½ (student - teacher)²: ½ each
    assert distill_signal(student, teacher, mask, loss_mode="k2")[0].tolist() == [[-0.5, -0.5]]
    # k1 = 1, -1; clamped to [-0.5, 0.5] before the sign flips
    r, m = distill_signal(student, teacher, mask, loss_max_clamp=0.5)
    assert r.tolist() == [[-0.5, 0.5]]
    assert m["abs_loss"].item() == 1.0  # metrics are of the unclamped estimate
