"""idle_unjustified_fraction: the paid idle node-hours beyond the standby that the
burst rule (agents/surplus.py), fitted to the bursts seen so far, asks for."""
from sim.profiles import profile
from sim.simulator import ClusterSimulator, Options
from sim.traces import Event, synthetic


def run(events, hours: float, **options) -> dict:
    """Every node the trace grants kept (--surplus keep): what idle time the rule justifies."""
    return ClusterSimulator(profile("gpt2", "arithmetic"), 3, "auto", Options(surplus="keep", **options)).run(
        events, hours)


def test_with_no_burst_seen_no_standby_is_justified():
    """Seven steady nodes at P=3 (no short pipelines): two pipelines and one idle
    node all along; nothing was ever lost, so none of its hours is justified."""
    out = run(synthetic(6, 7, ("a", "b", "c"), 0.0, 0), 6, max_stages=1)
    assert out["idle_fraction"] == round(1 / 7, 4) == out["idle_unjustified_fraction"]


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
