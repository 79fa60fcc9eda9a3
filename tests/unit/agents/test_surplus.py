"""The burst-sized standby (agents/surplus.py) against an independent count: the
distribution of nodes lost in a window, summed over the number of bursts by
repeated convolution of the observed sizes, weighted by Poisson probabilities."""
import math

import numpy as np
import pytest

from agents.surplus import BurstModel, binomial_standby


def by_convolution(sizes, elapsed, window, limit) -> np.ndarray:
    """P(s nodes lost), s = 0..limit, as the sum over n bursts of Pois(n) times
    the n-fold convolution of the size distribution."""
    p = np.zeros(max(sizes) + 1)
    for size in sizes:
        p[size] += 1 / len(sizes)
    mean = len(sizes) / elapsed * window
    out, n_fold = np.zeros(limit + 1), np.array([1.0])
    for n in range(0, 60):
        poisson = math.exp(-mean) * mean ** n / math.factorial(n)
        out[:min(limit + 1, len(n_fold))] += poisson * n_fold[:limit + 1]
        n_fold = np.convolve(n_fold, p)
    return out


@pytest.mark.parametrize("sizes,elapsed,window", [
    ((1, 1, 1, 2, 6), 36_000.0, 300.0),
    ((3, 3, 4), 7_200.0, 600.0),
    ((1,) * 40, 3_600.0, 300.0),
])
def test_the_recursion_equals_the_convolution(sizes, elapsed, window):
    model = BurstModel(sizes, elapsed)
    assert model.loss_distribution(window, 30) == pytest.approx(list(by_convolution(sizes, elapsed, window, 30)),
                                                                abs=1e-12)


def test_the_standby_is_the_smallest_k_whose_tail_is_within_epsilon():
    model = BurstModel((1, 1, 2, 5), 20_000.0)
    mass = by_convolution((1, 1, 2, 5), 20_000.0, 600.0, 40)
    k = model.standby(600.0, 0.01, 40)
    assert 1 - mass[:k + 1].sum() <= 0.01 < 1 - mass[:k].sum()


def poisson_quantile(mean: float, epsilon: float) -> int:
    """The smallest n with P(Poisson(mean) > n) <= epsilon, summed term by term."""
    n, total = 0, math.exp(-mean)
    while 1 - total > epsilon:
        n += 1
        total += math.exp(-mean) * mean ** n / math.factorial(n)
    return n


def test_bursts_need_more_standby_than_the_same_losses_independent():
    """Ten zone bursts of 6 nodes in ten hours against 60 single losses in the same
    time over 36 nodes: the same mean loss, but a burst takes 6 at once, so the burst
    model covers whole bursts; the binomial rule of independent faults asks for less."""
    bursts = BurstModel((6,) * 10, 36_000.0).standby(600.0, 0.01, 36)
    singles = BurstModel((1,) * 60, 36_000.0).standby(600.0, 0.01, 36)
    binomial = binomial_standby(36, 60 / 36 / 36_000.0, 600.0, 0.01)
    assert bursts == 6 * poisson_quantile(10 / 36_000 * 600, 0.01) == 12
    assert singles == poisson_quantile(60 / 36_000 * 600, 0.01) == 4
    assert binomial <= singles < bursts


def test_nothing_seen_asks_for_nothing_and_the_limit_caps():
    assert BurstModel((), 3_600.0).standby(300.0, 0.01, 10) == 0
    assert BurstModel((20,), 60.0).standby(3_600.0, 0.01, 10) == 10


def test_sizes_below_one_are_refused_and_a_large_fleet_does_not_overflow():
    with pytest.raises(ValueError, match="one node or more"):
        BurstModel((0, 1), 3_600.0)
    assert 0 < binomial_standby(5_000, 1 / 36_000, 600.0, 0.01) < 5_000  # math.comb would overflow floats


def test_a_burst_in_the_first_seconds_is_not_read_as_a_rate_of_one_a_second():
    """Observed over less than one window, the rate is taken over the window."""
    assert BurstModel((1,), 0.01).standby(300.0, 0.01, 50) == BurstModel((1,), 300.0).standby(300.0, 0.01, 50) < 50
