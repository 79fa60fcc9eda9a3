"""With `--replica-sync next`, the part of an iteration in which a node's death is
not survivable within it, and what the cluster simulator charges for it.

The sync of iteration i lands in iteration i+1 (schedules/syncs.py). Until the sync
a stage's owner sends at the start of its stream has landed on the holder, the
holder's replica is a step behind: an owner that dies then cannot be taken over
from that replica alone (schedules/recovery.py refuses it). With more than one pipeline a
death after the owner's reduce is one too: its share of the sum went into the
reduce, and the holder can recompute only its own pipeline's (HOTPATH.md, piece 4).

The windows come from the fault-free schedule of a full pipeline under the
profile's cost model (a measured profile: the compiler's default model), stage by
stage. Where in its iteration a death falls is read from the samples trained since
the last iteration began (`RunState.phase`), so a replay stays deterministic; a
death during a pause (a failover, a reconfiguration, a checkpoint's stall) comes
between iterations, when every sync is owed.

What a death in its window costs: with two pipelines or more, the holder borrows
what it misses from another pipeline's owner of the stage (its kept gradients of
the iteration before, or this iteration's reduced sum), so the death is survived
in the iteration at a failover's cost plus one transfer of the stage's gradients
(`lend_seconds`), as long as such an owner is still alive; where the batch of
deaths took the stage's owner in every pipeline, or with one pipeline, or between
iterations, the stage counts as lost in its pipeline (`stale`): redone from a peer
pipeline, or, where every pipeline lost it, rolled back to the checkpoint. (Not
modelled: a new epoch's first iteration owes no sync, so it has no window.)
"""
from __future__ import annotations

import math
import statistics
from functools import lru_cache

from schedules import syncs
from schedules.compiler import Schedule, compile_schedule
from schedules.compiler import simulate as simulate_schedule
from schedules.cost import CostModel
from schedules.syncs import Window

from sim.profiles import Profile
from schedules.options import Redundancy, ReplicaSync, ScheduleOptions


def full_pipeline(profile, depth: int, pipelines: int, redundancy: str, frc: str,
                  sync: str) -> tuple[Schedule, CostModel]:
    """The fault-free schedule of one of `pipelines` full pipelines, with its share of
    the profile's microbatches, and the cost model it was placed by (a measured
    profile: the compiler's default)."""
    total = getattr(profile, "microbatches", None) or 4 * pipelines
    cost = profile.cost(depth, pipelines) if isinstance(profile, Profile) else CostModel()
    options = ScheduleOptions(redundancy=redundancy, frc=frc, sync=sync)
    return compile_schedule(depth, math.ceil(total / pipelines), (), options, cost), cost


@lru_cache(maxsize=None)
def stage_windows(profile, depth: int, pipelines: int, redundancy: str, frc: str,
                  sync: str) -> tuple[Window, ...]:
    """Each stage's window in a fault-free iteration of one of `pipelines` full
    pipelines; none (empty) with the sync at the end, without replicas or pipelines."""
    if sync != ReplicaSync.NEXT or redundancy == Redundancy.OFF or pipelines < 1:
        return ()  # (no pipeline: the fleet fell below one, nothing trains to die in a window)
    schedule, cost = full_pipeline(profile, depth, pipelines, redundancy, frc, sync)
    return syncs.windows(simulate_schedule(schedule), cost, depth, pipelines)


def _caught(windows: tuple[Window, ...], dead: list[set[int]], phase: float, between: bool) -> list[set[int]]:
    """Of each pipeline's dead stage positions, those whose death fell in their window
    (all of them `between` iterations)."""
    if not windows:
        return [set() for _ in dead]
    return [{st for st in stages if st < len(windows) and (between or windows[st].holds(phase))} if stages else set()
            for stages in dead]  # most pipelines lost nothing


def stale(windows: tuple[Window, ...], dead: list[set[int]], phase: float, between: bool = False) -> list[set[int]]:
    """Of each pipeline's dead stage positions (`dead`: one set a pipeline), those left
    a step behind: dead in their window with no other pipeline's owner of the stage
    alive to lend what the holder misses (so all of them with one pipeline); all of
    them `between` iterations, when every sync is owed."""
    caught = _caught(windows, dead, phase, between)
    if between:
        return caught
    return [{st for st in late if all(st in other for j, other in enumerate(dead) if j != i)} if late else set()
            for i, late in enumerate(caught)]


def lent(windows: tuple[Window, ...], dead: list[set[int]], phase: float, between: bool = False) -> list[set[int]]:
    """Of each pipeline's dead stage positions, those dead in their window that another
    pipeline's live owner of the stage lends to: survived in the iteration."""
    return [caught - behind for caught, behind in zip(_caught(windows, dead, phase, between),
                                                       stale(windows, dead, phase, between))]


@lru_cache(maxsize=None)
def lend_seconds(profile, depth: int) -> float:
    """What a lent death adds to its failover: one transfer of the stage's gradients
    from the lender to the holder, the profile's sync transfer; none for a measured
    profile, which has iteration times but no transfer of its own."""
    return profile.cost(depth).sync_transfer / 1000 if isinstance(profile, Profile) else 0.0


@lru_cache(maxsize=64)
def mean_share(windows: tuple[Window, ...]) -> float:
    """The share of deaths that fall in a window, when deaths come at any time to any stage."""
    return statistics.mean(w.share for w in windows) if windows else 0.0
