"""The strategies the cluster simulator compares: what each does when spot nodes
come and go, so that the simulator's event loop stays the same for all of them.

  bamboo      every node keeps its successor's replica (eager FRC, in the bubbles
              only with --frc bubbles): a preemption costs a failover pause (and
              the dead stage's forwards no bubble held, recomputed) and the
              pipeline runs merged until the next
              iteration boundary, where the agents' policy (the same function the
              agents run) reconfigures; an iteration no pipeline can finish is
              redone from another pipeline's copies, and only a stage lost on every
              node sends the job back to its last checkpoint (a fatal failure)
  lazy        Bamboo with lazy redundancy: replicas kept in sync but no FRC while
              nothing fails (the lazy schedule's iteration time); a death costs
              eager's merged iteration plus the dead stage's forwards
  redo        no redundant computation (Oobleck's semantics): a preemption of a
              node in use abandons the iteration under way, the lost stages are
              reloaded from a data-parallel peer pipeline over the network, and the
              job goes back to its last checkpoint only when no copy of a stage is left
  checkpoint  no redundancy (Varuna-style): any preemption of a node in use stops
              the job, which restarts from its last checkpoint on the nodes left;
              a scale-out restarts it too (after a fresh checkpoint, losing nothing)
  on-demand   no preemptions: a fixed cluster of the trace's mean size (rounded to
              whole pipelines) at the on-demand price

A spot strategy's `react` takes one batch of simultaneous trace events (the nodes
now `live`, those just `removed`), charges its pauses and losses to the run's
state and returns the next configuration. Every spot strategy checkpoints at the
same cost (sim/checkpointing.py); `mtbf` says how often it needs one.
"""
from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import Protocol

from schedules.deaths import IN_ITERATION, PEERS, STORAGE
from schedules.layout import Layout

from agents.policy import Config
from sim.accounting import RunState, summary
from sim.checkpointing import CheckpointCosts, TraceStats
from sim.options import Options
from sim.profiles import MeasuredProfile, Profile
from sim.reconfiguration import (dead_stages, handover_seconds, lost_everywhere, nodes_dead, positions_dead,
                                 stages_moved, used_nodes)
from sim.traces import Event
from sim.windows import Window, lend_seconds, lent, stale
from schedules.options import Redundancy


class Simulation(Protocol):
    """What a strategy asks of the simulator that runs it (sim/simulator.py's
    ClusterSimulator): declared here, so that the strategies import nothing above them."""
    profile: Profile | MeasuredProfile
    P: int
    opt: Options
    strategy: str
    costs: CheckpointCosts
    trace: TraceStats
    job_mtbf: float
    noticed: dict[str, float]

    def iteration_seconds(self, pipelines: int, merged: bool = False, mode: str | None = None,
                          sync: str | None = None) -> float: ...
    def config_seconds(self, config: Config, mode: str | None = None, sync: str | None = None) -> float: ...
    def throughput(self, pipelines: int) -> float: ...
    def config_throughput(self, config: Config | None, mode: str | None = None) -> float: ...
    def uncovered(self, pipelines: int, sync: str | None = None) -> float: ...
    def windows(self, pipelines: int, mode: str | None = None, sync: str | None = None) -> tuple[Window, ...]: ...
    def next_config(self, live: dict[str, str], previous: Config | None) -> Config: ...
    @property
    def restart_seconds(self) -> float: ...
    def rollback_seconds(self, lost: frozenset[int], live: dict[str, str]) -> float: ...
    def rollback_path(self, live: dict[str, str]) -> str: ...
    def copy_load_seconds(self) -> float: ...
    def compiled_sync(self, mode: str, sync: str | None = None) -> str: ...
    def replay(self, events: list[Event], horizon: float) -> dict: ...
    def take_checkpoint(self, s: RunState, used_nodes: int, config: Config | None = None) -> None: ...


class Spot(ABC):
    """A strategy on spot nodes: the trace is replayed and every batch reacted to."""
    redundancy = "off"  # the schedule's redundancy, which sets the iteration time

    def run(self, sim: Simulation, events: list[Event], horizon: float) -> dict:
        """The run's summary; the simulator's replay calls back `react` on each batch."""
        return sim.replay(events, horizon)

    def mtbf(self, sim: Simulation, used_nodes: int) -> float:
        """Mean seconds between the failures that send this job back to a checkpoint:
        any preemption of a node in use (the trace's node MTBF over the nodes used)."""
        return sim.trace.node_mtbf_seconds / used_nodes

    def notice(self, sim: Simulation, s: RunState, config: Config | None, live: dict[str, str],
               doomed: set[str]) -> Config | None:
        """A preemption of `doomed` is announced (`live`: the nodes not doomed): the
        configuration to run until it comes. By default nothing is done ahead."""
        return config

    @abstractmethod
    def react(self, sim: Simulation, s: RunState, config: Config | None, live: dict[str, str],
              removed: set[str]) -> Config | None:
        """Charge the batch's pauses and losses to `s`; return the configuration to run next."""

    def report(self, sim: Simulation, s: RunState) -> dict:
        """Fields of this strategy's own, added at the end of the run's summary."""
        return {}


class PeerRecovery(Spot):
    """A strategy that survives most preemptions without a checkpoint: it needs one
    only against the rarer loss of every copy of a stage."""

    def run(self, sim: Simulation, events: list[Event], horizon: float) -> dict:
        """Two passes when the interval is the formula's: one without checkpoints
        counts the fatal failures the trace brings (at least one is assumed), which
        sets the MTBF; the second is the run."""
        if sim.opt.checkpoint_seconds is None:
            sim.job_mtbf = math.inf
            fatal = sim.replay(events, horizon)["fatal_failures"]
            sim.job_mtbf = horizon / max(1, fatal)
        return sim.replay(events, horizon)

    def mtbf(self, sim: Simulation, used_nodes: int) -> float:
        return sim.job_mtbf

    def notice(self, sim: Simulation, s: RunState, config: Config | None, live: dict[str, str],
               doomed: set[str]) -> Config | None:
        """Drain, as the runtime does on a notice: the doomed nodes' stages move to the
        others now (a reconfiguration, no failover), so their preemption costs nothing."""
        if not config or not doomed & used_nodes(config):
            return config
        s.drained += len(doomed & used_nodes(config))
        return self.react(sim, s, config, live, set())

    def report(self, sim: Simulation, s: RunState) -> dict:
        mtbf = sim.job_mtbf
        return {"redone_from_peers": s.redos,
                "fatal_mtbf_hours": round(mtbf / 3600, 3) if math.isfinite(mtbf) else None}


class Bamboo(PeerRecovery):
    """Redundant computation: survive what the replicas cover, reconfigure at the boundary."""
    redundancy = "eager"

    def react(self, sim: Simulation, s: RunState, config: Config | None, live: dict[str, str],
              removed: set[str]) -> Config | None:
        if config:
            s.pause(self._failover(sim, s, config, live, removed), "failover")
        nxt = sim.next_config(live, config)
        if nxt.depth < sim.P:
            return nxt  # too few nodes: they wait, holding the state
        if config and stages_moved(config, nxt):
            s.pause(sim.opt.reconfigure_seconds + handover_seconds(sim.profile, sim.P), "reconfiguration")
        return nxt

    def _failover(self, sim: Simulation, s: RunState, config: Config, live: dict[str, str],
                  removed: set[str]) -> float:
        """Seconds lost to the deaths in `removed`: a merged iteration where one node of a
        pipeline died and its replicas cover it (with eager, plus the dead stage's
        forwards that had no FRC; with --replica-sync next and a death in its window,
        plus the transfer of what another pipeline's owner of the stage lends the
        holder, sim/windows.py), a redo where they do not (a replica a step behind
        that nobody lends to included), a rollback where a stage died everywhere.
        The deaths are counted under that path (schedules/deaths.py) while it trains."""
        if removed.isdisjoint(used_nodes(config)):
            return 0.0  # no node of it died: nothing to fail over (what follows would count none)
        depth = config.depth  # below P when too few nodes were left: they wait, holding the state
        pipelines = len(config.pipelines)
        deaths = dead_stages(config, removed)
        where = (sim.windows(pipelines, self.redundancy), positions_dead(config, removed),
                 s.phase(sim.profile.samples_per_iteration()), s.paused_until > s.t)
        behind, borrowed = stale(*where), lent(*where)
        redo = [count > 1 or bool(late) or bool(dead) and bool(Layout.lost(depth, dead))
                for count, dead, late in zip(nodes_dead(config, removed), deaths, behind)]
        pause = 0.0
        for dead, redone, lends in zip(deaths, redo, borrowed):
            if dead and not redone:
                lend = lend_seconds(sim.profile, sim.P) if lends else 0.0
                pause = max(pause, sim.iteration_seconds(pipelines, merged=True) + self._unplaced(sim, config, removed)
                            + lend)
            elif redone:  # abandoned: redone from copies elsewhere
                pause = max(pause, sim.opt.failure_timeout + sim.iteration_seconds(pipelines))
        killed = sum(nodes_dead(config, removed)) if depth == sim.P else 0  # waiting: no iteration runs
        if lost := lost_everywhere(depth, deaths, behind):
            s.rewind()  # back to the checkpoint
            count_rollback(sim, s, live, killed)
            return sim.rollback_seconds(lost, live)
        if any(redo):
            s.redos += 1
        s.survive(PEERS if any(redo) else IN_ITERATION, killed)  # one abort redoes every pipeline
        return pause

    def _unplaced(self, sim: Simulation, config: Config, removed: set[str]) -> float:
        """Eager: the dead stage's forwards that no bubble held (no FRC ran), which
        its holder recomputes as lazy does (none with --frc all)."""
        forwards = lazy_forwards_seconds(sim, config, removed) if self.redundancy == Redundancy.EAGER else 0.0
        return forwards * sim.uncovered(len(config.pipelines)) if forwards else 0.0  # lazy: all, in its react


class Lazy(Bamboo):
    """`--strategy bamboo --redundancy lazy`: iterations as cheap as bounded eager's
    (cheaper than --frc all's), dearer deaths: every forward of the dead stage."""
    redundancy = "lazy"

    def react(self, sim: Simulation, s: RunState, config: Config | None, live: dict[str, str],
              removed: set[str]) -> Config | None:
        nxt = super().react(sim, s, config, live, removed)
        s.pause(lazy_forwards_seconds(sim, config, removed), "recomputation")
        return nxt


def count_rollback(sim: Simulation, s: RunState, live: dict[str, str], deaths: int) -> None:
    """Count `deaths` as survived by a rollback, from memory or from storage as
    `rollback_seconds` charges it. One from storage (--rollback memory) adds what
    its reads take beyond a copy in a peer's memory, for every `live` node (at
    most the nodes it pauses), to what a node holding copies of every stage, in
    no pipeline, could have saved (`storage_reload_node_hours`)."""
    path = sim.rollback_path(live)
    s.survive(path, deaths)
    if path == STORAGE and sim.opt.rollback == "memory" and isinstance(sim.profile, Profile):
        s.storage_reloads += max(0.0, sim.costs.load_seconds - sim.copy_load_seconds()) * len(live)


def lazy_forwards_seconds(sim: Simulation, config: Config | None, removed: set[str]) -> float:
    """What lazy adds to eager's failover when a node in use died: its predecessor
    recomputes the dead stage's forwards (a third of the stage's share of the work)."""
    if not config or config.depth != sim.P or not config.pipelines:
        return 0.0  # waiting for nodes: nothing under way to recompute
    if not removed & used_nodes(config):
        return 0.0
    return sim.config_seconds(config, mode="off") / (3 * sim.P)


class RedoFromPeers(PeerRecovery):
    """Oobleck's semantics: no redundant computation; a failure drops the iteration
    under way and reloads the lost stages from a data-parallel peer."""

    def react(self, sim: Simulation, s: RunState, config: Config | None, live: dict[str, str],
              removed: set[str]) -> Config | None:
        deaths = positions_dead(config, removed) if config and not removed.isdisjoint(used_nodes(config)) else []
        if any(deaths):
            s.abandon_iteration(sim.profile.samples_per_iteration())
            killed = sum(nodes_dead(config, removed)) if config.depth == sim.P else 0  # waiting: no iteration runs
            if lost := frozenset.intersection(*map(frozenset, deaths)):
                s.rewind()  # a stage with no copy left: back to the checkpoint
                count_rollback(sim, s, live, killed)
                s.pause(sim.rollback_seconds(lost, live), "rollback")
                return sim.next_config(live, None)
            s.redos += 1
            s.survive(PEERS, killed)
            s.pause(sim.opt.failure_timeout, "detection")
        nxt = sim.next_config(live, config)
        if config and nxt.depth == sim.P and stages_moved(config, nxt):
            s.pause(sim.opt.reconfigure_seconds + peer_reload_seconds(sim), "reconfiguration")
        return nxt

    def report(self, sim: Simulation, s: RunState) -> dict:
        return {**super().report(sim, s), "partial_iterations_lost_samples": round(s.lost_partial),
                "peer_bandwidth": sim.opt.peer_bandwidth, "peer_reload_seconds": round(peer_reload_seconds(sim), 3),
                "failure_timeout": sim.opt.failure_timeout, "reconfigure_seconds": sim.opt.reconfigure_seconds}


class CheckpointRestart(Spot):
    """No redundancy: any loss of a node in use restarts from the last checkpoint."""

    def react(self, sim: Simulation, s: RunState, config: Config | None, live: dict[str, str],
              removed: set[str]) -> Config | None:
        nxt = sim.next_config(live, None) if live else Config(0, 0)
        used = used_nodes(config)
        if config and used & removed:
            s.survive(STORAGE, len(used & removed))
            noticed = [sim.noticed.get(n) for n in used & removed]
            if all(t is not None and t <= s.t - sim.costs.write_seconds for t in noticed):
                s.pause(sim.costs.write_seconds, "checkpoint writes")  # on notice, before the node went
                s.save_now()
            s.rewind()
            s.pause(sim.restart_seconds, "restarts")
            return nxt
        if config and self._worth_widening(sim, config, nxt):
            sim.take_checkpoint(s, len(used))  # then restart wider
            s.pause(sim.restart_seconds, "restarts")
            return nxt
        return config if config and config.depth == sim.P and config.pipelines else nxt

    def _worth_widening(self, sim: Simulation, config: Config, nxt: Config) -> bool:
        """Restart on more nodes when the samples gained until the next failure (which
        restarts on every node anyway) outweigh those a checkpoint and restart cost."""
        now, wider = sim.config_throughput(config), sim.config_throughput(nxt)
        if wider <= now:  # nothing to gain (nxt may use no node at all)
            return False
        until_failure = self.mtbf(sim, len(used_nodes(nxt)))
        return (wider - now) * until_failure > wider * (sim.restart_seconds + sim.costs.write_seconds)

    def report(self, sim: Simulation, s: RunState) -> dict:
        mtbf = sim.trace.node_mtbf_seconds
        return {"node_mtbf_hours": round(mtbf / 3600, 4) if math.isfinite(mtbf) else None}


class OnDemand:
    """No preemptions, so nothing to react to: the run is one fixed cluster throughout."""
    redundancy = "off"

    def run(self, sim: Simulation, events: list[Event], horizon: float) -> dict:
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
        out = summary(sim.strategy, 0, 0, float(nodes), rate * horizon, horizon,
                      nodes * sim.opt.on_demand_price, [(0.0, nodes, rate)])
        out["ledger"] = {"training": round(nodes * horizon / 3600, 4)}  # every node-hour trains
        return out


STRATEGIES = {"bamboo": Bamboo, "lazy": Lazy, "redo": RedoFromPeers, "checkpoint": CheckpointRestart,
              "on-demand": OnDemand}


def peer_reload_seconds(sim: Simulation) -> float:
    """One stage's state from a peer pipeline; the stages reload in parallel."""
    if isinstance(sim.profile, Profile):
        return sim.profile.stage_state_bytes(sim.P) / sim.opt.peer_bandwidth
    return sim.profile.handover_ms / 1000
