"""A discrete-event simulator that also validates: runs instruction streams on a cost model.

Each node executes its stream serially. Sends are asynchronous (the message lands
in a FIFO channel per (sender, receiver) pair after the transfer latency);
receives block until the next message on their channel arrives, and that message
must be the one they expect (NCCL and gloo pair point-to-point calls in order).
Every instruction's inputs must exist on the node when it starts. At the end every
stage's gradients must hold every microbatch exactly once, every stage is stepped
on its owner and replica holder, and no message is left unreceived. An
evaluation (forward-only) run keeps no forward state and checks instead that
every stage ran every microbatch's forward exactly once, on its owner.

A node may also be *list scheduled*: instead of one fixed stream it has a few
chains, and whenever it can run the head of more than one chain the simulator
picks the one that can start first. The compiler uses this to merge instruction
groups; the result is the order the node actually ran, a plain stream again.
"""
from __future__ import annotations

from collections import Counter, defaultdict, deque
from dataclasses import dataclass, field
from typing import NamedTuple

from schedules.cost import CostModel
from schedules.ir import RECVS, SENDS, Instr, Op, channel
from schedules.layout import Layout, ScheduleError

COMPUTE = frozenset({Op.FORWARD, Op.BACKWARD, Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT})


class ValidationError(ScheduleError):
    """A stream that cannot run: `kind` is deadlock, out-of-order, use-before-produce,
    unmatched, exactly-once, not-stepped, leak, missing-frc, or frc-delay (an FRC
    that lengthens the fault-free iteration under --frc bubbles: bubbles.py)."""

    def __init__(self, kind: str, message: str):
        super().__init__(f"{kind}: {message}")
        self.kind = kind


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
class _Node:
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


class Simulator:
    def __init__(self, layout: Layout, microbatches: int, cost: CostModel | None = None,
                 dead: tuple[int, int] | None = None, expect_frc: bool = True, evaluation: bool = False,
                 late_sync: bool = False, expect_syncs: bool = True):
        self.layout = layout
        self.P = layout.stages
        self.M = microbatches
        self.cost = cost or CostModel()
        self.dead_node, self.dead_at = dead if dead else (None, None)
        self.expect_frc = expect_frc  # False for streams before the FRC pass
        self.evaluation = evaluation  # forward-only streams: no state kept, nothing stepped
        self.late_sync = late_sync    # each replica's sync is the iteration before's (schedules/syncs.py)
        self.expect_syncs = expect_syncs  # False for streams before the late syncs are placed
        self.nodes = {n: _Node(layers=frozenset(layout.owned(n)) | {layout.replica(n)} - {None})
                      for n in layout.alive}
        self.channels: dict[tuple, deque] = defaultdict(deque)
        self.normal_forwards: Counter = Counter()
        self.spans: list[Span] = []
        self.messages: list[Message] = []
        # For list-scheduled senders: the order in which each fixed receiver takes
        # their messages, so that the chosen order keeps every channel FIFO.
        self.expected: dict[tuple, deque] = {}

    # -- one instruction -------------------------------------------------------------
    def missing(self, node: int, ins: Instr) -> tuple[str, str] | None:
        """Why `ins` cannot start now on `node`: ("wait", ..) for a message not yet
        sent, ("order" | "data", reason) for a broken stream; None when it can."""
        st, op, s, mb = self.nodes[node], ins.op, ins.stage, ins.mb
        if op in RECVS:
            return self._not_received(node, ins)
        if op in SENDS and channel(ins, node) in self.expected:
            q = self.expected[channel(ins, node)]
            if not q or q[0] != (SENDS[op], s, mb):
                return ("order", f"node {node} sends {ins} but node {ins.peer} expects "
                        f"{q[0] if q else 'nothing more'} first")
        need = None
        if op is Op.LOAD:
            need = mb in st.loaded and f"microbatch {mb} loaded twice"
        elif op in COMPUTE and (s in st.reduced or (s, True) in st.stepped and not self.late_sync):
            need = f"stage {s} computes after its gradients were reduced or its step was taken"
        elif (op in COMPUTE and self.late_sync and s == self.layout.replica(node)
              and (s, True) not in st.stepped):
            need = f"stage {s} computed on its replica before it took the sync of the iteration before"
        elif op is Op.FORWARD:
            if s not in st.layers:
                need = f"does not hold the layers of stage {s}"
            elif (s == 0 or s == self.P - 1) and mb not in st.loaded:
                need = f"microbatch {mb} not loaded"
            elif s > 0 and (s - 1, mb) not in st.acts:
                need = f"no input activation (stage {s - 1}, mb {mb})"
            elif (s, mb) in st.states:
                need = f"forward state (stage {s}, mb {mb}) computed twice"
        elif op in (Op.BACKWARD, Op.BACKWARD_INPUT):
            if s not in st.layers:
                need = f"does not hold the layers of stage {s}"
            elif st.states.get((s, mb)) is not True:
                need = f"no resident forward state (stage {s}, mb {mb})"
            elif s < self.P - 1 and (s + 1, mb) not in st.grads:
                need = f"no output gradient (stage {s + 1}, mb {mb})"
        elif op is Op.BACKWARD_WEIGHT:
            need = st.states.get((s, mb)) != "weights" and f"no input gradient's pass before (stage {s}, mb {mb})"
        elif op is Op.SEND_ACT:
            need = (s, mb) not in st.acts and f"no activation (stage {s}, mb {mb}) to send"
        elif op is Op.SEND_GRAD:
            need = (s, mb) not in st.grads and f"no gradient (stage {s}, mb {mb}) to send"
        elif op is Op.SWAP_OUT:
            need = st.states.get((s, mb)) is not True and f"nothing resident to swap out ({s}, {mb})"
        elif op is Op.SWAP_IN:
            need = st.states.get((s, mb)) is not False and f"nothing swapped out to swap in ({s}, {mb})"
        elif op is Op.REDUCE_GRADS:
            need = s in st.reduced and f"stage {s} reduced twice"
        elif op is Op.SEND_SYNC and self.late_sync:
            need = s in st.reduced and f"stage {s}: the sync of the iteration before sent after this one's reduce"
        elif op is Op.SEND_SYNC:
            need = s not in st.reduced and f"stage {s} synced before it was reduced"
        elif op is Op.OPTIMIZER_STEP:
            ready = st.synced if ins.redundant else st.reduced
            need = (s not in ready or (s, ins.redundant) in st.stepped) and f"stage {s} stepped without gradients"
        return ("data", f"node {node}: {ins}: {need}") if need else None

    def _not_received(self, node: int, ins: Instr) -> tuple[str, str] | None:
        """`missing` for a receive: its message not sent yet, or another first."""
        q = self.channels.get(channel(ins, node))
        if not q:
            return ("wait", f"node {node} waits for {ins}")
        sent = q[0][0]
        if sent.op is not RECVS[ins.op] or sent.stage != ins.stage or sent.mb != ins.mb:
            return ("order", f"node {node} expects {ins} but node {ins.peer} sent {sent} first")
        return None

    def start_time(self, node: int, ins: Instr) -> float:
        clock = self.nodes[node].clock
        return max(clock, self.channels[channel(ins, node)][0][1]) if ins.op in RECVS else clock

    def execute(self, node: int, ins: Instr) -> None:
        st, op, key = self.nodes[node], ins.op, (ins.stage, ins.mb)
        start = self.start_time(node, ins)
        end = start + self.cost.duration(ins)
        if op in RECVS:
            sent, _, sent_at = self.channels[channel(ins, node)].popleft()
            self.messages.append(Message(ins.peer, node, sent, sent_at, end))
        if op in SENDS:
            self.channels[channel(ins, node)].append((ins, end + self.cost.latency(ins), end))
            if channel(ins, node) in self.expected:
                self.expected[channel(ins, node)].popleft()
        if op is Op.LOAD:
            st.loaded.add(ins.mb)
        elif op is Op.FORWARD and self.evaluation:
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
            self._check_exactly_once(node, ins.stage, st.accum[ins.stage])
            st.reduced.add(ins.stage)
        elif op is Op.OPTIMIZER_STEP:
            st.stepped.add((ins.stage, ins.redundant))
        elif op is Op.RECV_SYNC:
            st.synced.add(ins.stage)
        st.peak_live = max(st.peak_live, st.live)
        st.peak_swapped = max(st.peak_swapped, st.swapped)
        st.clock, st.busy = end, st.busy + (end - start)
        st.done.append(ins)
        self.spans.append(Span(node, start, end, ins))

    def _check_exactly_once(self, node: int, stage: int, mbs: list[int]) -> None:
        counts = Counter(mbs)
        lost = [mb for mb in range(self.M) if counts[mb] == 0]
        twice = sorted(mb for mb, c in counts.items() if c > 1)
        if lost or twice:
            raise ValidationError("exactly-once", f"node {node} reduces stage {stage} with microbatches "
                                  f"missing {lost} and counted twice {twice}")

    # -- whole streams ---------------------------------------------------------------
    def run(self, streams: dict[int, list[Instr]], scheduled: dict[int, Chains] | None = None,
            allow_stuck: bool = False) -> Report:
        scheduled = scheduled or {}
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
        while True:
            progress = False
            for n, todo in fixed.items():
                while todo:
                    why = self.missing(n, todo[0])
                    if why is None:
                        self.execute(n, todo.popleft())
                        progress = True
                    elif why[0] == "wait":
                        break
                    elif why[0] == "order":
                        raise ValidationError("out-of-order", why[1])
                    else:
                        raise ValidationError("use-before-produce", why[1])
                if not todo and n in chains and not chains[n][0]:
                    fixed[n] = chains.pop(n)[1]
                    progress = True
            if not progress and not self._schedule_one(fixed, chains):
                break
        return self._finish(fixed, chains, allow_stuck)

    def _schedule_one(self, fixed: dict, chains: dict) -> bool:
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
        self.execute(n, chain.popleft())
        chains[n] = ([c for c in chains[n][0] if c], chains[n][1])
        return True

    def _finish(self, fixed: dict, chains: dict, allow_stuck: bool) -> Report:
        live = [n for n in self.nodes if n != self.dead_node]
        stuck = {n: (fixed[n][0] if fixed[n] else "a chain") for n in live if fixed[n] or n in chains}
        if stuck and not allow_stuck:
            raise ValidationError("deadlock", "; ".join(f"node {n} blocked at {i}" for n, i in stuck.items()))
        if not allow_stuck:
            self._check_end(live)
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

    def _check_end(self, live: list[int]) -> None:
        for (src, dst, _), q in self.channels.items():
            if q and self.dead_node not in (src, dst):
                raise ValidationError("unmatched", f"node {src} sent {q[0][0]} to node {dst}, never received")
        if self.evaluation:
            self._check_forwards()
            return
        final = self.layout if self.dead_node is None else self.layout.with_failed(self.dead_node)
        reducers = Counter(s for n in live for s in self.nodes[n].reduced)
        for s in range(self.P):
            if reducers[s] > 1:
                raise ValidationError("exactly-once", f"stage {s} reduced on {reducers[s]} nodes")
            owner, holder = final.owner(s), final.holder(s)
            if self.late_sync:  # the syncs in the streams are to the holders the iteration began with
                holder = self.layout.holder(s) if self.layout.holder(s) != self.dead_node else None
            if not self.nodes[owner].stepped & ({(s, False)} if self.late_sync else {(s, False), (s, True)}):
                raise ValidationError("not-stepped", f"stage {s} never stepped on its owner, node {owner}")
            if holder is not None and self.expect_syncs and (s, True) not in self.nodes[holder].stepped:
                raise ValidationError("not-stepped", f"replica of stage {s} on node {holder} never stepped")
        for n in live:
            st, r = self.nodes[n], final.replica(n)
            left = sorted(k for k, resident in st.states.items() if resident)
            if left:
                raise ValidationError("leak", f"node {n} ends with forward state {left[0]} still resident")
            missing = [mb for mb in range(self.M) if self.expect_frc and r is not None and (r, mb) not in st.frc]
            if missing:
                raise ValidationError("missing-frc", f"node {n} never ran FRC of stage {r} for microbatch {missing[0]}")
        twice = sorted(k for k, c in self.normal_forwards.items() if c > 1)
        if twice:
            raise ValidationError("exactly-once", f"forward (stage, mb) {twice[0]} computed twice as normal work")


    def _check_forwards(self) -> None:
        """Evaluation: every (stage, mb) forwarded exactly once, by the stage's owner."""
        for s in range(self.P):
            owner = self.nodes[self.layout.owner(s)]
            for mb in range(self.M):
                if self.normal_forwards[(s, mb)] != 1 or (s, mb) not in owner.acts:
                    raise ValidationError("exactly-once", f"evaluation forward (stage {s}, mb {mb}) ran "
                                          f"{self.normal_forwards[(s, mb)]} times or not on its owner")


def validate(layout: Layout, microbatches: int, streams: dict[int, list[Instr]],
             cost: CostModel | None = None, dead: tuple[int, int] | None = None,
             expect_frc: bool = True) -> Report:
    """Simulate `streams`; raise ValidationError on the first problem, else report."""
    return Simulator(layout, microbatches, cost, dead, expect_frc).run(streams)


def start_times(streams: dict[int, list[Instr]], cost: CostModel) -> dict[int, list[float]]:
    """Start time of every instruction, assuming the streams are valid. A lean copy of
    the simulator's timing rule with no checks, fast enough for the compile path."""
    channels: dict[tuple, deque] = defaultdict(deque)
    pcs = {n: 0 for n in streams}
    clocks = {n: 0.0 for n in streams}
    starts: dict[int, list[float]] = {n: [] for n in streams}
    duration, latency = cost.duration, cost.latency
    progress = True
    while progress:
        progress = False
        for n, stream in streams.items():
            pc, clock, out = pcs[n], clocks[n], starts[n]
            while pc < len(stream):
                ins = stream[pc]
                op = ins.op
                if op in RECVS:
                    q = channels[(ins.peer, n, RECVS[op])]
                    if not q:
                        break
                    arrival = q.popleft()
                    start = clock if clock > arrival else arrival
                else:
                    start = clock
                out.append(start)
                clock = start + duration(ins)
                if op in SENDS:
                    channels[(n, ins.peer, op)].append(clock + latency(ins))
                pc += 1
            progress |= pc != pcs[n]
            pcs[n], clocks[n] = pc, clock
    if any(pcs[n] < len(s) for n, s in streams.items()):
        raise ValidationError("deadlock", "streams do not complete")
    return starts
