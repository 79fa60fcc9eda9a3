"""A discrete-event simulation of one training job over a preemption trace, for
three strategies, in samples per second per dollar.

  bamboo      every node keeps its successor's replica (eager FRC): a preemption
              costs a failover pause and the pipeline runs merged until the next
              iteration boundary, where the agents' policy (the same function the
              agents run) reconfigures; an iteration no pipeline can finish is
              redone from another pipeline's copies, and only a stage lost on every
              node sends the job back to its last checkpoint (a fatal failure)
  checkpoint  no redundancy (Varuna-style): any preemption of a node in use stops
              the job, which restarts from its last checkpoint on the nodes left;
              a scale-out restarts it too (after a fresh checkpoint, losing nothing)
  on-demand   no preemptions: a fixed cluster of the trace's mean size (rounded to
              whole pipelines) at the on-demand price

Iteration times come from the schedule simulator on a model profile's cost model
(or from a profile measured by bamboo-train). Pauses: a failover costs one
iteration; a reconfiguration `reconfigure_seconds` plus moving one stage's state;
a redo the failure timeout plus the redone iteration; a restart `restart_seconds`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from functools import lru_cache

from agents.policy import Config, next_config
from schedules.compiler import compile_schedule, simulate as simulate_schedule
from sim.profiles import NETWORK, MeasuredProfile, Profile
from sim.traces import Event

STRATEGIES = ("bamboo", "checkpoint", "on-demand")


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


@dataclass
class _State:
    t: float = 0.0
    samples: float = 0.0
    saved: float = 0.0          # samples in the last checkpoint
    next_checkpoint: float = 0.0
    paused_until: float = 0.0
    node_seconds: float = 0.0
    fatal: int = 0
    redos: int = 0              # iterations abandoned and redone from another pipeline's copies
    preemptions: int = 0
    timeline: list = field(default_factory=list)  # (time, nodes, samples/s)


class ClusterSimulator:
    def __init__(self, profile: Profile | MeasuredProfile, depth: int, strategy: str, options: Options = Options()):
        if strategy not in STRATEGIES:
            raise ValueError(f"unknown strategy {strategy!r} (choose from {', '.join(STRATEGIES)})")
        if depth < 2:
            raise ValueError(f"--stages must be at least 2 (got {depth})")
        self.profile, self.P, self.strategy, self.opt = profile, depth, strategy, options

    # -- iteration times -------------------------------------------------------------------
    def iteration_seconds(self, pipelines: int, merged: bool = False) -> float:
        redundancy = "eager" if self.strategy == "bamboo" else "off"
        return _iteration_ms(self.profile, self.P, pipelines, redundancy, merged) / 1000

    def throughput(self, pipelines: int) -> float:
        """Samples per second of `pipelines` healthy pipelines."""
        if pipelines < 1:
            return 0.0
        return self.profile.samples_per_iteration() / self.iteration_seconds(pipelines)

    # -- the run -------------------------------------------------------------------------
    def run(self, events: list[Event], hours: float | None = None) -> dict:
        horizon = hours * 3600 if hours else max((e.time for e in events), default=0.0)
        delay = self.opt.startup_seconds
        events = sorted((replace(e, time=e.time + delay) if e.action == "add" and e.time > 0 else e
                         for e in events if e.time <= horizon), key=lambda e: e.time)
        if self.strategy == "on-demand":
            return self._on_demand(events, horizon)
        s = _State(next_checkpoint=self.opt.checkpoint_seconds)
        zones: dict[str, str] = {}
        live: dict[str, str] = {}
        config: Config | None = None
        queue = sorted(events, key=lambda e: e.time)
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
            config = self._react(s, config, live, removed)
        self._advance(s, horizon, config, len(live))
        return self._result(s, horizon)

    def _window(self, config: Config | None) -> float:
        """Removals closer than this land in one iteration."""
        return self.iteration_seconds(max(1, len(config.pipelines) if config else 1))

    def _react(self, s: _State, config: Config | None, live: dict[str, str], removed: set[str]) -> Config | None:
        """Apply one batch of simultaneous events; return the next configuration."""
        P = self.P
        previous = config
        if self.strategy == "bamboo":
            if config:
                pause = 0.0
                depth = config.depth  # below P when too few nodes were left: they wait, holding the state
                lost_stages = set(range(depth))
                for pipe in config.pipelines:
                    dead = {i for i, n in enumerate(pipe) if n in removed}
                    lost_stages &= {i for i in dead if (i - 1) % depth in dead}
                    if len(dead) == 1:
                        pause = max(pause, self.iteration_seconds(len(config.pipelines), merged=True))
                    elif len(dead) > 1:  # abandoned: redone from copies elsewhere
                        pause = max(pause, self.opt.failure_timeout + self.iteration_seconds(len(config.pipelines)))
                if any(sum(n in removed for n in pipe) > 1 for pipe in config.pipelines):
                    s.redos += 1
                if config.pipelines and lost_stages:  # no copy left anywhere
                    s.redos -= any(sum(n in removed for n in pipe) > 1 for pipe in config.pipelines)
                    s.fatal += 1
                    s.samples = s.saved
                    pause = self.opt.restart_seconds
                self._pause(s, pause)
            config = next_config(live, config, P)
            if config.depth < P:
                return config  # too few nodes: waits
            if previous and _moved(previous, config):
                handover = self.profile.stage_state_bytes(P) * 2 / NETWORK if isinstance(self.profile, Profile) \
                    else self.profile.handover_ms / 1000
                self._pause(s, self.opt.reconfigure_seconds + handover)
            return config
        # checkpoint restarts
        config = next_config(live, None, P) if len(live) >= P else Config(0, 0)
        used = {n for pipe in previous.pipelines for n in pipe} if previous else set()
        if previous and used & removed:
            s.fatal += 1
            s.samples = s.saved
            self._pause(s, self.opt.restart_seconds)
            return config
        if previous and len(config.pipelines) > len(previous.pipelines):
            s.saved = s.samples  # checkpoint, then restart wider
            self._pause(s, self.opt.restart_seconds)
            return config
        return previous if previous and previous.depth == P else config

    def _pause(self, s: _State, seconds: float) -> None:
        s.paused_until = max(s.paused_until, s.t) + seconds

    def _advance(self, s: _State, to: float, config: Config | None, nodes: int) -> None:
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
                s.saved = s.samples
                s.next_checkpoint += self.opt.checkpoint_seconds

    def _result(self, s: _State, horizon: float) -> dict:
        hours = horizon / 3600 if horizon else 0.0
        mean_nodes = s.node_seconds / horizon if horizon else 0.0
        cost_per_hour = mean_nodes * self.opt.spot_price
        out = _summary(self.strategy, s.preemptions, s.fatal, mean_nodes, s.samples, horizon, cost_per_hour,
                       hours, s.timeline)
        if self.strategy == "bamboo":
            out["redone_from_peers"] = s.redos
        return out

    def _on_demand(self, events: list[Event], horizon: float) -> dict:
        probe = ClusterSimulator(self.profile, self.P, "checkpoint", self.opt)  # no redundancy
        count, area, last = 0, 0.0, 0.0
        for e in events:
            area += count * (e.time - last)
            count, last = count + (1 if e.action == "add" else -1), e.time
        area += count * (horizon - last)
        mean = area / horizon if horizon else 0.0
        D = max(1, round(mean / self.P))
        rate = probe.throughput(D)
        return _summary("on-demand", 0, 0, float(D * self.P), rate * horizon, horizon,
                        D * self.P * self.opt.on_demand_price, horizon / 3600, [(0.0, D * self.P, rate)])


def _summary(strategy, preemptions, fatal, mean_nodes, samples, horizon, cost_per_hour, hours, timeline) -> dict:
    throughput = samples / horizon if horizon else 0.0
    return {"strategy": strategy, "hours": round(hours, 3), "preemptions": preemptions, "fatal_failures": fatal,
            "mean_nodes": round(mean_nodes, 3), "throughput": round(throughput, 4),
            "cost_per_hour": round(cost_per_hour, 3),
            "value": round(throughput / cost_per_hour, 5) if cost_per_hour else 0.0,
            "samples": round(samples), "timeline": [(round(t, 1), n, round(r, 4)) for t, n, r in timeline]}


def _moved(a: Config, b: Config) -> bool:
    before = {n: s for pipe in a.pipelines for s, n in enumerate(pipe)}
    return any(before.get(n) != s for pipe in b.pipelines for s, n in enumerate(pipe))


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
