"""KL: the seed's two-token example, estimator properties, chunked exact KL, in-reward placement."""

import math

import pytest
import torch

from posttrain.algorithms import ESTIMATORS, exact_kl, kl_estimate, kl_penalized_rewards

P = torch.tensor([0.8, 0.2], dtype=torch.float64)
Q = torch.tensor([0.5, 0.5], dtype=torch.float64)


def test_seed_exact_kl():
    """Seed: KL = 0.8 ln(0.8/0.5) + 0.2 ln(0.2/0.5) = 0.8 ln 1.6 + 0.2 ln 0.4 ~ 0.1927."""
    expected = 0.8 * math.log(1.6) + 0.2 * math.log(0.4)
    assert exact_kl(P.log(), Q.log()).item() == pytest.approx(expected, abs=1e-15)
    assert round(expected, 4) == 0.1927


def test_seed_per_token_estimators_by_hand():
    """Token 0 (p .8, q .5): log p/q = ln 1.6 ~ 0.4700; k2 = 0.4700^2 / 2 ~ 0.1105;
    k3 = q/p - 1 - ln(q/p) = 0.625 - 1 + 0.4700 ~ 0.0950.
    Token 1 (p .2, q .5): log p/q = ln 0.4 ~ -0.9163; k2 ~ 0.4198; k3 = 2.5 - 1 - ln 2.5 ~ 0.5837."""
    log_p, log_q = P.log(), Q.log()
    assert kl_estimate(log_p, log_q, "k1").tolist() == pytest.approx([math.log(1.6), math.log(0.4)])
    assert kl_estimate(log_p, log_q, "k2").tolist() == pytest.approx([0.5 * math.log(1.6) ** 2, 0.5 * math.log(0.4) ** 2])
    assert kl_estimate(log_p, log_q, "k3").tolist() == pytest.approx([0.625 - 1 - math.log(0.625), 2.5 - 1 - math.log(2.5)])


def test_k1_and_k3_are_unbiased_k2_is_not():
    """Expectation under the policy, computed exactly by enumeration over the vocabulary."""
    generator = torch.Generator().manual_seed(0)
    for _ in range(5):
        log_p = torch.log_softmax(torch.randn(50, generator=generator, dtype=torch.float64) * 2, -1)
        log_q = torch.log_softmax(torch.randn(50, generator=generator, dtype=torch.float64) * 2, -1)
        exact = exact_kl(log_p, log_q).item()
        p = log_p.exp()
        for estimator in ("k1", "k3"):
            assert (p * kl_estimate(log_p, log_q, estimator)).sum().item() == pytest.approx(exact, rel=1e-10)
        assert abs((p * kl_estimate(log_p, log_q, "k2")).sum().item() - exact) > 1e-6


def test_sampled_k3_converges_to_exact_kl():
    """Monte Carlo with a fixed seed: mean of k3 over 200k policy samples is within 1% of exact."""
    generator = torch.Generator().manual_seed(1)
    log_p = torch.log_softmax(torch.randn(20, generator=generator, dtype=torch.float64), -1)
    log_q = torch.log_softmax(torch.randn(20, generator=generator, dtype=torch.float64), -1)
    samples = torch.multinomial(log_p.exp(), 200_000, replacement=True, generator=generator)
    estimate = kl_estimate(log_p[samples], log_q[samples], "k3").mean().item()
    assert estimate == pytest.approx(exact_kl(log_p, log_q).item(), rel=0.01)


def test_k3_and_k2_are_never_negative():
    log_ratio = torch.linspace(-30, 30, 10_001, dtype=torch.float64)
    for estimator in ("k2", "k3"):
        assert (kl_estimate(log_ratio, torch.zeros_like(log_ratio), estimator) >= 0).all()
    assert (kl_estimate(log_ratio, torch.zeros_like(log_ratio), "k1") < 0).any()


def test_estimator_clamp_and_unknown_name():
    huge = kl_estimate(torch.tensor([-50.0]), torch.tensor([0.0]), "k3", clamp=10.0)
    assert huge.item() == 10.0
    with pytest.raises(ValueError, match="k1, k2, k3"):
        kl_estimate(torch.zeros(1), torch.zeros(1), "k4")


def test_clamped_k3_of_a_far_token_has_a_finite_gradient():
    """float32, clamp 10, log-ratios x = logprobs - ref_logprobs = [-200, -5, -1, 5, 15]; k3(x) =
    e^-x - 1 + x, dk3/dx = 1 - e^-x.
    x = -200: e^200 overflows float32 (ln of its max is 88.72), so unclamped k3 is inf, and the
    clamp's zero gradient times dk3/dx = -inf was NaN. The log-ratio is clamped to -20 first:
    k3(-20) = e^20 - 21 ~ 4.85e8 > 10 -> value 10; both clamps are saturated -> gradient 0.
    x = -5: k3 = e^5 - 6 ~ 142.4 > 10 -> 10, gradient 0 (the estimate's clamp).
    x = -1: k3 = e - 2 ~ 0.7183, gradient 1 - e ~ -1.7183.
    x = 5: k3 = 4 + e^-5 ~ 4.0067, gradient 1 - e^-5 ~ 0.9933.
    x = 15: k3 = 14 + e^-15 > 10 -> 10, gradient 0.
    The gradient with respect to ref_logprobs is minus that with respect to logprobs."""
    log_ratios = [-200.0, -5.0, -1.0, 5.0, 15.0]
    ref_logprobs = torch.full((1, 5), -1.0, requires_grad=True)
    logprobs = (torch.tensor([log_ratios]) - 1.0).requires_grad_()
    estimate = kl_estimate(logprobs, ref_logprobs, "k3", clamp=10.0)
    estimate.sum().backward()
    e = math.e
    assert estimate.dtype == torch.float32
    assert estimate[0].tolist() == pytest.approx([10.0, 10.0, e - 2, 4 + math.exp(-5), 10.0], rel=1e-6)
    assert torch.isfinite(logprobs.grad).all() and torch.isfinite(ref_logprobs.grad).all()
    assert logprobs.grad[0].tolist() == pytest.approx([0.0, 0.0, 1 - e, 1 - math.exp(-5), 0.0], rel=1e-6, abs=1e-7)
    assert ref_logprobs.grad[0].tolist() == pytest.approx([0.0, 0.0, e - 1, math.exp(-5) - 1, 0.0], rel=1e-6, abs=1e-7)


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_log_ratio_clamp_changes_no_value_for_clamps_up_to_19(estimator):
    """The estimator's clamp applied to the raw log-ratio (float64, which does not overflow over
    [-300, 300]) gives the same values as kl_estimate, which clamps the log-ratio to +-20 first:
    the smallest |estimate| at +-20 is k3(20) = 19 + e^-20, so every clamp <= 19 is already
    reached there. A clamp above 19, or not positive, is refused."""
    log_ratio = torch.linspace(-300, 300, 60_001, dtype=torch.float64)
    zeros = torch.zeros_like(log_ratio)
    for clamp in (0.05, 1.0, 10.0, 19.0):
        expected = ESTIMATORS[estimator](log_ratio).clamp(-clamp, clamp)
        assert torch.equal(kl_estimate(log_ratio, zeros, estimator, clamp=clamp), expected), clamp
    for clamp in (19.5, 0.0, -1.0):
        with pytest.raises(ValueError, match="clamp"):
            kl_estimate(log_ratio, zeros, estimator, clamp=clamp)


@pytest.mark.parametrize("chunk_size", [1, 3, 7, 1024])
def test_chunked_exact_kl_matches_naive(chunk_size):
    generator = torch.Generator().manual_seed(2)
    logits = torch.randn(3, 5, 11, generator=generator)
    ref_logits = torch.randn(3, 5, 11, generator=generator)
    for temperature in (1.0, 0.7):
        p = torch.softmax(logits / temperature, -1)
        naive = (p * (torch.log_softmax(logits / temperature, -1) - torch.log_softmax(ref_logits / temperature, -1))).sum(-1)
        chunked = exact_kl(logits, ref_logits, temperature=temperature, chunk_size=chunk_size)
        assert chunked.shape == (3, 5)
        assert torch.allclose(chunked, naive, atol=1e-6)
    assert torch.allclose(exact_kl(logits, logits), torch.zeros(3, 5), atol=1e-6)


def test_exact_kl_has_gradient_and_rejects_shape_mismatch():
    logits = torch.randn(4, 6, requires_grad=True)
    exact_kl(logits, torch.randn(4, 6), chunk_size=2).sum().backward()
    assert logits.grad is not None and logits.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="differ"):
        exact_kl(torch.zeros(2, 3), torch.zeros(2, 4))


def test_kl_in_reward_placement_by_hand():
    """Rewards [1, 0]; kl [[.1, .2, .3], [.5, .5, .5]]; masks: row 0 three tokens, row 1 one token;
    beta 0.5: row 0 -> [-.05, -.1, -.15 + 1]; row 1 -> [-.25 + 0, 0, 0]."""
    kl = torch.tensor([[0.1, 0.2, 0.3], [0.5, 0.5, 0.5]], dtype=torch.float64)
    mask = torch.tensor([[True, True, True], [True, False, False]])
    token_rewards = kl_penalized_rewards(torch.tensor([1.0, 0.0], dtype=torch.float64), kl, mask, beta=0.5)
    assert token_rewards.tolist()[0] == pytest.approx([-0.05, -0.1, 0.85])
    assert token_rewards.tolist()[1] == pytest.approx([-0.25, 0.0, 0.0])
    empty = kl_penalized_rewards(torch.tensor([3.0]), torch.zeros(1, 2), torch.zeros(1, 2, dtype=torch.bool), 0.1)
    assert empty.tolist() == [[0.0, 0.0]]
