"""Pass: with compute ahead, an order whose next iteration's first forwards fill this
one's tail.

With --compute-ahead stage 0's owner runs the next iteration's leading forwards on
a thread as soon as its own step is taken, and sends them once the boundary has
agreed (bamboo/runtime/ahead.py). With 1F1B's order that fills little: stage 0
begins with few forwards, and the last stage's tail (its last weight passes and
its step) is shorter than stage 0's (its last backward, its step, then the first
forward), so the last stage still waits for its first activation. Two knobs lengthen
both sides:

    extra   stage 0 (every stage but the last) warms up with `extra` more forwards
            than 1F1B's: one more microbatch's activations alive each;
    lag     each split backward's weight pass waits until `lag` more input passes
            have sent their gradients (early_grads.py: one), so the last `lag`
            weight passes make the tail: one more microbatch's graph held each.

Both are chosen on the cost model by the steady-state period: the iteration's time
when iterations run back to back, each node going on to its next stream as soon as
its own one ends (REPEATS iterations' makespan less REPEATS - 1's). The smallest
of each is kept among equal periods, and today's order (no extra, early_grads.py's
depth and lag) is the first candidate, so the pass never chooses worse by its own
estimate. The estimate leaves the agreement out: stage 0's sends wait for every node's
end of the iteration before, which with two stages gates nothing (the last stage asks
for its first activation after its own step). The math is unchanged: the same passes
for the same microbatches, in another order.
"""
from __future__ import annotations

from schedules.cost import CostModel
from schedules.early_grads import split_backwards, split_last
from schedules.ir import Instr
from schedules.layout import Layout
from schedules.lower import plain_streams
from schedules.options import BackwardSplit, ScheduleOptions
from schedules.timing.bubbles import makespan
from schedules.timing.engine import start_times

LAGS = (1, 2, 3, 4)  # weight passes held back, each a microbatch's graph kept longer
REPEATS = 3          # iterations run back to back to estimate the period


def period(streams: dict[int, list[Instr]], cost: CostModel) -> float:
    """The steady-state iteration time of `streams` run back to back (see above)."""
    def span(k: int) -> float:
        repeated = {n: s * k for n, s in streams.items()}
        return makespan(repeated, start_times(repeated, cost), cost)
    return span(REPEATS) - span(REPEATS - 1)


def overlapped_streams(layout: Layout, microbatches: int, options: ScheduleOptions,
                       cost: CostModel) -> dict[int, list[Instr]]:
    """The streams before FRC and late syncs, their order chosen for compute ahead:
    the candidate with the shortest period, the fewest extra forwards and the
    shortest lag among equals."""
    def plain(extra: int) -> dict[int, list[Instr]]:
        return plain_streams(layout, microbatches, options.order, cost, options.sync, extra)

    def split(streams: dict[int, list[Instr]], lag: int) -> dict[int, list[Instr]]:
        return {n: split_last(s, microbatches, lag) for n, s in streams.items()}

    splits = options.split is BackwardSplit.LAST
    first = plain(0)
    if splits:
        first = split_backwards(first, lambda s: makespan(s, start_times(s, cost), cost))
    best, best_time = first, period(first, cost)
    for extra in range(len(layout.groups()) + 1):
        streams = plain(extra)
        for candidate in ([split(streams, lag) for lag in LAGS] if splits else [streams]):
            time = period(candidate, cost)
            if time < best_time - 1e-9:
                best, best_time = candidate, time
    return best
