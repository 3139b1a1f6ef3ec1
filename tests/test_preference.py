"""Preference losses: the seed's pair, stability, gradients, and each variant by hand."""

import math

import pytest
import torch

from posttrain.algorithms import (
    PREFERENCE_LOSSES,
    dpo_loss,
    hinge_loss,
    ipo_loss,
    length_normalized_dpo_loss,
    robust_dpo_loss,
)


def t(*values):
    return torch.tensor(values, dtype=torch.float64)


SEED = (t(-2.0), t(-4.0), t(-3.0), t(-3.0))


def test_seed_dpo_pair():
    """Seed: gap (-2 - -3) - (-4 - -3) = 2, beta 0.2, logit 0.4, loss log(1 + e^-0.4) ~ 0.5130."""
    losses, chosen_rewards, rejected_rewards = dpo_loss(*SEED, beta=0.2)
    assert losses.item() == pytest.approx(0.5130152523999526, abs=1e-15)
    assert losses.item() == pytest.approx(math.log1p(math.exp(-0.4)), abs=1e-15)
    assert (chosen_rewards - rejected_rewards).item() == pytest.approx(0.4)
    assert chosen_rewards.item() == pytest.approx(0.2) and rejected_rewards.item() == pytest.approx(-0.2)
    assert losses.item() < math.log(2)


def test_policy_equal_to_reference_gives_ln2_whatever_the_logprobs():
    chosen, rejected = t(-1.0, -50.0, -7.5), t(-9.0, -2.0, -7.5)
    losses, _, _ = dpo_loss(chosen, rejected, chosen.clone(), rejected.clone(), beta=0.3)
    assert losses.tolist() == pytest.approx([math.log(2)] * 3)


def test_dpo_is_stable_for_huge_logits():
    """A naive log(1 + exp(-x)) overflows at x = -1000; logsigmoid gives 1000 exactly."""
    losses, _, _ = dpo_loss(t(-2000.0), t(0.0), t(0.0), t(0.0), beta=0.5)
    assert losses.item() == pytest.approx(1000.0)
    losses, _, _ = dpo_loss(t(2000.0), t(0.0), t(0.0), t(0.0), beta=0.5)
    assert torch.isfinite(losses).all() and losses.item() == pytest.approx(0.0, abs=1e-300)


def test_dpo_gradient_pushes_chosen_up_and_rejected_down():
    chosen, rejected = t(-2.0).requires_grad_(), t(-4.0).requires_grad_()
    losses, _, _ = dpo_loss(chosen, rejected, t(-3.0), t(-3.0), beta=0.2)
    losses.sum().backward()
    # d loss / d chosen = -beta * sigmoid(-beta h) = -0.2 * sigmoid(-0.4) < 0: descent raises chosen.
    sigmoid = 1 / (1 + math.exp(0.4))
    assert chosen.grad.item() == pytest.approx(-0.2 * sigmoid)
    assert rejected.grad.item() == pytest.approx(0.2 * sigmoid)


def test_conservative_dpo_by_hand():
    """e = 0.1: 0.9 * softplus(-0.4) + 0.1 * softplus(0.4) = 0.9 * 0.513015 + 0.1 * 0.913015."""
    losses, _, _ = dpo_loss(*SEED, beta=0.2, label_smoothing=0.1)
    expected = 0.9 * math.log1p(math.exp(-0.4)) + 0.1 * math.log1p(math.exp(0.4))
    assert losses.item() == pytest.approx(expected)
    with pytest.raises(ValueError):
        dpo_loss(*SEED, beta=0.2, label_smoothing=0.5)


def test_conservative_registry_entry_smooths_by_default():
    """The "conservative" loss is never silently plain DPO: default e = 0.1, and e = 0 is refused."""
    losses, _, _ = PREFERENCE_LOSSES["conservative"](*SEED, beta=0.2)
    assert losses.item() == pytest.approx(0.9 * math.log1p(math.exp(-0.4)) + 0.1 * math.log1p(math.exp(0.4)))
    with pytest.raises(ValueError):
        PREFERENCE_LOSSES["conservative"](*SEED, beta=0.2, label_smoothing=0.0)


def test_robust_dpo_by_hand():
    """e = 0.1: (0.9 * softplus(-0.4) - 0.1 * softplus(0.4)) / 0.8; with e = 0 it is DPO."""
    losses, _, _ = robust_dpo_loss(*SEED, beta=0.2, label_smoothing=0.1)
    expected = (0.9 * math.log1p(math.exp(-0.4)) - 0.1 * math.log1p(math.exp(0.4))) / 0.8
    assert losses.item() == pytest.approx(expected)
    assert robust_dpo_loss(*SEED, beta=0.2, label_smoothing=0.0)[0].item() == pytest.approx(0.5130152523999526)


def test_ipo_and_hinge_by_hand():
    """h = 2, beta 0.2: IPO (2 - 1/0.4)^2 = 0.25; hinge max(0, 1 - 0.4) = 0.6; hinge is 0 past margin 1."""
    assert ipo_loss(*SEED, beta=0.2)[0].item() == pytest.approx(0.25)
    assert hinge_loss(*SEED, beta=0.2)[0].item() == pytest.approx(0.6)
    assert hinge_loss(*SEED, beta=1.0)[0].item() == 0.0


def test_length_normalized_is_a_different_objective():
    """Chosen: -2 over 4 tokens, rejected -4 over 2 tokens, references -3 over the same lengths.
    Per-token gap: (-0.5 + 0.75) - (-2 + 1.5) = 0.75; beta 0.2 -> softplus(-0.15). Summed DPO
    on the same pair gives softplus(-0.4): different numbers, hence a different name."""
    losses, chosen_rewards, rejected_rewards = length_normalized_dpo_loss(*SEED, t(4.0), t(2.0), beta=0.2)
    assert losses.item() == pytest.approx(math.log1p(math.exp(-0.15)))
    assert chosen_rewards.item() == pytest.approx(0.2 * 0.25)
    assert rejected_rewards.item() == pytest.approx(0.2 * -0.5)
    assert losses.item() != pytest.approx(dpo_loss(*SEED, beta=0.2)[0].item())


def test_registry_returns_per_pair_losses_and_rewards():
    chosen, rejected = torch.randn(5, dtype=torch.float64), torch.randn(5, dtype=torch.float64)
    for name, loss_fn in PREFERENCE_LOSSES.items():
        losses, chosen_rewards, rejected_rewards = loss_fn(chosen, rejected, chosen * 0.5, rejected * 0.5, beta=0.1)
        assert losses.shape == chosen_rewards.shape == rejected_rewards.shape == (5,), name
        assert torch.allclose(chosen_rewards, 0.1 * (chosen - chosen * 0.5)), name
