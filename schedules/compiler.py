"""The compiler: (P, M, failed set, options) -> every node's instruction stream.

    plain_streams      pass (a) order + (b) communication, groups merged   lower.py
    split_backwards    a node's last input gradients sent first,      early_grads.py
                       their weights after (as deep as the cost model says)
    overlapped_streams (--compute-ahead) the above, or another order whose   overlap.py
                       next first forwards fill the tail
    defer_syncs        (--replica-sync next) the sync in the next iteration syncs.py
    insert_frc         pass (c) eager FRC in bubbles + (d) swap-out         redundancy.py
    check_in_bubbles   (--frc bubbles) no FRC delays anything: `simulate`    bubbles.py
    lazy_brc           pass (e) what a node runs if its successor dies      redundancy.py
                       (lazy redundancy: no FRC; replicas kept in sync, and
                       after a death FRC and BRC both run in recovery)
    recover            pass (f) mid-iteration failure                       recovery.py
    eval_streams       pass (g) forward-only evaluation streams             evaluation.py

Streams are compiled for all nodes at once because FRC goes where the cost model
says a node waits; `compile_stage` picks one node's stream out.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import lru_cache

from schedules.timing.bubbles import check_in_bubbles
from schedules.cost import CostModel
from schedules.early_grads import split_backwards
from schedules.evaluation import eval_streams
from schedules.ir import Instr
from schedules.layout import Layout, ScheduleError, check_microbatches
from schedules.lower import plain_streams
from schedules.options import BackwardSplit, Frc, Redundancy, ReplicaSync, ScheduleOptions
from schedules.overlap import overlapped_streams
from schedules.recovery import recover
from schedules.redundancy import frc_microbatches, insert_frc, lazy_brc
from schedules.syncs import defer_syncs
from schedules.timing.cut import Matches

REDUNDANCY = Redundancy.values()
DEFAULT = ScheduleOptions()


@dataclass(frozen=True)
class Schedule:
    stages: int
    microbatches: int
    failed: tuple[int, ...]
    streams: dict[int, list[Instr]]
    options: ScheduleOptions = DEFAULT
    fail_node: int | None = None
    fail_before: int | None = None
    resume_at: dict[int, int] = field(default_factory=dict)
    evaluation: bool = False  # forward-only streams of the validation loss (compile_eval)
    cost: CostModel = field(default_factory=CostModel, compare=False, repr=False)

    # The options, as the schedule's readers ask for them.
    redundancy = property(lambda self: self.options.redundancy)
    order = property(lambda self: self.options.order)
    frc = property(lambda self: self.options.frc)      # eager: FRC only where it fits the node's waits, or all
    sync = property(lambda self: self.options.sync)    # at the iteration's end, in the next, or none owed (syncs.py)
    split = property(lambda self: self.options.split)  # last backwards split, or none (early_grads.py)

    @property
    def layout(self) -> Layout:
        return Layout(self.stages, frozenset(self.failed), self.options.keeps_replicas)

    def frc_microbatches(self, node: int) -> list[int]:
        """The microbatches whose FRC `node` runs for its replica (read from its stream)."""
        r = self.layout.replica(node)
        return [] if r is None or self.evaluation else frc_microbatches(self.streams[node], r)

    def lazy_brc(self, node: int) -> list[Instr]:
        """What `node` would run for its replica if the replica's owner died."""
        if self.redundancy is Redundancy.OFF or self.fail_node is not None or self.evaluation:
            return []
        return lazy_brc(self.layout, node, self.microbatches, frc_ran=self.frc_microbatches(node))

    def to_json(self) -> dict:
        out = {"stages": self.stages, "microbatches": self.microbatches, "failed": list(self.failed),
               "redundancy": self.redundancy.value, "order": self.order.value}
        if self.redundancy is Redundancy.EAGER:
            out["frc"] = self.frc.value
        if self.sync is not ReplicaSync.END:
            out["replica_sync"] = self.sync.value
        if self.split is not BackwardSplit.LAST:
            out["backward_split"] = self.split.value
        if self.options.ahead:
            out["compute_ahead"] = True
        if self.fail_node is not None:
            out.update(fail_node=self.fail_node, fail_before=self.fail_before)
        if self.evaluation:
            out["evaluation"] = True
        streams = []
        for node, stream in self.streams.items():
            entry = {"node": node, "instructions": [i.to_dict() for i in stream]}
            if self.redundancy is Redundancy.EAGER and self.fail_node is None and not self.evaluation:
                entry["frc"] = self.frc_microbatches(node)
            brc = self.lazy_brc(node)
            if brc:
                entry["lazy_brc"] = [i.to_dict() for i in brc]
            if node in self.resume_at:
                entry["resume_at"] = self.resume_at[node]
            streams.append(entry)
        out["streams"] = streams
        return out


def base_streams(layout: Layout, microbatches: int, options: ScheduleOptions, cost: CostModel) -> dict:
    """The streams before FRC: plain, last backwards split as the options say, with
    the replica sync where they say."""
    streams = plain_streams(layout, microbatches, options.order, cost, options.sync)
    if options.split is BackwardSplit.LAST:
        streams = split_backwards(streams, cost)
    if options.ahead:
        streams = overlapped_streams(layout, microbatches, options, cost, first=streams)
    return defer_syncs(layout, streams, cost) if options.sync is ReplicaSync.NEXT else streams


@lru_cache(maxsize=64)
def _compile(stages: int, microbatches: int, failed: tuple[int, ...], options: ScheduleOptions,
             cost: CostModel) -> Schedule:
    check_microbatches(microbatches)
    layout = Layout(stages, frozenset(failed), options.keeps_replicas)
    cost.check_stages(stages)
    streams = base_streams(layout, microbatches, options, cost)
    if options.redundancy is Redundancy.EAGER:
        streams = insert_frc(layout, microbatches, streams, cost, options.frc, options.sync)
    return Schedule(stages, microbatches, tuple(sorted(set(failed))), streams, options, cost=cost)


def compile_schedule(stages: int, microbatches: int, failed: tuple[int, ...] = (),
                     options: ScheduleOptions = DEFAULT, cost: CostModel = CostModel()) -> Schedule:
    """One iteration for every live node, with `failed` nodes' groups merged into
    their predecessors' (a failure handled at an iteration boundary), compiled as
    the options say (schedules/options.py). Compiled schedules are cached; each call
    gets its own copy of the streams."""
    cached = _compile(stages, microbatches, tuple(failed), options, cost)
    return replace(cached, streams={n: list(s) for n, s in cached.streams.items()})


def compile_stage(stages: int, microbatches: int, node: int, **given) -> list[Instr]:
    """The stream of one node (node i starts as stage i)."""
    schedule = compile_schedule(stages, microbatches, **given)
    if node not in schedule.streams:
        raise ScheduleError(f"node {node} is not a live node of this schedule")
    return schedule.streams[node]


def compile_recovery(stages: int, microbatches: int, fail_node: int, fail_before: int,
                     failed: tuple[int, ...] = (), options: ScheduleOptions = DEFAULT,
                     cost: CostModel = CostModel()) -> Schedule:
    """The survivors' streams for an iteration in which `fail_node` dies before its
    instruction `fail_before`: what they ran up to the cut, then the recovery. The
    dead stage's microbatches whose FRC ran are swapped in, the rest recomputed."""
    key = (stages, microbatches, tuple(failed), options, cost)
    base = _compile(*key)  # the cached schedule itself: recover() only reads it
    if options.redundancy is Redundancy.OFF:
        raise ScheduleError(f"node {fail_node} failing mid-iteration is not survivable with "
                            "--redundancy off: no other node holds its layers")
    streams, resume_at, _ = recover(base.layout, microbatches, base.streams, fail_node, fail_before, cost,
                                    options, _matches(*key))
    return Schedule(stages, microbatches, base.failed, dict(sorted(streams.items())), options,
                    fail_node=fail_node, fail_before=fail_before, resume_at=resume_at, cost=cost)


@lru_cache(maxsize=64)
def _matches(stages: int, microbatches: int, failed: tuple[int, ...], options: ScheduleOptions,
             cost: CostModel) -> Matches:
    """A schedule's message tables, the first step of every recovery plan from it."""
    return Matches(_compile(stages, microbatches, failed, options, cost).streams)


@lru_cache(maxsize=64)
def _compile_eval(stages: int, microbatches: int, failed: tuple[int, ...], redundancy: Redundancy,
                  cost: CostModel) -> Schedule:
    check_microbatches(microbatches)
    options = ScheduleOptions(redundancy=redundancy)
    layout = Layout(stages, frozenset(failed), options.keeps_replicas)
    cost.check_stages(stages)
    return Schedule(stages, microbatches, tuple(sorted(set(failed))), eval_streams(layout, microbatches, cost),
                    options, evaluation=True, cost=cost)


def compile_eval(stages: int, microbatches: int, failed: tuple[int, ...] = (), redundancy: str = "eager",
                 cost: CostModel = CostModel()) -> Schedule:
    """Forward-only streams that compute the loss of `microbatches` evaluation
    microbatches on the pipeline as it stands (`failed` nodes' groups merged), and
    change no parameter. Validated by the engine's checks as they are compiled; cached."""
    mode = ScheduleOptions(redundancy=redundancy).redundancy  # a ScheduleError names a bad one
    cached = _compile_eval(stages, microbatches, tuple(failed), mode, cost)
    return replace(cached, streams={n: list(s) for n, s in cached.streams.items()})


def simulate(schedule: Schedule, cost: CostModel | None = None):
    """Run a compiled schedule (recovery included: the dead node runs its prefix)
    through the engine and its checks, on the cost model it was compiled with unless
    another is given, and return its Report. A fault-free bounded eager schedule,
    on the cost model its FRC was placed with, must also delay nothing of the same
    streams without FRC (bubbles.py; not checked as it is compiled, which would
    time every stream twice more on the runtime's path)."""
    from schedules.timing.engine import Engine

    cost = cost or schedule.cost
    streams = dict(schedule.streams)
    if schedule.evaluation:
        return Engine(schedule.layout, schedule.microbatches, cost, evaluation=True).run(streams)
    dead = None
    if schedule.fail_node is not None:
        base = compile_schedule(schedule.stages, schedule.microbatches, schedule.failed, schedule.options,
                                schedule.cost)
        streams[schedule.fail_node] = base.streams[schedule.fail_node]
        dead = (schedule.fail_node, schedule.fail_before)
    elif schedule.redundancy is Redundancy.EAGER and schedule.frc is Frc.BUBBLES and cost == schedule.cost:
        plain = base_streams(schedule.layout, schedule.microbatches, schedule.options, cost)
        check_in_bubbles(plain, streams, cost)
    return Engine(schedule.layout, schedule.microbatches, cost, dead,
                  expect_frc=schedule.options.every_frc, late_sync=schedule.sync is ReplicaSync.NEXT,
                  expect_syncs=schedule.sync is not ReplicaSync.NONE).run(streams)
