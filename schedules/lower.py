"""Pass (b): lower compute orders to instructions with communication, and merge groups.

A group (virtual stage) runs its stages back to back: a forward receives the input
activation of its first stage (or loads the microbatch), runs every stage's
forward, and sends the last stage's output on; a backward mirrors it. The end of
the iteration (the tail) reduces each owned stage, steps it, and syncs the replica
holder. A node that owns two groups (node P-1 after node 0 failed runs stage 0 and
stage P-1) gets one stream from both by list scheduling in the engine.
"""
from __future__ import annotations

from schedules import ir
from schedules.cost import CostModel
from schedules.timing.engine import Chains, Engine
from schedules.ir import Instr, Op
from schedules.layout import Group, Layout
from schedules.order import ORDERS, Step
from schedules.options import ReplicaSync


def lower_group(layout: Layout, group: Group, order: list[Step]) -> list[Instr]:
    P, node, stages = layout.stages, group.node, group.stages
    first, last = stages[0], stages[-1]
    labels_here = last == P - 1 and first != 0 and layout.owner(0) != node
    up = layout.owner(first - 1) if first > 0 else -1
    down = layout.owner(last + 1) if last < P - 1 else -1
    out: list[Instr] = []
    add = out.append
    for kind, mb in order:
        if kind == "F":
            if first == 0 or labels_here:
                add(ir.load(mb))
            if up >= 0:
                add(Instr(Op.RECV_ACT, first - 1, mb, up))
            out.extend(Instr(Op.FORWARD, s, mb) for s in stages)
            if down >= 0:
                add(Instr(Op.SEND_ACT, last, mb, down))
        else:
            if down >= 0:
                add(Instr(Op.RECV_GRAD, last + 1, mb, down))
            out.extend(Instr(Op.BACKWARD, s, mb) for s in reversed(stages))
            if up >= 0:
                add(Instr(Op.SEND_GRAD, first, mb, up))
    return out


def tail(layout: Layout, node: int, sync: str = "end") -> list[Instr]:
    """Reduce every owned stage (in stage order, so that data-parallel collectives
    are issued in one global order), sync its replica's holder, step it; then step
    the replica this node keeps from its owner's reduced gradients. The sync goes
    before the owner's own step so that the two steps run at the same time. With
    `sync` "next" the sync and the replica's step go in the next iteration's
    streams instead (schedules/syncs.py)."""
    out: list[Instr] = []
    for s in layout.owned(node):
        out.append(ir.reduce_grads(s))
        holder = layout.holder(s)
        if holder is not None and holder != node and sync == ReplicaSync.END:
            out.append(ir.send_sync(s, holder))
        out.append(ir.optimizer_step(s))
    r = layout.replica(node)
    if r is not None and sync == ReplicaSync.END:
        out += [ir.recv_sync(r, layout.owner(r)), ir.optimizer_step(r, redundant=True)]
    return out


def is_tail(ins: Instr) -> bool:
    return ins.op in (Op.REDUCE_GRADS, Op.OPTIMIZER_STEP, Op.SEND_SYNC, Op.RECV_SYNC)


def plain_streams(layout: Layout, microbatches: int, order: str = "1f1b",
                  cost: CostModel | None = None, sync: str = "end", extra: int = 0) -> dict[int, list[Instr]]:
    """Streams without redundancy for every live node: groups lowered, then merged.
    `sync` "next": the tails leave the replica sync out (schedules/syncs.py adds it);
    `extra`: forwards added to the warm-up (schedules/order.py)."""
    groups = layout.groups()
    per_node: dict[int, list[list[Instr]]] = {}
    for v, group in enumerate(groups):
        steps = ORDERS[order](len(groups), microbatches, v, extra)
        per_node.setdefault(group.node, []).append(lower_group(layout, group, steps))
    streams = {n: bodies[0] + tail(layout, n, sync) for n, bodies in per_node.items() if len(bodies) == 1}
    multi = {n: Chains([], bodies, tail(layout, n, sync)) for n, bodies in per_node.items() if len(bodies) > 1}
    if multi:
        report = Engine(layout, microbatches, cost, expect_frc=False, late_sync=sync == ReplicaSync.NEXT,
                           expect_syncs=sync == ReplicaSync.END).run(streams, multi)
        streams.update({n: report.streams[n] for n in multi})
    return {n: streams[n] for n in sorted(streams)}
