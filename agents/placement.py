"""Where nodes go in a pipeline, given their zones and hosts: pure functions the
policy (agents/policy.py) uses to keep neighbouring stages apart.

A host is one machine with several workers (`bamboo-agent --workers N`): its
loss takes every one of them at once, and two neighbouring stages of a pipeline
(cyclically: stage P-1 keeps stage 0's replica) lost together are a stage lost for
the pipeline. So no host holds neighbouring stages when the hosts allow it; that
comes before spreading zones (a host is in one zone; zones only may fail
together). A node's host defaults to the node itself: one worker per machine.
"""
from __future__ import annotations

from collections import Counter
from itertools import chain, zip_longest
from typing import Mapping

SEARCH_STEPS = 20_000  # the hole search gives up after this many steps and fills greedily
_GAP = object()  # a zone's queue run out, in the round robin


def host_of(hosts: Mapping[str, str] | None, node: str) -> str:
    return hosts.get(node, node) if hosts else node


def host_conflicts(pipeline: tuple[str, ...], hosts: Mapping[str, str] | None) -> int:
    """Neighbouring stage pairs (cyclic) on two different nodes of one host."""
    n = len(pipeline)
    pairs = [(pipeline[i], pipeline[(i + 1) % n]) for i in range(n)] if n > 1 else []
    return sum(a != b and host_of(hosts, a) == host_of(hosts, b) for a, b in pairs)


def cap(depth: int, count: int) -> int:
    """The most nodes of one host that `count` cycles of `depth` take with no two
    of them neighbours: every other place."""
    return count * (depth // 2) if depth > 1 else 1 << 30


def spread_order(nodes: list[str], zones: Mapping[str, str], hosts: Mapping[str, str] | None) -> list[str]:
    """Nodes in runs: the largest zone first, and inside a zone the largest host
    first. Placed on every other slot of a cycle in this order, a run no longer
    than half the cycle has no two members side by side."""
    zone_size = Counter(map(zones.__getitem__, nodes))
    if not hosts and len(set(nodes)) == len(nodes):  # each node its own host, once: every host's size is 1
        return sorted(nodes, key=lambda n: (-zone_size[zones[n]], zones[n], n))
    host_size = Counter(host_of(hosts, n) for n in nodes)
    return sorted(nodes, key=lambda n: (-zone_size[zones[n]], zones[n], -host_size[host_of(hosts, n)],
                                        host_of(hosts, n), n))


def choose(candidates: list[str], k: int, zones: Mapping[str, str], hosts: Mapping[str, str] | None,
           most: int) -> list[str]:
    """k candidates taken round-robin over zones (each zone's queue in order), no
    host beyond `most` while others remain, so the new pipelines get as many
    zones as the spares offer and can keep each host's nodes apart."""
    queues: dict[str, list[str]] = {}
    for n in candidates:
        queues.setdefault(zones[n], []).append(n)
    order = sorted(queues, key=lambda z: (-len(queues[z]), z))
    if not hosts and most >= 1 and k >= 0 and len(set(candidates)) == len(candidates):
        # each node its own host, taken once: the round robin takes the queues' heads
        rounds = zip_longest(*(queues[z] for z in order), fillvalue=_GAP)
        return [n for n in chain.from_iterable(rounds) if n is not _GAP][:k]
    out: list[str] = []
    taken: dict[str, int] = {}
    progress = True
    while len(out) < k and progress:
        progress = False
        for z in order:
            pick = next((n for n in queues[z] if taken.get(host_of(hosts, n), 0) < most), None)
            if pick is not None and len(out) < k:
                queues[z].remove(pick)
                out.append(pick)
                taken[host_of(hosts, pick)] = taken.get(host_of(hosts, pick), 0) + 1
                progress = True
    picked = set(out)
    rest = [n for n in candidates if n not in picked]
    return out + rest[:k - len(out)]  # the hosts allow no better: the next in line


def _ranked(spares: list[str], pipe: list, s: int, kind: Mapping[str, tuple[str, str]],
            pack: bool = False) -> list[str]:
    """Spares for hole s, best first: neither a neighbour's host nor zone (with
    `pack`: of a neighbour's zone), then not its host, then the rest; one of each
    (host, zone) kind (`kind`: node -> both; the others would do the same), in queue order."""
    P = len(pipe)
    near = [kind[x] for x in (pipe[(s - 1) % P], pipe[(s + 1) % P]) if x]
    avoid_hosts, avoid_zones = {h for h, _ in near}, {z for _, z in near}
    first: dict[tuple[str, str], str] = {}
    for n in spares:
        if kind[n] not in first:
            first[kind[n]] = n
    return sorted(first.values(), key=lambda n: (kind[n][0] in avoid_hosts, (kind[n][1] in avoid_zones) != pack))


def first_ranked(spares: list[str], pipe: list, s: int, zones: Mapping[str, str], pack: bool = False) -> str:
    """`_ranked`'s first spare for hole s where each node is its own host: the first in
    queue order of the best kind, found without ranking every spare."""
    P = len(pipe)
    near = [x for x in (pipe[(s - 1) % P], pipe[(s + 1) % P]) if x]
    avoid_zones = {zones[x] for x in near}
    best, best_key = None, (True, True)
    for n in spares:
        key = (n in near, (zones[n] in avoid_zones) != pack)
        if best is None or key < best_key:
            best, best_key = n, key
            if key == (False, False):
                break
    return best


def fill_holes(partial: list[list[str | None]], spares: list[str], zones: Mapping[str, str],
               hosts: Mapping[str, str] | None, pack: bool = False) -> None:
    """Fill the holes (None) from `spares` (taken from it) in stage order, each
    with a node from a zone unlike its neighbours' (with `pack`, of their zone:
    bytes between zones cost more than spreading saves), and never beside a node of
    its own host where some way of filling them all allows (a bounded search;
    past its bound, or with no such way, the greedy choice)."""
    holes = [(p, s) for p, pipe in enumerate(partial) if None in pipe
             for s, n in enumerate(pipe) if n is None][:len(spares)]
    if not hosts:  # each node its own host: no fill clashes, and the search takes each hole's first choice
        for p, s in holes:
            partial[p][s] = n = first_ranked(spares, partial[p], s, zones, pack)
            spares.remove(n)
        return
    budget = [SEARCH_STEPS]
    kind = {n: (host_of(hosts, n), zones[n]) for n in spares + [x for pipe in partial for x in pipe if x]}

    def search(i: int) -> bool:
        if i == len(holes):
            return True
        budget[0] -= 1
        if budget[0] < 0:
            return False
        p, s = holes[i]
        for n in _ranked(spares, partial[p], s, kind, pack):
            partial[p][s] = n
            if not _clashes(partial[p], s, hosts):
                at = spares.index(n)
                spares.pop(at)
                if search(i + 1):
                    return True
                spares.insert(at, n)  # back in its place in the queue
        partial[p][s] = None
        return False

    if _hosts_allow(holes, partial, spares, hosts) and search(0):
        return
    for p, s in holes:  # the hosts allow no better: best first, conflicts and all
        n = _ranked(spares, partial[p], s, kind, pack)[0]
        partial[p][s] = n
        spares.remove(n)


def _hosts_allow(holes: list[tuple[int, int]], partial: list[list[str | None]], spares: list[str],
                 hosts: Mapping[str, str] | None) -> bool:
    """Whether every hole can take its own spare of a host unlike its neighbours'
    (neighbouring holes aside): Hall's condition, each hole barring at most two
    hosts. Without it no fill keeps the hosts apart, and the search would only run
    its 20,000 steps before the greedy choice."""
    room: dict[str, int] = {}
    for n in spares:
        room[host_of(hosts, n)] = room.get(host_of(hosts, n), 0) + 1
    barred: dict[frozenset[str], int] = {}  # holes barring each host, and each pair of hosts
    for p, s in holes:
        pipe = partial[p]
        near = frozenset(host_of(hosts, x) for x in (pipe[(s - 1) % len(pipe)], pipe[(s + 1) % len(pipe)]) if x)
        for bar in {near, *(frozenset([h]) for h in near)} - {frozenset()}:
            barred[bar] = barred.get(bar, 0) + 1
    return all(count <= len(spares) - sum(room.get(h, 0) for h in bar) for bar, count in barred.items())


def _clashes(pipe: list, s: int, hosts: Mapping[str, str] | None) -> bool:
    P = len(pipe)
    return any(x and x != pipe[s] and host_of(hosts, x) == host_of(hosts, pipe[s])
               for x in (pipe[(s - 1) % P], pipe[(s + 1) % P]))
