"""Capacity as a decision: the trace says which nodes the cloud has free, the job
holds those it asks for, gives back those it does not need and asks again when it
does.

A node the trace adds is taken at once while the job's standing request (its
desired capacity, as an autoscaling group keeps it) is above what it holds, as
the cloud fills a request when capacity appears; otherwise it stays free. A node
the job releases stops being paid at once and joins the free ones. A node asked
for from the free ones comes `--acquire-seconds` later, if the trace still has it
free then; it is paid from the request (its boot is billed), booked as an
acquisition wait. A free node the trace removes costs the job nothing.

Also here: how trace events are grouped for the event loop (simultaneous
batches, notices, acquisitions).
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from sim.traces import Event

ACQUIRE = "acquire"  # an event of the loop's own: requested nodes come (`node` holds the count)


@dataclass
class Capacity:
    free: dict[str, str] = field(default_factory=dict)  # node -> zone: the trace has it, the job does not
    desired: int | None = None  # the standing request: nodes the job wants to hold (None: all it is granted)
    arriving: int = 0         # nodes asked for from the free ones, not yet here (paid)
    waiting: int = 0          # held nodes in no pipeline kept for the nodes asked for
    short_since: float | None = None  # since when a request stood that nothing could fill
    released: int = 0         # nodes given back, so far
    acquired: int = 0         # nodes that came from a request, so far

    def wants(self, held: int) -> bool:
        """Whether a node the trace adds now is taken: the request is not yet met."""
        return self.desired is None or held + self.arriving < self.desired

    def request(self, queue: list[Event], now: float, count: int, delay: float) -> None:
        """Ask for `count` of the free nodes: they come `delay` seconds from `now`."""
        count = min(count, len(self.free) - self.arriving)
        if count > 0:
            self.arriving += count
            bisect.insort(queue, Event(now + delay, ACQUIRE, str(count)), key=lambda e: e.time)

    def arrive(self, count: int, held_zones: list[str]) -> dict[str, str]:
        """The `count` requested nodes come, from the free ones still there: those
        in the zones the job holds fewest nodes in first."""
        self.arriving -= count
        load = {zone: held_zones.count(zone) for zone in self.free.values()}
        got: dict[str, str] = {}
        while self.free and len(got) < count:
            node = min(self.free, key=lambda n: (load[self.free[n]], self.free[n], n))
            got[node] = self.free.pop(node)
            load[got[node]] += 1
        self.acquired += len(got)
        return got

    def describe(self) -> dict:
        return {"nodes_released": self.released, "nodes_acquired": self.acquired}


def next_batch(queue: list[Event], window: float) -> list[Event]:
    """Take the next events that land together off the queue: those at the first
    one's time, and removals within `window` (one iteration) of it. Notices at one
    time, and each acquisition, form a batch of their own."""
    batch = [queue.pop(0)]
    if batch[0].action == ACQUIRE:
        return batch
    if batch[0].action == "notice":
        while queue and queue[0].action == "notice" and queue[0].time == batch[0].time:
            batch.append(queue.pop(0))
        return batch
    while queue and queue[0].action in ("add", "remove") and (
            queue[0].time == batch[0].time or (queue[0].action == "remove" and queue[0].time - batch[0].time < window)):
        batch.append(queue.pop(0))
    return batch


def with_notices(events: list[Event], seconds: float) -> list[Event]:
    """`events` with a "notice" `seconds` before each removal (not before the node's
    arrival), sorted by time; a notice sorts before other events at its time."""
    if seconds <= 0:
        return events
    added: dict[str, float] = {}
    notices = []
    for e in events:
        if e.action == "add":
            added[e.node] = e.time
        elif e.action == "remove":
            notices.append(Event(max(e.time - seconds, added.get(e.node, 0.0)), "notice", e.node, e.zone))
    return sorted(events + notices, key=lambda e: (e.time, e.action != "notice"))
