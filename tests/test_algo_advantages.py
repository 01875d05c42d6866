import math

import pytest
import torch

from asyncrl.algo.advantages import (
    grpo_advantages,
    overlong_penalty,
    rloo_advantages,
    zero_variance_mask,
)


def t(*xs: float) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.float64)


def ids(*xs: int) -> torch.Tensor:
    return torch.tensor(xs)


def test_grpo_one_group_hand_values() -> None:
    a = grpo_advantages(t(1, 0, 1, 0), ids(0, 0, 0, 0))
    # mean 0.5, unbiased std sqrt(1/3) = 0.57735, so 0.5 / 0.57735 = 0.866
    expected = 0.5 / (math.sqrt(1 / 3) + 1e-6)
    torch.testing.assert_close(a, t(expected, -expected, expected, -expected))
    assert abs(expected - 0.866) < 1e-3


def test_grpo_single_sample_group_has_mean_zero_std_one() -> None:
    a = grpo_advantages(t(0.7, 1, 0), ids(5, 9, 9))
    torch.testing.assert_close(a[0], torch.tensor(0.7 / (1 + 1e-6), dtype=torch.float64))
    torch.testing.assert_close(a[1:], t(1, -1) * (0.5 / (math.sqrt(0.5) + 1e-6)))


def test_grpo_interleaved_groups_match_separate_calls() -> None:
    rewards = t(1, 3, 0, 5, 1, 4)
    groups = ids(7, 2, 7, 2, 7, 2)
    a = grpo_advantages(rewards, groups)
    torch.testing.assert_close(a[0::2], grpo_advantages(t(1, 0, 1), ids(0, 0, 0)))
    torch.testing.assert_close(a[1::2], grpo_advantages(t(3, 5, 4), ids(0, 0, 0)))
    torch.testing.assert_close(a[1::2], t(-1, 1, 0) / (1 + 1e-6))


def test_grpo_constant_group_gives_zero() -> None:
    assert torch.equal(grpo_advantages(t(1, 1, 1), ids(0, 0, 0)), t(0, 0, 0))


def test_dr_grpo_does_not_divide_by_std() -> None:
    a = grpo_advantages(t(1, 0, 1, 0, 3), ids(0, 0, 0, 0, 1), norm_by_std=False)
    torch.testing.assert_close(a, t(0.5, -0.5, 0.5, -0.5, 3))


def test_grpo_integer_rewards_are_promoted() -> None:
    a = grpo_advantages(torch.tensor([1, 0]), ids(0, 0))
    assert a.is_floating_point()
    assert a[0] > 0 > a[1]


def test_grpo_rejects_mismatched_shapes() -> None:
    with pytest.raises(ValueError, match="equal length"):
        grpo_advantages(t(1, 0), ids(0, 0, 0))


def test_rloo_hand_values() -> None:
    a = rloo_advantages(t(1, 2, 3), ids(0, 0, 0))
    torch.testing.assert_close(a, t(1 - 2.5, 2 - 2, 3 - 1.5))


def test_rloo_single_sample_group_is_zero_and_groups_are_separate() -> None:
    a = rloo_advantages(t(4, 1, 5, 3), ids(1, 0, 2, 0))
    torch.testing.assert_close(a, t(0, -2, 0, 2))


def test_zero_variance_mask_keeps_only_informative_groups() -> None:
    rewards = t(1, 1, 0, 1, 0.5, 0.25, 0.25, 7)
    groups = ids(0, 0, 1, 1, 2, 3, 3, 2)
    assert zero_variance_mask(rewards, groups).tolist() == [
        False,
        False,
        True,
        True,
        True,
        False,
        False,
        True,
    ]


def test_zero_variance_mask_single_sample_group_is_dropped() -> None:
    assert zero_variance_mask(t(1, 0, 1), ids(0, 1, 1)).tolist() == [False, True, True]


def test_overlong_penalty_ramp() -> None:
    p = overlong_penalty(torch.tensor([0, 16, 17, 18, 20, 25]), max_len=20, buffer_len=4)
    torch.testing.assert_close(p, torch.tensor([0.0, 0.0, -0.25, -0.5, -1.0, -1.0]))
    p2 = overlong_penalty(torch.tensor([18, 30]), max_len=20, buffer_len=4, penalty_factor=0.5)
    torch.testing.assert_close(p2, torch.tensor([-0.25, -0.5]))


@pytest.mark.parametrize("buffer_len", [0, 21])
def test_overlong_penalty_rejects_bad_buffer(buffer_len: int) -> None:
    with pytest.raises(ValueError, match="buffer_len"):
        overlong_penalty(torch.tensor([1]), max_len=20, buffer_len=buffer_len)
