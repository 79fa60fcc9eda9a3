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

Both are chosen on the cost model by the steady-state `period`: the time from one
iteration's agreement to the next, where stage 0's owner began the iteration's
prefix (`prefix_ahead`: what the runtime runs ahead) as soon as its own stream of the
iteration before ended, and nothing it sends leaves before the agreement. The
smallest of each is kept among equal periods, and today's order (no extra,
early_grads.py's depth and lag) is the first candidate, so the pass never chooses
worse by its own estimate. The math is unchanged: the same passes for the same
microbatches, in another order.
"""
from __future__ import annotations

from schedules.cost import CostModel
from schedules.early_grads import split_last
from schedules.ir import Instr, Op
from schedules.layout import Layout
from schedules.lower import plain_streams
from schedules.options import BackwardSplit, ScheduleOptions
from schedules.timing.bubbles import makespan
from schedules.timing.fast import start_times

EXTRA = 4            # at most this many more forwards first, each a microbatch's activations alive
LAGS = (1, 2, 3, 4)  # weight passes held back, each a microbatch's graph kept longer
ROUNDS = 8           # iterations the period's estimate runs to settle

# What runs ahead: local compute whose inputs the agreement cannot change (the runtime's
# thread runs these), and the sends between them, posted once the agreement is in.
AHEAD_OPS = frozenset({Op.LOAD, Op.FORWARD})
POSTED_AFTER = frozenset({Op.SEND_ACT})


def leading_syncs(stream: list[Instr]) -> int:
    """How many late syncs (--replica-sync next) the stream begins with: the owner's
    sends of the iteration before's gradients, which the forwards after them do not
    read. They go once the agreement is in; what follows them may run ahead."""
    return next((i for i, ins in enumerate(stream) if ins.op is not Op.SEND_SYNC), len(stream))


def prefix_ahead(stream: list[Instr]) -> list[Instr]:
    """The stream's leading loads, forwards and their sends after its late syncs (not
    FRC's redundant forwards, whose saved tensors go to host memory): empty unless a
    forward is among them, which only a stream that begins at stage 0 has."""
    prefix = []
    for ins in stream[leading_syncs(stream):]:
        if ins.op not in AHEAD_OPS | POSTED_AFTER or ins.redundant:
            break
        prefix.append(ins)
    return prefix if any(i.op is Op.FORWARD for i in prefix) else []


def period(streams: dict[int, list[Instr]], cost: CostModel) -> float:
    """The steady-state iteration time of `streams` (see above): each round starts
    the nodes with a prefix as early as the round before left them free, up to the
    prefix's compute, and measures to the last node's end."""
    ahead = {n: sum(cost.duration(i) for i in prefix_ahead(s) if i.op in AHEAD_OPS) for n, s in streams.items()}
    ahead = {n: t for n, t in ahead.items() if t > 0}
    head, span = dict.fromkeys(ahead, 0.0), 0.0
    for _ in range(ROUNDS):
        starts = start_times(streams, cost, {n: -h for n, h in head.items()})
        span = makespan(streams, starts, cost)
        settled, head = head, {n: min(ahead[n], span - (starts[n][-1] + cost.duration(streams[n][-1]))) for n in ahead}
        if all(abs(head[n] - settled[n]) < 1e-9 for n in head):
            break
    return span


def overlapped_streams(layout: Layout, microbatches: int, options: ScheduleOptions, cost: CostModel,
                       first: dict[int, list[Instr]]) -> dict[int, list[Instr]]:
    """The streams before FRC and late syncs, their order chosen for compute ahead:
    of `first` (the order compiled without compute ahead) and the candidates above,
    the one with the shortest period, the fewest extra forwards and the shortest lag
    among equals."""
    splits = options.split is BackwardSplit.LAST
    best, best_time = first, period(first, cost)
    for extra in range(min(len(layout.groups()), EXTRA) + 1):
        streams = plain_streams(layout, microbatches, options.order, cost, options.sync, extra)
        candidates = [{n: split_last(s, microbatches, lag) for n, s in streams.items()} for lag in LAGS]
        for candidate in candidates if splits else [streams]:
            time = period(candidate, cost)
            if time < best_time - 1e-9:
                best, best_time = candidate, time
    return best
