"""The per-step sampling math on hand-made logits: truncation, log-probs, and token frequencies."""

import math

import pytest
import torch

from posttrain.errors import UserError
from posttrain.rollout.sampling import (
    SamplingConfig,
    gather_logprobs,
    sample_from_logits,
    sample_from_probs,
    sample_step,
    sampler_logits,
)

# Chi-square critical values at p = 0.001 (a fair sampler fails one test in a thousand seeds; the
# seeds are fixed, so these tests are deterministic): df -> value.
CHI2_999 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515}


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    keep = probs > 0
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


def log_of(probs):
    return torch.tensor(probs, dtype=torch.float32).log().unsqueeze(0)


def test_top_p_keeps_the_token_that_crosses_p():
    """probs [0.5, 0.25, 0.125, 0.125] (exact in float32). Mass *before* each token in descending order:
    [0, 0.5, 0.75, 0.875]. top_p = 0.7 keeps tokens whose mass-before < 0.7: the first two, renormalised
    to [2/3, 1/3]. top_p = 0.5 keeps only the first (0.5 is not < 0.5). top_p = 0.8 keeps three."""
    logits = log_of([0.5, 0.25, 0.125, 0.125])
    kept = torch.softmax(sampler_logits(logits, top_p=0.7), -1)[0]
    assert torch.allclose(kept, torch.tensor([2 / 3, 1 / 3, 0, 0]), atol=1e-6)
    assert torch.isfinite(sampler_logits(logits, top_p=0.5)[0]).tolist() == [True, False, False, False]
    assert torch.isfinite(sampler_logits(logits, top_p=0.8)[0]).tolist() == [True, True, True, False]
    # order in the vocabulary does not matter
    shuffled = log_of([0.125, 0.25, 0.125, 0.5])
    assert torch.isfinite(sampler_logits(shuffled, top_p=0.7)[0]).tolist() == [False, True, False, True]


def test_top_k_and_top_p_compose():
    """top_k=3 on [0.4, 0.3, 0.2, 0.1] leaves [0.4, 0.3, 0.2] -> renormalised [4/9, 3/9, 2/9]; then
    top_p=0.6 keeps mass-before [0, 4/9=0.444] < 0.6: the first two -> [4/7, 3/7]."""
    logits = log_of([0.4, 0.3, 0.2, 0.1])
    only_k = torch.softmax(sampler_logits(logits, top_k=3), -1)[0]
    assert torch.allclose(only_k, torch.tensor([4 / 9, 3 / 9, 2 / 9, 0]), atol=1e-6)
    both = torch.softmax(sampler_logits(logits, top_k=3, top_p=0.6), -1)[0]
    assert torch.allclose(both, torch.tensor([4 / 7, 3 / 7, 0, 0]), atol=1e-6)


def test_inverse_cdf_picks_by_cumulative_mass():
    """probs [0.5, 0.25, 0.25]: cdf [0.5, 0.75, 1]; u in [0, .5) -> 0, [.5, .75) -> 1, [.75, 1) -> 2."""
    logits = log_of([0.5, 0.25, 0.25]).expand(6, 3)
    uniforms = torch.tensor([0.0, 0.49, 0.5, 0.74, 0.75, 0.999999], dtype=torch.float64)
    assert sample_from_logits(logits, uniforms).tolist() == [0, 0, 1, 1, 2, 2]


def test_inverse_cdf_never_draws_a_removed_token():
    """Even a uniform that rounds up to the total mass lands on the last *allowed* token."""
    logits = torch.tensor([[0.0, 0.0, float("-inf"), float("-inf")]])
    for u in (1 - 2 ** -53, 1 - 2 ** -30, 0.9999999):
        assert sample_from_logits(logits, torch.tensor([u], dtype=torch.float64)).item() == 1


def test_two_level_inverse_cdf_equals_the_full_cumsum():
    """Optimised vs naive: block sums then one block's cumsum give the same token as one float64
    cumsum over the whole vocabulary (V = 1000 is not a multiple of the block; a third of the
    probabilities are exactly 0 and must never be drawn)."""
    generator = torch.Generator().manual_seed(0)
    probs = torch.rand(300, 1000, generator=generator)
    probs[torch.rand(300, 1000, generator=generator) < 0.33] = 0.0
    uniforms = torch.rand(300, generator=generator, dtype=torch.float64)
    tokens, total = sample_from_probs(probs, uniforms)
    cdf = probs.double().cumsum(-1)
    naive = torch.searchsorted(cdf, (uniforms * cdf[:, -1]).unsqueeze(-1), right=True).squeeze(-1)
    assert torch.equal(tokens, naive)
    assert (probs.gather(-1, tokens.unsqueeze(-1)) > 0).all()
    assert torch.allclose(total, probs.double().sum(-1))


def test_frequencies_match_temperature_and_top_p():
    """Chi-square, fixed seed. logits = log [0.4, 0.3, 0.2, 0.1]; temperature 0.5 squares and
    renormalises: [16, 9, 4, 1] / 30 = [0.533, 0.3, 0.133, 0.033]. top_p = 0.8: mass-before
    [0, 0.533, 0.833, ...]: keeps two, renormalised [16/25, 9/25] = [0.64, 0.36]."""
    config = SamplingConfig(temperature=0.5, top_p=0.8)
    expected = torch.tensor([0.64, 0.36, 0.0, 0.0])
    draws = 20000
    logits = log_of([0.4, 0.3, 0.2, 0.1]).expand(draws, 4)
    uniforms = torch.rand(draws, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    tokens, sampler, plain = sample_step(logits, config, uniforms)
    counts = torch.bincount(tokens, minlength=4).double()
    assert counts[2] == counts[3] == 0
    assert chi_square(counts, expected.double()) < CHI2_999[1]
    # both log-probs, by hand: sampler = log 0.64 for token 0; plain (temperature only) = log 16/30
    first = tokens == 0
    assert torch.allclose(sampler[first], torch.tensor(math.log(0.64)), atol=1e-5)
    assert torch.allclose(plain[first], torch.tensor(math.log(16 / 30)), atol=1e-5)


def test_frequencies_match_temperature_and_top_k():
    """Temperature 2 takes square roots: sqrt([0.4, 0.3, 0.2, 0.1]) / sum; top_k = 3 drops the last
    and renormalises the other three; chi-square with 2 degrees of freedom."""
    config = SamplingConfig(temperature=2.0, top_k=3)
    roots = torch.tensor([0.4, 0.3, 0.2, 0.1]).sqrt()
    expected = torch.cat([roots[:3] / roots[:3].sum(), torch.zeros(1)]).double()
    draws = 20000
    uniforms = torch.rand(draws, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    tokens, _, _ = sample_step(log_of([0.4, 0.3, 0.2, 0.1]).expand(draws, 4), config, uniforms)
    counts = torch.bincount(tokens, minlength=4).double()
    assert counts[3] == 0
    assert chi_square(counts, expected) < CHI2_999[2]


def test_a_biased_sampler_fails_the_chi_square():
    """The test can fail: draws at temperature 1 are rejected against the temperature-0.5 distribution
    [16, 9, 4, 1] / 30 (3 degrees of freedom)."""
    draws = 20000
    uniforms = torch.rand(draws, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    tokens, _, _ = sample_step(log_of([0.4, 0.3, 0.2, 0.1]).expand(draws, 4), SamplingConfig(), uniforms)
    counts = torch.bincount(tokens, minlength=4).double()
    assert chi_square(counts, torch.tensor([16, 9, 4, 1]).double() / 30) > CHI2_999[3]
    assert chi_square(counts, torch.tensor([0.4, 0.3, 0.2, 0.1]).double()) < CHI2_999[3]


def test_sampler_and_plain_logprobs_differ_by_the_kept_mass():
    """With truncation, sampler log-prob = plain log-prob - log(mass kept); without, they are equal."""
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(0))
    uniforms = torch.rand(5, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    config = SamplingConfig(temperature=0.7, top_p=0.6)
    tokens, sampler, plain = sample_step(logits, config, uniforms)
    scaled = logits / 0.7
    kept_mass = (torch.softmax(scaled, -1) * torch.isfinite(sampler_logits(scaled, top_p=0.6))).sum(-1)
    assert torch.allclose(sampler, plain - kept_mass.log(), atol=1e-5)
    assert torch.allclose(plain, gather_logprobs(torch.log_softmax(scaled, -1), tokens), atol=1e-6)
    tokens, sampler, plain = sample_step(logits, SamplingConfig(temperature=0.7), uniforms)
    assert torch.equal(sampler, plain)


def test_greedy_and_banned_ids():
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0]])
    tokens, sampler, plain = sample_step(logits, SamplingConfig(greedy=True), torch.zeros(2))
    assert tokens.tolist() == [1, 0] and sampler.tolist() == [0.0, 0.0]
    assert torch.allclose(plain, torch.log_softmax(logits, -1)[[0, 1], [1, 0]])
    tokens, sampler, plain = sample_step(logits, SamplingConfig(greedy=True), torch.zeros(2),
                                         banned_ids=torch.tensor([1]))
    assert tokens.tolist() == [2, 0]
    # sampling with a ban: token 1 never drawn, sampler renormalised without it
    draws = torch.rand(2000, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    tokens, sampler, plain = sample_step(logits[:1].expand(2000, 3), SamplingConfig(), draws,
                                         banned_ids=torch.tensor([1]))
    assert not (tokens == 1).any()
    assert torch.allclose(sampler[tokens == 2], torch.tensor(math.log(math.e / (1 + math.e))), atol=1e-5)


@pytest.mark.parametrize("bad", [dict(temperature=0.0), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-1),
                                 dict(max_new_tokens=0), dict(min_new_tokens=9, max_new_tokens=8),
                                 dict(stop_strings="abc"), dict(stop_strings=("",))])
def test_bad_settings_are_one_line_errors(bad):
    with pytest.raises(UserError):
        SamplingConfig(**bad)
