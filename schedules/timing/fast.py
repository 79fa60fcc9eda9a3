"""The engine's timing rule without its checks (schedules/timing/engine.py runs the
same streams with every check): when each instruction starts, and when the last
node ends, for streams valid by construction. The compiler times thousands of
candidate streams on its path (FRC in the bubbles, the backward split, the late
sync's place), so this pass makes one dictionary look-up an instruction.
"""
from __future__ import annotations

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
    node's clock at its end. One look-up an instruction: its kind, duration, channel
    and flight time, kept by the cost model (`timing_table`)."""
    channels: dict[tuple, deque] = defaultdict(deque)
    pcs = {n: 0 for n in streams}
    clocks = {n: (begin or {}).get(n, 0.0) for n in streams}
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
                    kind = _KIND[ins.op]
                    facts = known[ins] = (kind, duration(ins), RECVS[ins.op] if kind is recv else ins.op,
                                          sync_transfer if ins.op is send_sync else transfer)
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
