"""How many standby nodes a spot job needs: sized from the bursts it has seen.

Spot capacity leaves in bursts (a zone's nodes within a minute), so the nodes a job
can lose before a replacement arrives are not a binomial of independent failures.
`BurstModel` fits what the job observed: bursts arrive at a rate (a Poisson
process, bursts per second of observation) and each takes a number of nodes drawn
from the sizes seen. The standby it asks for is the smallest k such that losing
more than k nodes within one acquisition delay has probability at most epsilon: a
compound Poisson tail, computed exactly by Panjer's recursion. Before the job has
seen a preemption it starts from auto's prior (a rate per node-hour, one node at a
time), which the bursts it sees then outweigh.

`binomial_standby` is the rule for independent hardware faults (ByteRobust's:
a quantile of a binomial over the fleet), kept as the baseline it is measured
against, beside a fixed count (SpotHedge's over-provisioning) and keeping every
node the cloud grants.

`standby_count` and `assign_surplus` are the one decision the agents and the
simulator share about the nodes beyond the pipelines: how many stay as warm
standby, and which; the rest are released. The burst rule's count is a ceiling:
the j-th standby is kept only while it earns its price, that is while the
throughput it saves (the samples/s a missing node costs, times the chance that
at least j nodes go within one acquisition) is at least what a paid node earns
on average. A node worth less than the average lowers the job's value per dollar.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable, Mapping

from bamboo.control.config import Surplus as SurplusRule  # burst, binomial, fixed, keep: the rules below


@dataclass(frozen=True)
class Roles:
    """The nodes in no pipeline, by role: kept warm, or given back to the cloud."""
    standby: tuple[str, ...] = ()
    release: tuple[str, ...] = ()


_CHECKED: list[tuple[int, ...]] = [()]  # the sizes last found valid (a tuple is immutable: checked once)


@dataclass(frozen=True)
class BurstModel:
    sizes: tuple[int, ...]   # nodes each observed burst took (one batch of simultaneous losses)
    elapsed: float           # seconds observed
    prior_bursts: float = 0.0   # single-node bursts assumed before any are seen ...
    prior_seconds: float = 0.0  # ... over this many seconds, as if observed

    def __post_init__(self):
        if self.sizes is _CHECKED[0]:
            return  # a job asks with the same bursts at every batch until the next one: a month is thousands long
        if self.sizes and min(self.sizes) < 1:
            raise ValueError(f"a burst takes one node or more (got {min(self.sizes)})")
        _CHECKED[0] = self.sizes

    @classmethod
    def seen(cls, sizes: tuple[int, ...], elapsed: float, nodes: int, prior_rate: float,
             prior_hours: float) -> BurstModel:
        """The bursts seen over `elapsed` seconds by a job of `nodes` nodes, with the
        prior auto also starts from: `prior_rate` deaths per node-hour (one node at a
        time, the cautious guess: nothing says bursts come) weighing as much as
        `prior_hours` node-hours of observation. Without it, a job that has seen no
        preemption yet would keep no standby."""
        return cls(sizes, elapsed, prior_rate * prior_hours, prior_hours * 3600 / max(1, nodes))

    def rate(self, window: float) -> float:
        """Bursts per second, over at least one `window` of observation (a burst
        seen in the first seconds is not a rate of one a second)."""
        bursts = len(self.sizes) + self.prior_bursts
        return bursts / max(self.elapsed + self.prior_seconds, window) if window > 0 else 0.0

    def nodes_per_second(self, window: float) -> float:
        """Nodes lost per second, over at least one `window`: the binomial baseline's
        rate, from the same observations."""
        return (sum(self.sizes) + self.prior_bursts) / max(self.elapsed + self.prior_seconds, window)

    def size_distribution(self) -> list[float]:
        """P(a burst takes j nodes), j = 0..the largest seen: the sizes seen, and the
        prior's bursts of one node."""
        return list(_size_distribution(self.sizes, self.prior_bursts))

    def loss_distribution(self, window: float, limit: int, epsilon: float = 0.0) -> list[float]:
        """P(exactly s nodes lost within `window` seconds), s = 0..limit, or up to
        the first s whose tail beyond is within `epsilon` (the rest of the mass is
        beyond the last)."""
        mean = self.rate(window) * window
        out = [math.exp(-mean)]
        if mean == 0:
            return out
        size_p = self.size_distribution()
        total = out[0]
        for s in range(1, limit + 1):  # Panjer: f(s) = (mean / s) * sum_j j p(j) f(s - j)
            if epsilon > 0 and 1 - total <= epsilon:
                break
            out.append(mean / s * sum(j * size_p[j] * out[s - j] for j in range(1, min(s, len(size_p) - 1) + 1)))
            total += out[-1]
        return out

    def standby(self, window: float, epsilon: float, limit: int) -> int:
        """The smallest k (at most `limit`) with P(more than k nodes lost within
        `window` seconds) <= `epsilon`."""
        return min(limit, _smallest_covering(self.loss_distribution(window, limit, epsilon), epsilon))


@lru_cache(maxsize=4)
def _size_distribution(sizes: tuple[int, ...], prior_bursts: float) -> tuple[float, ...]:
    """`BurstModel.size_distribution`, kept: a job asks it of the same bursts at every
    batch of events until the next burst, and a month of them is thousands long."""
    weights = [0.0] * (max(sizes, default=1) + 1)
    weights[1] += prior_bursts
    for size in sizes:
        weights[size] += 1
    total = sum(weights)
    return tuple(w / total for w in weights) if total else tuple(weights)


def binomial_standby(nodes: int, rate_per_node: float, window: float, epsilon: float) -> int:
    """The smallest k with P(more than k of `nodes` lost within `window` seconds)
    <= `epsilon`, each node lost independently at `rate_per_node` per second."""
    p = 1 - math.exp(-rate_per_node * window)
    if p <= 0 or p >= 1:
        return 0 if p <= 0 else nodes
    log = lambda k: (math.lgamma(nodes + 1) - math.lgamma(k + 1) - math.lgamma(nodes - k + 1)  # noqa: E731
                     + k * math.log(p) + (nodes - k) * math.log1p(-p))
    return _smallest_covering([math.exp(log(k)) for k in range(nodes + 1)], epsilon)


def _smallest_covering(mass: list[float], epsilon: float) -> int:
    total = 0.0
    for k, p in enumerate(mass):
        total += p
        if 1 - total <= epsilon:
            return k
    return len(mass) - 1


class Economics:
    """What the burst rule weighs a standby by, in samples per second: the job's
    throughput with its first j trainers gone, in the order a burst takes them
    (`throughput(j)`, asked for lazily and once each), over the nodes it pays for."""

    def __init__(self, throughput: Callable[[int], float], paid: int):
        self._throughput, self.paid = throughput, max(1, paid)
        self._seen: dict[int, float] = {}

    def throughput(self, gone: int) -> float:
        if gone not in self._seen:
            self._seen[gone] = self._throughput(gone)
        return self._seen[gone]

    @property
    def earned_per_node(self) -> float:
        """The samples/s a paid node earns on average."""
        return self.throughput(0) / self.paid

    def loss(self, j: int) -> float:
        """What the j-th node missing from the pipelines costs (j from 1) until its
        replacement comes: a burst's later losses often fall in a pipeline already broken."""
        return max(0.0, self.throughput(j - 1) - self.throughput(j))


def standby_count(rule: SurplusRule, bursts: BurstModel, window: float, epsilon: float, trainers: int,
                  limit: int, economics: Economics | None = None, fixed: int = 0) -> int:
    """How many of `limit` surplus nodes to keep as standby under `rule`, for
    `trainers` nodes in pipelines and replacements `window` seconds away."""
    if rule == SurplusRule.KEEP:
        return limit
    if rule == SurplusRule.FIXED:
        return min(fixed, limit)
    if window <= 0:
        return 0  # a replacement comes at once: no standby is needed
    if rule == SurplusRule.BINOMIAL:
        rate = bursts.nodes_per_second(window) / max(1, trainers)  # nodes lost per node-second
        return min(limit, binomial_standby(trainers, rate, window, epsilon))
    ceiling = bursts.standby(window, epsilon, limit)
    if economics is None or ceiling == 0:
        return ceiling
    tail = 1.0  # P(at least j nodes lost within the window)
    for j, p in enumerate(bursts.loss_distribution(window, ceiling), start=1):
        tail -= p
        if tail * economics.loss(j) < economics.earned_per_node:
            return j - 1
    return ceiling


def burst_order(trainers: Mapping[str, str]) -> list[str]:
    """The `trainers` (node -> zone) in the order a burst takes them: the zone with
    the most of them first (spot capacity leaves a zone at a time)."""
    runs: dict[str, list[str]] = {}  # each zone's trainers by name: the zone's count is its run's length
    for n in sorted(trainers):
        runs.setdefault(trainers[n], []).append(n)
    return [n for zone in sorted(runs, key=lambda z: (-len(runs[z]), z)) for n in runs[zone]]


def assign_surplus(idle: Mapping[str, str], trainers: Mapping[str, str], standby: int) -> Roles:
    """Which of the `idle` nodes (node -> zone) stay as the `standby`: those in the
    zones with the fewest `trainers` (node -> zone) first, so that a burst that
    takes a zone's trainers leaves the standby that replaces them; the rest go.
    The simulator picks the free nodes an acquisition brings the same way."""
    load = {zone: 0 for zone in idle.values()}
    for zone in trainers.values():
        if zone in load:
            load[zone] += 1
    queues: dict[str, list[str]] = {}  # each zone's nodes, the first by name last (taken first)
    for n in sorted(idle, reverse=True):
        queues.setdefault(idle[n], []).append(n)
    kept: list[str] = []
    while queues and len(kept) < standby:
        zone = min(queues, key=lambda z: (load[z], z))  # a zone's first node is the best of it
        kept.append(queues[zone].pop())
        if not queues[zone]:
            del queues[zone]
        load[zone] += 1  # the next standby goes where fewest are, counting this one
    chosen = set(kept)
    return Roles(standby=tuple(kept), release=tuple(n for n in sorted(idle) if n not in chosen))
