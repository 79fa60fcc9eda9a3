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
from schedules.timing.fast import Timed
from schedules.ir import Instr, Op, RECVS, SENDS
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


# Up to this many instructions in all streams, a holder's waits the node cannot make
# up alone are also tried on the whole iteration (its peers may have the slack);
# beyond, that search would cost more than the compile path may spend.
WHOLE_SEARCH_INSTRUCTIONS = 1024
WHOLE_SEARCH_PLACES = 32


def defer_syncs(layout: Layout, streams: dict[int, list[Instr]], cost: CostModel) -> dict[int, list[Instr]]:
    """`streams` (tails without syncs) with each sync placed in the next iteration:
    the owners' sends first, each holder's receive and replica step in the first
    wait after the sync lands from which they delay nothing, else at the end."""
    out = {n: late_sends(layout, n) + list(stream) for n, stream in streams.items()}
    timed = Timed(out, cost)
    starts, end = timed.starts, timed.makespan  # the starts stay these but after a search (the others delay nothing)
    whole = sum(map(len, out.values())) <= WHOLE_SEARCH_INSTRUCTIONS
    for node, stream in list(out.items()):
        r = layout.replica(node)
        if r is None or layout.owner(r) == node:
            continue
        owner = layout.owner(r)
        sent = next(i for i, ins in enumerate(out[owner]) if ins.op is Op.SEND_SYNC and ins.stage == r)
        landed = starts[owner][sent] + cost.duration(out[owner][sent]) + cost.sync_transfer
        ops = [ir.recv_sync(r, owner), ir.optimizer_step(r, True)]
        need = sum(cost.duration(op) for op in ops)
        waits = _waits(stream, starts[node], landed, cost)
        at = next((i for i, idle in waits if _absorbed(stream, starts[node], i, idle + need, cost, end)), None)
        searched = at is None and whole  # the wait the whole iteration makes up best, else the end
        if searched:
            timed = timed if timed.streams == out else Timed(out, cost)
            at = _least_delay(timed, node, _after(stream, starts[node], landed, cost)[:WHOLE_SEARCH_PLACES], ops)
        at = len(stream) if at is None else at
        out[node] = stream[:at] + ops + stream[at:]
        if searched:  # the peers' times may have moved
            timed = Timed(out, cost)
            starts = timed.starts
    return out


def _waits(stream: list[Instr], starts: list[float], landed: float, cost: CostModel) -> list[tuple[int, float]]:
    """The receives the node waits for after the sync has landed, each with when the
    node could begin the sync's ops there."""
    out = []
    for i, ins in enumerate(stream):
        if ins.op in RECVS and i > 0:
            idle_from = max(starts[i - 1] + cost.duration(stream[i - 1]), landed)
            if idle_from < starts[i]:
                out.append((i, idle_from))
    return out


def _after(stream: list[Instr], starts: list[float], landed: float, cost: CostModel) -> list[int]:
    """The places in the stream from the sync's landing on: the ops that start after
    it, and the receive the node waits at while it lands."""
    return [i for i in range(1, len(stream) + 1)
            if starts[i - 1] + cost.duration(stream[i - 1]) >= landed
            or (i < len(stream) and stream[i].op in RECVS and starts[i] > landed)]


def _absorbed(stream: list[Instr], starts: list[float], i: int, clock: float, cost: CostModel,
              end: float) -> bool:
    """Whether the node's ops from `i` on, resumed at `clock`, make up the delay in its
    own waits before a peer sees it (a send, a reduce) and end by `end`: a receive's
    message arrives when it started (it waited) or earlier (it did not), so its
    new start is max(clock, old start)."""
    for j in range(i, len(stream)):
        ins = stream[j]
        if clock <= starts[j] + 1e-9:
            return True  # caught up: every op from here keeps its time
        if ins.op in SENDS or ins.op is Op.REDUCE_GRADS:
            return False
        clock += cost.duration(ins)
    return clock <= end + 1e-9


def _least_delay(base: Timed, node: int, places: list[int], ops: list[Instr]) -> int:
    """Of `places` and the end of `node`'s stream, the first place for `ops` after which
    the iteration ends soonest. Added ops only ever start things later (a receive
    waits, a step takes time: every start is a max of sums), so no place ends before
    the iteration without them: the first place that ends then is the answer, and
    the places after it are not timed. Each place is timed from where it changes
    the iteration (fast.py `Timed`)."""
    streams = base.streams
    stream = streams[node]
    places = [*places, len(stream)]
    times: list[float] = []
    for i in places:
        times.append(base.finish({**streams, node: stream[:i] + ops + stream[i:]}, {node: i}))
        if times[-1] <= base.makespan:
            break
    return places[times.index(min(times))]


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
