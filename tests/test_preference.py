"""Preference losses: the seed's pair, stability, gradients, and each variant by hand."""

import math

import pytest
import torch

from posttrain.algorithms import (
    PAIR_METRICS,
    PREFERENCE_LOSSES,
    dpo_loss,
    hinge_loss,
    ipo_loss,
    length_normalized_dpo_loss,
    pair_columns,
    pair_metrics,
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
    ones = torch.ones(5, dtype=torch.long)  # one token per response: length_normalized then equals sigmoid
    for name, loss_fn in PREFERENCE_LOSSES.items():
        losses, chosen_rewards, rejected_rewards = loss_fn(chosen, rejected, chosen * 0.5, rejected * 0.5, ones, ones, beta=0.1)
        assert losses.shape == chosen_rewards.shape == rejected_rewards.shape == (5,), name
        assert torch.allclose(chosen_rewards, 0.1 * (chosen - chosen * 0.5)), name


def test_one_signature_refuses_what_a_loss_does_not_take():
    """ipo and hinge take no label smoothing; length_normalized needs the lengths."""
    for name in ("ipo", "hinge", "length_normalized"):
        with pytest.raises(ValueError, match="label smoothing"):
            PREFERENCE_LOSSES[name](*SEED, t(4.0), t(2.0), beta=0.2, label_smoothing=0.1)
    with pytest.raises(ValueError, match="lengths"):
        PREFERENCE_LOSSES["length_normalized"](*SEED, beta=0.2)


def test_pair_metrics_by_hand():
    """Two pairs. Policy chosen [-2, -1], rejected [-4, -1]; reference chosen [-3, -1], rejected [-3, -2].
    Log-ratios: chosen [1, 0], rejected [-1, 1]; beta 0.5 -> rewards chosen [0.5, 0], rejected
    [-0.5, 0.5]; margins [1, -0.5], mean 0.25; accuracy 1/2 (the second pair's chosen reward is lower).
    Losses softplus(-1) = 0.313262 and softplus(0.5) = 0.974077, mean 0.643669."""
    chosen, rejected, ref_chosen, ref_rejected = t(-2.0, -1.0), t(-4.0, -1.0), t(-3.0, -1.0), t(-3.0, -2.0)
    losses, chosen_rewards, rejected_rewards = dpo_loss(chosen, rejected, ref_chosen, ref_rejected, beta=0.5)
    columns = pair_columns(losses, chosen_rewards, rejected_rewards, chosen, rejected, ref_chosen, ref_rejected)
    assert columns.shape == (7, 2) and not columns.requires_grad
    metrics = pair_metrics(columns)
    assert list(metrics) == list(PAIR_METRICS)
    expected = {
        "loss/preference": 0.643669, "rewards/chosen": 0.25, "rewards/rejected": 0.0, "rewards/margins": 0.25,
        "rewards/accuracy": 0.5, "logps/chosen": -1.5, "logps/rejected": -2.5, "logratio/chosen": 0.5, "logratio/rejected": 0.0,
    }
    for key, value in expected.items():
        assert metrics[key].dim() == 0 and metrics[key].item() == pytest.approx(value, abs=1e-6), key
