"""Zone spread as a priced choice (agents/spread.py) and the packed placement the
policy makes of it (agents/policy.py), against counts and bills worked by hand."""
import pytest

from agents.policy import Priced, next_config
from agents.spread import GIB, pack_zones, zone_bursts_per_hour
from agents.surplus import BurstModel
from sim.pricing import crossing_shares

TWELVE = {f"n{i}": "abc"[i % 3] for i in range(12)}  # four nodes in each of zones a, b, c


def test_zone_bursts_are_the_bursts_of_more_than_one_node():
    """Sizes 1, 1, 3, 2 over 7200 s: 4 bursts in 2 h, half of them of two nodes or more."""
    model = BurstModel((1, 1, 3, 2), 7200.0)
    assert zone_bursts_per_hour(model, 300.0) == pytest.approx(2 * 0.5)
    assert zone_bursts_per_hour(BurstModel((1, 1), 7200.0), 300.0) == 0.0


def test_packing_pays_when_the_bytes_it_saves_cost_more_than_the_bursts_it_risks():
    """100 GiB an hour saved at $0.02 is $2 an hour; one zone burst an hour costing
    1,000 node-seconds more at $0.9 a node-hour is $0.25, at $9 it is $2.50."""
    saved = 100 * GIB
    assert pack_zones(saved, 0.02, 1.0, 1000.0, 0.9)
    assert not pack_zones(saved, 0.02, 1.0, 1000.0, 9.0)
    assert not pack_zones(saved, 0.0, 0.0, 0.0, 0.9)  # no price: spreading is free
    assert not pack_zones(-saved, 0.02, 0.0, 0.0, 0.9)  # packing sends more


def test_packed_pipelines_each_take_one_zone_and_send_nothing_between_zones_but_the_reduce():
    spread = next_config(TWELVE, None, 4, max_pipelines=8)
    packed = next_config(TWELVE, None, 4, max_pipelines=8, priced=Priced(pack_zones=True))
    assert all(len({TWELVE[n] for n in p}) == 3 for p in spread.pipelines)  # four stages over three zones
    assert sorted(len({TWELVE[n] for n in p}) for p in packed.pipelines) == [1, 1, 1]
    assert {TWELVE[p[0]] for p in packed.pipelines} == {"a", "b", "c"}
    shares = crossing_shares(packed, TWELVE)
    assert shares["activations, forward"] == shares["replica syncs"] == 0.0
    assert shares["data-parallel reduce"] == 1.0  # each stage's ring goes round the three zones
    assert crossing_shares(spread, TWELVE)["activations, forward"] == 1.0


def test_a_packed_pipeline_s_hole_takes_a_node_of_its_zone():
    """Nine nodes at P=4, packed: two pipelines, each in its zone; a death in the
    first is filled from its zone's spare, not from the third zone's."""
    nine = {**{f"a{i}": "a" for i in range(5)}, **{f"b{i}": "b" for i in range(4)}}
    nine["c0"] = "c"
    first = next_config(nine, None, 4, max_pipelines=8, priced=Priced(pack_zones=True))
    zone = nine[first.pipelines[0][0]]
    assert len({nine[n] for n in first.pipelines[0]}) == 1
    dead = first.pipelines[0][1]
    after = next_config({n: z for n, z in nine.items() if n != dead}, first, 4, max_pipelines=8,
                        priced=Priced(pack_zones=True))
    filled = after.pipelines[0][1]
    assert filled != dead and nine[filled] == zone, (first, after)
