"""Pass (f), mid-iteration: finish the iteration after node d dies before instruction k.

The cut. Node d ran instructions [0, k) and every message it sent then arrived.
Every survivor runs its own stream as far as it can without d's later work (sends
to d are lost, receives from d block forever): that maximal cut is where each
survivor switches to its recovery stream, so a runtime only needs (d, k) to know
where every node stands. It is found by counting messages (timing/cut.py), not by
running the iteration. A message of d that its receiver had not taken in at the
cut is dropped; the new owner sends it again.

The recovery. Node d's weight gradients died with it, so its predecessor p runs
stage d's backward for every microbatch (BRC), from the FRC intermediates it
swapped out, or from a forward it recomputes when FRC had not run yet or never
runs (lazy; bounded eager's microbatches that no bubble held). Activations
of stage d that never reached the successor q are sent from FRC results or fresh
forwards. q re-sends the gradients it had sent to d (it kept them) and sends the
rest to p. p interleaves chains by list scheduling: whichever chain's next
instruction can start first, ties broken in this order: receive gradients, send
activations q waits for, its own remaining work, BRC its own backward waits for,
and last the BRC nothing waits for. Other nodes go on unchanged; every tail is re-made
for the new owners, minus what already ran. Only p's choices are checked as they are
made (the engine's `lean` run times the rest): the other streams are validated ones,
rerouted, and the tests validate whole plans (compiler.simulate).
"""
from __future__ import annotations

from collections import Counter
from typing import Callable

from schedules import ir
from schedules.cost import CostModel
from schedules.timing.cut import Matches
from schedules.timing.engine import Chains, Engine, Report
from schedules.ir import SENDS, Instr, Op
from schedules.layout import Layout, ScheduleError
from schedules.lower import is_tail, tail
from schedules.options import ReplicaSync, ScheduleOptions


def _without(ops: list[Instr], done: list[Instr]) -> list[Instr]:
    left = Counter(done)
    out = []
    for ins in ops:
        if left[ins]:
            left[ins] -= 1
        else:
            out.append(ins)
    return out


def check_failure(layout: Layout, base: dict[int, list[Instr]], node: int, before: int) -> Layout:
    """The layout after `node` dies mid-iteration, or a ScheduleError saying why it can't."""
    if node not in layout.alive:
        raise ScheduleError(f"--fail-node {node} is not a live node (live: {list(layout.alive)})")
    after = layout.with_failed(node)  # raises for adjacent failures
    if layout.holder(node) is None:
        raise ScheduleError(f"node {node} failing is not survivable: no node keeps a replica of "
                            f"stage {node} (is redundancy off?)")
    if not 0 <= before <= len(base[node]):
        raise ScheduleError(f"--fail-before {before} is out of range 0..{len(base[node])} "
                            f"(node {node} has {len(base[node])} instructions)")
    return after


def _check_late_syncs(base: dict[int, list[Instr]], d: int, k: int, p: int) -> None:
    """--replica-sync next: a sync of d's that had not arrived at the cut leaves p's
    replica of d's stage a step behind, which no recovery in the iteration mends."""
    lost = [i for i in base[d][k:] if i.op is Op.SEND_SYNC and i.peer == p]
    if lost:
        raise ScheduleError(f"node {d} dying before its instruction {k} is not survivable in the iteration: the "
                            f"sync of the iteration before ({lost[0]}) had not reached node {p}, whose replica "
                            "of its stage is then a step behind (--replica-sync next)")


def recover(layout: Layout, microbatches: int, base: dict[int, list[Instr]], d: int, k: int,
            cost: CostModel | None = None, options: ScheduleOptions = ScheduleOptions(),
            matches: Matches | None = None) -> tuple[dict[int, list[Instr]], dict[int, int], Report]:
    """Full streams of the survivors (prefix + recovery), where each recovery starts,
    and the engine's report of the whole iteration (only p's choices checked). p swaps
    in the FRC results of stage d that ran before the cut and recomputes every other
    forward it needs (all of them with lazy). With --replica-sync next the syncs in
    the streams are the iteration before's (syncs.py); p takes d's first. `base` is
    only read; `matches`: its message tables, when the caller keeps them."""
    P, M, sync = layout.stages, microbatches, options.sync
    after = check_failure(layout, base, d, k)
    p, q = (d - 1) % P, (d + 1) % P
    late, synced = sync == ReplicaSync.NEXT, sync != ReplicaSync.NONE  # "none": no sync in the streams (syncs.py)
    if late:
        _check_late_syncs(base, d, k, p)
    ends = is_tail if sync == ReplicaSync.END else _late_tail  # the iteration's own reduces and steps
    check = dict(expect_frc=options.every_frc, late_sync=late, expect_syncs=synced)
    matches = matches or Matches(base)
    cut = matches.cut(d, k)
    prefix = {n: s[:cut[n]] for n, s in base.items() if n != d}
    dead_ran = base[d][:k]
    # What survivors took in from d counts; a message of d still queued at the cut
    # (its receiver waits on something else first) is dropped and sent again by p.
    # (With late syncs, the one in the streams says nothing of this iteration's.)
    # d stepped, synced
    stage_done = sync == ReplicaSync.END and any(i.op is Op.RECV_SYNC and i.peer == d for i in prefix[p])

    full: dict[int, list[Instr]] = {}
    for n, pre in prefix.items():
        rest = base[n][len(pre):]
        if stage_done:  # nothing to recompute: drop what was addressed to d
            full[n] = pre + [i for i in rest if i.peer != d or i.op not in ir.COMM]
            continue
        body = [i for i in rest if not ends(i)]
        new_tail = _without(tail(after, n, sync), [i for i in pre if ends(i)])
        full[n] = pre + (_reroute(n, body, d, p, q) if matches.talk(n, d) else body) + new_tail
    if stage_done:
        report = Engine(layout, M, cost, dead=(d, k), expect_frc=options.every_frc).run({**full, d: dead_ran},
                                                                                       lean=True)
        return full, {n: len(prefix[n]) for n in prefix}, report

    resend = [ir.send_grad(i.stage, i.mb, p) for i in prefix[q] if i.op is Op.SEND_GRAD and i.peer == d]
    if p != q:
        full[q] = prefix[q] + resend + full[q][len(prefix[q]):]
    grad_order = [i.mb for i in full[q][len(prefix[q]):] if i.op is Op.SEND_GRAD and i.peer == p]
    delivered = {i.mb for i in prefix[q] if i.op is Op.RECV_ACT and i.peer == d}
    chains, chain_loads = _brc_chains(layout, M, d, p, q, prefix[p], delivered, grad_order)
    first = _late_sync_of(full[p][len(prefix[p]):], d) if late else []  # the replica current before its BRC
    own = [i for i in full[p][len(prefix[p]):]
           if not ends(i) and not (i.op is Op.LOAD and i.mb in chain_loads) and i not in first]
    p_tail = [i for i in full[p][len(prefix[p]):] if ends(i)]
    recvs, acts, urgent, deferred = chains
    scheduled = {p: Chains(prefix[p] + first, [recvs, acts, own, urgent, deferred], p_tail)}
    report = Engine(layout, M, cost, dead=(d, k), **check).run({**full, d: dead_ran}, scheduled, lean=True)
    full[p] = report.streams[p]
    return full, {n: len(prefix[n]) for n in prefix}, report


def _late_tail(ins: Instr) -> bool:
    """With late syncs (syncs.py): the iteration's own reduces and steps, its tail."""
    return ins.op is Op.REDUCE_GRADS or (ins.op is Op.OPTIMIZER_STEP and not ins.redundant)


def _late_sync_of(rest: list[Instr], d: int) -> list[Instr]:
    """p's receive of d's late sync still to run, and the replica step after it."""
    recv = next((i for i in rest if i.op is Op.RECV_SYNC and i.peer == d), None)
    return [] if recv is None else [recv, ir.optimizer_step(recv.stage, redundant=True)]


def _reroute(n: int, body: list[Instr], d: int, p: int, q: int) -> list[Instr]:
    """Point a survivor's remaining work at p instead of d; p's hand-offs become local.
    A late sync to d is lost with it; p's from d (arrived, or the cut would not be
    survivable) stays."""
    out = []
    for ins in body:
        if ins.op is Op.SEND_SYNC and ins.peer == d:
            continue
        if ins.op is Op.RECV_SYNC and ins.peer == d and n == p:
            out.append(ins)
            continue
        if ins.op in ir.COMM and ins.peer == d:
            if n == p and ins.op in (Op.SEND_ACT, Op.RECV_GRAD):
                continue  # p now computes stage d itself
            if n == q and ins.op in (Op.RECV_ACT, Op.SEND_GRAD):
                if p == q:
                    continue  # two stages: the survivor runs the whole pipeline
                ins = ins._replace(peer=p)
            else:
                raise AssertionError(f"node {n} talks to failed node {d}: {ins}")
        if n == p and ins.stage == d and ins.op in (Op.FORWARD, Op.SWAP_OUT):
            continue  # FRC of stage d still to come: the chains below take over
        out.append(ins)
    return out


def _brc_chains(layout: Layout, M: int, d: int, p: int, q: int, p_ran: list[Instr],
                delivered: set[int], grad_order: list[int]) -> tuple[list[list[Instr]], set[int]]:
    """p's chains for stage d: gradients from q, activations q still needs, and the
    backwards of every microbatch (urgent first, deferred last)."""
    P = layout.stages
    has_down = d < P - 1
    frc: dict[int, bool] = {}  # mb -> intermediates resident (True) or in host memory (False)
    for i in p_ran:
        if i.stage == d and i.op in (Op.FORWARD, Op.SWAP_OUT):
            frc[i.mb] = i.op is Op.FORWARD
    loaded = {i.mb for i in p_ran if i.op is Op.LOAD}
    needs_load = d in (0, P - 1)
    chain_loads: set[int] = set()

    def fresh_forward(mb: int, redundant: bool) -> list[Instr]:
        ops = []
        if needs_load and mb not in loaded:
            ops.append(ir.load(mb))
            chain_loads.add(mb)
        return ops + [ir.forward(d, mb, redundant)]

    acts: list[Instr] = []
    to_send = [mb for mb in range(M) if mb not in delivered] if has_down else []
    for mb in to_send:
        if mb in frc:
            acts += [ir.swap_in(d, mb)] if frc[mb] is False else []
        else:
            acts += fresh_forward(mb, redundant=False)
        if q != p:
            acts.append(ir.send_act(d, mb, q))

    # Gradients from q arrive in q's order; backwards whose result p's own stage still
    # waits for go first, the rest (p already ran its own backward) can wait.
    recvs = [ir.recv_grad(d + 1, mb, q) for mb in grad_order] if has_down and p != q else []
    own_done = {i.mb for i in p_ran if i.op in ir.INPUT_GRADS and i.stage == (d - 1) % P}
    urgent: list[Instr] = []
    deferred: list[Instr] = []
    for mb in (grad_order if recvs else range(M)):
        out = deferred if mb in own_done else urgent
        fresh = mb in to_send and mb not in frc
        if mb in frc and frc[mb] is False and mb not in to_send:
            out.append(ir.swap_in(d, mb))
        elif mb not in frc and not fresh:
            out += fresh_forward(mb, redundant=True)
        out.append(ir.backward(d, mb, redundant=not fresh))
    return [recvs, acts, urgent, deferred], chain_loads


def tails_last(rest: list[Instr], late: bool = False) -> list[Instr]:
    """`rest` of a recovery stream with its tail (reduces, syncs and steps; with
    `late` syncs only the iteration's own reduces and steps) moved behind all
    other work, stage by stage in ascending order, as every unbroken stream has it.
    The executor applies it at a replan. A node's reduces are collectives across
    pipelines, and a node that takes stage 0 over from the last stage may already
    have its own stage's reduce in the prefix it ran: it would wait there for the
    owner of that stage in a pipeline that recovered earlier, which waits in stage
    0's reduce for it, in ascending order (bamboo-chaos --network seed 10). With
    every tail at the end and in one order, a node waits in a reduce only once its
    compute is done, and only for stages no lower than any it still owes. Non-tail
    work never waits on a tail, so no wait inside the pipeline grows a cycle."""
    ends = _late_tail if late else is_tail
    body = [i for i in rest if not ends(i)]
    return body + sorted((i for i in rest if ends(i)), key=_tail_rank)


def _tail_rank(ins: Instr) -> tuple[bool, int, int]:
    """Where a tail instruction goes: the owned stages' (reduce, sync, step) by
    stage, then the replica's (its sync, its step), as schedules/lower.py's tail."""
    replica = ins.op is Op.RECV_SYNC or (ins.op is Op.OPTIMIZER_STEP and ins.redundant)
    order = (Op.RECV_SYNC, Op.OPTIMIZER_STEP) if replica else (Op.REDUCE_GRADS, Op.SEND_SYNC, Op.OPTIMIZER_STEP)
    return replica, ins.stage, order.index(ins.op)


def sends_first(rest: list[Instr], ready: Callable[[Instr], bool]) -> list[Instr]:
    """`rest` of a recovery stream with the activation and gradient sends whose
    tensors are `ready` moved to its front, each channel's in their order (a send
    behind one not ready stays behind it). The executor applies it at a replan: a
    survivor called away from a collective takes it up again next, and its peers
    there may wait, through a stage they reduce first, on what the node taking the
    dead node's stage over needs from this one: re-sent kept gradients
    (bamboo-chaos --network seed 20). Posting a send earlier never makes a wait
    longer: sends are posted, and each channel's order stays."""
    front, back, blocked = [], [], set()
    for ins in rest:
        channel = (ins.op, ins.peer)
        if ins.op in (Op.SEND_ACT, Op.SEND_GRAD) and channel not in blocked and ready(ins):
            front.append(ins)
            continue
        if ins.op in SENDS:
            blocked.add(channel)
        back.append(ins)
    return front + back
