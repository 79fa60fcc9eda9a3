"""The reconfiguration policy: one pure function from the live nodes (with their
zones), the previous configuration and the target depth to the next configuration.

Rules, in priority order:
  1. Keep the depth P; as many full pipelines as live nodes // P, but never more
     pipelines than there are microbatches to share (a pipeline with none would
     have nothing to run). With `max_stages` 2 (--max-stages-per-node), the nodes
     left over form a pipeline shorter than P, each on a contiguous range of at
     most two stages (`pipelines[j]` names the node of every stage, so such a node
     appears twice), or, too few for one, join a full pipeline's nodes in two
     short ones; each only where an estimate of the iteration finds it no slower
     and, when the nodes no pipeline uses are released (`per_node`), only where
     it trains as many samples per node as without it.
     Only when too few nodes are left for one pipeline is the depth reduced (to
     all of them), and the configuration says so.
  2. Move as little as possible: a surviving node keeps its (pipeline, stage);
     pipelines with the most survivors are the ones kept. With short pipelines, a
     change that no death forces is made only for a 5% faster iteration.
  3. Holes left by dead nodes are filled first from the standby queue (oldest
     first), then from newcomers, then from the nodes of dissolved pipelines, then
     from short pipelines.
  4. Nodes left over form new pipelines while P of them remain; the rest wait in
     the standby queue.
  5. Neighbouring stages (cyclically: node P-1 keeps stage 0's replica) sit in
     different zones whenever the zones allow: new pipelines are dealt zones
     evenly and arranged so, and a hole takes a node from a zone unlike its
     neighbours' when one is available. Unless bytes between zones cost more than
     that spread saves (`Priced.pack_zones`, agents/spread.py): then each new
     pipeline takes the nodes of as few zones as it can, the pipelines in
     different zones, and a hole takes a node of its neighbours' zone.
  6. Before zones, hosts (`hosts`: node -> machine, for machines of several
     workers): no host holds neighbouring stages of a pipeline whenever the
     hosts allow it (agents/placement.py); where they cannot, the fewest such
     pairs, and never a failure. A survivor keeps its stage even beside a node of
     its host (rule 2).
The simulator imports this same function.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from itertools import chain
from typing import Callable, Mapping

from agents.placement import cap, choose, fill_holes, host_of, spread_order
from schedules.split import estimated_slots, split_by_speed

Estimate = Callable[[list[tuple]], float]  # pipelines (each: the node of every stage) -> one iteration's time

MAX_STAGES = 2  # a node holds at most its stage and one more (the memory eager needs for a replica)
MIN_GAIN = 0.05  # with short pipelines, a reconfiguration no death forces must make iterations this much faster


@dataclass(frozen=True)
class Priced:
    """What the job pays for, as the policy weighs it."""
    per_node: bool = False    # the nodes no pipeline uses are released: a short pipeline must train as much per node
    pack_zones: bool = False  # bytes between zones cost more than spreading saves: a pipeline in as few zones as it can


@dataclass(frozen=True)
class Config:
    epoch: int
    depth: int
    pipelines: tuple[tuple[str, ...], ...] = ()   # pipeline j: node of each stage
    standby: tuple[str, ...] = ()                # waiting, oldest first
    notes: tuple[str, ...] = field(default=(), compare=False)

    def slots(self) -> dict[str, tuple[int, int]]:
        """node -> (pipeline, its first stage)."""
        out: dict[str, tuple[int, int]] = {}
        for j, pipe in enumerate(self.pipelines):
            for s, n in enumerate(pipe):
                out.setdefault(n, (j, s))
        return out

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


def arrange(nodes: list[str], zones: Mapping[str, str], hosts: Mapping[str, str] | None = None) -> tuple[str, ...]:
    """Order nodes on a cycle with as few same-zone neighbours as possible and no
    same-host ones where the hosts allow: the most common zone (inside it, host)
    takes every other slot, then the next ones continue."""
    ordered = spread_order(nodes, zones, hosts)
    slots = list(range(0, len(nodes), 2)) + list(range(1, len(nodes), 2))
    out = [""] * len(nodes)
    for slot, node in zip(slots, ordered):
        out[slot] = node
    return tuple(out)


def _deal(nodes: list[str], zones: Mapping[str, str], count: int, hosts: Mapping[str, str] | None) -> list[list[str]]:
    """Split nodes into `count` equal groups, each zone, and each host, spread evenly over them."""
    if hosts:
        by_zone = sorted(nodes, key=lambda n: (zones[n], host_of(hosts, n), n))
    else:  # by name, then (stable) by zone: the same order, sorted in C
        by_zone = sorted(sorted(nodes), key=zones.__getitem__)
    return [by_zone[i::count] for i in range(count)]  # node i to group i mod count


class Spread:
    """New pipelines with their zones spread: each zone dealt evenly over them, and
    no two neighbours in one zone where the zones allow (rule 5)."""

    def __init__(self, zones: Mapping[str, str], hosts: Mapping[str, str] | None):
        self.zones, self.hosts = zones, hosts

    def choose(self, candidates: list[str], k: int, most: int) -> list[str]:
        return choose(candidates, k, self.zones, self.hosts, most)

    def deal(self, nodes: list[str], count: int) -> list[list[str]]:
        return _deal(nodes, self.zones, count, self.hosts)

    def arrange(self, nodes: list[str]) -> tuple[str, ...]:
        return arrange(nodes, self.zones, self.hosts)


class Packed(Spread):
    """New pipelines packed in zones: the nodes of the zones with the most spares
    first, each pipeline cut from them in zone order (so in as few zones as it can),
    arranged zone by zone with its hosts apart."""

    def __init__(self, zones: Mapping[str, str], hosts: Mapping[str, str] | None, depth: int):
        super().__init__(zones, hosts)
        self.depth = depth

    def _zone_major(self, nodes: list[str]) -> list[str]:
        size: dict[str, int] = {}
        for n in nodes:
            size[self.zones[n]] = size.get(self.zones[n], 0) + 1
        return sorted(nodes, key=lambda n: (-size[self.zones[n]], self.zones[n]))  # stable: queue order in a zone

    def _runs(self, nodes: list[str]) -> list[list[str]]:
        """`nodes` by zone, the largest zone first, each in queue order."""
        runs: dict[str, list[str]] = {}
        for n in self._zone_major(nodes):
            runs.setdefault(self.zones[n], []).append(n)
        return list(runs.values())

    def choose(self, candidates: list[str], k: int, most: int) -> list[str]:
        """Whole pipelines of one zone first (the largest zones'), then the rest in zone order."""
        whole = [n for run in self._runs(candidates) for n in run[:len(run) - len(run) % self.depth]]
        taken = set(whole)
        first = whole + [n for n in self._zone_major(candidates) if n not in taken]
        return choose(first, k, dict.fromkeys(candidates, ""), self.hosts, most)

    def deal(self, nodes: list[str], count: int) -> list[list[str]]:
        ordered, size = self._zone_major(nodes), len(nodes) // count
        return [ordered[i * size:(i + 1) * size] for i in range(count)]

    def arrange(self, nodes: list[str]) -> tuple[str, ...]:
        one = dict.fromkeys(nodes, "")  # inside a zone only the hosts are kept apart
        return tuple(n for run in self._runs(nodes) for n in arrange(run, one, self.hosts))


def nodes_for_a_pipeline(depth: int, max_stages: int = 1) -> int:
    """The fewest live nodes that make a pipeline of `depth` stages, at most `max_stages` per node
    (fewer make one only by reducing the depth): what the first configuration waits for."""
    return -(-depth // max_stages)


def pipeline_lengths(nodes: int, depth: int, max_stages: int, most: int | None, merge: bool = True,
                     iteration: Estimate | None = None, per_node: bool = False) -> list[int]:
    """How many nodes each pipeline has (full ones first): as many full pipelines of
    `depth` as fit, and the nodes left over either wait in standby, or form one
    shorter pipeline when they can hold every stage at `max_stages` per node, or,
    when they are too few and `merge` allows, join the last full pipeline's nodes in
    two short ones. Of these the one that uses the most nodes, unless the `iteration`
    estimate finds it more than 1% slower, or, with `per_node` (the nodes left over
    are released, not kept), unless it trains fewer samples per node: a node that
    earns less than the others lowers the job's value per dollar. Never more than
    `most` pipelines: each needs a microbatch."""
    full, rest = divmod(nodes, depth)
    shortest = nodes_for_a_pipeline(depth, max_stages)
    choices = [[depth] * full]
    if rest and max_stages > 1:
        if rest >= shortest:
            choices.append([depth] * full + [rest])
        elif full and merge:
            choices.append([depth] * (full - 1) + [(depth + rest + 1) // 2, (depth + rest) // 2])
    choices = [c for c in choices if c and (most is None or len(c) <= most)] or [choices[0][:most]]
    if iteration is None:
        return choices[-1]
    best = choices[0]
    for lengths in choices[1:]:
        seconds, best_seconds = (iteration(list(shapes_of(tuple(c), depth))) for c in (lengths, best))
        if seconds <= 1.01 * best_seconds and (not per_node or seconds * sum(lengths) <= best_seconds * sum(best)):
            best = lengths
    return best


@lru_cache(maxsize=256)
def shapes_of(lengths: tuple[int, ...], depth: int) -> tuple[tuple[int, ...], ...]:
    """Pipelines of `lengths` nodes (named 0, 1, ...) laid out on `depth` stages: what
    an estimate weighs, kept (a thousand nodes ask for the same few lists at every call)."""
    return tuple(lay_out(tuple(range(n)), depth) for n in lengths)


def slot_estimate(microbatches: int) -> Estimate:
    """The compiler-free estimate of an iteration (schedules/split.py), in stage slots."""
    def iteration(pipelines: list[tuple]) -> float:
        shares = split_by_speed(microbatches, pipelines)
        return max(estimated_slots(p, len(m)) for p, m in zip(pipelines, shares))
    return iteration


def lay_out(nodes: tuple[str, ...], depth: int) -> tuple[str, ...]:
    """A pipeline's node of each stage: `nodes` in order, each on a contiguous range of
    stages, the first ones a stage longer when the stages do not divide evenly."""
    base, extra = divmod(depth, len(nodes))
    return tuple(n for i, n in enumerate(nodes) for _ in range(base + (i < extra)))


def next_config(live: Mapping[str, str], previous: Config | None, depth: int,
                max_pipelines: int | None = None, max_stages: int = 1, iteration: Estimate | None = None,
                hosts: Mapping[str, str] | None = None, priced: Priced = Priced()) -> Config:
    """`live`: node -> zone. `previous`: the configuration in force (None at start).
    `hosts`: node -> host, for nodes that share a machine (default: each its own).
    `max_pipelines`: at most this many pipelines (the global microbatch count).
    `max_stages`: the most stages one node may hold (above 1, short pipelines, formed
    where `iteration` estimates them faster: by default, the stage-slot estimate of
    the `max_pipelines` microbatches, and with `priced.per_node`, where they also train
    as many samples per node). `priced.pack_zones`: pipelines packed in zones (rule 5)."""
    if depth < 1:
        raise ValueError(f"depth must be at least 1 (got {depth})")
    if not 1 <= max_stages <= MAX_STAGES:
        raise ValueError(f"--max-stages-per-node must be 1 or 2 (got {max_stages})")
    epoch = previous.epoch + 1 if previous else 0
    notes: list[str] = []
    P = depth
    if len(live) < nodes_for_a_pipeline(depth, max_stages):
        P = len(live)
        notes.append(f"depth reduced from {depth} to {P}: only {P} nodes are alive")
    if P == 0:
        return Config(epoch, 0, (), (), tuple(notes))
    if iteration is None and max_pipelines is not None:
        iteration = slot_estimate(max_pipelines)
    plan = _plan(live, previous, Config(epoch, P, notes=tuple(notes)), max_stages if P == depth else 1,
                 max_pipelines, (iteration, priced), hosts)
    stay = _unchanged(previous, live, epoch, P) if max_stages > 1 and iteration and P == depth else None
    if stay and plan.pipelines != stay.pipelines and iteration(list(plan.pipelines)) > (
            1 - MIN_GAIN) * iteration(list(stay.pipelines)):
        return stay  # no node died in a pipeline, and the new plan is not worth a reconfiguration
    return plan


def _unchanged(previous: Config | None, live: Mapping[str, str], epoch: int, depth: int) -> Config | None:
    """The previous pipelines as they were, the other live nodes in standby; None
    when a node of them died or they ran another depth."""
    if not previous or not previous.pipelines or previous.depth != depth or not all(
            map(live.__contains__, chain.from_iterable(previous.pipelines))):
        return None
    placed = set(chain.from_iterable(previous.pipelines))
    waiting = set(previous.standby)
    standby = [n for n in previous.standby if n in live] + sorted(live.keys() - placed - waiting)
    return Config(epoch, previous.depth, previous.pipelines, tuple(standby))


def _plan(live: Mapping[str, str], previous: Config | None, base: Config, max_stages: int,
          max_pipelines: int | None, weigh: tuple[Estimate | None, Priced], hosts: Mapping[str, str] | None) -> Config:
    """The pipelines `live` forms at `base`'s depth, moving as few nodes as rules 2 to 5
    allow; `weigh`: the estimate and what is priced (short pipelines earning per node, zones packed)."""
    P = base.depth
    iteration, priced = weigh
    place = Packed(live, hosts, P) if priced.pack_zones else Spread(live, hosts)
    # a full pipeline that lost nodes is mended (from a short pipeline if need be) before two short ones replace it
    alive = live.__contains__
    mend = bool(previous) and previous.depth == P and not all(map(alive, chain.from_iterable(previous.pipelines))) \
        and any(len(set(p)) == P and not all(map(alive, p)) for p in previous.pipelines)
    lengths = pipeline_lengths(len(live), P, max_stages, max_pipelines, not mend, iteration, priced.per_node)
    notes = list(base.notes)
    kept: list[list[str | None]] = []
    leftover: list[str] = []
    if previous and previous.depth == P:
        kept, leftover = _survivors(previous, live, lengths)
    elif previous:
        # depth changed: keep the survivors' previous order, re-cut into new pipelines
        leftover = list(dict.fromkeys(n for pipe in previous.pipelines for n in pipe if n in live))
        notes.append(f"depth changed from {previous.depth} to {P}: pipelines re-formed")
    placed = set(chain.from_iterable(kept))
    placed.discard(None)
    standby = [n for n in (previous.standby if previous else ()) if n in live and n not in placed]
    waiting, freed = set(standby), set(leftover)
    newcomers = sorted(live.keys() - placed - waiting - freed)
    spares = standby + newcomers + [n for n in leftover if n not in waiting]
    pipelines = _fill_holes(kept, spares, live, hosts, priced.pack_zones)
    # New pipelines from what is left: as many zones as possible, dealt evenly, arranged.
    short = [n for n in lengths if n < P]
    sizes = [len(set(pipe)) for pipe in pipelines]
    for size in sizes:
        if size in short:
            short.remove(size)
    new_count = min(len(lengths) - len(short) - sizes.count(P), len(spares) // P)
    if new_count > 0:
        chosen = place.choose(spares, new_count * P, cap(P, new_count))
        spares = _without(spares, chosen)
        pipelines += [place.arrange(group) for group in place.deal(chosen, new_count)]
    for length in short:
        if len(spares) >= length:
            chosen = place.choose(spares, length, cap(length, 1))
            spares = _without(spares, chosen)
            pipelines.append(lay_out(place.arrange(chosen), P))
    return Config(base.epoch, P, tuple(pipelines), tuple(spares), tuple(notes))


def _without(nodes: list[str], taken: list[str]) -> list[str]:
    """`nodes` less `taken`, in order (a set: at a thousand nodes a list's lookups add up)."""
    gone = set(taken)
    return [n for n in nodes if n not in gone]


def _survivors(previous: Config, live: Mapping[str, str], lengths: list[int]):
    """Of the previous pipelines, in their order: each one kept, as it was (every
    node alive and a pipeline of its length still wanted) or with holes (None) to
    fill (a full one, most survivors first, ties: lowest index); and the nodes of
    the rest in order, those of short pipelines last (taken last to fill a hole)."""
    wanted = list(lengths)
    alive = live.__contains__
    sizes = [len(set(pipe)) for pipe in previous.pipelines]
    intact = set()
    for j, pipe in enumerate(previous.pipelines):
        if sizes[j] in wanted and all(map(alive, pipe)):
            wanted.remove(sizes[j])
            intact.add(j)
    damaged = [j for j, size in enumerate(sizes) if j not in intact and size == previous.depth]
    ranked = sorted(damaged, key=lambda j: (-sum(map(alive, previous.pipelines[j])), j))
    repair = {j for j in ranked[:wanted.count(previous.depth)] if any(map(alive, previous.pipelines[j]))}
    kept: list[list[str | None]] = []
    leftover: list[str] = []
    for j, pipe in enumerate(previous.pipelines):
        if j in intact:
            kept.append(list(pipe))  # every node of it live
        elif j in repair:
            kept.append([n if n in live else None for n in pipe])
        else:
            leftover += [n for n in dict.fromkeys(pipe) if n in live]
    short = {n for pipe, size in zip(previous.pipelines, sizes) if size < len(pipe) for n in pipe}
    return kept, [n for n in leftover if n not in short] + [n for n in leftover if n in short]


def _fill_holes(partial: list[list[str | None]], spares: list[str], live: Mapping[str, str],
                hosts: Mapping[str, str] | None, pack: bool) -> list[tuple[str, ...]]:
    """Fill holes (agents/placement.py: zones unlike the neighbours', or with `pack`
    like them; hosts apart); a pipeline that cannot be completed dissolves (its
    nodes go back to `spares`)."""
    fill_holes(partial, spares, live, hosts, pack)
    spares[:0] = [n for p in partial if not all(p) for n in p if n]
    return [tuple(p) for p in partial if all(p)]


def moves(previous: Config | None, config: Config) -> list[tuple[str, int]]:
    """(node, stage) for every node that must load a stage it did not run before
    the next epoch starts (a pipeline renumbered moves no layers)."""
    before = {(n, s) for pipe in previous.pipelines for s, n in enumerate(pipe)} if previous else set()
    return sorted({(n, s) for pipe in config.pipelines for s, n in enumerate(pipe)} - before)
