"""The whole decision on small fleets (zones, shared hosts, short pipelines, nodes
over released or kept, previous configurations) against a brute force over every
configuration, scored by the rules agents/policy.py states, and the surplus
roles (agents/surplus.py) against every choice of standby. The references are
written from the docstrings, not from the policy's helpers."""
import itertools
import random

from agents.policy import Priced, next_config
from agents.surplus import assign_surplus


def fleet(rng: random.Random, nodes: int):
    """live (node -> zone) and hosts (node -> machine, some holding several nodes, each in one zone)."""
    machines = rng.randint(1, nodes)
    zone_of = {f"h{h}": "abc"[rng.randrange(rng.randint(1, 3))] for h in range(machines)}
    hosts = {f"n{i}": f"h{rng.randrange(machines)}" for i in range(nodes)}
    return {n: zone_of[h] for n, h in hosts.items()}, hosts


def cycle_cost(cycle, zones, hosts) -> tuple[int, int]:
    """(pairs of neighbours on one host, pairs in one zone) around a pipeline's node cycle."""
    pairs = [(cycle[i], cycle[(i + 1) % len(cycle)]) for i in range(len(cycle))] if len(cycle) > 1 else []
    return sum(hosts[a] == hosts[b] for a, b in pairs), sum(zones[a] == zones[b] for a, b in pairs)


def total(pipelines, zones, hosts) -> tuple[int, int]:
    costs = [cycle_cost(tuple(dict.fromkeys(p)), zones, hosts) for p in pipelines]
    return sum(c[0] for c in costs), sum(c[1] for c in costs)


def best_cycle(group, zones, hosts) -> tuple[int, int]:
    """The least (host pairs, zone pairs), hosts first, over every cyclic order of `group`."""
    return min(cycle_cost((group[0], *rest), zones, hosts) for rest in itertools.permutations(group[1:]))


def best_placement(live, hosts, lengths) -> tuple[int, int]:
    """The least total (host pairs, zone pairs) over every choice of disjoint node
    groups of `lengths` (the rest in standby) and every order of each."""
    memo = {}

    def search(nodes, todo):
        if not todo:
            return (0, 0)
        best = None
        for group in itertools.combinations(nodes, todo[0]):
            if group not in memo:
                memo[group] = best_cycle(group, live, hosts)
            rest = search([n for n in nodes if n not in group], todo[1:])
            cost = (memo[group][0] + rest[0], memo[group][1] + rest[1])
            best = cost if best is None or cost < best else best
        return best
    return search(sorted(live), list(lengths))


def least_slots(lengths, depth: int, microbatches: int) -> int:
    """The 1F1B stage-slot estimate (schedules/split.py) of the fastest split: the
    least T such that the pipelines, each node on at most ceil(depth / nodes) stages,
    can run all the microbatches, at least one each, within T slots."""
    busiest = [-(-depth // n) for n in lengths]
    slots = depth
    while sum((slots - depth) // k + 1 for k in busiest) < microbatches:
        slots += 1
    return slots


def documented_lengths(nodes: int, depth: int, max_stages: int, most, per_node: bool, seconds) -> list[int]:
    """pipeline_lengths' rule: the full pipelines, or with the nodes over either a
    short pipeline of them (enough to hold every stage) or, too few, the last full
    pipeline's nodes and them in two halves; the one using more nodes unless the
    estimate (`seconds` of the lengths; None: none) finds it more than 1% slower or,
    with the nodes over released, it trains fewer samples per node. Never more
    pipelines than microbatches."""
    full, rest = divmod(nodes, depth)
    other = None
    if rest and max_stages > 1:
        if rest >= -(-depth // max_stages):
            other = [depth] * full + [rest]
        elif full:
            other = [depth] * (full - 1) + [(depth + rest + 1) // 2, (depth + rest) // 2]
    plain = [depth] * full
    fits = [c for c in (plain, other) if c and (most is None or len(c) <= most)]
    if not fits:
        return plain[:most]
    if seconds is None or len(fits) == 1:
        return fits[-1]
    slow, fast = seconds(plain), seconds(other)
    ok = fast <= 1.01 * slow and (not per_node or fast * sum(other) <= slow * sum(plain))
    return other if ok else plain


def made_up_estimate(salt: int):
    """An iteration estimate (of the pipelines' lengths only) that may find more nodes
    slower, as a cost model may: a fixed pseudo-random time per set of lengths."""
    def seconds(lengths) -> float:
        return random.Random(f"{salt}:{sorted(lengths)}").choice((1.0, 1.005, 1.02, 1.2))  # some within 1%
    return seconds


def check_layout(config, live, depth: int, max_stages: int):
    """Each live node once; each pipeline every stage, each node a contiguous range of
    at most `max_stages`, the first nodes the longer ranges."""
    placed = [n for p in config.pipelines for n in dict.fromkeys(p)]
    assert sorted(placed + list(config.standby)) == sorted(live)
    for pipe in config.pipelines:
        assert len(pipe) == depth
        runs = [len(list(g)) for _, g in itertools.groupby(pipe)]
        assert len(runs) == len(set(pipe)) and max(runs) <= max_stages and runs == sorted(runs, reverse=True)


def test_a_first_configuration_is_the_best_of_every_configuration():
    """The pipelines' lengths are the documented rule's (by the stage-slot estimate of
    the microbatches, or another estimate); every pipeline has its best order; with
    full pipelines only, no choice of nodes and orders has fewer host pairs, nor as
    few and fewer zone pairs. (Short pipelines are cut from the nodes the full ones
    leave, which that joint optimum does not always survive.)"""
    rng = random.Random(17)
    joint = 0
    for _ in range(300):
        live, hosts = fleet(rng, rng.randint(1, 8))
        depth, max_stages = rng.randint(2, 5), rng.choice((1, 2))
        most, per_node = rng.choice((None, rng.randint(1, 4))), rng.random() < 0.5
        seconds = None if most is None else lambda lengths: least_slots(lengths, depth, most)  # noqa: E731
        iteration = None
        if rng.random() < 0.3:
            seconds = made_up_estimate(rng.randrange(1 << 30))
            iteration = lambda pipes, s=seconds: s([len(set(p)) for p in pipes])  # noqa: E731
        config = next_config(live, None, depth, most, max_stages, iteration, hosts, Priced(per_node=per_node))
        shortest = -(-depth // max_stages)
        if len(live) < shortest:  # too few for a pipeline: one of them all, at the depth they make
            assert config.depth == len(live) and len(config.pipelines) == 1
            continue
        check_layout(config, live, depth, max_stages)
        lengths = [len(set(p)) for p in config.pipelines]
        assert lengths == documented_lengths(len(live), depth, max_stages, most, per_node, seconds)
        for pipe in config.pipelines:  # every pipeline in its best order: hosts apart first, then zones
            nodes = tuple(dict.fromkeys(pipe))
            assert cycle_cost(nodes, live, hosts) == best_cycle(nodes, live, hosts), (live, hosts, config)
        if all(n == depth for n in lengths):  # full pipelines: the best nodes too, and each zone dealt evenly
            assert total(config.pipelines, live, hosts) == best_placement(live, hosts, lengths), (live, hosts, config)
            for zone in set(live.values()):
                counts = [sum(live[n] == zone for n in p) for p in config.pipelines]
                assert not counts or max(counts) - min(counts) <= 1
            joint += bool(lengths)
        reordered = dict(reversed(list(live.items())))  # deterministic: the order nodes are listed in is no input
        assert next_config(reordered, None, depth, most, max_stages, iteration, dict(reversed(list(hosts.items()))),
                           Priced(per_node=per_node)) == config
    assert joint > 100


def hole_fills(partial, spares, zones, hosts):
    """(host pairs, zone pairs) of the kept pipelines for every way to fill their holes from `spares`."""
    holes = [(j, s) for j, p in enumerate(partial) for s, n in enumerate(p) if n is None]
    for choice in itertools.permutations(spares, len(holes)):
        pipes = [list(p) for p in partial]
        for (j, s), n in zip(holes, choice):
            pipes[j][s] = n
        yield choice, total(pipes, zones, hosts)


def test_holes_are_filled_as_the_rules_say_against_every_fill():
    """After deaths and newcomers: the pipelines with the most survivors (ties: the
    lowest index) are kept, their survivors on their stages; no hole's filler sits
    beside a node of its host where some fill allows; a lone hole takes a node of a
    zone unlike its neighbours' where a host-safe one exists."""
    rng = random.Random(23)
    checked = 0
    for _ in range(600):
        live, hosts = fleet(rng, rng.randint(3, 9))
        depth, most = rng.randint(2, 4), rng.choice((None, rng.randint(1, 3)))
        first = next_config(live, None, depth, most, hosts=hosts)
        dead = set(rng.sample(sorted(live), rng.randint(1, max(1, len(live) // 3))))
        now = {n: z for n, z in live.items() if n not in dead}
        zone_of = {hosts[n]: z for n, z in live.items()}
        for j in range(rng.randint(0, 2)):  # newcomers, on a machine of the fleet or a new one
            hosts[f"j{j}"] = rng.choice(sorted(zone_of) + [f"new{j}"])
            now[f"j{j}"] = zone_of.get(hosts[f"j{j}"], rng.choice("abc"))
        config = next_config(now, first, depth, most, hosts=hosts)
        if config.depth != depth or first.depth != depth:
            continue
        survivors = [[n for n in p if n in now] for p in first.pipelines]
        ranked = sorted(range(len(survivors)), key=lambda j: (-len(survivors[j]), j))
        partial = [[n if n in now else None for n in first.pipelines[j]]
                   for j in ranked[:len(config.pipelines)] if survivors[j]]
        spares = sorted(n for n in now if all(n not in p for p in partial))
        holes = sum(p.count(None) for p in partial)
        if not holes or holes > len(spares):
            continue
        mended = [next(q for q in config.pipelines if all(n in (None, q[s]) for s, n in enumerate(p)))
                  for p in partial]  # each kept pipeline, its survivors on their stages
        fills = list(hole_fills(partial, spares, now, hosts))
        fewest, own = min(cost[0] for _, cost in fills), sum(survivor_pairs(p, hosts) for p in partial)
        if fewest == own:  # some fill puts no filler beside a node of its host: the policy's is one
            assert total(mended, now, hosts)[0] == own, (first, now, hosts, config)
        if holes == 1 and fewest == own:
            j, s = next((j, s) for j, p in enumerate(partial) for s, n in enumerate(p) if n is None)
            near = {now[partial[j][(s - 1) % depth]], now[partial[j][(s + 1) % depth]]}
            if any(now[c[0]] not in near for c, cost in fills if cost[0] == own):
                assert now[mended[j][s]] not in near, (first, now, hosts, config)
        checked += 1
    assert checked > 150


def survivor_pairs(partial, hosts) -> int:
    """Host pairs between neighbouring survivors of a pipeline with holes: no fill changes them."""
    P = len(partial)
    return sum(a is not None and b is not None and hosts[a] == hosts[b]
               for a, b in ((partial[i], partial[(i + 1) % P]) for i in range(P)))


def test_the_standby_left_is_the_most_even_over_zones_of_every_choice():
    """The policy's nodes in no pipeline, split by the surplus roles: the standby
    kept makes the trainers-and-standby per zone (of the zones with idle nodes) the
    most even of every choice of that many (its smallest count the largest, then
    the next...), each zone's first nodes by name; the rest are released."""
    rng = random.Random(29)
    checked = 0
    for _ in range(300):
        live, hosts = fleet(rng, rng.randint(1, 10))
        config = next_config(live, None, rng.randint(1, 4), rng.randint(1, 3), rng.choice((1, 2)), hosts=hosts,
                             priced=Priced(per_node=True))
        trainers = {n: live[n] for p in config.pipelines for n in p}
        idle = {n: live[n] for n in config.standby}
        keep = rng.randint(0, len(idle) + 1)
        roles = assign_surplus(idle, trainers, keep)
        zones = sorted(set(idle.values()))

        def load(standby):
            return sorted(sum(z == zone for z in trainers.values()) + sum(idle[n] == zone for n in standby)
                          for zone in zones)
        assert load(roles.standby) == max(load(s) for s in itertools.combinations(sorted(idle), min(keep, len(idle))))
        for zone in zones:
            mine = sorted(n for n in roles.standby if idle[n] == zone)
            assert mine == sorted(n for n in idle if idle[n] == zone)[:len(mine)]
        assert sorted(roles.standby + roles.release) == sorted(idle) and not set(roles.standby) & set(roles.release)
        checked += len(idle) > 1 and 0 < keep < len(idle)
    assert checked > 30
