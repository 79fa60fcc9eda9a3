"""The reconfiguration policy, against brute force and over random histories."""
import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from agents.policy import Config, arrange, moves, next_config, zone_conflicts


def min_conflicts(nodes, zones):
    """Brute force: the fewest same-zone neighbours over every cyclic order."""
    first, rest = nodes[0], nodes[1:]
    return min(zone_conflicts((first, *perm), zones) for perm in itertools.permutations(rest))


clusters = st.integers(0, 14).flatmap(
    lambda n: st.lists(st.sampled_from("abc"), min_size=n, max_size=n)).map(
    lambda zs: {f"n{i:02d}": z for i, z in enumerate(zs)})


def check_invariants(cfg: Config, live: dict, depth: int, most: int | None = None):
    placed = [n for pipe in cfg.pipelines for n in pipe]
    assert sorted(placed + list(cfg.standby)) == sorted(live)       # each live node once
    assert all(len(pipe) == cfg.depth for pipe in cfg.pipelines)
    assert cfg.depth == min(depth, len(live))                       # depth kept while it can be
    if cfg.depth:
        fit = len(live) // cfg.depth
        assert len(cfg.pipelines) == (fit if most is None else min(fit, most))  # as many as fit and may run
    assert bool(cfg.notes) == (len(live) < depth) or any("changed" in n for n in cfg.notes)


@settings(max_examples=200)
@given(clusters, st.integers(1, 6))
def test_fresh_configuration(live, depth):
    cfg = next_config(live, None, depth)
    check_invariants(cfg, live, depth)
    for pipe in cfg.pipelines:  # every pipeline as zone-spread as its nodes allow
        assert zone_conflicts(pipe, live) == min_conflicts(list(pipe), live)
    for zone in set(live.values()):  # and zones dealt evenly over pipelines
        counts = [sum(live[n] == zone for n in pipe) for pipe in cfg.pipelines]
        assert not counts or max(counts) - min(counts) <= 1


@settings(max_examples=200)
@given(clusters, st.integers(1, 5), st.data())
def test_after_failures_and_joins(live, depth, data):
    most = data.draw(st.none() | st.integers(1, 4))  # the microbatches pipelines share
    previous = next_config(live, None, depth, most)
    check_invariants(previous, live, depth, most)
    dead = data.draw(st.sets(st.sampled_from(sorted(live)) if live else st.nothing()))
    joined = {f"j{i}": z for i, z in enumerate(data.draw(st.lists(st.sampled_from("abc"), max_size=4)))}
    now = {n: z for n, z in live.items() if n not in dead} | joined
    cfg = next_config(now, previous, depth, most)
    check_invariants(cfg, now, depth, most)
    assert cfg.epoch == previous.epoch + 1
    if cfg.depth == previous.depth:
        # The pipelines with the most survivors (ties: lowest index) are kept: their
        # survivors keep their stages and stay together.
        survivors = [[n for n in pipe if n in now] for pipe in previous.pipelines]
        ranked = sorted(range(len(survivors)), key=lambda j: (-len(survivors[j]), j))
        kept = [j for j in ranked[:len(cfg.pipelines)] if survivors[j]]
        before, after = previous.slots(), cfg.slots()
        for j in kept:
            assert all(after[n][1] == before[n][1] for n in survivors[j])
            assert len({after[n][0] for n in survivors[j]}) == 1
        # Layers move only into the holes of kept pipelines and into new pipelines.
        holes = sum(cfg.depth - len(survivors[j]) for j in kept)
        fresh = (len(cfg.pipelines) - len(kept)) * cfg.depth
        assert len(moves(previous, cfg)) <= holes + fresh


def test_standby_replaces_a_failed_node_first_and_from_another_zone():
    live = {"a1": "a", "b1": "b", "a2": "a", "b2": "b", "s1": "a", "s2": "b"}
    first = next_config(live, None, 4)
    assert len(first.pipelines) == 1 and len(first.standby) == 2
    victim = first.pipelines[0][1]
    left, right = first.pipelines[0][0], first.pipelines[0][2]
    cfg = next_config({n: z for n, z in live.items() if n != victim}, first, 4)
    filler = cfg.pipelines[0][1]
    assert filler in first.standby
    assert live[filler] not in {live[left], live[right]}
    assert moves(first, cfg) == [(filler, 1)]


def test_joining_nodes_form_a_new_pipeline_and_too_few_reduce_depth():
    live = {f"n{i}": "abc"[i % 3] for i in range(4)}
    cfg = next_config(live, None, 4)
    grown = next_config(live | {f"m{i}": "abc"[i % 3] for i in range(4)}, cfg, 4)
    assert len(grown.pipelines) == 2 and grown.pipelines[0] == cfg.pipelines[0]
    shrunk = next_config({"n0": "a", "n1": "b"}, grown, 4)
    assert shrunk.depth == 2 and "depth reduced from 4 to 2" in shrunk.notes[0]


def test_pipelines_never_outnumber_the_microbatches():
    """Issue 11, item 4: six nodes at depth 2 could make three pipelines, but with
    two microbatches a third would have none to run; the rest wait in standby."""
    live = {f"n{i}": "ab"[i % 2] for i in range(6)}
    first = next_config({n: live[n] for n in ("n0", "n1")}, None, 2, max_pipelines=2)
    grown = next_config(live, first, 2, max_pipelines=2)
    assert len(grown.pipelines) == 2 and len(grown.standby) == 2
    assert first.pipelines[0] in grown.pipelines  # the running pipeline is kept as it was


def test_arrange_alternates_zones():
    zones = {"a1": "a", "a2": "a", "b1": "b", "b2": "b", "c1": "c"}
    order = arrange(list(zones), zones)
    assert zone_conflicts(order, zones) == 0


def test_config_round_trips_through_json():
    cfg = next_config({"x": "a", "y": "b", "z": "c"}, None, 2)
    assert Config.from_dict(cfg.to_dict()) == cfg
