"""idle_unjustified_fraction: the paid idle node-hours beyond the standby that the
burst rule (agents/surplus.py), fitted to the bursts seen so far, asks for."""
import math

import pytest

from sim.profiles import profile
from sim.simulator import ClusterSimulator, Options
from sim.traces import Event, synthetic


def run(events, hours: float, **options) -> dict:
    """Every node the trace grants kept (--surplus keep): what idle time the rule justifies."""
    return ClusterSimulator(profile("gpt2", "arithmetic"), 3, "auto", Options(surplus="keep", **options)).run(
        events, hours)


def test_with_no_burst_seen_only_the_prior_justifies_a_standby_while_it_lasts():
    """Seven steady nodes at P=3 (no short pipelines): two pipelines and one idle
    node all along. Nothing is ever lost, so only auto's prior justifies it (0.05
    deaths per node-hour weighing 2 node-hours of the six trainers: 0.1 single-node
    bursts over 1200 s), until the chance of a loss within the 300 s wait,
    1 - exp(-0.1 x 300 / (t + 1200)), falls to 0.01: solved for t by hand."""
    out = run(synthetic(6, 7, ("a", "b", "c"), 0.0, 0), 6, max_stages=1)
    until = 0.1 * 300 / -math.log(1 - 0.01) - 1200
    assert 1700 < until < 1800
    assert out["idle_fraction"] == round(1 / 7, 4)
    assert out["idle_unjustified_fraction"] == pytest.approx((6 * 3600 - until) / (7 * 6 * 3600), abs=1e-4)


def test_bursts_justify_standby_and_a_looser_epsilon_justifies_less():
    """A burst of three nodes each hour (back ten minutes later) on ten nodes: after
    the first, the burst rule keeps idle nodes as standby; with a larger epsilon, or
    a shorter acquisition wait, it keeps fewer."""
    events = [Event(0.0, "add", f"n{i}", "abc"[i % 3]) for i in range(10)]
    for hour in range(1, 6):
        gone = [f"n{(hour + k) % 10}" for k in range(3)]
        events += [Event(hour * 3600.0, "remove", n, "abc"[int(n[1:]) % 3]) for n in gone]
        events += [Event(hour * 3600.0 + 600, "add", n, "abc"[int(n[1:]) % 3]) for n in gone]
    strict = run(sorted(events), 6, max_stages=1, acquire_seconds=600.0, standby_epsilon=0.01)
    loose = run(sorted(events), 6, max_stages=1, acquire_seconds=60.0, standby_epsilon=0.5)
    assert strict["idle_fraction"] == loose["idle_fraction"] > 0
    assert strict["idle_unjustified_fraction"] < loose["idle_unjustified_fraction"] <= loose["idle_fraction"]
