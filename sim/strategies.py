"""The strategies the cluster simulator compares: what each does when spot nodes
come and go, so that the simulator's event loop stays the same for all of them.

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

A spot strategy's `react` takes one batch of simultaneous trace events (the nodes
now `live`, those just `removed`), charges its pauses and losses to the run's
state and returns the next configuration.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

from agents.policy import Config, next_config
from schedules.layout import Layout
from sim.accounting import RunState, summary
from sim.profiles import NETWORK, Profile

if TYPE_CHECKING:
    from sim.simulator import ClusterSimulator
    from sim.traces import Event


class Spot(ABC):
    """A strategy on spot nodes: the trace is replayed and every batch reacted to."""
    redundancy = "off"  # the schedule's redundancy, which sets the iteration time

    def run(self, sim: ClusterSimulator, events: list[Event], horizon: float) -> dict:
        """The run's summary; the simulator's replay calls back `react` on each batch."""
        return sim.replay(events, horizon)

    @abstractmethod
    def react(self, sim: ClusterSimulator, s: RunState, config: Config | None, live: dict[str, str],
              removed: set[str]) -> Config | None:
        """Charge the batch's pauses and losses to `s`; return the configuration to run next."""

    def report(self, s: RunState) -> dict:
        """Fields of this strategy's own, added at the end of the run's summary."""
        return {}


class Bamboo(Spot):
    """Redundant computation: survive what the replicas cover, reconfigure at the boundary."""
    redundancy = "eager"

    def react(self, sim: ClusterSimulator, s: RunState, config: Config | None, live: dict[str, str],
              removed: set[str]) -> Config | None:
        if config:
            s.pause(self._failover(sim, s, config, removed))
        nxt = next_config(live, config, sim.P)
        if nxt.depth < sim.P:
            return nxt  # too few nodes: they wait, holding the state
        if config and _moved(config, nxt):
            s.pause(sim.opt.reconfigure_seconds + _handover_seconds(sim.profile, sim.P))
        return nxt

    @staticmethod
    def _failover(sim: ClusterSimulator, s: RunState, config: Config, removed: set[str]) -> float:
        """Seconds lost to the deaths in `removed`: a merged iteration where one node of a
        pipeline died, a redo where more did, a restart where a stage died everywhere."""
        depth = config.depth  # below P when too few nodes were left: they wait, holding the state
        pipelines = len(config.pipelines)
        deaths = [{i for i, n in enumerate(pipe) if n in removed} for pipe in config.pipelines]
        pause = 0.0
        for dead in deaths:
            if len(dead) == 1:
                pause = max(pause, sim.iteration_seconds(pipelines, merged=True))
            elif len(dead) > 1:  # abandoned: redone from copies elsewhere
                pause = max(pause, sim.opt.failure_timeout + sim.iteration_seconds(pipelines))
        if _lost_everywhere(depth, deaths):
            s.rewind()  # back to the checkpoint
            return sim.opt.restart_seconds
        if any(len(dead) > 1 for dead in deaths):
            s.redos += 1
        return pause

    def report(self, s: RunState) -> dict:
        return {"redone_from_peers": s.redos}


class CheckpointRestart(Spot):
    """No redundancy: any loss of a node in use restarts from the last checkpoint."""

    def react(self, sim: ClusterSimulator, s: RunState, config: Config | None, live: dict[str, str],
              removed: set[str]) -> Config | None:
        nxt = next_config(live, None, sim.P) if len(live) >= sim.P else Config(0, 0)
        used = {n for pipe in config.pipelines for n in pipe} if config else set()
        if config and used & removed:
            s.rewind()
            s.pause(sim.opt.restart_seconds)
            return nxt
        if config and len(nxt.pipelines) > len(config.pipelines):
            s.checkpoint()  # then restart wider
            s.pause(sim.opt.restart_seconds)
            return nxt
        return config if config and config.depth == sim.P else nxt


class OnDemand:
    """No preemptions, so nothing to react to: the run is one fixed cluster throughout."""
    redundancy = "off"

    def run(self, sim: ClusterSimulator, events: list[Event], horizon: float) -> dict:
        """The trace's mean cluster size, rounded to whole pipelines, at the on-demand price."""
        count, area, last = 0, 0.0, 0.0
        for e in events:
            area += count * (e.time - last)
            count, last = count + (1 if e.action == "add" else -1), e.time
        area += count * (horizon - last)
        mean = area / horizon if horizon else 0.0
        pipelines = max(1, round(mean / sim.P))
        nodes = pipelines * sim.P
        rate = sim.throughput(pipelines)
        return summary(sim.strategy, 0, 0, float(nodes), rate * horizon, horizon,
                       nodes * sim.opt.on_demand_price, horizon / 3600, [(0.0, nodes, rate)])


STRATEGIES = {"bamboo": Bamboo, "checkpoint": CheckpointRestart, "on-demand": OnDemand}


def _moved(a: Config, b: Config) -> bool:
    """Whether any node of `b` computes a different stage than it did in `a`."""
    before = {n: s for pipe in a.pipelines for s, n in enumerate(pipe)}
    return any(before.get(n) != s for pipe in b.pipelines for s, n in enumerate(pipe))


def _lost_everywhere(depth: int, deaths: list[set[int]]) -> frozenset[int]:
    """Stages with no live copy in any pipeline: lost in each one (`deaths`: the
    stage positions that died in each pipeline)."""
    if not deaths:
        return frozenset()
    return frozenset.intersection(*(Layout.lost(depth, dead) for dead in deaths))


def _handover_seconds(profile, depth: int) -> float:
    """Moving one stage's state (weights and optimizer) to its new node."""
    if isinstance(profile, Profile):
        return profile.stage_state_bytes(depth) * 2 / NETWORK
    return profile.handover_ms / 1000
