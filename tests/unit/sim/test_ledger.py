"""The simulator's ledger: paid node-hours by what they went to. The parts sum to
the node-hours paid, and each part is checked against what the run says
happened (checkpoints taken, the schedule's iteration times)."""
import pytest

from sim.profiles import profile
from sim.simulator import STRATEGIES, ClusterSimulator, Options
from sim.traces import read, synthetic

P3 = read("traces/ec2-p3-trace.csv", "auto")


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_the_parts_sum_to_the_node_hours_paid(strategy):
    out = ClusterSimulator(profile("gpt2", "arithmetic"), 6, strategy, Options()).run(P3, 4)
    price = Options().on_demand_price if strategy == "on-demand" else Options().spot_price
    paid = out["cost_per_hour"] / price * out["hours"]
    assert sum(out["ledger"].values()) == pytest.approx(paid, rel=1e-3)


def test_steady_nodes_book_checkpoint_writes_and_redundancy_as_the_run_did():
    """Twelve nodes that never leave, P=6: two pipelines, nothing idle. The writes are
    the checkpoints taken times one write on every node; eager's redundant share is
    what the schedule adds to an iteration without redundancy."""
    steady = synthetic(2, 12, ("a", "b", "c"), 0.0, 0)
    sim = ClusterSimulator(profile("gpt2", "arithmetic"), 6, "bamboo", Options(checkpoint_seconds=600.0, replica_sync="end"))
    out = sim.run(steady, 2)
    taken = out["checkpointing"]["checkpoints_taken"]
    assert taken > 0 and set(out["ledger"]) == {"checkpoint writes", "redundancy", "training"}
    assert out["ledger"]["checkpoint writes"] == pytest.approx(
        taken * out["checkpointing"]["write_seconds"] * 12 / 3600, abs=1e-3)
    share = 1 - sim.iteration_seconds(2, mode="off") / sim.iteration_seconds(2)
    computing = out["ledger"]["redundancy"] + out["ledger"]["training"]
    assert share > 0 and out["ledger"]["redundancy"] / computing == pytest.approx(share, rel=1e-3)
