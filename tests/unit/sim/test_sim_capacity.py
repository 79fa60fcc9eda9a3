"""Capacity as a decision (sim/capacity.py): a node released stops being paid, one
asked for from the trace's free nodes comes --acquire-seconds later and is paid
while it comes, a free node the trace removes costs nothing, and a request the
trace cannot fill is filled by its next node at once. Each case is checked
against a run of a plainer trace, or against the times and counts it implies."""
import os

import pytest

from sim.profiles import PROFILES
from sim.simulator import ClusterSimulator, Options
from sim.traces import Event, read

BERT = PROFILES["bert-large"]
P3 = os.path.join(os.path.dirname(__file__), "..", "..", "..", "traces", "ec2-p3-trace.csv")


def start(nodes, zones="ab"):
    return [Event(0, "add", f"n{i}", zones[i % len(zones)]) for i in range(nodes)]


def run(events, surplus="burst", strategy="redo", **options):
    opt = Options(max_stages=1, free_checkpoints=True, surplus=surplus, **options)
    return ClusterSimulator(BERT, 2, strategy, opt).run(events, hours=1.0)


def test_a_node_in_no_pipeline_is_released_and_no_longer_paid():
    """Five steady nodes at P=2: two pipelines and one node over. Nothing was ever
    lost, so the burst rule keeps no standby: that node goes at once, and the job
    trains as four nodes do, paying for four."""
    released, four = run(start(5)), run(start(4), surplus="keep")
    kept = run(start(5), surplus="keep")
    assert released["mean_nodes"] == pytest.approx(4.0) and kept["mean_nodes"] == pytest.approx(5.0)
    assert released["samples"] == four["samples"] == kept["samples"]
    assert released["nodes_released"] == 1 and released["idle_fraction"] == 0.0
    assert released["value"] == pytest.approx(kept["value"] * 5 / 4, rel=1e-3)


def test_a_replacement_comes_after_the_acquisition_and_is_paid_while_it_comes():
    """n1 dies at 1000 s: one pipeline is left, and the released node is asked for.
    It comes at 1000 + 300 s; until then it is paid (acquisition waits). The
    survivor of the broken pipeline waits for it, paid too: after a death the burst
    rule asks for one standby, so that node is booked as standby, not as idle."""
    events = start(5) + [Event(1000.0, "remove", "n1", "b")]
    out = run(events, acquire_seconds=300.0)
    one, two = [(t, n) for t, n, rate in out["timeline"] if t >= 1000.0][:2]
    assert one == (1000.0, 4) and two == (1300.0, 4)  # three held and one coming, then four held
    rates = {t: rate for t, _, rate in out["timeline"]}
    assert rates[1000.0] < rates[1300.0] == rates[0.0]  # one pipeline while it comes, two after
    assert out["nodes_acquired"] == 1
    assert out["ledger"]["acquisition waits"] == pytest.approx(300 / 3600, abs=1e-4)
    assert out["ledger"]["standby"] == pytest.approx(300 / 3600, abs=1e-4)
    assert out["idle_unjustified_fraction"] == pytest.approx(300 / (4 * 3600), abs=1e-4)  # the node coming
    assert out["mean_nodes"] == pytest.approx(4.0)


def test_a_free_node_the_trace_takes_costs_the_job_nothing():
    """The node over (released at once) is preempted later: the job never sees it."""
    gone = run(start(5) + [Event(1000.0, "remove", "n4", "a")])
    four = run(start(4), surplus="keep")
    assert gone["preemptions"] == 0 and gone["samples"] == four["samples"]


def test_a_request_the_trace_cannot_fill_takes_its_next_node_at_once():
    """Four nodes, none free: after n1's death the job still asks for four (a
    preemption does not lower the request), the survivor of the broken pipeline
    waits for the replacement rather than being released, and the node the trace
    adds 200 s later (within --acquire-seconds) is taken then: as if every node
    were kept. The survivor's wait is the standby the burst rule asks for after a
    death; where the rule asks for none (a loss allowed half the time), an
    acquisition wait."""
    events = start(4) + [Event(1000.0, "remove", "n1", "b"), Event(1200.0, "add", "n9", "b")]
    out, kept = run(events, acquire_seconds=300.0), run(events, surplus="keep")
    assert out["samples"] == kept["samples"] and out["mean_nodes"] == kept["mean_nodes"]
    assert out["nodes_released"] == out["nodes_acquired"] == 0
    assert out["ledger"]["standby"] == pytest.approx(200 / 3600, abs=1e-4)  # the survivor, waiting
    none = run(events, standby_epsilon=0.5, acquire_seconds=300.0)
    assert none["samples"] == kept["samples"] and "standby" not in none["ledger"]
    assert none["ledger"]["acquisition waits"] == pytest.approx(200 / 3600, abs=1e-4)


def test_a_request_nothing_fills_for_the_acquisition_time_is_given_up():
    """The same death, but the trace has no node for 1000 s: the survivor waits
    300 s (what re-acquiring it would cost), is released, and comes back with the
    new node: both asked for at 2000 s, here at 2300 s. Its wait is booked as the
    standby the burst rule asks for after a death (the price weighing, not the
    rule's count, let it go); the two nodes coming as acquisition waits."""
    events = start(4) + [Event(1000.0, "remove", "n1", "b"), Event(2000.0, "add", "n9", "b")]
    out = run(events, acquire_seconds=300.0)
    paid = [(t, n) for t, n, _ in out["timeline"] if t >= 1000.0]
    assert paid[:4] == [(1000.0, 3), (1300.0, 2), (2000.0, 4), (2300.0, 4)]
    assert out["nodes_released"] == 1 and out["nodes_acquired"] == 2
    assert out["ledger"]["acquisition waits"] == pytest.approx(2 * 300 / 3600, abs=1e-4)
    assert out["ledger"]["standby"] == pytest.approx(300 / 3600, abs=1e-4)


@pytest.mark.parametrize("surplus", ["burst", "binomial", "fixed", "keep"])
def test_the_ledger_sums_to_the_paid_node_hours(surplus):
    """On the EC2 p3 trace (four hours), for every strategy: the ledger's parts add
    up to mean paid nodes times hours, within 1%."""
    events = read(P3, "ec2")
    opt = Options(surplus=surplus)
    for strategy in ("auto", "redo", "checkpoint"):
        out = ClusterSimulator(BERT, 4, strategy, opt).run(events, hours=4.0)
        assert sum(out["ledger"].values()) == pytest.approx(out["mean_nodes"] * 4.0, rel=0.01)
