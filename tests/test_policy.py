"""Clipped surrogate, value loss and aggregation: the seed's token, gradients, split invariance."""

import math

import pytest
import torch

from posttrain.algorithms import aggregate, clipped_surrogate, clipped_value_loss

SQRT3 = math.sqrt(3)


def one_token(new_prob, old_prob=0.20, advantage=SQRT3, **kwargs):
    logprobs = torch.tensor([[math.log(new_prob)]], dtype=torch.float64, requires_grad=True)
    old_logprobs = torch.tensor([[math.log(old_prob)]], dtype=torch.float64)
    loss, stats = clipped_surrogate(logprobs, old_logprobs, torch.tensor([advantage], dtype=torch.float64), **kwargs)
    return logprobs, loss, stats


def test_seed_clipped_token():
    """Seed: ratio = exp(ln 0.26 - ln 0.20) = 1.3; clip range [0.8, 1.2]; A = sqrt(3):
    objective = min(1.3 A, 1.2 A) = 1.2 sqrt(3) ~ 2.078; loss = -2.078."""
    _, loss, stats = one_token(0.26)
    assert stats["ratio"].item() == pytest.approx(1.3, abs=1e-12)
    assert loss.item() == pytest.approx(-1.2 * SQRT3, abs=1e-12)
    assert round(-loss.item(), 3) == 2.078
    assert stats["clipped_high"].item() and not stats["clipped_low"].item()


def test_ratio_1_6_gives_the_same_clipped_value():
    """Seed: a ratio of 1.6 (new prob 0.32) gives the same clipped objective 1.2 sqrt(3)."""
    _, loss_13, _ = one_token(0.26)
    _, loss_16, stats = one_token(0.32)
    assert stats["ratio"].item() == pytest.approx(1.6)
    assert loss_16.item() == pytest.approx(loss_13.item(), abs=1e-12)


def test_clipped_in_direction_of_advantage_has_zero_gradient():
    logprobs, loss, _ = one_token(0.26)  # ratio 1.3 > 1.2 with A > 0
    loss.sum().backward()
    assert logprobs.grad.item() == 0.0
    logprobs, loss, stats = one_token(0.10, advantage=-1.0)  # ratio 0.5 < 0.8 with A < 0
    loss.sum().backward()
    assert stats["clipped_low"].item() and logprobs.grad.item() == 0.0


def test_unclipped_gradient_is_minus_advantage_times_ratio():
    """Inside the range, d(-A r)/d logp = -A r. Ratio 1.1, A = sqrt(3): grad = -1.1 sqrt(3).
    Outside the range but against the advantage (ratio 1.3, A < 0) the loss is NOT clipped:
    -A r = 1.3 with grad 1.3 (PPO's pessimism)."""
    logprobs, loss, _ = one_token(0.22)
    loss.sum().backward()
    assert logprobs.grad.item() == pytest.approx(-1.1 * SQRT3)
    logprobs, loss, stats = one_token(0.26, advantage=-1.0)
    loss.sum().backward()
    assert loss.item() == pytest.approx(1.3)
    assert logprobs.grad.item() == pytest.approx(1.3)
    assert not stats["clipped_low"].item() and not stats["clipped_high"].item()


def test_clip_higher_is_asymmetric():
    """DAPO clip-higher: clip_low 0.2, clip_high 0.28. Ratio 1.25 with A = 1 is inside [0.8, 1.28]:
    loss -1.25; ratio 0.75 with A = -1 is below 0.8: loss = max(0.75, 0.8) = 0.8."""
    _, loss, stats = one_token(0.25, advantage=1.0, clip_low=0.2, clip_high=0.28)
    assert loss.item() == pytest.approx(-1.25) and not stats["clipped_high"].item()
    _, loss, stats = one_token(0.15, advantage=-1.0, clip_low=0.2, clip_high=0.28)
    assert loss.item() == pytest.approx(0.8) and stats["clipped_low"].item()


def test_dual_clip_bounds_negative_advantages():
    """Ratio 5 (0.2 -> 1.0), A = -1: plain PPO loss max(5, 1.2) = 5; dual clip c = 3 caps it at 3
    with zero gradient. Positive advantages are untouched by the dual clip."""
    _, loss, _ = one_token(1.0, advantage=-1.0)
    assert loss.item() == pytest.approx(5.0)
    logprobs, loss, stats = one_token(1.0, advantage=-1.0, dual_clip=3.0)
    loss.sum().backward()
    assert loss.item() == pytest.approx(3.0) and stats["dual_clipped"].item()
    assert logprobs.grad.item() == 0.0
    _, loss, stats = one_token(0.22, advantage=1.0, dual_clip=3.0)
    assert loss.item() == pytest.approx(-1.1) and not stats["dual_clipped"].item()
    with pytest.raises(ValueError):
        one_token(0.2, dual_clip=0.9)


def test_ratio_is_one_at_the_first_step_and_huge_log_ratios_stay_finite():
    logprobs = torch.randn(3, 5, dtype=torch.float64)
    loss, stats = clipped_surrogate(logprobs, logprobs.clone(), torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64))
    assert torch.equal(stats["ratio"], torch.ones(3, 5, dtype=torch.float64))
    assert torch.allclose(loss, -torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)[:, None].expand(3, 5))
    loss, _ = clipped_surrogate(torch.tensor([[0.0]]), torch.tensor([[-1000.0]]), torch.tensor([-1.0]))
    assert torch.isfinite(loss).all()


def test_value_loss_by_hand():
    """V_old 1.0, V 1.5, R 2.0, c 0.2: unclipped 0.5 (1.5 - 2)^2 = 0.125; clipped value 1.2,
    0.5 (1.2 - 2)^2 = 0.32; loss = max = 0.32 (clipped branch active).
    V 0.9: unclipped 0.5 * 1.21 = 0.605; clipped value 0.9 (inside), same -> 0.605."""
    values = torch.tensor([[1.5, 0.9]])
    loss, clipped = clipped_value_loss(values, torch.tensor([[1.0, 1.0]]), torch.tensor([[2.0, 2.0]]), 0.2)
    assert loss.tolist()[0] == pytest.approx([0.32, 0.605])
    assert clipped.tolist() == [[True, False]]
    plain, _ = clipped_value_loss(values, torch.tensor([[1.0, 1.0]]), torch.tensor([[2.0, 2.0]]), None)
    assert plain.tolist()[0] == pytest.approx([0.125, 0.605])


PER_TOKEN = torch.tensor([[1.0, 2.0, 3.0, 0.0], [4.0, 0.0, 0.0, 0.0]])
MASK = torch.tensor([[True, True, True, False], [True, False, False, False]])


@pytest.mark.parametrize(
    "mode, expected",
    [
        # (1 + 2 + 3 + 4) / 4 tokens
        ("token_mean", 2.5),
        # mean of per-sequence means: (2 + 4) / 2
        ("seq_mean_token_mean", 3.0),
        # mean of per-sequence sums: (6 + 4) / 2
        ("seq_mean_token_sum", 5.0),
        # all tokens / (2 sequences * L = 4)
        ("seq_mean_token_sum_norm", 10.0 / 8.0),
    ],
)
def test_aggregation_modes_by_hand(mode, expected):
    assert aggregate(PER_TOKEN, MASK, mode, max_length=4).item() == pytest.approx(expected)


def test_aggregation_errors():
    with pytest.raises(ValueError, match="max_length"):
        aggregate(PER_TOKEN, MASK, "seq_mean_token_sum_norm")
    with pytest.raises(ValueError, match="unknown aggregation"):
        aggregate(PER_TOKEN, MASK, "sum")


@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"])
def test_aggregation_is_invariant_to_micro_batch_split(mode):
    """Loss and gradient of the whole batch equal the sums over micro-batches of sizes 1, 2 and 3,
    when each micro-batch is given the global token and sequence counts."""
    generator = torch.Generator().manual_seed(0)
    logprobs = torch.randn(6, 7, generator=generator, dtype=torch.float64).requires_grad_(True)
    old_logprobs = logprobs.detach() + 0.3 * torch.randn(6, 7, generator=generator, dtype=torch.float64)
    advantages = torch.randn(6, generator=generator, dtype=torch.float64)
    lengths = torch.tensor([7, 1, 4, 6, 2, 5])
    mask = torch.arange(7)[None, :] < lengths[:, None]
    global_tokens, global_sequences = mask.sum(), mask.shape[0]

    def loss_of(rows):
        per_token, _ = clipped_surrogate(logprobs[rows], old_logprobs[rows], advantages[rows])
        return aggregate(per_token, mask[rows], mode, global_tokens, global_sequences, max_length=7)

    full = loss_of(slice(0, 6))
    (full_grad,) = torch.autograd.grad(full, logprobs)
    split = loss_of(slice(0, 1)) + loss_of(slice(1, 3)) + loss_of(slice(3, 6))
    (split_grad,) = torch.autograd.grad(split, logprobs)
    assert split.item() == pytest.approx(full.item(), abs=1e-12)
    assert torch.allclose(split_grad, full_grad, atol=1e-12)
    # Without the global normaliser, token_mean over micro-batches is a different number.
    if mode == "token_mean":
        naive = sum(
            aggregate(clipped_surrogate(logprobs[r], old_logprobs[r], advantages[r])[0], mask[r], mode)
            for r in (slice(0, 1), slice(1, 3), slice(3, 6))
        ) / 3
        assert abs(naive.item() - full.item()) > 1e-3
