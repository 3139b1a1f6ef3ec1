"""Statistics of acceptance: confidence intervals, pass@k, paired gains, unpaired differences, and the
trend of a logged metric over recent steps (the alarms are in alarms.py)."""

from __future__ import annotations

import math
from typing import Sequence

Z95 = 1.959963984540054  # two-sided 95% normal quantile


def wilson_interval(successes: float, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval for a binomial proportion (Wilson 1927); well behaved at 0 and 1.

    Example: 50 of 100 -> about (0.404, 0.596); 0 of 10 -> (0.0, 0.278).
    """
    if n <= 0:
        return (0.0, 1.0)
    p = successes / n
    denominator = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denominator
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denominator
    low = 0.0 if successes <= 0 else max(0.0, centre - half)  # exact bounds at the ends, not 1e-17
    high = 1.0 if successes >= n else min(1.0, centre + half)
    return (low, high)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c passed (Chen et al., arXiv:2107.03374 eq. 1):
    1 - C(n - c, k) / C(n, k). Example: n = 4, c = 1, k = 2 -> 1 - C(3,2)/C(4,2) = 1 - 3/6 = 0.5."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"need 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod((n - c - i) / (n - i) for i in range(k))


def paired_difference_ci(before: Sequence[float | None], after: Sequence[float | None], z: float = Z95) -> tuple[float, float, float]:
    """Mean gain `after - before` over the same problems and its normal-approximation interval,
    using the paired differences' sample variance (problems shared by both evaluations make the
    gain far less noisy than two independent proportions would be).

    Returns: (gain, low, high).
    """
    if len(before) != len(after):
        raise ValueError("before and after must score the same problems")
    # Problems either evaluation could not score (None) are left out of both.
    differences = [a - b for a, b in zip(after, before) if a is not None and b is not None]
    if not differences:
        raise ValueError("no problem was scored by both evaluations")
    n = len(differences)
    gain = sum(differences) / n
    variance = sum((d - gain) ** 2 for d in differences) / max(1, n - 1)
    half = z * math.sqrt(variance / n)
    return gain, gain - half, gain + half


def unpaired_difference_ci(start: float, start_ci: list, end: float, end_ci: list) -> tuple[float, float, float]:
    """end - start with Newcombe's hybrid score interval from the two Wilson intervals (Newcombe
    1998, Statistics in Medicine 17:873, method 10), for two evaluations of different problems.

    Example: 0.5 [0.4, 0.6] -> 0.7 [0.6, 0.78]: 0.2, [0.2 - sqrt(0.1^2 + 0.1^2), 0.2 + sqrt(0.08^2 + 0.1^2)]
    = (0.2, 0.0586, 0.3281)."""
    (start_low, start_high), (end_low, end_high) = start_ci, end_ci
    difference = end - start
    return (difference, difference - math.hypot(end - end_low, start_high - start),
            difference + math.hypot(end_high - end, start - start_low))


def least_squares_slope(values: Sequence[float]) -> float | None:
    """The ordinary least-squares slope of `values` against their step index 0, 1, ..., n - 1 (one
    step apart): sum (x - mean x)(y - mean y) / sum (x - mean x)^2, per step; None under 2 points.
    The recipes log it over the last few steps of `entropy` as `entropy/slope` (docs/metrics.md).

    Example: [3.0, 2.5, 2.0] -> -0.5; [1.0, 2.0, 1.0, 2.0] -> 0.2 (centred x -1.5, -0.5,
    0.5, 1.5 and y -0.5, 0.5, -0.5, 0.5: sum xy 1, sum x^2 5).
    """
    n = len(values)
    if n < 2:
        return None
    mean_x, mean_y = (n - 1) / 2, sum(values) / n
    return sum((x - mean_x) * (y - mean_y) for x, y in enumerate(values)) / sum((x - mean_x) ** 2 for x in range(n))
