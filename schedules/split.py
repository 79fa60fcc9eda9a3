"""The global microbatches over pipelines of unequal length.

A short pipeline (fewer nodes than stages) has nodes that run two consecutive
stages, so it is slower. Each pipeline is given a count of the M global
microbatches in proportion to its speed, so that all finish together, and runs
exactly the microbatch ids it is given: the samples and the averaged gradient
are the same whatever the split.

The speed comes from a 1F1B estimate in units of one stage's forward and
backward: m microbatches through a pipeline whose busiest node runs k stages take
about (m - 1) * k + P, the fill and drain through all P stages plus one slot of
the busiest node per further microbatch.
"""
from __future__ import annotations

import heapq
from typing import Callable, Hashable, Sequence

from schedules.layout import ScheduleError


def merged(pipeline: Sequence[Hashable]) -> frozenset[int]:
    """The stages a pipeline's node runs after its first one: `pipeline[s]` is the
    node of stage s, and a node on a range of stages appears at each of them. The
    compiler runs such a pipeline as one whose node s failed and was merged into
    its predecessor."""
    return frozenset(s for s in range(1, len(pipeline)) if pipeline[s] == pipeline[s - 1])


def busiest(pipeline: Sequence[Hashable]) -> int:
    """The most stages one node of the pipeline runs."""
    counts: dict = {}
    for node in pipeline:
        counts[node] = counts.get(node, 0) + 1
    return max(counts.values())


def estimated_slots(pipeline: Sequence[Hashable], microbatches: int) -> int:
    """One iteration of `microbatches` in stage-slots (module docstring)."""
    return (microbatches - 1) * busiest(pipeline) + len(pipeline) if microbatches else 0


def split_by_speed(total: int, pipelines: Sequence[Sequence[Hashable]],
                   duration: Callable[[Sequence[Hashable], int], float] = estimated_slots) -> list[range]:
    """Global microbatch ids of each pipeline, in order: every pipeline at least one,
    each further one to the pipeline that would finish it first (ties: the lowest
    index). `duration(pipeline, microbatches)`: the estimate above, or a cost
    model's (a pipeline may then be whatever that duration reads of it). Equal
    pipelines get an even split, the first ones one more."""
    if len(pipelines) > total:
        raise ScheduleError(f"{len(pipelines)} pipelines cannot share {total} microbatches: each needs one")
    counts = [1] * len(pipelines)
    # each pipeline's time with one more, smallest first: only the one that takes it changes
    heap = [(duration(p, 2), j) for j, p in enumerate(pipelines)]
    heapq.heapify(heap)
    for _ in range(total - len(pipelines)):
        j = heapq.heappop(heap)[1]
        counts[j] += 1
        heapq.heappush(heap, (duration(pipelines[j], counts[j] + 1), j))
    out, start = [], 0
    for n in counts:
        out.append(range(start, start + n))
        start += n
    return out
