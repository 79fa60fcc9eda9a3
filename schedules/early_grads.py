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

from schedules import ir
from schedules.cost import CostModel
from schedules.ir import Instr, Op
from schedules.lower import is_tail
from schedules.options import BackwardSplit
from schedules.timing.fast import Timed

SPLITS = BackwardSplit.values()  # --backward-split: each node's last backwards split (depth by the cost model), or none


def split_backwards(streams: dict[int, list[Instr]], cost: CostModel) -> dict[int, list[Instr]]:
    """`streams` with each node's last backwards split, as deep as shortens the
    iteration most under `cost`: each depth timed from its first split (fast.py
    `Timed`), up to the depth that splits every backward a node may split."""
    base = Timed(streams, cost)
    sends = {n: splittable(stream) for n, stream in streams.items()}
    most = max(map(len, sends.values()), default=0)
    best, best_time, depth = streams, base.makespan, 1
    while most > depth // 2:  # the depth before split fewer on some node
        candidate = {n: split_last(stream, depth, sends=sends[n]) for n, stream in streams.items()}
        time = base.finish(candidate, {n: at[-depth:][0] - 1 for n, at in sends.items() if at})
        if time < best_time - 1e-9:
            best, best_time = candidate, time
        depth *= 2
    return best


def splittable(stream: list[Instr]) -> list[int]:
    """The positions of the sends whose backward split_last may split: every backward
    that sends a gradient, when only the tail follows the last one; else none."""
    sends = [pc for pc, i in enumerate(stream) if i.op is Op.SEND_GRAD and pc > 0
             and stream[pc - 1] == ir.backward(i.stage, i.mb)]
    return sends if sends and all(is_tail(i) for i in stream[sends[-1] + 1:]) else []


def split_last(stream: list[Instr], depth: int, lag: int = 1, sends: list[int] | None = None) -> list[Instr]:
    """`stream` with its last `depth` (>= 1) backwards that send a gradient split,
    each weight pass after the send of the split one `lag` (>= 1) later, the last
    ones after the last send; unchanged unless only the tail follows the node's last
    backward and its send. `sends`: the stream's `splittable`, when known."""
    sends = splittable(stream) if sends is None else sends
    if not sends:
        return stream
    split = set(sends[-depth:])
    first = sends[-depth:][0] - 1  # the first backward split: what comes before it stays
    out: list[Instr] = stream[:first]
    owed: list[Instr] = []  # the weight passes of the last `lag` split backwards, oldest first
    for pc, ins in enumerate(stream[first:], first):
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
