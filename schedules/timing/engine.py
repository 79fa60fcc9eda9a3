"""The event engine: runs instruction streams on a cost model, in simulated time.

Each node executes its stream serially. Sends are asynchronous (the message lands
in a FIFO channel per (sender, receiver) pair after the transfer latency);
receives block until the next message on their channel arrives, and that message
must be the one they expect (NCCL and gloo pair point-to-point calls in order).
What else a stream must respect (inputs present, every microbatch once, every
stage stepped, nothing left behind) is schedules/timing/checks.py's: the engine asks
its checks before and after each instruction and at the end.

A node may also be *list scheduled*: instead of one fixed stream it has a few
chains, and whenever it can run the head of more than one chain the engine picks
the one that can start first. Lowering uses this to merge instruction groups; the
result is the order the node actually ran, a plain stream again.
"""
from __future__ import annotations

from collections import Counter, defaultdict, deque
from dataclasses import dataclass, field
from typing import NamedTuple

from schedules.timing.checks import Checks, ValidationError, timeline
from schedules.cost import CostModel
from schedules.ir import RECVS, SENDS, Instr, Op, channel
from schedules.layout import Layout


WAIT = ("wait", "its message is not sent yet")  # the commonest answer, never shown: not formatted each time


class Span(NamedTuple):
    node: int
    start: float
    end: float
    instr: Instr


class Message(NamedTuple):
    src: int
    dst: int
    instr: Instr     # the send
    sent: float
    received: float  # when the receive completed


class Chains(NamedTuple):
    """A list-scheduled node: a fixed prefix, chains to interleave, then a fixed tail."""
    prefix: list[Instr]
    chains: list[list[Instr]]
    tail: list[Instr]


@dataclass
class Report:
    makespan: float
    busy: dict[int, float]
    bubble: dict[int, float]          # idle fraction of the makespan, per node
    peak_live: dict[int, int]         # most forward states resident at once, per node
    peak_swapped: dict[int, int]      # most FRC intermediates in host memory at once
    spans: list[Span]
    messages: list[Message]
    streams: dict[int, list[Instr]]   # what each node executed, in order
    finished: dict[int, bool]


@dataclass
class NodeState:
    """What one node holds at a point of the simulated iteration."""
    layers: frozenset[int]
    clock: float = 0.0
    busy: float = 0.0
    loaded: set = field(default_factory=set)
    acts: set = field(default_factory=set)       # (stage, mb) outputs present on the device
    grads: set = field(default_factory=set)      # (stage, mb) gradients w.r.t. a stage's input
    states: dict = field(default_factory=dict)   # (stage, mb) -> True resident / False swapped /
                                                 # "weights" kept for BACKWARD_WEIGHT
    live: int = 0
    swapped: int = 0
    peak_live: int = 0
    peak_swapped: int = 0
    accum: dict = field(default_factory=lambda: defaultdict(list))
    reduced: set = field(default_factory=set)
    stepped: set = field(default_factory=set)
    synced: set = field(default_factory=set)
    frc: set = field(default_factory=set)        # (stage, mb) computed redundantly
    done: list = field(default_factory=list)


class Engine:
    """One iteration of `layout`'s nodes, `dead` = (node, instructions it ran) if one
    dies in it. The keyword options choose the checks (schedules/timing/checks.py)."""

    def __init__(self, layout: Layout, microbatches: int, cost: CostModel | None = None,
                 dead: tuple[int, int] | None = None, expect_frc: bool = True, evaluation: bool = False,
                 late_sync: bool = False, expect_syncs: bool = True):
        self.layout = layout
        self.P = layout.stages
        self.M = microbatches
        self.cost = cost or CostModel()
        self.dead_node, self.dead_at = dead if dead else (None, None)
        self.checks = Checks(self, expect_frc=expect_frc, evaluation=evaluation, late_sync=late_sync,
                             expect_syncs=expect_syncs)
        self.nodes = {n: NodeState(layers=frozenset(layout.owned(n)) | {layout.replica(n)} - {None})
                      for n in layout.alive}
        self.channels: dict[tuple, deque] = defaultdict(deque)
        self.normal_forwards: Counter = Counter()
        self.spans: list[Span] = []
        self.messages: list[Message] = []
        # For list-scheduled senders: the order in which each fixed receiver takes
        # their messages, so that the chosen order keeps every channel FIFO.
        self.expected: dict[tuple, deque] = {}
        self.awake: deque = deque()  # nodes that may run on: never tried yet, or sent something since
        self.is_awake: set = set()

    def wake(self, node: int) -> None:
        if node not in self.is_awake:
            self.is_awake.add(node)
            self.awake.append(node)

    # -- one instruction -------------------------------------------------------------
    def missing(self, node: int, ins: Instr) -> tuple[str, str] | None:
        """Why `ins` cannot start now on `node`: ("wait", ..) for a message not yet
        sent, ("order" | "data", reason) for a broken stream; None when it can."""
        if ins.op in RECVS:
            return self._not_received(node, ins)
        if ins.op in SENDS and channel(ins, node) in self.expected:
            q = self.expected[channel(ins, node)]
            if not q or q[0] != (SENDS[ins.op], ins.stage, ins.mb):
                return ("order", f"node {node} sends {ins} but node {ins.peer} expects "
                        f"{q[0] if q else 'nothing more'} first")
        for check in self.checks.by_op.get(ins.op, ()):
            need = check(node, self.nodes[node], ins)
            if need:
                return ("data", f"node {node}: {ins}: {need}")
        return None

    def _not_received(self, node: int, ins: Instr) -> tuple[str, str] | None:
        """`missing` for a receive: its message not sent yet, or another first."""
        q = self.channels.get(channel(ins, node))
        if not q:
            return WAIT
        sent = q[0][0]
        if sent.op is not RECVS[ins.op] or sent.stage != ins.stage or sent.mb != ins.mb:
            return ("order", f"node {node} expects {ins} but node {ins.peer} sent {sent} first")
        return None

    def start_time(self, node: int, ins: Instr) -> float:
        clock = self.nodes[node].clock
        return max(clock, self.channels[channel(ins, node)][0][1]) if ins.op in RECVS else clock

    def execute(self, node: int, ins: Instr) -> None:
        st = self.nodes[node]
        start = self.start_time(node, ins)
        end = start + self.cost.duration(ins)
        if ins.op in RECVS:
            sent, _, sent_at = self.channels[channel(ins, node)].popleft()
            self.messages.append(Message(ins.peer, node, sent, sent_at, end))
        if ins.op in SENDS:
            self.channels[channel(ins, node)].append((ins, end + self.cost.latency(ins), end))
            if channel(ins, node) in self.expected:
                self.expected[channel(ins, node)].popleft()
            self.wake(ins.peer)
        self.checks.on_execute(node, st, ins)
        self._apply(node, st, ins)
        st.peak_live = max(st.peak_live, st.live)
        st.peak_swapped = max(st.peak_swapped, st.swapped)
        st.clock, st.busy = end, st.busy + (end - start)
        st.done.append(ins)
        self.spans.append(Span(node, start, end, ins))

    def _apply(self, node: int, st: NodeState, ins: Instr) -> None:
        """What `ins` changes on the node."""
        op, key = ins.op, (ins.stage, ins.mb)
        if op is Op.LOAD:
            st.loaded.add(ins.mb)
        elif op is Op.FORWARD and self.checks.evaluation:
            st.acts.add(key)
            self.normal_forwards[key] += 1
        elif op is Op.FORWARD:
            st.acts.add(key)
            st.states[key] = True
            st.live += 1
            if not ins.redundant and node != self.dead_node:
                self.normal_forwards[key] += 1
            elif ins.redundant:
                st.frc.add(key)
        elif op is Op.BACKWARD:
            del st.states[key]
            st.live -= 1
            st.grads.add(key)
            st.accum[ins.stage].append(ins.mb)
        elif op is Op.BACKWARD_INPUT:
            st.states[key] = "weights"  # its memory held until the weight pass
            st.grads.add(key)
        elif op is Op.BACKWARD_WEIGHT:
            del st.states[key]
            st.live -= 1
            st.accum[ins.stage].append(ins.mb)
        elif op is Op.RECV_ACT:
            st.acts.add(key)
        elif op is Op.RECV_GRAD:
            st.grads.add(key)
        elif op is Op.SWAP_OUT:
            st.states[key], st.live, st.swapped = False, st.live - 1, st.swapped + 1
            st.acts.discard(key)
        elif op is Op.SWAP_IN:
            st.states[key], st.live, st.swapped = True, st.live + 1, st.swapped - 1
            st.acts.add(key)
        elif op is Op.REDUCE_GRADS:
            st.reduced.add(ins.stage)
        elif op is Op.OPTIMIZER_STEP:
            st.stepped.add((ins.stage, ins.redundant))
        elif op is Op.RECV_SYNC:
            st.synced.add(ins.stage)

    # -- whole streams ---------------------------------------------------------------
    def run(self, streams: dict[int, list[Instr]], scheduled: dict[int, Chains] | None = None,
            allow_stuck: bool = False, lean: bool = False) -> Report:
        """Run every node to its end; a ValidationError carries the timeline so far,
        the instruction that broke a check marked. `lean`: only the list-scheduled
        nodes are checked and recorded (their choices need their state); the fixed
        streams are only timed, as streams already validated (recovery.py)."""
        fixed, chains = self._queues(streams, scheduled or {})
        marked: dict[int, Instr] = {}
        checked = set(chains) if lean else set(self.nodes)
        try:
            self._run(fixed, chains, marked, checked)
            return self._finish(fixed, chains, allow_stuck, marked, lean)
        except ValidationError as e:
            e.timeline = timeline({n: st.done for n, st in self.nodes.items()}, marked)
            raise

    def _queues(self, streams: dict, scheduled: dict[int, Chains]) -> tuple[dict, dict]:
        fixed = {n: deque(streams.get(n, ())) for n in self.nodes}
        chains = {}
        for n, spec in scheduled.items():
            fixed[n] = deque(spec.prefix)
            chains[n] = ([deque(c) for c in spec.chains if c], deque(spec.tail))
            for peer, stream in streams.items():
                if peer not in scheduled and peer != self.dead_node:
                    for i in stream:
                        if i.op in RECVS and i.peer == n:
                            self.expected.setdefault(channel(i, peer), deque()).append((i.op, i.stage, i.mb))
        if self.dead_node is not None:
            fixed[self.dead_node] = deque(list(fixed[self.dead_node])[:self.dead_at])
        return fixed, chains

    def _run(self, fixed: dict, chains: dict, marked: dict[int, Instr], checked: set[int]) -> None:
        """Run the fixed streams as far as they go (a node runs again only once it was
        sent something), then one instruction of the list-scheduled chains; repeat."""
        for n in fixed:
            self.wake(n)
        while True:
            while self.awake:
                n = self.awake.popleft()
                self.is_awake.discard(n)
                todo = fixed[n]
                if todo:
                    self._advance(n, todo, marked) if n in checked else self._advance_timed(n, todo)
                if not todo and n in chains and not chains[n][0]:
                    fixed[n] = chains.pop(n)[1]
                    self.wake(n)
            if not self._schedule_one(fixed, chains, marked):
                break

    def _advance(self, n: int, todo: deque, marked: dict[int, Instr]) -> None:
        """Run node n's fixed stream, each instruction checked, until it waits."""
        while todo:
            why = self.missing(n, todo[0])
            if why is None:
                self._step(n, todo.popleft(), marked)
            elif why[0] == "wait":
                break
            else:
                marked[n] = todo[0]
                raise ValidationError("out-of-order" if why[0] == "order" else "use-before-produce", why[1])

    def _advance_timed(self, n: int, todo: deque) -> None:
        """`_advance` for a stream already validated: the same times and messages,
        no checks and no record but the order it ran."""
        st, channels, duration, latency = self.nodes[n], self.channels, self.cost.duration, self.cost.latency
        clock = st.clock
        while todo:
            ins = todo[0]
            op = ins.op
            if op in RECVS:
                q = channels.get((ins.peer, n, RECVS[op]))
                if not q:
                    break
                sent, arrival, _ = q.popleft()
                if sent.stage != ins.stage or sent.mb != ins.mb:
                    raise ValidationError("out-of-order",
                                          f"node {n} expects {ins} but node {ins.peer} sent {sent} first")
                start = clock if clock > arrival else arrival
            else:
                start = clock
            end = start + duration(ins)
            if op in SENDS:
                channels[(n, ins.peer, op)].append((ins, end + latency(ins), end))
                self.wake(ins.peer)
            st.busy += end - start
            clock = end
            st.done.append(todo.popleft())
        st.clock = clock

    def _step(self, node: int, ins: Instr, marked: dict[int, Instr]) -> None:
        try:
            self.execute(node, ins)
        except ValidationError:
            marked[node] = ins
            raise

    def _schedule_one(self, fixed: dict, chains: dict, marked: dict[int, Instr]) -> bool:
        best = None
        for n, (heads, _) in chains.items():
            if fixed[n]:
                continue
            for ci, chain in enumerate(heads):
                if self.missing(n, chain[0]) is None:
                    key = (self.start_time(n, chain[0]), ci, n)
                    if best is None or key < best[0]:
                        best = (key, n, chain)
        if best is None:
            return False
        _, n, chain = best
        self._step(n, chain.popleft(), marked)
        self.wake(n)
        chains[n] = ([c for c in chains[n][0] if c], chains[n][1])
        return True

    def _finish(self, fixed: dict, chains: dict, allow_stuck: bool, marked: dict[int, Instr],
                lean: bool = False) -> Report:
        live = [n for n in self.nodes if n != self.dead_node]
        stuck = {n: (fixed[n][0] if fixed[n] else "a chain") for n in live if fixed[n] or n in chains}
        if stuck and not allow_stuck:
            marked.update({n: i for n, i in stuck.items() if isinstance(i, Instr)})
            raise ValidationError("deadlock", "; ".join(f"node {n} blocked at {i}" for n, i in stuck.items()))
        if not allow_stuck and not lean:
            self.checks.at_end(live)
        makespan = max((self.nodes[n].clock for n in live), default=0.0)
        return Report(
            makespan=makespan,
            busy={n: self.nodes[n].busy for n in live},
            bubble={n: (1 - self.nodes[n].busy / makespan) if makespan else 0.0 for n in live},
            peak_live={n: self.nodes[n].peak_live for n in live},
            peak_swapped={n: self.nodes[n].peak_swapped for n in live},
            spans=self.spans,
            messages=self.messages,
            streams={n: list(st.done) for n, st in self.nodes.items()},
            finished={n: n not in stuck for n in live})


def validate(layout: Layout, microbatches: int, streams: dict[int, list[Instr]],
             cost: CostModel | None = None, dead: tuple[int, int] | None = None,
             expect_frc: bool = True) -> Report:
    """Run `streams`; raise ValidationError on the first broken check, else report."""
    return Engine(layout, microbatches, cost, dead, expect_frc).run(streams)
