"""Pass: a node's last backwards send their input gradients before computing weights.

Every stage waits for its successor's gradients, and the successor computes each
in one backward with its own weights' gradients, which nobody upstream needs.
Split, a backward computes the input gradient first (BACKWARD_INPUT), the
gradient goes out (SEND_GRAD), and the weights (BACKWARD_WEIGHT) wait one slot:
they run after the next split backward's send, the last of them after the node's
last send, before its tail (reduce, step, sync). So each gradient leaves a weight
pass earlier, and in the drain the predecessors run their backwards while the
node computes weights. This is zero-bubble pipelining's split (Qi et al., 2024;
with P=2 and every backward split, the order of torch's ZB1P on the last stage).

How many of each node's last backwards are split (`depth`, the same on every
node) is chosen on the cost model: the depth with the shortest simulated
iteration among 1, 2, 4, ... up to all of them, the smallest among equals. Each
split backward holds its microbatch's graph one slot longer. A node whose last
backward does not end in a send, or is followed by more than the tail, keeps
whole backwards. The math is unchanged: the same gradients from the same
autograd functions (bamboo/runtime/two_pass.py, tests/integration/test_early_grads.py).
"""
from __future__ import annotations

from typing import Callable

from schedules import ir
from schedules.ir import Instr, Op
from schedules.lower import is_tail
from schedules.options import BackwardSplit

SPLITS = BackwardSplit.values()  # --backward-split: each node's last backwards split (depth by the cost model), or none


def split_backwards(streams: dict[int, list[Instr]], makespan: Callable[[dict], float]) -> dict[int, list[Instr]]:
    """`streams` with each node's last backwards split, as deep as shortens the
    iteration most by `makespan` (a simulation of the streams)."""
    best, best_time, last, depth = streams, makespan(streams), streams, 1
    while True:
        candidate = {node: split_last(stream, depth) for node, stream in streams.items()}
        if candidate == last:
            return best  # no node has more backwards to split
        time = makespan(candidate)
        if time < best_time - 1e-9:
            best, best_time = candidate, time
        last, depth = candidate, depth * 2


def split_last(stream: list[Instr], depth: int, lag: int = 1) -> list[Instr]:
    """`stream` with its last `depth` (>= 1) backwards that send a gradient split,
    each weight pass after the send of the split one `lag` (>= 1) later, the last
    ones after the last send; unchanged unless only the tail follows the node's last
    backward and its send."""
    sends = [pc for pc, i in enumerate(stream) if i.op is Op.SEND_GRAD and pc > 0
             and stream[pc - 1] == ir.backward(i.stage, i.mb)]
    if not sends or any(not is_tail(i) for i in stream[sends[-1] + 1:]):
        return stream
    split = set(sends[-depth:])
    out: list[Instr] = []
    owed: list[Instr] = []  # the weight passes of the last `lag` split backwards, oldest first
    for pc, ins in enumerate(stream):
        if pc + 1 in split:
            out.append(ir.backward_input(ins.stage, ins.mb))
            continue
        out.append(ins)
        if pc in split:
            owed.append(ir.backward_weight(ins.stage, ins.mb))
            if len(owed) > lag:
                out.append(owed.pop(0))
        if pc == sends[-1]:
            out += owed
    return out
