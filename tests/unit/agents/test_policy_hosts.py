"""The policy with hosts of several workers (agents/placement.py): no host holds
neighbouring stages of a pipeline whenever some placement allows it, checked
against a brute force over every placement of small cases."""
import itertools
import random

from agents.placement import host_conflicts
from agents.policy import Config, next_config, zone_conflicts


def cluster(rng: random.Random, nodes: int, zones: int, hosts: int):
    """live (node -> zone) and hosts (node -> host), each host in one zone."""
    zone_of_host = {f"h{h}": "abc"[rng.randrange(zones)] for h in range(hosts)}
    host = {str(n): f"h{rng.randrange(hosts)}" for n in range(nodes)}
    return {n: zone_of_host[h] for n, h in host.items()}, host


def clashes(config: Config, hosts) -> int:
    return sum(host_conflicts(p, hosts) for p in config.pipelines)


def placements(nodes: list[str], count: int, depth: int):
    """Every way to put `count` pipelines of `depth` on `nodes` (as pipelines)."""
    for perm in itertools.permutations(nodes, count * depth):
        yield [perm[j * depth:(j + 1) * depth] for j in range(count)]


def test_first_configuration_keeps_hosts_apart_whenever_possible():
    rng = random.Random(7)
    checked = 0
    for _ in range(60):
        nodes, depth = rng.randint(3, 7), rng.randint(2, 4)
        live, hosts = cluster(rng, nodes, rng.randint(1, 3), rng.randint(1, nodes))
        config = next_config(live, None, depth, hosts=hosts)
        count = len(config.pipelines)
        assert count == nodes // depth or depth > nodes
        found = next_config(live, None, depth)  # the same shape without hosts
        assert len(found.pipelines) == count
        if depth > nodes:
            continue
        best = min(sum(host_conflicts(tuple(p), hosts) for p in pipes)
                   for pipes in placements(sorted(live), count, depth))
        assert clashes(config, hosts) == best, (live, hosts, depth, config)
        if best == 0:
            # zones stay spread as well as any host-safe placement spreads them
            fewest = min(sum(zone_conflicts(tuple(p), live) for p in pipes)
                         for pipes in placements(sorted(live), count, depth)
                         if not sum(host_conflicts(tuple(p), hosts) for p in pipes))
            assert sum(zone_conflicts(p, live) for p in config.pipelines) == fewest, (live, hosts, depth, config)
            checked += 1
    assert checked > 20


def test_holes_are_filled_apart_from_the_neighbours_hosts_whenever_possible():
    rng = random.Random(11)
    checked = 0
    for _ in range(80):
        nodes, depth = rng.randint(5, 9), rng.randint(3, 5)
        live, hosts = cluster(rng, nodes, rng.randint(1, 2), rng.randint(2, nodes))
        first = next_config(live, None, depth, hosts=hosts)
        if not first.pipelines:
            continue
        dead = set(rng.sample(sorted(first.pipelines[0]), rng.randint(1, 2)))
        alive = {n: z for n, z in live.items() if n not in dead}
        config = next_config(alive, first, depth, hosts=hosts)
        kept = [[n if n not in dead else None for n in p] for p in first.pipelines]
        spares = [n for n in alive if all(n not in p for p in first.pipelines)]
        holes = [(j, s) for j, p in enumerate(kept) for s, n in enumerate(p) if n is None]
        if len(spares) < len(holes) or len(first.pipelines) != 1:
            continue
        assert all(config.pipelines[0][s] == n for s, n in enumerate(first.pipelines[0]) if n not in dead)

        def fill(choice):
            pipe = list(kept[0])
            for (_, s), n in zip(holes, choice):
                pipe[s] = n
            return host_conflicts(tuple(pipe), hosts)
        best = min(fill(c) for c in itertools.permutations(spares, len(holes)))
        already = host_conflicts(tuple(n for n in kept[0] if n), hosts)  # survivors' own pairs, never moved
        assert host_conflicts(config.pipelines[0], hosts) == best or best > 0 and already, (first, dead, hosts)
        checked += best == 0 and len(holes) > 1
    assert checked > 5


def test_never_fails_when_hosts_cannot_be_kept_apart():
    rng = random.Random(3)
    for _ in range(200):
        nodes, depth = rng.randint(2, 12), rng.randint(2, 6)
        live = {str(n): "ab"[rng.randrange(2)] for n in range(nodes)}
        hosts = {n: f"h{rng.randrange(2)}" for n in live}  # hosts across zones, too few to keep apart
        config = next_config(live, None, depth, max_stages=rng.choice((1, 2)), hosts=hosts)
        placed = [n for p in config.pipelines for n in dict.fromkeys(p)]
        assert sorted(placed + list(config.standby)) == sorted(live)
        dead = set(rng.sample(sorted(live), rng.randint(0, nodes // 2)))
        after = next_config({n: z for n, z in live.items() if n not in dead}, config, depth, hosts=hosts)
        assert not {n for p in after.pipelines for n in p} & dead


def test_one_node_per_host_is_the_policy_without_hosts():
    rng = random.Random(5)
    for _ in range(100):
        nodes, depth = rng.randint(2, 12), rng.randint(2, 5)
        live = {str(n): "abc"[rng.randrange(3)] for n in range(nodes)}
        stages = rng.choice((1, 2))
        first = next_config(live, None, depth, 8, stages)
        assert next_config(live, None, depth, 8, stages, hosts={n: n for n in live}) == first
        alive = {n: z for n, z in live.items() if rng.random() > 0.3}
        assert next_config(alive, first, depth, 8, stages, hosts={}) == next_config(alive, first, depth, 8, stages)


def test_two_workers_per_host_at_depth_four():
    """Three hosts of two workers, P=4: no host on neighbouring stages, and a
    host's loss leaves no stage without a copy in the pipeline, and the standby
    nodes take its stages."""
    live = {str(n): "abc"[n // 2] for n in range(6)}
    hosts = {str(n): f"host{n // 2}" for n in range(6)}
    config = next_config(live, None, 4, hosts=hosts)
    pipe = config.pipelines[0]
    assert host_conflicts(pipe, hosts) == 0 and zone_conflicts(pipe, live) == 0
    for host in set(hosts.values()):
        dead = {n for n in live if hosts[n] == host}
        stages = [s for s, n in enumerate(pipe) if n in dead]
        assert all((s + 1) % 4 not in stages for s in stages)  # never two neighbours
        after = next_config({n: z for n, z in live.items() if n not in dead}, config, 4, hosts=hosts)
        assert len(after.pipelines) == 1 and not set(after.pipelines[0]) & dead


def test_the_hole_search_is_skipped_exactly_where_no_fill_keeps_the_hosts_apart():
    """`_hosts_allow` (Hall's condition) against every fill, for holes with no hole
    beside them, where it is exact: it must never skip a search that could succeed."""
    from agents.placement import _hosts_allow
    rng = random.Random(13)
    skipped = 0
    for _ in range(400):
        depth, machines = rng.randint(2, 6), rng.randint(1, 4)
        partial = [[f"p{j}s{s}" for s in range(depth)] for j in range(rng.randint(1, 3))]
        for pipe in partial:
            for s in range(0, depth - 1, 2):  # every other stage at most, never the last: no two holes side by side
                if rng.random() < 0.5:
                    pipe[s] = None
        spares = [f"x{i}" for i in range(rng.randint(0, 5))]
        hosts = {n: f"h{rng.randrange(machines + 1)}" for n in spares + [n for p in partial for n in p if n]}
        holes = [(j, s) for j, p in enumerate(partial) for s, n in enumerate(p) if n is None][:len(spares)]

        def apart(choice):
            return all(hosts[n] not in {hosts[partial[j][(s - 1) % depth]], hosts[partial[j][(s + 1) % depth]]}
                       for (j, s), n in zip(holes, choice))
        possible = any(apart(c) for c in itertools.permutations(spares, len(holes)))
        assert _hosts_allow(holes, partial, spares, hosts) == possible, (partial, spares, hosts)
        skipped += not possible
    assert skipped > 40
