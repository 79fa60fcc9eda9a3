"""How many standby nodes a spot job needs: sized from the bursts it has seen.

Spot capacity leaves in bursts (a zone's nodes within a minute), so the nodes a job
can lose before a replacement arrives are not a binomial of independent failures.
`BurstModel` fits what the job observed: bursts arrive at a rate (a Poisson
process, bursts per second of observation) and each takes a number of nodes drawn
from the sizes seen. The standby it asks for is the smallest k such that losing
more than k nodes within one acquisition delay has probability at most epsilon: a
compound Poisson tail, computed exactly by Panjer's recursion.

`binomial_standby` is the rule for independent hardware faults (ByteRobust's:
a quantile of a binomial over the fleet), kept as the baseline it is measured
against.
"""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class BurstModel:
    sizes: tuple[int, ...]   # nodes each observed burst took (one batch of simultaneous losses)
    elapsed: float           # seconds observed

    def __post_init__(self):
        if any(size < 1 for size in self.sizes):
            raise ValueError(f"a burst takes one node or more (got {min(self.sizes)})")

    def rate(self, window: float) -> float:
        """Bursts per second, over at least one `window` of observation (a burst
        seen in the first seconds is not a rate of one a second)."""
        return len(self.sizes) / max(self.elapsed, window) if window > 0 else 0.0

    def loss_distribution(self, window: float, limit: int, epsilon: float = 0.0) -> list[float]:
        """P(exactly s nodes lost within `window` seconds), s = 0..limit, or up to
        the first s whose tail beyond is within `epsilon` (the rest of the mass is
        beyond the last)."""
        mean = self.rate(window) * window
        out = [math.exp(-mean)]
        if not self.sizes or mean == 0:
            return out
        size_p = [0.0] * (max(self.sizes) + 1)
        for size in self.sizes:
            size_p[size] += 1 / len(self.sizes)
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
