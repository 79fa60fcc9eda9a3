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

from schedules.deaths import MEMORY, STORAGE

from agents.policy import Config, Priced, next_config
from agents.surplus import BurstModel, SurplusRule, burst_order
from sim.accounting import RunState, book, ledger, summary
from sim.bound import bound as bound_of
from sim.auto import PRIOR_HOURS, PRIOR_RATE, Auto
from sim.capacity import ACQUIRE, Capacity, justified_standby, next_batch, settle, with_notices
from sim.checkpointing import TraceStats, checkpoint_costs, checkpoint_report, optimal_interval, trace_stats
from sim.options import PACK, SPREAD, Options
from sim.pricing import packing_pays
from sim.profiles import MeasuredProfile, Profile
from sim.strategies import STRATEGIES as SPOT_AND_ON_DEMAND
from sim.strategies import Spot
from sim.reconfiguration import memory_copies, shape, used_nodes
from sim.traces import Event
from sim.iteration_times import config_ms, iteration_ms, uncovered_share
from sim.memo import ByKey, Kept, PolicyMemo, Table
from sim.windows import Window, stage_windows
from schedules.options import JobReplicaSync, Redundancy, ReplicaSync

__all__ = ["STRATEGIES", "ClusterSimulator", "Options"]

STRATEGIES = {**SPOT_AND_ON_DEMAND, "auto": Auto}


def rules_of(strategy: str, options: Options):
    """What `strategy` does about a trace. With --replica-sync auto, Bamboo's eager
    and lazy choose their sync epoch by epoch as auto does (sim/auto.py), their
    mode fixed."""
    if options.replica_sync == JobReplicaSync.AUTO and strategy in ("bamboo", "lazy"):
        return Auto(modes=(STRATEGIES[strategy].redundancy,))
    return STRATEGIES[strategy]()


class ClusterSimulator:
    def __init__(self, profile: Profile | MeasuredProfile, depth: int, strategy: str, options: Options = Options()):
        if strategy not in STRATEGIES:
            raise ValueError(f"unknown strategy {strategy!r} (choose from {', '.join(STRATEGIES)})")
        if depth < 2:
            raise ValueError(f"--stages must be at least 2 (got {depth})")
        options.check()
        self.profile, self.P, self.opt = profile, depth, options
        self.strategy = strategy              # the name, as the result reports it
        self.rules = rules_of(strategy, options)  # what this strategy does about the trace
        self.costs = checkpoint_costs(profile, depth, options)
        self.trace = TraceStats(0.0, 0)       # set by run()
        self.job_mtbf: float = math.inf       # the failures this strategy must checkpoint against, per node
        self.zones: dict[str, str] = {}       # node -> zone, of every node seen (set by replay())
        self.copies: dict[int, set[str]] = {}  # stage -> the nodes holding the last checkpoint's copy in memory
        self.noticed: dict[str, float] = {}   # node -> when its preemption was announced
        self.capacity = Capacity()            # the trace's nodes the job does not hold (set by replay())
        self.state = RunState()               # the replay's run so far (set by replay())
        self.reference_nodes = 0.0            # the trace's mean count of nodes: the on-demand cluster compared with
        self.policy_memo = PolicyMemo()       # the policy's answers, given again for equal inputs (sim/memo.py)
        self.decided = ByKey()                # what the surplus rule asks of the policy, by what determines it
        shapes = Kept(shape, 1 << 16)  # a pipeline's shape, by its nodes: most pipelines outlive many plans
        self._iteration_ms = Table(lambda pipelines, mode, sync: config_ms(
            self.profile, self.P, tuple(map(shapes.__getitem__, pipelines)), mode, self.opt.frc, sync))
        self._bursts: tuple[RunState | None, tuple[int, ...]] = (None, ())  # a run's bursts, as a tuple
        self.burst_order = self._burst_orders()  # made again by replay()

    def _burst_orders(self) -> Table:
        """The order a burst takes a set of used nodes in, kept per set: by the zones
        of the run under way (each replay starts a new one)."""
        return Table(lambda used: burst_order({n: self.zones[n] for n in used}))

    # -- iteration times -------------------------------------------------------------------
    def iteration_seconds(self, pipelines: int, merged: bool = False, mode: str | None = None,
                          sync: str | None = None) -> float:
        """One iteration of `pipelines` full pipelines in `mode` with `sync` (default:
        the strategy's)."""
        mode = mode or self.rules.redundancy
        return iteration_ms(self.profile, self.P, pipelines, mode, merged, self.opt.frc,
                             self.compiled_sync(mode, sync)) / 1000

    def config_seconds(self, config: Config, mode: str | None = None, sync: str | None = None) -> float:
        """One iteration of `config`'s pipelines, short ones included, the microbatches
        split by speed (schedules/split.py): the slowest pipeline's."""
        return self._estimate(list(config.pipelines), mode, sync) / 1000

    def throughput(self, pipelines: int) -> float:
        """Samples per second of `pipelines` healthy full pipelines."""
        if pipelines < 1:
            return 0.0
        return self.profile.samples_per_iteration() / self.iteration_seconds(pipelines)

    def uncovered(self, pipelines: int, sync: str | None = None) -> float:
        """The share of a pipeline's microbatches that eager runs no FRC for (a death
        then recomputes their forwards as lazy does): 0 with --frc all; with
        bubbles, what the schedule's placement leaves out, over the nodes."""
        return uncovered_share(self.profile, self.P, pipelines, self.opt.frc, self.compiled_sync(Redundancy.EAGER, sync))

    def windows(self, pipelines: int, mode: str | None = None, sync: str | None = None) -> tuple[Window, ...]:
        """Each stage's window of deaths not survivable in the iteration (sim/windows.py):
        none unless the sync is in the next iteration."""
        mode = mode or self.rules.redundancy
        return stage_windows(self.profile, self.P, pipelines, mode, self.opt.frc, self.compiled_sync(mode, sync))

    def compiled_sync(self, mode: str, sync: str | None = None) -> str:
        """The replica sync the schedules of `mode` compile with: `sync`, else the
        strategy's choice now (--replica-sync auto) or the run's; off has none, nor
        auto before its first choice."""
        chosen = sync or getattr(self.rules, "sync", None) or self.opt.replica_sync
        return ReplicaSync.END if mode == Redundancy.OFF or chosen == JobReplicaSync.AUTO else ReplicaSync(chosen)

    def config_throughput(self, config: Config | None, mode: str | None = None) -> float:
        """Samples per second of `config` while nothing fails (0 while it cannot train)."""
        if not self.running(config):
            return 0.0
        return self.profile.samples_per_iteration() / self.config_seconds(config, mode)

    def goodput(self, throughput: float, mean_nodes: float) -> float:
        """Samples/s per paid node, relative to a node of the on-demand cluster the
        trace's mean size would buy (whole pipelines, as `on-demand` runs): one
        reference for every strategy, however many nodes it chose to pay for."""
        if not mean_nodes:
            return 0.0
        pipelines = max(1, round((self.reference_nodes or mean_nodes) / self.P))
        on_demand = self.profile.samples_per_iteration() / self.iteration_seconds(pipelines, mode="off")
        return throughput / mean_nodes / (on_demand / (pipelines * self.P))

    def next_config(self, live: dict[str, str], previous: Config | None) -> Config:
        """The agents' own policy, as this run sets it (short pipelines up to
        --max-stages-per-node; what no pipeline uses is released unless --surplus
        keep), with the pipelines packed in zones where that costs less
        (--zone-spread, agents/spread.py)."""
        priced = Priced(per_node=self.opt.surplus != SurplusRule.KEEP)
        mode = self.rules.redundancy  # the estimate's, which weighs short pipelines
        plan = lambda how: self.policy_memo.get(  # noqa: E731
            live, previous, (how, mode, self.compiled_sync(mode)),
            lambda: next_config(live, previous, self.P, self.profile_microbatches(), self.opt.max_stages,
                                self._estimate, priced=how))
        if self.opt.zone_spread == PACK:
            return plan(replace(priced, pack_zones=True))
        spread = plan(priced)
        if self.opt.zone_spread == SPREAD or not self.opt.cross_zone_price:
            return spread
        packed = plan(replace(priced, pack_zones=True))
        return packed if packing_pays(self, spread, packed) else spread

    def _estimate(self, pipelines: list[tuple], mode: str | None = None, sync: str | None = None) -> float:
        """Milliseconds of an iteration of `pipelines` (each: the node of every stage):
        the schedule simulator's, and the policy's estimate."""
        mode = mode or self.rules.redundancy
        return self._iteration_ms(tuple(pipelines), mode, self.compiled_sync(mode, sync))

    def bursts_seen(self, s: RunState, nodes: int, at: float | None = None) -> BurstModel:
        """The bursts of preemptions seen by a job training on `nodes` nodes, by `at`
        (default: now), from the runtime's prior (--auto-prior-rate, --auto-prior-hours)."""
        kept, sizes = self._bursts
        if kept is not s or len(sizes) != len(s.bursts):  # a run's bursts only grow
            self._bursts = kept, sizes = s, tuple(s.bursts)
        return BurstModel.seen(sizes, s.t if at is None else at, nodes, PRIOR_RATE, PRIOR_HOURS)

    def profile_microbatches(self) -> int | None:
        return getattr(self.profile, "microbatches", None)

    @property
    def restart_seconds(self) -> float:
        return self.costs.restart_seconds

    def rollback_path(self, live: dict[str, str]) -> str:
        """Where a rollback reads the checkpoint (every stage goes back to it): from
        memory when the live nodes hold a copy of every stage (--rollback memory), as
        the agents require (bamboo/state/copies.py `newest_covered`), else from storage."""
        if self.opt.rollback == "relaunch" or not isinstance(self.profile, Profile):
            return STORAGE
        return MEMORY if all(self.copies.get(stage, set()) & set(live) for stage in range(self.P)) else STORAGE

    def rollback_seconds(self, lost: frozenset[int], live: dict[str, str]) -> float:
        """A stage lost on every node, with the surviving processes kept up (--rollback
        memory): the failure timeout, a reconfiguration and each lost stage's state from
        a live node's copy of the checkpoint in memory over --peer-bandwidth, or from
        storage where no copy lives. With --rollback relaunch: the restart."""
        if self.opt.rollback == "relaunch" or not isinstance(self.profile, Profile):
            return self.restart_seconds
        load = self.copy_load_seconds() if self.rollback_path(live) == MEMORY else self.costs.load_seconds
        return self.opt.failure_timeout + self.opt.reconfigure_seconds + load

    def copy_load_seconds(self) -> float:
        """A stage's state from a copy in a peer's memory, over --peer-bandwidth."""
        return self.profile.stage_state_bytes(self.P) / self.opt.peer_bandwidth

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
        self.decided = ByKey()  # the nodes' zones are this trace's (each replay of it gives them the same)
        self.reference_nodes = self.trace.node_hours * 3600 / horizon if horizon else 0.0
        spot = isinstance(self.rules, Spot)  # on-demand nodes are never preempted: no notice, no bound
        result = self.rules.run(self, with_notices(events, self.opt.notice_seconds) if spot else events, horizon)
        if spot:
            result.update(self.bound(events, horizon))
        result.setdefault("goodput", round(self.goodput(result["throughput"], result["mean_nodes"]), 4))
        result.setdefault("idle_fraction", 0.0)
        return result

    def bound(self, events: list[Event], horizon: float) -> dict:
        """The figures a scheduler that loses nothing reaches (sim/bound.py)."""
        return bound_of(self, events, horizon)

    def replay(self, events: list[Event], horizon: float) -> dict:
        """Spot nodes: train between batches of simultaneous events (sorted by time),
        letting the strategy react to each batch, then settle the nodes beyond the
        pipelines (sim/capacity.py). A noticed node is paid for until it goes, but
        the policy no longer counts on it."""
        s = self.state = RunState()
        self.zones, self.copies, self.noticed, self.capacity = {}, {}, {}, Capacity()
        self.burst_order = self._burst_orders()
        live: dict[str, str] = {}
        config: Config | None = None
        queue = list(events)
        while queue and queue[0].time <= horizon:  # an acquisition may be due after the trace's end
            batch = next_batch(queue, self._window(config))
            self._advance(s, batch[0].time, config, live)
            if batch[0].action == "notice":
                doomed = {e.node for e in batch if e.node in live}
                self.noticed.update({n: batch[0].time for n in doomed})
                was_running = self.running(config)
                config = self.rules.notice(self, s, config, self.usable(live), doomed)
                if was_running != self.running(config):
                    self._rearm(s, config, restarted=True)
                continue
            removed = self._apply(s, batch, live)
            fatal, was_running = s.fatal, self.running(config)
            config = self.rules.react(self, s, config, self.usable(live), removed)
            for n in removed:
                self.noticed.pop(n, None)
            self._rearm(s, config, restarted=s.fatal > fatal or not was_running)
            settle(self, s, config, live, queue)
        self._advance(s, horizon, config, live)
        return self._result(s, horizon)

    def _apply(self, s: RunState, batch: list[Event], live: dict[str, str]) -> set[str]:
        """The batch's arrivals and removals: the job's nodes it took (returned)."""
        if batch[0].action == ACQUIRE:
            live.update(self.capacity.arrive(int(batch[0].node), live))
            return set()
        for e in batch:
            if e.action == "add":
                zone = self.zones.setdefault(e.node, e.zone or self.opt.zones[len(self.zones) % len(self.opt.zones)])
                if self.opt.surplus == SurplusRule.KEEP or self.capacity.wants(len(live)):
                    live[e.node] = zone
                else:
                    self.capacity.free[e.node] = zone
        gone = {e.node for e in batch if e.action == "remove"}
        for n in gone:
            self.capacity.free.pop(n, None)  # capacity the job did not hold: nothing lost
        removed = gone & set(live)
        s.preemptions += len(removed)
        if removed:
            s.bursts.append(len(removed))
        self.copies = {stage: held - removed for stage, held in self.copies.items()}  # a node returns empty
        for n in removed:
            live.pop(n, None)
        return removed

    def usable(self, live: dict[str, str]) -> dict[str, str]:
        """The live nodes the policy may place: not those whose preemption was announced."""
        if not self.noticed:
            return dict(live)
        return {n: z for n, z in live.items() if n not in self.noticed}

    def running(self, config: Config | None) -> bool:
        return bool(config and config.depth == self.P and config.pipelines)

    def _rearm(self, s: RunState, config: Config | None, restarted: bool) -> None:
        """Schedule the next checkpoint for the nodes `config` uses: a period starts
        again when training (re)starts."""
        if not self.running(config):
            return  # a checkpoint that falls due meanwhile is skipped (_advance)
        if restarted:
            s.period_start = s.resumes()
        interval = self.checkpoint_interval(len(used_nodes(config)))
        s.next_checkpoint = s.period_start + interval

    def _window(self, config: Config | None) -> float:
        """Removals closer than this land in one iteration."""
        return self.iteration_seconds(max(1, len(config.pipelines) if config else 1))

    def _advance(self, s: RunState, to: float, config: Config | None, live: dict[str, str]) -> None:
        """Train from s.t to `to` under `config`, stalling for checkpoints on the way;
        the nodes paid for but in no pipeline are idle, those asked for and not yet
        here wait for their acquisition."""
        rate = self.config_throughput(config)
        used = len(used_nodes(config)) if self.running(config) else 0
        nodes = len(live) + self.capacity.arriving
        s.timeline.append((s.t, nodes, rate))
        s.node_seconds += nodes * max(0.0, to - s.t)
        idle = max(0, len(live) - used)
        s.idle_seconds += (idle + self.capacity.arriving) * max(0.0, to - s.t)
        span = (s.t, to)
        justified = justified_standby(self, s, used, idle, span)  # booked as standby (book)
        while s.t < to:
            step_to = min(to, max(s.t, s.next_checkpoint))
            working = max(0.0, step_to - max(s.t, s.paused_until))
            s.samples += rate * working
            s.t = step_to
            if s.t >= s.next_checkpoint and not self.running(config):
                s.skip_checkpoint()  # rearmed when training resumes
            elif s.t >= s.next_checkpoint:
                self.take_checkpoint(s, used, config)
        book(s, span, (len(live), used, self.capacity.arriving), justified,
             self._redundant_share(config) if used else 0.0, waiting=self.capacity.waiting)

    def _redundant_share(self, config: Config) -> float:
        """The share of an iteration of `config` that its redundancy adds (FRC, replica
        syncs): 1 - (its time without redundancy) / (its time)."""
        return max(0.0, 1 - self.config_seconds(config, "off") / self.config_seconds(config))

    def take_checkpoint(self, s: RunState, used_nodes: int, config: Config | None = None) -> None:
        """Stall for the write; the period to the next checkpoint starts when it ends.
        Each stage's copy stays in memory on its writer and one more node (memory_copies)."""
        s.pause(self.costs.write_seconds, "checkpoint writes")
        s.checkpoint(done_at=s.paused_until)
        s.checkpoints += 1
        s.period_start = s.paused_until
        interval = self.checkpoint_interval(used_nodes)
        s.interval_sum, s.intervals = s.interval_sum + interval, s.intervals + 1
        s.next_checkpoint = s.period_start + interval
        if config is not None:
            self.copies = memory_copies(config, self.zones)

    def _result(self, s: RunState, horizon: float) -> dict:
        mean_nodes = s.node_seconds / horizon if horizon else 0.0
        cost_per_hour = mean_nodes * self.opt.spot_price
        series = self.opt.price_series
        if series is not None and horizon:  # each node-second at the price of its time
            cost_per_hour = series.per_hour(s.timeline, horizon)
        out = summary(self.strategy, s.preemptions, s.fatal, mean_nodes, s.samples, horizon, cost_per_hour,
                      s.timeline)
        out["goodput"] = round(self.goodput(out["throughput"], mean_nodes), 4)
        paid = s.node_seconds or 1.0
        out["idle_fraction"] = round(s.idle_seconds / paid, 4) if s.node_seconds else 0.0
        out["ledger"] = ledger(s)  # paid node-hours by what they went to
        out["idle_unjustified_fraction"] = round((s.idle_seconds - s.booked.get("standby", 0.0)) / paid, 4) \
            if s.node_seconds else 0.0  # idle beyond the standby the burst rule asks for
        out["notices_drained"] = s.drained
        out.update(self.capacity.describe(), surplus=self.opt.surplus)
        if series is not None:
            out["mean_spot_price"] = round(cost_per_hour / mean_nodes, 6) if mean_nodes else series.prices[0]
        out["deaths_survived"] = dict(s.survived)
        out["storage_reload_node_hours"] = round(s.storage_reloads / 3600, 4)  # what a state holder could save
        out.update(self.rules.report(self, s))
        out["checkpointing"] = checkpoint_report(self.opt, self.costs, s)
        return out
