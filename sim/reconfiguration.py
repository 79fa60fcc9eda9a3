"""What a reconfiguration loses and costs, shared by the strategies and by `auto`:
which nodes changed stage, which stages died in each pipeline, which are lost on
every node, and how long one stage's state takes to move."""
from __future__ import annotations

from itertools import chain

from schedules.layout import Layout
from schedules.split import merged

from agents.policy import Config
from sim.memo import ByIdentity
from sim.profiles import NETWORK, Profile


def stages_moved(a: Config, b: Config) -> bool:
    """Whether any node of `b` computes a stage it did not compute in `a`."""
    if b.pipelines is a.pipelines or set(b.pipelines) <= set(a.pipelines):
        return False  # every pipeline of b ran as it is in a: the usual batch, without the node-by-node walk
    before = {(n, s) for pipe in a.pipelines for s, n in enumerate(pipe)}
    return any((n, s) not in before for pipe in b.pipelines for s, n in enumerate(pipe))


def used_nodes(config: Config | None) -> frozenset[str]:
    """The nodes that compute in `config`."""
    return _nodes_of(config.pipelines) if config else frozenset()


# kept for the few configurations in force: a batch asks for them several times
_nodes_of = ByIdentity(lambda pipelines: frozenset().union(*pipelines))


def shape(pipeline: tuple[str, ...]) -> tuple[int, ...]:
    """How many stages each node of a pipeline runs, in stage order."""
    if len(set(pipeline)) == len(pipeline):
        return (1,) * len(pipeline)  # every node on one stage: the usual case, without the walk
    sizes: list[int] = []
    for s, n in enumerate(pipeline):
        if s and n == pipeline[s - 1]:
            sizes[-1] += 1
        else:
            sizes.append(1)
    return tuple(sizes)


def positions_dead(config: Config, removed: set[str]) -> list[set[int]]:
    """The stages whose node died, in each pipeline of `config`."""
    return [{i for i, n in enumerate(pipe) if n in removed} if not removed.isdisjoint(pipe) else set()
            for pipe in config.pipelines]


def dead_stages(config: Config, removed: set[str]) -> list[set[int]]:
    """The stage positions that died in each pipeline of `config`: a dead node's
    stages and, in a short pipeline with a death, the stages merged into a
    predecessor (the compiler counts them as failed nodes, so that `Layout.lost`
    says which stages have no copy left)."""
    positions = positions_dead(config, removed)
    return [dead | merged(pipe) if dead else dead for dead, pipe in zip(positions, config.pipelines)]


def nodes_dead(config: Config, removed: set[str]) -> list[int]:
    """How many nodes died in each pipeline of `config`."""
    return [len(set(pipe) & removed) for pipe in config.pipelines]


def memory_copies(config: Config, zones: dict[str, str]) -> dict[int, set[str]]:
    """Who keeps each stage's checkpoint in memory, as the runtime chooses
    (bamboo/state/copies.py): its writer (its owner in the first pipeline) and one
    node that is neither it nor a neighbour's owner there, so that no two neighbours'
    deaths take both: the first along the first pipeline after s + 1, then the other
    pipelines' nodes, one in another zone than the writer's first, and in a third
    zone (neither the writer's nor its replica holder's) when there is one."""
    pipe = config.pipelines[0]
    P = len(pipe)
    out: dict[int, set[str]] = {}
    for s in range(P):
        near = {pipe[(s + d) % P] for d in (-1, 0, 1)}
        ring = (pipe[(s + k) % P] for k in range(2, P))
        candidates = (n for n in chain(ring, chain.from_iterable(config.pipelines[1:])) if n not in near)
        out[s] = {pipe[s]} | set(_first_apart(candidates, zones, zones.get(pipe[s]), zones.get(pipe[(s - 1) % P])))
    return out


def _first_apart(candidates, zones: dict[str, str], own: str | None, previous: str | None) -> list[str]:
    """The first candidate in neither zone, else the first not in `own`, else the
    first: read lazily, as a fleet's nodes are many and the answer usually early."""
    away = first = None
    for n in candidates:
        first = n if first is None else first
        if zones.get(n) != own:
            if zones.get(n) != previous:
                return [n]
            away = n if away is None else away
    return [x for x in (away if away is not None else first,) if x is not None]


def lost_everywhere(depth: int, deaths: list[set[int]], stale: list[set[int]] | None = None) -> frozenset[int]:
    """Stages with no live copy in any pipeline: lost in each one (`deaths`: the
    stage positions that died in each pipeline; `stale`: those of them whose replica
    was a step behind, sim/windows.py)."""
    if not deaths:
        return frozenset()
    stale = stale or [set() for _ in deaths]
    if any(not dead and not behind for dead, behind in zip(deaths, stale)):
        return frozenset()  # a pipeline lost nothing: every stage lives there
    return frozenset.intersection(*(Layout.lost(depth, dead) | behind for dead, behind in zip(deaths, stale)))


def handover_seconds(profile, depth: int) -> float:
    """Moving one stage's state (weights and optimizer) to its new node."""
    if isinstance(profile, Profile):
        return profile.stage_state_bytes(depth) * 2 / NETWORK
    return profile.handover_ms / 1000
