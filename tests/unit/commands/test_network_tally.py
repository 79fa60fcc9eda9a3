"""The ledger's bytes between zones (commands/status/network.py) on hand-built
epochs: where each kind goes, the share that crosses, a ring reduce's bytes on the
wire, and counters from etcd that are no count."""
import math

from bamboo.control.protocol import Zone
from commands.status.network import NetworkTally, destinations

# two pipelines of three stages; node 5 runs stages 1 and 2 of the second (a short pipeline)
PIPES = ((0, 1, 2), (3, 5, 5))
ZONES = {0: Zone("a"), 1: Zone("b"), 2: Zone("a"), 3: Zone("a"), 5: Zone("b")}


def test_each_kind_goes_where_the_schedule_sends_it():
    assert destinations(PIPES, 1, "send_act") == [2] and destinations(PIPES, 1, "send_grad") == [0]
    assert destinations(PIPES, 0, "send_grad") == [] and destinations(PIPES, 2, "send_act") == []
    assert destinations(PIPES, 0, "send_sync") == [2]  # node 2 keeps stage 0's replica (stage 0 - 1, cyclically)
    assert destinations(PIPES, 5, "send_act") == [] and destinations(PIPES, 5, "send_grad") == [3]
    assert destinations(PIPES, 5, "reduce") == [1, 2] and destinations(PIPES, 9, "send_act") == []
    assert destinations(PIPES, 1, "handover") == []


def test_the_share_that_crosses_a_zone_by_hand():
    tally = NetworkTally()
    tally.add(PIPES, 1, {"send_act": 100, "send_grad": 40, "reduce": 10}, ZONES)
    tally.add(PIPES, 1, {"send_act": 300, "send_grad": 40, "reduce": 30}, ZONES)  # counters only grow
    # node 1 (zone b): activations to 2 (a) cross; gradients to 0 (a) cross; the reduce goes to its stage's
    # peer 5 (b), and on the wire a ring over 2 pipelines sends 2 (2 - 1) / 2 = 1 times the counter
    assert tally.snapshot() == {"sent": {"send_act": 300.0, "send_grad": 40.0, "reduce": 30.0},
                                "crossed": {"send_act": 300.0, "send_grad": 40.0}}
    tally.add(PIPES, 0, {"send_sync": 50}, ZONES)  # to node 2, in its own zone a
    assert tally.snapshot()["crossed"].get("send_sync", 0.0) == 0.0


def test_counters_that_are_no_count_are_skipped_and_kinds_are_bounded():
    tally = NetworkTally()
    bad = {"send_act": -5, "send_grad": math.nan, "send_sync": True, "x" * 41: 7, "reduce": "9"}
    tally.add(PIPES, 1, bad, ZONES)
    tally.add(PIPES, 1, [1, 2], ZONES)
    tally.add(PIPES, 1, {f"k{i}": 1 for i in range(100)}, ZONES)
    assert tally.snapshot()["crossed"] == {} and len(tally.snapshot()["sent"]) == 32
