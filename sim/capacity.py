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

`settle` applies the surplus rule after each batch of events; also here: how
trace events are grouped for the event loop (simultaneous
batches, notices, acquisitions).
"""
from __future__ import annotations

import bisect
from collections import Counter
from dataclasses import dataclass, field

from agents.policy import Config
from agents.surplus import Economics, SurplusRule, assign_surplus, standby_count
from sim.accounting import RunState
from sim.memo import ByIdentity
from sim.options import PACK, SPREAD
from sim.reconfiguration import shape, used_nodes
from sim.traces import Event

ACQUIRE = "acquire"  # an event of the loop's own: requested nodes come (`node` holds the count)
ALL = 10 ** 9        # a request for every node the trace has


@dataclass
class Capacity:
    free: dict[str, str] = field(default_factory=dict)  # node -> zone: the trace has it, the job does not
    desired: int | None = None  # the standing request: nodes the job wants to hold (None: all it is granted)
    arriving: int = 0         # nodes asked for from the free ones, not yet here (paid)
    waiting: bool = False     # the held nodes in no pipeline are kept for the nodes asked for
    give_up_at: float | None = None  # when a request that nothing could fill is given up
    released: int = 0         # nodes given back, so far
    acquired: int = 0         # nodes that came from a request, so far

    def wants(self, held: int) -> bool:
        """Whether a node the trace adds now is taken: the request is not yet met."""
        return self.desired is None or held + self.arriving < self.desired

    def short_of(self, held: int) -> bool:
        """Whether the job holds fewer than it asked for: its nodes in no pipeline
        wait for the newcomers (they are paid either way) instead of going."""
        return self.desired is not None and held < self.desired

    def request(self, queue: list[Event], now: float, count: int, delay: float) -> None:
        """Ask for `count` of the free nodes: they come `delay` seconds from `now`."""
        count = min(count, len(self.free) - self.arriving)
        if count > 0:
            self.arriving += count
            bisect.insort(queue, Event(now + delay, ACQUIRE, str(count)), key=lambda e: e.time)

    def arrive(self, count: int, held: dict[str, str]) -> dict[str, str]:
        """The `count` requested nodes come, from the free ones still there: those
        in the zones the job holds fewest nodes in first (`held`: node -> zone), as
        the standby is placed."""
        self.arriving -= count
        got = {n: self.free.pop(n) for n in assign_surplus(self.free, held, count).standby}
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


def settle(sim, s: RunState, config: Config | None, live: dict[str, str], queue: list[Event]) -> None:
    """After a batch, the surplus rule (agents/surplus.py) on `sim`'s run: keep the
    standby it asks for and release the other nodes in no pipeline, unless they
    wait for nodes asked for; ask for free nodes that would train. The request
    stands as a group's desired capacity does: a preemption leaves it (the lost
    node is replaced), a release lowers it."""
    cap = sim.capacity
    if sim.opt.surplus == SurplusRule.KEEP:
        return
    if not sim.running(config):  # too few nodes to train: they hold the state, and all are wanted
        cap.desired, cap.waiting, cap.give_up_at = None, False, None
    else:
        usable, used = sim.usable(live), used_nodes(config)
        idle = {n: usable[n] for n in usable.keys() - used}  # in no pipeline (the order is never read)
        standby = standby_of(sim, s, config, len(idle) + len(cap.free), len(live))
        useful = max(len(used), placed_with(sim, config, {**usable, **cap.free}) if cap.free else 0) + standby
        cap.desired = max(len(live) + cap.arriving if cap.desired is None else cap.desired, useful)
        given_up = _given_up(cap, s.t, len(live), queue, sim.opt.acquire_seconds)
        if given_up:
            cap.desired = useful  # what is held beyond it goes below
        cap.waiting = cap.short_of(len(live))  # for the nodes asked for
        if not cap.waiting:
            for n in assign_surplus(idle, dict(zip(used, map(live.__getitem__, used))), standby).release:
                cap.free[n] = live.pop(n)
                cap.desired -= 0 if given_up else 1  # a release lowers the request (after a give-up: lowered)
                cap.released += 1
                sim.copies = {stage: held - {n} for stage, held in sim.copies.items()}
    wanted = ALL if cap.desired is None else cap.desired
    cap.request(queue, s.t, wanted - len(live) - cap.arriving, sim.opt.acquire_seconds)


def _given_up(cap: Capacity, now: float, held: int, queue: list[Event], delay: float) -> bool:
    """Whether a request nothing can fill (no node free, none coming) has stood for
    `delay` (--acquire-seconds): the nodes waiting for it are then released.
    Waiting no longer than a re-acquisition costs is the ski-rental rule: it pays
    at most twice what knowing when capacity returns would."""
    if held + cap.arriving >= (cap.desired or 0) or cap.arriving or cap.free:
        cap.give_up_at = None
        return False
    if cap.give_up_at is None:
        cap.give_up_at = now + delay
        bisect.insort(queue, Event(cap.give_up_at, ACQUIRE, "0"), key=lambda e: e.time)  # look again then
    if now < cap.give_up_at:
        return False
    cap.give_up_at = None
    return True


def standby_of(sim, s: RunState, config: Config, limit: int, paid: int) -> int:
    """The standby the surplus rule keeps, of at most `limit` nodes beyond the
    pipelines of `config`, weighed (burst rule) by what each missing node costs it:
    the throughput of the policy's next configuration with one more of its nodes
    gone, as a burst takes them."""
    used = used_nodes(config)
    order = sim.burst_order(used)
    doomed = tuple(n for n in order if n in sim.noticed) if sim.noticed else ()
    mode = sim.rules.redundancy
    spread = spread_only(sim)

    def throughput(gone: int) -> float:
        if not gone:
            return sim.config_throughput(config)
        lost = set(order[:gone]).union(doomed)

        def after() -> float:
            left = [n for n in order if n not in lost]
            return sim.config_throughput(sim.next_config(dict(zip(left, map(sim.zones.__getitem__, left))), config))
        # which nodes are left turns on the pipelines, the zones (fixed in a run) and the notices; where the
        # policy only spreads, what it forms of them turns on each pipeline's shape and survivors (`survivors`)
        key = (config.depth, survivors(config, lost), len(order) - len(lost)) if spread else \
            (config.pipelines, gone, doomed)
        return sim.decided.get(("burst", *key, mode, sim.compiled_sync(mode)), after)
    return standby_count(SurplusRule(sim.opt.surplus), sim.bursts_seen(s, len(used)), sim.opt.acquire_seconds,
                         sim.opt.standby_epsilon, len(used), limit, Economics(throughput, paid + sim.capacity.arriving),
                         sim.opt.fixed_standby)


def placed_with(sim, config: Config, nodes: dict[str, str]) -> int:
    """How many of `nodes` (node -> zone) the policy's next configuration after
    `config` puts in pipelines. With every node of `config` among them (and each
    node its own host, as in the simulator) that count turns only on `config`'s
    pipelines and how many nodes there are: the policy keeps the pipelines that fit
    the lengths `pipeline_lengths` gives and forms the others whichever the nodes.
    Where it only spreads pipelines (`spread_only`), it turns only on their shapes."""
    def count() -> int:
        wider = sim.next_config(nodes, config)
        return len(used_nodes(wider)) if sim.running(wider) else 0
    if not used_nodes(config) <= nodes.keys():
        return count()
    pipelines = outline(config.pipelines)[0] if spread_only(sim) else config.pipelines
    mode = sim.rules.redundancy
    return sim.decided.get(("placed", config.depth, pipelines, len(nodes), mode, sim.compiled_sync(mode)), count)


def spread_only(sim) -> bool:
    """Whether the policy only spreads pipelines over zones (never packs them): the
    spread takes nodes round robin over zones, as many as asked while any are left,
    and fills a hole while a spare is left (each node its own host), and every
    estimate it weighs is by shape, so what it forms turns on counts and shapes."""
    return sim.opt.zone_spread != PACK and (sim.opt.zone_spread == SPREAD or not sim.opt.cross_zone_price)


def survivors(config: Config, lost: set[str]) -> tuple:
    """Each pipeline's shape, and how many nodes the pipelines that lost any lost
    (by index) when `lost` go: what the policy's next configuration after `config`
    turns on, where it only spreads. It keeps the whole pipelines it wants, mends the
    full ones with the most survivors (holes filled in order while spares last) and
    forms new ones from the rest by count. Counted from the few lost, not the many left."""
    shapes, where = outline(config.pipelines)
    return shapes, tuple(sorted(Counter(map(where.__getitem__, lost)).items()))


def _outline(pipelines: tuple[tuple[str, ...], ...]) -> tuple[tuple[tuple[int, ...], ...], dict[str, int]]:
    """Each pipeline's shape and, by node, the index of its pipeline."""
    return tuple(map(shape, pipelines)), {n: j for j, pipe in enumerate(pipelines) for n in pipe}


outline = ByIdentity(_outline)  # kept for the few configurations in force: a batch weighs several bursts of each


def justified_standby(sim, s: RunState, used: int, idle: int, span: tuple[float, float]) -> float:
    """Node-seconds of `span` that the burst rule justifies of `idle` nodes beside
    `used` ones. With no burst in the span its count only falls (the rate seen
    thins), so each count's end is found by bisection, to a second."""
    count = lambda at: sim.bursts_seen(s, used, at).standby(  # noqa: E731
        sim.opt.acquire_seconds, sim.opt.standby_epsilon, idle)
    t, end = span
    total = 0.0
    while idle and t < end and (k := count(t)):
        lo, hi = (end, end) if count(end) == k else (t, end)
        while hi - lo > 1.0:
            lo, hi = ((lo + hi) / 2, hi) if count((lo + hi) / 2) == k else (lo, (lo + hi) / 2)
        total += k * (hi - t)
        t = hi
    return total
