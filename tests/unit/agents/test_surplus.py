"""The burst-sized standby (agents/surplus.py) against an independent count: the
distribution of nodes lost in a window, summed over the number of bursts by
repeated convolution of the observed sizes, weighted by Poisson probabilities."""
import math

import numpy as np
import pytest

from agents.surplus import BurstModel, binomial_standby


def by_convolution(sizes, elapsed, window, limit, prior_bursts=0.0, prior_seconds=0.0) -> np.ndarray:
    """P(s nodes lost), s = 0..limit, as the sum over n bursts of Pois(n) times
    the n-fold convolution of the size distribution (the prior's bursts: one node each)."""
    p = np.zeros(max(sizes, default=1) + 1)
    for size in sizes:
        p[size] += 1
    p[1] += prior_bursts
    p /= p.sum()
    mean = (len(sizes) + prior_bursts) / (elapsed + prior_seconds) * window
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


def test_before_any_preemption_the_prior_sizes_the_standby():
    """Six nodes at auto's prior, 0.05 deaths per node-hour weighing 2 node-hours:
    0.1 single-node bursts over 20 minutes. In a 300 s wait one node is lost with
    chance 1 - exp(-0.025) > 0.01, two within 0.01: one standby. A burst of four
    seen after an hour outweighs it: the convolution with the prior's bursts."""
    prior = BurstModel.seen((), 0.0, 6, 0.05, 2.0)
    assert (prior.prior_bursts, prior.prior_seconds) == pytest.approx((0.1, 1200.0))
    assert 1 - math.exp(-0.025) > 0.01 and prior.standby(300.0, 0.01, 10) == 1
    assert BurstModel.seen((), 0.0, 6, 0.001, 2.0).standby(300.0, 0.01, 10) == 0
    seen = BurstModel.seen((4,), 3_600.0, 6, 0.05, 2.0)
    mass = by_convolution((4,), 3_600.0, 300.0, 20, 0.1, 1200.0)
    assert seen.loss_distribution(300.0, 20) == pytest.approx(list(mass), abs=1e-12)
    assert seen.standby(300.0, 0.01, 20) == next(k for k in range(21) if 1 - mass[:k + 1].sum() <= 0.01) == 4


def test_sizes_below_one_are_refused_and_a_large_fleet_does_not_overflow():
    with pytest.raises(ValueError, match="one node or more"):
        BurstModel((0, 1), 3_600.0)
    seen = (1, 3)
    BurstModel(seen, 3_600.0)
    BurstModel(seen, 7_200.0)  # the same bursts again: checked once
    with pytest.raises(ValueError, match="one node or more"):
        BurstModel((*seen, -2), 3_600.0)  # a new tuple is checked whole
    assert 0 < binomial_standby(5_000, 1 / 36_000, 600.0, 0.01) < 5_000  # math.comb would overflow floats


def test_a_burst_in_the_first_seconds_is_not_read_as_a_rate_of_one_a_second():
    """Observed over less than one window, the rate is taken over the window."""
    assert BurstModel((1,), 0.01).standby(300.0, 0.01, 50) == BurstModel((1,), 300.0).standby(300.0, 0.01, 50) < 50


def test_the_rules_count_as_named():
    """keep holds every surplus node, fixed its count, binomial the binomial
    quantile at the loss rate per node observed (nodes lost per node-second)."""
    from agents.surplus import SurplusRule, standby_count
    seen = BurstModel((2, 1, 3), 7_200.0)
    assert standby_count(SurplusRule.KEEP, seen, 300.0, 0.01, 12, 5) == 5
    assert standby_count(SurplusRule.FIXED, seen, 300.0, 0.01, 12, 5, fixed=2) == 2
    assert standby_count(SurplusRule.FIXED, seen, 300.0, 0.01, 12, 1, fixed=2) == 1
    # by hand: 6 nodes lost over 12 nodes x 7200 s, so p = 1 - exp(-rate x 300 s) per node, and
    # the smallest k with P(more than k of 12 lost) <= 0.01, summed term by term
    p = 1 - math.exp(-6 / 7_200.0 / 12 * 300.0)
    tail = lambda k: sum(math.comb(12, j) * p ** j * (1 - p) ** (12 - j) for j in range(k + 1, 13))  # noqa: E731
    assert standby_count(SurplusRule.BINOMIAL, seen, 300.0, 0.01, 12, 5) == min(5, next(k for k in range(13)
                                                                                      if tail(k) <= 0.01))


def test_the_burst_rule_keeps_a_standby_only_while_it_earns_its_price():
    """The j-th standby stays while P(at least j lost within the window) times what
    the j-th missing node costs is at least what a paid node earns: checked against
    the tail of the independent convolution, with every loss costing the same and
    with only the first costing (the second falls in the pipeline already broken)."""
    from agents.surplus import Economics, SurplusRule, standby_count
    sizes, elapsed, window = (1, 1, 2, 5), 20_000.0, 600.0
    model = BurstModel(sizes, elapsed)
    ceiling = model.standby(window, 0.01, 30)
    mass = by_convolution(sizes, elapsed, window, 40)
    at_least = lambda j: 1 - mass[:j].sum()  # noqa: E731  P(j or more lost)
    base = 100.0
    for loss, paid in ((10.0, 10), (10.0, 200), (1.0, 100), (30.0, 4), (100.0, 10_000)):
        for cost in (lambda j: loss, lambda j: loss if j == 1 else 0.0):  # noqa: B023
            expected = 0
            while expected < ceiling and at_least(expected + 1) * cost(expected + 1) >= base / paid:
                expected += 1
            left = lambda gone: base - sum(cost(j) for j in range(1, gone + 1))  # noqa: E731,B023
            got = standby_count(SurplusRule.BURST, model, window, 0.01, 20, 30, Economics(left, paid))
            assert got == expected, (loss, paid, cost(2))
    assert standby_count(SurplusRule.BURST, model, window, 0.01, 20, 30) == ceiling  # no economics: the ceiling


def test_a_burst_takes_the_zone_with_the_most_trainers_first():
    from agents.surplus import burst_order
    trainers = {"t1": "b", "t2": "a", "t3": "b", "t4": "c", "t5": "a", "t6": "b"}
    assert burst_order(trainers) == ["t1", "t3", "t6", "t2", "t5", "t4"]


def test_the_standby_goes_to_the_zones_with_fewest_trainers():
    from agents.surplus import assign_surplus
    trainers = {"t1": "a", "t2": "a", "t3": "a", "t4": "b", "t5": "b", "t6": "c"}
    idle = {"i1": "a", "i2": "b", "i3": "c", "i4": "c"}
    out = assign_surplus(idle, trainers, 2)
    assert out.standby == ("i3", "i2")  # c has one trainer, then b (two) ties with c (now two): b by name
    assert out.release == ("i1", "i4")
    assert assign_surplus(idle, trainers, 0).release == tuple(sorted(idle))
    assert assign_surplus(idle, trainers, 9).standby and not assign_surplus(idle, trainers, 9).release
