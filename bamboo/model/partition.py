"""Split an ordered list of layers into P contiguous stages of balanced cost."""
from __future__ import annotations

from typing import Sequence


class PartitionError(ValueError):
    """The layers cannot be split as asked."""


def partition(costs: Sequence[float], stages: int) -> list[range]:
    """Contiguous ranges of layer indices, one per stage, minimising the largest
    stage cost (exact, by dynamic programming over split points)."""
    n = len(costs)
    if stages < 1:
        raise PartitionError(f"need at least one stage (got {stages})")
    if stages > n:
        raise PartitionError(f"--stages {stages} is more than the model's {n} layers")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))
    inf = float("inf")
    # best[k][i]: the smallest possible max-stage cost for the first i layers in k stages
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for k in range(1, stages + 1):
        for i in range(k, n - (stages - k) + 1):
            for j in range(k - 1, i):
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                if cost < best[k][i]:
                    best[k][i], cut[k][i] = cost, j
    bounds, i = [n], n
    for k in range(stages, 0, -1):
        i = cut[k][i]
        bounds.append(i)
    bounds.reverse()
    return [range(bounds[k], bounds[k + 1]) for k in range(stages)]
