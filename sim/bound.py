"""The bound a spot run is measured against: what a scheduler would reach that
loses nothing on a preemption and runs the policy's pipelines on every node at once
(and, unless --surplus keep, pays for no other node, as if its releases and
acquisitions were instant). It reads the trace and the policy, not the run, so the
strategies that weigh the policy's short pipelines by one mode and sync (redo and
checkpoint) share one: a fleet's month of policy calls, made once."""
from __future__ import annotations

from agents.policy import Config
from agents.surplus import SurplusRule
from sim.options import PRICED
from sim.reconfiguration import used_nodes
from sim.traces import Event

KEPT: dict[tuple, dict] = {}  # bounds by all they depend on, the few latest


def bound(sim, events: list[Event], horizon: float) -> dict:
    """`throughput_bound`, and `goodput_bound`, with `goodput` of the same reference
    (fault-free throughput per node of an on-demand cluster), of `sim`'s job over
    `events`; one a run's bursts sway (--zone-spread auto at a price) is its own."""
    if sim.opt.zone_spread == PRICED and sim.opt.cross_zone_price:
        return _bound(sim, events, horizon)
    mode = sim.rules.redundancy
    key = (sim.profile, sim.P, sim.opt, mode, sim.compiled_sync(mode), horizon, tuple(events))
    if key not in KEPT:
        if len(KEPT) >= 8:
            KEPT.clear()
        KEPT[key] = _bound(sim, events, horizon)
    return dict(KEPT[key])


def _bound(sim, events: list[Event], horizon: float) -> dict:
    live: dict[str, str] = {}
    config: Config | None = None
    samples = node_seconds = 0.0
    for e, until in zip(events, [e.time for e in events[1:]] + [horizon]):
        if e.action == "add":
            live[e.node] = e.zone or sim.opt.zones[len(live) % len(sim.opt.zones)]
        else:
            live.pop(e.node, None)
        if until == e.time:
            continue  # events at one time land together, as the replay's batches
        config = sim.next_config(live, config) if live else None
        samples += sim.config_throughput(config, mode="off") * max(0.0, until - e.time)
        paid = len(live) if sim.opt.surplus == SurplusRule.KEEP or not sim.running(config) \
            else len(used_nodes(config))  # with release, only the nodes that train are paid
        node_seconds += paid * max(0.0, until - e.time)
    mean_nodes, rate = (node_seconds / horizon, samples / horizon) if horizon else (0.0, 0.0)
    return {"goodput_bound": round(sim.goodput(rate, mean_nodes), 4), "throughput_bound": round(rate, 4)}
