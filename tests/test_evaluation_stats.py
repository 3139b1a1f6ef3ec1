"""Acceptance statistics by hand: Wilson interval, pass@k, paired gain, divergence alarm."""

import math
from itertools import combinations

import pytest

from posttrain.evaluation.alarms import DivergenceAlarm
from posttrain.evaluation.stats import paired_difference_ci, pass_at_k, wilson_interval


def test_wilson_by_hand():
    """50/100: centre (0.5 + z^2/200) / (1 + z^2/100) = 0.5; half-width
    z sqrt(0.25/100 + z^2/40000) / (1 + z^2/100) = 1.96 * 0.050960 / 1.038415 ~ 0.0962."""
    low, high = wilson_interval(50, 100)
    assert (low, high) == pytest.approx((0.5 - 0.09617, 0.5 + 0.09617), abs=1e-4)
    low, high = wilson_interval(0, 10)
    assert low == 0.0 and high == pytest.approx(0.2775, abs=1e-4)
    assert wilson_interval(0, 0) == (0.0, 1.0)


def test_pass_at_k_matches_enumeration():
    """pass@k = fraction of k-subsets of the n samples containing at least one pass."""
    samples = [True, False, False, True, False, False]
    for k in range(1, 7):
        subsets = list(combinations(samples, k))
        expected = sum(any(s) for s in subsets) / len(subsets)
        assert pass_at_k(6, 2, k) == pytest.approx(expected)
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)
    assert pass_at_k(5, 0, 3) == 0.0
    with pytest.raises(ValueError):
        pass_at_k(3, 1, 4)


def test_paired_difference_by_hand():
    """Differences [1, 0, 1, 0]: gain 0.5, sample variance (4 * 0.25) / 3 = 1/3,
    half-width 1.96 * sqrt(1/12) ~ 0.5658."""
    gain, low, high = paired_difference_ci([0, 1, 0, 1], [1, 1, 1, 1])
    assert gain == 0.5
    half = 1.959963984540054 * math.sqrt(1 / 12)
    assert (low, high) == pytest.approx((0.5 - half, 0.5 + half))


def test_divergence_alarm():
    alarm = DivergenceAlarm(window=3, reward_rise=0.1)
    assert alarm.observe(10, 0.2, 0.30) is None
    assert alarm.observe(20, 0.3, 0.31) is None
    assert alarm.observe(30, 0.5, 0.30) is not None  # reward +0.3, held-out 0.0
    assert "divergence" in alarm.rings[0]
    assert alarm.observe(40, 0.7, 0.30) is None and len(alarm.rings) == 1  # still diverging: it rang already
    resumed = DivergenceAlarm(window=3, reward_rise=0.1, history=[list(h) for h in alarm.history], rings=alarm.rings)
    assert resumed.observe(50, 0.9, 0.30) is None and resumed.history[0] == (10, 0.2, 0.30)
    healthy = DivergenceAlarm(window=2, reward_rise=0.1)
    healthy.observe(1, 0.2, 0.3)
    assert healthy.observe(2, 0.5, 0.4) is None  # both rose
