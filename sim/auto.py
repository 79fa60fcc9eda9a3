"""The `auto` strategy: Bamboo with `--redundancy auto`, the mode re-chosen at every
batch of trace events by the agents' own pure function (`agents.modes.choose`).
With `--replica-sync auto` it chooses a *setting*, the mode with its sync; eager
and lazy then run as an `Auto` of their one mode, choosing only the sync.

The rate it chooses from is weighted as the agents weigh it (node-hours of the
nodes in use, a one-hour half-life, from the same prior), counting a batch of
simultaneous deaths once: each cost below is what the whole batch costs, and the
runtime's product of rate and cost is the same, as it divides an iteration's added
time by the deaths in it. Where the runtime measures each mode's iteration time and
cost of a death, the simulator knows them from its profile: the iteration of each
mode's schedule; a death costs a merged iteration with eager (plus the dead
stage's forwards that no bubble held FRC for, with --frc bubbles), that plus all
the dead stage's forwards (a third of its share of the work) with lazy (with
--replica-sync next, a death in a window, sim/windows.py, costs with two pipelines
or more also the transfer of what another pipeline lends, and the share of deaths
seen to find a replica a step behind a redo; with one pipeline the window costs a
rollback instead), and a redo
with off (the failure timeout, half an iteration lost and a stage reloaded from a
peer; the reconfiguration after a death is paid in every mode, so it is left out
of the comparison), or with off on one pipeline a rollback to the checkpoint. A switch
pauses for a reconfiguration, and one from off to a redundant mode also for the
replicas' handover; a switch decided at a reconfiguration that the deaths or joins
bring anyway rides it (the agents write the new mode into that epoch), so it adds
only the handover.
"""
from __future__ import annotations

from agents.modes import HALF_LIFE_HOURS, MODES, choose, job_syncs, parts, setting, settings
from agents.policy import Config
from sim.accounting import RunState
from sim.checkpointing import optimal_interval
from sim.reconfiguration import dead_stages, handover_seconds, lost_everywhere, stages_moved, used_nodes
from sim.strategies import Bamboo, RedoFromPeers, Simulation, lazy_forwards_seconds, peer_reload_seconds
from sim.windows import lend_seconds, mean_share
from schedules.options import Redundancy, ReplicaSync

PRIOR_RATE, PRIOR_HOURS = 0.05, 2.0  # the runtime's defaults (--auto-prior-rate, --auto-prior-hours)


class Auto(Bamboo):
    def __init__(self, state: RunState | None = None, modes: tuple[str, ...] = MODES):
        self.modes = modes       # the modes it chooses from (one: Bamboo's eager or lazy, its sync chosen)
        self.state = state       # the run these observations belong to (a strategy may replay twice)
        self.redundancy = modes[0] if len(modes) == 1 else Redundancy.OFF  # until the first choice
        self.sync: str | None = None  # the replica sync chosen (--replica-sync auto); None: the run's
        self.failures = self.node_hours = self.last = 0.0  # weighted batches with deaths
        self.fatal = 0.0     # ... of them a stage of which no replica is left (eager, lazy: a rollback)
        self.bare = 0.0      # ... of them a stage dead in every pipeline (off, which keeps no replica: a rollback)
        self.redone = 0.0    # ... or two nodes of one pipeline died (eager, lazy: a redo)
        self.late = 0.0      # weighted batches with deaths while replicas synced in the next iteration ...
        self.stale = 0.0     # ... of them redone or rolled back only for a replica a step behind (a window's)
        self.switches: list[tuple[float, str]] = []  # (time, the setting switched to)

    def react(self, sim: Simulation, s: RunState, config: Config | None, live: dict[str, str],
              removed: set[str]) -> Config | None:
        if s is not self.state:
            self.__init__(s, self.modes)  # a new replay starts afresh
        used = used_nodes(config)
        decay = 0.5 ** ((s.t - self.last) / 3600 / HALF_LIFE_HOURS)
        self.node_hours = self.node_hours * decay + len(used) * (s.t - self.last) / 3600
        self.failures = self.failures * decay + (1 if used & removed else 0)  # a batch: one failure
        deaths = dead_stages(config, removed) if used & removed else []
        fatal = bool(lost_everywhere(config.depth, deaths)) if deaths else False
        self.fatal = self.fatal * decay + fatal
        self.bare = self.bare * decay + (bool(frozenset.intersection(*map(frozenset, deaths))) if deaths else False)
        covered = not fatal and not any(len(dead) > 1 for dead in deaths)  # by the replicas, were they current
        self.redone = self.redone * decay + (not fatal and not covered)
        self.last = s.t
        rules = RedoFromPeers if self.redundancy == Redundancy.OFF else Bamboo
        fatal_before, redos_before = s.fatal, s.redos
        nxt = rules.react(self, sim, s, config, live, removed)
        if self.redundancy != Redundancy.OFF and sim.compiled_sync(self.redundancy) == ReplicaSync.NEXT:
            self.late = self.late * decay + bool(deaths)
            self.stale = self.stale * decay + (bool(deaths) and covered and (s.fatal, s.redos) != (fatal_before,
                                                                                                redos_before))
        else:
            self.late, self.stale = self.late * decay, self.stale * decay
        if self.redundancy == Redundancy.LAZY:
            s.pause(lazy_forwards_seconds(sim, config, removed), "recomputation")
        if nxt and nxt.depth == sim.P and nxt.pipelines:
            # a restart from the checkpoint is a reconfiguration too
            moved = config is not None and stages_moved(config, nxt) or s.fatal > fatal_before
            self._choose(sim, s, nxt, reconfigured=moved)
        return nxt

    def _choose(self, sim: Simulation, s: RunState, config: Config, reconfigured: bool) -> None:
        pipelines, nodes = len(config.pipelines), len(used_nodes(config))
        names = [n for n in settings(job_syncs(sim.opt.replica_sync)) if parts(n)[0] in self.modes]
        seconds = {n: sim.config_seconds(config, *parts(n)) for n in names}
        rate = (self.failures + PRIOR_RATE * PRIOR_HOURS) / (self.node_hours + PRIOR_HOURS)
        rollback = rollback_seconds(sim, rate, nodes)
        off = sim.config_seconds(config, Redundancy.OFF)
        pause = {n: self._pause(sim, (pipelines, nodes, rate), (seconds[n], off, rollback), *parts(n)) for n in names}
        current = setting(self.redundancy, sim.compiled_sync(self.redundancy)) if self.switches else ""
        mode, sync = parts(choose(current, rate, nodes, pipelines, seconds, pause, rollback))
        sync = None if mode == Redundancy.OFF else sync  # off syncs nothing: the run's, should a mode follow
        if (mode, sync) != (self.redundancy, self.sync) or not self.switches:
            if self.switches:  # the new setting rides a reconfiguration under way, or needs one; replicas
                # are built from off, and sent again from their owners after a late sync (a step behind)
                build = self.redundancy == Redundancy.OFF or self.sync == ReplicaSync.NEXT != sync
                s.pause((0.0 if reconfigured else sim.opt.reconfigure_seconds)
                        + (handover_seconds(sim.profile, sim.P) if build and mode != Redundancy.OFF else 0.0),
                        "reconfiguration")
            self.redundancy, self.sync = mode, sync
            self.switches.append((s.t, setting(mode, sync)))

    def _pause(self, sim: Simulation, job: tuple[int, int, float], costs: tuple[float, float, float], mode: str,
               sync: str) -> float:
        """What a batch of deaths costs `mode` with `sync` (`job`: its pipelines, nodes
        and deaths per node-hour; `costs`: its iteration, off's and a rollback, in
        seconds), as the runtime measures it in that setting: off's redo from a peer
        (a rollback for the share of batches that left a stage in no pipeline);
        a redundant mode's failover (eager: a merged iteration and the dead stage's
        forwards no bubble held FRC for; lazy: all of them), or, for the share of the
        batches seen so far that its replicas did not cover, their redo or rollback;
        a death in a late sync's window (its stage's, sim/windows.py) costs, with two
        pipelines or more, the failover and the transfer of what another pipeline's
        owner of the stage lends (as if one were alive: an approximation), but the
        share of deaths seen to find a replica a step behind is redone; with one
        pipeline it is rolled back (`window_rollback`: with the checkpoints it makes
        necessary), on the larger of the two shares."""
        (pipelines, nodes, rate), (seconds, off, rollback) = job, costs
        if mode == Redundancy.OFF:  # a stage dead in every pipeline has no peer to redo from
            bare = self.bare / self.failures if self.failures else 0.0
            return (1 - bare) * (sim.opt.failure_timeout + off / 2 + peer_reload_seconds(sim)) + bare * rollback
        forwards = off / (3 * sim.P)  # recomputing the dead stage's forwards: all with lazy, eager's without FRC
        merged = sim.iteration_seconds(pipelines, merged=True, mode=Redundancy.EAGER, sync=sync)
        failover = merged + forwards * (sim.uncovered(pipelines, sync) if mode == Redundancy.EAGER else 1.0)
        redo = sim.opt.failure_timeout + seconds
        window = mean_share(sim.windows(pipelines, mode, sync))
        # the share of deaths seen to find a replica a step behind (between iterations every sync is owed)
        seen = self.stale / self.late if sync == ReplicaSync.NEXT and self.late else 0.0
        if pipelines > 1:
            failover = (1 - seen) * (failover + window * lend_seconds(sim.profile, sim.P)) + seen * redo
        elif window := max(window, seen):
            failover = (1 - window) * failover + window * window_rollback(sim, rate * window, nodes)
        fatal, redone = (self.fatal / self.failures, self.redone / self.failures) if self.failures else (0.0, 0.0)
        return (1 - fatal - redone) * failover + redone * redo + fatal * rollback

    def report(self, sim: Simulation, s: RunState) -> dict:
        time_in = {}
        for (t, mode), (end, _) in zip(self.switches, self.switches[1:] + [(s.t, "")]):
            time_in[mode] = time_in.get(mode, 0.0) + end - t
        return {**super().report(sim, s), "mode_switches": len(self.switches) - 1,
                "hours_per_mode": {m: round(v / 3600, 3) for m, v in time_in.items()},
                "auto_prior_rate": PRIOR_RATE, "auto_prior_hours": PRIOR_HOURS}


def rollback_seconds(sim: Simulation, rate: float, nodes: int) -> float:
    """What a death costs off on one pipeline, which goes back to its last
    checkpoint: the restart and, on average, half an interval of work. The interval
    is the fixed one or the formula's for `rate` on `nodes`; its writes are left
    out, as every mode takes them at the same interval."""
    return sim.rollback_seconds(frozenset(), {}) + _interval(sim, rate, nodes) / 2


def window_rollback(sim: Simulation, rate: float, nodes: int) -> float:
    """What a death in a late sync's window costs one pipeline, `rate` such deaths a
    node-hour on `nodes`: the rollback, half an interval of work and, unless the
    interval is fixed, the writes of the checkpoints these deaths make necessary
    (at the formula's interval, as much again as the work lost: Young's optimum)."""
    if sim.opt.checkpoint_seconds:
        return rollback_seconds(sim, rate, nodes)
    writes = sim.costs.write_seconds * _mtbf(rate, nodes) / _interval(sim, rate, nodes)
    return rollback_seconds(sim, rate, nodes) + writes


def _mtbf(rate: float, nodes: int) -> float:
    return 3600 / (max(rate, 1e-9) * nodes)


def _interval(sim: Simulation, rate: float, nodes: int) -> float:
    """Seconds between checkpoints: the fixed interval, or the formula's at `rate`
    deaths a node-hour on `nodes`."""
    return sim.opt.checkpoint_seconds or optimal_interval(sim.opt.checkpoint_formula, sim.costs.write_seconds,
                                                          _mtbf(rate, nodes))
