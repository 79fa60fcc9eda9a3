"""Pass: each node's last backward sends its input gradient before it computes weights.

In 1F1B's cool-down every stage waits for its successor's last gradient, and the
successor computes that gradient in one backward with its own weights' gradients,
which nobody upstream needs. Split there, the backward computes the input gradient
first (BACKWARD_INPUT), the gradient goes out (SEND_GRAD), and the weights follow
(BACKWARD_WEIGHT) while the predecessor runs its own backward: the drain's chain of
P-1 backwards becomes a chain of input gradients, as in zero-bubble pipelines
(Qi et al., 2024, whose ZB-H1 also defers the other microbatches' weights).

Only a node's last backward is split, and only where nothing but the iteration's
tail (reduce, step, sync) follows its send: the runtime's weight pass traverses
the stage's graph again (cost.py charges it a whole backward), which there delays
no other instruction of the node. The math is unchanged: the same gradients,
accumulated by the same autograd passes (tests/test_early_grads.py).
"""
from __future__ import annotations

from schedules import ir
from schedules.ir import Instr, Op

SPLITS = ("last", "off")  # --backward-split: each node's last backward split, or none
COMPUTE_OPS = frozenset({Op.FORWARD, Op.BACKWARD})


def split_last_backwards(streams: dict[int, list[Instr]]) -> dict[int, list[Instr]]:
    """Every node's stream with its last backward split where that sends a gradient."""
    return {node: split_last_backward(stream) for node, stream in streams.items()}


def split_last_backward(stream: list[Instr]) -> list[Instr]:
    """`stream` with its last BACKWARD, if a SEND_GRAD of its own output follows it
    and no compute after that, as BACKWARD_INPUT, SEND_GRAD, BACKWARD_WEIGHT."""
    at = max((pc for pc, i in enumerate(stream) if i.op in COMPUTE_OPS), default=-1)
    if at < 0 or at + 1 >= len(stream):
        return stream
    back, send = stream[at], stream[at + 1]
    if back.op is not Op.BACKWARD or back.redundant or send.op is not Op.SEND_GRAD \
            or (send.stage, send.mb) != (back.stage, back.mb):
        return stream
    return stream[:at] + [ir.backward_input(back.stage, back.mb), send,
                          ir.backward_weight(back.stage, back.mb)] + stream[at + 2:]
