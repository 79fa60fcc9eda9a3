"""Passes (c), (d), (e): eager FRC in bubbles, swap-out after it, and the lazy BRC stream.

With lazy redundancy, pass (c) does not run: the replica is kept in sync at every
step, and only after its owner dies does the node run FRC (from the replica's
inputs, its own stage's outputs, which it kept) and BRC, both in the recovery.

Node m keeps a replica of stage r = (m+1) mod P warm by running r's forward on
every microbatch (forward redundant computation, FRC) from its own stage's output
(node P-1 loads the microbatch to run stage 0; node P-2 loads labels for the loss). The intermediates go straight to
host memory (swap-out); they come back only if node r dies, when node m runs r's
backward (BRC) for the lost microbatches.

Placement: the plain streams are timed on the cost model, and each FRC goes into
the first idle wait (a blocking receive) after its input exists where it fits
whole, so it delays nothing. FRC that fits nowhere runs in the wait before the
replica's final sync, where it delays only this node's replica step.
"""
from __future__ import annotations

from schedules import ir
from schedules.cost import CostModel
from schedules.ir import Instr, Op, RECVS
from schedules.layout import Layout
from schedules.simulator import start_times


def frc_ops(replica: int, mb: int, load: bool) -> list[Instr]:
    ops = [ir.load(mb)] if load else []
    return ops + [ir.forward(replica, mb, redundant=True), ir.swap_out(replica, mb)]


def lazy_brc(layout: Layout, node: int, microbatches: int, frc_ran: bool = True) -> list[Instr]:
    """The BRC work `node` owes its replica if the replica's owner dies: swap in and
    backward for every microbatch, or, with lazy redundancy (no FRC ran), forward
    from the replica's input it kept and backward. The recovery pass (recovery.py)
    turns it into a real stream: it adds the gradient receives, the activations the
    successor still needs, and drops the swap-ins of microbatches whose FRC had not run."""
    r = layout.replica(node)
    if r is None:
        return []
    first = ir.swap_in if frc_ran else (lambda stage, mb: ir.forward(stage, mb, redundant=True))
    return [op for mb in range(microbatches) for op in (first(r, mb), ir.backward(r, mb, redundant=True))]


def insert_frc(layout: Layout, microbatches: int, streams: dict[int, list[Instr]],
               cost: CostModel) -> dict[int, list[Instr]]:
    starts = start_times(streams, cost)
    out = {}
    for node, stream in streams.items():
        r = layout.replica(node)
        needs_load = r in (0, layout.stages - 1)  # stage 0 reads inputs, stage P-1 labels
        out[node] = stream if r is None else _fill(r, needs_load, microbatches, stream, starts[node], cost)
    return out


def _fill(r: int, needs_load: bool, microbatches: int, stream: list[Instr], starts: list[float],
          cost: CostModel) -> list[Instr]:
    """Insert FRC of stage r for every microbatch, in order, into `stream`'s waits."""
    out: list[Instr] = []
    loaded: set[int] = set()
    have_input: set[int] = set(range(microbatches)) if r == 0 else set()
    nxt = 0  # next microbatch to run FRC for

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
        if op in RECVS and nxt < microbatches:
            if op is Op.RECV_SYNC:  # last wait of the iteration: everything left goes here
                while nxt < microbatches:
                    out += frc(nxt)
                    nxt += 1
            gap = starts[i] - (starts[i - 1] + duration(stream[i - 1]) if i else 0.0)
            while nxt < microbatches and nxt in have_input and frc_cost(nxt) <= gap + 1e-9:
                gap -= frc_cost(nxt)
                out += frc(nxt)
                nxt += 1
        elif op is Op.LOAD:
            if ins.mb in loaded:
                continue  # FRC already loaded this microbatch
            loaded.add(ins.mb)
        elif op is Op.FORWARD and ins.stage == r - 1:
            have_input.add(ins.mb)
        out.append(ins)
    if nxt != microbatches:
        raise RuntimeError("internal: a node with a replica must end its stream with recv_sync")
    return out
