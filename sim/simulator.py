"""A discrete-event simulation of one training job over a preemption trace, for
the strategies of sim/strategies.py, in samples per second per dollar.

This module is the part every strategy shares: the trace replayed batch by batch
(removals within one iteration land together), training between batches at the
rate of the healthy pipelines, checkpoints that stall training (sim/checkpointing.py)
and the cost of the nodes held.

Iteration times come from the schedule simulator on a model profile's cost model
(or from a profile measured by bamboo-train). Pauses: a failover costs one
iteration; a reconfiguration `reconfigure_seconds` plus moving one stage's state;
a redo the failure timeout plus the redone iteration; a restart relaunches, loads
the checkpoint and warms up.
"""
from __future__ import annotations

import math
from dataclasses import replace
from functools import lru_cache

from schedules.compiler import compile_schedule
from schedules.compiler import simulate as simulate_schedule

from agents.policy import Config
from sim.accounting import RunState, summary
from sim.auto import Auto
from sim.checkpointing import CheckpointCosts, TraceStats, optimal_interval, trace_stats
from sim.options import Options
from sim.profiles import MeasuredProfile, Profile
from sim.strategies import STRATEGIES as SPOT_AND_ON_DEMAND
from sim.traces import Event

__all__ = ["STRATEGIES", "ClusterSimulator", "Options"]

STRATEGIES = {**SPOT_AND_ON_DEMAND, "auto": Auto}


class ClusterSimulator:
    def __init__(self, profile: Profile | MeasuredProfile, depth: int, strategy: str, options: Options = Options()):
        if strategy not in STRATEGIES:
            raise ValueError(f"unknown strategy {strategy!r} (choose from {', '.join(STRATEGIES)})")
        if depth < 2:
            raise ValueError(f"--stages must be at least 2 (got {depth})")
        options.check()
        self.profile, self.P, self.opt = profile, depth, options
        self.strategy = strategy              # the name, as the result reports it
        self.rules = STRATEGIES[strategy]()   # what this strategy does about the trace
        self.costs = checkpoint_costs(profile, depth, options)
        self.trace = TraceStats(0.0, 0)       # set by run()
        self.job_mtbf: float = math.inf       # the failures this strategy must checkpoint against, per node

    # -- iteration times -------------------------------------------------------------------
    def iteration_seconds(self, pipelines: int, merged: bool = False, mode: str | None = None) -> float:
        """One iteration of `pipelines` pipelines in `mode` (default: the strategy's)."""
        return _iteration_ms(self.profile, self.P, pipelines, mode or self.rules.redundancy, merged) / 1000

    def throughput(self, pipelines: int) -> float:
        """Samples per second of `pipelines` healthy pipelines."""
        if pipelines < 1:
            return 0.0
        return self.profile.samples_per_iteration() / self.iteration_seconds(pipelines)

    @property
    def restart_seconds(self) -> float:
        return self.costs.restart_seconds

    def checkpoint_interval(self, used_nodes: int) -> float:
        """Training seconds between checkpoints while `used_nodes` nodes compute."""
        if self.opt.checkpoint_seconds is not None:
            return self.opt.checkpoint_seconds
        mtbf = self.rules.mtbf(self, max(1, used_nodes))
        return optimal_interval(self.opt.checkpoint_formula, self.costs.write_seconds, mtbf)

    # -- the run -------------------------------------------------------------------------
    def run(self, events: list[Event], hours: float | None = None) -> dict:
        """The first `hours` of the trace (all of it by default), arrivals delayed by the startup time."""
        horizon = hours * 3600 if hours else max((e.time for e in events), default=0.0)
        delay = self.opt.startup_seconds
        events = sorted((replace(e, time=e.time + delay) if e.action == "add" and e.time > 0 else e
                         for e in events if e.time <= horizon), key=lambda e: e.time)
        self.trace = trace_stats(events, horizon)
        return self.rules.run(self, events, horizon)

    def replay(self, events: list[Event], horizon: float) -> dict:
        """Spot nodes: train between batches of simultaneous events (sorted by time),
        letting the strategy react to each batch."""
        s = RunState()
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
            fatal, was_running = s.fatal, self._running(config)
            config = self.rules.react(self, s, config, live, removed)
            self._rearm(s, config, restarted=s.fatal > fatal or not was_running)
        self._advance(s, horizon, config, len(live))
        return self._result(s, horizon)

    def _running(self, config: Config | None) -> bool:
        return bool(config and config.depth == self.P and config.pipelines)

    def _rearm(self, s: RunState, config: Config | None, restarted: bool) -> None:
        """Schedule the next checkpoint for the nodes `config` uses: a period starts
        again when training (re)starts."""
        if not self._running(config):
            s.next_checkpoint = math.inf
            return
        if restarted:
            s.period_start = s.resumes()
        interval = self.checkpoint_interval(len(config.pipelines) * self.P)
        s.next_checkpoint = s.period_start + interval

    def _window(self, config: Config | None) -> float:
        """Removals closer than this land in one iteration."""
        return self.iteration_seconds(max(1, len(config.pipelines) if config else 1))

    def _advance(self, s: RunState, to: float, config: Config | None, nodes: int) -> None:
        """Train from s.t to `to` under `config`, stalling for checkpoints on the way."""
        D = len(config.pipelines) if self._running(config) else 0
        rate = self.throughput(D)
        s.timeline.append((s.t, nodes, rate))
        s.node_seconds += nodes * max(0.0, to - s.t)
        while s.t < to:
            step_to = min(to, max(s.t, s.next_checkpoint))
            working = max(0.0, step_to - max(s.t, s.paused_until))
            s.samples += rate * working
            s.t = step_to
            if s.t >= s.next_checkpoint:
                self.take_checkpoint(s, D * self.P)

    def take_checkpoint(self, s: RunState, used_nodes: int) -> None:
        """Stall for the write; the period to the next checkpoint starts when it ends."""
        s.pause(self.costs.write_seconds)
        s.checkpoint(done_at=s.paused_until)
        s.checkpoints += 1
        s.period_start = s.paused_until
        interval = self.checkpoint_interval(used_nodes)
        s.interval_sum, s.intervals = s.interval_sum + interval, s.intervals + 1
        s.next_checkpoint = s.period_start + interval

    def parameters(self, s: RunState | None = None) -> dict:
        """Every parameter of this run's checkpoints and restarts, and what followed."""
        out = {"formula": "fixed" if self.opt.checkpoint_seconds is not None else self.opt.checkpoint_formula,
               "bytes_per_param": self.opt.checkpoint_bytes_per_param, **self.costs.describe()}
        if self.opt.checkpoint_seconds is not None:
            out["interval_seconds"] = self.opt.checkpoint_seconds
        if s is not None:
            out["checkpoints_taken"] = s.checkpoints
            out["mean_interval_seconds"] = round(s.interval_sum / s.intervals, 2) if s.intervals else None
        return out

    def _result(self, s: RunState, horizon: float) -> dict:
        hours = horizon / 3600 if horizon else 0.0
        mean_nodes = s.node_seconds / horizon if horizon else 0.0
        cost_per_hour = mean_nodes * self.opt.spot_price
        out = summary(self.strategy, s.preemptions, s.fatal, mean_nodes, s.samples, horizon, cost_per_hour,
                      hours, s.timeline)
        out.update(self.rules.report(self, s))
        out["checkpointing"] = self.parameters(s)
        return out


def checkpoint_costs(profile, depth: int, opt: Options) -> CheckpointCosts:
    """One stage's checkpoint bytes from the profile's parameter count (a measured
    profile has none: its checkpoints are free)."""
    params = profile.stage_params(depth) if isinstance(profile, Profile) else 0.0
    return CheckpointCosts(state_bytes=params * opt.checkpoint_bytes_per_param,
                           snapshot_bandwidth=opt.snapshot_bandwidth, storage_bandwidth=opt.storage_bandwidth,
                           relaunch_seconds=opt.relaunch_seconds, warmup_seconds=opt.warmup_seconds,
                           free_writes=opt.free_checkpoints or params == 0, restart_override=opt.restart_seconds)


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
