"""Pass (b2), `--replica-sync next`: each replica's sync lands in the next iteration.

With the sync at the end (`end`, the default), the holder of a stage's replica
takes the owner's reduced gradients after the owner's last backward, and the
holder of stage 0 (node P-1) waits for node 0, the last node to finish: the
transfer lies on the iteration's critical path (docs/HOTPATH.md).

With `next`, the sync of iteration i travels in iteration i+1's streams: the
owner's stream begins with its SEND_SYNC (of the gradients it kept from its step),
and the holder takes it (RECV_SYNC) and steps the replica in the first wait that
starts after the sync has landed, under the cost model, and holds the step whole;
else at the end of its stream, where nobody waits for it. Both halves stay inside
one iteration, so no message crosses a boundary. Eager's FRC of the replica then
goes only after that step (redundancy.py), as it must use the replica's current
weights. What it costs: until the sync lands, the replica is a step behind, and a
death of its owner then is not survivable within the iteration (recovery.py).
"""
from __future__ import annotations

from typing import NamedTuple

from schedules import ir
from schedules.cost import CostModel
from schedules.timing.engine import start_times
from schedules.ir import Instr, Op, RECVS
from schedules.layout import Layout
from schedules.options import SYNC_CHOICES, ReplicaSync

SYNC_MODES = SYNC_CHOICES
# "none": `next`'s first iteration of a run or an epoch, which owes no sync (the
# replicas came whole), so its streams carry none: a runtime compiles it so.
COMPILED_SYNCS = ReplicaSync.values()


def late_sends(layout: Layout, node: int) -> list[Instr]:
    """The syncs `node` owes the holders of its stages' replicas, from the iteration before."""
    holders = ((s, layout.holder(s)) for s in layout.owned(node))
    return [ir.send_sync(s, h) for s, h in holders if h is not None and h != node]


def defer_syncs(layout: Layout, streams: dict[int, list[Instr]], cost: CostModel) -> dict[int, list[Instr]]:
    """`streams` (tails without syncs) with each sync placed in the next iteration:
    the owners' sends first, each holder's receive and replica step where they delay
    nothing if such a wait exists."""
    out = {n: late_sends(layout, n) + list(stream) for n, stream in streams.items()}
    starts = start_times(out, cost)
    for node, stream in out.items():
        r = layout.replica(node)
        if r is None:
            continue
        owner = layout.owner(r)
        if owner == node:
            continue
        sent = next(i for i, ins in enumerate(out[owner]) if ins.op is Op.SEND_SYNC and ins.stage == r)
        landed = starts[owner][sent] + cost.duration(out[owner][sent]) + cost.sync_transfer
        out[node] = _placed(stream, starts[node], landed, [ir.recv_sync(r, owner), ir.optimizer_step(r, True)],
                            cost)
    return out


def _placed(stream: list[Instr], starts: list[float], landed: float, ops: list[Instr],
            cost: CostModel) -> list[Instr]:
    """`ops` before the first receive whose wait, from `landed` on, holds them whole;
    else at the end of the stream."""
    need = sum(cost.duration(op) for op in ops)
    for i, ins in enumerate(stream):
        if ins.op not in RECVS or i == 0:
            continue
        idle_from = max(starts[i - 1] + cost.duration(stream[i - 1]), landed)
        if idle_from + need <= starts[i] + 1e-9:
            return stream[:i] + ops + stream[i:]
    return stream + ops


def sync_landed_first(stream: list[Instr], replica: int) -> bool:
    """Whether `stream` takes its replica's sync and step before any FRC of it."""
    synced = False
    for ins in stream:
        if ins.op is Op.OPTIMIZER_STEP and ins.redundant and ins.stage == replica:
            synced = True
        elif ir.is_frc(ins) and ins.stage == replica and not synced:
            return False
    return True


class Window(NamedTuple):
    """A stage's window, as shares of the iteration: a death of its owner before
    `landed` or from `reduced` on is not survivable in the iteration."""
    landed: float   # the owner's sync of the iteration before has landed on the holder
    reduced: float  # the owner's reduce has ended (1.0 with one pipeline: no reduce to lose)

    def holds(self, phase: float) -> bool:
        return phase < self.landed or phase >= self.reduced

    @property
    def share(self) -> float:
        return min(1.0, self.landed + 1.0 - max(self.reduced, self.landed))


def windows(report, cost: CostModel, stages: int, pipelines: int) -> tuple[Window, ...]:
    """Each stage's window in the simulated fault-free iteration (`report`) of one of
    `pipelines` pipelines: until its owner's sync of the iteration before has
    landed on the holder (0: none sent), and with more than one pipeline also from
    the end of its owner's reduce on (its pipeline's share went into the peers'
    sums). sim/windows.py and agents/modes.py read them."""
    landed, reduced = [0.0] * stages, [report.makespan] * stages
    for span in report.spans:
        if span.instr.op is Op.SEND_SYNC:
            landed[span.instr.stage] = span.end + cost.sync_transfer
        elif span.instr.op is Op.REDUCE_GRADS and pipelines > 1:
            reduced[span.instr.stage] = span.end
    return tuple(Window(min(1.0, a / report.makespan), b / report.makespan) for a, b in zip(landed, reduced))
