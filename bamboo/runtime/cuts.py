"""Where a dead node's stream was cut: the instruction before which it died, from
the messages of it its peers received (each counts what it got on every channel).
Kept apart from the failover (bamboo/runtime/failover.py), which asks it once the
channels from the dead node settled."""
from __future__ import annotations

from collections import Counter

from schedules.ir import Instr, Op, SENDS


class Unsurvivable(RuntimeError):
    """A failure this pipeline cannot recover from inside the iteration."""


def died_before(stream: list[Instr], received: dict[int, dict[str, int]], late: bool = False) -> int:
    """k such that the dead node's sends before k all arrived and none after did.
    `received[peer][kind]` counts what `peer` got from it this iteration. `late`
    (--replica-sync next): the iteration before's sync, on a channel of its own,
    may be overtaken by later sends; if it has not arrived its replica is behind."""
    seen: Counter = Counter()
    k = 0
    arrived_all_so_far = True
    for i, ins in enumerate(stream):
        if ins.op not in SENDS:
            continue
        n = seen[(ins.peer, ins.op)]
        seen[(ins.peer, ins.op)] += 1
        got = received.get(ins.peer, {}).get(ins.op.value, 0) > n
        if late and ins.op is Op.SEND_SYNC:
            if not got:
                raise Unsurvivable(f"its sync of the iteration before ({ins}) had not arrived: that replica of its "
                                   "stage is then a step behind (--replica-sync next)")
            k = max(k, i + 1)
        elif got:
            if not arrived_all_so_far:
                raise Unsurvivable(f"node's messages arrived out of order (a later one, {ins}, "
                                   "arrived after an earlier one was lost)")
            k = i + 1
        else:
            arrived_all_so_far = False
    return k
