"""Preference losses: the seed's pair, stability, gradients, and each variant by hand."""

import math

import pytest
import torch

from posttrain.algorithms import (
    PAIR_METRICS,
    dpo_loss,
    hinge_loss,
    ipo_loss,
    length_normalized_dpo_loss,
    pair_columns,
    pair_metrics,
    robust_dpo_loss,
)
from posttrain.losses.objectives import PREFERENCE_OBJECTIVES

# The pure loss of every objective with a reference, by its `loss.type` name (the objective table's `pair_loss`).
PREFERENCE_LOSSES = {name: entry.pair_loss for name, entry in PREFERENCE_OBJECTIVES.items() if entry.pair_loss is not None}


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


def test_length_normalized_ipo_by_hand():
    """Chosen -2 over 4 tokens, rejected -4 over 2, references -3, -3, beta 0.2: per-token gap
    h_mean = (-2 + 3) / 4 - (-4 + 3) / 2 = 0.25 + 0.5 = 0.75; loss (0.75 - 1/0.4)^2 = 1.75^2 = 3.0625
    (summed IPO on the same pair: 0.25). Implicit rewards per token: 0.2 * 0.25, 0.2 * -0.5."""
    losses, chosen_rewards, rejected_rewards = PREFERENCE_LOSSES["length_normalized_ipo"](*SEED, t(4.0), t(2.0), beta=0.2)
    assert losses.item() == pytest.approx(3.0625)
    assert chosen_rewards.item() == pytest.approx(0.05) and rejected_rewards.item() == pytest.approx(-0.1)
    assert ipo_loss(*SEED, beta=0.2)[0].item() == pytest.approx(0.25)


def trl_ipo(chosen, rejected, ref_chosen, ref_rejected, chosen_tokens, rejected_tokens, beta):
    """TRL's DPOTrainer `ipo` (TRL 1.16), written out: each log-ratio divided by its completion's
    token count (clamped to >= 1), then (difference - 1 / (2 beta))^2."""
    chosen_average = (chosen - ref_chosen) / chosen_tokens.clamp(min=1.0)
    rejected_average = (rejected - ref_rejected) / rejected_tokens.clamp(min=1.0)
    return (chosen_average - rejected_average - 1 / (2 * beta)) ** 2


def trl_sigmoid(chosen, rejected, ref_chosen, ref_rejected, beta):
    """TRL's `sigmoid` (TRL 1.16), written out: -logsigmoid(beta h), with no label_smoothing term."""
    return -torch.nn.functional.logsigmoid(beta * ((chosen - ref_chosen) - (rejected - ref_rejected)))


def random_pairs(pairs=64, seed=0):
    generator = torch.Generator().manual_seed(seed)
    logps = [-torch.rand(pairs, generator=generator, dtype=torch.float64) * 40 for _ in range(4)]
    lengths = [torch.randint(0, 30, (pairs,), generator=generator).to(torch.float64) for _ in range(2)]
    return logps, lengths


def test_length_normalized_ipo_equals_trl_ipo_and_ipo_does_not():
    """On random pairs with lengths 0-29 (0 is clamped to 1 by both), our `length_normalized_ipo`
    equals TRL's `ipo` to rounding; our `ipo` (summed log-ratios) does not."""
    logps, lengths = random_pairs()
    for beta in (0.1, 0.5):
        expected = trl_ipo(*logps, *lengths, beta)
        ours = PREFERENCE_LOSSES["length_normalized_ipo"](*logps, *lengths, beta=beta)[0]
        assert torch.allclose(ours, expected, rtol=1e-12, atol=1e-12)
        assert not torch.allclose(PREFERENCE_LOSSES["ipo"](*logps, *lengths, beta=beta)[0], expected, rtol=1e-3)


def test_sigmoid_with_label_smoothing_is_cdpo_not_trl_sigmoid():
    """TRL's `sigmoid` ignores label_smoothing; ours is cDPO with it. With e = 0 the two agree;
    with e = 0.1 ours is 0.9 * softplus(-beta h) + 0.1 * softplus(beta h), not TRL's softplus(-beta h)."""
    logps, _ = random_pairs(seed=1)
    expected = trl_sigmoid(*logps, beta=0.1)
    assert torch.allclose(PREFERENCE_LOSSES["sigmoid"](*logps, beta=0.1)[0], expected, rtol=1e-12)
    smoothed = PREFERENCE_LOSSES["sigmoid"](*logps, beta=0.1, label_smoothing=0.1)[0]
    logits = 0.1 * ((logps[0] - logps[2]) - (logps[1] - logps[3]))
    cdpo = 0.9 * torch.nn.functional.softplus(-logits) + 0.1 * torch.nn.functional.softplus(logits)
    assert torch.allclose(smoothed, cdpo, rtol=1e-12)
    assert not torch.allclose(smoothed, expected, rtol=1e-3)


def test_registry_returns_per_pair_losses_and_rewards():
    chosen, rejected = torch.randn(5, dtype=torch.float64), torch.randn(5, dtype=torch.float64)
    ones = torch.ones(5, dtype=torch.long)  # one token per response: length_normalized then equals sigmoid
    for name, loss_fn in PREFERENCE_LOSSES.items():
        losses, chosen_rewards, rejected_rewards = loss_fn(chosen, rejected, chosen * 0.5, rejected * 0.5, ones, ones, beta=0.1)
        assert losses.shape == chosen_rewards.shape == rejected_rewards.shape == (5,), name
        assert torch.allclose(chosen_rewards, 0.1 * (chosen - chosen * 0.5)), name


def test_one_signature_refuses_what_a_loss_does_not_take():
    """ipo, hinge and the length-normalised losses take no label smoothing; the length-normalised
    ones need the lengths."""
    for name in ("ipo", "hinge", "length_normalized", "length_normalized_ipo"):
        with pytest.raises(ValueError, match="label smoothing"):
            PREFERENCE_LOSSES[name](*SEED, t(4.0), t(2.0), beta=0.2, label_smoothing=0.1)
    for name in ("length_normalized", "length_normalized_ipo"):
        with pytest.raises(ValueError, match="lengths"):
            PREFERENCE_LOSSES[name](*SEED, beta=0.2)


def test_pair_metrics_count_ties_apart():
    """Rewards chosen [0.2, -0.1, 0], rejected [-0.2, 0.3, 0]: the first pair right, the second
    wrong, the third a tie (TRL's convention counts it wrong): accuracy 1/3, ties 1/3, margins 0."""
    chosen_rewards, rejected_rewards, zeros = t(0.2, -0.1, 0.0), t(-0.2, 0.3, 0.0), torch.zeros(3)
    metrics = pair_metrics(pair_columns(zeros, chosen_rewards, rejected_rewards, zeros, zeros, zeros, zeros))
    assert metrics["rewards/accuracy"].item() == pytest.approx(1 / 3) and metrics["rewards/ties"].item() == pytest.approx(1 / 3)
    assert metrics["rewards/margins"].item() == pytest.approx(0.0, abs=1e-7)


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
        "rewards/accuracy": 0.5, "rewards/ties": 0.0, "logps/chosen": -1.5, "logps/rejected": -2.5, "logratio/chosen": 0.5, "logratio/rejected": 0.0,
    }
    for key, value in expected.items():
        assert metrics[key].dim() == 0 and metrics[key].item() == pytest.approx(value, abs=1e-6), key
