"""Advantages: the seed's group, NaN handling, scaling modes, RLOO, GAE and whitening, by hand."""

import math

import pytest
import torch

from posttrain.algorithms import gae, group_statistics, grpo_advantages, rloo_advantages, whiten


def t(values):
    return torch.tensor(values, dtype=torch.float64)


def test_seed_group_statistics_and_advantages():
    """Seed: rewards [0, 1, 0, 0]; mean = 1/4; population variance = (3 * (1/4)^2 + (3/4)^2) / 4
    = (3/16 + 9/16) / 4 = 3/16, std = sqrt(3)/4 ~ 0.4330. Advantages with eps = 0:
    (1 - 1/4) / (sqrt(3)/4) = 3/sqrt(3) = sqrt(3); (0 - 1/4) / (sqrt(3)/4) = -1/sqrt(3)."""
    rewards = t([0, 1, 0, 0])
    mean, std, count = group_statistics(rewards, 4)
    assert mean.item() == 0.25
    assert std.item() == pytest.approx(math.sqrt(3) / 4, abs=1e-15)
    assert count.item() == 4
    advantages = grpo_advantages(rewards, 4, scale="group", eps=0.0)
    expected = [-1 / math.sqrt(3), math.sqrt(3), -1 / math.sqrt(3), -1 / math.sqrt(3)]
    assert advantages.tolist() == pytest.approx(expected, abs=1e-12)
    assert advantages[1].item() == pytest.approx(math.sqrt(3), abs=1e-15)
    assert advantages.sum().item() == pytest.approx(0.0, abs=1e-12)
    assert [round(a, 3) for a in advantages.tolist()] == [-0.577, 1.732, -0.577, -0.577]


def test_unbiased_std_option_differs_from_population():
    """Sample std of [0, 1, 0, 0]: variance (3/4) / 3 = 1/4, std 1/2, so the winner gets 0.75 / 0.5 = 1.5."""
    advantages = grpo_advantages(t([0, 1, 0, 0]), 4, eps=0.0, unbiased_std=True)
    assert advantages.tolist() == pytest.approx([-0.5, 1.5, -0.5, -0.5])


def test_epsilon_is_explicit():
    """eps = 0.1: sqrt(3) * (sqrt(3)/4) / (sqrt(3)/4 + 0.1) = 0.75 / 0.5330127 ~ 1.407098."""
    advantages = grpo_advantages(t([0, 1, 0, 0]), 4, eps=0.1)
    assert advantages[1].item() == pytest.approx(0.75 / (math.sqrt(3) / 4 + 0.1), abs=1e-12)


def test_all_equal_groups_give_zero_advantage_even_with_zero_eps():
    """The seed: all-right or all-wrong groups have no policy-gradient signal, whatever the scaling."""
    rewards = t([1, 1, 1, 1, 0, 0, 0, 0])
    for scale in ("group", "batch", "none"):
        advantages = grpo_advantages(rewards, 4, scale=scale, eps=0.0)
        assert torch.equal(advantages, torch.zeros(8, dtype=torch.float64)), scale


def test_nan_rewards_are_excluded_and_get_zero():
    """Group [nan, 1, 0, 0]: valid rewards [1, 0, 0], mean 1/3, population std sqrt(2/9) = sqrt(2)/3.
    Advantages: (1 - 1/3) / (sqrt(2)/3) = 2/sqrt(2) = sqrt(2); (0 - 1/3) / (sqrt(2)/3) = -1/sqrt(2)."""
    rewards = t([math.nan, 1, 0, 0])
    mean, std, count = group_statistics(rewards, 4)
    assert mean.item() == pytest.approx(1 / 3)
    assert std.item() == pytest.approx(math.sqrt(2) / 3)
    assert count.item() == 3
    advantages = grpo_advantages(rewards, 4, eps=0.0)
    assert advantages.tolist() == pytest.approx([0.0, math.sqrt(2), -1 / math.sqrt(2), -1 / math.sqrt(2)])
    all_nan = grpo_advantages(t([math.nan, math.nan, 1, 0]), 2, eps=0.0)
    assert all_nan.tolist() == pytest.approx([0.0, 0.0, 1.0, -1.0])


def test_scale_none_is_dr_grpo_and_batch_uses_batch_std():
    """Two groups [0, 1] and [0, 0, ...]: with scale none, A = r - group mean.
    Batch [0, 1, 1, 1]: group means 0.5 and 1; batch population std of [0, 1, 1, 1] = sqrt(3)/4."""
    rewards = t([0, 1, 1, 1])
    assert grpo_advantages(rewards, 2, scale="none").tolist() == [-0.5, 0.5, 0.0, 0.0]
    batch_std = math.sqrt(3) / 4
    assert grpo_advantages(rewards, 2, scale="batch", eps=0.0).tolist() == pytest.approx(
        [-0.5 / batch_std, 0.5 / batch_std, 0.0, 0.0]
    )
    assert grpo_advantages(rewards, 2, scale="group", eps=0.0).tolist() == pytest.approx([-1.0, 1.0, 0.0, 0.0])


def test_vectorised_matches_a_plain_loop():
    generator = torch.Generator().manual_seed(0)
    rewards = torch.rand(6 * 5, generator=generator, dtype=torch.float64)
    rewards[[3, 11, 12]] = math.nan
    advantages = grpo_advantages(rewards, 5, eps=1e-6)
    for b in range(6):
        group = [r for r in rewards[b * 5 : (b + 1) * 5].tolist() if not math.isnan(r)]
        mean = sum(group) / len(group)
        std = math.sqrt(sum((r - mean) ** 2 for r in group) / len(group))
        for g in range(5):
            r = rewards[b * 5 + g].item()
            expected = 0.0 if math.isnan(r) else (r - mean) / (std + 1e-6)
            assert advantages[b * 5 + g].item() == pytest.approx(expected, abs=1e-12)


def test_bad_group_arguments():
    with pytest.raises(ValueError, match="at least 2"):
        grpo_advantages(t([1.0]), 1)
    with pytest.raises(ValueError, match="B\\*G"):
        grpo_advantages(t([1.0, 0.0, 1.0]), 2)
    with pytest.raises(ValueError, match="scale"):
        grpo_advantages(t([1.0, 0.0]), 2, scale="rank")


def test_rloo_by_hand():
    """[0, 1, 0, 0]: baselines are the means of the other three: 1/3, 0, 1/3, 1/3."""
    assert rloo_advantages(t([0, 1, 0, 0]), 4).tolist() == pytest.approx([-1 / 3, 1.0, -1 / 3, -1 / 3])
    # NaN excluded: [nan, 2, 4] -> 2 - 4 = -2, 4 - 2 = 2; a lone valid sample gets 0.
    assert rloo_advantages(t([math.nan, 2, 4]), 3).tolist() == pytest.approx([0.0, -2.0, 2.0])
    assert rloo_advantages(t([math.nan, 5.0]), 2).tolist() == [0.0, 0.0]


def test_gae_by_hand():
    """One sequence, 3 response tokens, reward 1 on the last, values [0.5, 0.6, 0.7], gamma 1,
    lambda 0.9.
      delta_2 = 1 + 0 - 0.7 = 0.3            A_2 = 0.3
      delta_1 = 0 + 0.7 - 0.6 = 0.1          A_1 = 0.1 + 0.9 * 0.3 = 0.37
      delta_0 = 0 + 0.6 - 0.5 = 0.1          A_0 = 0.1 + 0.9 * 0.37 = 0.433
    returns = A + V = [0.933, 0.97, 1.0]."""
    rewards = t([[0, 0, 1, 0]])
    values = t([[0.5, 0.6, 0.7, 9.9]])
    mask = torch.tensor([[True, True, True, False]])
    advantages, returns = gae(rewards, values, mask, gamma=1.0, lam=0.9)
    assert advantages.tolist()[0] == pytest.approx([0.433, 0.37, 0.3, 0.0])
    assert returns.tolist()[0] == pytest.approx([0.933, 0.97, 1.0, 0.0])


def test_gae_skips_masked_positions_and_lambda_one_is_monte_carlo():
    """A False position in the middle is skipped: the result equals the same sequence without it.
    With gamma = lambda = 1, A_t = (sum of future rewards) - V_t."""
    rewards = t([[0.0, 0.0, 0.0, 2.0]])
    values = t([[0.1, 7.0, 0.3, 0.4]])
    mask = torch.tensor([[True, False, True, True]])
    advantages, _ = gae(rewards, values, mask, gamma=1.0, lam=1.0)
    compact, _ = gae(t([[0.0, 0.0, 2.0]]), t([[0.1, 0.3, 0.4]]), torch.ones(1, 3, dtype=torch.bool), 1.0, 1.0)
    assert advantages[0, [0, 2, 3]].tolist() == pytest.approx(compact[0].tolist())
    assert advantages[0, 1].item() == 0.0
    assert compact[0].tolist() == pytest.approx([2 - 0.1, 2 - 0.3, 2 - 0.4])


def test_whiten_masked():
    """Masked values [1, 3] (the 100 is masked out): mean 2, population std 1 -> [-1, 1]."""
    values = t([[1.0, 3.0, 100.0]])
    mask = torch.tensor([[True, True, False]])
    assert whiten(values, mask, eps=0.0).tolist()[0] == pytest.approx([-1.0, 1.0, 0.0])
    assert whiten(values, mask, shift_mean=False, eps=0.0).tolist()[0] == pytest.approx([1.0, 3.0, 0.0])
    # [0, 4]: mean 2, std 2 -> whitened [-1, 1]; shift_mean=False adds the mean back: [1, 3].
    spread = t([[0.0, 4.0]])
    assert whiten(spread, torch.ones(1, 2, dtype=torch.bool), shift_mean=False, eps=0.0).tolist()[0] == pytest.approx([1.0, 3.0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("value, size", [(0.1, 3), (0.3, 6), (0.7, 5)])
def test_identical_non_binary_rewards_give_exactly_zero(dtype, value, size):
    """A float mean of [0.1, 0.1, 0.1] is one rounding step off 0.1; without the unanimity check the
    residue (~1e-17) divided by a ~1e-17 std gave advantages of -1 with eps = 0."""
    rewards = torch.full((size,), value, dtype=dtype)
    for scale in ("group", "batch", "none"):
        for eps in (0.0, 1e-6):
            assert torch.equal(grpo_advantages(rewards, size, scale=scale, eps=eps), torch.zeros(size, dtype=dtype))
    mixed = torch.tensor([value] * size + [0.0, 1.0] * (size // 2) + [0.5] * (size % 2), dtype=dtype)
    advantages = grpo_advantages(mixed, size, eps=0.0)
    assert torch.equal(advantages[:size], torch.zeros(size, dtype=dtype))
    assert advantages[size:].abs().sum() > 0
