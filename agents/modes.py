"""`--redundancy auto`: which redundancy mode the next iterations run in.

Eager redundancy pays for its fast recovery in every fault-free iteration, off
pays nothing until a death costs a whole redone iteration, lazy sits between.
Which is cheapest depends on how often nodes die, so the agents measure it: after
each iteration one agent folds what the job observed into `ModeStats` (deaths and
node-hours, exponentially weighted; each mode's fault-free iteration time and
what a death cost in it), and `choose` picks the mode with the fewest expected
seconds per iteration. Modes not measured yet are estimated from the schedule
simulator's ratios to the one that was. `choose` is pure, and bamboo-sim's auto
strategy calls it too, as both call `agents.policy.next_config`.

With `--replica-sync auto` the same choice is made over *settings*, a mode with
its replica sync (`eager+next`: the sync in the next iteration); `setting_for` is
what the agents write into an epoch.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from schedules.options import JobRedundancy, JobReplicaSync, Redundancy, ReplicaSync, ScheduleOptions

MODES = tuple(Redundancy)  # eager, lazy, off: the order breaks ties
SYNCS = (ReplicaSync.END, ReplicaSync.NEXT)  # a replica's sync: at the iteration's end first, as ties go
MARGIN = 0.05            # a switch must save this share of an iteration: it costs a reconfiguration
HALF_LIFE_HOURS = 1.0    # of the weights of past deaths and node-hours
SMOOTHING = 0.3          # of the measured times: new = (1 - s) * old + s * sample
REDO_ITERATIONS = 1.5    # off: a death loses half an iteration on average, and the redo's epoch about one


@dataclass(frozen=True)
class ModeStats:
    """What a job observed, after some iteration."""
    deaths: float = 0.0                          # weighted deaths
    node_hours: float = 0.0                      # weighted node-hours run
    seconds: dict = field(default_factory=dict)  # setting (mode, or mode+sync) -> fault-free iteration seconds
    pause: dict = field(default_factory=dict)    # setting -> seconds a death added to its iteration
    time: float = 0.0                            # when the last observed iteration ended (0: none yet)
    dead: int = 0                                # deaths recorded in the job so far
    costs: dict | None = None                    # the newest cost model the job's op times gave (CostModel
                                                 # keywords, its first pipeline's): windows are weighed on it

    def rate(self, prior_rate: float, prior_hours: float) -> float:
        """Deaths per node-hour: the weighted observation, and `prior_rate` with the
        weight of `prior_hours` node-hours (--auto-prior-rate, --auto-prior-hours)."""
        return (self.deaths + prior_rate * prior_hours) / (self.node_hours + prior_hours)


def setting(mode: str, sync: str) -> str:
    """A mode and its replica sync as one name, what times are measured and chosen
    by: the mode alone with the sync at the iteration's end (and off, which syncs
    nothing), "<mode>+next" with the sync in the next iteration."""
    if sync == ReplicaSync.NEXT and mode != Redundancy.OFF:
        return f"{mode}+{ReplicaSync.NEXT}"
    return str(mode)


def epoch_setting(schedule, epoch) -> str:
    """The setting `epoch` (an Assignment) runs under the job's `schedule` (its
    ScheduleSpec): its mode with its sync."""
    return setting(epoch.mode(schedule.redundancy), schedule.epoch_sync(epoch))


def parts(name: str) -> tuple[str, str]:
    """(mode, sync) of a `setting` name."""
    mode, _, sync = name.partition("+")
    return mode, sync or str(ReplicaSync.END)


def settings(syncs) -> tuple[str, ...]:
    """The settings to choose from, each mode with each of `syncs`, in the order
    that breaks ties."""
    return tuple(dict.fromkeys(setting(m, sync) for m in MODES for sync in syncs))


def job_syncs(sync: str) -> tuple[ReplicaSync, ...]:
    """The syncs a run's --replica-sync lets the agents choose from."""
    return SYNCS if sync == JobReplicaSync.AUTO else (ReplicaSync(sync),)


def _smooth(old: float | None, sample: float) -> float:
    return sample if old is None else (1 - SMOOTHING) * old + SMOOTHING * sample


def observe(stats: ModeStats, now: float, nodes: int, dead: int, mode: str, disturbed: bool,
            costs: dict | None = None) -> ModeStats:
    """`stats` after one more iteration in `mode` (a `setting`: a mode with its sync)
    that ended at `now` on `nodes` nodes, with `dead` deaths recorded job-wide by
    then; `disturbed`: it had a failover, a redo or a new epoch, so its time is not
    a fault-free sample; `costs`: the cost model its boundary agreed from measured
    op times, if it did (kept as the newest)."""
    costs = costs or stats.costs
    if not stats.time:
        return ModeStats(stats.deaths, stats.node_hours, stats.seconds, stats.pause, now, dead, costs)
    elapsed = max(0.0, now - stats.time)
    decay = 0.5 ** (elapsed / 3600 / HALF_LIFE_HOURS)
    new_deaths = max(0, dead - stats.dead)
    seconds, pause = dict(stats.seconds), dict(stats.pause)
    if new_deaths and mode in seconds:
        pause[mode] = _smooth(pause.get(mode), max(0.0, elapsed - seconds[mode]) / new_deaths)
    elif not new_deaths and not disturbed:
        seconds[mode] = _smooth(seconds.get(mode), elapsed)
    return ModeStats(stats.deaths * decay + new_deaths, stats.node_hours * decay + nodes * elapsed / 3600,
                     seconds, pause, now, dead, costs)


@functools.lru_cache(maxsize=64)
def simulated(stages: int, microbatches: int, sync: str = "end") -> tuple[dict, dict]:
    """(iteration time, added time of a death mid-iteration) of each mode, in units
    of the fault-free iteration without redundancy, from the schedule simulator's
    default cost model (a death halfway through the middle node's stream, after
    its sync of the iteration before has landed with --replica-sync next)."""
    from schedules.compiler import compile_recovery, compile_schedule, simulate

    off = simulate(compile_schedule(stages, microbatches, (), ScheduleOptions(redundancy=Redundancy.OFF))).makespan
    times, pauses = {Redundancy.OFF: 1.0}, {Redundancy.OFF: REDO_ITERATIONS}
    for mode in (Redundancy.EAGER, Redundancy.LAZY):
        options = ScheduleOptions(redundancy=mode, sync=sync)
        base = compile_schedule(stages, microbatches, (), options)
        d = stages // 2
        recovered = simulate(compile_recovery(stages, microbatches, d, len(base.streams[d]) // 2, (), options))
        times[mode] = simulate(base).makespan / off
        pauses[mode] = max(0.0, recovered.makespan - simulate(base).makespan) / off
    return times, pauses


@functools.lru_cache(maxsize=64)
def window_share(stages: int, microbatches: int, pipelines: int = 1, cost=None) -> float:
    """--replica-sync next: the share of an iteration, mean over the stages, in
    which an owner's death leaves its holder's replica a step behind (schedules/syncs.py
    `windows`): before its sync of the iteration before has landed on its holder,
    and with two pipelines or more after its reduce. `estimates` charges it a
    rollback on one pipeline only: with two or more, another pipeline's owner of
    the stage lends the holder what it misses. Eager's schedule (lazy's lands
    alike) on `cost`, the job's measured cost model (`measured_cost`), or else the
    default one, where a sync flies a tenth of a forward: a share of 0.3 to 1.5% at
    P=2..8 on one pipeline, where the calibrated GPU profiles give 5 to 28%
    (docs/simulator.md)."""
    from schedules.compiler import compile_schedule, simulate
    from schedules.cost import CostModel
    from schedules.syncs import windows

    cost = cost or CostModel()
    options = ScheduleOptions(redundancy=Redundancy.EAGER, sync=ReplicaSync.NEXT)
    report = simulate(compile_schedule(stages, microbatches, (), options, cost))
    return sum(w.share for w in windows(report, cost, stages, pipelines)) / stages


COST_FIELDS = ("forward", "backward", "transfer", "send", "swap", "load", "reduce", "step", "sync_transfer",
               "frc_factor", "brc_factor", "input_share")  # what a calibration agrees (bamboo/runtime/calibration.py)


def measured_cost(costs: dict | None, stages: int):
    """The CostModel of `costs` (its keywords, as the boundary agreed them from the
    nodes' measured op times, read back from etcd: untrusted), or None where they
    are missing, malformed or for another depth."""
    from schedules.cost import CostModel
    from schedules.layout import ScheduleError

    if not isinstance(costs, dict) or set(costs) - set(COST_FIELDS):
        return None
    try:
        cost = CostModel(**costs)
        cost.check_stages(stages)
    except (TypeError, ValueError, ScheduleError):
        return None
    return cost if all(isinstance(getattr(cost, f), tuple) for f in ("forward", "backward")) else None


def estimates(stats: ModeStats, stages: int, microbatches: int, syncs=(ReplicaSync.END,),
              rollback=None, pipelines: int = 1) -> tuple[dict, dict]:
    """Iteration seconds and seconds per death of every setting (each mode with each
    of `syncs`): measured where a setting ran, else the simulator's ratio to a
    measured one (1 s units before any). With the sync in the next iteration on one
    pipeline a simulated death of eager or lazy costs, in the window's share of
    deaths, `rollback(seconds, pause)`, its rollback to the checkpoint (None without
    a checkpoint interval: then nothing is charged); with two pipelines or more
    nothing beyond its failover, as another pipeline's owner of the stage lends the
    holder what it misses (as if one were always alive: an approximation; the
    transfer it costs is left out). A setting's measured pause is taken as measured
    (what its iterations with a death took beyond the usual)."""
    names = settings(syncs)
    times, pauses = {}, {}
    for sync in syncs:
        sync_times, sync_pauses = simulated(stages, microbatches, sync)
        for m in MODES:
            times.setdefault(setting(m, sync), sync_times[m])
            pauses.setdefault(setting(m, sync), sync_pauses[m])
    known = next((n for n in names if n in stats.seconds), None)
    unit = stats.seconds[known] / times[known] if known else 1.0  # seconds of an off iteration
    seconds = {n: stats.seconds.get(n, times[n] * unit) for n in names}
    pause = {n: stats.pause.get(n, pauses[n] * unit) for n in names}
    late = [n for n in names if parts(n)[1] == ReplicaSync.NEXT and n not in stats.pause]
    lost = None
    if late and pipelines < 2 and rollback is not None:  # with two pipelines or more a peer's owner lends
        lost = rollback(seconds, pause)
    if lost is not None:
        share = window_share(stages, microbatches, pipelines, measured_cost(stats.costs, stages))
        pause.update({n: (1 - share) * pause[n] + share * lost for n in late})
    return seconds, pause


def expected_seconds(seconds: float, pause: float, rate: float, nodes: int) -> float:
    """Seconds per iteration: the iteration, plus the deaths expected during it
    (rate per node-hour x nodes x its length) times what each adds."""
    return seconds * (1 + rate * nodes * pause / 3600)


def rollback_cost(every: int, every_seconds: float, seconds: dict, pause: dict) -> float | None:
    """What a death costs off on one pipeline, which goes back to its last checkpoint
    (bamboo-sim's auto weighs it alike): a redo's pause, as the survivors stay up and
    take the layers from peers' memory or storage, and half an interval's work on
    average (`every` iterations or `every_seconds` between checkpoints). None
    without checkpoints: off then needs two pipelines."""
    if every:
        return pause[Redundancy.OFF] + every / 2 * seconds[Redundancy.OFF]
    if every_seconds:
        return pause[Redundancy.OFF] + every_seconds / 2
    return None


def weighed_pauses(pause: dict, pipelines: int, rollback: float | None) -> dict:
    """Each mode's cost of a death as `choose` weighs it: off on one pipeline goes
    back to its checkpoint (`rollback`), where with peers it redoes the iteration."""
    return {**pause, Redundancy.OFF: rollback} if pipelines < 2 and rollback is not None else pause


def choose(current: str, rate: float, nodes: int, pipelines: int, seconds: dict, pause: dict,
           rollback: float | None = None) -> str:
    """Of the settings `seconds` names (modes, or `setting`s: a mode with its sync),
    the one with the fewest expected seconds per iteration, kept unless another
    saves more than MARGIN of it (`current` "": none yet); ties go by the order of
    `seconds`. Off redoes a death from a second pipeline's copy of the stage; with
    one pipeline a death sends it back to its last checkpoint, which it may risk
    only when there is one: `rollback` is then what such a death costs (None: no
    checkpoint, off needs two pipelines)."""
    allowed = [n for n in seconds if parts(n)[0] != Redundancy.OFF or pipelines >= 2 or rollback is not None]
    pause = weighed_pauses(pause, pipelines, rollback)
    cost = {n: expected_seconds(seconds[n], pause[n], rate, nodes) for n in allowed}
    best = min(allowed, key=lambda n: (cost[n], allowed.index(n)))
    if current in cost and not math.isclose(cost[current], 0.0) and cost[best] >= cost[current] * (1 - MARGIN):
        return current
    return best


def job_estimates(cfg, stats: ModeStats, stages: int, pipelines: int = 1) -> tuple[dict, dict, float | None]:
    """`estimates` for a job's settings (JobConfig `cfg`: its syncs, its checkpoints,
    its global microbatches, split over `pipelines`), and what a rollback costs off
    on one pipeline (None: no checkpoint interval)."""
    def rollback(seconds: dict, pause: dict) -> float | None:
        c = cfg.checkpoints
        return rollback_cost(c.checkpoint_every, c.checkpoint_seconds, seconds, pause) if c.checkpoint else None
    microbatches = max(1, cfg.schedule.microbatches // max(1, pipelines))
    seconds, pause = estimates(stats, stages, microbatches, job_syncs(cfg.schedule.replica_sync), rollback,
                               pipelines)
    return seconds, pause, rollback(seconds, pause)


def setting_for(cfg, epoch, stats: ModeStats | None, wanted=None) -> tuple[str, str]:
    """(mode, sync) for `epoch` (an Assignment) of the job `cfg` (a JobConfig): the
    job's, or where it leaves them to the agents (auto) what `choose` picks from
    `stats` over the settings it allows (`wanted`: a ModeChoice picked already,
    after the iteration before the epoch's first). The sync is "" where the job
    fixes it (the epoch runs the job's)."""
    s = cfg.schedule
    if not s.chooses:
        return s.redundancy, ""
    stats = stats or ModeStats()
    pipelines = len(epoch.pipelines)
    seconds, pause, rollback = job_estimates(cfg, stats, epoch.depth, pipelines)
    own = lambda sync: sync if s.replica_sync == JobReplicaSync.AUTO else ""  # noqa: E731
    syncs = syncs_allowed(cfg, pipelines)  # of those the job's --replica-sync gives (job_estimates)
    if wanted is not None and (wanted.mode != Redundancy.OFF or pipelines >= 2 or rollback is not None) \
            and (wanted.mode == Redundancy.OFF or (wanted.sync or s.fixed_sync) in syncs):
        return wanted.mode, own(wanted.sync or s.fixed_sync)  # (a sync read from etcd: one of `syncs`)
    modes = MODES if s.redundancy == JobRedundancy.AUTO else (s.redundancy,)
    names = [n for n in seconds if parts(n)[0] in modes and (parts(n)[0] == Redundancy.OFF or parts(n)[1] in syncs)]
    # "" for the first epoch: no setting to keep, the best one
    current = setting(epoch.redundancy, s.epoch_sync(epoch)) if epoch.redundancy else ""
    rate = stats.rate(s.auto_prior_rate, s.auto_prior_hours)
    mode, sync = parts(choose(current, rate, len(epoch.members), pipelines, {n: seconds[n] for n in names},
                              pause, rollback))
    return mode, own(sync)


def syncs_allowed(cfg, pipelines: int) -> tuple[str, ...]:
    """The syncs an epoch of `pipelines` may run: the job's; with --replica-sync auto
    the sync in the next iteration only where it runs (not with --check-replicas) and where a death in its window has somewhere to turn (a peer
    pipeline's owner of the stage to borrow from, or a checkpoint), else at the end."""
    if cfg.schedule.replica_sync != JobReplicaSync.AUTO:
        return (str(cfg.schedule.replica_sync),)
    t = cfg.testing
    late = not t.check_replicas and (pipelines >= 2 or cfg.checkpoints.checkpoint is not None)
    return (str(ReplicaSync.END), str(ReplicaSync.NEXT)) if late else (str(ReplicaSync.END),)
