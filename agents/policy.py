"""The reconfiguration policy: one pure function from the live nodes (with their
zones), the previous configuration and the target depth to the next configuration.

Rules, in priority order:
  1. Keep the depth P; D = live nodes // P, but never more pipelines than there
     are microbatches to share (a pipeline with none would have nothing to run).
     Only when fewer than P nodes are left is the depth reduced (to all of them),
     and the configuration says so.
  2. Move as little as possible: a surviving node keeps its (pipeline, stage);
     pipelines with the most survivors are the ones kept.
  3. Holes left by dead nodes are filled first from the standby queue (oldest
     first), then from newcomers, then from the nodes of dissolved pipelines.
  4. Nodes left over form new pipelines while P of them remain; the rest wait in
     the standby queue.
  5. Neighbouring stages (cyclically: node P-1 keeps stage 0's replica) sit in
     different zones whenever the zones allow: new pipelines are dealt zones
     evenly and arranged so, and a hole takes a node from a zone unlike its
     neighbours' when one is available.
The simulator imports this same function.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping


@dataclass(frozen=True)
class Config:
    epoch: int
    depth: int
    pipelines: tuple[tuple[str, ...], ...] = ()   # pipeline j: node of each stage
    standby: tuple[str, ...] = ()                # waiting, oldest first
    notes: tuple[str, ...] = field(default=(), compare=False)

    def slots(self) -> dict[str, tuple[int, int]]:
        """node -> (pipeline, stage)."""
        return {n: (j, s) for j, pipe in enumerate(self.pipelines) for s, n in enumerate(pipe)}

    def to_dict(self) -> dict:
        return {"epoch": self.epoch, "depth": self.depth, "pipelines": [list(p) for p in self.pipelines],
                "standby": list(self.standby), "notes": list(self.notes)}

    @classmethod
    def from_dict(cls, d: dict) -> "Config":
        return cls(d["epoch"], d["depth"], tuple(tuple(p) for p in d["pipelines"]), tuple(d["standby"]),
                   tuple(d.get("notes", ())))


def zone_conflicts(pipeline: tuple[str, ...], zones: Mapping[str, str]) -> int:
    """Neighbouring stage pairs (cyclic) whose nodes share a zone."""
    n = len(pipeline)
    if n < 2:
        return 0
    return sum(zones[pipeline[i]] == zones[pipeline[(i + 1) % n]] for i in range(n))


def arrange(nodes: list[str], zones: Mapping[str, str]) -> tuple[str, ...]:
    """Order nodes on a cycle with as few same-zone neighbours as possible: the
    most common zone takes every other slot, then the next zones continue."""
    by_zone: dict[str, list[str]] = {}
    for n in sorted(nodes):
        by_zone.setdefault(zones[n], []).append(n)
    ordered = [n for _, group in sorted(by_zone.items(), key=lambda kv: (-len(kv[1]), kv[0])) for n in group]
    slots = list(range(0, len(nodes), 2)) + list(range(1, len(nodes), 2))
    out = [""] * len(nodes)
    for slot, node in zip(slots, ordered):
        out[slot] = node
    return tuple(out)


def _deal(nodes: list[str], zones: Mapping[str, str], count: int) -> list[list[str]]:
    """Split nodes into `count` equal groups, each zone spread evenly over them."""
    by_zone = sorted(nodes, key=lambda n: (zones[n], n))
    groups: list[list[str]] = [[] for _ in range(count)]
    for i, n in enumerate(by_zone):
        groups[i % count].append(n)
    return groups


def _choose(candidates: list[str], k: int, zones: Mapping[str, str]) -> list[str]:
    """k candidates taken round-robin over zones (each zone's queue in order), so
    the new pipelines get as many zones as the spares offer."""
    queues: dict[str, list[str]] = {}
    for n in candidates:
        queues.setdefault(zones[n], []).append(n)
    order = sorted(queues, key=lambda z: (-len(queues[z]), z))
    out: list[str] = []
    while len(out) < k:
        for z in order:
            if queues[z] and len(out) < k:
                out.append(queues[z].pop(0))
    return out


def _pick(candidates: list[str], avoid: set[str], zones: Mapping[str, str]) -> str:
    """The first candidate whose zone is not in `avoid`, else the first."""
    return next((n for n in candidates if zones[n] not in avoid), candidates[0])


def next_config(live: Mapping[str, str], previous: Config | None, depth: int,
                max_pipelines: int | None = None) -> Config:
    """`live`: node -> zone. `previous`: the configuration in force (None at start).
    `max_pipelines`: at most this many pipelines (the global microbatch count)."""
    if depth < 1:
        raise ValueError(f"depth must be at least 1 (got {depth})")
    epoch = previous.epoch + 1 if previous else 0
    notes: list[str] = []
    P = depth
    if len(live) < depth:
        P = len(live)
        notes.append(f"depth reduced from {depth} to {P}: only {P} nodes are alive")
    if P == 0:
        return Config(epoch, 0, (), (), tuple(notes))
    D = len(live) // P if max_pipelines is None else min(len(live) // P, max_pipelines)

    # Surviving pipelines, most survivors first (ties: lowest index), when the depth holds.
    kept: list[list[str | None]] = []
    spares_dissolved: list[str] = []
    if previous and previous.depth == P:
        ranked = sorted(range(len(previous.pipelines)),
                        key=lambda j: (-sum(n in live for n in previous.pipelines[j]), j))
        keep = sorted(j for j in ranked[:D] if any(n in live for n in previous.pipelines[j]))
        for j, pipe in enumerate(previous.pipelines):
            alive = [n if n in live else None for n in pipe]
            if j in keep:
                kept.append(alive)
            else:
                spares_dissolved += [n for n in alive if n]
    elif previous:
        # depth changed: keep the survivors' previous order, re-cut into new pipelines
        order = [n for pipe in previous.pipelines for n in pipe if n in live]
        spares_dissolved = order
        notes.append(f"depth changed from {previous.depth} to {P}: pipelines re-formed")

    placed = {n for pipe in kept for n in pipe if n}
    standby = [n for n in (previous.standby if previous else ()) if n in live and n not in placed]
    newcomers = sorted(n for n in live if n not in placed and n not in standby and n not in spares_dissolved)
    spares = standby + newcomers + [n for n in spares_dissolved if n not in standby]

    # Fill holes in stage order, each with a node from a zone unlike its neighbours'.
    for pipe in kept:
        for s, n in enumerate(pipe):
            if n is None and spares:
                avoid = {live[x] for x in (pipe[(s - 1) % P], pipe[(s + 1) % P]) if x}
                choice = _pick(spares, avoid, live)
                spares.remove(choice)
                pipe[s] = choice
    pipelines = [tuple(p) for p in kept if all(p)]
    broken = [n for p in kept if not all(p) for n in p if n]
    spares = broken + spares  # a kept pipeline that could not be completed dissolves

    # New pipelines from what is left: as many zones as possible, dealt evenly, arranged.
    new_count = min(D - len(pipelines), len(spares) // P)
    if new_count > 0:
        chosen = _choose(spares, new_count * P, live)
        spares = [n for n in spares if n not in chosen]
        pipelines += [arrange(group, live) for group in _deal(chosen, live, new_count)]
    return Config(epoch, P, tuple(pipelines), tuple(spares), tuple(notes))


def moves(previous: Config | None, config: Config) -> list[tuple[str, int]]:
    """(node, stage) for every node that must load a stage it did not run before
    the next epoch starts (a pipeline renumbered moves no layers)."""
    before = {n: s for n, (_, s) in previous.slots().items()} if previous else {}
    return sorted((n, s) for n, (_, s) in config.slots().items() if before.get(n) != s)
