"""The reconfiguration policy, against brute force and over random histories."""
import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from agents.policy import Config, Priced, arrange, moves, next_config, zone_conflicts


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
    """Six nodes at depth 2 could make three pipelines, but with
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


# -- pipelines shorter than P (--max-stages-per-node 2) --------------------------------

def node_ranges(pipe):
    """node -> the stages it runs, checked contiguous."""
    out = {}
    for s, n in enumerate(pipe):
        out.setdefault(n, []).append(s)
    for stages in out.values():
        assert stages == list(range(stages[0], stages[0] + len(stages)))
    return out


def check_short(cfg: Config, live: dict, depth: int):
    placed = [n for pipe in cfg.pipelines for n in dict.fromkeys(pipe)]
    assert sorted(placed + list(cfg.standby)) == sorted(live)  # each live node once
    for pipe in cfg.pipelines:
        assert len(pipe) == cfg.depth
        ranges = node_ranges(pipe)
        assert all(len(stages) <= 2 for stages in ranges.values())
        if len(ranges) < cfg.depth:  # a short pipeline: the first nodes run the extra stages
            sizes = [len(ranges[n]) for n in dict.fromkeys(pipe)]
            assert sizes == sorted(sizes, reverse=True)


@settings(max_examples=200)
@given(clusters, st.integers(2, 6))
def test_short_pipelines_use_every_node_the_stages_allow(live, depth):
    """Without a cost estimate (no microbatch count), every node trains once the
    nodes can hold the P stages at two per node, whatever their count."""
    cfg = next_config(live, None, depth, max_stages=2)
    check_short(cfg, live, depth)
    if len(live) >= depth:
        assert cfg.depth == depth and not cfg.standby
        assert sum(len(set(p)) == depth for p in cfg.pipelines) >= len(live) // depth - 1
    elif len(live) >= -(-depth // 2):
        assert cfg.depth == depth and len(cfg.pipelines) == 1 and not cfg.notes  # one short pipeline, no reduced depth
    for pipe in cfg.pipelines:  # each as zone-spread as its nodes allow
        nodes = list(dict.fromkeys(pipe))
        if len(nodes) <= 7:
            assert zone_conflicts(tuple(nodes), live) == min_conflicts(nodes, live)


@settings(max_examples=200)
@given(clusters, st.integers(2, 5), st.data())
def test_short_pipelines_after_failures_and_joins(live, depth, data):
    previous = next_config(live, None, depth, max_stages=2)
    dead = data.draw(st.sets(st.sampled_from(sorted(live)) if live else st.nothing()))
    joined = {f"j{i}": z for i, z in enumerate(data.draw(st.lists(st.sampled_from("abc"), max_size=4)))}
    now = {n: z for n, z in live.items() if n not in dead} | joined
    cfg = next_config(now, previous, depth, max_stages=2)
    check_short(cfg, now, depth)
    if not dead and not joined:  # nothing changed: nothing moves
        assert cfg.pipelines == previous.pipelines and not moves(previous, cfg)
    intact = [p for p in previous.pipelines if all(n in now for n in p)]
    if cfg.depth == previous.depth:  # an intact full pipeline is kept as it was while full ones are wanted
        full = [p for p in cfg.pipelines if len(set(p)) == depth]
        for pipe in intact:
            if len(set(pipe)) == depth and len(full) >= len([p for p in intact if len(set(p)) == depth]):
                assert pipe in cfg.pipelines


def test_a_full_pipeline_that_loses_a_node_takes_one_from_the_short_pipeline():
    live = {f"n{i}": "abc"[i % 3] for i in range(5)}
    first = next_config(live, None, 3, max_stages=2)
    full, short = first.pipelines
    assert len(set(full)) == 3 and len(set(short)) == 2 and short[0] == short[1]  # stages 0 and 1 on one node
    victim = full[1]
    cfg = next_config({n: z for n, z in live.items() if n != victim}, first, 3, max_stages=2)
    mended = cfg.pipelines[0]
    assert mended[0] == full[0] and mended[2] == full[2] and mended[1] in short  # taken from the short pipeline
    assert len(cfg.pipelines) == 1 and cfg.standby == tuple(n for n in dict.fromkeys(short) if n != mended[1])
    # a death in the short pipeline leaves the full one alone: the survivor joins it as a short pair
    cfg = next_config({n: z for n, z in live.items() if n != short[2]}, first, 3, max_stages=2)
    assert len(cfg.pipelines) == 2 and all(len(set(p)) == 2 for p in cfg.pipelines)


def test_a_short_pipeline_is_formed_only_where_the_estimate_finds_it_faster():
    live = {f"n{i}": "ab"[i % 2] for i in range(18)}
    slots = next_config(live, None, 12, max_pipelines=24, max_stages=2)  # the stage-slot estimate: faster
    assert [len(set(p)) for p in slots.pipelines] == [12, 6]
    slower = next_config(live, None, 12, max_pipelines=24, max_stages=2,
                         iteration=lambda pipes: len(pipes))  # an estimate where every pipeline costs
    assert [len(set(p)) for p in slower.pipelines] == [12] and len(slower.standby) == 6
    assert next_config(live, None, 12, max_pipelines=1, max_stages=2).pipelines == slower.pipelines


def test_when_the_nodes_over_are_released_a_short_pipeline_must_train_as_much_per_node():
    """M=4, P=3. Eight nodes: a short pipeline of the two over takes no slot off the
    iteration (4 stage slots with it or without, by the estimate), so it is formed
    when every node is kept and not when they would be released. Eleven nodes: a
    pipeline of two takes the fourth microbatch (3 slots against 4), and the
    iteration's slots times its nodes is lower than with three pipelines of three:
    it is formed either way."""
    from agents.policy import lay_out, slot_estimate
    est = slot_estimate(4)
    slots = lambda lengths: est([lay_out(tuple(range(n)), 3) for n in lengths])  # noqa: E731
    assert slots([3, 3, 2]) == slots([3, 3]) == 4
    assert slots([3, 3, 3, 2]) * 11 < slots([3, 3, 3]) * 9
    for n, kept, released in ((8, [3, 3, 2], [3, 3]), (11, [3, 3, 3, 2], [3, 3, 3, 2])):
        live = {f"n{i}": "abc"[i % 3] for i in range(n)}
        for per_node, lengths in ((False, kept), (True, released)):
            cfg = next_config(live, None, 3, max_pipelines=4, max_stages=2, priced=Priced(per_node=per_node))
            assert [len(set(p)) for p in cfg.pipelines] == lengths, (n, per_node)


def test_max_stages_out_of_range_is_refused():
    import pytest
    for bad in (0, 3):
        with pytest.raises(ValueError, match="--max-stages-per-node must be 1 or 2"):
            next_config({"a": "a"}, None, 2, max_stages=bad)
