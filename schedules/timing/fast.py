"""The engine's timing rule without its checks (schedules/timing/engine.py runs the
same streams with every check): when each instruction starts, and when the last
node ends, for streams valid by construction. The compiler times thousands of
candidate streams on its path (FRC in the bubbles, the backward split, the late
sync's place), so this pass makes one dictionary look-up an instruction.
"""
from __future__ import annotations

from bisect import bisect_left
from collections import defaultdict, deque
from functools import partial

from schedules.timing.checks import ValidationError
from schedules.cost import CostModel
from schedules.ir import RECVS, SENDS, Instr, Op

_RECV, _SEND, _OTHER = "recv", "send", "other"
_KIND = {op: _RECV if op in RECVS else _SEND if op in SENDS else _OTHER for op in Op}
_NOWHERE = partial(deque, maxlen=0)  # appending to it keeps nothing, in C


def start_times(streams: dict[int, list[Instr]], cost: CostModel,
                begin: dict[int, float] | None = None) -> dict[int, list[float]]:
    """Start time of every instruction, assuming the streams are valid. A lean copy of
    the engine's timing rule with no checks, fast enough for the compile path.
    `begin`: nodes that start before 0 (compute run ahead, schedules/overlap.py);
    nothing they send leaves before 0, when the iteration's agreement is in."""
    starts: dict[int, list[float]] = {n: [] for n in streams}
    _time(streams, cost, begin, starts)
    return starts


def finish_time(streams: dict[int, list[Instr]], cost: CostModel) -> float:
    """When the last node ends its stream, by `start_times`' rule, keeping no start (a
    compile's searches time a whole iteration for each place they try)."""
    clocks = _time(streams, cost, None, {n: _NOWHERE() for n in streams})
    return max((clocks[n] for n, s in streams.items() if s), default=0.0)


def _time(streams: dict[int, list[Instr]], cost: CostModel, begin: dict[int, float] | None,
          starts: dict) -> dict[int, float]:
    """Run the streams, appending each instruction's start to `starts[node]`; each
    node's clock at its end."""
    clocks = {n: (begin or {}).get(n, 0.0) for n in streams}
    return _run(streams, cost, {n: 0 for n in streams}, clocks, defaultdict(deque), starts)


def _run(streams: dict[int, list[Instr]], cost: CostModel, pcs: dict[int, int], clocks: dict[int, float],
         channels: dict[tuple, deque], starts: dict) -> dict[int, float]:
    """Run the streams from each node's `pcs` at its clock, with the messages in
    flight in `channels` ((sender, receiver, kind) -> arrivals, oldest first). One
    look-up an instruction: its kind, duration, channel and flight time, kept by the
    cost model (`timing_table`)."""
    known, duration = cost.timing_table(), cost.duration
    transfer, sync_transfer, send_sync = cost.transfer, cost.sync_transfer, Op.SEND_SYNC
    recv, send = _RECV, _SEND
    progress = True
    while progress:
        progress = False
        for n, stream in streams.items():
            pc, clock, out = pcs[n], clocks[n], starts[n]
            end = len(stream)
            while pc < end:
                ins = stream[pc]
                facts = known.get(ins)
                if facts is None:
                    facts = known[ins] = _facts(ins, duration(ins), sync_transfer if ins.op is send_sync else transfer)
                kind, d, chan, flight = facts
                if kind is recv:
                    q = channels[(ins.peer, n, chan)]
                    if not q:
                        break
                    arrival = q.popleft()
                    start = clock if clock > arrival else arrival
                else:
                    start = clock
                out.append(start)
                clock = start + d
                if kind is send:
                    channels[(n, ins.peer, chan)].append((clock if clock >= 0.0 else 0.0) + flight)
                pc += 1
            progress |= pc != pcs[n]
            pcs[n], clocks[n] = pc, clock
    if any(pcs[n] < len(s) for n, s in streams.items()):
        raise ValidationError("deadlock", "streams do not complete")
    return clocks


def _facts(ins: Instr, duration: float, flight: float) -> tuple:
    """What the timing pass needs of an instruction: its kind, its duration, the
    channel it sends or receives on, its message's flight time."""
    kind = _KIND[ins.op]
    return kind, duration, RECVS[ins.op] if kind is _RECV else ins.op, flight


class Timed:
    """One iteration's timing, kept so that a trial changed only from some place on
    (a compile's search: a split backward, a late sync's place) is timed from
    there. Nothing that starts before the earliest change ends can move: a start
    is the max of the node's clock and a message's arrival, and a change only ever
    reaches later instructions through them. So the trial resumes every node at
    its first instruction starting from then on, with the messages in flight at
    that point, and gives the same number as timing it whole (finish_time)."""

    def __init__(self, streams: dict[int, list[Instr]], cost: CostModel):
        self.streams, self.cost = dict(streams), cost  # the nodes' lists as they are now
        self.starts = start_times(streams, cost)
        self._known = cost.timing_table()  # by now it holds every instruction of `streams`
        self.makespan = max((self.end(n, len(s) - 1) for n, s in streams.items() if s), default=0.0)
        self._messages: tuple[dict, dict] | None = None  # see _in_flight: made at the first trial

    def end(self, node: int, pc: int) -> float:
        """When the node's instruction `pc` ends (0.0 before its first)."""
        return self.starts[node][pc] + self._known[self.streams[node][pc]][1] if pc >= 0 else 0.0

    def finish(self, trial: dict[int, list[Instr]], changed: dict[int, int]) -> float:
        """`finish_time(trial)`, where `trial` differs from the kept streams only on
        the nodes of `changed`, each from its position `changed[node]` on."""
        if not changed:
            return self.makespan  # the kept streams themselves
        since = min(self.end(n, at - 1) for n, at in changed.items())
        pcs = {n: bisect_left(self.starts[n], since) for n in trial}
        clocks = {n: self.end(n, pc - 1) for n, pc in pcs.items()}
        clocks = _run(trial, self.cost, pcs, clocks, self._in_flight(since), {n: _NOWHERE() for n in trial})
        return max((clocks[n] for n, s in trial.items() if s), default=0.0)

    def _in_flight(self, since: float) -> dict[tuple, deque]:
        """The messages sent before `since` that no receive before it took, by channel."""
        if self._messages is None:
            sent: dict[tuple, tuple[list[float], list[float]]] = defaultdict(lambda: ([], []))  # starts, arrivals
            taken: dict[tuple, list[float]] = defaultdict(list)  # the starts of a channel's receives
            known = self._known
            for n, stream in self.streams.items():
                for ins, start in zip(stream, self.starts[n]):
                    kind, d, chan, flight = known[ins]
                    if kind is _SEND:
                        starts, arrivals = sent[(n, ins.peer, chan)]
                        starts.append(start)
                        end = start + d
                        arrivals.append((end if end >= 0.0 else 0.0) + flight)
                    elif kind is _RECV:
                        taken[(ins.peer, n, chan)].append(start)
            self._messages = sent, taken
        sent, taken = self._messages
        channels: dict[tuple, deque] = defaultdict(deque)
        for key, (starts, arrivals) in sent.items():
            first, last = bisect_left(taken.get(key, ()), since), bisect_left(starts, since)
            if last > first:
                channels[key] = deque(arrivals[first:last])
        return channels
