"""Pass: a node's last backwards send their input gradients before computing weights.

In 1F1B's drain every stage waits for its successor's last gradients, and the
successor computes each in one backward with its own weights' gradients, which
nobody upstream needs. Split, a backward computes the input gradient first
(BACKWARD_INPUT), the gradient goes out (SEND_GRAD), and the weights follow
(BACKWARD_WEIGHT) at the end of the node's work, before its tail (reduce, step,
sync), while the predecessors run their own backwards. This is zero-bubble
pipelining's split (Qi et al., 2024), for the backwards whose weights fit the
drain: with P=2 and weights half a backward, the last stage's last two.

How many of each node's last backwards are split (`depth`, the same on every
node) is chosen on the cost model: the depth with the shortest simulated
iteration, the smallest among equals, up to MAX_DEPTH. Each split backward keeps
its microbatch's graph until its weight pass, one more microbatch's activations
held. A node whose last backward does not end in a send, or is followed by more
than the tail, keeps whole backwards. The math is unchanged: the same gradients
from the same autograd functions (tests/test_early_grads.py).
"""
from __future__ import annotations

from typing import Callable

from schedules import ir
from schedules.ir import Instr, Op
from schedules.lower import is_tail

SPLITS = ("last", "off")  # --backward-split: each node's last backwards split (depth by the cost model), or none
MAX_DEPTH = 4


def split_backwards(streams: dict[int, list[Instr]], makespan: Callable[[dict], float]) -> dict[int, list[Instr]]:
    """`streams` with each node's last backwards split, as deep as shortens the
    iteration most by `makespan` (a simulation of the streams)."""
    best, best_time = streams, makespan(streams)
    for depth in range(1, MAX_DEPTH + 1):
        candidate = {node: split_last(stream, depth) for node, stream in streams.items()}
        if candidate == best:
            break  # no node has more backwards to split
        time = makespan(candidate)
        if time < best_time - 1e-9:
            best, best_time = candidate, time
    return best


def split_last(stream: list[Instr], depth: int) -> list[Instr]:
    """`stream` with its last `depth` backwards that send a gradient split, their
    weight passes in order after the last of those sends; unchanged unless only
    the tail follows the node's last backward and its send."""
    sends = [pc for pc, i in enumerate(stream) if i.op is Op.SEND_GRAD and pc > 0
             and stream[pc - 1] == ir.backward(i.stage, i.mb)]
    if not sends or any(not is_tail(i) for i in stream[sends[-1] + 1:]):
        return stream
    split = set(sends[-depth:])
    out: list[Instr] = []
    weights: list[Instr] = []
    for pc, ins in enumerate(stream):
        if pc + 1 in split:
            out.append(ir.backward_input(ins.stage, ins.mb))
            weights.append(ir.backward_weight(ins.stage, ins.mb))
        else:
            out.append(ins)
        if pc == sends[-1]:
            out += weights
    return out
