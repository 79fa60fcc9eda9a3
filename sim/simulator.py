"""A discrete-event simulation of one training job over a preemption trace, for
three strategies (sim/strategies.py), in samples per second per dollar.

This module is the part every strategy shares: the trace replayed batch by batch
(removals within one iteration land together), training between batches at the
rate of the healthy pipelines, checkpoints, and the cost of the nodes held.

Iteration times come from the schedule simulator on a model profile's cost model
(or from a profile measured by bamboo-train). Pauses: a failover costs one
iteration; a reconfiguration `reconfigure_seconds` plus moving one stage's state;
a redo the failure timeout plus the redone iteration; a restart `restart_seconds`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import lru_cache

from agents.policy import Config
from schedules.compiler import compile_schedule, simulate as simulate_schedule
from sim.accounting import RunState, summary
from sim.profiles import MeasuredProfile, Profile
from sim.strategies import STRATEGIES
from sim.traces import Event

__all__ = ["STRATEGIES", "ClusterSimulator", "Options"]


@dataclass(frozen=True)
class Options:
    spot_price: float = 0.918           # USD per node-hour (EC2 p3.2xlarge spot, as in the Bamboo paper)
    on_demand_price: float = 3.06       # USD per node-hour (p3.2xlarge on demand)
    checkpoint_seconds: float = 1800.0  # checkpoint interval
    restart_seconds: float = 120.0      # stop, relaunch, load a checkpoint
    reconfigure_seconds: float = 10.0   # agents' decision and new process groups
    failure_timeout: float = 3.0        # seconds before a silent node counts as dead
    zones: tuple[str, ...] = ("a", "b", "c")  # for traces without zones: nodes dealt in turn
    startup_seconds: float = 0.0        # from a node's arrival to its being usable (0: the trace says when)


class ClusterSimulator:
    def __init__(self, profile: Profile | MeasuredProfile, depth: int, strategy: str, options: Options = Options()):
        if strategy not in STRATEGIES:
            raise ValueError(f"unknown strategy {strategy!r} (choose from {', '.join(STRATEGIES)})")
        if depth < 2:
            raise ValueError(f"--stages must be at least 2 (got {depth})")
        self.profile, self.P, self.opt = profile, depth, options
        self.strategy = strategy              # the name, as the result reports it
        self.rules = STRATEGIES[strategy]()   # what this strategy does about the trace

    # -- iteration times -------------------------------------------------------------------
    def iteration_seconds(self, pipelines: int, merged: bool = False) -> float:
        return _iteration_ms(self.profile, self.P, pipelines, self.rules.redundancy, merged) / 1000

    def throughput(self, pipelines: int) -> float:
        """Samples per second of `pipelines` healthy pipelines."""
        if pipelines < 1:
            return 0.0
        return self.profile.samples_per_iteration() / self.iteration_seconds(pipelines)

    # -- the run -------------------------------------------------------------------------
    def run(self, events: list[Event], hours: float | None = None) -> dict:
        """The first `hours` of the trace (all of it by default), arrivals delayed by the startup time."""
        horizon = hours * 3600 if hours else max((e.time for e in events), default=0.0)
        delay = self.opt.startup_seconds
        events = sorted((replace(e, time=e.time + delay) if e.action == "add" and e.time > 0 else e
                         for e in events if e.time <= horizon), key=lambda e: e.time)
        return self.rules.run(self, events, horizon)

    def replay(self, events: list[Event], horizon: float) -> dict:
        """Spot nodes: train between batches of simultaneous events (sorted by time),
        letting the strategy react to each batch."""
        s = RunState(next_checkpoint=self.opt.checkpoint_seconds)
        zones: dict[str, str] = {}
        live: dict[str, str] = {}
        config: Config | None = None
        queue = list(events)
        while queue:
            batch = _next_batch(queue, self._window(config))
            self._advance(s, batch[0].time, config, len(live))
            for e in batch:
                if e.action == "add":
                    zones.setdefault(e.node, e.zone or self.opt.zones[len(zones) % len(self.opt.zones)])
                    live[e.node] = zones[e.node]
            removed = {e.node for e in batch if e.action == "remove"}
            s.preemptions += len(removed)
            for n in removed:
                live.pop(n, None)
            config = self.rules.react(self, s, config, live, removed)
        self._advance(s, horizon, config, len(live))
        return self._result(s, horizon)

    def _window(self, config: Config | None) -> float:
        """Removals closer than this land in one iteration."""
        return self.iteration_seconds(max(1, len(config.pipelines) if config else 1))

    def _advance(self, s: RunState, to: float, config: Config | None, nodes: int) -> None:
        """Train from s.t to `to` under `config`, taking checkpoints on the way."""
        D = len(config.pipelines) if config and config.depth == self.P else 0
        rate = self.throughput(D)
        s.timeline.append((s.t, nodes, rate))
        s.node_seconds += nodes * max(0.0, to - s.t)
        while s.t < to:
            step_to = min(to, s.next_checkpoint)
            working = max(0.0, step_to - max(s.t, s.paused_until))
            s.samples += rate * working
            s.t = step_to
            if s.t >= s.next_checkpoint:
                s.checkpoint()
                s.next_checkpoint += self.opt.checkpoint_seconds

    def _result(self, s: RunState, horizon: float) -> dict:
        hours = horizon / 3600 if horizon else 0.0
        mean_nodes = s.node_seconds / horizon if horizon else 0.0
        cost_per_hour = mean_nodes * self.opt.spot_price
        out = summary(self.strategy, s.preemptions, s.fatal, mean_nodes, s.samples, horizon, cost_per_hour,
                      hours, s.timeline)
        out.update(self.rules.report(s))
        return out


def _next_batch(queue: list[Event], window: float) -> list[Event]:
    """Take the next events that land together off the queue: those at the first
    one's time, and removals within `window` (one iteration) of it."""
    batch = [queue.pop(0)]
    while queue and (queue[0].time == batch[0].time or
                     (queue[0].action == "remove" and queue[0].time - batch[0].time < window)):
        batch.append(queue.pop(0))
    return batch


@lru_cache(maxsize=None)
def _iteration_ms(profile, depth: int, pipelines: int, redundancy: str, merged: bool) -> float:
    if isinstance(profile, MeasuredProfile):
        known = dict(profile.iteration_ms)
        return known.get(pipelines) or known[min(known, key=lambda d: abs(d - pipelines))]
    microbatches = math.ceil(profile.microbatches / pipelines)
    cost = profile.cost(depth, pipelines)
    failed = (1,) if merged else ()
    schedule = compile_schedule(depth, microbatches, failed, redundancy if not merged else "eager", cost=cost)
    return simulate_schedule(schedule).makespan
