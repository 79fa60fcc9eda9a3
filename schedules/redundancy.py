"""Passes (c), (d), (e): eager FRC in bubbles, swap-out after it, and the lazy BRC stream.

With lazy redundancy, pass (c) does not run: the replica is kept in sync at every
step, and only after its owner dies does the node run FRC (from the replica's
inputs, its own stage's outputs, which it kept) and BRC, both in the recovery.

Node m keeps a replica of stage r = (m+1) mod P warm by running r's forward on
microbatches (forward redundant computation, FRC) from its own stage's output
(node P-1 loads the microbatch to run stage 0; node P-2 loads labels for the
loss). The intermediates go straight to host memory (swap-out); they come back
only if node r dies, when node m runs r's backward (BRC) for the lost
microbatches.

Placement: the plain streams are timed on the cost model, and each FRC goes into
the first idle wait (a blocking receive) after its input exists where it fits
whole, so it delays nothing. What happens to the FRC that fits nowhere is the
mode's (FRC_MODES):

  bubbles  it is not run before a failure. The wait before the replica's sync
           also counts the time the node would idle after its stream, until the
           iteration's last node ends (nothing waits for the replica's step).
           With the sync at the end, the node's first wait gives room first to
           the replica's step owed from the iteration before, which the runtime
           takes there, before any FRC (bamboo/runtime/steps.py; with
           --replica-sync next the step is in the stream).
           FRC is placed in microbatch order, so the first microbatch that finds
           no wait has none, nor has any later one. After the replica's owner
           dies, the recovery recomputes those forwards from the inputs the node
           kept, as lazy does (recovery.py). The fault-free iteration is then
           exactly as long as without FRC under the cost model it was placed
           with (bubbles.py checks it).
  all      it runs in the wait before the replica's final sync, where it delays
           only this node's replica step (and so, maybe, the iteration's end):
           every microbatch has FRC.

Which microbatches have FRC is visible from the stream (`frc_microbatches`).
"""
from __future__ import annotations

import math
from typing import Collection, NamedTuple

from schedules import ir
from schedules.cost import CostModel
from schedules.timing.fast import start_times
from schedules.ir import Instr, Op, RECVS
from schedules.layout import Layout
from schedules.options import Frc, ReplicaSync


FRC_MODES = Frc.values()


def frc_ops(replica: int, mb: int, load: bool) -> list[Instr]:
    ops = [ir.load(mb)] if load else []
    return ops + [ir.forward(replica, mb, redundant=True), ir.swap_out(replica, mb)]


def frc_microbatches(stream: list[Instr], stage: int) -> list[int]:
    """The microbatches whose FRC of `stage` the stream runs, in stream order."""
    return [i.mb for i in stream if ir.is_frc(i) and i.stage == stage]


def lazy_brc(layout: Layout, node: int, microbatches: int, frc_ran: Collection[int] = ()) -> list[Instr]:
    """The BRC work `node` owes its replica if the replica's owner dies: for each
    microbatch, swap in and backward where its FRC ran (`frc_ran`), else forward
    from the replica's input it kept and backward (lazy redundancy, or bounded
    eager's microbatches that did not fit a bubble). The recovery pass (recovery.py)
    turns it into a real stream: it adds the gradient receives, the activations the
    successor still needs, and drops the swap-ins of microbatches whose FRC had not run."""
    r = layout.replica(node)
    if r is None:
        return []
    ran = set(frc_ran)
    out: list[Instr] = []
    for mb in range(microbatches):
        first = ir.swap_in(r, mb) if mb in ran else ir.forward(r, mb, redundant=True)
        out += [first, ir.backward(r, mb, redundant=True)]
    return out


def insert_frc(layout: Layout, microbatches: int, streams: dict[int, list[Instr]], cost: CostModel,
               mode: str = "bubbles", sync: str = "end") -> dict[int, list[Instr]]:
    """`streams` with each node's FRC of its replica placed as `mode` says. With
    `sync` "next", only after the replica's step (syncs.py), and the node's idle
    time after its stream counts as a last wait."""
    starts = start_times(streams, cost)
    ends = {n: t[-1] + cost.duration(streams[n][-1]) if t else 0.0 for n, t in starts.items()}
    length = max(ends.values(), default=0.0)
    out = {}
    for node, stream in streams.items():
        r = layout.replica(node)
        needs_load = r in (0, layout.stages - 1)  # stage 0 reads inputs, stage P-1 labels
        # bubbles: a node that ends before the iteration does idles until then, so its
        # replica's sync and step (which nobody waits for) may go that much later
        end_slack = length - ends[node] if mode == Frc.BUBBLES else math.inf
        # bubbles, sync at the end: the runtime takes the replica's step owed from the
        # iteration before in the node's first wait, before any FRC there (bamboo/runtime/steps.py)
        owed = cost.step if mode == Frc.BUBBLES and sync == ReplicaSync.END else 0.0
        room = Room(end_slack, late=sync == ReplicaSync.NEXT, owed=owed)
        out[node] = stream if r is None else _fill(r, needs_load, microbatches, stream, starts[node], cost, room)
    return out


class Room(NamedTuple):
    """What a node's waits can hold beyond their gaps. The wait before the replica's
    sync is longer by `end_slack`; with an infinite slack (--frc all) everything left
    goes there. `late`: the sync comes from the iteration before, in the stream; no
    FRC before the replica's step, and `end_slack` is after the stream. `owed`: what
    the first wait holds before any FRC (the replica's deferred step)."""
    end_slack: float
    late: bool = False
    owed: float = 0.0


def _fill(r: int, needs_load: bool, microbatches: int, stream: list[Instr], starts: list[float],
          cost: CostModel, room: Room) -> list[Instr]:
    """Insert FRC of stage r, microbatch by microbatch in order, into `stream`'s
    waits as `room` says; what finds no wait is left out."""
    end_slack, late, owed = room
    out: list[Instr] = []
    loaded: set[int] = set()
    have_input: set[int] = set(range(microbatches)) if r == 0 else set()
    nxt = 0  # next microbatch to run FRC for
    synced = not late  # whether the replica holds this iteration's weights yet

    def frc(mb: int) -> list[Instr]:
        ops = frc_ops(r, mb, load=(needs_load and mb not in loaded))
        loaded.add(mb)
        return ops

    run_cost = sum(cost.duration(i) for i in frc_ops(r, 0, load=False))

    def frc_cost(mb: int) -> float:
        return run_cost + (cost.load if needs_load and mb not in loaded else 0.0)

    duration = cost.duration
    for i, ins in enumerate(stream):
        op = ins.op
        if op in RECVS and nxt < microbatches and synced:
            if op is Op.RECV_SYNC and end_slack == math.inf:  # last wait of the iteration: everything left
                while nxt < microbatches:
                    out += frc(nxt)
                    nxt += 1
            gap = starts[i] - (starts[i - 1] + duration(stream[i - 1]) if i else 0.0)
            gap, owed = gap - owed, 0.0
            if op is Op.RECV_SYNC:
                gap += end_slack
            while nxt < microbatches and nxt in have_input and frc_cost(nxt) <= gap + 1e-9:
                gap -= frc_cost(nxt)
                out += frc(nxt)
                nxt += 1
        elif op is Op.OPTIMIZER_STEP and ins.redundant and ins.stage == r:
            synced = True
        elif op is Op.LOAD:
            if ins.mb in loaded:
                continue  # FRC already loaded this microbatch
            loaded.add(ins.mb)
        elif op is Op.FORWARD and ins.stage == r - 1:
            have_input.add(ins.mb)
        out.append(ins)
    gap = end_slack
    while late and nxt < microbatches and frc_cost(nxt) <= gap + 1e-9:  # nothing waits for the node
        gap -= frc_cost(nxt)
        out += frc(nxt)
        nxt += 1
    if nxt != microbatches and end_slack == math.inf:
        raise RuntimeError("internal: a node with a replica must end its stream with recv_sync")
    return out
